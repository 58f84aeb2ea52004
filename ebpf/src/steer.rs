//! sk_lookup: the one place where a new connection in a pod netns is given to a
//! listener. Runs on every TCP/UDP listener lookup in an enrolled pod's netns
//! (SYNs, including the TIME_WAIT-reuse path); established traffic never
//! reaches it.
//!
//! sk_lookup programs cannot learn their netns (no bpf_get_netns_cookie), so
//! the pod comes from the hint a tc program left on the SYN's way in.
//!
//! Maps touched per TCP lookup: flow_hints (1 lookup + 1 delete), pod_state
//! (1 lookup), listeners (1 lookup when steering), counters (1 update).

use aya_ebpf::{
    bindings::sk_action::{SK_DROP, SK_PASS},
    helpers::bpf_ktime_get_ns,
    programs::SkLookupContext,
};
use sluice_common::{
    Counters, FlowHint, FlowKey, HintVerdict, ListenerKey, Role, FAMILY_V4, FLOW_HINT_TTL_NS,
};

use crate::{
    addr::{is_loopback, is_probe},
    maps::{count, FLOW_HINTS, LISTENERS, POD_STATE},
};

const IPPROTO_TCP: u32 = 6;

pub fn steer(ctx: &SkLookupContext) -> u32 {
    let l = unsafe { &*ctx.lookup };
    // Row O5: only TCP is captured.
    if l.protocol != IPPROTO_TCP {
        return SK_PASS;
    }
    let family = l.family as u8;
    let (remote, local) = if family == FAMILY_V4 {
        ([l.remote_ip4, 0, 0, 0], [l.local_ip4, 0, 0, 0])
    } else {
        (l.remote_ip6, l.local_ip6)
    };
    // Row O2: loopback destinations are the app's own business.
    if is_loopback(family, &local) {
        return SK_PASS;
    }
    let key = FlowKey {
        remote_addr: remote,
        local_addr: local,
        remote_port: u16::from_be(l.remote_port),
        local_port: l.local_port as u16,
        family,
        _pad: [0; 3],
    };
    let Some(hint) = take_hint(&key) else {
        // Row I3: kubelet probes are let through by the ingress program unhinted.
        if is_probe(family, &remote) {
            return SK_PASS;
        }
        // Every other SYN into an enrolled pod crossed one of our tc programs.
        // No hint means a path we do not know (an interface added after
        // enrollment, a hint lost): fail closed.
        return SK_DROP;
    };
    let cookie = hint.netns_cookie;
    let role = match HintVerdict::from_u32(hint.verdict) {
        // Rows O2/I4: arrived over the pod's lo (in-pod, or ztunnel's own
        // connection); row I3h: sent by a socket of the node (kubelet).
        // Row I6: a pod that bypasses inbound capture.
        Some(HintVerdict::Local | HintVerdict::Host | HintVerdict::Bypass) => {
            if cookie != 0 {
                count(cookie, |c: &mut Counters| &mut c.bypassed);
            }
            return SK_PASS;
        }
        Some(HintVerdict::Outbound) => Role::Outbound,
        Some(HintVerdict::Inbound) => Role::Inbound,
        Some(HintVerdict::Hbone) => Role::Hbone,
        None => return SK_DROP,
    };

    // Row F1: anything but Enabled/Served fails closed. The tc programs already drop
    // such SYNs silently; a drop here (an RST to the client) only covers races.
    let steers = unsafe { POD_STATE.get(cookie) }.is_some_and(|p| p.steers());
    if !steers {
        count(cookie, |c: &mut Counters| &mut c.dropped_fail_closed);
        return SK_DROP;
    }
    let lkey = ListenerKey::new(cookie, role, family);
    match LISTENERS.redirect_sk_lookup(ctx, lkey, 0) {
        Ok(()) => {
            count(cookie, |c: &mut Counters| match role {
                Role::Outbound => &mut c.captured_outbound,
                Role::Inbound => &mut c.captured_inbound,
                Role::Hbone => &mut c.captured_hbone,
            });
            SK_PASS
        }
        Err(_) => {
            count(cookie, |c: &mut Counters| &mut c.missing_socket);
            SK_DROP
        }
    }
}

/// Takes (reads and deletes) a fresh hint for this connection, if any.
#[inline(always)]
fn take_hint(key: &FlowKey) -> Option<FlowHint> {
    let h = *unsafe { FLOW_HINTS.get(key) }?;
    let _ = FLOW_HINTS.remove(key);
    if unsafe { bpf_ktime_get_ns() }.wrapping_sub(h.at_ns) > FLOW_HINT_TTL_NS {
        return None;
    }
    Some(h)
}

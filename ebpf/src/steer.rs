//! sk_lookup: the one place where a new connection in a pod netns is given to a
//! listener. Runs on every TCP/UDP listener lookup in an enrolled pod's netns
//! (SYNs, including the TIME_WAIT-reuse path; a SYN-cookie ACK, which
//! misses the established table as the SYN did; datagrams to unconnected
//! UDP sockets; and the tc programs' own socket lookups); established
//! traffic never reaches it.
//!
//! sk_lookup programs cannot learn their netns (no bpf_get_netns_cookie), so
//! the pod comes from the hint a tc program left on the SYN's way in. A TCP
//! hint is kept (until it expires) rather than taken: sk_lookup has no TCP
//! flags, and a cookie ACK needs the same answer as its SYN.
//!
//! Maps touched per TCP lookup: flow_hints (1 lookup, a flag write on first
//! use; on a miss, 1 in flow_hints_overflow), tc_lookup (1 lookup), pod_state (1 lookup), listeners (1 lookup
//! when steering), counters (1 update on first use).

use aya_ebpf::{
    bindings::sk_action::{SK_DROP, SK_PASS},
    helpers::bpf_ktime_get_ns,
    programs::SkLookupContext,
};
use sluice_common::{
    Counters, DnsCounters, DropReason, FlowHint, FlowKey, HintVerdict, ListenerKey, Role,
    FAMILY_V4, FLOW_HINT_TTL_NS, HINT_USED, PORT_DNS,
};

use crate::{
    addr::{is_loopback, is_probe},
    hints::{hint_ptr, release_hint},
    maps::{
        count, count_dns, count_drop, DNS_LISTENERS, LISTENERS, POD_STATE, TC_LOOKUP,
        TC_LOOKUP_ASKING_REROUTED, TC_LOOKUP_REFUSED_STEERED, VERIFY_HINTS,
    },
    tc::pod_of,
};

const IPPROTO_TCP: u32 = 6;
const IPPROTO_UDP: u32 = 17;

pub fn steer(ctx: &SkLookupContext) -> u32 {
    let l = unsafe { &*ctx.lookup };
    if l.protocol == IPPROTO_UDP {
        return steer_udp(ctx);
    }
    // Row O5: no other protocol is captured.
    if l.protocol != IPPROTO_TCP {
        return SK_PASS;
    }
    let key = lookup_key(ctx);
    let (family, remote, local) = (key.family, key.remote_addr, key.local_addr);
    // Row O2: loopback destinations are the app's own business.
    if is_loopback(family, &local) {
        return SK_PASS;
    }
    if key.remote_port == 0 {
        if let Some(h) = unsafe { VERIFY_HINTS.get(key) } {
            return verify(ctx, h);
        }
    }
    // A tc program asking which socket a segment would reach: answer as for
    // the segment itself, but count nothing and mark nothing (see TC_LOOKUP).
    let asking = TC_LOOKUP.get(0).copied().unwrap_or(0);
    let asked_by_tc = asking != 0;
    let Some(hint) = hint_ptr(&key) else {
        return unhinted(family, &remote, asked_by_tc);
    };
    let h = unsafe { *hint };
    // A real lookup honours a hint for its TTL. tc's lookups do not look at
    // its age: a segment of a connection that was steered keeps being
    // delivered locally (where this lookup refuses it once the hint is
    // stale), never sent out of the pod around ztunnel.
    if !asked_by_tc && unsafe { bpf_ktime_get_ns() }.wrapping_sub(h.at_ns) > FLOW_HINT_TTL_NS {
        return unhinted(family, &remote, false);
    }
    // Count a connection once: on the lookup of its SYN, not again on its
    // SYN-cookie ACK's (which finds the same hint).
    let first = !asked_by_tc && h.flags & HINT_USED == 0;
    if first {
        unsafe { (*hint).flags = h.flags | HINT_USED };
    }
    let cookie = h.netns_cookie;
    let role = match HintVerdict::from_u32(h.verdict) {
        // Rows O2/I4: arrived over the pod's lo (in-pod, or ztunnel's own
        // connection); row I3h: sent by a socket of the node (kubelet).
        // Row I6: a pod that bypasses inbound capture.
        Some(HintVerdict::Local | HintVerdict::Host | HintVerdict::Bypass) => {
            if first && cookie != 0 {
                count(cookie, |c: &mut Counters| &mut c.bypassed);
            }
            return SK_PASS;
        }
        Some(HintVerdict::Outbound) => Role::Outbound,
        Some(HintVerdict::Inbound) => Role::Inbound,
        Some(HintVerdict::Hbone) => Role::Hbone,
        Some(HintVerdict::DnsTcp) => Role::DnsTcp,
        // As if there were no hint: a `Deny` (written by builds before the
        // programs removed a refused SYN's hint instead) only overwrote an
        // older hint of the tuple.
        Some(HintVerdict::Deny | HintVerdict::DnsUdp) | None => {
            return unhinted(family, &remote, asked_by_tc)
        }
    };

    // Row F1: anything but Enabled/Served fails closed. The tc programs already drop
    // such SYNs silently; a drop here (an RST to the client) only covers races.
    let pod = unsafe { POD_STATE.get(cookie) };
    // A tc program asking about the app's own segment of a flow its pod
    // (still enrolled) steered is told the flow is refused (see
    // `TC_LOOKUP_REFUSED_STEERED`); a hint of another pod's, or of one
    // gone, says nothing of this segment.
    // Asked only on a refusal: the accepted path pays no address lookup.
    let its_own = || {
        asked_by_tc
            && pod.is_some()
            && matches!(role, Role::Outbound | Role::DnsTcp)
            && (asking == TC_LOOKUP_ASKING_REROUTED || pod_of(family, &remote) == Some(cookie))
    };
    if !pod.is_some_and(|p| p.steers()) {
        if first {
            count(cookie, |c: &mut Counters| &mut c.dropped_fail_closed);
        }
        return refused_steered(its_own());
    }
    let lkey = ListenerKey::new(cookie, role, family);
    let assigned = if role == Role::DnsTcp {
        DNS_LISTENERS.redirect_sk_lookup(ctx, lkey, 0)
    } else {
        LISTENERS.redirect_sk_lookup(ctx, lkey, 0)
    };
    match assigned {
        Ok(()) => {
            if !first {
                return SK_PASS;
            }
            if role == Role::DnsTcp {
                count_dns(cookie, |c: &mut DnsCounters| &mut c.captured_tcp);
                return SK_PASS;
            }
            count(cookie, |c: &mut Counters| match role {
                Role::Inbound => &mut c.captured_inbound,
                Role::Hbone => &mut c.captured_hbone,
                _ => &mut c.captured_outbound,
            });
            SK_PASS
        }
        Err(_) => {
            if first {
                count(cookie, |c: &mut Counters| &mut c.missing_socket);
            }
            refused_steered(its_own())
        }
    }
}

/// Refuses a flow hinted for ztunnel; with `tell`, the tc program asking is
/// told so (`TC_LOOKUP_REFUSED_STEERED`), so that it keeps the segment in
/// the pod.
#[inline(always)]
fn refused_steered(tell: bool) -> u32 {
    if tell {
        if let Some(a) = TC_LOOKUP.get_ptr_mut(0) {
            unsafe { *a = TC_LOOKUP_REFUSED_STEERED };
        }
    }
    SK_DROP
}

/// A verification's test run (see `sluice_common::verify`): the answer a
/// lookup with hint `h` gets, with nothing counted or marked, and the
/// listener assigned without reuseport selection (which a test run cannot
/// make).
#[inline(always)]
fn verify(ctx: &SkLookupContext, h: &FlowHint) -> u32 {
    let role = match HintVerdict::from_u32(h.verdict) {
        Some(HintVerdict::Outbound) => Role::Outbound,
        Some(HintVerdict::Inbound) => Role::Inbound,
        Some(HintVerdict::Hbone) => Role::Hbone,
        Some(HintVerdict::DnsTcp) => Role::DnsTcp,
        Some(HintVerdict::DnsUdp) => Role::DnsUdp,
        Some(HintVerdict::Local | HintVerdict::Host | HintVerdict::Bypass) => return SK_PASS,
        Some(HintVerdict::Deny) | None => return SK_DROP,
    };
    let cookie = h.netns_cookie;
    if !unsafe { POD_STATE.get(cookie) }.is_some_and(|p| p.steers()) {
        return SK_DROP;
    }
    let l = unsafe { &*ctx.lookup };
    let lkey = ListenerKey::new(cookie, role, l.family as u8);
    let assigned = if role.is_dns() {
        DNS_LISTENERS.redirect_sk_lookup(ctx, lkey, BPF_SK_LOOKUP_F_NO_REUSEPORT)
    } else {
        LISTENERS.redirect_sk_lookup(ctx, lkey, BPF_SK_LOOKUP_F_NO_REUSEPORT)
    };
    if assigned.is_ok() {
        SK_PASS
    } else {
        SK_DROP
    }
}

/// `bpf_sk_assign`'s flag in sk_lookup: take the socket itself, not a
/// member of its reuseport group chosen by hash.
const BPF_SK_LOOKUP_F_NO_REUSEPORT: u64 = 1 << 1;

/// A TCP lookup no tc program vouched for.
#[inline(always)]
fn unhinted(family: u8, remote: &[u32; 4], asked_by_tc: bool) -> u32 {
    // Row I3: kubelet probes are let through by the ingress program unhinted.
    if is_probe(family, remote) {
        return SK_PASS;
    }
    // Every other SYN into an enrolled pod crossed one of our tc programs.
    // No hint means a path we do not know (an interface added after
    // enrollment, a hint lost or expired): fail closed. Counted node-wide
    // (the pod is not known), but not for tc's lookups: the replies of every
    // uncaptured connection (probes, flows from before enrollment) ask.
    if !asked_by_tc {
        count_drop(DropReason::Unhinted);
    }
    SK_DROP
}

/// A UDP datagram for an unconnected socket: a DNS query the egress program
/// redirected (row D1) goes to the proxy's UDP socket. Everything else —
/// answers to the app's unconnected sockets, any other UDP — is left alone,
/// and only datagrams to port 53 cost a map lookup.
#[inline(always)]
fn steer_udp(ctx: &SkLookupContext) -> u32 {
    let l = unsafe { &*ctx.lookup };
    if l.local_port != PORT_DNS as u32 {
        return SK_PASS;
    }
    let key = lookup_key(ctx);
    if key.remote_port == 0 {
        if let Some(h) = unsafe { VERIFY_HINTS.get(key) } {
            return verify(ctx, h);
        }
    }
    let Some(hint) = take_udp_hint(&key) else {
        return SK_PASS;
    };
    let cookie = hint.netns_cookie;
    let lkey = ListenerKey::new(cookie, Role::DnsUdp, l.family as u8);
    match DNS_LISTENERS.redirect_sk_lookup(ctx, lkey, 0) {
        Ok(()) => {
            count_dns(cookie, |c: &mut DnsCounters| &mut c.captured_udp);
            SK_PASS
        }
        // The socket closed since the egress program looked: the query is
        // lost (the resolver retries) rather than refused by an ICMP error.
        Err(_) => {
            count(cookie, |c: &mut Counters| &mut c.missing_socket);
            SK_DROP
        }
    }
}

/// The flow-hint key of this lookup. Every address word is read with its
/// own volatile load, unconditionally: the verifier only accepts context
/// loads at a constant offset from the context pointer, and without this
/// LLVM may share one address computation between the IPv4 and IPv6 fields
/// (a "modified ctx ptr" the verifier refuses).
#[inline(always)]
fn lookup_key(ctx: &SkLookupContext) -> FlowKey {
    use core::ptr::{addr_of, read_volatile};
    let l = ctx.lookup;
    let word = |p: *const u32| unsafe { read_volatile(p) };
    let family = unsafe { word(addr_of!((*l).family)) } as u8;
    let v4 = unsafe {
        [
            word(addr_of!((*l).remote_ip4)),
            word(addr_of!((*l).local_ip4)),
        ]
    };
    let r6 = unsafe {
        [
            word(addr_of!((*l).remote_ip6[0])),
            word(addr_of!((*l).remote_ip6[1])),
            word(addr_of!((*l).remote_ip6[2])),
            word(addr_of!((*l).remote_ip6[3])),
        ]
    };
    let l6 = unsafe {
        [
            word(addr_of!((*l).local_ip6[0])),
            word(addr_of!((*l).local_ip6[1])),
            word(addr_of!((*l).local_ip6[2])),
            word(addr_of!((*l).local_ip6[3])),
        ]
    };
    let (remote, local) = if family == FAMILY_V4 {
        ([v4[0], 0, 0, 0], [v4[1], 0, 0, 0])
    } else {
        (r6, l6)
    };
    FlowKey {
        remote_addr: remote,
        local_addr: local,
        remote_port: u16::from_be(unsafe { read_volatile(addr_of!((*l).remote_port)) }),
        local_port: unsafe { word(addr_of!((*l).local_port)) } as u16,
        family,
        _pad: [0; 3],
    }
}

/// Takes (reads and deletes) a fresh DNS query hint for this datagram, if
/// any: UDP hints are one per query. A TCP hint of the same addresses and
/// ports (the key has no protocol) is left for its connection.
#[inline(always)]
fn take_udp_hint(key: &FlowKey) -> Option<FlowHint> {
    let h = unsafe { *hint_ptr(key)? };
    if h.verdict != HintVerdict::DnsUdp as u32 {
        return None;
    }
    // Its pod's share back, stale or not: the hint is gone.
    release_hint(key);
    if unsafe { bpf_ktime_get_ns() }.wrapping_sub(h.at_ns) > FLOW_HINT_TTL_NS {
        return None;
    }
    Some(h)
}

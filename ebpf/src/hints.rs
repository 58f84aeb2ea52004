//! Flow hints: a tc program's verdict on a SYN (or DNS datagram), left for
//! sk_lookup, which cannot learn the packet's netns or path. Keyed by the
//! 4-tuple as sk_lookup sees it.
//!
//! Each pod has a share of `flow_hints` (issue 38, case 4):
//! `HINTS_PER_POD_PER_S` hints left unreleased a second (`hint_budget`). A
//! hint that an answer releases gives its share back, so only what a pod
//! leaves behind counts: SYN-cookie handshakes (whose hint stays for the
//! ACK), SYNs nothing answered, and UDP DNS queries dropped before their
//! lookup took their hint. Past its share, a pod's hints go to
//! `flow_hints_overflow`, which only pods past their share write: they
//! still work while that map holds them, and they never evict another
//! pod's hint from `flow_hints`. Readers look in `flow_hints` first; a
//! hint written to the overflow map removes its tuple's older one there,
//! so a tuple's newest verdict is the one found.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use sluice_common::{FlowHint, FlowKey, HintVerdict, HINTS_PER_POD_PER_S, HINT_CHARGED};

use crate::{
    budget,
    maps::{FLOW_HINTS, FLOW_HINTS_OVERFLOW, HINTS_OVER_SHARE, HINT_BUDGET},
};

/// The flow-hint key of a packet from `saddr:sport` to `daddr:dport`, as
/// sk_lookup will see its lookup (remote = source, local = destination).
#[inline(always)]
pub fn flow_key(family: u8, saddr: [u32; 4], daddr: [u32; 4], sport: u16, dport: u16) -> FlowKey {
    FlowKey {
        remote_addr: saddr,
        local_addr: daddr,
        remote_port: sport,
        local_port: dport,
        family,
        _pad: [0; 3],
    }
}

/// Writes a verdict no pod's share pays for (the node's `Host` hints) over
/// any older hint of the same tuple in `flow_hints`.
#[inline(always)]
pub fn put_hint(cookie: u64, key: &FlowKey, verdict: HintVerdict) {
    let _ = FLOW_HINTS.insert(key, hint(cookie, verdict, 0), 0);
}

/// Writes this SYN's verdict, paid from the pod's share (`HINT_*` `flags`
/// already set); past the share, to the overflow map.
#[inline(always)]
pub fn put_charged_hint(cookie: u64, key: &FlowKey, verdict: HintVerdict, flags: u32) {
    if budget::take(&HINT_BUDGET, cookie, HINTS_PER_POD_PER_S).is_some() {
        let _ = FLOW_HINTS.insert(key, hint(cookie, verdict, flags | HINT_CHARGED), 0);
        return;
    }
    if let Some(c) = HINTS_OVER_SHARE.get_ptr_mut(0) {
        // Per-CPU value: no other writer, a plain add is enough.
        unsafe { *c += 1 };
    }
    let _ = FLOW_HINTS.remove(key);
    let _ = FLOW_HINTS_OVERFLOW.insert(key, hint(cookie, verdict, flags), 0);
}

#[inline(always)]
fn hint(cookie: u64, verdict: HintVerdict, flags: u32) -> FlowHint {
    FlowHint {
        verdict: verdict as u32,
        flags,
        netns_cookie: cookie,
        at_ns: unsafe { bpf_ktime_get_ns() },
    }
}

/// The hint of this tuple, to read or mark.
#[inline(always)]
pub fn hint_ptr(key: &FlowKey) -> Option<*mut FlowHint> {
    FLOW_HINTS
        .get_ptr_mut(key)
        .or_else(|| FLOW_HINTS_OVERFLOW.get_ptr_mut(key))
}

/// The hint of this tuple in `flow_hints` only: where hints no share pays
/// for are (`Host`).
#[inline(always)]
pub fn unshared_hint_ptr(key: &FlowKey) -> Option<*mut FlowHint> {
    FLOW_HINTS.get_ptr_mut(key)
}

/// Removes a hint that has served, giving its pod's share back if it paid.
#[inline(always)]
pub fn release_hint(key: &FlowKey) {
    let Some(h) = (unsafe { FLOW_HINTS.get(key) }).copied() else {
        let _ = FLOW_HINTS_OVERFLOW.remove(key);
        return;
    };
    // Only the CPU whose removal took it gives its share back: two taking
    // one hint at once give it back once.
    if FLOW_HINTS.remove(key).is_ok() && h.flags & HINT_CHARGED != 0 {
        budget::give_back(&HINT_BUDGET, h.netns_cookie);
    }
}

/// Removes any hint of this tuple, wherever it is: sk_lookup then finds
/// none and refuses the lookup. No share is given back: the hint did not
/// serve its SYN.
#[inline(always)]
pub fn forget_hint(key: &FlowKey) {
    let _ = FLOW_HINTS.remove(key);
    let _ = FLOW_HINTS_OVERFLOW.remove(key);
}

//! The local route (`--local-route`, issue 42). The agent routes a pod's
//! app TCP over the pod's `lo` (`iif lo ipproto tcp fwmark 0/0xfff lookup
//! 101`, `local default dev lo src <pod address> table 101`): the MSS of a
//! connection is fixed at `connect()` from its route, so a captured
//! connection gets loopback's (≈ 65 kB) instead of the pod interface's
//! (1,448), and its packets never pass the interface's programs.
//!
//! `lo`'s egress program gives such a SYN the verdict the interface's
//! egress program gives today: the socket's netns names the pod (the
//! local route is only offered where tc programs can ask: Linux ≥ 6.15).
//! It writes the hint with [`HINT_LO_OUT`]; `lo`'s ingress keeps only such
//! a hint for a SYN that is not exempt. A packet of a flow that the local
//! route sent over `lo` but no socket of the pod terminates (a connection
//! from before enrollment, re-routed when the rule came; a SYN the pod's
//! exclusions keep out of capture that no exclusion rule caught) leaves by
//! the pod's interface, marked so that the kernel's route lookup skips
//! the local route.

use aya_ebpf::{helpers::bpf_redirect_neigh, programs::TcContext};
use sluice_common::{Counters, DropReason, HINT_LO_OUT, MARK_DIRECT, MARK_MASK, MARK_ZTUNNEL};

use crate::{
    addr::{is_loopback, is_probe},
    capture::{flow_key, outbound_verdict, terminated_locally, TC_OK, TC_SHOT},
    exclusions,
    maps::{LOCAL_ROUTE, POD_STATE},
    packet::{parse_tcp, Tcp, L2_ETH},
    tc::{mark, netns_cookie, pod_of},
    verify::Writes,
};

/// Egress on the pod's `lo`.
#[inline(always)]
pub fn lo_egress(ctx: &TcContext) -> i32 {
    let Some(t) = parse_tcp::<L2_ETH>(ctx) else {
        return TC_OK;
    };
    // ztunnel's own sockets (row O4) and in-pod traffic to loopback (row O3).
    if mark(ctx) & MARK_MASK == MARK_ZTUNNEL || is_loopback(t.family, &t.daddr) {
        return TC_OK;
    }
    // Every packet here has a socket of this netns (or none, read as the
    // node's): the pod it names, if it takes the local route.
    let Some(cookie) = netns_cookie(ctx) else {
        return TC_OK;
    };
    // To one of the pod's own addresses (row O2): `lo`'s ingress decides, as
    // without the local route.
    if pod_of(t.family, &t.daddr) == Some(cookie) {
        return TC_OK;
    }
    let Some(uplink) = (unsafe { LOCAL_ROUTE.get(cookie) }).copied() else {
        return TC_OK;
    };
    if t.is_syn() {
        return syn(ctx, cookie, uplink, &t);
    }
    // A flow ztunnel terminates (15001 or the DNS proxy accepted it, or
    // answered its SYN with a cookie; the app's answers to ztunnel's
    // inbound connections): it stays on `lo`. Any other flow leaves.
    if terminated_locally(ctx, &t) {
        return TC_OK;
    }
    leave(ctx, uplink)
}

/// A SYN of pod `cookie` that the local route sent over `lo`: hinted for
/// 15001 (or the DNS proxy), sent out (its exclusions), or dropped (fail
/// closed), as the interface's egress program decides.
#[inline(always)]
fn syn(ctx: &TcContext, cookie: u64, uplink: u32, t: &Tcp) -> i32 {
    let w = Writes::of(ctx, t.sport);
    // Row O3: to the probe address, never captured.
    if is_probe(t.family, &t.daddr) {
        return leave(ctx, uplink);
    }
    // The socket is the pod's: its source must not be another pod's address.
    if pod_of(t.family, &t.saddr).is_some_and(|owner| owner != cookie) {
        w.count_drop(DropReason::UnknownSource);
        return TC_SHOT;
    }
    let Some(pod) = (unsafe { POD_STATE.get(cookie) }) else {
        // Being removed: fail closed.
        return TC_SHOT;
    };
    // Row E1: kept out of capture, in any state. The interface's egress
    // program meets the SYN on its way out, and counts it there.
    if exclusions::outbound(cookie, t) {
        return leave(ctx, uplink);
    }
    if !pod.steers() {
        w.count(cookie, |c: &mut Counters| &mut c.dropped_fail_closed);
        return TC_SHOT;
    }
    let Some(verdict) = outbound_verdict(w, cookie, t) else {
        return TC_SHOT;
    };
    w.put_charged_hint(ctx, cookie, &flow_key(t), verdict, HINT_LO_OUT);
    TC_OK
}

/// Sends the packet out of the pod by interface `uplink`, its next hop
/// from the kernel's route lookup, marked so that the lookup takes the
/// main table, not the local route.
#[inline(always)]
fn leave(ctx: &TcContext, uplink: u32) -> i32 {
    ctx.set_mark((mark(ctx) & !MARK_MASK) | MARK_DIRECT);
    unsafe { bpf_redirect_neigh(uplink, core::ptr::null_mut(), 0, 0) as i32 }
}

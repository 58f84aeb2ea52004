//! tc programs on the pod's interfaces (cls_bpf filters, or tcx links). They never pick a listener
//! (sk_lookup does); they decide which packets are delivered locally, leave
//! hints for sk_lookup, and drop SYNs that would otherwise bypass ztunnel.
//!
//! Per-packet cost: every TCP packet is parsed; only SYNs touch pod_state,
//! pod_addrs (ingress), listeners, flow_hints and hint_budget (SYN-ACKs:
//! flow_hints and hint_budget, to release). Non-SYN egress packets cost one socket lookup
//! (bpf_skc_lookup_tcp), which is how a flow that ztunnel terminates inside the
//! pod is recognised without any per-flow state of our own (a lookup that
//! misses the established table runs sk_lookup, which reads the flow's hint:
//! how a SYN-cookie handshake's ACK is recognised).
//!
//! Every SYN that passes a tc program on its way to a listener lookup
//! leaves its own hint, or, where nothing is exempt or steered, removes
//! any hint of its tuple: a hint kept from an earlier connection of the
//! same tuple never speaks for it, and a SYN that is refused holds no
//! entry of the node-wide map (a pod connecting in a loop to a closed port
//! or a spoofed source must not fill it: issue 38, case 4).

use aya_ebpf::{
    bindings::{tcx_action_base::TCX_NEXT, TC_ACT_SHOT},
    helpers::{bpf_ktime_get_ns, bpf_sk_assign, bpf_sk_fullsock, bpf_sk_release},
    programs::TcContext,
    EbpfContext,
};
use core::ffi::c_void;
use sluice_common::{
    Counters, DropReason, ExcludedCounters, FlowKey, HintVerdict, Role, FLOW_HINT_TTL_NS,
    HINT_HOST_TAKEN, HINT_LO_OUT, HINT_LO_TAKEN, HINT_USED, MARK_DIRECT, MARK_MASK, MARK_REDIRECT,
    MARK_ZTUNNEL, POD_FLAG_BYPASS_INBOUND, PORT_DNS, PORT_HBONE, PORT_OUTBOUND,
};

use crate::{
    addr::{is_loopback, is_probe},
    dns, exclusions,
    hints::{forget_hint, hint_ptr, put_charged_hint, release_hint, unshared_hint_ptr},
    lookup::{loopback, skc_lookup, skc_lookup_found},
    maps::{count, count_drop, NODE_NETNS, POD_STATE, TC_LOOKUP_ASKING, TC_LOOKUP_ASKING_REROUTED},
    origin::{from_its_pod, Sent},
    packet::{parse, parse_tcp, Parsed, Tcp, L2_ETH},
    tc::{
        listener_present, mark, mark_redirect, netns_cookie, pod_flags, pod_of, redirect_to_self,
    },
    verify::Writes,
};

/// Not ours to decide: the next program on the hook runs (tcx's
/// `TCX_NEXT`, cls_bpf's `TC_ACT_UNSPEC`: the next filter), and with none the
/// packet goes on. Passing on with `TCX_NEXT` rather than `TC_ACT_OK` lets
/// programs after sluice's on the hook (filters of a later priority, tcx
/// links appended after sluice's) still see the packet.
pub const TC_OK: i32 = TCX_NEXT;
pub const TC_SHOT: i32 = TC_ACT_SHOT;
const BPF_TCP_LISTEN: u32 = 10;
/// A request socket: a handshake the listener answered without a cookie.
const BPF_TCP_NEW_SYN_RECV: u32 = 12;

/// Egress on the pod's interface: the app's outbound TCP. `L2`: the
/// interface's link-layer header length (`L2_ETH`, or `L2_NONE` for an L3
/// device).
#[inline(always)]
pub fn egress<const L2: usize>(ctx: &TcContext) -> i32 {
    let t = match parse::<L2>(ctx) {
        Parsed::Tcp(t) => t,
        // Rows D1-D3: DNS capture; any other UDP is not captured (row O5).
        Parsed::Udp(u) => return dns::egress_udp::<L2>(ctx, &u),
        Parsed::Other => return TC_OK, // row O5
        // IPv6 whose headers hide what it carries: it could be a SYN around
        // ztunnel, so it does not leave an enrolled pod (ztunnel's own aside).
        Parsed::Opaque => {
            if mark(ctx) & MARK_MASK == MARK_ZTUNNEL {
                return TC_OK;
            }
            // A socket of no enrolled pod (not this pod's own) may send it;
            // without netns cookies, this interface is captured, so no.
            if netns_cookie(ctx).is_some_and(|c| unsafe { POD_STATE.get(c) }.is_none()) {
                return TC_OK;
            }
            count_drop(DropReason::Malformed);
            return TC_SHOT;
        }
    };
    // An inbound handshake answered from a request socket: its hint has
    // served (the client's ACK meets that socket, no lookup runs again).
    if t.is_syn_ack() {
        release_answered_hint(ctx, &t);
    }
    // Rows O4/O6: ztunnel's own sockets (and what they accepted) leave untouched.
    if mark(ctx) & MARK_MASK == MARK_ZTUNNEL {
        return TC_OK;
    }
    // Row O3 (loopback never reaches this interface, checked for symmetry).
    if is_probe(t.family, &t.daddr) || is_loopback(t.family, &t.daddr) {
        return TC_OK;
    }
    if t.is_syn() {
        let w = Writes::of(ctx, t.sport);
        // A new outbound connection (row O1): steer it to 15001 or fail closed (F1).
        // The pod is the socket's netns; a SYN without a socket (crafted, odd
        // paths) reads as the host netns, and a kernel that cannot tell has
        // none: then the source address names the pod.
        // (Plain cookies, 0 for none, rather than options: the verifier
        // must never see a read of an unset payload.)
        let by_socket = netns_cookie(ctx);
        let owner = pod_of(t.family, &t.saddr).unwrap_or(0);
        let socket_pod = match by_socket {
            Some(c) if unsafe { POD_STATE.get(c) }.is_some() => c,
            _ => 0,
        };
        let cookie = if socket_pod != 0 { socket_pod } else { owner };
        let Some(pod) = (unsafe { POD_STATE.get(cookie) }) else {
            if by_socket.is_some() {
                return TC_OK;
            }
            // This interface is captured (the program runs nowhere else) and
            // the SYN's source is no pod's: it does not leave around ztunnel.
            w.count_drop(DropReason::UnknownSource);
            return TC_SHOT;
        };
        // A source address another pod owns: never steered as that pod's
        // (its listeners, its identity) nor as this one's.
        let role = || {
            if t.dport == PORT_DNS
                && dns::dns_on(cookie)
                && listener_present(cookie, Role::DnsTcp, t.family)
            {
                Role::DnsTcp
            } else {
                Role::Outbound
            }
        };
        let sent = Sent {
            by_its_socket: socket_pod != 0,
            owner,
            family: t.family,
            saddr: t.saddr,
            sport: t.sport,
        };
        if !from_its_pod(ctx, cookie, role, &sent) {
            w.count_drop(DropReason::UnknownSource);
            return TC_SHOT;
        }
        // Row E1: the pod's exclusions keep it out of capture, in any
        // state (it never meets ztunnel).
        if exclusions::outbound(cookie, &t) {
            w.count_excluded(cookie, |c: &mut ExcludedCounters| &mut c.outbound);
            // An older hint for this 4-tuple (a captured connection whose
            // handshake ended in a SYN cookie) would steer its packets.
            w.forget_hint(&flow_key(&t));
            return TC_OK;
        }
        if !pod.steers() {
            w.count(cookie, |c: &mut Counters| &mut c.dropped_fail_closed);
            return TC_SHOT;
        }
        let Some(verdict) = outbound_verdict(w, cookie, &t) else {
            return TC_SHOT;
        };
        w.put_charged_hint(ctx, cookie, &flow_key(&t), verdict, 0);
        return redirect_to_self::<L2>(ctx);
    }
    // Not a SYN: deliver locally only packets of flows a local socket terminates
    // (outbound flows ztunnel accepted on 15001, or whose SYN it answered
    // with a cookie; the app's replies to ztunnel's spoofed-source
    // connections: row I4). Flows from before enrollment have no such socket
    // and leave normally (row I5); a flow steered to ztunnel never does.
    if terminated_locally(ctx, &t) {
        return redirect_to_self::<L2>(ctx);
    }
    TC_OK
}

/// Where a steering pod's outbound SYN goes: row D2, TCP to port 53 to the
/// DNS proxy when the pod has one; else 15001; `None` (counted) when the
/// pod has no 15001 listener (fail closed).
#[inline(always)]
pub fn outbound_verdict(w: Writes, cookie: u64, t: &Tcp) -> Option<HintVerdict> {
    if dns::captures_tcp(w, cookie, t) {
        Some(HintVerdict::DnsTcp)
    } else if listener_present(cookie, Role::Outbound, t.family) {
        Some(HintVerdict::Outbound)
    } else {
        w.count(cookie, |c: &mut Counters| &mut c.missing_socket);
        None
    }
}

/// Ingress on the pod's interface: drop inbound SYNs that ztunnel cannot take
/// (row F1), so the client retries instead of reaching the app or being reset;
/// hint the others to sk_lookup (rows I1/I2).
#[inline(always)]
pub fn ingress<const L2: usize>(ctx: &TcContext) -> i32 {
    let t = match parse::<L2>(ctx) {
        Parsed::Tcp(t) => t,
        Parsed::Udp(_) | Parsed::Other => return TC_OK,
        // Headers that hide what they carry (an IPv6 extension chain past
        // the walk, a first fragment cut inside the TCP header): a SYN
        // there would write no verdict of its own and meet whatever older
        // hint its tuple has (a node's `Host` one, say). It does not enter.
        Parsed::Opaque => {
            count_drop(DropReason::Malformed);
            return TC_SHOT;
        }
    };
    let mesh = mark(ctx) & MARK_MASK;
    // Under the local route (`--local-route`) a socket the app accepts takes
    // the mark of the segment that made it (`tcp_fwmark_accept`: the SYN, or
    // a SYN-cookie handshake's ACK): marked, its answers leave by the main
    // table, not the local route. (ztunnel's listeners have their own mark,
    // which wins; without the local route sluice reads it nowhere.)
    if mesh == 0 {
        ctx.set_mark(mark(ctx) | MARK_DIRECT);
    }
    if !t.is_syn() || mesh == MARK_REDIRECT {
        // Established traffic, or our own egress redirect (already checked there).
        return TC_OK;
    }
    let w = Writes::of(ctx, t.sport);
    // An address we do not know (added after enrollment?) is steered to
    // nothing, and sk_lookup refuses it: fail closed. (Row I3's probes pass
    // there unhinted, as below.)
    let Some(cookie) = pod_of(t.family, &t.daddr) else {
        if !is_probe(t.family, &t.saddr) {
            w.forget_hint(&flow_key(&t));
        }
        return TC_OK;
    };
    inbound_syn(ctx, w, cookie, &t)
}

/// [`ingress`]'s verdict on a SYN addressed to pod `cookie`.
#[inline(always)]
fn inbound_syn(ctx: &TcContext, w: Writes, cookie: u64, t: &Tcp) -> i32 {
    // Row I3: sk_lookup passes the probe address unhinted (no program writes
    // another verdict for it, so no older hint can be in the way).
    if is_probe(t.family, &t.saddr) {
        w.count(cookie, |c: &mut Counters| &mut c.bypassed);
        return TC_OK;
    }
    // Row I3h: the node's own socket sent it (the host-side program said
    // so): sk_lookup lets it through on that hint, in any pod state.
    if !w.verifying() && host_hinted(cookie, t) {
        return TC_OK;
    }
    // Row I6: the pod asked for no inbound capture (Istio's "ingress mode"):
    // its SYNs go where they are addressed; HBONE still reaches ztunnel.
    // Row E2: so do those its exclusions keep out of capture.
    if t.dport != PORT_HBONE {
        let bypass = pod_flags(cookie) & POD_FLAG_BYPASS_INBOUND != 0;
        if bypass || exclusions::inbound(cookie, t.dport) {
            if !bypass {
                w.count_excluded(cookie, |c: &mut ExcludedCounters| &mut c.inbound);
            }
            w.put_charged_hint(ctx, cookie, &flow_key(t), HintVerdict::Bypass, 0);
            return TC_OK;
        }
    }
    let Some(pod) = (unsafe { POD_STATE.get(cookie) }) else {
        // Being removed: sk_lookup refuses it.
        w.forget_hint(&flow_key(t));
        return TC_OK;
    };
    if !pod.steers() {
        w.count(cookie, |c: &mut Counters| &mut c.dropped_fail_closed);
        return TC_SHOT;
    }
    let (role, verdict) = if t.dport == PORT_HBONE {
        (Role::Hbone, HintVerdict::Hbone)
    } else {
        (Role::Inbound, HintVerdict::Inbound)
    };
    if !listener_present(cookie, role, t.family) {
        w.count(cookie, |c: &mut Counters| &mut c.missing_socket);
        return TC_SHOT;
    }
    w.put_charged_hint(ctx, cookie, &flow_key(t), verdict, 0);
    TC_OK
}

/// Ingress on a pod interface named in `istio.io/reroute-virtual-interfaces`
/// (a VM's tap in the pod, KubeVirt): TCP arriving there is the VM's
/// outbound, captured to 15001 as Istio's `-i IFACE -j REDIRECT --to-ports
/// 15001` does (row I7). The SYN is assigned to ztunnel's 15001 listener
/// (found in this netns through loopback, which sk_lookup leaves alone) and
/// marked for local delivery; the listener's netns names the pod. Later
/// packets of flows ztunnel terminates are delivered locally the same way,
/// and so is the ACK of a handshake the listener answered with a SYN
/// cookie, which sk_lookup gives to 15001 on the SYN's hint; no listener,
/// or a pod that does not steer, drops the SYN (fail closed).
pub fn reroute_ingress(ctx: &TcContext) -> i32 {
    let t = match parse::<L2_ETH>(ctx) {
        Parsed::Tcp(t) => t,
        Parsed::Udp(_) | Parsed::Other => return TC_OK,
        // A SYN could hide there: nothing opaque passes a captured interface.
        Parsed::Opaque => {
            count_drop(DropReason::Malformed);
            return TC_SHOT;
        }
    };
    if !t.is_syn() {
        if terminated_locally_as(ctx, &t, TC_LOOKUP_ASKING_REROUTED) {
            mark_redirect(ctx);
        }
        return TC_OK;
    }
    let Some(listener) = outbound_listener(ctx, &t) else {
        return TC_SHOT;
    };
    let assigned = unsafe { bpf_sk_assign(ctx.as_ptr(), listener, 0) };
    unsafe { bpf_sk_release(listener) };
    if assigned != 0 {
        return TC_SHOT;
    }
    // The packet's socket is now the listener: its netns is the pod's. A
    // kernel that cannot tell the netns cannot tell the pod (the agent
    // refuses rerouted interfaces there): fail closed.
    let Some(cookie) = netns_cookie(ctx) else {
        count_drop(DropReason::UnknownSource);
        return TC_SHOT;
    };
    if !unsafe { POD_STATE.get(cookie) }.is_some_and(|p| p.steers()) {
        count(cookie, |c: &mut Counters| &mut c.dropped_fail_closed);
        return TC_SHOT;
    }
    // For the cookie ACK's lookup (the SYN itself skips it): counted here,
    // so marked used.
    put_charged_hint(cookie, &flow_key(&t), HintVerdict::Outbound, HINT_USED);
    count(cookie, |c: &mut Counters| &mut c.captured_outbound);
    mark_redirect(ctx);
    TC_OK
}

/// The 15001 listener of this netns (referenced: the caller releases it),
/// looked up at loopback so that sk_lookup passes the lookup through.
#[inline(always)]
fn outbound_listener(ctx: &TcContext, t: &Tcp) -> Option<*mut c_void> {
    let sk = skc_lookup(
        ctx,
        t.family,
        &t.saddr,
        &loopback(t.family),
        t.sport,
        PORT_OUTBOUND,
    )?;
    if unsafe { (*sk).state } != BPF_TCP_LISTEN {
        unsafe { bpf_sk_release(sk as *mut c_void) };
        return None;
    }
    Some(sk as *mut c_void)
}

/// Ingress on the pod's `lo`: Istio exempts `-i lo` traffic (the app to its own
/// pod IP, ztunnel's spoofed-source connections to the app). sk_lookup cannot
/// see the input device for these, so tell it with a hint (rows O2, I4).
pub fn lo_ingress(ctx: &TcContext) -> i32 {
    let t = match parse::<L2_ETH>(ctx) {
        Parsed::Tcp(t) => Some(t),
        // Row D1: the DNS proxy's answer, given the resolver's address back.
        Parsed::Udp(u) => return dns::restore_answer(ctx, &u),
        _ => None,
    };
    if let Some(t) = t {
        // The answer to a SYN that came this way, exempt (its hint says
        // `Local`): the hint has served once the listener answered from a
        // request socket. (The SYN-ACK lost its socket in loopback's
        // transmit: the lookup tells.) Other SYN-ACKs over lo answer SYNs
        // steered from egress (15001, the DNS proxy): the app's ACK meets
        // that request socket on egress and releases the hint there, so
        // they cost no socket lookup here.
        if t.is_syn_ack() && !is_loopback(t.family, &t.saddr) && answers_local_hint(&t) {
            release_hint_of_request(ctx, &t);
        }
        // The answer of a closed port to an exempt SYN: the connection is
        // over, and so is its hint's use.
        if t.is_rst() && !is_loopback(t.family, &t.saddr) && answers_local_hint(&t) {
            let syn = crate::hints::flow_key(t.family, t.daddr, t.saddr, t.dport, t.sport);
            release_hint(&syn);
        }
        if t.is_syn() && !is_loopback(t.family, &t.daddr) {
            // The cookie only serves the counters: 0 (unknown) is fine here.
            let cookie = pod_of(t.family, &t.daddr).unwrap_or(0);
            // Only ztunnel's marked connections (row I4) and the pod's own
            // traffic to its own address (row O2) are exempt. A SYN with
            // another, spoofed source plants no hint: it could otherwise
            // exempt a later real inbound connection with the same tuple.
            // ztunnel's mark first: it spares ztunnel's SYNs the address lookup.
            let exempt = mark(ctx) & MARK_MASK == MARK_ZTUNNEL
                || is_loopback(t.family, &t.saddr)
                || (cookie != 0 && pod_of(t.family, &t.saddr) == Some(cookie));
            // A SYN that is not exempt is steered nowhere either: sk_lookup
            // refuses it (row X3), whatever an older hint of its tuple said,
            // unless `lo`'s egress hinted this very SYN (the local route
            // sent it here). (A cookie of 0, an address of no pod, is one
            // share for all such SYNs.)
            if exempt {
                put_charged_hint(cookie, &flow_key(&t), HintVerdict::Local, 0);
            } else if !take_lo_out_hint(&t) {
                forget_hint(&flow_key(&t));
            }
        }
        unmark_ztunnels(ctx, &t);
    }
    TC_OK
}

/// With `tcp_fwmark_accept` (the local route sets it; a pod may too) a
/// socket the app accepts takes the mark of the segment that made it
/// (ztunnel's SYN, or a SYN-cookie handshake's ACK). With ztunnel's mark,
/// the app's answers would take the main table and leave the pod as
/// ztunnel's own, uncaptured: the mark goes from every ztunnel segment to
/// an enrolled pod's address (on the local route, the answers then take it
/// back to ztunnel's socket; otherwise the egress program redirects them).
#[inline(always)]
fn unmark_ztunnels(ctx: &TcContext, t: &Tcp) {
    if mark(ctx) & MARK_MASK == MARK_ZTUNNEL && pod_of(t.family, &t.daddr).is_some() {
        ctx.set_mark(mark(ctx) & !MARK_MASK);
    }
}

/// Egress on the host side of a pod's veth, in the node's netns: a SYN that
/// a socket of the node netns itself sent (kubelet's probes, any host
/// process) is hinted as exempt, which the pod's ingress program leaves in
/// place. Forwarded SYNs (other nodes, NodePort after masquerading) carry no
/// socket and pods' SYNs (bridged) another netns's: they are captured as
/// usual. The origin decides, not the source address — what istio-cni's
/// `-m owner --socket-exists` host rule decides.
///
/// A guest on the host's interface: it never drops or redirects, and says
/// `TCX_NEXT` so that programs after it (the primary CNI's) still run.
pub fn host_egress(ctx: &TcContext) -> i32 {
    let Some(t) = parse_tcp::<L2_ETH>(ctx) else {
        return TCX_NEXT;
    };
    if !t.is_syn() || unsafe { (*ctx.skb.skb).__bindgen_anon_2.sk }.is_null() {
        return TCX_NEXT;
    }
    // The socket's netns must be the node's. Where tc cannot ask, the SYN
    // must not have been received by the node: a forwarded one lost its
    // socket to IP, but one a bridge passes on from a neighbour pod (a
    // bridge CNI's `cni0`) still holds that pod's socket here on 6.1; both
    // name the interface they came in on, which a SYN the node sent has not.
    let node = NODE_NETNS.get(0).copied().unwrap_or(0);
    let nodes_own = match netns_cookie(ctx) {
        Some(c) => c == node,
        None => (unsafe { (*ctx.skb.skb).ingress_ifindex }) == 0,
    };
    if node == 0 || !nodes_own {
        return TCX_NEXT;
    }
    if let Some(cookie) = pod_of(t.family, &t.daddr) {
        Writes::of(ctx, t.sport).put_hint(ctx, cookie, &flow_key(&t), HintVerdict::Host);
    }
    TCX_NEXT
}

/// Did `lo`'s egress hint this SYN (the local route sent it over `lo`)?
/// Such a hint lets one SYN in, the one it was written for; a SYN that
/// did not pass `lo`'s egress (a packet socket that bypasses the qdisc)
/// finds it taken, or none.
#[inline(always)]
fn take_lo_out_hint(t: &Tcp) -> bool {
    let Some(h) = hint_ptr(&flow_key(t)) else {
        return false;
    };
    let hint = unsafe { *h };
    let fresh = unsafe { bpf_ktime_get_ns() }.wrapping_sub(hint.at_ns) <= FLOW_HINT_TTL_NS;
    // A source that is a pod's address is that pod's hint or none (another
    // pod's SYN with its tuple takes nothing).
    let its = pod_of(t.family, &t.saddr).is_none_or(|owner| owner == hint.netns_cookie);
    if hint.flags & (HINT_LO_OUT | HINT_LO_TAKEN) != HINT_LO_OUT || !fresh || !its {
        return false;
    }
    unsafe { (*h).flags = hint.flags | HINT_LO_TAKEN };
    true
}

/// Did the host-side program hint this SYN as the node's own (for this pod)?
/// A `Host` hint lets one SYN in, the one it was written for (it stays, for
/// sk_lookup and a cookie ACK): a later SYN of the tuple the host side did
/// not hint again (forwarded, not the node's) is captured.
#[inline(always)]
fn host_hinted(cookie: u64, t: &Tcp) -> bool {
    let key = flow_key(t);
    let Some(h) = unshared_hint_ptr(&key) else {
        return false;
    };
    let hint = unsafe { *h };
    let fresh = unsafe { bpf_ktime_get_ns() }.wrapping_sub(hint.at_ns) <= FLOW_HINT_TTL_NS;
    if hint.verdict != HintVerdict::Host as u32
        || hint.netns_cookie != cookie
        || hint.flags & HINT_HOST_TAKEN != 0
        || !fresh
    {
        return false;
    }
    unsafe { (*h).flags = hint.flags | HINT_HOST_TAKEN };
    true
}

#[inline(always)]
pub fn flow_key(t: &Tcp) -> FlowKey {
    crate::hints::flow_key(t.family, t.saddr, t.daddr, t.sport, t.dport)
}

/// Forgets the hint of the SYN this SYN-ACK answers when a request socket
/// sent it (the kernel attaches the request socket to a normal SYN-ACK; a
/// SYN-cookie SYN-ACK has none, and its hint stays for the cookie ACK's
/// lookup). Hints kept for their TTL would fill the LRU map at any
/// sustained connection rate, and every insert would then evict.
#[inline(always)]
fn release_answered_hint(ctx: &TcContext, t: &Tcp) {
    let sk = unsafe { (*ctx.skb.skb).__bindgen_anon_2.sk };
    if !sk.is_null() {
        let syn = crate::hints::flow_key(t.family, t.daddr, t.saddr, t.dport, t.sport);
        release_hint(&syn);
    }
}

/// Whether the SYN this SYN-ACK answers left a `Local` hint (it came over
/// lo, exempt).
#[inline(always)]
fn answers_local_hint(t: &Tcp) -> bool {
    let syn = crate::hints::flow_key(t.family, t.daddr, t.saddr, t.dport, t.sport);
    hint_ptr(&syn).is_some_and(|h| unsafe { (*h).verdict } == HintVerdict::Local as u32)
}

/// Forgets the hint of the SYN this SYN-ACK answers when the listener keeps
/// a request socket for it (a SYN-cookie handshake has none: its hint stays
/// for the cookie ACK's lookup).
#[inline(always)]
fn release_hint_of_request(ctx: &TcContext, t: &Tcp) {
    let Some(sk) = skc_lookup(ctx, t.family, &t.daddr, &t.saddr, t.dport, t.sport) else {
        return;
    };
    if unsafe { (*sk).state } == BPF_TCP_NEW_SYN_RECV {
        let syn = crate::hints::flow_key(t.family, t.daddr, t.saddr, t.dport, t.sport);
        release_hint(&syn);
    }
    unsafe { bpf_sk_release(sk as *mut c_void) };
}

/// Would this packet, received here, be taken by a socket of this netns
/// that is ztunnel's? A connected (non-listening) socket can only be one
/// ztunnel made or accepted. A listener with ztunnel's mark is one that
/// sk_lookup gave this flow on its SYN's hint: a handshake answered with a
/// SYN cookie has no socket until that listener takes its ACK, so the ACK
/// (and what follows it) goes where the SYN went, not out of the pod.
/// Another listener (the app's, bound to a wildcard address) is not the
/// flow's: sk_lookup refuses unhinted lookups before one is reached.
///
/// A flow of the pod's that was steered to ztunnel, which no longer takes
/// it (the listener gone, or the pod no longer steering, while a SYN-cookie
/// handshake waits for its ACK), stays too: delivered in the pod, where the
/// lookup refuses it again and the app gets a reset, instead of leaving the
/// pod around ztunnel.
#[inline(always)]
pub fn terminated_locally(ctx: &TcContext, t: &Tcp) -> bool {
    terminated_locally_as(ctx, t, TC_LOOKUP_ASKING)
}

/// [`terminated_locally`] asking as `asking` (`TC_LOOKUP_ASKING*`).
#[inline(always)]
fn terminated_locally_as(ctx: &TcContext, t: &Tcp, asking: u32) -> bool {
    let found = skc_lookup_found(ctx, t.family, &t.saddr, &t.daddr, t.sport, t.dport, asking);
    let Some(sk) = found.sk else {
        return found.refused_steered;
    };
    let state = unsafe { (*sk).state };
    // The app's ACK of an outbound handshake 15001 answered from a request
    // socket (not a SYN cookie): the SYN's hint has served.
    if state == BPF_TCP_NEW_SYN_RECV {
        release_hint(&flow_key(t));
    }
    let ours = state != BPF_TCP_LISTEN || {
        // A listener is a full socket: its mark can be read.
        let full = unsafe { bpf_sk_fullsock(sk) };
        !full.is_null() && unsafe { (*full).mark } & MARK_MASK == MARK_ZTUNNEL
    };
    unsafe { bpf_sk_release(sk as *mut c_void) };
    ours
}

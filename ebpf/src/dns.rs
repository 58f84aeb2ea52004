//! DNS capture (rows D1-D4): a pod's queries to port 53 go to ztunnel's DNS
//! proxy on the pod's localhost:15053, as Istio's `REDIRECT --to-ports 15053`
//! rules send them, and the proxy's UDP answers get the resolver's address
//! back as their source — what conntrack's de-NAT gives Istio.
//!
//! - UDP: the egress program records the query (querying socket + DNS id →
//!   resolver) in `dns_flows`, hints sk_lookup and delivers the datagram
//!   locally, where sk_lookup hands it to the proxy's UDP socket. The
//!   proxy answers from 127.0.0.1:15053 (::1) over `lo`; the `lo` program
//!   finds the query, rewrites the answer's source to the resolver's and
//!   forgets the query.
//! - TCP: the SYN is steered to the proxy's TCP listener like an outbound
//!   connection to 15001; the accepted socket already has the resolver's
//!   address as its own, so nothing is rewritten.
//!
//! Pass-through, never blackhole: a pod without a proxy socket (ztunnel run
//! without its DNS proxy) or not steering keeps resolving as if capture were
//! off — UDP leaves for the resolver, TCP is captured to 15001 (row D4).

use aya_ebpf::{
    bindings::{tcx_action_base::TCX_NEXT, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_SHOT},
    helpers::bpf_csum_diff,
    programs::TcContext,
};
use sluice_common::{
    DnsCounters, DnsFlow, DnsFlowKey, DropReason, HintVerdict, Role, DNS_QUERIES_PER_POD_PER_S,
    FAMILY_V4, MARK_MASK, MARK_ZTUNNEL, POD_FLAG_DNS_CAPTURE, PORT_DNS, PORT_DNS_PROXY,
};

use crate::{
    addr::is_loopback,
    budget,
    hints::{flow_key, put_charged_hint},
    maps::{count_dns, DNS_BUDGET, DNS_FLOWS, POD_STATE},
    origin::{from_its_pod, Sent},
    packet::{Tcp, Udp, IPV4_CHECK, IPV4_SADDR, IPV6_SADDR},
    tc::{listener_present, mark, netns_cookie, pod_flags, pod_of, redirect_to_self},
    verify::Writes,
};

/// Passed on to the next program on the hook (see capture.rs `TC_OK`).
const PASS: i32 = TCX_NEXT;
const DROP: i32 = TC_ACT_SHOT;

#[inline(always)]
pub fn dns_on(cookie: u64) -> bool {
    pod_flags(cookie) & POD_FLAG_DNS_CAPTURE != 0
}

/// The DNS message id: the first two bytes of the UDP payload.
#[inline(always)]
fn dns_id(ctx: &TcContext, u: &Udp) -> Option<u16> {
    ctx.load::<[u8; 2]>(u.l4 + Udp::PAYLOAD)
        .ok()
        .map(u16::from_be_bytes)
}

/// Egress on the pod's interface, UDP: a query to port 53 goes to the proxy
/// (row D1); ztunnel's own (mark 0x539) and anything else leave (D3, O5).
pub fn egress_udp<const L2: usize>(ctx: &TcContext, u: &Udp) -> i32 {
    if u.dport != PORT_DNS || mark(ctx) & MARK_MASK == MARK_ZTUNNEL {
        return PASS;
    }
    let w = Writes::of(ctx, u.sport);
    // The pod: its socket's netns, else (no cookies in tc) its source
    // address's. (Plain cookies, 0 for none: see capture.rs.)
    let by_socket = netns_cookie(ctx);
    let cookie = match by_socket {
        Some(c) => c,
        None => pod_of(u.family, &u.saddr).unwrap_or(0),
    };
    if cookie == 0 {
        // A captured interface, a source no pod has, no socket's netns to
        // tell the pod: as for a SYN, it does not leave around ztunnel.
        w.count_drop(DropReason::UnknownSource);
        return DROP;
    }
    if !dns_on(cookie) {
        return PASS;
    }
    // Another pod's source address: never that pod's query (its proxy
    // socket would take it, and its answer go to that pod's app).
    // Whose address the source is, when the socket named the pod; else it
    // is the pod's by the lookup above.
    let owner = match by_socket {
        Some(_) => pod_of(u.family, &u.saddr).unwrap_or(0),
        None => cookie,
    };
    let sent = Sent {
        by_its_socket: by_socket.is_some(),
        owner,
        family: u.family,
        saddr: u.saddr,
        sport: u.sport,
    };
    if !from_its_pod(ctx, cookie, || Role::DnsUdp, &sent) {
        w.count_drop(DropReason::UnknownSource);
        return DROP;
    }
    let steers = unsafe { POD_STATE.get(cookie) }.is_some_and(|p| p.steers());
    if !steers || !listener_present(cookie, Role::DnsUdp, u.family) {
        w.count_dns(cookie, |c: &mut DnsCounters| &mut c.passthrough);
        return PASS;
    }
    // Shorter than a DNS header: not a query the proxy could answer.
    let Some(id) = dns_id(ctx, u) else {
        return PASS;
    };
    let hint = flow_key(u.family, u.saddr, u.daddr, u.sport, u.dport);
    if w.verifying() {
        w.put_hint(ctx, cookie, &hint, HintVerdict::DnsUdp);
        return redirect_to_self::<L2>(ctx);
    }
    let Some(budget_window) = budget::take(&DNS_BUDGET, cookie, DNS_QUERIES_PER_POD_PER_S) else {
        w.count_drop(DropReason::DnsOverBudget);
        return DROP;
    };
    let key = DnsFlowKey::new(u.family, u.saddr, u.sport, id);
    let flow = DnsFlow {
        resolver_addr: u.daddr,
        netns_cookie: cookie,
        resolver_port: u.dport,
        _pad: 0,
        budget_window,
    };
    if DNS_FLOWS.insert(key, flow, 0).is_err() {
        w.count_dns(cookie, |c: &mut DnsCounters| &mut c.passthrough);
        return PASS;
    }
    // Paid from the pod's hint share, and given back when sk_lookup takes it:
    // a query dropped before its lookup (the pod's own raw-table rule, a
    // datagram too short for UDP) leaves its hint behind, as a SYN nothing
    // answers does.
    put_charged_hint(cookie, &hint, HintVerdict::DnsUdp, 0);
    redirect_to_self::<L2>(ctx)
}

/// Egress SYN of a steering pod: does it go to the DNS proxy (row D2)? A
/// pod with DNS capture but no proxy listener is counted and goes on to
/// 15001, as without DNS capture (row D4).
#[inline(always)]
pub fn captures_tcp(w: Writes, cookie: u64, t: &Tcp) -> bool {
    if t.dport != PORT_DNS || !dns_on(cookie) {
        return false;
    }
    if listener_present(cookie, Role::DnsTcp, t.family) {
        return true;
    }
    w.count_dns(cookie, |c: &mut DnsCounters| &mut c.passthrough);
    false
}

/// Ingress on the pod's `lo`, UDP: an answer of the proxy (from loopback
/// port 15053) to a query recorded in `dns_flows` leaves `lo` with the
/// resolver's address and port as its source, checksums updated. Everything
/// else passes untouched.
pub fn restore_answer(ctx: &TcContext, u: &Udp) -> i32 {
    if u.sport != PORT_DNS_PROXY || !is_loopback(u.family, &u.saddr) {
        return PASS;
    }
    let Some(id) = dns_id(ctx, u) else {
        return PASS;
    };
    // The answer goes to the querying socket: the query's source.
    let key = DnsFlowKey::new(u.family, u.daddr, u.dport, id);
    let Some(flow) = (unsafe { DNS_FLOWS.get(key) }).copied() else {
        if let Some(cookie) = pod_of(u.family, &u.daddr) {
            count_dns(cookie, |c: &mut DnsCounters| &mut c.replies_unmapped);
        }
        return PASS;
    };
    if rewrite_source(ctx, u, &flow).is_ok() {
        count_dns(flow.netns_cookie, |c: &mut DnsCounters| {
            &mut c.replies_restored
        });
        // Answered: the entry has served (a query sent again is recorded
        // again), so the node-wide map holds only queries in flight, not
        // every recent one of a pod that asks fast (issue 38, case 3).
        let _ = DNS_FLOWS.remove(key);
        // And its use of the pod's budget is given back, if taken in this
        // window: the budget bounds the pod's unanswered queries, not the
        // rate its proxy answers.
        budget::give_back_in(&DNS_BUDGET, flow.netns_cookie, flow.budget_window);
    }
    PASS
}

/// Source address and port := the resolver's, with the IPv4 header checksum
/// and the UDP checksum (whose pseudo-header holds the addresses) updated.
/// `MARK_MANGLED_0` keeps an IPv4 "no checksum" 0 as 0.
#[inline(always)]
fn rewrite_source(ctx: &TcContext, u: &Udp, flow: &DnsFlow) -> Result<(), i64> {
    let check = u.l4 + Udp::CHECK;
    let l4_flags = (BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0) as u64;
    if u.family == FAMILY_V4 {
        let (old, new) = (u.saddr[0], flow.resolver_addr[0]);
        ctx.l4_csum_replace(check, old as u64, new as u64, l4_flags | 4)?;
        ctx.l3_csum_replace(u.l3 + IPV4_CHECK, old as u64, new as u64, 4)?;
        ctx.store(u.l3 + IPV4_SADDR, &new, 0)?;
    } else {
        let mut old = u.saddr;
        let mut new = flow.resolver_addr;
        let diff = unsafe { bpf_csum_diff(old.as_mut_ptr(), 16, new.as_mut_ptr(), 16, 0) };
        if diff < 0 {
            return Err(diff);
        }
        ctx.l4_csum_replace(check, 0, diff as u64, l4_flags)?;
        ctx.store(u.l3 + IPV6_SADDR, &new, 0)?;
    }
    let (old_port, new_port) = (PORT_DNS_PROXY.to_be(), flow.resolver_port.to_be());
    ctx.l4_csum_replace(
        check,
        old_port as u64,
        new_port as u64,
        BPF_F_MARK_MANGLED_0 as u64 | 2,
    )?;
    ctx.store(u.l4, &new_port, 0)?;
    Ok(())
}

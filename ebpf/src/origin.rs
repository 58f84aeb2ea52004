//! Whose packet is it: a packet leaving a pod's interface must be the pod's
//! it names, not a neighbour's whose source address it carries (issue 38,
//! case 6).

use aya_ebpf::{helpers::bpf_sk_release, programs::TcContext};
use core::ffi::c_void;
use sluice_common::Role;

use crate::{
    lookup::{loopback, sk_lookup_udp, skc_lookup},
    tc::listener,
};

/// What the program knows of who sent a packet.
pub struct Sent {
    /// Its socket's netns is the pod the packet names (the kernel tells
    /// tc programs the netns: Linux ≥ 6.15).
    pub by_its_socket: bool,
    /// The pod (netns cookie) its source address belongs to; 0: none.
    pub owner: u64,
    pub family: u8,
    pub saddr: [u32; 4],
    pub sport: u16,
}

/// Whether a packet leaving an enrolled pod's interface that names pod
/// `cookie` (by its socket's netns, else by its source address) came from
/// that pod. Sent by that pod's socket: its source must not be another
/// pod's address. Otherwise (a kernel without netns cookies in tc, or a
/// packet without a socket: forwarded by the pod) the address named the
/// pod, and a pod with `NET_RAW` may have written a neighbour's: `cookie`'s
/// `role` listener must then be the one this interface's netns holds (a
/// socket lookup at loopback, where ztunnel's listeners answer; `role`
/// names it, asked only then). A pod without that listener fails closed
/// later on.
#[inline(always)]
pub fn from_its_pod(
    ctx: &TcContext,
    cookie: u64,
    role: impl FnOnce() -> Role,
    sent: &Sent,
) -> bool {
    if sent.by_its_socket {
        return sent.owner == 0 || sent.owner == cookie;
    }
    // Only here: which listener steers the packet costs map lookups.
    let role = role();
    let Some(registered) = listener(cookie, role, sent.family) else {
        return true;
    };
    let (family, saddr, sport, port) = (sent.family, &sent.saddr, sent.sport, role.port());
    let here = if role == Role::DnsUdp {
        sk_lookup_udp(ctx, family, saddr, &loopback(family), sport, port)
    } else {
        skc_lookup(ctx, family, saddr, &loopback(family), sport, port).map(|s| s as *mut c_void)
    };
    let same = here.is_some_and(|h| core::ptr::eq(h, registered));
    unsafe { bpf_sk_release(registered) };
    if let Some(h) = here {
        unsafe { bpf_sk_release(h) };
    }
    same
}

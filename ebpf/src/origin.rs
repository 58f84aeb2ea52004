//! Whose packet is it: a packet leaving a pod's interface must be the pod's
//! it names, not a neighbour's whose source address it carries (issue 38,
//! case 6).

use aya_ebpf::{helpers::bpf_sk_release, programs::TcContext};
use core::ffi::c_void;
use sluice_common::Role;

use crate::{
    lookup::{loopback, sk_lookup_udp, skc_lookup},
    tc::{listener, netns_cookie},
};

/// Whether a packet leaving an enrolled pod's interface that names pod
/// `cookie` (by its socket's netns, else by `owner`, its source address's
/// pod) came from that pod. When its socket's netns is the pod's, that pod
/// sent it: its source must not be another pod's address (`owner`).
/// Otherwise (a kernel without netns cookies in tc, or a packet without a
/// socket: forwarded by the pod) the address named the pod, and a pod with
/// `NET_RAW` may have written a neighbour's: `cookie`'s `role` listener must
/// then be the one this interface's netns holds (a socket lookup at
/// loopback, where ztunnel's listeners answer). A pod without that listener
/// fails closed later on.
#[inline(always)]
pub fn from_its_pod(
    ctx: &TcContext,
    cookie: u64,
    owner: Option<u64>,
    role: Role,
    family: u8,
    saddr: &[u32; 4],
    sport: u16,
) -> bool {
    if netns_cookie(ctx) == Some(cookie) {
        return owner.is_none_or(|o| o == cookie);
    }
    let Some(registered) = listener(cookie, role, family) else {
        return true;
    };
    let port = role.port();
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

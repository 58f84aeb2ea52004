//! What every tc program asks of a packet or does with one: its mark and
//! netns, the pod it belongs to, local delivery. (Hints for sk_lookup:
//! `hints`.)

use aya_ebpf::{
    bindings::{BPF_F_INGRESS, TC_ACT_SHOT},
    helpers::{bpf_get_netns_cookie, bpf_map_lookup_elem, bpf_redirect, bpf_sk_release},
    programs::TcContext,
    EbpfContext,
};
use core::ffi::c_void;
use sluice_common::{AddrKey, ListenerKey, Role, MARK_MASK, MARK_REDIRECT};

use crate::maps::{DNS_LISTENERS, LISTENERS, POD_ADDRS, POD_FLAGS};

#[inline(always)]
pub fn mark(ctx: &TcContext) -> u32 {
    unsafe { (*ctx.skb.skb).mark }
}

/// Sets the mesh bits of the mark to "deliver locally" (the policy route).
#[inline(always)]
pub fn mark_redirect(ctx: &TcContext) {
    ctx.set_mark((mark(ctx) & !MARK_MASK) | MARK_REDIRECT);
}

/// Whether tc programs may call `bpf_get_netns_cookie` (Linux ≥ 6.15). Set
/// by the loader from its probe before the programs are loaded; a read-only
/// global, so the verifier of an older kernel prunes the call it would
/// reject and never sees it.
#[no_mangle]
static NETNS_COOKIE_IN_TC: u8 = 1;

/// The netns of an outgoing packet's socket (which every SYN an app sends
/// has), by cookie; `None` on kernels whose tc programs cannot ask, where
/// callers find the pod by the packet's address instead.
#[inline(always)]
pub fn netns_cookie(ctx: &TcContext) -> Option<u64> {
    if unsafe { core::ptr::read_volatile(&NETNS_COOKIE_IN_TC) } == 0 {
        return None;
    }
    Some(unsafe { bpf_get_netns_cookie(ctx.as_ptr()) })
}

/// The pod an incoming packet is addressed to, if it is one of a pod's addresses.
#[inline(always)]
pub fn pod_of(family: u8, daddr: &[u32; 4]) -> Option<u64> {
    unsafe { POD_ADDRS.get(AddrKey::new(family, *daddr)) }.copied()
}

/// A pod's `POD_FLAG_*` bits (none without an entry).
#[inline(always)]
pub fn pod_flags(cookie: u64) -> u32 {
    unsafe { POD_FLAGS.get(cookie) }.copied().unwrap_or(0)
}

/// Re-injects the packet at the pod interface's ingress with the "deliver
/// locally" mark; the policy route (table 100) then makes it local. `L2`:
/// the interface's link-layer header length (`packet::L2_ETH` or
/// `packet::L2_NONE`).
#[inline(always)]
pub fn redirect_to_self<const L2: usize>(ctx: &TcContext) -> i32 {
    // Ethernet: destination MAC := source MAC (our own), or the frame
    // re-enters as PACKET_OTHERHOST and IP drops it. An L3 device's packet
    // has no MAC to fix (the kernel re-injects it as the host's).
    if L2 != crate::packet::L2_NONE {
        let Ok(src) = ctx.load::<[u8; 6]>(6) else {
            return TC_ACT_SHOT;
        };
        if ctx.store(0, &src, 0).is_err() {
            return TC_ACT_SHOT;
        }
    }
    mark_redirect(ctx);
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    unsafe { bpf_redirect(ifindex, BPF_F_INGRESS as u64) as i32 }
}

/// Is there a listener for this role in this pod? (Lookups on a socket map
/// return a referenced socket, released at once.)
#[inline(always)]
pub fn listener_present(cookie: u64, role: Role, family: u8) -> bool {
    let Some(sk) = listener(cookie, role, family) else {
        return false;
    };
    unsafe { bpf_sk_release(sk) };
    true
}

/// The pod's registered listener for this role, referenced (the caller
/// releases it).
#[inline(always)]
pub fn listener(cookie: u64, role: Role, family: u8) -> Option<*mut c_void> {
    let key = ListenerKey::new(cookie, role, family);
    let map = if role.is_dns() {
        &DNS_LISTENERS as *const _ as *mut c_void
    } else {
        &LISTENERS as *const _ as *mut c_void
    };
    let sk = unsafe { bpf_map_lookup_elem(map, &key as *const _ as *const c_void) };
    (!sk.is_null()).then_some(sk)
}

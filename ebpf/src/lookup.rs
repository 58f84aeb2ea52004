//! Socket lookups the tc programs make in the netns of the interface they
//! run on (`BPF_F_CURRENT_NETNS`): which socket a segment would reach, and
//! where ztunnel's listeners answer (loopback).

use aya_ebpf::{
    bindings::{bpf_sock_tuple, BPF_F_CURRENT_NETNS},
    helpers::{bpf_sk_lookup_udp, bpf_skc_lookup_tcp},
    programs::TcContext,
    EbpfContext,
};
use core::ffi::c_void;
use sluice_common::FAMILY_V4;

use crate::maps::{TC_LOOKUP, TC_LOOKUP_ASKING, TC_LOOKUP_REFUSED_STEERED};

/// The loopback address of `family`, as raw network-order words.
#[inline(always)]
pub fn loopback(family: u8) -> [u32; 4] {
    if family == FAMILY_V4 {
        [u32::from_ne_bytes([127, 0, 0, 1]), 0, 0, 0]
    } else {
        [0, 0, 0, u32::from_ne_bytes([0, 0, 0, 1])]
    }
}

/// The UDP socket of this netns a datagram from `saddr:sport` to
/// `daddr:dport` would reach, referenced (the caller releases it).
#[inline(always)]
pub fn sk_lookup_udp(
    ctx: &TcContext,
    family: u8,
    saddr: &[u32; 4],
    daddr: &[u32; 4],
    sport: u16,
    dport: u16,
) -> Option<*mut c_void> {
    let (mut tuple, size) = sock_tuple(family, saddr, daddr, sport, dport);
    let sk = unsafe {
        bpf_sk_lookup_udp(
            ctx.as_ptr(),
            &mut tuple,
            size as u32,
            BPF_F_CURRENT_NETNS as u64,
            0,
        )
    };
    (!sk.is_null()).then_some(sk as *mut c_void)
}

/// What a tc program's lookup found.
pub struct Found {
    pub sk: Option<*mut aya_ebpf::bindings::bpf_sock>,
    /// sk_lookup refused the flow though it had steered its SYN to ztunnel
    /// (the pod no longer steers, or the listener is gone): see
    /// [`TC_LOOKUP_REFUSED_STEERED`].
    pub refused_steered: bool,
}

/// The socket of this netns a packet from `saddr:sport` to `daddr:dport`
/// would be delivered to, referenced (the caller releases it).
#[inline(always)]
pub fn skc_lookup(
    ctx: &TcContext,
    family: u8,
    saddr: &[u32; 4],
    daddr: &[u32; 4],
    sport: u16,
    dport: u16,
) -> Option<*mut aya_ebpf::bindings::bpf_sock> {
    skc_lookup_found(ctx, family, saddr, daddr, sport, dport, TC_LOOKUP_ASKING).sk
}

/// [`skc_lookup`], also saying whether sk_lookup refused a steered flow;
/// `asking`: what `TC_LOOKUP` says meanwhile (`TC_LOOKUP_ASKING*`).
#[inline(always)]
pub fn skc_lookup_found(
    ctx: &TcContext,
    family: u8,
    saddr: &[u32; 4],
    daddr: &[u32; 4],
    sport: u16,
    dport: u16,
    asking_as: u32,
) -> Found {
    // sk_lookup runs inside this lookup: it is told who asks (TC_LOOKUP),
    // and says there whether it refused a steered flow.
    let asking = TC_LOOKUP.get_ptr_mut(0);
    let (mut tuple, size) = sock_tuple(family, saddr, daddr, sport, dport);
    if let Some(a) = asking {
        unsafe { *a = asking_as };
    }
    let sk = unsafe {
        bpf_skc_lookup_tcp(
            ctx.as_ptr(),
            &mut tuple,
            size as u32,
            BPF_F_CURRENT_NETNS as u64,
            0,
        )
    };
    let mut refused_steered = false;
    if let Some(a) = asking {
        refused_steered = unsafe { *a } == TC_LOOKUP_REFUSED_STEERED;
        unsafe { *a = 0 };
    }
    Found {
        sk: (!sk.is_null()).then_some(sk),
        refused_steered,
    }
}

/// A socket-lookup tuple and its size for `family`.
#[inline(always)]
fn sock_tuple(
    family: u8,
    saddr: &[u32; 4],
    daddr: &[u32; 4],
    sport: u16,
    dport: u16,
) -> (bpf_sock_tuple, usize) {
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    let size = if family == FAMILY_V4 {
        let v4 = unsafe { &mut tuple.__bindgen_anon_1.ipv4 };
        v4.saddr = saddr[0];
        v4.daddr = daddr[0];
        v4.sport = sport.to_be();
        v4.dport = dport.to_be();
        core::mem::size_of_val(v4)
    } else {
        let v6 = unsafe { &mut tuple.__bindgen_anon_1.ipv6 };
        v6.saddr = *saddr;
        v6.daddr = *daddr;
        v6.sport = sport.to_be();
        v6.dport = dport.to_be();
        core::mem::size_of_val(v6)
    };
    (tuple, size)
}

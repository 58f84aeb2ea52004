//! sluice's kernel programs. Loaded once per node, attached per pod netns:
//! - `sluice_steer`   (sk_lookup, netns link): assigns ztunnel's listeners;
//! - `sluice_egress`  (tcx egress, pod interface): captures outbound TCP and
//!   DNS queries;
//! - `sluice_ingress` (tcx ingress, pod interface): fails closed on inbound SYNs;
//! - `sluice_egress_l3`, `sluice_ingress_l3`: the same two for a pod
//!   interface without an Ethernet header (netkit in L3 mode, WireGuard, tun,
//!   IP tunnels), whose packets start with their IP header;
//! - `sluice_lo`      (tcx ingress, pod `lo`): marks in-pod connections as
//!   exempt; gives the DNS proxy's answers the resolver's address;
//! - `sluice_lo_out`  (tcx egress, pod `lo`, with `--local-route`): gives
//!   the app's SYNs that the local route sent over `lo` the verdict
//!   `sluice_egress` gives the others (see `local_route.rs`);
//! - `sluice_reroute` (tcx ingress, a pod's virtual interface, e.g. a VM's
//!   tap): the VM's TCP is the pod's outbound, captured to 15001;
//! - `sluice_host`    (tcx egress, the host side of a pod's veth, in the node
//!   netns): marks connections the node's own sockets open (kubelet's probes)
//!   as exempt.
//!
//! All inputs come from maps written by user space (see `maps.rs`).
#![no_std]
#![no_main]

mod addr;
mod budget;
mod capture;
mod dns;
mod exclusions;
mod hints;
mod local_route;
mod lookup;
mod maps;
mod origin;
mod packet;
mod steer;
mod tc;
mod verify;

use aya_ebpf::{
    macros::{classifier, sk_lookup},
    programs::{SkLookupContext, TcContext},
};

#[sk_lookup]
pub fn sluice_steer(ctx: SkLookupContext) -> u32 {
    // Never true (ports fit 16 bits): only makes the variant's instructions differ.
    #[cfg(feature = "upgrade-variant")]
    if unsafe { (*ctx.lookup).local_port } == u32::MAX {
        return aya_ebpf::bindings::sk_action::SK_PASS;
    }
    steer::steer(&ctx)
}

#[classifier]
pub fn sluice_egress(ctx: TcContext) -> i32 {
    #[cfg(feature = "upgrade-variant")]
    if ctx.len() == u32::MAX {
        return aya_ebpf::bindings::TC_ACT_OK;
    }
    capture::egress::<{ packet::L2_ETH }>(&ctx)
}

#[classifier]
pub fn sluice_egress_l3(ctx: TcContext) -> i32 {
    #[cfg(feature = "upgrade-variant")]
    if ctx.len() == u32::MAX {
        return aya_ebpf::bindings::TC_ACT_OK;
    }
    capture::egress::<{ packet::L2_NONE }>(&ctx)
}

#[classifier]
pub fn sluice_ingress(ctx: TcContext) -> i32 {
    #[cfg(feature = "upgrade-variant")]
    if ctx.len() == u32::MAX {
        return aya_ebpf::bindings::TC_ACT_OK;
    }
    capture::ingress::<{ packet::L2_ETH }>(&ctx)
}

#[classifier]
pub fn sluice_ingress_l3(ctx: TcContext) -> i32 {
    #[cfg(feature = "upgrade-variant")]
    if ctx.len() == u32::MAX {
        return aya_ebpf::bindings::TC_ACT_OK;
    }
    capture::ingress::<{ packet::L2_NONE }>(&ctx)
}

#[classifier]
pub fn sluice_lo(ctx: TcContext) -> i32 {
    #[cfg(feature = "upgrade-variant")]
    if ctx.len() == u32::MAX {
        return aya_ebpf::bindings::TC_ACT_OK;
    }
    capture::lo_ingress(&ctx)
}

#[classifier]
pub fn sluice_lo_out(ctx: TcContext) -> i32 {
    #[cfg(feature = "upgrade-variant")]
    if ctx.len() == u32::MAX {
        return aya_ebpf::bindings::TC_ACT_OK;
    }
    local_route::lo_egress(&ctx)
}

#[classifier]
pub fn sluice_reroute(ctx: TcContext) -> i32 {
    #[cfg(feature = "upgrade-variant")]
    if ctx.len() == u32::MAX {
        return aya_ebpf::bindings::TC_ACT_OK;
    }
    capture::reroute_ingress(&ctx)
}

#[classifier]
pub fn sluice_host(ctx: TcContext) -> i32 {
    #[cfg(feature = "upgrade-variant")]
    if ctx.len() == u32::MAX {
        return aya_ebpf::bindings::tcx_action_base::TCX_NEXT;
    }
    capture::host_egress(&ctx)
}

#[link_section = "license"]
#[no_mangle]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any path that could reach this.
    loop {}
}

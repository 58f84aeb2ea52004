//! Types and constants shared by sluice's kernel programs and user space.
//!
//! Everything here is `#[repr(C)]` plain old data: the same definition is the
//! layout of a map key or value on both sides of the kernel boundary. Every
//! port, mark and address that the dataplane depends on is defined once, here.
#![no_std]

/// ztunnel's in-pod listener for outbound traffic of the app.
pub const PORT_OUTBOUND: u16 = 15001;
/// ztunnel's in-pod listener for plaintext inbound traffic.
pub const PORT_INBOUND: u16 = 15006;
/// ztunnel's in-pod listener for inbound HBONE (mTLS tunnel) traffic.
pub const PORT_HBONE: u16 = 15008;
/// ztunnel's in-pod DNS proxy, on localhost (127.0.0.1 and ::1), TCP and UDP.
pub const PORT_DNS_PROXY: u16 = 15053;
/// The DNS port whose traffic DNS capture sends to [`PORT_DNS_PROXY`].
pub const PORT_DNS: u16 = 53;

/// Mark ztunnel sets (SO_MARK 1337) on every socket it owns: never captured.
pub const MARK_ZTUNNEL: u32 = 0x539;
/// Mark that makes a packet take the "deliver locally" policy route.
pub const MARK_REDIRECT: u32 = 0x111;
/// Only these bits of the packet mark belong to the mesh (Istio uses the same mask).
pub const MARK_MASK: u32 = 0xfff;
/// Mark of a pod's packet that leaves by its interface under the local
/// route (`--local-route`): an inbound SYN that reaches the app directly
/// (its request socket takes the mark, `tcp_fwmark_accept`, so its answers
/// skip the local route), or a packet of an uncaptured flow that `lo`'s
/// egress program sends out (the kernel's route lookup for it must skip
/// the local route too).
pub const MARK_DIRECT: u32 = 0x112;

/// Policy routing table holding `local default dev lo` inside the pod netns.
pub const ROUTE_TABLE: u32 = 100;
/// Priority of the `fwmark 0x111/0xfff lookup 100` rule (the one Istio uses).
pub const RULE_PRIORITY: u32 = 32764;
/// With `--local-route`: the table holding `local default dev lo src <pod
/// address>`, which the app's TCP takes (`iif lo ipproto tcp fwmark
/// 0/0xfff lookup 101`), so that a captured connection is routed over `lo`
/// (loopback's MSS) instead of the pod's interface.
pub const LOCAL_ROUTE_TABLE: u32 = 101;
/// Priority of the local route's rule: after the pod's exclusions' rules
/// (`LOCAL_ROUTE_PRIORITY - 1`, which send excluded flows to the main
/// table) and before Istio's.
pub const LOCAL_ROUTE_PRIORITY: u32 = 32763;

/// Source address kubelet health probes are SNATed to on the node (IPv4).
pub const PROBE_ADDR_V4: [u8; 4] = [169, 254, 7, 127];
/// Source address kubelet health probes are SNATed to on the node (IPv6).
pub const PROBE_ADDR_V6: [u8; 16] = [
    0xfd, 0x16, 0x92, 0x54, 0x71, 0x27, 0x13, 0x37, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
];

/// A TCP flow hint left by a tc program is honoured by sk_lookup this long
/// after its SYN. A connection's listener lookup normally runs once, on the
/// SYN's path, microseconds after the hint was written; with SYN cookies
/// (the listener's queue overflowed, or `tcp_syncookies=2`) it runs again
/// for the client's ACK (and, if that ACK is lost or the accept queue is
/// full, for its retransmitted data), one round trip and some RTOs later.
/// Every SYN writes its own verdict over an older hint of its tuple, so the
/// bound only decides how late a cookie continuation may come before it is
/// refused (reset, fail closed), never which connection a hint is for.
pub const FLOW_HINT_TTL_NS: u64 = 3_000_000_000;

/// `AF_INET` / `AF_INET6` as stored in map keys.
pub const FAMILY_V4: u8 = 2;
pub const FAMILY_V6: u8 = 10;

mod counters;
mod exclusions;
mod flow;
mod keys;
mod pod;
mod stamp;
mod verify;

pub use counters::*;
pub use exclusions::*;
pub use flow::*;
pub use keys::*;
pub use pod::*;
pub use stamp::*;
pub use verify::*;

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: all of these are repr(C), Copy, with explicit padding fields so
    // every byte is initialised.
    unsafe impl aya::Pod for PodEntry {}
    unsafe impl aya::Pod for ListenerKey {}
    unsafe impl aya::Pod for Counters {}
    unsafe impl aya::Pod for FlowKey {}
    unsafe impl aya::Pod for FlowHint {}
    unsafe impl aya::Pod for PodMeta {}
    unsafe impl aya::Pod for AddrKey {}
    unsafe impl aya::Pod for Stamp {}
    unsafe impl aya::Pod for DnsFlowKey {}
    unsafe impl aya::Pod for DnsFlow {}
    unsafe impl aya::Pod for Budget {}
    unsafe impl aya::Pod for DnsCounters {}
    unsafe impl aya::Pod for Exclusions {}
    unsafe impl aya::Pod for ExcludedCounters {}
}

#[cfg(test)]
mod tests;

//! Minimal, bounds-checked header parsing for the tc programs.
//!
//! Only what the programs decide on: address family, addresses, TCP ports and
//! flags, UDP ports and where the UDP header is (DNS capture rewrites it). IPv6 extension headers (an app may add them with setsockopt
//! IPV6_HOPOPTS/IPV6_DSTOPTS/IPV6_RTHDR) are walked, up to
//! [`MAX_EXT_HEADERS`]: a chain longer than that, or cut short, is
//! [`Parsed::Opaque`], which the egress program drops rather than let a TCP
//! segment it could not see leave uncaptured.

use aya_ebpf::programs::TcContext;
use sluice_common::{FAMILY_V4, FAMILY_V6};

/// The link-layer header before IP: Ethernet's (veth, lo, macvlan, ipvlan)
/// or none (an L3 device: netkit in L3 mode, WireGuard, tun, IP tunnels),
/// where the packet starts with its IP header and `skb->protocol` says which.
pub const L2_ETH: usize = 14;
pub const L2_NONE: usize = 0;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
/// Where the IPv4 header's checksum and source address sit in it.
pub const IPV4_CHECK: usize = 10;
pub const IPV4_SADDR: usize = 12;
/// Where the IPv6 header's source address sits in it.
pub const IPV6_SADDR: usize = 8;
const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_AH: u8 = 51;
const IPPROTO_DSTOPTS: u8 = 60;
/// The Linux stack adds at most hop-by-hop, destination (twice), routing and
/// fragment headers to what it sends; 6 covers it with room to spare.
pub const MAX_EXT_HEADERS: usize = 6;

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

/// A TCP segment's identity as the programs need it.
pub struct Tcp {
    pub family: u8,
    /// Raw network-order words; IPv4 uses word 0.
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    /// Host byte order.
    pub sport: u16,
    pub dport: u16,
    pub flags: u8,
}

impl Tcp {
    /// A connection request: SYN without ACK (also excludes RST/FIN oddities).
    #[inline(always)]
    pub fn is_syn(&self) -> bool {
        self.flags & (TCP_SYN | TCP_ACK | TCP_RST | TCP_FIN) == TCP_SYN
    }

    /// A reset (a closed port's answer to a SYN, among others).
    #[inline(always)]
    pub fn is_rst(&self) -> bool {
        self.flags & TCP_RST != 0
    }

    /// A listener's answer to a connection request: SYN and ACK.
    #[inline(always)]
    pub fn is_syn_ack(&self) -> bool {
        self.flags & (TCP_SYN | TCP_ACK | TCP_RST | TCP_FIN) == TCP_SYN | TCP_ACK
    }
}

/// A UDP datagram's identity, and where its IP and UDP headers start (from
/// the frame's first byte) for the programs that read or rewrite it.
pub struct Udp {
    pub family: u8,
    /// Raw network-order words; IPv4 uses word 0.
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    /// Host byte order.
    pub sport: u16,
    pub dport: u16,
    pub l3: usize,
    pub l4: usize,
}

impl Udp {
    /// Offset of the UDP checksum and of the payload's first byte.
    pub const CHECK: usize = 6;
    pub const PAYLOAD: usize = 8;
}

#[inline(always)]
fn ptr_at<T>(ctx: &TcContext, off: usize) -> Option<*const T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + off + core::mem::size_of::<T>() > end {
        return None;
    }
    Some((start + off) as *const T)
}

#[repr(C)]
struct Ipv4Hdr {
    ver_ihl: u8,
    tos: u8,
    tot_len: u16,
    id: u16,
    frag_off: u16,
    ttl: u8,
    protocol: u8,
    check: u16,
    saddr: u32,
    daddr: u32,
}

#[repr(C)]
struct Ipv6Hdr {
    ver_tc_flow: u32,
    payload_len: u16,
    nexthdr: u8,
    hop_limit: u8,
    saddr: [u32; 4],
    daddr: [u32; 4],
}

/// Source port, destination port and the flags byte: the first 14 bytes of TCP.
#[repr(C)]
struct TcpHead {
    sport: u16,
    dport: u16,
    seq: u32,
    ack: u32,
    off: u8,
    flags: u8,
}

/// What a frame is, as far as the programs care.
pub enum Parsed {
    Tcp(Tcp),
    Udp(Udp),
    /// Neither TCP nor UDP (or not the first fragment of a segment).
    Other,
    /// IPv6 whose extension-header chain could not be walked to its end.
    Opaque,
}

/// The first bytes of an IPv6 extension header.
#[repr(C)]
struct ExtHead {
    nexthdr: u8,
    len: u8,
}

/// Walks the IPv6 extension headers after the fixed header: the upper-layer
/// protocol and its offset, or `None` for a chain too long or cut short.
#[inline(always)]
fn ipv6_upper<const L2: usize>(ctx: &TcContext, first: u8) -> Option<(u8, usize)> {
    let mut next = first;
    let mut off = L2 + 40;
    for _ in 0..MAX_EXT_HEADERS {
        let len = match next {
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS => {
                let h = unsafe { &*ptr_at::<ExtHead>(ctx, off)? };
                next = h.nexthdr;
                (h.len as usize + 1) * 8
            }
            IPPROTO_AH => {
                let h = unsafe { &*ptr_at::<ExtHead>(ctx, off)? };
                next = h.nexthdr;
                (h.len as usize + 2) * 4
            }
            IPPROTO_FRAGMENT => {
                let h = unsafe { &*ptr_at::<[u8; 4]>(ctx, off)? };
                next = h[0];
                // A later fragment carries no upper-layer header.
                let frag_off = u16::from_be_bytes([h[2], h[3]]) & 0xfff8;
                if frag_off != 0 {
                    return Some((u8::MAX, 0));
                }
                8
            }
            upper => return Some((upper, off)),
        };
        off += len;
    }
    match next {
        IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_AH | IPPROTO_FRAGMENT => None,
        upper => Some((upper, off)),
    }
}

/// Parses a frame carrying TCP or UDP over IPv4 or IPv6, after a link-layer
/// header of `L2` bytes ([`L2_ETH`] or [`L2_NONE`]).
#[inline(always)]
pub fn parse<const L2: usize>(ctx: &TcContext) -> Parsed {
    let proto = if L2 == L2_NONE {
        // Network byte order in the low 16 bits.
        u16::from_be(unsafe { (*ctx.skb.skb).protocol } as u16)
    } else {
        let Some(proto) = ptr_at::<u16>(ctx, 12) else {
            return Parsed::Other;
        };
        u16::from_be(unsafe { *proto })
    };
    let (family, saddr, daddr, l4_proto, l4) = match proto {
        ETH_P_IP => {
            let Some(ip) = ptr_at::<Ipv4Hdr>(ctx, L2) else {
                return Parsed::Other;
            };
            let ip = unsafe { &*ip };
            // Only the first fragment carries the TCP or UDP header.
            let l4_known = ip.protocol == IPPROTO_TCP || ip.protocol == IPPROTO_UDP;
            if !l4_known || u16::from_be(ip.frag_off) & 0x1fff != 0 {
                return Parsed::Other;
            }
            let ihl = ((ip.ver_ihl & 0x0f) as usize) * 4;
            if ihl < 20 {
                return Parsed::Other;
            }
            (
                FAMILY_V4,
                [ip.saddr, 0, 0, 0],
                [ip.daddr, 0, 0, 0],
                ip.protocol,
                L2 + ihl,
            )
        }
        ETH_P_IPV6 => {
            let Some(ip) = ptr_at::<Ipv6Hdr>(ctx, L2) else {
                return Parsed::Other;
            };
            let ip = unsafe { &*ip };
            match ipv6_upper::<L2>(ctx, ip.nexthdr) {
                Some((IPPROTO_TCP, off)) => (FAMILY_V6, ip.saddr, ip.daddr, IPPROTO_TCP, off),
                Some((IPPROTO_UDP, off)) => (FAMILY_V6, ip.saddr, ip.daddr, IPPROTO_UDP, off),
                Some(_) => return Parsed::Other,
                None => return Parsed::Opaque,
            }
        }
        _ => return Parsed::Other,
    };
    if l4_proto == IPPROTO_UDP {
        // Ports only: the first 4 bytes of the UDP header.
        let Some(ports) = ptr_at::<[u16; 2]>(ctx, l4) else {
            return Parsed::Other;
        };
        let ports = unsafe { &*ports };
        return Parsed::Udp(Udp {
            family,
            saddr,
            daddr,
            sport: u16::from_be(ports[0]),
            dport: u16::from_be(ports[1]),
            l3: L2,
            l4,
        });
    }
    let Some(tcp) = ptr_at::<TcpHead>(ctx, l4) else {
        return Parsed::Opaque;
    };
    let tcp = unsafe { &*tcp };
    Parsed::Tcp(Tcp {
        family,
        saddr,
        daddr,
        sport: u16::from_be(tcp.sport),
        dport: u16::from_be(tcp.dport),
        flags: tcp.flags,
    })
}

/// [`parse`], for the programs that treat anything but TCP alike.
#[inline(always)]
pub fn parse_tcp<const L2: usize>(ctx: &TcContext) -> Option<Tcp> {
    match parse::<L2>(ctx) {
        Parsed::Tcp(t) => Some(t),
        _ => None,
    }
}

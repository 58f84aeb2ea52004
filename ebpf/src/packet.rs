//! Minimal, bounds-checked header parsing for the tc programs.
//!
//! Only what the programs decide on: address family, addresses, TCP ports and
//! flags. IPv6 extension headers are not walked: such packets read as non-TCP.

use aya_ebpf::programs::TcContext;
use sluice_common::{FAMILY_V4, FAMILY_V6};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;

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

/// Parses an Ethernet frame carrying TCP over IPv4 or IPv6; `None` otherwise.
#[inline(always)]
pub fn parse_tcp(ctx: &TcContext) -> Option<Tcp> {
    let proto: u16 = u16::from_be(unsafe { *ptr_at::<u16>(ctx, 12)? });
    let (family, saddr, daddr, l4) = match proto {
        ETH_P_IP => {
            let ip = ptr_at::<Ipv4Hdr>(ctx, ETH_HLEN)?;
            let ip = unsafe { &*ip };
            if ip.protocol != IPPROTO_TCP {
                return None;
            }
            let ihl = ((ip.ver_ihl & 0x0f) as usize) * 4;
            if ihl < 20 {
                return None;
            }
            (
                FAMILY_V4,
                [ip.saddr, 0, 0, 0],
                [ip.daddr, 0, 0, 0],
                ETH_HLEN + ihl,
            )
        }
        ETH_P_IPV6 => {
            let ip = ptr_at::<Ipv6Hdr>(ctx, ETH_HLEN)?;
            let ip = unsafe { &*ip };
            if ip.nexthdr != IPPROTO_TCP {
                return None;
            }
            (FAMILY_V6, ip.saddr, ip.daddr, ETH_HLEN + 40)
        }
        _ => return None,
    };
    let tcp = unsafe { &*ptr_at::<TcpHead>(ctx, l4)? };
    Some(Tcp {
        family,
        saddr,
        daddr,
        sport: u16::from_be(tcp.sport),
        dport: u16::from_be(tcp.dport),
        flags: tcp.flags,
    })
}

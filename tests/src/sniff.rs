//! Seeing which IPv6 packets really leave a namespace: an AF_PACKET socket in
//! the receiving netns, and a raw sender for packets no ordinary socket
//! makes (long extension-header chains).

use std::{
    mem::MaybeUninit,
    net::{Ipv6Addr, SocketAddr, SocketAddrV6},
};

use socket2::{Domain, Protocol, Socket, Type};

use crate::ns::run_in;

const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_DSTOPTS: u8 = 60;

/// One IPv6 packet as it arrived: its first next-header and source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub next_header: u8,
    pub src: Ipv6Addr,
    pub payload: Vec<u8>,
}

/// Every IPv6 frame arriving in a netns, from the moment it is made.
pub struct Sniffer(Socket);

impl Sniffer {
    pub fn start(netns: &str) -> std::io::Result<Self> {
        let s = run_in(netns, || {
            Socket::new(
                Domain::PACKET,
                Type::RAW,
                Some(Protocol::from(i32::from(ETH_P_IPV6.to_be()))),
            )
        })?;
        s.set_nonblocking(true)?;
        Ok(Self(s))
    }

    /// The frames received since the last call (without blocking).
    pub fn drain(&self) -> Vec<Seen> {
        let mut out = Vec::new();
        let mut buf = [MaybeUninit::<u8>::uninit(); 2048];
        while let Ok(n) = self.0.recv(&mut buf) {
            // SAFETY: recv initialised the first n bytes.
            let b: Vec<u8> = buf[..n]
                .iter()
                .map(|x| unsafe { x.assume_init() })
                .collect();
            // Ethernet (14) + IPv6 (40).
            if b.len() < 54 || u16::from_be_bytes([b[12], b[13]]) != ETH_P_IPV6 {
                continue;
            }
            let src: [u8; 16] = b[22..38].try_into().expect("16 bytes");
            out.push(Seen {
                next_header: b[20],
                src: src.into(),
                payload: b[54..].to_vec(),
            });
        }
        out
    }
}

/// Sends from netns `from` to `to` an IPv6 packet whose chain of `headers`
/// destination-options headers (8 bytes each, one PadN) ends in a TCP SYN
/// from port 40000 to `port`. Longer than the programs walk, it hides the
/// SYN from them.
pub fn send_dstopts_chain(
    from: &str,
    to: Ipv6Addr,
    port: u16,
    headers: usize,
) -> std::io::Result<()> {
    let mut p = Vec::new();
    for i in 0..headers {
        let next = if i + 1 == headers { 6 } else { IPPROTO_DSTOPTS };
        p.extend_from_slice(&[next, 0, 1, 4, 0, 0, 0, 0]);
    }
    // TCP: ports, seq, ack, data offset 5, SYN, window; checksum left 0.
    p.extend_from_slice(&40000u16.to_be_bytes());
    p.extend_from_slice(&port.to_be_bytes());
    p.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0]);
    let from = from.to_owned();
    run_in(&from, move || {
        let s = Socket::new(
            Domain::IPV6,
            Type::RAW,
            Some(Protocol::from(i32::from(IPPROTO_DSTOPTS))),
        )?;
        let dst = SocketAddr::V6(SocketAddrV6::new(to, 0, 0, 0));
        s.send_to(&p, &dst.into()).map(drop)
    })
}

const ETH_P_ALL: u16 = 0x0003;
const ETH_P_IP: u16 = 0x0800;

/// One TCP segment or UDP datagram as it crossed an interface of a netns
/// (IPv4, or IPv6 without extension headers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// 6 (TCP) or 17 (UDP).
    pub proto: u8,
    pub src: SocketAddr,
    pub dst: SocketAddr,
    /// TCP flags (0 for UDP).
    pub flags: u8,
    pub payload: Vec<u8>,
}

/// Every TCP and UDP packet crossing the interfaces of a netns, both ways,
/// from the moment it is made: what left a pod, whoever sent it.
pub struct L4Sniffer(Socket);

impl L4Sniffer {
    pub fn start(netns: &str) -> std::io::Result<Self> {
        let s = run_in(netns, || {
            Socket::new(
                Domain::PACKET,
                Type::RAW,
                Some(Protocol::from(i32::from(ETH_P_ALL.to_be()))),
            )
        })?;
        s.set_nonblocking(true)?;
        Ok(Self(s))
    }

    /// The packets seen since the last call (without blocking).
    pub fn drain(&self) -> Vec<Segment> {
        let mut out = Vec::new();
        let mut buf = [MaybeUninit::<u8>::uninit(); 2048];
        while let Ok(n) = self.0.recv(&mut buf) {
            // SAFETY: recv initialised the first n bytes.
            let b: Vec<u8> = buf[..n]
                .iter()
                .map(|x| unsafe { x.assume_init() })
                .collect();
            out.extend(segment(&b));
        }
        out
    }
}

/// The TCP or UDP packet in an Ethernet frame, if it is one.
fn segment(b: &[u8]) -> Option<Segment> {
    use std::net::{IpAddr, Ipv4Addr};
    let ethertype = u16::from_be_bytes([*b.get(12)?, *b.get(13)?]);
    let (proto, src, dst, l4) = match ethertype {
        ETH_P_IP => {
            let ihl = usize::from(b.get(14)? & 0x0f) * 4;
            let src: [u8; 4] = b.get(26..30)?.try_into().ok()?;
            let dst: [u8; 4] = b.get(30..34)?.try_into().ok()?;
            (
                *b.get(23)?,
                IpAddr::from(Ipv4Addr::from(src)),
                IpAddr::from(Ipv4Addr::from(dst)),
                14 + ihl,
            )
        }
        ETH_P_IPV6 => {
            let src: [u8; 16] = b.get(22..38)?.try_into().ok()?;
            let dst: [u8; 16] = b.get(38..54)?.try_into().ok()?;
            (
                *b.get(20)?,
                IpAddr::from(Ipv6Addr::from(src)),
                IpAddr::from(Ipv6Addr::from(dst)),
                54,
            )
        }
        _ => return None,
    };
    let port = |at: usize| Some(u16::from_be_bytes([*b.get(at)?, *b.get(at + 1)?]));
    let (sport, dport) = (port(l4)?, port(l4 + 2)?);
    let (flags, payload_at) = match proto {
        6 => (*b.get(l4 + 13)?, l4 + usize::from(b.get(l4 + 12)? >> 4) * 4),
        17 => (0, l4 + 8),
        _ => return None,
    };
    Some(Segment {
        proto,
        src: SocketAddr::new(src, sport),
        dst: SocketAddr::new(dst, dport),
        flags,
        payload: b.get(payload_at..).unwrap_or_default().to_vec(),
    })
}

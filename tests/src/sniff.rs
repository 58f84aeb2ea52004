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

//! The synthetic frames a verification runs the tc programs on: Ethernet,
//! then IPv4 or IPv6, then a TCP SYN or a UDP DNS query, from source port 0
//! (see `sluice_common::verify`). Remote ends are documentation addresses
//! (192.0.2.0/24, 2001:db8::/32), which no real peer has. And the lookups
//! sk_lookup is run on, and their flow-hint keys.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use sluice_common::{FlowKey, FAMILY_V4, FAMILY_V6};

use crate::dataplane::{state::addr_key, testrun::Lookup};

/// The remote end of the verification's connections, by family.
pub fn remote(v6: bool, port: u16) -> SocketAddr {
    let ip: IpAddr = if v6 {
        Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0x5115, 1).into()
    } else {
        Ipv4Addr::new(192, 0, 2, 115).into()
    };
    SocketAddr::new(ip, port)
}

const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;

/// A TCP SYN from `src` to `dst` (same family).
pub fn tcp_syn(src: SocketAddr, dst: SocketAddr) -> Vec<u8> {
    let mut tcp = [0u8; 20];
    tcp[0..2].copy_from_slice(&src.port().to_be_bytes());
    tcp[2..4].copy_from_slice(&dst.port().to_be_bytes());
    tcp[4..8].copy_from_slice(&1u32.to_be_bytes()); // sequence number
    tcp[12] = 5 << 4; // data offset: 5 words
    tcp[13] = 0x02; // SYN
    tcp[14..16].copy_from_slice(&u16::MAX.to_be_bytes()); // window
    frame(src.ip(), dst.ip(), IPPROTO_TCP, &tcp)
}

/// A UDP datagram from `src` to `dst` holding a DNS query header.
pub fn udp_dns(src: SocketAddr, dst: SocketAddr) -> Vec<u8> {
    let mut udp = [0u8; 8 + 12];
    udp[0..2].copy_from_slice(&src.port().to_be_bytes());
    udp[2..4].copy_from_slice(&dst.port().to_be_bytes());
    let len = udp.len() as u16;
    udp[4..6].copy_from_slice(&len.to_be_bytes());
    udp[8..10].copy_from_slice(&0x5115u16.to_be_bytes()); // DNS id
    udp[10] = 0x01; // recursion desired
    frame(src.ip(), dst.ip(), IPPROTO_UDP, &udp)
}

fn frame(src: IpAddr, dst: IpAddr, proto: u8, l4: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + 40 + l4.len());
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x01]); // destination MAC
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x02]); // source MAC
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            f.extend_from_slice(&0x0800u16.to_be_bytes());
            let mut ip = [0u8; 20];
            ip[0] = 0x45;
            ip[2..4].copy_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
            ip[6] = 0x40; // don't fragment
            ip[8] = 64;
            ip[9] = proto;
            ip[12..16].copy_from_slice(&s.octets());
            ip[16..20].copy_from_slice(&d.octets());
            let sum = checksum(&ip);
            ip[10..12].copy_from_slice(&sum.to_be_bytes());
            f.extend_from_slice(&ip);
        }
        _ => {
            let (s, d) = (v6_of(src), v6_of(dst));
            f.extend_from_slice(&0x86ddu16.to_be_bytes());
            let mut ip = [0u8; 40];
            ip[0] = 0x60;
            ip[4..6].copy_from_slice(&(l4.len() as u16).to_be_bytes());
            ip[6] = proto;
            ip[7] = 64;
            ip[8..24].copy_from_slice(&s.octets());
            ip[24..40].copy_from_slice(&d.octets());
            f.extend_from_slice(&ip);
        }
    }
    f.extend_from_slice(l4);
    f
}

fn v6_of(a: IpAddr) -> Ipv6Addr {
    match a {
        IpAddr::V6(a) => a,
        IpAddr::V4(a) => a.to_ipv6_mapped(),
    }
}

/// The Internet checksum of `bytes` (an IPv4 header with its checksum 0).
fn checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// A TCP listener lookup from `remote` to `local`.
pub fn tcp(remote: SocketAddr, local: SocketAddr) -> Lookup {
    Lookup {
        protocol: libc::IPPROTO_TCP as u8,
        remote,
        local,
    }
}

/// The flow-hint key of a lookup from `from` to `to`.
pub fn flow_key(from: SocketAddr, to: SocketAddr) -> FlowKey {
    let (r, l) = (addr_key(&from.ip()), addr_key(&to.ip()));
    FlowKey {
        remote_addr: r.addr,
        local_addr: l.addr,
        remote_port: from.port(),
        local_port: to.port(),
        family: if from.is_ipv4() { FAMILY_V4 } else { FAMILY_V6 },
        _pad: [0; 3],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_carry_their_ports_and_a_valid_ipv4_header() {
        let src = SocketAddr::new(Ipv4Addr::new(10, 0, 0, 2).into(), 0);
        let f = tcp_syn(src, remote(false, 80));
        assert_eq!(f.len(), 14 + 20 + 20);
        assert_eq!(&f[12..14], &[0x08, 0x00]);
        // A header with its checksum sums to 0xffff: complemented, 0.
        assert_eq!(checksum(&f[14..34]), 0);
        assert_eq!(&f[34..36], &[0, 0]);
        assert_eq!(&f[36..38], &80u16.to_be_bytes());
        assert_eq!(f[47], 0x02);
        let g = udp_dns(remote(true, 0), SocketAddr::new(remote(true, 0).ip(), 53));
        assert_eq!(g.len(), 14 + 40 + 20);
        assert_eq!(g[14 + 6], IPPROTO_UDP);
    }
}

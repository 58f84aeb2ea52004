//! The listener map's roles and key, and the node-wide pod-address key.

use crate::{PORT_DNS_PROXY, PORT_HBONE, PORT_INBOUND, PORT_OUTBOUND};

/// Which of ztunnel's in-pod listeners a connection is steered to.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Outbound = 1,
    Inbound = 2,
    Hbone = 3,
    /// ztunnel's DNS proxy, TCP (DNS capture only; not needed to steer).
    DnsTcp = 4,
    /// ztunnel's DNS proxy, UDP (DNS capture only; not needed to steer).
    DnsUdp = 5,
}

impl Role {
    /// The listeners every enrolled pod needs before it steers.
    pub const ALL: [Role; 3] = [Role::Outbound, Role::Inbound, Role::Hbone];
    /// The DNS proxy's sockets: optional (ztunnel may run without DNS proxy).
    pub const DNS: [Role; 2] = [Role::DnsTcp, Role::DnsUdp];

    pub const fn port(self) -> u16 {
        match self {
            Self::Outbound => PORT_OUTBOUND,
            Self::Inbound => PORT_INBOUND,
            Self::Hbone => PORT_HBONE,
            Self::DnsTcp | Self::DnsUdp => PORT_DNS_PROXY,
        }
    }

    pub const fn is_dns(self) -> bool {
        matches!(self, Self::DnsTcp | Self::DnsUdp)
    }

    pub const fn from_port(port: u16) -> Option<Self> {
        match port {
            PORT_OUTBOUND => Some(Self::Outbound),
            PORT_INBOUND => Some(Self::Inbound),
            PORT_HBONE => Some(Self::Hbone),
            _ => None,
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Outbound => "outbound",
            Self::Inbound => "inbound",
            Self::Hbone => "hbone",
            Self::DnsTcp => "dns-tcp",
            Self::DnsUdp => "dns-udp",
        }
    }
}

/// Key of the listener socket map: one socket per pod, role and address family.
///
/// A dual-stack `[::]` listener is registered under both families, so one
/// socket serves IPv4 and IPv6 lookups, exactly as it does without capture.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ListenerKey {
    pub netns_cookie: u64,
    pub role: u8,
    pub family: u8,
    pub _pad: [u8; 6],
}

impl ListenerKey {
    pub const fn new(netns_cookie: u64, role: Role, family: u8) -> Self {
        Self {
            netns_cookie,
            role: role as u8,
            family,
            _pad: [0; 6],
        }
    }

    /// A key of ztunnel's DNS proxy sockets (the `dns_listeners` map).
    pub const fn is_dns(&self) -> bool {
        self.role == Role::DnsTcp as u8 || self.role == Role::DnsUdp as u8
    }
}

/// Key of the pod-address map: one of a pod's addresses. Ingress packets
/// carry no socket, and bpf_get_netns_cookie() in tc answers from the packet's
/// socket, so the ingress programs find the pod by destination address.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AddrKey {
    pub family: u8,
    pub _pad: [u8; 3],
    /// Raw network-order words; IPv4 uses word 0 only.
    pub addr: [u32; 4],
}

impl AddrKey {
    pub const fn new(family: u8, addr: [u32; 4]) -> Self {
        Self {
            family,
            _pad: [0; 3],
            addr,
        }
    }
}

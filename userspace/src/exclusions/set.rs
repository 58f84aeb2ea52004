//! A pod's exclusions as parsed from its annotations, and their
//! `pod_exclusions` map value.

use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use sluice_common::{
    Exclusions, IpRange, EXCLUSIONS_MAX, EXCL_IN_INCLUDE, EXCL_OUT_INCLUDE, FAMILY_V4, FAMILY_V6,
    PORT_DNS, PROBE_ADDR_V4, PROBE_ADDR_V6,
};

pub const EXCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeOutboundPorts";
pub const EXCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
pub const INCLUDE_OUTBOUND_IP_RANGES: &str = "traffic.sidecar.istio.io/includeOutboundIPRanges";
pub const INCLUDE_OUTBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeOutboundPorts";
pub const EXCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/excludeInboundPorts";
pub const INCLUDE_INBOUND_PORTS: &str = "traffic.sidecar.istio.io/includeInboundPorts";
/// The six, in the order `status` lists them (the one read last came
/// last: the fuzz corpus names them by position).
pub const ANNOTATIONS: [&str; 6] = [
    EXCLUDE_OUTBOUND_PORTS,
    EXCLUDE_OUTBOUND_IP_RANGES,
    INCLUDE_OUTBOUND_IP_RANGES,
    EXCLUDE_INBOUND_PORTS,
    INCLUDE_INBOUND_PORTS,
    INCLUDE_OUTBOUND_PORTS,
];

/// An include list: `*` (everything, as without the annotation) or only
/// what it names (possibly nothing).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Include<T> {
    #[default]
    All,
    Only(Vec<T>),
}

impl<T> Include<T> {
    fn listed(&self) -> &[T] {
        match self {
            Self::All => &[],
            Self::Only(v) => v,
        }
    }
}

/// A pod's exclusions as parsed (each list sorted, without repeats).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct PodExclusions {
    pub exclude_outbound_ports: Vec<u16>,
    pub exclude_outbound_ip_ranges: Vec<IpNet>,
    pub include_outbound_ip_ranges: Include<IpNet>,
    /// Captured whatever `include_outbound_ip_ranges` says (an excluded
    /// port or range still wins); with `*` ranges, everything already is.
    pub include_outbound_ports: Vec<u16>,
    pub exclude_inbound_ports: Vec<u16>,
    pub include_inbound_ports: Include<u16>,
}

impl PodExclusions {
    /// Nothing excluded: the pod is captured fully.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Whether the pod's DNS stays out of capture: port 53 is excluded
    /// (address ranges never take DNS out of capture).
    pub fn excludes_dns(&self) -> bool {
        self.exclude_outbound_ports.contains(&PORT_DNS)
    }

    /// Ports over all lists.
    pub fn ports(&self) -> usize {
        self.exclude_outbound_ports.len()
            + self.include_outbound_ports.len()
            + self.exclude_inbound_ports.len()
            + self.include_inbound_ports.listed().len()
    }

    /// Address ranges over all lists.
    pub fn ranges(&self) -> usize {
        self.exclude_outbound_ip_ranges.len() + self.include_outbound_ip_ranges.listed().len()
    }

    /// The `pod_exclusions` value. Callers hold a parsed value, whose
    /// counts [`parse`](super::parse) bounded by `EXCLUSIONS_MAX`.
    pub fn to_value(&self) -> Exclusions {
        fn fill<T: Copy>(into: &mut [T; EXCLUSIONS_MAX], from: &[T]) -> u8 {
            let n = from.len().min(EXCLUSIONS_MAX);
            into[..n].copy_from_slice(&from[..n]);
            n as u8
        }
        let mut x = Exclusions::EMPTY;
        x.n_out_ports = fill(&mut x.out_ports, &self.exclude_outbound_ports);
        // From the far end of the same array (see `Exclusions`): the
        // counts bound both lists together by EXCLUSIONS_MAX.
        let room = EXCLUSIONS_MAX - x.n_out_ports as usize;
        let included: Vec<u16> = self
            .include_outbound_ports
            .iter()
            .take(room)
            .copied()
            .collect();
        for (i, p) in included.iter().enumerate() {
            x.out_ports[EXCLUSIONS_MAX - 1 - i] = *p;
        }
        x.n_out_included_ports = included.len() as u8;
        x.n_in_ports = fill(&mut x.in_ports, &self.exclude_inbound_ports);
        x.n_in_included = fill(&mut x.in_included, self.include_inbound_ports.listed());
        let ranges = |v: &[IpNet]| v.iter().map(range_of).collect::<Vec<_>>();
        x.n_out_ranges = fill(&mut x.out_ranges, &ranges(&self.exclude_outbound_ip_ranges));
        x.n_out_included = fill(
            &mut x.out_included,
            &ranges(self.include_outbound_ip_ranges.listed()),
        );
        if matches!(self.include_outbound_ip_ranges, Include::Only(_)) {
            x.flags |= EXCL_OUT_INCLUDE;
        }
        if matches!(self.include_inbound_ports, Include::Only(_)) {
            x.flags |= EXCL_IN_INCLUDE;
        }
        x
    }

    /// Back from a `pod_exclusions` value (what `status` shows: what the
    /// programs hold, not what the annotations say).
    pub fn from_value(x: &Exclusions) -> Self {
        let ports =
            |v: &[u16; EXCLUSIONS_MAX], n: u8| v[..(n as usize).min(EXCLUSIONS_MAX)].to_vec();
        let nets = |v: &[IpRange; EXCLUSIONS_MAX], n: u8| {
            v[..(n as usize).min(EXCLUSIONS_MAX)]
                .iter()
                .filter_map(net_of)
                .collect::<Vec<_>>()
        };
        Self {
            exclude_outbound_ports: ports(&x.out_ports, x.n_out_ports),
            exclude_outbound_ip_ranges: nets(&x.out_ranges, x.n_out_ranges),
            include_outbound_ip_ranges: if x.flags & EXCL_OUT_INCLUDE != 0 {
                Include::Only(nets(&x.out_included, x.n_out_included))
            } else {
                Include::All
            },
            include_outbound_ports: {
                let n = (x.n_out_included_ports as usize).min(EXCLUSIONS_MAX);
                let mut v: Vec<u16> = (0..n)
                    .map(|i| x.out_ports[EXCLUSIONS_MAX - 1 - i])
                    .collect();
                v.sort_unstable();
                v
            },
            exclude_inbound_ports: ports(&x.in_ports, x.n_in_ports),
            include_inbound_ports: if x.flags & EXCL_IN_INCLUDE != 0 {
                Include::Only(ports(&x.in_included, x.n_in_included))
            } else {
                Include::All
            },
        }
    }

    /// A port whose inbound connections are captured: `preferred` when it
    /// is, else the first that is; `None` when none is (what a
    /// verification runs: see `podnet::verify`).
    pub fn captured_inbound_port(&self, preferred: u16) -> Option<u16> {
        let x = self.to_value();
        let listed = self.include_inbound_ports.listed().iter().copied();
        std::iter::once(preferred)
            .chain(listed)
            .chain(1..=u16::MAX)
            .take(EXCLUSIONS_MAX * 2 + 2)
            .find(|p| !x.excludes_inbound(*p))
    }

    /// A destination of the same family as `preferred` whose outbound
    /// connections are captured: `preferred` when they are, else one in an
    /// included range or on an included port, not excluded; `None` when
    /// there is none.
    pub fn captured_outbound(&self, preferred: SocketAddr) -> Option<SocketAddr> {
        let x = self.to_value();
        let v6 = preferred.is_ipv6();
        let included = self.include_outbound_ip_ranges.listed().iter();
        // Loopback and the probe address are never captured, whatever the
        // lists say: a destination there would fail the verification.
        let capturable = |a: &IpAddr| {
            !a.is_loopback()
                && *a != IpAddr::from(PROBE_ADDR_V4)
                && *a != IpAddr::from(PROBE_ADDR_V6)
        };
        let addrs: Vec<IpAddr> = std::iter::once(preferred.ip())
            .chain(
                included
                    .filter(|n| n.addr().is_ipv6() == v6)
                    .flat_map(|n| [n.network(), n.broadcast()]),
            )
            .filter(capturable)
            .collect();
        let unexcluded = std::iter::once(preferred.port())
            .chain(1..=u16::MAX)
            .find(|p| *p != PORT_DNS && !self.exclude_outbound_ports.contains(p));
        // Not 53: with DNS capture on, TCP there goes to the DNS proxy, not
        // to 15001, whatever the lists say.
        let ports: Vec<u16> = std::iter::once(preferred.port())
            .chain(self.include_outbound_ports.iter().copied())
            .chain(unexcluded)
            .filter(|p| *p != PORT_DNS)
            .collect();
        addrs
            .iter()
            .flat_map(|a| ports.iter().map(|p| SocketAddr::new(*a, *p)))
            .find(|d| !x.excludes_outbound(family(d.ip()), &words(d.ip()), d.port()))
    }

    /// One `annotation: value` line per list that is in force, in the
    /// annotations' own syntax.
    pub fn lines(&self) -> Vec<(&'static str, String)> {
        let ports = |v: &[u16]| v.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
        let nets = |v: &[IpNet]| v.iter().map(IpNet::to_string).collect::<Vec<_>>().join(",");
        let mut out = Vec::new();
        if !self.exclude_outbound_ports.is_empty() {
            out.push((EXCLUDE_OUTBOUND_PORTS, ports(&self.exclude_outbound_ports)));
        }
        if !self.exclude_outbound_ip_ranges.is_empty() {
            out.push((
                EXCLUDE_OUTBOUND_IP_RANGES,
                nets(&self.exclude_outbound_ip_ranges),
            ));
        }
        if let Include::Only(v) = &self.include_outbound_ip_ranges {
            out.push((INCLUDE_OUTBOUND_IP_RANGES, nets(v)));
        }
        if !self.exclude_inbound_ports.is_empty() {
            out.push((EXCLUDE_INBOUND_PORTS, ports(&self.exclude_inbound_ports)));
        }
        if let Include::Only(v) = &self.include_inbound_ports {
            out.push((INCLUDE_INBOUND_PORTS, ports(v)));
        }
        if !self.include_outbound_ports.is_empty() {
            out.push((INCLUDE_OUTBOUND_PORTS, ports(&self.include_outbound_ports)));
        }
        out
    }
}

/// Raw network-order words, the way the programs hold an address.
pub(super) fn words(ip: IpAddr) -> [u32; 4] {
    let bytes: Vec<u8> = match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    let mut w = [0u32; 4];
    for (i, c) in bytes.chunks(4).enumerate() {
        w[i] = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
    }
    w
}

fn family(ip: IpAddr) -> u8 {
    if ip.is_ipv4() {
        FAMILY_V4
    } else {
        FAMILY_V6
    }
}

fn range_of(net: &IpNet) -> IpRange {
    let net = net.trunc();
    IpRange {
        addr: words(net.network()),
        mask: words(net.netmask()),
        family: family(net.addr()),
        _pad: [0; 3],
    }
}

fn net_of(r: &IpRange) -> Option<IpNet> {
    let bytes: Vec<u8> = r.addr.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let prefix: u32 = r.mask.iter().map(|w| w.count_ones()).sum();
    let ip = match r.family {
        FAMILY_V4 => IpAddr::from(<[u8; 4]>::try_from(&bytes[..4]).ok()?),
        FAMILY_V6 => IpAddr::from(<[u8; 16]>::try_from(&bytes[..]).ok()?),
        _ => return None,
    };
    IpNet::new(ip, prefix as u8).ok()
}

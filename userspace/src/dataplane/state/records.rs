//! One enrolled pod as `status` reports it, read from the maps (never from
//! process memory).

use std::net::IpAddr;

use serde::Serialize;
use sluice_common::{Counters, DnsCounters, ListenerKey, PodState, Role, FAMILY_V4};

use crate::{options::DnsChoice, workload::Workload};

/// One enrolled pod, as the maps describe it.
#[derive(Debug, Clone, Serialize)]
pub struct PodRecord {
    pub uid: String,
    pub netns: String,
    pub workload: Option<Workload>,
    pub netns_cookie: u64,
    /// `None` when the map holds a state this build does not know (`null`
    /// in JSON; the state's name otherwise).
    pub state: Option<PodState>,
    /// ztunnel knows the pod's workload (state `Served`): fully enrolled.
    pub served: bool,
    pub generation: u32,
    pub enrolled_at_ns: u64,
    pub changed_at_ns: u64,
    /// Registered listeners as "role/family", e.g. "inbound/ipv4".
    pub listeners: Vec<String>,
    pub counters: Counters,
    /// DNS capture: the pod's choice, whether it is on, and its counters.
    pub dns: DnsView,
    /// `ambient.istio.io/bypass-inbound-capture`: inbound not captured.
    pub bypass_inbound: bool,
    /// `istio.io/reroute-virtual-interfaces`: interfaces whose TCP is the
    /// pod's outbound.
    pub reroute: Vec<String>,
    /// Its TCP takes the local route (`--local-route`): captured
    /// connections run over `lo`, by the interface of this index otherwise.
    pub local_route: Option<u32>,
    /// The exclusions in force (`traffic.sidecar.istio.io/*`, as the node's
    /// policy applied them): what the programs hold.
    pub exclusions: crate::exclusions::PodExclusions,
    /// Connections those exclusions kept out of capture.
    pub excluded: sluice_common::ExcludedCounters,
    /// The pod's addresses in the node-wide address map (what inbound
    /// capture and the address-theft guard know the pod by).
    pub addresses: Vec<IpAddr>,
    /// The pod's pinned links (`steer`, `egress_eth0`, `lo`, `host_eth0`…),
    /// from the bpffs (filled by `status::read`; empty from the maps alone).
    pub links: Vec<String>,
}

/// A pod's DNS capture as `status` shows it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct DnsView {
    /// `captured` (on, and ztunnel's DNS proxy has sockets in the pod),
    /// `pass-through` (on, but no proxy socket: queries go to the resolver
    /// uncaptured), or `off`.
    pub mode: DnsMode,
    /// Who decided: `node-default` (`--dns-capture`), or the pod's
    /// annotations (`on`, `off`).
    pub choice: DnsChoice,
    pub captured_udp: u64,
    pub captured_tcp: u64,
    pub passthrough: u64,
    pub replies_restored: u64,
    pub replies_unmapped: u64,
}

impl DnsView {
    pub fn new(mode: DnsMode, choice: DnsChoice, c: &DnsCounters) -> Self {
        Self {
            mode,
            choice,
            captured_udp: c.captured_udp,
            captured_tcp: c.captured_tcp,
            passthrough: c.passthrough,
            replies_restored: c.replies_restored,
            replies_unmapped: c.replies_unmapped,
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum DnsMode {
    Captured,
    PassThrough,
    Off,
}

impl DnsMode {
    /// Whether the programs capture the pod's DNS (`on`) and whether its
    /// proxy has a socket to send it to.
    pub fn of(on: bool, has_proxy: bool) -> Self {
        match (on, has_proxy) {
            (false, _) => DnsMode::Off,
            (true, true) => DnsMode::Captured,
            (true, false) => DnsMode::PassThrough,
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Captured => "captured",
            Self::PassThrough => "pass-through",
            Self::Off => "off",
        }
    }
}

/// Registered listeners as "role/family", sorted.
pub fn listener_names(keys: &[ListenerKey]) -> Vec<String> {
    let mut names: Vec<String> = keys
        .iter()
        .map(|k| {
            let role = Role::ALL
                .into_iter()
                .chain(Role::DNS)
                .find(|r| *r as u8 == k.role)
                .map_or("unknown", Role::as_str);
            let fam = if k.family == FAMILY_V4 {
                "ipv4"
            } else {
                "ipv6"
            };
            format!("{role}/{fam}")
        })
        .collect();
    names.sort();
    names
}

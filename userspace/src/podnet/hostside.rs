//! The host side of a pod's interfaces: the node's netns, and the veth peer of
//! each pod interface in it. A tc program on that peer's egress sees which
//! SYNs a socket of the node itself sent (kubelet's probes) — the one place
//! where that origin is still visible — and exempts them from capture.
//!
//! A peer counts only when both ends agree: the pod interface's link (index
//! and netns id) names the node's interface, and that interface's link names
//! the pod's back. An interface with no such peer (no veth, or a peer in
//! another netns) gets no host-side link; its pod keeps the address-only
//! probe exemption (169.254.7.127).

use std::{
    collections::HashMap,
    os::fd::AsRawFd,
    path::Path,
    sync::{Arc, Mutex},
};

use crate::{
    podnet::netns::{Netns, NetnsError},
    podnet::rtnl::Rtnl,
};
use aya::maps::{Array, MapData};
use netlink_packet_route::{
    link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage},
    nsid::{NsidAttribute, NsidMessage},
    RouteNetlinkMessage,
};

/// Name of the map holding the node's netns cookie.
pub const NODE_MAP: &str = "node_netns";

#[derive(Debug, thiserror::Error)]
pub enum HostSideError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("rtnetlink {what}: {source}")]
    Netlink {
        what: &'static str,
        source: std::io::Error,
    },
    #[error(
        "the pinned dataplane predates the host-side program (an agent of this build loads it)"
    )]
    NoProgram,
    #[error("writing the node netns cookie to {path}: {reason}")]
    Map { path: String, reason: String },
}

/// The node's network namespace: where host processes (kubelet) live and
/// the host side of pods' interfaces is.
#[derive(Debug)]
pub struct Node {
    pub netns: Netns,
    pub cookie: u64,
    /// An rtnetlink socket in the node netns, made once: host-side lookups
    /// and filters go over it without entering the netns.
    pub nl: Rtnl,
    /// Which pod each host-side veth belongs to, for the node's tc watch.
    pub peers: HostIndex,
}

impl Node {
    /// Opens the node netns at `path` (for the agent: its own, as a
    /// hostNetwork pod; tests pass a netns that plays the node).
    pub fn open(path: &Path) -> Result<Self, HostSideError> {
        let netns = Netns::open(path)?;
        let cookie = netns.cookie()?;
        let nl = netns.run(open)??;
        Ok(Self {
            netns,
            cookie,
            nl,
            peers: HostIndex::default(),
        })
    }

    /// Tells the host-side program which netns is the node's.
    pub fn publish(&self, maps_dir: &Path) -> Result<(), HostSideError> {
        let path = maps_dir.join(NODE_MAP);
        let err = |reason: String| HostSideError::Map {
            path: path.display().to_string(),
            reason,
        };
        let data = MapData::from_pin(&path).map_err(|e| err(e.to_string()))?;
        let mut map: Array<MapData, u64> =
            Array::try_from(aya::maps::Map::Array(data)).map_err(|e| err(e.to_string()))?;
        map.set(0, self.cookie, 0).map_err(|e| err(e.to_string()))
    }
}

/// The node-side peer of one pod interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPeer {
    pub pod_iface: String,
    /// The peer's name and index in the node netns.
    pub host_iface: String,
    pub host_index: u32,
}

/// The pod (netns cookie) each host-side veth (node ifindex) belongs to, as
/// the last enrollment or repair of that pod found it: what turns a tc event
/// in the node netns into the pod to verify. Shared (cloned) with the watch,
/// so that reading it never waits for the dataplane's lock. An index
/// reused by another pod is overwritten by that pod's enrollment; entries of
/// pods gone are pruned by the periodic verification (until then an event
/// on their index verifies a pod that is not enrolled: nothing).
#[derive(Debug, Clone, Default)]
pub struct HostIndex(Arc<Mutex<HashMap<u32, u64>>>);

impl HostIndex {
    /// Records that `peers` are pod `cookie`'s.
    pub fn record(&self, cookie: u64, peers: &[HostPeer]) {
        let mut m = self.0.lock().unwrap();
        for p in peers {
            m.insert(p.host_index, cookie);
        }
    }

    /// The pod whose host-side veth has index `index`.
    pub fn pod_of(&self, index: u32) -> Option<u64> {
        self.0.lock().unwrap().get(&index).copied()
    }

    /// Every pod with a recorded host-side veth.
    pub fn pods(&self) -> std::collections::BTreeSet<u64> {
        self.0.lock().unwrap().values().copied().collect()
    }

    /// Keeps only the entries of pods for which `keep` holds.
    pub fn retain(&self, keep: impl Fn(u64) -> bool) {
        self.0.lock().unwrap().retain(|_, c| keep(*c));
    }
}

/// One interface as rtnetlink describes it.
#[derive(Debug, Clone, Default)]
struct Link {
    index: u32,
    name: String,
    veth: bool,
    /// IFLA_LINK: the peer's index (in the peer's netns).
    peer_index: Option<u32>,
    /// IFLA_LINK_NETNSID: the peer's netns, as this netns numbers it.
    peer_nsid: Option<i32>,
}

impl Link {
    fn from_message(m: &LinkMessage) -> Self {
        let mut l = Link {
            index: m.header.index,
            ..Link::default()
        };
        for a in &m.attributes {
            match a {
                LinkAttribute::IfName(n) => l.name = n.clone(),
                LinkAttribute::Link(i) => l.peer_index = Some(*i),
                LinkAttribute::LinkNetNsId(id) => l.peer_nsid = Some(*id),
                LinkAttribute::LinkInfo(infos) => {
                    l.veth = infos
                        .iter()
                        .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth)));
                }
                _ => {}
            }
        }
        l
    }
}

/// The node-side peers of the pod's interfaces `ifaces` that have one.
pub fn peers(pod: &Netns, node: &Node, ifaces: &[String]) -> Result<Vec<HostPeer>, HostSideError> {
    // Seen from the pod: each interface, and the id it gives the node netns.
    let node_fd = raw_fd(&node.netns);
    let (links, node_id) = pod.run(|| -> Result<_, HostSideError> {
        let nl = open()?;
        let mut links = Vec::new();
        for i in ifaces {
            if let Some(l) = link_by_name(&nl, i)? {
                links.push(l);
            }
        }
        Ok((links, nsid_of(&nl, node_fd)?))
    })??;
    peers_of(pod, node, links, node_id)
}

/// [`peers`] from what a pod's link dump (`links`, over `pod_nl`, a socket
/// in the pod netns) said: no visit of either netns.
pub fn peers_over(
    pod: &Netns,
    pod_nl: &Rtnl,
    links: &[LinkMessage],
    node: &Node,
) -> Result<Vec<HostPeer>, HostSideError> {
    let node_id = nsid_of(pod_nl, raw_fd(&node.netns))?;
    let links = links.iter().map(Link::from_message).collect();
    peers_of(pod, node, links, node_id)
}

/// The peers among the pod's `links` (the node netns being `node_id` to
/// the pod) whose node-side end points back at them, asked over the node's
/// socket.
fn peers_of(
    pod: &Netns,
    node: &Node,
    links: Vec<Link>,
    node_id: Option<i32>,
) -> Result<Vec<HostPeer>, HostSideError> {
    let Some(node_id) = node_id else {
        return Ok(Vec::new());
    };
    let candidates: Vec<Link> = links
        .into_iter()
        .filter(|l| l.veth && l.peer_nsid == Some(node_id) && l.peer_index.is_some())
        .collect();
    if candidates.is_empty() {
        return Ok(Vec::new());
    }
    // Seen from the node: the peer points back at the pod interface.
    let nl = &node.nl;
    let Some(pod_id) = nsid_of(nl, raw_fd(pod))? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for l in candidates {
        let Some(peer) = link_by_index(nl, l.peer_index.unwrap_or(0))? else {
            continue;
        };
        if peer.veth && peer.peer_index == Some(l.index) && peer.peer_nsid == Some(pod_id) {
            out.push(HostPeer {
                pod_iface: l.name,
                host_iface: peer.name,
                host_index: peer.index,
            });
        }
    }
    Ok(out)
}

fn open() -> Result<Rtnl, HostSideError> {
    Rtnl::open().map_err(|source| HostSideError::Netlink {
        what: "socket",
        source,
    })
}

/// One request on `nl`, its error named for `what`.
fn ask(
    nl: &Rtnl,
    what: &'static str,
    msg: RouteNetlinkMessage,
) -> Result<Option<RouteNetlinkMessage>, HostSideError> {
    nl.request(msg)
        .map_err(|source| HostSideError::Netlink { what, source })
}

fn link(nl: &Rtnl, msg: LinkMessage) -> Result<Option<Link>, HostSideError> {
    Ok(
        match ask(nl, "get link", RouteNetlinkMessage::GetLink(msg))? {
            Some(RouteNetlinkMessage::NewLink(m)) => Some(Link::from_message(&m)),
            _ => None,
        },
    )
}

fn link_by_name(nl: &Rtnl, name: &str) -> Result<Option<Link>, HostSideError> {
    let mut msg = LinkMessage::default();
    msg.attributes.push(LinkAttribute::IfName(name.to_owned()));
    link(nl, msg)
}

fn link_by_index(nl: &Rtnl, index: u32) -> Result<Option<Link>, HostSideError> {
    let mut msg = LinkMessage::default();
    msg.header.index = index;
    link(nl, msg)
}

/// The id `nl`'s netns gives the netns open as `fd`, if it has one.
fn nsid_of(nl: &Rtnl, fd: i32) -> Result<Option<i32>, HostSideError> {
    let mut msg = NsidMessage::default();
    msg.attributes.push(NsidAttribute::Fd(fd as u32));
    Ok(
        match ask(nl, "get netns id", RouteNetlinkMessage::GetNsId(msg))? {
            Some(RouteNetlinkMessage::NewNsId(m)) => m.attributes.iter().find_map(|a| match a {
                NsidAttribute::Id(id) if *id >= 0 => Some(*id),
                _ => None,
            }),
            _ => None,
        },
    )
}

/// A netns's raw fd, for requests that name a netns by fd (valid while
/// `ns` lives).
fn raw_fd(ns: &Netns) -> i32 {
    std::os::fd::AsFd::as_fd(ns).as_raw_fd()
}

//! A pod netns as one enrollment sees it: an rtnetlink socket made inside
//! it, and what that socket's link and address dumps say. The socket stays
//! in the pod's netns whatever the calling thread does next, so the
//! enrollment's routes and filters go over it from the agent's own netns:
//! one visit of the pod netns instead of one per step, and no socket, name
//! lookup or ioctl per interface.

use std::net::IpAddr;

use netlink_packet_route::{
    address::{AddressAttribute, AddressHeaderFlags, AddressMessage},
    link::{AfSpecInet, AfSpecInet6, AfSpecUnspec, LinkAttribute, LinkLayerType, LinkMessage},
    RouteNetlinkMessage,
};

use crate::{
    podnet::netns::{Netns, NetnsError},
    podnet::rtnl::Rtnl,
};

/// One interface of the pod besides `lo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Iface {
    pub name: String,
    pub index: u32,
    /// No Ethernet header (netkit in L3 mode, WireGuard, tun, IP tunnels).
    pub l3: bool,
    /// `net.ipv4.conf.<iface>.accept_local` is on (the pod's routes need it).
    pub accept_local: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("{what} in {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
}

/// The pod netns over one rtnetlink socket.
pub struct PodView {
    pub nl: Rtnl,
    /// The netns cookie: the key of the pod's state.
    pub cookie: u64,
    /// Interfaces besides `lo`, by name.
    pub ifaces: Vec<Iface>,
    /// `lo`'s index.
    pub lo: u32,
    /// Whether IPv6 is on for `lo` (where the IPv6 local route points).
    pub ipv6: bool,
    /// The addresses on every interface but `lo`, sorted.
    pub addrs: Vec<IpAddr>,
    /// Those of `addrs` not usable as a source yet, or ever: IPv6 duplicate
    /// address detection still running (tentative) or failed.
    pub unsettled: Vec<IpAddr>,
    /// The link dump's messages of the interfaces besides `lo` (their
    /// peers: [`crate::podnet::hostside::peers_over`]).
    pub links: Vec<LinkMessage>,
}

impl PodView {
    /// Opens the socket inside `netns` (its only visit) and reads the rest
    /// over it.
    pub fn open(netns: &Netns) -> Result<Self, ViewError> {
        Self::read(netns, true)
    }

    /// [`PodView::open`] without the address dump: `addrs` is empty.
    pub fn open_links(netns: &Netns) -> Result<Self, ViewError> {
        Self::read(netns, false)
    }

    fn read(netns: &Netns, with_addrs: bool) -> Result<Self, ViewError> {
        let path = netns.path().display().to_string();
        let nl = netns.run(Rtnl::open)?.map_err(|source| ViewError::Io {
            what: "rtnetlink socket",
            path: path.clone(),
            source,
        })?;
        let io = |what: &'static str| {
            let path = path.clone();
            move |source| ViewError::Io { what, path, source }
        };
        let cookie = nl.netns_cookie().map_err(io("reading the netns cookie"))?;
        let links = nl
            .dump(RouteNetlinkMessage::GetLink(LinkMessage::default()))
            .map_err(io("listing interfaces"))?;
        let (mut ifaces, mut lo, mut ipv6) = (Vec::new(), None, false);
        let mut others = Vec::new();
        for m in links {
            let RouteNetlinkMessage::NewLink(m) = m else {
                continue;
            };
            let Some(name) = m.attributes.iter().find_map(|a| match a {
                LinkAttribute::IfName(n) => Some(n.clone()),
                _ => None,
            }) else {
                continue;
            };
            if name == "lo" {
                lo = Some(m.header.index);
                ipv6 = ipv6_on(&m);
                continue;
            }
            let kind = m.header.link_layer_type;
            ifaces.push(Iface {
                name,
                index: m.header.index,
                l3: kind != LinkLayerType::Ether && kind != LinkLayerType::Loopback,
                accept_local: accept_local_on(&m),
            });
            others.push(m);
        }
        ifaces.sort_by(|a, b| a.name.cmp(&b.name));
        let lo =
            lo.ok_or_else(|| io("finding lo")(std::io::Error::from(std::io::ErrorKind::NotFound)))?;
        let dump = match with_addrs {
            true => nl
                .dump(RouteNetlinkMessage::GetAddress(AddressMessage::default()))
                .map_err(io("listing the pod's addresses"))?,
            false => Vec::new(),
        };
        let (mut addrs, mut unsettled) = (Vec::new(), Vec::new());
        for m in dump {
            let RouteNetlinkMessage::NewAddress(m) = m else {
                continue;
            };
            let Some(a) = address_of(&m).filter(|_| m.header.index != lo) else {
                continue;
            };
            let dad = AddressHeaderFlags::Tentative | AddressHeaderFlags::Dadfailed;
            if m.header.flags.intersects(dad) {
                unsettled.push(a);
            }
            addrs.push(a);
        }
        addrs.sort();
        addrs.dedup();
        Ok(Self {
            nl,
            cookie,
            ifaces,
            lo,
            ipv6,
            addrs,
            unsettled,
            links: others,
        })
    }

    /// The names of the interfaces besides `lo`.
    pub fn names(&self) -> Vec<String> {
        self.ifaces.iter().map(|i| i.name.clone()).collect()
    }

    /// The names of those without an Ethernet header.
    pub fn l3_names(&self) -> Vec<String> {
        self.ifaces
            .iter()
            .filter(|i| i.l3)
            .map(|i| i.name.clone())
            .collect()
    }

    /// The index of interface `name` (`lo` included) when it was read.
    pub fn index(&self, name: &str) -> Option<u32> {
        if name == "lo" {
            return Some(self.lo);
        }
        self.ifaces.iter().find(|i| i.name == name).map(|i| i.index)
    }
}

/// The address of an address message, as getifaddrs(3) gives it: the local
/// address where there is one (IPv4 peer-to-peer links name the peer in
/// `IFA_ADDRESS`), else `IFA_ADDRESS`.
fn address_of(m: &AddressMessage) -> Option<IpAddr> {
    let local = m.attributes.iter().find_map(|a| match a {
        AddressAttribute::Local(a) => Some(*a),
        _ => None,
    });
    local.or_else(|| {
        m.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(a) => Some(*a),
            _ => None,
        })
    })
}

/// Whether a link accepts packets from its own addresses, from its IPv4
/// device settings.
fn accept_local_on(m: &LinkMessage) -> bool {
    m.attributes.iter().any(|a| match a {
        LinkAttribute::AfSpecUnspec(specs) => specs.iter().any(|s| match s {
            AfSpecUnspec::Inet(v4) => v4
                .iter()
                .any(|o| matches!(o, AfSpecInet::DevConf(c) if c.accept_local != 0)),
            _ => false,
        }),
        _ => false,
    })
}

/// Whether a link has IPv6 on, from its IPv6 device settings (none at all:
/// the kernel has no IPv6 here).
pub fn ipv6_on(m: &LinkMessage) -> bool {
    m.attributes.iter().any(|a| match a {
        LinkAttribute::AfSpecUnspec(specs) => specs.iter().any(|s| match s {
            AfSpecUnspec::Inet6(v6) => v6
                .iter()
                .any(|o| matches!(o, AfSpecInet6::DevConf(c) if c.disable_ipv6 == 0)),
            _ => false,
        }),
        _ => false,
    })
}

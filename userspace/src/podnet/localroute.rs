//! The local route (`--local-route`, issue 42): the pod's app TCP is routed
//! over its `lo` instead of its interface, so that a captured connection
//! gets loopback's MSS (the MSS is fixed at `connect()` from the route)
//! and never passes the interface's programs. Per family with an address:
//!
//! ```text
//! ip rule add iif lo ipproto tcp fwmark 0/0xfff lookup 101 pref 32763
//! ip route add local default dev lo src <pod address> table 101
//! sysctl net.ipv4.tcp_fwmark_accept=1
//! ```
//!
//! The pod's outbound exclusions come first, to the main table (`iif lo
//! ipproto tcp dport P lookup main`, `… to RANGE lookup main`, pref 32762),
//! and with an include list the rule is one per included range (`… to
//! RANGE lookup 101`): an excluded connection is routed by the interface
//! from `connect()` on, with the interface's MSS. (The programs decide
//! regardless: a rule missing or late only costs speed.)
//!
//! `iif lo` is every locally sent packet (source validation of inbound
//! packets is not). `fwmark 0/0xfff` leaves out ztunnel's sockets (0x539),
//! redirected packets (0x111) and `MARK_DIRECT`: the ingress program marks
//! an inbound SYN that reaches the app directly, and with
//! `tcp_fwmark_accept` the app's socket takes that mark, so its answers
//! leave by the interface. `lo`'s egress program (`sluice_lo_out`) gives
//! the SYNs the local route sends the capture verdict, and sends out the
//! packets of flows no socket of the pod terminates (connections from
//! before the rule).
//!
//! Offered to a pod with one interface besides `lo`, with an Ethernet
//! header, and no rerouted interfaces; only where tc programs can read a
//! packet's netns (Linux ≥ 6.15: the verdict on `lo` goes by it).

use std::net::IpAddr;

use ipnet::IpNet;

use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL};
use netlink_packet_route::{
    route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteScope, RouteType},
    rule::{RuleAction, RuleAttribute, RuleMessage, RulePortRange},
    AddressFamily, IpProtocol, RouteNetlinkMessage,
};
use sluice_common::{LOCAL_ROUTE_PRIORITY, LOCAL_ROUTE_TABLE, MARK_MASK};

use crate::{
    exclusions::{Include, PodExclusions},
    options::PodOptions,
    podnet::{podview::PodView, routes::RouteError, rtnl::Rtnl, sysctl},
};

const TCP_FWMARK_ACCEPT: &str = "net/ipv4/tcp_fwmark_accept";
/// The main routing table's id.
const RT_TABLE_MAIN: u32 = 254;

/// Why a pod's TCP keeps its interface's route, or the index of the
/// interface it leaves by on the local route.
pub fn uplink(view: &PodView, options: &PodOptions) -> Result<u32, &'static str> {
    if !options.reroute.is_empty() {
        return Err("it has rerouted interfaces");
    }
    match view.ifaces.as_slice() {
        [one] if !one.l3 => Ok(one.index),
        [_] => Err("its interface has no Ethernet header"),
        _ => Err("it has more than one interface besides lo"),
    }
}

/// The source address of the local route per family: the pod's first
/// address of it that is not link-local.
pub fn sources(addrs: &[IpAddr]) -> Vec<IpAddr> {
    let v4 = addrs.iter().find(|a| a.is_ipv4());
    let v6 = addrs.iter().find(|a| match a {
        IpAddr::V6(v6) => !v6.is_unicast_link_local(),
        IpAddr::V4(_) => false,
    });
    v4.into_iter().chain(v6).copied().collect()
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> RouteError {
    let what = what.into();
    move |source| RouteError::Io { what, source }
}

/// Installs the routes, then the rules for exclusions `x` (nothing takes a
/// route before its rule exists, and exclusions come before the local
/// route's), over `nl` (a socket in the pod's netns); `lo`: its index.
/// Idempotent. The sysctl is [`accept_marks`]'.
pub fn install_over(
    nl: &Rtnl,
    lo: u32,
    sources: &[IpAddr],
    x: &PodExclusions,
) -> Result<(), RouteError> {
    for src in sources {
        let route = route(lo, family(src), Some(*src));
        add(nl, RouteNetlinkMessage::NewRoute(route))
            .map_err(io(format!("adding the local route from {src}")))?;
    }
    for r in rules(sources, x) {
        let what = format!("adding the local route's rule {:?}", r.attributes);
        add(nl, RouteNetlinkMessage::NewRule(r)).map_err(io(what))?;
    }
    Ok(())
}

/// Replaces the pod's rules with those of exclusions `x` (they changed):
/// the old ones go first, so that meanwhile the pod's TCP takes the
/// interface's route (captured there, as without the local route).
pub fn replace_rules(
    nl: &Rtnl,
    lo: u32,
    sources: &[IpAddr],
    x: &PodExclusions,
) -> Result<(), RouteError> {
    remove_rules(nl)?;
    install_over(nl, lo, sources, x)
}

/// Every rule of the local route, by priority (the exclusions' and its
/// own), in both families.
fn remove_rules(nl: &Rtnl) -> Result<(), RouteError> {
    for f in [AddressFamily::Inet, AddressFamily::Inet6] {
        for pref in [LOCAL_ROUTE_PRIORITY - 1, LOCAL_ROUTE_PRIORITY] {
            // One rule a request, until none of the priority is left (at
            // most 2 × EXCLUSIONS_MAX + 1; the bound only guards against a
            // kernel that keeps answering yes).
            for _ in 0..=2 * sluice_common::EXCLUSIONS_MAX + 1 {
                let mut m = RuleMessage::default();
                m.header.family = f;
                m.attributes = vec![RuleAttribute::Priority(pref)];
                if !del(nl, RouteNetlinkMessage::DelRule(m))
                    .map_err(io("removing the local route's rules"))?
                {
                    break;
                }
            }
        }
    }
    Ok(())
}

/// The rules of a pod with addresses `sources` and exclusions `x`: its
/// exclusions' (to the main table), then the local route's, per family.
fn rules(sources: &[IpAddr], x: &PodExclusions) -> Vec<RuleMessage> {
    let mut out = Vec::new();
    for f in sources.iter().map(family) {
        let of_family = |n: &&IpNet| family(&n.addr()) == f;
        let excluded = |more| rule(f, LOCAL_ROUTE_PRIORITY - 1, RT_TABLE_MAIN, more);
        for &port in &x.exclude_outbound_ports {
            let range = RulePortRange {
                start: port,
                end: port,
            };
            out.push(excluded(vec![RuleAttribute::DestinationPortRange(range)]));
        }
        for net in x.exclude_outbound_ip_ranges.iter().filter(of_family) {
            out.push(to(excluded(vec![]), net));
        }
        // `fwmark 0/0xfff`: a socket without a mark of the mesh's.
        let unmarked = vec![RuleAttribute::FwMark(0), RuleAttribute::FwMask(MARK_MASK)];
        let captured = || rule(f, LOCAL_ROUTE_PRIORITY, LOCAL_ROUTE_TABLE, unmarked.clone());
        match &x.include_outbound_ip_ranges {
            Include::All => out.push(captured()),
            Include::Only(nets) => {
                out.extend(nets.iter().filter(of_family).map(|n| to(captured(), n)))
            }
        }
    }
    out
}

/// `rule` for destinations in `net` only.
fn to(mut rule: RuleMessage, net: &IpNet) -> RuleMessage {
    rule.header.dst_len = net.prefix_len();
    rule.attributes
        .push(RuleAttribute::Destination(net.network()));
    rule
}

fn add(nl: &Rtnl, msg: RouteNetlinkMessage) -> std::io::Result<()> {
    match nl.change(msg, NLM_F_CREATE | NLM_F_EXCL) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        r => r,
    }
}

/// `net.ipv4.tcp_fwmark_accept` (for IPv6 too): a socket the app accepts
/// takes its SYN's mark. A file of the pod's /proc/sys: call inside its
/// netns.
pub fn accept_marks(on: bool) -> Result<(), RouteError> {
    sysctl::write(TCP_FWMARK_ACCEPT, if on { "1" } else { "0" })
        .map_err(|(path, source)| io(path.display().to_string())(source))
}

/// Removes the rules, then the routes, and turns the sysctl off. Call
/// inside the pod's netns. Entries already gone are no error (also the
/// rollback of a partial install).
pub fn remove() -> Result<(), RouteError> {
    let nl = Rtnl::open().map_err(io("rtnetlink socket"))?;
    let lo = nix::net::if_::if_nametoindex("lo").map_err(|e| io("finding lo")(e.into()))?;
    remove_rules(&nl)?;
    for f in [AddressFamily::Inet, AddressFamily::Inet6] {
        del(&nl, RouteNetlinkMessage::DelRoute(route(lo, f, None)))
            .map_err(io("removing the local route"))?;
    }
    // A pod without its own IPv4 sysctls (none such) or a read-only
    // /proc/sys: nothing was set.
    match accept_marks(false) {
        Err(RouteError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            Ok(())
        }
        r => r,
    }
}

/// Deletes one entry; `false` when there was none.
fn del(nl: &Rtnl, msg: RouteNetlinkMessage) -> std::io::Result<bool> {
    match nl.request(msg) {
        Err(e) if matches!(e.raw_os_error(), Some(libc::ESRCH | libc::ENOENT)) => Ok(false),
        r => r.map(|_| true),
    }
}

fn family(a: &IpAddr) -> AddressFamily {
    match a {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    }
}

fn table_byte() -> u8 {
    if LOCAL_ROUTE_TABLE < 256 {
        LOCAL_ROUTE_TABLE as u8
    } else {
        RouteHeader::RT_TABLE_UNSPEC
    }
}

/// `iif lo ipproto tcp [more] lookup TABLE pref PREF`.
fn rule(family: AddressFamily, pref: u32, table: u32, more: Vec<RuleAttribute>) -> RuleMessage {
    let mut m = RuleMessage::default();
    m.header.family = family;
    m.header.action = RuleAction::ToTable;
    m.header.table = if table < 256 {
        table as u8
    } else {
        RouteHeader::RT_TABLE_UNSPEC
    };
    m.attributes = vec![
        RuleAttribute::Iifname("lo".into()),
        RuleAttribute::IpProtocol(IpProtocol::Tcp),
        RuleAttribute::Priority(pref),
        RuleAttribute::Table(table),
    ];
    m.attributes.extend(more);
    m
}

/// `local default dev lo [src SRC] table 101` of `family`.
fn route(lo: u32, family: AddressFamily, src: Option<IpAddr>) -> RouteMessage {
    let mut m = RouteMessage::default();
    let default = match family {
        AddressFamily::Inet6 => RouteAddress::Inet6(0.into()),
        _ => RouteAddress::Inet(0.into()),
    };
    m.header.address_family = family;
    m.header.destination_prefix_length = 0;
    m.header.table = table_byte();
    m.header.kind = RouteType::Local;
    m.header.scope = RouteScope::Host;
    m.header.protocol = netlink_packet_route::route::RouteProtocol::Static;
    m.attributes = vec![
        RouteAttribute::Destination(default),
        RouteAttribute::Table(LOCAL_ROUTE_TABLE),
        RouteAttribute::Oif(lo),
    ];
    if let Some(src) = src {
        m.attributes.push(RouteAttribute::PrefSource(match src {
            IpAddr::V4(a) => RouteAddress::Inet(a),
            IpAddr::V6(a) => RouteAddress::Inet6(a),
        }));
    }
    m
}

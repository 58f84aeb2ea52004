//! The pod-side routing that makes a redirected packet local: a policy rule
//! `fwmark 0x111/0xfff lookup 100` and a route `local default dev lo table 100`
//! (both families), plus `accept_local` on the pod's interfaces (the redirected
//! packet's source is the pod's own address) and `tcp_migrate_req` (lossless
//! ztunnel upgrades). Set over rtnetlink and sysctl files (`sysctl`) from
//! inside the pod netns; no `ip` command.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use netlink_packet_core::{DefaultNla, NLM_F_CREATE, NLM_F_EXCL};
use netlink_packet_route::{
    link::{AfSpecInet, AfSpecUnspec, LinkAttribute, LinkFlags, LinkMessage},
    route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteScope, RouteType},
    rule::{RuleAction, RuleAttribute, RuleMessage},
    AddressFamily, RouteNetlinkMessage,
};
use sluice_common::{MARK_MASK, MARK_REDIRECT, ROUTE_TABLE, RULE_PRIORITY};

use crate::{podnet::rtnl::Rtnl, podnet::sysctl};

#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> RouteError {
    let what = what.into();
    move |source| RouteError::Io { what, source }
}

/// Whether IPv6 is usable on the calling thread's netns' `lo` (where the
/// IPv6 route points), from its IPv6 device settings over rtnetlink: a
/// file under /proc/sys/net costs ~0.1 ms to open from a thread that moved
/// into another netns (its dentries are rebuilt for that netns).
fn ipv6_on_lo(nl: &Rtnl, lo: u32) -> Result<bool, RouteError> {
    let mut get = LinkMessage::default();
    get.header.index = lo;
    let answer = nl
        .request(RouteNetlinkMessage::GetLink(get))
        .map_err(io("reading lo's IPv6 settings"))?;
    let Some(RouteNetlinkMessage::NewLink(m)) = answer else {
        return Err(RouteError::Io {
            what: "reading lo's IPv6 settings".into(),
            source: std::io::Error::other("no answer for lo"),
        });
    };
    Ok(crate::podnet::podview::ipv6_on(&m))
}

fn set_sysctl(name: &str, on: bool) -> Result<(), RouteError> {
    sysctl::write(name, if on { "1" } else { "0" })
        .map_err(|(path, source)| io(path.display().to_string())(source))
}

/// `net.ipv4.conf.<iface>.accept_local`, set over rtnetlink (the IPv4
/// device setting alone, by its index in `IFLA_INET_CONF`): cheaper than
/// its /proc/sys file from a pod's netns (see [`ipv6_on_lo`]), and needs no
/// writable /proc/sys. An interface gone meanwhile is no error. (The sysctl
/// handler also flushes cached routes when the value drops to 0; the
/// rtnetlink path does not, and need not: teardown removes the rule and
/// route those packets took.)
fn set_accept_local(nl: &Rtnl, iface: &str, on: bool) -> Result<(), RouteError> {
    let Ok(index) = nix::net::if_::if_nametoindex(iface) else {
        return Ok(());
    };
    set_accept_local_at(nl, index, on).map_err(io(format!("setting accept_local on {iface}")))
}

/// [`set_accept_local`] on the interface of `index` in `nl`'s netns.
fn set_accept_local_at(nl: &Rtnl, index: u32, on: bool) -> std::io::Result<()> {
    const IFLA_INET_CONF: u16 = 1;
    const IPV4_DEVCONF_ACCEPT_LOCAL: u16 = 23;
    let mut conf = Vec::with_capacity(8);
    conf.extend_from_slice(&8u16.to_ne_bytes());
    conf.extend_from_slice(&IPV4_DEVCONF_ACCEPT_LOCAL.to_ne_bytes());
    conf.extend_from_slice(&u32::from(on).to_ne_bytes());
    let mut set = LinkMessage::default();
    set.header.index = index;
    set.attributes
        .push(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet(vec![
            AfSpecInet::Other(DefaultNla::new(IFLA_INET_CONF, conf)),
        ])]));
    nl.request(RouteNetlinkMessage::SetLink(set)).map(drop)
}

/// Requests queued on a closing listener move to another listener of its
/// SO_REUSEPORT group instead of being reset: with it, a ztunnel upgrade (old
/// and new listeners in one group, the old one closing) loses no connection.
/// A sysctl file only: must run inside the pod netns.
pub fn set_migrate_req(on: bool) -> Result<(), RouteError> {
    set_sysctl("net/ipv4/tcp_migrate_req", on)
}

/// Installs the rule, routes and sysctls. Must run inside the pod netns.
/// Idempotent: entries that already exist are left as they are.
pub fn install(pod_ifaces: &[String]) -> Result<(), RouteError> {
    let nl = Rtnl::open().map_err(io("rtnetlink socket"))?;
    let indexes: Vec<u32> = pod_ifaces
        .iter()
        .filter_map(|i| nix::net::if_::if_nametoindex(i.as_str()).ok())
        .collect();
    set_migrate_req(true)?;
    let lo = lo_index()?;
    let ipv6 = ipv6_on_lo(&nl, lo)?;
    install_over(&nl, &indexes, lo, ipv6)
}

/// What [`install`] does over rtnetlink, on `nl` (a socket in the pod's
/// netns, used from any thread): `accept_local` on the interfaces of
/// `ifaces` (indexes; one gone meanwhile is no error), `lo` (its index) up,
/// the rule and the route, for IPv6 too when `ipv6`. The sysctl is the
/// caller's ([`set_migrate_req`]).
pub fn install_over(nl: &Rtnl, ifaces: &[u32], lo: u32, ipv6: bool) -> Result<(), RouteError> {
    for &i in ifaces {
        match set_accept_local_at(nl, i, true) {
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {}
            r => r.map_err(io(format!("setting accept_local on interface {i}")))?,
        }
    }
    // The local route needs lo up; the runtime's loopback plugin may not
    // have run yet when we are called from CNI ADD.
    let mut up = LinkMessage::default();
    up.header.index = lo;
    up.header.flags = LinkFlags::Up;
    up.header.change_mask = LinkFlags::Up;
    nl.request(RouteNetlinkMessage::SetLink(up))
        .map_err(io("setting lo up"))?;
    for (what, msg) in entries(lo, ipv6) {
        let created = match msg {
            Entry::Rule(m) => RouteNetlinkMessage::NewRule(m),
            Entry::Route(m) => RouteNetlinkMessage::NewRoute(m),
        };
        match nl.change(created, NLM_F_CREATE | NLM_F_EXCL) {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            r => r.map_err(io(format!("adding the {what}")))?,
        }
    }
    Ok(())
}

/// Removes what [`install`] added. Must run inside the pod netns. Missing
/// entries are not an error (teardown is also the rollback of a partial install).
pub fn remove(pod_ifaces: &[String]) -> Result<(), RouteError> {
    let nl = Rtnl::open().map_err(io("rtnetlink socket"))?;
    for i in pod_ifaces {
        // The interface may be gone with the pod; nothing to undo then.
        let _ = set_accept_local(&nl, i, false);
    }
    let _ = set_migrate_req(false);
    let lo = lo_index()?;
    for (what, msg) in entries(lo, ipv6_on_lo(&nl, lo)?) {
        let deleted = match msg {
            Entry::Rule(m) => RouteNetlinkMessage::DelRule(m),
            Entry::Route(m) => RouteNetlinkMessage::DelRoute(m),
        };
        nl.delete(deleted)
            .map_err(io(format!("removing the {what}")))?;
    }
    Ok(())
}

enum Entry {
    Rule(RuleMessage),
    Route(RouteMessage),
}

/// The rule and the route, per family (IPv6 when `ipv6`).
fn entries(lo: u32, ipv6: bool) -> Vec<(&'static str, Entry)> {
    let mut out = vec![
        ("IPv4 policy rule", Entry::Rule(rule(AddressFamily::Inet))),
        ("IPv4 local route", Entry::Route(route_v4(lo))),
    ];
    if ipv6 {
        out.push(("IPv6 policy rule", Entry::Rule(rule(AddressFamily::Inet6))));
        out.push(("IPv6 local route", Entry::Route(route_v6(lo))));
    }
    out
}

/// A table id as a rule's or route's header holds it: past 255 the
/// header says "unspecified" and the `Table` attribute alone names it.
pub fn table_byte(table: u32) -> u8 {
    u8::try_from(table).unwrap_or(RouteHeader::RT_TABLE_UNSPEC)
}

/// Index of `lo` in the calling thread's netns.
fn lo_index() -> Result<u32, RouteError> {
    nix::net::if_::if_nametoindex("lo").map_err(|e| RouteError::Io {
        what: "finding lo in the pod netns".into(),
        source: e.into(),
    })
}

/// `fwmark 0x111/0xfff lookup 100` at sluice's priority.
fn rule(family: AddressFamily) -> RuleMessage {
    let mut m = RuleMessage::default();
    m.header.family = family;
    m.header.action = RuleAction::ToTable;
    m.header.table = table_byte(ROUTE_TABLE);
    m.attributes = vec![
        RuleAttribute::FwMark(MARK_REDIRECT),
        RuleAttribute::FwMask(MARK_MASK),
        RuleAttribute::Priority(RULE_PRIORITY),
        RuleAttribute::Table(ROUTE_TABLE),
    ];
    m
}

fn route_v4(lo: u32) -> RouteMessage {
    local_default(AddressFamily::Inet, lo, ROUTE_TABLE, None)
}

fn route_v6(lo: u32) -> RouteMessage {
    local_default(AddressFamily::Inet6, lo, ROUTE_TABLE, None)
}

/// `local default dev lo [src SRC] table TABLE` of `family` (`lo`: its
/// index).
pub fn local_default(
    family: AddressFamily,
    lo: u32,
    table: u32,
    src: Option<IpAddr>,
) -> RouteMessage {
    let addr = |a: IpAddr| match a {
        IpAddr::V4(a) => RouteAddress::Inet(a),
        IpAddr::V6(a) => RouteAddress::Inet6(a),
    };
    let default = match family {
        AddressFamily::Inet6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    };
    let mut m = RouteMessage::default();
    m.header.address_family = family;
    m.header.destination_prefix_length = 0;
    m.header.table = table_byte(table);
    m.header.kind = RouteType::Local;
    m.header.scope = RouteScope::Host;
    m.header.protocol = netlink_packet_route::route::RouteProtocol::Static;
    m.attributes = vec![
        RouteAttribute::Destination(addr(default)),
        RouteAttribute::Table(table),
        RouteAttribute::Oif(lo),
    ];
    m.attributes
        .extend(src.map(|s| RouteAttribute::PrefSource(addr(s))));
    m
}

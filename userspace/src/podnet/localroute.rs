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
//! regardless: a connection no rule kept off the local route is sent out
//! by `lo`'s egress program, at the peer's MSS.)
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

use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE};
use netlink_packet_route::{
    route::RouteMessage,
    rule::{RuleAction, RuleAttribute, RuleMessage, RulePortRange},
    AddressFamily, IpProtocol, RouteNetlinkMessage,
};
use sluice_common::{
    LOCAL_ROUTE_PRIORITY, LOCAL_ROUTE_TABLE, MARK_MASK, PROBE_ADDR_V4, PROBE_ADDR_V6,
};

use crate::{
    exclusions::{Include, PodExclusions},
    options::PodOptions,
    podnet::{
        netns::Netns,
        podview::PodView,
        routes::{local_default, table_byte, RouteError},
        rtnl::Rtnl,
        sockets, sysctl,
    },
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

/// Whether a pod's app may have started when it is enrolled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AppStarted {
    /// At its sandbox's CNI ADD: the runtime starts no container of the
    /// pod before the ADD returns, so the pod has no connection of its own.
    No,
    /// Enrolled later (by its watch, by hand, or taken over from
    /// istio-cni): it may hold connections.
    Maybe,
}

/// Whether the pod can take the local route now: the index of the
/// interface it leaves by and the route's sources, or why not. A pod with
/// open TCP connections is not offered it (it runs already: sluice was
/// installed under it, or it is taken over from istio-cni): the rule would
/// re-route them over `lo` with loopback's MTU, and out of the pod by
/// `lo`'s egress program at the peer's MSS alone, which an interface of a
/// smaller MTU drops. They are counted only where the app may have started
/// (`started`): the count walks the node's whole established hash table
/// (≈ 1.4 ms on a small VM), which a pod at its CNI ADD need not pay.
/// Call from outside `netns`.
pub fn offer(
    netns: &Netns,
    view: &PodView,
    options: &PodOptions,
    started: AppStarted,
) -> Result<(u32, Vec<IpAddr>), String> {
    let uplink = uplink(view, options).map_err(str::to_owned)?;
    let sources = sources(view);
    if sources.is_empty() {
        return Err("it has no address".into());
    }
    if started == AppStarted::Maybe {
        let open = netns
            .run(sockets::open_tcp_connections)
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("cannot count its TCP connections: {e}"))?;
        if open > 0 {
            return Err(format!("it has {open} TCP connections open already"));
        }
    }
    Ok((uplink, sources))
}

/// The source address of the local route per family: the pod's first
/// address of it that is not link-local (IPv6 only where it is on for
/// `lo`, where its route points).
pub fn sources(view: &PodView) -> Vec<IpAddr> {
    let (addrs, ipv6) = (&view.addrs, view.ipv6);
    let v4 = addrs.iter().find(|a| match a {
        IpAddr::V4(v4) => !v4.is_link_local(),
        IpAddr::V6(_) => false,
    });
    // A tentative IPv6 address is refused as a route's source until its
    // duplicate address detection ends (the repair adds it then).
    let v6 = addrs.iter().find(|a| match a {
        IpAddr::V6(v6) => ipv6 && !v6.is_unicast_link_local() && !view.unsettled.contains(a),
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
    // Replaced, not only added: a repair after the pod's address changed
    // gives the route the new source.
    for src in sources {
        let route = RouteNetlinkMessage::NewRoute(route(lo, family(src), Some(*src)));
        nl.change(route, NLM_F_CREATE | NLM_F_REPLACE)
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
/// Returns how many it removed.
fn remove_rules(nl: &Rtnl) -> Result<usize, RouteError> {
    let mut removed = 0;
    for f in [AddressFamily::Inet, AddressFamily::Inet6] {
        // The local route's rule first: excluded flows never take it
        // meanwhile.
        for (pref, table) in [
            (LOCAL_ROUTE_PRIORITY, LOCAL_ROUTE_TABLE),
            (LOCAL_ROUTE_PRIORITY - 1, RT_TABLE_MAIN),
        ] {
            // One rule a request, until none of the priority is left (a
            // pod's exclusions make at most 3 × EXCLUSIONS_MAX + 1 of a
            // family; the bound only guards against a kernel that keeps
            // answering yes).
            for _ in 0..3 * sluice_common::EXCLUSIONS_MAX + 2 {
                // Its priority, table and `iif lo`: a rule of the pod's own
                // at the same priority stays.
                let mut m = RuleMessage::default();
                m.header.family = f;
                m.header.table = table_byte(table);
                m.attributes = vec![
                    RuleAttribute::Priority(pref),
                    RuleAttribute::Table(table),
                    RuleAttribute::Iifname("lo".into()),
                ];
                if !nl
                    .delete(RouteNetlinkMessage::DelRule(m))
                    .map_err(io("removing the local route's rules"))?
                {
                    break;
                }
                removed += 1;
            }
        }
    }
    Ok(removed)
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
        // Row O3: the probe address is never captured.
        out.push(to(excluded(vec![]), &probe_net(f)));
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

/// The probe address (`PROBE_ADDR_*`) of family `f`, as a host range.
fn probe_net(f: AddressFamily) -> IpNet {
    match f {
        AddressFamily::Inet6 => IpNet::from(IpAddr::from(PROBE_ADDR_V6)),
        _ => IpNet::from(IpAddr::from(PROBE_ADDR_V4)),
    }
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

/// Removes the rules, then the routes, and turns the sysctl off where
/// `was_on` (the pod's entry said so) or anything was found. Call inside
/// the pod's netns. Entries already gone are no error (also the rollback of
/// a partial install).
pub fn remove(was_on: bool) -> Result<(), RouteError> {
    let nl = Rtnl::open().map_err(io("rtnetlink socket"))?;
    let lo = nix::net::if_::if_nametoindex("lo").map_err(|e| io("finding lo")(e.into()))?;
    let mut removed = remove_rules(&nl)?;
    for f in [AddressFamily::Inet, AddressFamily::Inet6] {
        let route = RouteNetlinkMessage::DelRoute(route(lo, f, None));
        removed += usize::from(nl.delete(route).map_err(io("removing the local route"))?);
    }
    // The sysctl only where the local route was (a pod never on it keeps
    // its own); a read-only /proc/sys: nothing was set.
    if !was_on && removed == 0 {
        return Ok(());
    }
    match accept_marks(false) {
        Err(RouteError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            Ok(())
        }
        r => r,
    }
}

fn family(a: &IpAddr) -> AddressFamily {
    match a {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    }
}

/// `iif lo ipproto tcp [more] lookup TABLE pref PREF`.
fn rule(family: AddressFamily, pref: u32, table: u32, more: Vec<RuleAttribute>) -> RuleMessage {
    let mut m = RuleMessage::default();
    m.header.family = family;
    m.header.action = RuleAction::ToTable;
    m.header.table = table_byte(table);
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
    local_default(family, lo, LOCAL_ROUTE_TABLE, src)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each rule as `pref table what`.
    fn shown(rules: &[RuleMessage]) -> Vec<String> {
        rules
            .iter()
            .map(|m| {
                let mut out = String::new();
                for a in &m.attributes {
                    match a {
                        RuleAttribute::Priority(p) => out.insert_str(0, &format!("{p}")),
                        RuleAttribute::Table(t) => out.push_str(&format!(" {t}")),
                        RuleAttribute::DestinationPortRange(r) => {
                            out.push_str(&format!(" dport {}", r.start))
                        }
                        RuleAttribute::Destination(d) => {
                            out.push_str(&format!(" to {d}/{}", m.header.dst_len))
                        }
                        RuleAttribute::FwMask(m) => out.push_str(&format!(" unmarked/{m:#x}")),
                        _ => {}
                    }
                }
                out
            })
            .collect()
    }

    #[test]
    fn exclusions_and_the_probe_address_come_first_and_an_include_list_narrows_the_rule() {
        let x = PodExclusions {
            exclude_outbound_ports: vec![9091],
            exclude_outbound_ip_ranges: vec![
                "10.9.0.0/16".parse().unwrap(),
                "fd00::/8".parse().unwrap(),
            ],
            include_outbound_ip_ranges: Include::Only(vec!["10.0.0.0/8".parse().unwrap()]),
            ..Default::default()
        };
        let v4: Vec<IpAddr> = vec!["10.1.0.5".parse().unwrap()];
        assert_eq!(
            shown(&rules(&v4, &x)),
            [
                "32762 254 dport 9091",
                "32762 254 to 169.254.7.127/32",
                "32762 254 to 10.9.0.0/16",
                "32763 101 unmarked/0xfff to 10.0.0.0/8",
            ]
        );
        // Both families, nothing excluded: the probe address and one rule each.
        let both: Vec<IpAddr> = vec!["10.1.0.5".parse().unwrap(), "fd00::5".parse().unwrap()];
        assert_eq!(
            shown(&rules(&both, &PodExclusions::default())),
            [
                "32762 254 to 169.254.7.127/32",
                "32763 101 unmarked/0xfff",
                "32762 254 to fd16:9254:7127:1337:ffff:ffff:ffff:ffff/128",
                "32763 101 unmarked/0xfff",
            ]
        );
    }
}

//! The pod-side routing that makes a redirected packet local: a policy rule
//! `fwmark 0x111/0xfff lookup 100` and a route `local default dev lo table 100`
//! (both families), plus `accept_local` on the pod's interfaces (the redirected
//! packet's source is the pod's own address) and `tcp_migrate_req` (lossless
//! ztunnel upgrades). Set over rtnetlink and sysctl files (`sysctl`) from
//! inside the pod netns; no `ip` command.

use std::net::{Ipv4Addr, Ipv6Addr};

use netlink_packet_route::{
    route::{RouteMessage, RouteScope, RouteType},
    rule::{RuleAction, RuleAttribute, RuleMessage},
};
use rtnetlink::{Handle, LinkUnspec, RouteMessageBuilder};
use sluice_common::{MARK_MASK, MARK_REDIRECT, ROUTE_TABLE, RULE_PRIORITY};

use crate::sysctl;

#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("rtnetlink: {0}")]
    Netlink(#[from] rtnetlink::Error),
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

/// Whether IPv6 is usable in the calling thread's netns.
fn ipv6_enabled() -> bool {
    sysctl::read("net/ipv6/conf/all/disable_ipv6").is_ok_and(|v| v == "0")
}

fn set_sysctl(name: &str, on: bool) -> Result<(), RouteError> {
    sysctl::write(name, if on { "1" } else { "0" })
        .map_err(|(path, source)| io(path.display().to_string())(source))
}

fn set_accept_local(iface: &str, on: bool) -> Result<(), RouteError> {
    set_sysctl(&format!("net/ipv4/conf/{iface}/accept_local"), on)
}

fn runtime() -> Result<tokio::runtime::Runtime, RouteError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(io("tokio runtime"))
}

/// Requests queued on a closing listener move to another listener of its
/// SO_REUSEPORT group instead of being reset: with it, a ztunnel upgrade (old
/// and new listeners in one group, the old one closing) loses no connection.
fn set_migrate_req(on: bool) -> Result<(), RouteError> {
    set_sysctl("net/ipv4/tcp_migrate_req", on)
}

/// Installs the rule, routes and sysctls. Must run inside the pod netns.
/// Idempotent: entries that already exist are left as they are.
pub fn install(pod_ifaces: &[String]) -> Result<(), RouteError> {
    for i in pod_ifaces {
        set_accept_local(i, true)?;
    }
    set_migrate_req(true)?;
    let v6 = ipv6_enabled();
    runtime()?.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(io("rtnetlink socket"))?;
        tokio::spawn(conn);
        let lo = lo_index()?;
        // The local route needs lo up; the runtime's loopback plugin may not
        // have run yet when we are called from CNI ADD.
        handle
            .link()
            .set(LinkUnspec::new_with_index(lo).up().build())
            .execute()
            .await?;
        ignore_exists(rule_v4(&handle).execute().await)?;
        ignore_exists(handle.route().add(route_v4(lo)).execute().await)?;
        if v6 {
            ignore_exists(rule_v6(&handle).execute().await)?;
            ignore_exists(handle.route().add(route_v6(lo)).execute().await)?;
        }
        Ok(())
    })
}

/// Removes what [`install`] added. Must run inside the pod netns. Missing
/// entries are not an error (teardown is also the rollback of a partial install).
pub fn remove(pod_ifaces: &[String]) -> Result<(), RouteError> {
    for i in pod_ifaces {
        // The interface may be gone with the pod; nothing to undo then.
        let _ = set_accept_local(i, false);
    }
    let _ = set_migrate_req(false);
    let v6 = ipv6_enabled();
    runtime()?.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(io("rtnetlink socket"))?;
        tokio::spawn(conn);
        let lo = lo_index()?;
        let mut rules = vec![rule_v4(&handle).message_mut().clone()];
        let mut routes = vec![route_v4(lo)];
        if v6 {
            rules.push(rule_v6(&handle).message_mut().clone());
            routes.push(route_v6(lo));
        }
        for r in rules {
            ignore_missing(handle.rule().del(r).execute().await)?;
        }
        for r in routes {
            ignore_missing(handle.route().del(r).execute().await)?;
        }
        Ok(())
    })
}

/// Index of `lo` in the calling thread's netns.
fn lo_index() -> Result<u32, RouteError> {
    nix::net::if_::if_nametoindex("lo").map_err(|e| RouteError::Io {
        what: "finding lo in the pod netns".into(),
        source: e.into(),
    })
}

fn rule_v4(h: &Handle) -> rtnetlink::RuleAddRequest<Ipv4Addr> {
    with_mask(h.rule().add().v4())
}

fn rule_v6(h: &Handle) -> rtnetlink::RuleAddRequest<Ipv6Addr> {
    with_mask(h.rule().add().v6())
}

fn with_mask<T>(r: rtnetlink::RuleAddRequest<T>) -> rtnetlink::RuleAddRequest<T> {
    let mut r = r
        .fw_mark(MARK_REDIRECT)
        .priority(RULE_PRIORITY)
        .table_id(ROUTE_TABLE)
        .action(RuleAction::ToTable);
    let msg: &mut RuleMessage = r.message_mut();
    msg.attributes.push(RuleAttribute::FwMask(MARK_MASK));
    r
}

fn route_v4(lo: u32) -> RouteMessage {
    local_route(
        RouteMessageBuilder::<Ipv4Addr>::new().destination_prefix(Ipv4Addr::UNSPECIFIED, 0),
        lo,
    )
}

fn route_v6(lo: u32) -> RouteMessage {
    local_route(
        RouteMessageBuilder::<Ipv6Addr>::new().destination_prefix(Ipv6Addr::UNSPECIFIED, 0),
        lo,
    )
}

/// `local default dev lo table 100`.
fn local_route<T>(r: RouteMessageBuilder<T>, lo: u32) -> RouteMessage {
    r.table_id(ROUTE_TABLE)
        .output_interface(lo)
        .kind(RouteType::Local)
        .scope(RouteScope::Host)
        .build()
}

fn errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.code.map(|c| -c.get()),
        _ => None,
    }
}

fn ignore_exists(r: Result<(), rtnetlink::Error>) -> Result<(), RouteError> {
    match r {
        Err(e) if errno(&e) == Some(libc::EEXIST) => Ok(()),
        other => Ok(other?),
    }
}

fn ignore_missing(r: Result<(), rtnetlink::Error>) -> Result<(), RouteError> {
    match r {
        Err(e) if matches!(errno(&e), Some(libc::ENOENT | libc::ESRCH)) => Ok(()),
        other => Ok(other?),
    }
}

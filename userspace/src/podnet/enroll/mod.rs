//! Enrolling and unenrolling one pod netns: attach (and pin) the links, install
//! the pod-side routing, write the shared state; register ztunnel's listeners
//! when they exist. Every step is undone on failure: no half-enrolled pod.
//!
//! This file reads as the sequences; each step is a file of its own:
//! `attach` (state entry, addresses, routes, links), `links` (one link and
//! its pin), `hostpeers`, `addrs`, `register` (ztunnel's listeners),
//! `reopen`, `repair`, `teardown` and `uninstall`.

mod addrs;
mod attach;
mod error;
mod hostpeers;
mod links;
mod register;
mod reopen;
mod repair;
mod teardown;
mod uninstall;

use std::path::Path;

use sluice_common::NETNS_PATH_LEN;

use crate::{
    dataplane::{
        loader::{Dataplane, Pins},
        migrate,
        state::{Maps, Published},
    },
    options::PodOptions,
    podnet::{hostside, netns::Netns, podview::PodView},
    uid::PodUid,
    workload::Workload,
};

pub use crate::podnet::localroute::AppStarted;
pub use addrs::{refresh_addrs, PodAddrs};
use error::unless_retired;
pub use error::EnrollError;
pub use hostpeers::host_peers;
pub use register::{register, register_keeping, Enrolled};
pub use reopen::{open_pod_netns, open_pod_netns_unless_gone, pod_interfaces};
pub use repair::{
    missing_after, missing_links, remove_orphan_pins, repair, repair_surveyed, survey, survey_plan,
    Repair, Survey, SurveyPlan,
};
pub use uninstall::{uninstall, UNINSTALL_DRAIN};

use teardown::{teardown, teardown_in};

/// Enrolls the pod whose netns is at `netns_path` without an agent: attach
/// capture, then register ztunnel's listeners if they already exist in the
/// netns (`Enabled`); otherwise the pod stays `Pending` (fail closed).
pub fn enroll(
    dp: &mut Dataplane,
    netns_path: &Path,
    uid: &PodUid,
    workload: &Workload,
) -> Result<Enrolled, EnrollError> {
    enroll_with(dp, netns_path, uid, workload, &PodOptions::default())
}

/// [`enroll`] with the pod's capture options.
pub fn enroll_with(
    dp: &mut Dataplane,
    netns_path: &Path,
    uid: &PodUid,
    workload: &Workload,
    options: &PodOptions,
) -> Result<Enrolled, EnrollError> {
    enroll_with_addrs(dp, netns_path, uid, workload, options, &PodAddrs::Netns)
}

/// [`enroll_with`], with the addresses the runtime gave the pod.
pub fn enroll_with_addrs(
    dp: &mut Dataplane,
    netns_path: &Path,
    uid: &PodUid,
    workload: &Workload,
    options: &PodOptions,
    addrs: &PodAddrs,
) -> Result<Enrolled, EnrollError> {
    let a = attach_pod(
        dp,
        netns_path,
        uid,
        workload,
        options,
        addrs,
        AppStarted::Maybe,
    )?;
    if let Err(e) = take_over(&a.netns) {
        back_out(dp, &a.netns, a.cookie);
        return Err(e);
    }
    register(dp.maps_mut(), &a.netns, a.cookie, None)
}

/// A pod whose capture was just attached (`Pending`).
pub struct Attached {
    pub netns: Netns,
    pub cookie: u64,
    /// Host-side veths left without the host-side program because another
    /// tool's qdisc holds their hook ("IFACE (KIND)"): the node's own
    /// connections to the pod are captured.
    pub host_hooks_held: Vec<String>,
    /// What publishing its addresses left out (past the cap, another
    /// pod's) or took from another pod.
    pub addrs: Published,
}

/// Attaches capture to a pod netns and records the pod as `Pending`: from its
/// first link on, its new connections fail closed until listeners are
/// registered. Returns the open netns and its cookie. The pod may still
/// carry istio-cni's rules: [`take_over`] comes next. `addrs`: which
/// addresses are the pod's; `started`: whether its app may run already.
pub fn attach_pod(
    dp: &mut Dataplane,
    netns_path: &Path,
    uid: &PodUid,
    workload: &Workload,
    options: &PodOptions,
    addrs: &PodAddrs,
    started: AppStarted,
) -> Result<Attached, EnrollError> {
    unless_retired(dp)?;
    let path = netns_path
        .to_str()
        .filter(|p| p.len() < NETNS_PATH_LEN)
        .ok_or_else(|| EnrollError::BadPath(netns_path.display().to_string()))?
        .to_owned();
    let netns = Netns::open(netns_path)?;
    if let Some(why) = netns.host_like() {
        return Err(EnrollError::HostNetns { path, why });
    }
    // The reroute program tells a pod by its listener's netns alone.
    if !options.reroute.is_empty() && !dp.features().netns_cookie_in_tc {
        return Err(EnrollError::RerouteUnsupported(options.reroute.join(",")));
    }
    let view = PodView::open(&netns)?;
    if view.ifaces.is_empty() {
        return Err(EnrollError::NoInterface(path));
    }
    let cookie = view.cookie;
    if let Some(cookie) = dp.maps().find_uid(uid) {
        return Err(EnrollError::AlreadyEnrolled {
            uid: uid.clone(),
            cookie,
        });
    }
    if dp.maps().entry(cookie).is_some() {
        let owner = dp.maps().meta(cookie).map(|m| m.uid).unwrap_or_default();
        return Err(EnrollError::NetnsTaken { path, uid: owner });
    }
    // Pins without state can only be the remains of an interrupted enroll;
    // a fresh pod has none, and skips the teardown's netlink round trips.
    if dp.pins().pod(cookie).exists() {
        teardown_in(dp, &netns, cookie)?;
    }
    let attached = attach::attach(
        dp, &netns, &view, uid, &path, workload, options, addrs, started,
    );
    let (host_hooks_held, addrs) = match attached {
        Ok(a) => a,
        Err(e) => {
            let _ = teardown_in(dp, &netns, cookie);
            return Err(e);
        }
    };
    Ok(Attached {
        netns,
        cookie,
        host_hooks_held,
        addrs,
    })
}

/// Takes a pod over from istio-cni, if it was istio-cni's: with sluice's
/// capture attached ([`attach_pod`]), Istio's in-pod rules go without a
/// moment uncaptured. Returns the iptables tools whose rules were removed
/// (empty: not istio-cni's pod). Runs those tools (seconds at worst, killed
/// after [`migrate::CHILD_TIMEOUT`]): the agent calls it without the
/// dataplane, so other pods' enrollments go on meanwhile. On an error the
/// caller backs the pod out ([`back_out`]): both rule sets at once would
/// misroute outbound traffic, so the pod is left to Istio's rules, with the
/// reason.
pub fn take_over(netns: &Netns) -> Result<Vec<&'static str>, EnrollError> {
    let tools = migrate::istio_rules(netns)?;
    if !tools.is_empty() {
        migrate::remove_istio_rules(netns, &tools)?;
        tracing::info!(
            ?tools,
            "took the pod over from istio-cni: its in-pod iptables rules are removed"
        );
    }
    Ok(tools)
}

/// Removes everything [`attach_pod`] attached for the pod of `cookie`,
/// whatever the pod's state: an enrollment that could not finish.
/// Best effort: what cannot be removed now, the next start's repair finds.
pub fn back_out(dp: &mut Dataplane, netns: &Netns, cookie: u64) {
    if let Err(e) = teardown_in(dp, netns, cookie) {
        tracing::warn!(cookie, error = %e, "backing out an enrollment left something behind");
    }
}

/// Puts exclusions `x` in force for enrolled pod `cookie` (for its new
/// connections; open ones keep their path), and on the local route its
/// rules with them. Returns whether anything changed.
pub fn set_exclusions(
    dp: &mut Dataplane,
    cookie: u64,
    x: &crate::exclusions::PodExclusions,
) -> Result<bool, EnrollError> {
    if !dp.set_exclusions(cookie, x)? {
        return Ok(false);
    }
    if dp.maps().local_route(cookie).is_some() {
        let netns = open_pod_netns(dp.maps(), cookie)?;
        let view = PodView::open(&netns)?;
        let sources = crate::podnet::localroute::sources(&view);
        crate::podnet::localroute::replace_rules(&view.nl, view.lo, &sources, x)?;
    }
    Ok(true)
}

/// With the node's local route off (`--local-route=false` after it was
/// on), takes every enrolled pod off it: its rules and route first (its TCP
/// takes the interface's route, captured there), then its entry; `lo`'s
/// egress program, idle without the entry, goes at its teardown. Returns
/// how many pods left it; a pod whose netns cannot be entered now keeps it
/// (logged; the next start tries again).
pub fn leave_local_route(dp: &mut Dataplane) -> usize {
    if dp.local_route() {
        return 0;
    }
    let on: Vec<u64> = dp
        .maps()
        .states()
        .into_iter()
        .map(|(cookie, _)| cookie)
        .filter(|c| dp.maps().local_route(*c).is_some())
        .collect();
    let mut left = 0;
    for cookie in on {
        let taken_off = open_pod_netns_unless_gone(dp.maps(), cookie)
            .map_err(|e| e.to_string())
            .and_then(|netns| match netns {
                Some(ns) => ns
                    .run(|| crate::podnet::localroute::remove(true))
                    .map_err(|e| e.to_string())?
                    .map_err(|e| e.to_string()),
                None => Ok(()),
            })
            .and_then(|()| {
                dp.maps_mut()
                    .set_local_route(cookie, None)
                    .map_err(|e| e.to_string())
            });
        match taken_off {
            Ok(()) => left += 1,
            Err(e) => tracing::warn!(cookie, error = %e, "the pod stays on the local route"),
        }
    }
    left
}

/// Re-registers the listeners of an enrolled pod (after ztunnel (re)started).
pub fn register_uid(dp: &mut Dataplane, uid: &PodUid) -> Result<Enrolled, EnrollError> {
    let cookie = dp
        .maps()
        .find_uid(uid)
        .ok_or_else(|| EnrollError::UnknownPod(uid.clone()))?;
    let netns = open_pod_netns(dp.maps(), cookie)?;
    refresh_addrs(dp.maps_mut(), &netns, cookie)?;
    register(dp.maps_mut(), &netns, cookie, None)
}

/// Unenrolls a pod: nothing of it remains (links, pins, routes, map entries).
/// `node`: the node's netns, where cls_bpf attachment has a filter on the
/// host side of the pod's veth (without it, that inert filter goes with the
/// veth).
pub fn unenroll(
    pins: &Pins,
    maps: &mut Maps,
    node: Option<&hostside::Node>,
    uid: &PodUid,
) -> Result<(), EnrollError> {
    let cookie = maps
        .find_uid(uid)
        .ok_or_else(|| EnrollError::UnknownPod(uid.clone()))?;
    // The netns may be gone with the pod (its routes went with it), or its
    // path may now name another netns: only touch the one with our cookie.
    let netns = open_pod_netns_unless_gone(maps, cookie)?;
    teardown(pins, maps, netns.as_ref(), node, cookie)
}

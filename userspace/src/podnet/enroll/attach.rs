//! Attaching a pod's capture, one durable step at a time: its state entry
//! (`Pending`) and options, its addresses, its routes, then its links.

use std::{fs, net::IpAddr};

use crate::{
    dataplane::{
        loader::Dataplane,
        state::{boottime_ns, Published},
        tcfilter,
    },
    fault::crash_point,
    options::PodOptions,
    podnet::{
        localroute::{self, AppStarted},
        netns::Netns,
        podlinks::{self, expected_links, LinkSpec},
        podview::PodView,
        routes,
    },
    uid::PodUid,
    workload::Workload,
};

use super::{
    addrs::{publish_addrs, PodAddrs},
    error::EnrollError,
    hostpeers::host_peers,
    links::attach_link,
};

/// Attaches the pod's capture, one step at a time; every step is durable
/// before the next begins (a link is pinned right after its attach), so a
/// process killed at any point leaves a prefix of these steps, which the
/// next agent completes (`repair`). The state entry comes first and says
/// `Pending`: from their first link on, the programs fail closed for the
/// pod. Returns the host-side hooks held by another tool's qdisc, and what
/// publishing its addresses (`addrs`) left out or took.
#[allow(clippy::too_many_arguments)]
pub fn attach(
    dp: &mut Dataplane,
    netns: &Netns,
    view: &PodView,
    uid: &PodUid,
    path: &str,
    workload: &Workload,
    options: &PodOptions,
    addrs: &PodAddrs,
    started: AppStarted,
) -> Result<(Vec<String>, Published), EnrollError> {
    let cookie = view.cookie;
    let node_dns = dp.dns_capture();
    let local_route = local_route(dp.local_route(), netns, view, options, started);
    let maps = dp.maps_mut();
    maps.attach(cookie, uid, path, workload, boottime_ns())?;
    // Before any link: a pod that bypasses inbound capture never has its
    // inbound captured. (Killed right here, the pod is enrolled without its
    // options: captured fully, the fail-closed side.) The local route's
    // entry too: its rules come last, once `lo`'s egress program is there.
    maps.set_options(cookie, options, node_dns)?;
    maps.set_local_route(cookie, local_route.as_ref().map(|(uplink, _)| *uplink))?;
    crash_point("enroll:state");
    let published = publish_addrs(maps, netns, cookie, addrs, &view.addrs)?;
    crash_point("enroll:addrs");
    // The sysctl is a file of the pod's /proc/sys: the one step that enters
    // the netns; the rest goes over the view's socket.
    netns.run(|| routes::set_migrate_req(true))??;
    let indexes: Vec<u32> = view.ifaces.iter().map(|i| i.index).collect();
    routes::install_over(&view.nl, &indexes, view.lo, view.ipv6)?;
    crash_point("enroll:routes");
    let held = attach_links(dp, netns, view, options, local_route.is_some())?;
    if let Some((_, sources)) = &local_route {
        // A route the kernel refuses leaves the pod on its interface's
        // route, enrolled all the same.
        let installed = netns
            .run(|| localroute::accept_marks(true))
            .map_err(EnrollError::from)
            .and_then(|r| Ok(r?))
            .and_then(|()| {
                Ok(localroute::install_over(
                    &view.nl,
                    view.lo,
                    sources,
                    &options.exclusions,
                )?)
            });
        if let Err(e) = installed {
            tracing::warn!(error = %e, "the pod's TCP keeps its interface's route");
            netns.run(|| localroute::remove(true))??;
            dp.maps_mut().set_local_route(view.cookie, None)?;
        }
        crash_point("enroll:local-route");
    }
    Ok((held, published))
}

/// The pod's interface index and the local route's sources, where the
/// node offers the local route (`offered`) and the pod can take it.
fn local_route(
    offered: bool,
    netns: &Netns,
    view: &PodView,
    options: &PodOptions,
    started: AppStarted,
) -> Option<(u32, Vec<IpAddr>)> {
    if !offered {
        return None;
    }
    localroute::offer(netns, view, options, started)
        .inspect_err(|why| tracing::info!("the pod's TCP keeps its interface's route: {why}"))
        .ok()
}

/// The pod's links, each pinned as soon as attached. Returns the host-side
/// hooks left to another tool's qdisc ("IFACE (KIND)").
fn attach_links(
    dp: &mut Dataplane,
    netns: &Netns,
    view: &PodView,
    options: &PodOptions,
    local_route: bool,
) -> Result<Vec<String>, EnrollError> {
    let ifaces = &view.names();
    let dir = dp.pins().pod(view.cookie);
    fs::create_dir_all(&dir).map_err(|source| EnrollError::Io {
        what: format!("creating {}", dir.display()),
        source,
    })?;
    // With tcx (`--tc-attach tcx`) each attach swaps the device's program
    // array and waits for an RCU grace period under RTNL (≈ 10–20 ms here);
    // cls_bpf filters (the default) need none.
    let (peers, mut held) = host_peers(dp, view.cookie, netns, Some(view), ifaces, true);
    let l3 = &view.l3_names();
    if let Some(i) = podlinks::reroute_on_l3(l3, &options.reroute) {
        return Err(EnrollError::RerouteOnL3(i.clone()));
    }
    for spec in expected_links(ifaces, l3, &peers, &options.reroute, local_route) {
        match attach_link(dp, netns, Some(view), &dir, &spec) {
            // Taken since it was asked: the host side only costs the probe
            // exemption, never the pod.
            Err(EnrollError::Attach { source, .. })
                if matches!(spec, LinkSpec::Host(_)) && tcfilter::is_hook_taken(&source) =>
            {
                if let LinkSpec::Host(p) = &spec {
                    held.push(format!("{} (not clsact)", p.host_iface));
                }
                continue;
            }
            r => r?,
        }
        crash_point(&format!("enroll:link:{}", spec.pin_name()));
    }
    Ok(held)
}

//! Verifying an enrolled pod and completing what is missing: what an
//! agent's start does for every pod, and what a CNI CHECK asks (read only).

use std::fs;

use sluice_common::PodState;

use crate::{
    dataplane::{
        loader::{Dataplane, Pins},
        migrate,
        state::Maps,
    },
    podnet::{
        hostside,
        netns::Netns,
        podlinks::{self, expected_links, LinkSpec},
        routes,
    },
};

use super::{
    addrs::refresh_addrs,
    error::EnrollError,
    hostpeers::host_peers,
    links::{attach_link, attached},
    reopen::{open_pod_netns, pod_interfaces},
    teardown::{remove_stateless, teardown},
};

/// What [`repair`] found and did for one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Repair {
    /// Every link, route and address entry was in place.
    Complete,
    /// Something was missing and is in place now.
    Repaired {
        /// Links attached again (pin names).
        relinked: Vec<String>,
        /// istio-cni's rules an interrupted take-over left, removed (by the
        /// tools that listed them).
        istio_rules: Vec<&'static str>,
    },
    /// The pod was being torn down (`Draining`): the teardown is finished.
    TornDown,
}

/// Verifies an enrolled pod link by link and completes what is missing:
/// routes and sysctls (idempotent), its addresses, and every link its
/// current interfaces call for; with `takeover`, also istio-cni's in-pod
/// rules that an enrollment killed before its last step left behind (a
/// process spawn per pod: the agent asks for it at start only). A pod caught
/// in its teardown (`Draining`) is torn down completely instead: it never
/// comes back to life.
pub fn repair(dp: &mut Dataplane, cookie: u64, takeover: bool) -> Result<Repair, EnrollError> {
    let draining = dp.maps().entry(cookie).and_then(|e| e.state()) == Some(PodState::Draining);
    if draining {
        let netns = open_pod_netns(dp.maps(), cookie).ok();
        let (pins, maps, node) = dp.parts_mut();
        teardown(pins, maps, netns.as_ref(), node, cookie)?;
        return Ok(Repair::TornDown);
    }
    let netns = open_pod_netns(dp.maps(), cookie)?;
    let path = dp.maps().meta(cookie).map(|m| m.netns).unwrap_or_default();
    refresh_addrs(dp.maps_mut(), &netns, cookie)?;
    let ifaces = pod_interfaces(&netns, &path)?;
    netns.run(|| routes::install(&ifaces))??;
    let relinked = relink(dp, &netns, cookie, &ifaces)?;
    let mut istio_rules = Vec::new();
    if takeover {
        istio_rules = migrate::istio_rules(&netns)?;
        if !istio_rules.is_empty() {
            migrate::remove_istio_rules(&netns, &istio_rules)?;
        }
    }
    Ok(if relinked.is_empty() && istio_rules.is_empty() {
        Repair::Complete
    } else {
        Repair::Repaired {
            relinked,
            istio_rules,
        }
    })
}

/// Attaches every link the pod's interfaces call for that is not attached;
/// returns their pin names.
fn relink(
    dp: &mut Dataplane,
    netns: &Netns,
    cookie: u64,
    ifaces: &[String],
) -> Result<Vec<String>, EnrollError> {
    let dir = dp.pins().pod(cookie);
    fs::create_dir_all(&dir).map_err(|source| EnrollError::Io {
        what: format!("creating {}", dir.display()),
        source,
    })?;
    let mut relinked = Vec::new();
    for spec in links_called_for(dp, netns, cookie, ifaces) {
        let pin_path = dir.join(spec.pin_name());
        if attached(dp, netns, &spec, &pin_path) {
            continue;
        }
        // A pin that does not open as a link is debris.
        let _ = fs::remove_file(&pin_path);
        attach_link(dp, netns, None, &dir, &spec)?;
        relinked.push(spec.pin_name());
    }
    Ok(relinked)
}

/// The links the pod's interfaces (and options) call for now.
fn links_called_for(
    dp: &Dataplane,
    netns: &Netns,
    cookie: u64,
    ifaces: &[String],
) -> Vec<LinkSpec> {
    let (peers, _) = host_peers(dp, netns, None, ifaces);
    let reroute = dp.maps().options(cookie).reroute;
    let l3 = podlinks::l3_of(netns, ifaces);
    expected_links(ifaces, &l3, &peers, &reroute)
}

/// The links a pod should have and has not (read only: nothing attached):
/// what a CNI CHECK reports. Empty when its capture is complete.
pub fn missing_links(dp: &Dataplane, cookie: u64) -> Result<Vec<String>, EnrollError> {
    let netns = open_pod_netns(dp.maps(), cookie)?;
    let path = dp.maps().meta(cookie).map(|m| m.netns).unwrap_or_default();
    let dir = dp.pins().pod(cookie);
    let ifaces = pod_interfaces(&netns, &path)?;
    Ok(links_called_for(dp, &netns, cookie, &ifaces)
        .into_iter()
        .filter(|spec| !attached(dp, &netns, spec, &dir.join(spec.pin_name())))
        .map(|spec| spec.pin_name())
        .collect())
}

/// Removes the pin directories of pods that have no state entry (maps lost
/// or replaced while pods were enrolled) and what they stand for. `node` as
/// for `unenroll`. Returns how many there were.
pub fn remove_orphan_pins(
    pins: &Pins,
    maps: &Maps,
    node: Option<&hostside::Node>,
) -> Result<usize, EnrollError> {
    let known = maps.cookies();
    let mut n = 0;
    if let Ok(entries) = fs::read_dir(pins.pods()) {
        for e in entries.flatten() {
            let Some(cookie) = e.file_name().to_str().and_then(|s| s.parse::<u64>().ok()) else {
                continue;
            };
            if !known.contains(&cookie) {
                remove_stateless(pins, node, cookie)?;
                n += 1;
            }
        }
    }
    Ok(n)
}

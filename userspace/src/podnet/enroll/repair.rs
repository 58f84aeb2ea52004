//! Verifying an enrolled pod and completing what is missing: what an
//! agent's start does for every pod, and what a CNI CHECK asks (read only).

use std::{collections::HashSet, fs, path::PathBuf};

use sluice_common::PodState;

use crate::{
    dataplane::{
        loader::{Dataplane, Pins},
        migrate,
        state::Maps,
        tcfilter,
    },
    podnet::{
        hostside, localroute,
        netns::Netns,
        podlinks::{self, expected_links, LinkSpec},
        podview::PodView,
        routes,
    },
};

use super::{
    addrs::refresh_addrs,
    error::{unless_retired, EnrollError},
    hostpeers::host_peers,
    links::{
        attach_link, attached, attached_seen_from, tcx_standing, unseat_if_behind, TcxStanding,
    },
    reopen::{open_pod_netns, open_pod_netns_unless_gone, pod_interfaces},
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

/// What a repair's survey needs to know of a pod, copied under the
/// node-wide lock.
pub struct SurveyPlan {
    cookie: u64,
    path: String,
    dir: PathBuf,
    reroute: Vec<String>,
    local_route: bool,
}

/// What a repair reads of a pod without the node-wide lock: its link dump
/// (interfaces, their kinds and `accept_local`, over a socket left in its
/// netns) and which of its pod-side links were attached when read. That is
/// the part of a repair linear in the pod's interfaces (a pin and a filter
/// query per link, about ten syscalls each); held under the lock, one pod's
/// many interfaces held every other pod's enrollment (issue 38, case 5).
pub struct Survey {
    cookie: u64,
    path: String,
    netns: Netns,
    view: PodView,
    /// Pin names of the pod-side links found attached.
    attached: HashSet<String>,
}

impl Survey {
    /// Whether this survey read the netns `cookie`'s pod has now.
    pub fn is_of(&self, dp: &Dataplane, cookie: u64) -> bool {
        self.cookie == cookie && dp.maps().meta(cookie).is_some_and(|m| m.netns == self.path)
    }
}

/// The plan of a pod's survey; `None` for a pod not enrolled or being torn
/// down (its repair surveys nothing).
pub fn survey_plan(dp: &Dataplane, cookie: u64) -> Option<SurveyPlan> {
    if dp.maps().entry(cookie)?.state()? == PodState::Draining {
        return None;
    }
    Some(SurveyPlan {
        cookie,
        path: dp.maps().meta(cookie)?.netns,
        dir: dp.pins().pod(cookie),
        reroute: dp.maps().options(cookie).reroute,
        local_route: dp.maps().local_route(cookie).is_some(),
    })
}

/// Reads what [`repair_surveyed`] needs of the pod's netns (no dataplane,
/// no writes): run it without the node-wide lock.
pub fn survey(plan: &SurveyPlan) -> Result<Survey, EnrollError> {
    crate::fault::pause_point("survey");
    let (netns, view) = read_pod(plan.cookie, &plan.path)?;
    // Pod-side links only (no peers asked): the node's netns is not needed.
    let (names, l3) = (view.names(), view.l3_names());
    let attached = expected_links(&names, &l3, &[], &plan.reroute, plan.local_route)
        .into_iter()
        .filter(|spec| {
            attached_seen_from(
                &netns,
                None,
                Some(&view),
                spec,
                &plan.dir.join(spec.pin_name()),
            )
        })
        .map(|spec| spec.pin_name())
        .collect();
    Ok(Survey {
        cookie: plan.cookie,
        path: plan.path.clone(),
        netns,
        view,
        attached,
    })
}

/// The pod's netns at `path`, checked to be the one of `cookie`, and its
/// link and address dumps.
fn read_pod(cookie: u64, path: &str) -> Result<(Netns, PodView), EnrollError> {
    let netns = Netns::open(std::path::Path::new(path))?;
    if netns.cookie()? != cookie {
        return Err(EnrollError::NetnsReplaced(path.to_owned()));
    }
    let view = PodView::open(&netns)?;
    if view.ifaces.is_empty() {
        return Err(EnrollError::NoInterface(path.to_owned()));
    }
    Ok((netns, view))
}

/// Verifies an enrolled pod link by link and completes what is missing:
/// routes and sysctls (idempotent), its addresses, and every link its
/// current interfaces call for; with `takeover`, also istio-cni's in-pod
/// rules that an enrollment killed before its last step left behind (a
/// process spawn per pod: the agent asks for it at start only). A pod caught
/// in its teardown (`Draining`) is torn down completely instead: it never
/// comes back to life.
pub fn repair(dp: &mut Dataplane, cookie: u64, takeover: bool) -> Result<Repair, EnrollError> {
    repair_surveyed(dp, cookie, takeover, None)
}

/// [`repair`] with what a [`survey`] of the pod read without the lock: the
/// interfaces it found, and no second look at the pod-side links it found
/// attached (those it found missing are looked at again). A survey of
/// another netns than the pod's now is ignored.
pub fn repair_surveyed(
    dp: &mut Dataplane,
    cookie: u64,
    takeover: bool,
    survey: Option<&Survey>,
) -> Result<Repair, EnrollError> {
    unless_retired(dp)?;
    let draining = dp.maps().entry(cookie).and_then(|e| e.state()) == Some(PodState::Draining);
    if draining {
        let netns = open_pod_netns_unless_gone(dp.maps(), cookie)?;
        let (pins, maps, node) = dp.parts_mut();
        teardown(pins, maps, netns.as_ref(), node, cookie)?;
        return Ok(Repair::TornDown);
    }
    let read_now;
    let survey = match survey.filter(|s| s.is_of(dp, cookie)) {
        Some(s) => s,
        None => {
            let path = dp.maps().meta(cookie).map(|m| m.netns).unwrap_or_default();
            let (netns, view) = read_pod(cookie, &path)?;
            read_now = Survey {
                cookie,
                path,
                netns,
                view,
                attached: HashSet::new(),
            };
            &read_now
        }
    };
    let (netns, view) = (&survey.netns, &survey.view);
    refresh_addrs(dp.maps_mut(), netns, cookie)?;
    // Routes and sysctls: `accept_local` only where the dump found it off.
    let lacking: Vec<u32> = view
        .ifaces
        .iter()
        .filter(|i| !i.accept_local)
        .map(|i| i.index)
        .collect();
    netns.run(|| routes::set_migrate_req(true))??;
    routes::install_over(&view.nl, &lacking, view.lo, view.ipv6)?;
    let relinked = relink(dp, survey)?;
    repair_local_route(dp, cookie, netns, view)?;
    let mut istio_rules = Vec::new();
    if takeover {
        istio_rules = migrate::istio_rules(netns)?;
        if !istio_rules.is_empty() {
            migrate::remove_istio_rules(netns, &istio_rules)?;
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

/// The local route's rules and sysctl, once `lo`'s egress program is there
/// (a pod on it). An interface it left by that is gone (replaced: another
/// index) is found again, or, when the pod no longer has one interface to
/// leave by, the pod is taken off the local route (its TCP takes the
/// interface's route, captured there).
fn repair_local_route(
    dp: &mut Dataplane,
    cookie: u64,
    netns: &Netns,
    view: &PodView,
) -> Result<(), EnrollError> {
    let Some(uplink) = dp.maps().local_route(cookie) else {
        return Ok(());
    };
    let options = dp.maps().options(cookie);
    let uplink = match view.ifaces.iter().any(|i| i.index == uplink) {
        true => Ok(uplink),
        false => localroute::uplink(view, &options).map_err(str::to_owned),
    };
    let uplink = uplink.and_then(|i| match dp.local_route() {
        true => Ok(i),
        false => Err("the node's local route is off".to_owned()),
    });
    let installed = uplink.and_then(|i| {
        let e = |e: &dyn std::fmt::Display| e.to_string();
        dp.maps_mut()
            .set_local_route(cookie, Some(i))
            .map_err(|x| e(&x))?;
        netns
            .run(|| localroute::accept_marks(true))
            .map_err(|x| e(&x))?
            .map_err(|x| e(&x))?;
        let sources = localroute::sources(view);
        localroute::install_over(&view.nl, view.lo, &sources, &options.exclusions)
            .map_err(|x| e(&x))
    });
    if let Err(why) = installed {
        tracing::warn!("the pod's TCP leaves the local route: {why}");
        netns.run(|| localroute::remove(true))??;
        dp.maps_mut().set_local_route(cookie, None)?;
    }
    Ok(())
}

/// Attaches every link the pod's interfaces call for that is not attached;
/// returns their pin names.
fn relink(dp: &mut Dataplane, survey: &Survey) -> Result<Vec<String>, EnrollError> {
    let (netns, cookie) = (&survey.netns, survey.cookie);
    let dir = dp.pins().pod(cookie);
    fs::create_dir_all(&dir).map_err(|source| EnrollError::Io {
        what: format!("creating {}", dir.display()),
        source,
    })?;
    let mut relinked = Vec::new();
    let view = &survey.view;
    for spec in links_called_for(
        dp,
        netns,
        cookie,
        Some(view),
        &view.names(),
        &view.l3_names(),
    ) {
        let pin_path = dir.join(spec.pin_name());
        if survey.attached.contains(&spec.pin_name()) || attached(dp, netns, &spec, &pin_path) {
            continue;
        }
        // A pin that does not open as a link is debris. One this process
        // cannot open now (out of descriptors) may hold a live link, which
        // removing it would detach: try again later.
        match tcfilter::pinned_or_busy(&pin_path) {
            Err(source) => {
                return Err(EnrollError::Io {
                    what: format!("reading the pin {}", pin_path.display()),
                    source,
                })
            }
            Ok(Some(tcfilter::Pinned::Link)) => {
                match tcx_standing(netns, dp.node().map(|n| &n.netns), &spec, &pin_path) {
                    // Its pin is debris: removed below, and attached anew.
                    Some(TcxStanding::Detached) => {
                        tracing::warn!(link = %spec.pin_name(), "sluice's tcx link was detached (its interface replaced?): attaching it again")
                    }
                    // Another tool's tcx program runs ahead of sluice's link:
                    // sluice's is detached (explicitly: the pin may not be
                    // its only holder) and attached again, first. Packets
                    // meeting the hook in between skip sluice's program;
                    // with the other program first they could skip it
                    // anyway. Never on a cls_bpf node, where sluice's
                    // filter could not run ahead of it either.
                    Some(TcxStanding::Behind(ahead))
                        if dp.tc_attach() == crate::dataplane::features::TcAttach::Tcx =>
                    {
                        tracing::warn!(link = %spec.pin_name(), ahead, "another tool's tcx program ran ahead of sluice's: putting sluice's first again");
                        crate::dataplane::relink::detach(&pin_path).map_err(|source| {
                            EnrollError::Io {
                                what: format!("detaching {}", pin_path.display()),
                                source,
                            }
                        })?;
                    }
                    _ => continue,
                }
            }
            Ok(_) => {}
        }
        let _ = fs::remove_file(&pin_path);
        unseat_if_behind(dp, netns, &spec);
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
    view: Option<&PodView>,
    ifaces: &[String],
    l3: &[String],
) -> Vec<LinkSpec> {
    let (peers, _) = host_peers(dp, cookie, netns, view, ifaces, false);
    let reroute = dp.maps().options(cookie).reroute;
    let local_route = dp.maps().local_route(cookie).is_some();
    expected_links(ifaces, l3, &peers, &reroute, local_route)
}

/// [`missing_links`] after a repair that used `survey` (of this pod: see
/// [`Survey::is_of`]): the pod-side links it found attached are not looked
/// at again, so what is left for the node-wide lock is in proportion to
/// what is missing.
pub fn missing_after(dp: &Dataplane, survey: &Survey) -> Vec<String> {
    let (netns, view) = (&survey.netns, &survey.view);
    let dir = dp.pins().pod(survey.cookie);
    let (names, l3) = (view.names(), view.l3_names());
    links_called_for(dp, netns, survey.cookie, Some(view), &names, &l3)
        .into_iter()
        .map(|spec| (spec.pin_name(), spec))
        .filter(|(pin, spec)| {
            !survey.attached.contains(pin) && !attached(dp, netns, spec, &dir.join(pin))
        })
        .map(|(pin, _)| pin)
        .collect()
}

/// The links a pod should have and has not (read only: nothing attached):
/// what a CNI CHECK reports. Empty when its capture is complete.
pub fn missing_links(dp: &Dataplane, cookie: u64) -> Result<Vec<String>, EnrollError> {
    let netns = open_pod_netns(dp.maps(), cookie)?;
    let path = dp.maps().meta(cookie).map(|m| m.netns).unwrap_or_default();
    let dir = dp.pins().pod(cookie);
    let ifaces = pod_interfaces(&netns, &path)?;
    let l3 = podlinks::l3_of(&netns, &ifaces);
    Ok(links_called_for(dp, &netns, cookie, None, &ifaces, &l3)
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

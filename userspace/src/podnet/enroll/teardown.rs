//! Removing everything of one pod: `Draining` first (fail closed), then its
//! links, filters and routes, then its entries. Also the rollback of an
//! enrollment, and the cleanup of pins whose state is lost.

use std::{cell::OnceCell, fs};

use aya::programs::links::PinnedLink;

use crate::{
    dataplane::{
        loader::{Dataplane, Pins},
        state::{boottime_ns, Maps},
        tcfilter,
    },
    fault::crash_point,
    lifecycle::Event,
    podnet::{
        hostside::{self, HostPeer},
        localroute,
        netns::{interfaces, Netns},
        podlinks::{self, LinkSpec, Side},
        routes,
    },
};

use super::error::EnrollError;

/// Removes everything of one pod. Idempotent; also the rollback of `enroll`.
pub fn teardown(
    pins: &Pins,
    maps: &mut Maps,
    netns: Option<&Netns>,
    node: Option<&hostside::Node>,
    cookie: u64,
) -> Result<(), EnrollError> {
    // Fail closed while links go away one by one; `Draining` is final: a
    // teardown cut short is finished by the next agent (`repair`).
    // (Debris without a readable state has nothing to fail closed.)
    maps.apply(cookie, Event::Drain, boottime_ns())?;
    crash_point("unenroll:draining");
    // Off: never on it (its entry comes before any rule).
    let local_route = Some(maps.local_route(cookie).is_some());
    remove_pod_side(pins, netns, node, cookie, local_route)?;
    crash_point("unenroll:routes");
    maps.apply(cookie, Event::TornDown, 0)?;
    Ok(())
}

/// [`teardown`] of a pod whose netns is open, with the dataplane's node.
pub fn teardown_in(dp: &mut Dataplane, netns: &Netns, cookie: u64) -> Result<(), EnrollError> {
    let (pins, maps, node) = dp.parts_mut();
    teardown(pins, maps, Some(netns), node, cookie)
}

/// Removes a pod's links (and their pins) and, in its netns when that is
/// open, its filters and routes: all of a teardown but the state entry.
/// `local_route`: whether the pod was on the local route (`None`: not
/// known, its rules are looked for).
fn remove_pod_side(
    pins: &Pins,
    netns: Option<&Netns>,
    node: Option<&hostside::Node>,
    cookie: u64,
    local_route: Option<bool>,
) -> Result<(), EnrollError> {
    // The interfaces say which filters to remove: an error here (out of
    // descriptors, say) must fail the teardown, not leave them running.
    let ifaces: Vec<String> = match netns {
        Some(ns) => ns
            .run(interfaces)?
            .map_err(|source| EnrollError::Io {
                what: "listing the pod's interfaces".into(),
                source,
            })?
            .into_iter()
            .filter(|i| i != "lo")
            .collect(),
        None => Vec::new(),
    };
    // The local route's rules before `lo`'s egress program: no SYN takes
    // the route without its verdict.
    if let Some(netns) = netns.filter(|_| local_route != Some(false)) {
        netns.run(|| localroute::remove(local_route == Some(true)))??;
    }
    remove_links(pins, cookie, &Filters::new(netns, node, &ifaces))?;
    if let Some(netns) = netns {
        netns.run(|| routes::remove(&ifaces))??;
    }
    Ok(())
}

/// Removes what is left of a pod that has pins but no state entry (maps
/// lost or unreadable, an uninstall of another version's pins): its links
/// go with their pins, and its filters and routes with them when its netns
/// still exists, found by the cookie its pin directory is named after (cls_bpf
/// filters are no BPF objects: they run on until removed in their netns).
pub fn remove_stateless(
    pins: &Pins,
    node: Option<&hostside::Node>,
    cookie: u64,
) -> Result<(), EnrollError> {
    let netns = crate::podnet::podns::find_by_cookie(cookie);
    if netns.is_none() {
        tracing::debug!(
            cookie,
            "no netns has this cookie any more: its filters went with it"
        );
    }
    remove_pod_side(pins, netns.as_ref(), node, cookie, None)
}

/// What [`remove_links`] needs to remove a pod's cls_bpf filters: the netns
/// they are in and the pod's interfaces as they are now, against which each
/// record's name is matched. A filter on an interface that is gone went
/// with it.
struct Filters<'a> {
    netns: Option<&'a Netns>,
    node: Option<&'a hostside::Node>,
    ifaces: &'a [String],
    /// The host sides of the pod's interfaces, looked up at the first
    /// host-side record (most pods have none); the error of that lookup.
    peers: OnceCell<Result<Vec<HostPeer>, String>>,
}

impl<'a> Filters<'a> {
    fn new(
        netns: Option<&'a Netns>,
        node: Option<&'a hostside::Node>,
        ifaces: &'a [String],
    ) -> Self {
        Self {
            netns,
            node,
            ifaces,
            peers: Default::default(),
        }
    }

    /// The link the record `name` stands for, if its interface is still
    /// there. A host side that cannot be looked up (out of descriptors,
    /// say) is an error: read as "no host side", the record of a filter
    /// still running on the node would be dropped.
    fn spec(&self, name: &str) -> Result<Option<LinkSpec>, EnrollError> {
        let named = |s: &LinkSpec| s.pin_name() == name;
        if let Some(s) = podlinks::possible_pod_links(self.ifaces)
            .into_iter()
            .find(named)
        {
            return Ok(Some(s));
        }
        let peers = self.peers.get_or_init(|| match (self.netns, self.node) {
            (Some(ns), Some(node)) => {
                hostside::peers(ns, node, self.ifaces).map_err(|e| e.to_string())
            }
            _ => Ok(Vec::new()),
        });
        let peers = peers.as_ref().map_err(|reason| EnrollError::Io {
            what: format!("looking up the host side of the record {name}"),
            source: std::io::Error::other(reason.clone()),
        })?;
        Ok(peers.iter().cloned().map(LinkSpec::Host).find(named))
    }

    /// Removes the filter the record `name` stands for, where it can be
    /// reached.
    fn detach(&self, name: &str) -> Result<(), EnrollError> {
        let Some(spec) = self.spec(name)? else {
            return Ok(());
        };
        let Some(hook) = spec.tc_hook() else {
            return Ok(());
        };
        let ns = match hook.side {
            Side::Pod => self.netns,
            Side::Node => self.node.map(|n| &n.netns),
        };
        let (iface, kind) = (hook.iface, hook.kind);
        let Some(ns) = ns else { return Ok(()) };
        ns.run(|| tcfilter::detach(iface, kind))?
            .map_err(|source| EnrollError::Attach {
                what: format!("removing the tc {kind:?} filter on {iface}"),
                source,
            })
    }
}

/// Unpins (and so detaches) every link of a pod and removes its directory.
/// sk_lookup goes first: while the tc programs of a `Draining` pod still drop
/// new SYNs from outside, connections over lo (ztunnel's to the app, for a
/// connection it already accepted) must not meet an sk_lookup whose `lo`
/// hint is already gone, which would refuse them.
fn remove_links(pins: &Pins, cookie: u64, filters: &Filters<'_>) -> Result<(), EnrollError> {
    let dir = pins.pod(cookie);
    if let Ok(entries) = fs::read_dir(&dir) {
        let mut entries: Vec<_> = entries.flatten().collect();
        entries.sort_by_key(|e| e.file_name() != "steer");
        for e in entries {
            let pinned = tcfilter::pinned_or_busy(&e.path()).map_err(|source| EnrollError::Io {
                what: format!("reading the pin {}", e.path().display()),
                source,
            })?;
            match pinned {
                // Detached now (`BPF_LINK_DETACH`), then unpinned and
                // dropped. Dropping the last reference alone detaches it
                // only when the kernel frees the link, in deferred work: an
                // sk_lookup program could then outlive the tc programs whose
                // hints it reads, and refuse (reset) the pod's inbound SYNs
                // meanwhile (seen under load in an uninstall). A detach that
                // fails (a kernel without it for this link) leaves the unpin
                // to do it, as before.
                Some(tcfilter::Pinned::Link) => {
                    let _ = crate::dataplane::relink::detach(&e.path());
                    match PinnedLink::from_pin(e.path()) {
                        Ok(link) => drop(link.unpin()),
                        Err(_) => drop(fs::remove_file(e.path())),
                    }
                }
                Some(tcfilter::Pinned::Program(_)) => {
                    filters.detach(&e.file_name().to_string_lossy())?;
                    drop(fs::remove_file(e.path()));
                }
                None => drop(fs::remove_file(e.path())),
            }
            crash_point(&format!(
                "unenroll:link:{}",
                e.file_name().to_string_lossy()
            ));
        }
    }
    match fs::remove_dir(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(EnrollError::Io {
            what: format!("removing {}", dir.display()),
            source: e,
        }),
        _ => Ok(()),
    }
}

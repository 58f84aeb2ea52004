//! One link of a pod: attached (a cls_bpf filter, or a tcx or sk_lookup
//! link) and pinned under the pod's directory, and whether it still is.

use std::{fs, path::Path};

use aya::programs::{links::FdLink, tc::TcAttachOptions, LinkOrder, SchedClassifier, TcAttachType};

use crate::{
    dataplane::{
        features::TcAttach,
        hookview::{self, Standing},
        loader::{Dataplane, Program},
        tcfilter,
    },
    fault::crash_point,
    podnet::{
        netns::Netns,
        podlinks::{LinkSpec, Side},
        podview::PodView,
        rtnl::Rtnl,
    },
};

use super::error::{unless_retired, EnrollError};

/// Attaches one link and pins it under `dir`; pod-side filters over
/// `view`'s socket when there is one (an enrollment), else from inside
/// `netns` (a repair).
pub fn attach_link(
    dp: &mut Dataplane,
    netns: &Netns,
    view: Option<&PodView>,
    dir: &Path,
    spec: &LinkSpec,
) -> Result<(), EnrollError> {
    unless_retired(dp)?;
    let path = dir.join(spec.pin_name());
    let tcx = dp.tc_attach() == TcAttach::Tcx;
    let lacking = |reason: &str| EnrollError::Pin {
        what: spec.pin_name(),
        reason: reason.into(),
    };
    match spec {
        LinkSpec::Steer => {
            let aerr = |source| EnrollError::Attach {
                what: "sk_lookup".into(),
                source,
            };
            let steer = dp.steer_mut();
            let id = steer.attach(netns).map_err(aerr)?;
            pin(FdLink::from(steer.take_link(id).map_err(aerr)?), &path)
        }
        // In the node netns: it only writes hints and passes every packet
        // on (TCX_NEXT), so the primary CNI's programs after it on the same
        // device still see everything.
        LinkSpec::Host(peer) => {
            let Some((node, prog)) = dp.host_side_mut() else {
                return Err(lacking("no node netns or host-side program"));
            };
            Tc {
                over: Some((&node.nl, peer.host_index)),
                ..Tc::new(&peer.host_iface, TcAttachType::Egress, tcx)
            }
            .attach(prog, &node.netns, &path)
        }
        // The pod side: a tc program on one of its interfaces.
        _ => {
            let Some(hook) = spec.tc_hook() else {
                return Err(lacking("no tc hook"));
            };
            let program = spec.program();
            let Some(prog) = dp.tc_program_mut(program) else {
                return Err(lacking(match program {
                    Program::EgressL3 | Program::IngressL3 => {
                        "the pinned dataplane predates the programs for interfaces without an Ethernet header"
                    }
                    Program::Reroute => "the pinned dataplane predates the reroute program",
                    _ => "the pinned dataplane lacks its program",
                }));
            };
            Tc {
                over: view.and_then(|v| Some((&v.nl, v.index(hook.iface)?))),
                ..Tc::new(hook.iface, hook.kind, tcx)
            }
            .attach(prog, netns, &path)
        }
    }
}

/// One tc attachment: sluice's cls_bpf filter (`tcfilter`), or with
/// `--tc-attach tcx` a tcx link, first in the device's chain: a program
/// ahead of sluice's could end the packet's walk before it runs.
struct Tc<'a> {
    iface: &'a str,
    kind: TcAttachType,
    tcx: bool,
    /// A socket in the hook's netns and the interface's index there: a
    /// filter goes over it (no visit of the netns).
    over: Option<(&'a Rtnl, u32)>,
}

impl<'a> Tc<'a> {
    fn new(iface: &'a str, kind: TcAttachType, tcx: bool) -> Self {
        Self {
            iface,
            kind,
            tcx,
            over: None,
        }
    }

    /// Attaches `prog` in `ns` and pins at `path` the link, or the program
    /// as the filter's record. Interface names resolve in the calling
    /// thread's netns, so the attach runs inside `ns`; the pin is made
    /// outside it (bpffs refuses pins from a thread in another netns).
    fn attach(
        self,
        prog: &mut SchedClassifier,
        ns: &Netns,
        path: &Path,
    ) -> Result<(), EnrollError> {
        let what = || format!("tc {:?} on {}", self.kind, self.iface);
        let aerr = |source| EnrollError::Attach {
            what: what(),
            source,
        };
        let (iface, kind) = (self.iface, self.kind);
        if !self.tcx {
            // The record first: a filter is no BPF object and outlives this
            // process, so one attached without its record would be left
            // running by a teardown (which goes by the records). A record
            // without its filter counts as not attached ([`attached`]).
            tcfilter::pin_record(prog, path).map_err(|e| EnrollError::Pin {
                what: path.display().to_string(),
                reason: e.to_string(),
            })?;
            if let Some(name) = path.file_name() {
                crash_point(&format!("enroll:record:{}", name.to_string_lossy()));
            }
            let attached = match self.over {
                Some((nl, index)) => tcfilter::attach_over(nl, prog, index, kind),
                None => ns.run(|| tcfilter::attach(prog, iface, kind))?,
            };
            if let Err(e) = attached {
                let _ = fs::remove_file(path);
                return Err(aerr(e));
            }
            return Ok(());
        }
        let link = ns.run(|| -> Result<FdLink, EnrollError> {
            let id = prog
                .attach_with_options(iface, kind, TcAttachOptions::TcxOrder(LinkOrder::first()))
                .map_err(aerr)?;
            let link = prog.take_link(id).map_err(aerr)?;
            FdLink::try_from(link).map_err(|e| EnrollError::Pin {
                what: what(),
                reason: crate::error_line(&e),
            })
        })??;
        pin(link, path)
    }
}

/// Whether `spec` is attached, as its pin at `path` records: a link (attached
/// while pinned), or the program standing for a cls_bpf filter, which counts
/// only while the kernel still runs that program in sluice's filter on the
/// hook (a filter can be deleted behind the record's back).
pub fn attached(dp: &Dataplane, netns: &Netns, spec: &LinkSpec, path: &Path) -> bool {
    attached_seen_from(netns, dp.node().map(|n| &n.netns), None, spec, path)
}

/// [`attached`] with the node's netns given (`None`: a node-side filter
/// counts as not attached), and, when `view` is given, a pod-side filter
/// asked about over its socket (no netns entered, no socket made). Needs no
/// dataplane: what a repair's survey asks without the node-wide lock.
pub fn attached_seen_from(
    netns: &Netns,
    node: Option<&Netns>,
    view: Option<&PodView>,
    spec: &LinkSpec,
    path: &Path,
) -> bool {
    match tcfilter::pinned(path) {
        None => false,
        Some(tcfilter::Pinned::Link) => !matches!(
            tcx_standing(netns, node, spec, path),
            Some(TcxStanding::Behind(_) | TcxStanding::Detached)
        ),
        Some(tcfilter::Pinned::Program(id)) => {
            let Some(hook) = spec.tc_hook() else {
                return false;
            };
            let over = view
                .filter(|_| hook.side == Side::Pod)
                .and_then(|v| Some((&v.nl, v.index(hook.iface)?)));
            let standing = match (over, hook_netns(hook.side, netns, node)) {
                (Some((nl, index)), _) => hookview::standing_over(nl, index, hook.kind),
                (None, Some(ns)) => match ns.run(|| hookview::standing_at(hook.iface, hook.kind)) {
                    Ok(s) => s,
                    Err(_) => return false,
                },
                (None, None) => return false,
            };
            matches!(standing, Ok(Standing::First(running)) if running == id)
        }
    }
}

/// Where `spec`'s tcx link (pinned at `path`) stands on its hook, as the
/// kernel says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcxStanding {
    /// Its program runs first.
    First,
    /// Another program (this id) runs ahead of it and could end the
    /// packet's walk before sluice's runs.
    Behind(u32),
    /// The link is detached (its device was deleted; a device of the same
    /// name made since has no program of sluice's).
    Detached,
}

/// [`TcxStanding`] of `spec`'s link, `None` when it cannot be told (a link
/// not on a tc hook, the node's netns unknown, a read or query failing):
/// a link is only ever replaced on the kernel's word.
pub fn tcx_standing(
    netns: &Netns,
    node: Option<&Netns>,
    spec: &LinkSpec,
    path: &Path,
) -> Option<TcxStanding> {
    let hook = spec.tc_hook()?;
    let ns = hook_netns(hook.side, netns, node)?;
    let ours = tcfilter::link_info(path)?;
    if ours.tcx_ifindex == 0 {
        return Some(TcxStanding::Detached);
    }
    // By link, not program: an upgrade swapping the program in sluice's
    // link between the two reads leaves it first.
    let (first, link) = ns
        .run(|| hookview::tcx_first(hook.iface, hook.kind))
        .ok()?
        .ok()??;
    Some(if link == ours.id {
        TcxStanding::First
    } else {
        TcxStanding::Behind(first)
    })
}

/// The netns a hook on `side` is in (`None`: the node's, not known here).
fn hook_netns<'a>(side: Side, pod: &'a Netns, node: Option<&'a Netns>) -> Option<&'a Netns> {
    match side {
        Side::Pod => Some(pod),
        Side::Node => node,
    }
}

/// Before `spec`'s filter is attached again: when another tool's filter
/// runs ahead of sluice's, sluice's is deleted, so that the attach adds it
/// back at the head of its priority (an attach over it would replace its
/// program in place, behind the other). Traffic through the hook bypassed
/// sluice's program already; the moment without it changes nothing. Links
/// (tcx, sk_lookup) are left alone.
pub fn unseat_if_behind(dp: &Dataplane, netns: &Netns, spec: &LinkSpec) {
    let Some(hook) = spec.tc_hook().filter(|_| dp.tc_attach() != TcAttach::Tcx) else {
        return;
    };
    let Some(ns) = hook_netns(hook.side, netns, dp.node().map(|n| &n.netns)) else {
        return;
    };
    let _ = ns.run(|| {
        if let Ok(Standing::Behind { ahead, .. }) = hookview::standing_at(hook.iface, hook.kind) {
            tracing::warn!(iface = hook.iface, hook = ?hook.kind, %ahead, "another tool's filter ran ahead of sluice's: putting sluice's first again");
            if let Err(e) = tcfilter::detach(hook.iface, hook.kind) {
                tracing::warn!(iface = hook.iface, error = %e, "removing sluice's filter to put it first");
            }
        }
    });
}

fn pin(link: FdLink, path: &Path) -> Result<(), EnrollError> {
    link.pin(path).map(drop).map_err(|e| EnrollError::Pin {
        what: path.display().to_string(),
        reason: crate::error_line(&e),
    })
}

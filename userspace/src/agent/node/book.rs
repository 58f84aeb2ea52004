//! The pod book: the dataplane (behind the one lock every kernel change
//! takes) and the pod table beside it, with what the other roles read from
//! both: a pod's cookie, state, netns, whether its sandbox lives. The pod's
//! state lives in the pinned map; the table holds what the agent needs to act
//! on it. Lock order: the dataplane before the table.

use std::{
    sync::{Arc, Mutex, MutexGuard, Weak},
    time::Duration,
};

use sluice_common::PodState;

use super::pods::PodTable;
use crate::{
    agent::cluster::Shown,
    cni::install::CniInstall,
    dataplane::{loader::Dataplane, state::boottime_ns},
    kube::gate::Capture,
    lifecycle::{Observer, Verification},
    metrics,
    podnet::{
        enroll::{self, EnrollError},
        netns::Netns,
    },
    readiness::{self, PodView},
    uid::PodUid,
    zds::server::Hub,
};

/// What a pod's netns path says of the sandbox it was enrolled with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Sandbox {
    Alive,
    Gone,
    /// The path could not be read for another reason (the error).
    Unknown(String),
}

pub(super) struct PodBook {
    dp: Mutex<Dataplane>,
    pods: Arc<PodTable>,
}

impl PodBook {
    pub(super) fn new(dp: Dataplane, pods: Arc<PodTable>) -> Self {
        Self {
            dp: Mutex::new(dp),
            pods,
        }
    }

    /// From now on `on_applied` sees every event the pinned map takes (see
    /// `lifecycle`).
    pub(super) fn observe(&self, on_applied: Observer) {
        self.dataplane().maps_mut().observe(on_applied);
    }

    /// The dataplane, locked: every change to the kernel's view of a pod
    /// holds it.
    pub(super) fn dataplane(&self) -> MutexGuard<'_, Dataplane> {
        self.dp.lock().unwrap()
    }

    /// Reads a pod's netns for a repair or a CHECK (see [`enroll::survey`]):
    /// the lock only to copy what the survey needs, the reads without it.
    /// `None` for a pod not enrolled or being torn down, or a survey that
    /// failed (the caller reads again under the lock, which reports).
    pub(super) fn survey(&self, cookie: u64) -> Option<enroll::Survey> {
        let plan = enroll::survey_plan(&self.dataplane(), cookie)?;
        enroll::survey(&plan).ok()
    }

    pub(super) fn pods(&self) -> &PodTable {
        &self.pods
    }

    /// `namespace/name` of a pod the agent holds (`-` for one it does not),
    /// for log spans.
    pub(super) fn pod_name(&self, uid: &str) -> String {
        self.pods
            .workload(uid)
            .map_or_else(|| "-".into(), |w| format!("{}/{}", w.namespace, w.name))
    }

    pub(super) fn pod_count(&self) -> usize {
        self.dataplane().maps().states().len()
    }

    /// From the table; the map is walked only for a pod the table does not
    /// hold (its netns could not be opened when the agent started).
    pub(super) fn cookie_of(&self, uid: &PodUid) -> Option<u64> {
        self.pods
            .cookie(uid.as_str())
            .or_else(|| self.dataplane().maps().find_uid(uid))
    }

    pub(super) fn state_of(&self, cookie: u64) -> Option<PodState> {
        self.dataplane()
            .maps()
            .entry(cookie)
            .and_then(|e| e.state())
    }

    /// Whether the pod's netns path still names the netns it was enrolled
    /// with (its sandbox lives). An error that says nothing of the netns
    /// (out of descriptors, say) is `Unknown`, never `Gone`: the guards
    /// that ask refuse rather than tear a live capture down.
    pub(super) fn sandbox(&self, cookie: u64) -> Sandbox {
        let path = match self.pods.netns(cookie) {
            Some(ns) => Some(ns.path().to_owned()),
            None => self.dataplane().maps().meta(cookie).map(|m| m.netns.into()),
        };
        let Some(path) = path else {
            return Sandbox::Gone;
        };
        match Netns::open(&path).and_then(|ns| ns.cookie()) {
            Ok(c) if c == cookie => Sandbox::Alive,
            Ok(_) => Sandbox::Gone,
            Err(e) if e.is_gone() => Sandbox::Gone,
            Err(e) => Sandbox::Unknown(e.to_string()),
        }
    }

    /// The pod's netns, as held since its enrollment; opened by its path
    /// (and checked) only for a pod the table does not hold.
    pub(super) fn netns_of(&self, cookie: u64) -> Result<Netns, EnrollError> {
        if let Some(ns) = self.pods.netns(cookie) {
            return ns.try_clone().map_err(|source| EnrollError::Io {
                what: "duplicating the pod's netns fd".into(),
                source,
            });
        }
        let dp = self.dataplane();
        enroll::open_pod_netns(dp.maps(), cookie)
    }

    /// The state the map has for the pod of `uid`, and whether its capture
    /// is complete (as the last repair found it).
    pub(super) fn state_by_uid(&self, uid: &str) -> Shown {
        let state = PodUid::new(uid)
            .ok()
            .and_then(|u| self.cookie_of(&u))
            .and_then(|cookie| self.state_of(cookie));
        match state {
            Some(state) => Shown {
                state: Some(state),
                capture: self.capture_of(uid),
                acked: self.pods.acked(uid),
            },
            None => Shown::default(),
        }
    }

    /// Whether the pod of `uid` has every link its capture calls for, and
    /// its capture passed its last verification.
    pub(super) fn capture_of(&self, uid: &str) -> Capture {
        if self.pods.is_incomplete(uid) {
            return Capture::Incomplete;
        }
        match self.pods.verification(uid) {
            Verification::Verified { .. } => Capture::Complete,
            Verification::Failed { .. } => Capture::Unverified,
            Verification::NotYet => Capture::NotYetVerified,
        }
    }

    /// Removes the pod's capture from the kernel (its row goes with the
    /// teardown's last step; the maps keep what its counters said for the
    /// metrics' totals). Blocking.
    pub(super) fn tear_down(&self, uid: &PodUid) -> Result<(), EnrollError> {
        let mut guard = self.dataplane();
        let (pins, maps, node) = guard.parts_mut();
        enroll::unenroll(pins, maps, node, uid)
    }

    /// The node condition's inputs: the pods as the pinned state map has
    /// them, the pins, the CNI config and `hub`'s connection. Blocking.
    pub(super) fn readiness_inputs(
        &self,
        cni: Option<&CniInstall>,
        pending_grace: Duration,
        hub: &Hub,
    ) -> readiness::Inputs {
        let dp = self.dataplane();
        let refused = self.pods.refused_by_ztunnel();
        let pods = dp
            .maps()
            .states()
            .into_iter()
            .map(|(cookie, e)| {
                let meta = dp.maps().meta(cookie);
                PodView {
                    name: meta
                        .as_ref()
                        .map(|m| format!("{}/{}", m.workload.namespace, m.workload.name))
                        .unwrap_or_else(|| format!("netns:{cookie}")),
                    state: e.state(),
                    changed_at_ns: e.changed_at_ns,
                    ztunnel_refused: meta.as_ref().is_some_and(|m| refused.contains(&m.uid)),
                    capture_incomplete: meta
                        .as_ref()
                        .is_some_and(|m| self.pods.is_incomplete(&m.uid)),
                    capture_unverified: meta.is_some_and(|m| {
                        matches!(self.pods.verification(&m.uid), Verification::Failed { .. })
                    }),
                }
            })
            .collect();
        readiness::Inputs {
            programs_loaded: dp.pins().is_loaded(),
            // Not managing the CNI config (a dev or hand-run agent): whoever
            // runs it vouches for it.
            cni_missing: cni.and_then(|c| c.in_force().err()),
            ztunnel_connected: hub.is_connected(),
            pods,
            now_ns: boottime_ns(),
            pending_grace,
        }
    }
}

/// The metrics' view of the maps, through the book (which owns them). Weak:
/// the book's observer holds the metrics.
pub(super) struct MapSource(pub(super) Weak<PodBook>);

impl metrics::Source for MapSource {
    fn sample(&self) -> metrics::Sample {
        let Some(book) = self.0.upgrade() else {
            return metrics::Sample::default();
        };
        let dp = book.dataplane();
        let mut pods = vec![
            ("Pending", 0),
            ("Enabled", 0),
            ("Served", 0),
            ("Draining", 0),
            ("Unknown", 0),
        ];
        let retired = dp.maps().retired_counters();
        let (mut kernel, mut dns, mut excluded) = (retired.kernel, retired.dns, retired.excluded);
        let mut dns_modes = vec![("captured", 0), ("pass-through", 0), ("off", 0)];
        let with_proxy = dp.maps().pods_with_dns_listener();
        let mut local_route = 0;
        for (cookie, e) in dp.maps().states() {
            local_route += u64::from(dp.maps().local_route(cookie).is_some());
            let state = e.state().map(PodState::as_str).unwrap_or("Unknown");
            if let Some(p) = pods.iter_mut().find(|(s, _)| *s == state) {
                p.1 += 1;
            }
            kernel.add(&dp.maps().counters(cookie));
            dns.add(&dp.maps().dns_counters(cookie));
            excluded.add(&dp.maps().excluded(cookie));
            let mode = dp.maps().dns_mode(cookie, with_proxy.contains(&cookie));
            if let Some(m) = dns_modes.iter_mut().find(|(s, _)| *s == mode.as_str()) {
                m.1 += 1;
            }
        }
        metrics::Sample {
            pods,
            kernel,
            dns,
            dns_modes,
            excluded,
            drops: sluice_common::DropReason::ALL
                .iter()
                .map(|r| (r.as_str(), dp.maps().drops(*r)))
                .collect(),
            hints_over_share: dp.maps().hints_over_share(),
            capture_incomplete: book.pods.incomplete().len() as u64,
            capture_unverified: book.pods.unverified() as u64,
            local_route,
        }
    }
}

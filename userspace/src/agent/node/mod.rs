//! The agent's view of its node: the pods it holds (`pods`: one record per
//! pod; their state lives in the pinned pod-state map), split by role:
//!
//! - `requests`: control-socket and CNI requests (enroll, unenroll, ADD/DEL/CHECK);
//! - `zds`: adds to ztunnel, their answers, listener registration, the ZDS `Handler`;
//! - `supervise`: listeners gone → Pending, retries with backoff, releasing
//!   listeners their ztunnel let go of;
//! - `relist`: reconciling with the Kubernetes API;
//! - `announce`: the pod annotation and readiness-gate queue.
//!
//! This file holds the node itself, what every role shares, the reaction to
//! every state change (`on_transition`) and the start-up verification.

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{Arc, Mutex, Weak},
    time::{Duration, Instant},
};

use sluice_common::{Counters, PodState};
use tokio::sync::{watch, Notify};
use tracing::{info, info_span, warn, Instrument as _};

use super::{
    cluster::{Admission, KubeCtx},
    custody::Custody,
    report::Report,
};
use crate::{
    cni::install::CniInstall,
    control::{NodeStatus, Request, Response, WaitingPod, ZtunnelView},
    dataplane::loader::Dataplane,
    dataplane::state::boottime_ns,
    kube::reconcile::{plan, Action, Enrolled},
    lifecycle::{Applied, Effect, Event, Incomplete},
    metrics::{self, CniCommand, CniResult, Failure, Metrics, ReconcileError},
    options::PodOptions,
    podnet::enroll::{self, EnrollError},
    podnet::netns::Netns,
    readiness::{self, PodView},
    uid::PodUid,
    workload::Workload,
    zds::{
        proto::WorkloadRequest,
        server::{Answer, Conn, Handler, Hub, SnapshotEntry, ZdsError},
    },
};

mod announce;
mod linkwatch;
mod pods;
mod relist;
mod requests;
mod served_check;
mod supervise;
mod uninstall;
mod ztunnels;

use crate::lifecycle::Cause;

pub use uninstall::Uninstall;

/// How often Enabled pods are checked for their listeners, at most.
const CHECK_EVERY: Duration = Duration::from_millis(200);
/// ztunnel opens a pod's listeners around its ack: look for this long.
const LISTENER_WAIT: Duration = Duration::from_secs(2);
/// How often the agent relists this node's pods from the API even when the
/// watch reports nothing.
const RESYNC: Duration = Duration::from_secs(60);
/// Pods captured this recently are never released by a relist.
const RECENT: Duration = Duration::from_secs(30);

pub struct Node {
    me: Weak<Node>,
    /// Present when the agent runs in a cluster.
    kube: Option<KubeCtx>,
    dp: Mutex<Dataplane>,
    hub: Arc<Hub>,
    wake: Notify,
    /// Pods (namespace, name) whose annotation and gate need writing.
    announcements: Mutex<std::collections::BTreeSet<(String, String)>>,
    announce_wake: Notify,
    /// The node condition and metrics, as last computed.
    report: Arc<Report>,
    /// Kernel counters of pods since unenrolled, so the metrics' totals
    /// never go backwards while the agent runs.
    retired: Mutex<Counters>,
    retired_dns: Mutex<sluice_common::DnsCounters>,
    /// Kubernetes Events on pods (with the API only).
    events: Option<crate::kube::events::Events>,
    /// This node's pods the last reconcile left uncaptured, with why.
    skipped: Mutex<Vec<crate::control::SkippedPod>>,
    /// Duplicates of the ztunnel listeners in the socket map.
    custody: Custody,
    /// Every pod the agent holds: identity, cookie, netns, retry schedule.
    pods: pods::PodTable,
    /// Whether ztunnel can serve the pods it acked.
    served: served_check::Served,
    /// Whether sluice is being (or was) removed from this node.
    uninstall: watch::Sender<uninstall::Uninstall>,
    /// Link-event sockets open (`linkwatch`): one per watched pod.
    link_watches: Arc<std::sync::atomic::AtomicUsize>,
}

pub use served_check::{ServedConfig, DEFAULT_RECHECK, FALLBACK_AFTER};

/// The metrics' view of the maps, through the node (which owns them).
struct MapSource(Weak<Node>);

impl metrics::Source for MapSource {
    fn sample(&self) -> metrics::Sample {
        let Some(node) = self.0.upgrade() else {
            return metrics::Sample::default();
        };
        let dp = node.dp.lock().unwrap();
        let mut pods = vec![
            ("Pending", 0),
            ("Enabled", 0),
            ("Served", 0),
            ("Draining", 0),
            ("Unknown", 0),
        ];
        let mut kernel = *node.retired.lock().unwrap();
        let mut dns = *node.retired_dns.lock().unwrap();
        let mut dns_modes = vec![("captured", 0), ("pass-through", 0), ("off", 0)];
        let with_proxy = dp.maps.pods_with_dns_listener();
        for (cookie, e) in dp.maps.states() {
            let state = e.state().map(PodState::as_str).unwrap_or("Unknown");
            if let Some(p) = pods.iter_mut().find(|(s, _)| *s == state) {
                p.1 += 1;
            }
            kernel.add(&dp.maps.counters(cookie));
            dns.add(&dp.maps.dns_counters(cookie));
            let mode = dp.maps.dns_mode(cookie, with_proxy.contains(&cookie));
            if let Some(m) = dns_modes.iter_mut().find(|(s, _)| *s == mode.as_str()) {
                m.1 += 1;
            }
        }
        metrics::Sample {
            pods,
            kernel,
            dns,
            dns_modes,
            drops: sluice_common::DropReason::ALL
                .iter()
                .map(|r| (r.as_str(), dp.maps.drops(*r)))
                .collect(),
            capture_incomplete: node.pods.incomplete().len() as u64,
        }
    }
}

impl Node {
    /// `condition_type`: the node condition's type, as `status` reports it.
    pub fn new(
        dp: Dataplane,
        hub: Arc<Hub>,
        kube: Option<KubeCtx>,
        condition_type: &str,
        served: ServedConfig,
        orphan_grace: Duration,
    ) -> Arc<Self> {
        let mut dp = dp;
        Arc::new_cyclic(|me: &Weak<Self>| {
            let node = me.clone();
            dp.maps.observe(Arc::new(move |a: &Applied| {
                if let Some(n) = node.upgrade() {
                    n.on_applied(a);
                }
            }));
            Self::with(me, dp, hub, kube, condition_type, served, orphan_grace)
        })
    }

    fn with(
        me: &Weak<Self>,
        dp: Dataplane,
        hub: Arc<Hub>,
        kube: Option<KubeCtx>,
        condition_type: &str,
        served: ServedConfig,
        orphan_grace: Duration,
    ) -> Self {
        let node_name = kube.as_ref().map(|k| k.node.clone());
        let events = kube
            .as_ref()
            .map(|k| crate::kube::events::Events::start(k.client.clone(), &k.node));
        Self {
            me: me.clone(),
            kube,
            dp: Mutex::new(dp),
            hub,
            wake: Notify::new(),
            announcements: Mutex::new(Default::default()),
            announce_wake: Notify::new(),
            report: Arc::new(Report::new(
                Arc::new(Metrics::new(Arc::new(MapSource(me.clone())))),
                condition_type,
            )),
            retired: Mutex::new(Counters::default()),
            retired_dns: Mutex::default(),
            events,
            skipped: Mutex::default(),
            link_watches: Default::default(),
            custody: Custody::new(orphan_grace),
            pods: pods::PodTable::default(),
            served: served_check::Served::new(served, node_name),
            uninstall: watch::Sender::new(uninstall::Uninstall::No),
        }
    }

    /// `namespace/name` of a pod the agent holds (`-` for one it does not),
    /// for log spans.
    pub(super) fn pod_name(&self, uid: &str) -> String {
        self.pods
            .workload(uid)
            .map_or_else(|| "-".into(), |w| format!("{}/{}", w.namespace, w.name))
    }

    /// Publishes a Kubernetes Event on an enrolled pod (nothing without the
    /// API, or for a pod the agent does not hold).
    pub(super) fn pod_event(&self, uid: &str, reason: crate::kube::events::Reason, note: &str) {
        let (Some(events), Some(w)) = (&self.events, self.pods.workload(uid)) else {
            return;
        };
        events.pod(crate::kube::events::PodRef::new(&w, uid), reason, note);
    }

    /// Every event the pinned map took, as it was just written (see
    /// `lifecycle`): the pod's track follows, and the step's effects run.
    /// Runs under the dataplane lock: it only queues.
    fn on_applied(&self, a: &Applied) {
        for effect in self.pods.follow(a) {
            match effect {
                Effect::Announce => {
                    let (from, to) = (a.from.map(PodState::as_str), a.to.map(PodState::as_str));
                    self.metrics().transition(from, to);
                    let uid = a.pod.as_ref().map(|p| p.uid.as_str()).unwrap_or("");
                    info!(
                        %uid,
                        cookie = a.cookie,
                        event = a.event.name(),
                        from = from.unwrap_or("none"),
                        to = to.unwrap_or("none"),
                        "pod state"
                    );
                    if let Some(p) = &a.pod {
                        self.announce_pod(&p.workload.namespace, &p.workload.name);
                    }
                }
                Effect::CheckServed => self.served.wake(),
                Effect::RecheckServed => self.served.recheck_soon(),
                Effect::Forget => {
                    if let Some(p) = &a.pod {
                        self.custody.forget(&p.uid);
                        self.pods.remove(&p.uid);
                    }
                }
                // Effects of track-only events: their callers run them.
                Effect::SendAdd | Effect::ReportCompleteness => {}
            }
        }
    }

    /// The ZDS connections this node's adds go to.
    pub fn hub(&self) -> Arc<Hub> {
        self.hub.clone()
    }

    pub fn report(&self) -> &Arc<Report> {
        &self.report
    }

    pub(super) fn metrics(&self) -> &Metrics {
        &self.report.metrics
    }
}

impl super::report::Inputs for Node {
    fn ztunnel_connected(&self) -> bool {
        self.hub.is_connected()
    }

    /// The node condition's inputs: the pods as the pinned state map has
    /// them, the pins, the CNI config and the ZDS connection.
    fn readiness_inputs(
        &self,
        cni: Option<&CniInstall>,
        pending_grace: Duration,
    ) -> readiness::Inputs {
        let dp = self.dp.lock().unwrap();
        let refused = self.pods.refused_by_ztunnel();
        let pods = dp
            .maps
            .states()
            .into_iter()
            .map(|(cookie, e)| {
                let meta = dp.maps.meta(cookie);
                PodView {
                    name: meta
                        .as_ref()
                        .map(|m| format!("{}/{}", m.workload.namespace, m.workload.name))
                        .unwrap_or_else(|| format!("netns:{cookie}")),
                    state: e.state(),
                    changed_at_ns: e.changed_at_ns,
                    ztunnel_refused: meta.as_ref().is_some_and(|m| refused.contains(&m.uid)),
                    capture_incomplete: meta.is_some_and(|m| self.pods.is_incomplete(&m.uid)),
                }
            })
            .collect();
        readiness::Inputs {
            programs_loaded: dp.pins.is_loaded(),
            // Not managing the CNI config (a dev or hand-run agent): whoever
            // runs it vouches for it.
            cni_installed: cni.is_none_or(CniInstall::is_installed),
            ztunnel_connected: self.hub.is_connected(),
            pods,
            now_ns: boottime_ns(),
            pending_grace,
        }
    }
}

impl Node {
    fn self_arc(&self) -> Option<Arc<Self>> {
        self.me.upgrade()
    }

    /// Verifies every pod's capture link by link and completes what an
    /// interrupted enrollment (or anything else) left out; finishes
    /// interrupted teardowns; removes pins no pod owns. Blocking: run it off
    /// the async workers. At start, before ZDS and the control socket serve,
    /// and again every `RESYNC`.
    pub fn verify_all(&self, at_start: bool) {
        let mut guard = self.dp.lock().unwrap();
        let dp = &mut *guard;
        for cookie in dp.maps.cookies() {
            self.verify_pod(dp, cookie, at_start);
        }
        match enroll::remove_orphan_pins(&dp.pins, &dp.maps, dp.node.as_ref()) {
            Ok(0) => {}
            Ok(n) => info!(pods = n, "removed pins of pods without state"),
            Err(e) => warn!(error = %e, "removing pins of pods without state"),
        }
    }

    /// [`Self::verify_all`] for one pod, if it is still enrolled: what the
    /// link watch runs when the pod's interfaces change. Blocking.
    pub(super) fn verify_one(&self, cookie: u64) {
        let mut guard = self.dp.lock().unwrap();
        if guard.maps.entry(cookie).is_some() {
            self.verify_pod(&mut guard, cookie, false);
        }
    }

    /// Verifies and completes one pod's capture (see [`enroll::repair`]),
    /// with an Event and a count when something was missing.
    fn verify_pod(&self, dp: &mut Dataplane, cookie: u64, at_start: bool) {
        {
            let (uid, pod) = dp
                .maps
                .meta(cookie)
                .map(|m| {
                    (
                        m.uid,
                        format!("{}/{}", m.workload.namespace, m.workload.name),
                    )
                })
                .unwrap_or_default();
            let span = info_span!("pod", %uid, %pod, cookie);
            let _e = span.enter();
            let outcome = enroll::repair(dp, cookie, at_start);
            match &outcome {
                Ok(enroll::Repair::Complete) => {}
                Ok(enroll::Repair::Repaired {
                    relinked,
                    istio_rules,
                }) => {
                    warn!(
                        ?relinked,
                        ?istio_rules,
                        "capture was incomplete: completed (links attached, istio-cni rules removed)"
                    );
                    let note = format!("capture was incomplete and has been completed: links attached {relinked:?}, istio-cni rules removed {istio_rules:?}");
                    self.pod_event(&uid, crate::kube::events::Reason::CaptureRepaired, &note);
                    self.metrics().capture_repaired();
                }
                Ok(enroll::Repair::TornDown) => {
                    info!("finished an interrupted teardown");
                    return;
                }
                Err(e) => warn!(error = %e, "could not verify the pod's capture; will retry"),
            }
            // A pod an earlier agent enrolled: open its netns once, now.
            if let Some(meta) = dp.maps.meta(cookie) {
                if !self.pods.contains(&meta.uid) {
                    let ns = enroll::open_pod_netns(&dp.maps, cookie).ok();
                    self.pods.insert(cookie, meta, ns);
                }
            }
            self.note_completeness(dp, cookie, &uid, &pod, outcome.err());
        }
    }

    /// After a repair of the pod (`failed`: its error, if it failed):
    /// whether its capture still lacks links, recorded for `sluice status`
    /// and, when that changes, told to Kubernetes (its readiness gate, an
    /// Event). A repair that failed for another reason (the netns being
    /// torn down, a map error) with every link in place changes nothing.
    fn note_completeness(
        &self,
        dp: &Dataplane,
        cookie: u64,
        uid: &str,
        pod: &str,
        failed: Option<enroll::EnrollError>,
    ) {
        let lacks = failed.and_then(|e| {
            let missing = enroll::missing_links(dp, cookie).ok()?;
            (!missing.is_empty()).then(|| Incomplete {
                missing,
                reason: crate::error_line(&e),
            })
        });
        let effects = self.pods.apply(uid, Event::Checked(lacks.clone()));
        if !effects.contains(&Effect::ReportCompleteness) {
            return;
        }
        match lacks {
            Some(Incomplete { missing, reason }) => {
                warn!(?missing, %reason, "the pod's capture is incomplete and cannot be completed now: part of its traffic bypasses ztunnel; retried at every repair");
                let note = format!("capture incomplete: {} cannot be attached ({reason}), so part of the pod's traffic bypasses ztunnel; the readiness gate is False until a repair completes it", missing.join(", "));
                self.pod_event(uid, crate::kube::events::Reason::CaptureIncomplete, &note);
            }
            None => info!("the pod's capture is complete again"),
        }
        if let Some((namespace, name)) = pod.split_once('/') {
            self.announce_pod(namespace, name);
        }
    }

    pub fn pod_count(&self) -> usize {
        self.dp.lock().unwrap().maps.states().len()
    }

    /// From the table; the map is walked only for a pod the table does not
    /// hold (its netns could not be opened when the agent started).
    fn cookie_of(&self, uid: &PodUid) -> Option<u64> {
        self.pods
            .cookie(uid.as_str())
            .or_else(|| self.dp.lock().unwrap().maps.find_uid(uid))
    }

    fn state_of(&self, cookie: u64) -> Option<PodState> {
        self.dp
            .lock()
            .unwrap()
            .maps
            .entry(cookie)
            .and_then(|e| e.state())
    }

    /// Whether the pod's netns path still names the netns it was enrolled
    /// with (its sandbox lives).
    fn sandbox_alive(&self, cookie: u64) -> bool {
        let path = match self.pods.netns(cookie) {
            Some(ns) => Some(ns.path().to_owned()),
            None => self
                .dp
                .lock()
                .unwrap()
                .maps
                .meta(cookie)
                .map(|m| m.netns.into()),
        };
        path.and_then(|p| Netns::open(&p).ok())
            .and_then(|ns| ns.cookie().ok())
            == Some(cookie)
    }

    /// The pod's netns, as held since its enrollment; opened by its path
    /// (and checked) only for a pod the table does not hold.
    fn netns_of(&self, cookie: u64) -> Result<Netns, EnrollError> {
        if let Some(ns) = self.pods.netns(cookie) {
            return ns.try_clone().map_err(|source| EnrollError::Io {
                what: "duplicating the pod's netns fd".into(),
                source,
            });
        }
        let dp = self.dp.lock().unwrap();
        enroll::open_pod_netns(&dp.maps, cookie)
    }

    /// Pods the agent is retrying, with why the last attempt failed.
    fn waiting(&self) -> Vec<WaitingPod> {
        self.pods.waiting()
    }

    /// The ztunnel processes the agent knows: connected ones, and those whose
    /// listeners it still holds.
    fn ztunnels(&self) -> Vec<ZtunnelView> {
        let owners = self.custody.pods_by_owner();
        let connected: Vec<i32> = self.hub.all().iter().filter_map(|c| c.pid).collect();
        let mut pids: Vec<i32> = owners
            .keys()
            .copied()
            .chain(connected.iter().copied())
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids.into_iter()
            .map(|pid| ZtunnelView {
                pid,
                connected: connected.contains(&pid),
                pods: owners.get(&pid).copied().unwrap_or(0),
                served_check: self.served.view(pid),
            })
            .collect()
    }
}

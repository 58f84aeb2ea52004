//! Reconciling with the API: capture ambient pods the CNI plugin did not
//! see, release pods that are gone or no longer ambient, rewrite annotations
//! and gates that disagree with the map, and keep what was left out (and
//! why) for `sluice status`.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use k8s_openapi::api::core::v1::Pod;
use sluice_common::PodState;
use tokio::sync::watch;
use tracing::{info, info_span, warn, Instrument as _};

use super::{announce::Announcer, book::PodBook, enroller::Enroller, exclusions::Exclusions};
use crate::{
    agent::cluster::{out_of_step, KubeCtx, NamespaceLabels},
    control::{ExclusionNotice, SkippedPod},
    dataplane::state::{boottime_ns, PodRecord},
    kube::{
        events::{PodRef, Reason},
        reconcile::{plan, Action, Enrolled},
    },
    metrics::{Metrics, ReconcileError},
    options::{OptionsError, PodOptions},
    podnet::enroll::{AppStarted, PodAddrs},
    uid::PodUid,
    workload::Workload,
};

/// How often the agent relists this node's pods from the API even when the
/// watch reports nothing.
const RESYNC: Duration = Duration::from_secs(60);
/// Pods captured this recently are never released by a relist.
const RECENT: Duration = Duration::from_secs(30);

pub struct Relist {
    /// `None`: no API, nothing to reconcile with.
    kube: Option<KubeCtx>,
    book: Arc<PodBook>,
    enroller: Arc<Enroller>,
    announcer: Arc<Announcer>,
    metrics: Arc<Metrics>,
    /// This node's pods the last reconcile left uncaptured, with why.
    skipped: Mutex<Vec<SkippedPod>>,
    /// Keeps enrolled pods' exclusions in step with their annotations.
    exclusions: Exclusions,
}

/// The addresses the runtime gave the pod of `uid`, as the API shows them.
fn ips_of(pods: &[Arc<Pod>], uid: &str) -> Vec<std::net::IpAddr> {
    pods.iter()
        .find(|p| p.metadata.uid.as_deref() == Some(uid))
        .map(|p| crate::kube::selection::pod_ips(p))
        .unwrap_or_default()
}

/// An ambient pod the plan captures.
struct ToCapture {
    uid: String,
    name: String,
    namespace: String,
    service_account: String,
    options: Result<PodOptions, OptionsError>,
    /// What the runtime gave it (`status.podIPs`).
    ips: Vec<std::net::IpAddr>,
}

impl Relist {
    pub(super) fn new(
        kube: Option<KubeCtx>,
        book: Arc<PodBook>,
        enroller: Arc<Enroller>,
        announcer: Arc<Announcer>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let exclusions = Exclusions::new(enroller.clone(), announcer.clone(), metrics.clone());
        Self {
            kube,
            book,
            enroller,
            announcer,
            metrics,
            skipped: Mutex::default(),
            exclusions,
        }
    }

    /// This node's pods the last reconcile left uncaptured, with why.
    pub(super) fn skipped(&self) -> Vec<SkippedPod> {
        self.skipped.lock().unwrap().clone()
    }

    /// Enrolled pods whose exclusion annotations are not in force as
    /// written, with why.
    pub(super) fn exclusion_notices(&self) -> Vec<ExclusionNotice> {
        self.exclusions.notices()
    }

    /// Keeps the enrolled pods equal to the ambient pods of this node (pods
    /// that became ambient after they started, pods that existed before the
    /// agent, pods gone while it was away): a pass at start, on every pod or
    /// namespace change the watch reports, and every `RESYNC`.
    pub(super) async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let Some(k) = self.kube.clone() else { return };
        // Watch events wake the loop at once; the timer is a safety net
        // (a pod whose capture failed is tried again).
        let (tx, mut changes) = tokio::sync::mpsc::channel(1);
        let metrics = self.metrics.clone();
        let (view, drive) = k.reflect(tx, move |e| {
            metrics.reconcile_error(ReconcileError::Api);
            warn!(error = %e, "watching the API failed; retrying with backoff");
        });
        let watching = tokio::spawn(drive);
        loop {
            // Until both stores hold their first LIST there is nothing to
            // plan from; the watch's first events wake the loop.
            if view.is_ready() {
                let (pods, namespaces) = view.snapshot();
                if let Err(e) = self.reconcile_from(&pods, &namespaces, RECENT).await {
                    warn!(error = %crate::one_line(&e), "reconciling failed; will retry");
                }
            }
            tokio::select! {
                _ = stop.changed() => break,
                _ = changes.recv() => {
                    // Let a burst of events settle into one pass.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    while changes.try_recv().is_ok() {}
                }
                _ = tokio::time::sleep(RESYNC) => {}
            }
        }
        watching.abort();
    }

    /// One pass from a fresh LIST of the API (at start and in tests; the
    /// loop above reads the reflectors' stores).
    pub async fn reconcile_once(&self, min_age: Duration) -> anyhow::Result<()> {
        let Some(k) = self.kube.clone() else {
            return Ok(());
        };
        let (pods, namespaces) = k.observe().await?;
        self.reconcile_from(&pods, &namespaces, min_age).await
    }

    /// One pass: plan from `pods` and `namespaces`, apply. Pods enrolled
    /// less than `min_age` ago are not removed (the API may not show a pod
    /// its CNI ADD just captured).
    async fn reconcile_from(
        &self,
        pods: &[Arc<Pod>],
        namespaces: &NamespaceLabels,
        min_age: Duration,
    ) -> anyhow::Result<()> {
        let Some(k) = self.kube.clone() else {
            return Ok(());
        };
        k.write_selection(namespaces);
        k.prune_records(&pods.iter().filter_map(|p| p.metadata.uid.clone()).collect());
        let now = boottime_ns();
        let book = self.book.clone();
        let records = tokio::task::spawn_blocking(move || book.dataplane().maps().pods()).await?;
        self.announce_out_of_step(pods, &records);
        let enrolled: Vec<Enrolled> = records
            .iter()
            .map(|r| Enrolled { uid: r.uid.clone() })
            .collect();
        *self.skipped.lock().unwrap() =
            crate::kube::reconcile::skipped(pods, namespaces, &k.node, &k.selection);
        self.claim_runtime_addrs(pods, &records).await?;
        let mut acted = false;
        for action in plan(pods, namespaces, &k.node, &k.selection, &enrolled) {
            acted = true;
            match action {
                Action::Enroll {
                    uid,
                    name,
                    namespace,
                    service_account,
                    options,
                } => {
                    let span = info_span!("pod", %uid, pod = %format!("{namespace}/{name}"));
                    let ips = ips_of(pods, &uid);
                    let pod = ToCapture {
                        uid,
                        name,
                        namespace,
                        service_account,
                        options: *options,
                        ips,
                    };
                    self.capture(&k, pod).instrument(span).await
                }
                Action::Unenroll { uid, reason } => {
                    let young = records.iter().any(|r| {
                        r.uid == uid
                            && now.saturating_sub(r.enrolled_at_ns) < min_age.as_nanos() as u64
                    });
                    if !young {
                        self.release(&uid, &reason, &records).await;
                    }
                }
            }
        }
        // The pods just captured or released too.
        let records = if acted {
            let book = self.book.clone();
            tokio::task::spawn_blocking(move || book.dataplane().maps().pods()).await?
        } else {
            records
        };
        self.exclusions.sync(&k.selection, pods, &records).await;
        Ok(())
    }

    /// Enrolled pods whose addresses a starting agent read from their netns
    /// get the runtime's (`status.podIPs`) once the API shows them
    /// (`Enroller::claim_addrs`: nothing for pods that have them already).
    async fn claim_runtime_addrs(
        &self,
        pods: &[Arc<Pod>],
        records: &[PodRecord],
    ) -> anyhow::Result<()> {
        let by_uid: HashMap<&str, &Pod> = pods
            .iter()
            .filter_map(|p| Some((p.metadata.uid.as_deref()?, p.as_ref())))
            .collect();
        let known: Vec<(PodUid, Vec<std::net::IpAddr>)> = records
            .iter()
            .filter_map(|r| {
                let ips = crate::kube::selection::pod_ips(by_uid.get(r.uid.as_str())?);
                Some((PodUid::new(&r.uid).ok()?, ips))
            })
            .filter(|(_, ips)| !ips.is_empty())
            .collect();
        let enroller = self.enroller.clone();
        tokio::task::spawn_blocking(move || {
            for (uid, ips) in known {
                enroller.claim_addrs(&uid, &ips);
            }
        })
        .await?;
        Ok(())
    }

    /// Annotations and gates that disagree with the map (a lost write,
    /// someone else's edit) are written again.
    fn announce_out_of_step(&self, pods: &[Arc<Pod>], records: &[PodRecord]) {
        let by_uid: HashMap<&str, PodState> = records
            .iter()
            .filter_map(|r| Some((r.uid.as_str(), r.state?)))
            .collect();
        for pod in pods {
            let m = &pod.metadata;
            let (Some(ns), Some(name), Some(uid)) = (&m.namespace, &m.name, &m.uid) else {
                continue;
            };
            let state = by_uid.get(uid.as_str()).copied();
            let capture = state.map_or(Default::default(), |_| self.book.capture_of(uid));
            if out_of_step(pod, state, capture) {
                self.announcer.announce_pod(ns, name, uid);
            }
        }
    }

    /// Captures a running ambient pod the CNI plugin did not (its netns as
    /// the plugin recorded it, or found from its processes).
    async fn capture(&self, k: &KubeCtx, pod: ToCapture) {
        let ToCapture {
            uid,
            name,
            namespace,
            service_account,
            options,
            ips,
        } = pod;
        let pod = PodRef {
            namespace: namespace.clone(),
            name: name.clone(),
            uid: uid.clone(),
        };
        let event = |reason, note: String| self.announcer.event(pod.clone(), reason, note);
        let recorded = PodUid::new(&uid).ok().and_then(|u| k.recorded_netns(&u));
        let found = {
            let (uid, ips) = (uid.clone(), ips.clone());
            // A recorded path counts only while it holds the pod's
            // addresses (a pid's netns path names another once reused).
            tokio::task::spawn_blocking(move || {
                recorded
                    .filter(|n| crate::podnet::podns::holds(n, &ips))
                    .or_else(|| crate::podnet::podns::find(&uid, &ips))
            })
            .await
            .ok()
            .flatten()
        };
        let Some(netns) = found else {
            self.metrics.reconcile_error(ReconcileError::NoProcess);
            warn!(ips = ?ips, "ambient pod without capture, but no process of its cgroup runs here yet in a netns that holds its IPs");
            return;
        };
        info!(netns = %netns.display(), "capturing a running ambient pod");
        let options = match options {
            Ok(o) => o,
            Err(e) => {
                warn!(error = %e, "not capturing: bad pod annotation");
                self.metrics.reconcile_error(ReconcileError::BadAnnotation);
                return event(Reason::InvalidAnnotation, format!("not captured: {e}"));
            }
        };
        let w = match Workload::new(&name, &namespace, &service_account) {
            Ok(w) => w,
            Err(e) => return warn!(error = %e, "bad workload identity"),
        };
        let addrs = PodAddrs::from_runtime(ips);
        let app = AppStarted::Maybe;
        match self
            .enroller
            .enroll(netns, &uid, w, options, addrs, app)
            .await
        {
            Ok(_) => self.metrics.captured_after_start(),
            Err(e) => {
                let e = crate::one_line(&e);
                warn!(error = %e, "enrolling failed; will retry");
                self.metrics.reconcile_error(ReconcileError::Enroll);
                event(
                    Reason::CaptureFailed,
                    format!("capturing the running pod failed (retried): {e}"),
                );
            }
        }
    }

    /// Releases a pod that is gone or no longer ambient.
    async fn release(&self, uid: &str, reason: &str, records: &[PodRecord]) {
        info!(%uid, %reason, "releasing pod");
        let who = records
            .iter()
            .find(|r| r.uid == uid)
            .and_then(|r| r.workload.as_ref());
        if let Some(w) = who {
            self.announcer.event(
                PodRef::new(w, uid),
                Reason::CaptureReleased,
                format!("capture removed: {reason}"),
            );
        }
        if let Err(e) = self.enroller.unenroll(uid).await {
            self.metrics.reconcile_error(ReconcileError::Unenroll);
            warn!(%uid, error = %crate::one_line(&e), "unenrolling failed; will retry");
        }
    }
}

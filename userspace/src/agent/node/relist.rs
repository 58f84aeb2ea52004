//! Reconciling with the API: capture ambient pods the CNI plugin did not
//! see, release pods that are gone or no longer ambient.

use super::*;
use k8s_openapi::api::core::v1::Pod;

use crate::kube::events::{PodRef, Reason};

impl Node {
    /// Keeps the enrolled pods equal to the ambient pods of this node (pods
    /// that became ambient after they started, pods that existed before the
    /// agent, pods gone while it was away): a pass at start, on every pod or
    /// namespace change the watch reports, and every `RESYNC`.
    pub async fn reconcile_with_api(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let Some(k) = self.kube.clone() else { return };
        // Watch events wake the loop at once; the timer is a safety net
        // (a pod whose capture failed is tried again).
        let (tx, mut changes) = tokio::sync::mpsc::channel(1);
        let me = self.clone();
        let (view, drive) = k.reflect(tx, move |e| {
            me.metrics().reconcile_error(ReconcileError::Api);
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
    pub async fn reconcile_once(self: &Arc<Self>, min_age: Duration) -> anyhow::Result<()> {
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
        self: &Arc<Self>,
        pods: &[Arc<Pod>],
        namespaces: &crate::agent::cluster::NamespaceLabels,
        min_age: Duration,
    ) -> anyhow::Result<()> {
        let Some(k) = self.kube.clone() else {
            return Ok(());
        };
        k.write_selection(namespaces);
        k.prune_records(&pods.iter().filter_map(|p| p.metadata.uid.clone()).collect());
        let now = boottime_ns();
        let this = self.clone();
        let records =
            tokio::task::spawn_blocking(move || this.dp.lock().unwrap().maps.pods()).await?;
        // Annotations and gates that disagree with the map (a lost write,
        // someone else's edit) are written again.
        let by_name: HashMap<(&str, &str), (PodState, &str)> = records
            .iter()
            .filter_map(|r| {
                let w = r.workload.as_ref()?;
                let state = r.state?;
                Some((
                    (w.namespace.as_str(), w.name.as_str()),
                    (state, r.uid.as_str()),
                ))
            })
            .collect();
        for pod in pods {
            let (Some(ns), Some(name)) = (&pod.metadata.namespace, &pod.metadata.name) else {
                continue;
            };
            let found = by_name.get(&(ns.as_str(), name.as_str())).copied();
            let state = found.map(|(s, _)| s);
            let capture = found.map_or(Default::default(), |(_, uid)| self.capture_of(uid));
            if crate::agent::cluster::out_of_step(pod, state, capture) {
                self.announce_pod(ns, name);
            }
        }
        let enrolled: Vec<Enrolled> = records
            .iter()
            .map(|r| Enrolled { uid: r.uid.clone() })
            .collect();
        *self.skipped.lock().unwrap() =
            crate::kube::reconcile::skipped(pods, namespaces, &k.node, &k.excluded);
        for action in plan(pods, namespaces, &k.node, &k.excluded, &enrolled) {
            match action {
                Action::Enroll {
                    uid,
                    name,
                    namespace,
                    service_account,
                    options,
                } => {
                    let span = info_span!("pod", %uid, pod = %format!("{namespace}/{name}"));
                    let pod = PodRef {
                        namespace: namespace.clone(),
                        name: name.clone(),
                        uid: uid.clone(),
                    };
                    let event = |reason, note: String| {
                        if let Some(e) = &self.events {
                            e.pod(pod.clone(), reason, note);
                        }
                    };
                    async {
                        let found = PodUid::new(&uid)
                            .ok()
                            .and_then(|u| k.recorded_netns(&u))
                            .or_else(|| crate::podnet::podns::find(&uid));
                        let Some(netns) = found else {
                            self.metrics().reconcile_error(ReconcileError::NoProcess);
                            warn!("ambient pod without capture, but none of its processes runs here yet");
                            return;
                        };
                        info!(netns = %netns.display(), "capturing a running ambient pod");
                        let options = match options {
                            Ok(o) => o,
                            Err(e) => {
                                warn!(error = %e, "not capturing: bad pod annotation");
                                self.metrics().reconcile_error(ReconcileError::BadAnnotation);
                                return event(Reason::InvalidAnnotation, format!("not captured: {e}"));
                            }
                        };
                        let w = match Workload::new(&name, &namespace, &service_account) {
                            Ok(w) => w,
                            Err(e) => return warn!(error = %e, "bad workload identity"),
                        };
                        match self.enroll(netns, &uid, w, options).await {
                            Ok(_) => self.metrics().captured_after_start(),
                            Err(e) => {
                                let e = crate::one_line(&e);
                                warn!(error = %e, "enrolling failed; will retry");
                                self.metrics().reconcile_error(ReconcileError::Enroll);
                                event(Reason::CaptureFailed, format!("capturing the running pod failed (retried): {e}"));
                            }
                        }
                    }
                    .instrument(span)
                    .await
                }
                Action::Unenroll { uid, reason } => {
                    let young = records.iter().any(|r| {
                        r.uid == uid
                            && now.saturating_sub(r.enrolled_at_ns) < min_age.as_nanos() as u64
                    });
                    if young {
                        continue;
                    }
                    info!(%uid, %reason, "releasing pod");
                    let who = records
                        .iter()
                        .find(|r| r.uid == uid)
                        .and_then(|r| r.workload.as_ref());
                    if let (Some(events), Some(w)) = (&self.events, who) {
                        events.pod(
                            PodRef::new(w, &uid),
                            Reason::CaptureReleased,
                            format!("capture removed: {reason}"),
                        );
                    }
                    if let Err(e) = self.unenroll(&uid).await {
                        self.metrics().reconcile_error(ReconcileError::Unenroll);
                        warn!(%uid, error = %crate::one_line(&e), "unenrolling failed; will retry");
                    }
                }
            }
        }
        Ok(())
    }
}

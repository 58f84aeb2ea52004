//! Telling Kubernetes about pods: one queue writes each pod's annotation and
//! readiness gate from the map's current state, and Events go on the pods.
//! Without the API (no `--node-name`) nothing is queued or sent.

use std::{
    collections::{BTreeSet, HashMap},
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::sync::{watch, Notify};
use tracing::{debug, warn};

use super::{book::PodBook, pods::PodTable};
use crate::{
    agent::cluster::KubeCtx,
    kube::events::{Events, PodRef, Reason},
};

pub(super) struct Announcer {
    kube: Option<KubeCtx>,
    /// Kubernetes Events on pods (with the API only).
    events: Option<Events>,
    /// Who a pod is, for its Events.
    pods: Arc<PodTable>,
    /// Pods (namespace, name, uid) whose annotation and gate need writing:
    /// by uid, so that one pod's state never lands on another of the same
    /// name (a StatefulSet's next pod, its predecessor still being torn
    /// down on this node).
    queue: Mutex<BTreeSet<(String, String, String)>>,
    wake: Notify,
    /// Pods whose last write failed, by uid: the wait before the next try,
    /// and whether that try is scheduled (one at a time per pod, however
    /// often the pod is queued meanwhile).
    backoff: Mutex<HashMap<String, (Duration, bool)>>,
}

/// The first wait after a failed write, doubled at each failure up to
/// [`RETRY_MAX`]: an API that refuses for good (RBAC taken away, a webhook
/// that denies) gets a few writes a minute per pod, not one a second.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(60);

impl Announcer {
    pub(super) fn new(kube: Option<KubeCtx>, pods: Arc<PodTable>) -> Self {
        let events = kube
            .as_ref()
            .map(|k| Events::start(k.client.clone(), &k.node));
        Self {
            kube,
            events,
            pods,
            queue: Mutex::default(),
            wake: Notify::new(),
            backoff: Mutex::default(),
        }
    }

    /// Queues pod `namespace/name` of `uid` for the announcer, which writes
    /// whatever state the map has for that uid when its turn comes: writes
    /// for one pod can neither overtake each other nor leave an old state
    /// behind.
    pub(super) fn announce_pod(&self, namespace: &str, name: &str, uid: &str) {
        if self.kube.is_none() {
            return;
        }
        self.queue
            .lock()
            .unwrap()
            .insert((namespace.to_owned(), name.to_owned(), uid.to_owned()));
        self.wake.notify_one();
    }

    /// A write for pod `uid` failed: how long before the next, or `None`
    /// when a retry is scheduled already.
    fn failed_write(&self, uid: &str) -> Option<Duration> {
        let mut b = self.backoff.lock().unwrap();
        let (wait, scheduled) = b.get(uid).copied().unwrap_or((RETRY_MIN, false));
        if scheduled {
            return None;
        }
        b.insert(uid.to_owned(), ((wait * 2).min(RETRY_MAX), true));
        Some(wait)
    }

    /// The scheduled retry for pod `uid` is due: it is queued, and a failure
    /// may schedule the next.
    fn retry_due(&self, uid: &str) {
        if let Some((_, scheduled)) = self.backoff.lock().unwrap().get_mut(uid) {
            *scheduled = false;
        }
    }

    /// A write for pod `uid` is done with: the next failure waits the least.
    fn written(&self, uid: &str) {
        self.backoff.lock().unwrap().remove(uid);
    }

    /// Publishes a Kubernetes Event on an enrolled pod (nothing without the
    /// API, or for a pod the agent does not hold).
    pub(super) fn pod_event(&self, uid: &str, reason: Reason, note: &str) {
        if let Some(w) = self.pods.workload(uid) {
            self.event(PodRef::new(&w, uid), reason, note);
        }
    }

    /// A Warning on a pod with more addresses than its share
    /// (`--max-pod-addresses`): `over` are not its for the programs.
    pub(super) fn too_many_addresses(&self, uid: &str, over: &[std::net::IpAddr]) {
        let note = format!(
            "the pod has more addresses than this node publishes per pod (--max-pod-addresses); not captured as its: {over:?}"
        );
        self.pod_event(uid, Reason::TooManyAddresses, &note);
    }

    /// Publishes a Kubernetes Event on `pod`, held or not (nothing without
    /// the API).
    pub(super) fn event(&self, pod: PodRef, reason: Reason, note: impl Into<String>) {
        if let Some(events) = &self.events {
            events.pod(pod, reason, note);
        }
    }

    /// Writes queued pods' annotation and readiness-gate condition, one pod
    /// at a time, as `book` has them; failures are retried with a per-pod
    /// backoff (not for gone pods).
    pub(super) async fn run(self: Arc<Self>, book: Arc<PodBook>, mut stop: watch::Receiver<bool>) {
        let Some(k) = self.kube.clone() else { return };
        loop {
            tokio::select! {
                _ = stop.changed() => return,
                _ = self.wake.notified() => {}
            }
            let batch = std::mem::take(&mut *self.queue.lock().unwrap());
            for (ns, name, uid) in batch {
                let book = book.clone();
                let u = uid.clone();
                let Ok(shown) = tokio::task::spawn_blocking(move || book.state_by_uid(&u)).await
                else {
                    continue;
                };
                let pod = format!("{ns}/{name}");
                match tokio::time::timeout(
                    crate::kube::API_TIMEOUT,
                    k.publish(&ns, &name, &uid, shown),
                )
                .await
                {
                    Ok(Ok(())) => self.written(&uid),
                    // Gone, or another pod of the name now (its uid is not
                    // the patch's: a conflict, or invalid as immutable).
                    Ok(Err(kube::Error::Api(e))) if matches!(e.code, 404 | 409 | 422) => {
                        self.written(&uid);
                        debug!(%pod, code = e.code, reason = %e.reason, "pod gone, or another of its name: not written");
                    }
                    failed => {
                        let why = match failed {
                            Ok(Err(e)) => e.to_string(),
                            _ => "the API server did not answer".into(),
                        };
                        let Some(wait) = self.failed_write(&uid) else {
                            continue;
                        };
                        warn!(%pod, error = %why, retry_in_s = wait.as_secs(), "could not update the pod's redirection annotation or readiness gate; will retry");
                        let this = self.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(wait).await;
                            this.retry_due(&uid);
                            this.announce_pod(&ns, &name, &uid);
                        });
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write the API keeps refusing (RBAC taken away, a webhook that
    /// denies) is retried ever less often, up to once a minute per pod; a
    /// write that lands starts the next failure's wait over. (It was every
    /// second, forever: 100 pods, 100 writes and warnings a second.)
    #[test]
    fn failed_writes_back_off_to_a_minute_and_a_written_pod_starts_over() {
        let a = Announcer::new(None, Arc::default());
        let mut waits = Vec::new();
        for _ in 0..8 {
            waits.push(a.failed_write("u1").expect("none scheduled").as_secs());
            // Queued again meanwhile (a relist, a repair) and failing: no
            // second retry while one is scheduled.
            assert_eq!(a.failed_write("u1"), None);
            a.retry_due("u1");
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(a.failed_write("u2"), Some(RETRY_MIN), "per pod");
        a.written("u1");
        assert_eq!(a.failed_write("u1"), Some(RETRY_MIN));
    }
}

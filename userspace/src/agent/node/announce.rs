//! Telling Kubernetes: one queue writes each pod's annotation and readiness
//! gate from the map's current state.

use super::*;

impl Node {
    /// Queues pod `namespace/name` for the announcer, which writes whatever
    /// state the map has for it when its turn comes: writes for one pod can
    /// neither overtake each other nor leave an old state behind.
    pub(super) fn announce_pod(&self, namespace: &str, name: &str) {
        if self.kube.is_none() {
            return;
        }
        self.announcements
            .lock()
            .unwrap()
            .insert((namespace.to_owned(), name.to_owned()));
        self.announce_wake.notify_one();
    }

    /// The state the map has for the pod named `namespace/name`, and
    /// whether its capture is complete (as the last repair found it).
    pub(super) fn state_by_name(
        &self,
        namespace: &str,
        name: &str,
    ) -> (Option<PodState>, crate::kube::gate::Capture) {
        let dp = self.dp.lock().unwrap();
        let found = dp.maps().states().into_iter().find_map(|(cookie, e)| {
            let m = dp.maps().meta(cookie)?;
            (m.workload.namespace == namespace && m.workload.name == name)
                .then(|| e.state().map(|s| (s, m.uid)))
                .flatten()
        });
        match found {
            Some((state, uid)) => (Some(state), self.capture_of(&uid)),
            None => (None, Default::default()),
        }
    }

    /// Whether the pod of `uid` has every link its capture calls for.
    pub(super) fn capture_of(&self, uid: &str) -> crate::kube::gate::Capture {
        use crate::kube::gate::Capture;
        if self.pods.is_incomplete(uid) {
            Capture::Incomplete
        } else {
            Capture::Complete
        }
    }

    /// Writes queued pods' annotation and readiness-gate condition, one pod
    /// at a time; failures are retried after a second (not for gone pods).
    pub async fn announcer(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let Some(k) = self.kube.clone() else { return };
        loop {
            tokio::select! {
                _ = stop.changed() => return,
                _ = self.announce_wake.notified() => {}
            }
            let batch = std::mem::take(&mut *self.announcements.lock().unwrap());
            for (ns, name) in batch {
                let this = self.clone();
                let (n, p) = (ns.clone(), name.clone());
                let Ok((state, capture)) =
                    tokio::task::spawn_blocking(move || this.state_by_name(&n, &p)).await
                else {
                    continue;
                };
                let pod = format!("{ns}/{name}");
                match tokio::time::timeout(
                    crate::kube::API_TIMEOUT,
                    k.publish(&ns, &name, state, capture),
                )
                .await
                {
                    Ok(Ok(())) => {}
                    Ok(Err(kube::Error::Api(e))) if e.code == 404 => {}
                    failed => {
                        let why = match failed {
                            Ok(Err(e)) => e.to_string(),
                            _ => "the API server did not answer".into(),
                        };
                        warn!(%pod, error = %why, "could not update the pod's redirection annotation or readiness gate; will retry");
                        let this = self.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            this.announce_pod(&ns, &name);
                        });
                    }
                }
            }
        }
    }
}

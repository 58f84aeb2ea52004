//! Listener supervision and retries: Enabled pods whose listeners are gone
//! go back to Pending; Pending pods are offered to ztunnel again, with
//! backoff; listeners whose ztunnel let go of them are released.

use super::*;

impl Node {
    /// Withdraws held listeners whose ztunnel let go of them (out of the
    /// socket map, so the pod fails closed; still held for the connections
    /// queued on them), except for pods with an add in flight (a newer
    /// ztunnel's listeners replace them first); closes those withdrawn longer
    /// than `--orphan-grace`.
    pub(super) fn release_orphans(&self, only: Option<&str>) {
        let withdrawn = self
            .custody
            .withdraw_orphans(only, |uid| self.pods.in_flight(uid));
        if !withdrawn.is_empty() {
            let mut dp = self.dp.lock().unwrap();
            for (uid, role) in &withdrawn {
                if let Some(cookie) = self.pods.cookie(uid) {
                    dp.maps_mut().remove_listener(cookie, *role);
                }
            }
            drop(dp);
            info!(
                listeners = withdrawn.len(),
                "ztunnel let go of listeners: out of the socket map; connections queued on them wait for the next ztunnel"
            );
            self.wake.notify_one();
        }
        let n = self.custody.expire();
        if n > 0 {
            warn!(
                listeners = n,
                "no ztunnel took over within the orphan grace: closed, connections queued on them were reset"
            );
        }
    }

    /// Schedules a retry with exponential backoff.
    pub(super) fn fail(&self, uid: &str, cause: Cause, why: &str) {
        self.pods.apply(
            uid,
            Event::AddFailed {
                cause,
                why: why.to_owned(),
            },
        );
    }

    /// Keeps the map's states true: Enabled pods whose listeners are gone
    /// (ztunnel exited) go back to Pending; Pending pods are offered to the
    /// newest ztunnel again, with backoff.
    pub async fn reconcile(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut verified = Instant::now();
        loop {
            tokio::select! {
                _ = stop.changed() => return,
                _ = self.wake.notified() => {},
                _ = tokio::time::sleep(CHECK_EVERY) => {},
            }
            if verified.elapsed() >= RESYNC {
                verified = Instant::now();
                let this = self.clone();
                let _ = tokio::task::spawn_blocking(move || this.verify_all(false)).await;
            }
            // The map walk waits for the dataplane lock an enrollment may
            // hold for tens of milliseconds: never on an async worker.
            let this = self.clone();
            let Ok(due) = tokio::task::spawn_blocking(move || this.check()).await else {
                continue;
            };
            let Some(conn) = self.hub.newest() else {
                continue;
            };
            for (cookie, uid, w) in due {
                let this = self.clone();
                let conn = conn.clone();
                let span = info_span!("pod", %uid, pod = %format!("{}/{}", w.namespace, w.name));
                tokio::spawn(
                    async move {
                        if let Err(why) = this.add(&conn, cookie, &uid, &w).await {
                            info!(%why, "pod stays Pending; will retry");
                        }
                    }
                    .instrument(span),
                );
            }
        }
    }

    /// One pass over the pods: demotes Enabled pods without listeners and
    /// returns the Pending pods due for another add.
    pub(super) fn check(&self) -> Vec<(u64, String, Workload)> {
        // First let go of listeners ztunnel closed: their map entries go,
        // and the pass below sees those pods without listeners.
        self.release_orphans(None);
        let mut due = Vec::new();
        let mut dp = self.dp.lock().unwrap();
        let connected = self.hub.is_connected();
        let complete = dp.maps().pods_with_every_listener();
        for (cookie, entry) in dp.maps().states() {
            let state = entry.state();
            if !matches!(
                state,
                Some(PodState::Pending | PodState::Enabled | PodState::Served)
            ) {
                continue;
            }
            let Some(meta) = dp.maps().meta(cookie) else {
                continue;
            };
            if !self.pods.contains(&meta.uid) {
                // Not opened at start (its netns was missing then): hold it
                // now, opened by path when needed.
                self.pods.insert(cookie, meta.clone(), None);
            }
            match state {
                Some(PodState::Enabled | PodState::Served) if !complete.contains(&cookie) => {
                    warn!(uid = %meta.uid, "ztunnel's listeners are gone (ztunnel restarting?): Pending, failing closed");
                    let _ = dp
                        .maps_mut()
                        .apply(cookie, Event::ListenersGone, boottime_ns());
                }
                Some(PodState::Pending)
                    if connected
                        && self
                            .pods
                            .apply(&meta.uid, Event::RetryDue(Instant::now()))
                            .contains(&Effect::SendAdd) =>
                {
                    due.push((cookie, meta.uid, meta.workload));
                }
                _ => {}
            }
        }
        due
    }
}

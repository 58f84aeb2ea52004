//! Listener supervision and retries: Enabled pods whose listeners are gone
//! go back to Pending; Pending pods are offered to ztunnel again, with
//! backoff; listeners whose ztunnel let go of them are released.

use super::*;

impl Node {
    /// Releases held listeners whose ztunnel let go of them, except for pods
    /// with an add in flight (a newer ztunnel's listeners replace them first).
    pub(super) fn release_orphans(&self, only: Option<&str>) {
        let n = self.custody.release_orphans(only, |uid| {
            self.retries
                .lock()
                .unwrap()
                .get(uid)
                .is_some_and(|r| r.in_flight)
        });
        if n > 0 {
            info!(listeners = n, "released listeners their ztunnel closed");
            self.wake.notify_one();
        }
    }

    /// Schedules a retry with exponential backoff.
    pub(super) fn fail(&self, uid: &str, why: &str) {
        let mut r = self.retries.lock().unwrap();
        let e = r.entry(uid.to_owned()).or_insert(Retry::fresh(false, None));
        e.in_flight = false;
        e.last_error = Some(why.to_owned());
        e.due = Instant::now() + e.backoff;
        e.backoff = (e.backoff * 2).min(RETRY_MAX);
    }

    pub(super) fn schedule(&self, uid: &str, after: Duration) {
        let mut r = self.retries.lock().unwrap();
        let e = r.entry(uid.to_owned()).or_insert(Retry::fresh(false, None));
        e.due = Instant::now() + after;
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
                let span = info_span!("pod", %uid);
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
        let mut retries = self.retries.lock().unwrap();
        let now = Instant::now();
        let connected = self.hub.is_connected();
        for p in dp.maps.pods() {
            let complete = Role::ALL
                .iter()
                .all(|r| p.listeners.iter().any(|l| l.starts_with(r.as_str())));
            match p.state {
                Some("Enabled") if !complete => {
                    warn!(uid = %p.uid, "ztunnel's listeners are gone (ztunnel restarting?): Pending, failing closed");
                    let _ = dp
                        .maps
                        .set_state(p.netns_cookie, PodState::Pending, boottime_ns());
                    retries.insert(
                        p.uid.clone(),
                        Retry::fresh(false, Some("ztunnel's listeners are gone".into())),
                    );
                }
                Some("Pending") => {
                    let r = retries
                        .entry(p.uid.clone())
                        .or_insert(Retry::fresh(false, None));
                    if !r.in_flight && r.due <= now && connected {
                        if let Some(w) = p.workload.clone() {
                            r.in_flight = true;
                            due.push((p.netns_cookie, p.uid.clone(), w));
                        }
                    }
                }
                _ => {}
            }
        }
        due
    }
}

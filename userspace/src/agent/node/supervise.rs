//! Supervision and retries: Enabled pods whose listeners are gone go back to
//! Pending; Pending pods are offered to ztunnel again, with backoff; listeners
//! whose ztunnel let go of them are released; every pod's capture is verified
//! every `VERIFY_EVERY`.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use sluice_common::PodState;
use tokio::sync::watch;
use tracing::{info, info_span, warn, Instrument as _};

use super::{book::PodBook, repair::Repairer, ztunnels::Ztunnels};
use crate::{
    dataplane::state::boottime_ns,
    lifecycle::{Effect, Event},
    workload::Workload,
};

/// How often Enabled pods are checked for their listeners, at most.
const CHECK_EVERY: Duration = Duration::from_millis(200);

pub(super) struct Supervisor {
    pub(super) book: Arc<PodBook>,
    pub(super) ztunnels: Arc<Ztunnels>,
    pub(super) repair: Arc<Repairer>,
}

impl Supervisor {
    /// Keeps the map's states true: Enabled pods whose listeners are gone
    /// (ztunnel exited) go back to Pending; Pending pods are offered to the
    /// newest ztunnel again, with backoff.
    pub(super) async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut verified = Instant::now();
        let mut period = self.repair.next_pass();
        loop {
            tokio::select! {
                _ = stop.changed() => return,
                _ = self.ztunnels.changed() => {},
                _ = tokio::time::sleep(CHECK_EVERY) => {},
            }
            if verified.elapsed() >= period {
                verified = Instant::now();
                period = self.repair.next_pass();
                let repair = self.repair.clone();
                let _ = tokio::task::spawn_blocking(move || repair.verify_all(false)).await;
            }
            // The map walk waits for the dataplane lock an enrollment may
            // hold for tens of milliseconds: never on an async worker.
            let this = self.clone();
            let Ok(due) = tokio::task::spawn_blocking(move || this.check()).await else {
                continue;
            };
            let Some(conn) = self.ztunnels.hub().newest() else {
                continue;
            };
            for (cookie, uid, w) in due {
                let ztunnels = self.ztunnels.clone();
                let conn = conn.clone();
                let span = info_span!("pod", %uid, pod = %format!("{}/{}", w.namespace, w.name));
                tokio::spawn(
                    async move {
                        if let Err(why) = ztunnels.add(&conn, cookie, &uid, &w).await {
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
    fn check(&self) -> Vec<(u64, String, Workload)> {
        // First let go of listeners ztunnel closed: their map entries go,
        // and the pass below sees those pods without listeners.
        self.ztunnels.release_orphans(None);
        let mut due = Vec::new();
        let pods = self.book.pods();
        let mut dp = self.book.dataplane();
        let connected = self.ztunnels.hub().is_connected();
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
            if !pods.contains(&meta.uid) {
                // Not opened at start (its netns was missing then): hold it
                // now, opened by path when needed.
                let acked = state.is_some_and(PodState::steers);
                pods.insert(cookie, meta.clone(), None, acked);
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
                        && pods
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

//! The ZDS side: adds to ztunnel, their answers, and registering the
//! listeners of the ztunnel that acked; the server's `Handler`.

use super::*;
use crate::{kube::events::Reason, lifecycle::Ztunnel};

impl Node {
    /// ZDS add on `conn`, then listener registration. Errors explain why the
    /// pod stays Pending (it is retried).
    pub(super) async fn add(
        self: &Arc<Self>,
        conn: &Arc<Conn>,
        cookie: u64,
        uid: &str,
        w: &Workload,
    ) -> Result<(), String> {
        let fd = self
            .netns_of(cookie)
            .map(Netns::into_fd)
            .map_err(|e| e.to_string())?;
        let out = conn.request(WorkloadRequest::add(uid, w), Some(fd)).await;
        self.after_add(uid, cookie, conn.pid, out).await
    }

    pub(super) async fn after_add(
        self: &Arc<Self>,
        uid: &str,
        cookie: u64,
        pid: Option<i32>,
        out: Result<Answer, ZdsError>,
    ) -> Result<(), String> {
        let (cause, why) = match out {
            Ok(Answer::Ack) => {
                self.metrics().zds_answer(true);
                // Before the pod can turn Enabled: the served check asks this one.
                self.pods.apply(uid, Event::Acked(Ztunnel::new(pid)));
                match self.register(uid, cookie, pid).await {
                    Ok(()) => {
                        // Listeners of an older ztunnel that were kept only
                        // until this one's replaced them.
                        self.release_orphans(Some(uid));
                        return Ok(());
                    }
                    Err(e) => {
                        self.metrics().failed(Failure::NoListeners);
                        self.pod_event(uid, Reason::ZtunnelListenersMissing, &e);
                        (Cause::Other, e)
                    }
                }
            }
            Ok(Answer::Nack(t)) => {
                warn!(%uid, nack = %t, "ztunnel nacked add");
                self.pod_event(
                    uid,
                    Reason::ZtunnelRejected,
                    &format!("ztunnel refused the pod: {t}"),
                );
                self.metrics().zds_answer(false);
                self.metrics().failed(Failure::Nack);
                (Cause::ZtunnelRefused, format!("ztunnel nacked add: {t}"))
            }
            Err(e) => {
                warn!(%uid, error = %e, "add failed");
                self.metrics().failed(Failure::Zds);
                (Cause::Other, format!("add failed: {e}"))
            }
        };
        self.fail(uid, cause, &why);
        self.release_orphans(Some(uid));
        Err(why)
    }

    /// Looks for the listeners of the ztunnel that just acked (`pid`) until
    /// every role has one, then the pod is Enabled.
    pub(super) async fn register(
        self: &Arc<Self>,
        uid: &str,
        cookie: u64,
        pid: Option<i32>,
    ) -> Result<(), String> {
        let start = Instant::now();
        let mut first = true;
        loop {
            let this = self.clone();
            let owned_uid = uid.to_owned();
            let got = tokio::task::spawn_blocking(move || -> Result<PodState, EnrollError> {
                let ns = this.netns_of(cookie)?;
                let mut guard = this.dp.lock().unwrap();
                let dp = &mut *guard;
                if first {
                    enroll::refresh_addrs(&mut dp.maps, &ns, cookie)?;
                }
                let (e, taken) = enroll::register_keeping(&mut dp.maps, &ns, cookie, pid)?;
                // Without a known peer there is no owner to ask about later.
                if pid.is_some() {
                    this.custody.keep(&owned_uid, taken);
                }
                Ok(e.state)
            })
            .await
            .map_err(|e| e.to_string())?;
            match got {
                Ok(s) if s.steers() => {
                    // Whether that ztunnel can serve the pod is asked at once
                    // (the step's effect).
                    info!(%uid, pid = pid.unwrap_or(0), state = s.as_str(), "ztunnel acked; listeners registered");
                    return Ok(());
                }
                Ok(_) if start.elapsed() < LISTENER_WAIT => {
                    first = false;
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Ok(_) => {
                    return Err(
                        "ztunnel acked but its listeners did not appear in the pod netns".into(),
                    )
                }
                Err(e) => return Err(e.to_string()),
            }
        }
    }
}

impl Handler for Node {
    fn snapshot(&self) -> Vec<SnapshotEntry> {
        let dp = self.dp.lock().unwrap();
        let mut out = Vec::new();
        for p in self.pods.staying() {
            let uid = p.identity.uid;
            // A pod being torn down is not offered again.
            if dp.maps.entry(p.cookie).and_then(|e| e.state()) == Some(PodState::Draining) {
                continue;
            }
            let held = p.netns.and_then(|n| n.try_clone().ok());
            match held.map_or_else(|| enroll::open_pod_netns(&dp.maps, p.cookie), Ok) {
                Ok(ns) => {
                    // The snapshot's add is this pod's attempt now; a new
                    // ztunnel starts the backoff afresh.
                    self.pods.apply(&uid, Event::AddSent);
                    out.push(SnapshotEntry::Add {
                        uid,
                        workload: p.identity.workload,
                        netns: ns.into_fd(),
                    });
                }
                Err(e) => {
                    warn!(%uid, error = %e, "pod netns unavailable: sending keep");
                    out.push(SnapshotEntry::Keep { uid });
                }
            }
        }
        out
    }

    fn add_outcome(&self, uid: &str, pid: Option<i32>, outcome: &Result<Answer, ZdsError>) {
        // Registration may take a while (listeners appear around the ack): off
        // the connection's task, so the snapshot goes on.
        let Some(this) = self.self_arc() else { return };
        let Some(cookie) = PodUid::new(uid).ok().and_then(|u| self.cookie_of(&u)) else {
            return;
        };
        let uid = uid.to_owned();
        let out = match outcome {
            Ok(a) => Ok(a.clone()),
            Err(e) => Err(ZdsError::Protocol(e.to_string())),
        };
        tokio::spawn(async move {
            if let Err(why) = this.after_add(&uid, cookie, pid, out).await {
                info!(%uid, %why, "pod stays Pending; will retry");
            }
        });
    }

    fn connected(&self, id: u64, pid: Option<i32>) {
        info!(conn = id, pid = pid.unwrap_or(0), "ztunnel live");
        self.wake.notify_one();
    }

    fn disconnected(&self, id: u64) {
        info!(conn = id, "ztunnel connection gone");
        self.release_orphans(None);
        self.wake.notify_one();
    }
}

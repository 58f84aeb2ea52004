//! The ztunnel connections: the ZDS hub, adds to ztunnel and their answers,
//! registering the listeners of the ztunnel that acked, and custody of those
//! listeners (released once their ztunnel lets go of them). Implements the
//! ZDS server's `Handler`.

use std::{
    collections::BTreeMap,
    sync::{Arc, Weak},
    time::{Duration, Instant},
};

use sluice_common::PodState;
use tokio::sync::Notify;
use tracing::{info, warn};

use super::{announce::Announcer, book::PodBook};
use crate::{
    agent::custody::Custody,
    kube::events::Reason,
    lifecycle::{Cause, Event, Ztunnel},
    metrics::{Failure, Metrics},
    podnet::enroll::{self, EnrollError},
    uid::PodUid,
    workload::Workload,
    zds::{
        age,
        proto::WorkloadRequest,
        server::{Answer, Conn, Handler, Hub, SnapshotEntry, ZdsError},
    },
};

/// ztunnel opens a pod's listeners around its ack: look for this long.
const LISTENER_WAIT: Duration = Duration::from_secs(2);

pub(super) struct Ztunnels {
    me: Weak<Ztunnels>,
    hub: Arc<Hub>,
    /// Duplicates of the ztunnel listeners in the socket map.
    custody: Arc<Custody>,
    book: Arc<PodBook>,
    announcer: Arc<Announcer>,
    metrics: Arc<Metrics>,
    /// A ztunnel came or went, or listeners were withdrawn: the supervision
    /// pass looks again.
    changed: Notify,
}

impl Ztunnels {
    pub(super) fn new(
        hub: Arc<Hub>,
        custody: Arc<Custody>,
        book: Arc<PodBook>,
        announcer: Arc<Announcer>,
        metrics: Arc<Metrics>,
    ) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            me: me.clone(),
            hub,
            custody,
            book,
            announcer,
            metrics,
            changed: Notify::new(),
        })
    }

    /// The ZDS connections this node's adds go to.
    pub(super) fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    /// Resolves at the next change of the ztunnels or their listeners.
    pub(super) async fn changed(&self) {
        self.changed.notified().await
    }

    /// For each ztunnel process (pid), how many pods' listeners it owns.
    pub(super) fn owners(&self) -> BTreeMap<i32, usize> {
        self.custody.pods_by_owner()
    }

    /// Drops the listeners held for a pod that is leaving.
    pub(super) fn forget(&self, uid: &str) {
        self.custody.forget(uid);
    }

    /// ZDS add on `conn`, then listener registration. Errors explain why the
    /// pod stays Pending (it is retried).
    pub(super) async fn add(
        &self,
        conn: &Arc<Conn>,
        cookie: u64,
        uid: &str,
        w: &Workload,
    ) -> Result<(), String> {
        let fd = match self.book.netns_of(cookie) {
            Ok(ns) => ns.into_fd(),
            Err(e) => {
                // Nothing to hand ztunnel (out of descriptors, say): this
                // attempt failed, and the backoff schedules the next one.
                // (Left in flight, the pod would never be offered again.)
                self.metrics.failed(Failure::Netns);
                let why = format!("the pod's netns could not be opened for ztunnel: {e}");
                self.failed(uid, Cause::Other, why.clone());
                return Err(why);
            }
        };
        // Where a test holds an add, its netns open, until the pod has left.
        #[cfg(feature = "fault-injection")]
        tokio::task::block_in_place(|| crate::fault::pause_point("zds:add"));
        let out = conn.request(WorkloadRequest::add(uid, w), Some(fd)).await;
        // The pod left while this add waited: its unenroll's `del` may have
        // reached ztunnel first (both queued on this connection), and
        // ztunnel now serves a pod that is gone, holding its netns, until
        // it next reconnects. It is deleted again, after the add.
        if matches!(out, Ok(Answer::Ack)) && !self.book.pods().is_staying(uid) {
            match conn.request(WorkloadRequest::del(uid), None).await {
                Ok(Answer::Ack) => {
                    info!(%uid, "the pod left while its add was in flight: del sent")
                }
                Ok(Answer::Nack(t)) => warn!(%uid, nack = %t, "ztunnel nacked del"),
                Err(e) => warn!(%uid, error = %e, "del failed"),
            }
            return Ok(());
        }
        self.after_add(uid, cookie, conn.pid, out).await
    }

    /// An attempt for the pod failed: retried with exponential backoff.
    fn failed(&self, uid: &str, cause: Cause, why: String) {
        self.book.pods().apply(uid, Event::AddFailed { cause, why });
        self.release_orphans(Some(uid));
    }

    async fn after_add(
        &self,
        uid: &str,
        cookie: u64,
        pid: Option<i32>,
        out: Result<Answer, ZdsError>,
    ) -> Result<(), String> {
        let (cause, why) = match out {
            Ok(Answer::Ack) => {
                self.metrics.zds_answer(true);
                match self.register(uid, cookie, pid).await {
                    Ok(()) => {
                        // Listeners of an older ztunnel that were kept only
                        // until this one's replaced them.
                        self.release_orphans(Some(uid));
                        return Ok(());
                    }
                    Err(e) => {
                        self.metrics.failed(Failure::NoListeners);
                        self.announcer
                            .pod_event(uid, Reason::ZtunnelListenersMissing, &e);
                        (Cause::Other, e)
                    }
                }
            }
            Ok(Answer::Nack(t)) => {
                warn!(%uid, nack = %t, "ztunnel nacked add");
                self.announcer.pod_event(
                    uid,
                    Reason::ZtunnelRejected,
                    &format!("ztunnel refused the pod: {t}"),
                );
                self.metrics.zds_answer(false);
                self.metrics.failed(Failure::Nack);
                (Cause::ZtunnelRefused, format!("ztunnel nacked add: {t}"))
            }
            Err(e) => {
                warn!(%uid, error = %e, "add failed");
                self.metrics.failed(Failure::Zds);
                (Cause::Other, format!("add failed: {e}"))
            }
        };
        self.failed(uid, cause, why.clone());
        Err(why)
    }

    /// Registers the listeners of the ztunnel that just acked (`acking`),
    /// or of a newer one (see [`serving`]), looking until every role has
    /// one; then the pod is Enabled.
    async fn register(&self, uid: &str, cookie: u64, acking: Option<i32>) -> Result<(), String> {
        let start = Instant::now();
        let mut first = true;
        loop {
            let (book, custody, hub) = (self.book.clone(), self.custody.clone(), self.hub.clone());
            let owned_uid = uid.to_owned();
            let got = tokio::task::spawn_blocking(move || -> Result<_, EnrollError> {
                let ns = book.netns_of(cookie)?;
                let mut guard = book.dataplane();
                let dp = &mut *guard;
                // An ack that comes after the uninstall took the pod: its
                // listeners are not kept (nothing serves them any more).
                if dp.is_retired() {
                    return Ok(None);
                }
                // Under the lock that registrations take: two ztunnels'
                // acks of one pod are decided one after the other.
                let pid = serving(&custody, &hub, &owned_uid, acking);
                // Before the pod can turn Enabled: the served check asks this one.
                book.pods()
                    .apply(&owned_uid, Event::Acked(Ztunnel::new(pid)));
                if first {
                    enroll::refresh_addrs(dp.maps_mut(), &ns, cookie)?;
                }
                let (e, taken) = enroll::register_keeping(dp.maps_mut(), &ns, cookie, pid)?;
                // Without a known peer there is no owner to ask about later.
                if pid.is_some() {
                    custody.keep(&owned_uid, taken);
                }
                Ok(Some((e.state, pid)))
            })
            .await
            .map_err(|e| e.to_string())?;
            match got {
                Ok(None) => {
                    info!(%uid, "ztunnel acked after the uninstall: nothing registered");
                    return Ok(());
                }
                Ok(Some((s, pid))) if s.steers() => {
                    if pid != acking {
                        self.metrics.older_ack();
                        info!(%uid, acking = acking.unwrap_or(0), pid = pid.unwrap_or(0), "an older ztunnel acked: the pod stays on the newer one's listeners");
                    }
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

    /// Withdraws held listeners whose ztunnel let go of them (out of the
    /// socket map, so the pod fails closed; still held for the connections
    /// queued on them), except for pods with an add in flight (a newer
    /// ztunnel's listeners replace them first); closes those withdrawn longer
    /// than `--orphan-grace`.
    pub(super) fn release_orphans(&self, only: Option<&str>) {
        let pods = self.book.pods();
        let withdrawn = self
            .custody
            .withdraw_orphans(only, |uid| pods.in_flight(uid));
        if !withdrawn.is_empty() {
            let mut dp = self.book.dataplane();
            for (uid, role) in &withdrawn {
                if let Some(cookie) = pods.cookie(uid) {
                    dp.maps_mut().remove_listener(cookie, *role);
                }
            }
            drop(dp);
            info!(
                listeners = withdrawn.len(),
                "ztunnel let go of listeners: out of the socket map; connections queued on them wait for the next ztunnel"
            );
            self.changed.notify_one();
        }
        let n = self.custody.expire();
        if n > 0 {
            warn!(
                listeners = n,
                "no ztunnel took over within the orphan grace: closed, connections queued on them were reset"
            );
        }
    }
}

impl Ztunnels {
    /// An `add` for each pod staying (not being torn down) but those `skip`
    /// names by uid and netns cookie, each now the pod's attempt (a new
    /// ztunnel starts the backoff afresh). A pod whose netns cannot be
    /// opened gets a `keep` when `keeps` (a snapshot's; after it, a keep is
    /// a protocol error), else nothing.
    fn adds(&self, skip: impl Fn(&str, u64) -> bool, keeps: bool) -> Vec<SnapshotEntry> {
        let dp = self.book.dataplane();
        let pods = self.book.pods();
        let mut out = Vec::new();
        for p in pods.staying() {
            let uid = p.identity.uid;
            if skip(&uid, p.cookie)
                || dp.maps().entry(p.cookie).and_then(|e| e.state()) == Some(PodState::Draining)
            {
                continue;
            }
            let held = p.netns.and_then(|n| n.try_clone().ok());
            match held.map_or_else(|| enroll::open_pod_netns(dp.maps(), p.cookie), Ok) {
                Ok(ns) => {
                    pods.apply(&uid, Event::AddSent);
                    out.push(SnapshotEntry::Add {
                        uid,
                        cookie: p.cookie,
                        workload: p.identity.workload,
                        netns: ns.into_fd(),
                    });
                }
                Err(e) if keeps => {
                    warn!(%uid, error = %e, "pod netns unavailable: sending keep");
                    out.push(SnapshotEntry::Keep { uid });
                }
                Err(e) => warn!(%uid, error = %e, "pod netns unavailable: no add"),
            }
        }
        out
    }
}

impl Handler for Ztunnels {
    fn snapshot(&self) -> Vec<SnapshotEntry> {
        self.adds(|_, _| false, true)
    }

    fn joined(&self, sent: &[(String, Option<u64>)]) -> Vec<SnapshotEntry> {
        self.adds(
            |uid, cookie| sent.iter().any(|(u, c)| u == uid && *c == Some(cookie)),
            false,
        )
    }

    fn add_outcome(
        &self,
        uid: &str,
        cookie: u64,
        pid: Option<i32>,
        outcome: &Result<Answer, ZdsError>,
    ) {
        // Registration may take a while (listeners appear around the ack): off
        // the connection's task, so the snapshot goes on.
        let Some(this) = self.me.upgrade() else {
            return;
        };
        // The add carried the netns of `cookie`: a pod enrolled again since
        // (another sandbox) is not registered on its answer.
        if PodUid::new(uid).ok().and_then(|u| self.book.cookie_of(&u)) != Some(cookie) {
            return;
        }
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

    fn add_not_sent(&self, uid: &str, why: &str) {
        self.failed(uid, Cause::Other, why.to_owned());
    }

    fn connected(&self, id: u64, pid: Option<i32>) {
        info!(conn = id, pid = pid.unwrap_or(0), "ztunnel live");
        self.changed.notify_one();
    }

    fn disconnected(&self, id: u64) {
        info!(conn = id, "ztunnel connection gone");
        self.release_orphans(None);
        self.changed.notify_one();
    }

    fn left(&self, uid: &str, cookie: Option<u64>) -> bool {
        let pods = self.book.pods();
        !pods.is_staying(uid) || cookie.is_some_and(|c| pods.cookie(uid) != Some(c))
    }
}

/// Whose listeners a pod gets after `acking`'s ack: its own, unless the pod
/// has those of a newer ztunnel process that still holds them and is still
/// connected. Then `acking` is an old ztunnel that reconnected during an
/// upgrade (both reconnect to a restarted agent, in any order) and drains
/// next: the pod stays with the newer one (registered again, which ends
/// this attempt) rather than going back to lose what the old one drops.
/// An unknown start time decides nothing: the acking ztunnel's are taken.
fn serving(custody: &Custody, hub: &Hub, uid: &str, acking: Option<i32>) -> Option<i32> {
    let Some(mine) = acking.and_then(age::started) else {
        return acking;
    };
    // Each start time read once; the connection check (no syscall) first.
    custody
        .holders(uid)
        .into_iter()
        .filter(|&p| Some(p) != acking && hub.attached(p))
        .filter_map(|p| Some((age::started(p)?, p)))
        .filter(|&(started, _)| started > mine)
        .max()
        .map(|(_, p)| p)
        .or(acking)
}

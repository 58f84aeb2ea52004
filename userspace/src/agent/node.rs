//! The agent's view of its node: enrolls and unenrolls pods, hands them to
//! ztunnel over ZDS, registers ztunnel's listeners after each ack, and keeps
//! checking that Enabled pods still have them (ztunnel restarts close them).
//!
//! Pod state lives in the pinned pod-state map; what is kept here is only
//! scheduling (when to retry a pod ztunnel has not taken yet).

use std::{
    collections::HashMap,
    os::fd::OwnedFd,
    path::PathBuf,
    sync::{Arc, Mutex, Weak},
    time::{Duration, Instant},
};

use sluice_common::{Counters, PodState, Role};
use tokio::sync::{watch, Notify};
use tracing::{info, info_span, warn, Instrument as _};

use super::{
    custody::Custody,
    kube::{Admission, KubeCtx},
    report::Report,
};
use crate::{
    cni::install::CniInstall,
    control::{NodeStatus, Request, Response, WaitingPod, ZtunnelView},
    enroll::{self, EnrollError},
    kube::reconcile::{plan, Action, Enrolled},
    lifecycle::Transition,
    loader::Dataplane,
    metrics::{self, Failure, Metrics},
    readiness::{self, PodView},
    state::{boottime_ns, CounterView},
    uid::PodUid,
    workload::Workload,
    zds::{
        proto::WorkloadRequest,
        server::{Answer, Conn, Handler, Hub, SnapshotEntry, ZdsError},
    },
};

/// How often Enabled pods are checked for their listeners, at most.
const CHECK_EVERY: Duration = Duration::from_millis(200);
/// ztunnel opens a pod's listeners around its ack: look for this long.
const LISTENER_WAIT: Duration = Duration::from_secs(2);
const RETRY_MIN: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);
/// How often the agent relists this node's pods from the API even when the
/// watch reports nothing.
const RESYNC: Duration = Duration::from_secs(60);
/// Pods captured this recently are never released by a relist.
const RECENT: Duration = Duration::from_secs(30);

#[derive(Debug)]
struct Retry {
    due: Instant,
    backoff: Duration,
    in_flight: bool,
    /// Why the last attempt left the pod Pending.
    last_error: Option<String>,
}

pub struct Node {
    me: Weak<Node>,
    /// Present when the agent runs in a cluster.
    kube: Option<KubeCtx>,
    dp: Mutex<Dataplane>,
    hub: Arc<Hub>,
    retries: Mutex<HashMap<String, Retry>>,
    wake: Notify,
    /// Pods (namespace, name) whose annotation and gate need writing.
    announcements: Mutex<std::collections::BTreeSet<(String, String)>>,
    announce_wake: Notify,
    /// The node condition and metrics, as last computed.
    report: Arc<Report>,
    /// Kernel counters of pods since unenrolled, so the metrics' totals
    /// never go backwards while the agent runs.
    retired: Mutex<Counters>,
    /// Duplicates of the ztunnel listeners in the socket map.
    custody: Custody,
}

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
            ("Draining", 0),
            ("Unknown", 0),
        ];
        let mut kernel = *node.retired.lock().unwrap();
        for (cookie, e) in dp.maps.states() {
            let state = e.state().map(PodState::as_str).unwrap_or("Unknown");
            if let Some(p) = pods.iter_mut().find(|(s, _)| *s == state) {
                p.1 += 1;
            }
            kernel.add(&dp.maps.counters(cookie));
        }
        metrics::Sample {
            pods,
            kernel: CounterView::from(kernel),
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
    ) -> Arc<Self> {
        let mut dp = dp;
        Arc::new_cyclic(|me: &Weak<Self>| {
            let node = me.clone();
            dp.maps.observe(Arc::new(move |t: &Transition| {
                if let Some(n) = node.upgrade() {
                    n.on_transition(t);
                }
            }));
            Self::with(me, dp, hub, kube, condition_type)
        })
    }

    fn with(
        me: &Weak<Self>,
        dp: Dataplane,
        hub: Arc<Hub>,
        kube: Option<KubeCtx>,
        condition_type: &str,
    ) -> Self {
        Self {
            me: me.clone(),
            kube,
            dp: Mutex::new(dp),
            hub,
            retries: Mutex::new(HashMap::new()),
            wake: Notify::new(),
            announcements: Mutex::new(Default::default()),
            announce_wake: Notify::new(),
            report: Arc::new(Report::new(
                Arc::new(Metrics::new(Arc::new(MapSource(me.clone())))),
                condition_type,
            )),
            retired: Mutex::new(Counters::default()),
            custody: Custody::default(),
        }
    }

    /// Every change of a pod's state, as the map was just written (see
    /// `lifecycle`): counted, logged, and queued for the pod's annotation
    /// and readiness gate. Runs under the dataplane lock: it only queues.
    fn on_transition(&self, t: &Transition) {
        let (from, to) = (t.from.map(PodState::as_str), t.to.map(PodState::as_str));
        self.metrics().transition(from, to);
        let uid = t.pod.as_ref().map(|p| p.uid.as_str()).unwrap_or("");
        info!(
            %uid,
            cookie = t.cookie,
            from = from.unwrap_or("none"),
            to = to.unwrap_or("none"),
            "pod state"
        );
        if let Some(p) = &t.pod {
            self.announce_pod(&p.workload.namespace, &p.workload.name);
        }
    }

    pub fn report(&self) -> &Arc<Report> {
        &self.report
    }

    fn metrics(&self) -> &Metrics {
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
        let pods = dp
            .maps
            .states()
            .into_iter()
            .map(|(cookie, e)| PodView {
                name: dp
                    .maps
                    .meta(cookie)
                    .map(|m| format!("{}/{}", m.workload.namespace, m.workload.name))
                    .unwrap_or_else(|| format!("netns:{cookie}")),
                state: e.state(),
                changed_at_ns: e.changed_at_ns,
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
    pub fn verify_all(&self) {
        let mut guard = self.dp.lock().unwrap();
        let dp = &mut *guard;
        for cookie in dp.maps.cookies() {
            let uid = dp.maps.meta(cookie).map(|m| m.uid).unwrap_or_default();
            let span = info_span!("pod", %uid, cookie);
            let _e = span.enter();
            match enroll::repair(dp, cookie) {
                Ok(enroll::Repair::Complete) => {}
                Ok(enroll::Repair::Relinked(links)) => {
                    warn!(?links, "capture was incomplete: links attached again")
                }
                Ok(enroll::Repair::TornDown) => {
                    self.custody.forget(&uid);
                    info!("finished an interrupted teardown")
                }
                Err(e) => warn!(error = %e, "could not verify the pod's capture; will retry"),
            }
        }
        match enroll::remove_orphan_pins(&dp.pins, &dp.maps) {
            Ok(0) => {}
            Ok(n) => info!(pods = n, "removed pins of pods without state"),
            Err(e) => warn!(error = %e, "removing pins of pods without state"),
        }
    }

    pub fn pod_count(&self) -> usize {
        self.dp.lock().unwrap().maps.states().len()
    }

    /// Serves one control request.
    pub async fn handle(self: &Arc<Self>, req: Request) -> Response {
        match req {
            Request::Enroll {
                netns,
                uid,
                workload,
            } => {
                let span = info_span!("pod", %uid, netns = %netns.display());
                self.enroll(netns, &uid, workload)
                    .instrument(span)
                    .await
                    .unwrap_or_else(|e| Response::Error {
                        message: crate::one_line(&e),
                    })
            }
            Request::Unenroll { uid } => {
                let span = info_span!("pod", %uid);
                match self.unenroll(&uid).instrument(span).await {
                    Ok(()) => Response::Unenrolled { uid },
                    Err(e) => Response::Error {
                        message: crate::one_line(&e),
                    },
                }
            }
            Request::CniAdd {
                container_id,
                netns,
                pod,
                ips,
            } => {
                let span = info_span!("cni_add", pod = %format!("{}/{}", pod.namespace, pod.name), container = %container_id);
                async {
                    info!(?ips, netns = %netns.display(), "CNI ADD");
                    self.cni_add(netns, &pod).await
                }
                .instrument(span)
                .await
                .unwrap_or_else(|e| Response::Error {
                    message: crate::one_line(&e),
                })
            }
            Request::CniDel {
                container_id,
                netns,
                pod,
            } => {
                let span = info_span!("cni_del", pod = %format!("{}/{}", pod.namespace, pod.name), container = %container_id);
                async {
                    let uid = cni_uid(&pod)?;
                    let Some(cookie) = self.cookie_of(&uid) else {
                        return Ok(Response::Unenrolled {
                            uid: uid.to_string(),
                        });
                    };
                    if let Some(k) = &self.kube {
                        let alive = {
                            let dp = self.dp.lock().unwrap();
                            enroll::open_pod_netns(&dp.maps, cookie).is_ok()
                        };
                        k.admit_del(&pod, alive).await?;
                    }
                    if !self.del_names_enrolled_sandbox(cookie, &netns) {
                        // A DEL for an older sandbox of this pod (the runtime
                        // made a new one, which ADD already captured): not ours.
                        info!(%uid, "CNI DEL for another sandbox of the pod: capture kept");
                        return Ok(Response::Unenrolled {
                            uid: uid.to_string(),
                        });
                    }
                    self.unenroll(uid.as_str()).await?;
                    Ok(Response::Unenrolled {
                        uid: uid.to_string(),
                    })
                }
                .instrument(span)
                .await
                .unwrap_or_else(|e: anyhow::Error| Response::Error {
                    message: crate::one_line(&e),
                })
            }
            Request::Status => Response::Node(NodeStatus {
                condition_type: self.report.condition_type.clone(),
                condition: self.report.condition(),
                ztunnel_connected: self.hub.is_connected(),
                ztunnels: self.ztunnels(),
                waiting: self.waiting(),
            }),
            Request::CniCheck { pod } => match cni_uid(&pod).map(|u| (self.cookie_of(&u), u)) {
                Ok((Some(cookie), uid)) => self.enrolled(&uid, cookie),
                Ok((None, uid)) => Response::Error {
                    message: format!("pod {}/{} ({uid}) is not enrolled", pod.namespace, pod.name),
                },
                Err(e) => Response::Error {
                    message: crate::one_line(&e),
                },
            },
        }
    }

    /// Whether a DEL (with the runtime's netns path, maybe empty) is about the
    /// sandbox we captured: its netns is ours, or ours is gone as well.
    fn del_names_enrolled_sandbox(&self, cookie: u64, netns: &std::path::Path) -> bool {
        let named = crate::netns::Netns::open(netns)
            .ok()
            .and_then(|n| n.cookie().ok());
        match named {
            Some(c) => c == cookie,
            None => {
                let dp = self.dp.lock().unwrap();
                enroll::open_pod_netns(&dp.maps, cookie).is_err()
            }
        }
    }

    /// The answer for a pod that is enrolled, with its current state.
    fn enrolled(&self, uid: &PodUid, cookie: u64) -> Response {
        Response::Enrolled {
            uid: uid.to_string(),
            cookie,
            state: self
                .state_of(cookie)
                .map(PodState::as_str)
                .unwrap_or("Unknown")
                .into(),
            note: None,
        }
    }

    fn cookie_of(&self, uid: &PodUid) -> Option<u64> {
        self.dp.lock().unwrap().maps.find_uid(uid)
    }

    /// CNI ADD: capture the new pod before it starts. A retried ADD for the
    /// same sandbox is a no-op; an ADD for a new sandbox of the same pod
    /// replaces the old capture.
    async fn cni_add(
        self: &Arc<Self>,
        netns: PathBuf,
        pod: &crate::cni::spec::PodRef,
    ) -> anyhow::Result<Response> {
        let (uid, workload) = match &self.kube {
            // Without a Kubernetes API to ask, the service account is unknown.
            None => (
                cni_uid(pod)?,
                Workload::new(&pod.name, &pod.namespace, "default")?,
            ),
            Some(k) => match k.admit_add(pod).await? {
                Admission::Skip(reason) => {
                    info!(%reason, "not capturing");
                    if let Some(uid) = &pod.uid {
                        k.record_netns(uid, &netns);
                    }
                    return Ok(Response::Skipped { reason });
                }
                Admission::Enroll { uid, workload } => (uid, workload),
            },
        };
        if let Some(cookie) = self.cookie_of(&uid) {
            let same = crate::netns::Netns::open(&netns)?.cookie()? == cookie;
            if same {
                return Ok(self.enrolled(&uid, cookie));
            }
            info!(%uid, "new sandbox for an enrolled pod: replacing its capture");
            self.unenroll(uid.as_str()).await?;
        }
        self.enroll(netns, uid.as_str(), workload).await
    }

    async fn enroll(
        self: &Arc<Self>,
        netns: PathBuf,
        uid: &str,
        workload: Workload,
    ) -> anyhow::Result<Response> {
        let uid = PodUid::new(uid)?;
        let workload = Workload::new(
            &workload.name,
            &workload.namespace,
            &workload.service_account,
        )?;
        let this = self.clone();
        let (w, u) = (workload.clone(), uid.clone());
        let started = Instant::now();
        let attached = tokio::task::spawn_blocking(move || -> Result<u64, EnrollError> {
            let mut dp = this.dp.lock().unwrap();
            Ok(enroll::attach_pod(&mut dp, &netns, &u, &w)?.1)
        })
        .await?;
        let cookie = match attached {
            Ok(c) => c,
            Err(e) => {
                self.metrics().failed(Failure::Attach);
                return Err(e.into());
            }
        };
        self.metrics().enrolled(started.elapsed());
        info!(cookie, "capture attached (Pending)");
        let note = match self.hub.newest() {
            None => {
                self.schedule(uid.as_str(), Duration::ZERO);
                Some(
                    "no ztunnel connected: it gets this pod in its snapshot when it connects"
                        .into(),
                )
            }
            Some(conn) => self.add(&conn, cookie, uid.as_str(), &workload).await.err(),
        };
        let state = self.state_of(cookie);
        Ok(Response::Enrolled {
            uid: uid.to_string(),
            cookie,
            state: state.map(PodState::as_str).unwrap_or("Unknown").into(),
            note: if state == Some(PodState::Enabled) {
                None
            } else {
                note
            },
        })
    }

    async fn unenroll(self: &Arc<Self>, uid: &str) -> anyhow::Result<()> {
        let uid = PodUid::new(uid)?;
        {
            let dp = self.dp.lock().unwrap();
            dp.maps
                .find_uid(&uid)
                .ok_or_else(|| EnrollError::UnknownPod(uid.clone()))?;
        }
        self.retries.lock().unwrap().remove(uid.as_str());
        // Every live ztunnel (two during an upgrade) lets go of the pod.
        for conn in self.hub.all() {
            match conn.request(WorkloadRequest::del(uid.as_str()), None).await {
                Ok(Answer::Ack) => self.metrics().zds_answer(true),
                Ok(Answer::Nack(t)) => {
                    self.metrics().zds_answer(false);
                    warn!(conn = conn.id, nack = %t, "ztunnel nacked del")
                }
                Err(e) => warn!(conn = conn.id, error = %e, "del failed"),
            }
        }
        self.custody.forget(uid.as_str());
        let this = self.clone();
        tokio::task::spawn_blocking(move || -> Result<(), EnrollError> {
            let mut guard = this.dp.lock().unwrap();
            let dp = &mut *guard;
            let last = dp.maps.find_uid(&uid).map(|c| dp.maps.counters(c));
            enroll::unenroll(&dp.pins, &mut dp.maps, &uid)?;
            if let Some(c) = last {
                this.retired.lock().unwrap().add(&c);
            }
            Ok(())
        })
        .await??;
        info!("unenrolled");
        Ok(())
    }

    /// Queues pod `namespace/name` for the announcer, which writes whatever
    /// state the map has for it when its turn comes: writes for one pod can
    /// neither overtake each other nor leave an old state behind.
    fn announce_pod(&self, namespace: &str, name: &str) {
        if self.kube.is_none() {
            return;
        }
        self.announcements
            .lock()
            .unwrap()
            .insert((namespace.to_owned(), name.to_owned()));
        self.announce_wake.notify_one();
    }

    /// The state the map has for the pod named `namespace/name`.
    fn state_by_name(&self, namespace: &str, name: &str) -> Option<PodState> {
        let dp = self.dp.lock().unwrap();
        dp.maps.states().into_iter().find_map(|(cookie, e)| {
            let m = dp.maps.meta(cookie)?;
            (m.workload.namespace == namespace && m.workload.name == name)
                .then(|| e.state())
                .flatten()
        })
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
                let Ok(state) =
                    tokio::task::spawn_blocking(move || this.state_by_name(&n, &p)).await
                else {
                    continue;
                };
                let pod = format!("{ns}/{name}");
                match tokio::time::timeout(crate::kube::API_TIMEOUT, k.publish(&ns, &name, state))
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

    fn state_of(&self, cookie: u64) -> Option<PodState> {
        self.dp
            .lock()
            .unwrap()
            .maps
            .entry(cookie)
            .and_then(|e| e.state())
    }

    fn netns_fd(&self, cookie: u64) -> Result<OwnedFd, EnrollError> {
        let dp = self.dp.lock().unwrap();
        let ns = enroll::open_pod_netns(&dp.maps, cookie)?;
        Ok(ns.into_fd())
    }

    /// ZDS add on `conn`, then listener registration. Errors explain why the
    /// pod stays Pending (it is retried).
    async fn add(
        self: &Arc<Self>,
        conn: &Arc<Conn>,
        cookie: u64,
        uid: &str,
        w: &Workload,
    ) -> Result<(), String> {
        let fd = self.netns_fd(cookie).map_err(|e| e.to_string())?;
        let out = conn.request(WorkloadRequest::add(uid, w), Some(fd)).await;
        self.after_add(uid, cookie, conn.pid, out).await
    }

    async fn after_add(
        self: &Arc<Self>,
        uid: &str,
        cookie: u64,
        pid: Option<i32>,
        out: Result<Answer, ZdsError>,
    ) -> Result<(), String> {
        let why = match out {
            Ok(Answer::Ack) => {
                self.metrics().zds_answer(true);
                match self.register(uid, cookie, pid).await {
                    Ok(()) => {
                        self.retries.lock().unwrap().remove(uid);
                        // Listeners of an older ztunnel that were kept only
                        // until this one's replaced them.
                        self.release_orphans(Some(uid));
                        return Ok(());
                    }
                    Err(e) => {
                        self.metrics().failed(Failure::NoListeners);
                        e
                    }
                }
            }
            Ok(Answer::Nack(t)) => {
                warn!(%uid, nack = %t, "ztunnel nacked add");
                self.metrics().zds_answer(false);
                self.metrics().failed(Failure::Nack);
                format!("ztunnel nacked add: {t}")
            }
            Err(e) => {
                warn!(%uid, error = %e, "add failed");
                self.metrics().failed(Failure::Zds);
                format!("add failed: {e}")
            }
        };
        self.fail(uid, &why);
        self.release_orphans(Some(uid));
        Err(why)
    }

    /// Releases held listeners whose ztunnel let go of them, except for pods
    /// with an add in flight (a newer ztunnel's listeners replace them first).
    fn release_orphans(&self, only: Option<&str>) {
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

    /// Pods the agent is retrying, with why the last attempt failed.
    fn waiting(&self) -> Vec<WaitingPod> {
        let mut out: Vec<WaitingPod> = self
            .retries
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(uid, r)| {
                r.last_error.as_ref().map(|e| WaitingPod {
                    uid: uid.clone(),
                    last_error: e.clone(),
                })
            })
            .collect();
        out.sort_by(|a, b| a.uid.cmp(&b.uid));
        out
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
            })
            .collect()
    }

    /// Looks for the listeners of the ztunnel that just acked (`pid`) until
    /// every role has one, then the pod is Enabled.
    async fn register(
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
                let mut guard = this.dp.lock().unwrap();
                let dp = &mut *guard;
                let ns = enroll::open_pod_netns(&dp.maps, cookie)?;
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
                Ok(PodState::Enabled) => {
                    info!(%uid, pid = pid.unwrap_or(0), "ztunnel acked; listeners registered: Enabled");
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

    /// Schedules a retry with exponential backoff.
    fn fail(&self, uid: &str, why: &str) {
        let mut r = self.retries.lock().unwrap();
        let e = r.entry(uid.to_owned()).or_insert(Retry {
            due: Instant::now(),
            backoff: RETRY_MIN,
            in_flight: false,
            last_error: None,
        });
        e.in_flight = false;
        e.last_error = Some(why.to_owned());
        e.due = Instant::now() + e.backoff;
        e.backoff = (e.backoff * 2).min(RETRY_MAX);
    }

    fn schedule(&self, uid: &str, after: Duration) {
        let mut r = self.retries.lock().unwrap();
        let e = r.entry(uid.to_owned()).or_insert(Retry {
            due: Instant::now(),
            backoff: RETRY_MIN,
            in_flight: false,
            last_error: None,
        });
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
                let _ = tokio::task::spawn_blocking(move || this.verify_all()).await;
            }
            let due = self.check();
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
    fn check(&self) -> Vec<(u64, String, Workload)> {
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
                        Retry {
                            due: now,
                            backoff: RETRY_MIN,
                            in_flight: false,
                            last_error: Some("ztunnel's listeners are gone".into()),
                        },
                    );
                }
                Some("Pending") => {
                    let r = retries.entry(p.uid.clone()).or_insert(Retry {
                        due: now,
                        backoff: RETRY_MIN,
                        in_flight: false,
                        last_error: None,
                    });
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

/// The uid a CNI request names: K8S_POD_UID when the runtime passes it, else
/// namespace.name (stable across ADD and DEL of one pod).
fn cni_uid(pod: &crate::cni::spec::PodRef) -> anyhow::Result<PodUid> {
    match &pod.uid {
        Some(u) => Ok(PodUid::new(u)?),
        None => Ok(PodUid::new(&format!("{}.{}", pod.namespace, pod.name))?),
    }
}

impl Node {
    /// Keeps the enrolled pods equal to the ambient pods of this node (pods
    /// that became ambient after they started, pods that existed before the
    /// agent, pods gone while it was away): a pass at start, on every pod or
    /// namespace change the watch reports, and every `RESYNC`.
    pub async fn reconcile_with_api(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let Some(k) = self.kube.clone() else { return };
        // Watch events wake the loop at once; the timer is a safety net.
        let (tx, mut changes) = tokio::sync::mpsc::channel(1);
        let watching = tokio::spawn(async move { k.changed(tx).await });
        loop {
            if let Err(e) = self.reconcile_once(RECENT).await {
                warn!(error = %crate::one_line(&e), "reconciling with the API failed; will retry");
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

    /// One pass: list, plan, apply. Pods enrolled less than `min_age` ago are
    /// not removed (the API may not show a pod its CNI ADD just captured).
    pub async fn reconcile_once(self: &Arc<Self>, min_age: Duration) -> anyhow::Result<()> {
        let Some(k) = self.kube.clone() else {
            return Ok(());
        };
        let (pods, namespaces) = k.observe().await?;
        k.prune_records(&pods.iter().filter_map(|p| p.metadata.uid.clone()).collect());
        let now = boottime_ns();
        let records = self.dp.lock().unwrap().maps.pods();
        // Annotations and gates that disagree with the map (a lost write,
        // someone else's edit) are written again.
        let by_name: HashMap<(&str, &str), PodState> = records
            .iter()
            .filter_map(|r| {
                let w = r.workload.as_ref()?;
                let state = r.state.and_then(PodState::from_name)?;
                Some(((w.namespace.as_str(), w.name.as_str()), state))
            })
            .collect();
        for pod in &pods {
            let (Some(ns), Some(name)) = (&pod.metadata.namespace, &pod.metadata.name) else {
                continue;
            };
            let state = by_name.get(&(ns.as_str(), name.as_str())).copied();
            if super::kube::out_of_step(pod, state) {
                self.announce_pod(ns, name);
            }
        }
        let enrolled: Vec<Enrolled> = records
            .iter()
            .map(|r| Enrolled { uid: r.uid.clone() })
            .collect();
        for action in plan(&pods, &namespaces, &k.node, &enrolled) {
            match action {
                Action::Enroll {
                    uid,
                    name,
                    namespace,
                    service_account,
                } => {
                    let span = info_span!("pod", %uid, pod = %format!("{namespace}/{name}"));
                    async {
                        let found = k.recorded_netns(&uid).or_else(|| crate::podns::find(&uid));
                        let Some(netns) = found else {
                            warn!("ambient pod without capture, but none of its processes runs here yet");
                            return;
                        };
                        info!(netns = %netns.display(), "capturing a running ambient pod");
                        let w = match Workload::new(&name, &namespace, &service_account) {
                            Ok(w) => w,
                            Err(e) => return warn!(error = %e, "bad workload identity"),
                        };
                        if let Err(e) = self.enroll(netns, &uid, w).await {
                            warn!(error = %crate::one_line(&e), "enrolling failed; will retry");
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
                    if let Err(e) = self.unenroll(&uid).await {
                        warn!(%uid, error = %crate::one_line(&e), "unenrolling failed; will retry");
                    }
                }
            }
        }
        Ok(())
    }
}

impl Handler for Node {
    fn snapshot(&self) -> Vec<SnapshotEntry> {
        let dp = self.dp.lock().unwrap();
        let mut retries = self.retries.lock().unwrap();
        let mut out = Vec::new();
        for cookie in dp.maps.cookies() {
            let Some(meta) = dp.maps.meta(cookie) else {
                continue;
            };
            // A pod being torn down is not offered again.
            if dp.maps.entry(cookie).and_then(|e| e.state()) == Some(PodState::Draining) {
                continue;
            }
            match enroll::open_pod_netns(&dp.maps, cookie) {
                Ok(ns) => {
                    // The snapshot's add is this pod's attempt now; a new
                    // ztunnel starts the backoff afresh.
                    retries.insert(
                        meta.uid.clone(),
                        Retry {
                            due: Instant::now(),
                            backoff: RETRY_MIN,
                            in_flight: true,
                            last_error: None,
                        },
                    );
                    out.push(SnapshotEntry::Add {
                        uid: meta.uid,
                        workload: meta.workload,
                        netns: ns.into_fd(),
                    });
                }
                Err(e) => {
                    warn!(uid = %meta.uid, error = %e, "pod netns unavailable: sending keep");
                    out.push(SnapshotEntry::Keep { uid: meta.uid });
                }
            }
        }
        out
    }

    fn add_outcome(&self, uid: &str, pid: Option<i32>, outcome: &Result<Answer, ZdsError>) {
        // Registration may take a while (listeners appear around the ack): off
        // the connection's task, so the snapshot goes on.
        let Some(this) = self.self_arc() else { return };
        let Some(cookie) = PodUid::new(uid)
            .ok()
            .and_then(|u| self.dp.lock().unwrap().maps.find_uid(&u))
        else {
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

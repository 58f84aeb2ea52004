//! Taking a pod in and letting it go, whoever asks (a CNI request, the
//! control socket, the relist): enrolling attaches its capture (Pending, fail
//! closed) and hands it to the newest ztunnel; unenrolling has every ztunnel
//! let go of it, then removes its capture. Kernel work runs off the async
//! workers.

use std::{net::IpAddr, path::PathBuf, sync::Arc, time::Instant};

use sluice_common::PodState;
use tracing::{info, warn};

use super::{announce::Announcer, book::PodBook, ztunnels::Ztunnels};
use crate::{
    control::Response,
    dataplane::state::{AddrSource, Maps},
    kube::events::{PodRef, Reason},
    lifecycle::Event,
    metrics::{Failure, Metrics},
    options::PodOptions,
    podnet::enroll::{self, AppStarted, EnrollError, PodAddrs},
    uid::PodUid,
    workload::{PodIdentity, Workload},
    zds::{proto::WorkloadRequest, server::Answer},
};

pub(super) struct Enroller {
    pub(super) book: Arc<PodBook>,
    pub(super) ztunnels: Arc<Ztunnels>,
    pub(super) announcer: Arc<Announcer>,
    pub(super) metrics: Arc<Metrics>,
}

impl Enroller {
    pub(super) async fn enroll(
        &self,
        netns: PathBuf,
        uid: &str,
        workload: Workload,
        options: PodOptions,
        addrs: PodAddrs,
        app: AppStarted,
    ) -> anyhow::Result<Response> {
        let uid = PodUid::new(uid)?;
        let workload = Workload::new(
            &workload.name,
            &workload.namespace,
            &workload.service_account,
        )?;
        let (book, w, u) = (self.book.clone(), workload.clone(), uid.clone());
        let started = Instant::now();
        let attached = tokio::task::spawn_blocking(move || {
            attach(&book, &netns, &u, &w, &options, &addrs, app)
        })
        .await?;
        let cookie = match attached {
            Ok(Captured {
                cookie,
                took_over,
                held,
                evicted,
                over_cap,
            }) => {
                self.announce_addresses(&uid, &workload, &evicted, &over_cap);
                let notes = [
                    (!held.is_empty()).then(|| (Reason::HostProbesCaptured, format!(
                        "captured, without the host-side program: another tool's qdisc holds the hook of {} (e.g. the bandwidth plugin's egress limit), so the node's own connections to the pod (kubelet probes) are captured by ztunnel too",
                        held.join(", ")
                    ))),
                    (!took_over.is_empty()).then(|| (Reason::TookOverFromIstioCni, format!(
                        "captured by sluice; istio-cni's in-pod rules removed ({})",
                        took_over.join(", ")
                    ))),
                ];
                for (reason, note) in notes.into_iter().flatten() {
                    self.announcer.pod_event(uid.as_str(), reason, &note);
                }
                cookie
            }
            Err(e) => {
                self.metrics.failed(Failure::Attach);
                return Err(e.into());
            }
        };
        self.metrics.enrolled(started.elapsed());
        info!(cookie, "capture attached (Pending)");
        let note = match self.ztunnels.hub().newest() {
            None => {
                self.book.pods().apply(
                    uid.as_str(),
                    Event::Wait {
                        why: "no ztunnel connected".into(),
                    },
                );
                self.announcer.pod_event(
                    uid.as_str(),
                    Reason::ZtunnelNotConnected,
                    "captured, but no ztunnel is connected to sluice: the pod's new connections fail closed until ztunnel connects and takes it",
                );
                Some(
                    "no ztunnel connected: it gets this pod in its snapshot when it connects"
                        .into(),
                )
            }
            Some(conn) => self
                .ztunnels
                .add(&conn, cookie, uid.as_str(), &workload)
                .await
                .err(),
        };
        let state = self.book.state_of(cookie);
        Ok(Response::Enrolled {
            uid: uid.to_string(),
            cookie,
            state,
            note: if state.is_some_and(PodState::steers) {
                None
            } else {
                note
            },
        })
    }

    /// Puts exclusions `x` in force for enrolled pod `uid`: for its new
    /// connections; open ones keep their path. Returns whether anything
    /// changed (`false` too for a pod not enrolled).
    pub(super) async fn set_exclusions(
        &self,
        uid: &str,
        x: crate::exclusions::PodExclusions,
    ) -> anyhow::Result<bool> {
        let book = self.book.clone();
        let uid = PodUid::new(uid)?;
        tokio::task::spawn_blocking(move || {
            let Some(cookie) = book.cookie_of(&uid) else {
                return Ok(false);
            };
            let mut dp = book.dataplane();
            Ok(crate::podnet::enroll::set_exclusions(&mut dp, cookie, &x)?)
        })
        .await?
    }

    /// The runtime's addresses for a pod already enrolled whose addresses
    /// came from its netns (adopted by a starting agent; a retried CNI ADD):
    /// published as its from now on, others' claims on them evicted.
    /// Nothing for a pod whose addresses came from the runtime already: a
    /// sandbox keeps its addresses for life.
    pub(super) fn claim_addrs(&self, uid: &PodUid, ips: &[IpAddr]) {
        let Some(cookie) = self.book.cookie_of(uid) else {
            return;
        };
        let (evicted, over_cap, workload) = {
            let mut dp = self.book.dataplane();
            let maps = dp.maps_mut();
            if ips.is_empty() || maps.addr_source(cookie) == Some(AddrSource::Runtime) {
                return;
            }
            let Some(meta) = maps.meta(cookie) else {
                return;
            };
            let out = match maps.claim_addrs(cookie, ips) {
                Ok(out) => out,
                Err(e) => {
                    return warn!(cookie, error = %e, "cannot publish the runtime's addresses")
                }
            };
            info!(
                cookie,
                ?ips,
                "the pod's addresses are the runtime's from now on"
            );
            (claimers(maps, &out.evicted), out.over_cap, meta.workload)
        };
        self.announce_addresses(uid, &workload, &evicted, &over_cap);
    }

    /// Events for what publishing the pod's addresses took from other pods
    /// (on each pod that lost its claim) or left out (past the cap).
    fn announce_addresses(
        &self,
        uid: &PodUid,
        w: &Workload,
        evicted: &[(IpAddr, PodIdentity)],
        over_cap: &[IpAddr],
    ) {
        for (addr, claimer) in evicted {
            self.metrics.address_claim_evicted();
            let note = format!(
                "the runtime gave {addr} to pod {}/{}: this pod's claim on it is removed (an address a pod adds to its own interface is never its for capture)",
                w.namespace, w.name
            );
            // By the map's identity: the claimer may be a pod this agent
            // does not hold (its netns could not be opened).
            let pod = PodRef::new(&claimer.workload, &claimer.uid);
            self.announcer.event(pod, Reason::AddressClaimEvicted, note);
        }
        if !over_cap.is_empty() {
            self.announcer.too_many_addresses(uid.as_str(), over_cap);
        }
    }

    pub(super) async fn unenroll(&self, uid: &str) -> anyhow::Result<()> {
        let uid = PodUid::new(uid)?;
        self.book
            .cookie_of(&uid)
            .ok_or_else(|| EnrollError::UnknownPod(uid.clone()))?;
        self.book
            .pods()
            .apply(uid.as_str(), Event::UnenrollRequested);
        // Every live ztunnel (two during an upgrade) lets go of the pod.
        for conn in self.ztunnels.hub().all() {
            match conn.request(WorkloadRequest::del(uid.as_str()), None).await {
                Ok(Answer::Ack) => self.metrics.zds_answer(true),
                Ok(Answer::Nack(t)) => {
                    self.metrics.zds_answer(false);
                    warn!(conn = conn.id, nack = %t, "ztunnel nacked del")
                }
                Err(e) => warn!(conn = conn.id, error = %e, "del failed"),
            }
        }
        self.ztunnels.forget(uid.as_str());
        let book = self.book.clone();
        let started = Instant::now();
        tokio::task::spawn_blocking(move || book.tear_down(&uid)).await??;
        // The row went with the teardown's last step (`Effect::Forget`).
        self.metrics.torn_down(started.elapsed());
        info!("unenrolled");
        Ok(())
    }
}

/// Who held each address the runtime's claim took (`Published::evicted`),
/// for their Events; a claimer no longer enrolled has none to get.
fn claimers(maps: &Maps, evicted: &[(IpAddr, u64)]) -> Vec<(IpAddr, PodIdentity)> {
    evicted
        .iter()
        .filter_map(|(addr, owner)| Some((*addr, maps.meta(*owner)?)))
        .collect()
}

/// A pod whose capture is attached and istio-cni's rules gone.
struct Captured {
    cookie: u64,
    /// istio-cni's rules that were removed.
    took_over: Vec<&'static str>,
    /// Host-side hooks another tool's qdisc holds.
    held: Vec<String>,
    /// Addresses the runtime gave it that another pod had claimed.
    evicted: Vec<(IpAddr, PodIdentity)>,
    /// Its addresses past the per-pod cap.
    over_cap: Vec<IpAddr>,
}

/// Attaches the pod's capture and holds it in the table, then removes
/// istio-cni's rules. Blocking.
fn attach(
    book: &PodBook,
    netns: &std::path::Path,
    uid: &PodUid,
    w: &Workload,
    options: &PodOptions,
    addrs: &PodAddrs,
    started: AppStarted,
) -> Result<Captured, EnrollError> {
    // Where a test holds an enrollment that waits for the dataplane.
    crate::fault::pause_point("enroll:lock");
    let (cookie, netns, held, evicted, over_cap) = {
        let mut dp = book.dataplane();
        let a = enroll::attach_pod(&mut dp, netns, uid, w, options, addrs, started)?;
        let evicted = claimers(dp.maps(), &a.addrs.evicted);
        // The netns stays open from here on: adds and registrations use it.
        if let Some(meta) = dp.maps().meta(a.cookie) {
            let kept = a.netns.try_clone().map_err(|source| EnrollError::Io {
                what: "duplicating the pod's netns fd".into(),
                source,
            });
            match kept {
                Ok(kept) => book.pods().insert(a.cookie, meta, Some(kept), false),
                Err(e) => {
                    enroll::back_out(&mut dp, &a.netns, a.cookie);
                    return Err(e);
                }
            }
        }
        // Its first add goes out right after: the supervision pass must not
        // send another.
        book.pods().apply(uid.as_str(), Event::AddSent);
        (
            a.cookie,
            a.netns,
            a.host_hooks_held,
            evicted,
            a.addrs.over_cap,
        )
    };
    // istio-cni's rules, if any, go without the dataplane held: the iptables
    // tools may take seconds, and other pods' enrollments must not wait for
    // them. This pod is Pending (fail closed) and marked attempting
    // meanwhile, so nothing else acts on it.
    match enroll::take_over(&netns) {
        Ok(took_over) => Ok(Captured {
            cookie,
            took_over,
            held,
            evicted,
            over_cap,
        }),
        Err(e) => {
            let mut dp = book.dataplane();
            // Its teardown's last step drops the pod's row too.
            enroll::back_out(&mut dp, &netns, cookie);
            Err(e)
        }
    }
}

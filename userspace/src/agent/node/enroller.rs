//! Taking a pod in and letting it go, whoever asks (a CNI request, the
//! control socket, the relist): enrolling attaches its capture (Pending, fail
//! closed) and hands it to the newest ztunnel; unenrolling has every ztunnel
//! let go of it, then removes its capture. Kernel work runs off the async
//! workers.

use std::{path::PathBuf, sync::Arc, time::Instant};

use sluice_common::PodState;
use tracing::{info, warn};

use super::{announce::Announcer, book::PodBook, ztunnels::Ztunnels};
use crate::{
    control::Response,
    kube::events::Reason,
    lifecycle::Event,
    metrics::{Failure, Metrics},
    options::PodOptions,
    podnet::enroll::{self, EnrollError},
    uid::PodUid,
    workload::Workload,
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
    ) -> anyhow::Result<Response> {
        let uid = PodUid::new(uid)?;
        let workload = Workload::new(
            &workload.name,
            &workload.namespace,
            &workload.service_account,
        )?;
        let (book, w, u) = (self.book.clone(), workload.clone(), uid.clone());
        let started = Instant::now();
        let attached =
            tokio::task::spawn_blocking(move || attach(&book, &netns, &u, &w, &options)).await?;
        let cookie = match attached {
            Ok(Captured {
                cookie,
                took_over,
                held,
            }) => {
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

/// A pod whose capture is attached and istio-cni's rules gone.
struct Captured {
    cookie: u64,
    /// istio-cni's rules that were removed.
    took_over: Vec<&'static str>,
    /// Host-side hooks another tool's qdisc holds.
    held: Vec<String>,
}

/// Attaches the pod's capture and holds it in the table, then removes
/// istio-cni's rules. Blocking.
fn attach(
    book: &PodBook,
    netns: &std::path::Path,
    uid: &PodUid,
    w: &Workload,
    options: &PodOptions,
) -> Result<Captured, EnrollError> {
    let (cookie, netns, held) = {
        let mut dp = book.dataplane();
        let a = enroll::attach_pod(&mut dp, netns, uid, w, options)?;
        // The netns stays open from here on: adds and registrations use it.
        if let Some(meta) = dp.maps().meta(a.cookie) {
            let kept = a.netns.try_clone().map_err(|source| EnrollError::Io {
                what: "duplicating the pod's netns fd".into(),
                source,
            });
            match kept {
                Ok(kept) => book.pods().insert(a.cookie, meta, Some(kept)),
                Err(e) => {
                    enroll::back_out(&mut dp, &a.netns, a.cookie);
                    return Err(e);
                }
            }
        }
        // Its first add goes out right after: the supervision pass must not
        // send another.
        book.pods().apply(uid.as_str(), Event::AddSent);
        (a.cookie, a.netns, a.host_hooks_held)
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
        }),
        Err(e) => {
            let mut dp = book.dataplane();
            // Its teardown's last step drops the pod's row too.
            enroll::back_out(&mut dp, &netns, cookie);
            Err(e)
        }
    }
}

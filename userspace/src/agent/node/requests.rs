//! Requests from the control socket and the CNI plugin: enroll, unenroll,
//! CNI ADD/DEL/CHECK, status. The CNI ones are admitted against the API
//! when the agent runs in a cluster, and guarded against forged DELs.

use std::{path::PathBuf, sync::Arc, time::Instant};

use sluice_common::PodState;
use tracing::{info, info_span, warn, Instrument as _};

use super::{
    book::{PodBook, Sandbox},
    enroller::Enroller,
    linkwatch::LinkWatch,
    relist::Relist,
    repair::VERIFY_EVERY,
    served_check::ServedChecker,
    uninstall::{Uninstall, Uninstaller},
    ztunnels::Ztunnels,
};
use crate::{
    agent::{
        cluster::{Admission, KubeCtx},
        report::Report,
    },
    control::{CniAdd, CniCheck, CniDel, NodeAnswer, NodeStatus, Request, Response, ZtunnelView},
    lifecycle::Event,
    metrics::{CniCommand, CniResult},
    options::PodOptions,
    podnet::{
        enroll::{self, AppStarted, PodAddrs},
        netns::Netns,
    },
    uid::PodUid,
    workload::Workload,
};

/// The control socket's side of the node: each request goes to the role
/// that does it.
pub struct Requests {
    pub(super) kube: Option<KubeCtx>,
    pub(super) book: Arc<PodBook>,
    pub(super) enroller: Arc<Enroller>,
    pub(super) ztunnels: Arc<Ztunnels>,
    pub(super) served: Arc<ServedChecker>,
    pub(super) relist: Arc<Relist>,
    pub(super) links: Arc<LinkWatch>,
    pub(super) uninstall: Arc<Uninstaller>,
    pub(super) report: Arc<Report>,
}

impl Requests {
    /// Serves one control request.
    pub async fn handle(&self, req: Request) -> Response {
        if self.uninstall.state() != Uninstall::No {
            return match req {
                Request::Status | Request::Uninstall => self.answer(req).await,
                // A pod the runtime creates meanwhile starts uncaptured, as
                // every pod will once sluice is gone; a DEL has nothing left
                // to undo.
                Request::CniAdd(_) | Request::CniDel(_) | Request::CniCheck(_) => {
                    Response::Skipped {
                        reason: format!(
                            "sluice is being removed from this node ({})",
                            self.uninstall.state()
                        ),
                    }
                }
                Request::Enroll { .. } | Request::Unenroll { .. } => Response::Error {
                    message: format!(
                        "sluice is being removed from this node ({})",
                        self.uninstall.state()
                    ),
                },
            };
        }
        self.answer(req).await
    }

    async fn answer(&self, req: Request) -> Response {
        match req {
            Request::Uninstall => {
                self.uninstall
                    .request(crate::kube::uninstall::Reason::Command);
                Response::More(NodeAnswer::Uninstalling)
            }
            Request::Enroll {
                netns,
                uid,
                workload,
            } => {
                let span = info_span!("pod", %uid, pod = %format!("{}/{}", workload.namespace, workload.name), netns = %netns.display());
                self.enroller
                    .enroll(
                        netns,
                        &uid,
                        workload,
                        PodOptions::default(),
                        PodAddrs::Netns,
                        AppStarted::Maybe,
                    )
                    .instrument(span)
                    .await
                    .unwrap_or_else(|e| Response::Error {
                        message: crate::one_line(&e),
                    })
            }
            Request::Unenroll { uid } => {
                if let Some(refused) = self.unenroll_guard(&uid) {
                    return refused;
                }
                let span = info_span!("pod", %uid, pod = %self.book.pod_name(&uid));
                match self.enroller.unenroll(&uid).instrument(span).await {
                    Ok(()) => Response::Unenrolled { uid },
                    Err(e) => Response::Error {
                        message: crate::one_line(&e),
                    },
                }
            }
            Request::CniAdd(CniAdd {
                container_id,
                netns,
                pod,
                ips,
            }) => {
                let span = info_span!("cni_add", pod = %format!("{}/{}", pod.namespace, pod.name), container = %container_id);
                let started = Instant::now();
                let r = async {
                    info!(?ips, netns = %netns.display(), "CNI ADD");
                    self.cni_add(&container_id, netns, &pod, &ips).await
                }
                .instrument(span)
                .await
                .unwrap_or_else(|e| Response::Error {
                    message: crate::one_line(&e),
                });
                self.count_cni(CniCommand::Add, &r, started);
                r
            }
            Request::CniDel(CniDel {
                container_id,
                netns,
                pod,
            }) => {
                let span = info_span!("cni_del", pod = %format!("{}/{}", pod.namespace, pod.name), container = %container_id);
                let started = Instant::now();
                let r = async { self.cni_del(&container_id, &netns, &pod).await }
                    .instrument(span)
                    .await
                    .unwrap_or_else(|e: anyhow::Error| Response::Error {
                        message: crate::one_line(&e),
                    });
                self.count_cni(CniCommand::Del, &r, started);
                r
            }
            Request::Status => Response::More(NodeAnswer::Node(self.status())),
            Request::CniCheck(CniCheck { pod }) => {
                let started = Instant::now();
                let r = self
                    .cni_check(&pod)
                    .await
                    .unwrap_or_else(|e| Response::Error {
                        message: crate::one_line(&e),
                    });
                self.count_cni(CniCommand::Check, &r, started);
                r
            }
        }
    }

    /// The node as `sluice status` shows it.
    fn status(&self) -> NodeStatus {
        // One lock: a second in the same expression would deadlock
        // (temporaries live to the end of the statement).
        let (dataplane, probes, tc_attach) = {
            let dp = self.book.dataplane();
            (dp.adoption().to_string(), dp.probes(), dp.tc_attach())
        };
        let pods = self.book.pods();
        NodeStatus {
            condition_type: self.report.condition_type.clone(),
            condition: self.report.condition(),
            ztunnel_connected: self.ztunnels.hub().is_connected(),
            ztunnels: self.ztunnel_views(),
            waiting: pods.waiting(),
            incomplete: pods.incomplete(),
            verifications: pods.verifications(),
            served_check: self.served.mode(),
            cni: self.report.cni(),
            dataplane,
            probes,
            uninstall: self.uninstall.state().to_string(),
            skipped: self.relist.skipped(),
            exclusion_notices: self.relist.exclusion_notices(),
            link_watches: self.links.sockets(),
            tc_attach: Some(tc_attach),
        }
    }

    /// The ztunnel processes the agent knows: connected ones, and those whose
    /// listeners it still holds.
    fn ztunnel_views(&self) -> Vec<ZtunnelView> {
        let owners = self.ztunnels.owners();
        let connected: Vec<i32> = self
            .ztunnels
            .hub()
            .all()
            .iter()
            .filter_map(|c| c.pid)
            .collect();
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
                served_check: self.served.view(pid),
            })
            .collect()
    }

    /// Counts a CNI request by its answer.
    fn count_cni(&self, cmd: CniCommand, r: &Response, started: Instant) {
        let result = match r {
            Response::Error { .. } => CniResult::Error,
            Response::Skipped { .. } => CniResult::Skipped,
            _ => CniResult::Ok,
        };
        self.report
            .metrics
            .cni_request(cmd, result, started.elapsed());
    }

    /// CNI DEL. Refused (the one DEL answer the plugin fails on) only when
    /// it would tear down the capture of the pod's live, enrolled sandbox
    /// and does not come from the runtime that made it: its container id is
    /// not the one whose ADD enrolled the pod. Everything else succeeds: a
    /// pod not enrolled, a DEL for another (older) sandbox of the pod, a gone
    /// sandbox.
    async fn cni_del(
        &self,
        container_id: &str,
        netns: &std::path::Path,
        pod: &crate::cni::spec::PodRef,
    ) -> anyhow::Result<Response> {
        let uid = cni_uid(pod)?;
        let done = Response::Unenrolled {
            uid: uid.to_string(),
        };
        let Some(cookie) = self.book.cookie_of(&uid) else {
            return Ok(done);
        };
        let cannot_tell = |why: &str| {
            Response::Refused {
            message: format!(
                "pod {}/{}: DEL for container {container_id}: cannot tell whether it names the live sandbox ({why}): refusing DEL, the runtime retries it",
                pod.namespace, pod.name
            ),
        }
        };
        match self.del_names_enrolled_sandbox(cookie, netns) {
            Ok(true) => {}
            Ok(false) => {
                // A DEL for an older sandbox of this pod (the runtime made a
                // new one, which ADD already captured): not ours.
                info!(%uid, "CNI DEL for another sandbox of the pod: capture kept");
                return Ok(done);
            }
            Err(why) => return Ok(cannot_tell(&why)),
        }
        match self.book.pods().sandbox_of(uid.as_str()) {
            Some(id) if id == container_id => {}
            Some(id) => match self.book.sandbox(cookie) {
                // The enrolled sandbox is gone: nothing left to protect.
                Sandbox::Gone => {}
                Sandbox::Alive => {
                    return Ok(Response::Refused {
                        message: format!(
                            "pod {}/{}: DEL for container {container_id}, but the pod was enrolled by the ADD of container {id}, whose sandbox is alive: refusing DEL",
                            pod.namespace, pod.name
                        ),
                    })
                }
                Sandbox::Unknown(why) => return Ok(cannot_tell(&why)),
            },
            // Enrolled otherwise (control socket, an earlier agent): ask the
            // API whether the pod is going away.
            None => {
                if let Some(k) = &self.kube {
                    let alive = self.book.sandbox(cookie) != Sandbox::Gone;
                    if let Err(e) = k.admit_del(pod, alive).await {
                        return Ok(Response::Refused {
                            message: crate::one_line(&e),
                        });
                    }
                }
            }
        }
        self.enroller.unenroll(uid.as_str()).await?;
        Ok(done)
    }

    /// The forged-DEL guard, for the control socket's unenroll: the capture
    /// of a sandbox its runtime enrolled (CNI ADD) and that is alive is torn
    /// down only by that runtime's DEL (or by uninstalling sluice).
    fn unenroll_guard(&self, uid: &str) -> Option<Response> {
        let cookie = self.book.cookie_of(&PodUid::new(uid).ok()?)?;
        let sandbox = self.book.pods().sandbox_of(uid)?;
        // A sandbox that cannot be told gone is kept, as a live one.
        (self.book.sandbox(cookie) != Sandbox::Gone).then(|| Response::Refused {
            message: format!(
                "pod {uid} was enrolled by its runtime (CNI ADD of container {sandbox}) and its sandbox is alive: only the runtime's DEL removes its capture. To take the pod out of the mesh, label it istio.io/dataplane-mode=none; `sluice uninstall` removes sluice from the node"
            ),
        })
    }

    /// CNI CHECK: success for a pod sluice does not manage; for one it does,
    /// success only when its capture is complete (every link pinned).
    async fn cni_check(&self, pod: &crate::cni::spec::PodRef) -> anyhow::Result<Response> {
        let uid = cni_uid(pod)?;
        let Some(cookie) = self.book.cookie_of(&uid) else {
            // Not enrolled. Managed anyway if the API selects it (its ADD
            // must have failed, or capture was removed behind our back).
            if let Some(k) = &self.kube {
                if let Admission::Enroll { .. } = k.admit_add(pod).await? {
                    anyhow::bail!(
                        "pod {}/{} is selected for ambient but not captured",
                        pod.namespace,
                        pod.name
                    );
                }
            }
            return Ok(Response::Skipped {
                reason: "not managed by sluice".into(),
            });
        };
        let book = self.book.clone();
        let missing = tokio::task::spawn_blocking(move || {
            let survey = book.survey(cookie);
            let dp = book.dataplane();
            match survey.filter(|s| s.is_of(&dp, cookie)) {
                Some(s) => Ok(enroll::missing_after(&dp, &s)),
                None => enroll::missing_links(&dp, cookie),
            }
        })
        .await??;
        if !missing.is_empty() {
            anyhow::bail!(
                "pod {}/{}: capture incomplete, missing links {}; the agent re-attaches them at its next verification (every {}s)",
                pod.namespace,
                pod.name,
                missing.join(", "),
                VERIFY_EVERY.as_secs()
            );
        }
        Ok(self.enrolled(&uid, cookie))
    }

    /// Whether a DEL (with the runtime's netns path, maybe empty) is about the
    /// sandbox we captured: its netns is ours, or ours is gone as well.
    /// `Err` (why) when that cannot be told: the DEL is then refused.
    fn del_names_enrolled_sandbox(
        &self,
        cookie: u64,
        netns: &std::path::Path,
    ) -> Result<bool, String> {
        match Netns::open(netns).and_then(|n| n.cookie()) {
            Ok(c) => Ok(c == cookie),
            // The DEL's netns is gone: it names the enrolled sandbox only if
            // that one is gone too.
            Err(e) if e.is_gone() => match self.book.sandbox(cookie) {
                Sandbox::Alive => Ok(false),
                Sandbox::Gone => Ok(true),
                Sandbox::Unknown(why) => Err(why),
            },
            Err(e) => Err(e.to_string()),
        }
    }

    /// The answer for a pod that is enrolled, with its current state.
    fn enrolled(&self, uid: &PodUid, cookie: u64) -> Response {
        Response::Enrolled {
            uid: uid.to_string(),
            cookie,
            state: self.book.state_of(cookie),
            note: None,
        }
    }

    /// CNI ADD: capture the new pod before it starts. A retried ADD for the
    /// same sandbox is a no-op; an ADD for a new sandbox of the same pod
    /// replaces the old capture.
    async fn cni_add(
        &self,
        container_id: &str,
        netns: PathBuf,
        pod: &crate::cni::spec::PodRef,
        ips: &[String],
    ) -> anyhow::Result<Response> {
        // The runtime's word on the pod's addresses: a bad one refuses the
        // pod (fail closed) rather than publish what its netns holds.
        let ips = ips
            .iter()
            .map(|ip| {
                ip.parse::<std::net::IpAddr>().map_err(|_| {
                    anyhow::anyhow!(
                        "prevResult names {ip:?} as the pod's address: not an IP address"
                    )
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let (uid, workload, options) = match &self.kube {
            // Without a Kubernetes API to ask, the service account (and the
            // pod's annotations) are unknown.
            None => (
                cni_uid(pod)?,
                Workload::new(&pod.name, &pod.namespace, "default")?,
                PodOptions::default(),
            ),
            Some(k) => match k.admit_add(pod).await? {
                Admission::Skip(reason) => {
                    info!(%reason, "not capturing");
                    // K8S_POD_UID comes from the runtime's CNI_ARGS: a file
                    // name only once validated.
                    match pod.uid.as_deref().map(PodUid::new) {
                        Some(Ok(uid)) => k.record_netns(&uid, &netns),
                        Some(Err(e)) => warn!(error = %e, "K8S_POD_UID not recorded"),
                        None => {}
                    }
                    return Ok(Response::Skipped { reason });
                }
                Admission::Enroll {
                    uid,
                    workload,
                    options,
                } => (uid, workload, *options),
            },
        };
        // The runtime starts the pod's containers once the ADD returns; a
        // netns captured before (by this pod's watch, perhaps while it ran)
        // may hold connections all the same.
        let mut app = AppStarted::No;
        if let Some(cookie) = self.book.cookie_of(&uid) {
            let same = Netns::open(&netns)?.cookie()? == cookie;
            if same {
                app = AppStarted::Maybe;
            }
            match self.book.state_of(cookie) {
                // A retried ADD (or the first one an agent restarted since
                // sees): this container made the enrolled sandbox, whose
                // capture is in place.
                Some(s) if same && s != PodState::Draining => {
                    self.book
                        .pods()
                        .apply(uid.as_str(), Event::SandboxOwned(container_id.to_owned()));
                    let (enroller, u) = (self.enroller.clone(), uid.clone());
                    tokio::task::spawn_blocking(move || enroller.claim_addrs(&u, &ips)).await?;
                    return Ok(self.enrolled(&uid, cookie));
                }
                // Only the pod's row is left, of an attempt that backed out.
                None => self.book.pods().remove(uid.as_str()),
                // An attempt that failed part-way left the capture being
                // torn down (`Draining`): answering it as enrolled would
                // let the pod start uncaptured. Its teardown is finished and
                // the pod captured anew.
                Some(_) if same => {
                    info!(%uid, "retried ADD for a pod whose capture an earlier attempt left half torn down: capturing it anew");
                    self.enroller.unenroll(uid.as_str()).await?;
                }
                Some(_) => {
                    info!(%uid, "new sandbox for an enrolled pod: replacing its capture");
                    self.enroller.unenroll(uid.as_str()).await?;
                }
            }
        }
        let out = self
            .enroller
            .enroll(
                netns,
                uid.as_str(),
                workload,
                options,
                PodAddrs::from_runtime(ips),
                app,
            )
            .await?;
        // Only this sandbox's runtime may tear it down again (CNI DEL).
        self.book
            .pods()
            .apply(uid.as_str(), Event::SandboxOwned(container_id.to_owned()));
        Ok(out)
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

//! Requests from the control socket and the CNI plugin: enroll, unenroll,
//! CNI ADD/DEL/CHECK, status. Kernel work runs off the async workers.

use super::*;
use crate::control::{CniAdd, CniCheck, CniDel, NodeAnswer};

impl Node {
    /// Serves one control request.
    pub async fn handle(self: &Arc<Self>, req: Request) -> Response {
        if self.uninstall_state() != Uninstall::No {
            return match req {
                Request::Status | Request::Uninstall => self.answer(req).await,
                // A pod the runtime creates meanwhile starts uncaptured, as
                // every pod will once sluice is gone; a DEL has nothing left
                // to undo.
                Request::CniAdd(_) | Request::CniDel(_) | Request::CniCheck(_) => {
                    Response::Skipped {
                        reason: format!(
                            "sluice is being removed from this node ({})",
                            self.uninstall_state()
                        ),
                    }
                }
                Request::Enroll { .. } | Request::Unenroll { .. } => Response::Error {
                    message: format!(
                        "sluice is being removed from this node ({})",
                        self.uninstall_state()
                    ),
                },
            };
        }
        self.answer(req).await
    }

    async fn answer(self: &Arc<Self>, req: Request) -> Response {
        match req {
            Request::Uninstall => {
                self.request_uninstall(crate::kube::uninstall::Reason::Command);
                Response::More(NodeAnswer::Uninstalling)
            }
            Request::Enroll {
                netns,
                uid,
                workload,
            } => {
                let span = info_span!("pod", %uid, pod = %format!("{}/{}", workload.namespace, workload.name), netns = %netns.display());
                self.enroll(netns, &uid, workload, PodOptions::default())
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
                let span = info_span!("pod", %uid, pod = %self.pod_name(&uid));
                match self.unenroll(&uid).instrument(span).await {
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
                    self.cni_add(&container_id, netns, &pod).await
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
            Request::Status => {
                // One lock: a second in the same expression would deadlock
                // (temporaries live to the end of the statement).
                let (dataplane, probes, tc_attach) = {
                    let dp = self.dp.lock().unwrap();
                    (dp.adoption().to_string(), dp.probes(), dp.tc_attach())
                };
                Response::More(NodeAnswer::Node(NodeStatus {
                    condition_type: self.report.condition_type.clone(),
                    condition: self.report.condition(),
                    ztunnel_connected: self.hub.is_connected(),
                    ztunnels: self.ztunnels(),
                    waiting: self.waiting(),
                    incomplete: self.pods.incomplete(),
                    served_check: self.served.mode(),
                    dataplane,
                    probes,
                    uninstall: self.uninstall_state().to_string(),
                    skipped: self.skipped.lock().unwrap().clone(),
                    link_watches: self.link_watches.load(std::sync::atomic::Ordering::Relaxed),
                    tc_attach: Some(tc_attach),
                }))
            }
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

    /// Counts a CNI request by its answer.
    fn count_cni(&self, cmd: CniCommand, r: &Response, started: Instant) {
        let result = match r {
            Response::Error { .. } => CniResult::Error,
            Response::Skipped { .. } => CniResult::Skipped,
            _ => CniResult::Ok,
        };
        self.metrics().cni_request(cmd, result, started.elapsed());
    }

    /// CNI DEL. Refused (the one DEL answer the plugin fails on) only when
    /// it would tear down the capture of the pod's live, enrolled sandbox
    /// and does not come from the runtime that made it: its container id is
    /// not the one whose ADD enrolled the pod. Everything else succeeds: a
    /// pod not enrolled, a DEL for another (older) sandbox of the pod, a gone
    /// sandbox.
    pub(super) async fn cni_del(
        self: &Arc<Self>,
        container_id: &str,
        netns: &std::path::Path,
        pod: &crate::cni::spec::PodRef,
    ) -> anyhow::Result<Response> {
        let uid = cni_uid(pod)?;
        let done = Response::Unenrolled {
            uid: uid.to_string(),
        };
        let Some(cookie) = self.cookie_of(&uid) else {
            return Ok(done);
        };
        if !self.del_names_enrolled_sandbox(cookie, netns) {
            // A DEL for an older sandbox of this pod (the runtime made a new
            // one, which ADD already captured): not ours.
            info!(%uid, "CNI DEL for another sandbox of the pod: capture kept");
            return Ok(done);
        }
        match self.pods.sandbox_of(uid.as_str()) {
            Some(id) if id == container_id => {}
            Some(id) if self.sandbox_alive(cookie) => {
                return Ok(Response::Refused {
                    message: format!(
                        "pod {}/{}: DEL for container {container_id}, but the pod was enrolled by the ADD of container {id}, whose sandbox is alive: refusing DEL",
                        pod.namespace, pod.name
                    ),
                })
            }
            // The enrolled sandbox is gone: nothing left to protect.
            Some(_) => {}
            // Enrolled otherwise (control socket, an earlier agent): ask the
            // API whether the pod is going away.
            None => {
                if let Some(k) = &self.kube {
                    if let Err(e) = k.admit_del(pod, self.sandbox_alive(cookie)).await {
                        return Ok(Response::Refused {
                            message: crate::one_line(&e),
                        });
                    }
                }
            }
        }
        self.unenroll(uid.as_str()).await?;
        Ok(done)
    }

    /// The forged-DEL guard, for the control socket's unenroll: the capture
    /// of a sandbox its runtime enrolled (CNI ADD) and that is alive is torn
    /// down only by that runtime's DEL (or by uninstalling sluice).
    fn unenroll_guard(&self, uid: &str) -> Option<Response> {
        let cookie = self.cookie_of(&PodUid::new(uid).ok()?)?;
        let sandbox = self.pods.sandbox_of(uid)?;
        self.sandbox_alive(cookie).then(|| Response::Refused {
            message: format!(
                "pod {uid} was enrolled by its runtime (CNI ADD of container {sandbox}) and its sandbox is alive: only the runtime's DEL removes its capture. To take the pod out of the mesh, label it istio.io/dataplane-mode=none; `sluice uninstall` removes sluice from the node"
            ),
        })
    }

    /// CNI CHECK: success for a pod sluice does not manage; for one it does,
    /// success only when its capture is complete (every link pinned).
    pub(super) async fn cni_check(
        self: &Arc<Self>,
        pod: &crate::cni::spec::PodRef,
    ) -> anyhow::Result<Response> {
        let uid = cni_uid(pod)?;
        let Some(cookie) = self.cookie_of(&uid) else {
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
        let this = self.clone();
        let missing = tokio::task::spawn_blocking(move || {
            enroll::missing_links(&this.dp.lock().unwrap(), cookie)
        })
        .await??;
        if !missing.is_empty() {
            anyhow::bail!(
                "pod {}/{}: capture incomplete, missing links {}; the agent re-attaches them at its next verification (every {}s)",
                pod.namespace,
                pod.name,
                missing.join(", "),
                RESYNC.as_secs()
            );
        }
        Ok(self.enrolled(&uid, cookie))
    }

    /// Whether a DEL (with the runtime's netns path, maybe empty) is about the
    /// sandbox we captured: its netns is ours, or ours is gone as well.
    pub(super) fn del_names_enrolled_sandbox(&self, cookie: u64, netns: &std::path::Path) -> bool {
        let named = crate::podnet::netns::Netns::open(netns)
            .ok()
            .and_then(|n| n.cookie().ok());
        match named {
            Some(c) => c == cookie,
            None => !self.sandbox_alive(cookie),
        }
    }

    /// The answer for a pod that is enrolled, with its current state.
    pub(super) fn enrolled(&self, uid: &PodUid, cookie: u64) -> Response {
        Response::Enrolled {
            uid: uid.to_string(),
            cookie,
            state: self.state_of(cookie),
            note: None,
        }
    }

    /// CNI ADD: capture the new pod before it starts. A retried ADD for the
    /// same sandbox is a no-op; an ADD for a new sandbox of the same pod
    /// replaces the old capture.
    pub(super) async fn cni_add(
        self: &Arc<Self>,
        container_id: &str,
        netns: PathBuf,
        pod: &crate::cni::spec::PodRef,
    ) -> anyhow::Result<Response> {
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
                } => (uid, workload, options),
            },
        };
        if let Some(cookie) = self.cookie_of(&uid) {
            let same = crate::podnet::netns::Netns::open(&netns)?.cookie()? == cookie;
            if same {
                // A retried ADD (or the first one an agent restarted since
                // sees): this container made the enrolled sandbox.
                self.pods
                    .apply(uid.as_str(), Event::SandboxOwned(container_id.to_owned()));
                return Ok(self.enrolled(&uid, cookie));
            }
            info!(%uid, "new sandbox for an enrolled pod: replacing its capture");
            self.unenroll(uid.as_str()).await?;
        }
        let out = self.enroll(netns, uid.as_str(), workload, options).await?;
        // Only this sandbox's runtime may tear it down again (CNI DEL).
        self.pods
            .apply(uid.as_str(), Event::SandboxOwned(container_id.to_owned()));
        Ok(out)
    }

    pub(super) async fn enroll(
        self: &Arc<Self>,
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
        let this = self.clone();
        let (w, u) = (workload.clone(), uid.clone());
        let started = Instant::now();
        let attached = tokio::task::spawn_blocking(move || -> Result<_, EnrollError> {
            let (cookie, netns, held) = {
                let mut dp = this.dp.lock().unwrap();
                let a = enroll::attach_pod(&mut dp, &netns, &u, &w, &options)?;
                // The netns stays open from here on: adds and registrations use it.
                if let Some(meta) = dp.maps().meta(a.cookie) {
                    let kept = a.netns.try_clone().map_err(|source| EnrollError::Io {
                        what: "duplicating the pod's netns fd".into(),
                        source,
                    });
                    match kept {
                        Ok(kept) => this.pods.insert(a.cookie, meta, Some(kept)),
                        Err(e) => {
                            enroll::back_out(&mut dp, &a.netns, a.cookie);
                            return Err(e);
                        }
                    }
                }
                // Its first add goes out below: the supervision pass must
                // not send another.
                this.pods.apply(u.as_str(), Event::AddSent);
                (a.cookie, a.netns, a.host_hooks_held)
            };
            // istio-cni's rules, if any, go without the dataplane held: the
            // iptables tools may take seconds, and other pods' enrollments
            // must not wait for them. This pod is Pending (fail closed) and
            // marked attempting meanwhile, so nothing else acts on it.
            match enroll::take_over(&netns) {
                Ok(took_over) => Ok((cookie, took_over, held)),
                Err(e) => {
                    let mut dp = this.dp.lock().unwrap();
                    // Its teardown's last step drops the pod's row too.
                    enroll::back_out(&mut dp, &netns, cookie);
                    Err(e)
                }
            }
        })
        .await?;
        let cookie = match attached {
            Ok((c, took_over, held)) => {
                use crate::kube::events::Reason;
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
                    self.pod_event(uid.as_str(), reason, &note);
                }
                c
            }
            Err(e) => {
                self.metrics().failed(Failure::Attach);
                return Err(e.into());
            }
        };
        self.metrics().enrolled(started.elapsed());
        info!(cookie, "capture attached (Pending)");
        let note = match self.hub.newest() {
            None => {
                self.pods.apply(
                    uid.as_str(),
                    Event::Wait {
                        why: "no ztunnel connected".into(),
                    },
                );
                self.pod_event(
                    uid.as_str(),
                    crate::kube::events::Reason::ZtunnelNotConnected,
                    "captured, but no ztunnel is connected to sluice: the pod's new connections fail closed until ztunnel connects and takes it",
                );
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
            state,
            note: if state.is_some_and(PodState::steers) {
                None
            } else {
                note
            },
        })
    }

    pub(super) async fn unenroll(self: &Arc<Self>, uid: &str) -> anyhow::Result<()> {
        let uid = PodUid::new(uid)?;
        self.cookie_of(&uid)
            .ok_or_else(|| EnrollError::UnknownPod(uid.clone()))?;
        self.pods.apply(uid.as_str(), Event::UnenrollRequested);
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
        let u = uid.clone();
        let started = Instant::now();
        tokio::task::spawn_blocking(move || -> Result<(), EnrollError> {
            let uid = u;
            let mut guard = this.dp.lock().unwrap();
            let dp = &mut *guard;
            let last = dp
                .maps()
                .find_uid(&uid)
                .map(|c| (dp.maps().counters(c), dp.maps().dns_counters(c)));
            let (pins, maps, node) = dp.parts_mut();
            enroll::unenroll(pins, maps, node, &uid)?;
            if let Some((c, d)) = last {
                this.retired.lock().unwrap().add(&c);
                this.retired_dns.lock().unwrap().add(&d);
            }
            Ok(())
        })
        .await??;
        // The row went with the teardown's last step (`Effect::Forget`).
        self.metrics().torn_down(started.elapsed());
        info!("unenrolled");
        Ok(())
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

//! What the agent tells the outside about its node, once a second: the node
//! condition (computed from the pinned maps and the agent's checks) goes to
//! `/readyz`, the metrics, the Node object (on change or heartbeat) and, once
//! True, removes the `--untaint` taints. On stop it writes `AgentStopped`.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tokio::sync::watch;
use tracing::{info, warn};

use crate::{
    cni::install::CniInstall,
    kube::{condition::ConditionWriter, taint},
    metrics::Metrics,
    readiness::{self, Condition},
};

const EVERY: Duration = Duration::from_secs(1);
/// How long a stopping agent tries to mark the node not ready.
const STOP_WRITE: Duration = Duration::from_secs(5);
/// A pass this late means the loop was held up (a hang, a frozen process):
/// someone else (the watchdog) may have written the condition meanwhile.
const LATE: Duration = Duration::from_secs(3);
/// `/readyz` stops trusting a condition older than this.
pub const STALE: Duration = Duration::from_secs(15);

#[derive(Debug, Clone)]
pub struct ReportConfig {
    pub condition_type: String,
    pub pending_grace: Duration,
    pub heartbeat: Duration,
    /// Taint keys to remove from the node once the condition is True.
    pub untaint: Vec<String>,
}

impl Default for ReportConfig {
    fn default() -> Self {
        Self {
            condition_type: readiness::DEFAULT_CONDITION_TYPE.into(),
            pending_grace: readiness::DEFAULT_PENDING_GRACE,
            heartbeat: crate::kube::condition::DEFAULT_HEARTBEAT,
            untaint: Vec::new(),
        }
    }
}

/// The latest condition and the metrics, shared with the admin listener and
/// the control socket.
pub struct Report {
    pub metrics: Arc<Metrics>,
    pub condition_type: String,
    current: Mutex<Option<(Condition, Instant)>>,
    /// The CNI config's line for `sluice status` (`None`: not managed).
    cni: Mutex<Option<String>>,
    /// sluice was removed from this node: nothing is reported any more.
    uninstalled: std::sync::atomic::AtomicBool,
}

impl Report {
    pub fn new(metrics: Arc<Metrics>, condition_type: &str) -> Self {
        Self {
            metrics,
            condition_type: condition_type.to_owned(),
            current: Mutex::new(None),
            cni: Mutex::new(None),
            uninstalled: Default::default(),
        }
    }

    /// Sets the condition from outside the readiness loop (an agent that
    /// cannot run one: see `agent::incompatible`).
    pub fn hold(&self, c: Condition) {
        self.set(c);
    }

    /// sluice was removed from the node: `/readyz` and `/healthz` answer
    /// 200 `uninstalled` (the watchdog must not mark the node, the kubelet
    /// must not restart the agent into installing again).
    pub fn set_uninstalled(&self) {
        self.uninstalled
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn is_uninstalled(&self) -> bool {
        self.uninstalled.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The last computed condition (`None` before the first pass).
    pub fn condition(&self) -> Option<Condition> {
        self.current
            .lock()
            .unwrap()
            .as_ref()
            .map(|(c, _)| c.clone())
    }

    /// The CNI config as the last pass found it (see `CniInstall::describe`).
    pub fn cni(&self) -> Option<String> {
        self.cni.lock().unwrap().clone()
    }

    /// How long ago the condition was last computed.
    pub fn age(&self) -> Option<Duration> {
        self.current
            .lock()
            .unwrap()
            .as_ref()
            .map(|(_, at)| at.elapsed())
    }

    fn set(&self, c: Condition) {
        self.metrics.set_condition(c.ready, c.reason);
        *self.current.lock().unwrap() = Some((c, Instant::now()));
    }
}

/// The Kubernetes side of the report: where the condition is written.
pub struct NodeApi {
    pub client: kube::Client,
    pub node: String,
}

/// What the report reads from the node each pass (the agent's `NodeAgent`; a
/// trait so this module does not depend on it).
pub trait Inputs: Send + Sync + 'static {
    /// The node condition's inputs (blocking: it walks the pinned maps).
    fn readiness_inputs(
        &self,
        cni: Option<&CniInstall>,
        pending_grace: Duration,
    ) -> readiness::Inputs;
    fn ztunnel_connected(&self) -> bool;
}

pub async fn run<N: Inputs>(
    report: Arc<Report>,
    node: Arc<N>,
    cni: Option<CniInstall>,
    cfg: ReportConfig,
    api: Option<NodeApi>,
    mut stop: watch::Receiver<bool>,
) {
    let mut writer = api.as_ref().map(|a| {
        ConditionWriter::new(
            a.client.clone(),
            &a.node,
            &cfg.condition_type,
            cfg.heartbeat,
        )
    });
    // Flips of the condition, as Events on the Node (`kubectl describe node`).
    let events = api
        .as_ref()
        .map(|a| crate::kube::events::Events::start(a.client.clone(), &a.node));
    let mut untainted = false;
    let mut last_pass = Instant::now();
    loop {
        if last_pass.elapsed() > LATE {
            if let Some(w) = writer.as_mut() {
                w.forget();
            }
        }
        last_pass = Instant::now();
        // The map walk takes the dataplane lock, which an enrollment may hold.
        let (n, c, grace) = (node.clone(), cni.clone(), cfg.pending_grace);
        let (inputs, cni_line) = tokio::task::spawn_blocking(move || {
            let line = c.as_ref().map(CniInstall::describe);
            (n.readiness_inputs(c.as_ref(), grace), line)
        })
        .await
        // A panic there is a bug: let it end the task (then /healthz fails).
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        *report.cni.lock().unwrap() = cni_line;
        let cond = readiness::compute(&inputs);
        let before = report.condition();
        if before.as_ref().map(|b| (b.ready, b.reason)) != Some((cond.ready, cond.reason)) {
            info!(ready = cond.ready, reason = cond.reason.as_str(), message = %cond.message, "node condition");
        }
        // Not for the first pass: the condition itself shows where it starts.
        if let (Some(b), Some(ev)) = (&before, &events) {
            if b.ready != cond.ready {
                use crate::kube::events::Reason as Ev;
                let reason = if cond.ready {
                    Ev::RedirectionReady
                } else {
                    Ev::RedirectionNotReady
                };
                ev.node(
                    reason,
                    format!("{}: {}", cond.reason.as_str(), cond.message),
                );
            }
        }
        report
            .metrics
            .set_ztunnel_connected(node.ztunnel_connected());
        report.set(cond.clone());
        if let Some(w) = writer.as_mut() {
            match tokio::time::timeout(crate::kube::API_TIMEOUT, w.update(&cond)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => warn!(error = %e, "could not write the node condition; will retry"),
                Err(_) => {
                    warn!("the API server did not answer the node condition write; will retry");
                    w.forget();
                }
            }
        }
        if !cond.ready {
            untainted = false;
        } else if !untainted {
            if let Some(a) = &api {
                untainted =
                    tokio::time::timeout(crate::kube::API_TIMEOUT, remove_taints(a, &cfg.untaint))
                        .await
                        .unwrap_or_else(|_| {
                            warn!("the API server did not answer the untaint; will retry");
                            false
                        });
            }
        }
        tokio::select! {
            _ = stop.changed() => break,
            _ = tokio::time::sleep(EVERY) => {}
        }
    }
    let stopped = Condition::agent_stopped();
    report.set(stopped.clone());
    if let Some(w) = writer {
        match tokio::time::timeout(STOP_WRITE, w.write(&stopped)).await {
            Ok(Ok(())) => info!("node condition set to AgentStopped"),
            Ok(Err(e)) => warn!(error = %e, "could not mark the node not ready on stop"),
            Err(_) => warn!("timed out marking the node not ready on stop"),
        }
    }
}

/// Removes the startup taints; true when they are gone.
async fn remove_taints(api: &NodeApi, keys: &[String]) -> bool {
    if keys.is_empty() {
        return true;
    }
    match taint::remove(api.client.clone(), &api.node, keys).await {
        Ok(removed) => {
            if removed {
                info!(taints = ?keys, "node ready: startup taints removed");
            }
            true
        }
        Err(e) => {
            warn!(taints = ?keys, error = %e, "could not remove the startup taints; will retry");
            false
        }
    }
}

//! What the agent tells the outside about its node, once a second: the node
//! condition (computed from the pinned maps and the agent's checks) goes to
//! `/readyz`, the metrics, the Node object (on change or heartbeat) and, once
//! True, removes the `--untaint` taints. On stop it writes `AgentStopped`.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::sync::watch;
use tracing::{info, warn};

use super::node::Node;
use crate::{
    cni::install::CniInstall,
    kube::{condition::ConditionWriter, taint},
    metrics::Metrics,
    readiness::{self, Condition},
};

const EVERY: Duration = Duration::from_secs(1);
/// How long a stopping agent tries to mark the node not ready.
const STOP_WRITE: Duration = Duration::from_secs(5);

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
    current: Mutex<Option<Condition>>,
}

impl Report {
    pub fn new(metrics: Arc<Metrics>, condition_type: &str) -> Self {
        Self {
            metrics,
            condition_type: condition_type.to_owned(),
            current: Mutex::new(None),
        }
    }

    /// The last computed condition (`None` before the first pass).
    pub fn condition(&self) -> Option<Condition> {
        self.current.lock().unwrap().clone()
    }

    fn set(&self, c: Condition) {
        self.metrics.set_condition(c.ready, c.reason);
        *self.current.lock().unwrap() = Some(c);
    }
}

/// The Kubernetes side of the report: where the condition is written.
pub struct NodeApi {
    pub client: kube::Client,
    pub node: String,
}

pub async fn run(
    report: Arc<Report>,
    node: Arc<Node>,
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
    let mut untainted = false;
    loop {
        let cond = readiness::compute(&node.readiness_inputs(cni.as_ref(), cfg.pending_grace));
        let before = report.condition();
        if before.as_ref().map(|b| (b.ready, b.reason)) != Some((cond.ready, cond.reason)) {
            info!(ready = cond.ready, reason = cond.reason.as_str(), message = %cond.message, "node condition");
        }
        report
            .metrics
            .set_ztunnel_connected(node.ztunnel_connected());
        report.set(cond.clone());
        if let Some(w) = writer.as_mut() {
            if let Err(e) = w.update(&cond).await {
                warn!(error = %e, "could not write the node condition; will retry");
            }
        }
        if !cond.ready {
            untainted = false;
        } else if !untainted {
            if let Some(a) = &api {
                untainted = remove_taints(a, &cfg.untaint).await;
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

/// Removes each startup taint; true when all are gone.
async fn remove_taints(api: &NodeApi, keys: &[String]) -> bool {
    let mut all = true;
    for key in keys {
        match taint::remove(api.client.clone(), &api.node, key).await {
            Ok(true) => info!(taint = %key, "node ready: startup taint removed"),
            Ok(false) => {}
            Err(e) => {
                warn!(taint = %key, error = %e, "could not remove the startup taint; will retry");
                all = false;
            }
        }
    }
    all
}

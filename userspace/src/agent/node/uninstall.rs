//! Removing sluice from this node while the agent runs: asked by
//! `sluice uninstall` (control socket), by the uninstall mark on the
//! DaemonSet, or found at SIGTERM (DaemonSet deleted). The agent's tasks stop
//! first; then the CNI entry and plugin go (new pods no longer come to sluice),
//! then every pod's capture (links, routes, map entries: the pod keeps working,
//! uncaptured), then the pins, then the node condition and this node's pod
//! annotations. The agent then stays up, answering `uninstalled`, until it is
//! stopped — exiting would only have the DaemonSet start it again.

use crate::kube::uninstall::Reason;

use super::*;

/// Where this node's uninstall stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Uninstall {
    No,
    /// Asked; the agent's tasks are stopping or the node is being cleaned.
    Started(Reason),
    Done(Reason),
    /// Cleaned as far as possible; what failed (run `sluice uninstall` again).
    Failed(Reason, String),
}

impl std::fmt::Display for Uninstall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Uninstall::No => f.write_str("no"),
            Uninstall::Started(r) => write!(f, "in progress ({})", r.as_str()),
            Uninstall::Done(r) => write!(f, "done ({})", r.as_str()),
            Uninstall::Failed(r, why) => write!(f, "failed ({}): {why}", r.as_str()),
        }
    }
}

impl Node {
    /// The API client, when the agent runs in a cluster.
    pub fn kube_client(&self) -> Option<kube::Client> {
        self.kube.as_ref().map(|k| k.client.clone())
    }

    pub fn uninstall_state(&self) -> Uninstall {
        self.uninstall.borrow().clone()
    }

    /// Asks for the uninstall (once; later asks change nothing). The agent's
    /// main loop carries it out.
    pub fn request_uninstall(&self, reason: Reason) {
        self.uninstall.send_if_modified(|u| {
            if *u == Uninstall::No {
                *u = Uninstall::Started(reason);
                true
            } else {
                false
            }
        });
    }

    /// A receiver that sees the uninstall being asked.
    pub fn watch_uninstall(&self) -> watch::Receiver<Uninstall> {
        self.uninstall.subscribe()
    }

    /// Carries the uninstall out, after the agent's tasks stopped (control
    /// and admin listeners aside). Each step runs whatever the previous one
    /// did; the first error is reported, the rest still runs.
    pub async fn uninstall_node(self: &Arc<Self>, cni: Option<&CniInstall>, reason: Reason) {
        self.request_uninstall(reason);
        let reason = match self.uninstall_state() {
            Uninstall::Started(r) => r,
            _ => reason,
        };
        let mut errors = Vec::new();
        if let Some(cni) = cni {
            match cni.uninstall() {
                Ok(()) => info!("sluice-cni removed from the node's CNI config"),
                Err(e) => errors.push(format!("removing sluice-cni: {e}")),
            }
        }
        let this = self.clone();
        let kernel = tokio::task::spawn_blocking(move || {
            let dp = this.dp.lock().unwrap();
            this.custody.forget_all();
            enroll::uninstall(dp.pins(), dp.node())
        })
        .await;
        match kernel {
            Ok(Ok(n)) => info!(pods = n, "every pod's capture removed, pins removed"),
            Ok(Err(e)) => errors.push(format!("removing capture: {}", crate::error_line(&e))),
            Err(e) => errors.push(format!("removing capture: {e}")),
        }
        if let Some(k) = &self.kube {
            let cleaned = tokio::time::timeout(crate::kube::API_TIMEOUT, async {
                crate::kube::uninstall::clean(
                    k.client.clone(),
                    &self.report.condition_type,
                    &[],
                    Some(&k.node),
                )
                .await
            })
            .await;
            match cleaned {
                Ok(Ok(c)) => info!(
                    annotations = c.annotations,
                    gates = c.gates,
                    "node condition and this node's pod annotations removed"
                ),
                Ok(Err(e)) => errors.push(format!("clearing the API objects: {e}")),
                Err(_) => errors.push("clearing the API objects: timed out".into()),
            }
        }
        self.report.set_uninstalled();
        let end = if errors.is_empty() {
            info!(why = reason.as_str(), "sluice removed from this node");
            Uninstall::Done(reason)
        } else {
            let why = errors.join("; ");
            warn!(%why, "uninstall incomplete; `sluice uninstall` on the node finishes it");
            Uninstall::Failed(reason, why)
        };
        self.uninstall.send_replace(end);
    }
}

//! Removing sluice from this node while the agent runs: asked by
//! `sluice uninstall` (control socket), by the uninstall mark on the
//! DaemonSet, or found at SIGTERM (DaemonSet deleted). The agent's tasks stop
//! first; then the CNI entry and plugin go (new pods no longer come to sluice),
//! then every pod's capture (links, routes, map entries: the pod keeps working,
//! uncaptured), then the pins, then the node condition and this node's pod
//! annotations. A pod whose capture cannot be removed stops no other's: it
//! stays (Draining, failing closed) with the pins and the node condition,
//! and asking again runs the uninstall again. The agent then stays up,
//! answering `uninstalled`, until it is stopped — exiting would only have
//! the DaemonSet start it again.

use std::sync::Arc;

use tokio::sync::watch;
use tracing::{info, warn};

use super::book::PodBook;
use crate::{
    agent::{cluster::KubeCtx, custody::Custody, report::Report},
    cni::install::CniInstall,
    kube::uninstall::Reason,
    podnet::enroll,
};

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

/// Where this node's uninstall stands, and carrying it out.
pub struct Uninstaller {
    state: watch::Sender<Uninstall>,
    kube: Option<KubeCtx>,
    book: Arc<PodBook>,
    custody: Arc<Custody>,
    report: Arc<Report>,
}

impl Uninstaller {
    pub(super) fn new(
        kube: Option<KubeCtx>,
        book: Arc<PodBook>,
        custody: Arc<Custody>,
        report: Arc<Report>,
    ) -> Self {
        Self {
            state: watch::Sender::new(Uninstall::No),
            kube,
            book,
            custody,
            report,
        }
    }

    pub fn state(&self) -> Uninstall {
        self.state.borrow().clone()
    }

    /// Asks for the uninstall; after one that failed, asks for it again
    /// (for the first reason). Otherwise later asks change nothing. The
    /// agent's main loop carries it out.
    pub fn request(&self, reason: Reason) {
        self.state.send_if_modified(|u| match u {
            Uninstall::No => {
                *u = Uninstall::Started(reason);
                true
            }
            Uninstall::Failed(first, _) => {
                *u = Uninstall::Started(*first);
                true
            }
            Uninstall::Started(_) | Uninstall::Done(_) => false,
        });
    }

    /// A receiver that sees the uninstall being asked.
    pub fn watch(&self) -> watch::Receiver<Uninstall> {
        self.state.subscribe()
    }

    /// Carries the uninstall out, after the agent's tasks stopped (control
    /// and admin listeners aside). Each step runs whatever the previous one
    /// did; the first error is reported, the rest still runs.
    pub async fn run(&self, cni: Option<&CniInstall>, reason: Reason) {
        self.request(reason);
        let reason = match self.state() {
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
        // What only the plugin read: stale once it is gone.
        if let Some(k) = &self.kube {
            k.forget_plugin_files();
        }
        let (book, custody) = (self.book.clone(), self.custody.clone());
        let kernel = tokio::task::spawn_blocking(move || {
            let mut dp = book.dataplane();
            dp.retire();
            custody.forget_all();
            enroll::uninstall(dp.pins(), dp.node())
        })
        .await;
        match kernel {
            Ok(Ok(n)) => info!(pods = n, "every pod's capture removed, pins removed"),
            Ok(Err(e)) => errors.push(format!("removing capture: {}", crate::error_line(&e))),
            Err(e) => errors.push(format!("removing capture: {e}")),
        }
        // A node with something left (a pod's capture, the CNI entry) keeps
        // its condition, so the Helm hook names it as not done; the pods'
        // annotations and gates go all the same (those left fail closed).
        if let Some(k) = &self.kube {
            let kind = errors
                .is_empty()
                .then_some(self.report.condition_type.as_str());
            let cleaned = tokio::time::timeout(crate::kube::API_TIMEOUT, async {
                crate::kube::uninstall::clean(k.client.clone(), kind, &[], Some(&k.node)).await
            })
            .await;
            match cleaned {
                Ok(Ok(c)) => info!(
                    annotations = c.annotations,
                    gates = c.gates,
                    conditions = c.conditions,
                    "this node's pod annotations and gates, and its condition unless kept, removed"
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
        self.state.send_replace(end);
    }
}

//! The uninstall mark on the agents' DaemonSet (or the DaemonSet being
//! deleted or gone): read at start (an agent restarted midway finishes the
//! uninstall), every few seconds while the agent runs, and at SIGTERM. A
//! DaemonSet that cannot be read says nothing: capture stays on a doubt.
//!
//! Only the mark is acted on at any moment. A DaemonSet being deleted or
//! gone means uninstall only at SIGTERM, as the reason the agent is stopped:
//! read while it runs, it may be an orphaning delete (`kubectl delete ds
//! --cascade=orphan`, then the DaemonSet recreated; the pods stay), and
//! "gone" counts only once this agent has read its DaemonSet, so a wrong
//! `--daemonset` (a kustomize `namePrefix`, say) never takes capture away.
//! A deletion seen while running is remembered for SIGTERM, when the read
//! may fail (`kubectl delete -k` removes the RBAC too), until a later read
//! finds the DaemonSet again (an orphaning delete, then re-created).

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use tokio::sync::watch;
use tracing::{info, warn};

use super::node::Uninstaller;
use crate::kube::uninstall::{decide, Reason};

/// How often the DaemonSet is read for the uninstall mark.
const EVERY: Duration = Duration::from_secs(5);

/// When the DaemonSet is read, which decides what it may say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moment {
    Start,
    Running,
    /// At SIGTERM.
    Stop,
}

/// Whether `reason`, read at `moment`, asks this agent to uninstall;
/// `seen`: whether the agent has read its DaemonSet before.
fn asks(moment: Moment, reason: Reason, seen: bool) -> bool {
    match reason {
        Reason::Requested | Reason::Command => true,
        Reason::Deleting => moment == Moment::Stop,
        Reason::Gone => moment == Moment::Stop && seen,
    }
}

/// The agents' DaemonSet, read for what it asks.
pub struct DaemonSetMark {
    client: kube::Client,
    namespace: String,
    name: String,
    /// Whether a read found it.
    seen: AtomicBool,
    /// A deletion (or, once seen, its absence) read while the agent runs,
    /// for SIGTERM should the read then fail.
    going: std::sync::Mutex<Option<Reason>>,
}

impl DaemonSetMark {
    pub fn new(client: kube::Client, (namespace, name): (String, String)) -> Arc<Self> {
        Arc::new(Self {
            client,
            namespace,
            name,
            seen: AtomicBool::new(false),
            going: std::sync::Mutex::new(None),
        })
    }

    /// What the DaemonSet asks at `moment`; `None` also when it cannot be
    /// read (capture stays on a doubt), unless at SIGTERM after a deletion
    /// read while running.
    pub async fn read(&self, moment: Moment) -> Option<Reason> {
        let read = tokio::time::timeout(
            crate::kube::API_TIMEOUT,
            decide(self.client.clone(), &self.namespace, &self.name),
        )
        .await;
        let going = *self.going.lock().unwrap();
        let reason = match read {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                let r = going.filter(|_| moment == Moment::Stop);
                warn!(daemonset = %self.name, error = %e, then = ?r, "cannot read the DaemonSet: taken as what it last said");
                return r;
            }
            Err(_) => {
                let r = going.filter(|_| moment == Moment::Stop);
                warn!(daemonset = %self.name, then = ?r, "reading the DaemonSet timed out: taken as what it last said");
                return r;
            }
        };
        let seen = if reason == Some(Reason::Gone) {
            self.seen.load(Ordering::Relaxed)
        } else {
            self.seen.store(true, Ordering::Relaxed);
            true
        };
        *self.going.lock().unwrap() = match reason {
            Some(r @ Reason::Deleting) => Some(r),
            Some(r @ Reason::Gone) if seen => Some(r),
            _ => None,
        };
        match reason {
            Some(r) if asks(moment, r, seen) => Some(r),
            Some(Reason::Gone) if !seen && moment != Moment::Running => {
                warn!(
                    daemonset = %format!("{}/{}", self.namespace, self.name),
                    "the agents' DaemonSet is not found (does --daemonset name it?): its deletion cannot be told from a wrong name, so only `sluice uninstall` or the mark removes sluice from this node"
                );
                None
            }
            _ => None,
        }
    }

    /// Reads the DaemonSet once and asks for the uninstall if it says so.
    pub async fn check(&self, moment: Moment, uninstall: &Uninstaller) {
        if let Some(r) = self.read(moment).await {
            uninstall.request(r);
        }
    }

    /// Reads the DaemonSet until it carries the mark, then asks the node.
    pub async fn watch(
        self: Arc<Self>,
        uninstall: Arc<Uninstaller>,
        mut stop: watch::Receiver<bool>,
    ) {
        tokio::select! {
            _ = stop.changed() => {}
            r = self.asked() => uninstall.request(r),
        }
    }

    /// Reads the DaemonSet every few seconds until it carries the mark.
    pub async fn asked(&self) -> Reason {
        loop {
            if let Some(r) = self.read(Moment::Running).await {
                info!(why = r.as_str(), "uninstall asked");
                return r;
            }
            tokio::time::sleep(EVERY).await;
        }
    }
}

/// Returns once the DaemonSet exists without the uninstall mark: cleared by
/// a `helm upgrade` after a failed or cancelled uninstall, or by hand. An
/// agent that removed sluice on the mark then exits, and its restart installs
/// sluice again. Never returns without a client and a DaemonSet to read.
pub async fn until_unmarked(client: Option<kube::Client>, ds: Option<(String, String)>) {
    let (Some(client), Some((namespace, name))) = (client, ds) else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(EVERY).await;
        let read = tokio::time::timeout(
            crate::kube::API_TIMEOUT,
            decide(client.clone(), &namespace, &name),
        )
        .await;
        if let Ok(Ok(None)) = read {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::kube::{
        mock::{self, reply},
        uninstall::REQUESTED,
    };

    fn daemonset(annotations: serde_json::Value, deleting: bool) -> serde_json::Value {
        let mut meta = json!({"name": "sluice", "annotations": annotations});
        if deleting {
            meta["deletionTimestamp"] = json!("2026-11-28T10:00:00Z");
        }
        json!({"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": meta,
            "spec": {"selector": {}, "template": {}}})
    }

    /// What one agent's reads at `moments` say, the API answering `answers`
    /// in turn.
    async fn reads(
        answers: Vec<(u16, serde_json::Value)>,
        moments: &[Moment],
    ) -> Vec<Option<Reason>> {
        let (client, mut handle) = mock::client();
        let server = tokio::spawn(async move {
            for (code, body) in answers {
                let (_, send) = handle.next_request().await.unwrap();
                reply(send, code, &body);
            }
        });
        let mark = DaemonSetMark::new(client, ("istio-system".into(), "sluice".into()));
        let mut got = Vec::new();
        for &moment in moments {
            got.push(mark.read(moment).await);
        }
        server.await.unwrap();
        got
    }

    fn not_found() -> serde_json::Value {
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": "NotFound", "code": 404, "message": "not found"})
    }

    /// Only the mark counts while the agent runs or starts: a DaemonSet
    /// orphan-deleted and recreated, or a wrong `--daemonset`, never takes
    /// capture away. At SIGTERM a deletion does, and "gone" once the agent
    /// has seen its DaemonSet.
    #[tokio::test]
    async fn only_the_mark_counts_until_sigterm_and_gone_only_once_seen() {
        let answers = vec![
            (404, not_found()),
            (404, not_found()),
            (200, daemonset(json!({}), true)),
            (200, daemonset(json!({REQUESTED: "false"}), false)),
            (404, not_found()),
            (404, not_found()),
            (200, daemonset(json!({}), true)),
            (200, daemonset(json!({REQUESTED: "true"}), false)),
        ];
        let got = reads(
            answers,
            &[
                Moment::Stop,
                Moment::Start,
                Moment::Running,
                Moment::Running,
                Moment::Running,
                Moment::Stop,
                Moment::Stop,
                Moment::Start,
            ],
        )
        .await;
        assert_eq!(
            got,
            [
                None,
                None,
                None,
                None,
                None,
                Some(Reason::Gone),
                Some(Reason::Deleting),
                Some(Reason::Requested)
            ]
        );
    }

    /// `kubectl delete -k` without the mark: the agent reads the deletion
    /// while it runs, and at SIGTERM the RBAC is gone too (403): what it
    /// read last decides. An orphaning delete, the DaemonSet then created
    /// again, is forgotten once read.
    #[tokio::test]
    async fn a_deletion_read_while_running_holds_at_sigterm_until_read_again() {
        let forbidden = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": "Forbidden", "code": 403, "message": "forbidden"});
        let answers = vec![
            (200, daemonset(json!({}), false)),
            (200, daemonset(json!({}), true)),
            (403, forbidden.clone()),
            (200, daemonset(json!({}), false)),
            (403, forbidden),
        ];
        let got = reads(
            answers,
            &[
                Moment::Running,
                Moment::Running,
                Moment::Stop,
                Moment::Running,
                Moment::Stop,
            ],
        )
        .await;
        assert_eq!(got, [None, None, Some(Reason::Deleting), None, None]);
    }

    /// Marked, unreadable, then unmarked: only the last ends the wait.
    #[tokio::test(start_paused = true)]
    async fn a_cleared_mark_ends_the_wait_a_read_failure_does_not() {
        let (client, mut handle) = mock::client();
        let ds = |mark: &str| {
            json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
                "metadata": {"name": "sluice", "annotations": {REQUESTED: mark}},
                "spec": {"selector": {}, "template": {}}})
        };
        let forbidden = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": "Forbidden", "code": 403, "message": "forbidden"});
        let server = tokio::spawn(async move {
            for (code, body) in [(200, ds("true")), (403, forbidden), (200, ds("false"))] {
                let (req, send) = handle.next_request().await.unwrap();
                assert_eq!(
                    req.uri().path(),
                    "/apis/apps/v1/namespaces/istio-system/daemonsets/sluice"
                );
                reply(send, code, &body);
            }
        });
        until_unmarked(Some(client), Some(("istio-system".into(), "sluice".into()))).await;
        server.await.unwrap();
    }
}

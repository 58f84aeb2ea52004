//! The uninstall mark on the agents' DaemonSet (or the DaemonSet being
//! deleted or gone): read at start (an agent restarted midway finishes the
//! uninstall), every few seconds while the agent runs, and at SIGTERM. A
//! DaemonSet that cannot be read says nothing: capture stays on a doubt.

use std::{sync::Arc, time::Duration};

use tokio::sync::watch;
use tracing::{info, warn};

use super::node::Uninstaller;
use crate::kube::uninstall::{decide, Reason};

/// How often the DaemonSet is read for the uninstall mark.
const EVERY: Duration = Duration::from_secs(5);

/// Whether the DaemonSet says uninstall; `None` also when it cannot be read
/// (capture stays on a doubt).
async fn uninstall_reason(
    client: &kube::Client,
    (namespace, name): &(String, String),
) -> Option<Reason> {
    let read = tokio::time::timeout(
        crate::kube::API_TIMEOUT,
        decide(client.clone(), namespace, name),
    )
    .await;
    match read {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            warn!(daemonset = %name, error = %e, "cannot read the DaemonSet: taken as not uninstalling");
            None
        }
        Err(_) => {
            warn!(daemonset = %name, "reading the DaemonSet timed out: taken as not uninstalling");
            None
        }
    }
}

/// Reads the DaemonSet once and asks for the uninstall if it says so.
pub async fn check(client: &kube::Client, ds: &(String, String), uninstall: &Uninstaller) {
    if let Some(r) = uninstall_reason(client, ds).await {
        uninstall.request(r);
    }
}

/// Reads the DaemonSet until it says uninstall, then asks the node.
pub async fn watch_for_mark(
    client: kube::Client,
    ds: (String, String),
    uninstall: Arc<Uninstaller>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        if let Some(r) = uninstall_reason(&client, &ds).await {
            info!(why = r.as_str(), "uninstall asked");
            uninstall.request(r);
            return;
        }
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(EVERY) => {}
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

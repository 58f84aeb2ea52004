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

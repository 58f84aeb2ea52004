//! The agent's local control socket: root-only (0600), one JSON request and
//! one JSON response per connection, newline-terminated. `sluice enroll` /
//! `unenroll` use it when an agent runs, so ZDS stays in step with capture.

use std::{
    io::{BufRead, BufReader, Write},
    os::unix::{fs::PermissionsExt, net::UnixStream},
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt},
    net::UnixListener,
    sync::watch,
};
use tracing::warn;

use super::node::Node;
use crate::{cni::spec::PodRef, readiness::Condition, workload::Workload};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Request {
    Enroll {
        netns: PathBuf,
        uid: String,
        workload: Workload,
    },
    Unenroll {
        uid: String,
    },
    /// From `sluice-cni` ADD: enroll the pod if it is ambient.
    CniAdd {
        container_id: String,
        netns: PathBuf,
        pod: PodRef,
        /// The pod's IPs from prevResult.
        ips: Vec<String>,
    },
    /// From `sluice-cni` DEL.
    /// `netns` is empty when the runtime no longer has it.
    CniDel {
        container_id: String,
        netns: PathBuf,
        pod: PodRef,
    },
    /// From `sluice-cni` CHECK.
    CniCheck {
        pod: PodRef,
    },
    /// The node-level state, for `sluice status`.
    Status,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Response {
    Enrolled {
        uid: String,
        cookie: u64,
        state: String,
        /// Why the pod is not Enabled yet, when it is not.
        note: Option<String>,
    },
    Unenrolled {
        uid: String,
    },
    /// Not ours to capture (not ambient, hostNetwork, sidecar…).
    Skipped {
        reason: String,
    },
    Error {
        message: String,
    },
    Node(NodeStatus),
}

/// What the agent reports about its node.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NodeStatus {
    pub condition_type: String,
    /// `None` before the agent's first readiness pass.
    pub condition: Option<Condition>,
    pub ztunnel_connected: bool,
}

pub fn bind(path: &Path) -> std::io::Result<std::os::unix::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let l = std::os::unix::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    l.set_nonblocking(true)?;
    Ok(l)
}

pub async fn serve(
    listener: std::os::unix::net::UnixListener,
    path: PathBuf,
    node: Arc<Node>,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let listener = UnixListener::from_std(listener)?;
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => {
                let (stream, _) = accepted?;
                let node = node.clone();
                tokio::spawn(async move {
                    if let Err(e) = handle(stream, node).await {
                        warn!(error = %e, "control connection failed");
                    }
                });
            }
        }
    }
    let _ = std::fs::remove_file(&path);
    Ok(())
}

async fn handle(stream: tokio::net::UnixStream, node: Arc<Node>) -> std::io::Result<()> {
    let (r, mut w) = stream.into_split();
    let mut line = String::new();
    tokio::io::BufReader::new(r).read_line(&mut line).await?;
    let resp = match serde_json::from_str::<Request>(&line) {
        Ok(req) => node.handle(req).await,
        Err(e) => Response::Error {
            message: format!("bad request: {e}"),
        },
    };
    let mut out = serde_json::to_vec(&resp).expect("responses always serialise");
    out.push(b'\n');
    w.write_all(&out).await
}

/// Sends one request to a running agent. `Ok(None)` when no agent listens.
pub fn call(path: &Path, req: &Request) -> anyhow::Result<Option<Response>> {
    // Enrollment waits for ztunnel's ack (5 s deadline) and its listeners.
    call_within(path, req, Duration::from_secs(30))
}

/// [`call`] with a deadline for the answer.
pub fn call_within(
    path: &Path,
    req: &Request,
    timeout: Duration,
) -> anyhow::Result<Option<Response>> {
    let mut s = match UnixStream::connect(path) {
        Ok(s) => s,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            return Ok(None)
        }
        Err(e) => {
            return Err(anyhow::anyhow!(
                "connecting to the agent at {}: {e}",
                path.display()
            ))
        }
    };
    s.set_read_timeout(Some(timeout))?;
    let mut out = serde_json::to_vec(req)?;
    out.push(b'\n');
    s.write_all(&out)?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    Ok(Some(serde_json::from_str(&line)?))
}

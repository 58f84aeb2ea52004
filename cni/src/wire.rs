//! The plugin's side of the agent's control protocol: one JSON request and
//! one JSON response per connection, newline-terminated, over the agent's
//! root-only unix socket. The agent's full protocol (`sluice::control`)
//! embeds these requests as they are, so both sides share one definition.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{de::DeserializeOwned, Deserialize, Serialize};

use sluice_common::PodState;

use crate::spec::PodRef;

pub const DEFAULT_CONTROL_SOCKET: &str = "/run/sluice/agent.sock";

/// ADD: enroll the pod if it is ambient.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniAdd {
    pub container_id: String,
    pub netns: PathBuf,
    pub pod: PodRef,
    /// The pod's IPs from prevResult.
    pub ips: Vec<String>,
}

/// DEL. `netns` is empty when the runtime no longer has it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniDel {
    pub container_id: String,
    pub netns: PathBuf,
    pub pod: PodRef,
}

/// CHECK.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniCheck {
    pub pod: PodRef,
}

/// What the plugin asks (the agent's `Request` has these variants, same
/// names, same bodies).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PluginRequest {
    CniAdd(CniAdd),
    CniDel(CniDel),
    CniCheck(CniCheck),
}

/// The agent's answer to a request about one pod: the plugin's requests and
/// the CLI's `enroll`/`unenroll` alike. The agent's own clients may get
/// more (`More`: its node status, an uninstall started); the plugin never
/// asks for those, so its `Answer` has none ([`NoMore`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Answer<M = NoMore> {
    Enrolled {
        uid: String,
        cookie: u64,
        /// `null`: an entry this build cannot read.
        state: Option<PodState>,
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
    /// Not carried out, on purpose: the request would tear down the capture
    /// of a pod's live sandbox and does not come from the runtime that made
    /// it (a forged CNI DEL). The one DEL answer the plugin fails on.
    Refused {
        message: String,
    },
    /// Answers about the node rather than a pod, each under its own tag.
    #[serde(untagged)]
    More(M),
}

/// No answer beyond a pod's: what the plugin can be told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NoMore {}

/// Sends `envelope` (one JSON object) to the agent at `path` and reads one
/// JSON answer within `timeout`. `Ok(None)` when no agent listens.
pub fn exchange<T: DeserializeOwned>(
    path: &Path,
    envelope: &impl Serialize,
    timeout: Duration,
) -> anyhow::Result<Option<T>> {
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
        Err(e) => anyhow::bail!("connecting to the agent at {}: {e}", path.display()),
    };
    s.set_read_timeout(Some(timeout))?;
    let mut out = serde_json::to_vec(envelope)?;
    out.push(b'\n');
    s.write_all(&out)?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    Ok(Some(serde_json::from_str(&line)?))
}

/// Enrollment waits for ztunnel's ack (5 s deadline) and its listeners.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// One plugin request to the agent at `path` (the agent on the node: no pin
/// root named).
pub fn call(path: &Path, req: &PluginRequest) -> anyhow::Result<Option<Answer>> {
    exchange(path, &serde_json::json!({ "request": req }), CALL_TIMEOUT)
}

//! Asking a ztunnel process what it knows: its admin API listens on
//! localhost inside ztunnel's own network namespace, so the request is made
//! from a short-lived thread that entered that netns (`/proc/<pid>/ns/net`;
//! the pid comes from the ZDS connection's peer credentials). Nothing in
//! ztunnel changes.

use std::{path::PathBuf, time::Duration};

use super::dump::{self, Known, Wanted};
use crate::podnet::netns::{Netns, NetnsError};

/// ztunnel's default admin port (ProxyConfig `proxyAdminPort`).
pub const DEFAULT_ADMIN_PORT: u16 = 15000;
/// One whole read of the dump, connect to last byte.
pub const TIMEOUT: Duration = Duration::from_secs(5);
/// The most of a dump the agent reads (≈ 30,000 workloads, pretty-printed).
const MAX_DUMP: u64 = 256 << 20;

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("ztunnel's pid is unknown (its ZDS connection carried no peer credentials)")]
    NoPid,
    #[error("entering ztunnel's netns")]
    Netns(#[from] NetnsError),
    #[error("ztunnel's admin API at {url} did not answer")]
    Unreachable {
        url: String,
        #[source]
        source: Box<ureq::Error>,
    },
    #[error("ztunnel's admin API at {url} stopped sending its config_dump midway (timeout or over {} MiB)", MAX_DUMP >> 20)]
    CutShort {
        url: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("ztunnel's admin API at {url} sent something that is not a config_dump")]
    NotADump {
        url: String,
        #[source]
        source: serde_json::Error,
    },
}

/// Which of `wanted` the ztunnel process `pid` serves, from its admin API on
/// `port`. Blocking (up to `TIMEOUT`): run it off the async workers.
pub fn known(
    pid: Option<i32>,
    port: u16,
    wanted: &[Wanted],
    node: Option<&str>,
) -> Result<Known, FetchError> {
    let pid = pid.filter(|p| *p > 0).ok_or(FetchError::NoPid)?;
    let ns = Netns::open(&PathBuf::from(format!("/proc/{pid}/ns/net")))?;
    ns.run(|| read(port, wanted, node))?
}

/// In ztunnel's netns: GET the dump and parse it as it arrives.
fn read(port: u16, wanted: &[Wanted], node: Option<&str>) -> Result<Known, FetchError> {
    let url = format!("http://127.0.0.1:{port}/config_dump");
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(TIMEOUT))
        // Loopback in ztunnel's netns: never through an HTTP(S)_PROXY from
        // the agent's environment.
        .proxy(None)
        .build()
        .into();
    let unreachable = |e: ureq::Error| FetchError::Unreachable {
        url: url.clone(),
        source: Box::new(e),
    };
    let mut resp = agent.get(&url).call().map_err(unreachable)?;
    let body = resp.body_mut().with_config().limit(MAX_DUMP).reader();
    dump::known(body, wanted, node).map_err(|source| {
        // A body cut short (timeout, size limit) shows as an I/O error
        // inside the parse: not the dump's fault.
        if source.is_io() {
            FetchError::CutShort { url, source }
        } else {
            FetchError::NotADump { url, source }
        }
    })
}

//! What can go wrong enrolling, repairing or tearing down a pod.

use aya::programs::ProgramError;
use sluice_common::NETNS_PATH_LEN;

use crate::{
    dataplane::{loader::Dataplane, migrate::MigrateError, state::StateError},
    podnet::{netns::NetnsError, podview::ViewError, routes::RouteError, sockets::SocketError},
    uid::PodUid,
};

#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("pod {uid} is already enrolled (netns cookie {cookie})")]
    AlreadyEnrolled { uid: PodUid, cookie: u64 },
    #[error("netns {path} is already enrolled as pod {uid}")]
    NetnsTaken { path: String, uid: String },
    #[error("no enrolled pod has uid {0}")]
    UnknownPod(PodUid),
    #[error(
        "istio.io/reroute-virtual-interfaces ({0}) needs bpf_get_netns_cookie in tc programs \
         (Linux ≥ 6.15), which this kernel lacks: the pod is not captured"
    )]
    RerouteUnsupported(String),
    #[error(
        "istio.io/reroute-virtual-interfaces names {0}, which has no Ethernet header: \
         only Ethernet interfaces can be rerouted; the pod is not captured"
    )]
    RerouteOnL3(String),
    #[error("the pod of netns cookie {0} is being torn down (Draining): it is not enabled again")]
    Draining(u64),
    #[error("netns {0} now belongs to another namespace than the enrolled pod's")]
    NetnsReplaced(String),
    #[error("netns path {0:?} is too long (max {max} bytes) or not UTF-8", max = NETNS_PATH_LEN - 1)]
    BadPath(String),
    #[error("netns {path} is {why}: sluice never captures it")]
    HostNetns { path: String, why: &'static str },
    #[error("netns {0} has no interface besides lo: nothing to capture")]
    NoInterface(String),
    #[error("attaching {what}: {source}")]
    Attach { what: String, source: ProgramError },
    #[error("pinning {what}: {reason}")]
    Pin { what: String, reason: String },
    #[error("pod routing: {0}")]
    Routes(#[from] RouteError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error("finding ztunnel's listeners: {0}")]
    Sockets(#[from] SocketError),
    #[error("taking over from istio-cni: {0}")]
    Migrate(#[from] MigrateError),
    #[error(
        "{removed} pods' capture removed, {} not: {}; their entries and the node's pins are \
         kept (those pods fail closed): run `sluice uninstall` again",
        left.len(),
        left.iter().map(|(c, e)| format!("netns cookie {c}: {e}")).collect::<Vec<_>>().join("; ")
    )]
    UninstallIncomplete {
        removed: usize,
        /// Each pod left, by netns cookie, with its teardown's error.
        left: Vec<(u64, String)>,
    },
    #[error("sluice is being removed from this node: nothing is attached any more")]
    Retired,
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

impl From<ViewError> for EnrollError {
    fn from(e: ViewError) -> Self {
        match e {
            ViewError::Netns(e) => e.into(),
            ViewError::Io { what, path, source } => EnrollError::Io {
                what: format!("{what} in {path}"),
                source,
            },
        }
    }
}

/// `Err(Retired)` once the uninstall has retired the dataplane: every path
/// that attaches or registers asks this first, under the dataplane's lock.
pub fn unless_retired(dp: &Dataplane) -> Result<(), EnrollError> {
    if dp.is_retired() {
        return Err(EnrollError::Retired);
    }
    Ok(())
}

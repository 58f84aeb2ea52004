//! The control protocol between the agent and its local clients (`sluice`
//! CLI, `sluice-cni`): one JSON request and one JSON response per
//! connection, newline-terminated, over the agent's root-only (0600) unix
//! socket. A leaf: the types and the client, nothing of the agent.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{Deserialize, Serialize};

pub use sluice_cni::wire::{Answer, CniAdd, CniCheck, CniDel, DEFAULT_CONTROL_SOCKET};

use crate::{readiness::Condition, workload::Workload};

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
    /// From `sluice-cni`: ADD, DEL, CHECK (the plugin's `PluginRequest`
    /// variants, the same on the wire).
    CniAdd(CniAdd),
    CniDel(CniDel),
    CniCheck(CniCheck),
    /// The node-level state, for `sluice status`.
    Status,
    /// Remove sluice from this node (`sluice uninstall`); answered at once
    /// with `Uninstalling`, carried out after the agent's tasks stopped
    /// (`Status` then says how it went).
    Uninstall,
}

/// The agent's answer to any request: a pod's ([`Answer`], the very type
/// the plugin reads) or, for the agent's own clients, the node's.
pub type Response = Answer<NodeAnswer>;

/// Answers about the node (`status`, `uninstall`), on the wire under their
/// own tags beside a pod's.
// One answer per connection: boxing the status would save nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum NodeAnswer {
    Node(NodeStatus),
    /// The uninstall was started (or already had been).
    Uninstalling,
}

/// One request on the wire. `bpf_root` is the pin root the caller works on
/// (`sluice --bpf-root`): an agent that owns another root refuses the
/// request instead of applying it to its own maps. `sluice-cni` sends none
/// (it always means the node's agent).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Envelope {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bpf_root: Option<PathBuf>,
    pub request: Request,
}

/// One request line as the agent reads it (without its newline).
pub fn parse_envelope(line: &str) -> Result<Envelope, String> {
    serde_json::from_str(line).map_err(|e| format!("bad request: {e}"))
}

/// Why an agent refuses a request for another pin root.
pub fn wrong_root(own: &Path, asked: &Path) -> Option<String> {
    let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_owned());
    (canon(own) != canon(asked)).then(|| {
        format!(
            "the agent on this control socket owns bpf root {} but the request is for {}: \
             pass --control-socket of the agent that owns {}, or no --bpf-root",
            own.display(),
            asked.display(),
            asked.display()
        )
    })
}

/// What the agent reports about its node.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NodeStatus {
    pub condition_type: String,
    /// `None` before the agent's first readiness pass.
    pub condition: Option<Condition>,
    pub ztunnel_connected: bool,
    /// ztunnel processes: connected over ZDS, and/or owning pods' listeners.
    #[serde(default)]
    pub ztunnels: Vec<ZtunnelView>,
    /// Pods left Pending by a failed attempt, retried with backoff.
    #[serde(default)]
    pub waiting: Vec<WaitingPod>,
    /// Enrolled pods whose capture lacks links a repair could not attach:
    /// part of their traffic bypasses ztunnel (their readiness gate is
    /// False). Retried at every repair.
    #[serde(default)]
    pub incomplete: Vec<IncompletePod>,
    /// What the last verification of each held pod's capture found (run on
    /// synthetic packets; see `podnet::verify`).
    #[serde(default)]
    pub verifications: Vec<PodVerification>,
    /// How the agent came by the pinned programs (loaded, adopted, upgraded
    /// in place, or another build's kept).
    #[serde(default)]
    pub dataplane: String,
    /// How kubelet's probes reach pods uncaptured (see `Dataplane::probes`).
    #[serde(default)]
    pub probes: String,
    /// The node's CNI config: the file in force, the mode, and trouble
    /// keeping it in step; `None`: the agent does not manage it.
    #[serde(default)]
    pub cni: Option<String>,
    /// How the agent decides a pod is served (`--served-check`).
    #[serde(default = "auto")]
    pub served_check: crate::served::Mode,
    /// Whether sluice is being removed from the node: `no`, `in progress
    /// (…)`, `done (…)`, `failed (…): …`.
    #[serde(default)]
    pub uninstall: String,
    /// Pods on this node the agent's last reconcile with the API did not
    /// capture, and why (not ambient, opted out, excluded namespace…).
    #[serde(default)]
    pub skipped: Vec<SkippedPod>,
    /// Enrolled pods whose exclusion annotations are not in force as
    /// written: ignored by this node's policy, or malformed.
    #[serde(default)]
    pub exclusion_notices: Vec<ExclusionNotice>,
    /// Pods whose netns the agent watches for new interfaces (see
    /// `agent/node/linkwatch.rs`): every held pod with an open netns, a
    /// tick (200 ms) after it arrives or leaves.
    #[serde(default)]
    pub link_watches: usize,
    /// How the agent attaches tc programs to new pods (`--tc-attach`, after
    /// a fallback to cls_bpf on a kernel without tcx); `None` from an agent
    /// of a build before the choice.
    #[serde(default)]
    pub tc_attach: Option<crate::dataplane::features::TcAttach>,
}

/// What the last verification of a pod's capture found.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PodVerification {
    pub uid: String,
    pub outcome: VerifyOutcome,
    /// The failed case (`failed`), or what was only looked at (`partial`).
    #[serde(default)]
    pub case: String,
    /// What the kernel did instead (`failed`).
    #[serde(default)]
    pub detail: String,
    /// Seconds since it ran; `None`: it has not.
    pub age_s: Option<u64>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum VerifyOutcome {
    NotYet,
    Verified,
    /// Verified, with some hooks only looked at (not run).
    Partial,
    Failed,
}

/// A pod of this node the agent leaves uncaptured, and why.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SkippedPod {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub reason: String,
}

/// Why a pod's exclusion annotations are not in force as written.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExclusionNotice {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    /// `ignored` (the node's policy; captured fully) or `invalid` (the
    /// exclusions it had stay in force).
    pub kind: String,
    pub detail: String,
}

fn auto() -> crate::served::Mode {
    crate::served::Mode::Auto
}

/// What the served check last heard from one ztunnel's admin API.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "check", rename_all = "snake_case")]
pub enum ServedCheck {
    /// Not asked yet (no pod of its waited to be served).
    #[default]
    NotAsked,
    /// Its last answer was a config_dump.
    Answering,
    /// It did not answer; its acks do not count as served yet.
    Failing { error: String },
    /// It has not answered for a while: its acks count as served.
    AcksCountAsServed { error: String },
    /// `--served-check=off`: acks count as served.
    Off,
}

/// A pod the agent retries, and why its last attempt failed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct WaitingPod {
    pub uid: String,
    pub last_error: String,
    /// The last attempt was refused by ztunnel (a nack): the pod's problem,
    /// not the node's (the node condition stays `True`).
    #[serde(default)]
    pub ztunnel_refused: bool,
}

/// An enrolled pod whose capture a repair could not complete.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct IncompletePod {
    pub uid: String,
    /// The links it lacks (pin names, e.g. `egress_eth0`).
    pub missing: Vec<String>,
    /// Why they could not be attached.
    pub reason: String,
}

/// One ztunnel process as the agent sees it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ZtunnelView {
    pub pid: i32,
    /// Has a live (post-snapshot) ZDS connection.
    pub connected: bool,
    /// Pods whose registered listeners it owns.
    pub pods: usize,
    #[serde(default)]
    pub served_check: ServedCheck,
}

/// Sends one request to a running agent, for pins under `bpf_root` (`None`:
/// whatever the agent owns). `Ok(None)` when no agent listens.
pub fn call(
    path: &Path,
    bpf_root: Option<&Path>,
    req: &Request,
) -> anyhow::Result<Option<Response>> {
    call_within(path, bpf_root, req, sluice_cni::wire::CALL_TIMEOUT)
}

/// [`call`] with a deadline for the answer.
pub fn call_within(
    path: &Path,
    bpf_root: Option<&Path>,
    req: &Request,
    timeout: Duration,
) -> anyhow::Result<Option<Response>> {
    let envelope = Envelope {
        bpf_root: bpf_root.map(Path::to_owned),
        request: req.clone(),
    };
    sluice_cni::wire::exchange(path, &envelope, timeout)
}

#[cfg(test)]
mod tests {
    use sluice_cni::{spec::PodRef, wire::PluginRequest};
    use sluice_common::PodState;

    use super::*;

    /// The plugin and the agent share the request bodies; the plugin reads
    /// the agent's answers with its own, smaller enum: both directions must
    /// agree on the wire.
    #[test]
    fn the_plugin_and_the_agent_agree_on_the_wire() {
        let pod = PodRef {
            name: "cart".into(),
            namespace: "shop".into(),
            uid: Some("u1".into()),
        };
        let sent = PluginRequest::CniAdd(CniAdd {
            container_id: "c1".into(),
            netns: "/run/netns/p".into(),
            pod: pod.clone(),
            ips: vec!["10.0.0.5".into()],
        });
        let line = serde_json::json!({ "request": sent }).to_string();
        let got = parse_envelope(&line).unwrap();
        assert!(got.bpf_root.is_none());
        assert!(
            matches!(&got.request, Request::CniAdd(a) if a.pod == pod && a.ips == ["10.0.0.5"]),
            "{got:?}"
        );
        let check = serde_json::json!({"request": PluginRequest::CniCheck(CniCheck { pod })});
        assert!(matches!(
            parse_envelope(&check.to_string()).unwrap().request,
            Request::CniCheck(_)
        ));
        // The plugin reads the agent's pod answers as they are: one type.
        let answers: [Answer; 5] = [
            Answer::Enrolled {
                uid: "u1".into(),
                cookie: 7,
                state: Some(PodState::Enabled),
                note: None,
            },
            Answer::Unenrolled { uid: "u1".into() },
            Answer::Skipped {
                reason: "not ambient".into(),
            },
            Answer::Error {
                message: "boom".into(),
            },
            Answer::Refused {
                message: "forged".into(),
            },
        ];
        for plugin in answers {
            let line = serde_json::to_string(&plugin).unwrap();
            let agent: Response = serde_json::from_str(&line).unwrap();
            assert_eq!(serde_json::to_string(&agent).unwrap(), line);
            assert_eq!(serde_json::from_str::<Answer>(&line).unwrap(), plugin);
        }
        // The node's answers keep their own tags beside the pod's.
        let uninstalling =
            serde_json::to_string(&Response::More(NodeAnswer::Uninstalling)).unwrap();
        assert_eq!(uninstalling, r#""uninstalling""#);
        assert_eq!(
            serde_json::from_str::<Response>(&uninstalling).unwrap(),
            Response::More(NodeAnswer::Uninstalling)
        );
        assert!(serde_json::from_str::<Answer>(&uninstalling).is_err());
    }
}

//! Kubernetes Events on pods and on the node: what `kubectl describe pod`,
//! `kubectl describe node` and `kubectl get events` show when the agent could
//! not capture a pod, ztunnel would not take it, the agent changed its
//! capture behind the scenes, or the node's redirection readiness flipped
//! (ztunnel gone, plugin missing…). Failures of
//! CNI ADD itself are not repeated here: kubelet already records the
//! plugin's error on the pod (`FailedCreatePodSandBox`).
//!
//! Published through `recorder`, which folds a repeated event (same pod,
//! reason, action and note) into one Event whose series count grows, from
//! one task fed by a bounded queue: publishing never holds up an
//! enrollment, and a burst beyond the queue is dropped (and logged) rather
//! than queued without bound. Each pod has a share of the queue
//! ([`PER_POD`]): a pod flapping its interfaces cannot push out the events
//! of its neighbours.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use super::recorder::{Recorder, Said};
use k8s_openapi::api::core::v1::ObjectReference;
use tokio::sync::mpsc;
use tracing::debug;

use crate::workload::Workload;

/// The controller name events carry (`reportingController`).
pub const CONTROLLER: &str = "sluice.dev/agent";
/// Events waiting to be published at most.
const QUEUE: usize = 256;
/// Events of one pod waiting to be published at most.
pub const PER_POD: usize = 8;

/// How many events each pod has waiting (by uid; no entry: none).
#[derive(Default)]
struct Shares(Mutex<HashMap<String, usize>>);

impl Shares {
    /// Takes a place for one more event of pod `uid`, if it has one left.
    fn take(&self, uid: &str) -> bool {
        let mut m = self.0.lock().unwrap();
        let n = m.entry(uid.to_owned()).or_default();
        if *n >= PER_POD {
            return false;
        }
        *n += 1;
        true
    }

    /// Gives a place back (its event was taken off the queue).
    fn give_back(&self, uid: &str) {
        let mut m = self.0.lock().unwrap();
        if let Some(n) = m.get_mut(uid) {
            *n -= 1;
            if *n == 0 {
                m.remove(uid);
            }
        }
    }
}

/// Why an event is published: its `reason`, searchable with
/// `kubectl get events --field-selector reason=…`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Captured while no ztunnel is connected: the pod's new connections
    /// fail closed until one connects and acks it.
    ZtunnelNotConnected,
    /// ztunnel refused the pod (its nack text in the note).
    ZtunnelRejected,
    /// ztunnel acked, but its listeners are not in the pod's netns.
    ZtunnelListenersMissing,
    /// Capturing a running ambient pod failed; retried.
    CaptureFailed,
    /// A pod annotation sluice reads is malformed: the pod is not captured.
    InvalidAnnotation,
    /// The agent found the pod's capture incomplete and completed it.
    CaptureRepaired,
    /// The agent found the pod's capture incomplete and could not complete
    /// it (e.g. another tool's qdisc holds a hook): part of its traffic
    /// bypasses ztunnel; its readiness gate is False until a repair
    /// completes it.
    CaptureIncomplete,
    /// Running the pod's capture (its programs on synthetic packets) did
    /// not give the captured verdicts: the note names the failed case; its
    /// readiness gate is False until a verification passes.
    CaptureVerificationFailed,
    /// The pod's capture was removed (no longer ambient, gone).
    CaptureReleased,
    /// The pod carried istio-cni's in-pod rules: sluice captures it now and
    /// removed them.
    TookOverFromIstioCni,
    /// Another tool's qdisc holds the hook of the pod's host-side veth: no
    /// host-side program there, so the node's own connections to the pod
    /// (kubelet's probes) are captured like any other.
    HostProbesCaptured,
    /// The pod has more addresses than `--max-pod-addresses`: those past it
    /// are not the pod's for the programs (a node-wide map, bounded per pod).
    TooManyAddresses,
    /// The runtime gave another pod an address this pod had claimed (on
    /// its interface, or left from before): the claim is gone, the address
    /// captures the other pod's traffic only.
    AddressClaimEvicted,
    /// The pod's exclusion annotations (`traffic.sidecar.istio.io/*`) are
    /// in force as the note lists them: that traffic bypasses ztunnel.
    PodExclusionsApplied,
    /// The pod carries exclusion annotations this node does not honour
    /// (`--pod-exclusions off`, or its namespace not allowed): captured fully.
    PodExclusionsIgnored,
    /// An exclusion annotation is malformed (the note names the entry): the
    /// pod keeps the exclusions it had.
    InvalidPodExclusions,
    /// On the node: its condition turned True (the note has the reason).
    RedirectionReady,
    /// On the node: its condition turned False (ztunnel disconnected, the
    /// plugin missing, pods pending…; the note has the reason and message).
    RedirectionNotReady,
}

impl Reason {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::ZtunnelNotConnected => "ZtunnelNotConnected",
            Self::ZtunnelRejected => "ZtunnelRejected",
            Self::ZtunnelListenersMissing => "ZtunnelListenersMissing",
            Self::CaptureFailed => "CaptureFailed",
            Self::InvalidAnnotation => "InvalidAnnotation",
            Self::CaptureRepaired => "CaptureRepaired",
            Self::CaptureIncomplete => "CaptureIncomplete",
            Self::CaptureVerificationFailed => "CaptureVerificationFailed",
            Self::CaptureReleased => "CaptureReleased",
            Self::TookOverFromIstioCni => "TookOverFromIstioCni",
            Self::HostProbesCaptured => "HostProbesCaptured",
            Self::TooManyAddresses => "TooManyAddresses",
            Self::AddressClaimEvicted => "AddressClaimEvicted",
            Self::PodExclusionsApplied => "PodExclusionsApplied",
            Self::PodExclusionsIgnored => "PodExclusionsIgnored",
            Self::InvalidPodExclusions => "InvalidPodExclusions",
            Self::RedirectionReady => "RedirectionReady",
            Self::RedirectionNotReady => "RedirectionNotReady",
        }
    }

    pub const fn warning(self) -> bool {
        !matches!(
            self,
            Self::CaptureRepaired
                | Self::CaptureReleased
                | Self::TookOverFromIstioCni
                | Self::PodExclusionsApplied
                | Self::RedirectionReady
        )
    }

    /// What the agent was doing (`action`).
    pub const fn action(self) -> &'static str {
        match self {
            Self::ZtunnelNotConnected | Self::ZtunnelRejected | Self::ZtunnelListenersMissing => {
                "HandToZtunnel"
            }
            Self::CaptureFailed
            | Self::InvalidAnnotation
            | Self::TookOverFromIstioCni
            | Self::HostProbesCaptured
            | Self::TooManyAddresses
            | Self::AddressClaimEvicted => "Capture",
            Self::CaptureRepaired | Self::CaptureIncomplete | Self::CaptureVerificationFailed => {
                "Verify"
            }
            Self::CaptureReleased => "Release",
            Self::PodExclusionsApplied
            | Self::PodExclusionsIgnored
            | Self::InvalidPodExclusions => "Exclude",
            Self::RedirectionReady | Self::RedirectionNotReady => "Report",
        }
    }
}

/// The pod an event is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl PodRef {
    pub fn new(w: &Workload, uid: &str) -> Self {
        Self {
            namespace: w.namespace.clone(),
            name: w.name.clone(),
            uid: uid.to_owned(),
        }
    }

    fn object_ref(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: Some(self.namespace.clone()),
            name: Some(self.name.clone()),
            uid: Some(self.uid.clone()),
            ..Default::default()
        }
    }
}

/// What an event is about.
#[derive(Debug, Clone)]
enum Regarding {
    Pod(PodRef),
    /// This node.
    Node,
}

/// A node's events carry its name as uid, as the kubelet's do: `kubectl
/// describe node` looks them up by that (or by the Node's real uid).
fn node_ref(name: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(name.to_owned()),
        uid: Some(name.to_owned()),
        ..Default::default()
    }
}

/// The agent's event publisher.
#[derive(Clone)]
pub struct Events {
    tx: mpsc::Sender<(Regarding, Reason, String)>,
    shares: Arc<Shares>,
}

impl Events {
    /// Starts the publishing task (on the current tokio runtime); events
    /// name this node as the reporting instance.
    pub fn start(client: kube::Client, node: &str) -> Self {
        let (tx, mut rx) = mpsc::channel::<(Regarding, Reason, String)>(QUEUE);
        let node = node.to_owned();
        let shares = Arc::new(Shares::default());
        let taken = shares.clone();
        let mut recorder = Recorder::new(client, CONTROLLER, &format!("sluice-{node}"));
        tokio::spawn(async move {
            while let Some((regarding, reason, note)) = rx.recv().await {
                if let Regarding::Pod(p) = &regarding {
                    taken.give_back(&p.uid);
                }
                let note = truncate(note);
                let said = Said {
                    warning: reason.warning(),
                    reason: reason.as_str(),
                    action: reason.action(),
                    note: &note,
                };
                let (object, what) = match &regarding {
                    Regarding::Pod(p) => {
                        (p.object_ref(), format!("pod {}/{}", p.namespace, p.name))
                    }
                    Regarding::Node => (node_ref(&node), format!("node {node}")),
                };
                if let Err(e) = recorder.publish(said, &object).await {
                    debug!(regarding = %what, reason = reason.as_str(), error = %e, "could not publish an event");
                }
            }
        });
        Self { tx, shares }
    }

    /// Queues an event; drops it when the queue is full (a burst the API
    /// is not keeping up with: the agent's own log has each of them) or the
    /// pod has its share of it waiting already. True: queued.
    pub fn pod(&self, pod: PodRef, reason: Reason, note: impl Into<String>) -> bool {
        if !self.shares.take(&pod.uid) {
            debug!(pod = %pod.uid, reason = reason.as_str(), "the pod's share of the event queue is full: event dropped");
            return false;
        }
        let uid = pod.uid.clone();
        let queued = self.queue(Regarding::Pod(pod), reason, note.into());
        if !queued {
            self.shares.give_back(&uid);
        }
        queued
    }

    /// Queues an event on this node.
    pub fn node(&self, reason: Reason, note: impl Into<String>) -> bool {
        self.queue(Regarding::Node, reason, note.into())
    }

    fn queue(&self, regarding: Regarding, reason: Reason, note: String) -> bool {
        let queued = self.tx.try_send((regarding, reason, note)).is_ok();
        if !queued {
            debug!(reason = reason.as_str(), "event queue full: event dropped");
        }
        queued
    }
}

/// An Event's note is at most 1 KiB.
fn truncate(mut note: String) -> String {
    const MAX: usize = 1024;
    if note.len() > MAX {
        let mut cut = MAX - 3;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
        note.push_str("...");
    }
    note
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warnings_are_the_failures_and_notes_fit() {
        assert!(Reason::ZtunnelRejected.warning() && !Reason::CaptureRepaired.warning());
        let long = "é".repeat(1000);
        let t = truncate(long);
        assert!(t.len() <= 1024 && t.ends_with("..."), "{}", t.len());
        assert_eq!(truncate("short".into()), "short");
    }

    /// A pod flooding events (an API that does not answer keeps them all
    /// waiting) gets its share of the queue; a neighbour's still gets in.
    #[tokio::test]
    async fn one_pod_cannot_push_out_its_neighbours_events() {
        let (client, _api) = crate::kube::mock::client();
        let events = Events::start(client, "node-1");
        let pod = |name: &str| PodRef {
            namespace: "shop".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        };
        let queued = (0..100)
            .filter(|i| events.pod(pod("flapping"), Reason::CaptureIncomplete, format!("{i}")))
            .count();
        // Its share, and perhaps one more taken off the queue meanwhile.
        assert!((PER_POD..=PER_POD + 1).contains(&queued), "{queued}");
        assert!(events.pod(pod("neighbour"), Reason::ZtunnelRejected, "nack"));
    }
}

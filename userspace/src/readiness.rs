//! Whether this node can enroll pods, as a node condition: a pure function of
//! what the pinned maps say about the pods and the agent's own checks. The
//! writer that puts it on the Node object is `kube::condition`.

use std::time::Duration;

use sluice_common::PodState;

/// The condition's default type (positive polarity: True = ready).
pub const DEFAULT_CONDITION_TYPE: &str = "sluice.dev/RedirectionReady";
/// How long a pod may stay Pending, or captured but not served, before the
/// node is reported not ready.
pub const DEFAULT_PENDING_GRACE: Duration = Duration::from_secs(10);
/// How many pending pods the message names.
const NAMED: usize = 5;

/// One enrolled pod, as the condition needs it.
#[derive(Debug, Clone)]
pub struct PodView {
    /// `namespace/name` (or the uid when the identity is unknown).
    pub name: String,
    pub state: Option<PodState>,
    /// CLOCK_BOOTTIME ns of the last state change.
    pub changed_at_ns: u64,
    /// Waiting because ztunnel refused its last add (a nack).
    pub ztunnel_refused: bool,
    /// Its capture lacks links the last repair could not attach.
    pub capture_incomplete: bool,
    /// Its capture failed its last verification (run on synthetic packets).
    pub capture_unverified: bool,
}

/// Everything the condition is computed from.
#[derive(Debug, Clone)]
pub struct Inputs {
    pub programs_loaded: bool,
    /// Why new pods would start without sluice-cni; `None`: they would not.
    pub cni_missing: Option<String>,
    /// ztunnel connected and acked its snapshot.
    pub ztunnel_connected: bool,
    pub pods: Vec<PodView>,
    pub now_ns: u64,
    pub pending_grace: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Ready,
    ProgramsNotLoaded,
    CniPluginMissing,
    ZtunnelDisconnected,
    PodsPendingEnrollment,
    /// Pending because ztunnel refuses them (nacks their add): ztunnel's
    /// verdict on those pods, so the condition stays True with this reason.
    PodsRefusedByZtunnel,
    /// Captured and acked, but ztunnel does not know the pod's workload.
    /// The node itself captures: the condition stays True with this reason.
    PodsNotServed,
    /// Captured in part: a link a pod's capture needs cannot be attached
    /// (another tool holds the hook). That pod's problem, so the condition
    /// stays True with this reason; the pod's gate is False.
    PodsCaptureIncomplete,
    /// A pod's capture, run on synthetic packets, did not give the captured
    /// verdicts (a program swapped or shadowed at a hook, a link detached,
    /// a listener gone from the socket map). That pod's problem: the
    /// condition stays True with this reason; the pod's gate is False.
    PodsCaptureUnverified,
    /// Written by the agent itself as it stops (SIGTERM).
    AgentStopped,
    /// Written by the watchdog when the agent stops answering.
    AgentNotRunning,
    /// The agent cannot take over the pinned dataplane (another build's
    /// maps it cannot open or migrate): capture stays as that build left it.
    DataplaneIncompatible,
    /// Another node agent (istio-cni's, a second sluice) serves ztunnel on
    /// this node: sluice does not start beside it.
    AnotherNodeAgent,
}

impl Reason {
    /// The `reason` field, as written on the Node.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Ready => "RedirectionReady",
            Reason::ProgramsNotLoaded => "ProgramsNotLoaded",
            Reason::CniPluginMissing => "CNIPluginMissing",
            Reason::ZtunnelDisconnected => "ZtunnelDisconnected",
            Reason::PodsPendingEnrollment => "PodsPendingEnrollment",
            Reason::PodsRefusedByZtunnel => "PodsRefusedByZtunnel",
            Reason::PodsNotServed => "PodsNotServed",
            Reason::PodsCaptureIncomplete => "PodsCaptureIncomplete",
            Reason::PodsCaptureUnverified => "PodsCaptureUnverified",
            Reason::AgentStopped => "AgentStopped",
            Reason::AgentNotRunning => "AgentNotRunning",
            Reason::DataplaneIncompatible => "DataplaneIncompatible",
            Reason::AnotherNodeAgent => "AnotherNodeAgent",
        }
    }
}

impl Reason {
    /// Every reason, for metrics that show each.
    pub const ALL: [Reason; 13] = [
        Reason::Ready,
        Reason::ProgramsNotLoaded,
        Reason::CniPluginMissing,
        Reason::ZtunnelDisconnected,
        Reason::PodsPendingEnrollment,
        Reason::PodsRefusedByZtunnel,
        Reason::PodsNotServed,
        Reason::PodsCaptureIncomplete,
        Reason::PodsCaptureUnverified,
        Reason::AgentStopped,
        Reason::AgentNotRunning,
        Reason::DataplaneIncompatible,
        Reason::AnotherNodeAgent,
    ];
}

impl serde::Serialize for Reason {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for Reason {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Reason::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown reason {s:?}")))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Condition {
    pub ready: bool,
    pub reason: Reason,
    pub message: String,
}

impl Condition {
    /// What the agent writes as it exits: capture stays, but nobody enrolls
    /// new pods or re-registers listeners until it is back.
    pub fn agent_stopped() -> Self {
        Self {
            ready: false,
            reason: Reason::AgentStopped,
            message: "the sluice agent stopped; capture stays in place, new pods wait for it"
                .into(),
        }
    }

    /// What the watchdog writes when the agent has not answered for `silent`.
    pub fn agent_not_running(silent: std::time::Duration) -> Self {
        Self {
            ready: false,
            reason: Reason::AgentNotRunning,
            message: format!(
                "the sluice agent has not answered its readiness check for {}",
                human(silent)
            ),
        }
    }

    /// The condition's `status` field.
    pub fn status(&self) -> &'static str {
        if self.ready {
            "True"
        } else {
            "False"
        }
    }
}

/// A duration as "150ms" or "6s".
fn human(d: std::time::Duration) -> String {
    if d < std::time::Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}s", d.as_secs())
    }
}

/// The first failing check decides the reason, in this order: programs, CNI
/// plugin, ztunnel, pods pending longer than the grace period.
pub fn compute(i: &Inputs) -> Condition {
    node_not_ready(i).unwrap_or_else(|| pods_condition(i))
}

/// What the node itself lacks to capture pods, if anything.
fn node_not_ready(i: &Inputs) -> Option<Condition> {
    let (reason, message) = if !i.programs_loaded {
        (
            Reason::ProgramsNotLoaded,
            "sluice's eBPF programs are not loaded and pinned on this node".into(),
        )
    } else if let Some(why) = &i.cni_missing {
        (Reason::CniPluginMissing, why.clone())
    } else if !i.ztunnel_connected {
        (
            Reason::ZtunnelDisconnected,
            format!(
                "ztunnel is not connected; {} ambient pods enrolled",
                i.pods.len()
            ),
        )
    } else {
        return None;
    };
    Some(Condition {
        ready: false,
        reason,
        message,
    })
}

/// How many pods `pick` finds (none: `None`), and up to [`NAMED`] of
/// their names, sorted.
fn found(i: &Inputs, pick: fn(&PodView) -> bool) -> Option<(usize, String)> {
    let mut hit: Vec<&str> = i
        .pods
        .iter()
        .filter(|p| pick(p))
        .map(|p| p.name.as_str())
        .collect();
    if hit.is_empty() {
        return None;
    }
    hit.sort_unstable();
    let n = hit.len();
    hit.truncate(NAMED);
    if n > NAMED {
        hit.push("…");
    }
    Some((n, hit.join(", ")))
}

/// The node captures: the condition says which pods wait, and for what.
fn pods_condition(i: &Inputs) -> Condition {
    let not_ready = |reason, message: String| Condition {
        ready: false,
        reason,
        message,
    };
    let total = i.pods.len();
    let grace = i.pending_grace.as_nanos() as u64;
    let waited = |p: &&PodView| i.now_ns.saturating_sub(p.changed_at_ns);
    let late = |pick: fn(&PodView) -> bool| {
        let mut late: Vec<&PodView> = i
            .pods
            .iter()
            .filter(|p| pick(p))
            .filter(|p| waited(p) > grace)
            .collect();
        late.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        late
    };
    let named = |late: &[&PodView]| {
        let mut names = late[..late.len().min(NAMED)]
            .iter()
            .map(|p| format!("{} ({})", p.name, human(Duration::from_nanos(waited(p)))))
            .collect::<Vec<_>>()
            .join(", ");
        if late.len() > NAMED {
            names.push_str(", …");
        }
        names
    };
    fn waits(p: &PodView) -> bool {
        !p.state.is_some_and(PodState::steers)
    }
    let pending = late(|p| waits(p) && !p.ztunnel_refused);
    if !pending.is_empty() {
        return not_ready(
            Reason::PodsPendingEnrollment,
            format!(
                "{} of {total} ambient pods pending for >{}s: {}",
                pending.len(),
                i.pending_grace.as_secs(),
                named(&pending)
            ),
        );
    }
    // Below, the node captures and enrolls: what the pods lack is on
    // ztunnel's or istiod's side, so the node stays True (no taint under a
    // continuous NodeReadinessRule, the agent stays Ready: one pod ztunnel
    // refuses, or an istiod outage, must not take nodes out), and the
    // message says which pods wait.
    // No grace: a repair found it, and it is a leak, not a wait.
    if let Some((n, names)) = found(i, |p| p.capture_incomplete) {
        return Condition {
            ready: true,
            reason: Reason::PodsCaptureIncomplete,
            message: format!(
                "{n} of {total} ambient pods captured in part (a link their capture needs cannot be attached; part of their traffic bypasses ztunnel): {names}"
            ),
        };
    }
    if let Some((n, names)) = found(i, |p| p.capture_unverified) {
        return Condition {
            ready: true,
            reason: Reason::PodsCaptureUnverified,
            message: format!(
                "{n} of {total} ambient pods failed the verification of their capture (run on synthetic packets, it did not give the captured verdicts; `sluice status --pod` names the case): {names}"
            ),
        };
    }
    let refused = late(|p| waits(p) && p.ztunnel_refused);
    if !refused.is_empty() {
        return Condition {
            ready: true,
            reason: Reason::PodsRefusedByZtunnel,
            message: format!(
                "{} of {total} ambient pods refused by ztunnel (it nacks their add; the pods wait, the node captures) for >{}s: {}",
                refused.len(),
                i.pending_grace.as_secs(),
                named(&refused)
            ),
        };
    }
    let unserved = late(|p| p.state == Some(PodState::Enabled));
    if !unserved.is_empty() {
        return Condition {
            ready: true,
            reason: Reason::PodsNotServed,
            message: format!(
                "{} of {total} ambient pods captured but not known to ztunnel (no workload from istiod) for >{}s: {}",
                unserved.len(),
                i.pending_grace.as_secs(),
                named(&unserved)
            ),
        };
    }
    Condition {
        ready: true,
        reason: Reason::Ready,
        message: format!("{total} ambient pods enrolled"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn pod(name: &str, state: PodState, changed_s: u64) -> PodView {
        PodView {
            name: name.into(),
            state: Some(state),
            changed_at_ns: changed_s * S,
            ztunnel_refused: false,
            capture_incomplete: false,
            capture_unverified: false,
        }
    }

    fn refused(name: &str, changed_s: u64) -> PodView {
        PodView {
            ztunnel_refused: true,
            ..pod(name, PodState::Pending, changed_s)
        }
    }

    fn inputs(pods: Vec<PodView>) -> Inputs {
        Inputs {
            programs_loaded: true,
            cni_missing: None,
            ztunnel_connected: true,
            pods,
            now_ns: 100 * S,
            pending_grace: DEFAULT_PENDING_GRACE,
        }
    }

    #[test]
    fn every_reason_is_reachable_in_priority_order() {
        let ok = inputs(vec![pod("ns/a", PodState::Served, 1)]);
        assert_eq!(compute(&ok).reason, Reason::Ready);
        assert!(compute(&ok).ready);
        let mut i = ok.clone();
        i.pods.push(pod("ns/c", PodState::Enabled, 50));
        assert_eq!(compute(&i).reason, Reason::PodsNotServed);
        i.pods.push(refused("ns/r", 50));
        assert_eq!(compute(&i).reason, Reason::PodsRefusedByZtunnel);
        assert!(compute(&i).ready);
        i.pods.push(PodView {
            capture_unverified: true,
            ..pod("ns/swapped", PodState::Served, 99)
        });
        let c = compute(&i);
        assert_eq!((c.ready, c.reason), (true, Reason::PodsCaptureUnverified));
        assert!(c.message.ends_with(": ns/swapped"), "{}", c.message);
        i.pods.push(PodView {
            capture_incomplete: true,
            ..pod("ns/half", PodState::Served, 99)
        });
        let c = compute(&i);
        assert_eq!((c.ready, c.reason), (true, Reason::PodsCaptureIncomplete));
        assert!(
            c.message.ends_with("bypasses ztunnel): ns/half"),
            "{}",
            c.message
        );
        i.pods.push(pod("ns/b", PodState::Pending, 50));
        assert_eq!(compute(&i).reason, Reason::PodsPendingEnrollment);
        i.ztunnel_connected = false;
        assert_eq!(compute(&i).reason, Reason::ZtunnelDisconnected);
        i.cni_missing = Some("02-x.conflist does not chain sluice-cni".into());
        assert_eq!(compute(&i).reason, Reason::CniPluginMissing);
        i.programs_loaded = false;
        let c = compute(&i);
        assert_eq!((c.ready, c.reason.as_str()), (false, "ProgramsNotLoaded"));
    }

    #[test]
    fn pending_pods_count_only_after_the_grace_period() {
        // Pending for 5 s of a 10 s grace: still ready.
        let fresh = inputs(vec![pod("ns/a", PodState::Pending, 95)]);
        assert!(compute(&fresh).ready);
        // Exactly at the grace: still ready; past it: not.
        let edge = inputs(vec![pod("ns/a", PodState::Pending, 90)]);
        assert!(compute(&edge).ready);
        let late = inputs(vec![pod("ns/a", PodState::Pending, 89)]);
        assert!(!compute(&late).ready);
        // Draining counts as not enrolled too.
        let draining = inputs(vec![pod("ns/a", PodState::Draining, 10)]);
        assert_eq!(compute(&draining).reason, Reason::PodsPendingEnrollment);
    }

    #[test]
    fn the_message_counts_and_names_the_late_pods() {
        let mut pods: Vec<PodView> = (0..7)
            .map(|n| pod(&format!("ns/p{n}"), PodState::Pending, 1))
            .collect();
        pods.extend((0..34).map(|n| pod(&format!("ns/ok{n}"), PodState::Served, 1)));
        let c = compute(&inputs(pods));
        assert_eq!(
            c.message,
            "7 of 41 ambient pods pending for >10s: ns/p0 (99s), ns/p1 (99s), ns/p2 (99s), ns/p3 (99s), ns/p4 (99s), …"
        );
    }

    #[test]
    fn captured_but_unserved_pods_are_named_with_how_long_they_waited() {
        let pods = vec![
            pod("ns/fresh", PodState::Enabled, 95),
            pod("ns/late", PodState::Enabled, 58),
            pod("ns/ok", PodState::Served, 1),
        ];
        let c = compute(&inputs(pods));
        // The node captures: True, with the reason naming what waits.
        assert_eq!((c.ready, c.reason), (true, Reason::PodsNotServed));
        assert_eq!(
            c.message,
            "1 of 3 ambient pods captured but not known to ztunnel (no workload from istiod) for >10s: ns/late (42s)"
        );
        // Within the grace: plain ready.
        let c = compute(&inputs(vec![pod("ns/fresh", PodState::Enabled, 95)]));
        assert_eq!((c.ready, c.reason), (true, Reason::Ready));
    }

    #[test]
    fn one_pod_ztunnel_refuses_does_not_take_the_node_out() {
        let pods = vec![
            refused("shop/cart", 58),
            refused("shop/fresh", 95),
            pod("ns/ok", PodState::Served, 1),
        ];
        let c = compute(&inputs(pods));
        assert_eq!((c.ready, c.reason), (true, Reason::PodsRefusedByZtunnel));
        assert_eq!(
            c.message,
            "1 of 3 ambient pods refused by ztunnel (it nacks their add; the pods wait, the node captures) for >10s: shop/cart (42s)"
        );
        // A pod waiting for the node's own reasons still makes it False.
        let c = compute(&inputs(vec![
            refused("shop/cart", 58),
            pod("shop/web", PodState::Pending, 58),
        ]));
        assert_eq!((c.ready, c.reason), (false, Reason::PodsPendingEnrollment));
        assert!(
            c.message.starts_with("1 of 2 ambient pods pending"),
            "{}",
            c.message
        );
    }
}

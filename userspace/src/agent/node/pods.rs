//! The pod table: one record per pod the agent holds, by uid. A record
//! carries what the agent needs to act on the pod without asking the kernel
//! again: who it is, its netns cookie, its netns (opened once, at enrollment
//! or when a starting agent adopts the pod) and the in-memory half of its
//! row (`lifecycle::Track`: retry plan, ztunnel, sandbox, completeness).
//!
//! The pod's state is not copied here: it lives in the pinned pod-state map,
//! shared with the programs, and changes only through `state::Maps::apply`.
//! The track changes only to what `lifecycle::step` returns: for the events
//! the map took ([`PodTable::follow`], its observer) and for the events that
//! concern the track alone ([`PodTable::apply`]).
//! Lock order: the dataplane before the table; nothing here takes the
//! dataplane.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Instant,
};

use tracing::warn;

use crate::{
    control::{IncompletePod, PodVerification, VerifyOutcome, WaitingPod},
    lifecycle::{self, Applied, Cause, Effect, Event, Plan, Track, Verification, Ztunnel},
    podnet::netns::Netns,
    workload::PodIdentity,
};

#[derive(Clone)]
pub(super) struct Pod {
    pub cookie: u64,
    pub identity: PodIdentity,
    /// `None` only for a pod whose netns could not be opened when a starting
    /// agent adopted it (it is then opened by path when needed).
    pub netns: Option<Arc<Netns>>,
    /// The in-memory half of the pod's row; changed only to what
    /// `lifecycle::step` returns.
    pub track: Track,
}

#[derive(Default)]
pub(super) struct PodTable {
    by_uid: Mutex<HashMap<String, Pod>>,
}

impl PodTable {
    /// Holds a pod from now on (replacing any record of the same uid), with
    /// nothing planned yet. `acked`: ztunnel has taken its capture already
    /// (a pod an earlier agent left steering).
    pub(super) fn insert(
        &self,
        cookie: u64,
        identity: PodIdentity,
        netns: Option<Netns>,
        acked: bool,
    ) {
        self.by_uid.lock().unwrap().insert(
            identity.uid.clone(),
            Pod {
                cookie,
                identity,
                netns: netns.map(Arc::new),
                track: Track {
                    acked,
                    ..Track::default()
                },
            },
        );
    }

    /// Whether ztunnel has taken the pod's capture since it was attached.
    pub(super) fn acked(&self, uid: &str) -> bool {
        self.track(uid, |t| t.acked).unwrap_or(false)
    }

    /// Drops a pod's row (the pod is gone, or its enrollment backed out).
    pub(super) fn remove(&self, uid: &str) {
        self.by_uid.lock().unwrap().remove(uid);
    }

    /// An event that only changes the pod's track (see
    /// `lifecycle::step_track`): what the agent must do about it. Nothing
    /// for a pod the table does not hold.
    pub(super) fn apply(&self, uid: &str, event: Event) -> Vec<Effect> {
        let mut t = self.by_uid.lock().unwrap();
        let Some(p) = t.get_mut(uid) else {
            return Vec::new();
        };
        match lifecycle::step_track(&p.track, &event, Instant::now()) {
            Ok(step) => {
                p.track = step.track;
                step.effects
            }
            Err(e) => {
                warn!(%uid, error = %e, "event refused");
                Vec::new()
            }
        }
    }

    /// An event the pinned map took (its observer): the pod's track follows
    /// the same step. Returns the effects to run. Runs under the dataplane
    /// lock (the lock order: the dataplane before the table).
    pub(super) fn follow(&self, a: &Applied) -> Vec<Effect> {
        let mut t = self.by_uid.lock().unwrap();
        let held = a.pod.as_ref().and_then(|p| t.get_mut(&p.uid));
        let track = held.as_ref().map(|p| p.track.clone()).unwrap_or_default();
        let step = match lifecycle::step(a.from, &track, &a.event, Instant::now()) {
            Ok(s) => s,
            Err(e) => {
                // The map decided with the same function: never here.
                warn!(cookie = a.cookie, error = %e, "the pod's track cannot follow its state");
                return Vec::new();
            }
        };
        debug_assert_eq!(step.state, a.to);
        if let Some(p) = held {
            p.track = step.track;
        }
        step.effects
    }

    pub(super) fn contains(&self, uid: &str) -> bool {
        self.by_uid.lock().unwrap().contains_key(uid)
    }

    /// Who the pod is (namespace, name, service account).
    pub(super) fn workload(&self, uid: &str) -> Option<crate::workload::Workload> {
        let pods = self.by_uid.lock().unwrap();
        pods.get(uid).map(|p| p.identity.workload.clone())
    }

    pub(super) fn cookie(&self, uid: &str) -> Option<u64> {
        self.by_uid.lock().unwrap().get(uid).map(|p| p.cookie)
    }

    /// The open netns of the pod with this cookie.
    pub(super) fn netns(&self, cookie: u64) -> Option<Arc<Netns>> {
        self.by_uid
            .lock()
            .unwrap()
            .values()
            .find(|p| p.cookie == cookie)
            .and_then(|p| p.netns.clone())
    }

    /// Every pod held whose netns is open, by cookie.
    pub(super) fn open_netns(&self) -> HashMap<u64, Arc<Netns>> {
        self.by_uid
            .lock()
            .unwrap()
            .values()
            .filter_map(|p| Some((p.cookie, p.netns.clone()?)))
            .collect()
    }

    /// Whether pod `uid` is held and not leaving.
    pub(super) fn is_staying(&self, uid: &str) -> bool {
        self.track(uid, |t| t.plan != Plan::Leaving)
            .unwrap_or(false)
    }

    /// Every pod held and not leaving, as of now.
    pub(super) fn staying(&self) -> Vec<Pod> {
        let mut out: Vec<Pod> = self
            .by_uid
            .lock()
            .unwrap()
            .values()
            .filter(|p| p.track.plan != Plan::Leaving)
            .cloned()
            .collect();
        out.sort_by_key(|p| p.cookie);
        out
    }

    fn track<R>(&self, uid: &str, f: impl FnOnce(&Track) -> R) -> Option<R> {
        self.by_uid.lock().unwrap().get(uid).map(|p| f(&p.track))
    }

    pub(super) fn sandbox_of(&self, uid: &str) -> Option<String> {
        self.track(uid, |t| t.sandbox.clone()).flatten()
    }

    /// The ztunnel whose listeners the pod was last registered with: the
    /// last to ack it, or a newer one that kept it (see `ztunnels::serving`).
    pub(super) fn ztunnel_of(&self, uid: &str) -> Option<Ztunnel> {
        self.track(uid, |t| t.ztunnel).flatten()
    }

    pub(super) fn in_flight(&self, uid: &str) -> bool {
        self.track(uid, |t| matches!(&t.plan, Plan::Retry(r) if r.in_flight))
            .unwrap_or(false)
    }

    /// The uids of waiting pods whose last attempt ztunnel refused.
    pub(super) fn refused_by_ztunnel(&self) -> std::collections::HashSet<String> {
        self.by_uid
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, p)| {
                matches!(&p.track.plan, Plan::Retry(r) if r.cause == Cause::ZtunnelRefused)
            })
            .map(|(uid, _)| uid.clone())
            .collect()
    }

    /// Whether the last repair left the pod's capture incomplete.
    pub(super) fn is_incomplete(&self, uid: &str) -> bool {
        self.track(uid, |t| t.incomplete.is_some()).unwrap_or(false)
    }

    /// What the pod's last verification found (not yet, for a pod the
    /// agent does not hold).
    pub(super) fn verification(&self, uid: &str) -> Verification {
        self.track(uid, |t| t.verification.clone())
            .unwrap_or_default()
    }

    /// What the last verification of each held pod found.
    pub(super) fn verifications(&self) -> Vec<PodVerification> {
        let mut out: Vec<PodVerification> = self
            .by_uid
            .lock()
            .unwrap()
            .iter()
            .map(|(uid, p)| {
                let (outcome, case, detail) = match &p.track.verification {
                    Verification::NotYet => (VerifyOutcome::NotYet, String::new(), String::new()),
                    Verification::Verified { unrun } if unrun.is_empty() => {
                        (VerifyOutcome::Verified, String::new(), String::new())
                    }
                    Verification::Verified { unrun } => {
                        (VerifyOutcome::Partial, unrun.join("; "), String::new())
                    }
                    Verification::Failed { case, detail } => {
                        (VerifyOutcome::Failed, case.clone(), detail.clone())
                    }
                };
                PodVerification {
                    uid: uid.clone(),
                    outcome,
                    case,
                    detail,
                    age_s: p.track.verified_at.map(|t| t.elapsed().as_secs()),
                }
            })
            .collect();
        out.sort_by(|a, b| a.uid.cmp(&b.uid));
        out
    }

    /// How many held pods failed their last verification.
    pub(super) fn unverified(&self) -> usize {
        self.by_uid
            .lock()
            .unwrap()
            .values()
            .filter(|p| matches!(p.track.verification, Verification::Failed { .. }))
            .count()
    }

    /// Pods whose capture the last repair could not complete.
    pub(super) fn incomplete(&self) -> Vec<IncompletePod> {
        let mut out: Vec<IncompletePod> = self
            .by_uid
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(uid, p)| {
                let i = p.track.incomplete.clone()?;
                Some(IncompletePod {
                    uid: uid.clone(),
                    missing: i.missing,
                    reason: i.reason,
                })
            })
            .collect();
        out.sort_by(|a, b| a.uid.cmp(&b.uid));
        out
    }

    /// Pods that wait, with why their last attempt failed.
    pub(super) fn waiting(&self) -> Vec<WaitingPod> {
        let mut out: Vec<WaitingPod> = self
            .by_uid
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(uid, p)| {
                let Plan::Retry(r) = &p.track.plan else {
                    return None;
                };
                let e = r.last_error.as_ref()?;
                Some(WaitingPod {
                    uid: uid.clone(),
                    last_error: e.clone(),
                    ztunnel_refused: r.cause == Cause::ZtunnelRefused,
                })
            })
            .collect();
        out.sort_by(|a, b| a.uid.cmp(&b.uid));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Workload;

    fn pod(uid: &str) -> PodIdentity {
        PodIdentity {
            uid: uid.into(),
            netns: "/proc/1/ns/net".into(),
            workload: Workload::new("a", "ns", "sa").unwrap(),
        }
    }

    #[test]
    fn the_table_keeps_what_the_machine_decides() {
        let t = PodTable::default();
        t.insert(7, pod("u1"), None, false);
        let due = |t: &PodTable| t.apply("u1", Event::RetryDue(Instant::now()));
        assert_eq!(due(&t), [Effect::SendAdd], "a new pod is due at once");
        assert!(t.in_flight("u1"));
        let nack = Event::AddFailed {
            cause: Cause::ZtunnelRefused,
            why: "nack".into(),
        };
        assert!(t.apply("u1", nack).is_empty());
        assert!(t.waiting()[0].ztunnel_refused);
        assert_eq!(t.refused_by_ztunnel(), ["u1".to_string()].into());
        // A new ztunnel's snapshot offers it again: until that add is
        // answered, the pod is still one ztunnel refused, not one pending
        // (which would take the node condition False in an upgrade).
        t.apply("u1", Event::AddSent);
        assert!(t.in_flight("u1") && t.waiting()[0].ztunnel_refused);
        assert_eq!(t.refused_by_ztunnel(), ["u1".to_string()].into());
        assert!(!t.acked("u1"));
        t.apply("u1", Event::Acked(Ztunnel::new(Some(42))));
        assert_eq!(t.ztunnel_of("u1"), Some(Ztunnel::Pid(42)));
        t.apply("u1", Event::SandboxOwned("c1".into()));
        assert_eq!(t.sandbox_of("u1").as_deref(), Some("c1"));
        // What the map took, the track follows.
        let effects = t.follow(&Applied {
            cookie: 7,
            pod: Some(pod("u1")),
            event: Event::Registered { complete: true },
            from: Some(sluice_common::PodState::Pending),
            to: Some(sluice_common::PodState::Enabled),
        });
        assert!(effects.contains(&Effect::CheckServed));
        assert!(t.waiting().is_empty() && !t.in_flight("u1"));
        assert!(
            t.acked("u1"),
            "ztunnel took it: its annotation stays enabled"
        );
        // A state-changing event never bypasses the map.
        assert!(t.apply("u1", Event::Drain).is_empty());
        assert_eq!(t.staying().len(), 1, "still planned, not leaving");
    }

    #[test]
    fn unknown_pods_take_no_events() {
        let t = PodTable::default();
        assert!(t.apply("nope", Event::RetryDue(Instant::now())).is_empty());
        assert!(t.waiting().is_empty());
        assert_eq!(t.cookie("nope"), None);
    }
}

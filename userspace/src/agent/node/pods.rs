//! The pod table: one record per pod the agent holds, by uid. A record
//! carries what the agent needs to act on the pod without asking the kernel
//! again: who it is, its netns cookie, its netns (opened once, at enrollment
//! or when a starting agent adopts the pod) and, while it waits for ztunnel,
//! its retry schedule.
//!
//! The pod's state is not copied here: it lives in the pinned pod-state map,
//! shared with the programs, and changes only through `state::Maps::change`.
//! Lock order: the dataplane before the table; nothing here takes the
//! dataplane.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use crate::{
    control::{IncompletePod, WaitingPod},
    netns::Netns,
    workload::PodIdentity,
};

pub(super) const RETRY_MIN: Duration = Duration::from_millis(500);
pub(super) const RETRY_MAX: Duration = Duration::from_secs(30);

/// When a waiting pod is offered to ztunnel next, and why it still waits.
#[derive(Debug, Clone)]
pub(super) struct Retry {
    /// `None`: due at once.
    due: Option<Instant>,
    backoff: Duration,
    /// An add for the pod is out (its answer decides what comes next).
    in_flight: bool,
    /// Why the last attempt left the pod Pending.
    last_error: Option<String>,
    /// Whose the last failure was.
    cause: Cause,
}

/// Whose fault a failed attempt is, for the node condition: a pod ztunnel
/// refuses is that pod's problem (the node captures, others enroll), so it
/// must not take the whole node out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum Cause {
    /// ztunnel answered the add with an error (a nack): its verdict on this
    /// pod.
    ZtunnelRefused,
    /// Anything else: no ztunnel, ZDS broke, listeners never appeared, the
    /// node's own capture failed.
    #[default]
    Other,
}

impl Retry {
    /// A first attempt, due now, with the backoff at its start.
    fn fresh(in_flight: bool, last_error: Option<String>) -> Self {
        Self {
            due: None,
            backoff: RETRY_MIN,
            in_flight,
            last_error,
            cause: Cause::Other,
        }
    }
}

#[derive(Clone)]
pub(super) struct Pod {
    pub cookie: u64,
    pub identity: PodIdentity,
    /// `None` only for a pod whose netns could not be opened when a starting
    /// agent adopted it (it is then opened by path when needed).
    pub netns: Option<Arc<Netns>>,
    /// The CNI container id (sandbox) whose ADD enrolled the pod, when a CNI
    /// ADD did (not a control-socket enroll, not a pod adopted at start).
    pub sandbox: Option<String>,
    /// The ztunnel whose add registers the pod's listeners (the one asked
    /// whether it serves the pod); `None` until this agent sends an add.
    pub ztunnel: Option<Ztunnel>,
    plan: Plan,
    /// Links its capture lacks that the last repair could not attach, and
    /// why (`None`: complete, as far as the last repair saw).
    incomplete: Option<(Vec<String>, String)>,
}

/// What the agent means to do with a pod next.
#[derive(Debug, Clone)]
enum Plan {
    /// Nothing: ztunnel has it (or nothing has been tried yet).
    Idle,
    /// Offer it to ztunnel (again) on this schedule.
    Retry(Retry),
    /// Being unenrolled: never offered to ztunnel again.
    Leaving,
}

/// A ztunnel process, as its ZDS connection identifies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Ztunnel {
    Pid(i32),
    /// The connection carried no usable peer credentials.
    UnknownPid,
}

impl Ztunnel {
    pub(super) fn new(pid: Option<i32>) -> Self {
        match pid {
            Some(p) if p > 0 => Self::Pid(p),
            _ => Self::UnknownPid,
        }
    }

    pub(super) fn pid(self) -> Option<i32> {
        match self {
            Self::Pid(p) => Some(p),
            Self::UnknownPid => None,
        }
    }
}

#[derive(Default)]
pub(super) struct PodTable {
    by_uid: Mutex<HashMap<String, Pod>>,
}

impl PodTable {
    /// Holds a pod from now on (replacing any record of the same uid).
    pub(super) fn insert(&self, cookie: u64, identity: PodIdentity, netns: Option<Netns>) {
        self.by_uid.lock().unwrap().insert(
            identity.uid.clone(),
            Pod {
                cookie,
                identity,
                netns: netns.map(Arc::new),
                sandbox: None,
                ztunnel: None,
                plan: Plan::Idle,
                incomplete: None,
            },
        );
    }

    pub(super) fn remove(&self, uid: &str) {
        self.by_uid.lock().unwrap().remove(uid);
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

    /// Every pod held and not leaving, as of now.
    pub(super) fn staying(&self) -> Vec<Pod> {
        let mut out: Vec<Pod> = self
            .by_uid
            .lock()
            .unwrap()
            .values()
            .filter(|p| !matches!(p.plan, Plan::Leaving))
            .cloned()
            .collect();
        out.sort_by_key(|p| p.cookie);
        out
    }

    /// Runs `f` on the pod's retry schedule, starting one (due now) if the
    /// pod has none. `None` when the table does not hold the pod or it is
    /// leaving.
    fn retry<R>(&self, uid: &str, f: impl FnOnce(&mut Retry) -> R) -> Option<R> {
        let mut t = self.by_uid.lock().unwrap();
        let p = t.get_mut(uid)?;
        match &mut p.plan {
            Plan::Leaving => None,
            Plan::Retry(r) => Some(f(r)),
            Plan::Idle => {
                let mut r = Retry::fresh(false, None);
                let out = f(&mut r);
                p.plan = Plan::Retry(r);
                Some(out)
            }
        }
    }

    /// Sets the plan unless the pod is leaving.
    fn plan(&self, uid: &str, plan: Plan) {
        if let Some(p) = self.by_uid.lock().unwrap().get_mut(uid) {
            if !matches!(p.plan, Plan::Leaving) {
                p.plan = plan;
            }
        }
    }

    /// The pod's attempt failed: the next one is due after the backoff,
    /// which doubles (up to `RETRY_MAX`).
    pub(super) fn failed(&self, uid: &str, cause: Cause, why: &str) {
        self.retry(uid, |r| {
            r.in_flight = false;
            r.last_error = Some(why.to_owned());
            r.cause = cause;
            r.due = Some(Instant::now() + r.backoff);
            r.backoff = (r.backoff * 2).min(RETRY_MAX);
        });
    }

    /// An add for the pod went out now, as a first attempt (a new ztunnel
    /// starts the backoff afresh).
    pub(super) fn attempting(&self, uid: &str) {
        self.plan(uid, Plan::Retry(Retry::fresh(true, None)));
    }

    /// The pod lost what made it Enabled: it waits again, from the start.
    pub(super) fn waits_again(&self, uid: &str, why: &str) {
        self.plan(uid, Plan::Retry(Retry::fresh(false, Some(why.to_owned()))));
    }

    /// ztunnel `pid` acked the pod: its listeners are the ones registered
    /// next, and it is the one asked whether it serves the pod.
    pub(super) fn acked_by(&self, uid: &str, pid: Option<i32>) {
        if let Some(p) = self.by_uid.lock().unwrap().get_mut(uid) {
            p.ztunnel = Some(Ztunnel::new(pid));
        }
    }

    /// Remembers the CNI container id whose ADD enrolled the pod.
    pub(super) fn set_sandbox(&self, uid: &str, container_id: &str) {
        if let Some(p) = self.by_uid.lock().unwrap().get_mut(uid) {
            p.sandbox = Some(container_id.to_owned());
        }
    }

    pub(super) fn sandbox_of(&self, uid: &str) -> Option<String> {
        self.by_uid
            .lock()
            .unwrap()
            .get(uid)
            .and_then(|p| p.sandbox.clone())
    }

    /// The ztunnel that acked the pod last.
    pub(super) fn ztunnel_of(&self, uid: &str) -> Option<Ztunnel> {
        self.by_uid.lock().unwrap().get(uid).and_then(|p| p.ztunnel)
    }

    /// ztunnel took the pod: it no longer waits.
    pub(super) fn taken(&self, uid: &str) {
        self.plan(uid, Plan::Idle);
    }

    /// The pod is being unenrolled: no add goes out for it any more. Its
    /// record stays (the pod is still in the maps) until `remove`.
    pub(super) fn leaving(&self, uid: &str) {
        if let Some(p) = self.by_uid.lock().unwrap().get_mut(uid) {
            p.plan = Plan::Leaving;
        }
    }

    pub(super) fn in_flight(&self, uid: &str) -> bool {
        self.by_uid
            .lock()
            .unwrap()
            .get(uid)
            .is_some_and(|p| matches!(&p.plan, Plan::Retry(r) if r.in_flight))
    }

    /// Whether the waiting pod is due for another add at `now`; if so its
    /// attempt is marked in flight.
    pub(super) fn take_due(&self, uid: &str, now: Instant) -> bool {
        self.retry(uid, |r| {
            let due = !r.in_flight && r.due.is_none_or(|d| d <= now);
            if due {
                r.in_flight = true;
            }
            due
        })
        .unwrap_or(false)
    }

    /// The uids of waiting pods whose last attempt ztunnel refused.
    pub(super) fn refused_by_ztunnel(&self) -> std::collections::HashSet<String> {
        self.by_uid
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, p)| matches!(&p.plan, Plan::Retry(r) if r.cause == Cause::ZtunnelRefused))
            .map(|(uid, _)| uid.clone())
            .collect()
    }

    /// Records the links the pod's capture lacks after a repair (`None`:
    /// none) and why; whether that changed what the pod lacks (a new
    /// reason for the same links is no change: nothing to announce).
    pub(super) fn set_incomplete(&self, uid: &str, now: Option<(Vec<String>, String)>) -> bool {
        let mut t = self.by_uid.lock().unwrap();
        let Some(p) = t.get_mut(uid) else {
            return false;
        };
        let changed = p.incomplete.as_ref().map(|(m, _)| m) != now.as_ref().map(|(m, _)| m);
        p.incomplete = now;
        changed
    }

    /// Whether the last repair left the pod's capture incomplete.
    pub(super) fn is_incomplete(&self, uid: &str) -> bool {
        self.by_uid
            .lock()
            .unwrap()
            .get(uid)
            .is_some_and(|p| p.incomplete.is_some())
    }

    /// Pods whose capture the last repair could not complete.
    pub(super) fn incomplete(&self) -> Vec<IncompletePod> {
        let mut out: Vec<IncompletePod> = self
            .by_uid
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(uid, p)| {
                let (missing, reason) = p.incomplete.clone()?;
                Some(IncompletePod {
                    uid: uid.clone(),
                    missing,
                    reason,
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
                let Plan::Retry(r) = &p.plan else { return None };
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
    fn a_failed_attempt_backs_off_and_says_why() {
        let t = PodTable::default();
        t.insert(7, pod("u1"), None);
        assert!(t.take_due("u1", Instant::now()), "a new pod is due at once");
        let now = Instant::now();
        assert!(!t.take_due("u1", now), "not twice while in flight");
        assert!(t.in_flight("u1"));
        t.failed("u1", Cause::ZtunnelRefused, "nack");
        assert!(!t.take_due("u1", Instant::now()), "backing off");
        assert!(t.waiting()[0].ztunnel_refused);
        assert_eq!(t.refused_by_ztunnel(), ["u1".to_string()].into());
        assert!(t.take_due("u1", Instant::now() + RETRY_MIN));
        t.failed("u1", Cause::Other, "add failed: connection reset");
        // The backoff doubled: one minimum interval is not enough any more.
        assert!(!t.take_due("u1", Instant::now() + RETRY_MIN));
        // The last failure decides whose it is.
        assert_eq!(t.waiting()[0].last_error, "add failed: connection reset");
        assert!(!t.waiting()[0].ztunnel_refused);
        assert!(t.refused_by_ztunnel().is_empty());
        t.acked_by("u1", Some(42));
        t.taken("u1");
        assert_eq!(t.staying()[0].ztunnel, Some(Ztunnel::Pid(42)));
        assert!(t.waiting().is_empty());
        assert!(!t.in_flight("u1"));
    }

    #[test]
    fn a_leaving_pod_is_never_offered_again() {
        let t = PodTable::default();
        t.insert(7, pod("u1"), None);
        t.failed("u1", Cause::ZtunnelRefused, "nack");
        t.leaving("u1");
        for _ in 0..2 {
            assert!(!t.take_due("u1", Instant::now() + RETRY_MAX));
            // A late answer or a snapshot cannot bring it back.
            t.failed("u1", Cause::ZtunnelRefused, "late nack");
            t.attempting("u1");
            t.waits_again("u1", "listeners gone");
        }
        assert!(t.waiting().is_empty());
        assert_eq!(t.cookie("u1"), Some(7), "still held until removed");
    }

    #[test]
    fn an_incomplete_capture_is_listed_until_a_repair_completes_it() {
        let t = PodTable::default();
        t.insert(7, pod("u1"), None);
        let lacks = || Some((vec!["egress_eth0".to_string()], "hook taken".to_string()));
        assert!(t.set_incomplete("u1", lacks()), "first seen: a change");
        assert!(t.is_incomplete("u1"));
        assert_eq!(t.incomplete()[0].missing, ["egress_eth0"]);
        let again = Some((vec!["egress_eth0".to_string()], "other words".to_string()));
        assert!(!t.set_incomplete("u1", again), "same links: no change");
        assert_eq!(t.incomplete()[0].reason, "other words");
        assert!(t.set_incomplete("u1", None), "completed: a change");
        assert!(!t.is_incomplete("u1") && t.incomplete().is_empty());
        assert!(!t.set_incomplete("gone", lacks()), "a pod not held");
    }

    #[test]
    fn unknown_pods_are_never_due() {
        let t = PodTable::default();
        assert!(!t.take_due("nope", Instant::now()));
        t.failed("nope", Cause::Other, "x");
        assert!(t.waiting().is_empty());
        assert_eq!(t.cookie("nope"), None);
    }
}

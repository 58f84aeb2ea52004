//! What the run has seen, shared by the traffic, the faults and the checks:
//! the live pods, the windows in which a fault may fail a pod's
//! connections, every connection's outcome, and the violations.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    sync::{
        atomic::{AtomicBool, Ordering},
        Mutex,
    },
    time::{Duration, Instant},
};

use serde::Serialize;

/// After a pod is seen Served again, its window stays open this much longer:
/// a connection a fault broke may be found broken a little later (a
/// long-lived one at its next exchange).
pub const GRACE: Duration = Duration::from_secs(2);

/// A window closes only on a Served seen this long after its fault was
/// injected: the agent notices some faults a little later (listeners gone),
/// and the pod's earlier Served is the state from before.
const NOTICE: Duration = Duration::from_secs(1);

/// A pod added this soon after a fault that touched every pod inherits the
/// fault's window (it lasts until the pod is first Served).
const INHERITED: Duration = Duration::from_secs(20);

/// Set by SIGINT or SIGTERM: the run stops as at its end, and tears down
/// what it made.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// SIGINT and SIGTERM end the run (its teardown included) instead of the
/// process. Handlers are not inherited across exec: the agent and the
/// peer keep their own.
pub fn stop_on_interrupt() {
    let handler = on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe).
        unsafe { libc::signal(sig, handler) };
    }
}

/// Whether the run was interrupted.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// A time in the run, in ms from its start.
pub type Ms = u64;

/// What a fault may do to a pod's connections until the pod is Served
/// again (plus [`GRACE`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opens {
    /// Nothing: every connection must succeed through it.
    Nothing,
    /// Fail any of them (ztunnel gone for a while).
    Failures,
    /// Fail only those open across it (a draining ztunnel ends them).
    LongLivedFailures,
    /// Fail any, and let them leave uncaptured: the capture was removed
    /// behind sluice's back until the agent repairs it.
    Tamper,
}

/// A span in which a fault may fail a pod's connections.
#[derive(Debug, Clone)]
struct Window {
    fault: &'static str,
    opens: Opens,
    start: Ms,
    /// When the fault's injection finished (a ztunnel's drain takes
    /// seconds): the pod's state before then says nothing of it.
    applied: Option<Ms>,
    /// The fault stays in effect until another releases it (an fd limit
    /// until its restore): no Served closes the window meanwhile, since
    /// the next fault may meet it (a ztunnel upgrade the agent cannot take
    /// while out of descriptors).
    held: bool,
    end: Option<Ms>,
}

impl Window {
    fn overlaps(&self, t0: Ms, t1: Ms) -> bool {
        self.start <= t1 && self.end.is_none_or(|e| e >= t0)
    }

    fn owns(&self, kind: &str) -> bool {
        match self.opens {
            Opens::Nothing => false,
            Opens::LongLivedFailures => kind == "long-lived",
            Opens::Failures | Opens::Tamper => true,
        }
    }
}

/// What the ledger keeps of one pod.
#[derive(Debug, Default)]
pub struct PodEntry {
    pub netns: String,
    pub ips: Vec<IpAddr>,
    windows: Vec<Window>,
    /// The last fault that touched it (all of them touch every pod but the
    /// per-pod ones).
    pub last_touch: Ms,
    /// Since when it has been Served without a break (None: not Served).
    pub served_since: Option<Ms>,
    /// Since when it has been reported Served with its capture incomplete.
    pub untrue_since: Option<Ms>,
}

impl PodEntry {
    pub fn new(netns: String, ips: Vec<IpAddr>) -> Self {
        Self {
            netns,
            ips,
            ..Self::default()
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Violation {
    pub at_ms: Ms,
    pub invariant: &'static str,
    pub pod: Option<String>,
    pub detail: String,
}

/// Connections of one kind (`outbound`, `inbound`, `long-lived`).
#[derive(Debug, Default, Clone, Serialize)]
pub struct Tally {
    pub attempted: u64,
    pub completed: u64,
    /// Failed, by the fault that owns the failure.
    pub failed_by_fault: BTreeMap<&'static str, u64>,
    pub failed_unowned: u64,
}

pub struct Ledger {
    start: Instant,
    pods: Mutex<BTreeMap<String, PodEntry>>,
    /// Pod addresses, while the pod is enrolled.
    owners: Mutex<HashMap<IpAddr, String>>,
    /// Windows of the faults that touched every pod: a pod added soon after
    /// one (while ztunnel still holds its acks, say) inherits it.
    global: Mutex<Vec<Window>>,
    tallies: Mutex<BTreeMap<&'static str, Tally>>,
    violations: Mutex<Vec<Violation>>,
    /// Uncaptured connections inside a tamper window (reported, owned).
    pub tamper_bypasses: Mutex<u64>,
    /// DNS queries passed through to their resolver as the programs
    /// counted them: no DNS socket of ztunnel's in the pod's map (row D4,
    /// by design; reported).
    pub dns_passthrough: Mutex<u64>,
    pub checks: Mutex<BTreeMap<&'static str, u64>>,
    stop: AtomicBool,
}

impl Ledger {
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
            pods: Mutex::default(),
            owners: Mutex::default(),
            global: Mutex::default(),
            tallies: Mutex::default(),
            violations: Mutex::default(),
            tamper_bypasses: Mutex::default(),
            dns_passthrough: Mutex::default(),
            checks: Mutex::default(),
            stop: AtomicBool::new(false),
        }
    }

    pub fn now(&self) -> Ms {
        self.start.elapsed().as_millis() as Ms
    }

    pub fn enrolled(&self, uid: &str, entry: PodEntry) {
        let mut owners = self.owners.lock().unwrap();
        for ip in &entry.ips {
            owners.insert(*ip, uid.to_owned());
        }
        let now = self.now();
        let windows = self
            .global
            .lock()
            .unwrap()
            .iter()
            .filter(|w| now.saturating_sub(w.start) < INHERITED.as_millis() as Ms)
            .cloned()
            .collect();
        self.pods.lock().unwrap().insert(
            uid.to_owned(),
            PodEntry {
                last_touch: now,
                windows,
                ..entry
            },
        );
    }

    /// The pod is gone (its traffic stopped and checked first).
    pub fn gone(&self, uid: &str) {
        if let Some(p) = self.pods.lock().unwrap().remove(uid) {
            let mut owners = self.owners.lock().unwrap();
            owners.retain(|_, u| u != uid);
            drop(p);
        }
    }

    /// The enrolled pod with address `ip`.
    pub fn owner(&self, ip: &IpAddr) -> Option<String> {
        self.owners.lock().unwrap().get(ip).cloned()
    }

    pub fn with_pods<R>(&self, f: impl FnOnce(&mut BTreeMap<String, PodEntry>) -> R) -> R {
        f(&mut self.pods.lock().unwrap())
    }

    /// A fault touched `uid` (or every pod): the pod must be Served again
    /// within the bound from now, and until then the fault may do what
    /// `opens` says to its connections.
    pub fn touch(&self, uid: Option<&str>, fault: &'static str, opens: Opens) {
        self.touch_with(uid, fault, opens, false);
    }

    /// [`Self::touch`] for a fault that stays in effect until
    /// [`Self::release`]d.
    pub fn touch_until_released(&self, uid: Option<&str>, fault: &'static str, opens: Opens) {
        self.touch_with(uid, fault, opens, true);
    }

    /// `fault`'s windows may close again (the pods' next Served).
    pub fn release(&self, fault: &'static str) {
        let mut pods = self.pods.lock().unwrap();
        let windows = pods.values_mut().flat_map(|p| p.windows.iter_mut());
        for w in windows.chain(self.global.lock().unwrap().iter_mut()) {
            if w.fault == fault {
                w.held = false;
            }
        }
    }

    fn touch_with(&self, uid: Option<&str>, fault: &'static str, opens: Opens, held: bool) {
        let now = self.now();
        let window = Window {
            fault,
            opens,
            start: now,
            applied: None,
            held,
            end: None,
        };
        if uid.is_none() && opens != Opens::Nothing {
            let mut global = self.global.lock().unwrap();
            global.retain(|w| now.saturating_sub(w.start) < INHERITED.as_millis() as Ms);
            global.push(window.clone());
        }
        let mut pods = self.pods.lock().unwrap();
        for (u, p) in pods.iter_mut() {
            if uid.is_some_and(|only| only != u) {
                continue;
            }
            p.last_touch = now;
            p.served_since = None;
            if opens != Opens::Nothing {
                p.windows.push(window.clone());
            }
        }
    }

    /// The fault just injected is in place: its windows may close from
    /// [`NOTICE`] on.
    pub fn applied(&self) {
        let now = self.now();
        let mut pods = self.pods.lock().unwrap();
        let windows = pods.values_mut().flat_map(|p| p.windows.iter_mut());
        for w in windows.chain(self.global.lock().unwrap().iter_mut()) {
            w.applied.get_or_insert(now);
        }
    }

    /// `uid` was seen Served with its capture in place: its windows whose
    /// fault was in place [`NOTICE`] before close after the grace time.
    pub fn served(&self, uid: &str) {
        let now = self.now();
        let notice = NOTICE.as_millis() as Ms;
        if let Some(p) = self.pods.lock().unwrap().get_mut(uid) {
            p.served_since.get_or_insert(now);
            p.untrue_since = None;
            for w in p.windows.iter_mut().filter(|w| w.end.is_none() && !w.held) {
                if w.applied.is_some_and(|a| now >= a + notice) {
                    w.end = Some(now + GRACE.as_millis() as Ms);
                }
            }
        }
    }

    /// `uid` is reported Served with its capture incomplete at `now`: for
    /// how long so far (`None` when the pod is gone).
    pub fn untrue_for(&self, uid: &str, now: Ms) -> Option<Ms> {
        let mut pods = self.pods.lock().unwrap();
        let p = pods.get_mut(uid)?;
        Some(now - *p.untrue_since.get_or_insert(now))
    }

    /// The fault owning a failure of `uid`'s connection over `[t0, t1]`.
    fn owner_of_failure(&self, uid: &str, kind: &str, t0: Ms, t1: Ms) -> Option<&'static str> {
        let pods = self.pods.lock().unwrap();
        let p = pods.get(uid)?;
        p.windows
            .iter()
            .rev()
            .find(|w| w.owns(kind) && w.overlaps(t0, t1))
            .map(|w| w.fault)
    }

    /// Whether a tamper window of `uid` covers `t`.
    pub fn tampered(&self, uid: &str, t: Ms) -> bool {
        let pods = self.pods.lock().unwrap();
        pods.get(uid).is_some_and(|p| {
            p.windows
                .iter()
                .any(|w| w.opens == Opens::Tamper && w.overlaps(t, t))
        })
    }

    /// One connection's outcome; an unowned failure is a violation.
    pub fn attempt(&self, kind: &'static str, uid: &str, t0: Ms, result: Result<(), String>) {
        let t1 = self.now();
        let owner = match &result {
            Ok(()) => None,
            Err(_) => Some(self.owner_of_failure(uid, kind, t0, t1)),
        };
        {
            let mut tallies = self.tallies.lock().unwrap();
            let t = tallies.entry(kind).or_default();
            t.attempted += 1;
            match owner {
                None => t.completed += 1,
                Some(Some(f)) => *t.failed_by_fault.entry(f).or_default() += 1,
                Some(None) => t.failed_unowned += 1,
            }
        }
        if let (Some(None), Err(e)) = (owner, result) {
            self.violate(
                "nothing lost",
                Some(uid),
                format!(
                    "a {kind} connection over [{t0}, {t1}] ms failed with no fault to own it: {e}"
                ),
            );
        }
    }

    pub fn violate(&self, invariant: &'static str, pod: Option<&str>, detail: String) {
        let v = Violation {
            at_ms: self.now(),
            invariant,
            pod: pod.map(str::to_owned),
            detail,
        };
        eprintln!("chaos: VIOLATION {v:?}");
        self.violations.lock().unwrap().push(v);
        self.stop.store(true, Ordering::SeqCst);
    }

    pub fn counted(&self, check: &'static str) {
        *self.checks.lock().unwrap().entry(check).or_default() += 1;
    }

    /// Whether the run must stop (a violation, or its end).
    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst) || interrupted()
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    pub fn violations(&self) -> Vec<Violation> {
        self.violations.lock().unwrap().clone()
    }

    pub fn tallies(&self) -> BTreeMap<&'static str, Tally> {
        self.tallies.lock().unwrap().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run 10 s in, with pod `a` whose windows were all put in place at
    /// its start (so that a Served now may close them).
    fn ten_seconds_in() -> Ledger {
        let l = Ledger {
            start: Instant::now() - Duration::from_secs(10),
            ..Ledger::new()
        };
        l.with_pods(|p| p.insert("a".into(), PodEntry::default()));
        l
    }

    fn put_in_place_at_start(l: &Ledger) {
        l.with_pods(|p| {
            for w in p.values_mut().flat_map(|p| p.windows.iter_mut()) {
                w.applied = Some(0);
            }
        });
    }

    /// An fd limit owns the pods' failures until its restore, however often
    /// they are Served meanwhile (seed 1795793498233835030: a ztunnel
    /// upgrade 3.4 s into a limit, which the agent could not take, failed a
    /// pod's connections after the pod had been Served under the limit).
    #[test]
    fn an_fd_limit_owns_failures_until_its_restore_whatever_is_served_between() {
        let l = ten_seconds_in();
        l.touch_until_released(None, "fd-limit", Opens::Failures);
        l.touch(None, "peer-kill", Opens::Failures);
        put_in_place_at_start(&l);
        l.served("a");
        let later = l.now() + 60_000;
        assert_eq!(
            l.owner_of_failure("a", "outbound", later, later + 1),
            Some("fd-limit")
        );
        l.release("fd-limit");
        l.served("a");
        assert_eq!(l.owner_of_failure("a", "outbound", later, later + 1), None);
    }
}

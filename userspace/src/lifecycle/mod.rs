//! The pod state machine, the one place that decides what happens to a pod.
//!
//! A pod's row has two halves: its state, pinned in the pod-state map that
//! the programs read ([`PodState`], or no entry), and what the agent keeps in
//! memory about it ([`Track`]: the plan for offering it to ztunnel, which
//! ztunnel took it, which sandbox enrolled it, what its capture lacks).
//! [`step`] is a pure function of the row and an [`Event`]: it returns the
//! next state, the next track and the [`Effect`]s the agent runs. Everything
//! else in sluice only produces events or carries out effects:
//!
//! - `state::Maps::apply` is the only writer of the pinned state: it asks
//!   [`decide`] (the state half of [`step`]) and tells its observer;
//! - the agent's pod table keeps the track, and changes it only to what
//!   [`step`] returns (for the events the map saw, through the observer).
//!
//! `docs/ARCHITECTURE.md` carries [`decide`]'s table, checked by a test.
//!
//! ```text
//!   (none) ──attach──► Pending ◄──listeners gone── Enabled ◄──workload lost── Served
//!                         │  └──listeners registered──►┘└──served found──────►┘
//!                         │             (Served ──listeners gone──► Pending)
//!                         └──────────drain──► Draining ◄──drain── Enabled, Served
//!                                                └──torn down──► (none)
//! ```
//! `Draining` is final: a pod being torn down never becomes `Pending` or
//! `Enabled` again (a crash mid-teardown is finished by the next agent).

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use sluice_common::PodState;

use crate::workload::PodIdentity;

#[cfg(test)]
mod tests;

/// The first retry of an add comes this long after a failure; each further
/// failure doubles it, up to [`RETRY_MAX`].
pub const RETRY_MIN: Duration = Duration::from_millis(500);
pub const RETRY_MAX: Duration = Duration::from_secs(30);

/// Something that happened to a pod: the machine's only input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Its capture is being attached (CNI ADD, an enroll request): its first
    /// entry, written before its first link.
    Attach,
    /// Listeners were registered after ztunnel's ack (or by `sluice
    /// register`): whether every role now has one.
    Registered { complete: bool },
    /// ztunnel's listeners are gone from the socket map (ztunnel exited).
    ListenersGone,
    /// The served check: ztunnel knows the pod's workload.
    ServedFound,
    /// The served check: ztunnel no longer knows it.
    WorkloadLost,
    /// The pod is to be unenrolled (CNI DEL, an unenroll request, a new
    /// sandbox): no add goes out for it any more. Its capture stays until
    /// [`Event::Drain`].
    UnenrollRequested,
    /// Its teardown begins (or an uninstall quiesces it): new connections
    /// fail closed while its links go.
    Drain,
    /// Its teardown finished (links, pins, routes gone), or an entry this
    /// build cannot read is removed.
    TornDown,
    /// An add for it went out as a first attempt (at enrollment, in a
    /// snapshot): the backoff starts afresh.
    AddSent,
    /// The retry pass asks whether its next add is due at this instant.
    RetryDue(Instant),
    /// An add failed, or its listeners never appeared.
    AddFailed { cause: Cause, why: String },
    /// It waits for a ztunnel (none connected) from the start of the backoff.
    Wait { why: String },
    /// A ztunnel acked it: this one's listeners are registered next (the
    /// acking one's, or a newer one's the pod keeps), and it is the one
    /// asked whether it serves the pod.
    Acked(Ztunnel),
    /// This CNI container (sandbox) enrolled it, or a retried ADD named it.
    SandboxOwned(String),
    /// A repair looked at its capture: the links it still lacks, and why
    /// (`None`: complete).
    Checked(Option<Incomplete>),
    /// Its capture was verified by running it (`podnet::verify`).
    Verified(Verification),
}

impl Event {
    /// The event's name in logs, errors and the documented table.
    pub fn name(&self) -> &'static str {
        match self {
            Event::Attach => "attach",
            Event::Registered { complete: true } => "listeners registered",
            Event::Registered { complete: false } => "listeners incomplete",
            Event::ListenersGone => "listeners gone",
            Event::ServedFound => "served found",
            Event::WorkloadLost => "workload lost",
            Event::UnenrollRequested => "unenroll requested",
            Event::Drain => "drain",
            Event::TornDown => "torn down",
            Event::AddSent => "add sent",
            Event::RetryDue(_) => "retry due",
            Event::AddFailed { .. } => "add failed",
            Event::Wait { .. } => "wait",
            Event::Acked(_) => "acked",
            Event::SandboxOwned(_) => "sandbox owned",
            Event::Checked(_) => "checked",
            Event::Verified(_) => "verified",
        }
    }

    /// Whether the event can change the pinned state: it then goes through
    /// the map (`Maps::apply`), never [`step_track`].
    pub fn touches_state(&self) -> bool {
        match self {
            Event::Attach
            | Event::Registered { .. }
            | Event::ListenersGone
            | Event::ServedFound
            | Event::WorkloadLost
            | Event::Drain
            | Event::TornDown => true,
            Event::UnenrollRequested
            | Event::AddSent
            | Event::RetryDue(_)
            | Event::AddFailed { .. }
            | Event::Wait { .. }
            | Event::Acked(_)
            | Event::SandboxOwned(_)
            | Event::Checked(_)
            | Event::Verified(_) => false,
        }
    }

    /// One event of each kind that can change the pinned state, in the
    /// order of the documented table.
    pub fn state_changing() -> [Event; 8] {
        [
            Event::Attach,
            Event::Registered { complete: true },
            Event::Registered { complete: false },
            Event::ListenersGone,
            Event::ServedFound,
            Event::WorkloadLost,
            Event::Drain,
            Event::TornDown,
        ]
    }
}

/// Whose fault a failed attempt is, for the node condition: a pod ztunnel
/// refuses is that pod's problem (the node captures, others enroll), so it
/// must not take the whole node out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Cause {
    /// ztunnel answered the add with an error (a nack): its verdict on this
    /// pod.
    ZtunnelRefused,
    /// Anything else: no ztunnel, ZDS broke, listeners never appeared, the
    /// node's own capture failed.
    #[default]
    Other,
}

/// A ztunnel process, as its ZDS connection identifies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Ztunnel {
    Pid(i32),
    /// The connection carried no usable peer credentials.
    UnknownPid,
}

impl Ztunnel {
    pub fn new(pid: Option<i32>) -> Self {
        match pid {
            Some(p) if p > 0 => Self::Pid(p),
            _ => Self::UnknownPid,
        }
    }

    pub fn pid(self) -> Option<i32> {
        match self {
            Self::Pid(p) => Some(p),
            Self::UnknownPid => None,
        }
    }
}

/// Links a pod's capture lacks that a repair could not attach, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Incomplete {
    pub missing: Vec<String>,
    pub reason: String,
}

/// What the last verification of a pod's capture found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Verification {
    /// Not verified since this agent last registered its listeners.
    #[default]
    NotYet,
    /// Every case passed. `unrun`: what could only be looked at, not run
    /// (an interface without an Ethernet header): verified in part.
    Verified { unrun: Vec<String> },
    /// A case failed: the kernel does not do what the pod's capture needs.
    Failed { case: String, detail: String },
}

impl Verification {
    /// What a change of which is worth telling: not yet, passed, or the
    /// failed case.
    fn class(&self) -> (u8, Option<&str>) {
        match self {
            Verification::NotYet => (0, None),
            Verification::Verified { .. } => (1, None),
            Verification::Failed { case, .. } => (2, Some(case)),
        }
    }
}

/// When a waiting pod is offered to ztunnel next, and why it still waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retry {
    /// `None`: due at once.
    pub due: Option<Instant>,
    pub backoff: Duration,
    /// An add for the pod is out (its answer decides what comes next).
    pub in_flight: bool,
    /// Why the last attempt left the pod Pending.
    pub last_error: Option<String>,
    /// Whose the last failure was.
    pub cause: Cause,
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

/// What the agent means to do with a pod next.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Plan {
    /// Nothing: ztunnel has it (or nothing has been tried yet).
    #[default]
    Idle,
    /// Offer it to ztunnel (again) on this schedule.
    Retry(Retry),
    /// Being unenrolled: never offered to ztunnel again.
    Leaving,
}

/// The half of a pod's row the agent keeps in memory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Track {
    pub plan: Plan,
    /// The ztunnel whose add registers the pod's listeners (the one asked
    /// whether it serves the pod); `None` until this agent sends an add.
    pub ztunnel: Option<Ztunnel>,
    /// The CNI container id (sandbox) whose ADD enrolled the pod, when a CNI
    /// ADD did (not a control-socket enroll, not a pod adopted at start).
    pub sandbox: Option<String>,
    /// What the last repair could not attach (`None`: complete, as far as
    /// the last repair saw).
    pub incomplete: Option<Incomplete>,
    /// What the last verification found, and when it ran.
    pub verification: Verification,
    pub verified_at: Option<Instant>,
    /// ztunnel has taken the pod's capture (its listeners registered) since
    /// it was attached: its annotation stays `enabled` while it waits for
    /// them again.
    pub acked: bool,
}

/// What the agent does because of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// The pinned state changed: count it, log it, and write the pod's
    /// annotation and readiness gate.
    Announce,
    /// The pod turned `Enabled`: ask its ztunnel now whether it serves it.
    CheckServed,
    /// A ztunnel (re)acked the pod: check the `Served` pods against it too.
    RecheckServed,
    /// The pod is due: send its ztunnel an add.
    SendAdd,
    /// What its capture lacks changed: tell Kubernetes (an Event, the gate).
    ReportCompleteness,
    /// Listeners were registered: verify the pod's capture by running it.
    Verify,
    /// Its verification passed or failed where it had not, or failed
    /// another case: tell Kubernetes (an Event, the gate).
    ReportVerification,
    /// The pod is gone: drop its row and the listeners held for it.
    Forget,
    /// The pod entered `Draining`: should its teardown be cut short (out of
    /// descriptors, say), the repairer finishes it, retrying until done.
    FinishTeardown,
}

/// The outcome of one event on one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub state: Option<PodState>,
    pub track: Track,
    pub effects: Vec<Effect>,
}

/// An event the machine does not take in the pod's state: a bug in the
/// caller, refused before anything is written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{event} in state {} is not a change sluice makes", name(*.from))]
pub struct Illegal {
    pub from: Option<PodState>,
    pub event: &'static str,
}

/// [`Illegal`], for the pod of a netns cookie.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pod of netns cookie {cookie}: {illegal}")]
pub struct IllegalTransition {
    pub cookie: u64,
    pub illegal: Illegal,
}

/// The name of a state in the documented table (`(none)`: no entry).
pub fn name(s: Option<PodState>) -> &'static str {
    s.map(PodState::as_str).unwrap_or("(none)")
}

/// The state half of [`step`]: the pod's next pinned state.
pub fn decide(from: Option<PodState>, event: &Event) -> Result<Option<PodState>, Illegal> {
    use PodState::{Draining, Enabled, Pending, Served};
    let illegal = || Illegal {
        from,
        event: event.name(),
    };
    let to = match (from, event) {
        (None, Event::Attach) => Pending,
        // Registration happens under the pod's ack; a pod being torn down is
        // never registered again (the caller checks before taking sockets).
        (Some(Pending | Enabled), Event::Registered { complete: true }) => Enabled,
        // Re-acked (a ztunnel upgrade, an agent restart): ztunnel serves
        // pods only after its first xDS sync, so the pod stays Served (and
        // its gate True) until the served check says otherwise.
        (Some(Served), Event::Registered { complete: true }) => Served,
        (Some(Pending | Enabled | Served), Event::Registered { complete: false }) => Pending,
        (Some(Pending | Enabled | Served), Event::ListenersGone) => Pending,
        (Some(Enabled | Served), Event::ServedFound) => Served,
        (Some(Enabled | Served), Event::WorkloadLost) => Enabled,
        // The served check read the pod earlier: an answer about a pod that
        // changed since says nothing now.
        (Some(s @ (Pending | Draining)), Event::ServedFound | Event::WorkloadLost) => s,
        (Some(Draining), Event::ListenersGone) => Draining,
        (Some(_), Event::Drain) => Draining,
        // Debris without a readable state has nothing to fail closed.
        (None, Event::Drain) => return Ok(None),
        (Some(Draining) | None, Event::TornDown) => return Ok(None),
        (
            s,
            Event::UnenrollRequested
            | Event::AddSent
            | Event::RetryDue(_)
            | Event::AddFailed { .. }
            | Event::Wait { .. }
            | Event::Acked(_)
            | Event::SandboxOwned(_)
            | Event::Checked(_)
            | Event::Verified(_),
        ) => return Ok(s),
        _ => return Err(illegal()),
    };
    Ok(Some(to))
}

/// One event on one pod: its next state, its next track, and what the agent
/// does about it.
pub fn step(
    from: Option<PodState>,
    track: &Track,
    event: &Event,
    now: Instant,
) -> Result<Step, Illegal> {
    let to = decide(from, event)?;
    let mut effects = Vec::new();
    if to != from {
        effects.push(Effect::Announce);
    }
    if to == Some(PodState::Enabled) && from != to {
        effects.push(Effect::CheckServed);
    }
    if to == Some(PodState::Draining) && from != to {
        effects.push(Effect::FinishTeardown);
    }
    let rest = next_track(track, event, to != from, now);
    effects.extend(rest.effects);
    Ok(Step {
        state: to,
        track: rest.track,
        effects,
    })
}

/// What a track-only event does: the next track and the effects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrackStep {
    pub track: Track,
    pub effects: Vec<Effect>,
}

/// [`step`] for an event that only ever changes the track (the agent's
/// memory), whatever the pod's state: an add's answer, a retry, a sandbox,
/// a repair's finding. An event that can change the state is refused: it
/// goes through the pinned map.
pub fn step_track(track: &Track, event: &Event, now: Instant) -> Result<TrackStep, Illegal> {
    if event.touches_state() {
        return Err(Illegal {
            from: None,
            event: event.name(),
        });
    }
    Ok(next_track(track, event, false, now))
}

/// The track half of [`step`]. `state_changed`: the event moved the pinned
/// state (only state events do).
fn next_track(track: &Track, event: &Event, state_changed: bool, now: Instant) -> TrackStep {
    let mut next = track.clone();
    let mut effects = Vec::new();
    let leaving = next.plan == Plan::Leaving;
    match event {
        Event::Registered { complete: true } => {
            if !leaving {
                next.plan = Plan::Idle;
            }
            next.acked = true;
            effects.push(Effect::RecheckServed);
            effects.push(Effect::Verify);
        }
        Event::ListenersGone if state_changed && !leaving => {
            next.plan = Plan::Retry(Retry::fresh(
                false,
                Some("ztunnel's listeners are gone".into()),
            ));
        }
        Event::UnenrollRequested | Event::Drain => next.plan = Plan::Leaving,
        Event::TornDown => effects.push(Effect::Forget),
        // A new attempt (a new ztunnel's snapshot) starts the backoff afresh;
        // what the last one met is still what the pod waits on until this
        // one is answered (a pod ztunnel refused is not a pod pending).
        Event::AddSent if !leaving => {
            let mut fresh = Retry::fresh(true, None);
            if let Plan::Retry(r) = &next.plan {
                fresh.cause = r.cause;
                fresh.last_error = r.last_error.clone();
            }
            next.plan = Plan::Retry(fresh);
        }
        Event::Wait { why } if !leaving => {
            next.plan = Plan::Retry(Retry::fresh(false, Some(why.clone())));
        }
        Event::RetryDue(at) => {
            let due = |r: &&mut Retry| !r.in_flight && r.due.is_none_or(|d| d <= *at);
            if let Some(r) = retry(&mut next.plan).filter(due) {
                r.in_flight = true;
                effects.push(Effect::SendAdd);
            }
        }
        Event::AddFailed { cause, why } => {
            if let Some(r) = retry(&mut next.plan) {
                r.in_flight = false;
                r.last_error = Some(why.clone());
                r.cause = *cause;
                r.due = Some(now + r.backoff);
                r.backoff = (r.backoff * 2).min(RETRY_MAX);
            }
        }
        Event::Acked(z) => next.ztunnel = Some(*z),
        Event::SandboxOwned(id) => next.sandbox = Some(id.clone()),
        Event::Checked(lacks) => {
            // A new reason for the same links is no change to announce.
            let links = |i: &Option<Incomplete>| i.as_ref().map(|i| i.missing.clone());
            if links(&next.incomplete) != links(lacks) {
                effects.push(Effect::ReportCompleteness);
            }
            next.incomplete = lacks.clone();
        }
        Event::Verified(v) => {
            if next.verification.class() != v.class() {
                effects.push(Effect::ReportVerification);
            }
            next.verification = v.clone();
            next.verified_at = Some(now);
        }
        _ => {}
    }
    TrackStep {
        track: next,
        effects,
    }
}

/// The pod's retry schedule, started (due now) for a pod that has none;
/// `None` for a pod that is leaving.
fn retry(plan: &mut Plan) -> Option<&mut Retry> {
    if *plan == Plan::Idle {
        *plan = Plan::Retry(Retry::fresh(false, None));
    }
    match plan {
        Plan::Retry(r) => Some(r),
        _ => None,
    }
}

/// An event the pinned map took, as its observer hears it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub cookie: u64,
    /// Who the pod is, as the map has it (`None` for debris).
    pub pod: Option<PodIdentity>,
    pub event: Event,
    pub from: Option<PodState>,
    pub to: Option<PodState>,
}

/// Hears every event the pinned map took, right after it was written
/// (called with the dataplane held: it must only queue work, never take that
/// lock).
pub type Observer = Arc<dyn Fn(&Applied) + Send + Sync>;

//! Verifying every pod's capture link by link and completing what an
//! interrupted enrollment (or anything else) left out; finishing interrupted
//! teardowns; removing pins no pod owns. At start (before ZDS and the control
//! socket serve), every `VERIFY_EVERY`, and for one pod when its links change.
//! Each pod's survey runs without the node-wide lock, one pod at a time.

use std::{sync::Arc, time::Duration};

use tracing::{info, info_span, warn};

use sluice_common::PodState;
use tokio::sync::watch;

use super::{announce::Announcer, book::PodBook, retries::Retries, verify_queue::VerifyQueue};
use crate::agent::custody::Custody;
use crate::{
    dataplane::loader::Dataplane,
    kube::events::Reason,
    lifecycle::{Effect, Event, Incomplete, Verification},
    metrics::Metrics,
    podnet::{
        enroll::{self, EnrollError},
        verify,
    },
};

/// How often every pod's capture is verified, whatever else happens, by
/// default (`--verify-every`).
pub const VERIFY_EVERY: Duration = Duration::from_secs(60);

/// One periodic pass in this many (the first included) also surveys and
/// repairs every pod's netns (routes, rules, sysctls, addresses, links)
/// before verifying it; the others only verify, and survey a pod only when
/// its verification fails. What a verification runs covers every hook;
/// what only the survey sees and no event announces (a sysctl the pod
/// changed itself, which affects only its own traffic) waits for the next
/// full pass. Changes that send events (links, addresses, tc, a route or
/// rule deleted) are repaired as they come.
pub const FULL_PASS_EVERY: u64 = 10;

pub struct Repairer {
    pub(super) book: Arc<PodBook>,
    pub(super) announcer: Arc<Announcer>,
    pub(super) metrics: Arc<Metrics>,
    /// Pods whose listeners were registered: verified by [`Self::run`].
    pub(super) queue: Arc<VerifyQueue>,
    /// How often every pod is verified (`--verify-every`).
    pub(super) every: Duration,
    /// ztunnel's listeners as the agent holds them: what sk_lookup must
    /// select.
    pub(super) custody: Arc<Custody>,
    /// When pods left unsettled by their last verification are tried again.
    pub(super) retries: Arc<Retries>,
    /// Periodic passes made: which are full (see [`FULL_PASS_EVERY`]).
    pub(super) passes: std::sync::atomic::AtomicU64,
}

impl Repairer {
    /// How long until the next verification of every pod: the period,
    /// give or take a tenth at random, so that nodes started together do
    /// not verify in step.
    pub(super) fn next_pass(&self) -> Duration {
        let jitter = rand_unit() * 0.2 - 0.1;
        self.every.mul_f64(1.0 + jitter)
    }

    /// Verifies and completes every pod's capture; removes pins no pod owns.
    /// Blocking: run it off the async workers.
    pub fn verify_all(&self, at_start: bool) {
        let pass = self
            .passes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let full = at_start || pass.is_multiple_of(FULL_PASS_EVERY);
        let cookies = self.book.dataplane().maps().cookies();
        for &cookie in &cookies {
            if full || !self.verified_alone(cookie) {
                self.verify(cookie, at_start);
            }
        }
        let dp = self.book.dataplane();
        if let Some(node) = dp.node() {
            node.peers.retain(|c| cookies.contains(&c));
        }
        match enroll::remove_orphan_pins(dp.pins(), dp.maps(), dp.node()) {
            Ok(0) => {}
            Ok(n) => info!(pods = n, "removed pins of pods without state"),
            Err(e) => warn!(error = %e, "removing pins of pods without state"),
        }
    }

    /// [`Self::verify_all`] for one pod, if it is still enrolled: what the
    /// link watch runs when the pod's interfaces change. Blocking.
    pub(super) fn verify_one(&self, cookie: u64) {
        self.verify(cookie, false);
    }

    /// Verifies the pods queued when their listeners were registered, when
    /// they entered `Draining` (to finish their teardown), and those queued
    /// again by [`Self::settle`], until `stop`.
    pub(super) async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        loop {
            let due = tokio::select! {
                _ = stop.changed() => return,
                due = self.queue.take() => due,
            };
            let this = self.clone();
            let _ = tokio::task::spawn_blocking(move || {
                for cookie in due {
                    this.verify(cookie, false);
                }
            })
            .await;
        }
    }

    /// After a verification of the pod: when it left something to do (a
    /// repair that failed, a teardown unfinished, a capture that failed its
    /// verification), the pod is queued again after 1 s, 2 s, 4 s… (at most
    /// the verification period), since nothing else may come to retry it:
    /// the agent out of descriptors when a pin was removed gets no second
    /// event once it has them back. Otherwise its backoff is forgotten.
    fn settle(&self, cookie: u64, unsettled: Option<&'static str>) {
        let Some(backoff) =
            self.retries
                .after_verification(cookie, unsettled.is_some(), self.every)
        else {
            return;
        };
        // Called off the runtime's workers, within it; a caller outside it
        // (none today) leaves the retry to the next event or pass.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.retries.fired(cookie);
            return;
        };
        warn!(
            cookie,
            ?backoff,
            "{}: trying again",
            unsettled.unwrap_or_default()
        );
        let (queue, retries) = (self.queue.clone(), self.retries.clone());
        runtime.spawn(async move {
            tokio::time::sleep(backoff).await;
            retries.fired(cookie);
            queue.push(cookie);
        });
    }

    /// A pod that steers verified without its survey: true when that
    /// passed (nothing more to do); false for a pod that does not steer
    /// (a Pending pod's capture fails closed only when whole: it is
    /// surveyed) and for one that failed (surveyed, repaired and verified
    /// again). A pass leaves the pod's repair backoff alone: it did not
    /// survey, so it cannot say a repair that failed now has nothing left
    /// to do (the retry already waiting does).
    fn verified_alone(&self, cookie: u64) -> bool {
        self.run_capture(cookie) == Some(true)
    }

    /// Verifies one pod, if it is still enrolled. What is linear in its
    /// interfaces (reading them, looking at each pod-side link) runs
    /// without the node-wide lock, so that a pod with many interfaces, or
    /// flapping ones, holds no other pod's enrollment; the lock is taken
    /// for the rest, which writes.
    fn verify(&self, cookie: u64, at_start: bool) {
        let survey = self.book.survey(cookie);
        let mut guard = self.book.dataplane();
        if guard.maps().entry(cookie).is_none() {
            if guard.maps_mut().sweep_stateless(cookie) {
                info!(cookie, "removed the map entries of a pod without state (an enrollment or teardown cut short between two writes)");
            }
            drop(guard);
            return self.settle(cookie, None);
        }
        let repaired = self.verify_pod(&mut guard, cookie, at_start, survey);
        drop(guard);
        let verified = self.run_capture(cookie) != Some(false);
        let unsettled = if self.book.state_of(cookie) == Some(PodState::Draining) {
            Some("a pod's teardown is unfinished")
        } else if !repaired {
            Some("a pod's capture could not be repaired")
        } else if !verified {
            Some("a pod's capture failed its verification")
        } else {
            None
        };
        self.settle(cookie, unsettled);
    }

    /// Runs the capture of a pod that steers (`Enabled`, `Served`) on
    /// synthetic packets (see [`verify`]): what its readiness gate waits
    /// for. The plan is read under the node-wide lock, the runs are made
    /// without it. Whether the capture passed; `None`: not run (the pod
    /// does not steer, or is gone).
    fn run_capture(&self, cookie: u64) -> Option<bool> {
        let (plan, uid, pod) = {
            let dp = self.book.dataplane();
            let meta = dp.maps().meta(cookie).filter(|_| steers(&dp, cookie))?;
            let pod = format!("{}/{}", meta.workload.namespace, meta.workload.name);
            (verify::plan(&dp, cookie), meta.uid, pod)
        };
        let plan = plan.map(|mut p| {
            p.listeners = self.custody.cookies(&uid);
            p
        });
        let span = info_span!("pod", %uid, %pod, cookie);
        let _e = span.enter();
        let outcome = match plan {
            Some(plan) => verify::verify(&plan),
            None => Err(verify::Failed {
                case: "netns".into(),
                detail: "cannot open the pod's netns".into(),
            }),
        };
        let found = match outcome {
            Ok(v) => Verification::Verified { unrun: v.unrun },
            Err(f) => Verification::Failed {
                case: f.case,
                detail: f.detail,
            },
        };
        let passed = !matches!(found, Verification::Failed { .. });
        self.record(&uid, &pod, found);
        Some(passed)
    }

    /// What a verification of the pod found: counted, put on its track,
    /// and, when its class or failed case changes, told to Kubernetes.
    fn record(&self, uid: &str, pod: &str, found: Verification) {
        self.metrics.capture_verification(match &found {
            Verification::Verified { unrun } if unrun.is_empty() => "verified",
            Verification::Verified { .. } => "partial",
            _ => "failed",
        });
        let effects = self.book.pods().apply(uid, Event::Verified(found.clone()));
        if !effects.contains(&Effect::ReportVerification) {
            return;
        }
        match &found {
            Verification::Failed { case, detail } => {
                warn!(%case, %detail, "the pod's capture failed its verification: its traffic may bypass ztunnel; the readiness gate is False until a verification passes");
                let note = format!("capture verification failed: {case}: {detail}; the readiness gate is False until a verification passes (retried at every change at the pod's hooks and every {}s)", self.every.as_secs());
                self.announcer
                    .pod_event(uid, Reason::CaptureVerificationFailed, &note);
            }
            _ => info!("the pod's capture passed its verification"),
        }
        if let Some((namespace, name)) = pod.split_once('/') {
            self.announcer.announce_pod(namespace, name, uid);
        }
    }

    /// Verifies and completes one pod's capture (see [`enroll::repair`]),
    /// with an Event and a count when something was missing. False when the
    /// repair failed (it is retried, see [`Self::settle`]).
    fn verify_pod(
        &self,
        dp: &mut Dataplane,
        cookie: u64,
        at_start: bool,
        survey: Option<enroll::Survey>,
    ) -> bool {
        let (uid, pod) = dp
            .maps()
            .meta(cookie)
            .map(|m| {
                (
                    m.uid,
                    format!("{}/{}", m.workload.namespace, m.workload.name),
                )
            })
            .unwrap_or_default();
        let span = info_span!("pod", %uid, %pod, cookie);
        let _e = span.enter();
        let outcome = enroll::repair_surveyed(dp, cookie, at_start, survey.as_ref());
        match &outcome {
            Ok(enroll::Repair::Complete) => {}
            Ok(enroll::Repair::Repaired {
                relinked,
                istio_rules,
            }) => {
                warn!(
                    ?relinked,
                    ?istio_rules,
                    "capture was incomplete: completed (links attached, istio-cni rules removed)"
                );
                // A steering pod's hooks were not as the capture needs them
                // until now: it failed its verification, whose run right
                // after the repair (see `verify`) can pass it again.
                // (A pod whose last verification failed already says so,
                // with the case that found it.)
                let failed = matches!(
                    self.book.pods().verification(&uid),
                    Verification::Failed { .. }
                );
                if !relinked.is_empty() && steers(dp, cookie) && !failed {
                    let detail = format!("{} not in place or not first at its hook (changed behind sluice's back); put back", relinked.join(", "));
                    self.record(
                        &uid,
                        &pod,
                        Verification::Failed {
                            case: "hooks".into(),
                            detail,
                        },
                    );
                }
                let note = format!("capture was incomplete and has been completed: links attached {relinked:?}, istio-cni rules removed {istio_rules:?}");
                self.announcer
                    .pod_event(&uid, Reason::CaptureRepaired, &note);
                self.metrics.capture_repaired();
            }
            Ok(enroll::Repair::TornDown) => {
                info!("finished an interrupted teardown");
                return true;
            }
            Err(e) => {
                warn!(error = %e, "could not verify the pod's capture; will retry");
                self.metrics.capture_repair_error();
            }
        }
        self.restore_listeners(dp, cookie, &uid, &pod);
        let repaired = outcome.is_ok();
        // A pod an earlier agent enrolled: open its netns once, now.
        if let Some(meta) = dp.maps().meta(cookie) {
            let pods = self.book.pods();
            if !pods.contains(&meta.uid) {
                let ns = enroll::open_pod_netns(dp.maps(), cookie).ok();
                let acked = dp.maps().entry(cookie).is_some_and(|e| e.steers());
                pods.insert(cookie, meta, ns, acked);
            }
        }
        let survey = survey.filter(|s| s.is_of(dp, cookie));
        self.note_completeness(dp, cookie, &uid, &pod, outcome.err(), survey.as_ref());
        repaired
    }

    /// A steering pod's listeners the agent holds but the socket map lacks
    /// (taken out behind its back) are put back, and reported as a failed
    /// verification of case `listeners`, as hooks put back are.
    fn restore_listeners(&self, dp: &mut Dataplane, cookie: u64, uid: &str, pod: &str) {
        // Only after a failed verification (a missing socket fails its
        // case), so that passing pods cost nothing here.
        let failed = matches!(
            self.book.pods().verification(uid),
            Verification::Failed { .. }
        );
        if !failed || !steers(dp, cookie) {
            return;
        }
        let restored = self.custody.restore(uid, cookie, dp.maps_mut());
        if restored.is_empty() {
            return;
        }
        warn!(
            ?restored,
            "ztunnel's listeners were gone from the socket map (behind sluice's back): put back"
        );
        let detail = format!(
            "{restored:?} not in the socket map (removed behind sluice's back); put back from the agent's duplicates"
        );
        self.record(
            uid,
            pod,
            Verification::Failed {
                case: "listeners".into(),
                detail: detail.clone(),
            },
        );
        self.announcer
            .pod_event(uid, Reason::CaptureRepaired, &detail);
        self.metrics.capture_repaired();
    }

    /// After a repair of the pod (`failed`: its error, if it failed):
    /// whether its capture still lacks links, recorded for `sluice status`
    /// and, when that changes, told to Kubernetes (its readiness gate, an
    /// Event). A repair that failed for another reason (the netns being
    /// torn down, a map error) with every link in place changes nothing.
    /// With the repair's `survey`, only what it did not find attached is
    /// looked at (under the lock) again.
    fn note_completeness(
        &self,
        dp: &Dataplane,
        cookie: u64,
        uid: &str,
        pod: &str,
        failed: Option<EnrollError>,
        survey: Option<&enroll::Survey>,
    ) {
        let lacks = match failed {
            None => None,
            Some(e) => {
                let missing = match survey {
                    Some(s) => enroll::missing_after(dp, s),
                    None => match enroll::missing_links(dp, cookie) {
                        Ok(m) => m,
                        // Cannot tell what is missing (out of descriptors,
                        // say): what was found before stands.
                        Err(_) => return,
                    },
                };
                (!missing.is_empty()).then(|| Incomplete {
                    missing,
                    reason: crate::error_line(&e),
                })
            }
        };
        let effects = self.book.pods().apply(uid, Event::Checked(lacks.clone()));
        if !effects.contains(&Effect::ReportCompleteness) {
            return;
        }
        match lacks {
            Some(Incomplete { missing, reason }) => {
                warn!(?missing, %reason, "the pod's capture is incomplete and cannot be completed now: part of its traffic bypasses ztunnel; retried at every repair");
                let note = format!("capture incomplete: {} cannot be attached ({reason}), so part of the pod's traffic bypasses ztunnel; the readiness gate is False until a repair completes it", missing.join(", "));
                self.announcer
                    .pod_event(uid, Reason::CaptureIncomplete, &note);
            }
            None => info!("the pod's capture is complete again"),
        }
        if let Some((namespace, name)) = pod.split_once('/') {
            self.announcer.announce_pod(namespace, name, uid);
        }
    }
}

/// Whether the pod's capture steers its traffic (`Enabled`, `Served`):
/// only then is it verified.
fn steers(dp: &Dataplane, cookie: u64) -> bool {
    dp.maps()
        .entry(cookie)
        .and_then(|e| e.state())
        .is_some_and(|s| matches!(s, PodState::Enabled | PodState::Served))
}

/// A number in [0, 1) from the clock's nanoseconds: jitter needs no more.
fn rand_unit() -> f64 {
    let ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    f64::from(ns % 1_000_000) / 1_000_000.0
}

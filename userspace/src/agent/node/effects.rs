//! The effect runner: every event the pinned map takes (see `lifecycle`)
//! moves the pod's track in the table, and the step's effects go to the
//! roles that act on them (the announcer, the served check, listener
//! custody). It runs under the dataplane lock, so it only queues and wakes.
//! It holds none of the roles that hold the dataplane: it lives inside it.

use std::sync::Arc;

use sluice_common::PodState;
use tracing::info;

use super::{
    announce::Announcer, pods::PodTable, served_check::ServedChecker, verify_queue::VerifyQueue,
};
use crate::{
    agent::custody::Custody,
    lifecycle::{Applied, Effect, Observer},
    metrics::Metrics,
};

pub(super) struct EffectRunner {
    pub(super) pods: Arc<PodTable>,
    pub(super) announcer: Arc<Announcer>,
    pub(super) served: Arc<ServedChecker>,
    pub(super) custody: Arc<Custody>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) verify: Arc<VerifyQueue>,
}

impl EffectRunner {
    /// The map's observer.
    pub(super) fn observer(self) -> Observer {
        Arc::new(move |a: &Applied| self.on_applied(a))
    }

    fn on_applied(&self, a: &Applied) {
        for effect in self.pods.follow(a) {
            match effect {
                Effect::Announce => {
                    let (from, to) = (a.from.map(PodState::as_str), a.to.map(PodState::as_str));
                    self.metrics.transition(from, to);
                    let uid = a.pod.as_ref().map(|p| p.uid.as_str()).unwrap_or("");
                    info!(
                        %uid,
                        cookie = a.cookie,
                        event = a.event.name(),
                        from = from.unwrap_or("none"),
                        to = to.unwrap_or("none"),
                        "pod state"
                    );
                    if let Some(p) = &a.pod {
                        self.announcer.announce_pod(
                            &p.workload.namespace,
                            &p.workload.name,
                            &p.uid,
                        );
                    }
                }
                Effect::CheckServed => self.served.wake(),
                Effect::RecheckServed => self.served.recheck_soon(),
                // The repairer verifies a steering pod, and finishes the
                // teardown of a `Draining` one (nothing once it is gone).
                Effect::Verify | Effect::FinishTeardown => self.verify.push(a.cookie),
                Effect::Forget => {
                    if let Some(p) = &a.pod {
                        self.custody.forget(&p.uid);
                        self.pods.remove(&p.uid);
                    }
                }
                // Effects of track-only events: their callers run them.
                Effect::SendAdd | Effect::ReportCompleteness | Effect::ReportVerification => {}
            }
        }
    }
}

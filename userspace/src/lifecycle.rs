//! The pod state machine, written once: which state changes are allowed, and
//! what a change tells the rest of the agent. The pinned pod-state map is the
//! only place a pod's state lives; `state::Maps` changes it in one
//! function, which checks [`allowed`] and reports every change to the
//! [`Observer`] (the agent: metrics, the pod's annotation and readiness gate,
//! logs).
//!
//! ```text
//!   (none) ──enroll──► Pending ◄──listeners gone── Enabled ◄──workload lost── Served
//!                         │  └──ztunnel acked, listeners registered──►┘└──ztunnel knows it──►┘
//!                         │                  (Served ──listeners gone──► Pending)
//!                         └──────────unenroll──► Draining ◄──unenroll── Enabled, Served
//!                                                   └──teardown done──► (none)
//! ```
//! `Draining` is final: a pod being torn down never becomes `Pending` or
//! `Enabled` again (a crash mid-teardown is finished by the next agent).

use std::sync::Arc;

use sluice_common::PodState;

use crate::workload::PodIdentity;

/// Whether a pod may go from `from` to `to` (`None`: no entry in the map).
pub const fn allowed(from: Option<PodState>, to: Option<PodState>) -> bool {
    use PodState::{Draining, Enabled, Pending, Served};
    matches!(
        (from, to),
        (None, Some(Pending))
            | (Some(Pending), Some(Pending | Enabled | Draining))
            | (Some(Enabled), Some(Pending | Enabled | Served | Draining))
            | (Some(Served), Some(Pending | Enabled | Served | Draining))
            | (Some(Draining), Some(Draining) | None)
            // Debris (an entry whose state this build cannot read, or none)
            // may always be removed.
            | (None, None)
    )
}

/// One change of a pod's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    pub cookie: u64,
    /// Who the pod is, as the map has it (`None` for debris).
    pub pod: Option<PodIdentity>,
    pub from: Option<PodState>,
    pub to: Option<PodState>,
}

/// Hears every state change, right after the map was written (called with
/// the dataplane held: it must only queue work, never take that lock).
pub type Observer = Arc<dyn Fn(&Transition) + Send + Sync>;

/// A state change the machine does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pod of netns cookie {cookie}: {} → {} is not a state change sluice makes", name(*.from), name(*.to))]
pub struct IllegalTransition {
    pub cookie: u64,
    pub from: Option<PodState>,
    pub to: Option<PodState>,
}

fn name(s: Option<PodState>) -> &'static str {
    s.map(PodState::as_str).unwrap_or("(not enrolled)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use PodState::*;

    #[test]
    fn the_table() {
        let all = [
            None,
            Some(Pending),
            Some(Enabled),
            Some(Served),
            Some(Draining),
        ];
        let legal = [
            (None, Some(Pending)),
            (None, None),
            (Some(Pending), Some(Pending)),
            (Some(Pending), Some(Enabled)),
            (Some(Pending), Some(Draining)),
            (Some(Enabled), Some(Pending)),
            (Some(Enabled), Some(Enabled)),
            (Some(Enabled), Some(Served)),
            (Some(Enabled), Some(Draining)),
            (Some(Served), Some(Pending)),
            (Some(Served), Some(Enabled)),
            (Some(Served), Some(Served)),
            (Some(Served), Some(Draining)),
            (Some(Draining), Some(Draining)),
            (Some(Draining), None),
        ];
        for from in all {
            for to in all {
                assert_eq!(
                    allowed(from, to),
                    legal.contains(&(from, to)),
                    "{} → {}",
                    name(from),
                    name(to)
                );
            }
        }
    }

    #[test]
    fn only_a_steering_pod_becomes_served() {
        assert!(!allowed(Some(Pending), Some(Served)));
        assert!(!allowed(None, Some(Served)));
    }

    #[test]
    fn draining_never_comes_back() {
        for to in [Pending, Enabled, Served] {
            let e = IllegalTransition {
                cookie: 7,
                from: Some(Draining),
                to: Some(to),
            };
            assert!(!allowed(e.from, e.to));
            assert!(e.to_string().contains("Draining →"), "{e}");
        }
    }
}

//! When to verify a pod again that its last verification left unsettled
//! (a repair that failed, a capture that failed its verification, a
//! teardown unfinished): after 1 s, 2 s, 4 s… at most the verification
//! period, with one retry per pod waiting at a time, however many
//! verifications (periodic passes, events, retries) find it unsettled
//! meanwhile.

use std::{collections::HashMap, sync::Mutex, time::Duration};

#[derive(Default)]
pub(super) struct Retries {
    by_pod: Mutex<HashMap<u64, Retry>>,
}

#[derive(Default)]
struct Retry {
    /// Retries scheduled since the pod was last settled (its backoff).
    tries: u32,
    /// A retry is waiting to fire.
    pending: bool,
}

impl Retries {
    /// A verification of `cookie` left it `unsettled` or not: how long until
    /// it is verified again, when a retry is to be scheduled now (none is
    /// waiting); `None` otherwise. A settled pod's backoff is forgotten.
    pub(super) fn after_verification(
        &self,
        cookie: u64,
        unsettled: bool,
        at_most: Duration,
    ) -> Option<Duration> {
        let mut by_pod = self.by_pod.lock().unwrap();
        if !unsettled {
            // The backoff is forgotten; a retry still waiting keeps its
            // mark until it fires, or a new failure meanwhile would start
            // a second chain beside it.
            match by_pod.get_mut(&cookie) {
                Some(r) if r.pending => r.tries = 0,
                _ => {
                    by_pod.remove(&cookie);
                }
            }
            return None;
        }
        let r = by_pod.entry(cookie).or_default();
        if r.pending {
            return None;
        }
        r.pending = true;
        let backoff = Duration::from_secs(1 << r.tries.min(6)).min(at_most);
        r.tries += 1;
        Some(backoff)
    }

    /// The retry of `cookie` fired (it is queued for its verification).
    pub(super) fn fired(&self, cookie: u64) {
        if let Some(r) = self.by_pod.lock().unwrap().get_mut(&cookie) {
            r.pending = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PERIOD: Duration = Duration::from_secs(60);

    #[test]
    fn one_retry_waits_per_pod_however_often_it_is_found_unsettled() {
        let r = Retries::default();
        assert_eq!(
            r.after_verification(7, true, PERIOD),
            Some(Duration::from_secs(1))
        );
        // A periodic pass and an event find it unsettled before the retry
        // fires: no second retry.
        assert_eq!(r.after_verification(7, true, PERIOD), None);
        assert_eq!(r.after_verification(7, true, PERIOD), None);
        r.fired(7);
        assert_eq!(
            r.after_verification(7, true, PERIOD),
            Some(Duration::from_secs(2))
        );
    }

    /// Settled (a link event's verification) while its retry waits, then
    /// unsettled again: still one chain, and the backoff starts over.
    #[test]
    fn settling_while_a_retry_waits_starts_no_second_chain() {
        let r = Retries::default();
        assert_eq!(
            r.after_verification(7, true, PERIOD),
            Some(Duration::from_secs(1))
        );
        assert_eq!(r.after_verification(7, false, PERIOD), None);
        assert_eq!(r.after_verification(7, true, PERIOD), None);
        r.fired(7);
        assert_eq!(
            r.after_verification(7, true, PERIOD),
            Some(Duration::from_secs(1))
        );
        r.fired(7);
        assert_eq!(r.after_verification(7, false, PERIOD), None);
        assert!(
            r.by_pod.lock().unwrap().is_empty(),
            "nothing kept once settled"
        );
    }

    #[test]
    fn the_backoff_doubles_to_the_period_and_is_forgotten_once_settled() {
        let r = Retries::default();
        let mut seen = Vec::new();
        for _ in 0..8 {
            seen.push(r.after_verification(7, true, PERIOD).unwrap().as_secs());
            r.fired(7);
        }
        assert_eq!(seen, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(r.after_verification(7, false, PERIOD), None);
        assert_eq!(
            r.after_verification(7, true, PERIOD),
            Some(Duration::from_secs(1))
        );
        // Another pod's backoff is its own.
        assert_eq!(
            r.after_verification(9, true, PERIOD),
            Some(Duration::from_secs(1))
        );
    }
}

//! How often one pod's link events may cost the agent work: a pod that flaps
//! its interfaces (it may, with NET_ADMIN in its own netns) gets its repairs
//! and address publishes spaced out, doubling up to [`MAX_GAP`] while it
//! keeps flapping, so it cannot keep the node-wide dataplane lock (and the
//! agent's CPU) from its neighbours. A pod that stays quiet for a while
//! starts again at [`MIN_GAP`].

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

/// The first gap between two handlings of one pod's link events.
pub const MIN_GAP: Duration = Duration::from_millis(100);
/// The longest gap a flapping pod is held to.
pub const MAX_GAP: Duration = Duration::from_secs(5);

/// Per pod (netns cookie): when its events were last handled, and the gap
/// the next must keep.
#[derive(Default)]
pub struct Pace {
    pods: HashMap<u64, (Instant, Duration)>,
}

impl Pace {
    /// Whether pod `cookie`'s events may be handled `now` (and then they are
    /// counted as handled); otherwise how long until they may.
    pub fn admit(&mut self, cookie: u64, now: Instant) -> Result<(), Duration> {
        let Some(&(last, gap)) = self.pods.get(&cookie) else {
            self.pods.insert(cookie, (now, MIN_GAP));
            return Ok(());
        };
        let since = now.saturating_duration_since(last);
        if since < gap {
            return Err(gap - since);
        }
        // Back again within twice its gap: still flapping, the gap grows.
        let next = if since < gap * 2 {
            (gap * 2).min(MAX_GAP)
        } else {
            MIN_GAP
        };
        self.pods.insert(cookie, (now, next));
        Ok(())
    }

    /// Forgets the pods `watched` no longer holds.
    pub fn keep_only(&mut self, watched: impl Fn(u64) -> bool) {
        self.pods.retain(|c, _| watched(*c));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flapping_pod_is_spaced_out_its_neighbour_is_not() {
        let mut p = Pace::default();
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        assert_eq!(p.admit(1, ms(0)), Ok(()));
        // Events every 10 ms: admitted at growing gaps only.
        let mut admitted = Vec::new();
        for n in (10..20_000).step_by(10) {
            if p.admit(1, ms(n)).is_ok() {
                admitted.push(n);
            }
        }
        let gaps: Vec<u64> = admitted.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(admitted[0], 100, "{admitted:?}");
        assert!(gaps.windows(2).all(|g| g[1] >= g[0]), "{gaps:?}");
        assert_eq!(
            *gaps.last().unwrap(),
            MAX_GAP.as_millis() as u64,
            "{gaps:?}"
        );
        assert!(admitted.len() < 20, "{} handlings in 20 s", admitted.len());
        // Another pod is not held back by the first.
        assert_eq!(p.admit(2, ms(19_995)), Ok(()));
        // Quiet for a while: the first starts over at the shortest gap.
        assert_eq!(p.admit(1, ms(60_000)), Ok(()));
        assert_eq!(p.admit(1, ms(60_050)), Err(Duration::from_millis(50)));
        assert_eq!(p.admit(1, ms(60_100)), Ok(()));
    }
}

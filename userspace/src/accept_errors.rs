//! What a listening socket's accept loop does when accept fails (EMFILE,
//! ENFILE, ENOBUFS, a connection reset before accept): it must neither stop
//! serving nor spin on a socket that stays readable. It backs off (10 ms
//! doubling to 1 s), logs the first failure of a streak and every 100th,
//! and counts them.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use tracing::warn;

/// Accept failures since the process started, over every listener.
pub static TOTAL: AtomicU64 = AtomicU64::new(0);

const FIRST: Duration = Duration::from_millis(10);
const MAX: Duration = Duration::from_secs(1);

#[derive(Debug, Default)]
pub struct AcceptErrors {
    streak: u32,
}

impl AcceptErrors {
    /// An accept worked: the next failure starts a new streak.
    pub fn ok(&mut self) {
        self.streak = 0;
    }

    /// An accept on `what` failed: log (first and every 100th of a streak),
    /// count, and wait before the next try.
    pub async fn failed(&mut self, what: &str, e: impl std::fmt::Display) {
        let e = e.to_string();
        TOTAL.fetch_add(1, Ordering::Relaxed);
        if self.streak.is_multiple_of(100) {
            warn!(listener = what, error = %e, failures_in_a_row = self.streak + 1, "accept failed; backing off");
        }
        let wait = FIRST.saturating_mul(1 << self.streak.min(7)).min(MAX);
        self.streak = self.streak.saturating_add(1);
        tokio::time::sleep(wait).await;
    }
}

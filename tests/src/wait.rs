//! Waiting on state, never on time: every test that needs the agent, ztunnel
//! or the kernel to get somewhere polls the state it needs (a map entry, a
//! `sluice status` field, a counter) until it holds or a deadline passes, and
//! then says what it last saw.
//!
//! The poll interval only bounds how often the state is read; nothing waits
//! for it to "be enough".

use std::{
    fmt::Debug,
    time::{Duration, Instant},
};

/// How often the state is read again.
const TICK: Duration = Duration::from_millis(10);

/// The default deadline: generous, because a deadline only matters when the
/// test is failing anyway (a loaded CI machine must never hit it).
pub const DEADLINE: Duration = Duration::from_secs(20);

/// Every deadline is multiplied by this whole number, if set: an emulated
/// VM (`cargo xtask test-kernels` without hardware virtualization) runs
/// everything many times slower.
pub const FACTOR_ENV: &str = "SLUICE_TEST_DEADLINE_FACTOR";

/// `within`, times [`FACTOR_ENV`].
pub fn scaled(within: Duration) -> Duration {
    static FACTOR: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let f = *FACTOR.get_or_init(|| {
        std::env::var(FACTOR_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|f| *f >= 1)
            .unwrap_or(1)
    });
    within * f
}

/// Polls `probe` until it returns `Ok`, or fails after `within` with
/// `what` and the last `Err` the probe gave (what it saw instead).
pub fn until<T, S: Debug>(
    what: &str,
    within: Duration,
    mut probe: impl FnMut() -> Result<T, S>,
) -> anyhow::Result<T> {
    let (start, within) = (Instant::now(), scaled(within));
    loop {
        if let Some(done) = settled(what, within, start, probe()) {
            return done;
        }
        std::thread::sleep(TICK);
    }
}

/// The outcome of one probe: `Some` when the wait is over (the state holds,
/// or the deadline passed), `None` to look again.
fn settled<T, S: Debug>(
    what: &str,
    within: Duration,
    start: Instant,
    probe: Result<T, S>,
) -> Option<anyhow::Result<T>> {
    match probe {
        Ok(v) => Some(Ok(v)),
        Err(seen) if start.elapsed() >= within => Some(Err(anyhow::anyhow!(
            "timed out after {within:?} waiting for {what}; last saw: {seen:?}"
        ))),
        Err(_) => None,
    }
}

/// [`until`] for a predicate over a value read each time: waits until
/// `ok(&read())`, reporting the last value read.
pub fn until_seen<S: Debug>(
    what: &str,
    within: Duration,
    mut read: impl FnMut() -> S,
    ok: impl Fn(&S) -> bool,
) -> anyhow::Result<S> {
    until(what, within, || {
        let s = read();
        if ok(&s) {
            Ok(s)
        } else {
            Err(s)
        }
    })
}

/// The async twin of [`until`], for tests that run on tokio.
pub async fn until_async<T, S: Debug>(
    what: &str,
    within: Duration,
    mut probe: impl FnMut() -> Result<T, S>,
) -> anyhow::Result<T> {
    let (start, within) = (Instant::now(), scaled(within));
    loop {
        if let Some(done) = settled(what, within, start, probe()) {
            return done;
        }
        tokio::time::sleep(TICK).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_what_it_last_saw() {
        let mut n = 0;
        let e = until("n to reach 1000", Duration::from_millis(30), || {
            n += 1;
            if n >= 1000 {
                Ok(())
            } else {
                Err(n)
            }
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("waiting for n to reach 1000; last saw: "), "{e}");
        assert!(!e.ends_with(": 1000"), "{e}");
    }

    #[test]
    fn returns_the_value_once_it_holds() {
        let mut n = 0;
        let got = until_seen(
            "n ≥ 3",
            DEADLINE,
            || {
                n += 1;
                n
            },
            |n| *n >= 3,
        )
        .unwrap();
        assert_eq!(got, 3);
    }
}

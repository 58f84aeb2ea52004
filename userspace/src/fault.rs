//! Crash points: where an enrollment or a teardown may be cut short by a
//! SIGKILL, named so a test can kill the process right after one of them and
//! check what the next agent makes of it. Pause points: where a test may
//! hold a thread of the agent (a slow netlink dump, say) to see what else
//! goes on meanwhile. Built only with the `fault-injection` feature (the
//! test build); otherwise every call is empty.

/// In the binary only when built with crash points, so a test can tell a
/// fault-injection build from the shipped one by reading the executable.
#[cfg(feature = "fault-injection")]
#[used]
pub static FAULT_INJECTION_MARKER: [u8; 31] = *b"sluice-fault-injection-build-v1";

/// Kills this process with SIGKILL right after `step` when the environment
/// says `SLUICE_CRASH_AT=<step>` (fault-injection builds only).
#[inline(always)]
pub fn crash_point(step: &str) {
    #[cfg(feature = "fault-injection")]
    {
        static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        let at = AT.get_or_init(|| std::env::var("SLUICE_CRASH_AT").ok());
        if at.as_deref() == Some(step) {
            eprintln!("fault injection: SIGKILL after {step}");
            // SAFETY: signalling ourselves; nothing after this runs.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
    }
    #[cfg(not(feature = "fault-injection"))]
    let _ = step;
}

/// Holds the calling thread at `step`, once per process, when the
/// environment says `SLUICE_PAUSE_AT=<step>` and `SLUICE_PAUSE_DIR=<dir>`
/// (fault-injection builds only): writes `<dir>/<step>.paused`, then opens
/// the FIFO `<dir>/<step>.release` (which the test made) for reading, which
/// blocks until the test opens it for writing.
#[inline(always)]
pub fn pause_point(step: &str) {
    #[cfg(feature = "fault-injection")]
    {
        use std::sync::{Mutex, OnceLock};
        static AT: OnceLock<Option<(String, std::path::PathBuf)>> = OnceLock::new();
        static DONE: Mutex<bool> = Mutex::new(false);
        let at = AT.get_or_init(|| {
            let step = std::env::var("SLUICE_PAUSE_AT").ok()?;
            let dir = std::env::var_os("SLUICE_PAUSE_DIR")?;
            Some((step, dir.into()))
        });
        let Some((at, dir)) = at else {
            return;
        };
        if at != step
            || std::mem::replace(&mut *DONE.lock().unwrap_or_else(|e| e.into_inner()), true)
        {
            return;
        }
        eprintln!("fault injection: paused at {step}");
        let _ = std::fs::write(dir.join(format!("{step}.paused")), "");
        let _ = std::fs::read(dir.join(format!("{step}.release")));
        eprintln!("fault injection: released at {step}");
    }
    #[cfg(not(feature = "fault-injection"))]
    let _ = step;
}

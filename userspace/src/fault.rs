//! Crash points: where an enrollment or a teardown may be cut short by a
//! SIGKILL, named so a test can kill the process right after one of them and
//! check what the next agent makes of it. Built only with the
//! `fault-injection` feature (the test build); otherwise every call is empty.

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

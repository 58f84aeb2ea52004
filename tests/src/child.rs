//! Children a test waits on, each with a deadline: a command that hangs (an
//! agent that never reaches its crash point, a tool stuck on a lock) fails
//! its test with what it printed so far, instead of hanging the suite.

use std::{
    process::{Child, Command, ExitStatus, Output, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::Context as _;

/// How long a child may run when its caller names no deadline: generous,
/// since it only matters when the test is failing anyway (scaled for VMs,
/// see [`crate::wait::scaled`]).
pub const CHILD_DEADLINE: Duration = Duration::from_secs(120);

/// How often a running child is looked at.
const TICK: Duration = Duration::from_millis(10);

/// [`Command::output`] and [`Command::status`], bounded in time.
pub trait Bounded {
    /// Runs the command to its end with its output captured; past
    /// `CHILD_DEADLINE` it is killed and the error says what it printed.
    fn output_bounded(&mut self) -> anyhow::Result<Output>;
    /// [`Bounded::output_bounded`] with the child's own stdout and stderr
    /// (not captured) and a deadline of the caller's.
    fn status_within(&mut self, within: Duration) -> anyhow::Result<ExitStatus>;
}

impl Bounded for Command {
    fn output_bounded(&mut self) -> anyhow::Result<Output> {
        let what = describe(self);
        let mut child = self
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {what}"))?;
        let out = drain(child.stdout.take());
        let err = drain(child.stderr.take());
        let status = wait(&mut child, crate::wait::scaled(CHILD_DEADLINE));
        // A grandchild that keeps a pipe open must not hang the test either.
        let collect = |rx: mpsc::Receiver<Vec<u8>>| rx.recv_timeout(Duration::from_secs(5));
        let (stdout, stderr) = (
            collect(out).unwrap_or_default(),
            collect(err).unwrap_or_default(),
        );
        match status {
            Some(status) => Ok(Output {
                status,
                stdout,
                stderr,
            }),
            None => anyhow::bail!(
                "{what} did not exit within {:?}: killed; its stdout: {:?}; its stderr: {:?}",
                crate::wait::scaled(CHILD_DEADLINE),
                String::from_utf8_lossy(&stdout),
                String::from_utf8_lossy(&stderr)
            ),
        }
    }

    fn status_within(&mut self, within: Duration) -> anyhow::Result<ExitStatus> {
        let what = describe(self);
        let within = crate::wait::scaled(within);
        let mut child = self.spawn().with_context(|| format!("starting {what}"))?;
        wait(&mut child, within)
            .with_context(|| format!("{what} did not exit within {within:?}: killed"))
    }
}

/// The command line, for messages.
fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Reads a pipe to its end on a thread of its own.
fn drain(pipe: Option<impl std::io::Read + Send + 'static>) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    if let Some(mut p) = pipe {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = p.read_to_end(&mut buf);
            let _ = tx.send(buf);
        });
    } else {
        let _ = tx.send(Vec::new());
    }
    rx
}

/// The child's exit status, or `None` (killed and reaped) past `within`.
fn wait(child: &mut Child, within: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(st)) => return Some(st),
            Ok(None) if start.elapsed() < within => std::thread::sleep(TICK),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_that_hangs_is_killed_with_what_it_printed() {
        let err = Command::new("sh")
            .args(["-c", "echo started; exec sleep 600"])
            .status_within(Duration::from_millis(200))
            .unwrap_err();
        assert!(err.to_string().contains("did not exit within"), "{err:#}");
    }

    #[test]
    fn a_child_that_ends_gives_its_output() {
        let out = Command::new("sh")
            .args(["-c", "echo out; echo err >&2; exit 3"])
            .output_bounded()
            .unwrap();
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(out.stdout, b"out\n");
        assert_eq!(out.stderr, b"err\n");
    }
}

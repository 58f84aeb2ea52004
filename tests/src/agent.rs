//! Processes for the agent tests: `sluice agent`, and the ZDS peer standing in
//! for ztunnel. Both are real processes (the peer must be one: ztunnel's
//! sockets close when its process dies, and the agent finds them by pid).

use crate::child::Bounded as _;
use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use anyhow::{ensure, Context as _};
use sluice::dataplane::loader::Pins;

use crate::{harness::sluice_bin, wait};

static SEQ: AtomicU32 = AtomicU32::new(0);

/// Output of one `sluice` command.
pub struct Out {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

pub struct AgentProc {
    child: Option<Child>,
    /// A command the agent runs under (it gets the sluice command line as
    /// arguments and must exec it), e.g. to restrict its capabilities.
    wrapper: Vec<String>,
    extra: Vec<String>,
    /// Extra environment for the agent process (e.g. a crash point).
    env: Vec<(String, String)>,
    pub dir: PathBuf,
    pub zds: PathBuf,
    pub control: PathBuf,
    pub root: PathBuf,
}

impl AgentProc {
    /// Starts `sluice agent` on the pins `pins`, with sockets in a fresh dir.
    pub fn start(pins: &Pins) -> anyhow::Result<Self> {
        Self::start_with(pins, &[])
    }

    /// Same, with extra `sluice agent` flags.
    pub fn start_with(pins: &Pins, extra: &[&str]) -> anyhow::Result<Self> {
        Self::start_wrapped(pins, &[], extra)
    }

    /// An agent that verifies every pod every second (`--verify-every 1s`)
    /// and serves its metrics on a free port, returned with it; `extra`
    /// flags after.
    pub fn start_verifying(pins: &Pins, extra: &[&str]) -> anyhow::Result<(Self, u16)> {
        let port = free_port()?;
        let addr = format!("127.0.0.1:{port}");
        let mut flags = vec!["--verify-every", "1s", "--metrics-addr", &addr];
        flags.extend_from_slice(extra);
        Ok((Self::start_with(pins, &flags)?, port))
    }

    /// Same, run under `wrapper` (see [`AgentProc::wrapper`]).
    pub fn start_wrapped(pins: &Pins, wrapper: &[&str], extra: &[&str]) -> anyhow::Result<Self> {
        Self::launch(pins, wrapper, extra, &[])
    }

    /// Starts the agent with everything a test may vary, sockets and log in
    /// a fresh directory of its own.
    fn launch(
        pins: &Pins,
        wrapper: &[&str],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let dir = PathBuf::from(format!("/tmp/sluice-agent-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let mut a = Self {
            child: None,
            wrapper: owned(wrapper),
            extra: owned(extra),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .chain(
                    crate::harness::as_if_kernel_env()
                        .into_iter()
                        .map(|(k, v)| (k.to_owned(), v)),
                )
                .collect(),
            zds: dir.join("ztunnel.sock"),
            control: dir.join("agent.sock"),
            root: pins.root().to_owned(),
            dir,
        };
        a.spawn()?;
        Ok(a)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        self.spawn_process()?;
        wait::until("the agent to bind its sockets", wait::DEADLINE, || {
            match (self.control.exists(), self.zds.exists()) {
                (true, true) => Ok(()),
                seen => Err((seen, self.log())),
            }
        })
    }

    /// Starts the agent again without waiting for its sockets (an agent
    /// that only reports, e.g. over a dataplane it cannot take over).
    pub fn restart_reporting_only(&mut self) -> anyhow::Result<()> {
        self.terminate();
        self.spawn_process()
    }

    fn spawn_process(&mut self) -> anyhow::Result<()> {
        // A killed agent leaves its socket files: the new one's must be
        // waited for, not the stale ones.
        let _ = std::fs::remove_file(&self.control);
        let _ = std::fs::remove_file(&self.zds);
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.dir.join("agent.log"))?;
        let mut cmd = match self.wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(sluice_bin());
                c
            }
            None => Command::new(sluice_bin()),
        };
        let child = cmd
            .arg("--bpf-root")
            .arg(&self.root)
            .arg("--control-socket")
            .arg(&self.control)
            .arg("agent")
            .arg("--zds-socket")
            .arg(&self.zds)
            // Tests run side by side: the admin listeners only where asked for.
            .args(
                ["--metrics-addr", "--health-addr"]
                    .into_iter()
                    .filter(|flag| !self.extra.iter().any(|a| a == flag))
                    .flat_map(|flag| [flag, "off"]),
            )
            .args(&self.extra)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting sluice agent")?;
        self.child = Some(child);
        Ok(())
    }

    /// `sluice status -o json`, whole: `{"node": …, "pods": […]}`.
    pub fn status_json(&self) -> anyhow::Result<serde_json::Value> {
        let out = self.sluice(&["status", "-o", "json"])?;
        ensure!(out.ok, "status: {}", out.stderr);
        Ok(serde_json::from_str(&out.stdout)?)
    }

    /// `sluice status -o json`'s `node.agent` (the agent's own report).
    pub fn node_status(&self) -> anyhow::Result<serde_json::Value> {
        Ok(self.status_json()?["node"]["agent"].clone())
    }

    /// Waits until the agent reports ztunnel process `pid` (see
    /// `NodeStatus::ztunnels`) and `ok` holds for its entry.
    pub fn wait_ztunnel(
        &self,
        pid: u32,
        what: &str,
        ok: impl Fn(&serde_json::Value) -> bool,
    ) -> anyhow::Result<()> {
        wait::until(what, wait::DEADLINE, || {
            let n = self.node_status().map_err(|e| e.to_string())?;
            let z = n["ztunnels"]
                .as_array()
                .and_then(|zs| zs.iter().find(|z| z["pid"] == pid))
                .cloned();
            match z {
                Some(z) if ok(&z) => Ok(()),
                _ => Err(n["ztunnels"].to_string()),
            }
        })
    }

    /// Starts `sluice agent` with `SLUICE_CRASH_AT=step`: it kills itself
    /// right after that step (fault-injection build).
    pub fn start_crashing_at(pins: &Pins, step: &str) -> anyhow::Result<Self> {
        Self::launch(pins, &[], &[], &[("SLUICE_CRASH_AT", step)])
    }

    /// Waits for the agent to die by a signal (a crash point), and says which.
    pub fn wait_killed(&mut self) -> anyhow::Result<i32> {
        use std::os::unix::process::ExitStatusExt as _;
        let mut c = self.child.take().context("agent not running")?;
        let status = wait::until("the agent to die", wait::DEADLINE, || match c.try_wait() {
            Ok(Some(st)) => Ok(st),
            other => Err(format!("{other:?}")),
        });
        let status = match status {
            Ok(s) => s,
            Err(e) => {
                let _ = c.kill();
                let _ = c.wait();
                return Err(e);
            }
        };
        status
            .signal()
            .with_context(|| format!("the agent exited ({status}), not killed:\n{}", self.log()))
    }

    /// Starts the agent again without the extra environment (after a crash).
    pub fn restart_clean(&mut self) -> anyhow::Result<()> {
        self.env.clear();
        self.restart()
    }

    /// The agent's pid (the wrapper execs it, so the same process).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    /// Runs the `sluice` CLI against this agent.
    pub fn sluice(&self, args: &[&str]) -> anyhow::Result<Out> {
        let out = Command::new(sluice_bin())
            .arg("--bpf-root")
            .arg(&self.root)
            .arg("--control-socket")
            .arg(&self.control)
            .args(args)
            .output_bounded()?;
        Ok(Out {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    /// `sluice enroll` through this agent: the pod netns at `netns`, as
    /// workload `namespace/name` with service account `app-sa`.
    pub fn enroll(
        &self,
        netns: &Path,
        uid: &str,
        namespace: &str,
        name: &str,
    ) -> anyhow::Result<Out> {
        let netns = netns.to_str().context("netns path is not UTF-8")?;
        self.sluice(&[
            "enroll",
            "--netns",
            netns,
            "--uid",
            uid,
            "--name",
            name,
            "--namespace",
            namespace,
            "--service-account",
            "app-sa",
        ])
    }

    /// SIGTERM and wait; returns whether it exited cleanly.
    pub fn terminate(&mut self) -> bool {
        let Some(mut c) = self.child.take() else {
            return true;
        };
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        match wait::until("the agent to exit on SIGTERM", wait::DEADLINE, || {
            match c.try_wait() {
                Ok(Some(st)) => Ok(st.success()),
                other => Err(format!("{other:?}")),
            }
        }) {
            Ok(clean) => clean,
            Err(_) => {
                let _ = c.kill();
                let _ = c.wait();
                false
            }
        }
    }

    /// Sets (or with `None` removes) a variable of the agent's environment
    /// for its next start.
    pub fn set_env(&mut self, key: &str, value: Option<&str>) {
        self.env.retain(|(k, _)| k != key);
        if let Some(v) = value {
            self.env.push((key.to_owned(), v.to_owned()));
        }
    }

    /// SIGKILL (no cleanup of any kind) and reap.
    pub fn kill(&mut self) -> anyhow::Result<()> {
        let mut c = self.child.take().context("agent not running")?;
        c.kill()?;
        c.wait()?;
        Ok(())
    }

    /// Starts the agent again (after `terminate`).
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.terminate();
        self.spawn()
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        self.terminate();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The ZDS peer process (`sluice-zds-peer`) and the events it printed.
pub struct PeerProc {
    child: Option<Child>,
    events: Arc<Mutex<Vec<serde_json::Value>>>,
}

impl PeerProc {
    pub fn start(bin: &Path, zds: &Path, extra: &[&str]) -> anyhow::Result<Self> {
        let mut child = Command::new(bin)
            .arg("--socket")
            .arg(zds)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the ZDS peer")?;
        let events = Arc::new(Mutex::new(Vec::new()));
        let ev = events.clone();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if let Ok(v) = serde_json::from_str(&line) {
                    ev.lock().unwrap().push(v);
                }
            }
        });
        Ok(Self {
            child: Some(child),
            events,
        })
    }

    pub fn events(&self) -> Vec<serde_json::Value> {
        self.events.lock().unwrap().clone()
    }

    /// Whether ztunnel's listeners accepted connections in every given role.
    pub fn accepted_roles(&self, roles: &[&str]) -> bool {
        let ev = self.events();
        roles.iter().all(|r| {
            ev.iter()
                .any(|e| e["event"] == "accepted" && e["role"] == *r)
        })
    }

    pub fn count(&self, event: &str) -> usize {
        self.events().iter().filter(|e| e["event"] == event).count()
    }

    /// Waits until `pred` holds over the events; the error lists them.
    pub fn wait_for(
        &self,
        what: &str,
        pred: impl Fn(&[serde_json::Value]) -> bool,
    ) -> anyhow::Result<()> {
        wait::until_seen(what, wait::DEADLINE, || self.events(), |e| pred(e)).map(drop)
    }

    /// Waits until this peer has received its snapshot.
    pub fn wait_snapshot(&self) -> anyhow::Result<()> {
        self.wait_for("the peer's snapshot", |e| {
            e.iter().any(|e| e["event"] == "snapshot_sent")
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL: a crash; its sockets close at once.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM: a draining exit, and wait for it.
    pub fn terminate(&mut self) {
        if let Some(mut c) = self.child.take() {
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let _ = c.wait();
        }
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A free loopback port (for an agent's --metrics-addr).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The sum of the agent's metric samples (its `--metrics-addr` on `port`)
/// whose line begins with `prefix` (a name and the start of its labels):
/// 0 when none is exported yet.
pub fn metric_sum(port: u16, prefix: &str) -> anyhow::Result<u64> {
    let (_, text) = http_get(port, "/metrics")?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum())
}

/// The prefix of the failed verifications' counter, for [`metric_sum`].
pub const FAILED_VERIFICATIONS: &str = "sluice_capture_verifications_total{result=\"failed\"}";

/// A plain HTTP/1.1 GET on loopback: status code and body.
pub fn http_get(port: u16, path: &str) -> anyhow::Result<(u16, String)> {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(crate::wait::scaled(Duration::from_secs(5))))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let (head, body) = resp.split_once("\r\n\r\n").context("no end of headers")?;
    let code = head
        .split_whitespace()
        .nth(1)
        .context("no status line")?
        .parse()?;
    Ok((code, body.to_owned()))
}

/// The agent's RLIMIT_NOFILE: `Some(n)`, at most `n` more descriptors
/// (the limit is on descriptor numbers, and a new one takes the lowest
/// free number: the limit is set `n` above that); `None`, up to its hard
/// limit.
pub fn fd_limit(pid: u32, headroom: Option<u64>) -> anyhow::Result<()> {
    if pid == 0 {
        return Ok(());
    }
    let pid = pid as libc::pid_t;
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit writes the current limit into `limit`.
    if unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut limit) } != 0 {
        // The agent exited meanwhile (another fault): nothing to limit.
        return Ok(());
    }
    limit.rlim_cur = match headroom {
        Some(n) => {
            let held: std::collections::BTreeSet<u64> =
                std::fs::read_dir(format!("/proc/{pid}/fd"))?
                    .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect();
            let lowest_free = (0..).find(|fd| !held.contains(fd)).unwrap_or(0);
            (lowest_free + n).min(limit.rlim_max)
        }
        None => limit.rlim_max,
    };
    // SAFETY: prlimit reads `limit`.
    let rc = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &limit, std::ptr::null_mut()) };
    if rc != 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH) {
        anyhow::bail!("prlimit: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

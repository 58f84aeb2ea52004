//! Running CNI plugins per the spec, as a container runtime does: config on
//! stdin, `CNI_*` in the environment, inside a netns of the test's own that
//! stands for the node (`ptp` puts the host end of its veth in the caller's
//! netns).

use std::{
    fs::File,
    io::Write,
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

use crate::ns::netns_path;

/// Debian's containernetworking-plugins.
pub const REFERENCE_PLUGINS: &str = "/usr/lib/cni";

pub struct Invocation {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
    /// Killed past its bound ([`Exec::run_within`]); `ok` is false.
    pub timed_out: bool,
}

impl Invocation {
    pub fn json(&self) -> anyhow::Result<serde_json::Value> {
        Ok(serde_json::from_str(&self.stdout)?)
    }
}

/// One plugin invocation from inside netns `node`.
pub struct Exec<'a> {
    pub node: &'a str,
    pub plugin: &'a Path,
    pub command: &'a str,
    pub container_id: &'a str,
    pub netns: Option<&'a Path>,
    pub args: &'a str,
    pub config: &'a serde_json::Value,
}

impl Exec<'_> {
    pub fn run(&self) -> anyhow::Result<Invocation> {
        let child = self.spawn()?;
        let out = child.wait_with_output()?;
        Ok(Invocation::of(&out))
    }

    /// [`Exec::run`], but a plugin still running after `within` is killed
    /// and counted as failed (`timed_out`): a runtime's call gives up too,
    /// and retries later.
    pub fn run_within(&self, within: Duration) -> anyhow::Result<Invocation> {
        let mut child = self.spawn()?;
        let deadline = Instant::now() + within;
        let timed_out = loop {
            if child.try_wait()?.is_some() {
                break false;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                break true;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let out = child.wait_with_output()?;
        let mut inv = Invocation::of(&out);
        inv.timed_out = timed_out;
        inv.ok &= !timed_out;
        Ok(inv)
    }

    /// The plugin started in the node's netns, its config written to it.
    fn spawn(&self) -> anyhow::Result<Child> {
        let node = File::open(netns_path(self.node))?;
        let fd = node.as_raw_fd();
        let mut cmd = Command::new(self.plugin);
        cmd.env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("CNI_COMMAND", self.command)
            .env("CNI_CONTAINERID", self.container_id)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", REFERENCE_PLUGINS)
            .env("CNI_ARGS", self.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(n) = self.netns {
            cmd.env("CNI_NETNS", n);
        }
        // SAFETY: setns is async-signal-safe; the fd stays open until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn()?;
        drop(node);
        child
            .stdin
            .take()
            .unwrap()
            .write_all(serde_json::to_string(self.config)?.as_bytes())?;
        Ok(child)
    }
}

impl Invocation {
    fn of(out: &Output) -> Self {
        Self {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).trim().to_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            timed_out: false,
        }
    }
}

pub fn plugin(name: &str) -> PathBuf {
    Path::new(REFERENCE_PLUGINS).join(name)
}

/// The config a runtime would use from `conf_dir` (the first `.conf`,
/// `.conflist` or `.json` by name), with its content.
pub fn in_force(conf_dir: &Path) -> Option<(PathBuf, serde_json::Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(conf_dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("conf" | "conflist" | "json")
            )
        })
        .collect();
    files.sort();
    let first = files.into_iter().next()?;
    let v = serde_json::from_slice(&std::fs::read(&first).ok()?).unwrap_or_default();
    Some((first, v))
}

/// Whether a parsed conflist ends with sluice-cni.
pub fn ends_with_sluice(v: &serde_json::Value) -> bool {
    v["plugins"]
        .as_array()
        .and_then(|p| p.last())
        .is_some_and(|p| p["type"] == "sluice-cni")
}

//! Running code inside a network namespace on a dedicated thread.

use crate::child::Bounded as _;
use std::{
    fs::File,
    os::fd::{AsFd, OwnedFd},
    path::PathBuf,
    sync::Arc,
    thread::JoinHandle,
};

use nix::sched::{setns, CloneFlags};

pub fn netns_path(name: &str) -> PathBuf {
    PathBuf::from(format!("/run/netns/{name}"))
}

/// Enters netns `name` on the calling thread. Only for threads we own.
pub fn enter(name: &str) -> std::io::Result<()> {
    let f = File::open(netns_path(name))?;
    setns(f.as_fd(), CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)
}

/// A network namespace to run threads in: by name, or by an fd we were handed
/// (as ztunnel is, over ZDS).
#[derive(Clone)]
pub enum Ns {
    Named(String),
    Fd(Arc<OwnedFd>),
}

impl Ns {
    pub fn enter(&self) -> std::io::Result<()> {
        match self {
            Ns::Named(n) => enter(n),
            Ns::Fd(fd) => setns(fd.as_fd(), CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from),
        }
    }

    /// Spawns a thread that lives in this netns.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> JoinHandle<T> {
        let ns = self.clone();
        std::thread::spawn(move || {
            ns.enter().expect("entering netns");
            f()
        })
    }
}

/// Spawns a thread that lives in netns `name`.
pub fn spawn_in<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> JoinHandle<T> {
    let name = name.to_owned();
    std::thread::spawn(move || {
        enter(&name).unwrap_or_else(|e| panic!("entering netns {name}: {e}"));
        f()
    })
}

/// Runs `f` in netns `name` and waits for it.
pub fn run_in<T: Send + 'static>(name: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    spawn_in(name, f).join().expect("netns thread panicked")
}

/// Runs a command inside netns `ns` (`ip netns exec`), failing with its
/// stderr.
pub fn exec(ns: &str, cmd: &[&str]) -> anyhow::Result<()> {
    output(ns, cmd).map(drop)
}

/// [`exec`], returning what the command printed.
pub fn output(ns: &str, cmd: &[&str]) -> anyhow::Result<String> {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns])
        .args(cmd)
        .output_bounded()?;
    anyhow::ensure!(
        out.status.success(),
        "{} (in {ns}): {}",
        cmd.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

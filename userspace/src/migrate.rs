//! Taking over a pod from istio-cni: a pod captured by Istio's in-pod
//! iptables rules (the cluster switched node agents) is enrolled with sluice
//! first, then Istio's `ISTIO_*` chains are removed — so there is no moment
//! without capture. The policy rule and table-100 route Istio installs are the
//! same as sluice's and stay. Uses the iptables tools, as istio-cni does.

use std::{
    os::{fd::AsRawFd, unix::process::CommandExt},
    process::Command,
};

use crate::netns::Netns;

const CHAINS: [(&str, &str, &str); 4] = [
    ("mangle", "PREROUTING", "ISTIO_PRERT"),
    ("mangle", "OUTPUT", "ISTIO_OUTPUT"),
    ("nat", "PREROUTING", "ISTIO_PRERT"),
    ("nat", "OUTPUT", "ISTIO_OUTPUT"),
];

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("running {cmd} in the pod netns: {source}")]
    Exec { cmd: String, source: std::io::Error },
    #[error("{cmd} failed in the pod netns: {stderr}")]
    Failed { cmd: String, stderr: String },
}

/// Runs an iptables tool inside `netns`; `None` when the tool is not installed.
fn run(
    netns: &Netns,
    bin: &str,
    args: &[&str],
) -> Result<Option<(bool, String, String)>, MigrateError> {
    let fd = netns.as_fd_raw();
    let mut cmd = Command::new(bin);
    cmd.args(args);
    // SAFETY: setns is async-signal-safe and the fd is open across spawn.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    match cmd.output() {
        Ok(o) => Ok(Some((
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(MigrateError::Exec {
            cmd: format!("{bin} {}", args.join(" ")),
            source,
        }),
    }
}

/// The iptables tools (IPv4, IPv6) whose rule set holds Istio's chains.
pub fn istio_rules(netns: &Netns) -> Result<Vec<&'static str>, MigrateError> {
    let mut found = Vec::new();
    for (save, tool) in [
        ("iptables-save", "iptables"),
        ("ip6tables-save", "ip6tables"),
    ] {
        if let Some((true, out, _)) = run(netns, save, &[])? {
            if out.contains(":ISTIO_PRERT") || out.contains(":ISTIO_OUTPUT") {
                found.push(tool);
            }
        }
    }
    Ok(found)
}

/// Removes Istio's chains (and the jumps to them) with `tools`.
pub fn remove_istio_rules(netns: &Netns, tools: &[&str]) -> Result<(), MigrateError> {
    for tool in tools {
        for (table, hook, chain) in CHAINS {
            // The jump may be absent (a partial install): only flush/delete must work.
            let _ = run(netns, tool, &["-t", table, "-D", hook, "-j", chain])?;
            for op in ["-F", "-X"] {
                if let Some((false, _, stderr)) = run(netns, tool, &["-t", table, op, chain])? {
                    if !stderr.contains("No chain") && !stderr.contains("does not exist") {
                        return Err(MigrateError::Failed {
                            cmd: format!("{tool} -t {table} {op} {chain}"),
                            stderr: stderr.trim().into(),
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

impl Netns {
    fn as_fd_raw(&self) -> i32 {
        use std::os::fd::AsFd;
        self.as_fd().as_raw_fd()
    }
}

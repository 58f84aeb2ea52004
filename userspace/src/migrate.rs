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

/// Per family: the nf_tables and legacy tools (istio-cni uses whichever its
/// host uses, and our image's default may be the other), the kernel file that
/// exists only when legacy tables are in use anywhere on the node, and the
/// plain tools for hosts that ship no variants.
const TOOLS: [(&str, &str, &str, &str, &str); 2] = [
    (
        "iptables-nft",
        "iptables-legacy",
        "/proc/net/ip_tables_names",
        "iptables",
        "-save",
    ),
    (
        "ip6tables-nft",
        "ip6tables-legacy",
        "/proc/net/ip6_tables_names",
        "ip6tables",
        "-save",
    ),
];

/// The iptables tools whose rule set holds Istio's chains.
pub fn istio_rules(netns: &Netns) -> Result<Vec<&'static str>, MigrateError> {
    let mut found = Vec::new();
    for (nft, legacy, legacy_in_use, plain, save) in TOOLS {
        let mut tools = vec![nft];
        if std::path::Path::new(legacy_in_use).exists() {
            tools.push(legacy);
        }
        let mut ran = false;
        for tool in tools.into_iter().chain(std::iter::once(plain)) {
            if ran && tool == plain {
                break;
            }
            let Some((ok, out, _)) = run(netns, &format!("{tool}{save}"), &[])? else {
                continue;
            };
            ran = true;
            if ok && (out.contains(":ISTIO_PRERT") || out.contains(":ISTIO_OUTPUT")) {
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

//! Taking over a pod from istio-cni: a pod captured by Istio's in-pod
//! iptables rules (the cluster switched node agents) is enrolled with sluice
//! first, then Istio's `ISTIO_*` chains are removed — so there is no moment
//! without capture. The policy rule and table-100 route Istio installs are the
//! same as sluice's and stay. Uses the iptables tools, as istio-cni does.

use std::{path::Path, process::Command};

use crate::netns::{Netns, NetnsError};

const CHAINS: [(&str, &str, &str); 4] = [
    ("mangle", "PREROUTING", "ISTIO_PRERT"),
    ("mangle", "OUTPUT", "ISTIO_OUTPUT"),
    ("nat", "PREROUTING", "ISTIO_PRERT"),
    ("nat", "OUTPUT", "ISTIO_OUTPUT"),
];

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("running {cmd} in the pod netns: {source}")]
    Exec { cmd: String, source: std::io::Error },
    #[error("{cmd} failed in the pod netns: {stderr}")]
    Failed { cmd: String, stderr: String },
    #[error("{cmd} did not finish within {secs} s in the pod netns: killed", secs = CHILD_TIMEOUT.as_secs())]
    TimedOut { cmd: String },
}

/// An iptables tool answers a pod netns in milliseconds; one that hangs (a
/// stuck xtables lock, a broken binary) is killed after this, and the
/// enrollment backs out with the reason instead of holding the dataplane.
pub const CHILD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs an iptables tool (in the calling thread's netns: the child inherits
/// it), killed after [`CHILD_TIMEOUT`]; `None` when the tool is not installed.
fn run(bin: &str, args: &[&str]) -> Result<Option<(bool, String, String)>, MigrateError> {
    let cmd = || format!("{bin} {}", args.join(" "));
    let child = match Command::new(bin)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(MigrateError::Exec { cmd: cmd(), source }),
    };
    let pid = child.id() as i32;
    // The output is read to the end by a thread of its own (a full pipe
    // must not stall the tool), and waited for here with a deadline.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(CHILD_TIMEOUT) {
        Ok(Ok(o)) => Ok(Some((
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        ))),
        Ok(Err(source)) => Err(MigrateError::Exec { cmd: cmd(), source }),
        Err(_) => {
            // SAFETY: kill(2) on the child's pid. It is reaped only by the
            // thread above, once it has died: a pid reused in between would
            // need the tool to exit within this very instant.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            Err(MigrateError::TimedOut { cmd: cmd() })
        }
    }
}

/// Per family: the nf_tables and legacy tools (istio-cni uses whichever its
/// host uses, and our image's default may be the other), the kernel file that
/// exists only when legacy tables are in use anywhere on the node, and the
/// plain tool for hosts that ship no variants.
const TOOLS: [(&str, &str, &str, &str); 2] = [
    (
        "iptables-nft",
        "iptables-legacy",
        "/proc/net/ip_tables_names",
        "iptables",
    ),
    (
        "ip6tables-nft",
        "ip6tables-legacy",
        "/proc/net/ip6_tables_names",
        "ip6tables",
    ),
];

/// Whether `tool`'s rule set holds Istio's chains; `None`: not installed.
fn has_istio_chains(tool: &str) -> Result<Option<bool>, MigrateError> {
    Ok(run(&format!("{tool}-save"), &[])?
        .map(|(ok, out, _)| ok && (out.contains(":ISTIO_PRERT") || out.contains(":ISTIO_OUTPUT"))))
}

/// The iptables tools whose rule set in `netns` holds Istio's chains.
pub fn istio_rules(netns: &Netns) -> Result<Vec<&'static str>, MigrateError> {
    netns.run(|| {
        let mut found = Vec::new();
        for (nft, legacy, legacy_in_use, plain) in TOOLS {
            let mut ran = false;
            for tool in [nft, legacy] {
                if tool == legacy && !Path::new(legacy_in_use).exists() {
                    continue;
                }
                if let Some(hit) = has_istio_chains(tool)? {
                    ran = true;
                    if hit {
                        found.push(tool);
                    }
                }
            }
            if !ran && has_istio_chains(plain)? == Some(true) {
                found.push(plain);
            }
        }
        Ok(found)
    })?
}

/// Removes Istio's chains (and the jumps to them) from `netns` with `tools`.
pub fn remove_istio_rules(netns: &Netns, tools: &[&str]) -> Result<(), MigrateError> {
    netns.run(|| {
        for tool in tools {
            for (table, hook, chain) in CHAINS {
                // The jump may be absent (a partial install): only flush/delete must work.
                let _ = run(tool, &["-t", table, "-D", hook, "-j", chain])?;
                for op in ["-F", "-X"] {
                    if let Some((false, _, stderr)) = run(tool, &["-t", table, op, chain])? {
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
    })?
}

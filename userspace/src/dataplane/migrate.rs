//! Taking over a pod from istio-cni: a pod captured by Istio's in-pod
//! iptables rules (the cluster switched node agents) is enrolled with sluice
//! first, then Istio's `ISTIO_*` chains are removed — so there is no moment
//! without capture. The policy rule and table-100 route Istio installs are the
//! same as sluice's and stay. Uses the iptables tools, as istio-cni does.

use std::process::Command;

use crate::podnet::netns::{Netns, NetnsError};

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
    #[error("reading {path} in the pod netns: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
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
/// host uses, and our image's default may be the other), the netns' list of
/// its legacy tables, and the plain tool for hosts that ship no variants.
const TOOLS: [(&str, &str, &str, &str); 2] = [
    ("iptables-nft", "iptables-legacy", LEGACY_V4, "iptables"),
    ("ip6tables-nft", "ip6tables-legacy", LEGACY_V6, "ip6tables"),
];

/// The per-netns lists of legacy tables ([`legacy_tables`]).
pub const LEGACY_V4: &str = "ip_tables_names";
pub const LEGACY_V6: &str = "ip6_tables_names";

/// Whether `tool`'s rule set holds Istio's chains; `None`: not installed.
/// A tool that fails still prints the tables it read before failing, and
/// Istio's chains there count. It is not an error: `iptables-nft-save`
/// fails on any table of iptables' names holding rules it cannot parse, as
/// a pod's own nftables rules may (`meta cpu`, sets), and refusing such a
/// pod would leave it uncaptured for good. Left: a failure before the tool
/// reached Istio's tables reads as none (istio-cni's rules would then stay
/// beside sluice's capture, both sending to ztunnel); it is logged.
fn has_istio_chains(tool: &str) -> Result<Option<bool>, MigrateError> {
    let cmd = format!("{tool}-save");
    let Some((ok, out, err)) = run(&cmd, &[])? else {
        return Ok(None);
    };
    let found = out.contains(":ISTIO_PRERT") || out.contains(":ISTIO_OUTPUT");
    if !ok && !found {
        tracing::warn!(%cmd, stderr = %err.trim(), "cannot read the pod's whole iptables rule set: taken as without istio-cni's rules");
    }
    Ok(Some(found))
}

/// Whether the calling thread's netns has legacy iptables tables of the
/// family whose list is `names`: the kernel makes a netns' legacy tables on
/// their first use there, so a netns no legacy tool ever touched lists none
/// (and a kernel without legacy iptables has no list). `/proc/thread-self`:
/// `/proc/net` is the netns of the process's main thread, not this one's.
/// An error other than the list missing (out of descriptors, say) cannot
/// tell.
pub fn legacy_tables(names: &str) -> std::io::Result<bool> {
    match std::fs::read(format!("/proc/thread-self/net/{names}")) {
        Ok(list) => Ok(!list.iter().all(u8::is_ascii_whitespace)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// The iptables tools whose rule set in `netns` holds Istio's chains. istio-cni's
/// rules can only be where the netns has iptables tables at all: a netns
/// without nf_tables tables (one netlink dump) and without legacy tables
/// (a proc file) — every pod istio-cni never captured — is answered without
/// running the tools, which cost milliseconds per enrollment.
pub fn istio_rules(netns: &Netns) -> Result<Vec<&'static str>, MigrateError> {
    netns.run(|| {
        let no_nft_rules = nf_tables_count() == Some(0);
        let mut found = Vec::new();
        for (nft, legacy, legacy_names, plain) in TOOLS {
            let mut answered = no_nft_rules;
            for tool in [nft, legacy] {
                let skip = if tool == nft {
                    no_nft_rules
                } else {
                    !legacy_tables(legacy_names).map_err(|source| MigrateError::Read {
                        path: format!("/proc/thread-self/net/{legacy_names}"),
                        source,
                    })?
                };
                if skip {
                    continue;
                }
                if let Some(hit) = has_istio_chains(tool)? {
                    answered = true;
                    if hit {
                        found.push(tool);
                    }
                }
            }
            if !answered && has_istio_chains(plain)? == Some(true) {
                found.push(plain);
            }
        }
        Ok(found)
    })?
}

/// How many nf_tables tables the calling thread's netns has (every family:
/// iptables-nft makes `ip`/`ip6` ones), from one `NFT_MSG_GETTABLE` dump;
/// `None` when the kernel does not answer it. Hand-rolled: the netlink
/// crates sluice uses have no nf_tables messages, and this needs only the
/// count of one dump.
pub fn nf_tables_count() -> Option<usize> {
    use netlink_sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr};
    const NFNL_SUBSYS_NFTABLES: u16 = 10;
    const NFT_MSG_NEWTABLE: u16 = 0;
    const NFT_MSG_GETTABLE: u16 = 1;
    const NLMSG_ERROR: u16 = 2;
    const NLMSG_DONE: u16 = 3;
    const REQUEST_DUMP: u16 = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    let mut sock = Socket::new(NETLINK_NETFILTER).ok()?;
    sock.bind_auto().ok()?;
    // nlmsghdr (len, type, flags, seq, pid) + nfgenmsg (family AF_UNSPEC,
    // version 0, res_id 0).
    let mut req = Vec::with_capacity(20);
    req.extend_from_slice(&20u32.to_ne_bytes());
    req.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE).to_ne_bytes());
    req.extend_from_slice(&REQUEST_DUMP.to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    req.extend_from_slice(&[0, 0, 0, 0]);
    sock.send_to(&req, &SocketAddr::new(0, 0), 0).ok()?;
    let mut tables = 0;
    loop {
        let (buf, _) = sock.recv_from_full().ok()?;
        let mut rest = &buf[..];
        while rest.len() >= 16 {
            let len = u32::from_ne_bytes(rest[0..4].try_into().ok()?) as usize;
            let kind = u16::from_ne_bytes(rest[4..6].try_into().ok()?);
            if len < 16 || len > rest.len() {
                return None;
            }
            match kind {
                NLMSG_DONE => return Some(tables),
                NLMSG_ERROR => return None,
                k if k == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE => tables += 1,
                _ => {}
            }
            // Messages are 4-byte aligned.
            rest = &rest[len.next_multiple_of(4).min(rest.len())..];
        }
        if buf.is_empty() {
            return None;
        }
    }
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

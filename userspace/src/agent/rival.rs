//! Another node agent on this node: istio-cni's, or a second sluice. Found
//! by the ZDS socket something already listens on before this agent binds it
//! (read from `/proc/net/unix`, never by connecting: a connection would look
//! like a ztunnel to that agent). Two node agents would both chain a plugin
//! into the conflist, both capture pods and take turns serving ztunnel; so
//! sluice refuses and says why, unless told to take over
//! (`--take-over-node-agent`), and starts once the other is gone.

use std::{
    fmt,
    path::{Path, PathBuf},
};

use super::{
    config::Config,
    hold::{report_only, OnUninstall},
};
use crate::readiness::{Condition, Reason};

/// `__SO_ACCEPTCON` in `/proc/net/unix`'s Flags column: a listening socket.
const ACCEPTCON: u32 = 1 << 16;

/// A process listening on the ZDS socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rival {
    pub socket: PathBuf,
    /// The process holding it, when it can be found in procfs.
    pub pid: Option<u32>,
    pub command: Option<String>,
}

impl fmt::Display for Rival {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let who = match (&self.command, self.pid) {
            // istio-cni's node agent runs as install-cni.
            (Some(c), Some(p)) if c == "install-cni" => {
                format!("istio-cni's node agent (pid {p}, {c})")
            }
            (Some(c), Some(p)) => format!("another process (pid {p}, {c})"),
            _ => "another process".into(),
        };
        write!(f, "{who} serves ztunnel on {}", self.socket.display())
    }
}

/// Who listens on `socket`, if anyone (procfs at `proc`, the node's: the
/// agent runs with hostNetwork and hostPID).
pub fn listening_on(socket: &Path, proc: &Path) -> Option<Rival> {
    let table = std::fs::read_to_string(proc.join("net/unix")).ok()?;
    let inode = listener_inode(&table, socket)?;
    let pid = owner(proc, inode);
    let command = pid.and_then(|p| {
        std::fs::read_to_string(proc.join(p.to_string()).join("comm"))
            .ok()
            .map(|c| c.trim().to_owned())
    });
    Some(Rival {
        socket: socket.to_owned(),
        pid,
        command,
    })
}

/// The inode of the listening socket bound at `path` in a `/proc/net/unix`
/// table (`Num RefCount Protocol Flags Type St Inode Path`).
fn listener_inode(table: &str, path: &Path) -> Option<u64> {
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (flags, inode, bound) = (f.get(3)?, f.get(6)?, f.get(7)?);
        let listening = u32::from_str_radix(flags, 16).is_ok_and(|v| v & ACCEPTCON != 0);
        (listening && Path::new(bound) == path)
            .then(|| inode.parse().ok())
            .flatten()
    })
}

/// The process with a descriptor on socket `inode`.
fn owner(proc: &Path, inode: u64) -> Option<u32> {
    let link = format!("socket:[{inode}]");
    std::fs::read_dir(proc).ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let fds = std::fs::read_dir(e.path().join("fd")).ok()?;
        fds.flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == link.as_str()))
            .then_some(pid)
    })
}

/// How often a refusing agent looks again for the other one.
const EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// With another node agent on the ZDS socket: reports it (node condition
/// False `AnotherNodeAgent`, `/readyz` 503) and waits until it is gone. True:
/// the agent may start (no rival, or it left); false: stopped meanwhile.
pub async fn wait_until_gone(
    cfg: &Config,
    term: &mut tokio::signal::unix::Signal,
) -> anyhow::Result<bool> {
    let proc = Path::new("/proc");
    let Some(rival) = listening_on(&cfg.zds_socket, proc) else {
        return Ok(true);
    };
    tracing::error!(%rival, "another node agent runs on this node: not starting (--take-over-node-agent replaces it)");
    let condition = Condition {
        ready: false,
        reason: Reason::AnotherNodeAgent,
        message: format!(
            "{rival}: two node agents would both capture pods and take turns serving ztunnel, so sluice does not start; remove the other (helm uninstall istio-cni) or set takeOverNodeAgent"
        ),
    };
    let socket = cfg.zds_socket.clone();
    let gone = async move {
        while listening_on(&socket, proc).is_some() {
            tokio::time::sleep(EVERY).await;
        }
        tracing::info!("the other node agent is gone: starting");
    };
    report_only(cfg, condition, gone, OnUninstall::Leave, term).await
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\
Num       RefCount Protocol Flags    Type St Inode Path
0000000000000000: 00000002 00000000 00010000 0001 01 31337 /var/run/ztunnel/ztunnel.sock
0000000000000000: 00000003 00000000 00000000 0001 03 31338 /var/run/ztunnel/ztunnel.sock
0000000000000000: 00000002 00000000 00010000 0001 01 4242 /run/other.sock
0000000000000000: 00000002 00000000 00010000 0005 01 777
";

    #[test]
    fn only_a_listener_on_the_very_path_counts() {
        let zds = Path::new("/var/run/ztunnel/ztunnel.sock");
        assert_eq!(listener_inode(TABLE, zds), Some(31337));
        assert_eq!(listener_inode(TABLE, Path::new("/run/none.sock")), None);
        // A connected (not listening) socket on the path is no rival.
        let connected_only: String = TABLE
            .lines()
            .filter(|l| !l.contains("31337"))
            .collect::<Vec<_>>()
            .join("\n");
        assert_eq!(listener_inode(&connected_only, zds), None);
    }

    #[test]
    fn this_process_is_found_listening_on_its_own_socket() {
        let dir = std::env::temp_dir().join(format!("sluice-rival-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("zds.sock");
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let rival = listening_on(&path, Path::new("/proc")).expect("a listener");
        assert_eq!(rival.pid, Some(std::process::id()));
        assert!(rival.to_string().contains("serves ztunnel on"), "{rival}");
        drop(listener);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(listening_on(&path, Path::new("/proc")), None);
    }
}

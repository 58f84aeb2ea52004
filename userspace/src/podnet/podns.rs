//! Finding the netns of a pod that did not come through our CNI plugin (it
//! existed before the agent, or became ambient later): a process in the pod's
//! cgroup whose netns holds one of the pod's IPs names it, and the runtime's
//! bind mount under /run/netns (stable, unlike /proc/PID) is preferred when
//! there is one. Runtimes without an infra process still have the pod's
//! containers in that cgroup.

use std::{
    collections::HashSet,
    fs,
    net::IpAddr,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use crate::podnet::netns::Netns;

/// Directories where runtimes bind-mount pod netns files.
pub const NETNS_DIRS: [&str; 2] = ["/run/netns", "/var/run/netns"];

/// Whether a /proc/PID/cgroup text puts the process in pod `uid` (cgroupfs
/// `pod<uid>`, or systemd `pod<uid with '_'>`).
pub fn in_pod_cgroup(cgroup: &str, uid: &str) -> bool {
    let systemd = uid.replace('-', "_");
    cgroup
        .lines()
        .any(|l| l.contains(&format!("pod{uid}")) || l.contains(&format!("pod{systemd}")))
}

/// The netns path of pod `uid`: that of a process in the pod's cgroup whose
/// netns holds one of `ips`, the pod's `status.podIPs` (istio-cni 1.31 does
/// the same). A process of the pod's cgroup can live in another netns: a
/// runtime shim in the host's (never taken), or a privileged container's
/// process after `unshare -n`, whichever comes first in /proc. Without the
/// address check that netns would be captured and handed to ztunnel as the
/// pod's, and the pod itself left uncaptured. Among netns that hold an
/// address, the one the runtime bind-mounted under /run/netns is preferred.
/// No `ips` (none reported yet): nothing is found. Blocking: it enters each
/// candidate netns once.
pub fn find(uid: &str, ips: &[IpAddr]) -> Option<PathBuf> {
    if ips.is_empty() {
        return None;
    }
    let mut seen = HashSet::new();
    let mut holding = None;
    for e in fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let in_pod = fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .is_ok_and(|cg| in_pod_cgroup(&cg, uid));
        if !in_pod {
            continue;
        }
        let path = PathBuf::from(format!("/proc/{pid}/ns/net"));
        let Ok(md) = fs::metadata(&path) else {
            continue;
        };
        if !seen.insert((md.dev(), md.ino())) {
            continue;
        }
        let Ok(ns) = Netns::open(&path) else { continue };
        if ns.host_like().is_some() || !holds_any(&ns, ips) {
            continue;
        }
        match bind_mount_of(md.ino()) {
            Some(mount) => return Some(mount),
            None => {
                holding.get_or_insert(path);
            }
        }
    }
    holding
}

/// Whether `path` names a netns, not the host's, with one of `ips` on an
/// interface: a path recorded earlier (`/proc/<pid>/ns/net` names another
/// netns once the pid is reused) checked against the pod's addresses now.
/// Blocking.
pub fn holds(path: &Path, ips: &[IpAddr]) -> bool {
    Netns::open(path).is_ok_and(|ns| ns.host_like().is_none() && holds_any(&ns, ips))
}

/// Whether `ns` has one of `ips` on an interface.
fn holds_any(ns: &Netns, ips: &[IpAddr]) -> bool {
    ns.run(crate::podnet::netns::addresses)
        .ok()
        .and_then(Result::ok)
        .is_some_and(|have| have.iter().any(|a| ips.contains(a)))
}

/// The netns whose cookie is `cookie`, if it still exists: looked for among
/// the runtimes' bind mounts, then every process's netns (each netns asked
/// once). A cookie is never reused while the machine runs, so a match is
/// that very netns. Never the host's or this process's own. For pins left
/// without their state entry: the rare case, so a walk of /proc is fine.
pub fn find_by_cookie(cookie: u64) -> Option<Netns> {
    let mounts = NETNS_DIRS
        .iter()
        .filter_map(|d| fs::read_dir(d).ok())
        .flat_map(|dir| dir.flatten().map(|e| e.path()));
    let procs = fs::read_dir("/proc")
        .into_iter()
        .flat_map(|dir| dir.flatten())
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.parse::<u32>().is_ok())
        })
        .map(|e| e.path().join("ns/net"));
    let mut seen = HashSet::new();
    mounts.chain(procs).find_map(|path| {
        let md = fs::metadata(&path).ok()?;
        if !seen.insert((md.dev(), md.ino())) {
            return None;
        }
        let ns = Netns::open(&path).ok()?;
        (ns.host_like().is_none() && ns.cookie().ok()? == cookie).then_some(ns)
    })
}

/// The /run/netns file for the netns with inode `ino`, if any.
fn bind_mount_of(ino: u64) -> Option<PathBuf> {
    NETNS_DIRS.iter().find_map(|d| {
        fs::read_dir(Path::new(d))
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| fs::metadata(p).is_ok_and(|m| m.ino() == ino))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_both_cgroup_drivers() {
        let uid = "5a1e0c3e-1b2a-4c9d-8e7f-0a1b2c3d4e5f";
        let systemd = "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod5a1e0c3e_1b2a_4c9d_8e7f_0a1b2c3d4e5f.slice/cri-containerd-abc.scope";
        let cgroupfs = "4:memory:/kubepods/burstable/pod5a1e0c3e-1b2a-4c9d-8e7f-0a1b2c3d4e5f/abc";
        assert!(in_pod_cgroup(systemd, uid));
        assert!(in_pod_cgroup(cgroupfs, uid));
        assert!(!in_pod_cgroup("0::/user.slice", uid));
    }
}

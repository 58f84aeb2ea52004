//! Finding the netns of a pod that did not come through our CNI plugin (it
//! existed before the agent, or became ambient later): a process in the pod's
//! cgroup names it, and the runtime's bind mount under /run/netns (stable,
//! unlike /proc/PID) is preferred when there is one. Runtimes without an infra
//! process still have the pod's containers in that cgroup.

use std::{
    collections::HashSet,
    fs,
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

/// The netns path of pod `uid`, if one of its processes runs here. A
/// process of the pod's cgroup in the host's network namespace (a runtime
/// shim such as conmon) or in sluice's own is never taken for the pod's.
pub fn find(uid: &str) -> Option<PathBuf> {
    let pid = fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cg = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        let ns = PathBuf::from(format!("/proc/{pid}/ns/net"));
        (in_pod_cgroup(&cg, uid) && crate::podnet::netns::path_is_host_like(&ns).is_none())
            .then_some(pid)
    })?;
    let proc_path = PathBuf::from(format!("/proc/{pid}/ns/net"));
    let ino = fs::metadata(&proc_path).ok()?.ino();
    Some(bind_mount_of(ino).unwrap_or(proc_path))
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

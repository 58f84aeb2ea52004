//! Network namespaces sluice never captures: the host's (pid 1's, which every
//! hostNetwork pod shares) and the caller's own. The plugin checks a sandbox
//! path before it asks the agent; the agent checks every netns it is handed.

use std::{os::unix::fs::MetadataExt as _, path::Path, sync::OnceLock};

/// Why the netns with nsfs identity `id` (device, inode) must never be
/// captured, if it must not.
pub fn host_like_id(id: (u64, u64)) -> Option<&'static str> {
    // Neither changes while the process runs (its threads enter pod netns
    // one at a time and come back; /proc/self is the main thread's): read
    // once, not per pod (each is a /proc lookup).
    // An unreadable file is asked again next time, never remembered as none.
    static HOST: OnceLock<(u64, u64)> = OnceLock::new();
    static OWN: OnceLock<(u64, u64)> = OnceLock::new();
    let of = |cell: &OnceLock<(u64, u64)>, p: &str| {
        cell.get().copied().or_else(|| {
            let m = std::fs::metadata(p).ok()?;
            Some(*cell.get_or_init(|| (m.dev(), m.ino())))
        })
    };
    if of(&HOST, "/proc/1/ns/net") == Some(id) {
        Some("the host's network namespace (pid 1's, shared by hostNetwork pods)")
    } else if of(&OWN, "/proc/self/ns/net") == Some(id) {
        Some("sluice's own network namespace")
    } else {
        None
    }
}

/// [`host_like_id`] for a netns path, without opening it.
pub fn path_is_host_like(path: &Path) -> Option<&'static str> {
    let m = std::fs::metadata(path).ok()?;
    host_like_id((m.dev(), m.ino()))
}

//! Net sysctls of the calling thread's netns, through a procfs mount (default
//! `/proc`). Net sysctl files answer for the netns of the thread that opens
//! them, whichever procfs mount they are opened through; so where `/proc/sys`
//! is read-only (any non-privileged container), a writable mount of the host's
//! procfs (`--proc-dir /host/proc`, a hostPath volume) does the same job.

use std::{
    io,
    path::{Path, PathBuf},
    sync::OnceLock,
};

static PROC: OnceLock<PathBuf> = OnceLock::new();

/// Uses `dir` as the procfs mount for every later sysctl (first call wins).
pub fn use_proc_dir(dir: &Path) {
    let _ = PROC.set(dir.to_owned());
}

fn path(name: &str) -> PathBuf {
    PROC.get()
        .map(PathBuf::as_path)
        .unwrap_or(Path::new("/proc"))
        .join("sys")
        .join(name)
}

/// Reads sysctl `name` (e.g. `net/ipv4/tcp_migrate_req`).
pub fn read(name: &str) -> io::Result<String> {
    std::fs::read_to_string(path(name)).map(|v| v.trim().to_owned())
}

/// Writes sysctl `name`; the error names the file.
pub fn write(name: &str, value: &str) -> Result<(), (PathBuf, io::Error)> {
    let p = path(name);
    std::fs::write(&p, value).map_err(|e| (p, e))
}

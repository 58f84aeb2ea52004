//! The node's CNI config directory as a container runtime reads it: the
//! `.conflist`, `.conf` and `.json` files in byte order of their names, the
//! first one in force (libcni's `ConfFiles`, as containerd and CRI-O load
//! it); and durable replacement of a file there.

use std::{
    fs,
    io::Write as _,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use serde_json::Value;

use super::error::{io, InstallError};

/// One config file, parsed (or why not).
#[derive(Debug)]
pub struct ConfFile {
    pub path: PathBuf,
    pub json: Result<Value, String>,
}

impl ConfFile {
    pub fn name(&self) -> &str {
        self.path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
    }

    /// The parsed file, or the error a runtime would meet reading it.
    pub fn parsed(&self) -> Result<&Value, InstallError> {
        self.json.as_ref().map_err(|msg| InstallError::Config {
            path: self.path.clone(),
            msg: msg.clone(),
        })
    }

    /// The plugin entries: a conflist's `plugins`, or a single-plugin
    /// `.conf` itself. Empty when unparsable.
    pub fn plugins(&self) -> Vec<&Value> {
        self.json.as_ref().map(plugins).unwrap_or_default()
    }
}

/// A config's plugin entries (see [`ConfFile::plugins`]).
pub fn plugins(v: &Value) -> Vec<&Value> {
    match v.get("plugins").and_then(Value::as_array) {
        Some(list) => list.iter().collect(),
        None if v.get("type").is_some() => vec![v],
        None => Vec::new(),
    }
}

/// The `type` of each plugin entry, in order.
pub fn plugin_types(v: &Value) -> Vec<&str> {
    plugins(v)
        .into_iter()
        .filter_map(|p| p.get("type").and_then(Value::as_str))
        .collect()
}

/// Every config file of `dir`, sorted as the runtime sorts them.
pub fn list(dir: &Path) -> Result<Vec<ConfFile>, InstallError> {
    let mut paths: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(io(format!("reading {}", dir.display())))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && is_config(p))
        .collect();
    paths.sort();
    Ok(paths
        .into_iter()
        .map(|path| {
            let json = fs::read(&path)
                .map_err(|e| format!("reading: {e}"))
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()));
            ConfFile { path, json }
        })
        .collect())
}

fn is_config(p: &Path) -> bool {
    matches!(
        p.extension().and_then(|e| e.to_str()),
        Some("conflist" | "conf" | "json")
    )
}

#[cfg(test)]
pub fn read_json(p: &Path) -> Result<Value, InstallError> {
    let b = fs::read(p).map_err(io(format!("reading {}", p.display())))?;
    serde_json::from_slice(&b).map_err(|e| InstallError::Config {
        path: p.to_owned(),
        msg: e.to_string(),
    })
}

/// Replaces `p` with `v`, durably: written to a hidden temp file the runtime
/// does not read (`.<name>.sluice-tmp`), flushed to disk, renamed over `p`,
/// and the directory flushed. Without the flushes a power loss right after
/// can leave an empty file that sorts first: the runtime then fails every
/// pod's network, or skips it and starts pods without sluice-cni.
///
/// The file gets the permissions of `like` (the file it replaces, or the
/// primary's it is made from), 0600 when that is gone: a primary kept
/// private (CIS 1.1.9) is not copied or rewritten readable to all.
pub fn write_json(p: &Path, v: &Value, like: &Path) -> Result<(), InstallError> {
    let dir = p.parent().unwrap_or(Path::new("."));
    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("conf");
    let tmp = dir.join(format!(".{name}.sluice-tmp"));
    let body = serde_json::to_vec_pretty(v).expect("JSON values serialise");
    let like = fs::metadata(like).ok();
    let mode = like
        .as_ref()
        .map_or(0o600, |m| m.permissions().mode() & 0o7777);
    let write = || -> std::io::Result<()> {
        // A temp file a crash left may be read-only (the mode of a
        // read-only primary): written anew, not opened.
        let _ = fs::remove_file(&tmp);
        let mut f = fs::File::create(&tmp)?;
        f.write_all(&body)?;
        f.sync_all()?;
        // Set once written, not asked at creation: the umask would take
        // bits away, and a read-only mode would stop the write.
        if let Some(m) = &like {
            std::os::unix::fs::fchown(&f, None, Some(std::os::unix::fs::MetadataExt::gid(m)))?;
        }
        f.set_permissions(fs::Permissions::from_mode(mode))
    };
    if let Err(e) = write() {
        let _ = fs::remove_file(&tmp);
        return Err(io(format!("writing {}", tmp.display()))(e));
    }
    fs::rename(&tmp, p).map_err(io(format!("replacing {}", p.display())))?;
    sync_dir(dir)
}

/// Removes `p` if it is there (durably, as [`write_json`]).
pub fn remove(p: &Path) -> Result<(), InstallError> {
    match fs::remove_file(p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(io(format!("removing {}", p.display()))(e))
        }
        _ => sync_dir(p.parent().unwrap_or(Path::new("."))),
    }
}

pub fn sync_dir(dir: &Path) -> Result<(), InstallError> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(format!("flushing {}", dir.display())))
}

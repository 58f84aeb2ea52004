//! What the CNI plugin needs to decide about a pod while the agent is down:
//! which namespaces were ambient when the agent last looked. The agent writes
//! it (atomically, on every change it sees) beside its control socket, on the
//! host's tmpfs; the plugin only reads it.
//!
//! With the agent down, a pod of an ambient namespace waits (the runtime
//! retries ADD) and any other pod starts. A pod selected only by its own
//! `istio.io/dataplane-mode=ambient` label in a namespace that is not ambient
//! cannot be told apart here (CNI carries no labels): it starts, and the
//! agent's pod watch captures it when it is back.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

/// The snapshot's file name, in the control socket's directory.
pub const FILE_NAME: &str = "selection.json";

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    /// Namespaces labelled `istio.io/dataplane-mode=ambient`.
    pub ambient_namespaces: BTreeSet<String>,
    /// When the agent wrote it (seconds since the Unix epoch), for messages.
    pub written_at: u64,
}

/// The snapshot path that goes with a control socket path.
pub fn path_for(control_socket: &Path) -> PathBuf {
    control_socket
        .parent()
        .unwrap_or(Path::new("/"))
        .join(FILE_NAME)
}

pub fn read(path: &Path) -> std::io::Result<Snapshot> {
    let bytes = std::fs::read(path)?;
    serde_json::from_slice(&bytes).map_err(std::io::Error::other)
}

/// Writes the snapshot unless the file already says the same namespaces;
/// returns whether it wrote. Atomic (temp file, rename): the plugin never
/// reads half a file.
pub fn write_if_changed(path: &Path, ambient: &BTreeSet<String>) -> std::io::Result<bool> {
    if read(path).is_ok_and(|s| &s.ambient_namespaces == ambient) {
        return Ok(false);
    }
    let s = Snapshot {
        ambient_namespaces: ambient.clone(),
        written_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(&s).map_err(std::io::Error::other)?)?;
    std::fs::rename(&tmp, path)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_once_per_change_and_read_back() {
        let dir = std::env::temp_dir().join(format!("sluice-snapshot-{}", std::process::id()));
        let path = dir.join(FILE_NAME);
        let a: BTreeSet<String> = ["shop".to_string()].into();
        assert!(write_if_changed(&path, &a).unwrap());
        assert!(!write_if_changed(&path, &a).unwrap());
        assert_eq!(read(&path).unwrap().ambient_namespaces, a);
        let b: BTreeSet<String> = ["shop".to_string(), "cart".to_string()].into();
        assert!(write_if_changed(&path, &b).unwrap());
        assert_eq!(read(&path).unwrap().ambient_namespaces, b);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

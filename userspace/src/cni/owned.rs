//! Owned mode (the default; istio-cni's `istioOwnedCNIConfig`): sluice
//! writes a conflist of its own, named to sort before the primary network's
//! file, holding the primary's chain with sluice-cni after it. The primary's
//! file is never written. A primary CNI that rewrites its file at boot
//! (dropping every plugin it does not know) therefore cannot take sluice-cni
//! out of the chain the runtime uses: the owned file is still on disk, read
//! first, and brought in step with the primary's new content.

use std::{fmt, path::Path, str::FromStr};

use serde_json::{json, Value};

use super::{
    conf_dir::{self, plugins, ConfFile},
    entry::{is_istio, is_ours, Entry},
    error::InstallError,
    inplace::{self, Restored},
    layout::Layout,
};

/// `--owned-cni-config-filename`'s default (istio-cni's is
/// `02-istio-cni.conflist`).
pub const DEFAULT_NAME: &str = "02-sluice.conflist";

/// The owned conflist's file name: a bare name of `[A-Za-z0-9._-]`, not
/// hidden, ending in `.conflist`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileName(String);

impl FileName {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for FileName {
    fn default() -> Self {
        Self(DEFAULT_NAME.into())
    }
}

impl fmt::Display for FileName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for FileName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let ok_chars = s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !ok_chars {
            return Err(format!(
                "{s:?}: a file name in the CNI conf dir, of letters, digits, '.', '_' and '-'"
            ));
        }
        if s.starts_with('.') || !s.ends_with(".conflist") || s == ".conflist" {
            return Err(format!(
                "{s:?}: must end in .conflist and not start with '.' (the runtime reads only such files); e.g. {DEFAULT_NAME}"
            ));
        }
        Ok(Self(s.into()))
    }
}

/// The owned file for the primary `base` (named `primary_name`, sluice's
/// in-place entry already out of it). The primary's object whole: its
/// `name` keys host-local's address leases and the runtime's result cache,
/// so it must not change. Its chain without sluice-cni and istio-cni; then
/// the plugins another tool put into the owned file (tools that chain into
/// "the first conflist" edit this one now, and are kept rather than fought);
/// then sluice-cni, marked with the primary's name and the plugin types
/// copied from it (so a plugin the primary drops is dropped here too, and
/// not kept as another tool's).
pub fn desired(primary_name: &str, base: &Value, current: Option<&Value>, entry: &Entry) -> Value {
    let mut conf = match base.get("plugins") {
        Some(_) => base.clone(),
        // A single-plugin .conf, wrapped as the runtime reads it.
        None => {
            let mut single = base.clone();
            let (mut version, mut name) = (json!("1.0.0"), json!("k8s-pod-network"));
            if let Value::Object(m) = &mut single {
                version = m.remove("cniVersion").unwrap_or(version);
                name = m.remove("name").unwrap_or(name);
            }
            json!({ "cniVersion": version, "name": name, "plugins": [single] })
        }
    };
    let chain: Vec<Value> = plugins(&conf)
        .into_iter()
        .filter(|p| !is_ours(p) && !is_istio(p))
        .cloned()
        .collect();
    let copied: Vec<&str> = chain
        .iter()
        .filter_map(|p| p.get("type").and_then(Value::as_str))
        .collect();
    let foreign: Vec<Value> = current
        .map(|c| {
            let before: Vec<&str> = plugins(c)
                .into_iter()
                .filter(|p| is_ours(p))
                .filter_map(|p| p.pointer("/sluice/copied").and_then(Value::as_array))
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            plugins(c)
                .into_iter()
                .filter(|p| !is_ours(p) && !is_istio(p))
                .filter(|p| {
                    let t = p.get("type").and_then(Value::as_str).unwrap_or_default();
                    !copied.contains(&t) && !before.contains(&t)
                })
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    let ours = entry.json(Some(json!({ "ownedFrom": primary_name, "copied": copied })));
    conf["plugins"] = Value::Array(chain.iter().cloned().chain(foreign).chain([ours]).collect());
    conf
}

/// What a pass did.
pub struct Synced {
    /// The owned file (now the first config).
    pub config: std::path::PathBuf,
    pub written: bool,
}

/// Brings the owned file `name` in step with the primary, then removes what
/// it supersedes: owned files under other names, istio-cni's owned file,
/// and an in-place entry of ours in the primary (moving from in-place mode).
/// Always in that order, so the chain the runtime reads never lacks
/// sluice-cni. On error nothing is written: the owned file stays as it was.
pub fn sync(
    dir: &Path,
    name: &FileName,
    files: &[ConfFile],
    entry: &Entry,
) -> Result<Synced, SyncError> {
    let layout = Layout::of(files, Some(name.as_str()));
    let primary = layout.primary(dir)?;
    let legacy = inplace::without_ours(primary)?;
    // The primary as it was before sluice's entry; for a converted list
    // whose original its CNI wrote anew since, that newer file.
    let newer = legacy
        .as_ref()
        .filter(|r| r.superseded())
        .and_then(|r| files.iter().find(|f| f.path == r.path));
    let base = legacy.as_ref().map(Restored::as_file);
    let base = newer.or(base.as_ref()).unwrap_or(primary);
    if name.as_str() >= base.name() {
        return Err(SyncError::SortsAfter {
            owned: name.clone(),
            primary: base.name().to_owned(),
        });
    }
    let target = dir.join(name.as_str());
    let current = layout
        .owned
        .iter()
        .find(|f| f.path == target)
        .and_then(|f| f.json.as_ref().ok());
    let want = desired(base.name(), base.parsed()?, current, entry);
    let written = current != Some(&want);
    if written {
        conf_dir::write_json(&target, &want, &primary.path)?;
    }
    for f in layout.owned.iter().filter(|f| f.path != target) {
        conf_dir::remove(&f.path)?;
    }
    for f in &layout.istio_owned {
        tracing::info!(config = %f.path.display(), "removing istio-cni's owned CNI config (sluice's owns the chain now)");
        conf_dir::remove(&f.path)?;
    }
    if let Some(r) = legacy {
        r.finish()?;
    }
    Ok(Synced {
        config: target,
        written,
    })
}

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// The runtime would read the primary first (e.g. Multus's
    /// `00-multus.conf`): the caller chains in place instead.
    #[error("the owned CNI config {owned} sorts after the primary {primary}: the runtime reads the primary first; chained into {primary} instead (pick an --owned-cni-config-filename that sorts first)")]
    SortsAfter { owned: FileName, primary: String },
    #[error(transparent)]
    Install(#[from] InstallError),
}

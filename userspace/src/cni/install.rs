//! Keeping `sluice-cni` in the node's CNI configuration: appended to the
//! primary network's conflist (a `.conf` becomes a `.conflist`), the binary
//! copied into the CNI bin dir, re-inserted whenever the primary CNI rewrites
//! its file, and removed again — exactly what was added — on uninstall.
//!
//! Files are replaced by write-to-temp + rename, so the runtime never reads a
//! half-written config and a running `sluice-cni` is never overwritten.

use std::{
    fs,
    path::{Path, PathBuf},
    time::Duration,
};

use serde_json::{json, Map, Value};
use tokio::sync::watch;
use tracing::{info, warn};

pub const PLUGIN_TYPE: &str = "sluice-cni";
pub const DEFAULT_CONF_DIR: &str = "/etc/cni/net.d";
pub const DEFAULT_BIN_DIR: &str = "/opt/cni/bin";
/// How often the conf dir is checked when no change was seen: a safety net
/// behind the inotify watch (the default of `--cni-recheck`).
pub const RECHECK: Duration = Duration::from_secs(5);
/// How often a conf dir that cannot be watched yet (not created yet) is
/// checked.
pub const POLL: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("no CNI network config in {0} yet (the primary CNI writes it)")]
    NoPrimary(PathBuf),
    #[error("{path}: {msg}")]
    Config { path: PathBuf, msg: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> InstallError {
    let what = what.into();
    move |source| InstallError::Io { what, source }
}

#[derive(Debug, Clone)]
pub struct CniInstall {
    pub conf_dir: PathBuf,
    pub bin_dir: PathBuf,
    /// The `sluice-cni` binary to copy (beside the running `sluice`).
    pub plugin: PathBuf,
    /// Put into our config entry for the plugin to find the agent.
    pub agent_socket: PathBuf,
    /// Put into our config entry: pods the plugin never asks the agent about.
    pub exclude_namespaces: Vec<String>,
    /// The safety-net check interval behind the watch ([`RECHECK`]).
    pub recheck: Duration,
}

/// What one pass changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    AlreadyInstalled(PathBuf),
    Inserted(PathBuf),
}

impl CniInstall {
    /// The primary network config: the lexicographically first `.conflist`,
    /// `.conf` or `.json` file, as container runtimes pick it.
    pub fn primary(&self) -> Result<PathBuf, InstallError> {
        let mut files: Vec<PathBuf> = fs::read_dir(&self.conf_dir)
            .map_err(io(format!("reading {}", self.conf_dir.display())))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.is_file()
                    && matches!(
                        p.extension().and_then(|e| e.to_str()),
                        Some("conflist" | "conf" | "json")
                    )
            })
            .collect();
        files.sort();
        files
            .into_iter()
            .next()
            .ok_or_else(|| InstallError::NoPrimary(self.conf_dir.clone()))
    }

    /// Whether our entry is in the primary conflist (readiness reports this).
    pub fn is_installed(&self) -> bool {
        self.primary()
            .ok()
            .and_then(|p| read_json(&p).ok())
            .is_some_and(|v| our_index(&v).is_some())
    }

    /// Copies the binary and makes sure our entry ends the primary conflist.
    pub fn install(&self) -> Result<Outcome, InstallError> {
        self.copy_binary()?;
        let primary = self.primary()?;
        let conf = read_json(&primary)?;
        let is_list = conf.get("plugins").is_some();
        if is_list {
            let mut conf = conf;
            let plugins = plugins_mut(&mut conf, &primary)?;
            match plugins.iter().position(is_ours) {
                Some(i) => {
                    // Ours, but maybe no longer last, or written with other
                    // settings: rewritten at the end (keeping its origin).
                    let ours = plugins.remove(i);
                    let converted = ours
                        .pointer("/sluice/convertedFrom")
                        .and_then(Value::as_str)
                        .map(str::to_owned);
                    let want = self.entry(converted.as_deref());
                    let unchanged = ours == want && i == plugins.len();
                    plugins.push(want);
                    if unchanged {
                        return Ok(Outcome::AlreadyInstalled(primary));
                    }
                }
                None => plugins.push(self.entry(None)),
            }
            write_json(&primary, &conf)?;
            return Ok(Outcome::Inserted(primary));
        }
        // A single-plugin .conf: becomes a .conflist holding it and us.
        let Value::Object(mut single) = conf else {
            return Err(InstallError::Config {
                path: primary,
                msg: "not a JSON object".into(),
            });
        };
        let version = single.remove("cniVersion").unwrap_or(json!("1.0.0"));
        let name = single.remove("name").unwrap_or(json!("k8s-pod-network"));
        let file_name = primary
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_owned();
        let list = json!({
            "cniVersion": version,
            "name": name,
            "plugins": [Value::Object(single), self.entry(Some(&file_name))],
        });
        let target = primary.with_extension("conflist");
        write_json(&target, &list)?;
        fs::remove_file(&primary).map_err(io(format!("removing {}", primary.display())))?;
        Ok(Outcome::Inserted(target))
    }

    /// Removes exactly what `install` added: our entry (restoring a converted
    /// `.conf`) and the binary.
    pub fn uninstall(&self) -> Result<(), InstallError> {
        if let Ok(primary) = self.primary() {
            let mut conf = read_json(&primary)?;
            if let Some(i) = our_index(&conf) {
                let plugins = plugins_mut(&mut conf, &primary)?;
                let ours = plugins.remove(i);
                let converted = ours
                    .get("sluice")
                    .and_then(|s| s.get("convertedFrom"))
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                match converted {
                    Some(orig) if plugins.len() == 1 => {
                        let mut single = plugins.remove(0);
                        if let Value::Object(m) = &mut single {
                            let mut restored = Map::new();
                            restored.insert("cniVersion".into(), conf["cniVersion"].clone());
                            restored.insert("name".into(), conf["name"].clone());
                            restored.extend(std::mem::take(m));
                            single = Value::Object(restored);
                        }
                        write_json(&self.conf_dir.join(&orig), &single)?;
                        fs::remove_file(&primary)
                            .map_err(io(format!("removing {}", primary.display())))?;
                    }
                    _ => write_json(&primary, &conf)?,
                }
            }
        }
        match fs::remove_file(self.bin_dir.join(PLUGIN_TYPE)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(io("removing the plugin binary")(e))
            }
            _ => Ok(()),
        }
    }

    /// Keeps the plugin installed until `stop`: re-inserts it whenever the
    /// primary CNI rewrites (or first writes) its config — at once, from an
    /// inotify watch on the conf dir (kindnet, Calico and others rewrite
    /// theirs on restart; a sandbox created in between would miss the
    /// plugin), with a check every `recheck` behind it. A conf dir that does
    /// not exist yet is polled until it can be watched.
    pub async fn keep_installed(self, mut stop: watch::Receiver<bool>) {
        let (tx, mut changed) = tokio::sync::mpsc::channel::<()>(1);
        let mut watcher: Option<notify::RecommendedWatcher> = None;
        let mut warned = false;
        loop {
            if watcher.is_none() {
                watcher = self.watch(tx.clone());
            }
            let this = self.clone();
            match tokio::task::spawn_blocking(move || this.install()).await {
                Ok(Ok(Outcome::Inserted(p))) => {
                    info!(config = %p.display(), "sluice-cni inserted into the CNI config");
                    warned = false;
                }
                Ok(Ok(Outcome::AlreadyInstalled(_))) => warned = false,
                Ok(Err(e)) if !warned => {
                    warn!(error = %e, "cannot install sluice-cni yet; will retry");
                    warned = true;
                }
                _ => {}
            }
            let wait = if watcher.is_some() {
                self.recheck
            } else {
                POLL
            };
            tokio::select! {
                _ = stop.changed() => return,
                _ = changed.recv() => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// An inotify watch on the conf dir that wakes `keep_installed` on any
    /// change (our own writes too: the pass after them finds nothing to do).
    fn watch(&self, tx: tokio::sync::mpsc::Sender<()>) -> Option<notify::RecommendedWatcher> {
        use notify::Watcher as _;
        let mut w = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
            if ev.is_ok() {
                // A wake-up already queued covers this one too.
                let _ = tx.try_send(());
            }
        })
        .ok()?;
        w.watch(&self.conf_dir, notify::RecursiveMode::NonRecursive)
            .ok()?;
        Some(w)
    }

    fn entry(&self, converted_from: Option<&str>) -> Value {
        let mut e = json!({
            "type": PLUGIN_TYPE,
            "agentSocket": self.agent_socket,
        });
        if !self.exclude_namespaces.is_empty() {
            e["excludeNamespaces"] = json!(self.exclude_namespaces);
        }
        if let Some(orig) = converted_from {
            e["sluice"] = json!({ "convertedFrom": orig });
        }
        e
    }

    /// Copies the plugin into the bin dir unless the copy there has the
    /// source's size and modification time (the copy is given the source's,
    /// so the once-a-second check reads two inodes, not two binaries).
    fn copy_binary(&self) -> Result<(), InstallError> {
        let dst = self.bin_dir.join(PLUGIN_TYPE);
        let src_meta =
            fs::metadata(&self.plugin).map_err(io(format!("reading {}", self.plugin.display())))?;
        let stamp = |m: &fs::Metadata| (m.len(), m.modified().ok());
        if fs::metadata(&dst).is_ok_and(|m| stamp(&m) == stamp(&src_meta)) {
            return Ok(());
        }
        let src =
            fs::read(&self.plugin).map_err(io(format!("reading {}", self.plugin.display())))?;
        fs::create_dir_all(&self.bin_dir)
            .map_err(io(format!("creating {}", self.bin_dir.display())))?;
        let tmp = self.bin_dir.join(format!(".{PLUGIN_TYPE}.tmp"));
        let write = || -> std::io::Result<()> {
            use std::os::unix::fs::PermissionsExt;
            let f = fs::File::create(&tmp)?;
            std::io::Write::write_all(&mut &f, &src)?;
            f.set_permissions(fs::Permissions::from_mode(0o755))?;
            if let Ok(t) = src_meta.modified() {
                f.set_modified(t)?;
            }
            Ok(())
        };
        write().map_err(io(format!("writing {}", tmp.display())))?;
        fs::rename(&tmp, &dst).map_err(io(format!("installing {}", dst.display())))
    }
}

fn is_ours(v: &Value) -> bool {
    v.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE)
}

fn our_index(conf: &Value) -> Option<usize> {
    conf.get("plugins")?.as_array()?.iter().position(is_ours)
}

fn plugins_mut<'a>(conf: &'a mut Value, path: &Path) -> Result<&'a mut Vec<Value>, InstallError> {
    conf.get_mut("plugins")
        .and_then(Value::as_array_mut)
        .ok_or_else(|| InstallError::Config {
            path: path.to_owned(),
            msg: "\"plugins\" is not a list".into(),
        })
}

fn read_json(p: &Path) -> Result<Value, InstallError> {
    let b = fs::read(p).map_err(io(format!("reading {}", p.display())))?;
    serde_json::from_slice(&b).map_err(|e| InstallError::Config {
        path: p.to_owned(),
        msg: e.to_string(),
    })
}

fn write_json(p: &Path, v: &Value) -> Result<(), InstallError> {
    let tmp = p.with_extension("sluice-tmp");
    let body = serde_json::to_vec_pretty(v).expect("JSON values serialise");
    fs::write(&tmp, body).map_err(io(format!("writing {}", tmp.display())))?;
    fs::rename(&tmp, p).map_err(io(format!("replacing {}", p.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Dirs(PathBuf);
    impl Drop for Dirs {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn setup(name: &str) -> (Dirs, CniInstall) {
        let root =
            std::env::temp_dir().join(format!("sluice-install-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(root.join("net.d")).unwrap();
        fs::write(root.join("sluice-cni-src"), b"#!/bin/sh\n").unwrap();
        let i = CniInstall {
            conf_dir: root.join("net.d"),
            bin_dir: root.join("bin"),
            plugin: root.join("sluice-cni-src"),
            agent_socket: "/run/sluice/agent.sock".into(),
            exclude_namespaces: vec!["kube-system".into()],
            recheck: RECHECK,
        };
        (Dirs(root), i)
    }

    const LIST: &str = r#"{"cniVersion":"1.0.0","name":"kindnet","plugins":[
        {"type":"ptp","ipam":{"type":"host-local"}},{"type":"portmap","capabilities":{"portMappings":true}}]}"#;

    #[test]
    fn appends_to_the_primary_conflist_once_and_uninstalls_exactly() {
        let (_d, i) = setup("list");
        let p = i.conf_dir.join("10-kindnet.conflist");
        fs::write(&p, LIST).unwrap();
        fs::write(i.conf_dir.join("99-other.conflist"), LIST).unwrap();
        assert_eq!(i.install().unwrap(), Outcome::Inserted(p.clone()));
        assert_eq!(i.install().unwrap(), Outcome::AlreadyInstalled(p.clone()));
        let v = read_json(&p).unwrap();
        let plugins = v["plugins"].as_array().unwrap();
        assert_eq!(plugins.len(), 3);
        assert_eq!(plugins[2]["type"], PLUGIN_TYPE);
        assert_eq!(plugins[2]["agentSocket"], "/run/sluice/agent.sock");
        assert_eq!(plugins[2]["excludeNamespaces"], json!(["kube-system"]));
        assert!(i.is_installed());
        // Other settings (an agent started with other flags): rewritten in place.
        let other = CniInstall {
            exclude_namespaces: vec!["kube-system".into(), "istio-system".into()],
            ..i.clone()
        };
        assert_eq!(other.install().unwrap(), Outcome::Inserted(p.clone()));
        let v = read_json(&p).unwrap();
        assert_eq!(v["plugins"].as_array().unwrap().len(), 3);
        assert_eq!(
            v["plugins"][2]["excludeNamespaces"],
            json!(["kube-system", "istio-system"])
        );
        assert_eq!(i.install().unwrap(), Outcome::Inserted(p.clone()));
        // Only the primary is touched.
        assert_eq!(
            read_json(&i.conf_dir.join("99-other.conflist")).unwrap(),
            serde_json::from_str::<Value>(LIST).unwrap()
        );
        assert!(i.bin_dir.join(PLUGIN_TYPE).exists());
        i.uninstall().unwrap();
        assert_eq!(
            read_json(&p).unwrap(),
            serde_json::from_str::<Value>(LIST).unwrap()
        );
        assert!(!i.bin_dir.join(PLUGIN_TYPE).exists());
        assert!(!i.is_installed());
    }

    #[test]
    fn the_plugin_binary_is_replaced_when_the_agent_brings_a_new_one() {
        let (_d, i) = setup("bin");
        fs::write(i.conf_dir.join("10-kindnet.conflist"), LIST).unwrap();
        i.install().unwrap();
        let dst = i.bin_dir.join(PLUGIN_TYPE);
        assert_eq!(fs::read(&dst).unwrap(), b"#!/bin/sh\n");
        // Unchanged source: the copy is left as it is (same inode).
        use std::os::unix::fs::MetadataExt;
        let ino = fs::metadata(&dst).unwrap().ino();
        i.install().unwrap();
        assert_eq!(fs::metadata(&dst).unwrap().ino(), ino);
        // A new agent image: same length, other bytes, other mtime.
        fs::write(&i.plugin, b"#!/bin/xx\n").unwrap();
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
        fs::File::options()
            .write(true)
            .open(&i.plugin)
            .unwrap()
            .set_modified(later)
            .unwrap();
        i.install().unwrap();
        assert_eq!(fs::read(&dst).unwrap(), b"#!/bin/xx\n");
    }

    #[test]
    fn a_conf_becomes_a_conflist_and_comes_back_on_uninstall() {
        let (_d, i) = setup("conf");
        let conf = r#"{"cniVersion":"0.4.0","name":"mynet","type":"bridge","bridge":"cni0","ipam":{"type":"host-local"}}"#;
        let orig = i.conf_dir.join("10-bridge.conf");
        fs::write(&orig, conf).unwrap();
        let list = i.conf_dir.join("10-bridge.conflist");
        assert_eq!(i.install().unwrap(), Outcome::Inserted(list.clone()));
        assert!(!orig.exists());
        let v = read_json(&list).unwrap();
        assert_eq!(v["cniVersion"], "0.4.0");
        assert_eq!(v["name"], "mynet");
        assert_eq!(v["plugins"][0]["type"], "bridge");
        assert_eq!(v["plugins"][1]["type"], PLUGIN_TYPE);
        i.uninstall().unwrap();
        assert!(!list.exists());
        assert_eq!(
            read_json(&orig).unwrap(),
            serde_json::from_str::<Value>(conf).unwrap()
        );
    }

    #[test]
    fn reinserts_after_the_primary_cni_rewrites_its_file() {
        let (_d, i) = setup("rewrite");
        let p = i.conf_dir.join("10-kindnet.conflist");
        fs::write(&p, LIST).unwrap();
        i.install().unwrap();
        // The primary CNI rewrites its config (without us) …
        fs::write(&p, LIST).unwrap();
        assert!(!i.is_installed());
        // … and the next pass puts us back, last.
        assert_eq!(i.install().unwrap(), Outcome::Inserted(p.clone()));
        assert_eq!(read_json(&p).unwrap()["plugins"][2]["type"], PLUGIN_TYPE);
        // A plugin appended after us: we move back to the end.
        let mut v = read_json(&p).unwrap();
        v["plugins"]
            .as_array_mut()
            .unwrap()
            .push(json!({"type": "bandwidth"}));
        write_json(&p, &v).unwrap();
        assert_eq!(i.install().unwrap(), Outcome::Inserted(p.clone()));
        let v = read_json(&p).unwrap();
        assert_eq!(v["plugins"][3]["type"], PLUGIN_TYPE);
        assert_eq!(
            v["plugins"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|p| is_ours(p))
                .count(),
            1
        );
    }

    #[test]
    fn no_primary_config_yet_is_a_clear_error() {
        let (_d, i) = setup("empty");
        assert!(matches!(i.install(), Err(InstallError::NoPrimary(_))));
        fs::write(i.conf_dir.join("10-bad.conflist"), "{oops").unwrap();
        assert!(matches!(i.install(), Err(InstallError::Config { .. })));
    }
}

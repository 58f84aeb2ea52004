//! Keeping `sluice-cni` in the node's CNI configuration, and the binary in
//! the CNI bin dir, until uninstall removes exactly what was added. Two
//! modes: an owned conflist that sorts first ([`owned`], the default), or
//! an entry appended to the primary network's own file ([`inplace`]). Either
//! is brought back in step whenever the primary CNI rewrites its file.
//!
//! Files are replaced by write-to-temp + flush + rename, so the runtime
//! never reads a half-written config and a running `sluice-cni` is never
//! overwritten.

use std::{
    fs,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::sync::watch;
use tracing::{info, warn};

pub use super::entry::PLUGIN_TYPE;
pub use super::error::InstallError;
pub use super::owned::FileName;
use super::{
    conf_dir,
    entry::{is_ours, Entry},
    error::io,
    inplace,
    layout::Layout,
    owned::{self, SyncError},
};

/// The owned conflist's default name, for clap.
pub fn owned_default() -> &'static str {
    owned::DEFAULT_NAME
}

pub const DEFAULT_CONF_DIR: &str = "/etc/cni/net.d";
pub const DEFAULT_BIN_DIR: &str = "/opt/cni/bin";
/// How often the conf dir is checked when no change was seen: a safety net
/// behind the inotify watch (the default of `--cni-recheck`).
pub const RECHECK: Duration = Duration::from_secs(5);
/// How often a conf dir that cannot be watched yet (not created yet) is
/// checked.
pub const POLL: Duration = Duration::from_secs(1);

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
    /// The owned conflist's name; `None`: in-place mode.
    pub owned: Option<FileName>,
    /// The last pass's result, for `sluice status` (shared by clones).
    last: Arc<Mutex<Option<String>>>,
}

/// The conf dir as `sluice check-node` reports it.
#[derive(Debug, Clone, Default)]
pub struct Survey {
    /// The primary network's config file, if there is one.
    pub primary: Option<String>,
    /// Why it does not parse.
    pub primary_error: Option<String>,
    pub primary_plugins: Vec<String>,
    /// The owned name sorts after the primary (the agent would chain in
    /// place): why.
    pub owned_sorts_after: Option<String>,
    /// Files another CNI renamed away (`*.cilium_bak`).
    pub backed_up: Vec<String>,
    /// Config files chaining istio-cni.
    pub istio: Vec<String>,
}

/// What one pass changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    AlreadyInstalled(PathBuf),
    /// Our entry was put into (or moved to the end of) this file in place.
    Inserted(PathBuf),
    /// The owned conflist was written.
    Written(PathBuf),
    /// Owned mode, but the owned name sorts after the primary: chained into
    /// the primary in place instead, for the reason given.
    InPlaceInstead {
        config: PathBuf,
        why: String,
    },
}

impl CniInstall {
    pub fn new(
        conf_dir: PathBuf,
        bin_dir: PathBuf,
        plugin: PathBuf,
        agent_socket: PathBuf,
    ) -> Self {
        Self {
            conf_dir,
            bin_dir,
            plugin,
            agent_socket,
            exclude_namespaces: Vec::new(),
            recheck: RECHECK,
            owned: Some(FileName::default()),
            last: Arc::default(),
        }
    }

    fn entry(&self) -> Entry<'_> {
        Entry {
            agent_socket: &self.agent_socket,
            exclude_namespaces: &self.exclude_namespaces,
        }
    }

    /// The config the runtime uses (the first in the conf dir) if it chains
    /// sluice-cni; otherwise why new pods would start without it.
    pub fn in_force(&self) -> Result<PathBuf, String> {
        let files = conf_dir::list(&self.conf_dir).map_err(|e| e.to_string())?;
        let Some(first) = files.first() else {
            return Err(format!(
                "no CNI config in {}: the runtime cannot start pods",
                self.conf_dir.display()
            ));
        };
        if first.plugins().into_iter().any(is_ours) {
            Ok(first.path.clone())
        } else {
            Err(format!(
                "{}, the CNI config the runtime uses, does not chain sluice-cni: new pods would start uncaptured",
                first.path.display()
            ))
        }
    }

    /// Whether new pods go through sluice-cni (readiness reports this).
    pub fn is_installed(&self) -> bool {
        self.in_force().is_ok()
    }

    /// One line for `sluice status`: the config in force, the mode, and the
    /// last pass's trouble, if any.
    pub fn describe(&self) -> String {
        let mode = match &self.owned {
            Some(n) => format!("owned {n}"),
            None => "in place".into(),
        };
        let now = match self.in_force() {
            Ok(p) => format!("{} chains sluice-cni ({mode})", p.display()),
            Err(e) => format!("MISSING: {e} ({mode})"),
        };
        match self.last.lock().unwrap().as_deref() {
            Some(trouble) => format!("{now}; last pass: {trouble}"),
            None => now,
        }
    }

    /// What the conf dir holds, for `sluice check-node` (reads only).
    pub fn survey(&self) -> Result<Survey, InstallError> {
        let files = conf_dir::list(&self.conf_dir)?;
        let layout = Layout::of(&files, self.owned.as_ref().map(FileName::as_str));
        let primary = layout.primary;
        let owned_sorts_after = match (&self.owned, primary) {
            (Some(name), Some(p)) if name.as_str() >= p.name() => Some(
                SyncError::SortsAfter {
                    owned: name.clone(),
                    primary: p.name().to_owned(),
                }
                .to_string(),
            ),
            _ => None,
        };
        let backed_up = std::fs::read_dir(&self.conf_dir)
            .map_err(io(format!("reading {}", self.conf_dir.display())))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cilium_bak"))
            .collect();
        Ok(Survey {
            primary: primary.map(|p| p.name().to_owned()),
            primary_error: primary.and_then(|p| p.json.as_ref().err().cloned()),
            primary_plugins: primary
                .and_then(|p| p.json.as_ref().ok())
                .map(|v| {
                    conf_dir::plugin_types(v)
                        .into_iter()
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default(),
            owned_sorts_after,
            backed_up,
            istio: files
                .iter()
                .filter(|f| f.plugins().into_iter().any(super::entry::is_istio))
                .map(|f| f.name().to_owned())
                .collect(),
        })
    }

    /// Copies the binary and brings the chain in step (see the module doc).
    pub fn install(&self) -> Result<Outcome, InstallError> {
        self.copy_binary()?;
        let files = conf_dir::list(&self.conf_dir)?;
        if let Some(name) = &self.owned {
            return match owned::sync(&self.conf_dir, name, &files, &self.entry()) {
                Ok(s) if s.written => Ok(Outcome::Written(s.config)),
                Ok(s) => Ok(Outcome::AlreadyInstalled(s.config)),
                Err(SyncError::Install(e)) => Err(e),
                Err(e @ SyncError::SortsAfter { .. }) => Ok(Outcome::InPlaceInstead {
                    config: self.in_place(&files)?.0,
                    why: e.to_string(),
                }),
            };
        }
        Ok(match self.in_place(&files)? {
            (p, true) => Outcome::Inserted(p),
            (p, false) => Outcome::AlreadyInstalled(p),
        })
    }

    /// In-place insertion, then owned and istio-cni owned files (which the
    /// runtime would read first) removed.
    fn in_place(&self, files: &[conf_dir::ConfFile]) -> Result<(PathBuf, bool), InstallError> {
        let layout = Layout::of(files, self.owned.as_ref().map(FileName::as_str));
        let (config, mut written) =
            inplace::insert(layout.primary(&self.conf_dir)?, &self.entry())?;
        for f in layout.owned.iter().chain(&layout.istio_owned) {
            conf_dir::remove(&f.path)?;
            written = true;
        }
        Ok((config, written))
    }

    /// Removes exactly what `install` added: owned conflists (whatever their
    /// name), in-place entries (restoring a converted `.conf`), the binary.
    /// istio-cni's files are not sluice's to restore.
    ///
    /// An entry is looked for in every other file, not only the primary's:
    /// a `.conf` that sluice turned into a `.conflist`, then written anew by
    /// the primary CNI (sorting first), leaves the `.conflist` second, in
    /// force as soon as the `.conf` goes. That stale `.conflist` is removed,
    /// the newer `.conf` kept.
    pub fn uninstall(&self) -> Result<(), InstallError> {
        if let Ok(files) = conf_dir::list(&self.conf_dir) {
            let layout = Layout::of(&files, self.owned.as_ref().map(FileName::as_str));
            for f in &layout.owned {
                conf_dir::remove(&f.path)?;
            }
            let sluices_or_istios = |f: &conf_dir::ConfFile| {
                layout
                    .owned
                    .iter()
                    .chain(&layout.istio_owned)
                    .any(|o| o.path == f.path)
            };
            for f in files
                .iter()
                .filter(|f| f.json.is_ok() && !sluices_or_istios(f))
            {
                if let Some(r) = inplace::without_ours(f)? {
                    r.finish()?;
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

    /// Keeps the plugin installed until `stop`: brings the chain back in
    /// step whenever the primary CNI rewrites (or first writes) its config —
    /// at once, from an inotify watch on the conf dir (kindnet, Calico and
    /// others rewrite theirs on restart; a sandbox created in between would
    /// miss the plugin), with a check every `recheck` behind it. A conf dir
    /// that does not exist yet is polled until it can be watched.
    pub async fn keep_installed(self, mut stop: watch::Receiver<bool>) {
        let (tx, mut changed) = tokio::sync::mpsc::channel::<()>(1);
        let mut watcher: Option<notify::RecommendedWatcher> = None;
        loop {
            if watcher.is_none() {
                watcher = self.watch(tx.clone());
            }
            let this = self.clone();
            let pass = tokio::task::spawn_blocking(move || this.install()).await;
            let trouble = match pass {
                Ok(Ok(Outcome::AlreadyInstalled(_))) => None,
                Ok(Ok(Outcome::Inserted(p))) => {
                    info!(config = %p.display(), "sluice-cni chained into the primary CNI config");
                    None
                }
                Ok(Ok(Outcome::Written(p))) => {
                    info!(config = %p.display(), "owned CNI config written");
                    None
                }
                Ok(Ok(Outcome::InPlaceInstead { why, .. })) => Some(why),
                Ok(Err(e)) => Some(match &self.owned {
                    Some(n) => format!("{e}; {n} kept as it was; will retry"),
                    None => format!("{e}; will retry"),
                }),
                Err(e) => Some(format!("the install pass failed: {e}")),
            };
            {
                let mut last = self.last.lock().unwrap();
                // Said once per distinct trouble, not on every pass.
                if let Some(t) = trouble.as_ref().filter(|t| last.as_ref() != Some(*t)) {
                    warn!(trouble = %t, "cannot keep sluice-cni in the CNI config as configured");
                }
                *last = trouble;
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
            // On disk before it is named: after a power loss a copy of the
            // right size and time but no data would pass the check above
            // for good, and every ADD and DEL would fail to run it.
            f.sync_all()
        };
        write().map_err(io(format!("writing {}", tmp.display())))?;
        fs::rename(&tmp, &dst).map_err(io(format!("installing {}", dst.display())))?;
        conf_dir::sync_dir(&self.bin_dir)
    }
}

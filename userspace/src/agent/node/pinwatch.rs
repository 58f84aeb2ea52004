//! The pins' side of the hook watch: an inotify watch on `pods/` under the
//! bpffs root, so that a pod's pin removed behind the agent's back is
//! repaired as soon as it goes. Removing the pin of a link nothing else holds
//! detaches it: the pod's sk_lookup program, and with it inbound and outbound
//! capture, stops at once, while every filter is still in place. The kernel
//! sends no event for that detach, so the pin's removal is the event. Each
//! removal names the pod by its directory, `pods/<netns cookie>/`; the
//! agent's own removals (teardown, upgrades) only cause a verification that
//! finds nothing to put back.

use std::path::{Path, PathBuf};

use tokio::sync::mpsc;
use tracing::{info, warn};

use super::rtevents::Changed;

/// Watches `pods_dir` and every pod directory in it, and relays each
/// removal under `pods_dir/<cookie>/` as that pod's hook change, while the
/// returned watcher lives. `None` (and a warning) when the watch cannot be
/// set: the periodic verification remains.
pub(super) fn spawn(
    pods_dir: PathBuf,
    tx: mpsc::UnboundedSender<(u64, Changed)>,
) -> Option<notify::RecommendedWatcher> {
    use notify::Watcher as _;
    let dir = pods_dir.clone();
    let watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        let Ok(ev) = ev else { return };
        if !matches!(ev.kind, notify::EventKind::Remove(_)) {
            return;
        }
        for cookie in ev.paths.iter().filter_map(|p| cookie_of(&dir, p)) {
            let _ = tx.send((cookie, Changed::TC));
        }
    });
    let watched = watcher.and_then(|mut w| {
        w.watch(&pods_dir, notify::RecursiveMode::Recursive)
            .map(|()| w)
    });
    match watched {
        Ok(w) => {
            info!(dir = %pods_dir.display(), "watching the pods' pins");
            Some(w)
        }
        Err(e) => {
            warn!(dir = %pods_dir.display(), error = %e, "cannot watch the pods' pins: a pin removed is found by the periodic verification only");
            None
        }
    }
}

/// The pod a path under `pods_dir` belongs to: its first component, a
/// netns cookie.
fn cookie_of(pods_dir: &Path, path: &Path) -> Option<u64> {
    path.strip_prefix(pods_dir)
        .ok()?
        .components()
        .next()?
        .as_os_str()
        .to_str()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_removed_pin_names_its_pod_by_the_directory() {
        let dir = Path::new("/sys/fs/bpf/sluice/pods");
        assert_eq!(cookie_of(dir, &dir.join("4099/steer")), Some(4099));
        assert_eq!(cookie_of(dir, &dir.join("4099")), Some(4099));
        assert_eq!(cookie_of(dir, &dir.join("stale/steer")), None);
        assert_eq!(cookie_of(dir, Path::new("/elsewhere/4099/steer")), None);
        assert_eq!(cookie_of(dir, dir), None);
    }
}

//! The bpffs under the pins: mounted when missing, locked while one process
//! loads, and emptied of the node-wide pins by an uninstall.

use std::{fs, path::Path};

use super::{error::LoadError, pins::Pins};

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Mounts bpffs on /sys/fs/bpf when nothing is mounted there (fresh machines
/// and some nodes come without it) and creates the root directory.
pub fn ensure_bpffs(root: &Path) -> Result<(), LoadError> {
    let base = Path::new("/sys/fs/bpf");
    let is_bpffs = |p: &Path| {
        nix::sys::statfs::statfs(p)
            .map(|s| s.filesystem_type().0 == BPF_FS_MAGIC)
            .unwrap_or(false)
    };
    if !is_bpffs(base) {
        nix::mount::mount(
            Some("bpf"),
            base,
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .map_err(|e| LoadError::Bpffs(format!("mounting bpffs on {}: {e}", base.display())))?;
    }
    fs::create_dir_all(root).map_err(LoadError::io(format!("creating {}", root.display())))?;
    if !is_bpffs(root) {
        return Err(LoadError::Bpffs(format!(
            "{} is not on a bpffs",
            root.display()
        )));
    }
    Ok(())
}

/// Serialises loading between processes (two `sluice enroll` at once must not
/// both load): an exclusive flock on the root directory itself, so no lock
/// file is left anywhere.
pub fn lock(pins: &Pins) -> Result<nix::fcntl::Flock<fs::File>, LoadError> {
    let f = fs::File::open(pins.root())
        .map_err(LoadError::io(format!("opening {}", pins.root().display())))?;
    nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, e)| {
        LoadError::Io {
            what: format!("locking {}", pins.root().display()),
            source: e.into(),
        }
    })
}

/// Removes the node-wide pins (programs, maps) and the root, if no pod remains.
pub fn remove_node_pins(pins: &Pins) -> Result<(), LoadError> {
    // With the maps of a migration that failed or was killed before its
    // renames (the next start's upgrade would have removed them).
    for dir in [pins.progs(), pins.maps(), super::maps_next::dir(pins)] {
        if let Ok(entries) = fs::read_dir(&dir) {
            for e in entries.flatten() {
                fs::remove_file(e.path())
                    .map_err(LoadError::io(format!("removing {}", e.path().display())))?;
            }
        }
        let _ = fs::remove_dir(&dir);
    }
    let _ = fs::remove_dir(pins.pods());
    let _ = fs::remove_dir(pins.root());
    Ok(())
}

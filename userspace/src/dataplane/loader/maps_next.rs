//! A migration's maps: this build's version of each changed map, created
//! under `maps_next/` beside the pinned one, filled from it, and renamed
//! over it last (bpffs renames replace atomically), so the old pinned maps
//! stay authoritative until then.

use std::{
    fs,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use aya::maps::{Map, MapData};

use crate::{
    dataplane::{
        mapcopy,
        stamp::Change,
        state::{Maps, StateError},
    },
    fault::crash_point,
    podnet::{netns::Netns, sockets},
};

use super::{error::LoadError, layout::REBUILT, pins::Pins};

/// Where a migration creates this build's maps (under the bpffs root).
const MAPS_NEXT: &str = "maps_next";

/// Per-CPU map types (`BPF_MAP_TYPE_PERCPU_HASH`, `_PERCPU_ARRAY`,
/// `_LRU_PERCPU_HASH`): user space reads one value per possible CPU.
const PER_CPU: [u32; 3] = [5, 6, 10];

/// Array map types (`BPF_MAP_TYPE_ARRAY`, `_PERCPU_ARRAY`): fixed indexes.
const ARRAYS: [u32; 2] = [2, 6];

pub fn dir(pins: &Pins) -> PathBuf {
    pins.root().join(MAPS_NEXT)
}

/// Removes the maps of a migration killed before its renames.
pub fn remove_leftovers(pins: &Pins) {
    for e in fs::read_dir(dir(pins)).into_iter().flatten().flatten() {
        let _ = fs::remove_file(e.path());
    }
}

/// Makes room for this build's version of the `changes` maps.
pub fn create(pins: &Pins, changes: &[Change]) -> Result<(), LoadError> {
    if changes.is_empty() {
        return Ok(());
    }
    let next = dir(pins);
    fs::create_dir_all(&next).map_err(LoadError::io(format!("creating {}", next.display())))
}

/// Fills this build's maps under `maps_next/` from the pinned ones: a byte
/// copy of every entry, then ztunnel's listeners and DNS proxy sockets of
/// every pod, found again in its netns (a socket map cannot be read back
/// from user space).
pub fn fill(pins: &Pins, changes: &[Change]) -> Result<(), LoadError> {
    let next = dir(pins);
    for c in changes {
        if !REBUILT.contains(&c.map.as_str()) {
            copy_entries(pins, &next, c)?;
        }
    }
    if changes
        .iter()
        .any(|c| c.map == "listeners" || c.map == "dns_listeners")
    {
        reregister_listeners(pins, &next, changes)?;
    }
    Ok(())
}

fn copy_entries(pins: &Pins, next: &Path, c: &Change) -> Result<(), LoadError> {
    let open = |dir: &Path| {
        MapData::from_pin(dir.join(&c.map)).map_err(|e| LoadError::Io {
            what: format!("opening map {}", c.map),
            source: std::io::Error::other(e),
        })
    };
    let (from, to) = (open(&pins.maps())?, open(next)?);
    let bytes = mapcopy::value_bytes(c.ours.value_size, PER_CPU.contains(&c.ours.map_type))
        .map_err(LoadError::io("counting CPUs"))?;
    let array = ARRAYS.contains(&c.ours.map_type);
    let n = mapcopy::copy(
        from.fd().as_fd(),
        to.fd().as_fd(),
        c.ours.key_size,
        bytes,
        array,
    )
    .map_err(LoadError::io(format!("copying map {} ({c})", c.map)))?;
    tracing::info!(map = %c.map, entries = n, "map migrated");
    Ok(())
}

/// Registers every pod's listeners, found in its netns, in the new socket
/// map (the other maps as they are then: the new ones where they changed).
fn reregister_listeners(pins: &Pins, next: &Path, changes: &[Change]) -> Result<(), LoadError> {
    let changed = |n: &str| changes.iter().any(|c| c.map == n);
    let mut maps = Maps::from_maps(|name| {
        let dir = if changed(name) {
            next.to_owned()
        } else {
            pins.maps()
        };
        let data =
            MapData::from_pin(dir.join(name)).map_err(|source| StateError::Map { name, source })?;
        Map::from_map_data(data).map_err(|source| StateError::Map { name, source })
    })?;
    for cookie in maps.cookies() {
        let path = maps.meta(cookie).map(|m| m.netns).unwrap_or_default();
        let Ok(ns) = Netns::open(Path::new(&path)) else {
            continue;
        };
        if ns.cookie().ok() != Some(cookie) {
            continue;
        }
        for l in sockets::take_listeners(&ns, cookie, None).unwrap_or_default() {
            for &family in &l.families {
                maps.insert_listener(
                    sluice_common::ListenerKey::new(cookie, l.role, family),
                    &l.fd,
                )?;
            }
        }
    }
    Ok(())
}

/// Last, renames this build's maps over the pinned ones, one at a time.
pub fn replace_pins(pins: &Pins, changes: &[Change]) -> Result<(), LoadError> {
    let next = dir(pins);
    for c in changes {
        let to = pins.maps().join(&c.map);
        fs::rename(next.join(&c.map), &to)
            .map_err(LoadError::io(format!("replacing {}", to.display())))?;
        crash_point("migrate_map_pin");
    }
    let _ = fs::remove_dir(&next);
    Ok(())
}

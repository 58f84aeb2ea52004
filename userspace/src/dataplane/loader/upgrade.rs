//! The agent's start over another build's pins: this build's programs
//! replace the pinned ones in place, and maps of another layout are
//! migrated first.
//!
//! Idempotent: a process killed midway leaves every link on a working
//! build's programs, the old pinned maps authoritative until their renames,
//! and the next start finishes. The crash points (`fault`) mark each durable
//! step.

use std::{fs, path::Path};

use aya::Ebpf;

use crate::{
    dataplane::{
        features::Features,
        refilter::{Refilter, NEXT_PREFIX},
        relink,
        stamp::{self, Change, Layout},
        tcfilter::{self, Pinned},
    },
    fault::crash_point,
    podnet::hostside::Node,
};

use super::{
    adoption::Adoption,
    error::LoadError,
    handles::{self, Programs},
    layout, maps_next,
    object::{ebpf_object, loader_for},
    pins::Pins,
    programs::Program,
};

/// A replacement program is pinned under this suffix, then renamed over the
/// old pin (bpffs renames replace atomically), so the program pins are never
/// missing, even to a process killed in between.
const NEXT: &str = "_next";

/// Replaces pinned programs of another build with this build's, in place:
/// loads this build's programs against the pinned maps, compares tags,
/// points every pod link of a changed program at the new one, then swaps
/// the program pins. When a pinned map has another size or flags than
/// this build's, migrates first: this build's version of that map is
/// created under `maps_next/`, the entries copied (ztunnel's listeners
/// re-registered from the pods' netns; flow hints, needed for a handshake,
/// not copied), every link is pointed at this build's programs, then the
/// map pins are renamed over the old ones. `node`: where a kernel without
/// tcx has the host-side filters.
pub fn upgrade(
    pins: &Pins,
    features: Features,
    node: Option<&Node>,
) -> Result<Adoption, LoadError> {
    let object = ebpf_object();
    if object.is_empty() {
        return Ok(Adoption::Same);
    }
    remove_leftovers(pins);
    let compared = layout::compare(pins, &object)?;
    if let Some(c) = compared.blocking() {
        return Ok(Adoption::Kept(format!(
            "the pinned maps have a layout this build cannot migrate ({c}); the pinned build keeps running"
        )));
    }
    let layout::Compared { ours, changes } = compared;
    maps_next::create(pins, &changes)?;
    let mut ebpf = load_beside(pins, features, &object, &changes)?;
    if !changes.is_empty() {
        maps_next::fill(pins, &changes)?;
        crash_point("migrate_filled");
    }
    let changed = changed_programs(pins, &ebpf, !changes.is_empty())?;
    if changed.is_empty() {
        write_stamp(pins, &object, &ours);
        return Ok(Adoption::Same);
    }
    let links = switch_links(pins, node, &mut ebpf, &changed)?;
    crash_point("upgrade_links");
    replace_program_pins(pins, &mut ebpf, &changed)?;
    maps_next::replace_pins(pins, &changes)?;
    write_stamp(pins, &object, &ours);
    Ok(if changes.is_empty() {
        Adoption::Upgraded {
            programs: changed.iter().map(|p| p.name()).collect(),
            links,
        }
    } else {
        Adoption::Migrated {
            maps: changes.iter().map(ToString::to_string).collect(),
            links,
        }
    })
}

/// Removes what a replacement killed before its renames left: program pins
/// under `_next`, maps under `maps_next/`, filter records under the
/// refilter's prefix.
fn remove_leftovers(pins: &Pins) {
    for p in Program::ALL {
        let _ = fs::remove_file(pins.progs().join(format!("{}{NEXT}", p.name())));
    }
    maps_next::remove_leftovers(pins);
    for pod in fs::read_dir(pins.pods()).into_iter().flatten().flatten() {
        for e in fs::read_dir(pod.path()).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with(NEXT_PREFIX) {
                let _ = fs::remove_file(e.path());
            }
        }
    }
}

/// This build's programs through the verifier (not pinned), against the
/// pinned maps; a `changes` map against its new version under `maps_next/`,
/// which the load creates.
fn load_beside(
    pins: &Pins,
    features: Features,
    object: &[u8],
    changes: &[Change],
) -> Result<Ebpf, LoadError> {
    let mut loader = loader_for(features);
    loader.default_map_pin_directory(pins.maps());
    for c in changes {
        loader.map_pin_path(c.map.as_str(), maps_next::dir(pins).join(&c.map));
    }
    let mut ebpf = loader.load(object)?;
    for p in Program::ALL {
        handles::load(&mut ebpf, p)?;
    }
    Ok(ebpf)
}

/// The programs whose pinned build is not this one (another tag). Pins of a
/// build before a program have none: it counts as changed (pinned, no link
/// to switch). A program's tag ignores which maps it uses: after a
/// migration every program is replaced, since the new maps are only the new
/// programs'.
fn changed_programs(pins: &Pins, ebpf: &Ebpf, migrating: bool) -> Result<Vec<Program>, LoadError> {
    let pinned = Programs::open(pins, false)?;
    let mut tags = Vec::new();
    for p in Program::ALL {
        tags.push((p, pinned.tag(p)?.unwrap_or(0)));
    }
    let mut changed = Vec::new();
    for (p, tag) in tags {
        if migrating || handles::loaded_tag(ebpf, p)? != tag {
            changed.push(p);
        }
    }
    Ok(changed)
}

/// Points every pod's links of a `changed` program at this build's, each
/// atomically: a tcx or sk_lookup link by BPF_LINK_UPDATE, a cls_bpf filter
/// (kernels without tcx) replaced at its handle. Returns how many switched.
fn switch_links(
    pins: &Pins,
    node: Option<&Node>,
    ebpf: &mut Ebpf,
    changed: &[Program],
) -> Result<usize, LoadError> {
    let mut links = 0;
    let mut filters = Refilter::new(&pins.maps(), node);
    let pods = fs::read_dir(pins.pods())
        .map_err(LoadError::io(format!("listing {}", pins.pods().display())))?;
    for pod in pods.flatten() {
        let cookie = pod.file_name().to_str().and_then(|c| c.parse::<u64>().ok());
        for link in fs::read_dir(pod.path()).into_iter().flatten().flatten() {
            let Some(prog) = Program::of_link(&link.file_name().to_string_lossy()) else {
                continue;
            };
            if changed.contains(&prog)
                && switch_link(ebpf, &mut filters, cookie, &link.path(), prog)?
            {
                links += 1;
                crash_point("upgrade_link");
            }
        }
    }
    Ok(links)
}

/// Points the link or filter pinned at `path` (of the pod `cookie`) at
/// this build's `prog`. `false`: nothing there to switch.
fn switch_link(
    ebpf: &mut Ebpf,
    filters: &mut Refilter<'_>,
    cookie: Option<u64>,
    path: &Path,
    prog: Program,
) -> Result<bool, LoadError> {
    match tcfilter::pinned(path) {
        Some(Pinned::Link) => {
            let fd = handles::in_object(ebpf, prog)?
                .fd()
                .map_err(handles::program_error(prog))?;
            match relink::update(path, std::os::fd::AsFd::as_fd(fd)) {
                Ok(()) => Ok(true),
                // Detached: its interface (tcx) or netns (sk_lookup) is gone,
                // and so is all it captured: a pod deleted while no agent
                // ran. Nothing to switch; the pod's repair or teardown sees
                // to the pin. (Stopping here would leave the node half on
                // each build.)
                Err(e) if e.raw_os_error() == Some(libc::ENOLINK) => {
                    tracing::info!(link = %path.display(), "detached (its pod gone?): left to the pod's repair");
                    Ok(false)
                }
                Err(e) => Err(LoadError::io(format!(
                    "pointing {} at this build's {}",
                    path.display(),
                    prog.name()
                ))(e)),
            }
        }
        Some(Pinned::Program(_)) => {
            let p = handles::tc_in_object(ebpf, prog)?;
            let Some(cookie) = cookie else {
                return Ok(false);
            };
            filters.switch(cookie, path, p).map_err(|e| LoadError::Io {
                what: format!(
                    "pointing the filter of {} at this build's {}",
                    path.display(),
                    prog.name()
                ),
                source: std::io::Error::other(e.to_string()),
            })
        }
        None => Ok(false),
    }
}

/// Then the program pins: new enrollments use this build's programs. Each
/// is pinned under `_next`, then renamed over the old pin.
fn replace_program_pins(
    pins: &Pins,
    ebpf: &mut Ebpf,
    changed: &[Program],
) -> Result<(), LoadError> {
    for &p in changed {
        let path = pins.program(p);
        let next = pins.progs().join(format!("{}{NEXT}", p.name()));
        handles::in_object(ebpf, p)?
            .pin(&next)
            .map_err(|source| LoadError::Pin {
                path: next.clone(),
                source,
            })?;
        crash_point("upgrade_pin_next");
        fs::rename(&next, &path).map_err(LoadError::io(format!("replacing {}", path.display())))?;
        crash_point("upgrade_pin");
    }
    Ok(())
}

fn write_stamp(pins: &Pins, object: &[u8], ours: &Layout) {
    if let Err(e) = stamp::write(&pins.maps(), object, ours) {
        tracing::warn!(error = %e, "could not write the dataplane stamp");
    }
}

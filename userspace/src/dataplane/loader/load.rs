//! The first load on a node: nothing is pinned yet, so this process loads
//! its build's programs and maps and pins them.

use std::fs;

use aya::Ebpf;

use crate::dataplane::{
    features::Features,
    stamp,
    state::{Maps, StateError},
};

use super::{
    bpffs::remove_node_pins,
    error::LoadError,
    handles::{self, Programs},
    object::{ebpf_object, loader_for},
    pins::Pins,
    programs::Program,
};

/// Loads this build's programs and maps and pins them under `pins`.
pub fn load(pins: &Pins, features: Features) -> Result<(Programs, Maps), LoadError> {
    let object = ebpf_object();
    if object.is_empty() {
        return Err(LoadError::NoObject);
    }
    for d in [pins.progs(), pins.maps(), pins.pods()] {
        fs::create_dir_all(&d).map_err(LoadError::io(format!("creating {}", d.display())))?;
    }
    let missing = features.missing();
    if !missing.is_empty() {
        return Err(LoadError::KernelTooOld(missing));
    }
    let mut ebpf = loader_for(features)
        .default_map_pin_directory(pins.maps())
        .load(&object)?;
    let programs = match load_and_pin(&mut ebpf, pins) {
        Ok(p) => p,
        Err(e) => {
            // Leave nothing half-loaded: the next attempt starts clean.
            let _ = remove_node_pins(pins);
            return Err(e);
        }
    };
    let maps = Maps::from_maps(|name| ebpf.take_map(name).ok_or(StateError::Missing(name)))?;
    match stamp::of_object(&object) {
        Ok(layout) => {
            if let Err(e) = stamp::write(&pins.maps(), &object, &layout) {
                tracing::warn!(error = %e, "could not write the dataplane stamp");
            }
        }
        Err(e) => tracing::warn!(error = %e, "could not read this build's map layout"),
    }
    Ok((programs, maps))
}

/// Loads every program through the verifier and pins it; returns handles of
/// our own from the pins, so the `Ebpf` object can go.
fn load_and_pin(ebpf: &mut Ebpf, pins: &Pins) -> Result<Programs, LoadError> {
    for p in Program::ALL {
        handles::load(ebpf, p)?;
        let path = pins.program(p);
        handles::in_object(ebpf, p)?
            .pin(&path)
            .map_err(|source| LoadError::Pin { path, source })?;
    }
    Programs::open(pins, true)
}

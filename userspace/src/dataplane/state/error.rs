//! What can go wrong reading or writing the pinned maps.

use aya::maps::MapError;

use crate::lifecycle::IllegalTransition;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        source: MapError,
    },
    #[error("map {0} missing from the eBPF object")]
    Missing(&'static str),
    #[error(transparent)]
    Illegal(#[from] IllegalTransition),
}

/// The error of map `name`.
pub fn merr(name: &'static str) -> impl FnOnce(MapError) -> StateError {
    move |source| StateError::Map { name, source }
}

//! The node's dataplane: the eBPF programs and maps, loaded once per node and
//! pinned ([`loader`]), the kernel's offer ([`features`]), which build pinned
//! what ([`stamp`]), the pinned pod state ([`state`]), tc filters and links
//! ([`tcfilter`], [`relink`], [`refilter`]), and moving pins between builds
//! ([`migrate`], [`mapcopy`]).

pub mod features;
pub mod hookview;
pub mod loader;
pub mod mapcopy;
pub mod migrate;
pub mod refilter;
pub mod relink;
pub mod stamp;
pub mod state;
pub mod tcfilter;
pub mod testrun;

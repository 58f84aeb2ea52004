//! The chained CNI plugin and what the agent does for it. The plugin itself
//! (`spec`, `plugin`, `snapshot`) lives in the `sluice-cni` crate, which is
//! built static for the host's `/opt/cni/bin`; `install` is the agent's
//! management of the node's CNI config.

pub mod install;
pub use sluice_cni::{plugin, snapshot, spec};

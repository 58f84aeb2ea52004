//! The chained CNI plugin and what the agent does for it. The plugin itself
//! (`spec`, `plugin`, `snapshot`) lives in the `sluice-cni` crate, which is
//! built static for the host's `/opt/cni/bin`; `install` is the agent's
//! management of the node's CNI config (an owned conflist, or an entry in the
//! primary's file), over the conf dir as the runtime reads it (`conf_dir`,
//! `layout`).

mod conf_dir;
mod entry;
mod error;
mod inplace;
pub mod install;
mod layout;
mod owned;
#[cfg(test)]
mod tests;
pub use sluice_cni::{plugin, snapshot, spec};

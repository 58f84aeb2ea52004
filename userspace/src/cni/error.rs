//! What can go wrong keeping `sluice-cni` in the node's CNI config.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("no CNI network config in {0} yet (the primary CNI writes it)")]
    NoPrimary(PathBuf),
    #[error("{path}: {msg}")]
    Config { path: PathBuf, msg: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

/// Wraps an I/O error with what was being done.
pub(super) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> InstallError {
    let what = what.into();
    move |source| InstallError::Io { what, source }
}

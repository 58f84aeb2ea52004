//! What can go wrong loading, adopting or upgrading the dataplane.

use std::path::PathBuf;

use aya::programs::ProgramError;

use crate::dataplane::state::StateError;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("bpffs: {0}")]
    Bpffs(String),
    #[error("loading the eBPF object: {0}")]
    Object(#[from] aya::EbpfError),
    #[error("program {name}: {source}{hint}")]
    Program {
        name: &'static str,
        source: ProgramError,
        hint: &'static str,
    },
    #[error("pinning {path}: {source}")]
    Pin {
        path: PathBuf,
        source: aya::pin::PinError,
    },
    #[error(transparent)]
    State(#[from] StateError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error(
        "this sluice binary was built without its eBPF object (`cargo xtask build-ebpf` had not \
         run): it cannot load the dataplane; build the object and then sluice again"
    )]
    NoObject,
    #[error("sluice is not loaded on this node (nothing pinned under {0}); enroll a pod first")]
    NotLoaded(PathBuf),
    #[error(
        "the pinned dataplane's maps have a layout this build cannot take over ({0}); the \
         pinned build's programs keep capturing every enrolled pod. Deploy the previous build \
         or one that converts these maps"
    )]
    Incompatible(String),
    #[error("this kernel lacks what sluice needs: {}", .0.join(", "))]
    KernelTooOld(Vec<&'static str>),
}

impl LoadError {
    /// An I/O error, saying what was being done.
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| LoadError::Io { what, source }
    }
}

/// What the kernel's refusal of a program likely means, for its error.
pub fn kernel_hint(e: &ProgramError) -> &'static str {
    let s = format!("{e:?}");
    if s.contains("EINVAL") || s.contains("Invalid argument") {
        " (this kernel may lack a feature sluice needs: sk_lookup (≥ 5.9), tcx (≥ 6.6), bpf_get_netns_cookie for tc/sk_lookup)"
    } else {
        ""
    }
}

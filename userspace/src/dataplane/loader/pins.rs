//! Where everything lives under the bpffs root.

use std::path::{Path, PathBuf};

use super::programs::Program;

pub const DEFAULT_ROOT: &str = "/sys/fs/bpf/sluice";

/// Where everything lives in bpffs.
#[derive(Debug, Clone)]
pub struct Pins {
    root: PathBuf,
}

impl Pins {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }
    pub fn root(&self) -> &Path {
        &self.root
    }
    pub fn progs(&self) -> PathBuf {
        self.root.join("progs")
    }
    pub fn maps(&self) -> PathBuf {
        self.root.join("maps")
    }
    pub fn pods(&self) -> PathBuf {
        self.root.join("pods")
    }
    pub fn pod(&self, cookie: u64) -> PathBuf {
        self.pods().join(cookie.to_string())
    }
    /// Where `p` is pinned.
    pub fn program(&self, p: Program) -> PathBuf {
        self.progs().join(p.name())
    }
    pub fn is_loaded(&self) -> bool {
        self.program(Program::Steer).exists()
    }
}

//! The node's switch: excluded traffic bypasses ztunnel's mTLS and policy,
//! so a node honours the annotations only when its operator says so
//! (`--pod-exclusions annotations`, Helm `ambient.podExclusions`), and
//! optionally only in some namespaces.

use super::{
    parse::{parse, ExclusionError},
    set::PodExclusions,
};

/// `--pod-exclusions`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PodExclusionsMode {
    /// The annotations are ignored (each pod carrying them gets a Warning
    /// Event): every ambient pod is captured fully.
    #[default]
    Off,
    /// The annotations are honoured (in the allowed namespaces).
    Annotations,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Policy {
    pub mode: PodExclusionsMode,
    /// Where the annotations are honoured (`--pod-exclusions-namespaces`);
    /// empty: every namespace.
    pub namespaces: Vec<String>,
}

/// What a pod's annotations come to on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// It carries none: captured fully.
    None,
    /// Honoured: these are in force.
    Apply(PodExclusions),
    /// It carries some, which this node does not honour (the reason):
    /// captured fully.
    Ignored(&'static str),
    /// Malformed: the pod keeps the exclusions it had (none, when new).
    Invalid(ExclusionError),
}

impl Policy {
    pub fn decide<'a>(
        &self,
        namespace: &str,
        get: impl FnMut(&str) -> Option<&'a str>,
    ) -> Decision {
        let parsed = parse(get);
        if matches!(parsed, Ok(None)) {
            return Decision::None;
        }
        if self.mode == PodExclusionsMode::Off {
            return Decision::Ignored(
                "this node does not honour exclusion annotations (--pod-exclusions off, the default): excluded traffic would bypass ztunnel's mTLS and policy",
            );
        }
        if !self.namespaces.is_empty() && !self.namespaces.iter().any(|n| n == namespace) {
            return Decision::Ignored(
                "the pod's namespace is not among those this node honours exclusion annotations in (--pod-exclusions-namespaces)",
            );
        }
        match parsed {
            Ok(x) => Decision::Apply(x.unwrap_or_default()),
            Err(e) => Decision::Invalid(e),
        }
    }
}

impl Decision {
    /// The exclusions to put in force for a pod that has `current`.
    pub fn target(&self, current: &PodExclusions) -> PodExclusions {
        match self {
            Self::None | Self::Ignored(_) => PodExclusions::default(),
            Self::Apply(x) => x.clone(),
            Self::Invalid(_) => current.clone(),
        }
    }
}

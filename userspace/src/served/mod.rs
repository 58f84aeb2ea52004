//! "Served": whether ztunnel can serve a captured pod, i.e. has received the
//! pod's workload from istiod over xDS. Until it has, upstream ztunnel
//! accepts the pod's captured connections and fails every one of them
//! ("timed out waiting for workload … from xds"). The agent reads ztunnel's
//! own view from its admin API (`fetch`) and picks out the pods it asks about
//! (`dump`).

pub mod dump;
pub mod fetch;

pub use dump::{Known, Wanted};

/// How the agent decides that a pod is served.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Ask ztunnel's admin API; if ztunnel does not answer for a while, count
    /// its ack as served (and say so in status and metrics).
    Auto,
    /// Count ztunnel's ack as served: no check.
    Off,
}

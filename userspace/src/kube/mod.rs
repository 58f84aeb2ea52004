//! What sluice asks of and tells Kubernetes: which pods are ambient
//! (`selection`), the `ambient.istio.io/redirection` annotation (`annotate`),
//! whether a CNI request matches a real pod on this node (`verify`), the node
//! condition (`condition`), the startup taint (`taint`) and the pods'
//! readiness-gate condition (`gate`), Events on pods (`events`), and clearing
//! all of it on uninstall (`uninstall`). The writers' patches share their
//! time stamps and conflict handling (`patch`).
//! Decisions are pure functions over API objects; the writers are thin.

pub mod annotate;
pub mod condition;
pub mod enablement;
pub mod events;
pub mod gate;
pub mod node_identity;
pub mod patch;
pub mod readiness_rule;
pub mod reconcile;
pub mod recorder;
pub mod selection;
pub mod taint;
pub mod uninstall;
pub mod verify;

use std::time::Duration;

/// Budget for one API exchange: the client has no read timeout of its own.
pub const API_TIMEOUT: Duration = Duration::from_secs(10);

/// kube-rs' mock service, for the writers' tests.
#[cfg(test)]
pub(crate) mod mock;

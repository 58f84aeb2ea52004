//! What sluice asks of and tells Kubernetes: which pods are ambient
//! (`selection`), the `ambient.istio.io/redirection` annotation (`annotate`),
//! and whether a CNI request matches a real pod on this node (`verify`).
//! Decisions are pure functions over API objects; the writers are thin.

pub mod annotate;
pub mod reconcile;
pub mod selection;
pub mod verify;

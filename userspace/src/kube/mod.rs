//! What sluice asks of and tells Kubernetes: which pods are ambient
//! (`selection`), the `ambient.istio.io/redirection` annotation (`annotate`),
//! whether a CNI request matches a real pod on this node (`verify`), the node
//! condition (`condition`), the startup taint (`taint`) and the pods'
//! readiness-gate condition (`gate`).
//! Decisions are pure functions over API objects; the writers are thin.

pub mod annotate;
pub mod condition;
pub mod gate;
pub mod reconcile;
pub mod selection;
pub mod taint;
pub mod verify;

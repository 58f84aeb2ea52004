//! The chained CNI plugin (`sluice-cni`) and the parts of it the agent shares.
//!
//! `spec` is the CNI wire format (config, env, errors), `plugin` the
//! ADD/DEL/CHECK/VERSION logic (the agent behind a function, for tests),
//! `wire` the plugin's side of the agent's control protocol, `snapshot` the
//! selection the plugin decides from while the agent is down, and `hostns`
//! which network namespaces are never captured.

pub mod hostns;
pub mod plugin;
pub mod snapshot;
pub mod spec;
pub mod wire;

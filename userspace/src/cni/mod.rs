//! The chained CNI plugin (`sluice-cni`) and what the agent does for it.
//!
//! `spec` is the CNI wire format (config, env, errors), `plugin` the
//! ADD/DEL/CHECK/VERSION logic (the agent behind a trait, for tests), `install`
//! the agent's management of the node's CNI config.

pub mod install;
pub mod plugin;
pub mod snapshot;
pub mod spec;

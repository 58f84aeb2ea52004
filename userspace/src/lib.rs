//! sluice: an eBPF redirection dataplane for Istio ambient mode.
//!
//! Data path, in the order a pod meets it: [`loader`] (programs and maps, once
//! per node) → [`enroll`] (per pod: links, routes, state) → [`sockets`]
//! (ztunnel's listeners into the socket map) → [`state`] (the pinned maps that
//! `status` reads).

pub mod agent;
pub mod cni;
pub mod enroll;
pub mod loader;
pub mod netns;
pub mod routes;
pub mod sockets;
pub mod state;
pub mod status;
pub mod uid;
pub mod workload;
pub mod zds;

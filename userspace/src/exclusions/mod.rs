//! Per-pod exclusions from capture: the six `traffic.sidecar.istio.io/*`
//! annotations sidecar mode honours, applied to ambient pods when the node
//! allows them (`--pod-exclusions annotations`). An excluded connection
//! goes where it is addressed, around ztunnel: no mTLS, no policy, no
//! telemetry for it. The programs decide at the SYN from the pod's entry in
//! `pod_exclusions` ([`sluice_common::Exclusions`]).

mod parse;
mod policy;
mod set;

pub use parse::{parse, ExclusionError};
pub use policy::{Decision, PodExclusionsMode, Policy};
pub use set::{
    Include, PodExclusions, ANNOTATIONS, EXCLUDE_INBOUND_PORTS, EXCLUDE_OUTBOUND_IP_RANGES,
    EXCLUDE_OUTBOUND_PORTS, INCLUDE_INBOUND_PORTS, INCLUDE_OUTBOUND_IP_RANGES,
    INCLUDE_OUTBOUND_PORTS,
};

#[cfg(test)]
mod tests;

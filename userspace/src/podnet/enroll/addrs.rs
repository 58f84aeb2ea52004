//! A pod's addresses, published to the ingress programs (and the
//! address-theft guard) at enrollment and again at each re-registration.

use std::net::IpAddr;

use crate::{
    dataplane::state::{Maps, Published},
    podnet::netns::{addresses, Netns},
};

use super::error::EnrollError;

/// Which addresses are a pod's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PodAddrs {
    /// What the container runtime gave it (CNI ADD's `prevResult`, the
    /// pod's `status.podIPs`): the truth, whatever its netns holds.
    Runtime(Vec<IpAddr>),
    /// Whatever its netns holds (a pod enrolled by hand, with no runtime
    /// to ask): never an address another enrolled pod has.
    #[default]
    Netns,
}

impl PodAddrs {
    /// The runtime's addresses, or the netns' when it named none (a
    /// `prevResult` without IPs).
    pub fn from_runtime(ips: Vec<IpAddr>) -> Self {
        if ips.is_empty() {
            Self::Netns
        } else {
            Self::Runtime(ips)
        }
    }
}

/// Publishes the pod's current addresses to the ingress programs (attach
/// does; re-registration does it once more, addresses may have changed),
/// unless the runtime named them: then nothing changes. Returns those past
/// the per-pod cap (not the pod's for the programs).
pub fn refresh_addrs(
    maps: &mut Maps,
    netns: &Netns,
    cookie: u64,
) -> Result<Vec<IpAddr>, EnrollError> {
    if maps.addr_source(cookie) == Some(crate::dataplane::state::AddrSource::Runtime) {
        return Ok(Vec::new());
    }
    let addrs = netns.run(addresses)?.map_err(|source| EnrollError::Io {
        what: "listing the pod's addresses".into(),
        source,
    })?;
    Ok(publish_addrs(maps, netns, cookie, &PodAddrs::Netns, &addrs)?.over_cap)
}

/// Publishes the pod's addresses: the runtime's when it named them (taken
/// from any pod that claimed them before), else `held`, read from the
/// pod's `netns`. Returns what was left out or taken.
pub fn publish_addrs(
    maps: &mut Maps,
    netns: &Netns,
    cookie: u64,
    which: &PodAddrs,
    held: &[IpAddr],
) -> Result<Published, EnrollError> {
    let out = match which {
        PodAddrs::Runtime(ips) => maps.claim_addrs(cookie, ips)?,
        PodAddrs::Netns => maps.set_addrs(cookie, held)?,
    };
    let path = netns.path().display();
    if !out.refused.is_empty() {
        tracing::warn!(
            cookie,
            addresses = ?out.refused,
            netns = %path,
            "the pod has addresses another enrolled pod owns: not taken over"
        );
    }
    if !out.over_cap.is_empty() {
        tracing::warn!(
            cookie,
            addresses = ?out.over_cap,
            netns = %path,
            "the pod has more addresses than --max-pod-addresses: these are not its for the programs"
        );
    }
    for (addr, owner) in &out.evicted {
        tracing::warn!(
            cookie,
            %addr,
            claimed_by = owner,
            netns = %path,
            "the runtime gave this pod an address another pod claimed: the claim is gone"
        );
    }
    Ok(out)
}

//! A pod's addresses, published to the ingress programs (and the
//! address-theft guard) at enrollment and again at each re-registration.

use crate::{
    dataplane::state::Maps,
    podnet::netns::{addresses, Netns},
};

use super::error::EnrollError;

/// Publishes the pod's current addresses to the ingress programs (attach
/// does; re-registration does it once more, addresses may have changed).
/// Returns those past the per-pod cap (not the pod's for the programs).
pub fn refresh_addrs(
    maps: &mut Maps,
    netns: &Netns,
    cookie: u64,
) -> Result<Vec<std::net::IpAddr>, EnrollError> {
    let addrs = netns.run(addresses)?.map_err(|source| EnrollError::Io {
        what: "listing the pod's addresses".into(),
        source,
    })?;
    publish_addrs(maps, netns, cookie, &addrs)
}

/// Publishes `addrs`, read from the pod's `netns`, as the pod's addresses.
/// Returns those past the per-pod cap.
pub fn publish_addrs(
    maps: &mut Maps,
    netns: &Netns,
    cookie: u64,
    addrs: &[std::net::IpAddr],
) -> Result<Vec<std::net::IpAddr>, EnrollError> {
    let out = maps.set_addrs(cookie, addrs)?;
    if !out.refused.is_empty() {
        tracing::warn!(
            cookie,
            addresses = ?out.refused,
            netns = %netns.path().display(),
            "the pod has addresses another enrolled pod owns: not taken over"
        );
    }
    if !out.over_cap.is_empty() {
        tracing::warn!(
            cookie,
            addresses = ?out.over_cap,
            netns = %netns.path().display(),
            "the pod has more addresses than --max-pod-addresses: these are not its for the programs"
        );
    }
    Ok(out.over_cap)
}

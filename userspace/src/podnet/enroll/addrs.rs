//! A pod's addresses, published to the ingress programs (and the
//! address-theft guard) at enrollment and again at each re-registration.

use crate::{
    dataplane::state::Maps,
    podnet::netns::{addresses, Netns},
};

use super::error::EnrollError;

/// Publishes the pod's current addresses to the ingress programs (attach
/// does; re-registration does it once more, addresses may have changed).
pub fn refresh_addrs(maps: &mut Maps, netns: &Netns, cookie: u64) -> Result<(), EnrollError> {
    let addrs = netns.run(addresses)?.map_err(|source| EnrollError::Io {
        what: "listing the pod's addresses".into(),
        source,
    })?;
    publish_addrs(maps, netns, cookie, &addrs)
}

/// Publishes `addrs`, read from the pod's `netns`, as the pod's addresses.
pub fn publish_addrs(
    maps: &mut Maps,
    netns: &Netns,
    cookie: u64,
    addrs: &[std::net::IpAddr],
) -> Result<(), EnrollError> {
    let refused = maps.set_addrs(cookie, addrs)?;
    if !refused.is_empty() {
        tracing::warn!(
            cookie,
            addresses = ?refused,
            netns = %netns.path().display(),
            "the pod has addresses another enrolled pod owns: not taken over"
        );
    }
    Ok(())
}

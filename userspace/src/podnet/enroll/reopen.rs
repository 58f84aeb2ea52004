//! An enrolled pod's netns, opened again from its recorded path, and its
//! interfaces as they are now.

use std::path::Path;

use crate::{
    dataplane::state::Maps,
    podnet::netns::{interfaces, Netns},
};

use super::error::EnrollError;

/// Opens an enrolled pod's netns again, checking it is still the same one.
pub fn open_pod_netns(maps: &Maps, cookie: u64) -> Result<Netns, EnrollError> {
    let path = maps.meta(cookie).map(|m| m.netns).unwrap_or_default();
    let netns = Netns::open(Path::new(&path))?;
    if netns.cookie()? != cookie {
        return Err(EnrollError::NetnsReplaced(path));
    }
    Ok(netns)
}

/// [`open_pod_netns`] for a teardown: `None` when the pod's netns is gone
/// (its path names none, or another one), whose filters and routes went
/// with it. Any other failure (out of descriptors, say) is an error: read
/// as "gone", it would have the teardown drop the records of filters that
/// still run.
pub fn open_pod_netns_unless_gone(maps: &Maps, cookie: u64) -> Result<Option<Netns>, EnrollError> {
    match open_pod_netns(maps, cookie) {
        Ok(ns) => Ok(Some(ns)),
        Err(EnrollError::NetnsReplaced(_)) => Ok(None),
        Err(EnrollError::Netns(e)) if e.is_gone() => Ok(None),
        Err(e) => Err(e),
    }
}

/// The pod's interfaces besides `lo`, read inside its netns.
pub fn pod_interfaces(netns: &Netns, path: &str) -> Result<Vec<String>, EnrollError> {
    let ifaces: Vec<String> = netns
        .run(interfaces)?
        .map_err(|source| EnrollError::Io {
            what: "listing interfaces".into(),
            source,
        })?
        .into_iter()
        .filter(|i| i != "lo")
        .collect();
    if ifaces.is_empty() {
        return Err(EnrollError::NoInterface(path.to_owned()));
    }
    Ok(ifaces)
}

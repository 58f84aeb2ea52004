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

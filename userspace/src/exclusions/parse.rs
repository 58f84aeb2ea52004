//! The annotations' syntax, as sidecar mode's injector accepts it: comma
//! lists (spaces around entries allowed) of ports (decimal, no ranges) or
//! CIDRs (IPv4 or IPv6, prefix required; host bits are ignored), and `*`
//! for the two include lists. An empty value is an empty list; for an
//! include list that means nothing is captured in its direction.

use ipnet::IpNet;
use sluice_common::{EXCLUSIONS_MAX, PORT_DNS_PROXY, PORT_HBONE, PORT_INBOUND, PORT_OUTBOUND};

use super::set::{
    Include, PodExclusions, ANNOTATIONS, EXCLUDE_INBOUND_PORTS, EXCLUDE_OUTBOUND_IP_RANGES,
    EXCLUDE_OUTBOUND_PORTS, INCLUDE_INBOUND_PORTS, INCLUDE_OUTBOUND_IP_RANGES,
    INCLUDE_OUTBOUND_PORTS,
};

/// What is wrong with a pod's exclusion annotations. Any of these leaves
/// the pod's exclusions as they were.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExclusionError {
    #[error("{annotation}: {entry:?} is not {expected}")]
    Unparsable {
        annotation: &'static str,
        entry: String,
        expected: &'static str,
    },
    #[error("{count} {what} over the exclusion annotations, more than the limit of {EXCLUSIONS_MAX} per pod")]
    TooMany { what: &'static str, count: usize },
    #[error("{annotation}: {port} is one of ztunnel's own ports (15001, 15006, 15008, 15053), which are never excluded")]
    ZtunnelPort { annotation: &'static str, port: u16 },
}

const ZTUNNEL_PORTS: [u16; 4] = [PORT_OUTBOUND, PORT_INBOUND, PORT_HBONE, PORT_DNS_PROXY];

/// A pod's exclusions from its annotations (`get`), or `None` when it
/// carries none of them.
pub fn parse<'a>(
    mut get: impl FnMut(&str) -> Option<&'a str>,
) -> Result<Option<PodExclusions>, ExclusionError> {
    let values = ANNOTATIONS.map(&mut get);
    if values.iter().all(Option::is_none) {
        return Ok(None);
    }
    let [out_ports, out_ranges, out_include, in_ports, in_include, out_include_ports] = values;
    let x = PodExclusions {
        exclude_outbound_ports: excluded_ports(EXCLUDE_OUTBOUND_PORTS, out_ports)?,
        exclude_outbound_ip_ranges: ranges(EXCLUDE_OUTBOUND_IP_RANGES, out_ranges.unwrap_or(""))?,
        include_outbound_ip_ranges: match out_include.map(str::trim) {
            None | Some("*") => Include::All,
            Some(v) => Include::Only(ranges(INCLUDE_OUTBOUND_IP_RANGES, v)?),
        },
        include_outbound_ports: Vec::new(),
        exclude_inbound_ports: excluded_ports(EXCLUDE_INBOUND_PORTS, in_ports)?,
        include_inbound_ports: match in_include.map(str::trim) {
            None | Some("*") => Include::All,
            Some(v) => Include::Only(ports(INCLUDE_INBOUND_PORTS, v)?),
        },
    };
    // Included ports matter only beside an include list of ranges: with
    // every range included (`*`, or no annotation) they change nothing and
    // are left out, so that they read as no exclusion; `*` includes every
    // port, as if every range were included.
    let mut x = x;
    match out_include_ports.map(str::trim) {
        Some("*") => x.include_outbound_ip_ranges = Include::All,
        Some(v) if matches!(x.include_outbound_ip_ranges, Include::Only(_)) => {
            x.include_outbound_ports = ports(INCLUDE_OUTBOUND_PORTS, v)?;
        }
        Some(v) => {
            ports(INCLUDE_OUTBOUND_PORTS, v)?;
        }
        None => {}
    }
    for (what, count) in [("ports", x.ports()), ("address ranges", x.ranges())] {
        if count > EXCLUSIONS_MAX {
            return Err(ExclusionError::TooMany { what, count });
        }
    }
    Ok(Some(x))
}

fn excluded_ports(
    annotation: &'static str,
    value: Option<&str>,
) -> Result<Vec<u16>, ExclusionError> {
    let v = ports(annotation, value.unwrap_or(""))?;
    match v.iter().find(|p| ZTUNNEL_PORTS.contains(p)) {
        Some(&port) => Err(ExclusionError::ZtunnelPort { annotation, port }),
        None => Ok(v),
    }
}

/// The entries of a comma list; none for an empty value.
fn entries(value: &str) -> impl Iterator<Item = &str> {
    let value = value.trim();
    value
        .split(',')
        .map(str::trim)
        .filter(move |_| !value.is_empty())
}

fn ports(annotation: &'static str, value: &str) -> Result<Vec<u16>, ExclusionError> {
    let mut v = entries(value)
        .map(|e| {
            let digits = !e.is_empty() && e.len() <= 5 && e.bytes().all(|b| b.is_ascii_digit());
            digits
                .then(|| e.parse::<u16>().ok())
                .flatten()
                .ok_or_else(|| ExclusionError::Unparsable {
                    annotation,
                    entry: e.to_owned(),
                    expected: "a port (0-65535)",
                })
        })
        .collect::<Result<Vec<u16>, _>>()?;
    v.sort_unstable();
    v.dedup();
    Ok(v)
}

fn ranges(annotation: &'static str, value: &str) -> Result<Vec<IpNet>, ExclusionError> {
    let mut v = entries(value)
        .map(|e| {
            e.parse::<IpNet>()
                .map(|n| n.trunc())
                .map_err(|_| ExclusionError::Unparsable {
                    annotation,
                    entry: e.to_owned(),
                    expected: "an address range (CIDR, such as 10.0.0.0/8 or fd00::/8)",
                })
        })
        .collect::<Result<Vec<IpNet>, _>>()?;
    v.sort_unstable();
    v.dedup();
    Ok(v)
}

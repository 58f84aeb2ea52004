//! The six exclusion annotations (`traffic.sidecar.istio.io/*`), as a pod
//! could carry them: parsing never panics; what parses stays within the
//! per-pod limit, survives the trip through its pinned-map form, decides
//! as the annotations say at every edge of each range (the kernel's words,
//! masks and families against `IpNet::contains`), and the destinations a
//! verification picks are ones the map value captures.
#![no_main]

use std::net::IpAddr;

use ipnet::IpNet;
use libfuzzer_sys::fuzz_target;
use sluice::exclusions::{parse, Include, PodExclusions, ANNOTATIONS};
use sluice_common::EXCLUSIONS_MAX;

/// The family and address words the programs see for `a`.
fn words(a: IpAddr) -> (u8, [u32; 4]) {
    match a {
        IpAddr::V4(a) => (2, [u32::from_ne_bytes(a.octets()), 0, 0, 0]),
        IpAddr::V6(a) => {
            let o = a.octets();
            let w = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            (10, [w(0), w(4), w(8), w(12)])
        }
    }
}

/// What the annotations say of an outbound connection to `a`:`port`, in
/// sidecar mode's order: exclusions, then included ports, then ranges.
fn excluded(x: &PodExclusions, a: IpAddr, port: u16) -> bool {
    let within = |nets: &[IpNet]| nets.iter().any(|n| n.contains(&a));
    x.exclude_outbound_ports.contains(&port)
        || within(&x.exclude_outbound_ip_ranges)
        || matches!(&x.include_outbound_ip_ranges, Include::Only(v)
            if !x.include_outbound_ports.contains(&port) && !within(v))
}

/// What the annotations say of an inbound connection to `port`: an include
/// list other than `*` decides alone; ztunnel's ports are always captured.
fn excluded_inbound(x: &PodExclusions, port: u16) -> bool {
    if [15001, 15006, 15008, 15053].contains(&port) {
        return false;
    }
    match &x.include_inbound_ports {
        Include::Only(v) => !v.contains(&port),
        Include::All => x.exclude_inbound_ports.contains(&port),
    }
}

/// Each range's first and last address and the ones just outside it.
fn edges(x: &PodExclusions) -> Vec<IpAddr> {
    let mut nets = x.exclude_outbound_ip_ranges.clone();
    if let Include::Only(v) = &x.include_outbound_ip_ranges {
        nets.extend(v);
    }
    // One address up or down, in the address's own family.
    let step = |a: IpAddr, up: bool| -> Option<IpAddr> {
        let (n, max) = match a {
            IpAddr::V4(a) => (u128::from(u32::from(a)), u128::from(u32::MAX)),
            IpAddr::V6(a) => (u128::from(a), u128::MAX),
        };
        let n = if up {
            n.checked_add(1).filter(|n| *n <= max)?
        } else {
            n.checked_sub(1)?
        };
        Some(match a {
            IpAddr::V4(_) => IpAddr::from(std::net::Ipv4Addr::from(n as u32)),
            IpAddr::V6(_) => IpAddr::from(std::net::Ipv6Addr::from(n)),
        })
    };
    nets.iter()
        .flat_map(|n| {
            let (first, last) = (n.network(), n.broadcast());
            [
                Some(first),
                Some(last),
                step(first, false),
                step(last, true),
            ]
        })
        .flatten()
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    // Parts separated by NUL; an empty part leaves its annotation out.
    let parts: Vec<&str> = text.splitn(ANNOTATIONS.len(), '\u{0}').collect();
    let get = |name: &str| {
        let i = ANNOTATIONS.iter().position(|a| *a == name)?;
        parts.get(i).copied().filter(|p| !p.is_empty())
    };
    let Ok(Some(x)) = parse(get) else {
        return;
    };
    assert!(x.ports() <= EXCLUSIONS_MAX && x.ranges() <= EXCLUSIONS_MAX);
    let value = x.to_value();
    assert_eq!(PodExclusions::from_value(&value), x);
    let listed = |v: &[u16]| v.iter().take(2).copied().collect::<Vec<_>>();
    let mut ports = vec![80, 5432];
    ports.extend(listed(&x.include_outbound_ports));
    ports.extend(listed(&x.exclude_outbound_ports));
    for a in edges(&x) {
        for &port in &ports {
            let (family, w) = words(a);
            assert_eq!(
                value.excludes_outbound(family, &w, port),
                excluded(&x, a, port),
                "{a}:{port}"
            );
        }
    }
    for preferred in ["192.0.2.1:80", "[2001:db8::1]:80"] {
        if let Some(d) = x.captured_outbound(preferred.parse().unwrap()) {
            let (family, w) = words(d.ip());
            assert!(!value.excludes_outbound(family, &w, d.port()));
        }
    }
    if let Some(p) = x.captured_inbound_port(80) {
        assert!(!value.excludes_inbound(p));
    }
    let mut inbound = vec![80, 15006];
    inbound.extend(listed(&x.exclude_inbound_ports));
    if let Include::Only(v) = &x.include_inbound_ports {
        inbound.extend(listed(v));
    }
    for p in inbound {
        assert_eq!(value.excludes_inbound(p), excluded_inbound(&x, p), "inbound {p}");
    }
});

//! The five exclusion annotations (`traffic.sidecar.istio.io/*`), as a pod
//! could carry them: parsing never panics; what parses stays within the
//! per-pod limit, survives the trip through its pinned-map form, and the
//! destinations a verification picks are ones the map value captures.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::exclusions::{parse, ANNOTATIONS};
use sluice_common::EXCLUSIONS_MAX;

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
    assert_eq!(sluice::exclusions::PodExclusions::from_value(&value), x);
    for preferred in ["192.0.2.1:80", "[2001:db8::1]:80"] {
        if let Some(d) = x.captured_outbound(preferred.parse().unwrap()) {
            let (family, words) = match d.ip() {
                std::net::IpAddr::V4(a) => (2, [u32::from_ne_bytes(a.octets()), 0, 0, 0]),
                std::net::IpAddr::V6(a) => {
                    let o = a.octets();
                    let w = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
                    (10, [w(0), w(4), w(8), w(12)])
                }
            };
            assert!(!value.excludes_outbound(family, &words, d.port()));
        }
    }
    if let Some(p) = x.captured_inbound_port(80) {
        assert!(!value.excludes_inbound(p));
    }
});

//! Pod labels and annotations, as the API would hand them to the agent: the
//! selection and the capture options (DNS capture's included) never panic, and options that parse
//! survive the trip through their pinned-map form.
#![no_main]

use k8s_openapi::api::core::v1::Pod;
use libfuzzer_sys::fuzz_target;
use sluice::{
    kube::selection,
    options::{
        PodOptions, BYPASS_DNS_CAPTURE, BYPASS_INBOUND_CAPTURE, DNS_CAPTURE,
        REROUTE_VIRTUAL_INTERFACES,
    },
};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.splitn(5, '\u{0}');
    let mut next = || parts.next().unwrap_or_default();
    let (mode, bypass, reroute, dns, bypass_dns) = (next(), next(), next(), next(), next());
    // The bypass-dns-capture annotation counts by presence: leave it out
    // when its part is empty.
    let mut annotations = serde_json::json!({
        BYPASS_INBOUND_CAPTURE: bypass,
        REROUTE_VIRTUAL_INTERFACES: reroute,
        DNS_CAPTURE: dns,
    });
    if !bypass_dns.is_empty() {
        annotations[BYPASS_DNS_CAPTURE] = bypass_dns.into();
    }
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": "p", "namespace": "ns", "uid": "u",
            "labels": {selection::DATAPLANE_MODE: mode},
            "annotations": annotations,
        },
        "spec": {"nodeName": "node-a", "containers": [{"name": "app"}]},
    }))
    .expect("a well-formed pod");
    let ns_labels = [(selection::DATAPLANE_MODE.to_string(), mode.to_string())].into();
    let _ = selection::select(
        &pod,
        Some(&ns_labels),
        "node-a",
        &selection::Selection::default(),
    );
    if let Ok(o) = selection::options(&pod) {
        for node_dns in [true, false] {
            let flags = o.flags(node_dns);
            assert_eq!(
                PodOptions::from_maps(flags, Some(&o.reroute_bytes()), None),
                o
            );
        }
    }
});

//! Pod labels and annotations, as the API would hand them to the agent: the
//! selection and the capture options never panic, and options that parse
//! survive the trip through their pinned-map form.
#![no_main]

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::Pod;
use libfuzzer_sys::fuzz_target;
use sluice::{
    kube::selection,
    options::{PodOptions, BYPASS_INBOUND_CAPTURE, REROUTE_VIRTUAL_INTERFACES},
};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.splitn(3, '\u{0}');
    let (mode, bypass, reroute) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": "p", "namespace": "ns", "uid": "u",
            "labels": {selection::DATAPLANE_MODE: mode},
            "annotations": {BYPASS_INBOUND_CAPTURE: bypass, REROUTE_VIRTUAL_INTERFACES: reroute},
        },
        "spec": {"nodeName": "node-a", "containers": [{"name": "app"}]},
    }))
    .expect("a well-formed pod");
    let ns_labels = [(selection::DATAPLANE_MODE.to_string(), mode.to_string())].into();
    let _ = selection::select(&pod, Some(&ns_labels), "node-a", &BTreeSet::new());
    if let Ok(o) = selection::options(&pod) {
        assert_eq!(PodOptions::from_maps(o.flags(), Some(&o.reroute_bytes())), o);
    }
});

//! Istio ambient's pod selection, exactly: a pod is in the mesh when an
//! enablement selector matches it and its namespace (by default: the pod or
//! its namespace labelled `istio.io/dataplane-mode=ambient`, unless the pod
//! says `istio.io/dataplane-mode=none`; see `enablement`); host-network pods
//! and pods with an Istio sidecar never are, nor pods of an excluded
//! namespace (istio-cni's `excludeNamespaces`). Only pods on this node are
//! ours.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;

pub const DATAPLANE_MODE: &str = "istio.io/dataplane-mode";
pub const AMBIENT: &str = "ambient";
pub const NONE: &str = "none";
/// Set by Istio's sidecar injector on injected pods.
pub const SIDECAR_STATUS: &str = "sidecar.istio.io/status";
pub const SIDECAR_CONTAINER: &str = "istio-proxy";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Enroll,
    Skip(Skip),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    OtherNode,
    HostNetwork,
    Sidecar,
    /// Succeeded or Failed: its sandbox is gone or going.
    Terminated,
    /// `istio.io/dataplane-mode=none` on the pod.
    OptedOut,
    /// Neither the pod nor its namespace asks for ambient.
    NotAmbient,
    /// No enablement selector matches (custom selectors).
    NotSelected,
    /// The namespace is excluded on this node (`--exclude-namespaces`).
    Excluded,
}

impl Skip {
    pub fn reason(self) -> &'static str {
        match self {
            Skip::OtherNode => "pod is scheduled on another node",
            Skip::HostNetwork => "pod uses the host network",
            Skip::Sidecar => "pod has an Istio sidecar",
            Skip::Terminated => "pod has terminated",
            Skip::OptedOut => "pod is labelled istio.io/dataplane-mode=none",
            Skip::NotAmbient => {
                "neither the pod nor its namespace is labelled istio.io/dataplane-mode=ambient"
            }
            Skip::NotSelected => {
                "no enablement selector (--enablement-selectors) matches the pod and its namespace"
            }
            Skip::Excluded => "the pod's namespace is excluded (--exclude-namespaces)",
        }
    }
}

/// The pod's capture options (its Istio annotations).
pub fn options(pod: &Pod) -> Result<crate::options::PodOptions, crate::options::OptionsError> {
    let annotations = pod.metadata.annotations.as_ref();
    crate::options::PodOptions::from_annotations(|k| annotations?.get(k).map(String::as_str))
}

/// What this node makes of the pod's exclusion annotations.
pub fn exclusions(pod: &Pod, sel: &Selection) -> crate::exclusions::Decision {
    let annotations = pod.metadata.annotations.as_ref();
    let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
    sel.exclusions
        .decide(ns, |k| annotations?.get(k).map(String::as_str))
}

/// The capture options of a pod about to be captured: its annotations',
/// with the exclusions this node honours (malformed ones: none, the pod
/// is captured fully).
pub fn new_pod_options(
    pod: &Pod,
    sel: &Selection,
) -> Result<crate::options::PodOptions, crate::options::OptionsError> {
    let mut o = options(pod)?;
    o.exclusions = exclusions(pod, sel).target(&Default::default());
    Ok(o)
}

/// The addresses the runtime gave the pod, as its status has them
/// (`status.podIPs`, else `status.podIP`); what does not parse is left out.
pub fn pod_ips(pod: &Pod) -> Vec<std::net::IpAddr> {
    let Some(status) = pod.status.as_ref() else {
        return Vec::new();
    };
    let listed = status.pod_ips.iter().flatten().map(|p| p.ip.as_str());
    let ips: Vec<std::net::IpAddr> = listed.filter_map(|ip| ip.parse().ok()).collect();
    if !ips.is_empty() {
        return ips;
    }
    status
        .pod_ip
        .iter()
        .filter_map(|ip| ip.parse().ok())
        .collect()
}

/// What decides which pods of this node are in the mesh, and which of
/// their exclusion annotations count.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// Namespaces whose pods are never captured (`--exclude-namespaces`).
    pub excluded: BTreeSet<String>,
    /// `--enablement-selectors`.
    pub enablement: super::enablement::Enablement,
    /// `--pod-exclusions`, `--pod-exclusions-namespaces`.
    pub exclusions: crate::exclusions::Policy,
}

impl Selection {
    pub fn excluding(excluded: BTreeSet<String>) -> Self {
        Self {
            excluded,
            ..Default::default()
        }
    }

    /// The namespaces whose pods the CNI plugin makes wait while the agent
    /// is down (see `Enablement::namespace_may_select`).
    pub fn waiting_namespaces<'a>(
        &self,
        namespaces: impl IntoIterator<Item = (&'a String, &'a BTreeMap<String, String>)>,
    ) -> BTreeSet<String> {
        namespaces
            .into_iter()
            .filter(|(name, labels)| {
                !self.excluded.contains(*name) && self.enablement.namespace_may_select(labels)
            })
            .map(|(name, _)| name.clone())
            .collect()
    }
}

pub fn select(
    pod: &Pod,
    namespace_labels: Option<&BTreeMap<String, String>>,
    node: &str,
    sel: &Selection,
) -> Verdict {
    let excluded = &sel.excluded;
    let spec = pod.spec.as_ref();
    if spec
        .and_then(|s| s.node_name.as_deref())
        .is_some_and(|n| n != node)
    {
        return Verdict::Skip(Skip::OtherNode);
    }
    if spec.and_then(|s| s.host_network).unwrap_or(false) {
        return Verdict::Skip(Skip::HostNetwork);
    }
    if pod
        .metadata
        .namespace
        .as_ref()
        .is_some_and(|ns| excluded.contains(ns))
    {
        return Verdict::Skip(Skip::Excluded);
    }
    let has_sidecar_annotation = pod
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(SIDECAR_STATUS));
    let has_proxy_container = spec.is_some_and(|s| {
        s.containers
            .iter()
            .chain(s.init_containers.iter().flatten())
            .any(|c| c.name == SIDECAR_CONTAINER)
    });
    if has_sidecar_annotation || has_proxy_container {
        return Verdict::Skip(Skip::Sidecar);
    }
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if matches!(phase, Some("Succeeded" | "Failed")) {
        return Verdict::Skip(Skip::Terminated);
    }
    let none = BTreeMap::new();
    let pod_labels = pod.metadata.labels.as_ref().unwrap_or(&none);
    if sel
        .enablement
        .selects(pod_labels, namespace_labels.unwrap_or(&none))
    {
        return Verdict::Enroll;
    }
    if !sel.enablement.is_default() {
        return Verdict::Skip(Skip::NotSelected);
    }
    match pod_labels.get(DATAPLANE_MODE).map(String::as_str) {
        Some(NONE) => Verdict::Skip(Skip::OptedOut),
        _ => Verdict::Skip(Skip::NotAmbient),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn pod_ips_come_from_the_status() {
        let pod = |status: serde_json::Value| -> Pod {
            serde_json::from_value(json!({"metadata": {"name": "p"}, "status": status})).unwrap()
        };
        let ips = |p: &Pod| -> Vec<String> { pod_ips(p).iter().map(ToString::to_string).collect() };
        let both =
            pod(json!({"podIP": "10.0.0.5", "podIPs": [{"ip": "10.0.0.5"}, {"ip": "fd00::5"}]}));
        assert_eq!(ips(&both), ["10.0.0.5", "fd00::5"]);
        assert_eq!(ips(&pod(json!({"podIP": "10.0.0.6"}))), ["10.0.0.6"]);
        assert!(ips(&pod(json!({"podIPs": [{"ip": "not-an-ip"}]}))).is_empty());
        assert!(ips(&pod(json!({}))).is_empty());
    }

    fn pod(v: serde_json::Value) -> Pod {
        let mut base = json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"nodeName": "node-a", "containers": [{"name": "app"}]},
            "status": {"phase": "Running"},
        });
        merge(&mut base, v);
        serde_json::from_value(base).unwrap()
    }

    fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
        match (a, b) {
            (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
                for (k, v) in b {
                    merge(a.entry(k).or_insert(serde_json::Value::Null), v);
                }
            }
            (a, b) => *a = b,
        }
    }

    fn ns(mode: Option<&str>) -> BTreeMap<String, String> {
        mode.map(|m| [(DATAPLANE_MODE.to_string(), m.to_string())].into())
            .unwrap_or_default()
    }

    #[test]
    fn selection_table() {
        use Skip::*;
        let ambient = json!({"metadata": {"labels": {DATAPLANE_MODE: AMBIENT}}});
        let none = json!({"metadata": {"labels": {DATAPLANE_MODE: NONE}}});
        let rows: Vec<(&str, serde_json::Value, Option<&str>, Verdict)> = vec![
            (
                "namespace ambient",
                json!({}),
                Some(AMBIENT),
                Verdict::Enroll,
            ),
            (
                "pod ambient, namespace unlabelled",
                ambient.clone(),
                None,
                Verdict::Enroll,
            ),
            (
                "pod ambient, namespace none",
                ambient.clone(),
                Some(NONE),
                Verdict::Enroll,
            ),
            (
                "pod none in an ambient namespace",
                none.clone(),
                Some(AMBIENT),
                Verdict::Skip(OptedOut),
            ),
            (
                "nothing labelled",
                json!({}),
                None,
                Verdict::Skip(NotAmbient),
            ),
            (
                "other label value",
                json!({"metadata": {"labels": {DATAPLANE_MODE: "sidecar"}}}),
                None,
                Verdict::Skip(NotAmbient),
            ),
            (
                "host network",
                json!({"spec": {"hostNetwork": true}}),
                Some(AMBIENT),
                Verdict::Skip(HostNetwork),
            ),
            (
                "sidecar annotation",
                json!({"metadata": {"annotations": {SIDECAR_STATUS: "{}"}}}),
                Some(AMBIENT),
                Verdict::Skip(Sidecar),
            ),
            (
                "istio-proxy container",
                json!({"spec": {"containers": [{"name": "app"}, {"name": SIDECAR_CONTAINER}]}}),
                Some(AMBIENT),
                Verdict::Skip(Sidecar),
            ),
            (
                "native sidecar (init container)",
                json!({"spec": {"initContainers": [{"name": SIDECAR_CONTAINER}]}}),
                Some(AMBIENT),
                Verdict::Skip(Sidecar),
            ),
            (
                "another node",
                json!({"spec": {"nodeName": "node-b"}}),
                Some(AMBIENT),
                Verdict::Skip(OtherNode),
            ),
            (
                "succeeded",
                json!({"status": {"phase": "Succeeded"}}),
                Some(AMBIENT),
                Verdict::Skip(Terminated),
            ),
            (
                "excluded namespace, pod ambient",
                json!({"metadata": {"namespace": "kube-system", "labels": {DATAPLANE_MODE: AMBIENT}}}),
                Some(AMBIENT),
                Verdict::Skip(Excluded),
            ),
        ];
        let excluded = Selection::excluding(["kube-system".to_string()].into());
        for (name, patch, ns_mode, want) in rows {
            let p = pod(patch);
            let labels = ns(ns_mode);
            assert_eq!(
                select(&p, Some(&labels), "node-a", &excluded),
                want,
                "{name}"
            );
        }
    }
}

//! Which pods are in the mesh: istio-cni's enablement selectors
//! (`ambient.enablementSelectors`, 1.27), a list of `{podSelector,
//! namespaceSelector}` pairs of Kubernetes label selectors. A pod is selected
//! when any one entry matches: its pod selector the pod's labels and its
//! namespace selector the namespace's (a missing or empty selector matches
//! everything). The default is Istio's: the pod labelled
//! `istio.io/dataplane-mode=ambient`, or its namespace so labelled and the pod
//! not `none`. Host-network pods, sidecar pods and excluded namespaces are
//! decided before the selectors (`selection`).

use std::{collections::BTreeMap, fmt, str::FromStr};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::core::{Selector, SelectorExt as _};
use serde::Deserialize;

/// `--enablement-selectors`' default: Istio's.
pub const DEFAULT: &str = r#"[{"podSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}},{"podSelector":{"matchExpressions":[{"key":"istio.io/dataplane-mode","operator":"NotIn","values":["none"]}]},"namespaceSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}}]"#;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawEntry {
    pod_selector: Option<LabelSelector>,
    namespace_selector: Option<LabelSelector>,
}

#[derive(Debug, Clone)]
struct Entry {
    pod: Selector,
    namespace: Selector,
    /// The pod selector says nothing (matches every pod).
    any_pod: bool,
    /// The namespace selector says nothing (matches every namespace).
    any_namespace: bool,
}

#[derive(Debug, Clone)]
pub struct Enablement {
    entries: Vec<Entry>,
    /// As given (for messages).
    text: String,
    /// Whether these are Istio's default selectors, whatever the key order
    /// (Helm's `toJson` sorts keys). Decided once: selection asks per pod.
    default: bool,
}

impl Enablement {
    /// Whether a pod with `pod` labels in a namespace with `namespace`
    /// labels is selected.
    pub fn selects(
        &self,
        pod: &BTreeMap<String, String>,
        namespace: &BTreeMap<String, String>,
    ) -> bool {
        self.entries
            .iter()
            .any(|e| e.pod.matches(pod) && e.namespace.matches(namespace))
    }

    /// Whether pods of a namespace with these labels may be selected without
    /// looking at the pod's own labels, which the CNI plugin cannot see: some
    /// entry matches the namespace and either names namespaces or takes
    /// every pod. The plugin's snapshot holds such namespaces; their pods
    /// wait while the agent is down. A pod selected only through an entry
    /// with no namespace selector (by its own labels) is not covered: it
    /// starts, and the agent's pod watch captures it when it is back.
    pub fn namespace_may_select(&self, namespace: &BTreeMap<String, String>) -> bool {
        self.entries
            .iter()
            .any(|e| (!e.any_namespace || e.any_pod) && e.namespace.matches(namespace))
    }

    /// Whether these are Istio's default selectors.
    pub fn is_default(&self) -> bool {
        self.default
    }
}

impl Default for Enablement {
    fn default() -> Self {
        DEFAULT
            .parse()
            .expect("the default enablement selectors parse")
    }
}

impl fmt::Display for Enablement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl FromStr for Enablement {
    type Err = String;

    /// A JSON list, as Helm's `toJson` renders the chart value.
    fn from_str(s: &str) -> Result<Self, String> {
        let json: serde_json::Value = serde_json::from_str(s)
            .map_err(|e| format!("{s:?}: {e} (expected a JSON list of label selector pairs)"))?;
        let raw: Vec<RawEntry> = serde_json::from_value(json.clone()).map_err(|e| {
            format!("{s:?}: {e} (expected a JSON list of {{\"podSelector\": …, \"namespaceSelector\": …}} label selectors)")
        })?;
        if raw.is_empty() {
            return Err(format!(
                "{s:?}: an empty list selects no pod at all; to capture nothing, do not label anything ambient"
            ));
        }
        let entries = raw
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                let empty = |l: &Option<LabelSelector>| {
                    l.as_ref().is_none_or(|l| {
                        l.match_labels.as_ref().is_none_or(BTreeMap::is_empty)
                            && l.match_expressions.as_ref().is_none_or(Vec::is_empty)
                    })
                };
                let (any_pod, any_namespace) =
                    (empty(&r.pod_selector), empty(&r.namespace_selector));
                let sel = |l: Option<LabelSelector>, what: &str| {
                    Selector::try_from(l.unwrap_or_default())
                        .map_err(|e| format!("{s:?}: entry {i}'s {what}: {}", e.0))
                };
                Ok(Entry {
                    pod: sel(r.pod_selector, "podSelector")?,
                    namespace: sel(r.namespace_selector, "namespaceSelector")?,
                    any_pod,
                    any_namespace,
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(Self {
            entries,
            text: s.to_owned(),
            default: serde_json::from_str::<serde_json::Value>(DEFAULT).is_ok_and(|d| d == json),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn istios_default_selects_as_the_labels_always_did() {
        let e = Enablement::default();
        assert!(e.is_default());
        // As Helm's toJson renders it: keys sorted.
        let sorted: Enablement = r#"[{"podSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}},{"namespaceSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}},"podSelector":{"matchExpressions":[{"key":"istio.io/dataplane-mode","operator":"NotIn","values":["none"]}]}}]"#.parse().unwrap();
        assert!(sorted.is_default());
        let ambient = labels(&[("istio.io/dataplane-mode", "ambient")]);
        let none = labels(&[("istio.io/dataplane-mode", "none")]);
        let plain = labels(&[]);
        assert!(e.selects(&ambient, &plain), "pod ambient");
        assert!(e.selects(&plain, &ambient), "namespace ambient");
        assert!(
            !e.selects(&none, &ambient),
            "pod none in an ambient namespace"
        );
        assert!(
            e.selects(&ambient, &none),
            "pod ambient in a namespace none"
        );
        assert!(!e.selects(&plain, &plain));
        // The plugin's snapshot: ambient namespaces only.
        assert!(e.namespace_may_select(&ambient));
        assert!(!e.namespace_may_select(&plain));
    }

    #[test]
    fn custom_selectors_with_expressions() {
        let e: Enablement = r#"[{"namespaceSelector":{"matchExpressions":[{"key":"team","operator":"In","values":["pay","shop"]}]},
            "podSelector":{"matchExpressions":[{"key":"mesh","operator":"DoesNotExist"}]}}]"#
            .parse()
            .unwrap();
        assert!(!e.is_default());
        let shop = labels(&[("team", "shop")]);
        assert!(e.selects(&labels(&[]), &shop));
        assert!(!e.selects(&labels(&[("mesh", "off")]), &shop));
        assert!(!e.selects(&labels(&[]), &labels(&[("team", "ops")])));
        assert!(e.namespace_may_select(&shop));
        // Everything: every namespace is in the snapshot.
        let all: Enablement = "[{}]".parse().unwrap();
        assert!(all.selects(&labels(&[]), &labels(&[])));
        assert!(all.namespace_may_select(&labels(&[])));
    }

    #[test]
    fn bad_selectors_are_refused_with_the_reason() {
        for (bad, says) in [
            ("{}", "expected a JSON list"),
            ("[{", "expected a JSON list"),
            ("[]", "selects no pod"),
            (r#"[{"podselector":{}}]"#, "unknown field"),
            (
                r#"[{"podSelector":{"matchExpressions":[{"key":"a","operator":"Near"}]}}]"#,
                "entry 0's podSelector",
            ),
        ] {
            let e = bad.parse::<Enablement>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}

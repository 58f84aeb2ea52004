//! What the agent should change so that the enrolled pods are exactly the
//! ambient pods on this node: a pure function of the pods and namespaces the
//! API shows and the pods the pinned maps hold.

use std::{
    borrow::Borrow,
    collections::{BTreeMap, BTreeSet},
};

use k8s_openapi::api::core::v1::Pod;

use super::selection::{select, Selection, Verdict};

/// An enrolled pod, as the maps know it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enrolled {
    pub uid: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// An ambient pod on this node without capture.
    Enroll {
        uid: String,
        name: String,
        namespace: String,
        service_account: String,
        /// From the pod's annotations (an error: the pod is not enrolled).
        options: Box<Result<crate::options::PodOptions, crate::options::OptionsError>>,
    },
    /// Captured, but gone from the node or no longer ambient.
    Unenroll { uid: String, reason: String },
}

/// `pods`: the pods on this node; `namespaces`: labels by namespace name.
pub fn plan<P: Borrow<Pod>>(
    pods: &[P],
    namespaces: &BTreeMap<String, BTreeMap<String, String>>,
    node: &str,
    sel: &Selection,
    enrolled: &[Enrolled],
) -> Vec<Action> {
    let have: BTreeSet<&str> = enrolled.iter().map(|e| e.uid.as_str()).collect();
    let mut actions = Vec::new();
    let mut seen = BTreeSet::new();
    for pod in pods {
        let pod = pod.borrow();
        let Some(uid) = pod.metadata.uid.as_deref() else {
            continue;
        };
        seen.insert(uid);
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let verdict = select(pod, namespaces.get(&ns), node, sel);
        match (verdict, have.contains(uid)) {
            (Verdict::Enroll, false) => actions.push(Action::Enroll {
                options: Box::new(super::selection::new_pod_options(pod, sel)),
                uid: uid.to_owned(),
                name: pod.metadata.name.clone().unwrap_or_default(),
                namespace: ns,
                service_account: pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.service_account_name.clone())
                    .unwrap_or_else(|| "default".into()),
            }),
            (Verdict::Skip(s), true) => actions.push(Action::Unenroll {
                uid: uid.to_owned(),
                reason: s.reason().into(),
            }),
            _ => {}
        }
    }
    for e in enrolled {
        if !seen.contains(e.uid.as_str()) {
            actions.push(Action::Unenroll {
                uid: e.uid.clone(),
                reason: "pod no longer exists on this node".into(),
            });
        }
    }
    actions
}

/// The pods of this node that selection leaves uncaptured, and why (for
/// `sluice status --pod`).
pub fn skipped<P: Borrow<Pod>>(
    pods: &[P],
    namespaces: &BTreeMap<String, BTreeMap<String, String>>,
    node: &str,
    sel: &Selection,
) -> Vec<crate::control::SkippedPod> {
    pods.iter()
        .map(Borrow::borrow)
        .filter_map(|pod: &Pod| {
            let ns = pod.metadata.namespace.clone().unwrap_or_default();
            match select(pod, namespaces.get(&ns), node, sel) {
                Verdict::Skip(s) => Some(crate::control::SkippedPod {
                    namespace: ns,
                    name: pod.metadata.name.clone().unwrap_or_default(),
                    uid: pod.metadata.uid.clone().unwrap_or_default(),
                    reason: s.reason().into(),
                }),
                Verdict::Enroll => None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(name: &str, ns: &str, labels: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns, "uid": format!("u-{name}"), "labels": labels},
            "spec": {"nodeName": "a", "serviceAccountName": "sa", "containers": [{"name": "app"}]},
            "status": {"phase": "Running"},
        }))
        .unwrap()
    }

    #[test]
    fn enrolls_missing_ambient_pods_and_unenrolls_the_rest() {
        let pods = vec![
            pod("new", "mesh", json!({})),
            pod("kept", "mesh", json!({})),
            pod("optout", "mesh", json!({"istio.io/dataplane-mode": "none"})),
            pod("plain", "other", json!({})),
        ];
        let namespaces: BTreeMap<String, BTreeMap<String, String>> = [
            (
                "mesh".to_string(),
                [("istio.io/dataplane-mode".to_string(), "ambient".to_string())].into(),
            ),
            ("other".to_string(), BTreeMap::new()),
        ]
        .into();
        let enrolled: Vec<Enrolled> = ["u-kept", "u-optout", "u-deleted"]
            .iter()
            .map(|u| Enrolled { uid: u.to_string() })
            .collect();
        let actions = plan(&pods, &namespaces, "a", &Selection::default(), &enrolled);
        assert_eq!(
            actions,
            vec![
                Action::Enroll {
                    uid: "u-new".into(),
                    name: "new".into(),
                    namespace: "mesh".into(),
                    service_account: "sa".into(),
                    options: Box::new(Ok(Default::default())),
                },
                Action::Unenroll {
                    uid: "u-optout".into(),
                    reason: "pod is labelled istio.io/dataplane-mode=none".into()
                },
                Action::Unenroll {
                    uid: "u-deleted".into(),
                    reason: "pod no longer exists on this node".into()
                },
            ]
        );
        // Nothing to do once applied.
        let enrolled: Vec<Enrolled> = ["u-kept", "u-new"]
            .iter()
            .map(|u| Enrolled { uid: u.to_string() })
            .collect();
        assert!(plan(&pods, &namespaces, "a", &Selection::default(), &enrolled).is_empty());
        // What is left uncaptured, with why.
        let left: Vec<(String, String)> = skipped(&pods, &namespaces, "a", &Selection::default())
            .into_iter()
            .map(|s| (s.name, s.reason))
            .collect();
        assert_eq!(
            left,
            [
                (
                    "optout".to_string(),
                    "pod is labelled istio.io/dataplane-mode=none".to_string()
                ),
                (
                    "plain".into(),
                    super::super::selection::Skip::NotAmbient.reason().into()
                ),
            ]
        );
    }
}

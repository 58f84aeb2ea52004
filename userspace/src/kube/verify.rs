//! Cross-checking CNI requests against the API, so that a local process
//! cannot un-capture a running pod with a forged DEL: the request must name a
//! pod that is really going away (or already gone) from this node.

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;

/// What the API says about the pod a CNI request names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// On this node, this uid, not terminating.
    Live,
    /// Deleting (deletionTimestamp) or in a terminal phase.
    Terminating,
    /// Not in the API, or another incarnation (different uid).
    Gone,
    /// On another node: not ours to act on.
    OtherNode(String),
}

/// The annotation the kubelet gives a static pod's mirror in the API: the
/// static pod's own uid (its config hash), which is what the runtime's
/// `K8S_POD_UID` carries for it.
const MIRROR_OF: &str = "kubernetes.io/config.mirror";

/// Whether `pod` is the incarnation a CNI request's `K8S_POD_UID` names:
/// its API uid, or for a static pod the kubelet's uid its mirror records.
fn is_incarnation(pod: &Pod, uid: &str) -> bool {
    pod.metadata.uid.as_deref() == Some(uid)
        || pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(MIRROR_OF))
            .is_some_and(|m| m == uid)
}

pub fn classify(pod: Option<&Pod>, uid: Option<&str>, node: &str) -> Found {
    let Some(pod) = pod else { return Found::Gone };
    if uid.is_some_and(|u| !is_incarnation(pod, u)) {
        return Found::Gone;
    }
    if let Some(n) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
        if n != node {
            return Found::OtherNode(n.to_owned());
        }
    }
    let terminal = matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    );
    if pod.metadata.deletion_timestamp.is_some() || terminal {
        return Found::Terminating;
    }
    Found::Live
}

/// Whether a CNI DEL may remove capture. `sandbox_alive`: the enrolled netns
/// still exists. A live pod loses capture only when its sandbox is gone.
pub fn del_allowed(found: &Found, sandbox_alive: bool) -> Result<(), String> {
    match found {
        Found::Gone | Found::Terminating => Ok(()),
        Found::Live if !sandbox_alive => Ok(()),
        Found::Live => {
            Err("the pod is running on this node and its sandbox is alive: refusing DEL".into())
        }
        Found::OtherNode(n) => Err(format!("the pod runs on node {n}, not here: refusing DEL")),
    }
}

/// Fetches the pod (None when it does not exist).
pub async fn fetch(client: kube::Client, namespace: &str, name: &str) -> kube::Result<Option<Pod>> {
    Api::<Pod>::namespaced(client, namespace)
        .get_opt(name)
        .await
}

#[cfg(test)]
mod tests {
    use http::{Request, Response, StatusCode};
    use kube::client::Body;
    use serde_json::json;

    use super::*;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn forged_del_for_a_running_pod_is_refused() {
        let live = pod(
            json!({"metadata": {"name": "p", "uid": "u1"}, "spec": {"nodeName": "a", "containers": []}, "status": {"phase": "Running"}}),
        );
        let deleting = pod(
            json!({"metadata": {"name": "p", "uid": "u1", "deletionTimestamp": "2026-11-22T00:00:00Z"}, "spec": {"nodeName": "a", "containers": []}}),
        );
        assert_eq!(classify(Some(&live), Some("u1"), "a"), Found::Live);
        assert!(del_allowed(&classify(Some(&live), Some("u1"), "a"), true).is_err());
        // Its sandbox died: the DEL is the runtime cleaning up.
        assert!(del_allowed(&classify(Some(&live), Some("u1"), "a"), false).is_ok());
        assert!(del_allowed(&classify(Some(&deleting), Some("u1"), "a"), true).is_ok());
        assert!(del_allowed(&classify(None, Some("u1"), "a"), true).is_ok());
        // Same name, new incarnation: the old one is gone.
        assert_eq!(classify(Some(&live), Some("u0"), "a"), Found::Gone);
        assert!(matches!(
            classify(Some(&live), Some("u1"), "b"),
            Found::OtherNode(_)
        ));
    }

    #[tokio::test]
    async fn fetch_maps_404_to_none() {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(svc, "default");
        let server = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!(req.uri().path(), "/api/v1/namespaces/shop/pods/gone");
            let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "pods \"gone\" not found"});
            send.send_response(
                Response::builder()
                    .status(StatusCode::NOT_FOUND)
                    .body(Body::from(serde_json::to_vec(&status).unwrap()))
                    .unwrap(),
            );
        });
        assert!(fetch(client, "shop", "gone").await.unwrap().is_none());
        server.await.unwrap();
    }
}

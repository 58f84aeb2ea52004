//! `--untaint KEY`: once the node condition is True, the agent removes the
//! startup taint `KEY` from its Node (for clusters without
//! node-readiness-controller). It never adds taints. The write is a merge
//! patch of `spec.taints` carrying the resourceVersion it was computed from,
//! so a taint another controller added meanwhile is not lost: 409, re-read,
//! retried.

use k8s_openapi::api::core::v1::{Node, Taint};
use kube::api::{Api, Patch, PatchParams};
use serde_json::{json, Value};

use super::patch::{precondition, retry_on_conflict};

/// The node's taints without those keyed in `keys`; `None` when it has none
/// of them.
pub fn without(node: &Node, keys: &[String]) -> Option<Vec<Taint>> {
    let taints = node.spec.as_ref()?.taints.as_ref()?;
    let ours = |t: &Taint| keys.contains(&t.key);
    taints
        .iter()
        .any(ours)
        .then(|| taints.iter().filter(|t| !ours(t)).cloned().collect())
}

/// The merge patch that leaves exactly `remaining`.
pub fn patch_body(remaining: &[Taint], resource_version: Option<&str>) -> Value {
    precondition(json!({ "spec": { "taints": remaining } }), resource_version)
}

/// Removes the taints keyed `keys` from `node` in one write; `Ok(false)`
/// when it had none of them.
pub async fn remove(client: kube::Client, node: &str, keys: &[String]) -> kube::Result<bool> {
    let api: Api<Node> = Api::all(client);
    retry_on_conflict(|| async {
        let n = api.get(node).await?;
        let Some(remaining) = without(&n, keys) else {
            return Ok(false);
        };
        let body = patch_body(&remaining, n.metadata.resource_version.as_deref());
        api.patch(node, &PatchParams::default(), &Patch::Merge(body))
            .await
            .map(|_| true)
    })
    .await
}

#[cfg(test)]
mod tests {
    use http::Method;

    use super::*;
    use crate::kube::mock::{self, reply};

    const KEY: &str = "cni.istio.io/not-ready";

    fn keys() -> Vec<String> {
        vec![KEY.into()]
    }

    fn node(rv: &str, taints: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "node-a", "resourceVersion": rv},
            "spec": {"taints": taints}})
    }

    #[tokio::test]
    async fn removes_only_that_taint_and_retries_a_conflict() {
        let (client, mut h) = mock::client();
        let server = tokio::spawn(async move {
            let ours = json!({"key": KEY, "effect": "NoSchedule"});
            let other = json!({"key": "dedicated", "value": "gpu", "effect": "NoSchedule"});
            let late = json!({"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"});
            let (req, send) = h.next_request().await.unwrap();
            assert_eq!(
                (req.method(), req.uri().path()),
                (&Method::GET, "/api/v1/nodes/node-a")
            );
            reply(send, 200, &node("10", json!([ours, other])));
            let (req, send) = h.next_request().await.unwrap();
            assert_eq!(
                (req.method(), req.uri().path()),
                (&Method::PATCH, "/api/v1/nodes/node-a")
            );
            assert_eq!(
                req.headers()["content-type"],
                "application/merge-patch+json"
            );
            let body = mock::body(req).await;
            assert_eq!(
                body,
                json!({"metadata": {"resourceVersion": "10"}, "spec": {"taints": [other]}})
            );
            mock::conflict(send);
            // The node controller added a taint meanwhile: it must survive.
            let (_, send) = h.next_request().await.unwrap();
            reply(send, 200, &node("11", json!([ours, other, late])));
            let (req, send) = h.next_request().await.unwrap();
            let body = mock::body(req).await;
            assert_eq!(
                body,
                json!({"metadata": {"resourceVersion": "11"}, "spec": {"taints": [other, late]}})
            );
            reply(send, 200, &node("12", json!([other, late])));
        });
        assert!(remove(client, "node-a", &keys()).await.unwrap());
        server.await.unwrap();
    }

    #[tokio::test]
    async fn never_writes_when_the_taint_is_absent() {
        let (client, mut h) = mock::client();
        let server = tokio::spawn(async move {
            let (_, send) = h.next_request().await.unwrap();
            reply(
                send,
                200,
                &node("3", json!([{"key": "dedicated", "effect": "NoSchedule"}])),
            );
            // The handle drops here: a PATCH would fail the call below.
        });
        assert!(!remove(client, "node-a", &keys()).await.unwrap());
        server.await.unwrap();
    }
}

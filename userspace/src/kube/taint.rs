//! `--untaint KEY`: once the node condition is True, the agent removes the
//! startup taint `KEY` from its Node (for clusters without
//! node-readiness-controller). It never adds taints. The write is a merge
//! patch of `spec.taints` carrying the resourceVersion it was computed from,
//! so a taint another controller added meanwhile is not lost: 409, re-read,
//! retried.

use k8s_openapi::api::core::v1::{Node, Taint};
use kube::api::{Api, Patch, PatchParams};
use serde_json::{json, Value};

const CONFLICT_ATTEMPTS: usize = 5;

/// The node's taints without those keyed `key`; `None` when there are none.
pub fn without(node: &Node, key: &str) -> Option<Vec<Taint>> {
    let taints = node.spec.as_ref()?.taints.as_ref()?;
    taints
        .iter()
        .any(|t| t.key == key)
        .then(|| taints.iter().filter(|t| t.key != key).cloned().collect())
}

/// The merge patch that leaves exactly `remaining`.
pub fn patch_body(remaining: &[Taint], resource_version: Option<&str>) -> Value {
    let mut body = json!({ "spec": { "taints": remaining } });
    if let Some(rv) = resource_version {
        body["metadata"] = json!({ "resourceVersion": rv });
    }
    body
}

/// Removes taint `key` from `node`; `Ok(false)` when it had none.
pub async fn remove(client: kube::Client, node: &str, key: &str) -> kube::Result<bool> {
    let api: Api<Node> = Api::all(client);
    let mut attempt = 0;
    loop {
        attempt += 1;
        let n = api.get(node).await?;
        let Some(remaining) = without(&n, key) else {
            return Ok(false);
        };
        let body = patch_body(&remaining, n.metadata.resource_version.as_deref());
        match api
            .patch(node, &PatchParams::default(), &Patch::Merge(body))
            .await
        {
            Err(kube::Error::Api(e)) if e.code == 409 && attempt < CONFLICT_ATTEMPTS => continue,
            r => return r.map(|_| true),
        }
    }
}

#[cfg(test)]
mod tests {
    use http::Method;

    use super::*;
    use crate::kube::mock::{self, reply};

    const KEY: &str = "cni.istio.io/not-ready";

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
        assert!(remove(client, "node-a", KEY).await.unwrap());
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
        assert!(!remove(client, "node-a", KEY).await.unwrap());
        server.await.unwrap();
    }
}

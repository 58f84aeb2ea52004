//! The `ambient.istio.io/redirection` annotation istiod reads (it sends HBONE
//! only to pods carrying `enabled`): a JSON merge patch on the pod's status
//! subresource, as upstream's node agent writes it.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{json, Value};
use sluice_common::PodState;

pub const REDIRECTION: &str = "ambient.istio.io/redirection";

/// The annotation's value for a pod state; `None` removes it.
pub fn value(state: Option<PodState>) -> Option<&'static str> {
    match state {
        // istiod's meaning: redirection is in place (what ztunnel knows of
        // the pod is the readiness gate's business).
        Some(PodState::Enabled | PodState::Served) => Some("enabled"),
        Some(PodState::Pending) => Some("pending"),
        Some(PodState::Draining) | None => None,
    }
}

/// The merge patch that sets (or with `None` removes) the annotation.
pub fn patch(value: Option<&str>) -> Value {
    json!({ "metadata": { "annotations": { REDIRECTION: value } } })
}

/// [`patch`] for the pod of `uid` only: the API server refuses it (a
/// conflict) for another pod of the same name (a StatefulSet's next one).
pub fn patch_for(uid: &str, value: Option<&str>) -> Value {
    json!({ "metadata": { "uid": uid, "annotations": { REDIRECTION: value } } })
}

/// Writes the annotation for `state` on pod `namespace/name`, if it is the
/// pod of `uid`.
pub async fn write(
    client: kube::Client,
    namespace: &str,
    name: &str,
    uid: &str,
    state: Option<PodState>,
) -> kube::Result<()> {
    let api: Api<Pod> = Api::namespaced(client, namespace);
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(patch_for(uid, value(state))),
    )
    .await
    .map(drop)
}

#[cfg(test)]
mod tests {
    use http::{Method, Request, Response};
    use kube::client::Body;

    use super::*;

    #[test]
    fn values_follow_the_pod_state() {
        assert_eq!(value(Some(PodState::Enabled)), Some("enabled"));
        assert_eq!(value(Some(PodState::Served)), Some("enabled"));
        assert_eq!(value(Some(PodState::Pending)), Some("pending"));
        assert_eq!(value(None), None);
        assert_eq!(
            patch(None),
            json!({"metadata": {"annotations": {REDIRECTION: null}}})
        );
    }

    #[tokio::test]
    async fn sends_exactly_one_merge_patch_to_the_status_subresource() {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = kube::Client::new(svc, "default");
        let server = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.expect("one request");
            assert_eq!(req.method(), Method::PATCH);
            assert_eq!(
                req.uri().path(),
                "/api/v1/namespaces/shop/pods/cart-1/status"
            );
            assert_eq!(
                req.headers()["content-type"],
                "application/merge-patch+json"
            );
            let body = req.into_body().collect_bytes().await.unwrap();
            let sent: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(
                sent,
                json!({"metadata": {"uid": "u-1", "annotations": {REDIRECTION: "enabled"}}})
            );
            let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cart-1", "namespace": "shop"}});
            send.send_response(
                Response::builder()
                    .body(Body::from(serde_json::to_vec(&pod).unwrap()))
                    .unwrap(),
            );
        });
        write(client, "shop", "cart-1", "u-1", Some(PodState::Enabled))
            .await
            .unwrap();
        server.await.unwrap();
    }
}

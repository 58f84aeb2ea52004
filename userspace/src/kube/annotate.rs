//! The `ambient.istio.io/redirection` annotation istiod reads (it sends HBONE
//! only to pods carrying `enabled`): a JSON merge patch on the pod's status
//! subresource, as upstream's node agent writes it.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{json, Value};
use sluice_common::PodState;

pub const REDIRECTION: &str = "ambient.istio.io/redirection";

/// The annotation's value for a pod state; `None` removes it. `acked`:
/// ztunnel has taken the pod's capture since it was attached. Such a pod
/// stays `enabled` while Pending for ztunnel's listeners to come back (a
/// ztunnel restart), as istio-cni leaves it: `pending` would have istiod
/// stop sending the pod HBONE, and push every pod of the node twice, for
/// an outage the capture already fails closed through.
pub fn value(state: Option<PodState>, acked: bool) -> Option<&'static str> {
    match state {
        // istiod's meaning: redirection is in place (what ztunnel knows of
        // the pod is the readiness gate's business).
        Some(PodState::Enabled | PodState::Served) => Some("enabled"),
        Some(PodState::Pending) if acked => Some("enabled"),
        Some(PodState::Pending) => Some("pending"),
        Some(PodState::Draining) | None => None,
    }
}

/// Whether `shown` is the annotation for `state` (either value, for a
/// Pending pod: which one depends on what ztunnel did before, which an
/// agent that restarted since does not know).
pub fn in_step(shown: Option<&str>, state: Option<PodState>) -> bool {
    match state {
        Some(PodState::Pending) => matches!(shown, Some("enabled" | "pending")),
        _ => shown == value(state, false),
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
    acked: bool,
) -> kube::Result<()> {
    let api: Api<Pod> = Api::namespaced(client, namespace);
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(patch_for(uid, value(state, acked))),
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
        assert_eq!(value(Some(PodState::Enabled), false), Some("enabled"));
        assert_eq!(value(Some(PodState::Served), true), Some("enabled"));
        assert_eq!(value(Some(PodState::Pending), false), Some("pending"));
        // Pending again after ztunnel took it (its listeners gone): as it was.
        assert_eq!(value(Some(PodState::Pending), true), Some("enabled"));
        assert_eq!(value(None, true), None);
        assert!(in_step(Some("enabled"), Some(PodState::Pending)));
        assert!(in_step(Some("pending"), Some(PodState::Pending)));
        assert!(!in_step(None, Some(PodState::Pending)));
        assert!(!in_step(Some("pending"), Some(PodState::Served)));
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
        write(
            client,
            "shop",
            "cart-1",
            "u-1",
            Some(PodState::Enabled),
            false,
        )
        .await
        .unwrap();
        server.await.unwrap();
    }
}

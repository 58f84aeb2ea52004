//! The uninstall decision, the mark, and the hook's order of API calls,
//! against kube-rs' mock service.

use http::Method;

use super::*;
use crate::kube::mock::{self, reply};

fn ds(meta: Value) -> DaemonSet {
    serde_json::from_value(json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": meta, "spec": {"selector": {}, "template": {}}}))
    .unwrap()
}

#[test]
fn a_daemonset_that_is_gone_deleted_or_marked_means_uninstall() {
    assert_eq!(reason(None), Some(Reason::Gone));
    assert_eq!(reason(Some(&ds(json!({"name": "sluice"})))), None);
    assert_eq!(
        reason(Some(&ds(
            json!({"name": "sluice", "deletionTimestamp": "2026-11-23T10:00:00Z"})
        ))),
        Some(Reason::Deleting)
    );
    assert_eq!(
        reason(Some(&ds(
            json!({"name": "sluice", "annotations": {REQUESTED: "true"}})
        ))),
        Some(Reason::Requested)
    );
    // Other annotations mean nothing.
    assert_eq!(
        reason(Some(&ds(
            json!({"name": "sluice", "annotations": {"a": "b"}})
        ))),
        None
    );
}

#[tokio::test]
async fn a_daemonset_that_cannot_be_read_is_not_an_uninstall() {
    let (client, mut handle) = mock::client();
    let server = tokio::spawn(async move {
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(req.method(), Method::GET);
        assert_eq!(
            req.uri().path(),
            "/apis/apps/v1/namespaces/istio-system/daemonsets/sluice"
        );
        reply(
            send,
            403,
            &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "Forbidden", "code": 403, "message": "forbidden"}),
        );
        let (_, send) = handle.next_request().await.unwrap();
        reply(
            send,
            404,
            &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "NotFound", "code": 404, "message": "not found"}),
        );
    });
    assert!(decide(client.clone(), "istio-system", "sluice")
        .await
        .is_err());
    assert_eq!(
        decide(client, "istio-system", "sluice").await.unwrap(),
        Some(Reason::Gone)
    );
    server.await.unwrap();
}

/// The hook's whole run: mark, a node still busy, then done, then the
/// cluster-wide cleanup (nothing left to clear here).
#[tokio::test(start_paused = true)]
async fn the_hook_marks_waits_for_the_nodes_then_clears_the_api() {
    let (client, mut handle) = mock::client();
    let server = tokio::spawn(async move {
        let mut seen = Vec::new();
        let pods = json!({"apiVersion": "v1", "kind": "PodList", "metadata": {},
            "items": [{"metadata": {"name": "a1"}, "spec": {"nodeName": "a", "containers": []}}]});
        let busy = json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {},
            "items": [{"metadata": {"name": "a"},
                "status": {"conditions": [{"type": "T", "status": "False"}]}}]});
        let clean = json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {},
            "items": [{"metadata": {"name": "a"}, "status": {"conditions": []}}]});
        let empty_pods =
            json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": []});
        let ds = json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "sluice"}, "spec": {"selector": {}, "template": {}}});
        for answer in [&ds, &pods, &busy, &pods, &clean, &empty_pods, &clean] {
            let (req, send) = handle.next_request().await.unwrap();
            seen.push(format!("{} {}", req.method(), req.uri().path()));
            reply(send, 200, answer);
        }
        seen
    });
    let cluster = Cluster {
        daemonset: "sluice",
        namespace: "istio-system",
        selector: "app=sluice",
        condition_type: "T",
        taints: &[],
        readiness_rule: None,
    };
    let left = cluster
        .uninstall(client, std::time::Duration::from_secs(120))
        .await
        .unwrap();
    assert!(left.is_empty(), "{left:?}");
    assert_eq!(
        server.await.unwrap(),
        [
            "PATCH /apis/apps/v1/namespaces/istio-system/daemonsets/sluice",
            "GET /api/v1/namespaces/istio-system/pods",
            "GET /api/v1/nodes",
            "GET /api/v1/namespaces/istio-system/pods",
            "GET /api/v1/nodes",
            "GET /api/v1/pods",
            "GET /api/v1/nodes",
        ]
    );
}

#[tokio::test]
async fn request_marks_the_daemonset_metadata_only() {
    let (client, mut handle) = mock::client();
    let server = tokio::spawn(async move {
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(req.method(), Method::PATCH);
        assert_eq!(
            req.uri().path(),
            "/apis/apps/v1/namespaces/istio-system/daemonsets/sluice"
        );
        let body = mock::body(req).await;
        assert_eq!(
            body,
            json!({"metadata": {"annotations": {REQUESTED: "true"}}})
        );
        reply(
            send,
            200,
            &json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "sluice"}, "spec": {"selector": {}, "template": {}}}),
        );
    });
    request(client, "istio-system", "sluice").await.unwrap();
    server.await.unwrap();
}

#[tokio::test]
async fn only_nodes_running_an_agent_and_keeping_the_condition_are_pending() {
    let (client, mut handle) = mock::client();
    let server = tokio::spawn(async move {
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(req.uri().path(), "/api/v1/namespaces/istio-system/pods");
        assert!(req
            .uri()
            .query()
            .unwrap()
            .contains("labelSelector=app%3Dsluice"));
        reply(
            send,
            200,
            &json!({"apiVersion": "v1", "kind": "PodList", "metadata": {},
            "items": [
                {"metadata": {"name": "a1"}, "spec": {"nodeName": "a", "containers": []}},
                {"metadata": {"name": "b1"}, "spec": {"nodeName": "b", "containers": []}}]}),
        );
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(req.uri().path(), "/api/v1/nodes");
        let cond = json!([{"type": "sluice.dev/RedirectionReady", "status": "False"}]);
        reply(
            send,
            200,
            &json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {},
            "items": [
                // a: cleaned (no condition); b: not yet; c: no agent.
                {"metadata": {"name": "a"}, "status": {"conditions": []}},
                {"metadata": {"name": "b"}, "status": {"conditions": cond}},
                {"metadata": {"name": "c"}, "status": {"conditions": cond}}]}),
        );
    });
    let pending = pending_nodes(
        client,
        "istio-system",
        "app=sluice",
        "sluice.dev/RedirectionReady",
    )
    .await
    .unwrap();
    assert_eq!(pending, BTreeSet::from(["b".to_owned()]));
    server.await.unwrap();
}

#[tokio::test]
async fn clean_clears_annotations_releases_gates_and_removes_conditions_and_taints() {
    const KIND: &str = "sluice.dev/RedirectionReady";
    const TAINT: &str = "readiness.k8s.io/sluice-not-ready";
    let (client, mut handle) = mock::client();
    let server = tokio::spawn(async move {
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(req.uri().path(), "/api/v1/pods");
        reply(
            send,
            200,
            &json!({"apiVersion": "v1", "kind": "PodList", "metadata": {},
            "items": [
                // Annotated and gated (gate False): both written.
                {"metadata": {"name": "cart", "namespace": "shop",
                    "annotations": {REDIRECTION: "enabled"}},
                 "spec": {"containers": [], "readinessGates": [{"conditionType": gate::GATE}]},
                 "status": {"conditions": [{"type": gate::GATE, "status": "False"}]}},
                // Neither: untouched.
                {"metadata": {"name": "web", "namespace": "shop"},
                 "spec": {"containers": []}}]}),
        );
        let mut writes = Vec::new();
        // Two pod writes, then the node list, then the node writes.
        for _ in 0..2 {
            let (req, send) = handle.next_request().await.unwrap();
            writes.push((
                req.method().clone(),
                req.uri().path().to_owned(),
                mock::body(req).await,
            ));
            reply(
                send,
                200,
                &json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "cart", "namespace": "shop"}}),
            );
        }
        assert_eq!(writes[0].1, "/api/v1/namespaces/shop/pods/cart/status");
        assert_eq!(
            writes[0].2,
            json!({"metadata": {"annotations": {REDIRECTION: null}}})
        );
        assert_eq!(writes[1].1, "/api/v1/namespaces/shop/pods/cart/status");
        let c = &writes[1].2["status"]["conditions"][0];
        assert_eq!(
            (
                c["type"].as_str(),
                c["status"].as_str(),
                c["reason"].as_str()
            ),
            (Some(gate::GATE), Some("True"), Some("SluiceUninstalled"))
        );
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(req.uri().path(), "/api/v1/nodes");
        let node = json!({"metadata": {"name": "n1", "resourceVersion": "7"},
            "spec": {"taints": [{"key": TAINT, "effect": "NoSchedule"},
                                {"key": "other", "effect": "NoSchedule"}]},
            "status": {"conditions": [{"type": KIND, "status": "True"}]}});
        reply(
            send,
            200,
            &json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {},
            "items": [node.clone()]}),
        );
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(req.uri().path(), "/api/v1/nodes/n1/status");
        assert_eq!(mock::body(req).await, condition_delete(KIND));
        reply(send, 200, &node);
        // The taint removal reads the node, then patches it.
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(req.method(), Method::GET);
        reply(send, 200, &node);
        let (req, send) = handle.next_request().await.unwrap();
        assert_eq!(req.uri().path(), "/api/v1/nodes/n1");
        let body = mock::body(req).await;
        assert_eq!(
            body["spec"]["taints"],
            json!([{"key": "other", "effect": "NoSchedule"}])
        );
        reply(send, 200, &node);
    });
    let done = clean(client, Some(KIND), &[TAINT.to_owned()], None)
        .await
        .unwrap();
    assert_eq!(
        done,
        Cleaned {
            annotations: 1,
            gates: 1,
            conditions: 1,
            taints: 1
        }
    );
    server.await.unwrap();
}

/// With a NodeReadinessRule, the hook deletes it before anything else: a
/// node whose condition goes while the rule exists is tainted.
#[tokio::test(start_paused = true)]
async fn the_hook_deletes_the_readiness_rule_before_marking_the_daemonset() {
    let (client, mut handle) = mock::client();
    let server = tokio::spawn(async move {
        let mut seen = Vec::new();
        let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Success"});
        let ds = json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "sluice"}, "spec": {"selector": {}, "template": {}}});
        let no_pods = json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": []});
        let no_nodes = json!({"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": []});
        for answer in [&status, &ds, &no_pods, &no_nodes, &no_pods, &no_nodes] {
            let (req, send) = handle.next_request().await.unwrap();
            seen.push(format!("{} {}", req.method(), req.uri().path()));
            reply(send, 200, answer);
        }
        seen
    });
    let cluster = Cluster {
        daemonset: "sluice",
        namespace: "istio-system",
        selector: "app=sluice",
        condition_type: "T",
        taints: &["readiness.k8s.io/sluice-not-ready".into()],
        readiness_rule: Some("sluice"),
    };
    cluster
        .uninstall(client, std::time::Duration::from_secs(120))
        .await
        .unwrap();
    let seen = server.await.unwrap();
    assert_eq!(
        seen[..2],
        [
            "DELETE /apis/readiness.node.x-k8s.io/v1alpha1/nodereadinessrules/sluice",
            "PATCH /apis/apps/v1/namespaces/istio-system/daemonsets/sluice",
        ],
        "{seen:#?}"
    );
}

/// A rule already gone (or a cluster without the controller's CRD) is fine;
/// any other failure stops the hook before a node is touched.
#[tokio::test]
async fn a_missing_rule_is_fine_a_forbidden_one_is_not() {
    let (client, mut handle) = mock::client();
    let server = tokio::spawn(async move {
        for code in [404, 403] {
            let (req, send) = handle.next_request().await.unwrap();
            assert_eq!(req.method(), Method::DELETE);
            reply(
                send,
                code,
                &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "code": code, "message": "no"}),
            );
        }
    });
    let rule = crate::kube::readiness_rule::delete;
    assert!(!rule(client.clone(), "sluice").await.unwrap());
    assert!(rule(client, "sluice").await.is_err());
    server.await.unwrap();
}

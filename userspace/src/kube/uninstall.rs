//! Uninstall, on the API side. `helm uninstall` runs a pre-delete hook Job
//! (`sluice uninstall-cluster`) while the chart's RBAC still exists: it marks
//! the DaemonSet with [`REQUESTED`]; every agent sees the mark, removes
//! sluice from its node (CNI entry and binary, every pod's capture, the pins)
//! and removes its node condition; the Job waits for that on every node that
//! runs an agent, then clears what sluice wrote on API objects cluster-wide
//! ([`clean`]). Only then does Helm delete the DaemonSet and the RBAC.
//!
//! Without Helm (`kubectl delete daemonset`), an agent stopping with its
//! DaemonSet gone or being deleted does the same node cleanup ([`decide`]).
//! A DaemonSet it cannot read (403, timeout) is *not* taken for an uninstall:
//! tearing down capture on a doubt would send pods' traffic around ztunnel.

use std::collections::BTreeSet;

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{Node, Pod},
};
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::{json, Value};

use super::{annotate::REDIRECTION, gate, patch::now_rfc3339, taint};

/// Annotation on the agents' DaemonSet asking them to remove sluice from
/// their nodes.
pub const REQUESTED: &str = "sluice.dev/uninstall";

/// Why an agent removes sluice from its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The DaemonSet carries [`REQUESTED`] (the Helm hook, or by hand).
    Requested,
    /// The DaemonSet is being deleted (it has a deletion timestamp).
    Deleting,
    /// The DaemonSet no longer exists.
    Gone,
    /// `sluice uninstall` asked through the control socket.
    Command,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Requested => "uninstall requested on the DaemonSet",
            Reason::Deleting => "the DaemonSet is being deleted",
            Reason::Gone => "the DaemonSet is gone",
            Reason::Command => "sluice uninstall",
        }
    }
}

/// Whether the DaemonSet, as read (`None`: 404), means uninstall.
pub fn reason(ds: Option<&DaemonSet>) -> Option<Reason> {
    let Some(ds) = ds else {
        return Some(Reason::Gone);
    };
    if ds.metadata.deletion_timestamp.is_some() {
        return Some(Reason::Deleting);
    }
    ds.metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(REQUESTED))
        .then_some(Reason::Requested)
}

/// Reads the agents' DaemonSet and decides. An error means "cannot tell":
/// the caller keeps capture in place.
pub async fn decide(
    client: kube::Client,
    namespace: &str,
    daemonset: &str,
) -> kube::Result<Option<Reason>> {
    let api: Api<DaemonSet> = Api::namespaced(client, namespace);
    Ok(reason(api.get_opt(daemonset).await?.as_ref()))
}

/// Marks the DaemonSet (metadata only: no rollout).
pub async fn request(client: kube::Client, namespace: &str, daemonset: &str) -> kube::Result<()> {
    let api: Api<DaemonSet> = Api::namespaced(client, namespace);
    let body = json!({ "metadata": { "annotations": { REQUESTED: "true" } } });
    api.patch(daemonset, &PatchParams::default(), &Patch::Merge(body))
        .await
        .map(drop)
}

/// The strategic merge patch that deletes node condition `kind`.
pub fn condition_delete(kind: &str) -> Value {
    json!({ "status": { "conditions": [{ "type": kind, "$patch": "delete" }] } })
}

/// Removes condition `kind` from `node` (an agent, when its node is clean).
pub async fn remove_condition(client: kube::Client, node: &str, kind: &str) -> kube::Result<()> {
    let api: Api<Node> = Api::all(client);
    api.patch_status(
        node,
        &PatchParams::default(),
        &Patch::Strategic(condition_delete(kind)),
    )
    .await
    .map(drop)
}

/// The nodes that run one of the agents (pods matching `selector` in
/// `namespace`) and still carry condition `kind`: those not clean yet.
pub async fn pending_nodes(
    client: kube::Client,
    namespace: &str,
    selector: &str,
    kind: &str,
) -> kube::Result<BTreeSet<String>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let with_agent: BTreeSet<String> = pods
        .list(&ListParams::default().labels(selector))
        .await?
        .items
        .into_iter()
        .filter_map(|p| p.spec.and_then(|s| s.node_name))
        .collect();
    let nodes: Api<Node> = Api::all(client);
    Ok(nodes
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|n| super::condition::current(n, kind).is_some())
        .filter_map(|n| n.metadata.name)
        .filter(|n| with_agent.contains(n))
        .collect())
}

/// The readiness-gate condition an uninstalled sluice leaves on pods that
/// list the gate. Not deleted: a pod that lists a gate without its condition
/// is never Ready, and the pods keep running (uncaptured) after uninstall.
pub fn gate_released(now: &str) -> Value {
    json!({ "status": { "conditions": [{
        "type": gate::GATE,
        "status": "True",
        "reason": "SluiceUninstalled",
        "message": "sluice was uninstalled: the pod is not captured",
        "lastTransitionTime": now,
    }]}})
}

/// What [`clean`] changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Cleaned {
    pub annotations: usize,
    pub gates: usize,
    pub conditions: usize,
    pub taints: usize,
}

/// Clears what sluice wrote on API objects, on every node and pod (or only
/// `node` and its pods): the `ambient.istio.io/redirection` annotation, the
/// readiness-gate condition (released, see [`gate_released`]), node
/// condition `kind`, and the taints keyed `taints` (e.g. the
/// NodeReadinessRule's, whose rule goes with the chart).
pub async fn clean(
    client: kube::Client,
    kind: &str,
    taints: &[String],
    node: Option<&str>,
) -> kube::Result<Cleaned> {
    let mut done = Cleaned::default();
    let now = now_rfc3339();
    let pods_on = match node {
        Some(n) => ListParams::default().fields(&format!("spec.nodeName={n}")),
        None => ListParams::default(),
    };
    let pods: Api<Pod> = Api::all(client.clone());
    for p in pods.list(&pods_on).await?.items {
        let (Some(ns), Some(name)) = (p.metadata.namespace.clone(), p.metadata.name.clone()) else {
            continue;
        };
        let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let annotated = p
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(REDIRECTION));
        if annotated {
            api.patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(super::annotate::patch(None)),
            )
            .await?;
            done.annotations += 1;
        }
        let gated_false =
            gate::has_gate(&p) && gate::current(&p).is_none_or(|c| c.status != "True");
        if gated_false {
            api.patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Strategic(gate_released(&now)),
            )
            .await?;
            done.gates += 1;
        }
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let nodes = match node {
        // An agent reads its own node only (no list grant).
        Some(n) => nodes.get_opt(n).await?.into_iter().collect(),
        None => nodes.list(&ListParams::default()).await?.items,
    };
    for n in nodes {
        let Some(name) = n.metadata.name.clone() else {
            continue;
        };
        if super::condition::current(&n, kind).is_some() {
            remove_condition(client.clone(), &name, kind).await?;
            done.conditions += 1;
        }
        if !taints.is_empty() && taint::without(&n, taints).is_some() {
            taint::remove(client.clone(), &name, taints).await?;
            done.taints += 1;
        }
    }
    Ok(done)
}

/// What `sluice uninstall-cluster` (the Helm pre-delete hook) works on.
pub struct Cluster<'a> {
    pub daemonset: &'a str,
    pub namespace: &'a str,
    /// Label selector of the agent pods.
    pub selector: &'a str,
    pub condition_type: &'a str,
    /// Taints to remove from every node.
    pub taints: &'a [String],
}

/// How often the hook looks at the nodes while they remove sluice.
const NODES_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

impl Cluster<'_> {
    /// Marks the DaemonSet, waits (up to `timeout`) until every node running
    /// an agent has removed sluice, then clears the API objects. Returns the
    /// nodes that had not finished in time (cleared on the API side anyway).
    pub async fn uninstall(
        &self,
        client: kube::Client,
        timeout: std::time::Duration,
    ) -> anyhow::Result<BTreeSet<String>> {
        use anyhow::Context as _;
        request(client.clone(), self.namespace, self.daemonset)
            .await
            .with_context(|| {
                format!(
                    "marking DaemonSet {}/{} for uninstall",
                    self.namespace, self.daemonset
                )
            })?;
        tracing::info!(daemonset = %self.daemonset, "uninstall asked; waiting for the nodes");
        let deadline = tokio::time::Instant::now() + timeout;
        let left = loop {
            let pending = pending_nodes(
                client.clone(),
                self.namespace,
                self.selector,
                self.condition_type,
            )
            .await;
            let late = tokio::time::Instant::now() >= deadline;
            match pending {
                Ok(p) if p.is_empty() || late => break p,
                Err(e) if late => return Err(e).context("listing the nodes that still run sluice"),
                Ok(p) => tracing::info!(nodes = ?p, "nodes still removing sluice"),
                Err(e) => tracing::warn!(error = %e, "listing the nodes that still run sluice"),
            }
            tokio::time::sleep(NODES_EVERY).await;
        };
        let done = clean(client, self.condition_type, self.taints, None)
            .await
            .context("clearing sluice's marks on pods and nodes")?;
        tracing::info!(
            annotations = done.annotations,
            gates = done.gates,
            conditions = done.conditions,
            taints = done.taints,
            "API objects cleared"
        );
        Ok(left)
    }
}

#[cfg(test)]
mod tests {
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
        let done = clean(client, KIND, &[TAINT.to_owned()], None)
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
}

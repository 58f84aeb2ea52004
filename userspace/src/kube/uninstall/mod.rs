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
/// their nodes when it says `"true"`. The chart renders it `"false"`, so a
/// `helm upgrade` after a failed or cancelled uninstall clears the mark
/// (Helm's three-way merge puts the chart's value back); by hand:
/// `kubectl annotate ds sluice sluice.dev/uninstall=false --overwrite`.
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
        .and_then(|a| a.get(REQUESTED))
        .is_some_and(|v| v == "true")
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
/// condition `kind` (`None`: kept, as by a node whose capture is not all
/// removed), and the taints keyed `taints` (e.g. the NodeReadinessRule's,
/// whose rule goes with the chart).
pub async fn clean(
    client: kube::Client,
    kind: Option<&str>,
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
        if let Some(kind) = kind.filter(|k| super::condition::current(&n, k).is_some()) {
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
    /// The NodeReadinessRule that taints nodes whose condition is not True:
    /// deleted first, before any node's condition goes.
    pub readiness_rule: Option<&'a str>,
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
        // node-readiness-controller takes a missing condition for Unknown
        // and taints the node: with the rule still there, every node would
        // be tainted NoSchedule as sluice leaves it (and again on every node
        // event, and for good if this hook failed).
        if let Some(rule) = self.readiness_rule {
            let deleted = super::readiness_rule::delete(client.clone(), rule)
                .await
                .with_context(|| {
                    format!(
                        "deleting NodeReadinessRule {rule} before the nodes lose their condition"
                    )
                })?;
            tracing::info!(rule, deleted, "NodeReadinessRule out of the way");
        }
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
        let done = clean(client, Some(self.condition_type), self.taints, None)
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
mod tests;

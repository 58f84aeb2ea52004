//! Removing sluice from a node whose agent only reports (another build's
//! pinned dataplane it cannot take over, another node agent on the ZDS
//! socket) when the DaemonSet asks: sluice-cni leaves the CNI config (else
//! the plugin, with no agent behind it, would refuse ambient pods for
//! good), whatever is pinned goes (another build's capture included), and
//! this node's API marks are cleared — its condition only once nothing is
//! left.

use tracing::{info, warn};

use crate::{
    cni::install::CniInstall,
    dataplane::loader::Pins,
    kube::uninstall::Reason,
    podnet::{enroll, hostside},
};

/// The API side of a node: its client, the node's name, the condition type.
pub struct NodeApi {
    pub client: kube::Client,
    pub node: String,
    pub condition_type: String,
}

/// Removes sluice from the node; the errors, if any (each step still runs).
pub async fn remove(
    why: Reason,
    cni: Option<&CniInstall>,
    pins: Pins,
    node: anyhow::Result<Option<hostside::Node>>,
    api: Option<&NodeApi>,
) -> Result<(), String> {
    info!(
        why = why.as_str(),
        "uninstall asked while only reporting: removing sluice from the node"
    );
    let mut errors = Vec::new();
    // Without it, the host side's filters of pods could not be removed.
    let node = node.unwrap_or_else(|e| {
        errors.push(format!("{e:#}"));
        None
    });
    if let Some(cni) = cni {
        if let Err(e) = cni.uninstall() {
            errors.push(format!("removing sluice-cni: {e}"));
        }
    }
    match tokio::task::spawn_blocking(move || enroll::uninstall(&pins, node.as_ref())).await {
        Ok(Ok(n)) => info!(pods = n, "every pinned pod's capture removed, pins removed"),
        Ok(Err(e)) => errors.push(format!("removing capture: {}", crate::error_line(&e))),
        Err(e) => errors.push(format!("removing capture: {e}")),
    }
    if let Some(a) = api {
        let kind = errors.is_empty().then_some(a.condition_type.as_str());
        let cleaned = tokio::time::timeout(
            crate::kube::API_TIMEOUT,
            crate::kube::uninstall::clean(a.client.clone(), kind, &[], Some(&a.node)),
        )
        .await;
        match cleaned {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => errors.push(format!("clearing the API objects: {e}")),
            Err(_) => errors.push("clearing the API objects: timed out".into()),
        }
    }
    if errors.is_empty() {
        info!("sluice removed from this node");
        Ok(())
    } else {
        let why = errors.join("; ");
        warn!(%why, "uninstall incomplete; `sluice uninstall` on the node finishes it");
        Err(why)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::{
        cni::install::CniInstall,
        kube::mock::{self, reply},
    };

    /// An agent holding (another build's dataplane) is asked to uninstall:
    /// sluice-cni leaves the CNI config, and the node's condition goes.
    #[tokio::test]
    async fn a_holding_agent_removes_sluice_cni_and_its_condition() {
        let root = std::env::temp_dir().join(format!("sluice-held-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let conf = root.join("net.d");
        std::fs::create_dir_all(&conf).unwrap();
        std::fs::write(
            conf.join("10-ptp.conflist"),
            r#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"ptp"}]}"#,
        )
        .unwrap();
        std::fs::write(root.join("sluice-cni-src"), b"#!/bin/sh\n").unwrap();
        let cni = CniInstall::new(
            conf,
            root.join("bin"),
            root.join("sluice-cni-src"),
            "/run/sluice/agent.sock".into(),
        );
        cni.install().unwrap();
        assert!(cni.in_force().is_ok(), "sluice-cni not installed");
        let (client, mut handle) = mock::client();
        let server = tokio::spawn(async move {
            let mut patched = Vec::new();
            while let Some((req, send)) = handle.next_request().await {
                let (method, path) = (req.method().clone(), req.uri().path().to_owned());
                match (method.as_str(), path.as_str()) {
                    ("GET", "/api/v1/pods") => reply(
                        send,
                        200,
                        &json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": []}),
                    ),
                    ("GET", "/api/v1/nodes/node-a") => reply(
                        send,
                        200,
                        &json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"},
                            "status": {"conditions": [{"type": "sluice.dev/RedirectionReady",
                                "status": "False", "reason": "DataplaneIncompatible"}]}}),
                    ),
                    ("PATCH", "/api/v1/nodes/node-a/status") => {
                        patched.push(mock::body(req).await);
                        reply(
                            send,
                            200,
                            &json!({"apiVersion": "v1", "kind": "Node",
                            "metadata": {"name": "node-a"}}),
                        );
                    }
                    other => panic!("unexpected request {other:?}"),
                }
            }
            patched
        });
        let api = NodeApi {
            client,
            node: "node-a".into(),
            condition_type: "sluice.dev/RedirectionReady".into(),
        };
        let pins = Pins::new(root.join("no-pins"));
        remove(Reason::Requested, Some(&cni), pins, Ok(None), Some(&api))
            .await
            .unwrap();
        drop(api);
        let patched = server.await.unwrap();
        let left = cni.in_force();
        let _ = std::fs::remove_dir_all(&root);
        assert!(
            left.is_err(),
            "sluice-cni is still in the CNI config: {left:?}"
        );
        assert_eq!(patched.len(), 1, "{patched:?}");
        assert!(
            patched[0].to_string().contains("RedirectionReady"),
            "{patched:?}"
        );
    }
}

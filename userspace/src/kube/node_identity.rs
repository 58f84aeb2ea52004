//! `--node-name` must name the Node this agent runs on. With another node's
//! name the agent would take every pod it captured here for a pod that left
//! the node, and release them all. So it compares the Node's `bootID`
//! (`status.nodeInfo.bootID`, reported by the kubelet) with this kernel's
//! (`/proc/sys/kernel/random/boot_id`) before it starts, and refuses a name
//! that is not this host's.

use k8s_openapi::api::core::v1::Node;
use kube::api::Api;

/// The kernel's boot id: the same in every container on the host.
pub const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NodeIdentityError {
    #[error("--node-name {0}: there is no such Node")]
    Missing(String),
    #[error(
        "--node-name {node}: that Node's boot id is {theirs}, this host's is {ours}: it names \
         another node (the agent would release every pod captured here as gone)"
    )]
    OtherHost {
        node: String,
        theirs: String,
        ours: String,
    },
}

/// Whether Node `name`, as read (`None`: 404), is this host (boot id
/// `ours`). A Node that reports no boot id cannot be told apart: accepted.
pub fn check(node: Option<&Node>, name: &str, ours: &str) -> Result<(), NodeIdentityError> {
    let node = node.ok_or_else(|| NodeIdentityError::Missing(name.to_owned()))?;
    let theirs = node
        .status
        .as_ref()
        .and_then(|s| s.node_info.as_ref())
        .map(|i| i.boot_id.trim())
        .unwrap_or_default();
    if theirs.is_empty() || theirs == ours.trim() {
        Ok(())
    } else {
        Err(NodeIdentityError::OtherHost {
            node: name.to_owned(),
            theirs: theirs.to_owned(),
            ours: ours.trim().to_owned(),
        })
    }
}

/// Reads Node `name` and checks it is this host. `Ok(Err(_))`: it is not;
/// `Err(_)`: the API could not say (the caller goes on: capture must not
/// wait for the API).
pub async fn verify(
    client: kube::Client,
    name: &str,
) -> kube::Result<Result<(), NodeIdentityError>> {
    let ours = std::fs::read_to_string(BOOT_ID).unwrap_or_default();
    let node = Api::<Node>::all(client).get_opt(name).await?;
    Ok(check(node.as_ref(), name, &ours))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn node(boot: &str) -> Node {
        serde_json::from_value(json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "n1"},
            "status": {"nodeInfo": {"bootID": boot, "machineID": "", "systemUUID": "",
                "kernelVersion": "", "osImage": "", "containerRuntimeVersion": "",
                "kubeletVersion": "", "kubeProxyVersion": "", "operatingSystem": "linux",
                "architecture": "amd64"}}}))
        .unwrap()
    }

    #[test]
    fn only_this_hosts_node_is_accepted() {
        assert_eq!(check(Some(&node("abc")), "n1", "abc\n"), Ok(()));
        assert_eq!(
            check(None, "n1", "abc"),
            Err(NodeIdentityError::Missing("n1".into()))
        );
        assert!(matches!(
            check(Some(&node("def")), "n1", "abc"),
            Err(NodeIdentityError::OtherHost { .. })
        ));
        // A Node without a boot id cannot be told apart.
        assert_eq!(check(Some(&node("")), "n1", "abc"), Ok(()));
    }
}

//! The NodeReadinessRule (kubernetes-sigs/node-readiness-controller) that
//! keeps a taint on nodes whose sluice condition is not True. No typed client
//! exists for it, so it is reached as a dynamic object; only the uninstall
//! hook touches it (the chart creates it).

use kube::{
    api::{Api, DeleteParams, DynamicObject},
    discovery::ApiResource,
};

/// `readiness.node.x-k8s.io/v1alpha1` `NodeReadinessRule`, cluster-scoped.
fn resource() -> ApiResource {
    ApiResource {
        group: "readiness.node.x-k8s.io".into(),
        version: "v1alpha1".into(),
        api_version: "readiness.node.x-k8s.io/v1alpha1".into(),
        kind: "NodeReadinessRule".into(),
        plural: "nodereadinessrules".into(),
    }
}

/// Deletes rule `name`: `Ok(false)` when there is none (or no such kind: the
/// controller's CRD is not installed), both fine for an uninstall.
pub async fn delete(client: kube::Client, name: &str) -> kube::Result<bool> {
    let api: Api<DynamicObject> = Api::all_with(client, &resource());
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

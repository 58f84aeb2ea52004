//! What sluice asks of and tells Kubernetes: which pods are ambient
//! (`selection`), the `ambient.istio.io/redirection` annotation (`annotate`),
//! whether a CNI request matches a real pod on this node (`verify`), the node
//! condition (`condition`), the startup taint (`taint`) and the pods'
//! readiness-gate condition (`gate`), Events on pods (`events`), and clearing
//! all of it on uninstall (`uninstall`). The writers' patches share their
//! time stamps and conflict handling (`patch`).
//! Decisions are pure functions over API objects; the writers are thin.

pub mod annotate;
pub mod condition;
pub mod events;
pub mod gate;
pub mod node_identity;
pub mod patch;
pub mod readiness_rule;
pub mod reconcile;
pub mod selection;
pub mod taint;
pub mod uninstall;
pub mod verify;

use std::time::Duration;

/// Budget for one API exchange: the client has no read timeout of its own.
pub const API_TIMEOUT: Duration = Duration::from_secs(10);

/// kube-rs' mock service, for the writers' tests: a client, and the API
/// server's side to answer it.
#[cfg(test)]
pub(crate) mod mock {
    use http::{Request, Response};
    use kube::client::Body;
    use serde_json::Value;

    pub type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;
    pub type Send = tower_test::mock::SendResponse<Response<Body>>;

    pub fn client() -> (kube::Client, Handle) {
        let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        (kube::Client::new(svc, "default"), handle)
    }

    /// Answers with `code` and a JSON body.
    pub fn reply(send: Send, code: u16, body: &Value) {
        send.send_response(
            Response::builder()
                .status(code)
                .body(Body::from(serde_json::to_vec(body).unwrap()))
                .unwrap(),
        );
    }

    /// A 409, as the API server answers a stale resourceVersion.
    pub fn conflict(send: Send) {
        let status = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "message": "the object has been modified", "reason": "Conflict", "code": 409});
        reply(send, 409, &status);
    }

    /// The request's JSON body.
    pub async fn body(req: Request<Body>) -> Value {
        serde_json::from_slice(&req.into_body().collect_bytes().await.unwrap()).unwrap()
    }
}

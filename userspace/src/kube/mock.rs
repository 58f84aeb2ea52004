//! kube-rs' mock service, for the writers' tests: a client, and the API
//! server's side to answer it.

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

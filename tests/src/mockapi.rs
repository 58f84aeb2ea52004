//! Answers for kube-rs' mock service (tower-test), as the API server sends them.

use http::Response;
use kube::client::Body;
use serde_json::Value;

pub type Send = tower_test::mock::SendResponse<Response<Body>>;

/// Answers with HTTP `code` and `body` as JSON.
pub fn reply(send: Send, code: u16, body: &Value) {
    send.send_response(
        Response::builder()
            .status(code)
            .body(Body::from(
                serde_json::to_vec(body).expect("JSON values serialise"),
            ))
            .expect("a valid response"),
    );
}

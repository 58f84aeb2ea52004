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

/// An Event the agent publishes under `prefix` (a create, or a patch of
/// its series): kept in `into` and answered with itself. Any other request
/// gets `send` back to answer.
pub fn event(
    prefix: &str,
    path: &str,
    body: &[u8],
    into: &std::sync::Mutex<Vec<Value>>,
    send: Send,
) -> Option<Send> {
    if !path.starts_with(prefix) {
        return Some(send);
    }
    let ev: Value = serde_json::from_slice(body).expect("an Event in JSON");
    into.lock().unwrap().push(ev.clone());
    reply(send, 200, &ev);
    None
}

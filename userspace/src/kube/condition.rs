//! The node condition on `nodes/<name>/status`: written when its status or
//! reason changes, else once per heartbeat (message-only changes, such as a
//! pod count, wait for it). `lastTransitionTime` moves only when the status
//! flips. Each write is a strategic merge patch of this one condition (the
//! kubelet's own conditions are untouched) carrying the resourceVersion it was
//! computed from, so a concurrent writer makes it fail with 409 and it is
//! recomputed and retried.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, NodeCondition};
use kube::api::{Api, Patch, PatchParams};
use serde_json::{json, Value};

use super::patch::{now_rfc3339, precondition, retry_on_conflict, transition_time};
use crate::readiness::Condition;

/// The default heartbeat: an unchanged condition is rewritten this often.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(60);

/// The condition of type `kind` on `node`, if it has one.
pub fn current<'a>(node: &'a Node, kind: &str) -> Option<&'a NodeCondition> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == kind)
}

/// The patch that sets condition `kind` to `desired` at time `now`, given what
/// the Node shows now: the transition time is kept unless the status flips.
pub fn patch_body(
    kind: &str,
    desired: &Condition,
    current: Option<&NodeCondition>,
    now: &str,
    resource_version: Option<&str>,
) -> Value {
    let was = current.map(|c| (c.status.as_str(), c.last_transition_time.as_ref()));
    let transition = transition_time(was, desired.status(), now);
    let body = json!({
        "status": {
            "conditions": [{
                "type": kind,
                "status": desired.status(),
                "reason": desired.reason.as_str(),
                "message": desired.message,
                "lastHeartbeatTime": now,
                "lastTransitionTime": transition,
            }]
        }
    });
    precondition(body, resource_version)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Same status and reason as the last write, within the heartbeat.
    Unchanged,
    Written,
}

/// Writes one node's condition; remembers its last write (so a restart
/// always writes once, from what the Node shows).
pub struct ConditionWriter {
    api: Api<Node>,
    node: String,
    kind: String,
    heartbeat: Duration,
    last: Option<(Condition, Instant)>,
}

impl ConditionWriter {
    pub fn new(client: kube::Client, node: &str, kind: &str, heartbeat: Duration) -> Self {
        Self {
            api: Api::all(client),
            node: node.to_owned(),
            kind: kind.to_owned(),
            heartbeat,
            last: None,
        }
    }

    /// Puts `desired` on the Node if it changed or the heartbeat is due.
    pub async fn update(&mut self, desired: &Condition) -> kube::Result<Outcome> {
        if let Some((last, at)) = &self.last {
            let same = last.ready == desired.ready && last.reason == desired.reason;
            if same && at.elapsed() < self.heartbeat {
                return Ok(Outcome::Unchanged);
            }
        }
        self.write(desired).await?;
        self.last = Some((desired.clone(), Instant::now()));
        Ok(Outcome::Written)
    }

    /// Forgets the last write: the next update writes (used when someone
    /// else may have written meanwhile, e.g. the watchdog during a hang).
    pub fn forget(&mut self) {
        self.last = None;
    }

    /// Writes `desired` now, whatever was written before.
    pub async fn write(&self, desired: &Condition) -> kube::Result<()> {
        retry_on_conflict(|| async {
            let node = self.api.get(&self.node).await?;
            let body = patch_body(
                &self.kind,
                desired,
                current(&node, &self.kind),
                &now_rfc3339(),
                node.metadata.resource_version.as_deref(),
            );
            self.api
                .patch_status(&self.node, &PatchParams::default(), &Patch::Strategic(body))
                .await
                .map(drop)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use http::Method;

    use super::*;
    use crate::kube::mock::{self, reply, Handle};
    use crate::readiness::Reason;

    const KIND: &str = "sluice.dev/RedirectionReady";

    fn ready() -> Condition {
        Condition {
            ready: true,
            reason: Reason::Ready,
            message: "2 ambient pods enrolled".into(),
        }
    }

    fn pending() -> Condition {
        Condition {
            ready: false,
            reason: Reason::PodsPendingEnrollment,
            message: "1 of 2 ambient pods pending for >10s: shop/cart".into(),
        }
    }

    fn node(rv: &str, cond: Option<Value>) -> Value {
        let mut conditions = vec![json!({"type": "Ready", "status": "True"})];
        conditions.extend(cond);
        json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "node-a", "resourceVersion": rv},
            "status": {"conditions": conditions}})
    }

    /// Expects a GET of the node and answers with `node`.
    async fn serve_get(h: &mut Handle, node: Value) {
        let (req, send) = h.next_request().await.expect("a GET");
        assert_eq!(req.method(), Method::GET);
        assert_eq!(req.uri().path(), "/api/v1/nodes/node-a");
        reply(send, 200, &node);
    }

    /// Expects the status PATCH; returns its body, answering with `code`.
    async fn serve_patch(h: &mut Handle, code: u16) -> Value {
        let (req, send) = h.next_request().await.expect("a PATCH");
        assert_eq!(req.method(), Method::PATCH);
        assert_eq!(req.uri().path(), "/api/v1/nodes/node-a/status");
        assert_eq!(
            req.headers()["content-type"],
            "application/strategic-merge-patch+json"
        );
        let body = mock::body(req).await;
        if code == 409 {
            mock::conflict(send);
        } else {
            reply(send, code, &node("2", None));
        }
        body
    }

    fn strip_times(mut body: Value) -> (Value, String, String) {
        let c = &mut body["status"]["conditions"][0];
        let hb = c["lastHeartbeatTime"].take().as_str().unwrap().to_owned();
        let tr = c["lastTransitionTime"].take().as_str().unwrap().to_owned();
        (body, hb, tr)
    }

    #[test]
    fn transition_time_moves_only_when_the_status_flips() {
        let was_false = serde_json::from_value::<NodeCondition>(json!({
            "type": KIND, "status": "False", "reason": "ZtunnelDisconnected",
            "lastTransitionTime": "2026-11-01T00:00:00Z"}))
        .unwrap();
        let now = "2026-11-22T03:00:00Z";
        // False → False with another reason: transition time kept.
        let b = patch_body(KIND, &pending(), Some(&was_false), now, Some("7"));
        assert_eq!(
            b,
            json!({"metadata": {"resourceVersion": "7"}, "status": {"conditions": [{
                "type": KIND, "status": "False", "reason": "PodsPendingEnrollment",
                "message": "1 of 2 ambient pods pending for >10s: shop/cart",
                "lastHeartbeatTime": now, "lastTransitionTime": "2026-11-01T00:00:00Z"}]}})
        );
        // False → True: now.
        let b = patch_body(KIND, &ready(), Some(&was_false), now, None);
        assert_eq!(
            b["status"]["conditions"][0]["lastTransitionTime"],
            json!(now)
        );
        assert!(b.get("metadata").is_none());
        // No condition yet: now.
        let b = patch_body(KIND, &ready(), None, now, None);
        assert_eq!(
            b["status"]["conditions"][0]["lastTransitionTime"],
            json!(now)
        );
    }

    #[tokio::test]
    async fn writes_on_change_and_heartbeat_only() {
        let (client, mut h) = mock::client();
        let mut w = ConditionWriter::new(client, "node-a", KIND, Duration::from_millis(300));
        // First write: the Node has no such condition.
        let server = tokio::spawn(async move {
            serve_get(&mut h, node("1", None)).await;
            let (body, hb, tr) = strip_times(serve_patch(&mut h, 200).await);
            assert_eq!(hb, tr, "a new condition starts its transition now");
            assert_eq!(
                body,
                json!({"metadata": {"resourceVersion": "1"}, "status": {"conditions": [{
                    "type": KIND, "status": "True", "reason": "RedirectionReady",
                    "message": "2 ambient pods enrolled",
                    "lastHeartbeatTime": null, "lastTransitionTime": null}]}})
            );
            h
        });
        assert_eq!(w.update(&ready()).await.unwrap(), Outcome::Written);
        let mut h = server.await.unwrap();

        // Same status and reason, new message, within the heartbeat: nothing sent.
        let mut recount = ready();
        recount.message = "3 ambient pods enrolled".into();
        // A request would wait forever for an answer the mock never sends.
        let quiet = tokio::time::timeout(Duration::from_secs(2), w.update(&recount)).await;
        let out = quiet.expect("a request was sent within the heartbeat");
        assert_eq!(out.unwrap(), Outcome::Unchanged);

        // After the heartbeat: rewritten, the transition time kept from the Node.
        tokio::time::sleep(Duration::from_millis(350)).await;
        let server = tokio::spawn(async move {
            let on_node = json!({"type": KIND, "status": "True", "reason": "RedirectionReady",
                "lastTransitionTime": "2026-11-22T01:00:00Z"});
            serve_get(&mut h, node("5", Some(on_node))).await;
            let body = serve_patch(&mut h, 200).await;
            let c = &body["status"]["conditions"][0];
            assert_eq!(c["lastTransitionTime"], "2026-11-22T01:00:00Z");
            assert_eq!(c["message"], "3 ambient pods enrolled");
            assert_eq!(body["metadata"]["resourceVersion"], "5");
            h
        });
        assert_eq!(w.update(&recount).await.unwrap(), Outcome::Written);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_conflict_is_recomputed_and_retried() {
        let (client, mut h) = mock::client();
        let mut w = ConditionWriter::new(client, "node-a", KIND, DEFAULT_HEARTBEAT);
        let server = tokio::spawn(async move {
            serve_get(&mut h, node("1", None)).await;
            let first = serve_patch(&mut h, 409).await;
            assert_eq!(first["metadata"]["resourceVersion"], "1");
            // Someone else wrote the condition (False) meanwhile.
            let theirs = json!({"type": KIND, "status": "False", "reason": "AgentNotRunning",
                "lastTransitionTime": "2026-11-22T02:00:00Z"});
            serve_get(&mut h, node("2", Some(theirs))).await;
            let second = serve_patch(&mut h, 200).await;
            assert_eq!(second["metadata"]["resourceVersion"], "2");
            let c = &second["status"]["conditions"][0];
            assert_eq!(c["status"], "False");
            assert_eq!(c["reason"], "PodsPendingEnrollment");
            assert_eq!(c["lastTransitionTime"], "2026-11-22T02:00:00Z");
        });
        assert_eq!(w.update(&pending()).await.unwrap(), Outcome::Written);
        server.await.unwrap();
    }
}

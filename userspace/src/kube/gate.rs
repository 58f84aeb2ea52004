//! The pod readiness gate `sluice.dev/redirected`: pods that list it in
//! `spec.readinessGates` become Ready only once sluice has them fully enrolled
//! (Served: captured, acked by ztunnel, and known to ztunnel from istiod), so
//! Services send traffic only to pods the mesh can serve. Pods
//! without the gate are left alone. Written as a strategic merge patch of this
//! one condition on the pod's status (the kubelet's conditions are untouched).

use k8s_openapi::api::core::v1::{Pod, PodCondition};
use kube::api::{Api, Patch, PatchParams};
use serde_json::{json, Value};
use sluice_common::PodState;

use super::patch::{now_rfc3339, transition_time};

pub const GATE: &str = "sluice.dev/redirected";

/// Whether the pod asks for the gate.
pub fn has_gate(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.readiness_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.condition_type == GATE))
}

/// Whether an enrolled pod's capture has every link it calls for, as the
/// agent's last repair found it, and does what it must when run, as its
/// last verification found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Capture {
    /// Complete, and its last verification passed.
    #[default]
    Complete,
    /// A link could not be attached (another tool holds a hook): part of
    /// the pod's traffic bypasses ztunnel, whatever its state says.
    Incomplete,
    /// Not verified yet since its listeners were registered.
    NotYetVerified,
    /// Its last verification failed: run on synthetic packets, the programs
    /// at its hooks did not give the captured verdicts.
    Unverified,
}

/// status, reason, message for a pod state (`None`: not enrolled) and its
/// capture.
pub fn condition_for(
    state: Option<PodState>,
    capture: Capture,
) -> (&'static str, &'static str, &'static str) {
    if capture == Capture::Incomplete && state.is_some_and(|s| s != PodState::Draining) {
        return (
            "False",
            "CaptureIncomplete",
            "captured in part: a link the pod's capture needs cannot be attached, so part of its traffic bypasses ztunnel (`sluice status` names it)",
        );
    }
    // Served is only as true as the capture's last run.
    if state == Some(PodState::Served) {
        match capture {
            Capture::Unverified => return (
                "False",
                "CaptureUnverified",
                "served, but running the pod's capture on synthetic packets did not give the captured verdicts: its traffic may bypass ztunnel (`sluice status --pod` names the case)",
            ),
            Capture::NotYetVerified => return (
                "False",
                "CaptureNotYetVerified",
                "served; the pod's capture has not been verified by running it yet",
            ),
            Capture::Complete | Capture::Incomplete => {}
        }
    }
    match state {
        Some(PodState::Served) => (
            "True",
            "Served",
            "captured; ztunnel has the pod, its listeners and its workload",
        ),
        Some(PodState::Enabled) => (
            "False",
            "NotServed",
            "captured and acked, but ztunnel has not received the pod's workload from istiod (xDS) yet: its connections would fail",
        ),
        Some(PodState::Pending) => (
            "False",
            "Pending",
            "captured, waiting for ztunnel: connections are held back (fail closed)",
        ),
        Some(PodState::Draining) => ("False", "Draining", "capture is being removed"),
        None => ("False", "NotEnrolled", "sluice does not capture this pod"),
    }
}

/// The patch for `state` and `capture` given the pod's current gate
/// condition.
pub fn patch_body(
    uid: &str,
    state: Option<PodState>,
    capture: Capture,
    current: Option<&PodCondition>,
    now: &str,
) -> Value {
    let (status, reason, message) = condition_for(state, capture);
    let was = current.map(|c| (c.status.as_str(), c.last_transition_time.as_ref()));
    let transition = transition_time(was, status, now);
    json!({ "metadata": { "uid": uid }, "status": { "conditions": [{
        "type": GATE,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": transition,
    }]}})
}

/// The pod's gate condition, if it has one.
pub fn current(pod: &Pod) -> Option<&PodCondition> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == GATE)
}

/// Sets the gate condition of pod `namespace/name` for `state` and
/// `capture`, if the pod has the gate. `Ok(false)`: it has none (nothing
/// written).
pub async fn write(
    client: kube::Client,
    namespace: &str,
    name: &str,
    uid: &str,
    state: Option<PodState>,
    capture: Capture,
) -> kube::Result<bool> {
    let api: Api<Pod> = Api::namespaced(client, namespace);
    let pod = api.get(name).await?;
    // Another pod of that name (a StatefulSet's next one): not this state's.
    if !has_gate(&pod) || pod.metadata.uid.as_deref() != Some(uid) {
        return Ok(false);
    }
    let body = patch_body(uid, state, capture, current(&pod), &now_rfc3339());
    api.patch_status(name, &PatchParams::default(), &Patch::Strategic(body))
        .await?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use http::Method;

    use super::*;
    use crate::kube::mock::{self, reply};

    fn pod(gated: bool, cond: Option<Value>) -> Value {
        let mut p = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "cart", "namespace": "shop", "uid": "u-cart"},
            "spec": {"containers": [{"name": "app"}]},
            "status": {"conditions": [{"type": "Ready", "status": "False"}]}});
        if gated {
            p["spec"]["readinessGates"] = json!([{"conditionType": GATE}]);
        }
        if let Some(c) = cond {
            p["status"]["conditions"].as_array_mut().unwrap().push(c);
        }
        p
    }

    #[tokio::test]
    async fn gated_pod_gets_true_when_served() {
        let (client, mut h) = mock::client();
        let server = tokio::spawn(async move {
            let (req, send) = h.next_request().await.unwrap();
            assert_eq!(
                (req.method(), req.uri().path()),
                (&Method::GET, "/api/v1/namespaces/shop/pods/cart")
            );
            let was = json!({"type": GATE, "status": "False", "reason": "Pending",
                "lastTransitionTime": "2026-11-22T01:00:00Z"});
            reply(send, 200, &pod(true, Some(was)));
            let (req, send) = h.next_request().await.unwrap();
            assert_eq!(
                (req.method(), req.uri().path()),
                (&Method::PATCH, "/api/v1/namespaces/shop/pods/cart/status")
            );
            assert_eq!(
                req.headers()["content-type"],
                "application/strategic-merge-patch+json"
            );
            let mut body = mock::body(req).await;
            let c = &mut body["status"]["conditions"][0];
            assert_ne!(c["lastTransitionTime"].take(), "2026-11-22T01:00:00Z");
            assert_eq!(
                body,
                json!({"metadata": {"uid": "u-cart"}, "status": {"conditions": [{"type": GATE, "status": "True",
                    "reason": "Served", "message": "captured; ztunnel has the pod, its listeners and its workload",
                    "lastTransitionTime": null}]}})
            );
            reply(send, 200, &pod(true, None));
        });
        assert!(write(
            client,
            "shop",
            "cart",
            "u-cart",
            Some(PodState::Served),
            Capture::Complete
        )
        .await
        .unwrap());
        server.await.unwrap();
    }

    #[test]
    fn only_served_is_true() {
        for s in PodState::ALL {
            let (status, reason, _) = condition_for(Some(s), Capture::Complete);
            assert_eq!(status == "True", s == PodState::Served, "{s:?}");
            assert_eq!(reason == "NotServed", s == PodState::Enabled, "{s:?}");
        }
        assert_eq!(condition_for(None, Capture::Complete).0, "False");
    }

    #[test]
    fn an_incomplete_capture_is_never_true() {
        for s in PodState::ALL {
            let (status, reason, _) = condition_for(Some(s), Capture::Incomplete);
            assert_eq!(status, "False", "{s:?}");
            // A pod being torn down says so.
            let want = if s == PodState::Draining {
                "Draining"
            } else {
                "CaptureIncomplete"
            };
            assert_eq!(reason, want, "{s:?}");
        }
        assert_eq!(
            condition_for(None, Capture::Incomplete).1,
            "NotEnrolled",
            "nothing captured, nothing incomplete"
        );
    }

    #[test]
    fn served_is_true_only_once_verified() {
        let served = Some(PodState::Served);
        assert_eq!(condition_for(served, Capture::Complete).0, "True");
        for (capture, reason) in [
            (Capture::NotYetVerified, "CaptureNotYetVerified"),
            (Capture::Unverified, "CaptureUnverified"),
        ] {
            assert_eq!(
                condition_for(served, capture),
                condition_for(served, capture)
            );
            let (status, why, _) = condition_for(served, capture);
            assert_eq!((status, why), ("False", reason));
            // Other states keep saying what they are.
            let (_, why, _) = condition_for(Some(PodState::Pending), capture);
            assert_eq!(why, "Pending");
        }
    }

    #[tokio::test]
    async fn ungated_pod_is_left_alone() {
        let (client, mut h) = mock::client();
        let server = tokio::spawn(async move {
            let (_, send) = h.next_request().await.unwrap();
            reply(send, 200, &pod(false, None));
            // The handle drops here: a further request (a PATCH) would fail
            // the call below.
        });
        assert!(!write(
            client,
            "shop",
            "cart",
            "u-cart",
            Some(PodState::Enabled),
            Capture::Complete
        )
        .await
        .unwrap());
        server.await.unwrap();
    }

    /// Another pod of the name (a StatefulSet's next one, the state's pod
    /// force-deleted): its gate is not this pod's to write.
    #[tokio::test]
    async fn another_pod_of_the_name_is_left_alone() {
        let (client, mut h) = mock::client();
        let server = tokio::spawn(async move {
            let (_, send) = h.next_request().await.unwrap();
            reply(send, 200, &pod(true, None));
        });
        assert!(!write(
            client,
            "shop",
            "cart",
            "u-cart-before",
            Some(PodState::Served),
            Capture::Complete
        )
        .await
        .unwrap());
        server.await.unwrap();
    }

    #[test]
    fn pending_is_false_and_keeps_its_transition_time() {
        let was = serde_json::from_value::<PodCondition>(json!({"type": GATE, "status": "False",
            "reason": "NotEnrolled", "lastTransitionTime": "2026-11-22T01:00:00Z"}))
        .unwrap();
        let b = patch_body(
            "u-cart",
            Some(PodState::Pending),
            Capture::Complete,
            Some(&was),
            "2026-11-22T03:00:00Z",
        );
        let c = &b["status"]["conditions"][0];
        assert_eq!(
            (c["status"].as_str(), c["reason"].as_str()),
            (Some("False"), Some("Pending"))
        );
        assert_eq!(c["lastTransitionTime"], "2026-11-22T01:00:00Z");
    }
}

//! What the writers' patches share: the times they carry (now, as the API
//! writes times, and a condition's `lastTransitionTime`) and optimistic
//! concurrency (a patch bound to the resourceVersion it was computed from,
//! recomputed and retried when the object changed meanwhile).

use std::future::Future;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{json, Value};

/// Attempts of a read-modify-write when the object keeps changing under us.
const CONFLICT_ATTEMPTS: usize = 5;

/// Now, as Kubernetes writes times (RFC 3339, seconds, UTC).
pub fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// A condition's `lastTransitionTime`: kept from the object when its status
/// stays the same, `now` when it flips (or the object has none).
pub fn transition_time(current: Option<(&str, Option<&Time>)>, status: &str, now: &str) -> Value {
    match current {
        Some((was, Some(t))) if was == status => serde_json::to_value(t).unwrap_or(json!(now)),
        _ => json!(now),
    }
}

/// Makes `patch` apply only to the object version it was computed from: the
/// API server answers 409 if the object changed since.
pub fn precondition(mut patch: Value, resource_version: Option<&str>) -> Value {
    if let Some(rv) = resource_version {
        patch["metadata"]["resourceVersion"] = json!(rv);
    }
    patch
}

/// Runs a read-modify-write `attempt` again while its patch meets a 409.
pub async fn retry_on_conflict<T, Fut>(mut attempt: impl FnMut() -> Fut) -> kube::Result<T>
where
    Fut: Future<Output = kube::Result<T>>,
{
    let mut n = 0;
    loop {
        n += 1;
        match attempt().await {
            Err(kube::Error::Api(e)) if e.code == 409 && n < CONFLICT_ATTEMPTS => continue,
            r => return r,
        }
    }
}

//! Every request the agent's and the watchdog's API functions make is allowed
//! by `deploy/rbac.yaml` (check-deploy checks that the chart grants the same),
//! and nothing is granted that no request needs. The functions called here are
//! all the places userspace builds a kube `Api` (kube::{condition, taint,
//! annotate, gate, verify}, kube::uninstall::{decide, clean (one node)},
//! kube::node_identity::verify,
//! agent::cluster::{admit_add, observe, changed}, kube::events); a new one must
//! be added here.
//! (`sluice uninstall-cluster`, the Helm hook, runs with the hook's own role.) They run against a recording mock API; each request
//! is mapped to the resource and verb RBAC checks it as.

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
    time::Duration,
};

use http::{Method, Request, Response};
use kube::client::Body;
use serde::Deserialize as _;
use serde_json::{json, Value};
use sluice::{
    agent::cluster::KubeCtx,
    cni::spec::PodRef,
    kube::{annotate, condition::ConditionWriter, gate, taint, uninstall, verify},
    readiness::Condition,
};
use sluice_common::PodState;

type Seen = Arc<Mutex<BTreeSet<(String, String)>>>;

/// The (resource, verb) RBAC checks a request as.
fn needed(method: &Method, path: &str, query: &str) -> (String, String) {
    if let Some(rest) = path.strip_prefix("/apis/events.k8s.io/v1/namespaces/") {
        let parts: Vec<&str> = rest.split('/').collect();
        let verb = match (method.as_str(), parts.as_slice()) {
            ("POST", [_, "events"]) => "create",
            ("PATCH", [_, "events", _]) => "patch",
            _ => panic!("unexpected events request {method} {path}"),
        };
        return ("events.k8s.io/events".into(), verb.into());
    }
    if let Some(rest) = path.strip_prefix("/apis/apps/v1/namespaces/") {
        let parts: Vec<&str> = rest.split('/').collect();
        assert!(
            matches!(parts.as_slice(), [_, "daemonsets", _]) && method == Method::GET,
            "unexpected apps request {method} {path}"
        );
        return ("apps/daemonsets".into(), "get".into());
    }
    let parts: Vec<&str> = path
        .strip_prefix("/api/v1/")
        .unwrap_or_else(|| panic!("not a core API path: {path}"))
        .split('/')
        .collect();
    let (resource, named) = match parts.as_slice() {
        ["nodes"] | ["pods"] | ["namespaces"] => (parts[0].to_string(), false),
        ["nodes", _] | ["namespaces", _] => (parts[0].to_string(), true),
        ["nodes", _, sub] => (format!("nodes/{sub}"), true),
        ["namespaces", _, kind, _] => (kind.to_string(), true),
        ["namespaces", _, kind, _, sub] => (format!("{kind}/{sub}"), true),
        other => panic!("unmapped path {other:?}"),
    };
    let verb = match (method.as_str(), named) {
        ("GET", true) => "get",
        ("GET", false) if query.contains("watch=true") => "watch",
        ("GET", false) => "list",
        ("PATCH", _) => "patch",
        (m, _) => panic!("unexpected method {m} {path}"),
    };
    (resource, verb.to_string())
}

/// What deploy/rbac.yaml's ClusterRole grants, as (resource, verb) pairs.
fn granted() -> BTreeSet<(String, String)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/rbac.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let mut out = BTreeSet::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let v: Value = serde_json::Value::deserialize(doc).unwrap();
        if v["kind"] != "ClusterRole" && v["kind"] != "Role" {
            continue;
        }
        for rule in v["rules"].as_array().unwrap() {
            let group = match rule["apiGroups"].as_array().map(Vec::as_slice) {
                Some([g]) if g == "" => "",
                // Only the agent's own DaemonSet, in its namespace.
                Some([g]) if g == "apps" && v["kind"] == "Role" => {
                    assert_eq!(rule["resourceNames"], json!(["sluice"]));
                    "apps/"
                }
                Some([g]) if g == "events.k8s.io" => "events.k8s.io/",
                other => panic!("unexpected API groups {other:?}"),
            };
            for r in rule["resources"].as_array().unwrap() {
                for verb in rule["verbs"].as_array().unwrap() {
                    out.insert((
                        format!("{group}{}", r.as_str().unwrap()),
                        verb.as_str().unwrap().into(),
                    ));
                }
            }
        }
    }
    out
}

/// A mock API server that records what each request needs and answers
/// with a plausible object for the path.
fn recording_api(seen: Seen) -> kube::Client {
    let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    tokio::spawn(async move {
        while let Some((req, send)) = handle.next_request().await {
            let (method, path) = (req.method().clone(), req.uri().path().to_owned());
            let query = req.uri().query().unwrap_or("").to_owned();
            seen.lock().unwrap().insert(needed(&method, &path, &query));
            if path.contains("/events") {
                // The API answers a create or patch with the object.
                let body = req.into_body().collect_bytes().await.unwrap_or_default();
                send.send_response(Response::builder().body(Body::from(body.to_vec())).unwrap());
                continue;
            }
            let body = if query.contains("watch=true") {
                Value::Null
            } else if path.contains("/daemonsets/") {
                json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
                    "metadata": {"name": "sluice", "namespace": "istio-system"},
                    "spec": {"selector": {}, "template": {}}})
            } else if path.ends_with("/pods") || path.ends_with("/namespaces") {
                json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": "5"}, "items": []})
            } else if path.starts_with("/api/v1/nodes/") {
                json!({"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": "node-a", "resourceVersion": "5"},
                    "spec": {"taints": [{"key": "cni.istio.io/not-ready", "effect": "NoSchedule"}]}})
            } else if path.contains("/pods/") {
                json!({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": "cart", "namespace": "shop", "uid": "u-1"},
                    "spec": {"nodeName": "node-a", "containers": [{"name": "app"}],
                        "readinessGates": [{"conditionType": gate::GATE}]},
                    "status": {"phase": "Running"}})
            } else {
                json!({"apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": "shop", "labels": {"istio.io/dataplane-mode": "ambient"}}})
            };
            let bytes = if body.is_null() {
                Vec::new()
            } else {
                serde_json::to_vec(&body).unwrap()
            };
            send.send_response(Response::builder().body(Body::from(bytes)).unwrap());
        }
    });
    kube::Client::new(svc, "default")
}

/// Waits until every (resource, verb) in `want` has been requested.
async fn wait_seen(seen: &Seen, what: &str, want: &[(&str, &str)]) {
    sluice_tests::wait::until_async(what, sluice_tests::wait::DEADLINE, || {
        let s = seen.lock().unwrap().clone();
        let all = want
            .iter()
            .all(|(r, v)| s.contains(&(r.to_string(), v.to_string())));
        if all {
            Ok(())
        } else {
            Err(s)
        }
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn rbac_grants_exactly_what_the_agent_and_watchdog_use() {
    let seen: Seen = Arc::default();
    let client = recording_api(seen.clone());

    // The node condition (agent and watchdog), the startup taint.
    let mut w = ConditionWriter::new(
        client.clone(),
        "node-a",
        "sluice.dev/RedirectionReady",
        Duration::from_secs(60),
    );
    w.update(&Condition::agent_stopped()).await.unwrap();
    // --untaint, recorded apart: granted only when the feature is on.
    let untaint_seen: Seen = Arc::default();
    assert!(taint::remove(
        recording_api(untaint_seen.clone()),
        "node-a",
        &["cni.istio.io/not-ready".into()]
    )
    .await
    .unwrap());
    // The pod annotation and readiness gate, the CNI cross-checks.
    annotate::write(
        client.clone(),
        "shop",
        "cart",
        "u-1",
        Some(PodState::Enabled),
        false,
    )
    .await
    .unwrap();
    assert!(gate::write(
        client.clone(),
        "shop",
        "cart",
        "u-1",
        Some(PodState::Enabled),
        gate::Capture::Complete
    )
    .await
    .unwrap());
    verify::fetch(client.clone(), "shop", "cart").await.unwrap();
    // --node-name checked against the Node (boot id).
    sluice::kube::node_identity::verify(client.clone(), "node-a")
        .await
        .unwrap()
        .unwrap();
    // Uninstall: the DaemonSet read, then this node's objects cleared.
    assert_eq!(
        uninstall::decide(client.clone(), "istio-system", "sluice")
            .await
            .unwrap(),
        None
    );
    uninstall::clean(
        client.clone(),
        Some("sluice.dev/RedirectionReady"),
        &[],
        Some("node-a"),
    )
    .await
    .unwrap();
    let k = KubeCtx {
        client: client.clone(),
        node: "node-a".into(),
        cni_records: None,
        selection: Default::default(),
        selection_file: None,
    };
    let pod = PodRef {
        name: "cart".into(),
        namespace: "shop".into(),
        uid: Some("u-1".into()),
    };
    k.admit_add(&pod).await.unwrap();
    // Events on a pod: the first creates, a repeat patches its series.
    let events = sluice::kube::events::Events::start(client.clone(), "node-a");
    let on = sluice::kube::events::PodRef {
        namespace: "shop".into(),
        name: "cart".into(),
        uid: "u-1".into(),
    };
    for _ in 0..2 {
        events.pod(
            on.clone(),
            sluice::kube::events::Reason::ZtunnelNotConnected,
            "no ztunnel",
        );
    }
    wait_seen(
        &seen,
        "the event's create and its repeat's patch",
        &[
            ("events.k8s.io/events", "create"),
            ("events.k8s.io/events", "patch"),
        ],
    )
    .await;
    k.observe().await.unwrap();
    // The reflectors' pod and namespace watches: list, then watch.
    let (tx, _rx) = tokio::sync::mpsc::channel(8);
    let (_view, drive) = k.reflect(tx, |_| {});
    let watching = tokio::spawn(drive);
    wait_seen(
        &seen,
        "the pod and namespace watches",
        &[("pods", "watch"), ("namespaces", "watch")],
    )
    .await;
    watching.abort();

    let seen = seen.lock().unwrap().clone();
    let granted = granted();
    let missing: Vec<_> = seen.difference(&granted).collect();
    assert!(
        missing.is_empty(),
        "requests deploy/rbac.yaml does not allow: {missing:?}"
    );
    let unused: Vec<_> = granted.difference(&seen).collect();
    assert!(unused.is_empty(), "granted but never used: {unused:?}");
    // What --untaint needs beyond that: exactly `patch` on nodes, which the
    // chart adds with readiness.untaint (check-deploy checks it renders).
    let extra: BTreeSet<_> = untaint_seen
        .lock()
        .unwrap()
        .difference(&granted)
        .cloned()
        .collect();
    assert_eq!(
        extra,
        BTreeSet::from([("nodes".to_string(), "patch".to_string())])
    );
}

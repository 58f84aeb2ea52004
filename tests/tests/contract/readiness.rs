//! The node condition, /readyz and the metrics, computed from the pinned maps
//! the dataplane writes: a real agent process, a ztunnel-like peer, a pod in
//! a real netns. And the stopping agent's last word on the Node (mock API).

use std::{
    path::Path,
    sync::{Arc, Mutex},
};

use anyhow::{ensure, Context as _};
use http::{Method, Request, Response};
use kube::client::Body;
use libtest_mimic::Trial;
use serde_json::{json, Value};
use sluice::{
    agent::{
        node::NodeAgent,
        report::{self, NodeApi, ReportConfig},
    },
    readiness::DEFAULT_CONDITION_TYPE,
    zds::server::{self, Hub},
};
use sluice_tests::{
    agent::{free_port, http_get, AgentProc, PeerProc},
    flow::{connect as tcp, Opts},
    harness::{Fixture, APP_PORT},
    mockapi,
    topology::Family,
    wait,
};

use crate::{trial, TestResult};

const PEER: &str = env!("CARGO_BIN_EXE_sluice-zds-peer");

pub fn trials() -> Vec<Trial> {
    vec![
        trial(
            "readiness::pending_past_grace_then_ready_when_ztunnel_acks",
            pending_then_ready,
        ),
        trial(
            "readiness::stopping_agent_marks_the_node_not_ready",
            stop_marks_node,
        ),
        trial(
            "readiness::ready_node_gets_its_startup_taint_removed",
            untaint_when_ready,
        ),
    ]
}

/// The node part of `sluice status -o json`.
fn node_status(agent: &AgentProc) -> anyhow::Result<Value> {
    Ok(agent.status_json()?["node"].clone())
}

fn wait_reason(agent: &AgentProc, want: &str) -> anyhow::Result<Value> {
    wait::until(
        &format!("the condition's reason to be {want}"),
        wait::DEADLINE,
        || match node_status(agent) {
            Ok(n) if n["agent"]["condition"]["reason"] == want => Ok(n),
            other => Err(format!("{other:?}")),
        },
    )
}

/// The value of one sample, parsed by a Prometheus text parser.
fn sample(
    scrape: &prometheus_parse::Scrape,
    name: &str,
    label: Option<(&str, &str)>,
) -> Option<f64> {
    scrape
        .samples
        .iter()
        .find(|s| s.metric == name && label.is_none_or(|(k, v)| s.labels.get(k) == Some(v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => f64::NAN,
        })
}

fn pending_then_ready() -> TestResult {
    let f = Fixture::new("rd", None)?;
    let port = free_port()?;
    let addr = format!("127.0.0.1:{port}");
    let agent = AgentProc::start_with(
        &f.topo.pins,
        &["--metrics-addr", &addr, "--pending-grace", "1s"],
    )?;

    // No ztunnel yet.
    wait_reason(&agent, "ZtunnelDisconnected")?;
    let (code, body) = http_get(port, "/readyz")?;
    ensure!(
        code == 503 && body.contains("ZtunnelDisconnected"),
        "{code} {body}"
    );
    ensure!(http_get(port, "/healthz")?.0 == 200);

    // A ztunnel that refuses the pod: it stays Pending. That is ztunnel's
    // verdict on one pod, not a fault of the node: after the grace the
    // condition stays True, its reason naming the pod.
    let mut refusing = PeerProc::start(Path::new(PEER), &agent.zds, &["--nack", "not today"])?;
    agent.wait_ztunnel(
        refusing.pid().context("no pid")?,
        "the refusing peer connected",
        |z| z["connected"] == true,
    )?;
    let out = agent.enroll(&f.topo.pod_netns_path(), f.uid.as_str(), "shop", "cart")?;
    ensure!(
        out.ok && out.stdout.contains("Pending"),
        "{} {}",
        out.stdout,
        out.stderr
    );
    let n = wait_reason(&agent, "PodsRefusedByZtunnel")?;
    let msg = n["agent"]["condition"]["message"]
        .as_str()
        .unwrap_or_default();
    ensure!(
        msg.starts_with("1 of 1 ambient pods refused by ztunnel (it nacks their add; the pods wait, the node captures) for >1s: shop/cart ("),
        "{msg}"
    );
    ensure!(n["agent"]["condition"]["ready"] == true, "{n}");
    ensure!(
        n["agent"]["waiting"][0]["ztunnel_refused"] == true,
        "{}",
        n["agent"]["waiting"]
    );
    ensure!(http_get(port, "/readyz")?.0 == 200);

    // A ztunnel that acks but opens no listeners: nothing refuses the pod,
    // capture just cannot complete, so past the grace the node is not
    // ready, naming the pod.
    refusing.kill();
    let mut broken = PeerProc::start(Path::new(PEER), &agent.zds, &["--ack-without-listening"])?;
    let n = wait_reason(&agent, "PodsPendingEnrollment")?;
    let msg = n["agent"]["condition"]["message"]
        .as_str()
        .unwrap_or_default();
    ensure!(
        // The pod, and how long it has waited (past the grace).
        msg.starts_with("1 of 1 ambient pods pending for >1s: shop/cart (")
            && msg.ends_with("s)")
            && !msg.ends_with("(0s)"),
        "{msg}"
    );
    ensure!(n["agent"]["condition"]["ready"] == false && n["agent"]["ztunnel_connected"] == true);
    let (code, body) = http_get(port, "/readyz")?;
    ensure!(
        code == 503 && body.contains("PodsPendingEnrollment"),
        "{code} {body}"
    );

    // A ztunnel that takes it (and knows its workload): its snapshot's add
    // is acked, the pod Served, the node ready.
    broken.kill();
    let _taking = PeerProc::start(Path::new(PEER), &agent.zds, &[])?;
    f.wait_state("Served")?;
    let n = wait_reason(&agent, "RedirectionReady")?;
    ensure!(n["agent"]["condition"]["ready"] == true, "{n}");
    ensure!(n["agent"]["condition_type"] == DEFAULT_CONDITION_TYPE);
    let (code, body) = http_get(port, "/readyz")?;
    ensure!(code == 200, "{code} {body}");
    let table = agent.sluice(&["status"])?.stdout;
    ensure!(
        table.contains("condition:  sluice.dev/RedirectionReady=True reason=RedirectionReady")
            && table.contains("ztunnel:    connected"),
        "{table}"
    );

    // Captured traffic shows in the kernel counters the metrics sum.
    let r = tcp(
        &f.topo.client,
        std::net::SocketAddr::new(f.topo.pod_ip(Family::V4), APP_PORT),
        Opts::default(),
    );
    ensure!(r.reply().is_some(), "{r:?}");
    let (code, text) = http_get(port, "/metrics")?;
    ensure!(code == 200);
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
        .context("parsing /metrics")?;
    let want = [
        ("sluice_pods", Some(("state", "Served")), 1.0),
        ("sluice_pods", Some(("state", "Enabled")), 0.0),
        ("sluice_pods", Some(("state", "Pending")), 0.0),
        ("sluice_time_to_served_seconds_count", None, 1.0),
        ("sluice_served_check_fallback", None, 0.0),
        ("sluice_ztunnel_connected", None, 1.0),
        ("sluice_node_ready", None, 1.0),
        (
            "sluice_node_condition_reason",
            Some(("reason", "RedirectionReady")),
            1.0,
        ),
        ("sluice_enrollments_total", None, 1.0),
        (
            "sluice_captured_connections_total",
            Some(("listener", "inbound")),
            1.0,
        ),
    ];
    for (name, label, v) in want {
        let got = sample(&scrape, name, label);
        ensure!(
            got == Some(v),
            "{name} {label:?}: {got:?}, want {v}\n{text}"
        );
    }
    for (name, label) in [
        ("sluice_zds_answers_total", ("answer", "nack")),
        ("sluice_zds_answers_total", ("answer", "ack")),
        (
            "sluice_enrollment_failures_total",
            ("reason", "ztunnel_nack"),
        ),
        // Pending → Enabled → Served, reported by the one place states change.
        ("sluice_pod_transitions_total", ("to", "Enabled")),
        ("sluice_pod_transitions_total", ("to", "Served")),
        ("sluice_served_checks_total", ("result", "answered")),
    ] {
        let got = sample(&scrape, name, Some(label)).unwrap_or(0.0);
        ensure!(got >= 1.0, "{name} {label:?}: {got}\n{text}");
    }
    Ok(())
}

/// A mock API server for one Node: answers GETs with the node (carrying the
/// last patched condition) and records every status patch.
fn node_api(patches: Arc<Mutex<Vec<Value>>>) -> kube::Client {
    let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    tokio::spawn(async move {
        while let Some((req, send)) = handle.next_request().await {
            let (method, path) = (req.method().clone(), req.uri().path().to_owned());
            let want = if method == Method::PATCH {
                "/api/v1/nodes/node-a/status"
            } else {
                "/api/v1/nodes/node-a"
            };
            assert_eq!(path, want, "{method} {path}");
            let body = req.into_body().collect_bytes().await.unwrap_or_default();
            if method == Method::PATCH {
                patches
                    .lock()
                    .unwrap()
                    .push(serde_json::from_slice(&body).unwrap());
            }
            let conditions: Vec<Value> = patches
                .lock()
                .unwrap()
                .last()
                .map(|p| p["status"]["conditions"].as_array().unwrap().clone())
                .unwrap_or_default();
            let node = json!({"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": "node-a", "resourceVersion": "1"},
                "status": {"conditions": conditions}});
            mockapi::reply(send, 200, &node);
        }
    });
    kube::Client::new(svc, "default")
}

fn stop_marks_node() -> TestResult {
    let f = Fixture::new("rs", None)?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let patches = Arc::new(Mutex::new(Vec::new()));
        let client = node_api(patches.clone());
        let node = NodeAgent::new(
            f.dataplane()?,
            Arc::new(Hub::default()),
            None,
            DEFAULT_CONDITION_TYPE,
            Default::default(),
            sluice::agent::node::Periods {
                orphan_grace: std::time::Duration::ZERO,
                ..Default::default()
            },
        );
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        let api = NodeApi {
            client,
            node: "node-a".into(),
        };
        let task = tokio::spawn(report::run(
            node.report().clone(),
            node.clone(),
            None,
            ReportConfig::default(),
            Some(api),
            stop,
        ));
        wait::until_async("a condition written", wait::DEADLINE, || {
            (!patches.lock().unwrap().is_empty())
                .then_some(())
                .ok_or("no patch")
        })
        .await?;
        let first = patches.lock().unwrap()[0]["status"]["conditions"][0].clone();
        ensure!(
            first["status"] == "False" && first["reason"] == "ZtunnelDisconnected",
            "{first}"
        );
        stop_tx.send(true)?;
        task.await?;
        let all = patches.lock().unwrap().clone();
        ensure!(
            all.len() == 2,
            "one write while running (unchanged), one on stop: {all:?}"
        );
        let last = &all[1]["status"]["conditions"][0];
        ensure!(
            last["status"] == "False"
                && last["reason"] == "AgentStopped"
                && last["lastTransitionTime"] == first["lastTransitionTime"],
            "{last}"
        );
        ensure!(node.report().condition().is_some_and(|c| !c.ready));
        Ok(())
    })
}

/// A mock API server for one Node with a startup taint: serves and records
/// status patches (the condition) and spec patches (the taints).
fn tainted_node_api(log: Arc<Mutex<Vec<(String, Value)>>>) -> kube::Client {
    let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    tokio::spawn(async move {
        let mut taints = json!([
            {"key": "cni.istio.io/not-ready", "effect": "NoSchedule"},
            {"key": "dedicated", "value": "mesh", "effect": "NoSchedule"}
        ]);
        let mut conditions = json!([]);
        while let Some((req, send)) = handle.next_request().await {
            let (method, path) = (req.method().clone(), req.uri().path().to_owned());
            let body = req.into_body().collect_bytes().await.unwrap_or_default();
            // Events on the (cluster-scoped) node land in `default`.
            if path == "/apis/events.k8s.io/v1/namespaces/default/events" {
                let ev: Value = serde_json::from_slice(&body).unwrap();
                log.lock().unwrap().push((path.clone(), ev.clone()));
                mockapi::reply(send, 200, &ev);
                continue;
            }
            if method == Method::PATCH {
                let v: Value = serde_json::from_slice(&body).unwrap();
                match path.as_str() {
                    "/api/v1/nodes/node-a/status" => conditions = v["status"]["conditions"].clone(),
                    "/api/v1/nodes/node-a" => taints = v["spec"]["taints"].clone(),
                    p => panic!("unexpected PATCH {p}"),
                }
                log.lock().unwrap().push((path.clone(), v));
            } else {
                assert!(path.starts_with("/api/v1/nodes/node-a"), "{method} {path}");
            }
            let node = json!({"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": "node-a", "resourceVersion": "1"},
                "spec": {"taints": taints}, "status": {"conditions": conditions}});
            mockapi::reply(send, 200, &node);
        }
    });
    kube::Client::new(svc, "default")
}

/// Programs pinned, a ztunnel connected (a real ZDS server in-process and the
/// peer process), no pod pending: the condition goes True, and only then is
/// the `--untaint` taint removed — the other taint stays.
fn untaint_when_ready() -> TestResult {
    let f = Fixture::new("ut", None)?;
    let dir = std::env::temp_dir().join(format!("sluice-untaint-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let zds = dir.join("ztunnel.sock");
    let rt = tokio::runtime::Runtime::new()?;
    let result = rt.block_on(async {
        let log = Arc::new(Mutex::new(Vec::new()));
        let client = tainted_node_api(log.clone());
        let hub = Arc::new(Hub::default());
        let node = NodeAgent::new(
            f.dataplane()?,
            hub.clone(),
            None,
            DEFAULT_CONDITION_TYPE,
            Default::default(),
            sluice::agent::node::Periods {
                orphan_grace: std::time::Duration::ZERO,
                ..Default::default()
            },
        );
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        let listener = server::bind(&zds)?;
        let serving = tokio::spawn(server::serve(
            listener,
            zds.clone(),
            hub.clone(),
            node.zds_handler(),
            stop.clone(),
        ));
        let cfg = ReportConfig {
            untaint: vec!["cni.istio.io/not-ready".into()],
            ..ReportConfig::default()
        };
        let api = NodeApi {
            client,
            node: "node-a".into(),
        };
        let reporting = tokio::spawn(report::run(
            node.report().clone(),
            node.clone(),
            None,
            cfg,
            Some(api),
            stop.clone(),
        ));
        // Not ready until a ztunnel connects; then the flip is an Event on
        // the node.
        wait::until_async("the first condition written", wait::DEADLINE, || {
            let l = log.lock().unwrap().clone();
            if l.iter().any(|(p, _)| p.ends_with("/status")) {
                Ok(())
            } else {
                Err(l)
            }
        })
        .await?;
        let _peer = PeerProc::start(Path::new(PEER), &zds, &[])?;
        wait::until_async("the taint removed", wait::DEADLINE, || {
            let l = log.lock().unwrap().clone();
            if l.iter().any(|(p, _)| p == "/api/v1/nodes/node-a") {
                Ok(())
            } else {
                Err(l)
            }
        })
        .await?;
        stop_tx.send(true)?;
        reporting.await?;
        let _ = serving.await;
        let log = log.lock().unwrap().clone();
        let untaint = log
            .iter()
            .position(|(p, _)| p == "/api/v1/nodes/node-a")
            .unwrap();
        let ready = log.iter().position(|(p, v)| {
            p.ends_with("/status") && v["status"]["conditions"][0]["status"] == "True"
        });
        ensure!(
            ready.is_some_and(|r| r < untaint),
            "untainted before True was written: {log:?}"
        );
        ensure!(
            log[untaint].1["spec"]["taints"]
                == json!([{"key": "dedicated", "value": "mesh", "effect": "NoSchedule"}]),
            "{log:?}"
        );
        ensure!(
            log.iter()
                .filter(|(p, _)| p == "/api/v1/nodes/node-a")
                .count()
                == 1,
            "the taint is removed once: {log:?}"
        );
        let events: Vec<&Value> = log
            .iter()
            .filter(|(p, _)| p.contains("/events"))
            .map(|(_, v)| v)
            .collect();
        ensure!(
            events.iter().any(|e| e["reason"] == "RedirectionReady"
                && e["type"] == "Normal"
                && e["regarding"]["kind"] == "Node"
                && e["regarding"]["name"] == "node-a"
                // What `kubectl describe node` looks for (the kubelet's
                // convention: a node's events carry its name as uid).
                && e["regarding"]["uid"] == "node-a"
                && e["note"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("RedirectionReady: "))),
            "no RedirectionReady event on the node: {events:?}"
        );
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&dir);
    result
}

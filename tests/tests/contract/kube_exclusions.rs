//! Pod exclusions through the agent (in-process, against kube-rs' mock
//! service): the node's switch, the annotations of a running pod changed
//! between reconcile passes (as the pod watch wakes them), bad values, and
//! what the pod's traffic does meanwhile.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use anyhow::ensure;
use http::{Method, Request, Response};
use kube::client::Body;
use libtest_mimic::Trial;
use serde_json::{json, Value};
use sluice::{
    agent::node::NodeAgent,
    control,
    exclusions::{PodExclusionsMode, Policy, EXCLUDE_OUTBOUND_PORTS},
    kube::selection::Selection,
};
use sluice_tests::{
    flow::{connect, Held, Opts, Reached},
    harness::{Fixture, REMOTE_PORT},
    mockapi,
    topology::Family,
};

use crate::{
    kube::{cluster_node_selecting, event, pod_ips_json, warning, Events, PodProcess},
    trial, TestResult,
};

pub fn trials() -> Vec<Trial> {
    vec![
        trial(
            "kube::pod_exclusions_follow_the_annotations_of_a_running_pod_and_bad_values_change_nothing",
            follows_annotations,
        ),
        trial(
            "kube::pod_exclusions_off_the_pod_is_captured_fully_with_a_warning",
            switched_off,
        ),
        trial(
            "kube::pod_exclusions_outside_the_allowed_namespaces_are_ignored_with_a_warning",
            namespace_not_allowed,
        ),
    ]
}

/// A mock API with one ambient pod, `mesh/web`, whose annotations are
/// whatever `annotations` holds at each LIST; events are recorded.
fn api(uid: String, ips: Value, annotations: Arc<Mutex<Value>>, events: Events) -> kube::Client {
    let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    tokio::spawn(async move {
        while let Some((req, send)) = handle.next_request().await {
            let (method, path) = (req.method().clone(), req.uri().path().to_owned());
            let body = req.into_body().collect_bytes().await.unwrap_or_default();
            let Some(send) = mockapi::event(
                "/apis/events.k8s.io/v1/namespaces/",
                &path,
                &body,
                &events,
                send,
            ) else {
                continue;
            };
            let reply = match (method, path.as_str()) {
                (Method::GET, "/api/v1/pods") => {
                    json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": [{
                    "metadata": {"name": "web", "namespace": "mesh", "uid": uid,
                        "annotations": annotations.lock().unwrap().clone()},
                    "spec": {"nodeName": "node-a", "serviceAccountName": "web-sa", "containers": [{"name": "app"}]},
                    "status": {"phase": "Running", "podIPs": ips}}]})
                }
                (Method::GET, "/api/v1/namespaces") => {
                    json!({"apiVersion": "v1", "kind": "NamespaceList", "metadata": {}, "items": [
                    {"metadata": {"name": "mesh", "labels": {"istio.io/dataplane-mode": "ambient"}}}]})
                }
                (Method::PATCH, p) if p.ends_with("/status") => {
                    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web"}})
                }
                (Method::GET, "/api/v1/namespaces/mesh/pods/web") => {
                    json!({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": "web", "namespace": "mesh"}, "spec": {"containers": [{"name": "app"}]}})
                }
                (m, p) => panic!("unexpected request {m} {p}"),
            };
            mockapi::reply(send, 200, &reply);
        }
    });
    kube::Client::new(svc, "default")
}

struct Setup {
    f: Fixture,
    uid: String,
    _process: PodProcess,
    annotations: Arc<Mutex<Value>>,
    events: Events,
}

impl Setup {
    fn new(tag: &str, n: u8) -> anyhow::Result<Self> {
        let f = Fixture::new(tag, None)?;
        let uid = format!(
            "7e57{:04x}-0000-4000-8000-0000000001{n:02x}",
            std::process::id() & 0xffff
        );
        let process = PodProcess::spawn(&f.topo.pod_netns_path(), &uid)?;
        Ok(Self {
            f,
            uid,
            _process: process,
            annotations: Arc::new(Mutex::new(json!({}))),
            events: Events::default(),
        })
    }

    fn node(&self, mode: PodExclusionsMode) -> anyhow::Result<(Arc<NodeAgent>, impl Drop)> {
        self.node_with(Policy {
            mode,
            namespaces: vec![],
        })
    }

    fn node_with(&self, exclusions: Policy) -> anyhow::Result<(Arc<NodeAgent>, impl Drop)> {
        let client = api(
            self.uid.clone(),
            pod_ips_json(&self.f),
            self.annotations.clone(),
            self.events.clone(),
        );
        let selection = Selection {
            exclusions,
            ..Selection::excluding(["kube-system".to_string()].into())
        };
        let (node, announcing) = cluster_node_selecting(
            self.f.dataplane()?,
            client,
            None,
            Default::default(),
            selection,
            None,
        )?;
        Ok((node, announcing))
    }

    fn annotate(&self, excluded_ports: Option<&str>) {
        *self.annotations.lock().unwrap() = match excluded_ports {
            Some(v) => json!({ EXCLUDE_OUTBOUND_PORTS: v }),
            None => json!({}),
        };
    }

    fn excluded_ports(&self) -> anyhow::Result<Vec<u16>> {
        let pods = sluice::status::read(&self.f.topo.pins)?;
        let p = pods
            .iter()
            .find(|p| p.uid == self.uid)
            .ok_or_else(|| anyhow::anyhow!("the pod is not enrolled: {pods:?}"))?;
        Ok(p.exclusions.exclude_outbound_ports.clone())
    }

    /// The pod's connection to the remote server: it reached it (excluded,
    /// though the pod is Pending: no ztunnel) or was dropped (captured,
    /// failing closed).
    fn reaches_remote(&self) -> bool {
        let to = SocketAddr::new(Family::V4.client(), REMOTE_PORT);
        matches!(
            connect(&self.f.topo.pod, to, Opts::default()),
            Reached::Reply(_)
        )
    }
}

async fn notices(node: &NodeAgent) -> anyhow::Result<Vec<control::ExclusionNotice>> {
    let control::Response::More(control::NodeAnswer::Node(n)) =
        node.requests().handle(control::Request::Status).await
    else {
        anyhow::bail!("no node status");
    };
    Ok(n.exclusion_notices)
}

/// A Normal Event with `reason` on `web` whose note holds `note`.
async fn normal(events: &Events, reason: &str, note: &str) -> TestResult {
    event(events, "Normal", reason, "web", &[note]).await
}

fn follows_annotations() -> TestResult {
    let s = Setup::new("exk", 1)?;
    let port = REMOTE_PORT.to_string();
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let (node, _announcing) = s.node(PodExclusionsMode::Annotations)?;
        let pass = || node.relist().reconcile_once(std::time::Duration::ZERO);
        // Captured with its exclusions in force from the start, announced:
        // the pod is Pending (no ztunnel), yet its excluded connections go
        // through.
        s.annotate(Some(&port));
        pass().await?;
        ensure!(
            s.excluded_ports()? == [REMOTE_PORT],
            "{:?}",
            s.excluded_ports()
        );
        normal(
            &s.events,
            "PodExclusionsApplied",
            "excludeOutboundPorts=9090",
        )
        .await?;
        ensure!(s.reaches_remote(), "an excluded connection failed");
        let held = Held::open(
            &s.f.topo.pod,
            SocketAddr::new(Family::V4.client(), REMOTE_PORT),
        )?;

        // Changed on the running pod: in force at the next pass, announced.
        s.annotate(Some(&format!("{port},6379")));
        pass().await?;
        ensure!(
            s.excluded_ports()? == [6379, REMOTE_PORT],
            "{:?}",
            s.excluded_ports()
        );
        normal(
            &s.events,
            "PodExclusionsApplied",
            "excludeOutboundPorts=6379,9090",
        )
        .await?;

        // Bad values change nothing and say which entry is wrong, in an
        // Event of their own each and in the status.
        // One more than the per-pod limit of 64 ports.
        let too_many = (1..=65)
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(",");
        for (value, named) in [
            ("9090,db", "\"db\""),
            ("15001", "15001"),
            (too_many.as_str(), "65 ports"),
        ] {
            s.annotate(Some(value));
            pass().await?;
            ensure!(
                s.excluded_ports()? == [6379, REMOTE_PORT],
                "{value}: {:?}",
                s.excluded_ports()
            );
            warning(&s.events, "InvalidPodExclusions", "web", &[named]).await?;
            let n = notices(&node).await?;
            ensure!(
                n.len() == 1 && n[0].kind == "invalid" && n[0].detail.contains(named),
                "{n:?}"
            );
        }
        ensure!(s.reaches_remote(), "still excluded after a bad value");

        // Removed: captured again (Pending: fails closed), the notice gone;
        // the connection opened while excluded keeps its path.
        s.annotate(None);
        pass().await?;
        ensure!(s.excluded_ports()?.is_empty(), "{:?}", s.excluded_ports());
        ensure!(
            !s.reaches_remote(),
            "a captured connection of a Pending pod went through"
        );
        ensure!(notices(&node).await?.is_empty());
        let mut held = held;
        ensure!(
            matches!(held.exchange(), Reached::Reply(_)),
            "the open connection lost its path"
        );
        let text = node.report().metrics.render();
        ensure!(
            text.lines().any(|l| l
                .starts_with("sluice_connections_excluded_total{direction=\"outbound\"} ")
                && !l.ends_with(" 0")),
            "{text}"
        );
        Ok(())
    })
}

fn switched_off() -> TestResult {
    ignored(
        Setup::new("exoff", 2)?,
        Policy {
            mode: PodExclusionsMode::Off,
            namespaces: vec![],
        },
        "--pod-exclusions off",
    )
}

/// With `--pod-exclusions-namespaces db`, a pod of another namespace that
/// carries exclusions is captured fully, and told why in a Warning.
fn namespace_not_allowed() -> TestResult {
    ignored(
        Setup::new("exns", 3)?,
        Policy {
            mode: PodExclusionsMode::Annotations,
            namespaces: vec!["db".into()],
        },
        "--pod-exclusions-namespaces",
    )
}

/// Under `policy`, the pod's exclusion annotation is not honoured: it is
/// captured fully (Pending: its connection fails closed), and a Warning and
/// its notice say `why`.
fn ignored(s: Setup, policy: Policy, why: &str) -> TestResult {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let (node, _announcing) = s.node_with(policy)?;
        s.annotate(Some(&REMOTE_PORT.to_string()));
        node.relist()
            .reconcile_once(std::time::Duration::ZERO)
            .await?;
        ensure!(s.excluded_ports()?.is_empty(), "{:?}", s.excluded_ports());
        ensure!(!s.reaches_remote(), "excluded, though {why}");
        warning(&s.events, "PodExclusionsIgnored", "web", &[why]).await?;
        let n = notices(&node).await?;
        ensure!(n.len() == 1 && n[0].kind == "ignored", "{n:?}");
        Ok(())
    })
}

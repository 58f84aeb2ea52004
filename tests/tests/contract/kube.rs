//! The agent in cluster mode, in-process, against kube-rs' mock service: CNI
//! requests admitted by the API's view of the pod, annotations written.

use std::sync::{Arc, Mutex};

use anyhow::{ensure, Context as _};
use http::{Method, Request, Response};
use kube::client::Body;
use libtest_mimic::Trial;
use serde_json::{json, Value};
use sluice::{
    agent::{
        cluster::KubeCtx,
        node::{NodeAgent, ServedConfig},
    },
    cni::spec::PodRef,
    control,
    zds::server::Hub,
};
use sluice_tests::{admin, agent::PeerProc, harness::Fixture, mockapi, topology::Family, wait};

const PEER: &str = env!("CARGO_BIN_EXE_sluice-zds-peer");

use crate::{trial, TestResult};

pub fn trials() -> Vec<Trial> {
    vec![
        trial("kube::cni_requests_are_admitted_against_the_api", admitted),
        trial(
            "kube::existing_pod_netns_found_by_cgroup",
            existing_pod_netns_found_by_cgroup,
        ),
        trial(
            "kube::relist_captures_running_ambient_pods_and_releases_gone_ones",
            relist,
        ),
        trial(
            "kube::a_recorded_netns_path_that_no_longer_holds_the_pods_addresses_is_not_captured",
            stale_record,
        ),
        trial(
            "kube::enablement_selectors_decide_capture_and_the_plugins_snapshot",
            enablement_selectors,
        ),
        trial(
            "kube::pod_watch_event_triggers_capture",
            watch_triggers_capture,
        ),
        trial(
            "kube::readiness_gate_is_true_only_while_ztunnel_serves_the_pod",
            gate_follows_served,
        ),
        trial(
            "kube::a_host_veth_whose_hook_another_qdisc_holds_gets_a_warning_event",
            host_hook_event,
        ),
        trial(
            "kube::a_capture_a_repair_cannot_complete_turns_the_gate_false_with_a_warning",
            incomplete_gate,
        ),
        trial(
            "kube::a_pod_that_claimed_an_address_the_runtime_gives_another_gets_a_warning",
            claim_evicted_event,
        ),
    ]
}

/// The agent's node in cluster mode (in-process) on `f`'s pins, with its
/// announcer running until the returned sender drops.
fn cluster_node(
    f: &Fixture,
    client: kube::Client,
    cni_records: Option<std::path::PathBuf>,
) -> anyhow::Result<(Arc<NodeAgent>, tokio::sync::watch::Sender<bool>)> {
    cluster_node_with(f, client, cni_records, Default::default(), None)
}

fn cluster_node_with(
    f: &Fixture,
    client: kube::Client,
    cni_records: Option<std::path::PathBuf>,
    served: ServedConfig,
    selection_file: Option<std::path::PathBuf>,
) -> anyhow::Result<(Arc<NodeAgent>, tokio::sync::watch::Sender<bool>)> {
    cluster_node_over(f.dataplane()?, client, cni_records, served, selection_file)
}

/// [`cluster_node_with`] on a dataplane made by the caller.
fn cluster_node_over(
    dp: sluice::dataplane::loader::Dataplane,
    client: kube::Client,
    cni_records: Option<std::path::PathBuf>,
    served: ServedConfig,
    selection_file: Option<std::path::PathBuf>,
) -> anyhow::Result<(Arc<NodeAgent>, tokio::sync::watch::Sender<bool>)> {
    let selection =
        sluice::kube::selection::Selection::excluding(["kube-system".to_string()].into());
    cluster_node_selecting(dp, client, cni_records, served, selection, selection_file)
}

/// [`cluster_node_over`] with the caller's selection.
pub(crate) fn cluster_node_selecting(
    dp: sluice::dataplane::loader::Dataplane,
    client: kube::Client,
    cni_records: Option<std::path::PathBuf>,
    served: ServedConfig,
    selection: sluice::kube::selection::Selection,
    selection_file: Option<std::path::PathBuf>,
) -> anyhow::Result<(Arc<NodeAgent>, tokio::sync::watch::Sender<bool>)> {
    let k = KubeCtx {
        client,
        node: "node-a".into(),
        cni_records,
        selection,
        selection_file,
    };
    let node = NodeAgent::new(
        dp,
        Arc::new(Hub::default()),
        Some(k),
        sluice::readiness::DEFAULT_CONDITION_TYPE,
        served,
        sluice::agent::node::Periods {
            orphan_grace: std::time::Duration::ZERO,
            ..Default::default()
        },
    );
    let (announcing, stop) = tokio::sync::watch::channel(false);
    tokio::spawn(node.announce(stop));
    Ok((node, announcing))
}

/// Events the mock API was sent (created, or a repeat's series patched).
pub(crate) type Events = Arc<Mutex<Vec<Value>>>;

/// A tiny API server: answers pod and namespace GETs from fixed objects and
/// records every status patch body and every event.
fn api(
    deleting: Arc<Mutex<bool>>,
    patches: Arc<Mutex<Vec<(String, Value)>>>,
    events: Events,
) -> kube::Client {
    let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    tokio::spawn(async move {
        while let Some((req, send)) = handle.next_request().await {
            let (method, path) = (req.method().clone(), req.uri().path().to_owned());
            let body = req.into_body().collect_bytes().await.unwrap_or_default();
            let pod = |name: &str, ns: &str, labels: Value| {
                let mut p = json!({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": name, "namespace": ns, "uid": format!("u-{name}"), "labels": labels},
                    "spec": {"nodeName": "node-a", "serviceAccountName": format!("{name}-sa"), "containers": [{"name": "app"}]},
                    "status": {"phase": "Running"}});
                if *deleting.lock().unwrap() {
                    p["metadata"]["deletionTimestamp"] = json!("2026-11-22T00:00:00Z");
                }
                // cart asks for sluice's readiness gate, for no inbound
                // capture and for no DNS capture.
                if name == "cart" {
                    p["spec"]["readinessGates"] =
                        json!([{"conditionType": "sluice.dev/redirected"}]);
                    p["metadata"]["annotations"] = json!({"ambient.istio.io/bypass-inbound-capture": "true", "ambient.istio.io/dns-capture": "false"});
                }
                p
            };
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
                (Method::GET, "/api/v1/namespaces/shop/pods/cart") => {
                    pod("cart", "shop", json!({}))
                }
                (Method::GET, "/api/v1/namespaces/other/pods/plain") => {
                    pod("plain", "other", json!({}))
                }
                (Method::GET, "/api/v1/namespaces/shop") => {
                    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop", "labels": {"istio.io/dataplane-mode": "ambient"}}})
                }
                (Method::GET, "/api/v1/namespaces/other") => {
                    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "other"}})
                }
                (Method::PATCH, p) if p.ends_with("/status") => {
                    patches
                        .lock()
                        .unwrap()
                        .push((p.to_owned(), serde_json::from_slice(&body).unwrap()));
                    pod("cart", "shop", json!({}))
                }
                (m, p) => panic!("unexpected request {m} {p}"),
            };
            mockapi::reply(send, 200, &reply);
        }
    });
    kube::Client::new(svc, "default")
}

/// Waits for a Warning Event with `reason` on the pod `name` whose note
/// holds each of `notes`.
pub(crate) async fn warning(
    events: &Events,
    reason: &str,
    name: &str,
    notes: &[&str],
) -> TestResult {
    event(events, "Warning", reason, name, notes).await
}

/// Waits for an Event of `type_` with `reason` on the pod `name` whose note
/// holds each of `notes`.
pub(crate) async fn event(
    events: &Events,
    type_: &str,
    reason: &str,
    name: &str,
    notes: &[&str],
) -> TestResult {
    let what = format!("a {type_} {reason} event on {name}");
    wait::until_async(&what, wait::DEADLINE, || {
        let seen = events.lock().unwrap().clone();
        let found = seen.iter().any(|e| {
            e["reason"] == reason
                && e["type"] == type_
                && e["regarding"]["name"] == name
                && e["note"]
                    .as_str()
                    .is_some_and(|n| notes.iter().all(|want| n.contains(want)))
        });
        if found {
            Ok(())
        } else {
            Err(seen)
        }
    })
    .await?;
    Ok(())
}

/// Another tool's `ingress` qdisc on the pod's host-side veth (the
/// bandwidth plugin's egress limit): the pod is captured without the
/// host-side program, and a Warning on the pod names the veth and says that
/// the node's own connections to it (kubelet's probes) go through ztunnel.
fn host_hook_event() -> TestResult {
    let f = Fixture::new("kubehq", None)?;
    let added = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &f.topo.client,
            "tc",
            "qdisc",
            "add",
            "dev",
            "veth-c",
            "ingress",
        ])
        .status()?;
    ensure!(added.success(), "adding the ingress qdisc");
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let events: Events = Arc::default();
        let client = api(Arc::default(), Arc::default(), events.clone());
        let mut dp = f.dataplane()?;
        dp.set_node(sluice::podnet::hostside::Node::open(
            &sluice_tests::ns::netns_path(&f.topo.client),
        )?)?;
        let (node, _announcing) = cluster_node_over(dp, client, None, Default::default(), None)?;
        let r = add_cart(&node, &f).await;
        ensure!(
            matches!(&r, control::Response::Enrolled { uid, .. } if uid == "u-cart"),
            "{r:?}"
        );
        warning(&events, "HostProbesCaptured", "cart", &["veth-c (ingress)"]).await?;
        Ok(())
    })
}

/// A pod enrolled earlier put shop/cart's address on its own interface;
/// cart's CNI ADD names that address (prevResult): it is cart's, and the
/// claimer gets a Warning naming the address and cart.
fn claim_evicted_event() -> TestResult {
    let claimer = Fixture::new("kubeev", None)?;
    let cart = Fixture::in_subnet("kubeevc", None, 1)?;
    let cart_ip = cart.topo.pod_ip(sluice_tests::topology::Family::V4);
    claimer.enroll()?;
    let ip = |args: &[&str]| sluice_tests::topology::ip(args);
    ip(&[
        "-n",
        &claimer.topo.pod,
        "addr",
        "add",
        &format!("{cart_ip}/32"),
        "dev",
        "eth0",
    ])?;
    let claimer_cookie = claimer.pod_record()?.netns_cookie;
    {
        let mut dp = claimer.dataplane()?;
        let ns = sluice::podnet::netns::Netns::open(&claimer.topo.pod_netns_path())?;
        sluice::podnet::enroll::refresh_addrs(dp.maps_mut(), &ns, claimer_cookie)?;
    }
    ensure!(claimer.pod_record()?.addresses.contains(&cart_ip));
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let events: Events = Arc::default();
        let client = api(Arc::default(), Arc::default(), events.clone());
        let (node, _announcing) = cluster_node(&claimer, client, None)?;
        let r = node
            .requests()
            .handle(control::Request::CniAdd(control::CniAdd {
                container_id: "c1".into(),
                netns: cart.topo.pod_netns_path(),
                pod: PodRef {
                    name: "cart".into(),
                    namespace: "shop".into(),
                    uid: Some("u-cart".into()),
                },
                ips: vec![cart_ip.to_string()],
            }))
            .await;
        ensure!(
            matches!(&r, control::Response::Enrolled { uid, .. } if uid == "u-cart"),
            "{r:?}"
        );
        let pods = sluice::status::read(&claimer.topo.pins)?;
        let cart_record = pods.iter().find(|p| p.uid == "u-cart").context("cart")?;
        ensure!(cart_record.addresses == [cart_ip], "{cart_record:?}");
        ensure!(!claimer.pod_record()?.addresses.contains(&cart_ip));
        let claimer_name = claimer.uid.as_str();
        let cart_ip = cart_ip.to_string();
        warning(
            &events,
            "AddressClaimEvicted",
            claimer_name,
            &[&cart_ip, "shop/cart"],
        )
        .await?;
        Ok(())
    })
}

/// Another tool's `ingress` qdisc takes the enrolled shop/cart's `eth0`
/// hook (sluice's filters go with the clsact it replaces): the agent's
/// repair cannot attach them again, so a Warning says what the pod lacks
/// and its readiness gate turns False with reason `CaptureIncomplete`. With
/// the hook free again, the repair completes the capture and the gate says
/// the pod's state again.
fn incomplete_gate() -> TestResult {
    let f = Fixture::new("kubeic", None)?;
    let tc =
        |args: &[&str]| sluice_tests::ns::exec(&f.topo.pod, &[&["tc", "qdisc"], args].concat());
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let events: Events = Arc::default();
        let patches: Arc<Mutex<Vec<(String, Value)>>> = Arc::default();
        let client = api(Arc::default(), patches.clone(), events.clone());
        let (node, _announcing) = cluster_node(&f, client, None)?;
        let r = add_cart(&node, &f).await;
        ensure!(
            matches!(&r, control::Response::Enrolled { uid, .. } if uid == "u-cart"),
            "{r:?}"
        );
        let verify = || {
            let n = node.clone();
            tokio::task::spawn_blocking(move || n.repair().verify_all(false))
        };
        // "STATUS/REASON" of the gate in the last status patch of shop/cart.
        let gate_reason = || {
            patches
                .lock()
                .unwrap()
                .iter()
                .rev()
                .find_map(|(path, body)| {
                    let c = body["status"]["conditions"]
                        .as_array()?
                        .iter()
                        .find(|c| c["type"] == "sluice.dev/redirected")?;
                    let (status, reason) = (c["status"].as_str()?, c["reason"].as_str()?);
                    path.ends_with("/pods/cart/status")
                        .then(|| format!("{status}/{reason}"))
                })
        };
        let gate_is = |want: &'static str| {
            let gate_reason = &gate_reason;
            wait::until_async(want, wait::DEADLINE, move || {
                let last = gate_reason();
                (last.as_deref() == Some(want)).then_some(()).ok_or(last)
            })
        };
        tc(&["del", "dev", "eth0", "clsact"])?;
        tc(&["add", "dev", "eth0", "ingress"])?;
        verify().await?;
        wait::until_async(
            "a CaptureIncomplete warning on shop/cart",
            wait::DEADLINE,
            || {
                let seen = events.lock().unwrap().clone();
                seen.iter()
                    .any(|e| {
                        e["reason"] == "CaptureIncomplete"
                            && e["type"] == "Warning"
                            && e["regarding"]["name"] == "cart"
                            && e["note"]
                                .as_str()
                                .is_some_and(|n| n.contains("egress_eth0, ingress_eth0"))
                    })
                    .then_some(())
                    .ok_or(seen)
            },
        )
        .await?;
        gate_is("False/CaptureIncomplete").await?;
        // A second repair that finds the same: no second warning.
        verify().await?;
        let warnings = events
            .lock()
            .unwrap()
            .iter()
            .filter(|e| e["reason"] == "CaptureIncomplete")
            .count();
        ensure!(
            warnings == 1,
            "{warnings} CaptureIncomplete events for one finding"
        );

        tc(&["del", "dev", "eth0", "ingress"])?;
        verify().await?;
        // Back to the pod's state: Pending (no ztunnel here).
        gate_is("False/Pending").await?;
        ensure!(
            events
                .lock()
                .unwrap()
                .iter()
                .any(|e| e["reason"] == "CaptureRepaired"),
            "no CaptureRepaired event"
        );
        Ok(())
    })
}

/// The CNI ADD of the mock API's shop/cart pod, in `f`'s pod netns.
async fn add_cart(node: &Arc<NodeAgent>, f: &Fixture) -> control::Response {
    let cart = PodRef {
        name: "cart".into(),
        namespace: "shop".into(),
        uid: Some("u-cart".into()),
    };
    node.requests()
        .handle(control::Request::CniAdd(control::CniAdd {
            container_id: "c1".into(),
            netns: f.topo.pod_netns_path(),
            pod: cart,
            ips: vec![],
        }))
        .await
}

fn admitted() -> TestResult {
    let f = Fixture::new("kube", None)?;
    // istio-cni had captured the pod: sluice takes it over (and says so).
    sluice_tests::istio::apply(&f.topo.pod)?;
    let records = std::env::temp_dir().join(format!("sluice-cni-records-{}", std::process::id()));
    let result = admitted_with(&f, &records);
    let _ = std::fs::remove_dir_all(&records);
    result
}

fn admitted_with(f: &Fixture, records: &std::path::Path) -> TestResult {
    let records = records.to_owned();
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let deleting = Arc::new(Mutex::new(false));
        let patches = Arc::new(Mutex::new(Vec::new()));
        let events: Events = Arc::default();
        let client = api(deleting.clone(), patches.clone(), events.clone());
        let (node, _announcing) = cluster_node(f, client, Some(records.clone()))?;
        let cart = PodRef { name: "cart".into(), namespace: "shop".into(), uid: Some("u-cart".into()) };
        let netns = f.topo.pod_netns_path();

        // Ambient namespace: enrolled (Pending: no ztunnel), with the pod's
        // real uid and service account, annotated `pending`, and its
        // readiness gate False.
        let r = node.requests()
            .handle(control::Request::CniAdd(control::CniAdd { container_id: "c1".into(), netns: netns.clone(), pod: cart.clone(), ips: vec![] }))
            .await;
        ensure!(matches!(&r, control::Response::Enrolled { uid, state: Some(sluice_common::PodState::Pending), .. } if uid == "u-cart"), "{r:?}");
        let pods = sluice::status::read(&f.topo.pins)?;
        let rec = pods.first().ok_or_else(|| anyhow::anyhow!("no pod enrolled"))?;
        ensure!(rec.workload.as_ref().is_some_and(|w| w.service_account == "cart-sa"), "{rec:?}");
        // Its annotation reached the programs.
        ensure!(rec.bypass_inbound, "bypass-inbound-capture not applied: {rec:?}");
        ensure!(
            rec.dns.mode == sluice::dataplane::state::DnsMode::Off && rec.dns.choice == sluice::options::DnsChoice::Off,
            "dns-capture: \"false\" not applied: {rec:?}"
        );
        // No ztunnel is connected: a Warning on the pod says so; and the
        // take-over from istio-cni is recorded.
        wait::until_async("ZtunnelNotConnected and TookOverFromIstioCni events on shop/cart", wait::DEADLINE, || {
            let seen = events.lock().unwrap().clone();
            let has = |reason: &str, kind: &str| {
                seen.iter().any(|e| {
                    e["reason"] == reason
                        && e["type"] == kind
                        && e["regarding"]["name"] == "cart"
                        && e["regarding"]["uid"] == "u-cart"
                        && e["reportingController"] == sluice::kube::events::CONTROLLER
                })
            };
            if has("ZtunnelNotConnected", "Warning") && has("TookOverFromIstioCni", "Normal") {
                Ok(())
            } else {
                Err(seen)
            }
        })
        .await?;
        wait_patch(&patches, 2).await?;
        ensure!(
            patches.lock().unwrap()[0] == ("/api/v1/namespaces/shop/pods/cart/status".into(), json!({"metadata": {"uid": "u-cart", "annotations": {"ambient.istio.io/redirection": "pending"}}})),
            "{:?}",
            patches.lock().unwrap()
        );
        let gate = |i: usize| patches.lock().unwrap()[i].1["status"]["conditions"][0].clone();
        ensure!(
            gate(1)["type"] == "sluice.dev/redirected" && gate(1)["status"] == "False" && gate(1)["reason"] == "Pending",
            "{:?}",
            patches.lock().unwrap()
        );

        // Not ambient: passed through, nothing enrolled.
        let plain = PodRef { name: "plain".into(), namespace: "other".into(), uid: Some("u-plain".into()) };
        let r = node.requests()
            .handle(control::Request::CniAdd(control::CniAdd { container_id: "c2".into(), netns: netns.clone(), pod: plain.clone(), ips: vec![] }))
            .await;
        ensure!(matches!(&r, control::Response::Skipped { reason } if reason.contains("neither the pod nor its namespace")), "{r:?}");
        // Its netns is remembered, for when it becomes ambient later.
        let recorded = std::fs::read_to_string(records.join("u-plain"))?;
        ensure!(recorded == netns.to_str().unwrap(), "recorded {recorded:?}");

        // CHECK: the captured pod passes; a pod sluice does not manage passes.
        let check = |pod: &PodRef| control::Request::CniCheck(control::CniCheck { pod: pod.clone() });
        let r = node.requests().handle(check(&cart)).await;
        ensure!(matches!(&r, control::Response::Enrolled { .. }), "{r:?}");
        let r = node.requests().handle(check(&plain)).await;
        ensure!(matches!(&r, control::Response::Skipped { .. }), "{r:?}");
        // A link lost behind the agent's back: CHECK names it.
        let cookie = sluice::status::read(&f.topo.pins)?[0].netns_cookie;
        std::fs::remove_file(f.topo.pins.pod(cookie).join("lo"))?;
        let r = node.requests().handle(check(&cart)).await;
        ensure!(matches!(&r, control::Response::Error { message } if message.contains("capture incomplete, missing links lo")), "{r:?}");
        let n = node.clone();
        tokio::task::spawn_blocking(move || n.repair().verify_all(false)).await?;
        let r = node.requests().handle(check(&cart)).await;
        ensure!(matches!(&r, control::Response::Enrolled { .. }), "repaired: {r:?}");

        // A forged DEL for the running pod (another container id, its
        // sandbox alive) is refused.
        let forged = control::Request::CniDel(control::CniDel { container_id: "forged".into(), netns: netns.clone(), pod: cart.clone() });
        let r = node.requests().handle(forged).await;
        ensure!(matches!(&r, control::Response::Refused { message } if message.contains("refusing DEL") && message.contains("container c1")), "{r:?}");
        ensure!(sluice::status::read(&f.topo.pins)?.len() == 1, "forged DEL removed capture");
        let del = control::Request::CniDel(control::CniDel { container_id: "c1".into(), netns: netns.clone(), pod: cart.clone() });

        // The runtime's own DEL (the pod is being deleted): it goes through
        // and the annotation goes.
        *deleting.lock().unwrap() = true;
        let r = node.requests().handle(del).await;
        ensure!(matches!(&r, control::Response::Unenrolled { .. }), "{r:?}");
        ensure!(sluice::status::read(&f.topo.pins)?.is_empty());
        wait_patch(&patches, 4).await?;
        ensure!(patches.lock().unwrap()[2].1 == json!({"metadata": {"uid": "u-cart", "annotations": {"ambient.istio.io/redirection": null}}}));
        ensure!(gate(3)["status"] == "False" && gate(3)["reason"] == "NotEnrolled", "{:?}", patches.lock().unwrap());
        Ok(())
    })
}

async fn wait_patch(patches: &Arc<Mutex<Vec<(String, Value)>>>, n: usize) -> TestResult {
    wait::until_async(&format!("{n} status patches"), wait::DEADLINE, || {
        let p = patches.lock().unwrap().clone();
        if p.len() >= n {
            Ok(())
        } else {
            Err(p)
        }
    })
    .await
}

/// The cgroup v2 mount (hybrid hosts have it at /sys/fs/cgroup/unified).
fn cgroup2_mount() -> Option<std::path::PathBuf> {
    std::fs::read_to_string("/proc/mounts")
        .ok()?
        .lines()
        .find(|l| l.split_whitespace().nth(2) == Some("cgroup2"))
        .and_then(|l| l.split_whitespace().nth(1))
        .map(std::path::PathBuf::from)
}

/// A container process of a pod: `sleep` in the pod's netns and in a cgroup
/// named the way the kubelet names pod cgroups. Removed on drop.
pub(crate) struct PodProcess {
    child: std::process::Child,
    cgroups: [std::path::PathBuf; 2],
}

impl PodProcess {
    pub(crate) fn spawn(netns: &std::path::Path, uid: &str) -> anyhow::Result<Self> {
        use std::os::{fd::AsRawFd, unix::process::CommandExt};
        let ns = std::fs::File::open(netns)?;
        let fd = ns.as_raw_fd();
        let mut cmd = std::process::Command::new("sleep");
        cmd.arg("60");
        // SAFETY: setns is async-signal-safe; the fd outlives spawn.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Self::in_cgroup(cmd, uid, "app")
    }

    /// A process of pod `uid`'s cgroup in a fresh netns of its own (only
    /// `lo`), as `unshare -n` in a privileged container makes.
    fn spawn_unshared(uid: &str) -> anyhow::Result<Self> {
        let mut cmd = std::process::Command::new("unshare");
        cmd.args(["-n", "sleep", "60"]);
        let p = Self::in_cgroup(cmd, uid, "decoy")?;
        // unshare enters its netns before it execs sleep: wait until it has.
        let own = |pid: u32| std::fs::read_link(format!("/proc/{pid}/ns/net")).ok();
        let me = own(std::process::id());
        let pid = p.child.id();
        sluice_tests::wait::until(
            "the decoy in a netns of its own",
            sluice_tests::wait::DEADLINE,
            || {
                let now = own(pid);
                (now.is_some() && now != me).then_some(()).ok_or(now)
            },
        )?;
        Ok(p)
    }

    /// Spawns `cmd` and moves it into a cgroup of pod `uid` (one per `tag`).
    fn in_cgroup(mut cmd: std::process::Command, uid: &str, tag: &str) -> anyhow::Result<Self> {
        let root =
            cgroup2_mount().ok_or_else(|| anyhow::anyhow!("no cgroup2 mount on this host"))?;
        let base = root.join(format!("sluice-test-{}-{uid}-{tag}", std::process::id()));
        let pod_cg = base.join(format!("kubepods-pod{}.slice", uid.replace('-', "_")));
        std::fs::create_dir_all(&pod_cg)?;
        let child = cmd.spawn()?;
        let p = Self {
            child,
            cgroups: [pod_cg.clone(), base],
        };
        std::fs::write(pod_cg.join("cgroup.procs"), p.child.id().to_string())?;
        Ok(p)
    }
}

impl Drop for PodProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for c in &self.cgroups {
            let _ = std::fs::remove_dir(c);
        }
    }
}

fn existing_pod_netns_found_by_cgroup() -> TestResult {
    let f = Fixture::new("podns", None)?;
    let uid = format!(
        "7e57{:04x}-0000-4000-8000-000000000001",
        std::process::id() & 0xffff
    );
    let ips = [f.topo.pod_ip(Family::V4), f.topo.pod_ip(Family::V6)];
    // A process of the pod's cgroup in a netns of its own (a privileged
    // container after `unshare -n`), started first so that /proc lists it
    // first: not the pod's, though it is in the pod's cgroup.
    let _decoy = PodProcess::spawn_unshared(&uid)?;
    let _p = PodProcess::spawn(&f.topo.pod_netns_path(), &uid)?;
    let found = sluice::podnet::podns::find(&uid, &ips);
    ensure!(
        found.as_deref() == Some(f.topo.pod_netns_path().as_path()),
        "found {found:?}"
    );
    // The pod's IPs decide: a netns without them is never the pod's.
    let elsewhere = ["10.255.255.1".parse()?];
    let found = sluice::podnet::podns::find(&uid, &elsewhere);
    ensure!(found.is_none(), "found {found:?} for IPs no netns holds");
    ensure!(
        sluice::podnet::podns::find(&uid, &[]).is_none(),
        "found a netns for a pod without IPs"
    );
    ensure!(sluice::podnet::podns::find("00000000-0000-4000-8000-00000000dead", &ips).is_none());
    Ok(())
}

/// The runtime's netns path recorded for an ambient pod (at an ADD it was
/// not captured at) now names a netns without the pod's addresses (a
/// `/proc/<pid>/ns/net` path whose pid another pod's process has taken):
/// the relist must not capture that netns as the pod (another pod's
/// traffic under its identity). Only the pod's own netns, found by its
/// addresses, is.
fn stale_record() -> TestResult {
    let f = Fixture::new("strec", None)?;
    let other = Fixture::in_subnet("strecb", None, 1)?;
    let records = std::env::temp_dir().join(format!("sluice-strec-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&records);
    let uid = "u-strec";
    let rt = tokio::runtime::Runtime::new()?;
    let result = rt.block_on(async {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let ips = pod_ips_json(&f);
        tokio::spawn(async move {
            while let Some((req, send)) = handle.next_request().await {
                let path = req.uri().path().to_owned();
                let reply = match path.as_str() {
                    "/api/v1/pods" => json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": [{
                        "metadata": {"name": "web", "namespace": "mesh", "uid": uid},
                        "spec": {"nodeName": "node-a", "serviceAccountName": "web-sa", "containers": [{"name": "app"}]},
                        "status": {"phase": "Running", "podIPs": ips}}]}),
                    "/api/v1/namespaces" => json!({"apiVersion": "v1", "kind": "NamespaceList", "metadata": {}, "items": [
                        {"metadata": {"name": "mesh", "labels": {"istio.io/dataplane-mode": "ambient"}}}]}),
                    p if p.starts_with("/apis/events.k8s.io/") => json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e"}}),
                    // The captured pod's annotation and gate check.
                    p if p.starts_with("/api/v1/namespaces/mesh/pods/web") => json!({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": "web", "namespace": "mesh", "uid": uid}, "spec": {"containers": [{"name": "app"}]}}),
                    p => panic!("unexpected request {p}"),
                };
                mockapi::reply(send, 200, &reply);
            }
        });
        let (node, _announcing) =
            cluster_node(&f, kube::Client::new(svc, "default"), Some(records.clone()))?;
        // As the agent records it (`KubeCtx::record_netns`): the path, in a
        // file named after the uid.
        std::fs::create_dir_all(&records)?;
        std::fs::write(records.join(uid), other.topo.pod_netns_path().to_str().context("path")?)?;
        node.relist().reconcile_once(std::time::Duration::ZERO).await?;
        let pods = sluice::status::read(&f.topo.pins)?;
        ensure!(
            pods.is_empty(),
            "a netns without the pod's addresses was captured as it: {pods:?}"
        );
        // The pod's own netns, recorded, is.
        std::fs::write(records.join(uid), f.topo.pod_netns_path().to_str().context("path")?)?;
        node.relist().reconcile_once(std::time::Duration::ZERO).await?;
        let pods = sluice::status::read(&f.topo.pins)?;
        ensure!(
            pods.len() == 1 && pods[0].uid == uid && pods[0].netns == f.topo.pod_netns_path().to_str().unwrap_or(""),
            "the pod's own recorded netns was not captured: {pods:?}"
        );
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&records);
    result
}

/// A fixture pod's `status.podIPs`, as the API lists them.
pub(crate) fn pod_ips_json(f: &Fixture) -> Value {
    json!([{"ip": f.topo.pod_ip(Family::V4).to_string()}, {"ip": f.topo.pod_ip(Family::V6).to_string()}])
}

fn relist() -> TestResult {
    let f = Fixture::new("relist", None)?;
    let stale = Fixture::in_subnet("stale", None, 1)?;
    let uid = format!(
        "7e57{:04x}-0000-4000-8000-000000000002",
        std::process::id() & 0xffff
    );
    let _p = PodProcess::spawn(&f.topo.pod_netns_path(), &uid)?;
    // A pod captured earlier that the API no longer has.
    {
        let mut dp = f.dataplane()?;
        let w = sluice::workload::Workload::new("stale", "mesh", "default")?;
        sluice::podnet::enroll::attach_pod(
            &mut dp,
            &stale.topo.pod_netns_path(),
            &sluice::uid::PodUid::new("stale-uid")?,
            &w,
            &Default::default(),
            &sluice::podnet::enroll::PodAddrs::Netns,
            sluice::podnet::enroll::AppStarted::Maybe,
        )?;
    }
    // The agent's selection snapshot: removed after the runtime, whose
    // tasks may write it again until they stop (declared first, dropped
    // last).
    struct RemoveOnDrop(std::path::PathBuf);
    impl Drop for RemoveOnDrop {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let dir =
        RemoveOnDrop(std::env::temp_dir().join(format!("sluice-relist-{}", std::process::id())));
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let patches = Arc::new(Mutex::new(Vec::new()));
        let events: Events = Arc::default();
        let (p2, u2, e2) = (patches.clone(), uid.clone(), events.clone());
        let ips2 = pod_ips_json(&f);
        tokio::spawn(async move {
            while let Some((req, send)) = handle.next_request().await {
                let (method, path, query) = (req.method().clone(), req.uri().path().to_owned(), req.uri().query().unwrap_or("").to_owned());
                let body = req.into_body().collect_bytes().await.unwrap_or_default();
                let Some(send) = mockapi::event("/apis/events.k8s.io/v1/namespaces/mesh/events", &path, &body, &e2, send) else {
                    continue;
                };
                let reply = match (method, path.as_str()) {
                    (Method::GET, "/api/v1/pods") => {
                        assert!(query.contains("fieldSelector=spec.nodeName%3Dnode-a"), "{query}");
                        json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": [{
                            "metadata": {"name": "web", "namespace": "mesh", "uid": u2},
                            "spec": {"nodeName": "node-a", "serviceAccountName": "web-sa", "containers": [{"name": "app"}]},
                            "status": {"phase": "Running", "podIPs": ips2}}, {
                            // Labelled ambient, but its namespace is excluded: never captured.
                            "metadata": {"name": "dns", "namespace": "kube-system", "uid": "u-dns", "labels": {"istio.io/dataplane-mode": "ambient"}},
                            "spec": {"nodeName": "node-a", "containers": [{"name": "app"}]},
                            "status": {"phase": "Running"}}]})
                    }
                    (Method::GET, "/api/v1/namespaces") => json!({"apiVersion": "v1", "kind": "NamespaceList", "metadata": {}, "items": [
                        {"metadata": {"name": "mesh", "labels": {"istio.io/dataplane-mode": "ambient"}}},
                        {"metadata": {"name": "kube-system", "labels": {"istio.io/dataplane-mode": "ambient"}}},
                        {"metadata": {"name": "plain"}}]}),
                    (Method::PATCH, p) if p.ends_with("/status") => {
                        p2.lock().unwrap().push((p.to_owned(), serde_json::from_slice::<Value>(&body).unwrap()));
                        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}})
                    }
                    // The readiness-gate check reads the pod (it has no gate).
                    (Method::GET, "/api/v1/namespaces/mesh/pods/web") => json!({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": "web", "namespace": "mesh"}, "spec": {"containers": [{"name": "app"}]}}),
                    // The released pod is gone from the API.
                    (Method::GET, "/api/v1/namespaces/mesh/pods/stale") => {
                        let gone = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404});
                        mockapi::reply(send, 404, &gone);
                        continue;
                    }
                    (m, p) => panic!("unexpected request {m} {p}"),
                };
                mockapi::reply(send, 200, &reply);
            }
        });
        let selection = dir.0.join(sluice::cni::snapshot::FILE_NAME);
        let (node, _announcing) = cluster_node_with(
            &f,
            kube::Client::new(svc, "default"),
            None,
            Default::default(),
            Some(selection.clone()),
        )?;
        node.relist().reconcile_once(std::time::Duration::ZERO).await?;
        let pods = sluice::status::read(&f.topo.pins)?;
        ensure!(pods.len() == 1 && pods[0].uid == uid, "{pods:?}");
        // The CNI plugin's view for when the agent is down: ambient
        // namespaces, the excluded one left out.
        let snap = sluice::cni::snapshot::read(&selection)?;
        ensure!(
            snap.ambient_namespaces == ["mesh".to_string()].into(),
            "{snap:?}"
        );
        // Captured by the reconcile, not at a CNI ADD: counted.
        let text = node.report().metrics.render();
        ensure!(
            text.lines().any(|l| l == "sluice_captured_after_start_total 1"),
            "{text}"
        );
        ensure!(pods[0].netns == f.topo.pod_netns_path().to_str().unwrap());
        ensure!(pods[0].workload.as_ref().is_some_and(|w| w.service_account == "web-sa"));
        // The captured pod's status is patched (other patches, such as the
        // released pod's, may come first).
        wait::until_async("web's status patched", wait::DEADLINE, || {
            let p = patches.lock().unwrap().clone();
            if p.iter().any(|(path, _)| path == "/api/v1/namespaces/mesh/pods/web/status") {
                Ok(())
            } else {
                Err(p)
            }
        })
        .await?;
        // Events: the stale pod's capture was released, and web was
        // captured with no ztunnel to hand it to.
        wait::until_async("the release and no-ztunnel events", wait::DEADLINE, || {
            let seen = events.lock().unwrap().clone();
            let has = |reason: &str, name: &str| {
                seen.iter().any(|e| e["reason"] == reason && e["regarding"]["name"] == name)
            };
            if has("CaptureReleased", "stale") && has("ZtunnelNotConnected", "web") {
                Ok(())
            } else {
                Err(seen)
            }
        })
        .await?;
        // The pod left out says why, for `status --pod`.
        let control::Response::More(control::NodeAnswer::Node(n)) = node.requests().handle(control::Request::Status).await else {
            anyhow::bail!("no node status");
        };
        let why = sluice::status::explain::explain("kube-system/dns", &[], Some(&n)).map(|e| e.verdict);
        ensure!(
            why == Some(sluice::status::explain::Verdict::NotCaptured {
                reason: "the pod's namespace is excluded (--exclude-namespaces)".into()
            }),
            "{why:?} from {:?}",
            n.skipped
        );
        // A second pass has nothing to do.
        node.relist().reconcile_once(std::time::Duration::ZERO).await?;
        ensure!(sluice::status::read(&f.topo.pins)?.len() == 1);
        Ok(())
    })
}

/// Custom enablement selectors (istio-cni's `ambient.enablementSelectors`)
/// replace Istio's default: a pod of a namespace they select is captured
/// though nothing is labelled `istio.io/dataplane-mode`; a pod labelled
/// ambient that they do not select is not, and says why; the plugin's
/// snapshot holds the namespaces they select. A captured pod of a namespace
/// that is now excluded is released (istio-cni 1.30).
fn enablement_selectors() -> TestResult {
    let f = Fixture::new("ensel", None)?;
    let legacy = Fixture::in_subnet("enleg", None, 1)?;
    let uid = format!(
        "7e57{:04x}-0000-4000-8000-000000000004",
        std::process::id() & 0xffff
    );
    let _p = PodProcess::spawn(&f.topo.pod_netns_path(), &uid)?;
    // Captured before `legacy` became an excluded namespace.
    let legacy_uid = "u-legacy";
    {
        let mut dp = f.dataplane()?;
        let w = sluice::workload::Workload::new("old", "legacy", "default")?;
        sluice::podnet::enroll::attach_pod(
            &mut dp,
            &legacy.topo.pod_netns_path(),
            &sluice::uid::PodUid::new(legacy_uid)?,
            &w,
            &Default::default(),
            &sluice::podnet::enroll::PodAddrs::Netns,
            sluice::podnet::enroll::AppStarted::Maybe,
        )?;
    }
    ensure!(sluice::status::read(&f.topo.pins)?.len() == 1);
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let (u2, ips2) = (uid.clone(), pod_ips_json(&f));
        let events: Events = Arc::default();
        let e2 = events.clone();
        tokio::spawn(async move {
            while let Some((req, send)) = handle.next_request().await {
                let (method, path) = (req.method().clone(), req.uri().path().to_owned());
                let body = req.into_body().collect_bytes().await.unwrap_or_default();
                let ambient = json!({"istio.io/dataplane-mode": "ambient"});
                let reply = match (method, path.as_str()) {
                    (Method::GET, "/api/v1/pods") => json!({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": [{
                            "metadata": {"name": "web", "namespace": "shop", "uid": u2},
                            "spec": {"nodeName": "node-a", "containers": [{"name": "app"}]},
                            "status": {"phase": "Running", "podIPs": ips2}}, {
                            // Labelled ambient, but the selectors do not say so.
                            "metadata": {"name": "labelled", "namespace": "mesh", "uid": "u-labelled", "labels": ambient},
                            "spec": {"nodeName": "node-a", "containers": [{"name": "app"}]},
                            "status": {"phase": "Running"}}, {
                            "metadata": {"name": "old", "namespace": "legacy", "uid": legacy_uid},
                            "spec": {"nodeName": "node-a", "containers": [{"name": "app"}]},
                            "status": {"phase": "Running"}}]}),
                    (Method::GET, "/api/v1/namespaces") => json!({"apiVersion": "v1", "kind": "NamespaceList", "metadata": {}, "items": [
                        {"metadata": {"name": "shop", "labels": {"team": "shop"}}},
                        {"metadata": {"name": "mesh", "labels": ambient}},
                        {"metadata": {"name": "legacy", "labels": {"team": "shop"}}}]}),
                    (Method::POST | Method::PATCH, p) if p.contains("/events") => {
                        let ev: Value = serde_json::from_slice(&body).unwrap_or_default();
                        e2.lock().unwrap().push(ev.clone());
                        ev
                    }
                    (Method::PATCH, _) => json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}}),
                    (Method::GET, p) if p.starts_with("/api/v1/namespaces/") => {
                        // Single-pod reads (announcing): as listed, without gates.
                        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": {"containers": []}})
                    }
                    (m, p) => panic!("unexpected request {m} {p}"),
                };
                mockapi::reply(send, 200, &reply);
            }
        });
        let dir = std::env::temp_dir().join(format!("sluice-ensel-{}", std::process::id()));
        let snapshot = dir.join(sluice::cni::snapshot::FILE_NAME);
        let selection = sluice::kube::selection::Selection {
            excluded: ["kube-system".to_string(), "legacy".to_string()].into(),
            enablement: r#"[{"namespaceSelector":{"matchLabels":{"team":"shop"}}}]"#.parse().map_err(anyhow::Error::msg)?,
            ..Default::default()
        };
        let (node, _announcing) = cluster_node_selecting(
            f.dataplane()?,
            kube::Client::new(svc, "default"),
            None,
            Default::default(),
            selection,
            Some(snapshot.clone()),
        )?;
        node.relist().reconcile_once(std::time::Duration::ZERO).await?;
        let pods = sluice::status::read(&f.topo.pins)?;
        let snap = sluice::cni::snapshot::read(&snapshot);
        let _ = std::fs::remove_dir_all(&dir);
        ensure!(
            pods.len() == 1 && pods[0].uid == uid,
            "only shop/web is captured (legacy/old released): {pods:?}"
        );
        let snap = snap?;
        ensure!(
            snap.ambient_namespaces == ["shop".to_string()].into(),
            "the plugin's snapshot follows the selectors, excluded namespaces left out: {snap:?}"
        );
        let control::Response::More(control::NodeAnswer::Node(n)) = node.requests().handle(control::Request::Status).await else {
            anyhow::bail!("no node status");
        };
        let why = |pod: &str| sluice::status::explain::explain(pod, &[], Some(&n)).map(|e| e.verdict);
        ensure!(
            why("mesh/labelled") == Some(sluice::status::explain::Verdict::NotCaptured {
                reason: "no enablement selector (--enablement-selectors) matches the pod and its namespace".into()
            }),
            "{:?}",
            n.skipped
        );
        ensure!(
            why("legacy/old") == Some(sluice::status::explain::Verdict::NotCaptured {
                reason: "the pod's namespace is excluded (--exclude-namespaces)".into()
            }),
            "{:?}",
            n.skipped
        );
        Ok(())
    })
}

/// A pod labelled ambient after it started is captured when the pod watch
/// reports it — long before the periodic relist would.
fn watch_triggers_capture() -> TestResult {
    let f = Fixture::new("watch", None)?;
    let uid = format!(
        "7e57{:04x}-0000-4000-8000-000000000003",
        std::process::id() & 0xffff
    );
    let _p = PodProcess::spawn(&f.topo.pod_netns_path(), &uid)?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let labelled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Requests seen: pod LISTs, and whether the pod watch has started.
        let pod_lists = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let pod_watch = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let (l2, u2) = (labelled.clone(), uid.clone());
        let ips2 = pod_ips_json(&f);
        let (lists2, watch2) = (pod_lists.clone(), pod_watch.clone());
        tokio::spawn(async move {
            while let Some((req, send)) = handle.next_request().await {
                let (path, query) = (req.uri().path().to_owned(), req.uri().query().unwrap_or("").to_owned());
                if path == "/api/v1/pods" {
                    if query.contains("watch=true") {
                        watch2.store(true, std::sync::atomic::Ordering::SeqCst);
                    } else {
                        lists2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                }
                let (u3, ips3) = (u2.clone(), ips2.clone());
                let pod = move |ambient: bool| {
                    let labels = if ambient { json!({"istio.io/dataplane-mode": "ambient"}) } else { json!({}) };
                    json!({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": "web", "namespace": "plain", "uid": u3, "labels": labels, "resourceVersion": "2"},
                        "spec": {"nodeName": "node-a", "containers": [{"name": "app"}]}, "status": {"phase": "Running", "podIPs": ips3}})
                };
                let l3 = l2.clone();
                tokio::spawn(async move {
                    let body = if query.contains("watch=true") {
                        // The mock API holds the watch until the label appears,
                        // then reports it (the poll paces the mock, not the test).
                        while !l3.load(std::sync::atomic::Ordering::SeqCst) {
                            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        }
                        if path == "/api/v1/pods" {
                            format!("{}\n", json!({"type": "MODIFIED", "object": pod(true)}))
                        } else {
                            // Namespaces: nothing to report; keep the watch open.
                            std::future::pending::<()>().await;
                            unreachable!()
                        }
                    } else if path == "/api/v1/pods" {
                        let ambient = l3.load(std::sync::atomic::Ordering::SeqCst);
                        json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": [pod(ambient)]}).to_string()
                    } else if path == "/api/v1/namespaces" {
                        json!({"apiVersion": "v1", "kind": "NamespaceList", "metadata": {"resourceVersion": "1"}, "items": [{"metadata": {"name": "plain"}}]}).to_string()
                    } else {
                        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web"}}).to_string()
                    };
                    send.send_response(Response::builder().body(Body::from(body.into_bytes())).unwrap());
                });
            }
        });
        let (node, _announcing) = cluster_node(&f, kube::Client::new(svc, "default"), None)?;
        // A pass while the pod is not ambient: nothing to capture.
        node.relist().reconcile_once(std::time::Duration::ZERO).await?;
        ensure!(sluice::status::read(&f.topo.pins)?.is_empty(), "captured before it was ambient");
        let (_stop_tx, stop) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(node.relist_with_api(stop));
        // The label comes only once the reflector has listed the pod
        // unlabelled (two pod LISTs with ours) and the watch is open: only
        // the watch event can lead to capture now (the next resync is 60 s
        // away).
        wait::until_async("the reflector's LIST and the pod watch", wait::DEADLINE, || {
            let seen = (
                pod_lists.load(std::sync::atomic::Ordering::SeqCst),
                pod_watch.load(std::sync::atomic::Ordering::SeqCst),
            );
            if seen.0 >= 2 && seen.1 { Ok(()) } else { Err(seen) }
        })
        .await?;
        labelled.store(true, std::sync::atomic::Ordering::SeqCst);
        let enrolled = wait::until_async("capture after the watch reported the label", wait::DEADLINE, || {
            match sluice::status::read(&f.topo.pins) {
                Ok(p) if p.iter().any(|p| p.uid == uid) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })
        .await;
        // The pass the event woke read the reflector's store: no LIST of
        // the API per event.
        let lists = pod_lists.load(std::sync::atomic::Ordering::SeqCst);
        let enrolled = enrolled.and_then(|()| {
            ensure!(lists == 2, "{lists} pod LISTs: the loop listed the API again");
            Ok(())
        });
        task.abort();
        enrolled
    })
}

/// The gate follows ztunnel's view: False (NotServed) while the ztunnel that
/// acked the pod has no workload for it, True (Served) once it has, False
/// again when the workload is removed; the annotation says `enabled` all along.
fn gate_follows_served() -> TestResult {
    let f = Fixture::new("gs", None)?;
    let dir = std::env::temp_dir().join(format!("sluice-gate-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = gate_follows_served_in(&f, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn gate_follows_served_in(f: &Fixture, dir: &std::path::Path) -> TestResult {
    use sluice::zds::server;
    let zds = dir.join("ztunnel.sock");
    let workloads = dir.join("workloads.json");
    let cart_workload = admin::workload(
        "shop",
        "cart",
        "cart-sa",
        &[f.topo.pod_ip(Family::V4), f.topo.pod_ip(Family::V6)],
    );
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let patches = Arc::new(Mutex::new(Vec::new()));
        let client = api(Arc::new(Mutex::new(false)), patches.clone(), Arc::default());
        let served = ServedConfig {
            recheck: std::time::Duration::from_millis(200),
            ..Default::default()
        };
        let (node, _announcing) = cluster_node_with(f, client, None, served, None)?;
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        let hub = node.hub();
        let serving = tokio::spawn(server::serve(
            server::bind(&zds)?,
            zds.clone(),
            hub,
            node.zds_handler(),
            stop.clone(),
        ));
        let checking = tokio::spawn(node.check_served(stop.clone()));
        // Served turns the gate True once the capture passed a verification.
        let verifying = tokio::spawn(node.verify_queued(stop.clone()));
        // A ztunnel whose xDS does not have the pod yet.
        std::fs::write(&workloads, "[]")?;
        let mut peer = PeerProc::start(
            std::path::Path::new(PEER),
            &zds,
            &["--admin-workloads", workloads.to_str().unwrap()],
        )?;
        let r = add_cart(&node, f).await;
        ensure!(matches!(&r, control::Response::Enrolled { .. }), "{r:?}");
        let last_gate = |reason: &'static str| {
            let patches = patches.clone();
            move || {
                let p = patches.lock().unwrap().clone();
                let gate = p
                    .iter()
                    .rev()
                    .find_map(|(_, b)| b["status"]["conditions"].get(0).cloned());
                match gate {
                    Some(g) if g["reason"] == reason => Ok(g),
                    other => Err(other),
                }
            }
        };
        let g = wait::until_async(
            "the gate False: NotServed",
            wait::DEADLINE,
            last_gate("NotServed"),
        )
        .await?;
        ensure!(g["status"] == "False", "{g}");
        let cart_record = || -> anyhow::Result<sluice::dataplane::state::PodRecord> {
            let pods = sluice::status::read(&f.topo.pins)?;
            pods.into_iter()
                .find(|p| p.uid == "u-cart")
                .ok_or_else(|| anyhow::anyhow!("u-cart not enrolled"))
        };
        ensure!(cart_record()?.state == Some(sluice_common::PodState::Enabled));
        // istiod pushes the workload: served.
        std::fs::write(&workloads, serde_json::to_vec(&[&cart_workload])?)?;
        let g =
            wait::until_async("the gate True: Served", wait::DEADLINE, last_gate("Served")).await?;
        ensure!(g["status"] == "True", "{g}");
        ensure!(cart_record()?.served);
        // The workload is removed from xDS: not served any more.
        std::fs::write(&workloads, "[]")?;
        // Noticed at the next recheck: 200 ms as configured, unless the
        // reads would take more than 0.1 % of a core at that rate (a read
        // counted as two cores busy) and the agent waits longer: on a
        // loaded machine a 10 ms read makes that 20 s, hence the longer
        // deadline.
        let g = wait::until_async(
            "the gate False again",
            wait::DEADLINE * 3,
            last_gate("NotServed"),
        )
        .await?;
        ensure!(g["status"] == "False", "{g}");
        ensure!(cart_record()?.state == Some(sluice_common::PodState::Enabled));
        // The annotation istiod reads said `enabled` once the pod was captured
        // and acked, and never went back to `pending`.
        let redirections = || -> Vec<Value> {
            patches
                .lock()
                .unwrap()
                .iter()
                .filter_map(|(_, b)| {
                    b["metadata"]["annotations"]
                        .get("ambient.istio.io/redirection")
                        .cloned()
                })
                .collect()
        };
        let annotations = redirections();
        ensure!(
            annotations.last() == Some(&json!("enabled")),
            "{annotations:?}"
        );
        // ztunnel goes (a crash, a restart): its listeners go, the pod is
        // Pending, failing closed, and its gate False; its annotation stays
        // `enabled`, as istio-cni leaves it, so that istiod keeps sending it
        // HBONE for the next ztunnel. (It went `pending`, and istiod pushed
        // every pod of the node twice.)
        let supervising = tokio::spawn(node.supervise(stop.clone()));
        peer.kill();
        wait::until_async(
            "the gate False: Pending",
            wait::DEADLINE,
            last_gate("Pending"),
        )
        .await?;
        ensure!(cart_record()?.state == Some(sluice_common::PodState::Pending));
        let annotations = redirections();
        let first = annotations.iter().position(|a| *a == json!("enabled"));
        ensure!(
            first.is_some_and(|i| annotations[i..].iter().all(|a| *a == json!("enabled"))),
            "{annotations:?}"
        );
        stop_tx.send(true)?;
        let _ = checking.await;
        let _ = verifying.await;
        let _ = serving.await;
        let _ = supervising.await;
        Ok(())
    })
}

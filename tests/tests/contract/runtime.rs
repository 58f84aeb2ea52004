//! The CNI chain under a real container runtime: Debian's containerd with
//! its CRI plugin and runc (`sluice_tests::containerd`), driven through the
//! CRI API as kubelet drives it, with the reference `ptp` plugin as the
//! primary CNI and `sluice-cni` chained after it by the agent itself
//! (`--install-cni`). The runtime passes the real `K8S_POD_*` args and
//! calls DEL on StopPodSandbox; nothing here hand-makes a CNI environment.

use std::{net::SocketAddr, path::Path};

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use serde_json::json;
use sluice::dataplane::loader::Pins;
use sluice_common::PodState;
use sluice_tests::{
    agent::{AgentProc, PeerProc},
    app::App,
    containerd::{self, Containerd},
    flow::{connect, Opts},
    topology::ip,
    wait,
};

use crate::{trial, TestResult};

const PEER: &str = env!("CARGO_BIN_EXE_sluice-zds-peer");

pub fn trials() -> Vec<Trial> {
    let why = containerd::unavailable();
    if let Some(why) = &why {
        eprintln!("skipping runtime::: {why}");
    }
    vec![trial(
        "runtime::containerd_pods_are_captured_through_the_chain_and_wait_only_when_ambient",
        containerd_pods,
    )
    .with_ignored_flag(why.is_some())]
}

/// The node: its netns (where containerd and the CNI plugins run), the
/// dataplane's pins, and a client elsewhere whose connections the node
/// routes to its pods; removed on drop, after the runtime is gone.
struct Node {
    netns: String,
    pins: Pins,
    remote: String,
}

/// The remote client's address, and the node's on its link.
const REMOTE_IP: &str = "10.252.0.2";
const NODE_IP: &str = "10.252.0.1";

impl Node {
    fn new() -> anyhow::Result<Self> {
        let id = std::process::id();
        let n = Self {
            netns: format!("slrn-{id}"),
            pins: Pins::new(format!("/sys/fs/bpf/sluice-test-runtime-{id}")),
            remote: format!("slrr-{id}"),
        };
        ip(&["netns", "add", &n.netns])?;
        // From here on, Drop removes what was made.
        ip(&["netns", "add", &n.remote])?;
        n.wire()?;
        Ok(n)
    }

    /// A node's own sockets are not captured (kubelet's probes), so the
    /// inbound rows use a client the node forwards for, as a peer node's
    /// pod would be.
    fn wire(&self) -> anyhow::Result<()> {
        let (node, remote) = (self.netns.as_str(), self.remote.as_str());
        ip(&["-n", node, "link", "set", "lo", "up"])?;
        ip(&["-n", remote, "link", "set", "lo", "up"])?;
        ip(&[
            "link", "add", "eth0", "netns", remote, "type", "veth", "peer", "name", "veth-rr",
            "netns", node,
        ])?;
        ip(&[
            "-n",
            node,
            "addr",
            "add",
            &format!("{NODE_IP}/24"),
            "dev",
            "veth-rr",
        ])?;
        ip(&[
            "-n",
            remote,
            "addr",
            "add",
            &format!("{REMOTE_IP}/24"),
            "dev",
            "eth0",
        ])?;
        ip(&["-n", node, "link", "set", "veth-rr", "up"])?;
        ip(&["-n", remote, "link", "set", "eth0", "up"])?;
        ip(&["-n", remote, "route", "add", "default", "via", NODE_IP])?;
        sluice_tests::ns::exec(node, &["sysctl", "-qw", "net.ipv4.ip_forward=1"])
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = sluice::podnet::enroll::uninstall(&self.pins, None);
        let _ = ip(&["netns", "del", &self.remote]);
        let _ = ip(&["netns", "del", &self.netns]);
    }
}

fn containerd_pods() -> TestResult {
    let node = Node::new()?;
    let mut rt = Containerd::new("rt")?;
    let result = with_runtime(&node, &mut rt);
    // The runtime goes first (its sandboxes' DELs reach the agent if it
    // still runs), then the agent, the peer and the node.
    drop(rt);
    result
}

fn with_runtime(node: &Node, rt: &mut Containerd) -> TestResult {
    // The primary CNI's conflist, as the node had it before sluice.
    let primary = rt.conf_dir.join("10-ptp.conflist");
    let ipam_dir = rt.dir.join("ipam");
    std::fs::write(
        &primary,
        json!({
            "cniVersion": "1.0.0", "name": "k8s-pod-network",
            "plugins": [{
                "type": "ptp", "ipMasq": false,
                "ipam": {
                    "type": "host-local", "subnet": "10.251.0.0/24", "dataDir": ipam_dir,
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            }],
        })
        .to_string(),
    )?;
    let node_netns = sluice_tests::ns::netns_path(&node.netns);
    let flags = [
        "--install-cni",
        "--cni-conf-dir",
        rt.conf_dir.to_str().unwrap(),
        "--cni-bin-dir",
        rt.bin_dir.to_str().unwrap(),
        "--node-netns",
        node_netns.to_str().unwrap(),
    ];
    let mut agent = AgentProc::start_with(&node.pins, &flags)?;
    let peer = PeerProc::start(Path::new(PEER), &agent.zds, &[])?;
    agent.wait_ztunnel(
        peer.pid().context("peer has no pid")?,
        "the agent to report the peer connected",
        |z| z["connected"] == true,
    )?;
    // The agent chains sluice-cni into the primary conflist; containerd
    // reads the conf dir as it is when it starts.
    wait::until("sluice-cni in the conflist", wait::DEADLINE, || {
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&primary).unwrap_or_default())
                .unwrap_or_default();
        let last = v["plugins"].as_array().and_then(|p| p.last().cloned());
        match last {
            Some(p) if p["type"] == "sluice-cni" => Ok(()),
            _ => Err(v),
        }
    })?;
    rt.start(&node.netns)?;

    // An ambient pod: its sandbox comes up captured, under the uid, name and
    // netns the runtime gave the chain.
    let uid = format!("u-cart-{}", std::process::id());
    let cart = rt.run_pod("shop", "cart", &uid).map_err(|e| {
        anyhow::anyhow!("{e:#}\nagent:\n{}\ncontainerd:\n{}", agent.log(), rt.log())
    })?;
    let pods = sluice::status::read(&node.pins)?;
    ensure!(
        pods.len() == 1
            && pods[0].uid == uid
            && pods[0].netns == cart.netns.to_str().unwrap_or_default()
            && matches!(pods[0].state, Some(PodState::Enabled | PodState::Served)),
        "after RunPodSandbox: {pods:?}"
    );
    ensure!(
        peer.events()
            .iter()
            .any(|e| e["event"] == "add" && e["workload"] == "shop/cart/default"),
        "ztunnel was not handed shop/cart: {:?}",
        peer.events()
    );
    // Traffic the node forwards to the pod goes through ztunnel's inbound
    // listener (row I1), through the sandbox the runtime made.
    let app = App::start(cart.netns_name(), 8080);
    let r = connect(
        &node.remote,
        SocketAddr::new(cart.ip, 8080),
        Opts::default(),
    );
    ensure!(
        r.reply().is_some_and(|l| l.starts_with("app:8080")),
        "inbound: {r:?}"
    );
    peer.wait_for("the inbound connection accepted by the peer", |_| {
        peer.accepted_roles(&["inbound"])
    })?;
    drop(app);
    // Stop and remove, as kubelet does: the runtime's DEL releases the
    // capture and leaves no pin.
    rt.remove_pod(&cart.id)?;
    ensure!(
        sluice::status::read(&node.pins)?.is_empty(),
        "still enrolled after StopPodSandbox"
    );
    ensure!(
        std::fs::read_dir(node.pins.pods())?.next().is_none(),
        "pins left after the sandbox was removed"
    );
    ensure!(peer
        .events()
        .iter()
        .any(|e| e["event"] == "del" && e["uid"] == uid));

    // The agent down: what it last knew says "shop" is ambient.
    ensure!(agent.terminate(), "the agent did not exit cleanly");
    sluice::cni::snapshot::write_if_changed(
        &agent.dir.join(sluice::cni::snapshot::FILE_NAME),
        &["shop".to_string()].into(),
    )?;
    // Pods that are not ambient, or of an excluded namespace, start.
    for (ns, name) in [("other", "plain"), ("kube-system", "coredns")] {
        let sb = rt
            .run_pod(ns, name, &format!("u-{name}"))
            .with_context(|| format!("{ns}/{name} did not start with the agent down"))?;
        ensure!(
            sluice::status::read(&node.pins)?.is_empty(),
            "{ns}/{name} captured without an agent"
        );
        rt.remove_pod(&sb.id)?;
    }
    // An ambient pod waits: its sandbox is refused (kubelet retries).
    let uid2 = format!("u-cart2-{}", std::process::id());
    let refused = rt.run_pod("shop", "cart2", &uid2);
    let err = match refused {
        Ok(sb) => anyhow::bail!("an ambient pod started without the agent: {sb:?}"),
        Err(e) => format!("{e:#}"),
    };
    ensure!(
        err.contains("sluice-cni") && err.contains("namespace shop is ambient"),
        "refusal does not say why: {err}"
    );
    ensure!(
        rt.sandboxes()?.is_empty(),
        "the refused sandbox was kept: {:?}",
        rt.sandboxes()
    );
    // With the agent back, the runtime's retry succeeds, captured.
    agent.restart()?;
    let cart2 = rt.run_pod("shop", "cart2", &uid2).map_err(|e| {
        anyhow::anyhow!("{e:#}\nagent:\n{}\ncontainerd:\n{}", agent.log(), rt.log())
    })?;
    let pods = sluice::status::read(&node.pins)?;
    ensure!(
        pods.len() == 1 && pods[0].uid == uid2,
        "not captured after the agent returned: {pods:?}"
    );
    rt.remove_pod(&cart2.id)?;
    ensure!(sluice::status::read(&node.pins)?.is_empty());
    ensure!(
        std::fs::read_dir(node.pins.pods())?.next().is_none(),
        "pins left after the last sandbox was removed"
    );
    Ok(())
}

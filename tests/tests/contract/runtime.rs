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
    containerd::{self, Containerd, Sandbox},
    flow::{connect, Opts},
    sniff::{L4Sniffer, Segment},
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
    [
        trial(
            "runtime::containerd_pods_are_captured_through_the_chain_and_wait_only_when_ambient",
            containerd_pods,
        ),
        trial(
            "runtime::a_reboot_never_starts_an_ambient_pod_uncaptured",
            reboot_owned,
        ),
        trial(
            "runtime::without_the_owned_conflist_a_reboot_shows_the_bypass",
            reboot_in_place,
        ),
    ]
    .into_iter()
    .map(|t| t.with_ignored_flag(why.is_some()))
    .collect()
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
    /// `tag` tells apart the nodes of trials that run at once.
    fn new(tag: &str) -> anyhow::Result<Self> {
        let id = std::process::id();
        let n = Self {
            netns: format!("slrn-{id}-{tag}"),
            pins: Pins::new(format!("/sys/fs/bpf/sluice-test-runtime-{id}-{tag}")),
            remote: format!("slrr-{id}-{tag}"),
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

/// The primary CNI's conflist: the reference `ptp` plugin with host-local
/// addresses from 10.251.0.0/24 (their state in `ipam`), and an `mtu` when
/// given (a primary rewriting its file with another setting).
fn ptp_conflist(ipam: &Path, mtu: Option<u32>) -> String {
    let mut ptp = json!({
        "type": "ptp", "ipMasq": false,
        "ipam": {
            "type": "host-local", "subnet": "10.251.0.0/24", "dataDir": ipam,
            "routes": [{"dst": "0.0.0.0/0"}],
        },
    });
    if let Some(m) = mtu {
        ptp["mtu"] = json!(m);
    }
    json!({"cniVersion": "1.0.0", "name": "k8s-pod-network", "plugins": [ptp]}).to_string()
}

/// The agent on `node`, keeping sluice-cni in `rt`'s CNI dirs (an owned
/// conflist, or in place), with kubelet's probes from the node netns.
fn start_agent(node: &Node, rt: &Containerd, owned: bool) -> anyhow::Result<AgentProc> {
    let node_netns = sluice_tests::ns::netns_path(&node.netns);
    let owned_flag = format!("--owned-cni-config={owned}");
    let flags = [
        "--install-cni",
        owned_flag.as_str(),
        "--cni-conf-dir",
        rt.conf_dir.to_str().context("path")?,
        "--cni-bin-dir",
        rt.bin_dir.to_str().context("path")?,
        "--node-netns",
        node_netns.to_str().context("path")?,
    ];
    AgentProc::start_with(&node.pins, &flags)
}

fn containerd_pods() -> TestResult {
    let node = Node::new("rt")?;
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
    std::fs::write(&primary, ptp_conflist(&rt.dir.join("ipam"), None))?;
    let mut agent = start_agent(node, rt, true)?;
    let peer = PeerProc::start(Path::new(PEER), &agent.zds, &[])?;
    agent.wait_ztunnel(
        peer.pid().context("peer has no pid")?,
        "the agent to report the peer connected",
        |z| z["connected"] == true,
    )?;
    // The agent writes its owned conflist, which sorts first; containerd
    // reads the conf dir as it is when it starts.
    wait::until("sluice-cni in the config in force", wait::DEADLINE, || {
        match sluice_tests::cni::in_force(&rt.conf_dir) {
            Some((p, v)) if p != primary && sluice_tests::cni::ends_with_sluice(&v) => Ok(()),
            other => Err(format!("{other:?}")),
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

/// The app's source port in the reboot rows: outside the ephemeral range
/// the ztunnel peer's onward sockets use, so a SYN from (pod IP, APP_PORT)
/// on the node side is the app's own, sent around ztunnel.
const APP_PORT: u16 = 20001;

/// A node reboot while the primary CNI rewrites its config (istio/istio
/// #55968): with the owned conflist, no ambient pod's app ever sends a SYN
/// around ztunnel.
fn reboot_owned() -> TestResult {
    let bypass = reboot(true)?;
    ensure!(
        bypass.is_empty(),
        "an ambient pod's app sent SYNs around ztunnel: {bypass:?}"
    );
    Ok(())
}

/// The same reboot with sluice-cni in the primary's own file: the rewrite
/// drops it and the ambient pod starts uncaptured. The sniffer must see it,
/// or the row above could not fail.
fn reboot_in_place() -> TestResult {
    let bypass = reboot(false)?;
    ensure!(
        !bypass.is_empty(),
        "without the owned conflist the sniffer saw no bypass: the reboot row could not fail"
    );
    Ok(())
}

/// Runs the reboot; the SYNs of the ambient pod's app that reached the node
/// side (each one bypassed ztunnel).
fn reboot(owned: bool) -> anyhow::Result<Vec<Segment>> {
    let tag = if owned { "rbo" } else { "rbi" };
    let node = Node::new(tag)?;
    let mut rt = Containerd::new(tag)?;
    let result = rebooted(&node, &mut rt, owned);
    drop(rt);
    result
}

fn rebooted(node: &Node, rt: &mut Containerd, owned: bool) -> anyhow::Result<Vec<Segment>> {
    let primary = rt.conf_dir.join("10-ptp.conflist");
    let ipam = rt.dir.join("ipam");
    let conflist = |mtu: Option<u32>| ptp_conflist(&ipam, mtu);
    std::fs::write(&primary, conflist(None))?;
    let mut agent = start_agent(node, rt, owned)?;
    let mut peer = PeerProc::start(Path::new(PEER), &agent.zds, &[])?;
    let conf_dir = rt.conf_dir.clone();
    let chained = |want_mtu: bool| {
        let conf_dir = conf_dir.clone();
        move || match sluice_tests::cni::in_force(&conf_dir) {
            Some((_, v))
                if sluice_tests::cni::ends_with_sluice(&v)
                    && (v["plugins"][0]["mtu"] == 1400) == want_mtu =>
            {
                Ok(())
            }
            other => Err(format!("{other:?}")),
        }
    };
    wait::until(
        "sluice-cni in the config in force",
        wait::DEADLINE,
        chained(false),
    )?;
    rt.start(&node.netns)?;
    let _server = App::start(&node.remote, 8080);
    let sniff = L4Sniffer::start(&node.netns)?;
    let server: SocketAddr = format!("{REMOTE_IP}:8080").parse()?;
    let app = |sb: &Sandbox| {
        connect(
            sb.netns_name(),
            server,
            Opts {
                src_port: Some(APP_PORT),
                ..Default::default()
            },
        )
    };
    let uid = format!("u-cart-{}", std::process::id());
    let cart = rt.run_pod("shop", "cart", &uid)?;
    ensure!(
        app(&cart)
            .reply()
            .is_some_and(|l| l.starts_with("app:8080")),
        "the captured pod's connection before the reboot"
    );

    // The reboot: every process and all kernel state gone (the pods' netns,
    // the pins, the tmpfs with the selection snapshot); files on disk kept.
    agent.kill()?;
    peer.kill();
    rt.remove_pod(&cart.id)?;
    std::fs::remove_dir_all(node.pins.root())?;
    let _ = std::fs::remove_file(agent.dir.join(sluice::cni::snapshot::FILE_NAME));
    let _ = std::fs::remove_dir_all(agent.dir.join("cni-pods"));
    // The primary CNI's DaemonSet rewrites its file at boot: only its own
    // plugins, one setting changed.
    let tmp = rt.conf_dir.join(".10-ptp.conflist.new");
    std::fs::write(&tmp, conflist(Some(1400)))?;
    std::fs::rename(&tmp, &primary)?;
    // containerd reloads the conf dir on the rename.
    let reloaded = |rt: &Containerd, want_mtu: bool| {
        wait::until("containerd to load the CNI config", wait::DEADLINE, || {
            let loaded = rt.cni_networks().map_err(|e| e.to_string())?;
            let ok = loaded.contains("\"mtu\":1400") == want_mtu;
            ok.then_some(()).ok_or(loaded)
        })
    };
    if !owned {
        reloaded(rt, true)?;
    }

    // kubelet recreates the node's pods; the agent is not back yet.
    let coredns = rt.run_pod("kube-system", "coredns", "u-coredns");
    let coredns = coredns.context("an excluded namespace's pod must start without the agent")?;
    let plain = rt.run_pod("other", "plain", "u-plain");
    let cart = rt.run_pod("shop", "cart", &uid);
    match &cart {
        Ok(sb) => {
            // Uncaptured: the app's connection leaves the pod as it is.
            let _ = app(sb);
        }
        Err(e) if owned => {
            let e = format!("{e:#}");
            ensure!(
                e.contains("sluice-cni")
                    && e.contains("no selection snapshot")
                    && e.contains("not started uncaptured"),
                "the refusal does not say why: {e}"
            );
        }
        Err(e) => anyhow::bail!("in place, the rewrite dropped sluice-cni, yet: {e:#}"),
    }
    if owned {
        ensure!(cart.is_err(), "the ambient pod started without the agent");
        // No snapshot: a pod outside the excluded namespaces waits too.
        let e = plain
            .as_ref()
            .err()
            .map(|e| format!("{e:#}"))
            .unwrap_or_default();
        ensure!(
            e.contains("no selection snapshot"),
            "a pod of another namespace must wait for the agent after a reboot: {e}"
        );
    }
    ensure!(
        sluice::status::read(&node.pins)?.is_empty(),
        "captured without an agent"
    );

    // The agent and ztunnel come back.
    agent.restart()?;
    let peer = PeerProc::start(Path::new(PEER), &agent.zds, &[])?;
    if owned {
        wait::until(
            "the owned conflist in step with the rewrite",
            wait::DEADLINE,
            chained(true),
        )?;
        ensure!(
            std::fs::read_to_string(&primary)? == conflist(Some(1400)),
            "the primary's file was written"
        );
        reloaded(rt, true)?;
        // kubelet's retry: the ambient pod starts, captured.
        let cart = rt.run_pod("shop", "cart", &uid).map_err(|e| {
            anyhow::anyhow!("{e:#}\nagent:\n{}\ncontainerd:\n{}", agent.log(), rt.log())
        })?;
        wait::until("the ambient pod Served", wait::DEADLINE, || {
            let pods = sluice::status::read(&node.pins).map_err(|e| e.to_string())?;
            match pods.iter().find(|p| p.uid == uid) {
                Some(p) if p.state == Some(PodState::Served) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })?;
        ensure!(
            app(&cart)
                .reply()
                .is_some_and(|l| l.starts_with("app:8080")),
            "the captured pod's connection after the reboot"
        );
        peer.wait_for("the app's connection accepted by the peer", |_| {
            peer.accepted_roles(&["outbound"])
        })?;
        rt.remove_pod(&cart.id)?;
    }
    // The excluded pod was never touched.
    ensure!(
        sluice::status::read(&node.pins)?
            .iter()
            .all(|p| p.uid != "u-coredns"),
        "the excluded pod was captured"
    );
    rt.remove_pod(&coredns.id)?;
    if let Ok(sb) = &plain {
        rt.remove_pod(&sb.id)?;
    }
    if let Ok(sb) = &cart {
        rt.remove_pod(&sb.id)?;
    }
    // Every SYN an app sent from the marker port that reached the node side
    // (only ambient pods' apps send from it).
    let bypass = sniff
        .drain()
        .into_iter()
        .filter(|s| {
            s.proto == 6 && s.flags & 0x12 == 0x02 && s.src.port() == APP_PORT && s.dst == server
        })
        .collect();
    Ok(bypass)
}

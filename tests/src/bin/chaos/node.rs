//! The node the chaos runs on, made of real parts: a node netns with the
//! host side of every pod's veth (Debian's `ptp` plugin, dual-stack), a
//! "remote" netns behind it where the servers and inbound clients live, the
//! agent enrolling through `sluice-cni`, and the ZDS peer standing in for
//! ztunnel. Everything made is removed on drop.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicU32, Ordering},
        Arc,
    },
    time::Duration,
};

use anyhow::{ensure, Context as _};
use serde_json::json;
use sluice::dataplane::loader::Pins;
use sluice_tests::{
    agent::{AgentProc, PeerProc},
    app::App,
    cni::{plugin, Exec, Invocation},
    dns,
    harness::{peer_bin, sluice_bin},
    ns::{netns_path, run_in},
    topology::ip,
};

/// App connections bind a source port from this range; the pods' own
/// ephemeral range (what ztunnel's sockets get) starts above it. A packet
/// from a pod address with a source port in here left without ztunnel.
pub const APP_PORTS: std::ops::RangeInclusive<u16> = 10_000..=19_999;
const EPHEMERAL: &str = "20000 60999";
pub const APP_PORT: u16 = 8080;
pub const REMOTE_PORT: u16 = 9090;
/// The remote netns' addresses, and the pods' ranges (routed to the node).
pub const REMOTE_V4: &str = "10.252.0.2";
pub const REMOTE_V6: &str = "fd00:252::2";
const CNI_NAMESPACE: &str = "chaos";
/// How long one `sluice-cni` call may take before the runner gives up on it
/// and retries later, as a runtime does. Without it, a plugin waiting out
/// its own 30 s on an agent that cannot accept (out of descriptors) holds
/// the schedule, and with it the fault's own end (`fd-restore`).
const CNI_CALL_BOUND: Duration = Duration::from_secs(3);
/// Every ztunnel of the run opens its DNS proxy in each pod, forwarding to
/// the remote's resolver.
const PEER_FLAGS: [&str; 2] = ["--dns-forward", "10.252.0.2:53"];

/// A pod the runner made: its netns, what the runtime gave it, its app.
pub struct Pod {
    pub uid: String,
    pub netns: String,
    /// The CNI container id of its sandbox.
    pub container: String,
    pub ips: Vec<IpAddr>,
    /// The host side of its veth, in the node netns.
    pub host_veth: String,
    /// Its app on [`APP_PORT`]: who it accepted.
    pub app: App,
    /// Set by the self-test fault: its app connections carry ztunnel's mark.
    pub bypass: Arc<AtomicBool>,
    prev_result: serde_json::Value,
}

pub struct Node {
    pub id: String,
    pub node_ns: String,
    pub remote_ns: String,
    pub dir: PathBuf,
    pub pins: Pins,
    pub agent: AgentProc,
    pub peer: PeerProc,
    /// The agent's pid now (0 while it is down), for the checker.
    pub agent_pid: Arc<AtomicU32>,
    pub remote_app: Option<App>,
    /// The resolver on the remote's port 53, which ztunnel's DNS proxy
    /// forwards to.
    remote_dns: Option<dns::Server>,
    next_pod: u32,
    /// The agent runs over the variant build's programs.
    on_variant: bool,
    /// The gate a peer holding its acks waits for.
    pub ack_gate: PathBuf,
}

impl Node {
    /// `local_route`: the agent puts pods' TCP on the local route.
    pub fn start(local_route: bool) -> anyhow::Result<Self> {
        let id = std::process::id().to_string();
        let (node_ns, remote_ns) = (format!("slxn-{id}"), format!("slxr-{id}"));
        let dir = PathBuf::from(format!("/tmp/sluice-chaos-{id}"));
        let pins = Pins::new(PathBuf::from(format!("/sys/fs/bpf/sluice-chaos-{id}")));
        std::fs::create_dir_all(&dir)?;
        // From the first netns on, a failure must remove what was made.
        let guard = Made {
            netns: vec![node_ns.clone(), remote_ns.clone()],
            dir: dir.clone(),
            pins: pins.clone(),
        };
        networks(&node_ns, &remote_ns)?;
        let route = if local_route { "true" } else { "false" };
        let agent = AgentProc::start_with(
            &pins,
            &["--node-netns", &path_str(&node_ns), "--local-route", route],
        )?;
        let peer = PeerProc::start(&peer_bin(), &agent.zds, &PEER_FLAGS)?;
        let agent_pid = Arc::new(AtomicU32::new(agent.pid().unwrap_or(0)));
        let remote_app = Some(App::start(&remote_ns, REMOTE_PORT));
        let remote_dns = Some(dns::upstream(
            &remote_ns,
            &[REMOTE_V4.parse()?, REMOTE_V6.parse()?],
        ));
        std::mem::forget(guard);
        let ack_gate = dir.join("acks");
        Ok(Self {
            id,
            node_ns,
            remote_ns,
            dir,
            pins,
            agent,
            peer,
            agent_pid,
            remote_app,
            remote_dns,
            next_pod: 0,
            on_variant: false,
            ack_gate,
        })
    }

    fn publish_agent_pid(&self) {
        let pid = self.agent.pid().unwrap_or(0);
        self.agent_pid.store(pid, Ordering::SeqCst);
    }

    pub fn kill_agent(&mut self) -> anyhow::Result<()> {
        self.agent_pid.store(0, Ordering::SeqCst);
        self.agent.kill()?;
        self.agent.restart()?;
        self.publish_agent_pid();
        Ok(())
    }

    /// SIGKILL the agent, run `meanwhile` while none runs, start it again.
    pub fn kill_agent_around<T>(
        &mut self,
        meanwhile: impl FnOnce(&mut Self) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        self.agent_pid.store(0, Ordering::SeqCst);
        self.agent.kill()?;
        let out = meanwhile(self);
        self.agent.restart()?;
        self.publish_agent_pid();
        out
    }

    pub fn term_agent(&mut self) -> anyhow::Result<()> {
        self.agent_pid.store(0, Ordering::SeqCst);
        self.agent.terminate();
        self.agent.restart()?;
        self.publish_agent_pid();
        Ok(())
    }

    /// SIGTERM, and a start over the other build's programs.
    pub fn upgrade_agent(&mut self) -> anyhow::Result<()> {
        let variant = variant_object();
        ensure!(
            variant.exists(),
            "{} is missing: `cargo xtask build-ebpf --variant` builds it",
            variant.display()
        );
        self.on_variant = !self.on_variant;
        let object = self.on_variant.then(|| variant.display().to_string());
        self.agent
            .set_env("SLUICE_EBPF_OBJECT_FILE", object.as_deref());
        self.term_agent()
    }

    /// A new peer process (`extra`: its flags); the old one is returned,
    /// still running.
    pub fn new_peer_with(&mut self, extra: &[&str]) -> anyhow::Result<PeerProc> {
        let flags = [&PEER_FLAGS[..], extra].concat();
        let new = PeerProc::start(&peer_bin(), &self.agent.zds, &flags)?;
        Ok(std::mem::replace(&mut self.peer, new))
    }

    pub fn new_peer(&mut self) -> anyhow::Result<PeerProc> {
        self.new_peer_with(&[])
    }

    /// A new pod's sandbox: its netns, `ptp` ADD, its app (containers
    /// start after the ADD, but the runner's traffic only once sluice's ADD
    /// succeeded, [`Node::add`]).
    pub fn sandbox(&mut self) -> anyhow::Result<Pod> {
        let n = self.next_pod;
        self.next_pod += 1;
        let uid = format!("chaos-{}-{n}", self.id);
        let netns = format!("slxp-{}-{n}", self.id);
        ip(&["netns", "add", &netns])?;
        let made = Made {
            netns: vec![netns.clone()],
            dir: PathBuf::new(),
            pins: Pins::new(PathBuf::new()),
        };
        ip(&["-n", &netns, "link", "set", "lo", "up"])?;
        pod_sysctls(&netns)?;
        let container = format!("sandbox-{n}");
        let ptp = self.cni(
            &plugin("ptp"),
            "ADD",
            &container,
            &uid,
            &netns,
            &self.ptp_conf(),
        )?;
        ensure!(ptp.ok, "ptp ADD: {} {}", ptp.stdout, ptp.stderr);
        let prev_result = ptp.json()?;
        let ips = result_ips(&prev_result)?;
        let host_veth = prev_result["interfaces"]
            .as_array()
            .and_then(|a| a.iter().find(|i| i.get("sandbox").is_none()))
            .and_then(|i| i["name"].as_str())
            .context("ptp's result names no host-side veth")?
            .to_owned();
        let app = App::start(&netns, APP_PORT);
        std::mem::forget(made);
        Ok(Pod {
            uid,
            netns,
            container,
            ips,
            host_veth,
            app,
            bypass: Arc::new(AtomicBool::new(false)),
            prev_result,
        })
    }

    /// One `sluice-cni ADD` for the pod's sandbox (the kubelet retries a
    /// failed one).
    pub fn add(&self, pod: &Pod) -> anyhow::Result<Invocation> {
        self.sluice_cni("ADD", pod, &pod.container, &pod.netns)
    }

    /// `sluice-cni DEL` for `pod` with sandbox `container`.
    pub fn del(&self, pod: &Pod, container: &str) -> anyhow::Result<Invocation> {
        self.sluice_cni("DEL", pod, container, &pod.netns)
    }

    /// The late DEL of a sandbox the pod had before: another container id,
    /// its netns long gone.
    pub fn stale_del(&self, pod: &Pod) -> anyhow::Result<Invocation> {
        self.sluice_cni("DEL", pod, "an-old-sandbox", &format!("{}-old", pod.netns))
    }

    /// ptp DEL and the netns removed, whatever sluice did.
    pub fn remove_pod(&self, pod: Pod) {
        let conf = self.ptp_conf();
        let _ = self.cni(
            &plugin("ptp"),
            "DEL",
            &pod.container,
            &pod.uid,
            &pod.netns,
            &conf,
        );
        drop(pod.app);
        let _ = ip(&["netns", "del", &pod.netns]);
    }

    fn sluice_cni(
        &self,
        command: &str,
        pod: &Pod,
        container: &str,
        netns: &str,
    ) -> anyhow::Result<Invocation> {
        let conf = json!({
            "cniVersion": "1.0.0", "name": "chaos", "type": "sluice-cni",
            "agentSocket": self.agent.control, "prevResult": pod.prev_result,
        });
        self.cni(&sluice_cni(), command, container, &pod.uid, netns, &conf)
    }

    fn cni(
        &self,
        plugin: &Path,
        command: &str,
        container: &str,
        uid: &str,
        netns: &str,
        config: &serde_json::Value,
    ) -> anyhow::Result<Invocation> {
        let args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={CNI_NAMESPACE};K8S_POD_NAME={uid};K8S_POD_UID={uid}"
        );
        let path = netns_path(netns);
        let exec = Exec {
            node: &self.node_ns,
            plugin,
            command,
            container_id: container,
            netns: Some(&path),
            args: &args,
            config,
        };
        if plugin == sluice_cni() {
            exec.run_within(CNI_CALL_BOUND)
        } else {
            exec.run()
        }
    }

    fn ptp_conf(&self) -> serde_json::Value {
        json!({
            "cniVersion": "1.0.0", "name": "chaos", "type": "ptp", "ipMasq": false,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": "10.251.0.0/24"}], [{"subnet": "fd00:251::/64"}]],
                "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}],
                "dataDir": self.dir.join("ipam"),
            },
        })
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.peer.kill();
        self.agent.terminate();
        drop(self.remote_app.take());
        drop(self.remote_dns.take());
        drop(Made {
            netns: vec![self.node_ns.clone(), self.remote_ns.clone()],
            dir: self.dir.clone(),
            pins: self.pins.clone(),
        });
    }
}

/// What a half-made node or pod leaves to remove.
struct Made {
    netns: Vec<String>,
    dir: PathBuf,
    pins: Pins,
}

impl Drop for Made {
    fn drop(&mut self) {
        if !self.pins.root().as_os_str().is_empty() && self.pins.root().exists() {
            if let Err(e) = sluice::podnet::enroll::uninstall(&self.pins, None) {
                eprintln!(
                    "chaos cleanup: uninstall {}: {e}",
                    self.pins.root().display()
                );
            }
        }
        for ns in &self.netns {
            let _ = ip(&["netns", "del", ns]);
        }
        if !self.dir.as_os_str().is_empty() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The node and remote netns, a veth between them, the node forwarding.
fn networks(node: &str, remote: &str) -> anyhow::Result<()> {
    for ns in [node, remote] {
        ip(&["netns", "add", ns])?;
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
    }
    run_in(node, || {
        write_sysctls(&[
            ("net/ipv4/ip_forward", "1"),
            ("net/ipv6/conf/all/forwarding", "1"),
            // New veths (ptp's) get their addresses at once.
            ("net/ipv6/conf/default/accept_dad", "0"),
            ("net/ipv6/conf/all/accept_dad", "0"),
        ])
    })?;
    ip(&[
        "link",
        "add",
        "to-remote",
        "netns",
        node,
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        remote,
    ])?;
    for (ns, dev, v4, v6) in [
        (node, "to-remote", "10.252.0.1/24", "fd00:252::1/64"),
        (remote, "eth0", "10.252.0.2/24", "fd00:252::2/64"),
    ] {
        ip(&["-n", ns, "addr", "add", v4, "dev", dev])?;
        ip(&["-n", ns, "addr", "add", v6, "dev", dev, "nodad"])?;
        ip(&["-n", ns, "link", "set", dev, "up"])?;
    }
    ip(&[
        "-n",
        remote,
        "route",
        "add",
        "10.251.0.0/16",
        "via",
        "10.252.0.1",
    ])?;
    ip(&[
        "-n",
        remote,
        "route",
        "add",
        "fd00:251::/48",
        "via",
        "fd00:252::1",
    ])?;
    Ok(())
}

/// A pod's ephemeral ports above [`APP_PORTS`], and no DAD on its veth.
fn pod_sysctls(netns: &str) -> anyhow::Result<()> {
    run_in(netns, || {
        write_sysctls(&[
            ("net/ipv4/ip_local_port_range", EPHEMERAL),
            ("net/ipv6/conf/default/accept_dad", "0"),
            ("net/ipv6/conf/all/accept_dad", "0"),
        ])
    })
}

fn write_sysctls(values: &[(&str, &str)]) -> anyhow::Result<()> {
    for (key, value) in values {
        let path = format!("/proc/sys/{key}");
        std::fs::write(&path, value).with_context(|| format!("writing {path}"))?;
    }
    Ok(())
}

fn result_ips(result: &serde_json::Value) -> anyhow::Result<Vec<IpAddr>> {
    result["ips"]
        .as_array()
        .context("ptp's result has no ips")?
        .iter()
        .map(|i| {
            let a = i["address"].as_str().context("an ip without an address")?;
            Ok(a.split('/').next().unwrap_or(a).parse()?)
        })
        .collect()
}

fn path_str(netns: &str) -> String {
    netns_path(netns).display().to_string()
}

/// "Another build" of the programs (same maps and behaviour, other
/// instructions), as the upgrade tests use it.
fn variant_object() -> PathBuf {
    sluice_bin()
        .parent()
        .and_then(Path::parent)
        .map(|target| target.join("ebpf-variant/bpfel-unknown-none/release/sluice-ebpf"))
        .unwrap_or_default()
}

/// The plugin beside `sluice` (`cargo xtask chaos` builds both).
fn sluice_cni() -> PathBuf {
    sluice_bin().with_file_name("sluice-cni")
}

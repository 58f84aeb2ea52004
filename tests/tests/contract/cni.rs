//! The chained CNI plugin against the real reference plugins (Debian's
//! containernetworking-plugins): `ptp` + `host-local` make a real pod netns
//! with a real address, then `sluice-cni` captures it through the agent.

use sluice_tests::child::Bounded as _;
use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
};

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use serde_json::json;
use sluice::dataplane::loader::Pins;
use sluice_common::PodState;
use sluice_tests::{
    agent::{AgentProc, PeerProc},
    app::App,
    cni::{plugin, Exec},
    flow::{connect, Opts},
    harness::{is_root, local_route_available, local_route_on, on_local_route, sluice_bin},
    topology::{has_local_route_rule, ip},
};

use crate::{trial, TestResult};

const PEER: &str = env!("CARGO_BIN_EXE_sluice-zds-peer");
const ARGS: &str =
    "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart-7f9;K8S_POD_UID=5a1e-cart";

pub fn trials() -> Vec<Trial> {
    let no_static = std::env::var_os(STATIC_CNI_ENV).is_none();
    if no_static {
        eprintln!(
            "skipping cni::the_plugin_is_a_static_executable: {STATIC_CNI_ENV} is not set \
             (the suite runs the debug build; `cargo xtask test` builds and names the static one)"
        );
    }
    vec![
        trial("cni::the_plugin_is_a_static_executable", plugin_is_static)
            .with_ignored_flag(no_static),
        trial(
            "cni::chain_with_reference_plugins_captures_and_cleans_up",
            chain,
        ),
        // The same with the agent's `--local-route`: the pod its ADD
        // enrolls takes it, and its DEL takes it off.
        trial(
            "cni::local_route::chain_with_reference_plugins_captures_and_cleans_up",
            || on_local_route(chain),
        )
        .with_ignored_flag(!is_root() || !local_route_available()),
        trial("cni::errors_are_spec_shaped", errors),
        trial(
            "cni::with_the_agent_down_only_ambient_pods_wait",
            agent_down,
        ),
        trial(
            "cni::agent_keeps_the_plugin_in_the_conflist",
            conflist_in_place,
        ),
        trial(
            "cni::agent_keeps_its_owned_conflist_in_step",
            conflist_owned,
        ),
        trial(
            "cni::check_node_says_what_would_stop_or_weaken_sluice",
            check_node,
        ),
        trial(
            "cni::neither_an_old_sandboxs_del_nor_unenroll_removes_the_live_capture",
            sandbox_swap,
        ),
    ]
}

/// The plugin binary the suite runs: the static build `cargo xtask test`
/// names in `SLUICE_CNI_BIN` (what the image ships), else the debug build
/// beside `sluice`.
pub(crate) fn sluice_cni() -> PathBuf {
    std::env::var_os(STATIC_CNI_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| sluice_bin().with_file_name("sluice-cni"))
}

const STATIC_CNI_ENV: &str = "SLUICE_CNI_BIN";

/// The plugin runs from the host's `/opt/cni/bin` on whatever distribution
/// the node has: no program interpreter (dynamic loader) and no shared
/// library it needs.
fn plugin_is_static() -> TestResult {
    use object::{
        elf,
        read::elf::{Dyn as _, ElfFile64, ProgramHeader as _},
        Endianness,
    };
    let path = sluice_cni();
    let data = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let file = ElfFile64::<Endianness>::parse(&*data)?;
    let endian = file.endian();
    let interp = file
        .elf_program_headers()
        .iter()
        .any(|p| p.p_type(endian) == elf::PT_INTERP);
    ensure!(
        !interp,
        "{} asks for a dynamic loader (PT_INTERP)",
        path.display()
    );
    let needed = file
        .elf_program_headers()
        .iter()
        .filter_map(|p| p.dynamic(endian, &*data).ok().flatten())
        .flatten()
        .filter(|d| d.d_tag(endian) == elf::DT_NEEDED)
        .count();
    ensure!(
        needed == 0,
        "{} needs {needed} shared libraries",
        path.display()
    );
    Ok(())
}

/// A node netns, a pod netns, a bpffs root and a temp dir; all removed on drop.
pub(crate) struct Node {
    node: String,
    pub(crate) pod: String,
    pub(crate) pins: Pins,
    dir: PathBuf,
}

impl Node {
    pub(crate) fn new(tag: &str) -> anyhow::Result<Self> {
        let id = format!("{}-{tag}", std::process::id());
        let n = Self {
            node: format!("slcn-{id}"),
            pod: format!("slcp-{id}"),
            pins: Pins::new(format!("/sys/fs/bpf/sluice-test-cni-{id}")),
            dir: PathBuf::from(format!("/tmp/sluice-cni-{id}")),
        };
        std::fs::create_dir_all(&n.dir)?;
        ip(&["netns", "add", &n.node])?;
        ip(&["netns", "add", &n.pod])?;
        ip(&["-n", &n.node, "link", "set", "lo", "up"])?;
        ip(&["-n", &n.pod, "link", "set", "lo", "up"])?;
        Ok(n)
    }

    pub(crate) fn pod_path(&self) -> PathBuf {
        PathBuf::from(format!("/run/netns/{}", self.pod))
    }

    pub(crate) fn ptp_conf(&self) -> serde_json::Value {
        json!({
            "cniVersion": "1.0.0",
            "name": "sluice-test",
            "type": "ptp",
            "ipMasq": false,
            "ipam": {"type": "host-local", "subnet": "10.250.0.0/24", "dataDir": self.dir.join("ipam")},
        })
    }

    pub(crate) fn exec<'a>(
        &'a self,
        plugin: &'a Path,
        command: &'a str,
        config: &'a serde_json::Value,
        netns: Option<&'a Path>,
    ) -> Exec<'a> {
        Exec {
            node: &self.node,
            plugin,
            command,
            container_id: "c0ffee",
            netns,
            args: ARGS,
            config,
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = sluice::podnet::enroll::uninstall(&self.pins, None);
        let _ = ip(&["netns", "del", &self.pod]);
        let _ = ip(&["netns", "del", &self.node]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn chain() -> TestResult {
    let n = Node::new(if local_route_on() {
        "chain-lr"
    } else {
        "chain"
    })?;
    let agent = AgentProc::start(&n.pins)?;
    let peer = PeerProc::start(Path::new(PEER), &agent.zds, &[])?;
    let app = App::start(&n.pod, 8080);
    let pod_path = n.pod_path();

    // The primary plugin, then ours with its result as prevResult.
    let ptp_conf = n.ptp_conf();
    let ptp = n
        .exec(&plugin("ptp"), "ADD", &ptp_conf, Some(&pod_path))
        .run()?;
    ensure!(ptp.ok, "ptp ADD: {} {}", ptp.stdout, ptp.stderr);
    let prev = ptp.json()?;
    // An address the runtime did not give the pod: never the pod's for
    // capture (only prevResult's are).
    ip(&["-n", &n.pod, "addr", "add", "10.196.0.9/32", "dev", "eth0"])?;
    let conf = json!({
        "cniVersion": "1.0.0", "name": "sluice-test", "type": "sluice-cni",
        "agentSocket": agent.control, "prevResult": prev,
    });
    let cni = sluice_cni();
    let add = n.exec(&cni, "ADD", &conf, Some(&pod_path)).run()?;
    ensure!(
        add.ok,
        "sluice-cni ADD: {} {}\n{}",
        add.stdout,
        add.stderr,
        agent.log()
    );
    ensure!(
        add.json()? == prev,
        "prevResult not passed through unchanged: {}",
        add.stdout
    );

    let pods = sluice::status::read(&n.pins)?;
    ensure!(
        // Enabled, or already Served: the served check may have run since.
        pods.len() == 1
            && pods[0].uid == "5a1e-cart"
            && matches!(pods[0].state, Some(PodState::Enabled | PodState::Served)),
        "{pods:?}"
    );
    ensure!(
        pods[0].netns == pod_path.to_str().unwrap(),
        "CNI netns path not recorded: {}",
        pods[0].netns
    );
    ensure!(peer
        .events()
        .iter()
        .any(|e| e["event"] == "add" && e["workload"] == "shop/cart-7f9/default"));
    ensure!(
        has_local_route_rule(&n.pod, false)? == local_route_on(),
        "the pod's local route rule: want it {}",
        local_route_on()
    );

    // Rows I1 and O1 through the pod the CNI chain made.
    let pod_ip: IpAddr = prev["ips"][0]["address"]
        .as_str()
        .context("no pod ip")?
        .split('/')
        .next()
        .unwrap()
        .parse()?;
    ensure!(
        pods[0].addresses == [pod_ip],
        "published {:?}, the runtime gave {pod_ip}",
        pods[0].addresses
    );
    let gw: IpAddr = prev["ips"][0]["gateway"]
        .as_str()
        .context("no gateway")?
        .parse()?;
    let r = connect(&n.node, SocketAddr::new(pod_ip, 8080), Opts::default());
    ensure!(
        r.reply().is_some_and(|l| l.starts_with("app:8080")),
        "inbound: {r:?}"
    );
    let remote = App::start(&n.node, 9090);
    let r = connect(&n.pod, SocketAddr::new(gw, 9090), Opts::default());
    ensure!(
        r.reply().is_some_and(|l| l.starts_with("app:9090")),
        "outbound: {r:?}"
    );
    peer.wait_for("inbound and outbound accepted by the peer", |_| {
        peer.accepted_roles(&["inbound", "outbound"])
    })?;
    ensure!(app.peers().len() == 1 && remote.peers().len() == 1);

    // CHECK: nothing printed, success. VERSION: the versions we speak.
    let check = n.exec(&cni, "CHECK", &conf, Some(&pod_path)).run()?;
    ensure!(
        check.ok && check.stdout.is_empty(),
        "CHECK: {} {}",
        check.stdout,
        check.stderr
    );
    let ver = n
        .exec(&cni, "VERSION", &json!({"cniVersion": "1.0.0"}), None)
        .run()?
        .json()?;
    for v in ["1.0.0", "0.4.0", "0.3.1"] {
        ensure!(
            ver["supportedVersions"]
                .as_array()
                .unwrap()
                .contains(&v.into()),
            "{ver}"
        );
    }

    // DEL in reverse order: ours, then the primary's. Nothing of the pod stays.
    let del = n.exec(&cni, "DEL", &conf, Some(&pod_path)).run()?;
    ensure!(
        del.ok && del.stdout.is_empty(),
        "sluice-cni DEL: {} {}",
        del.stdout,
        del.stderr
    );
    let ptp_del = n
        .exec(&plugin("ptp"), "DEL", &ptp_conf, Some(&pod_path))
        .run()?;
    ensure!(ptp_del.ok, "ptp DEL: {}", ptp_del.stderr);
    ensure!(
        sluice::status::read(&n.pins)?.is_empty(),
        "pod still enrolled after DEL"
    );
    ensure!(
        std::fs::read_dir(n.pins.pods())?.next().is_none(),
        "pins left after DEL"
    );
    ensure!(
        !has_local_route_rule(&n.pod, false)?,
        "the local route's rule left after DEL"
    );
    let all = sluice_tests::ns::output(&n.pod, &["ip", "route", "show", "table", "all"])?;
    ensure!(
        !all.lines().any(|l| l.contains("table 101")),
        "table 101 after DEL: {all}"
    );
    ensure!(peer
        .events()
        .iter()
        .any(|e| e["event"] == "del" && e["uid"] == "5a1e-cart"));
    // A second DEL (runtimes retry) is fine.
    ensure!(n.exec(&cni, "DEL", &conf, Some(&pod_path)).run()?.ok);
    Ok(())
}

fn errors() -> TestResult {
    let n = Node::new("err")?;
    let cni = sluice_cni();
    let pod_path = n.pod_path();
    let prev = json!({"cniVersion": "1.0.0", "ips": [{"address": "10.250.0.9/24"}]});
    let conf = |sock: &str| json!({"cniVersion": "1.0.0", "name": "t", "type": "sluice-cni", "agentSocket": sock, "prevResult": prev});
    let code = |inv: &sluice_tests::cni::Invocation| -> anyhow::Result<u64> {
        ensure!(!inv.ok, "expected failure, got {}", inv.stdout);
        let v = inv
            .json()
            .with_context(|| format!("error is not JSON: {:?}", inv.stdout))?;
        ensure!(v["msg"].is_string() && v["cniVersion"].is_string(), "{v}");
        v["code"].as_u64().context("no code")
    };
    // Bad stdin JSON → 6 (decode failure).
    let bad = json!("{not json");
    let inv = Exec {
        node: &n.node,
        plugin: &cni,
        command: "ADD",
        container_id: "c",
        netns: Some(&pod_path),
        args: ARGS,
        config: &bad,
    }
    .run()?;
    ensure!(code(&inv)? == 6, "{}", inv.stdout);
    // Missing CNI_NETNS on ADD → 4 (invalid env).
    let c = conf("/nonexistent/agent.sock");
    let inv = Exec {
        node: &n.node,
        plugin: &cni,
        command: "ADD",
        container_id: "c",
        netns: None,
        args: ARGS,
        config: &c,
    }
    .run()?;
    ensure!(code(&inv)? == 4, "{}", inv.stdout);
    // No agent → 11 (try again later): the pod must not start uncaptured.
    let inv = n.exec(&cni, "ADD", &c, Some(&pod_path)).run()?;
    ensure!(code(&inv)? == 11, "{}", inv.stdout);
    ensure!(
        inv.stdout.contains("not started uncaptured"),
        "{}",
        inv.stdout
    );
    Ok(())
}

fn wait(what: &str, f: impl Fn() -> bool) -> TestResult {
    sluice_tests::wait::until(what, sluice_tests::wait::DEADLINE, || {
        f().then_some(()).ok_or("not yet")
    })
}

/// In-place mode (`--owned-cni-config=false`): the entry is appended to the
/// primary's own file, put back after the primary rewrites it, and removed
/// exactly on uninstall.
fn conflist_in_place() -> TestResult {
    let n = Node::new("conf")?;
    let (conf_dir, bin_dir) = (n.dir.join("net.d"), n.dir.join("bin"));
    std::fs::create_dir_all(&conf_dir)?;
    let primary = conf_dir.join("10-ptp.conflist");
    let original = json!({"cniVersion": "1.0.0", "name": "k8s", "plugins": [n.ptp_conf()]});
    std::fs::write(&primary, original.to_string())?;
    let read = || -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(&primary).unwrap_or_default()).unwrap_or_default()
    };
    let ours = sluice_tests::cni::ends_with_sluice;
    let dirs = cni_dirs(&conf_dir, &bin_dir);
    let mut flags = vec!["--install-cni", "--owned-cni-config=false"];
    flags.extend(dirs.iter().map(String::as_str));
    // No periodic check within the test: only the inotify watch can put the
    // entry back after the rewrite below.
    flags.extend(["--cni-recheck", "600m"]);
    let mut agent = AgentProc::start_with(&n.pins, &flags)?;
    wait("the plugin in the conflist", || ours(&read()))?;
    // Its entry carries the excluded namespaces (the default, plus the
    // agent's own): the plugin decides those pods without the agent.
    let entry = read()["plugins"]
        .as_array()
        .and_then(|p| p.last().cloned())
        .unwrap_or_default();
    ensure!(
        entry["excludeNamespaces"] == json!(["istio-system", "kube-system"]),
        "{entry}"
    );
    ensure!(
        bin_dir.join("sluice-cni").exists(),
        "plugin binary not copied"
    );
    // The primary CNI rewrites its file without us: we come back, woken by
    // the watch.
    std::fs::write(&primary, original.to_string())?;
    wait("re-insertion after the primary CNI's rewrite", || {
        ours(&read())
    })?;
    // An agent restart leaves the plugin in place (pods keep going through it).
    ensure!(agent.terminate());
    ensure!(ours(&read()) && bin_dir.join("sluice-cni").exists());
    uninstall_cni(&dirs)?;
    ensure!(read() == original, "conflist not restored: {}", read());
    ensure!(!bin_dir.join("sluice-cni").exists());
    Ok(())
}

/// Owned mode (the default): the agent writes `02-sluice.conflist`, which
/// the runtime reads first, follows every rewrite of the primary's file at
/// once (inotify alone), never writes the primary's file, and removes only
/// its own file on uninstall.
fn conflist_owned() -> TestResult {
    let n = Node::new("own")?;
    let (conf_dir, bin_dir) = (n.dir.join("net.d"), n.dir.join("bin"));
    std::fs::create_dir_all(&conf_dir)?;
    let primary = conf_dir.join("10-ptp.conflist");
    let original = json!({"cniVersion": "1.0.0", "name": "k8s", "plugins": [n.ptp_conf()]});
    std::fs::write(&primary, original.to_string())?;
    let owned = conf_dir.join("02-sluice.conflist");
    let dirs = cni_dirs(&conf_dir, &bin_dir);
    let mut flags = vec!["--install-cni"];
    flags.extend(dirs.iter().map(String::as_str));
    flags.extend(["--cni-recheck", "600m"]);
    let mut agent = AgentProc::start_with(&n.pins, &flags)?;
    let in_force = || sluice_tests::cni::in_force(&conf_dir).unwrap_or_default();
    wait("the owned conflist in force", || {
        let (p, v) = in_force();
        p == owned && sluice_tests::cni::ends_with_sluice(&v)
    })?;
    let (_, v) = in_force();
    ensure!(
        v["name"] == "k8s" && v["plugins"][0] == original["plugins"][0],
        "{v}"
    );
    // The primary CNI rewrites its file at boot, with another setting.
    let mut rewritten = original.clone();
    rewritten["plugins"][0]["mtu"] = json!(1400);
    let tmp = conf_dir.join(".10-ptp.tmp");
    let rewritten_text = rewritten.to_string();
    std::fs::write(&tmp, &rewritten_text)?;
    std::fs::rename(&tmp, &primary)?;
    wait("the owned conflist in step with the rewrite", || {
        let (p, v) = in_force();
        p == owned && v["plugins"][0]["mtu"] == 1400 && sluice_tests::cni::ends_with_sluice(&v)
    })?;
    let primary_now = std::fs::read_to_string(&primary)?;
    ensure!(
        primary_now == rewritten_text,
        "the primary's file was written: {primary_now}"
    );
    // The agent's status names the config in force.
    wait("status names the owned conflist", || {
        agent.node_status().is_ok_and(|st| {
            st["cni"]
                .as_str()
                .is_some_and(|c| c.contains("02-sluice.conflist chains sluice-cni"))
        })
    })?;
    ensure!(agent.terminate());
    ensure!(
        owned.exists(),
        "an agent stop must leave the owned conflist"
    );
    uninstall_cni(&dirs)?;
    ensure!(!owned.exists(), "the owned conflist is left");
    ensure!(std::fs::read_to_string(&primary)? == primary_now);
    ensure!(!bin_dir.join("sluice-cni").exists());
    Ok(())
}

/// `sluice check-node` on a node (a netns of the test's) and its CNI dirs:
/// no primary config is a failure (exit 1); a node sluice runs on passes
/// (exit 0); another tool's qdisc on a veth and istio-cni chained in the
/// primary are warnings (exit 2); a CNI that renamed other configs away
/// (Cilium's exclusive mode) is a failure again.
fn check_node() -> TestResult {
    let n = Node::new("chk")?;
    let (conf_dir, bin_dir) = (n.dir.join("net.d"), n.dir.join("bin"));
    std::fs::create_dir_all(&conf_dir)?;
    std::fs::create_dir_all(&bin_dir)?;
    let netns = format!("/run/netns/{}", n.node);
    let zds = n.dir.join("zds.sock");
    let mut args = vec![
        "--bpf-root".to_string(),
        n.pins.root().display().to_string(),
        "check-node".into(),
        "--node-netns".into(),
        netns,
        "--zds-socket".into(),
        zds.display().to_string(),
        "-o".into(),
        "json".into(),
    ];
    args.extend(cni_dirs(&conf_dir, &bin_dir));
    let check = || -> anyhow::Result<(i32, serde_json::Value)> {
        let out = std::process::Command::new(sluice_bin())
            .args(&args)
            .output_bounded()?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .with_context(|| String::from_utf8_lossy(&out.stderr).into_owned())?;
        Ok((out.status.code().unwrap_or(-1), v))
    };
    let said = |v: &serde_json::Value, check: &str, level: &str| -> Vec<String> {
        v["findings"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|f| f["check"] == check && f["level"] == level)
            .filter_map(|f| f["detail"].as_str().map(str::to_owned))
            .collect()
    };
    let (code, v) = check()?;
    ensure!(
        code == 1 && !said(&v, "cni config", "fail").is_empty(),
        "no primary config: {code} {v}"
    );
    let primary = conf_dir.join("10-ptp.conflist");
    let plain = json!({"cniVersion": "1.0.0", "name": "k8s", "plugins": [n.ptp_conf()]});
    std::fs::write(&primary, plain.to_string())?;
    let (code, v) = check()?;
    ensure!(code == 0, "a node sluice runs on: {code} {v}");
    // Another tool's ingress qdisc on a veth; istio-cni chained in place.
    ip(&[
        "-n", &n.node, "link", "add", "v0", "type", "veth", "peer", "name", "v1",
    ])?;
    sluice_tests::ns::exec(&n.node, &["tc", "qdisc", "add", "dev", "v0", "ingress"])?;
    let mut istio = plain.clone();
    istio["plugins"]
        .as_array_mut()
        .context("plugins")?
        .push(json!({"type": "istio-cni"}));
    std::fs::write(&primary, istio.to_string())?;
    let (code, v) = check()?;
    let veths = said(&v, "host veths", "warn");
    let istio_said = said(&v, "istio-cni", "warn");
    ensure!(
        code == 2
            && veths.iter().any(|d| d.contains("v0 (ingress)"))
            && istio_said.iter().any(|d| d.contains("10-ptp.conflist")),
        "warnings: {code} {v}"
    );
    // Cilium with cni.exclusive=true renamed a config away.
    std::fs::write(conf_dir.join("05-other.conflist.cilium_bak"), "{}")?;
    let (code, v) = check()?;
    ensure!(
        code == 1
            && said(&v, "cni config", "fail")
                .iter()
                .any(|d| d.contains("05-other.conflist.cilium_bak")),
        "a renamed config: {code} {v}"
    );
    Ok(())
}

fn cni_dirs(conf_dir: &Path, bin_dir: &Path) -> Vec<String> {
    vec![
        "--cni-conf-dir".into(),
        conf_dir.display().to_string(),
        "--cni-bin-dir".into(),
        bin_dir.display().to_string(),
    ]
}

fn uninstall_cni(dirs: &[String]) -> TestResult {
    let out = std::process::Command::new(sluice_bin())
        .arg("uninstall-cni")
        .args(dirs)
        .output_bounded()?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn sandbox_swap() -> TestResult {
    let n = Node::new("swap")?;
    let second = format!("{}-b", n.pod);
    ip(&["netns", "add", &second])?;
    let result = (|| -> TestResult {
        let agent = AgentProc::start(&n.pins)?;
        let (a, b) = (n.pod_path(), PathBuf::from(format!("/run/netns/{second}")));
        // Each sandbox gets its own address from the primary CNI.
        let ptp_conf = n.ptp_conf();
        let add = |netns: &Path, id: &'static str| -> anyhow::Result<serde_json::Value> {
            let prev = Exec {
                container_id: id,
                ..n.exec(&plugin("ptp"), "ADD", &ptp_conf, Some(netns))
            }
            .run()?
            .json()?;
            let conf = json!({"cniVersion": "1.0.0", "name": "sluice-test", "type": "sluice-cni", "agentSocket": agent.control, "prevResult": prev});
            let cni = sluice_cni();
            let out = Exec {
                container_id: id,
                ..n.exec(&cni, "ADD", &conf, Some(netns))
            }
            .run()?;
            ensure!(out.ok, "ADD {id}: {}", out.stdout);
            Ok(conf)
        };
        let conf_a = add(&a, "sandbox-a")?;
        let cookie_a = sluice::status::read(&n.pins)?[0].netns_cookie;
        // The runtime makes a new sandbox for the same pod: ADD moves capture…
        let conf_b = add(&b, "sandbox-b")?;
        let pods = sluice::status::read(&n.pins)?;
        ensure!(
            pods.len() == 1
                && pods[0].netns_cookie != cookie_a
                && pods[0].netns == b.to_str().unwrap(),
            "{pods:?}"
        );
        // … and the late DEL of the old sandbox must not remove it.
        let cni = sluice_cni();
        ensure!(
            Exec {
                container_id: "sandbox-a",
                ..n.exec(&cni, "DEL", &conf_a, Some(&a))
            }
            .run()?
            .ok
        );
        let pods = sluice::status::read(&n.pins)?;
        ensure!(
            pods.len() == 1 && pods[0].netns == b.to_str().unwrap(),
            "capture of the new sandbox lost: {pods:?}\n{}",
            agent.log()
        );
        // Nor may the control socket's unenroll (the same guard).
        let out = agent.sluice(&["unenroll", "--uid", &pods[0].uid])?;
        ensure!(
            !out.ok && out.stderr.contains("only the runtime's DEL"),
            "unenroll of a live CNI-enrolled pod: {}{}",
            out.stdout,
            out.stderr
        );
        ensure!(sluice::status::read(&n.pins)?.len() == 1);
        ensure!(
            Exec {
                container_id: "sandbox-b",
                ..n.exec(&cni, "DEL", &conf_b, Some(&b))
            }
            .run()?
            .ok
        );
        ensure!(sluice::status::read(&n.pins)?.is_empty());
        for (id, ns) in [("sandbox-a", &a), ("sandbox-b", &b)] {
            let _ = Exec {
                container_id: id,
                ..n.exec(&plugin("ptp"), "DEL", &ptp_conf, Some(ns))
            }
            .run();
        }
        Ok(())
    })();
    let _ = ip(&["netns", "del", &second]);
    result
}

/// Pods that must never wait for sluice: with the agent down, a pod of a
/// namespace that is not ambient (the agent's last selection snapshot) and a
/// pod of an excluded namespace start; an ambient pod waits (code 11) until
/// the agent is back, then is captured.
fn agent_down() -> TestResult {
    let n = Node::new("down")?;
    let cni = sluice_cni();
    let pod_path = n.pod_path();
    let ptp_conf = n.ptp_conf();
    let ptp = n
        .exec(&plugin("ptp"), "ADD", &ptp_conf, Some(&pod_path))
        .run()?;
    ensure!(ptp.ok, "ptp ADD: {} {}", ptp.stdout, ptp.stderr);
    let prev = ptp.json()?;
    let mut agent = AgentProc::start(&n.pins)?;
    agent.terminate();
    // What the agent last saw: "shop" is ambient.
    sluice::cni::snapshot::write_if_changed(
        &agent.dir.join(sluice::cni::snapshot::FILE_NAME),
        &["shop".to_string()].into(),
    )?;
    let conf = json!({
        "cniVersion": "1.0.0", "name": "sluice-test", "type": "sluice-cni",
        "agentSocket": agent.control, "excludeNamespaces": ["kube-system"], "prevResult": prev,
    });
    let add = |args: &str| {
        Exec {
            args,
            ..n.exec(&cni, "ADD", &conf, Some(&pod_path))
        }
        .run()
    };
    for (ns, why) in [("other", "not ambient"), ("kube-system", "excluded")] {
        let args = format!("K8S_POD_NAMESPACE={ns};K8S_POD_NAME=p;K8S_POD_UID=u-{ns}");
        let inv = add(&args)?;
        ensure!(
            inv.ok && inv.json()? == prev,
            "{ns} ({why}) did not start: {} {}",
            inv.stdout,
            inv.stderr
        );
    }
    ensure!(
        sluice::status::read(&n.pins)
            .map(|p| p.is_empty())
            .unwrap_or(true),
        "captured without an agent"
    );
    let inv = add(ARGS)?;
    ensure!(!inv.ok, "an ambient pod started without the agent");
    let err = inv.json()?;
    ensure!(err["code"] == 11, "{err}");
    ensure!(
        err["details"]
            .as_str()
            .is_some_and(|d| d.contains("namespace shop is ambient")),
        "{err}"
    );
    agent.restart()?;
    let inv = add(ARGS)?;
    ensure!(inv.ok, "{} {}\n{}", inv.stdout, inv.stderr, agent.log());
    let pods = sluice::status::read(&n.pins)?;
    ensure!(
        pods.len() == 1 && pods[0].uid == "5a1e-cart",
        "not captured after the agent returned: {pods:?}"
    );
    Ok(())
}

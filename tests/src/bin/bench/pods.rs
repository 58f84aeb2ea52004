//! Scenarios on many bare pods: enrollment (cold, warm, concurrent, RTNL
//! hold time), churn under traffic, and the agent's memory.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, TcpStream},
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering},
        Arc, Barrier, Mutex,
    },
    time::{Duration, Instant},
};

use anyhow::{ensure, Context as _};
use rand::rngs::StdRng;
use sluice::{
    control::{self, Request},
    dataplane::features::{Features, TcAttach},
    dataplane::loader::{Dataplane, Pins},
    dataplane::state::Maps,
    podnet::enroll,
    uid::PodUid,
};
use sluice_tests::{
    agent::AgentProc, inspect::proc_status_kib, istio, ns::spawn_in, sink::Mode, topology::ip,
};

use crate::{ns_path, percentile, traffic::Setup, workload, Config, Dir, Report, Variant};

/// Pod netns for enrollment and scale: a netns with one interface and address.
pub struct BarePod {
    pub name: String,
}

/// The bare pods of a scenario and the "node" netns holding their veth peers,
/// as on a real node; all deleted on drop (also when a scenario fails).
pub struct BarePods(Vec<BarePod>, String);

impl std::ops::Deref for BarePods {
    type Target = [BarePod];
    fn deref(&self) -> &[BarePod] {
        &self.0
    }
}

impl BarePods {
    /// Their node netns, for a dataplane to enroll them as the agent does
    /// (the host side of each veth gets sluice's host-side program).
    pub fn node(&self) -> anyhow::Result<sluice::podnet::hostside::Node> {
        Ok(sluice::podnet::hostside::Node::open(&ns_path(&self.1))?)
    }
}

impl Drop for BarePods {
    fn drop(&mut self) {
        let mut lines: String = self
            .0
            .iter()
            .map(|p| format!("netns del {}\n", p.name))
            .collect();
        lines += &format!("netns del {}\n", self.1);
        if let Err(e) = ip_batch(None, &lines) {
            eprintln!("cleanup: {e}");
        }
    }
}

/// Runs `ip [-n ns] -force -batch -` with `lines`: one process for many
/// commands (`-force`: a failing line does not stop the others).
fn ip_batch(ns: Option<&str>, lines: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut cmd = std::process::Command::new("ip");
    if let Some(ns) = ns {
        cmd.args(["-n", ns]);
    }
    let mut child = cmd
        .args(["-force", "-batch", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running ip -batch")?;
    child.stdin.take().unwrap().write_all(lines.as_bytes())?;
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "ip -batch: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Runs `f` on `n` bare pods and a bpffs root of their own (`tag` names
/// both), then removes what sluice pinned there and the pods, also when `f`
/// fails.
pub fn with_bare_pods<R>(
    tag: &str,
    n: usize,
    f: impl FnOnce(&BarePods, &sluice::dataplane::loader::Pins) -> anyhow::Result<R>,
) -> anyhow::Result<R> {
    let pods = bare_pods(tag, n)?;
    let pins = sluice::dataplane::loader::Pins::new(format!(
        "/sys/fs/bpf/sluice-bench-{tag}-{}",
        std::process::id()
    ));
    let result = f(&pods, &pins);
    if let Err(e) = sluice::podnet::enroll::uninstall(&pins, None) {
        eprintln!("cleanup: uninstall {}: {e}", pins.root().display());
    }
    drop(pods);
    result
}

/// `n` pod netns, each with an `eth0` (address 10.210.x.y/32, up) whose
/// veth peer is in the node netns, and `lo` up. Made with two `ip -batch`
/// runs and netlink from inside each pod netns (an `ip` process per step
/// cost a minute at 1,000 pods).
pub fn bare_pods(tag: &str, n: usize) -> anyhow::Result<BarePods> {
    let pid = std::process::id();
    let node = format!("slb-{tag}-{pid}-node");
    let pods = BarePods(
        (0..n)
            .map(|i| BarePod {
                name: format!("slb-{tag}-{pid}-{i}"),
            })
            .collect(),
        node.clone(),
    );
    // From here on, Drop removes whatever was made.
    let mut add = format!("netns add {node}\n");
    for p in pods.iter() {
        add += &format!("netns add {}\n", p.name);
    }
    ip_batch(None, &add)?;
    let veths: String = pods
        .iter()
        .enumerate()
        .map(|(i, p)| {
            format!(
                "link add veth{i} type veth peer name eth0 netns {}\n",
                p.name
            )
        })
        .collect();
    ip_batch(Some(&node), &veths)?;
    for (i, p) in pods.iter().enumerate() {
        let addr = Ipv4Addr::new(
            10,
            210 + (i / 65536) as u8,
            (i / 256 % 256) as u8,
            (i % 256) as u8,
        );
        sluice_tests::ns::run_in(&p.name, move || configure_pod(addr))
            .with_context(|| format!("configuring {}", p.name))?;
    }
    Ok(pods)
}

/// In the calling thread's netns: `addr/32` on eth0, eth0 and lo up.
fn configure_pod(addr: Ipv4Addr) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    rt.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection()?;
        tokio::spawn(conn);
        let eth0 = nix::net::if_::if_nametoindex("eth0")?;
        let lo = nix::net::if_::if_nametoindex("lo")?;
        handle
            .address()
            .add(eth0, IpAddr::V4(addr), 32)
            .execute()
            .await?;
        for link in [eth0, lo] {
            handle
                .link()
                .set(rtnetlink::LinkUnspec::new_with_index(link).up().build())
                .execute()
                .await?;
        }
        anyhow::Ok(())
    })
}

/// A bpffs root of the bench's own, unenrolled and removed on drop.
struct OwnPins(Pins);

impl OwnPins {
    fn new(tag: &str) -> Self {
        Self(Pins::new(format!(
            "/sys/fs/bpf/sluice-bench-{tag}-{}",
            std::process::id()
        )))
    }
}

impl Drop for OwnPins {
    fn drop(&mut self) {
        if let Err(e) = enroll::uninstall(&self.0, None) {
            eprintln!("cleanup: uninstall {}: {e}", self.0.root().display());
        }
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// sluice's enrollment as the agent makes it (capture attached, then the
/// istio-cni take-over check), in ms.
fn sluice_enroll(dp: &mut Dataplane, pod: &str, uid: &str) -> anyhow::Result<f64> {
    let uid = PodUid::new(uid)?;
    let t = Instant::now();
    let a = enroll::attach_pod(
        dp,
        &ns_path(pod),
        &uid,
        &workload(pod),
        &Default::default(),
        &enroll::PodAddrs::Netns,
        // A new pod, as at its CNI ADD.
        enroll::AppStarted::No,
    )?;
    enroll::take_over(&a.netns)?;
    Ok(ms(t))
}

fn sluice_unenroll(dp: &mut Dataplane, uid: &str) -> anyhow::Result<f64> {
    let uid = PodUid::new(uid)?;
    let t = Instant::now();
    let (pins, maps, node) = dp.parts_mut();
    enroll::unenroll(pins, maps, node, &uid)?;
    Ok(ms(t))
}

fn istio_cni_enroll(pod: &str) -> anyhow::Result<f64> {
    let t = Instant::now();
    istio::apply_istio_cni(pod)?;
    Ok(ms(t))
}

/// `{what}_ms_{p50,p99,p999}_{variant}`.
fn put_percentiles(report: &mut Report, what: &str, variant: &str, v: &[f64]) {
    if v.is_empty() {
        return;
    }
    for (q, name) in [(0.5, "p50"), (0.99, "p99"), (0.999, "p999")] {
        report.put(
            &format!("{what}_ms_{name}_{variant}"),
            percentile(v.to_vec(), q),
        );
    }
}

/// Scenario `enroll`: per-pod enrollment for sluice (cls_bpf filters, the
/// default; tcx links where the kernel has them: keys `_tcx`; the local
/// route where it is offered: keys `_local_route`) against
/// istio-cni's (the replica), cold and warm; teardown; N pods at once; and
/// how long each enrollment holds RTNL.
pub fn enrollment(report: &mut Report, cfg: &Config, _rng: &mut StdRng) -> anyhow::Result<()> {
    let features = Features::get();
    // Cold: the first pod after the programs are loaded (a fresh bpffs root
    // each time); loading is once per node, timed apart.
    let cold_pods = bare_pods("ec", cfg.cold_reps)?;
    let (mut cold, mut load) = (Vec::new(), Vec::new());
    for (i, p) in cold_pods.iter().enumerate() {
        let pins = OwnPins::new(&format!("cold{i}"));
        let t = Instant::now();
        let mut dp = Dataplane::load_or_adopt(pins.0.clone())?;
        load.push(ms(t));
        dp.set_node(cold_pods.node()?)?;
        cold.push(sluice_enroll(&mut dp, &p.name, &format!("cold-{i}"))?);
    }
    drop(cold_pods);
    report.put("load_ms_sluice", crate::median(load));
    report.put("enroll_ms_cold_sluice", crate::median(cold));

    // Warm, one pod at a time, interleaved per pod: sluice attaches (and is
    // removed again), then with tcx links, then istio-cni's replica
    // captures the same netns (last: sluice's take-over check would
    // otherwise find its rules and remove them).
    let pods = bare_pods("en", cfg.enroll_pods)?;
    let pins = OwnPins::new("en");
    let tx_pins = OwnPins::new("en-tx");
    let mut dp = Dataplane::load_or_adopt(pins.0.clone())?;
    let mut tx = Dataplane::load_or_adopt(tx_pins.0.clone())?;
    tx.set_tc_attach(TcAttach::Tcx);
    // With `--local-route` (keys `_local_route`), where the kernel offers it.
    let lr_pins = OwnPins::new("en-lr");
    let mut lr = Dataplane::load_or_adopt(lr_pins.0.clone())?;
    let local_route = lr.set_local_route(true);
    dp.set_node(pods.node()?)?;
    tx.set_node(pods.node()?)?;
    lr.set_node(pods.node()?)?;
    let mut t: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for (i, p) in pods.iter().enumerate() {
        let uid = format!("en-{i}");
        t.entry("enroll_sluice")
            .or_default()
            .push(sluice_enroll(&mut dp, &p.name, &uid)?);
        t.entry("teardown_sluice")
            .or_default()
            .push(sluice_unenroll(&mut dp, &uid)?);
        if features.tcx {
            t.entry("enroll_sluice_tcx")
                .or_default()
                .push(sluice_enroll(&mut tx, &p.name, &uid)?);
            t.entry("teardown_sluice_tcx")
                .or_default()
                .push(sluice_unenroll(&mut tx, &uid)?);
        }
        if local_route {
            t.entry("enroll_sluice_local_route")
                .or_default()
                .push(sluice_enroll(&mut lr, &p.name, &uid)?);
            let on = lr.maps().find_uid(&PodUid::new(&uid)?);
            ensure!(
                on.and_then(|c| lr.maps().local_route(c)).is_some(),
                "{} was not put on the local route",
                p.name
            );
            t.entry("teardown_sluice_local_route")
                .or_default()
                .push(sluice_unenroll(&mut lr, &uid)?);
        }
        t.entry("enroll_iptables")
            .or_default()
            .push(istio_cni_enroll(&p.name)?);
    }
    drop(pods);
    report.put("enroll_ms_cold_iptables", t["enroll_iptables"][0]);
    for (k, v) in &t {
        let (what, variant) = k.split_once('_').unwrap();
        put_percentiles(report, what, variant, v);
    }
    report.put(
        "enroll_ratio_iptables_vs_sluice",
        percentile(t["enroll_iptables"].clone(), 0.5) / percentile(t["enroll_sluice"].clone(), 0.5),
    );
    if features.tcx {
        report.put(
            "enroll_ratio_iptables_vs_sluice_tcx",
            percentile(t["enroll_iptables"].clone(), 0.5)
                / percentile(t["enroll_sluice_tcx"].clone(), 0.5),
        );
    }

    // N pods at once, each from a thread of its own, as the agent runs
    // them: attach under the dataplane lock, the take-over check without.
    let n = cfg.concurrent_pods;
    let pods = bare_pods("cc", n)?;
    dp.set_node(pods.node()?)?;
    let shared = Mutex::new(dp);
    let wall = concurrently(&pods, |i, pod| {
        let uid = PodUid::new(&format!("cc-{i}"))?;
        let a = {
            let mut dp = shared.lock().unwrap();
            enroll::attach_pod(
                &mut dp,
                &ns_path(pod),
                &uid,
                &workload(pod),
                &Default::default(),
                &enroll::PodAddrs::Netns,
                // A new pod, as at its CNI ADD.
                enroll::AppStarted::No,
            )?
        };
        enroll::take_over(&a.netns)?;
        Ok(())
    })?;
    report.put(&format!("enroll_{n}_concurrent_s_sluice"), wall);
    let mut dp = shared.into_inner().unwrap();
    for i in 0..n {
        sluice_unenroll(&mut dp, &format!("cc-{i}"))?;
    }
    let wall = concurrently(&pods, |_, pod| istio::apply_istio_cni(pod))?;
    report.put(&format!("enroll_{n}_concurrent_s_iptables"), wall);
    drop(pods);

    rtnl_hold(report, cfg, &mut dp, features.tcx.then_some(&mut tx))?;
    drop((dp, tx, lr));
    Ok(())
}

/// Runs `f` for every pod at once, one thread each, all released together:
/// the wall time (s) until the last is done.
fn concurrently(
    pods: &BarePods,
    f: impl Fn(usize, &str) -> anyhow::Result<()> + Sync,
) -> anyhow::Result<f64> {
    let barrier = Barrier::new(pods.len() + 1);
    std::thread::scope(|s| {
        let threads: Vec<_> = pods
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (f, barrier) = (&f, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    f(i, &p.name)
                })
            })
            .collect();
        barrier.wait();
        let t = Instant::now();
        for th in threads {
            th.join()
                .map_err(|_| anyhow::anyhow!("enrollment thread panicked"))??;
        }
        Ok(t.elapsed().as_secs_f64())
    })
}

/// A loop taking RTNL as often as it can (an `RTM_NEWLINK` setting `lo` up
/// in a netns of the bench's own), recording how long each request takes:
/// while something else holds RTNL, it waits.
pub(crate) struct RtnlProbe {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<anyhow::Result<ProbeRun>>,
}

pub(crate) struct ProbeRun {
    /// Each request's latency, ms.
    pub(crate) lat: Vec<f64>,
    /// Time the probe thread was runnable but not running (waiting for a
    /// CPU, not for RTNL), ms, from its schedstat.
    runqueue_ms: f64,
    /// How long it ran, ms.
    wall_ms: f64,
}

impl ProbeRun {
    /// Time spent waiting for RTNL, ms: each request's latency beyond
    /// `idle_median`, summed, less the time waiting for a CPU.
    pub(crate) fn waited_ms(&self, idle_median: f64) -> f64 {
        let excess: f64 = self.lat.iter().map(|l| (l - idle_median).max(0.0)).sum();
        (excess - self.runqueue_ms).max(0.0)
    }
}

/// The calling thread's time waiting on a run queue, ns (schedstat's second field).
fn runqueue_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

impl RtnlProbe {
    pub(crate) fn start(ns: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = spawn_in(ns, move || -> anyhow::Result<ProbeRun> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()?;
            rt.block_on(async {
                let (conn, handle, _) = rtnetlink::new_connection()?;
                tokio::spawn(conn);
                let lo = nix::net::if_::if_nametoindex("lo")?;
                let mut lat = Vec::new();
                let rq0 = runqueue_ns();
                let start = Instant::now();
                while !s.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    handle
                        .link()
                        .set(rtnetlink::LinkUnspec::new_with_index(lo).up().build())
                        .execute()
                        .await?;
                    lat.push(ms(t));
                }
                let runqueue_ms = (runqueue_ns() - rq0) as f64 / 1e6;
                Ok(ProbeRun {
                    lat,
                    runqueue_ms,
                    wall_ms: ms(start),
                })
            })
        });
        Self { stop, thread }
    }

    pub(crate) fn stop(self) -> anyhow::Result<ProbeRun> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("RTNL probe panicked"))?
    }
}

/// RTNL hold time per enrollment: the RTNL probe runs idle, then while pods
/// are enrolled one after another by each variant; the probe's waiting
/// beyond its idle median, summed, less the time it waited for a CPU
/// rather than for RTNL and less what it waited for at the idle run's rate
/// (others' RTNL use: the rest of the machine), divided by the pods
/// enrolled meanwhile. (An estimate: it misses holds that start and end
/// within one probe request.)
fn rtnl_hold(
    report: &mut Report,
    cfg: &Config,
    dp: &mut Dataplane,
    tx: Option<&mut Dataplane>,
) -> anyhow::Result<()> {
    let probe_ns = format!("slb-rtnl-{}", std::process::id());
    ip(&["netns", "add", &probe_ns])?;
    struct DelNs(String);
    impl Drop for DelNs {
        fn drop(&mut self) {
            let _ = ip(&["netns", "del", &self.0]);
        }
    }
    let _del = DelNs(probe_ns.clone());
    let probe = RtnlProbe::start(&probe_ns);
    std::thread::sleep(cfg.rtnl_idle);
    let idle_run = probe.stop()?;
    let idle = idle_run.lat.clone();
    ensure!(!idle.is_empty(), "the RTNL probe made no request");
    let idle_median = percentile(idle.clone(), 0.5);
    let idle_rate = idle_run.waited_ms(idle_median) / idle_run.wall_ms;
    report.put("rtnl_probe_wait_ms_per_s_idle", idle_rate * 1e3);
    report.put("rtnl_probe_ms_p50_idle", idle_median);
    report.put("rtnl_probe_ms_p99_idle", percentile(idle.clone(), 0.99));
    report.put("rtnl_probe_ms_max_idle", percentile(idle, 1.0));

    let pods = bare_pods("rt", cfg.rtnl_pods)?;
    dp.set_node(pods.node()?)?;
    let n = pods.len() as f64;
    let mut phase =
        |name: &str, f: &mut dyn FnMut(usize, &str) -> anyhow::Result<f64>| -> anyhow::Result<()> {
            let probe = RtnlProbe::start(&probe_ns);
            let mut res = Ok(());
            for (i, p) in pods.iter().enumerate() {
                if let Err(e) = f(i, &p.name) {
                    res = Err(e);
                    break;
                }
            }
            let run = probe.stop()?;
            res?;
            let waited: f64 = run.lat.iter().map(|l| (l - idle_median).max(0.0)).sum();
            report.put(
                &format!("rtnl_ms_per_pod_{name}"),
                (waited - run.runqueue_ms).max(0.0) / n,
            );
            report.put(
                &format!("rtnl_probe_ms_p99_{name}"),
                percentile(run.lat.clone(), 0.99),
            );
            report.put(
                &format!("rtnl_probe_ms_max_{name}"),
                percentile(run.lat, 1.0),
            );
            Ok(())
        };
    phase("sluice", &mut |i, pod| {
        sluice_enroll(dp, pod, &format!("rt-{i}"))
    })?;
    for i in 0..pods.len() {
        sluice_unenroll(dp, &format!("rt-{i}"))?;
    }
    if let Some(tx) = tx {
        tx.set_node(pods.node()?)?;
        phase("sluice_tcx", &mut |i, pod| {
            sluice_enroll(tx, pod, &format!("rt-{i}"))
        })?;
        for i in 0..pods.len() {
            sluice_unenroll(tx, &format!("rt-{i}"))?;
        }
    }
    phase("iptables", &mut |_, pod| istio_cni_enroll(pod))?;
    Ok(())
}

const QUIET: u8 = 1;
const CHURNING: u8 = 2;
const DONE: u8 = 3;

/// Scenario `churn`: pods enrolled and unenrolled at a target rate on the
/// node's dataplane while a steady pod on it carries traffic, in windows
/// alternating with quiet ones: the steady pod's failed connections and
/// connect latency, churning vs quiet. Once with cls_bpf filters (the
/// default) and, where the kernel has tcx, once more with tcx links (keys
/// `_tcx`): they cap the rate far below the target.
pub fn churn(report: &mut Report, cfg: &Config, _rng: &mut StdRng) -> anyhow::Result<()> {
    churn_with(report, cfg, "", TcAttach::ClsBpf)?;
    if Features::get().tcx {
        churn_with(report, cfg, "_tcx", TcAttach::Tcx)?;
    }
    Ok(())
}

/// One steady client: a connection every `every` (not back to back: the
/// steady pod must not take the CPUs the churn needs), from `ns` to `dst`,
/// closed at once; (phase, latency µs or None for a failure) per connection.
fn steady_client(
    ns: &str,
    dst: std::net::SocketAddr,
    every: Duration,
    phase: &AtomicU8,
) -> anyhow::Result<Vec<(u8, Option<f64>)>> {
    sluice_tests::ns::enter(ns)?;
    let mut out = Vec::new();
    let mut next = Instant::now();
    loop {
        let p = phase.load(Ordering::SeqCst);
        if p == DONE {
            return Ok(out);
        }
        let t = Instant::now();
        let ok = TcpStream::connect_timeout(&dst, Duration::from_secs(1)).is_ok();
        if p != 0 {
            out.push((p, ok.then(|| t.elapsed().as_secs_f64() * 1e6)));
        }
        next += every;
        match next.checked_duration_since(Instant::now()) {
            Some(wait) => std::thread::sleep(wait),
            None => next = Instant::now(),
        }
    }
}

fn churn_with(
    report: &mut Report,
    cfg: &Config,
    suffix: &str,
    attach: TcAttach,
) -> anyhow::Result<()> {
    let steady = Setup::with_features(Variant::Sluice, Mode::AcceptClose, None)?;
    let pool = bare_pods("ch", cfg.churn_pool)?;
    let mut dp = Dataplane::load_or_adopt(steady.topo.pins.clone())?;
    dp.set_tc_attach(attach);
    dp.set_node(pool.node()?)?;
    let dp = Mutex::new(dp);
    let phase = AtomicU8::new(0);
    let ticket = AtomicU64::new(0);
    let window_start = Mutex::new(Instant::now());
    let cycles = AtomicU64::new(0);
    let interval = Duration::from_secs_f64(1.0 / cfg.churn_rate);
    let locks: Vec<Mutex<()>> = pool.iter().map(|_| Mutex::new(())).collect();
    // One enroll + unenroll of pool pod `i`, as the agent runs them.
    let cycle = |i: usize| -> anyhow::Result<()> {
        let _held = locks[i].lock().unwrap();
        let pod = &pool[i].name;
        let uid = PodUid::new(&format!("ch-{i}"))?;
        let a = enroll::attach_pod(
            &mut dp.lock().unwrap(),
            &ns_path(pod),
            &uid,
            &workload(pod),
            &Default::default(),
            &enroll::PodAddrs::Netns,
            // A new pod, as at its CNI ADD.
            enroll::AppStarted::No,
        )?;
        enroll::take_over(&a.netns)?;
        let mut d = dp.lock().unwrap();
        let (pins, maps, node) = d.parts_mut();
        enroll::unenroll(pins, maps, node, &uid)?;
        cycles.fetch_add(1, Ordering::SeqCst);
        Ok(())
    };
    type Samples = Vec<(u8, Option<f64>)>;
    let (samples, churn_time, n_cycles) =
        std::thread::scope(|s| -> anyhow::Result<(Samples, Duration, u64)> {
            let workers: Vec<_> = (0..cfg.churn_workers)
                .map(|_| {
                    s.spawn(|| -> anyhow::Result<()> {
                        loop {
                            match phase.load(Ordering::SeqCst) {
                                DONE => return Ok(()),
                                CHURNING => {}
                                _ => {
                                    std::thread::sleep(Duration::from_millis(1));
                                    continue;
                                }
                            }
                            // Ticket k is due k intervals into the window.
                            let k = ticket.fetch_add(1, Ordering::SeqCst);
                            let due = *window_start.lock().unwrap() + interval * k as u32;
                            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                                std::thread::sleep(wait);
                            }
                            if phase.load(Ordering::SeqCst) == CHURNING {
                                cycle(k as usize % locks.len())?;
                            }
                        }
                    })
                })
                .collect();
            let clients: Vec<_> = Dir::ALL
                .iter()
                .map(|d| {
                    let (ns, dst) = (steady.client_ns(*d).to_owned(), steady.dst(*d));
                    let phase = &phase;
                    s.spawn(move || steady_client(&ns, dst, Duration::from_millis(2), phase))
                })
                .collect();
            let mut churn_time = Duration::ZERO;
            std::thread::sleep(Duration::from_millis(300));
            'windows: for _ in 0..cfg.churn_windows {
                for p in [QUIET, CHURNING] {
                    ticket.store(0, Ordering::SeqCst);
                    *window_start.lock().unwrap() = Instant::now();
                    phase.store(p, Ordering::SeqCst);
                    std::thread::sleep(cfg.churn_window);
                    if p == CHURNING {
                        churn_time += cfg.churn_window;
                    }
                    // A worker stops on its first error: end the run then.
                    if workers.iter().any(|w| w.is_finished()) {
                        break 'windows;
                    }
                }
            }
            phase.store(DONE, Ordering::SeqCst);
            let mut errors = Vec::new();
            for w in workers {
                match w.join() {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => errors.push(e),
                    Err(_) => errors.push(anyhow::anyhow!("churn worker panicked")),
                }
            }
            let mut samples = Vec::new();
            for c in clients {
                samples.extend(
                    c.join()
                        .map_err(|_| anyhow::anyhow!("steady client panicked"))??,
                );
            }
            if let Some(e) = errors.into_iter().next() {
                return Err(e.context("churn"));
            }
            Ok((samples, churn_time, cycles.load(Ordering::SeqCst)))
        })?;
    drop(dp);
    let lat = |p: u8| -> Vec<f64> {
        samples
            .iter()
            .filter(|(q, _)| *q == p)
            .filter_map(|(_, l)| *l)
            .collect()
    };
    let failed = |p: u8| {
        samples
            .iter()
            .filter(|(q, l)| *q == p && l.is_none())
            .count()
    };
    let (quiet, churning) = (lat(QUIET), lat(CHURNING));
    ensure!(
        !quiet.is_empty() && !churning.is_empty(),
        "churn: the steady pod made no connection"
    );
    // Every steady connection that succeeded went to the capture listener.
    let ok = samples.iter().filter(|(_, l)| l.is_some()).count() as u64;
    let landed = steady.sink(Dir::Inbound).accepted() + steady.sink(Dir::Outbound).accepted();
    ensure!(
        landed >= ok,
        "churn: {ok} steady connections succeeded, {landed} captured"
    );
    report.put(&format!("churn_target_pods_per_s{suffix}"), cfg.churn_rate);
    report.put(
        &format!("churn_pods_per_s{suffix}"),
        n_cycles as f64 / churn_time.as_secs_f64(),
    );
    report.put(&format!("churn_connections{suffix}"), churning.len() as f64);
    report.put(
        &format!("churn_failed_connections{suffix}"),
        failed(CHURNING) as f64,
    );
    report.put(
        &format!("churn_failed_connections_quiet{suffix}"),
        failed(QUIET) as f64,
    );
    let (pq, pc) = (percentile(quiet, 0.99), percentile(churning, 0.99));
    report.put(&format!("churn_p99_us_quiet{suffix}"), pq);
    report.put(&format!("churn_p99_us_churning{suffix}"), pc);
    report.put(&format!("churn_p99_ratio{suffix}"), pc / pq);
    drop(pool);
    Ok(())
}

/// Scenario `memory`: the agent's RSS and BPF map memory with N pods
/// enrolled through it.
pub fn memory(report: &mut Report, cfg: &Config, _rng: &mut StdRng) -> anyhow::Result<()> {
    let n = cfg.memory_pods;
    let t = Instant::now();
    let pods = bare_pods("mem", n)?;
    eprintln!("bench: memory: {n} pod netns made in {:.1?}", t.elapsed());
    let pins = OwnPins::new("mem");
    let agent = AgentProc::start(&pins.0)?;
    let t = Instant::now();
    for (i, p) in pods.iter().enumerate() {
        let resp = control::call(
            &agent.control,
            Some(pins.0.root()),
            &Request::Enroll {
                netns: ns_path(&p.name),
                uid: format!("mem-{i}"),
                workload: workload(&p.name),
            },
        )?
        .context("agent not listening")?;
        ensure!(
            matches!(resp, control::Response::Enrolled { .. }),
            "enroll through the agent failed: {resp:?}"
        );
    }
    eprintln!("bench: memory: {n} pods enrolled in {:.1?}", t.elapsed());
    let pid = agent_pid(&agent)?;
    let rss_kib = proc_status_kib(pid as u32, "VmRSS:")?;
    let map_bytes = map_memlock(pid)?;
    report.put(&format!("agent_rss_mib_{n}_pods"), rss_kib as f64 / 1024.0);
    report.put(
        &format!("bpf_map_memory_mib_{n}_pods"),
        map_bytes as f64 / (1024.0 * 1024.0),
    );
    let maps = Maps::open_pinned(&pins.0.maps())?;
    ensure!(maps.pods().len() == n);
    drop(agent);
    // The namespaces first: the kernel detaches their links in batches,
    // much faster than unenrolling pod by pod; the pins go after.
    let t = Instant::now();
    drop(pods);
    let netns = t.elapsed();
    drop(pins);
    eprintln!(
        "bench: memory: cleaned up in {:.1?} (netns {netns:.1?})",
        t.elapsed()
    );
    Ok(())
}

fn agent_pid(agent: &AgentProc) -> anyhow::Result<i32> {
    // The agent is the process with the control socket's directory in its argv.
    for e in std::fs::read_dir("/proc")?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd);
        if cmd.contains(&*agent.control.to_string_lossy()) && cmd.contains("agent") {
            return Ok(pid);
        }
    }
    anyhow::bail!("agent process not found")
}

/// Sum of `memlock` over the BPF map fds the agent holds (from fdinfo).
fn map_memlock(pid: i32) -> anyhow::Result<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))?.flatten() {
        let info = std::fs::read_to_string(e.path()).unwrap_or_default();
        if info.contains("map_type:") {
            if let Some(v) = info.lines().find_map(|l| l.strip_prefix("memlock:")) {
                total += v.trim().parse::<u64>().unwrap_or(0);
            }
        }
    }
    Ok(total)
}

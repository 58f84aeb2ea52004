//! `cargo xtask bench`: sluice vs Istio's iptables rules vs no capture, side
//! by side in one run, variants interleaved round by round (A B C A B C …).
//! Writes `target/bench/results.json` and prints a markdown table.
//!
//! Only ratios measured within this run mean anything; absolute numbers
//! depend on the machine and what else it is doing.

use std::{
    collections::BTreeMap,
    io::Write,
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream},
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{ensure, Context as _};
use sluice::served::{fetch, Wanted};
use sluice::{
    control::{self, Request},
    enroll,
    loader::{Dataplane, Pins},
    state::Maps,
    uid::PodUid,
    workload::Workload,
};
use sluice_common::MARK_ZTUNNEL;
use sluice_tests::{
    admin,
    agent::{AgentProc, PeerProc},
    harness::{is_root, peer_bin, REMOTE_PORT},
    inspect::proc_status_kib,
    istio,
    ns::spawn_in,
    sink::{Mode, Sink},
    topology::{ip, Family, Topology},
    wait,
};

const ROUNDS: usize = 5;
const RATE_WINDOW: Duration = Duration::from_millis(1500);
const CLIENTS: usize = 2;
const LATENCY_SAMPLES: usize = 1000;
const ENROLL_PODS: usize = 100;
const SCALE_PODS: usize = 500;
const MEMORY_PODS: usize = 250;
/// Workloads in the mesh ztunnel's config_dump lists (scenario 8).
const MESH_WORKLOADS: usize = 10_000;
const SERVED_CHECKS: usize = 20;
const SERVED_PODS: usize = 5;
const APP_PORT: u16 = 8080;
const BULK_PORT: u16 = 9999;

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Variant {
    None,
    Iptables,
    Sluice,
}

impl Variant {
    const ALL: [Variant; 3] = [Variant::None, Variant::Iptables, Variant::Sluice];
    fn name(self) -> &'static str {
        match self {
            Variant::None => "none",
            Variant::Iptables => "iptables",
            Variant::Sluice => "sluice",
        }
    }
}

/// One topology set up for a variant: the client netns, the pod netns, and
/// the same accept-and-close sinks behind whatever redirection is in place.
struct Setup {
    variant: Variant,
    topo: Topology,
    _sinks: Vec<Sink>,
}

impl Setup {
    fn new(variant: Variant) -> anyhow::Result<Self> {
        let topo = Topology::new(&format!("b{}", &variant.name()[..1]))?;
        let mut sinks = vec![
            // The uncaptured destinations: the app in the pod, the remote server.
            Sink::plain(&topo.pod, APP_PORT, Mode::AcceptClose),
            Sink::plain(&topo.client, REMOTE_PORT, Mode::AcceptClose),
            Sink::plain(&topo.client, BULK_PORT, Mode::Discard),
        ];
        if variant != Variant::None {
            for port in [15001, 15006, 15008] {
                sinks.push(Sink::ztunnel_like(&topo.pod, port, Mode::AcceptClose));
            }
        }
        match variant {
            Variant::None => {}
            Variant::Iptables => istio::apply(&topo.pod)?,
            Variant::Sluice => enroll_enabled(&topo, "bench-pod")?,
        }
        for ns in [&topo.client, &topo.pod] {
            tune(ns)?;
        }
        Ok(Self {
            variant,
            topo,
            _sinks: sinks,
        })
    }
}

/// Enrolls the topology's pod as `name`, with ztunnel's listeners there.
fn enroll_enabled(topo: &Topology, name: &str) -> anyhow::Result<()> {
    let mut dp = Dataplane::load_or_adopt(topo.pins.clone())?;
    let uid = PodUid::new(name)?;
    let e = enroll::enroll(&mut dp, &topo.pod_netns_path(), &uid, &workload(name))?;
    ensure!(
        e.state == sluice_common::PodState::Enabled,
        "bench pod not Enabled: {e:?}"
    );
    Ok(())
}

fn workload(name: &str) -> Workload {
    Workload::new(name, "bench", "default").expect("valid workload")
}

/// Room for many short connections: wide port range, TIME_WAIT reuse.
fn tune(ns: &str) -> anyhow::Result<()> {
    let ns = ns.to_owned();
    sluice_tests::ns::run_in(&ns, || -> std::io::Result<()> {
        std::fs::write("/proc/sys/net/ipv4/ip_local_port_range", "10000 65000")?;
        std::fs::write("/proc/sys/net/ipv4/tcp_tw_reuse", "1")?;
        Ok(())
    })?;
    Ok(())
}

/// Connections per second from `clients` threads in `ns` to `dst` over `window`.
fn rate(ns: &str, dst: SocketAddr, window: Duration) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (stop, done) = (stop.clone(), done.clone());
            spawn_in(ns, move || {
                while !stop.load(Ordering::Relaxed) {
                    if TcpStream::connect_timeout(&dst, Duration::from_secs(2)).is_ok() {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    let start = Instant::now();
    std::thread::sleep(window);
    stop.store(true, Ordering::Relaxed);
    let n = done.load(Ordering::Relaxed);
    let secs = start.elapsed().as_secs_f64();
    for t in threads {
        let _ = t.join();
    }
    n as f64 / secs
}

/// `n` sequential connect() latencies (µs) from `ns` to `dst`.
fn latencies(ns: &str, dst: SocketAddr, n: usize) -> Vec<f64> {
    spawn_in(ns, move || {
        (0..n)
            .filter_map(|_| {
                let t = Instant::now();
                let ok = TcpStream::connect_timeout(&dst, Duration::from_secs(2)).is_ok();
                ok.then(|| t.elapsed().as_secs_f64() * 1e6)
            })
            .collect()
    })
    .join()
    .unwrap_or_default()
}

/// Bytes/s of one bulk flow marked 0x539 (never captured) from the pod.
fn bulk(ns: &str, dst: SocketAddr, window: Duration) -> f64 {
    spawn_in(ns, move || {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
        s.set_mark(MARK_ZTUNNEL).ok()?;
        s.connect(&dst.into()).ok()?;
        let mut s: TcpStream = s.into();
        let buf = vec![0u8; 256 * 1024];
        let start = Instant::now();
        let mut sent = 0u64;
        while start.elapsed() < window {
            sent += s.write(&buf).ok()? as u64;
        }
        Some(sent as f64 / start.elapsed().as_secs_f64())
    })
    .join()
    .ok()
    .flatten()
    .unwrap_or(0.0)
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

/// Median over rounds of the per-round ratio a/b.
fn ratio(per_round: &[BTreeMap<Variant, f64>], a: Variant, b: Variant) -> f64 {
    median(per_round.iter().map(|r| r[&a] / r[&b]).collect())
}

struct Report {
    results: BTreeMap<String, f64>,
}

impl Report {
    fn put(&mut self, k: &str, v: f64) {
        self.results
            .insert(k.to_owned(), (v * 1000.0).round() / 1000.0);
    }
}

fn main() -> anyhow::Result<()> {
    ensure!(
        is_root(),
        "the benchmarks need root (network namespaces, eBPF, iptables)"
    );
    let mut report = Report {
        results: BTreeMap::new(),
    };
    // SLUICE_BENCH=name[,name…] runs only some scenarios (for profiling).
    let only = std::env::var("SLUICE_BENCH").ok();
    let wanted = |name: &str| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|n| n == name))
    };
    let t0 = Instant::now();
    type Scenario = fn(&mut Report) -> anyhow::Result<()>;
    let scenarios: [(&str, Scenario); 6] = [
        ("connections", connection_scenarios),
        ("dns", dns_queries),
        ("enroll", enrollment),
        ("scale", scale),
        ("memory", memory),
        ("served", served),
    ];
    for (name, run) in scenarios {
        if wanted(name) {
            run(&mut report)?;
            eprintln!("bench: {name} done at {:.0?}", t0.elapsed());
        }
    }
    write(&report)
}

/// Scenarios 1–4: rates, latency, uncaptured throughput, interleaved.
fn connection_scenarios(report: &mut Report) -> anyhow::Result<()> {
    let setups: Vec<Setup> = Variant::ALL
        .iter()
        .map(|v| Setup::new(*v))
        .collect::<Result<_, _>>()?;
    let pod = SocketAddr::new(Family::V4.pod(), APP_PORT);
    let remote = SocketAddr::new(Family::V4.client(), REMOTE_PORT);
    let bulk_dst = SocketAddr::new(Family::V4.client(), BULK_PORT);
    let (mut inbound, mut outbound, mut throughput) = (Vec::new(), Vec::new(), Vec::new());
    let mut lat: BTreeMap<Variant, Vec<f64>> = BTreeMap::new();
    // A short warm-up pass, not counted: the first connections in a fresh
    // netns pay for cold caches and allocations.
    for s in &setups {
        rate(&s.topo.client, pod, Duration::from_millis(300));
        rate(&s.topo.pod, remote, Duration::from_millis(300));
    }
    for round in 0..ROUNDS {
        let (mut i, mut o, mut t) = (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
        for s in &setups {
            i.insert(s.variant, rate(&s.topo.client, pod, RATE_WINDOW));
            o.insert(s.variant, rate(&s.topo.pod, remote, RATE_WINDOW));
            lat.entry(s.variant).or_default().extend(latencies(
                &s.topo.client,
                pod,
                LATENCY_SAMPLES,
            ));
            if s.variant != Variant::Iptables {
                t.insert(
                    s.variant,
                    bulk(&s.topo.pod, bulk_dst, Duration::from_millis(700)),
                );
            }
        }
        eprintln!("bench: round {} inbound {i:?} outbound {o:?}", round + 1);
        inbound.push(i);
        outbound.push(o);
        throughput.push(t);
    }
    for (dir, rounds) in [("inbound", &inbound), ("outbound", &outbound)] {
        for v in Variant::ALL {
            report.put(
                &format!("{dir}_rate_per_s_{}", v.name()),
                median(rounds.iter().map(|r| r[&v]).collect()),
            );
        }
        report.put(
            &format!("{dir}_rate_ratio_sluice_vs_none"),
            ratio(rounds, Variant::Sluice, Variant::None),
        );
        report.put(
            &format!("{dir}_rate_ratio_iptables_vs_none"),
            ratio(rounds, Variant::Iptables, Variant::None),
        );
        report.put(
            &format!("{dir}_rate_ratio_sluice_vs_iptables"),
            ratio(rounds, Variant::Sluice, Variant::Iptables),
        );
    }
    for (v, samples) in &lat {
        report.put(
            &format!("connect_p50_us_{}", v.name()),
            percentile(samples.clone(), 0.50),
        );
        report.put(
            &format!("connect_p99_us_{}", v.name()),
            percentile(samples.clone(), 0.99),
        );
    }
    report.put(
        "p99_ratio_sluice_vs_none",
        percentile(lat[&Variant::Sluice].clone(), 0.99)
            / percentile(lat[&Variant::None].clone(), 0.99),
    );
    report.put(
        "uncaptured_throughput_ratio",
        ratio(&throughput, Variant::Sluice, Variant::None),
    );
    report.put(
        "uncaptured_throughput_gbit_s_none",
        median(
            throughput
                .iter()
                .map(|r| r[&Variant::None] * 8.0 / 1e9)
                .collect(),
        ),
    );
    Ok(())
}

/// A pod netns with ztunnel's DNS proxy (the stand-in, answering itself)
/// behind each variant's DNS capture, and its capture listeners.
struct DnsSetup {
    variant: Variant,
    _proxy: sluice_tests::dns::Server,
    _sinks: Vec<Sink>,
    topo: Topology,
}

impl DnsSetup {
    fn new(variant: Variant) -> anyhow::Result<Self> {
        let topo = Topology::new(&format!("d{}", &variant.name()[..1]))?;
        let resolver = SocketAddr::new(Family::V4.client(), 53);
        let proxy = sluice_tests::dns::proxy(&topo.pod, resolver);
        let sinks = [15001, 15006, 15008]
            .into_iter()
            .map(|port| Sink::ztunnel_like(&topo.pod, port, Mode::AcceptClose))
            .collect();
        match variant {
            Variant::None => {}
            Variant::Iptables => istio::apply_with_dns_capture(&topo.pod)?,
            // DNS capture is on by default.
            Variant::Sluice => enroll_enabled(&topo, "bench-dns")?,
        }
        Ok(Self {
            variant,
            _proxy: proxy,
            _sinks: sinks,
            topo,
        })
    }

    /// Where the app sends its queries: the resolver (captured to the
    /// proxy), or, with no capture, the proxy itself.
    fn server(&self) -> SocketAddr {
        match self.variant {
            Variant::None => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 15053),
            _ => SocketAddr::new(Family::V4.client(), 53),
        }
    }
}

/// Scenario: DNS queries per second from one connected UDP socket, through
/// capture to the DNS proxy (sluice, Istio's rules) vs straight to the same
/// proxy (none), interleaved round by round.
fn dns_queries(report: &mut Report) -> anyhow::Result<()> {
    let setups: Vec<DnsSetup> = Variant::ALL
        .iter()
        .map(|v| DnsSetup::new(*v))
        .collect::<Result<_, _>>()?;
    let rate = |s: &DnsSetup, window| {
        sluice_tests::dns::query_rate(&s.topo.pod, s.server(), "a.proxy.test", window)
            .with_context(|| format!("DNS queries, {}", s.variant.name()))
    };
    for s in &setups {
        rate(s, Duration::from_millis(300))?;
    }
    let mut rounds = Vec::new();
    for round in 0..ROUNDS {
        let mut r = BTreeMap::new();
        for s in &setups {
            r.insert(s.variant, rate(s, RATE_WINDOW)?);
        }
        eprintln!("bench: round {} dns {r:?}", round + 1);
        rounds.push(r);
    }
    for v in Variant::ALL {
        report.put(
            &format!("dns_queries_per_s_{}", v.name()),
            median(rounds.iter().map(|r| r[&v]).collect()),
        );
    }
    report.put(
        "dns_rate_ratio_sluice_vs_direct",
        ratio(&rounds, Variant::Sluice, Variant::None),
    );
    report.put(
        "dns_rate_ratio_iptables_vs_direct",
        ratio(&rounds, Variant::Iptables, Variant::None),
    );
    report.put(
        "dns_rate_ratio_sluice_vs_iptables",
        ratio(&rounds, Variant::Sluice, Variant::Iptables),
    );
    Ok(())
}

/// Pod netns for enrollment and scale: a netns with one interface and address.
struct BarePod {
    name: String,
}

/// The bare pods of a scenario and the "node" netns holding their veth peers,
/// as on a real node; all deleted on drop (also when a scenario fails).
struct BarePods(Vec<BarePod>, String);

impl std::ops::Deref for BarePods {
    type Target = [BarePod];
    fn deref(&self) -> &[BarePod] {
        &self.0
    }
}

impl Drop for BarePods {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = ip(&["netns", "del", &p.name]);
        }
        let _ = ip(&["netns", "del", &self.1]);
    }
}

fn bare_pods(tag: &str, n: usize) -> anyhow::Result<BarePods> {
    let node = format!("slb-{tag}-{}-node", std::process::id());
    ip(&["netns", "add", &node])?;
    let mut pods = BarePods(Vec::with_capacity(n), node.clone());
    for i in 0..n {
        let name = format!("slb-{tag}-{}-{i}", std::process::id());
        ip(&["netns", "add", &name])?;
        pods.0.push(BarePod { name: name.clone() });
        let addr = IpAddr::V4(Ipv4Addr::new(
            10,
            210 + (i / 65536) as u8,
            (i / 256 % 256) as u8,
            (i % 256) as u8,
        ));
        let host_end = format!("veth{i}");
        ip(&[
            "-n", &node, "link", "add", &host_end, "type", "veth", "peer", "name", "eth0", "netns",
            &name,
        ])?;
        ip(&[
            "-n",
            &name,
            "addr",
            "add",
            &format!("{addr}/32"),
            "dev",
            "eth0",
        ])?;
        ip(&["-n", &name, "link", "set", "eth0", "up"])?;
        ip(&["-n", &name, "link", "set", "lo", "up"])?;
    }
    Ok(pods)
}

fn ns_path(name: &str) -> PathBuf {
    PathBuf::from(format!("/run/netns/{name}"))
}

/// Per-pod times of the enrollment scenario, ms.
#[derive(Default)]
struct Timings {
    /// As sluice attaches on this kernel: tcx links where it has them.
    tcx: Vec<f64>,
    tcx_teardown: Vec<f64>,
    /// As cls_bpf filters, where that is not the default (kernels with tcx).
    cls_bpf: Vec<f64>,
    cls_bpf_teardown: Vec<f64>,
    iptables: Vec<f64>,
}

/// Scenario 5: capture setup for N pods, sluice (as it attaches on this
/// kernel, and on a kernel with tcx also with the cls_bpf filters of kernels
/// without it) vs iptables-restore + routes.
fn enrollment(report: &mut Report) -> anyhow::Result<()> {
    let pods = bare_pods("en", ENROLL_PODS)?;
    let result = (|| -> anyhow::Result<()> {
        let pins = Pins::new(format!("/sys/fs/bpf/sluice-bench-{}", std::process::id()));
        let nl_pins = Pins::new(format!(
            "/sys/fs/bpf/sluice-bench-nl-{}",
            std::process::id()
        ));
        // Loading is once per node, not per pod: not part of the per-pod cost.
        let features = sluice::features::Features::get();
        let mut dp = Dataplane::load_or_adopt(pins.clone())?;
        // The same programs attached as cls_bpf filters (kernels without tcx),
        // where the kernel has tcx for the default.
        let no_tcx = sluice::features::Features {
            tcx: false,
            ..features
        };
        let mut nl = Dataplane::load_or_adopt_with(nl_pins.clone(), no_tcx)?;
        let mut ms = Timings::default();
        // Interleaved per pod: sluice attaches as it does on this kernel (and
        // is removed again), then with cls_bpf filters if that is not the
        // same, then Istio's rules go into the same netns the way istio-cni
        // applies them.
        for (i, p) in pods.iter().enumerate() {
            let uid = PodUid::new(&format!("en-{i}"))?;
            let mut variants = vec![(&mut dp, &mut ms.tcx, &mut ms.tcx_teardown)];
            if features.tcx {
                variants.push((&mut nl, &mut ms.cls_bpf, &mut ms.cls_bpf_teardown));
            }
            for (dp, enroll_ms, teardown_ms) in variants {
                let t = Instant::now();
                let a = enroll::attach_pod(
                    dp,
                    &ns_path(&p.name),
                    &uid,
                    &workload(&p.name),
                    &Default::default(),
                )?;
                // The agent's enrollment checks for istio-cni's rules too.
                enroll::take_over(&a.netns)?;
                enroll_ms.push(t.elapsed().as_secs_f64() * 1e3);
                let t = Instant::now();
                enroll::unenroll(&dp.pins, &mut dp.maps, dp.node.as_ref(), &uid)?;
                teardown_ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
            let t = Instant::now();
            istio::apply(&p.name)?;
            ms.iptables.push(t.elapsed().as_secs_f64() * 1e3);
        }
        drop((dp, nl));
        enroll::uninstall(&pins, None)?;
        enroll::uninstall(&nl_pins, None)?;
        let (s, i): (f64, f64) = (ms.tcx.iter().sum(), ms.iptables.iter().sum());
        report.put("enroll_time_ratio_iptables_vs_sluice", i / s);
        report.put("enroll_total_ms_sluice", s);
        report.put("enroll_total_ms_iptables", i);
        for (key, v) in [
            ("sluice", ms.tcx),
            ("iptables", ms.iptables),
            ("sluice_cls_bpf", ms.cls_bpf),
        ] {
            if v.is_empty() {
                continue;
            }
            report.put(&format!("enroll_p50_ms_{key}"), percentile(v.clone(), 0.5));
            report.put(&format!("enroll_p99_ms_{key}"), percentile(v, 0.99));
        }
        for (key, v) in [
            ("sluice", ms.tcx_teardown),
            ("sluice_cls_bpf", ms.cls_bpf_teardown),
        ] {
            if v.is_empty() {
                continue;
            }
            report.put(
                &format!("teardown_p50_ms_{key}"),
                percentile(v.clone(), 0.5),
            );
            report.put(&format!("teardown_p99_ms_{key}"), percentile(v, 0.99));
        }
        Ok(())
    })();
    drop(pods);
    result
}

/// Scenario 6: inbound rate to a pod sharing the node's maps with 499 other
/// enrolled pods vs a pod alone in its own set of maps, both on this node and
/// measured interleaved. Per-connection work is per-netns or O(1) map
/// lookups; this shows whether map population changes that.
fn scale(report: &mut Report) -> anyhow::Result<()> {
    let alone = Setup::new(Variant::Sluice)?;
    let crowded = Setup::new(Variant::Sluice)?;
    let others = bare_pods("sc", SCALE_PODS - 1)?;
    let result = (|| -> anyhow::Result<()> {
        let mut dp = Dataplane::load_or_adopt(crowded.topo.pins.clone())?;
        for (i, p) in others.iter().enumerate() {
            let uid = PodUid::new(&format!("sc-{i}"))?;
            enroll::attach_pod(
                &mut dp,
                &ns_path(&p.name),
                &uid,
                &workload(&p.name),
                &Default::default(),
            )?;
        }
        ensure!(
            dp.maps.pods().len() == SCALE_PODS,
            "expected {SCALE_PODS} pods enrolled"
        );
        let pod = SocketAddr::new(Family::V4.pod(), APP_PORT);
        let mut ratios = Vec::new();
        for _ in 0..ROUNDS {
            let one = rate(&alone.topo.client, pod, RATE_WINDOW);
            let many = rate(&crowded.topo.client, pod, RATE_WINDOW);
            ratios.push(many / one);
        }
        report.put("rate_ratio_500_vs_1_pods", median(ratios));
        Ok(())
    })();
    drop(others);
    result
}

/// Scenario 7: the agent's RSS and BPF map memory with 250 pods enrolled.
fn memory(report: &mut Report) -> anyhow::Result<()> {
    let pins = Pins::new(format!(
        "/sys/fs/bpf/sluice-bench-mem-{}",
        std::process::id()
    ));
    let pods = bare_pods("mem", MEMORY_PODS)?;
    let result = (|| -> anyhow::Result<()> {
        let agent = AgentProc::start(&pins)?;
        for (i, p) in pods.iter().enumerate() {
            let resp = control::call(
                &agent.control,
                Some(pins.root()),
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
        let pid = agent_pid(&agent)?;
        let rss_kib = proc_status_kib(pid as u32, "VmRSS:")?;
        let map_bytes = map_memlock(pid)?;
        report.put("agent_rss_mib_250_pods", rss_kib as f64 / 1024.0);
        report.put(
            "bpf_map_memory_mib_250_pods",
            map_bytes as f64 / (1024.0 * 1024.0),
        );
        let maps = Maps::open_pinned(&pins.maps())?;
        ensure!(maps.pods().len() == MEMORY_PODS);
        Ok(())
    })();
    let _ = enroll::uninstall(&pins, None);
    drop(pods);
    result
}

/// Scenario 8: the served check against a ztunnel whose config_dump lists
/// 10,000 workloads: the cost of one check in the agent (wall time, CPU of
/// this process, which does exactly what the agent does: enter ztunnel's
/// netns, GET, parse as it streams) and, through a real agent, the time from
/// enrollment to Served as the pinned map records it.
fn served(report: &mut Report) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("sluice-bench-served-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let pods = bare_pods("sv", SERVED_PODS)?;
    let result = served_in(report, &dir, &pods);
    drop(pods);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn served_in(report: &mut Report, dir: &std::path::Path, pods: &BarePods) -> anyhow::Result<()> {
    // The mesh: 10,000 workloads, the bench pods among the last ones.
    let mut mesh: Vec<serde_json::Value> = (0..MESH_WORKLOADS - SERVED_PODS)
        .map(|i| {
            let ip = IpAddr::V4(Ipv4Addr::new(
                10,
                100 + (i / 65536) as u8,
                (i / 256 % 256) as u8,
                (i % 256) as u8,
            ));
            admin::workload(
                &format!("ns-{}", i % 100),
                &format!("w-{i}"),
                "default",
                &[ip],
            )
        })
        .collect();
    for (i, p) in pods.0.iter().enumerate() {
        let ip = IpAddr::V4(Ipv4Addr::new(10, 210, 0, i as u8));
        mesh.push(admin::workload("bench", &p.name, "default", &[ip]));
    }
    let file = dir.join("workloads.json");
    std::fs::write(&file, serde_json::to_vec(&mesh)?)?;
    report.put(
        "config_dump_mib_10k_workloads",
        admin::dump(mesh).len() as f64 / (1024.0 * 1024.0),
    );

    // One check, as the agent makes it, against a ztunnel stand-in with no
    // agent to talk to (it only serves its admin API).
    let mut peer = PeerProc::start(
        &peer_bin(),
        &dir.join("no-agent.sock"),
        &["--admin-workloads", file.to_str().unwrap()],
    )?;
    let pid = peer.pid().context("peer pid")? as i32;
    let wanted = [Wanted {
        namespace: "bench".into(),
        name: pods.0[0].name.clone(),
        service_account: "default".into(),
        ips: vec![IpAddr::V4(Ipv4Addr::new(10, 210, 0, 0))],
    }];
    wait::until("the admin stand-in to answer", wait::DEADLINE, || {
        fetch::known(Some(pid), fetch::DEFAULT_ADMIN_PORT, &wanted, None).map_err(|e| e.to_string())
    })?;
    let (mut wall, cpu0) = (Vec::new(), cpu_ms_self());
    for _ in 0..SERVED_CHECKS {
        let t = Instant::now();
        let known = fetch::known(Some(pid), fetch::DEFAULT_ADMIN_PORT, &wanted, None)?;
        wall.push(t.elapsed().as_secs_f64() * 1e3);
        ensure!(known.len() == 1, "the pod not found among 10k workloads");
    }
    report.put(
        "served_check_cpu_ms_10k_workloads",
        (cpu_ms_self() - cpu0) / SERVED_CHECKS as f64,
    );
    report.put("served_check_ms_10k_workloads", percentile(wall, 0.5));
    peer.kill();

    // Enrollment to Served through a real agent and that ztunnel stand-in.
    let pins = Pins::new(format!(
        "/sys/fs/bpf/sluice-bench-sv-{}",
        std::process::id()
    ));
    let result = (|| -> anyhow::Result<()> {
        let agent = AgentProc::start(&pins)?;
        let _peer = PeerProc::start(
            &peer_bin(),
            &agent.zds,
            &["--admin-workloads", file.to_str().unwrap()],
        )?;
        wait::until(
            "the stand-in connected",
            wait::DEADLINE,
            || match control::call(&agent.control, Some(pins.root()), &Request::Status) {
                Ok(Some(control::Response::Node(n))) if n.ztunnel_connected => Ok(()),
                other => Err(format!("{other:?}")),
            },
        )?;
        let mut ms = Vec::new();
        for (i, p) in pods.0.iter().enumerate() {
            let uid = format!("sv-{i}");
            let resp = control::call(
                &agent.control,
                Some(pins.root()),
                &Request::Enroll {
                    netns: ns_path(&p.name),
                    uid: uid.clone(),
                    workload: workload(&p.name),
                },
            )?
            .context("agent not listening")?;
            ensure!(
                matches!(resp, control::Response::Enrolled { .. }),
                "{resp:?}"
            );
            let maps = Maps::open_pinned(&pins.maps())?;
            let e = wait::until("the pod Served", wait::DEADLINE, || {
                let cookie = maps.find_uid(&PodUid::new(&uid).map_err(|e| e.to_string())?);
                match cookie.and_then(|c| maps.entry(c)) {
                    Some(e) if e.state() == Some(sluice_common::PodState::Served) => Ok(e),
                    other => Err(format!("{other:?}")),
                }
            })?;
            ms.push((e.changed_at_ns - e.enrolled_at_ns) as f64 / 1e6);
        }
        report.put(
            "time_to_served_ms_p50_10k_workloads",
            percentile(ms.clone(), 0.5),
        );
        report.put("time_to_served_ms_max_10k_workloads", percentile(ms, 1.0));
        Ok(())
    })();
    let _ = enroll::uninstall(&pins, None);
    result
}

/// CPU time (user + system) this process has used, in ms.
fn cpu_ms_self() -> f64 {
    let r = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF);
    r.map(|r| {
        let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 * 1e3 + tv.tv_usec() as f64 / 1e3;
        t(r.user_time()) + t(r.system_time())
    })
    .unwrap_or(0.0)
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

fn write(report: &Report) -> anyhow::Result<()> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&dir)?;
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")?
        .trim()
        .to_owned();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")?
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_default();
    let json = serde_json::json!({
        "kernel": kernel,
        "kernel_features": sluice::features::Features::get().summary(),
        "cpu": cpu,
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "rounds": ROUNDS,
        "results": report.results,
    });
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    println!("| figure | value |\n|---|---|");
    for (k, v) in &report.results {
        println!("| {k} | {v} |");
    }
    println!(
        "\nkernel {kernel} ({}), {cpu}; results in target/bench/results.json",
        sluice::features::Features::get().summary()
    );
    Ok(())
}

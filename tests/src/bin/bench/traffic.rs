//! Scenarios on one captured pod per variant: CPU per connection, connect
//! latency, request/response, bulk, and the 500-vs-1-pods rate.

use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{ensure, Context as _};
use rand::{rngs::StdRng, seq::SliceRandom};
use sluice::{dataplane::loader::Dataplane, podnet::enroll, uid::PodUid};
use sluice_common::MARK_ZTUNNEL;
use sluice_tests::{
    harness::{APP_PORT, REMOTE_PORT},
    istio,
    ns::spawn_in,
    sink::{Mode, Sink},
    topology::{Family, Topology},
};

use crate::{
    enroll_enabled, mean_ci95, median, percentile, pods::bare_pods, ratio, workload, Config, Dir,
    Report, Variant,
};

const BULK_PORT: u16 = 9999;
/// ztunnel's in-pod listeners: outbound, inbound plaintext, HBONE.
const OUTBOUND_PORT: u16 = 15001;
const INBOUND_PORT: u16 = 15006;
const HBONE_PORT: u16 = 15008;

/// One pod for a variant: a client netns and a pod netns, ztunnel-like
/// listeners (the same sinks in every variant) on 15001/15006/15008 in the
/// pod, whatever capture the variant has, and a discard sink for the
/// uncaptured flow in the client netns. No app or remote server listens:
/// a connection that capture missed is refused, and counted as failed.
pub struct Setup {
    pub variant: Variant,
    inbound: Sink,
    outbound: Sink,
    _hbone: Sink,
    _bulk: Sink,
    // Last: dropped after the listeners, it removes the namespaces.
    pub topo: Topology,
}

impl Setup {
    pub fn new(variant: Variant, mode: Mode) -> anyhow::Result<Self> {
        Self::with_features(variant, mode, None)
    }

    /// Same, sluice's programs attached as on a kernel with `features`.
    pub fn with_features(
        variant: Variant,
        mode: Mode,
        features: Option<sluice::dataplane::features::Features>,
    ) -> anyhow::Result<Self> {
        Self::make(variant, mode, features)
    }

    fn make(
        variant: Variant,
        mode: Mode,
        features: Option<sluice::dataplane::features::Features>,
    ) -> anyhow::Result<Self> {
        let topo = Topology::new(&format!("b{}", &variant.name()[..1]))?;
        let s = Self {
            variant,
            inbound: Sink::ztunnel_like(&topo.pod, INBOUND_PORT, mode),
            outbound: Sink::ztunnel_like(&topo.pod, OUTBOUND_PORT, mode),
            _hbone: Sink::ztunnel_like(&topo.pod, HBONE_PORT, mode),
            _bulk: Sink::plain(&topo.client, BULK_PORT, Mode::Discard),
            topo,
        };
        match variant {
            Variant::None => {}
            Variant::Iptables => istio::apply_istio_cni(&s.topo.pod)?,
            Variant::Sluice => enroll_enabled(&s.topo, "bench-pod", features, false)?,
            Variant::LocalRoute => enroll_enabled(&s.topo, "bench-pod", features, true)?,
            Variant::Hooks => pass_filters(&s.topo.pod)?,
        }
        for ns in [&s.topo.client, &s.topo.pod] {
            tune(ns)?;
        }
        Ok(s)
    }

    /// The netns the connecting side runs in.
    pub fn client_ns(&self, dir: Dir) -> &str {
        match dir {
            Dir::Inbound => &self.topo.client,
            Dir::Outbound => &self.topo.pod,
        }
    }

    /// Where the connecting side connects: with capture, the app's port on
    /// the pod (inbound) or a remote server (outbound); without, straight to
    /// the listener capture would have delivered to (the pod's own address
    /// for outbound, over lo as captured outbound goes too).
    pub fn dst(&self, dir: Dir) -> SocketAddr {
        let pod = Family::V4.pod();
        match (self.variant, dir) {
            (Variant::None | Variant::Hooks, Dir::Inbound) => SocketAddr::new(pod, INBOUND_PORT),
            (Variant::None | Variant::Hooks, Dir::Outbound) => SocketAddr::new(pod, OUTBOUND_PORT),
            (_, Dir::Inbound) => SocketAddr::new(pod, APP_PORT),
            (_, Dir::Outbound) => SocketAddr::new(Family::V4.client(), REMOTE_PORT),
        }
    }

    /// The listener a connection in `dir` must end at.
    pub fn sink(&self, dir: Dir) -> &Sink {
        match dir {
            Dir::Inbound => &self.inbound,
            Dir::Outbound => &self.outbound,
        }
    }
}

/// A setup per variant, indexed by `Variant as usize`.
fn setups(variants: &[Variant], mode: Mode) -> anyhow::Result<Vec<Setup>> {
    variants.iter().map(|v| Setup::new(*v, mode)).collect()
}

/// Every (variant, direction) pair, in a random order.
fn shuffled(rng: &mut StdRng) -> Vec<(Variant, Dir)> {
    shuffled_of(&Variant::ALL, rng)
}

fn shuffled_of(variants: &[Variant], rng: &mut StdRng) -> Vec<(Variant, Dir)> {
    let mut order: Vec<_> = variants
        .iter()
        .flat_map(|v| Dir::ALL.iter().map(move |d| (*v, *d)))
        .collect();
    order.shuffle(rng);
    order
}

/// In pod netns `ns`, a clsact qdisc and a filter that matches nothing (a
/// classic BPF `ret #0`: the packet goes on) on each hook sluice's programs
/// use there: `eth0` ingress and egress, `lo` ingress.
fn pass_filters(ns: &str) -> anyhow::Result<()> {
    for (dev, hook) in [("eth0", "ingress"), ("eth0", "egress"), ("lo", "ingress")] {
        if hook == "ingress" {
            sluice_tests::ns::exec(ns, &["tc", "qdisc", "add", "dev", dev, "clsact"])?;
        }
        sluice_tests::ns::exec(
            ns,
            &[
                "tc",
                "filter",
                "add",
                "dev",
                dev,
                hook,
                "prio",
                "1",
                "protocol",
                "all",
                "bpf",
                "bytecode",
                "1,6 0 0 0,",
            ],
        )?;
    }
    Ok(())
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

/// Waits (briefly) until `sink` has accepted `want` connections in all,
/// and fails if it does not: connections that did not end at the listener
/// capture should have delivered them to were not measured as meant.
fn landed(sink: &Sink, want: u64, what: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while sink.accepted() < want && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    ensure!(
        sink.accepted() >= want,
        "{what}: {} of {want} connections reached the listener",
        sink.accepted()
    );
    Ok(())
}

/// `n` connect() calls one after another from `ns` to `dst`, each closed at
/// once: the latency of each successful one (µs) and the failures.
fn connects(ns: &str, dst: SocketAddr, n: usize) -> (Vec<f64>, usize) {
    spawn_in(ns, move || {
        let mut lat = Vec::with_capacity(n);
        let mut failed = 0;
        for _ in 0..n {
            let t = Instant::now();
            match TcpStream::connect_timeout(&dst, Duration::from_secs(2)) {
                Ok(_) => lat.push(t.elapsed().as_secs_f64() * 1e6),
                Err(_) => failed += 1,
            }
        }
        (lat, failed)
    })
    .join()
    .unwrap_or_default()
}

/// Runs `n` connections in `dir` on `s` and checks they all landed.
fn connect_batch(s: &Setup, dir: Dir, n: usize) -> anyhow::Result<Vec<f64>> {
    let before = s.sink(dir).accepted();
    let (lat, failed) = connects(s.client_ns(dir), s.dst(dir), n);
    let what = format!("{} {}", s.variant.name(), dir.name());
    ensure!(failed == 0, "{what}: {failed} of {n} connections failed");
    landed(s.sink(dir), before + n as u64, &what)?;
    Ok(lat)
}

/// CPU time counters, read before and after a batch of connections.
#[derive(Clone, Copy)]
struct CpuSnap {
    /// This process (every thread: clients, listeners), ns.
    process_ns: u64,
    /// The ksoftirqd threads (softirq work deferred out of our threads), ns.
    ksoftirqd_ns: u64,
    /// Every CPU busy (user, nice, system, irq, softirq), from /proc/stat, ns.
    system_ns: u64,
}

fn ksoftirqd_pids() -> Vec<u32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.starts_with("ksoftirqd/") {
            pids.push(pid);
        }
    }
    pids
}

fn cpu_snap(ksoftirqd: &[u32]) -> CpuSnap {
    let process_ns = nix::time::clock_gettime(nix::time::ClockId::CLOCK_PROCESS_CPUTIME_ID)
        .map_or(0, |t| {
            t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
        });
    // /proc/<pid>/schedstat: time on CPU (ns) first.
    let ksoftirqd_ns = ksoftirqd
        .iter()
        .filter_map(|p| {
            std::fs::read_to_string(format!("/proc/{p}/schedstat"))
                .ok()?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal …
    let busy: u64 = [0, 1, 2, 5, 6].iter().filter_map(|i| ticks.get(*i)).sum();
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .unwrap_or(100) as u64;
    CpuSnap {
        process_ns,
        ksoftirqd_ns,
        system_ns: busy * 1_000_000_000 / hz,
    }
}

/// Scenario `cpu`: the CPU a captured connection costs on top of the same
/// connection uncaptured, inbound and outbound, for sluice and istio-cni's
/// rules. Rounds of one batch per variant and direction in a random order;
/// per round the uncaptured batch's CPU per connection is subtracted from
/// each captured one's; mean and 95 % CI over rounds. Then, with BPF run
/// time statistics on, each sluice program's time per run.
pub fn cpu(report: &mut Report, cfg: &Config, rng: &mut StdRng) -> anyhow::Result<()> {
    let mut variants = vec![
        Variant::None,
        Variant::Iptables,
        Variant::Sluice,
        Variant::Hooks,
    ];
    if Variant::local_route_offered() {
        variants.push(Variant::LocalRoute);
    }
    let setups = setups(&variants, Mode::AcceptClose)?;
    let softirqd = ksoftirqd_pids();
    for s in &setups {
        for d in Dir::ALL {
            connect_batch(s, d, cfg.cpu_conns / 10)?;
        }
    }
    // Per (variant, direction): per round, µs per connection.
    let mut own: BTreeMap<(Variant, Dir), Vec<f64>> = BTreeMap::new();
    let mut system: BTreeMap<(Variant, Dir), Vec<f64>> = BTreeMap::new();
    for round in 0..cfg.cpu_rounds {
        for (v, d) in shuffled_of(&variants, rng) {
            let s = &setups[v as usize];
            let a = cpu_snap(&softirqd);
            connect_batch(s, d, cfg.cpu_conns)?;
            let b = cpu_snap(&softirqd);
            let n = cfg.cpu_conns as f64;
            let per = |x: u64, y: u64| (y.saturating_sub(x)) as f64 / 1e3 / n;
            own.entry((v, d))
                .or_default()
                .push(per(a.process_ns, b.process_ns) + per(a.ksoftirqd_ns, b.ksoftirqd_ns));
            system
                .entry((v, d))
                .or_default()
                .push(per(a.system_ns, b.system_ns));
        }
        eprintln!(
            "bench: cpu round {} µs/conn {:?}",
            round + 1,
            own.iter()
                .map(|((v, d), x)| (
                    format!("{}-{}", v.name(), d.name()),
                    (x[round] * 10.0).round() / 10.0
                ))
                .collect::<Vec<_>>()
        );
    }
    for d in Dir::ALL {
        let dn = d.name();
        let (base, base_ci) = mean_ci95(&own[&(Variant::None, d)]);
        report.put(&format!("cpu_us_per_conn_{dn}_none"), base);
        report.put(&format!("cpu_us_per_conn_{dn}_none_ci95"), base_ci);
        let mut added = BTreeMap::new();
        for &v in variants.iter().filter(|v| **v != Variant::None) {
            let vn = v.name();
            for (suffix, m) in [("", &own), ("_systemwide", &system)] {
                let diff: Vec<f64> = m[&(v, d)]
                    .iter()
                    .zip(&m[&(Variant::None, d)])
                    .map(|(x, b)| x - b)
                    .collect();
                let (mean, ci) = mean_ci95(&diff);
                report.put(&format!("cpu_us_per_conn_{dn}_{vn}{suffix}"), mean);
                report.put(&format!("cpu_us_per_conn_{dn}_{vn}{suffix}_ci95"), ci);
                if suffix.is_empty() {
                    added.insert(v, (mean, ci));
                }
            }
        }
        // A ratio only where sluice's added CPU is told apart from nothing.
        let (s, s_ci) = added[&Variant::Sluice];
        let (i, _) = added[&Variant::Iptables];
        report.put(
            &format!("cpu_ratio_iptables_vs_sluice_{dn}"),
            if s > s_ci { i / s } else { f64::NAN },
        );
    }
    bpf_run_time(report, cfg, &setups[Variant::Sluice as usize])
}

/// Each sluice program's run time per run (BPF_ENABLE_STATS, on only while
/// this runs: it costs every BPF program two clock reads), and the BPF time
/// per connection in each direction.
fn bpf_run_time(report: &mut Report, cfg: &Config, s: &Setup) -> anyhow::Result<()> {
    let read = || program_stats(s);
    let _stats =
        aya::sys::enable_stats(aya::sys::Stats::RunTime).context("BPF_ENABLE_STATS (run time)")?;
    let mut total: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for d in Dir::ALL {
        let a = read()?;
        connect_batch(s, d, cfg.bpf_conns)?;
        let b = read()?;
        let mut ns = 0;
        for (name, (t1, c1)) in &b {
            let (t0, c0) = a.get(name).copied().unwrap_or_default();
            let e = total.entry(name.clone()).or_default();
            e.0 += t1 - t0;
            e.1 += c1 - c0;
            ns += t1 - t0;
        }
        report.put(
            &format!("bpf_ns_per_conn_{}", d.name()),
            ns as f64 / cfg.bpf_conns as f64,
        );
    }
    for (name, (t, c)) in total {
        if c > 0 {
            report.put(&format!("bpf_ns_per_run_{name}"), t as f64 / c as f64);
            report.put(
                &format!("bpf_runs_per_conn_{name}"),
                c as f64 / (2 * cfg.bpf_conns) as f64,
            );
        }
    }
    Ok(())
}

/// Each pinned sluice program's (run time ns, run count), by its name less
/// `sluice_` (counted only while BPF_ENABLE_STATS is on).
fn program_stats(s: &Setup) -> anyhow::Result<BTreeMap<String, (u64, u64)>> {
    let mut m = BTreeMap::new();
    for e in std::fs::read_dir(s.topo.pins.progs())? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let info = aya::programs::ProgramInfo::from_pin(e.path())
            .with_context(|| format!("program info of {name}"))?;
        let short = name.strip_prefix("sluice_").unwrap_or(&name).to_owned();
        m.insert(short, (info.run_time().as_nanos() as u64, info.run_count()));
    }
    Ok(m)
}

/// Scenario `latency`: connect() latency, one connection at a time, every
/// variant and direction once per round in a random order; percentiles
/// over all rounds' samples. sluice on the local route too (keys
/// `_sluice_local_route`), where the kernel offers it.
pub fn latency(report: &mut Report, cfg: &Config, rng: &mut StdRng) -> anyhow::Result<()> {
    let mut variants = Variant::ALL.to_vec();
    if Variant::local_route_offered() {
        variants.push(Variant::LocalRoute);
    }
    let setups: BTreeMap<Variant, Setup> = variants
        .iter()
        .map(|v| Ok((*v, Setup::new(*v, Mode::AcceptClose)?)))
        .collect::<anyhow::Result<_>>()?;
    for s in setups.values() {
        for d in Dir::ALL {
            connect_batch(s, d, cfg.lat_samples / 4)?;
        }
    }
    let mut lat: BTreeMap<(Variant, Dir), Vec<f64>> = BTreeMap::new();
    for _ in 0..cfg.lat_rounds {
        for (v, d) in shuffled_of(&variants, rng) {
            let l = connect_batch(&setups[&v], d, cfg.lat_samples)?;
            lat.entry((v, d)).or_default().extend(l);
        }
    }
    let p = |v, d, q| percentile(lat[&(v, d)].clone(), q);
    for ((v, d), samples) in &lat {
        let k = format!("{}_{}", d.name(), v.name());
        report.put(
            &format!("connect_us_p50_{k}"),
            percentile(samples.clone(), 0.5),
        );
        report.put(
            &format!("connect_us_p99_{k}"),
            percentile(samples.clone(), 0.99),
        );
        report.put(
            &format!("connect_us_p999_{k}"),
            percentile(samples.clone(), 0.999),
        );
    }
    for (d, suffix) in [(Dir::Inbound, ""), (Dir::Outbound, "_outbound")] {
        for v in variants.iter().copied().filter(|v| *v != Variant::None) {
            report.put(
                &format!("p99_ratio_{}_vs_none{suffix}", v.name()),
                p(v, d, 0.99) / p(Variant::None, d, 0.99),
            );
        }
    }
    Ok(())
}

/// One connection from `ns` to `dst`, 1 KiB written and echoed back at a
/// time for `window`: the round-trip times (µs).
fn echo_rounds(ns: &str, dst: SocketAddr, window: Duration) -> anyhow::Result<Vec<f64>> {
    spawn_in(ns, move || -> anyhow::Result<Vec<f64>> {
        let mut c = TcpStream::connect_timeout(&dst, Duration::from_secs(2))?;
        c.set_nodelay(true)?;
        c.set_read_timeout(Some(Duration::from_secs(2)))?;
        let req = [0x5au8; 1024];
        let mut resp = [0u8; 1024];
        let mut rtt = Vec::new();
        let start = Instant::now();
        while start.elapsed() < window {
            let t = Instant::now();
            c.write_all(&req)?;
            c.read_exact(&mut resp)?;
            rtt.push(t.elapsed().as_secs_f64() * 1e6);
        }
        Ok(rtt)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("echo client panicked"))?
}

/// Scenario `rr`: 1 KiB request/response over one connection through
/// capture (to the same echoing listener uncaptured), rounds in a random
/// order: requests per second and round-trip percentiles.
pub fn request_response(report: &mut Report, cfg: &Config, rng: &mut StdRng) -> anyhow::Result<()> {
    let setups = setups(&Variant::ALL, Mode::Echo)?;
    let mut rtt: BTreeMap<(Variant, Dir), Vec<f64>> = BTreeMap::new();
    let mut rounds: Vec<BTreeMap<(Variant, Dir), f64>> = Vec::new();
    for _ in 0..cfg.rr_rounds {
        let mut r = BTreeMap::new();
        for (v, d) in shuffled(rng) {
            let s = &setups[v as usize];
            let before = s.sink(d).accepted();
            let t = Instant::now();
            let l = echo_rounds(s.client_ns(d), s.dst(d), cfg.rr_window)
                .with_context(|| format!("rr {} {}", v.name(), d.name()))?;
            r.insert((v, d), l.len() as f64 / t.elapsed().as_secs_f64());
            landed(s.sink(d), before + 1, "rr")?;
            rtt.entry((v, d)).or_default().extend(l);
        }
        rounds.push(r);
    }
    for ((v, d), l) in &rtt {
        let k = format!("{}_{}", d.name(), v.name());
        report.put(
            &format!("rr_per_s_{k}"),
            median(rounds.iter().map(|r| r[&(*v, *d)]).collect()),
        );
        report.put(&format!("rr_us_p50_{k}"), percentile(l.clone(), 0.5));
        report.put(&format!("rr_us_p99_{k}"), percentile(l.clone(), 0.99));
    }
    for d in Dir::ALL {
        for v in [Variant::Sluice, Variant::Iptables] {
            report.put(
                &format!("rr_rate_ratio_{}_vs_none_{}", v.name(), d.name()),
                ratio(&rounds, (v, d), (Variant::None, d)),
            );
        }
    }
    Ok(())
}

/// What one bulk flow measured: its rate and what TCP says it sent with.
struct Flow {
    bytes_per_s: f64,
    /// What was written in all.
    bytes: u64,
    /// `tcpi_snd_mss`: the payload of each segment the sender cuts.
    snd_mss: u32,
}

/// Writes to `dst` from `ns` for `window`; `mss` caps the segment size the
/// client asks for (`TCP_MAXSEG`).
fn bulk_flow(
    ns: &str,
    dst: SocketAddr,
    window: Duration,
    mark: Option<u32>,
    mss: Option<u32>,
) -> Option<Flow> {
    spawn_in(ns, move || {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
        if let Some(m) = mark {
            s.set_mark(m).ok()?;
        }
        if let Some(m) = mss {
            s.set_mss(m).ok()?;
        }
        s.connect_timeout(&dst.into(), Duration::from_secs(2))
            .ok()?;
        let mut s: TcpStream = s.into();
        let buf = vec![0u8; 256 * 1024];
        let start = Instant::now();
        let mut sent = 0u64;
        while start.elapsed() < window {
            sent += s.write(&buf).ok()? as u64;
        }
        let bytes_per_s = sent as f64 / start.elapsed().as_secs_f64();
        Some(Flow {
            bytes_per_s,
            bytes: sent,
            snd_mss: tcp_info(&s)?.tcpi_snd_mss,
        })
    })
    .join()
    .ok()
    .flatten()
}

fn tcp_info(s: &TcpStream) -> Option<libc::tcp_info> {
    use std::os::fd::AsRawFd;
    // SAFETY: tcp_info is plain data, for which all zeroes is a value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` outlives the call, and the kernel writes at most `len`
    // bytes (its size) to it.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(info)
}

/// The segment size a captured outbound flow is sent with: its route is the
/// pod's `eth0` (a veth, MTU 1500) less the IPv4 and TCP headers, while the
/// uncaptured variant's flow crosses `lo` (MTU 65536).
const POD_MSS: u32 = 1460;

/// One measurement of the `bulk` scenario.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Bulk {
    /// Through a variant's capture (`none`: straight to the listener).
    Flow(Variant, Dir),
    /// `none` outbound, its client asking for the captured flow's MSS:
    /// what a flow routed as the captured one is costs without capture.
    NoneAtPodMss,
    /// sluice outbound, the pod's TCP on the local route (`--local-route`).
    LocalRoute,
}

/// Scenario `bulk`: one bulk flow through capture in each direction (to the
/// same discarding listener uncaptured, also at the captured flow's MSS),
/// rounds in a random order; then [`uncaptured`]. Then, with BPF run-time stats
/// on, one captured outbound flow: how often each program ran per MiB and
/// what a run cost (the per-packet share of the capture's cost). Besides,
/// sluice outbound with the pod's TCP on the local route, where the kernel
/// offers it.
pub fn bulk(report: &mut Report, cfg: &Config, rng: &mut StdRng) -> anyhow::Result<()> {
    let setups = setups(&Variant::ALL, Mode::Discard)?;
    let local = match Variant::local_route_offered() {
        true => Some(Setup::new(Variant::LocalRoute, Mode::Discard)?),
        false => None,
    };
    let mut rounds: Vec<BTreeMap<Bulk, f64>> = Vec::new();
    let mut mss: BTreeMap<Bulk, u32> = BTreeMap::new();
    for _ in 0..cfg.bulk_rounds {
        let mut r = BTreeMap::new();
        let mut order: Vec<Bulk> = shuffled(rng)
            .into_iter()
            .map(|(v, d)| Bulk::Flow(v, d))
            .chain([Bulk::NoneAtPodMss])
            .chain(local.as_ref().map(|_| Bulk::LocalRoute))
            .collect();
        order.shuffle(rng);
        for case in order {
            let flow = match case {
                Bulk::Flow(v, d) => {
                    let s = &setups[v as usize];
                    let before = s.sink(d).accepted();
                    let flow = bulk_flow(s.client_ns(d), s.dst(d), cfg.bulk_window, None, None);
                    landed(s.sink(d), before + 1, "bulk")?;
                    flow
                }
                Bulk::NoneAtPodMss => {
                    let s = &setups[Variant::None as usize];
                    let d = Dir::Outbound;
                    let before = s.sink(d).accepted();
                    let flow = bulk_flow(
                        s.client_ns(d),
                        s.dst(d),
                        cfg.bulk_window,
                        None,
                        Some(POD_MSS),
                    );
                    landed(s.sink(d), before + 1, "bulk")?;
                    flow
                }
                Bulk::LocalRoute => {
                    let s = local.as_ref().context("no local route setup")?;
                    let d = Dir::Outbound;
                    let before = s.sink(d).accepted();
                    let flow = bulk_flow(s.client_ns(d), s.dst(d), cfg.bulk_window, None, None);
                    landed(s.sink(d), before + 1, "bulk over the local route")?;
                    flow
                }
            };
            let flow = flow.filter(|f| f.bytes_per_s > 0.0);
            let flow = flow.with_context(|| format!("bulk flow {case:?} failed"))?;
            r.insert(case, flow.bytes_per_s);
            mss.insert(case, flow.snd_mss);
        }
        rounds.push(r);
    }
    report_bulk(report, &rounds, &mss, local.is_some());
    uncaptured(report, cfg, rng, &setups)?;
    bulk_bpf_runs(
        report,
        cfg,
        &setups[Variant::Sluice as usize],
        local.as_ref(),
    )
}

/// The `bulk` rounds' keys: medians over rounds (Gbit/s, per-round
/// ratios) and each flow's MSS.
fn report_bulk(
    report: &mut Report,
    rounds: &[BTreeMap<Bulk, f64>],
    mss: &BTreeMap<Bulk, u32>,
    local: bool,
) {
    let gbit = |k| median(rounds.iter().map(|r| r[&k] * 8.0 / 1e9).collect());
    for v in Variant::ALL {
        for d in Dir::ALL {
            let k = format!("{}_{}", d.name(), v.name());
            report.put(&format!("bulk_gbit_s_{k}"), gbit(Bulk::Flow(v, d)));
            report.put(
                &format!("bulk_snd_mss_{k}"),
                f64::from(mss[&Bulk::Flow(v, d)]),
            );
        }
    }
    for d in Dir::ALL {
        for v in [Variant::Sluice, Variant::Iptables] {
            report.put(
                &format!("bulk_ratio_{}_vs_none_{}", v.name(), d.name()),
                ratio(rounds, Bulk::Flow(v, d), Bulk::Flow(Variant::None, d)),
            );
        }
    }
    report.put(
        "bulk_gbit_s_outbound_none_at_pod_mss",
        gbit(Bulk::NoneAtPodMss),
    );
    report.put(
        "bulk_snd_mss_outbound_none_at_pod_mss",
        f64::from(mss[&Bulk::NoneAtPodMss]),
    );
    report.put(
        "bulk_ratio_none_at_pod_mss_vs_none_outbound",
        ratio(
            rounds,
            Bulk::NoneAtPodMss,
            Bulk::Flow(Variant::None, Dir::Outbound),
        ),
    );
    report.put(
        "bulk_ratio_sluice_vs_none_at_pod_mss_outbound",
        ratio(
            rounds,
            Bulk::Flow(Variant::Sluice, Dir::Outbound),
            Bulk::NoneAtPodMss,
        ),
    );
    if local {
        report.put(
            "bulk_gbit_s_outbound_sluice_local_route",
            gbit(Bulk::LocalRoute),
        );
        report.put(
            "bulk_snd_mss_outbound_sluice_local_route",
            f64::from(mss[&Bulk::LocalRoute]),
        );
        report.put(
            "bulk_ratio_sluice_local_route_vs_none_outbound",
            ratio(
                rounds,
                Bulk::LocalRoute,
                Bulk::Flow(Variant::None, Dir::Outbound),
            ),
        );
    }
}

/// A flow capture lets through (ztunnel's mark 0x539, to a server beside
/// the pod), on each variant's pod, in rounds of its own (the variants in a
/// random order): `uncaptured_throughput_ratio[_iptables]`, the mean over
/// rounds of the round's ratio to `none`, with its 95 % CI (`_ci95`). Its
/// own rounds because the target (0.99) is finer than one flow's spread on
/// a small machine: more of them than of the other flows.
fn uncaptured(
    report: &mut Report,
    cfg: &Config,
    rng: &mut StdRng,
    setups: &[Setup],
) -> anyhow::Result<()> {
    let dst = SocketAddr::new(Family::V4.client(), BULK_PORT);
    let mut rounds: Vec<BTreeMap<Variant, f64>> = Vec::new();
    for _ in 0..cfg.uncaptured_rounds {
        let mut order = Variant::ALL.to_vec();
        order.shuffle(rng);
        let mut r = BTreeMap::new();
        for v in order {
            let pod = &setups[v as usize].topo.pod;
            let flow = bulk_flow(pod, dst, cfg.bulk_window, Some(MARK_ZTUNNEL), None)
                .filter(|f| f.bytes_per_s > 0.0)
                .with_context(|| format!("uncaptured bulk flow on the {} pod failed", v.name()))?;
            r.insert(v, flow.bytes_per_s);
        }
        rounds.push(r);
    }
    report.put(
        "uncaptured_throughput_gbit_s_none",
        median(
            rounds
                .iter()
                .map(|r| r[&Variant::None] * 8.0 / 1e9)
                .collect(),
        ),
    );
    for (v, key) in [
        (Variant::Sluice, "uncaptured_throughput_ratio"),
        (Variant::Iptables, "uncaptured_throughput_ratio_iptables"),
    ] {
        let per_round: Vec<f64> = rounds.iter().map(|r| r[&v] / r[&Variant::None]).collect();
        let (mean, ci) = mean_ci95(&per_round);
        report.put(key, mean);
        report.put(&format!("{key}_ci95"), ci);
    }
    Ok(())
}

/// With BPF run-time stats on, one captured outbound bulk flow and one
/// uncaptured: per sluice program, runs per MiB sent and ns per run, the
/// programs' time per MiB (`bulk_bpf_ns_per_mib_{outbound,uncaptured}`) and
/// their share of a core at the flow's rate (`bulk_bpf_core_pct_*`).
fn bulk_bpf_runs(
    report: &mut Report,
    cfg: &Config,
    s: &Setup,
    local: Option<&Setup>,
) -> anyhow::Result<()> {
    let _stats =
        aya::sys::enable_stats(aya::sys::Stats::RunTime).context("BPF_ENABLE_STATS (run time)")?;
    let uncaptured_dst = SocketAddr::new(Family::V4.client(), BULK_PORT);
    let local = local.map(|l| {
        (
            "outbound_local_route",
            l,
            &l.topo.pod[..],
            l.dst(Dir::Outbound),
            None,
        )
    });
    for (case, s, ns, dst, mark) in [
        (
            "outbound",
            s,
            s.client_ns(Dir::Outbound),
            s.dst(Dir::Outbound),
            None,
        ),
        (
            "uncaptured",
            s,
            &s.topo.pod[..],
            uncaptured_dst,
            Some(MARK_ZTUNNEL),
        ),
    ]
    .into_iter()
    .chain(local)
    {
        let before = program_stats(s)?;
        let flow = bulk_flow(ns, dst, cfg.bulk_window, mark, None)
            .with_context(|| format!("bulk flow {case} with stats failed"))?;
        let after = program_stats(s)?;
        let mib = flow.bytes as f64 / (1024.0 * 1024.0);
        let mut total = 0;
        for (name, (t1, c1)) in &after {
            let (t0, c0) = before.get(name).copied().unwrap_or_default();
            total += t1 - t0;
            if c1 > &c0 {
                report.put(
                    &format!("bulk_bpf_runs_per_mib_{case}_{name}"),
                    (c1 - c0) as f64 / mib,
                );
                report.put(
                    &format!("bulk_bpf_ns_per_run_{case}_{name}"),
                    (t1 - t0) as f64 / (c1 - c0) as f64,
                );
            }
        }
        let ns_per_mib = total as f64 / mib;
        report.put(&format!("bulk_bpf_ns_per_mib_{case}"), ns_per_mib);
        // The programs' share of one core at the flow's own rate: what the
        // capture's per-packet work takes from the flow, at most (the runs
        // are spread over the sender's and the receiver's cores).
        let mib_per_s = flow.bytes_per_s / (1024.0 * 1024.0);
        report.put(
            &format!("bulk_bpf_core_pct_{case}"),
            ns_per_mib * mib_per_s / 1e9 * 100.0,
        );
    }
    Ok(())
}

/// Connections per second from 2 threads in `ns` to `dst` over `window`.
fn rate(ns: &str, dst: SocketAddr, window: Duration) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..2)
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

/// Scenario `scale`: inbound rate to a pod sharing the node's maps with
/// N−1 other enrolled pods vs a pod alone in its own set of maps, both on
/// this node and measured interleaved. Per-connection work is per-netns or
/// O(1) map lookups; this shows whether map population changes that.
pub fn scale(report: &mut Report, cfg: &Config, _rng: &mut StdRng) -> anyhow::Result<()> {
    let n = cfg.scale_pods;
    let alone = Setup::new(Variant::Sluice, Mode::AcceptClose)?;
    let crowded = Setup::new(Variant::Sluice, Mode::AcceptClose)?;
    let others = bare_pods("sc", n - 1)?;
    let mut dp = Dataplane::load_or_adopt(crowded.topo.pins.clone())?;
    for (i, p) in others.iter().enumerate() {
        let uid = PodUid::new(&format!("sc-{i}"))?;
        enroll::attach_pod(
            &mut dp,
            &crate::ns_path(&p.name),
            &uid,
            &workload(&p.name),
            &Default::default(),
            &enroll::PodAddrs::Netns,
            // A new pod, as at its CNI ADD.
            enroll::AppStarted::No,
        )?;
    }
    ensure!(dp.maps().pods().len() == n, "expected {n} pods enrolled");
    let mut ratios = Vec::new();
    for _ in 0..cfg.scale_rounds {
        let b = (alone.inbound.accepted(), crowded.inbound.accepted());
        let one = rate(&alone.topo.client, alone.dst(Dir::Inbound), cfg.rate_window);
        let many = rate(
            &crowded.topo.client,
            crowded.dst(Dir::Inbound),
            cfg.rate_window,
        );
        ensure!(
            alone.inbound.accepted() > b.0 && crowded.inbound.accepted() > b.1,
            "scale: connections not captured"
        );
        ratios.push(many / one);
    }
    report.put(&format!("rate_ratio_{n}_vs_1_pods"), median(ratios));
    Ok(())
}

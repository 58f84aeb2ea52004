//! `cargo xtask bench`: sluice vs a replica of istio-cni's in-pod iptables
//! capture vs no capture, side by side in one run. Writes
//! `target/bench/results.json` (flat numbers, keys documented in
//! docs/PERFORMANCE.md) and prints a markdown table.
//!
//! Scenarios (`SLUICE_BENCH=cpu,latency,…` selects some, default all):
//! `cpu` (added CPU per captured connection, BPF run time per program),
//! `latency` (connect-only latency), `rr` (1 KiB request/response), `bulk`
//! (bulk through capture, and uncaptured), `enroll` (per-pod enrollment
//! cold and warm, concurrent, RTNL hold time), `churn` (enroll/unenroll
//! while steady pods carry traffic), `scale` (500 vs 1 pods), `memory`
//! (agent RSS and map memory at 1,000 pods), `dns`, `served`, `isolation`
//! (a neighbour's hints and DNS answers while one pod floods), `verify`
//! (verifying a pod's capture), `exclusions` (a pod's exclusions per SYN).
//!
//! `SLUICE_BENCH_SMOKE=1` shrinks every count (a quick check that the bench
//! works, not figures); `SLUICE_BENCH_SEED=<u64>` fixes the seed of the
//! randomised round order (printed either way).
//!
//! Only comparisons measured within this run mean anything; absolute numbers
//! depend on the machine and what else it is doing.

mod dns;
mod exclusions;
mod isolation;
mod pods;
mod served;
mod traffic;
mod verify;

use std::{collections::BTreeMap, path::PathBuf, time::Duration, time::Instant};

use anyhow::ensure;
use rand::{rngs::StdRng, SeedableRng};
use sluice::{dataplane::loader::Dataplane, podnet::enroll, uid::PodUid, workload::Workload};
use sluice_tests::{harness::is_root, topology::Topology};

/// How many of everything a run does. [`Config::full`] is what the figures in
/// docs/PERFORMANCE.md come from; [`Config::smoke`] only checks that the bench
/// works.
#[derive(Debug, Clone)]
pub struct Config {
    pub smoke: bool,
    pub seed: u64,
    /// `cpu`: rounds (each measures every variant and direction once, in a
    /// random order) and connections per measurement.
    pub cpu_rounds: usize,
    pub cpu_conns: usize,
    /// `cpu`: connections per direction with BPF run-time stats on.
    pub bpf_conns: usize,
    /// `latency`: rounds, and connect() samples per variant, direction and round.
    pub lat_rounds: usize,
    pub lat_samples: usize,
    /// `rr` and `bulk`: rounds and the length of one measurement.
    pub rr_rounds: usize,
    pub rr_window: Duration,
    pub bulk_rounds: usize,
    pub bulk_window: Duration,
    /// `bulk`: rounds of the flows capture lets through (finer target).
    pub uncaptured_rounds: usize,
    /// `enroll`: pods enrolled one by one (each variant), cold samples
    /// (fresh program load each), pods enrolled at once, pods per RTNL phase.
    pub enroll_pods: usize,
    pub cold_reps: usize,
    pub concurrent_pods: usize,
    pub rtnl_pods: usize,
    pub rtnl_idle: Duration,
    /// `churn`: target rate, pool of churned pods, windows of each kind.
    pub churn_rate: f64,
    pub churn_pool: usize,
    pub churn_workers: usize,
    pub churn_windows: usize,
    pub churn_window: Duration,
    /// `scale`, `memory`.
    pub scale_pods: usize,
    pub scale_rounds: usize,
    pub memory_pods: usize,
    /// `dns`: rounds and window (as before).
    pub dns_rounds: usize,
    pub rate_window: Duration,
    /// `served`.
    pub mesh_workloads: usize,
    pub served_checks: usize,
    /// `served`: pods enrolled at once, as at a node's start.
    pub served_burst: usize,
    /// `verify`: pods verified, and passes over all of them.
    pub verify_pods: usize,
    pub verify_passes: usize,
    /// `isolation`: the flood's length, the neighbour's kept-hint
    /// connections and DNS queries.
    pub flood_window: Duration,
    pub isolation_conns: usize,
    pub isolation_queries: usize,
}

impl Config {
    fn full(seed: u64) -> Self {
        Self {
            smoke: false,
            seed,
            cpu_rounds: 15,
            cpu_conns: 10_000,
            bpf_conns: 10_000,
            lat_rounds: 15,
            lat_samples: 2_000,
            rr_rounds: 5,
            rr_window: Duration::from_secs(1),
            bulk_rounds: 5,
            bulk_window: Duration::from_secs(1),
            uncaptured_rounds: 15,
            enroll_pods: 200,
            cold_reps: 5,
            concurrent_pods: 100,
            rtnl_pods: 30,
            rtnl_idle: Duration::from_secs(2),
            churn_rate: 100.0,
            churn_pool: 40,
            churn_workers: 8,
            churn_windows: 3,
            churn_window: Duration::from_secs(3),
            scale_pods: 500,
            scale_rounds: 5,
            memory_pods: 1_000,
            dns_rounds: 5,
            rate_window: Duration::from_millis(1500),
            mesh_workloads: 10_000,
            served_checks: 20,
            served_burst: 110,
            verify_pods: 250,
            verify_passes: 5,
            flood_window: Duration::from_secs(1),
            isolation_conns: 200,
            isolation_queries: 10,
        }
    }

    fn smoke(seed: u64) -> Self {
        Self {
            smoke: true,
            cpu_rounds: 3,
            cpu_conns: 1_000,
            bpf_conns: 1_000,
            lat_rounds: 3,
            lat_samples: 200,
            rr_rounds: 2,
            rr_window: Duration::from_millis(200),
            bulk_rounds: 2,
            bulk_window: Duration::from_millis(200),
            uncaptured_rounds: 2,
            enroll_pods: 10,
            cold_reps: 2,
            concurrent_pods: 10,
            rtnl_pods: 5,
            rtnl_idle: Duration::from_millis(300),
            churn_pool: 10,
            churn_windows: 1,
            churn_window: Duration::from_secs(1),
            scale_pods: 20,
            scale_rounds: 2,
            memory_pods: 20,
            dns_rounds: 2,
            rate_window: Duration::from_millis(300),
            mesh_workloads: 1_000,
            served_checks: 3,
            served_burst: 10,
            verify_pods: 5,
            verify_passes: 1,
            flood_window: Duration::from_millis(300),
            isolation_conns: 20,
            isolation_queries: 3,
            ..Self::full(seed)
        }
    }

    fn json(&self) -> serde_json::Value {
        let ms = |d: Duration| d.as_millis() as u64;
        serde_json::json!({
            "smoke": self.smoke,
            "seed": self.seed,
            "cpu_rounds": self.cpu_rounds,
            "cpu_conns": self.cpu_conns,
            "bpf_conns": self.bpf_conns,
            "lat_rounds": self.lat_rounds,
            "lat_samples": self.lat_samples,
            "rr_rounds": self.rr_rounds,
            "rr_window_ms": ms(self.rr_window),
            "bulk_rounds": self.bulk_rounds,
            "bulk_window_ms": ms(self.bulk_window),
            "uncaptured_rounds": self.uncaptured_rounds,
            "enroll_pods": self.enroll_pods,
            "cold_reps": self.cold_reps,
            "concurrent_pods": self.concurrent_pods,
            "rtnl_pods": self.rtnl_pods,
            "churn_rate": self.churn_rate,
            "churn_pool": self.churn_pool,
            "churn_windows": self.churn_windows,
            "churn_window_ms": ms(self.churn_window),
            "scale_pods": self.scale_pods,
            "memory_pods": self.memory_pods,
            "dns_rounds": self.dns_rounds,
            "mesh_workloads": self.mesh_workloads,
            "served_burst": self.served_burst,
        })
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum Variant {
    None,
    Iptables,
    Sluice,
    /// Uncaptured, with a pass-through filter on each tc hook sluice's
    /// programs use in the pod: what the hooks cost without the programs'
    /// work (`cpu` only, to split sluice's added CPU).
    Hooks,
    /// sluice with the pod's TCP on the local route (`--local-route`;
    /// `cpu` and `bulk`, where the kernel offers it).
    LocalRoute,
}

impl Variant {
    pub const ALL: [Variant; 3] = [Variant::None, Variant::Iptables, Variant::Sluice];

    /// Whether this kernel offers the local route (Linux ≥ 6.15).
    pub fn local_route_offered() -> bool {
        sluice::dataplane::features::Features::get().netns_cookie_in_tc
    }
    pub fn name(self) -> &'static str {
        match self {
            Variant::None => "none",
            Variant::Iptables => "iptables",
            Variant::Sluice => "sluice",
            Variant::Hooks => "hooks",
            Variant::LocalRoute => "sluice_local_route",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum Dir {
    Inbound,
    Outbound,
}

impl Dir {
    pub const ALL: [Dir; 2] = [Dir::Inbound, Dir::Outbound];
    pub fn name(self) -> &'static str {
        match self {
            Dir::Inbound => "inbound",
            Dir::Outbound => "outbound",
        }
    }
}

pub struct Report {
    pub results: BTreeMap<String, f64>,
}

impl Report {
    pub fn put(&mut self, k: &str, v: f64) {
        // Three decimals; NaN (no meaningful value) becomes JSON null.
        self.results
            .insert(k.to_owned(), (v * 1000.0).round() / 1000.0);
    }
}

pub fn median(v: Vec<f64>) -> f64 {
    percentile(v, 0.5)
}

/// The `p` quantile of `v` (nearest rank on the sorted samples).
pub fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

/// Mean of `v` and the half-width of its 95 % confidence interval
/// (Student's t, the samples taken as independent: one per round).
pub fn mean_ci95(v: &[f64]) -> (f64, f64) {
    let n = v.len();
    if n == 0 {
        return (f64::NAN, f64::NAN);
    }
    let mean = v.iter().sum::<f64>() / n as f64;
    if n < 2 {
        return (mean, f64::NAN);
    }
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (mean, t975(n - 1) * (var / n as f64).sqrt())
}

/// Student's t 0.975 quantile for `df` degrees of freedom (the standard
/// table; 1.96 past 30).
fn t975(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    T.get(df.wrapping_sub(1)).copied().unwrap_or(1.96)
}

/// Median over rounds of the per-round ratio a/b.
pub fn ratio<K: Ord>(per_round: &[BTreeMap<K, f64>], a: K, b: K) -> f64 {
    median(per_round.iter().map(|r| r[&a] / r[&b]).collect())
}

/// Enrolls the topology's pod as `name`, with ztunnel's listeners there,
/// the programs attached as on a kernel with `features` (default: this one's).
pub fn enroll_enabled(
    topo: &Topology,
    name: &str,
    features: Option<sluice::dataplane::features::Features>,
    local_route: bool,
) -> anyhow::Result<()> {
    let mut dp = match features {
        Some(f) => Dataplane::load_or_adopt_with(topo.pins.clone(), f)?,
        None => Dataplane::load_or_adopt(topo.pins.clone())?,
    };
    ensure!(
        dp.set_local_route(local_route) == local_route,
        "the local route is not offered on this kernel (Linux < 6.15)"
    );
    let uid = PodUid::new(name)?;
    let e = enroll::enroll(&mut dp, &topo.pod_netns_path(), &uid, &workload(name))?;
    ensure!(
        e.state == sluice_common::PodState::Enabled,
        "bench pod not Enabled: {e:?}"
    );
    Ok(())
}

pub fn workload(name: &str) -> Workload {
    Workload::new(name, "bench", "default").expect("valid workload")
}

pub fn ns_path(name: &str) -> PathBuf {
    PathBuf::from(format!("/run/netns/{name}"))
}

type Scenario = fn(&mut Report, &Config, &mut StdRng) -> anyhow::Result<()>;

fn main() -> anyhow::Result<()> {
    ensure!(
        is_root(),
        "the benchmarks need root (network namespaces, eBPF, iptables)"
    );
    let seed = match std::env::var("SLUICE_BENCH_SEED") {
        Ok(s) => s.parse()?,
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos() as u64,
    };
    let smoke = std::env::var("SLUICE_BENCH_SMOKE").is_ok_and(|v| !v.is_empty() && v != "0");
    let cfg = if smoke {
        Config::smoke(seed)
    } else {
        Config::full(seed)
    };
    eprintln!(
        "bench: seed {seed} (SLUICE_BENCH_SEED={seed} repeats the round order){}",
        if smoke { ", smoke run" } else { "" }
    );
    let mut rng = StdRng::seed_from_u64(seed);
    let mut report = Report {
        results: BTreeMap::new(),
    };
    let scenarios: [(&str, Scenario); 13] = [
        ("cpu", traffic::cpu),
        ("latency", traffic::latency),
        ("rr", traffic::request_response),
        ("bulk", traffic::bulk),
        ("enroll", pods::enrollment),
        ("churn", pods::churn),
        ("scale", traffic::scale),
        ("memory", pods::memory),
        ("dns", dns::dns_queries),
        ("served", served::served),
        ("isolation", isolation::isolation),
        ("verify", verify::verification),
        ("exclusions", exclusions::exclusions),
    ];
    let only = std::env::var("SLUICE_BENCH").ok().filter(|o| !o.is_empty());
    if let Some(o) = &only {
        for n in o.split(',') {
            ensure!(
                scenarios.iter().any(|(name, _)| *name == n),
                "SLUICE_BENCH: no scenario {n:?} (there are: {})",
                scenarios.map(|(n, _)| n).join(",")
            );
        }
    }
    let wanted = |name: &str| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|n| n == name))
    };
    let t0 = Instant::now();
    for (name, run) in scenarios {
        if wanted(name) {
            let t = Instant::now();
            run(&mut report, &cfg, &mut rng)?;
            eprintln!(
                "bench: {name} done in {:.1?} (at {:.0?})",
                t.elapsed(),
                t0.elapsed()
            );
        }
    }
    write(&report, &cfg)
}

fn write(report: &Report, cfg: &Config) -> anyhow::Result<()> {
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
        "kernel_features": sluice::dataplane::features::Features::get().summary(),
        "cpu": cpu,
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "config": cfg.json(),
        "results": report.results,
    });
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    println!("| figure | value |\n|---|---|");
    for (k, v) in &report.results {
        if v.is_nan() {
            println!("| {k} | null |");
        } else {
            println!("| {k} | {v} |");
        }
    }
    println!(
        "\nkernel {kernel} ({}), {cpu}; seed {}{}; results in target/bench/results.json",
        sluice::dataplane::features::Features::get().summary(),
        cfg.seed,
        if cfg.smoke {
            " (SMOKE RUN: counts shrunk, figures not meaningful)"
        } else {
            ""
        }
    );
    Ok(())
}

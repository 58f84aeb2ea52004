//! `sluice-chaos`: random faults on top of each other under steady traffic,
//! with the invariants checked all the time (`cargo xtask chaos` builds and
//! runs it; docs/TESTING.md, Chaos).
//!
//! sluice-chaos [--duration 10m] [--seed N] [--replay FILE] [--pods N]
//!              [--self-test] [--out DIR]
//!
//! Exit 0: no violation, nothing leaked. Exit 1: a violation (the run stops
//! at the first; the schedule up to it is written for `--replay`) or a leak.
//! `--self-test`: one pod's app connections get ztunnel's mark after 5 s (a
//! bypass); exit 0 only when the run caught it within 2 s.

mod check;
mod faults;
mod ledger;
mod node;
mod report;
mod run;
mod schedule;
mod traffic;

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use anyhow::{bail, ensure, Context as _};
use sluice_tests::harness::{is_root, sluice_bin};

use crate::{
    report::Report,
    run::Run,
    schedule::{Fault, Schedule},
};

const INITIAL_PODS: usize = 4;
/// The self-test's bypass comes this long into the run, and must be caught
/// within [`CAUGHT_WITHIN`].
const BYPASS_AT: Duration = Duration::from_secs(5);
const CAUGHT_WITHIN: Duration = Duration::from_secs(2);

struct Opts {
    duration: Duration,
    seed: Option<u64>,
    replay: Option<PathBuf>,
    pods: usize,
    self_test: bool,
    out: PathBuf,
}

fn opts() -> anyhow::Result<Opts> {
    let mut o = Opts {
        duration: Duration::from_secs(600),
        seed: None,
        replay: None,
        pods: INITIAL_PODS,
        self_test: false,
        // target/<profile>/sluice → target/chaos
        out: sluice_bin()
            .parent()
            .and_then(|p| p.parent())
            .context("target dir layout")?
            .join("chaos"),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--duration" => o.duration = humantime::parse_duration(&value()?)?,
            "--seed" => o.seed = Some(value()?.parse().context("--seed")?),
            "--replay" => o.replay = Some(value()?.into()),
            "--pods" => o.pods = value()?.parse().context("--pods")?,
            "--out" => o.out = value()?.into(),
            "--self-test" => o.self_test = true,
            other => bail!("unknown argument {other:?} (see the usage in the source's header)"),
        }
    }
    ensure!(
        (schedule::MIN_PODS..=schedule::MAX_PODS).contains(&o.pods),
        "--pods must be {}..={}",
        schedule::MIN_PODS,
        schedule::MAX_PODS
    );
    Ok(o)
}

fn main() -> anyhow::Result<()> {
    ensure!(
        is_root(),
        "the chaos run needs root (network namespaces, eBPF)"
    );
    let o = opts()?;
    let seed = o.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let (schedule, replayed) = match &o.replay {
        Some(f) => {
            let text =
                std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
            (serde_json::from_str::<Schedule>(&text)?, true)
        }
        None if o.self_test => (
            Schedule::bypass_only(seed, BYPASS_AT + Duration::from_secs(15), BYPASS_AT),
            false,
        ),
        None => (Schedule::draw(seed, o.duration, o.pods), false),
    };
    eprintln!(
        "chaos: seed {} ({} faults over {} s, pods' TCP on {}; --seed {} draws it again)",
        schedule.seed,
        schedule.events.len(),
        schedule.duration_ms / 1000,
        if schedule.local_route {
            "the local route"
        } else {
            "the interface's route"
        },
        schedule.seed
    );
    ledger::stop_on_interrupt();
    let report = run(&schedule, o.pods, replayed, &o.out)?;
    let path = report.write(&o.out)?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    eprintln!("chaos: report in {}", path.display());
    if let Some(why) = &report.runner_error {
        anyhow::bail!(
            "the runner failed (not a violation of sluice's): {why} (seed {}; --replay {})",
            report.seed,
            report.schedule_file.as_deref().unwrap_or("-")
        );
    }
    ensure!(
        !ledger::interrupted(),
        "interrupted after {} s (torn down; the report covers the run so far)",
        report.duration_s
    );
    if o.self_test {
        let caught = report
            .bypass_caught_after_ms
            .is_some_and(|ms| ms <= CAUGHT_WITHIN.as_millis() as u64);
        ensure!(
            caught && report.leaks.is_empty(),
            "the self-test's bypass was not caught within {CAUGHT_WITHIN:?}"
        );
        return Ok(());
    }
    ensure!(
        report.violations.is_empty() && report.leaks.is_empty(),
        "{} violations, {} leaks (seed {}{})",
        report.violations.len(),
        report.leaks.len(),
        report.seed,
        report
            .schedule_file
            .as_deref()
            .map(|f| format!("; --replay {f}"))
            .unwrap_or_default()
    );
    Ok(())
}

fn run(
    schedule: &Schedule,
    pods: usize,
    replayed: bool,
    out: &std::path::Path,
) -> anyhow::Result<Report> {
    let mut run = Run::start(pods, schedule.local_route)?;
    // The agent logs wall-clock time; the schedule and the ledger count from
    // here.
    let zero = std::time::SystemTime::now() - Duration::from_millis(run.ledger.now());
    eprintln!(
        "chaos: 0 ms is {} (the agent's log's clock)",
        humantime::format_rfc3339_millis(zero)
    );
    // One clock for the schedule and the violations: the ledger's.
    let now = |run: &Run| Duration::from_millis(run.ledger.now());
    let mut faults: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut bypass_at = None;
    // A fault the runner itself could not make ends the run (torn down and
    // reported like any other) and fails it.
    let mut runner_error = None;
    for e in &schedule.events {
        let at = Duration::from_millis(e.at_ms);
        while now(&run) < at && !run.ledger.stopping() {
            run.retry();
            std::thread::sleep(at.saturating_sub(now(&run)).min(Duration::from_millis(50)));
        }
        if run.ledger.stopping() {
            break;
        }
        // Late when the faults before it took long (a drain, a hog): the
        // time it was made at is what the ledger's windows go by.
        eprintln!(
            "chaos: {:>7} ms {:?} (made at {} ms)",
            e.at_ms,
            e.fault,
            run.ledger.now()
        );
        if matches!(e.fault, Fault::InjectBypass { .. }) {
            bypass_at = Some(run.ledger.now());
        }
        if let Err(err) = faults::apply(&mut run, &e.fault) {
            let why = format!("injecting {:?} at {} ms: {err:#}", e.fault, e.at_ms);
            eprintln!("chaos: the runner failed: {why}");
            runner_error = Some((e.at_ms, why));
            break;
        }
        run.ledger.applied();
        *faults.entry(e.fault.kind()).or_default() += 1;
    }
    faults::heal_lasting(&run);
    let end = Duration::from_millis(schedule.duration_ms);
    let finishing = |run: &Run| !run.ledger.stopping() && runner_error.is_none();
    while now(&run) < end && finishing(&run) {
        run.retry();
        std::thread::sleep(Duration::from_millis(50));
    }
    // The last check of the bound: every pod Served (the checker stops the
    // run when one is not, within the bound after its last fault).
    while finishing(&run)
        && !run
            .ledger
            .with_pods(|p| p.values().all(|p| p.served_since.is_some()))
    {
        run.retry();
        std::thread::sleep(Duration::from_millis(50));
    }
    let agent = run.stop_traffic();
    let violations = run.ledger.violations();
    let stopped_at = violations
        .first()
        .map(|v| v.at_ms)
        .or(runner_error.as_ref().map(|(at, _)| *at));
    let schedule_file = match stopped_at {
        Some(at) => Some(keep_schedule(out, schedule, at, &run)?),
        None => None,
    };
    let bypass_caught_after_ms = bypass_at.and_then(|at| {
        violations
            .iter()
            .find(|v| v.invariant == "no bypass")
            .map(|v| v.at_ms.saturating_sub(at))
    });
    let leaks = teardown(&mut run);
    let invariant_checks = run.ledger.checks.lock().unwrap().clone();
    let tamper_bypasses = *run.ledger.tamper_bypasses.lock().unwrap();
    let dns_passthrough = *run.ledger.dns_passthrough.lock().unwrap();
    Ok(Report {
        seed: schedule.seed,
        local_route: schedule.local_route,
        duration_s: now(&run).as_secs(),
        replayed,
        faults,
        connections: run.ledger.tallies(),
        invariant_checks,
        violations,
        leaks,
        tamper_bypasses,
        dns_passthrough,
        agent,
        bypass_caught_after_ms,
        schedule_file,
        runner_error: runner_error.map(|(_, why)| why),
    })
}

/// Writes the schedule up to `at_ms` (a violation, or the fault the runner
/// failed at) and the agent's log beside it; returns the schedule's path.
fn keep_schedule(
    out: &std::path::Path,
    schedule: &Schedule,
    at_ms: u64,
    run: &Run,
) -> anyhow::Result<String> {
    std::fs::create_dir_all(out)?;
    let f = out.join(format!("schedule-{}.json", schedule.seed));
    let seen = schedule.until(at_ms);
    std::fs::write(&f, serde_json::to_string_pretty(&seen)?)?;
    eprintln!(
        "chaos: the schedule up to where it stopped: {}",
        f.display()
    );
    // What the agent said, for whoever reads the violation.
    let log = out.join(format!("agent-{}.log", schedule.seed));
    std::fs::write(&log, run.node.agent.log())?;
    eprintln!("chaos: the agent's log: {}", log.display());
    for e in &seen.events {
        eprintln!("chaos:   {:>7} ms {:?}", e.at_ms, e.fault);
    }
    Ok(f.display().to_string())
}

/// Every pod deleted through the CNI, `sluice uninstall` through the agent,
/// the processes stopped; then what is left.
fn teardown(run: &mut Run) -> Vec<String> {
    let mut leaks = Vec::new();
    if let Err(e) = run.delete_all() {
        leaks.push(format!("a pod's teardown failed: {e:#}"));
    }
    let (conf, bin) = (run.node.dir.join("net.d"), run.node.dir.join("bin"));
    let _ = std::fs::create_dir_all(&conf);
    let _ = std::fs::create_dir_all(&bin);
    let (conf, bin) = (conf.display().to_string(), bin.display().to_string());
    match run
        .node
        .agent
        .sluice(&["uninstall", "--cni-conf-dir", &conf, "--cni-bin-dir", &bin])
    {
        Ok(out) if out.ok => {}
        Ok(out) => leaks.push(format!("sluice uninstall failed: {}", out.stderr.trim())),
        Err(e) => leaks.push(format!("sluice uninstall: {e:#}")),
    }
    run.node.agent.terminate();
    run.node.peer.terminate();
    leaks.extend(report::leaks(&run.node, &format!("slxp-{}-", run.node.id)));
    leaks
}

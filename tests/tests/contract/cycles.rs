//! Many enroll/unenroll cycles against one agent and one ztunnel leave
//! nothing behind: the agent's descriptors, the links running sluice's
//! programs, the pins, the pod netns's rules and routes and the map entries
//! all count the same after as before, and the agent's memory stays bounded.

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use sluice::{
    control::{self, Request, Response},
    dataplane::state::Maps,
    workload::Workload,
};
use sluice_tests::child::Bounded as _;
use sluice_tests::{
    agent::{AgentProc, PeerProc},
    harness::{as_if_kernel, without_tcx, Fixture},
    inspect::{filter_programs, pinned_programs, proc_status_kib},
    wait,
};

use crate::{tcx_trial, trial, TestResult};

const PEER: &str = env!("CARGO_BIN_EXE_sluice-zds-peer");
/// Cycles after which the baseline is taken (lazily made descriptors and
/// allocator pools exist by then).
const WARM_UP: usize = 20;

pub fn trials() -> Vec<Trial> {
    vec![
        trial("cycles::enroll_unenroll_cycles_leak_nothing", || {
            leak_nothing(cycles())
        }),
        // As on kernels without tcx (no netns cookies in tc either): a
        // tenth of the cycles.
        trial(
            "cycles::no_tcx::enroll_unenroll_cycles_leak_nothing",
            || as_if_kernel(without_tcx(), || leak_nothing(cycles().div_ceil(10))),
        ),
        // tcx links: a tenth of the cycles (each attach and detach waits
        // for an RCU grace period).
        tcx_trial("cycles::tcx::enroll_unenroll_cycles_leak_nothing", || {
            leak_nothing(cycles().div_ceil(10))
        }),
    ]
}

fn cycles() -> usize {
    // SLUICE_CYCLES: fewer for a quick local run; CI runs the 1,000.
    std::env::var("SLUICE_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

/// Everything the test counts.
#[derive(Debug, PartialEq, Eq)]
struct Counts {
    agent_fds: usize,
    /// Links and cls_bpf filters running sluice's programs.
    links: usize,
    pod_pins: usize,
    pod_rules_and_routes: Vec<String>,
    map_entries: usize,
}

fn count(f: &Fixture, agent_pid: u32, prog_ids: &[u32]) -> anyhow::Result<Counts> {
    let mut links = aya::programs::loaded_links()
        .filter_map(Result::ok)
        .filter(|l| prog_ids.contains(&l.program_id()))
        .count();
    // Kernels without tcx: the pod's cls_bpf filters running them.
    for (iface, dir) in [("eth0", "egress"), ("eth0", "ingress"), ("lo", "ingress")] {
        links += filter_programs(&f.topo.pod, iface, dir)?
            .iter()
            .filter(|(_, id)| prog_ids.contains(id))
            .count();
    }
    let pod_pins = std::fs::read_dir(f.topo.pins.pods())?.count();
    let mut routes = Vec::new();
    for args in [
        &["rule", "show"][..],
        &["-6", "rule", "show"],
        &["route", "show", "table", "all"],
        &["-6", "route", "show", "table", "all"],
    ] {
        let out = std::process::Command::new("ip")
            .args(["-n", f.topo.pod.as_str()])
            .args(args)
            .output_bounded()?;
        ensure!(out.status.success(), "ip {args:?}: {out:?}");
        // The kernel adds eth0's IPv6 link-local address and its routes on
        // its own schedule (after the link comes up): not sluice's.
        routes.extend(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| !l.contains("fe80::"))
                .map(str::to_owned),
        );
    }
    let maps = Maps::open_pinned(&f.topo.pins.maps())?;
    let map_entries = maps.cookies().len() + maps.pods().len();
    Ok(Counts {
        agent_fds: std::fs::read_dir(format!("/proc/{agent_pid}/fd"))?.count(),
        links,
        pod_pins,
        pod_rules_and_routes: routes,
        map_entries,
    })
}

fn enroll(agent: &AgentProc, f: &Fixture, i: usize) -> TestResult {
    let enrolled = control::call(
        &agent.control,
        Some(f.topo.pins.root()),
        &Request::Enroll {
            netns: f.topo.pod_netns_path(),
            uid: format!("cycle-{i}"),
            workload: Workload::new("cycling", "ambient", "app-sa")?,
        },
    )?
    .context("no agent")?;
    ensure!(
        matches!(&enrolled, Response::Enrolled { state: Some(s), .. } if s.steers()),
        "cycle {i}: {enrolled:?}\n{}",
        agent.log()
    );
    Ok(())
}

fn unenroll(agent: &AgentProc, f: &Fixture, i: usize) -> TestResult {
    let uid = format!("cycle-{i}");
    let gone = control::call(
        &agent.control,
        Some(f.topo.pins.root()),
        &Request::Unenroll { uid },
    )?
    .context("no agent")?;
    ensure!(
        matches!(gone, Response::Unenrolled { .. }),
        "cycle {i}: {gone:?}"
    );
    Ok(())
}

/// The agent's link-event socket for the last pod closes a tick after the
/// pod leaves: fds are counted once none is open.
fn no_link_watches(agent: &AgentProc) -> TestResult {
    wait::until("no link-event socket open", wait::DEADLINE, || {
        let n = agent.node_status().map(|s| s["link_watches"].clone());
        match n {
            Ok(v) if v == 0 => Ok(()),
            other => Err(other.map_err(|e| e.to_string())),
        }
    })?;
    Ok(())
}

fn cycle(agent: &AgentProc, f: &Fixture, i: usize) -> TestResult {
    enroll(agent, f, i)?;
    unenroll(agent, f, i)
}

fn leak_nothing(n: usize) -> TestResult {
    let f = Fixture::new("cy", None)?;
    let agent = AgentProc::start(&f.topo.pins)?;
    let pid = agent.pid().context("agent pid")?;
    let peer = PeerProc::start(std::path::Path::new(PEER), &agent.zds, &[])?;
    agent.wait_ztunnel(peer.pid().context("peer pid")?, "the peer connected", |z| {
        z["connected"] == true
    })?;
    let prog_ids: Vec<u32> = pinned_programs(&f.topo.pins)?
        .values()
        .map(|(id, _)| *id)
        .collect();
    // The counts see an enrolled pod: every link pinned for it runs one
    // of the programs, and its pins, routes and map entries are there.
    let idle = count(&f, pid, &prog_ids)?;
    enroll(&agent, &f, 0)?;
    let live = count(&f, pid, &prog_ids)?;
    let pinned_links = std::fs::read_dir(f.topo.pins.pods())?
        .flatten()
        .map(|d| std::fs::read_dir(d.path()).map(|l| l.count()).unwrap_or(0))
        .sum::<usize>();
    ensure!(
        live.links == pinned_links
            && live.links >= 4
            && live.pod_pins == 1
            && live.map_entries > 0
            && live.pod_rules_and_routes.len() > idle.pod_rules_and_routes.len(),
        "an enrolled pod counts as {live:?} with {pinned_links} link pins"
    );
    unenroll(&agent, &f, 0)?;
    for i in 1..WARM_UP {
        cycle(&agent, &f, i)?;
    }
    no_link_watches(&agent)?;
    let before = count(&f, pid, &prog_ids)?;
    let rss_before = proc_status_kib(pid, "VmRSS:")?;
    for i in WARM_UP..WARM_UP + n {
        cycle(&agent, &f, i)?;
    }
    no_link_watches(&agent)?;
    let after = count(&f, pid, &prog_ids)?;
    let rss_after = proc_status_kib(pid, "VmRSS:")?;
    println!(
        "{n} cycles: agent fds {} → {}, links {} → {}, rules and routes {} → {}; agent RSS {rss_before} KiB → {rss_after} KiB; peer adds {}",
        before.agent_fds,
        after.agent_fds,
        before.links,
        after.links,
        before.pod_rules_and_routes.len(),
        after.pod_rules_and_routes.len(),
        peer.count("add")
    );
    ensure!(before == after, "leaked: {before:?} → {after:?}");
    // One add per enrollment: no duplicate from the supervision pass while
    // the enrollment's own add is out.
    ensure!(
        peer.count("add") == WARM_UP + n,
        "{} adds for {} enrollments",
        peer.count("add"),
        WARM_UP + n
    );
    ensure!(
        after.links == 0 && after.pod_pins == 0 && after.map_entries == 0,
        "{after:?}"
    );
    // Bounded: a per-cycle leak of even 8 KiB would show as 8 MiB here.
    ensure!(
        rss_after <= rss_before + 8 * 1024,
        "agent RSS grew from {rss_before} KiB to {rss_after} KiB over {n} cycles"
    );
    Ok(())
}

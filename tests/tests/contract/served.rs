//! "Fully enrolled" means ztunnel can serve the pod: the served check, with
//! the agent as a process and a ZDS peer whose admin API lists the
//! workloads the test decides (as istiod's xDS would have pushed them).

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use serde_json::Value;
use sluice::agent::node::FALLBACK_AFTER;
use sluice_common::PodState;
use sluice_tests::{
    admin,
    agent::{free_port, http_get, AgentProc, PeerProc},
    harness::{steering, Fixture},
    topology::Family,
    wait,
};

use crate::{trial, TestResult};

const PEER: &str = env!("CARGO_BIN_EXE_sluice-zds-peer");

pub fn trials() -> Vec<Trial> {
    vec![
        trial(
            "served::unknown_pod_is_captured_not_served_until_ztunnel_gets_its_workload",
            unknown_then_known,
        ),
        trial(
            "served::silent_admin_api_counts_acks_as_served_and_says_so",
            silent_admin,
        ),
        trial("served::check_off_counts_the_ack_without_asking", check_off),
    ]
}

/// A scratch dir for a test's workload file, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> anyhow::Result<Self> {
        let d = std::env::temp_dir().join(format!("sluice-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d)?;
        Ok(Self(d))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn enroll(agent: &AgentProc, f: &Fixture) -> TestResult {
    let out = agent.enroll(
        &f.topo.pod_netns_path(),
        f.uid.as_str(),
        "ambient",
        f.uid.as_str(),
    )?;
    ensure!(
        out.ok && steering(&out.stdout),
        "enroll: {} {}\n{}",
        out.stdout,
        out.stderr,
        agent.log()
    );
    Ok(())
}

/// The pod as the test's peer would learn it from xDS (the enroll above
/// names it ambient/<uid> with service account app-sa).
fn workload_of(f: &Fixture) -> Value {
    admin::workload(
        "ambient",
        f.uid.as_str(),
        "app-sa",
        &[f.topo.pod_ip(Family::V4), f.topo.pod_ip(Family::V6)],
    )
}

fn wait_condition(agent: &AgentProc, reason: &str) -> anyhow::Result<Value> {
    wait::until(
        &format!("the node condition's reason {reason}"),
        wait::DEADLINE,
        || match agent.node_status() {
            Ok(n) if n["condition"]["reason"] == reason => Ok(n),
            other => Err(format!("{other:?}")),
        },
    )
}

fn start_peer(agent: &AgentProc, flags: &[&str]) -> anyhow::Result<PeerProc> {
    let p = PeerProc::start(Path::new(PEER), &agent.zds, flags)?;
    let pid = p.pid().context("peer has no pid")?;
    agent.wait_ztunnel(pid, "the peer connected", |z| z["connected"] == true)?;
    Ok(p)
}

/// Rows: pod unknown → captured, not served, gate False and the condition
/// names it with its wait; workload appears → served; status shows both.
fn unknown_then_known() -> TestResult {
    let f = Fixture::new("sv", None)?;
    let scratch = Scratch::new("served")?;
    let workloads = scratch.0.join("workloads.json");
    std::fs::write(&workloads, "[]")?;
    let agent = AgentProc::start_with(&f.topo.pins, &["--pending-grace", "1s"])?;
    let peer = start_peer(&agent, &["--admin-workloads", workloads.to_str().unwrap()])?;
    enroll(&agent, &f)?;

    let n = wait_condition(&agent, "PodsNotServed")?;
    // The node captures the pod: True, and the reason names what waits.
    ensure!(n["condition"]["ready"] == true, "{n}");
    let msg = n["condition"]["message"].as_str().unwrap_or_default();
    let named = format!("ambient/{} (", f.uid);
    ensure!(
        msg.contains("captured but not known to ztunnel") && msg.contains(&named),
        "{msg}"
    );
    ensure!(f.pod_record()?.state == Some(PodState::Enabled));
    // Captured all the same: ztunnel's listeners take the connections.
    ensure!(f.pod_record()?.listeners.len() == 6);
    let table = agent.sluice(&["status"])?.stdout;
    let row = table
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some(f.uid.as_str()))
        .context("no row")?;
    let cols: Vec<&str> = row.split_whitespace().collect();
    ensure!(
        cols[2] == "Enabled" && cols[3] == "no" && cols[4].starts_with('('),
        "{table}"
    );
    let pid = peer.pid().context("pid")?;
    agent.wait_ztunnel(pid, "the peer's admin API read", |z| {
        z["served_check"]["check"] == "answering"
    })?;
    ensure!(peer.count("admin") >= 1, "the agent never asked");

    // istiod pushes the workload.
    std::fs::write(&workloads, serde_json::to_vec(&[workload_of(&f)])?)?;
    f.wait_state("Served")?;
    let n = wait_condition(&agent, "RedirectionReady")?;
    ensure!(n["condition"]["ready"] == true, "{n}");
    let s = agent.status_json()?;
    ensure!(s["pods"][0]["served"] == true, "{s}");
    let table = agent.sluice(&["status"])?.stdout;
    ensure!(
        table.lines().any(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.get(1) == Some(&f.uid.as_str()) && cols[2..4] == ["Served", "yes"]
        }),
        "{table}"
    );
    Ok(())
}

/// Row: admin unreachable → after the documented grace the ack counts as
/// served; status and the metric say the check is not working.
fn silent_admin() -> TestResult {
    let f = Fixture::new("sa", None)?;
    let port = free_port()?;
    let addr = format!("127.0.0.1:{port}");
    let agent = AgentProc::start_with(&f.topo.pins, &["--metrics-addr", &addr])?;
    let peer = start_peer(&agent, &["--no-admin"])?;
    enroll(&agent, &f)?;
    // The fallback takes 3 failed asks over FALLBACK_AFTER: a longer deadline
    // than the usual one, which only matters when the test fails.
    wait::until(
        "the pod Served by the fallback",
        FALLBACK_AFTER + wait::DEADLINE,
        || match f.pod_record().map(|r| r.state) {
            Ok(Some(PodState::Served)) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    )?;
    let pid = peer.pid().context("pid")?;
    agent.wait_ztunnel(pid, "acks counted as served", |z| {
        z["served_check"]["check"] == "acks_count_as_served"
            && z["served_check"]["error"]
                .as_str()
                .is_some_and(|e| e.contains("127.0.0.1:15000"))
    })?;
    let (code, text) = http_get(port, "/metrics")?;
    ensure!(code == 200);
    ensure!(
        text.lines().any(|l| l == "sluice_served_check_fallback 1"),
        "{text}"
    );
    let table = agent.sluice(&["status"])?.stdout;
    ensure!(table.contains("acks count as served"), "{table}");
    Ok(())
}

/// `--served-check off`: the ack is served, ztunnel's admin API is not asked.
fn check_off() -> TestResult {
    let f = Fixture::new("so", None)?;
    let agent = AgentProc::start_with(&f.topo.pins, &["--served-check", "off"])?;
    let peer = start_peer(&agent, &[])?;
    enroll(&agent, &f)?;
    f.wait_state("Served")?;
    let n = agent.node_status()?;
    ensure!(n["served_check"] == "off", "{n}");
    ensure!(n["ztunnels"][0]["served_check"]["check"] == "off", "{n}");
    ensure!(peer.count("admin") == 0, "{:?}", peer.events());
    Ok(())
}

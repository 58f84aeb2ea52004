//! ztunnel's snapshot racing the pod lifecycle: a pod unenrolled while the
//! snapshot of a connecting ztunnel goes out.

use std::path::Path;

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use sluice_tests::{
    agent::{AgentProc, PeerProc},
    harness::Fixture,
};

use crate::{agent::enroll, trial, TestResult};

const PEER: &str = env!("CARGO_BIN_EXE_sluice-zds-peer");

pub fn trials() -> Vec<Trial> {
    vec![trial(
        "snapshot::a_pod_unenrolled_while_the_snapshot_goes_out_is_deleted_from_that_ztunnel",
        unenrolled_during_snapshot,
    )]
}

/// Two pods wait for ztunnel; one connects and holds its first ack (its
/// snapshot stays in flight). Pod b is unenrolled meanwhile: its `del` goes
/// to the connections live then, which this one is not yet. Once the
/// snapshot is through, this ztunnel must get b's `del` too. (It kept b,
/// added from the snapshot after b's teardown, until it restarted.)
fn unenrolled_during_snapshot() -> TestResult {
    let a = Fixture::in_subnet("usa", None, 1)?;
    let b = Fixture::in_subnet("usb", None, 2)?;
    let agent = AgentProc::start(&a.topo.pins)?;
    for f in [&a, &b] {
        let out = enroll(&agent, f)?;
        ensure!(out.ok, "{}{}", out.stdout, out.stderr);
    }
    let gate = agent.dir.join("ztunnel-may-ack");
    let gate_arg = gate.to_str().context("path")?.to_owned();
    let p = PeerProc::start(
        Path::new(PEER),
        &agent.zds,
        &["--hold-acks-until", &gate_arg],
    )?;
    p.wait_for("the snapshot's first add held", |e| {
        e.iter().any(|e| e["event"] == "listening")
    })?;
    let out = agent.sluice(&["unenroll", "--uid", b.uid.as_str()])?;
    ensure!(out.ok, "unenroll: {}{}", out.stdout, out.stderr);
    std::fs::write(&gate, "")?;
    let uid = b.uid.as_str().to_owned();
    p.wait_for("b's del at the ztunnel of the snapshot", |e| {
        e.iter()
            .any(|e| e["event"] == "del" && e["uid"] == uid.as_str())
    })
    .with_context(|| format!("{:?}\n{}", p.events(), agent.log()))?;
    Ok(())
}

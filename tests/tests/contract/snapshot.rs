//! ztunnel's snapshot racing the pod lifecycle: a pod unenrolled, or
//! enrolled, while the snapshot of a connecting ztunnel goes out.

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use sluice_tests::{agent::AgentProc, harness::Fixture};

use crate::{
    agent::{enroll, enroll_enabled, held_peer, peer, Pause},
    trial, TestResult,
};

pub fn trials() -> Vec<Trial> {
    vec![
        trial(
            "snapshot::a_pod_unenrolled_while_the_snapshot_goes_out_is_deleted_from_that_ztunnel",
            unenrolled_during_snapshot,
        ),
        trial(
            "snapshot::a_pod_enrolled_while_a_newer_ztunnels_snapshot_goes_out_is_added_to_it",
            enrolled_during_snapshot,
        ),
        trial(
            "snapshot::a_pod_unenrolled_while_its_add_waits_is_deleted_again_after_it",
            unenrolled_during_add,
        ),
    ]
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
    let (p, gate) = held_peer(&agent, "the snapshot's first add held")?;
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

/// An older ztunnel serves pod a; a newer one connects and holds its first
/// ack (its snapshot stays in flight). Pod b is enrolled meanwhile: its add
/// goes to the connection live then, the older one's. Once the snapshot is
/// through, the newer ztunnel must get b's add too: it serves b from then
/// on, as in an upgrade, where the older one drains next. (b stayed with
/// the older ztunnel only, and lost its listeners when that one drained.)
fn enrolled_during_snapshot() -> TestResult {
    let a = Fixture::in_subnet("esa", None, 1)?;
    let b = Fixture::in_subnet("esb", None, 2)?;
    let agent = AgentProc::start(&a.topo.pins)?;
    let old = peer(&agent)?;
    enroll_enabled(&agent, &a)?;
    let (new, gate) = held_peer(&agent, "the newer ztunnel's snapshot held at a's add")?;
    let out = enroll(&agent, &b)?;
    ensure!(out.ok, "enroll b: {}{}", out.stdout, out.stderr);
    let uid = b.uid.as_str().to_owned();
    let added = |e: &[serde_json::Value]| {
        e.iter()
            .any(|e| e["event"] == "add" && e["uid"] == uid.as_str())
    };
    old.wait_for("b's add at the older ztunnel", added)?;
    std::fs::write(&gate, "")?;
    new.wait_for("b's add at the newer ztunnel", added)
        .with_context(|| format!("{:?}\n{}", new.events(), agent.log()))?;
    Ok(())
}

/// A pod's add, its netns open, is held just before it is queued on the
/// connection (a pause point of the fault-injection build), and the pod is
/// unenrolled meanwhile: its `del` reaches ztunnel first, then the add.
/// ztunnel must end without the pod: the agent deletes it again once the
/// add is answered. (ztunnel kept a proxy for the gone pod, and its netns,
/// until it next reconnected.)
fn unenrolled_during_add() -> TestResult {
    let a = Fixture::new("uda", None)?;
    let pause = Pause::new("uda", "zds:add")?;
    let agent = pause.agent(&a.topo.pins)?;
    let p = peer(&agent)?;
    let uid = a.uid.as_str().to_owned();
    std::thread::scope(|s| -> TestResult {
        let held = s.spawn(|| enroll(&agent, &a));
        pause.wait_held("the pod's add held")?;
        let out = agent.sluice(&["unenroll", "--uid", &uid])?;
        ensure!(out.ok, "unenroll: {}{}", out.stdout, out.stderr);
        pause.release()?;
        held.join().expect("enroll thread panicked")?;
        Ok(())
    })?;
    let ours = |e: &serde_json::Value| e["uid"] == uid.as_str();
    p.wait_for("a del after the pod's add", |e| {
        let last = e
            .iter()
            .rev()
            .find(|e| ours(e) && e["event"] != "listening");
        e.iter().any(|e| ours(e) && e["event"] == "add")
            && last.is_some_and(|e| e["event"] == "del")
    })
    .with_context(|| format!("{:?}\n{}", p.events(), agent.log()))?;
    Ok(())
}

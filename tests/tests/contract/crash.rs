//! Crash safety: the agent is killed (SIGKILL, from a fault-injection crash
//! point) right after each step of an enrollment and of a teardown, and
//! started again. The next agent must find each pod either completely
//! captured (an interrupted enrollment is completed) or completely removed
//! (an interrupted teardown is finished) — never half: no inbound or outbound
//! connection may reach its destination without passing ztunnel while the
//! pod is enrolled.

use std::{net::SocketAddr, path::Path};

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use sluice::podnet::podlinks::{expected_links, LinkSpec};
use sluice_common::PodState;
use sluice_tests::{
    agent::{AgentProc, PeerProc},
    flow::{connect, Opts},
    harness::{steering, Fixture, APP_PORT, REMOTE_PORT},
    topology::Family,
};

use crate::{needs_fault_injection, tcx_trial, trial, TestResult};

const PEER: &str = env!("CARGO_BIN_EXE_sluice-zds-peer");

/// The pod interface of every test topology.
const POD_IFACE: &str = "eth0";

fn pod_links() -> Vec<LinkSpec> {
    expected_links(&[POD_IFACE.to_owned()], &[], &[], &[], false)
}

/// Every crash point of an enrollment, in order. A cls_bpf filter's record
/// is pinned before the filter is attached (`enroll:record:…`): killed
/// between the two, the pod has a record without its filter, which the
/// next agent must not take for attached.
fn enroll_steps() -> Vec<String> {
    let mut v: Vec<String> = ["enroll:state", "enroll:addrs", "enroll:routes"]
        .map(String::from)
        .into();
    for l in pod_links() {
        if l != LinkSpec::Steer {
            v.push(format!("enroll:record:{}", l.pin_name()));
        }
        v.push(format!("enroll:link:{}", l.pin_name()));
    }
    v
}

/// Every crash point of a teardown (links go in directory order; each one's
/// point is hit whatever its position).
fn unenroll_steps() -> Vec<String> {
    let mut v = vec!["unenroll:draining".to_owned()];
    v.extend(
        pod_links()
            .iter()
            .map(|l| format!("unenroll:link:{}", l.pin_name())),
    );
    v.push("unenroll:routes".into());
    v
}

pub fn trials() -> Vec<Trial> {
    let mut v = Vec::new();
    for step in enroll_steps() {
        let name = format!(
            "crash::killed_after_{}_then_completed",
            step.replace(':', "_")
        );
        v.push(needs_fault_injection(trial(name, move || {
            enroll_killed(&step)
        })));
    }
    for step in unenroll_steps() {
        let name = format!(
            "crash::killed_after_{}_then_finished",
            step.replace(':', "_")
        );
        v.push(needs_fault_injection(trial(name, move || {
            unenroll_killed(&step)
        })));
    }
    v.push(trial(
        "crash::lost_tc_links_are_found_and_attached_again_on_restart",
        lost_links,
    ));
    v.push(tcx_trial(
        "crash::tcx::lost_tc_links_are_found_and_attached_again_on_restart",
        lost_links,
    ));
    v.push(needs_fault_injection(trial(
        "crash::takeover_from_istio_cni_killed_before_its_rules_went_is_finished",
        takeover_killed,
    )));
    v.push(needs_fault_injection(trial(
        "crash::killed_between_a_pods_identity_and_its_state_then_enrolled_again",
        identity_without_state,
    )));
    v
}

/// Killed between a new pod's two first map writes (its identity, then its
/// state): the next agent removes the identity left without a state, and
/// the pod enrolls again. (Its uid read as enrolled for good: every ADD and
/// enroll was refused as "already enrolled", and nothing swept it.)
fn identity_without_state() -> TestResult {
    let step = "enroll:identity";
    let f = Fixture::new(&tag(step), None)?;
    let mut agent = AgentProc::start_crashing_at(&f.topo.pins, step)?;
    let p = peer(&agent)?;
    let enroll =
        |agent: &AgentProc| agent.enroll(&f.topo.pod_netns_path(), f.uid.as_str(), "shop", "cart");
    let out = enroll(&agent)?;
    ensure!(!out.ok, "enroll survived the crash point: {}", out.stdout);
    ensure!(agent.wait_killed()? == libc::SIGKILL);
    agent.restart_clean()?;
    // Pending until ztunnel reconnects, then Served.
    let out = enroll(&agent)?;
    ensure!(
        out.ok,
        "enrolled again: {}{}\n{}",
        out.stdout,
        out.stderr,
        agent.log()
    );
    f.wait_state("Served")
        .with_context(|| format!("{:?}\n{}", p.events(), agent.log()))?;
    captured(&f, &p)
}

fn tag(step: &str) -> String {
    // Short, unique per step: namespace and veth names are length-limited.
    let h = step
        .bytes()
        .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(b.into()));
    format!("k{:04x}", h & 0xffff)
}

fn peer(agent: &AgentProc) -> anyhow::Result<PeerProc> {
    let p = PeerProc::start(Path::new(PEER), &agent.zds, &[])?;
    let pid = p.pid().context("peer has no pid")?;
    agent.wait_ztunnel(pid, "the peer connected", |z| z["connected"] == true)?;
    Ok(p)
}

fn count(p: &PeerProc, role: &str) -> usize {
    p.events()
        .iter()
        .filter(|e| e["event"] == "accepted" && e["role"] == role)
        .count()
}

/// Inbound and outbound both pass ztunnel (the peer accepts them) and reach
/// their destination.
fn captured(f: &Fixture, p: &PeerProc) -> TestResult {
    let (inb, outb) = (count(p, "inbound"), count(p, "outbound"));
    both_ways(f)?;
    p.wait_for("both connections accepted by ztunnel", |_| {
        count(p, "inbound") > inb && count(p, "outbound") > outb
    })
}

/// An inbound connection reaches the app and an outbound one the remote.
fn both_ways(f: &Fixture) -> TestResult {
    let r = connect(
        &f.topo.client,
        SocketAddr::new(f.topo.pod_ip(Family::V4), APP_PORT),
        Opts::default(),
    );
    ensure!(
        r.reply().is_some_and(|l| l.starts_with("app:8080")),
        "inbound: {r:?}"
    );
    let r = connect(
        &f.topo.pod,
        SocketAddr::new(f.topo.client_ip(Family::V4), REMOTE_PORT),
        Opts::default(),
    );
    ensure!(
        r.reply().is_some_and(|l| l.starts_with("app:9090")),
        "outbound: {r:?}"
    );
    Ok(())
}

/// Every link of the pod is pinned.
fn all_links_pinned(f: &Fixture) -> TestResult {
    let cookie = f.pod_record()?.netns_cookie;
    let dir = f.topo.pins.pod(cookie);
    let missing: Vec<String> = pod_links()
        .iter()
        .map(LinkSpec::pin_name)
        .filter(|n| !dir.join(n).exists())
        .collect();
    ensure!(
        missing.is_empty(),
        "links missing after restart: {missing:?}"
    );
    Ok(())
}

fn enroll_killed(step: &str) -> TestResult {
    let f = Fixture::new(&tag(step), None)?;
    let mut agent = AgentProc::start_crashing_at(&f.topo.pins, step)?;
    let p = peer(&agent)?;
    let out = agent.enroll(&f.topo.pod_netns_path(), f.uid.as_str(), "shop", "cart")?;
    ensure!(
        !out.ok,
        "enroll survived the crash point {step}: {}",
        out.stdout
    );
    let sig = agent.wait_killed()?;
    ensure!(sig == libc::SIGKILL, "killed by signal {sig}");
    // The crash left the pod part-way: recorded (the first step), Pending.
    let rec = f.pod_record()?;
    ensure!(rec.state == Some(PodState::Pending), "{rec:?}");

    agent.restart_clean()?;
    // The restarted agent completed the capture before serving; ztunnel
    // reconnects, gets the pod in its snapshot, and it becomes Served.
    all_links_pinned(&f)?;
    f.wait_state("Served")
        .with_context(|| format!("{:?}\n{}", p.events(), agent.log()))?;
    captured(&f, &p)?;
    ensure!(
        f.app.peers().len() == 1 && f.remote.peers().len() == 1,
        "only the connections through ztunnel reached the app and the remote"
    );
    Ok(())
}

fn unenroll_killed(step: &str) -> TestResult {
    let f = Fixture::new(&tag(step), None)?;
    let mut agent = AgentProc::start_crashing_at(&f.topo.pins, step)?;
    let p = peer(&agent)?;
    let out = agent.enroll(&f.topo.pod_netns_path(), f.uid.as_str(), "shop", "cart")?;
    ensure!(
        out.ok && steering(&out.stdout),
        "{}{}",
        out.stdout,
        out.stderr
    );
    captured(&f, &p)?;
    let cookie = f.pod_record()?.netns_cookie;
    let out = agent.sluice(&["unenroll", "--uid", f.uid.as_str()])?;
    ensure!(
        !out.ok,
        "unenroll survived the crash point {step}: {}",
        out.stdout
    );
    ensure!(agent.wait_killed()? == libc::SIGKILL);
    // Caught in its teardown: failing closed.
    let rec = f.pod_record()?;
    ensure!(rec.state == Some(PodState::Draining), "{rec:?}");

    agent.restart_clean()?;
    // The restarted agent finished the teardown before serving: nothing of
    // the pod is left, and its traffic flows as if sluice had never been.
    ensure!(
        f.pod_record().is_err(),
        "pod still recorded after the restart"
    );
    ensure!(
        !f.topo.pins.pod(cookie).exists(),
        "pins left: {}",
        f.topo.pins.pod(cookie).display()
    );
    let (inb, outb) = (count(&p, "inbound"), count(&p, "outbound"));
    both_ways(&f)?;
    ensure!(
        count(&p, "inbound") == inb && count(&p, "outbound") == outb,
        "a removed pod's traffic still went to ztunnel"
    );
    Ok(())
}

/// A pod istio-cni had captured: the enrollment is killed after sluice's
/// last link, before Istio's rules are removed (both rule sets at once would
/// misroute outbound). The restarted agent removes them, and the pod is
/// captured by sluice.
fn takeover_killed() -> TestResult {
    let step = pod_links()
        .last()
        .map(|l| format!("enroll:link:{}", l.pin_name()))
        .context("no links")?;
    let f = Fixture::new("tko", None)?;
    sluice_tests::istio::apply(&f.topo.pod)?;
    let ns = sluice::podnet::netns::Netns::open(&f.topo.pod_netns_path())?;
    ensure!(
        !sluice::dataplane::migrate::istio_rules(&ns)?.is_empty(),
        "Istio's rules not applied"
    );
    let mut agent = AgentProc::start_crashing_at(&f.topo.pins, &step)?;
    let out = agent.enroll(&f.topo.pod_netns_path(), f.uid.as_str(), "shop", "cart")?;
    ensure!(!out.ok, "enroll survived the crash point: {}", out.stdout);
    ensure!(agent.wait_killed()? == libc::SIGKILL);
    ensure!(
        !sluice::dataplane::migrate::istio_rules(&ns)?.is_empty(),
        "Istio's rules went before the crash point"
    );
    agent.restart_clean()?;
    let left = sluice::dataplane::migrate::istio_rules(&ns)?;
    ensure!(
        left.is_empty(),
        "Istio's rules left after the restart: {left:?}"
    );
    let p = peer(&agent)?;
    f.wait_state("Served")?;
    captured(&f, &p)
}

/// The state the issue found by hand: an Enabled pod whose tc links are gone
/// (their pins removed, so the links detached). A restarted agent attaches
/// them again, and outbound is captured, not leaked.
fn lost_links() -> TestResult {
    let f = Fixture::new("lost", None)?;
    let mut agent = AgentProc::start(&f.topo.pins)?;
    let p = peer(&agent)?;
    let out = agent.enroll(&f.topo.pod_netns_path(), f.uid.as_str(), "shop", "cart")?;
    ensure!(
        out.ok && steering(&out.stdout),
        "{}{}",
        out.stdout,
        out.stderr
    );
    ensure!(agent.terminate(), "agent did not stop cleanly");
    let dir = f.topo.pins.pod(f.pod_record()?.netns_cookie);
    for l in pod_links().iter().filter(|l| **l != LinkSpec::Steer) {
        let pin = dir.join(l.pin_name());
        match sluice::dataplane::tcfilter::pinned(&pin) {
            // A cls_bpf filter: deleted from the kernel, its record removed.
            Some(sluice::dataplane::tcfilter::Pinned::Program(_)) => {
                let hook = l.tc_hook().context("a tc link")?;
                let (iface, kind) = (hook.iface.to_owned(), hook.kind);
                sluice_tests::ns::run_in(&f.topo.pod, move || {
                    sluice::dataplane::tcfilter::detach(&iface, kind)
                })?;
                std::fs::remove_file(&pin)?;
            }
            // Unpinned and dropped: the link detaches.
            _ => drop(aya::programs::links::PinnedLink::from_pin(&pin)?.unpin()?),
        }
    }
    agent.restart()?;
    all_links_pinned(&f)?;
    f.wait_state("Served")?;
    captured(&f, &p)
}

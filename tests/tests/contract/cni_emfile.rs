//! The runtime's requests while the agent is out of descriptors (EMFILE),
//! for each headroom in turn, so that every step that opens one fails in
//! some case. Both bugs were found by chaos runs, where a replayed schedule
//! reproduces them only by chance: where EMFILE strikes depends on what else
//! holds descriptors at that moment.
//! - A retried ADD may only be answered once the pod is captured (seed
//!   1795780032951110225: an ADD cut short left its capture half torn down,
//!   `Draining`; the retry was answered as enrolled, and the pod started
//!   uncaptured).
//! - A late DEL for the pod's old sandbox never tears down the live capture
//!   (seed 1795776823800260720: the guard read "cannot open the netns" as
//!   "the sandbox is gone").
//! - A DEL cut short leaves nothing behind once the agent has finished it
//!   (found by this sweep itself).
//! - A repair cut short is tried again once the agent has descriptors back
//!   (seed 1795791762004746862, the first 2-hour run: a pod's pins removed
//!   while the agent was out of descriptors; the repair the removal caused
//!   failed, no event followed, and the pod's sk_lookup link stayed detached
//!   until the next periodic verification, up to 60 s later).
//! - A pod is offered to a new ztunnel once the agent has descriptors back
//!   (seed 1795811323619444927: ztunnel restarted while the agent was out of
//!   descriptors; the add that could not open the pod's netns stayed "in
//!   flight" for good, so the pod was never offered again and stayed
//!   `Pending`).

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use serde_json::json;
use sluice_common::PodState;
use sluice_tests::{
    agent::{fd_limit, AgentProc},
    cni::{plugin, Exec, Invocation},
    inspect::Hook,
    wait,
};

use sluice_tests::harness::Fixture;

use crate::{
    cni::{sluice_cni, Node},
    trial, TestResult,
};

pub fn trials() -> Vec<Trial> {
    vec![
        trial(
            "cni::an_add_cut_short_by_emfile_then_retried_leaves_the_pod_captured",
            add_retried_after_emfile,
        ),
        trial(
            "cni::a_stale_del_under_emfile_keeps_the_live_capture",
            stale_del_under_emfile,
        ),
        trial(
            "cni::a_del_cut_short_by_emfile_is_finished_by_the_agent",
            del_cut_short_is_finished,
        ),
        trial(
            "agent::an_unenroll_under_emfile_leaves_the_pod_captured_or_gone",
            unenroll_under_emfile,
        ),
        trial(
            "agent::a_repair_cut_short_by_emfile_is_tried_again_without_an_event",
            repair_retried_after_emfile,
        ),
        trial(
            "agent::a_ztunnel_restart_under_emfile_offers_the_pod_again",
            ztunnel_restart_under_emfile,
        ),
    ]
}

/// A node with a pod made by `ptp`, the agent, and `sluice-cni`'s config
/// for it.
struct Setup {
    n: Node,
    agent: AgentProc,
    ptp_conf: serde_json::Value,
    conf: serde_json::Value,
}

impl Setup {
    fn new(tag: &str) -> anyhow::Result<Self> {
        Self::with_agent_flags(tag, &[])
    }

    /// Same, the agent started with `flags`.
    fn with_agent_flags(tag: &str, flags: &[&str]) -> anyhow::Result<Self> {
        let n = Node::new(tag)?;
        let agent = AgentProc::start_with(&n.pins, flags)?;
        let ptp_conf = n.ptp_conf();
        let ptp = n
            .exec(&plugin("ptp"), "ADD", &ptp_conf, Some(&n.pod_path()))
            .run()?;
        ensure!(ptp.ok, "ptp ADD: {} {}", ptp.stdout, ptp.stderr);
        let conf = json!({"cniVersion": "1.0.0", "name": "sluice-test", "type": "sluice-cni",
            "agentSocket": agent.control, "prevResult": ptp.json()?});
        Ok(Self {
            n,
            agent,
            ptp_conf,
            conf,
        })
    }

    /// `sluice-cni <command>` for the pod's sandbox.
    fn sluice(&self, command: &str) -> anyhow::Result<Invocation> {
        let cni = sluice_cni();
        let pod = self.n.pod_path();
        self.n.exec(&cni, command, &self.conf, Some(&pod)).run()
    }

    /// `add` was answered OK, and the pod is captured.
    fn added(&self, what: &str, add: &Invocation) -> TestResult {
        ensure!(add.ok, "{what}: {} {}", add.stdout, add.stderr);
        self.captured(what)
    }

    /// The pod is captured: its state attached, sluice's program at its
    /// egress.
    fn captured(&self, what: &str) -> TestResult {
        let pods = sluice::status::read(&self.n.pins)?;
        let state = pods.first().and_then(|p| p.state);
        ensure!(
            pods.len() == 1 && state.is_some_and(|s| s != PodState::Draining),
            "after {what}, the pod is not captured: {pods:?}\n{}",
            self.agent.log()
        );
        self.egress().program().with_context(|| {
            format!("{what}: nothing at the pod's egress\n{}", self.agent.log())
        })?;
        Ok(())
    }

    /// The pod's egress hook, where sluice's filter runs while it is
    /// captured.
    fn egress(&self) -> Hook<'_> {
        Hook {
            ns: &self.n.pod,
            dev: "eth0",
            dir: "egress",
        }
    }

    fn pid(&self) -> anyhow::Result<u32> {
        self.agent.pid().context("the agent's pid")
    }

    fn remove_pod(&self) {
        let pod = self.n.pod_path();
        let _ = self
            .n
            .exec(&plugin("ptp"), "DEL", &self.ptp_conf, Some(&pod))
            .run();
    }
}

/// For every descriptor headroom, from one until an ADD succeeds within
/// it, one ADD under that limit (cut short wherever the descriptors ran
/// out), then, the limit lifted, the runtime's retry: an ADD answered OK
/// leaves the pod captured (its state attached, sluice's program first on
/// its egress hook), whichever step the first attempt stopped at. DEL
/// between headrooms.
fn add_retried_after_emfile() -> TestResult {
    let s = Setup::new("emf")?;
    let pid = s.pid()?;
    let mut cut_short = 0;
    // From one: with none, the agent cannot even accept the plugin's
    // connection, which then waits out its timeout (refused, not this case).
    for headroom in 1..64 {
        fd_limit(pid, Some(headroom))?;
        let first = s.sluice("ADD");
        fd_limit(pid, None)?;
        let first = first?;
        if first.ok {
            s.added(
                &format!("the ADD with {headroom} descriptors to spare"),
                &first,
            )?;
        } else {
            cut_short += 1;
            let retry = s.sluice("ADD")?;
            s.added(
                &format!("the retried ADD (first with {headroom} to spare)"),
                &retry,
            )?;
        }
        let del = s.sluice("DEL")?;
        ensure!(del.ok, "DEL: {} {}", del.stdout, del.stderr);
        ensure!(
            sluice::status::read(&s.n.pins)?.is_empty(),
            "DEL left the pod"
        );
        if first.ok {
            ensure!(
                cut_short > 0,
                "no ADD failed under any limit: nothing was tested"
            );
            s.remove_pod();
            return Ok(());
        }
    }
    anyhow::bail!("no ADD succeeded with up to 63 descriptors to spare")
}

/// The pod captured, then for every descriptor headroom from one until the
/// agent can tell, a DEL for another sandbox of the pod (another container
/// id, a netns long gone) under that limit: refused or accepted, it leaves
/// the live capture in place.
fn stale_del_under_emfile() -> TestResult {
    let s = Setup::new("esd")?;
    let pid = s.pid()?;
    s.added("the ADD", &s.sluice("ADD")?)?;
    let cni = sluice_cni();
    let old = std::path::PathBuf::from(format!("{}-old", s.n.pod_path().display()));
    let mut refused = 0;
    for headroom in 1..64 {
        fd_limit(pid, Some(headroom))?;
        let del = Exec {
            container_id: "an-old-sandbox",
            ..s.n.exec(&cni, "DEL", &s.conf, Some(&old))
        }
        .run();
        fd_limit(pid, None)?;
        let del = del?;
        refused += usize::from(!del.ok);
        let what = format!("a stale DEL with {headroom} descriptors to spare");
        s.captured(&what)?;
        if del.ok {
            ensure!(
                refused > 0,
                "no stale DEL was cut short: nothing was tested"
            );
            let del = s.sluice("DEL")?;
            ensure!(del.ok, "DEL: {} {}", del.stdout, del.stderr);
            s.remove_pod();
            return Ok(());
        }
    }
    anyhow::bail!("no stale DEL was answered with up to 63 descriptors to spare")
}

/// For every descriptor headroom from one until a DEL finishes within it:
/// the pod captured, one DEL under that limit (cut short wherever the
/// descriptors ran out, or refused: retried), the limit lifted. `sluice-cni`
/// answers a DEL OK whatever the agent could not do (a runtime must be able
/// to remove a sandbox), and the agent finishes the teardown itself (at
/// once, then after 1 s, 2 s, 4 s… while it cannot), so nothing of the pod
/// is left soon after: no state, no pins, and no filter at its hooks. (Found by this sweep: a teardown under EMFILE read "cannot
/// look the interface up" as "the interface is gone", dropped the filter's
/// record and left the filter running, with nothing left to say it was
/// sluice's.)
fn del_cut_short_is_finished() -> TestResult {
    let s = Setup::new("edl")?;
    let pid = s.pid()?;
    let mut cut_short = 0;
    for headroom in 1..64 {
        s.added("the ADD", &s.sluice("ADD")?)?;
        let cookie = sluice::status::read(&s.n.pins)?[0].netns_cookie;
        fd_limit(pid, Some(headroom))?;
        let del = s.sluice("DEL");
        let left = sluice::status::read(&s.n.pins).map(|p| !p.is_empty());
        fd_limit(pid, None)?;
        let del = del?;
        let what = format!("a DEL with {headroom} descriptors to spare");
        // Refused (it cannot tell whether the DEL names the live sandbox):
        // the runtime retries it.
        let finished = del.ok && !left?;
        cut_short += usize::from(!finished);
        let del = if del.ok { del } else { s.sluice("DEL")? };
        ensure!(del.ok, "{what}, retried: {} {}", del.stdout, del.stderr);
        wait::until(
            &format!("nothing left after {what}"),
            wait::DEADLINE,
            || gone(&s, cookie),
        )
        .with_context(|| s.agent.log())?;
        if finished {
            ensure!(cut_short > 0, "no DEL was cut short: nothing was tested");
            s.remove_pod();
            return Ok(());
        }
    }
    anyhow::bail!("no DEL finished with up to 63 descriptors to spare")
}

/// Nothing of the pod at its hooks, in the state map or in its pins.
fn gone(s: &Setup, cookie: u64) -> Result<(), String> {
    let pods = sluice::status::read(&s.n.pins).map_err(|e| e.to_string())?;
    match (
        pods.is_empty(),
        s.n.pins.pod(cookie).exists(),
        s.egress().program().is_ok(),
    ) {
        (true, false, false) => Ok(()),
        left => Err(format!("pod, pins, filter left: {left:?} {pods:?}")),
    }
}

/// A pod enrolled over the control socket (as the agent captures a
/// running pod, with no sandbox to guard), then for every descriptor
/// headroom from one until an unenroll finishes within it: one unenroll
/// under that limit, the limit lifted, and a retry while it is refused.
/// Its capture is whole or gone, never half: once the state is gone, so is
/// everything at its hooks (no filter left running with nothing to say it
/// was sluice's).
fn unenroll_under_emfile() -> TestResult {
    let s = Setup::new("eun")?;
    let pid = s.pid()?;
    let uid = "5a1e-cart";
    for headroom in 1..64 {
        let e = s.agent.enroll(&s.n.pod_path(), uid, "shop", "cart-7f9")?;
        ensure!(e.ok, "enroll: {} {}", e.stdout, e.stderr);
        s.captured("the enrollment")?;
        let cookie = sluice::status::read(&s.n.pins)?[0].netns_cookie;
        fd_limit(pid, Some(headroom))?;
        let first = s.agent.sluice(&["unenroll", "--uid", uid]);
        fd_limit(pid, None)?;
        let first = first?;
        let what = format!("an unenroll with {headroom} descriptors to spare");
        if first.ok {
            gone(&s, cookie)
                .map_err(|e| anyhow::anyhow!("{what} said done: {e}\n{}", s.agent.log()))?;
            // Every headroom below this one cut the unenroll short.
            ensure!(
                headroom > 1,
                "no unenroll was cut short: nothing was tested"
            );
            s.remove_pod();
            return Ok(());
        }
        // What the first attempt left is whole or being torn down; the
        // retry finishes it.
        // (The first may have finished after all, its answer lost: the
        // agent could not write it, or the CLI gave up waiting.)
        let retry = s.agent.sluice(&["unenroll", "--uid", uid])?;
        ensure!(
            retry.ok || retry.stderr.contains("no enrolled pod has uid"),
            "{what}, retried: {} {}",
            retry.stdout,
            retry.stderr
        );
        gone(&s, cookie).map_err(|e| anyhow::anyhow!("{what}, retried: {e}\n{}", s.agent.log()))?;
    }
    anyhow::bail!("no unenroll finished with up to 63 descriptors to spare")
}

/// For every descriptor headroom from one until a repair succeeds within
/// it: the pod's sk_lookup link pin removed (which detaches the link: its
/// inbound and outbound capture stop) while the agent is under that limit,
/// the agent's repair of it counted as failed
/// (`sluice_capture_repair_errors_total`), then the limit lifted and
/// nothing else done: the link is back well before the periodic
/// verification (set to 10 minutes here) could put it back.
fn repair_retried_after_emfile() -> TestResult {
    let port = sluice_tests::agent::free_port()?;
    let metrics = format!("127.0.0.1:{port}");
    let s = Setup::with_agent_flags(
        "erp",
        &["--metrics-addr", &metrics, "--verify-every", "10m"],
    )?;
    let add = s.sluice("ADD")?;
    s.added("the ADD", &add)?;
    let cookie = sluice::status::read(&s.n.pins)?[0].netns_cookie;
    let pid = s.pid()?;
    let pin = s.n.pins.pod(cookie).join("steer");
    let netns = s.n.pod_path();
    // The link pinned and attached in the pod's netns.
    let attached = || -> Result<(), String> {
        let running =
            sluice_tests::inspect::sk_lookup_programs(&netns).map_err(|e| e.to_string())?;
        match (pin.exists(), running.is_empty()) {
            (true, false) => Ok(()),
            seen => Err(format!("pin, nothing attached: {seen:?}")),
        }
    };
    attached().map_err(anyhow::Error::msg)?;
    // Once without a limit: its repair shows the agent watches the pod
    // (a pod not watched yet is verified when its watch opens, which under
    // the limit it would not).
    std::fs::remove_file(&pin)?;
    wait::until("the link put back", wait::DEADLINE, attached).with_context(|| s.agent.log())?;
    for headroom in 1..64 {
        let before = repair_errors(port)?;
        fd_limit(pid, Some(headroom))?;
        let removed = std::fs::remove_file(&pin);
        // The repair the removal causes runs under the limit: it fails
        // (counted) or puts the link back. (The count is read over a new
        // connection, which the agent accepts once the failed repair has
        // closed its descriptors.)
        let repair = removed.map_err(anyhow::Error::from).and_then(|()| {
            wait::until(
                &format!("the repair with {headroom} descriptors to spare"),
                wait::DEADLINE,
                || match (attached(), repair_errors(port)) {
                    (Ok(()), _) => Ok(false),
                    (_, Ok(n)) if n > before => Ok(true),
                    seen => Err(format!("{seen:?}")),
                },
            )
        });
        fd_limit(pid, None)?;
        let failed = repair.with_context(|| s.agent.log())?;
        if !failed {
            // Every headroom below this one cut the repair short.
            ensure!(headroom > 1, "no repair was cut short: nothing was tested");
            s.remove_pod();
            return Ok(());
        }
        wait::until(
            &format!(
                "the link put back after a repair with {headroom} descriptors to spare failed"
            ),
            wait::DEADLINE,
            attached,
        )
        .with_context(|| s.agent.log())?;
    }
    anyhow::bail!("no repair succeeded with up to 63 descriptors to spare")
}

/// `sluice_capture_repair_errors_total` from the agent's metrics.
fn repair_errors(port: u16) -> anyhow::Result<u64> {
    let (code, body) = sluice_tests::agent::http_get(port, "/metrics")?;
    ensure!(code == 200, "metrics: HTTP {code}");
    let line = body
        .lines()
        .find_map(|l| l.strip_prefix("sluice_capture_repair_errors_total "))
        .context("no sluice_capture_repair_errors_total")?;
    Ok(line.trim().parse()?)
}

/// A pod Served, then for every descriptor headroom from one until ztunnel's
/// snapshot can carry the pod: ztunnel gone (the pod `Pending`, its
/// listeners closed at once: `--orphan-grace 0s`), a new one started while
/// the agent is under that limit, which its snapshot and the adds after it
/// may not be able to open the pod's netns for (`keep`, then attempts
/// counted as `netns_unavailable`), and the limit lifted: the pod is
/// offered to the new ztunnel and `Served` again.
fn ztunnel_restart_under_emfile() -> TestResult {
    use sluice_tests::agent::{free_port, metric_sum, PeerProc};
    const UNAVAILABLE: &str = "sluice_enrollment_failures_total{reason=\"netns_unavailable\"}";
    let port = free_port()?;
    let metrics = format!("127.0.0.1:{port}");
    let f = Fixture::new("ezr", None)?;
    let agent = AgentProc::start_with(
        &f.topo.pins,
        &["--metrics-addr", &metrics, "--orphan-grace", "0s"],
    )?;
    let mut peer = crate::agent::peer_with(&agent, &[])?;
    crate::agent::enroll_enabled(&agent, &f)?;
    f.wait_state("Served")?;
    let pid = agent.pid().context("the agent's pid")?;
    let offered = |p: &PeerProc| {
        let events = p.events();
        let snapshot = events.split(|e| e["event"] == "snapshot_sent").next();
        (
            snapshot.is_some_and(|s| {
                s.iter()
                    .any(|e| e["event"] == "add" && e["uid"] == f.uid.as_str())
            }),
            events
                .iter()
                .any(|e| e["event"] == "add" && e["uid"] == f.uid.as_str()),
        )
    };
    let mut cut_short = 0;
    // A descriptor the agent held only for a moment when the limit was set
    // (a status or metrics connection) raises the headroom by one: a first
    // headroom whose snapshot carried the pod anyway is tried again.
    let headrooms = std::iter::repeat_n(1, 5).chain(2..64);
    for headroom in headrooms {
        peer.kill();
        f.wait_state("Pending")?;
        wait::until("no ztunnel connected", wait::DEADLINE, || {
            let n = agent.node_status().map_err(|e| e.to_string())?;
            match n["ztunnels"].as_array() {
                Some(z) if z.iter().all(|z| z["connected"] != true) => Ok(()),
                _ => Err(n["ztunnels"].to_string()),
            }
        })?;
        let before = metric_sum(port, UNAVAILABLE)?;
        fd_limit(pid, Some(headroom))?;
        // Under the limit: the snapshot, and the attempt the agent makes
        // right after it for a pod the snapshot could not carry. (Nothing
        // the agent serves can be read under the limit: its interface
        // watch retries take the last descriptors.)
        let next = PeerProc::start(&sluice_tests::harness::peer_bin(), &agent.zds, &[]);
        let snapshot = next
            .as_ref()
            .map_err(|e| anyhow::anyhow!("{e}"))
            .and_then(PeerProc::wait_snapshot);
        fd_limit(pid, None)?;
        peer = next?;
        snapshot.with_context(|| agent.log())?;
        let what = format!("a ztunnel restart with {headroom} descriptors to spare");
        peer.wait_for(&format!("the pod offered after {what}"), |_| {
            offered(&peer).1
        })
        .with_context(|| agent.log())?;
        f.wait_state("Served")
            .with_context(|| format!("after {what}\n{}", agent.log()))?;
        cut_short += usize::from(metric_sum(port, UNAVAILABLE)? > before);
        if offered(&peer).0 {
            if cut_short > 0 {
                return Ok(());
            }
            ensure!(
                headroom == 1,
                "no attempt failed to open the netns: nothing was tested"
            );
        }
    }
    anyhow::bail!("no snapshot carried the pod with up to 63 descriptors to spare")
}

//! Verification by running the capture (issue 40): the programs the kernel
//! holds at a captured pod's hooks, run on synthetic packets, give the
//! captured verdicts and leave nothing behind; each way capture can break
//! silently is named by the case it fails.

use anyhow::{ensure, Context as _};
use aya::maps::{HashMap, Map, MapData};
use libtest_mimic::Trial;
use sluice::{
    dataplane::state::Maps,
    podnet::{enroll, verify},
};
use sluice_common::{Budget, Counters, DropReason, FlowHint, FlowKey, Role};
use sluice_tests::{
    agent::{http_get, AgentProc, PeerProc},
    harness::{as_if_kernel, peer_bin, without_netns_cookie_in_tc, Fixture},
    inspect::Hook,
    ns::netns_path,
    standin::Bind,
    wait,
};

use crate::{local_route_trial, tcx_trial, trial, TestResult};
use sluice_tests::harness::tcx_available;

pub fn trials() -> Vec<Trial> {
    vec![
        trial(
            "verify::a_captured_pod_passes_and_the_test_runs_leave_no_trace",
            || passes_without_trace("vpt"),
        ),
        trial(
            "verify::no_netns_cookie_in_tc::a_captured_pod_passes_and_the_test_runs_leave_no_trace",
            || as_if_kernel(without_netns_cookie_in_tc(), || passes_without_trace("vpn")),
        ),
        tcx_trial(
            "verify::tcx::a_captured_pod_passes_and_the_test_runs_leave_no_trace",
            || passes_without_trace("vpx"),
        ),
        local_route_trial(
            "verify::local_route::a_captured_pod_passes_and_los_egress_program_removed_is_named",
            lo_out_removed,
        ),
        trial(
            "verify::each_silent_break_is_named_by_its_case",
            breaks_named,
        ),
        trial(
            "verify::a_pod_failing_verification_is_not_served_until_it_passes",
            agent_reports_failure,
        ),
        trial(
            "verify::the_host_side_program_is_run_too_and_named_when_missing",
            host_side,
        ),
        tcx_trial("verify::tcx::a_foreign_tcx_program_first_is_named", || {
            tcx_ahead("vtx")
        }),
        // cls_bpf filters run after every tcx program of the hook.
        trial(
            "verify::a_foreign_tcx_program_ahead_of_sluices_filter_is_named",
            || tcx_ahead("vtc"),
        )
        .with_ignored_flag(!sluice_tests::harness::is_root() || !tcx_available()),
    ]
}

/// A captured pod: enrolled, the stand-in's listeners registered.
fn captured(tag: &str) -> anyhow::Result<(Fixture, u64)> {
    let f = Fixture::new(tag, Some(Bind::DualStack))?;
    f.enroll()?;
    let cookie = f.register()?.cookie;
    Ok((f, cookie))
}

pub(crate) fn run(
    f: &Fixture,
    cookie: u64,
) -> anyhow::Result<Result<verify::Verified, verify::Failed>> {
    let dp = f.dataplane()?;
    let plan = verify::plan(&dp, cookie).context("no verification plan for the pod")?;
    Ok(verify::verify(&plan))
}

/// What real traffic could meet of a verification: the pod's counters,
/// the node's drops, and the entries of the hint maps.
#[derive(Debug, PartialEq, Eq)]
struct Trace {
    counters: Counters,
    drops: Vec<u64>,
    over_share: u64,
    hints: usize,
    overflow: usize,
    budget: usize,
    verify_hints: usize,
}

fn trace(f: &Fixture, cookie: u64) -> anyhow::Result<Trace> {
    let dir = f.topo.pins.maps();
    let maps = Maps::open_pinned(&dir)?;
    let hints = |name: &str| -> anyhow::Result<usize> {
        let data = MapData::from_pin(dir.join(name))?;
        Ok(
            HashMap::<_, FlowKey, FlowHint>::try_from(Map::LruHashMap(data))?
                .keys()
                .count(),
        )
    };
    let budget = HashMap::<_, u64, Budget>::try_from(Map::LruHashMap(MapData::from_pin(
        dir.join("hint_budget"),
    )?))?
    .keys()
    .count();
    let verify_hints = HashMap::<_, FlowKey, FlowHint>::try_from(Map::HashMap(MapData::from_pin(
        dir.join("verify_hints"),
    )?))?
    .keys()
    .count();
    Ok(Trace {
        counters: maps.counters(cookie),
        drops: DropReason::ALL.iter().map(|r| maps.drops(*r)).collect(),
        over_share: maps.hints_over_share(),
        hints: hints("flow_hints")?,
        overflow: hints("flow_hints_overflow")?,
        budget,
        verify_hints,
    })
}

fn passes_without_trace(tag: &str) -> TestResult {
    let (f, cookie) = captured(tag)?;
    let before = trace(&f, cookie)?;
    let v = run(&f, cookie)?.map_err(|e| anyhow::anyhow!("verification failed: {e}"))?;
    // Two addresses, each: inbound, HBONE and outbound (tc and sk_lookup)
    // and ztunnel's mark; plus the hooks.
    ensure!(v.cases >= 2 * 7, "only {} cases ran: {v:?}", v.cases);
    ensure!(v.unrun.is_empty(), "left unrun: {:?}", v.unrun);
    let after = trace(&f, cookie)?;
    ensure!(
        before == after,
        "the verification left a trace:\nbefore {before:?}\nafter  {after:?}"
    );
    Ok(())
}

/// On the local route: the pod passes, `lo`'s egress program run on its
/// SYN (without ztunnel's 15001 listener, that case fails first); without
/// the program (its filter deleted by a pod with NET_ADMIN) the case names
/// the hook, and a repair puts it back.
fn lo_out_removed() -> TestResult {
    let (f, cookie) = captured("vlo")?;
    run(&f, cookie)?.map_err(|e| anyhow::anyhow!("before any break: {e}"))?;
    Maps::open_pinned(&f.topo.pins.maps())?.remove_listener(cookie, Role::Outbound);
    match run(&f, cookie)? {
        Err(e) if e.case.starts_with("outbound over lo") => {}
        other => anyhow::bail!("expected the local route's case to fail, got {other:?}"),
    }
    f.register()?;
    run(&f, cookie)?.map_err(|e| anyhow::anyhow!("after re-registering: {e}"))?;
    let lo = Hook {
        ns: &f.topo.pod,
        dev: "lo",
        dir: "egress",
    };
    lo.tc("del", None)?;
    match run(&f, cookie)? {
        Err(e) if e.case.starts_with("egress lo") => {}
        other => anyhow::bail!("expected case \"egress lo\" to fail, got {other:?}"),
    }
    let mut dp = f.dataplane()?;
    enroll::repair(&mut dp, cookie, false)?;
    drop(dp);
    run(&f, cookie)?.map_err(|e| anyhow::anyhow!("still failing after the repair: {e}"))?;
    Ok(())
}

/// Each break fails the case that names it; the repair (or re-registering
/// the listener) makes the pod pass again.
fn breaks_named() -> TestResult {
    let (f, cookie) = captured("vbn")?;
    let dir = f.topo.pins.pod(cookie);
    let expect = |what: &str, case: &str| -> TestResult {
        match run(&f, cookie)? {
            Err(e) if e.case.starts_with(case) => Ok(()),
            other => anyhow::bail!("{what}: expected case {case:?} to fail, got {other:?}"),
        }
    };
    let repaired = |what: &str| -> TestResult {
        let mut dp = f.dataplane()?;
        enroll::repair(&mut dp, cookie, false)?;
        drop(dp);
        run(&f, cookie)?
            .map_err(|e| anyhow::anyhow!("{what}: still failing after the repair: {e}"))?;
        Ok(())
    };
    run(&f, cookie)?.map_err(|e| anyhow::anyhow!("before any break: {e}"))?;

    let hook = |dir| Hook {
        ns: &f.topo.pod,
        dev: "eth0",
        dir,
    };
    let (egress, ingress) = (hook("egress"), hook("ingress"));
    // The egress filter's program swapped for the ingress one, in place.
    egress.tc("replace", Some(&dir.join("ingress_eth0")))?;
    expect("a swapped program", "egress eth0")?;
    repaired("a swapped program")?;

    // The egress filter moved to the ingress hook (another tool's idea of
    // its place): egress has none, ingress runs it ahead of sluice's.
    egress.tc("del", None)?;
    ingress.tc_handle("add", "0x7", Some(&dir.join("egress_eth0")))?;
    expect("a filter moved to the other hook", "egress eth0")?;
    repaired("a filter moved")?;
    // The repair put sluice's ingress filter back in front of the moved one.
    ingress.tc_handle("del", "0x7", None)?;
    run(&f, cookie)?.map_err(|e| anyhow::anyhow!("after removing the moved filter: {e}"))?;

    // Another tool's filter that passes everything, ahead of sluice's.
    let pass = f.topo.pins.progs().join("verify_pass");
    sluice_tests::inspect::pin_pass_program(&pass)?;
    egress.tc_handle("add", "0x2", Some(&pass))?;
    expect("a foreign filter ahead", "egress eth0")?;
    repaired("a foreign filter ahead")?;
    egress.tc_handle("del", "0x2", None)?;

    // ztunnel's inbound listener gone from the socket map.
    Maps::open_pinned(&f.topo.pins.maps())?.remove_listener(cookie, Role::Inbound);
    expect("the inbound listener gone from the map", "inbound")?;
    f.register()?;
    run(&f, cookie)?.map_err(|e| anyhow::anyhow!("after re-registering: {e}"))?;

    // The sk_lookup link detached: its pin was what held it. The kernel
    // may free a link after its last reference goes (deferred work): the
    // verification fails once it has.
    std::fs::remove_file(dir.join("steer"))?;
    wait::until(
        "the sk_lookup link detached",
        wait::DEADLINE,
        || match run(&f, cookie) {
            Ok(Err(e)) if e.case == "sk_lookup" => Ok(()),
            other => Err(format!("{other:?}")),
        },
    )?;
    repaired("the sk_lookup link detached")
}

/// The agent verifies a pod once its listeners are registered and every
/// `--verify-every`: a foreign sk_lookup program in the pod's netns (no
/// event announces it, and the agent leaves it alone) fails the pod's
/// verification within a period. Meanwhile `sluice status` says the pod is
/// not served and why, `--pod` names the case, and the failure is counted;
/// once it is gone, the pod passes again.
fn agent_reports_failure() -> TestResult {
    let f = Fixture::new("vag", None)?;
    let (agent, port) = AgentProc::start_verifying(&f.topo.pins, &[])?;
    let _peer = PeerProc::start(&peer_bin(), &agent.zds, &[])?;
    let out = agent.enroll(&f.topo.pod_netns_path(), f.uid.as_str(), "default", "vag")?;
    ensure!(
        out.ok,
        "enroll: {} {}\n{}",
        out.stdout,
        out.stderr,
        agent.log()
    );
    let uid = f.uid.as_str().to_owned();
    let agent = &agent;
    let outcome = |want: &'static str| {
        let uid = uid.clone();
        move || match agent.node_status() {
            Ok(s) => {
                let v = s["verifications"]
                    .as_array()
                    .and_then(|a| a.iter().find(|v| v["uid"] == uid.as_str()).cloned());
                match v {
                    Some(v) if v["outcome"] == want => Ok(v),
                    other => Err(format!("{other:?}")),
                }
            }
            Err(e) => Err(e.to_string()),
        }
    };
    wait::until("the pod verified", wait::DEADLINE, outcome("verified"))
        .with_context(|| agent.log())?;
    let foreign = sluice_tests::inspect::attach_pass_sk_lookup(&f.topo.pod_netns_path())?;
    let v = wait::until(
        "the pod's verification failed",
        wait::DEADLINE,
        outcome("failed"),
    )
    .with_context(|| agent.log())?;
    ensure!(v["case"] == "sk_lookup", "{v}");
    let table = agent.sluice(&["status"])?.stdout;
    ensure!(
        table.contains("no (unverified: sk_lookup)"),
        "the SERVED column does not say it:\n{table}"
    );
    let pod = agent.sluice(&["status", "--pod", f.uid.as_str()])?;
    let pod = format!("{}{}", pod.stdout, pod.stderr);
    ensure!(
        pod.contains("failed verification: sk_lookup") && pod.contains("FAILED"),
        "`status --pod` does not explain it:\n{pod}"
    );
    let (_, metrics) = http_get(port, "/metrics")?;
    ensure!(
        metrics.lines().any(|l| l
            .starts_with("sluice_capture_verifications_total{result=\"failed\"}")
            && !l.ends_with(" 0")),
        "no failed verification counted:\n{metrics}"
    );
    drop(foreign);
    wait::until(
        "the pod verified again",
        wait::DEADLINE,
        outcome("verified"),
    )
    .with_context(|| agent.log())?;
    // ztunnel's inbound listener taken out of the socket map behind the
    // agent's back: the supervisor sees the pod's listeners gone, it waits
    // (fail closed) and is offered to ztunnel again, whose re-ack puts the
    // listeners back; then it is verified again.
    let cookie = f.pod_record()?.netns_cookie;
    Maps::open_pinned(&f.topo.pins.maps())?.remove_listener(cookie, Role::Inbound);
    wait::until("the inbound listener back", wait::DEADLINE, || {
        match f.pod_record() {
            Ok(r) if r.listeners.iter().any(|l| l.starts_with("inbound/")) => Ok(()),
            r => Err(format!("{:?}", r.map(|r| r.listeners))),
        }
    })
    .with_context(|| agent.log())?;
    wait::until("verified with it back", wait::DEADLINE, outcome("verified"))
        .with_context(|| agent.log())?;
    // A break the tc event announces (the egress filter's program swapped
    // in place) is put back within milliseconds, before a verification
    // could run on it: it is still reported, as a failed verification of
    // case `hooks` (counted, an Event), and the pod passes again.
    let failed =
        || sluice_tests::agent::metric_sum(port, sluice_tests::agent::FAILED_VERIFICATIONS);
    let before = failed()?;
    let hook = Hook {
        ns: &f.topo.pod,
        dev: "eth0",
        dir: "egress",
    };
    let ours = hook.program()?;
    hook.tc(
        "replace",
        Some(&f.topo.pins.pod(cookie).join("ingress_eth0")),
    )?;
    hook.wait_program(ours).with_context(|| agent.log())?;
    wait::until("the break counted", wait::DEADLINE, || match failed() {
        Ok(n) if n > before => Ok(()),
        other => Err(format!("{other:?}")),
    })
    .with_context(|| agent.log())?;
    wait::until(
        "verified after the repair",
        wait::DEADLINE,
        outcome("verified"),
    )
    .with_context(|| agent.log())?;
    Ok(())
}

/// With the node known, the host side of the pod's veth is verified too:
/// its program runs first there and hints a probe-shaped SYN as the
/// node's own. Deleted, the case names it; the repair puts it back.
fn host_side() -> TestResult {
    let f = Fixture::new("vhs", Some(Bind::DualStack))?;
    let cookie = f.enroll_with_node()?.cookie;
    f.register()?;
    let node = || -> anyhow::Result<sluice::dataplane::loader::Dataplane> {
        let mut dp = f.dataplane()?;
        dp.set_node(sluice::podnet::hostside::Node::open(&netns_path(
            &f.topo.client,
        ))?)?;
        Ok(dp)
    };
    let run = || -> anyhow::Result<Result<verify::Verified, verify::Failed>> {
        let dp = node()?;
        let plan = verify::plan(&dp, cookie).context("no verification plan")?;
        ensure!(
            plan.host.as_ref().is_some_and(|h| h.peers.len() == 1),
            "the plan has no host side"
        );
        Ok(verify::verify(&plan))
    };
    let before = run()?.map_err(|e| anyhow::anyhow!("before: {e}"))?;
    let host = Hook {
        ns: &f.topo.client,
        dev: "veth-c",
        dir: "egress",
    };
    host.tc("del", None)?;
    match run()? {
        Err(e) if e.case == "host side veth-c" => {}
        other => anyhow::bail!("the missing host-side filter: {other:?}"),
    }
    enroll::repair(&mut node()?, cookie, false)?;
    let after = run()?.map_err(|e| anyhow::anyhow!("after the repair: {e}"))?;
    ensure!(after.cases == before.cases, "{before:?} vs {after:?}");
    Ok(())
}

/// Another tool's tcx program attached first on the pod's egress hook (no
/// netlink event announces it): whatever sluice attaches there, a
/// cls_bpf filter or a tcx link, runs after it, and the case names it.
fn tcx_ahead(tag: &str) -> TestResult {
    let (f, cookie) = captured(tag)?;
    let pass = f.topo.pins.progs().join("tcx_pass");
    sluice_tests::inspect::pin_pass_program(&pass)?;
    let link = sluice_tests::inspect::attach_tcx_first(
        &f.topo.pod,
        "eth0",
        aya::programs::TcAttachType::Egress,
        &pass,
    )?;
    match run(&f, cookie)? {
        Err(e) if e.case == "egress eth0" && e.detail.contains("runs first") => {}
        other => anyhow::bail!("a foreign tcx program first: {other:?}"),
    }
    drop(link);
    wait::until("verified once it is gone", wait::DEADLINE, || {
        match run(&f, cookie) {
            Ok(Ok(_)) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })?;
    Ok(())
}

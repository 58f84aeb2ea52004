//! A runtime's ADD that failed, retried: the retry may only be answered
//! once the pod is captured. Found by the chaos run (seed
//! 1795780032951110225): an ADD cut short by EMFILE left its capture half
//! torn down (`Draining`), the retried ADD was answered as enrolled, and the
//! pod started uncaptured.

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use serde_json::json;
use sluice_common::PodState;
use sluice_tests::{
    agent::{fd_limit, AgentProc},
    cni::{plugin, Invocation},
    inspect::Hook,
};

use crate::{
    cni::{sluice_cni, Node},
    trial, TestResult,
};

pub fn trials() -> Vec<Trial> {
    vec![trial(
        "cni::an_add_cut_short_by_emfile_then_retried_leaves_the_pod_captured",
        add_retried_after_emfile,
    )]
}

/// For every descriptor headroom, from one until an ADD succeeds within
/// it, one ADD under that limit (cut short wherever the descriptors ran
/// out), then, the limit lifted, the runtime's retry: an ADD answered OK
/// leaves the pod captured (its state attached, sluice's program first on
/// its egress hook), whichever step the first attempt stopped at. DEL
/// between headrooms.
fn add_retried_after_emfile() -> TestResult {
    let n = Node::new("emf")?;
    let agent = AgentProc::start(&n.pins)?;
    let pid = agent.pid().context("the agent's pid")?;
    let pod = n.pod_path();
    let ptp_conf = n.ptp_conf();
    let ptp = n.exec(&plugin("ptp"), "ADD", &ptp_conf, Some(&pod)).run()?;
    ensure!(ptp.ok, "ptp ADD: {} {}", ptp.stdout, ptp.stderr);
    let conf = json!({"cniVersion": "1.0.0", "name": "sluice-test", "type": "sluice-cni",
        "agentSocket": agent.control, "prevResult": ptp.json()?});
    let cni = sluice_cni();
    let sluice = |command| n.exec(&cni, command, &conf, Some(&pod)).run();
    let captured = |what: &str, add: &Invocation| -> TestResult {
        ensure!(add.ok, "{what}: {} {}", add.stdout, add.stderr);
        let pods = sluice::status::read(&n.pins)?;
        let state = pods.first().and_then(|p| p.state);
        ensure!(
            pods.len() == 1 && state.is_some_and(|s| s != PodState::Draining),
            "{what} was answered OK, but the pod is not captured: {pods:?}\n{}",
            agent.log()
        );
        let egress = Hook {
            ns: &n.pod,
            dev: "eth0",
            dir: "egress",
        };
        egress
            .program()
            .with_context(|| format!("{what}: nothing at the pod's egress\n{}", agent.log()))?;
        Ok(())
    };
    let mut cut_short = 0;
    // From one: with none, the agent cannot even accept the plugin's
    // connection, which then waits out its timeout (refused, not this case).
    for headroom in 1..64 {
        fd_limit(pid, Some(headroom))?;
        let first = sluice("ADD");
        fd_limit(pid, None)?;
        let first = first?;
        if first.ok {
            captured(
                &format!("the ADD with {headroom} descriptors to spare"),
                &first,
            )?;
        } else {
            cut_short += 1;
            let retry = sluice("ADD")?;
            captured(
                &format!("the retried ADD (first with {headroom} to spare)"),
                &retry,
            )?;
        }
        let del = sluice("DEL")?;
        ensure!(del.ok, "DEL: {} {}", del.stdout, del.stderr);
        ensure!(
            sluice::status::read(&n.pins)?.is_empty(),
            "DEL left the pod"
        );
        if first.ok {
            ensure!(
                cut_short > 0,
                "no ADD failed under any limit: nothing was tested"
            );
            let _ = n.exec(&plugin("ptp"), "DEL", &ptp_conf, Some(&pod)).run();
            return Ok(());
        }
    }
    anyhow::bail!("no ADD succeeded with up to 63 descriptors to spare")
}

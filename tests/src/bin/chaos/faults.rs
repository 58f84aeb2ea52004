//! Applying one fault to the run, and telling the ledger what it may do to
//! the pods' connections (`Opens`): a fault that is not allowed to fail a
//! connection makes every failure under it a violation.

use std::{
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use sluice_tests::ns;

use crate::{ledger::Opens, run::Run, schedule::Fault};

/// Applies `fault`; an error is the run's own failure to inject it (not a
/// violation of sluice's).
pub fn apply(run: &mut Run, fault: &Fault) -> anyhow::Result<()> {
    let kind = fault.kind();
    let l = run.ledger.clone();
    match *fault {
        Fault::AgentKill => {
            // The dataplane stays pinned: traffic goes on while it is down.
            l.touch(None, kind, Opens::Nothing);
            run.node.kill_agent()?;
        }
        Fault::AgentTerm => {
            l.touch(None, kind, Opens::Nothing);
            run.node.term_agent()?;
        }
        Fault::PeerKill => {
            // Its proxied connections die with it; new ones fail closed
            // until the new peer's listeners are in.
            l.touch(None, kind, Opens::Failures);
            run.node.peer.kill();
            drop(run.node.new_peer()?);
        }
        Fault::PeerUpgradeNewFirst => {
            // The old peer drains: only what it still holds may fail.
            l.touch(None, kind, Opens::LongLivedFailures);
            let mut old = run.node.new_peer()?;
            run.node.peer.wait_snapshot()?;
            old.terminate();
        }
        Fault::PeerUpgradeOldFirst => {
            l.touch(None, kind, Opens::Failures);
            run.node.peer.terminate();
            drop(run.node.new_peer()?);
        }
        Fault::PodAdd => run.add_pod()?,
        Fault::PodDelete { slot } => {
            if let Some(i) = run.pick(slot) {
                run.delete_pod(i, 0)?;
            }
        }
        Fault::DelStorm { slot } => {
            if let Some(i) = run.pick(slot) {
                run.delete_pod(i, 4)?;
            }
        }
        Fault::StaleDel { slot } => {
            if let Some(i) = run.pick(slot) {
                // The live capture must stay: nothing may fail.
                let pod = &run.pods[i].pod;
                l.touch(Some(&pod.uid), kind, Opens::Nothing);
                let del = run.node.del(pod, "an-old-sandbox")?;
                anyhow::ensure!(del.ok, "a stale DEL failed: {}", del.stdout);
            }
        }
        Fault::FilterDelete { slot } => {
            if let Some(i) = run.pick(slot) {
                l.touch(Some(&run.pods[i].pod.uid), kind, Opens::Tamper);
                // The agent may have put it back under another's fault already.
                let _ = run.hook(i, "egress").tc("delete", None);
            }
        }
        Fault::ProgramReplace { slot } => {
            if let Some(i) = run.pick(slot) {
                l.touch(Some(&run.pods[i].pod.uid), kind, Opens::Tamper);
                let pin = run.pass_pin.clone();
                let _ = run.hook(i, "egress").tc("replace", Some(&pin));
            }
        }
        Fault::ForeignQdisc { slot } => {
            if let Some(i) = run.pick(slot) {
                let pod = &run.pods[i].pod;
                l.touch(Some(&pod.uid), kind, Opens::Nothing);
                // Already there from an earlier fault: the same state.
                let _ = ns::exec(
                    &run.node.node_ns,
                    &["tc", "qdisc", "add", "dev", &pod.host_veth, "ingress"],
                );
            }
        }
        Fault::CpuHog { secs } => cpu_hog(Duration::from_secs(secs)),
        Fault::InjectBypass { slot } => {
            let i = run.pick(slot).context("no pod to bypass")?;
            run.pods[i].pod.bypass.store(true, Ordering::SeqCst);
        }
    }
    Ok(())
}

/// One busy thread per core for `d`, in the background.
fn cpu_hog(d: Duration) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for _ in 0..cores {
        std::thread::spawn(move || {
            let end = Instant::now() + d;
            let mut x = 0u64;
            while Instant::now() < end {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
        });
    }
}

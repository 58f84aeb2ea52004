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

/// How long a new peer is given to get its snapshot before the old one
/// goes: the bound of the runner's other calls that wait on the agent.
const SNAPSHOT_WITHIN: std::time::Duration = std::time::Duration::from_secs(3);

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
        Fault::AgentUpgrade => {
            // The programs are replaced in place: nothing may fail.
            l.touch(None, kind, Opens::Nothing);
            run.node.upgrade_agent()?;
        }
        Fault::FdLimit | Fault::FdRestore => {
            // An agent out of descriptors cannot take a new ztunnel's
            // connection or listeners (it accepts and duplicates) and
            // fails closed: from the limit until the pods are Served again
            // after the restore, however often they are Served between.
            let limit = matches!(fault, Fault::FdLimit);
            if limit {
                l.touch_until_released(None, kind, Opens::Failures);
            } else {
                l.touch(None, kind, Opens::Failures);
                l.release(Fault::FdLimit.kind());
            }
            let headroom = limit.then_some(8);
            sluice_tests::agent::fd_limit(run.node.agent_pid.load(Ordering::SeqCst), headroom)?;
        }
        Fault::ControlFlood => {
            l.touch(None, kind, Opens::Nothing);
            control_flood(&run.node.agent.control);
        }
        Fault::PeerNack => {
            // A ztunnel that refuses every pod: none is Served, its
            // connections fail closed.
            l.touch(None, kind, Opens::Failures);
            run.node.peer.kill();
            drop(run.node.new_peer_with(&["--nack", "chaos: no config"])?);
        }
        Fault::PeerHoldAcks => {
            l.touch(None, kind, Opens::Failures);
            let _ = std::fs::remove_file(&run.node.ack_gate);
            let gate = run.node.ack_gate.display().to_string();
            run.node.peer.kill();
            drop(run.node.new_peer_with(&["--hold-acks-until", &gate])?);
        }
        Fault::PeerHeal => {
            l.touch(None, kind, Opens::Failures);
            std::fs::write(&run.node.ack_gate, "")?;
            run.node.peer.kill();
            drop(run.node.new_peer()?);
        }
        Fault::PeerKill => {
            // Its proxied connections die with it; new ones fail closed
            // until the new peer's listeners are in.
            l.touch(None, kind, Opens::Failures);
            run.node.peer.kill();
            drop(run.node.new_peer()?);
        }
        Fault::PeerUpgradeNewFirst => {
            // The old peer drains once the new one has its snapshot: only
            // what it still holds may fail. An agent out of descriptors may
            // give the new one none for a while: the old one goes anyway
            // (as Kubernetes ends it after its grace), and until the new
            // peer has the pods their new connections may fail too. Waiting
            // longer would hold the schedule, and with it the fd limit's
            // restore (a 2-hour run stopped on that after 99 minutes).
            l.touch(None, kind, Opens::LongLivedFailures);
            let old = run.node.new_peer()?;
            drain_after_snapshot(run, kind, old);
        }
        Fault::PeerUpgradeAcrossAgentRestart => {
            // The pinned dataplane and the old peer serve while no agent
            // runs; then the pods move to the new peer, whichever of the
            // two reconnects last (seed 1795815962517742895): only what the
            // old one still holds may fail.
            l.touch(None, kind, Opens::LongLivedFailures);
            let connects =
                |e: &[serde_json::Value]| e.iter().filter(|e| e["event"] == "connected").count();
            let before = connects(&run.node.peer.events());
            let old = run.node.kill_agent_around(|node| node.new_peer())?;
            // The sequence needs the old one back too (its reconnect backs
            // off up to about a second); without it, this was a kill and a
            // plain upgrade, which is said.
            let back = sluice_tests::wait::until_seen(
                "the old peer reconnecting",
                SNAPSHOT_WITHIN,
                || old.events(),
                |e| connects(e) > before,
            );
            if back.is_err() {
                eprintln!("chaos: the old peer did not reconnect within {SNAPSHOT_WITHIN:?}");
            }
            drain_after_snapshot(run, kind, old);
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
                let del = run.node.stale_del(pod)?;
                // Refused is fine (the runtime retries it): an agent that
                // cannot tell which sandbox a DEL names keeps the capture.
                // The invariants judge what happened to the pod.
                if !del.ok {
                    eprintln!("chaos: the stale DEL was refused: {}", del.stdout);
                }
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
        Fault::PinsRemoved { slot } => {
            if let Some(i) = run.pick(slot) {
                l.touch(Some(&run.pods[i].pod.uid), kind, Opens::Tamper);
                remove_pod_pins(run, i)?;
            }
        }
        Fault::IfaceAdd { slot } | Fault::IfaceRemove { slot } => {
            if let Some(i) = run.pick(slot) {
                let pod = &run.pods[i].pod;
                l.touch(Some(&pod.uid), kind, Opens::Nothing);
                let verb: &[&str] = match fault {
                    Fault::IfaceAdd { .. } => &["add", "chaos0", "type", "dummy"],
                    _ => &["del", "chaos0"],
                };
                // Already there, or already gone (another pod had the slot).
                let _ = ns::exec(&pod.netns, &[&["ip", "link"][..], verb].concat());
                let _ = ns::exec(&pod.netns, &["ip", "link", "set", "chaos0", "up"]);
            }
        }
        Fault::AddressAdd { slot } => {
            if let Some(i) = run.pick(slot) {
                let pod = &run.pods[i].pod;
                l.touch(Some(&pod.uid), kind, Opens::Nothing);
                let _ = ns::exec(
                    &pod.netns,
                    &["ip", "addr", "add", "10.196.0.9/32", "dev", "eth0"],
                );
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
        Fault::HintFlood { slot } => {
            if let Some(i) = run.pick(slot) {
                let pod = &run.pods[i].pod;
                // Past its share the flooder's own hints live in the overflow
                // map, where its own connections may lose them; no other
                // pod's may.
                l.touch(Some(&pod.uid), kind, Opens::Failures);
                hint_flood(&pod.netns, pod.ips[0], Duration::from_secs(2));
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

/// The old peer SIGTERMed (drained) once the new one has its snapshot, or
/// after [`SNAPSHOT_WITHIN`] anyway (as Kubernetes ends it after its
/// grace); until the new one has the pods, their new connections may then
/// fail too.
fn drain_after_snapshot(run: &Run, kind: &'static str, mut old: sluice_tests::agent::PeerProc) {
    let snapshot = sluice_tests::wait::until_seen(
        "the new peer's snapshot",
        SNAPSHOT_WITHIN,
        || run.node.peer.events(),
        |e| e.iter().any(|e| e["event"] == "snapshot_sent"),
    );
    if snapshot.is_err() {
        eprintln!("chaos: the new peer got no snapshot within {SNAPSHOT_WITHIN:?}: the old one goes anyway");
        run.ledger.touch(None, kind, Opens::Failures);
    }
    old.terminate();
}

/// Ends what lasts at the end of a run (a replayed schedule cut at a
/// violation has no healing events): the agent's fd limit back up, held
/// acks released.
pub fn heal_lasting(run: &Run) {
    let _ = sluice_tests::agent::fd_limit(run.node.agent_pid.load(Ordering::SeqCst), None);
    let _ = std::fs::write(&run.node.ack_gate, "");
}

/// 200 connections to the control socket, half of them with half a
/// request, held a second.
/// On a thread of its own: a connect blocks while the socket's backlog is
/// full (an agent out of descriptors accepts nothing), and the schedule,
/// with the fault that ends that (`fd-restore`), must go on meanwhile.
fn control_flood(socket: &std::path::Path) {
    use std::io::Write as _;
    let socket = socket.to_owned();
    std::thread::spawn(move || {
        let conns: Vec<_> = (0..200)
            .filter_map(|i| {
                let mut c = std::os::unix::net::UnixStream::connect(&socket).ok()?;
                if i % 2 == 0 {
                    let _ = c.write_all(b"{\"status\":");
                }
                Some(c)
            })
            .collect();
        std::thread::sleep(Duration::from_secs(1));
        drop(conns);
    });
}

/// Removes the pod's pins under `pods/<netns cookie>/` (found through
/// the status records).
fn remove_pod_pins(run: &Run, i: usize) -> anyhow::Result<()> {
    let uid = &run.pods[i].pod.uid;
    let records = sluice::status::read(&run.node.pins)?;
    let Some(r) = records.iter().find(|r| &r.uid == uid) else {
        return Ok(());
    };
    let dir = run.node.pins.pods().join(r.netns_cookie.to_string());
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.flatten() {
            let _ = std::fs::remove_file(e.path());
        }
    }
    Ok(())
}

/// Two threads in netns `netns` connecting to `ip`'s closed port 9 for
/// `d`, in the background.
fn hint_flood(netns: &str, ip: std::net::IpAddr, d: Duration) {
    let to = std::net::SocketAddr::new(ip, 9);
    for _ in 0..2 {
        ns::spawn_in(netns, move || {
            let end = Instant::now() + d;
            while Instant::now() < end {
                let _ = std::net::TcpStream::connect_timeout(&to, Duration::from_millis(200));
            }
        });
    }
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

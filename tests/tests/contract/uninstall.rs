//! Uninstall under trouble: an enrollment that waited for the dataplane
//! while the uninstall ran, and a pod whose teardown fails.

use std::path::{Path, PathBuf};

use anyhow::ensure;
use libtest_mimic::Trial;
use sluice_tests::{
    agent::AgentProc, child::Bounded as _, harness::Fixture, inspect::filter_programs,
};

use crate::{
    agent::{enroll, enroll_enabled, ensure_steering, peer, walk, Pause},
    needs_fault_injection, trial, TestResult,
};

pub fn trials() -> Vec<Trial> {
    vec![
        needs_fault_injection(trial(
            "uninstall::an_enrollment_waiting_for_the_dataplane_attaches_nothing_after_it",
            waiting_enrollment,
        )),
        trial(
            "uninstall::a_pod_it_cannot_tear_down_stops_no_other_and_asked_again_it_finishes",
            failing_pod,
        ),
    ]
}

/// A pod's tc filters on `eth0`, both directions.
fn filters(f: &Fixture) -> anyhow::Result<usize> {
    Ok(filter_programs(&f.topo.pod, "eth0", "ingress")?.len()
        + filter_programs(&f.topo.pod, "eth0", "egress")?.len())
}

/// An enrollment admitted before the uninstall, held (a pause point of the
/// fault-injection build) just before it takes the dataplane, is released
/// once the uninstall is done: it must fail and attach nothing. (It used to
/// re-create its pin directory under the root the uninstall had removed and
/// capture the pod on a node sluice had left.)
fn waiting_enrollment() -> TestResult {
    let a = Fixture::new("uwe", None)?;
    let pause = Pause::new("uwe", "enroll:lock")?;
    let agent = pause.agent(&a.topo.pins)?;
    std::thread::scope(|s| -> TestResult {
        let held = s.spawn(|| enroll(&agent, &a));
        pause.wait_held("the enrollment held before the dataplane")?;
        let out = agent.sluice(&["uninstall"])?;
        ensure!(out.ok, "sluice uninstall: {}{}", out.stdout, out.stderr);
        pause.release()?;
        let out = held.join().expect("enroll thread panicked")?;
        ensure!(
            !out.ok && out.stderr.contains("being removed"),
            "the held enrollment: {}{}\n{}",
            out.stdout,
            out.stderr,
            agent.log()
        );
        Ok(())
    })?;
    let left = walk(a.topo.pins.root());
    ensure!(left.is_empty(), "pins after the uninstall: {left:?}");
    ensure!(filters(&a)? == 0, "the pod got filters after the uninstall");
    Ok(())
}

/// A bind mount of a pod's netns at a path of the test's, removed (lazily)
/// and the path with it when dropped.
struct NetnsMount(PathBuf);

impl NetnsMount {
    fn bind(netns: &Path, at: &Path) -> anyhow::Result<Self> {
        std::fs::write(at, "")?;
        let out = std::process::Command::new("mount")
            .arg("--bind")
            .args([netns, at])
            .output_bounded()?;
        ensure!(
            out.status.success(),
            "mount --bind: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(Self(at.to_owned()))
    }

    fn unmount(&self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .output_bounded();
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Drop for NetnsMount {
    fn drop(&mut self) {
        self.unmount();
    }
}

/// Two pods enrolled; pod a's recorded netns path is then made unreadable
/// (a symlink loop: an error that says nothing of the netns, so a teardown
/// must not take it for gone). `sluice uninstall` through the agent must
/// still remove pod b's capture, keep a's (Draining: it fails closed) and
/// the node's pins, and say what is left; once the path reads again,
/// `sluice uninstall` again finishes it. (The teardown loop stopped at the
/// first pod that failed, leaving the rest blackholed, and an uninstall
/// that failed could not be run again while the agent ran.)
fn failing_pod() -> TestResult {
    let a = Fixture::in_subnet("ufa", None, 1)?;
    let b = Fixture::in_subnet("ufb", None, 2)?;
    let dir = PathBuf::from(format!("/tmp/sluice-ufa-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("a-netns");
    let result = (|| -> TestResult {
        let mut mount = Some(NetnsMount::bind(&a.topo.pod_netns_path(), &path)?);
        let agent = AgentProc::start(&a.topo.pins)?;
        let _peer = peer(&agent)?;
        let uid = a.uid.as_str();
        let out = agent.enroll(&path, uid, "ambient", uid)?;
        ensure_steering("a", &out, &agent)?;
        enroll_enabled(&agent, &b)?;
        ensure!(filters(&a)? > 0 && filters(&b)? > 0, "no filters to remove");
        // a's path: unreadable, not gone.
        if let Some(m) = mount.take() {
            m.unmount();
        }
        std::os::unix::fs::symlink(&path, &path)?;
        let out = agent.sluice(&["uninstall"])?;
        ensure!(
            !out.ok && out.stderr.contains("run `sluice uninstall` again"),
            "the first uninstall: {}{}\n{}",
            out.stdout,
            out.stderr,
            agent.log()
        );
        ensure!(filters(&b)? == 0, "b's filters stayed: {}", agent.log());
        ensure!(
            filters(&a)? > 0,
            "a's filters went though its netns could not be read"
        );
        ensure!(
            a.topo.pins.maps().exists(),
            "the node's pins went with a pod left"
        );
        let n = agent.node_status()?;
        ensure!(
            n["uninstall"]
                .as_str()
                .is_some_and(|u| u.starts_with("failed")),
            "{n}"
        );
        std::fs::remove_file(&path)?;
        mount = Some(NetnsMount::bind(&a.topo.pod_netns_path(), &path)?);
        let out = agent.sluice(&["uninstall"])?;
        ensure!(
            out.ok,
            "asked again: {}{}\n{}",
            out.stdout,
            out.stderr,
            agent.log()
        );
        ensure!(filters(&a)? == 0, "a's filters stayed");
        let left = walk(a.topo.pins.root());
        ensure!(left.is_empty(), "pins left: {left:?}");
        drop(mount);
        Ok(())
    })();
    // The mount went with the closure; a symlink may be left.
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

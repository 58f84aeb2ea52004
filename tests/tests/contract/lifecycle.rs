//! Enrollment lifecycle through the `sluice` binary, as an operator uses it:
//! capture outlives the process that set it up, a new process reports it, and
//! every bad input gets one clear error line and leaves nothing behind.

use std::{net::SocketAddr, process::Command};

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use sluice_tests::{
    flow::{connect, Opts},
    harness::{sluice_bin, Fixture, APP_PORT},
    ns::run_in,
    standin::Bind,
    topology::{ip, Family},
};

use crate::{trial, TestResult};

pub fn trials() -> Vec<Trial> {
    vec![
        trial(
            "lifecycle::capture_outlives_the_enrolling_process",
            outlives_process,
        ),
        trial(
            "lifecycle::bad_input_gives_one_error_and_leaves_nothing",
            bad_input,
        ),
        trial(
            "lifecycle::failed_enroll_rolls_back_everything",
            failed_enroll_rolls_back,
        ),
        trial(
            "lifecycle::unenroll_after_the_netns_is_gone",
            unenroll_after_netns_gone,
        ),
    ]
}

struct Out {
    ok: bool,
    stdout: String,
    stderr: String,
}

fn sluice(f: &Fixture, args: &[&str]) -> anyhow::Result<Out> {
    let out = Command::new(sluice_bin())
        .arg("--bpf-root")
        .arg(f.topo.pins.root())
        .args(args)
        .output()
        .with_context(|| format!("running {}", sluice_bin().display()))?;
    Ok(Out {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

fn outlives_process() -> TestResult {
    let f = Fixture::new("life", Some(Bind::DualStack))?;
    let netns = f.topo.pod_netns_path();
    // The enrolling process exits; nothing of ours keeps running.
    let out = sluice(
        &f,
        &[
            "enroll",
            "--netns",
            netns.to_str().unwrap(),
            "--uid",
            f.uid.as_str(),
        ],
    )?;
    ensure!(out.ok, "enroll failed: {}", out.stderr);
    ensure!(out.stdout.contains("Enabled"), "{}", out.stdout);
    let r = connect(
        &f.topo.client,
        SocketAddr::new(Family::V4.pod(), APP_PORT),
        Opts::default(),
    );
    ensure!(
        r.reply().is_some_and(|l| l.starts_with("app:8080")),
        "{r:?}"
    );
    ensure!(
        f.standin().accepted().len() == 1,
        "not captured after the process exited"
    );
    // A new process reads it all back from the pins.
    let out = sluice(&f, &["status", "-o", "json"])?;
    ensure!(out.ok, "status failed: {}", out.stderr);
    let v: serde_json::Value = serde_json::from_str(&out.stdout)?;
    let pod = &v[0];
    ensure!(pod["uid"] == f.uid.as_str(), "{v}");
    ensure!(pod["state"] == "Enabled", "{v}");
    ensure!(pod["netns"] == netns.to_str().unwrap(), "{v}");
    ensure!(pod["counters"]["captured_inbound"] == 1, "{v}");
    ensure!(pod["listeners"].as_array().map(Vec::len) == Some(6), "{v}");
    let table = sluice(&f, &["status"])?;
    ensure!(
        table.stdout.contains(f.uid.as_str()) && table.stdout.contains("Enabled"),
        "{}",
        table.stdout
    );
    let out = sluice(&f, &["unenroll", "--uid", f.uid.as_str()])?;
    ensure!(out.ok, "unenroll failed: {}", out.stderr);
    ensure!(sluice(&f, &["status", "-o", "json"])?.stdout.trim() == "[]");
    Ok(())
}

/// Asserts a failed command printed exactly one error line containing `needle`.
fn fails_with(out: &Out, needle: &str) -> TestResult {
    ensure!(!out.ok, "expected failure, got success: {}", out.stdout);
    let lines: Vec<&str> = out.stderr.lines().collect();
    ensure!(lines.len() == 1, "expected one error line, got {lines:?}");
    ensure!(
        lines[0].starts_with("sluice: ") && lines[0].contains(needle),
        "{:?} lacks {needle:?}",
        lines[0]
    );
    Ok(())
}

fn bad_input() -> TestResult {
    let f = Fixture::new("bad", Some(Bind::DualStack))?;
    let netns = f.topo.pod_netns_path();
    let netns = netns.to_str().unwrap();
    let uid = f.uid.as_str();

    fails_with(
        &sluice(
            &f,
            &[
                "enroll",
                "--netns",
                "/run/netns/sluice-no-such-netns",
                "--uid",
                uid,
            ],
        )?,
        "No such file",
    )?;
    fails_with(
        &sluice(
            &f,
            &["enroll", "--netns", "/proc/self/ns/uts", "--uid", uid],
        )?,
        "is not a network namespace",
    )?;
    fails_with(
        &sluice(&f, &["enroll", "--netns", "/etc/hostname", "--uid", uid])?,
        "is not a network namespace",
    )?;
    fails_with(
        &sluice(&f, &["enroll", "--netns", netns, "--uid", "bad/uid"])?,
        "characters other than",
    )?;
    fails_with(
        &sluice(&f, &["unenroll", "--uid", "nobody"])?,
        "no enrolled pod has uid nobody",
    )?;
    ensure!(
        !f.topo.pins.pods().exists() || std::fs::read_dir(f.topo.pins.pods())?.next().is_none()
    );

    ensure!(sluice(&f, &["enroll", "--netns", netns, "--uid", uid])?.ok);
    fails_with(
        &sluice(&f, &["enroll", "--netns", netns, "--uid", uid])?,
        "already enrolled",
    )?;
    fails_with(
        &sluice(&f, &["enroll", "--netns", netns, "--uid", "other-pod"])?,
        "already enrolled as pod",
    )?;
    fails_with(
        &sluice(&f, &["unenroll", "--uid", "other-pod"])?,
        "no enrolled pod has uid other-pod",
    )?;
    fails_with(
        &sluice(&f, &["register", "--uid", "other-pod"])?,
        "no enrolled pod has uid other-pod",
    )?;
    // The failed attempts changed nothing: one pod, still Enabled and capturing.
    let rec = f.pod_record()?;
    ensure!(rec.state == Some("Enabled"), "{rec:?}");
    ensure!(std::fs::read_dir(f.topo.pins.pods())?.count() == 1);
    let r = connect(
        &f.topo.client,
        SocketAddr::new(Family::V4.pod(), APP_PORT),
        Opts::default(),
    );
    ensure!(
        r.reply().is_some() && f.standin().accepted().len() == 1,
        "{r:?}"
    );
    Ok(())
}

fn failed_enroll_rolls_back() -> TestResult {
    // A netns with only lo: attaching fails after state, the sk_lookup link
    // and the routes were written; all of it must be undone.
    let f = Fixture::new("rb", None)?;
    let lonely = format!("{}-lo", f.topo.pod);
    ip(&["netns", "add", &lonely])?;
    let result = (|| -> TestResult {
        let path = format!("/run/netns/{lonely}");
        let out = sluice(&f, &["enroll", "--netns", &path, "--uid", "lonely"])?;
        fails_with(&out, "has no interface besides lo")?;
        ensure!(
            std::fs::read_dir(f.topo.pins.pods())?.next().is_none(),
            "pod pins left behind"
        );
        let maps = sluice::state::Maps::open_pinned(&f.topo.pins.maps())?;
        ensure!(
            maps.cookies().is_empty(),
            "map entries left behind: {:?}",
            maps.cookies()
        );
        let name = lonely.clone();
        ensure!(
            !run_in(&name, sluice::routes::rule_present)?,
            "policy rule left behind"
        );
        Ok(())
    })();
    ip(&["netns", "del", &lonely])?;
    result
}

fn unenroll_after_netns_gone() -> TestResult {
    let f = Fixture::new("gone", Some(Bind::DualStack))?;
    let cookie = f.enroll()?.cookie;
    ensure!(f.topo.pins.pod(cookie).exists());
    // The pod's netns goes away with the pod (the pinned links keep nothing alive).
    ip(&["netns", "del", &f.topo.pod])?;
    let out = sluice(&f, &["unenroll", "--uid", f.uid.as_str()])?;
    ensure!(out.ok, "unenroll failed: {}", out.stderr);
    ensure!(!f.topo.pins.pod(cookie).exists(), "pins left behind");
    let maps = sluice::state::Maps::open_pinned(&f.topo.pins.maps())?;
    ensure!(maps.cookies().is_empty());
    Ok(())
}

//! The chaos runner's own check (`sluice-chaos --self-test`): one pod's app
//! connections start to leave with ztunnel's mark, which no capture
//! touches, a bypass as a broken capture would make; the runner must stop
//! on it as a violation within 2 s, name the pod, and leave nothing behind.
//!
//! And every bug a chaos run found, as the schedule of 1–3 faults that
//! shows it (`sluice-chaos --replay`), named after the bug. The bugs found
//! with the agent out of descriptors, which a schedule reproduces only by
//! chance, are tested deterministically in `cni_emfile.rs`.

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use serde_json::json;
use sluice_tests::child::Bounded as _;

use crate::{trial, TestResult};

const CHAOS: &str = env!("CARGO_BIN_EXE_sluice-chaos");

pub fn trials() -> Vec<Trial> {
    vec![
        trial(
            "chaos::the_runner_catches_an_injected_bypass_within_2_s",
            injected_bypass,
        ),
        // Removing the pin of a pod's sk_lookup link detached it: inbound
        // reached the app without ztunnel, and the pod stayed Served.
        trial("chaos::a_pods_pins_removed_are_put_back_at_once", || {
            replay(
                "pins",
                &[(4_000, json!({"kind": "pins-removed", "slot": 0}))],
            )
        }),
    ]
}

/// Runs the schedule of `faults` (ms into the run, the fault as the
/// schedule's JSON has it) for 15 s: no violation, nothing leaked.
fn replay(tag: &str, faults: &[(u64, serde_json::Value)]) -> TestResult {
    let dir = std::env::temp_dir().join(format!("sluice-chaos-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let schedule = json!({
        "seed": 0,
        "duration_ms": 15_000,
        "events": faults.iter().map(|(at, f)| json!({"at_ms": at, "fault": f})).collect::<Vec<_>>(),
    });
    let file = dir.join("schedule.json");
    std::fs::write(&file, schedule.to_string())?;
    let result = replay_file(tag, &file);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Runs the schedule in `file`: no violation, nothing leaked.
fn replay_file(tag: &str, file: &std::path::Path) -> TestResult {
    let dir = std::env::temp_dir().join(format!("sluice-chaos-{tag}-out-{}", std::process::id()));
    let out = std::process::Command::new(CHAOS)
        .arg("--replay")
        .arg(file)
        .arg("--out")
        .arg(&dir)
        .output_bounded()?;
    let report = std::fs::read_to_string(dir.join("chaos.json")).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    ensure!(
        out.status.success(),
        "{}\n{report}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn injected_bypass() -> TestResult {
    let out_dir =
        std::env::temp_dir().join(format!("sluice-chaos-self-test-{}", std::process::id()));
    let out = std::process::Command::new(CHAOS)
        .args(["--self-test", "--seed", "1", "--out"])
        .arg(&out_dir)
        .output_bounded()?;
    let report = std::fs::read_to_string(out_dir.join("chaos.json"));
    let _ = std::fs::remove_dir_all(&out_dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.success(), "the self-test failed: {stderr}");
    let report: serde_json::Value =
        serde_json::from_str(&report.context("the report")?).context("the report's JSON")?;
    let first = &report["violations"][0];
    ensure!(
        first["invariant"] == "no bypass"
            && first["pod"]
                .as_str()
                .is_some_and(|p| p.starts_with("chaos-"))
            && report["leaks"].as_array().is_some_and(Vec::is_empty)
            && report["schedule_file"].is_string(),
        "{report:#}"
    );
    Ok(())
}

//! The chaos runner's own check (`sluice-chaos --self-test`): one pod's app
//! connections start to leave with ztunnel's mark, which no capture
//! touches, a bypass as a broken capture would make; the runner must stop
//! on it as a violation within 2 s, name the pod, and leave nothing behind.

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use sluice_tests::child::Bounded as _;

use crate::{trial, TestResult};

const CHAOS: &str = env!("CARGO_BIN_EXE_sluice-chaos");

pub fn trials() -> Vec<Trial> {
    vec![trial(
        "chaos::the_runner_catches_an_injected_bypass_within_2_s",
        injected_bypass,
    )]
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

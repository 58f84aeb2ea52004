//! `cargo xtask fuzz --time N`: every cargo-fuzz target in `fuzz/` for N
//! seconds (libFuzzer, nightly; optimised, with AddressSanitizer), from the
//! seeds in
//! `fuzz/corpus/<target>/`; what libFuzzer finds new goes to
//! `target/fuzz-corpus/<target>/`, so the repository stays clean. A crash
//! fails the run and leaves its input in `fuzz/artifacts/<target>/`: make
//! it a regression test, then fix it.

use std::process::Command;

use anyhow::{Context as _, Result};

use crate::{run, setup, workspace_root};

/// Every target in fuzz/Cargo.toml.
pub const TARGETS: [&str; 5] = [
    "zds_messages",
    "control_request",
    "cni_plugin",
    "pod_annotations",
    "pod_exclusions",
];

/// How the targets are built.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Build {
    /// Optimised, AddressSanitizer: for long runs.
    Thorough,
    /// Unoptimised, no sanitizer: builds in a fraction of the time, for the
    /// short bounded run after the tests (the parsers are safe Rust: a
    /// panic or an assertion is what they can hit).
    Quick,
}

pub fn fuzz(secs: u64, build: Build) -> Result<()> {
    setup::ensure_cargo_fuzz()?;
    let root = workspace_root();
    let flags: &[&str] = match build {
        Build::Thorough => &[],
        Build::Quick => &["--dev", "--sanitizer", "none"],
    };
    // One build of every target (its output shown), then the runs.
    run(Command::new("cargo")
        .current_dir(&root)
        .args([&setup::plus_nightly(), "fuzz", "build"])
        .args(flags)
        .env_remove("RUSTC")
        .env_remove("RUSTC_WRAPPER"))?;
    let mut total = 0u64;
    for t in TARGETS {
        let corpus = root.join("target/fuzz-corpus").join(t);
        std::fs::create_dir_all(&corpus)
            .with_context(|| format!("creating {}", corpus.display()))?;
        let seeds = root.join("fuzz/corpus").join(t);
        let out = Command::new("cargo")
            .current_dir(&root)
            .args([&setup::plus_nightly(), "fuzz", "run"])
            .args(flags)
            .arg(t)
            .arg(&corpus)
            .arg(&seeds)
            .args([
                "--",
                &format!("-max_total_time={secs}"),
                "-print_final_stats=1",
            ])
            .env_remove("RUSTC")
            .env_remove("RUSTC_WRAPPER")
            .output()
            .with_context(|| format!("running cargo fuzz run {t}"))?;
        let log = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            eprintln!("{log}");
            anyhow::bail!(
                "fuzz target {t} failed ({}): see its input in fuzz/artifacts/{t}/",
                out.status
            );
        }
        let runs = log
            .lines()
            .find_map(|l| l.strip_prefix("stat::number_of_executed_units:"))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0);
        total += runs;
        eprintln!("xtask: fuzz {t}: {runs} executions in {secs} s, no crash");
    }
    eprintln!(
        "xtask: fuzz: {total} executions over {} targets",
        TARGETS.len()
    );
    Ok(())
}

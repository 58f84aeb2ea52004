//! `cargo xtask chaos`: builds what the chaos runner drives (the agent with
//! its fault-injection build, the CNI plugin, the ZDS peer, the runner) and
//! runs `sluice-chaos`: random faults on top of each other under steady
//! traffic, the invariants checked all the time (docs/TESTING.md, Chaos).

use std::{path::PathBuf, process::Command};

use anyhow::Result;

use crate::{build_ebpf, build_ebpf_variant, build_test_bins, cargo, run, setup, target_dir};

#[derive(clap::Args, Clone, Debug, Default)]
pub struct Args {
    /// How long the faults and traffic go on (`3m`, `2h`, …).
    #[arg(long, default_value = "10m")]
    pub duration: String,
    /// The seed the schedule is drawn from (default: a fresh one, printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Run the schedule a failed run wrote (target/chaos/schedule-<seed>.json).
    #[arg(long)]
    pub replay: Option<PathBuf>,
}

/// Setup, build, then one run.
pub fn chaos(args: &Args) -> Result<()> {
    setup::run(setup::Scope::Everything)?;
    build_ebpf()?;
    // The agent-upgrade fault starts the agent over another build's programs.
    build_ebpf_variant()?;
    build_test_bins()?;
    build_runner()?;
    run_built(args)
}

/// The runner and the peer it starts (debug builds, beside `sluice`).
pub fn build_runner() -> Result<()> {
    cargo(&[
        "build",
        "-p",
        "sluice-tests",
        "--bin",
        "sluice-chaos",
        "--bin",
        "sluice-zds-peer",
    ])
}

/// One run of the built runner.
pub fn run_built(args: &Args) -> Result<()> {
    let mut cmd = Command::new(target_dir().join("debug/sluice-chaos"));
    cmd.args(["--duration", &args.duration]);
    if let Some(seed) = args.seed {
        cmd.args(["--seed", &seed.to_string()]);
    }
    if let Some(f) = &args.replay {
        cmd.arg("--replay").arg(f);
    }
    run(&mut cmd)
}

//! Everything that is not plain cargo: toolchain setup, the eBPF build, tests,
//! the demo, benchmarks, the container image and the deploy/ checks.

mod deploy;
mod setup;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what building and testing need, only what is missing: nightly
    /// rust-src, bpf-linker built against rustc's own LLVM, Debian packages.
    Setup,
    /// Build the eBPF object (release, bpfel-unknown-none).
    BuildEbpf,
    /// Setup, build, lint and run every test (root: the dataplane tests need it).
    Test {
        /// Extra arguments passed to `cargo test` after `--`.
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Setup, build, and run the demo: enroll a pod netns and show captured traffic.
    Demo,
    /// Build in release and run the benchmarks (root): sluice vs Istio's rules vs none.
    Bench,
    /// Build the container image (needs a Docker engine).
    Image {
        /// Image reference to tag the build with.
        #[arg(long, default_value = deploy::DEFAULT_TAG)]
        tag: String,
    },
    /// Render, lint and validate deploy/ (manifests, Helm chart); shellcheck scripts.
    CheckDeploy,
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Setup => setup::run(),
        Cmd::BuildEbpf => build_ebpf(),
        Cmd::Test { args } => test(&args),
        Cmd::Demo => demo(),
        Cmd::Bench => bench(),
        Cmd::Image { tag } => deploy::image(&tag),
        Cmd::CheckDeploy => deploy::check(),
    }
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_owned()
}

pub fn run(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    let status = cmd.status().with_context(|| format!("running {shown}"))?;
    if !status.success() {
        bail!("{shown} failed: {status}");
    }
    Ok(())
}

/// `cargo +nightly <cmd> -p sluice-ebpf` for the BPF target.
fn ebpf_cargo(cmd: &str, extra: &[&str]) -> Result<()> {
    if let Some(missing) = setup::missing_for_ebpf() {
        bail!("cannot build the eBPF object: {missing}. Run `cargo xtask setup` (installs it).");
    }
    let rustflags = ["-Cdebuginfo=2", "-Clink-arg=--btf"].join("\x1f");
    run(Command::new("cargo")
        .current_dir(workspace_root())
        .args(["+nightly", cmd, "--release", "-p", "sluice-ebpf"])
        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
        .args(extra)
        .env("CARGO_ENCODED_RUSTFLAGS", rustflags)
        // bpf-linker is linked against the nightly sysroot's libLLVM.
        .env("LD_LIBRARY_PATH", setup::nightly_sysroot()?.join("lib"))
        .env_remove("RUSTC")
        .env_remove("RUSTC_WRAPPER"))
}

fn build_ebpf() -> Result<()> {
    ebpf_cargo("build", &[])
}

fn cargo(args: &[&str]) -> Result<()> {
    run(Command::new("cargo")
        .current_dir(workspace_root())
        .args(args))
}

fn test(extra: &[String]) -> Result<()> {
    setup::run()?;
    build_ebpf()?;
    cargo(&["fmt", "--all", "--", "--check"])?;
    ebpf_cargo("clippy", &["--", "-D", "warnings"])?;
    // The eBPF crate only builds for the BPF target (above).
    let host = ["--workspace", "--exclude", "sluice-ebpf"];
    cargo(
        &[
            &["clippy"][..],
            &host,
            &["--all-targets", "--", "-D", "warnings"],
        ]
        .concat(),
    )?;
    deploy::check()?;
    // The lifecycle tests run the `sluice` binary itself.
    cargo(&["build", "-p", "sluice", "--bins"])?;
    let mut args = [&["test"][..], &host].concat();
    if !extra.is_empty() {
        args.push("--");
        args.extend(extra.iter().map(String::as_str));
    }
    cargo(&args)
}

fn demo() -> Result<()> {
    setup::run()?;
    build_ebpf()?;
    cargo(&[
        "run",
        "--quiet",
        "-p",
        "sluice-tests",
        "--bin",
        "sluice-demo",
    ])
}

fn bench() -> Result<()> {
    setup::run()?;
    build_ebpf()?;
    // The memory scenario runs the release `sluice agent` beside the bench binary.
    cargo(&["build", "--release", "-p", "sluice", "--bins"])?;
    cargo(&[
        "run",
        "--release",
        "--quiet",
        "-p",
        "sluice-tests",
        "--bin",
        "sluice-bench",
    ])
}

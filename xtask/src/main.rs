//! Everything that is not plain cargo: toolchain setup, the eBPF build, tests,
//! the demo, benchmarks, the container image, the deploy/ checks, and the
//! tests in VMs on older kernels.

mod chaos;
mod deploy;
mod fuzz;
mod kernels;
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
    Setup {
        /// Only what building the shipped binaries needs (the image's
        /// build stage): no test packages, no lint components.
        #[arg(long)]
        build_only: bool,
    },
    /// Build the eBPF object (release, bpfel-unknown-none).
    BuildEbpf {
        /// Also the upgrade tests' variant builds (target/ebpf-variant,
        /// target/ebpf-layout);
        /// `cargo xtask test` builds it itself.
        #[arg(long)]
        variant: bool,
    },
    /// Build the CNI plugin static (release, <arch>-unknown-linux-musl): what
    /// the image ships into the host's /opt/cni/bin.
    BuildCni,
    /// Setup, build, lint and run every test (root: the dataplane tests need it).
    Test {
        /// Run the tests this many times in a row (after one setup, build
        /// and lint), stopping at the first failing run: for flakes.
        #[arg(long, default_value_t = 1)]
        repeat: u32,
        /// Keep every core busy with `stress-ng --cpu N` while the tests run
        /// (installed on first use): timing assumptions show up as failures.
        #[arg(long)]
        cpu_hog: bool,
        /// Seconds of chaos (`cargo xtask chaos`, a fresh seed) after the
        /// tests (0: none).
        #[arg(long, default_value_t = 180)]
        chaos_time: u64,
        /// Seconds each fuzz target runs after the tests (0: none).
        #[arg(long, default_value_t = 10)]
        fuzz_time: u64,
        /// The contract tests run last in a VM booting Debian's 6.1 kernel
        /// (`test-kernels`): those whose name contains one of these
        /// (comma-separated; "": none).
        #[arg(long, default_value = VM_SUBSET)]
        vm_tests: String,
        /// Extra arguments passed to `cargo test` after `--`, e.g. a test
        /// name with `--exact`.
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Run every fuzz target (fuzz/) for a bounded time each; installs
    /// cargo-fuzz on first use.
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 60)]
        time: u64,
    },
    /// Random faults on top of each other under steady traffic, the
    /// invariants checked all the time (root): agent and ztunnel crashes and
    /// upgrades, pods added and deleted, the capture tampered with.
    Chaos(chaos::Args),
    /// Setup, build, and run the demo: enroll a pod netns and show captured traffic.
    Demo,
    /// Build in release and run the benchmarks (root): sluice vs istio-cni's rules vs none.
    /// SLUICE_BENCH=cpu,latency,… picks scenarios, SLUICE_BENCH_SMOKE=1 shrinks every
    /// count (a quick check), SLUICE_BENCH_SEED=N repeats a run's round order.
    Bench,
    /// Build the container image (needs a Docker engine).
    Image {
        /// Image reference to tag the build with.
        #[arg(long, default_value = deploy::DEFAULT_TAG)]
        tag: String,
    },
    /// Render, lint and validate deploy/ (manifests, Helm chart), run every
    /// sluice command the chart renders through the CLI's parser
    /// (`--check-args`): the install's dry run. Shellcheck scripts.
    CheckDeploy,
    /// Write deploy/daemonset.yaml and deploy/rbac.yaml from the chart's
    /// default values (the chart is their one source; check-deploy compares).
    RenderDeploy,
    /// Build the contract tests and run them (or `--run` a command) in a qemu
    /// VM booting Debian's 6.1 or 6.12 kernel (root; installs qemu on first use).
    TestKernels(kernels::Args),
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Setup { build_only } => setup::run(if build_only {
            setup::Scope::Build
        } else {
            setup::Scope::Everything
        }),
        Cmd::BuildCni => {
            eprintln!("built {}", build_cni()?.display());
            Ok(())
        }
        Cmd::BuildEbpf { variant } => {
            build_ebpf()?;
            if variant {
                build_ebpf_variant()?;
            }
            Ok(())
        }
        Cmd::Test {
            repeat,
            cpu_hog,
            chaos_time,
            fuzz_time,
            vm_tests,
            args,
        } => {
            test(&args, repeat, cpu_hog)?;
            if chaos_time > 0 {
                chaos::build_runner()?;
                chaos::run_built(&chaos::Args {
                    duration: format!("{chaos_time}s"),
                    ..chaos::Args::default()
                })?;
            }
            if fuzz_time > 0 {
                fuzz::fuzz(fuzz_time, fuzz::Build::Quick)?;
            }
            if !vm_tests.is_empty() {
                kernels::oldest(&vm_tests)?;
            }
            Ok(())
        }
        Cmd::Fuzz { time } => fuzz::fuzz(time, fuzz::Build::Thorough),
        Cmd::Chaos(args) => chaos::chaos(&args),
        Cmd::Demo => demo(),
        Cmd::Bench => bench(),
        Cmd::Image { tag } => deploy::image(&tag),
        Cmd::CheckDeploy => deploy::check(None),
        Cmd::RenderDeploy => deploy::render_plain(),
        Cmd::TestKernels(args) => kernels::run(args),
    }
}

/// Cargo's target dir: CARGO_TARGET_DIR, else the workspace's.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
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

/// `cargo +<pinned nightly> <cmd> -p sluice-ebpf` for the BPF target.
fn ebpf_cargo(cmd: &str, extra: &[&str]) -> Result<()> {
    if let Some(missing) = setup::missing_for_ebpf() {
        bail!("cannot build the eBPF object: {missing}. Run `cargo xtask setup` (installs it).");
    }
    // The exclusion checks stay global functions, which the kernel verifies
    // once each (ebpf/src/exclusions.rs).
    let rustflags = [
        "-Cdebuginfo=2",
        "-Clink-arg=--btf",
        "-Clink-arg=--export=sluice_excluded_outbound,sluice_excluded_inbound",
    ]
    .join("\x1f");
    run(Command::new("cargo")
        .current_dir(workspace_root())
        .args([
            &setup::plus_nightly(),
            cmd,
            "--release",
            "-p",
            "sluice-ebpf",
        ])
        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
        .args(extra)
        .env("CARGO_ENCODED_RUSTFLAGS", rustflags)
        // bpf-linker is linked against the nightly sysroot's libLLVM.
        .env("LD_LIBRARY_PATH", setup::nightly_sysroot()?.join("lib"))
        .env_remove("RUSTC")
        .env_remove("RUSTC_WRAPPER"))
}

pub fn build_ebpf() -> Result<()> {
    ebpf_cargo("build", &[])
}

/// Where the upgrade tests find "another build" of the programs, and one
/// with another map layout.
pub const VARIANT_TARGET_DIR: &str = "target/ebpf-variant";
pub const LAYOUT_TARGET_DIR: &str = "target/ebpf-layout";
/// The programs without the exclusion checks, for the bench (scenario
/// `exclusions`) to measure them against.
pub const NO_EXCLUSIONS_TARGET_DIR: &str = "target/ebpf-no-exclusions";

/// The programs with the `upgrade-variant` feature (different instructions,
/// same maps and behaviour), in a target dir of their own.
pub fn build_ebpf_variant() -> Result<()> {
    ebpf_cargo(
        "build",
        &[
            "--features",
            "upgrade-variant",
            "--target-dir",
            VARIANT_TARGET_DIR,
        ],
    )?;
    ebpf_cargo(
        "build",
        &[
            "--features",
            "layout-variant",
            "--target-dir",
            LAYOUT_TARGET_DIR,
        ],
    )
}

/// The static target of the CNI plugin, for this machine's architecture.
pub fn cni_target() -> String {
    format!("{}-unknown-linux-musl", std::env::consts::ARCH)
}

/// Builds `sluice-cni` static; returns the binary's path.
fn build_cni() -> Result<PathBuf> {
    let target = cni_target();
    cargo(&[
        "build",
        "--release",
        "-p",
        "sluice-cni",
        "--target",
        &target,
    ])?;
    Ok(workspace_root()
        .join("target")
        .join(&target)
        .join("release/sluice-cni"))
}

pub fn cargo(args: &[&str]) -> Result<()> {
    run(Command::new("cargo")
        .current_dir(workspace_root())
        .args(args))
}

/// Where the CNI tests find the static plugin.
const STATIC_CNI_ENV: &str = "SLUICE_CNI_BIN";

/// The binaries the tests run besides their own (the eBPF objects aside);
/// returns the static CNI plugin's path, for STATIC_CNI_ENV.
pub fn build_test_bins() -> Result<PathBuf> {
    // The lifecycle tests run the `sluice` binary itself; the crash tests
    // need its crash points (never in a shipped build).
    cargo(&[
        "build",
        "-p",
        "sluice",
        "--bins",
        "--features",
        "fault-injection",
    ])?;
    // The agent copies the plugin from beside itself; the CNI tests run the
    // static build the image ships.
    cargo(&["build", "-p", "sluice-cni"])?;
    build_cni()
}

/// What `cargo xtask test` runs on the oldest supported kernel: the
/// behaviour contract's IPv4 rows, on the real cls_bpf and address-keyed
/// paths, the verification's test runs, the pod exclusions' rows (the
/// exclusion checks are global functions, which each kernel's verifier
/// checks its own way), and the host-side program's rows (what a packet's
/// socket says there differs by kernel: a bridged SYN keeps its sender's
/// on 6.1, not on 6.18) (about 5 minutes emulated; the whole suite takes 15
/// per kernel, see docs/TESTING.md, Testing on older kernels).
const VM_SUBSET: &str = "contract::ipv4::,verify::,exclusions,probes::";

fn test(extra: &[String], repeat: u32, cpu_hog: bool) -> Result<()> {
    setup::run(setup::Scope::Everything)?;
    build_ebpf()?;
    build_ebpf_variant()?;
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
    let static_cni = build_test_bins()?;
    // The chart's commands go through the binary the tests run.
    deploy::check(Some(&target_dir().join("debug/sluice")))?;
    let mut args = [&["test"][..], &host].concat();
    if !extra.is_empty() {
        args.push("--");
        args.extend(extra.iter().map(String::as_str));
    }
    let _hog = if cpu_hog {
        Some(CpuHog::start()?)
    } else {
        None
    };
    for run in 1..=repeat {
        if repeat > 1 {
            eprintln!("xtask: test run {run} of {repeat}");
        }
        crate::run(
            Command::new("cargo")
                .current_dir(workspace_root())
                .args(&args)
                .env(STATIC_CNI_ENV, &static_cni),
        )
        .with_context(|| format!("test run {run} of {repeat} failed"))?;
    }
    if repeat > 1 {
        eprintln!("xtask: {repeat} consecutive test runs passed");
    }
    Ok(())
}

/// `stress-ng --cpu N` on every core while it lives.
struct CpuHog(std::process::Child);

impl CpuHog {
    fn start() -> Result<Self> {
        setup::ensure_stress_ng()?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let child = Command::new("stress-ng")
            .args(["--cpu", &cores.to_string(), "--quiet"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .context("starting stress-ng")?;
        eprintln!("xtask: stress-ng keeps {cores} cores busy");
        Ok(Self(child))
    }
}

impl Drop for CpuHog {
    fn drop(&mut self) {
        // stress-ng's workers stop with their parent's SIGTERM.
        terminate(self.0.id());
        let _ = self.0.wait();
    }
}

/// SIGTERM to `pid` (via kill(1): the xtask has no libc dependency).
fn terminate(pid: u32) {
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
}

fn demo() -> Result<()> {
    setup::run(setup::Scope::Everything)?;
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
    setup::run(setup::Scope::Everything)?;
    build_ebpf()?;
    ebpf_cargo(
        "build",
        &[
            "--features",
            "bench-no-exclusions",
            "--target-dir",
            NO_EXCLUSIONS_TARGET_DIR,
        ],
    )?;
    // The memory and served scenarios run the release `sluice agent` and the
    // ZDS peer beside the bench binary.
    cargo(&["build", "--release", "-p", "sluice", "--bins"])?;
    cargo(&["build", "--release", "-p", "sluice-tests", "--bins"])?;
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

//! Toolchain bootstrap, idempotent: each step checks first and installs only
//! what is missing.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};

use crate::run as exec;

/// Debian packages the tests and demo use, by a file each installs: iproute2
/// (test topologies), iptables/nftables (the differential test applies
/// Istio's real rules), the reference CNI plugins (the CNI chain test),
/// shellcheck (`check-deploy` lints the shell scripts), mount and util-linux's
/// unshare/setpriv (the tests remount /proc/sys read-only and restrict the
/// agent's capabilities), a C compiler (crates with C parts, the linker),
/// dig (a real resolver client for the DNS capture tests), containerd with
/// runc, catatonit as the sandbox's pause process, and protoc (the CRI
/// client's build script) for the container-runtime test.
const APT_PACKAGES: &[(&str, &str)] = &[
    ("ip", "iproute2"),
    ("mount", "mount"),
    ("setpriv", "util-linux"),
    ("cc", "gcc"),
    ("iptables-restore", "iptables"),
    ("nft", "nftables"),
    ("/usr/lib/cni/ptp", "containernetworking-plugins"),
    ("shellcheck", "shellcheck"),
    ("dig", "bind9-dnsutils"),
    ("containerd", "containerd"),
    ("runc", "runc"),
    ("catatonit", "catatonit"),
    ("protoc", "protobuf-compiler"),
];

/// `check-deploy` runs its tools from a Python venv; Debian's python3 can
/// create one only with python3-venv (ensurepip) installed.
fn has_python_venv() -> bool {
    Command::new("python3")
        .args(["-c", "import venv, ensurepip"])
        .output()
        .is_ok_and(|o| o.status.success())
}

const BPF_LINKER_VERSION: &str = "0.13.0";

/// The one nightly pin: the eBPF build (build-std, bpf-linker built against
/// this toolchain's own LLVM, which bpf-linker 0.13 supports for LLVM 21–23
/// only), the eBPF crate's clippy, fuzzing, and the image (its build stage
/// runs `cargo xtask setup --build-only`). Move it on purpose, with the
/// bpf-linker version, never by whatever nightly is current.
pub const NIGHTLY: &str = "nightly-2026-05-20";

/// `+<NIGHTLY>`, the toolchain argument of rustc and cargo.
pub fn plus_nightly() -> String {
    format!("+{NIGHTLY}")
}

/// What `setup` installs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// What building, linting and every test use.
    Everything,
    /// Only what building the shipped binaries needs (the image's build
    /// stage): the toolchains, the musl target, bpf-linker, a C linker.
    Build,
}

pub fn nightly_sysroot() -> Result<PathBuf> {
    let out = Command::new("rustc")
        .args([&plus_nightly(), "--print", "sysroot"])
        .output()
        .with_context(|| format!("running rustc +{NIGHTLY} (is that toolchain installed? `cargo xtask setup` installs it)"))?;
    if !out.status.success() {
        bail!("rustc +{NIGHTLY} --print sysroot failed: install that toolchain (`cargo xtask setup` does)");
    }
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

fn has_rust_src() -> bool {
    nightly_sysroot()
        .map(|s| s.join("lib/rustlib/src/rust/library/core").exists())
        .unwrap_or(false)
}

fn bpf_linker_path() -> Option<PathBuf> {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")))?;
    let p = home.join("bin/bpf-linker");
    p.exists().then_some(p)
}

/// Whether bpf-linker is installed and loads the pinned toolchain's LLVM
/// (one built against another nightly's may not).
fn bpf_linker_runs() -> bool {
    let (Some(linker), Ok(sysroot)) = (bpf_linker_path(), nightly_sysroot()) else {
        return false;
    };
    Command::new(linker)
        .arg("--version")
        .env("LD_LIBRARY_PATH", sysroot.join("lib"))
        .output()
        .is_ok_and(|o| o.status.success())
}

/// What the eBPF build lacks, if anything.
pub fn missing_for_ebpf() -> Option<String> {
    if !has_rust_src() {
        return Some(format!("the {NIGHTLY} rust-src component is missing"));
    }
    if bpf_linker_path().is_none() {
        return Some("bpf-linker is not installed".into());
    }
    None
}

pub fn which(bin: &str) -> bool {
    if bin.starts_with('/') {
        return Path::new(bin).exists();
    }
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(bin).exists()))
        .unwrap_or(false)
        || ["/usr/sbin", "/sbin"]
            .iter()
            .any(|d| Path::new(d).join(bin).exists())
}

/// Whether the default toolchain has the standard library for `target`.
fn target_installed(target: &str) -> bool {
    Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l == target)
        })
}

/// The components `toolchain` (None: the default one) lacks of `wanted`;
/// all of them when the toolchain itself is not installed.
fn missing_components(toolchain: Option<&str>, wanted: &[&'static str]) -> Vec<&'static str> {
    let mut cmd = Command::new("rustup");
    cmd.args(["component", "list", "--installed"]);
    if let Some(t) = toolchain {
        cmd.args(["--toolchain", t]);
    }
    let installed = cmd
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    wanted
        .iter()
        .filter(|c| {
            !installed
                .lines()
                .any(|l| l.starts_with(&format!("{c}-")) || l == **c)
        })
        .copied()
        .collect()
}

pub fn run(scope: Scope) -> Result<()> {
    // rustfmt and clippy for the host crates' lint.
    let stable = match scope {
        Scope::Everything => missing_components(None, &["rustfmt", "clippy"]),
        Scope::Build => Vec::new(),
    };
    if !stable.is_empty() {
        eprintln!("setup: installing {stable:?}");
        exec(
            Command::new("rustup")
                .args(["component", "add"])
                .args(&stable),
        )?;
    }
    // The pinned nightly with rust-src (the eBPF build) and clippy (its lint).
    if Command::new("rustup")
        .args(["run", NIGHTLY, "rustc", "--version"])
        .output()
        .map_or(true, |o| !o.status.success())
    {
        eprintln!("setup: installing the {NIGHTLY} toolchain");
        exec(Command::new("rustup").args([
            "toolchain",
            "install",
            NIGHTLY,
            "--profile",
            "minimal",
        ]))?;
    }
    let nightly = missing_components(Some(NIGHTLY), &["rust-src", "clippy"]);
    if !nightly.is_empty() || !has_rust_src() {
        eprintln!("setup: installing {NIGHTLY} {nightly:?}");
        exec(Command::new("rustup").args([
            "component",
            "add",
            "--toolchain",
            NIGHTLY,
            "rust-src",
            "clippy",
        ]))?;
    }
    // The CNI plugin is built static (musl) for the host's /opt/cni/bin.
    let musl = crate::cni_target();
    if !target_installed(&musl) {
        eprintln!("setup: installing the {musl} target");
        exec(Command::new("rustup").args(["target", "add", &musl]))?;
    }
    if !bpf_linker_runs() {
        install_bpf_linker()?;
    }
    if scope == Scope::Build {
        let cc = APT_PACKAGES.iter().find(|(bin, _)| *bin == "cc");
        return match cc {
            Some((bin, pkg)) if !which(bin) => apt_install(&[pkg]),
            _ => Ok(()),
        };
    }
    let mut missing: Vec<&str> = APT_PACKAGES
        .iter()
        .filter(|(bin, _)| !which(bin))
        .map(|(_, pkg)| *pkg)
        .collect();
    if !has_python_venv() {
        missing.push("python3-venv");
    }
    apt_install(&missing)
}

/// Installs Debian packages (none: nothing to do). Waits for a concurrent
/// apt instead of failing on its lock.
pub fn apt_install(packages: &[&str]) -> Result<()> {
    if packages.is_empty() {
        return Ok(());
    }
    eprintln!("setup: installing Debian packages {packages:?}");
    const LOCK_WAIT: &str = "DPkg::Lock::Timeout=120";
    exec(Command::new("apt-get").args(["-o", LOCK_WAIT, "update", "-qq"]))?;
    // Packages with a daemon (containerd) must not start it on a host with
    // an init system: the tests run their own, private instance.
    let _no_daemons = NoDaemonStarts::install()?;
    exec(
        Command::new("apt-get")
            .args([
                "-o",
                LOCK_WAIT,
                "install",
                "-y",
                "-qq",
                "--no-install-recommends",
            ])
            .args(packages)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

/// A `policy-rc.d` that answers 101 ("action forbidden") while packages
/// install, so their maintainer scripts start no service; removed on drop.
/// An existing policy is left as it is.
struct NoDaemonStarts(Option<&'static Path>);

impl NoDaemonStarts {
    const PATH: &'static str = "/usr/sbin/policy-rc.d";

    fn install() -> Result<Self> {
        let path = Path::new(Self::PATH);
        if path.exists() {
            return Ok(Self(None));
        }
        std::fs::write(
            path,
            "#!/bin/sh\n# written by cargo xtask setup while it installs packages\nexit 101\n",
        )
        .with_context(|| format!("writing {}", path.display()))?;
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
        Ok(Self(Some(path)))
    }
}

impl Drop for NoDaemonStarts {
    fn drop(&mut self) {
        if let Some(path) = self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// `stress-ng`, for `cargo xtask test --cpu-hog` (not needed otherwise).
/// cargo-fuzz, from crates.io, and a C++ compiler (libFuzzer is built from
/// source by libfuzzer-sys).
pub fn ensure_cargo_fuzz() -> Result<()> {
    if !which("c++") {
        apt_install(&["g++"])?;
    }
    let installed = Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if installed {
        return Ok(());
    }
    eprintln!("setup: installing cargo-fuzz");
    exec(Command::new("cargo").args(["install", "--locked", "cargo-fuzz"]))
}

pub fn ensure_stress_ng() -> Result<()> {
    if which("stress-ng") {
        return Ok(());
    }
    apt_install(&["stress-ng"])
}

/// bpf-linker must use rustc's own LLVM: LLVM_PREFIX points at a directory
/// whose lib/libLLVM.so links to the nightly sysroot's libLLVM.so.*.
fn install_bpf_linker() -> Result<()> {
    let sysroot = nightly_sysroot()?;
    let lib = sysroot.join("lib");
    let llvm = std::fs::read_dir(&lib)?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libLLVM.so."))
        })
        .with_context(|| format!("no libLLVM.so.* in {}", lib.display()))?;
    let major = llvm
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("libLLVM.so."))
        .and_then(|v| v.split('.').next())
        .context("cannot read the LLVM version from the nightly sysroot")?
        .to_owned();
    let prefix = crate::workspace_root().join("target/llvm-prefix");
    std::fs::create_dir_all(prefix.join("lib"))?;
    let link = prefix.join("lib/libLLVM.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&llvm, &link)?;
    eprintln!(
        "setup: building bpf-linker {BPF_LINKER_VERSION} against {} (LLVM {major})",
        llvm.display()
    );
    exec(
        Command::new("cargo")
            .args([
                &plus_nightly(),
                "install",
                "--force",
                "--locked",
                "bpf-linker",
                "--version",
                BPF_LINKER_VERSION,
            ])
            .args([
                "--no-default-features",
                "--features",
                &format!("llvm-{major}"),
            ])
            .env("LLVM_PREFIX", &prefix)
            .env("LD_LIBRARY_PATH", &lib),
    )
}

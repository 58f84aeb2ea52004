//! `cargo xtask test-kernels`: a command, by default the contract test binary,
//! run inside a qemu VM that boots an older Debian kernel (6.1 from bookworm,
//! 6.12 from bookworm-backports) while the host keeps its own.
//!
//! The guest has no disk image: its root is the host's root filesystem, shared
//! read-only over 9p under an overlay whose upper layer is a tmpfs, so it runs
//! the host's tools and cargo target dir as they are, and what it writes goes
//! with it. A small initramfs (static busybox and the modules that 9p and
//! overlayfs need) builds that root and switches into it.
//!
//! Kernels are Debian's packages, downloaded (never installed) and unpacked
//! once under target/kernels/<version>/.

use std::{
    collections::{HashMap, HashSet},
    ffi::OsStr,
    fs,
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::mpsc::{self, RecvTimeoutError},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context as _, Result};
use clap::ValueEnum;

use crate::{run as exec, setup, workspace_root};

#[derive(clap::Args)]
pub struct Args {
    /// Kernels to boot, one after the other (repeatable or comma-separated).
    #[arg(long = "kernel", value_enum, value_delimiter = ',', default_values = ["6.1", "6.12"])]
    kernels: Vec<Kernel>,
    /// Run this shell command in the guest (from the current directory)
    /// instead of the contract tests.
    #[arg(long, conflicts_with = "args")]
    run: Option<String>,
    /// Seconds each VM may run before it is stopped and the run fails.
    #[arg(long, default_value_t = 3600)]
    timeout: u64,
    /// Arguments for the contract test binary, e.g. a test name filter.
    #[arg(trailing_var_arg = true)]
    args: Vec<String>,
    /// Several runs of the contract test binary, one after the other, each
    /// with its arguments (in place of `args`; libtest takes one filter).
    #[arg(skip)]
    runs: Vec<Vec<String>>,
}

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum Kernel {
    /// Debian bookworm's kernel.
    #[value(name = "6.1")]
    V6_1,
    /// bookworm-backports' kernel.
    #[value(name = "6.12")]
    V6_12,
}

impl Kernel {
    fn line(self) -> &'static str {
        match self {
            Kernel::V6_1 => "6.1",
            Kernel::V6_12 => "6.12",
        }
    }

    /// The suite whose `linux-image-amd64` depends on this line's current
    /// kernel; None: apt's default candidate (bookworm or its security
    /// updates, whichever is newer).
    fn suite(self) -> Option<&'static str> {
        match self {
            Kernel::V6_1 => None,
            Kernel::V6_12 => Some(BACKPORTS),
        }
    }
}

const BACKPORTS: &str = "bookworm-backports";
/// Where the backports suite goes when no apt source names it yet.
const BACKPORTS_SOURCE: &str = "/etc/apt/sources.list.d/sluice-bookworm-backports.sources";
/// Debian's metapackage for the generic amd64 flavour. Not the lighter
/// `cloud-amd64` one: it has no 9p (CONFIG_NET_9P is not set).
const META_PACKAGE: &str = "linux-image-amd64";
/// From busybox-static: the initramfs has no libc to link against.
const BUSYBOX: &str = "/bin/busybox";
/// What the initramfs loads to mount its root: virtio's PCI transport, 9p
/// over it, overlayfs. Modules in Debian's 6.1, some built in later; their
/// dependencies come from modules.dep.
const INIT_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p", "overlay"];
/// The guest's console lines that tell the host where it is.
const START_MARKER: &str = "SLUICE-VM-START";
const EXIT_MARKER: &str = "SLUICE-VM-EXIT ";
/// From starting qemu to the command, emulated on a busy host: 15 s is usual.
/// What the tests multiply their deadlines by (`tests/src/wait.rs`).
const DEADLINE_FACTOR_ENV: &str = "SLUICE_TEST_DEADLINE_FACTOR";

const BOOT_TIMEOUT: Duration = Duration::from_secs(180);

/// The contract tests whose name contains one of `filters` (comma-separated),
/// in a VM booting the oldest supported kernel (6.1): what `cargo xtask
/// test` runs last.
pub fn oldest(filters: &str) -> Result<()> {
    run(Args {
        kernels: vec![Kernel::V6_1],
        run: None,
        timeout: 1800,
        args: Vec::new(),
        runs: filters.split(',').map(|f| vec![f.to_owned()]).collect(),
    })
}

pub fn run(args: Args) -> Result<()> {
    ensure!(
        std::env::consts::ARCH == "x86_64",
        "test-kernels boots Debian's amd64 kernels with qemu-system-x86_64: x86_64 hosts only"
    );
    ensure_host_tools()?;
    if args.kernels.contains(&Kernel::V6_12) {
        ensure_backports()?;
    }
    let kernels = args
        .kernels
        .iter()
        .map(|&k| prepare(k))
        .collect::<Result<Vec<_>>>()?;
    let accel = accelerator();
    // Under emulation everything runs many times slower: the tests' waits
    // for state get that much longer to fail (a deadline is only ever met
    // by a failing test).
    let emulated = accel.contains(&"tcg");
    let factor = if emulated { "10" } else { "1" };
    // The leak test's enroll/unenroll cycles: a tenth of the 1,000 (still
    // ten times its warm-up) when every cycle costs ten times as much.
    let cycles = if emulated { "100" } else { "1000" };
    let env = [
        (DEADLINE_FACTOR_ENV, OsStr::new(factor)),
        ("SLUICE_CYCLES", OsStr::new(cycles)),
    ];
    let command = match &args.run {
        Some(cmd) => command_file(&std::env::current_dir()?, &env, cmd),
        None if args.runs.is_empty() => contract_command(std::slice::from_ref(&args.args), &env)?,
        None => contract_command(&args.runs, &env)?,
    };
    let timeout = Duration::from_secs(args.timeout);
    let outcomes: Vec<_> = kernels
        .iter()
        .map(|k| (k, boot(k, &accel, &command, timeout)))
        .collect();
    let mut failed = 0;
    for (k, outcome) in &outcomes {
        let name = format!("{} ({})", k.kernel.line(), k.kver);
        match outcome {
            Ok(o) => {
                failed += usize::from(o.code != 0);
                let counts = o.counts.as_ref().map_or(String::new(), |c| {
                    format!(
                        "; {} passed, {} failed, {} ignored",
                        c.passed, c.failed, c.ignored
                    )
                });
                eprintln!(
                    "test-kernels: {name}: exit {}{counts}; booted in {:.1} s, ran {:.1} s in all",
                    o.code,
                    o.booted.as_secs_f64(),
                    o.total.as_secs_f64()
                );
            }
            Err(e) => {
                failed += 1;
                eprintln!("test-kernels: {name}: {e:#}");
            }
        }
    }
    if failed > 0 {
        bail!(
            "the command failed on {failed} of {} kernels",
            outcomes.len()
        );
    }
    Ok(())
}

/// qemu, busybox-static for the initramfs, kmod: depmod here, and the
/// guest's /sbin/modprobe through which its kernel loads modules on demand
/// (veth, sch_ingress, nf_tables...).
fn ensure_host_tools() -> Result<()> {
    let mut missing = Vec::new();
    if !setup::which("qemu-system-x86_64") {
        missing.push("qemu-system-x86");
    }
    // busybox (dynamic) installs the same path.
    let static_busybox = Command::new("dpkg-query")
        .args(["-W", "-f=${db:Status-Status}", "busybox-static"])
        .output()
        .is_ok_and(|o| o.stdout == b"installed");
    if !static_busybox {
        missing.push("busybox-static");
    }
    if !setup::which("depmod") {
        missing.push("kmod");
    }
    setup::apt_install(&missing)
}

/// Adds bookworm-backports to apt's sources (a file of its own, on the
/// mirror bookworm already comes from) unless a source has it already.
fn ensure_backports() -> Result<()> {
    let targets = String::from_utf8(
        Command::new("apt-get")
            .args(["indextargets", "--format", "$(REPO_URI) $(RELEASE)"])
            .output()
            .context("running apt-get indextargets")?
            .stdout,
    )?;
    let suites: Vec<(&str, &str)> = targets.lines().filter_map(|l| l.split_once(' ')).collect();
    if suites.iter().any(|(_, suite)| *suite == BACKPORTS) {
        return Ok(());
    }
    // indextargets lists only what `apt-get update` fetched.
    if !Path::new(BACKPORTS_SOURCE).exists() {
        let mirror = suites
            .iter()
            .find(|(_, suite)| *suite == "bookworm")
            .map(|(uri, _)| *uri)
            .context("no apt source for Debian bookworm: the kernels come from bookworm and bookworm-backports")?;
        eprintln!("test-kernels: adding {BACKPORTS} ({mirror}) to apt's sources");
        fs::write(
            BACKPORTS_SOURCE,
            format!(
                "Types: deb\nURIs: {mirror}\nSuites: {BACKPORTS}\nComponents: main\n\
                 Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
            ),
        )
        .with_context(|| format!("writing {BACKPORTS_SOURCE}"))?;
    }
    apt_update()
}

fn apt_update() -> Result<()> {
    exec(Command::new("apt-get").args(["-o", "DPkg::Lock::Timeout=120", "update", "-qq"]))
}

/// A kernel unpacked under target/kernels/.
struct Prepared {
    kernel: Kernel,
    /// Its release, as `uname -r` and /lib/modules name it.
    kver: String,
    root: PathBuf,
}

impl Prepared {
    fn modules(&self) -> PathBuf {
        self.root.join("lib/modules").join(&self.kver)
    }
}

fn kernels_dir() -> PathBuf {
    workspace_root().join("target/kernels")
}

/// The line's current kernel, downloaded and unpacked unless it already is.
fn prepare(kernel: Kernel) -> Result<Prepared> {
    // apt-cache knows nothing before the first `apt-get update`.
    let package = match current_package(kernel) {
        Ok(p) => p,
        Err(_) => {
            apt_update()?;
            current_package(kernel)?
        }
    };
    let kver = package
        .strip_prefix("linux-image-")
        .context("unexpected kernel package name")?
        .to_owned();
    ensure!(
        kver.starts_with(&format!("{}.", kernel.line())),
        "{META_PACKAGE} resolves to {package}, not a {} kernel: is this host Debian bookworm?",
        kernel.line()
    );
    let root = kernels_dir().join(&kver);
    if !root.exists() {
        fetch(&package, &kver, &root)?;
    }
    Ok(Prepared { kernel, kver, root })
}

/// `linux-image-<kver>`, from what the flavour's metapackage depends on.
fn current_package(kernel: Kernel) -> Result<String> {
    let mut cmd = Command::new("apt-cache");
    if let Some(suite) = kernel.suite() {
        cmd.args(["-t", suite]);
    }
    let out = cmd
        .args(["depends", META_PACKAGE])
        .output()
        .context("running apt-cache")?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Depends: "))
        .filter(|p| p.starts_with("linux-image-"))
        .map(str::to_owned)
        .with_context(|| {
            format!(
                "apt-cache finds no kernel {META_PACKAGE} depends on for {}: {}",
                kernel.line(),
                String::from_utf8_lossy(&out.stderr).trim()
            )
        })
}

/// Downloads `<package>-unsigned` (the same kernel and modules as the signed
/// package; qemu boots it directly, with no Secure Boot to please), unpacks
/// it, and indexes its modules, in a staging dir renamed into place at the
/// end so an interrupted run leaves nothing that looks ready.
fn fetch(package: &str, kver: &str, root: &Path) -> Result<()> {
    let staging = kernels_dir().join(format!("{kver}.part"));
    if staging.exists() {
        fs::remove_dir_all(&staging)?;
    }
    fs::create_dir_all(&staging)?;
    let unsigned = format!("{package}-unsigned");
    eprintln!("test-kernels: downloading {unsigned}");
    // apt's own download user cannot write into target/.
    exec(
        Command::new("apt-get")
            .args([
                "-qq",
                "-o",
                "APT::Sandbox::User=root",
                "download",
                &unsigned,
            ])
            .current_dir(&staging),
    )?;
    let deb = fs::read_dir(&staging)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension() == Some(OsStr::new("deb")))
        .context("apt-get download left no .deb")?;
    let tree = staging.join("root");
    exec(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tree))?;
    // The package ships no modules.dep: its postinst runs depmod.
    exec(Command::new("depmod").arg("-b").arg(&tree).arg(kver))?;
    fs::rename(&tree, root)?;
    fs::remove_dir_all(&staging)?;
    Ok(())
}

/// Builds what the contract tests run (as `cargo xtask test` does, without
/// its lint) and returns the guest's command file running the test binary.
fn contract_command(runs: &[Vec<String>], env: &[(&str, &OsStr)]) -> Result<String> {
    setup::run(setup::Scope::Everything)?;
    crate::build_ebpf()?;
    crate::build_ebpf_variant()?;
    let static_cni = crate::build_test_bins()?;
    let binary = quote(contract_binary()?);
    // Each run after the one before passed; the first failure's status is
    // the command's.
    let cmd = runs
        .iter()
        .map(|args| {
            let mut one = binary.clone();
            for arg in args {
                one.push(' ');
                one.push_str(&quote(arg));
            }
            one
        })
        .collect::<Vec<_>>()
        .join(" && ");
    // cargo runs a test binary from its package's directory.
    let mut env = env.to_vec();
    env.push((crate::STATIC_CNI_ENV, static_cni.as_os_str()));
    Ok(command_file(&workspace_root().join("tests"), &env, &cmd))
}

/// Builds the contract test binary; returns its path.
fn contract_binary() -> Result<PathBuf> {
    let out = Command::new("cargo")
        .current_dir(workspace_root())
        .args(["test", "-p", "sluice-tests", "--test", "contract"])
        .args(["--no-run", "--message-format=json"])
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo test --no-run")?;
    ensure!(out.status.success(), "building the contract tests failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "contract")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .context("cargo built no contract test executable")
}

/// The shell script the guest runs: the host's PATH and HOME (it sees the
/// same files), `env`, then `command` in `dir`.
fn command_file(dir: &Path, env: &[(&str, &OsStr)], command: &str) -> String {
    let mut script = String::new();
    for var in ["PATH", "HOME"] {
        if let Some(value) = std::env::var_os(var) {
            script += &format!("export {var}={}\n", quote(value));
        }
    }
    for (var, value) in env {
        script += &format!("export {var}={}\n", quote(value));
    }
    script += &format!("cd {} || exit 125\n{command}\n", quote(dir));
    script
}

/// `s` single-quoted for sh.
fn quote(s: impl AsRef<OsStr>) -> String {
    format!("'{}'", s.as_ref().to_string_lossy().replace('\'', r"'\''"))
}

/// How a command ended in one VM.
struct Outcome {
    code: i32,
    counts: Option<Counts>,
    /// From starting qemu to the command's start.
    booted: Duration,
    total: Duration,
}

/// libtest's closing line: `test result: FAILED. 3 passed; 2 failed; 1 ignored; ...`.
struct Counts {
    passed: u32,
    failed: u32,
    ignored: u32,
}

impl Counts {
    fn parse(line: &str) -> Option<Self> {
        let rest = line.strip_prefix("test result: ")?;
        let count = |what: &str| {
            rest.split(';').find_map(|part| {
                part.trim()
                    .strip_suffix(what)?
                    .split_whitespace()
                    .last()?
                    .parse()
                    .ok()
            })
        };
        Some(Self {
            passed: count(" passed")?,
            failed: count(" failed")?,
            ignored: count(" ignored")?,
        })
    }
}

/// Boots `k` with `command` in its initramfs, streams the console, and
/// returns how the command ended.
fn boot(k: &Prepared, accel: &[&str], command: &str, timeout: Duration) -> Result<Outcome> {
    let initrd = kernels_dir().join(format!("initramfs-{}-{}.cpio", k.kver, std::process::id()));
    fs::write(&initrd, initramfs(k, command)?)
        .with_context(|| format!("writing {}", initrd.display()))?;
    let outcome = run_vm(k, accel, &initrd, timeout);
    let _ = fs::remove_file(&initrd);
    outcome
}

fn run_vm(k: &Prepared, accel: &[&str], initrd: &Path, timeout: Duration) -> Result<Outcome> {
    let mut qemu = Command::new("qemu-system-x86_64");
    qemu.args(accel)
        .args([
            "-m",
            "4G",
            "-smp",
            "2",
            "-nographic",
            "-no-reboot",
            "-nic",
            "none",
        ])
        .arg("-kernel")
        .arg(k.root.join("boot").join(format!("vmlinuz-{}", k.kver)))
        .arg("-initrd")
        .arg(initrd)
        // The crypto self-tests take seconds under emulation, and once hung
        // a CPU there (soft lockup, minutes); nothing here tests crypto.
        .args([
            "-append",
            "console=ttyS0 panic=-1 quiet cryptomgr.notests=1",
        ])
        .args([
            "-virtfs",
            "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    eprintln!("test-kernels: booting {} ({})", k.kernel.line(), k.kver);
    let started = Instant::now();
    let mut child = qemu.spawn().context("starting qemu-system-x86_64")?;
    let console = child.stdout.take().expect("piped");
    let (lines, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(console).split(b'\n').map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let (mut booted, mut code, mut counts) = (None, None, None::<Counts>);
    loop {
        // Until the command starts, a boot hang would otherwise wait for the
        // command's whole timeout.
        let limit = if booted.is_none() {
            timeout.min(BOOT_TIMEOUT)
        } else {
            timeout
        };
        match rx.recv_timeout(limit.saturating_sub(started.elapsed())) {
            Ok(raw) => {
                let line = strip_escapes(&String::from_utf8_lossy(&raw));
                let line = line.trim_end_matches('\r');
                println!("{line}");
                if line == START_MARKER {
                    booted = Some(started.elapsed());
                } else if let Some(c) = line.strip_prefix(EXIT_MARKER) {
                    code = c.trim().parse().ok();
                } else if let Some(c) = Counts::parse(line) {
                    // One closing line per run of the binary: summed.
                    counts = Some(match counts {
                        Some(a) => Counts {
                            passed: a.passed + c.passed,
                            failed: a.failed + c.failed,
                            ignored: a.ignored + c.ignored,
                        },
                        None => c,
                    });
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                let _ = child.wait();
                let what = if booted.is_none() {
                    "reach the command"
                } else {
                    "finish"
                };
                bail!(
                    "did not {what} within {} s: stopped the VM",
                    limit.as_secs()
                );
            }
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    let status = child.wait()?;
    let (Some(booted), Some(code)) = (booted, code) else {
        bail!("the VM ended ({status}) without reporting the command's exit status: see its console above");
    };
    Ok(Outcome {
        code,
        counts,
        booted,
        total: started.elapsed(),
    })
}

/// `line` without terminal escape sequences: SeaBIOS resets and clears the
/// terminal on the serial console.
fn strip_escapes(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c != '\x1b' {
            out.push(c);
        } else if chars.next() == Some('[') {
            // A control sequence ends with a byte in @..~; other escapes
            // are ESC and one character.
            chars.by_ref().find(|c| ('@'..='~').contains(c));
        }
    }
    out
}

/// qemu's accelerator and CPU: KVM where it can run a stock kernel, else
/// emulation.
fn accelerator() -> [&'static str; 4] {
    if kvm_usable() {
        return ["-accel", "kvm", "-cpu", "host"];
    }
    eprintln!("test-kernels: no hardware virtualization behind /dev/kvm: emulating (TCG, slower)");
    ["-accel", "tcg", "-cpu", "max"]
}

/// Hardware virtualization behind /dev/kvm. A /dev/kvm without vmx or svm
/// among the CPU's flags (software nested virtualization such as PVM) runs
/// only guests built for it: a stock kernel hangs before its first line.
fn kvm_usable() -> bool {
    let open = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    open && fs::read_to_string("/proc/cpuinfo").is_ok_and(|info| {
        info.lines()
            .filter(|l| l.starts_with("flags"))
            .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"))
    })
}

/// The initramfs: busybox, the modules to mount the root, stage 1 as /init,
/// stage 2 and the command for the new root.
fn initramfs(k: &Prepared, command: &str) -> Result<Vec<u8>> {
    let modules = k.modules();
    let mut cpio = Cpio::default();
    for dir in ["bin", "dev", "modules"] {
        cpio.entry(dir, 0o40755, 0, &[]);
    }
    // The kernel opens it for /init's stdio before anything is mounted.
    cpio.entry("dev/console", 0o20600, (5 << 8) | 1, &[]);
    cpio.entry("bin/busybox", 0o100755, 0, &fs::read(BUSYBOX)?);
    let mut insmods = String::new();
    for path in load_order(&modules, INIT_MODULES)? {
        let name = path.rsplit('/').next().unwrap_or(&path);
        cpio.entry(
            &format!("modules/{name}"),
            0o100644,
            0,
            &fs::read(modules.join(&path))?,
        );
        // busybox's insmod hands an xz module to the kernel as it is first
        // (which logs "Invalid ELF header magic") before unpacking it itself.
        if let Some(plain) = name.strip_suffix(".xz") {
            insmods += &format!("unxz /modules/{name}\ninsmod /modules/{plain}\n");
        } else {
            insmods += &format!("insmod /modules/{name}\n");
        }
    }
    cpio.entry(
        "init",
        0o100755,
        0,
        stage1(&insmods, &modules, &k.kver).as_bytes(),
    );
    cpio.entry("stage2", 0o100755, 0, STAGE2.as_bytes());
    cpio.entry("command", 0o100644, 0, command.as_bytes());
    Ok(cpio.finish())
}

/// Stage 1, /init in the initramfs: the host's root (9p, read-only) under a
/// tmpfs overlay (its /tmp too: a workspace cloned under /tmp must stay
/// visible), the kernel's filesystems and this kernel's modules (for
/// modprobe) in it, then PID 1 becomes stage 2 there.
fn stage1(insmods: &str, modules: &Path, kver: &str) -> String {
    format!(
        r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
set -e
{insmods}
mkdir -p /lower /upper /newroot
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=loose,ro hostroot /lower
mount -t tmpfs -o mode=0755 tmpfs /upper
mkdir /upper/data /upper/work
mount -t overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work overlay /newroot
cd /newroot
mount -t proc proc proc
mount -t sysfs sysfs sys
mount -t devtmpfs devtmpfs dev
mkdir -p dev/pts dev/shm
mount -t devpts devpts dev/pts
mount -t tmpfs tmpfs dev/shm
mount -t tmpfs -o mode=0755 tmpfs run
mount -t bpf bpf sys/fs/bpf
mount -t cgroup2 cgroup2 sys/fs/cgroup
mkdir -p lib/modules/{kver}
mount --bind {modules} lib/modules/{kver}
ip link set lo up
mkdir run/sluice-vm
cp /stage2 /command run/sluice-vm/
exec switch_root /newroot /bin/sh /run/sluice-vm/stage2
"#,
        modules = quote(Path::new("/newroot").join(modules.strip_prefix("/").unwrap_or(modules))),
    )
}

/// Stage 2, PID 1 in the host's root: runs the command and reports how it
/// ended, then powers off (qemu then exits). It waits for the power-off with
/// a builtin (the 9p share goes first) and must not exit: that panics.
const STAGE2: &str = r#"printf '\nSLUICE-VM-START\n'
/bin/sh /run/sluice-vm/command
printf '\nSLUICE-VM-EXIT %s\n' "$?"
echo o > /proc/sysrq-trigger
read -r _
"#;

/// Module paths (relative to lib/modules/<kver>) to insmod for `wanted`,
/// each after its dependencies; built-in modules need none.
fn load_order(modules: &Path, wanted: &[&str]) -> Result<Vec<String>> {
    let read = |file: &str| {
        fs::read_to_string(modules.join(file))
            .with_context(|| format!("reading {}", modules.join(file).display()))
    };
    let deps: HashMap<String, (String, Vec<String>)> = read("modules.dep")?
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(path, deps)| {
            let deps = deps.split_whitespace().map(module_name).collect();
            (module_name(path), (path.to_owned(), deps))
        })
        .collect();
    let builtin: HashSet<String> = read("modules.builtin")?.lines().map(module_name).collect();
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    let mut pending: Vec<(String, bool)> = wanted
        .iter()
        .rev()
        .map(|m| (m.to_string(), false))
        .collect();
    // Depth-first; (name, true) once its dependencies are queued before it.
    while let Some((name, deps_done)) = pending.pop() {
        if deps_done {
            order.push(deps[&name].0.clone());
            continue;
        }
        if builtin.contains(&name) || !seen.insert(name.clone()) {
            continue;
        }
        let (_, needs) = deps
            .get(&name)
            .with_context(|| format!("module {name} is neither in modules.dep nor built in"))?;
        pending.push((name.clone(), true));
        pending.extend(needs.iter().map(|d| (d.clone(), false)));
    }
    Ok(order)
}

/// `kernel/fs/9p/9p.ko.xz` → `9p`; `-` and `_` are the same to the kernel.
fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.split(".ko").next().unwrap_or(file).replace('-', "_")
}

/// A newc cpio archive, the format the kernel unpacks an initramfs from
/// (written here: Debian does not install cpio by default).
#[derive(Default)]
struct Cpio {
    out: Vec<u8>,
    inode: u32,
}

impl Cpio {
    /// One entry: `mode` carries the file type, `rdev` is (major << 8) | minor.
    fn entry(&mut self, name: &str, mode: u32, rdev: u32, data: &[u8]) {
        self.inode += 1;
        let fields = [
            self.inode,
            mode,
            0, // uid
            0, // gid
            1, // nlink
            0, // mtime
            u32::try_from(data.len()).expect("initramfs entries are small"),
            0, // dev major
            0, // dev minor
            rdev >> 8,
            rdev & 0xff,
            u32::try_from(name.len() + 1).expect("short name"),
            0, // check
        ];
        self.out.extend_from_slice(b"070701");
        for field in fields {
            self.out
                .extend_from_slice(format!("{field:08x}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, 0, &[]);
        self.out
    }
}

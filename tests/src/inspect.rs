//! Reading state from outside, as an operator would: the programs pinned
//! under a bpf root (id and tag), and a process's `/proc/<pid>/status`.

use crate::child::Bounded as _;
use std::collections::BTreeMap;

use anyhow::Context as _;
use aya::programs::{SchedClassifier, SkLookup};
use sluice::dataplane::loader::{Pins, Program};

/// Kernel program id and tag of each program pinned under `pins`, by pin
/// name.
pub fn pinned_programs(pins: &Pins) -> anyhow::Result<BTreeMap<String, (u32, u64)>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(pins.progs())? {
        let path = e?.path();
        let name = path
            .file_name()
            .context("a pin without a name")?
            .to_string_lossy()
            .into_owned();
        let info = if name == Program::Steer.name() {
            SkLookup::from_pin(&path)?.info()?
        } else {
            SchedClassifier::from_pin(&path)?.info()?
        };
        out.insert(name, (info.id(), info.tag()));
    }
    Ok(out)
}

/// A KiB figure of `/proc/<pid>/status` (`field` with its colon, e.g. `VmRSS:`).
pub fn proc_status_kib(pid: u32, field: &str) -> anyhow::Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

/// The cls_bpf filters on `iface`'s `dir` hook (`"ingress"` or
/// `"egress"`) in netns `ns` (an `ip netns` name), as `tc` shows them:
/// (priority, program id), in the order they run. The kernel's answer, not
/// sluice's record of it.
pub fn filter_programs(ns: &str, iface: &str, dir: &str) -> anyhow::Result<Vec<(u64, u32)>> {
    let out = std::process::Command::new("ip")
        .args([
            "netns", "exec", ns, "tc", "-j", "filter", "show", "dev", iface, dir,
        ])
        .output_bounded()
        .context("running tc")?;
    anyhow::ensure!(
        out.status.success(),
        "tc filter show dev {iface} {dir} in {ns}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let filters: Vec<serde_json::Value> =
        serde_json::from_slice(&out.stdout).context("tc's JSON output")?;
    Ok(filters
        .iter()
        .filter(|f| f["kind"] == "bpf")
        .filter_map(|f| {
            let id = f["options"]["prog"]["id"].as_u64()?;
            Some((f["pref"].as_u64()?, id as u32))
        })
        .collect())
}

/// The program id sluice's filter (priority 1) on a hook runs (see
/// [`filter_programs`]).
pub fn filter_program(ns: &str, iface: &str, dir: &str) -> anyhow::Result<u32> {
    let all = filter_programs(ns, iface, dir)?;
    all.iter()
        .find(|(pref, _)| *pref == 1)
        .map(|(_, id)| *id)
        .with_context(|| format!("no bpf filter at priority 1 on {iface} {dir} in {ns}: {all:?}"))
}

/// Loads a tc program that only returns `TC_ACT_OK` (ends the chain, writes
/// no map) and pins it at `path`: another CNI's program, for tests of where
/// sluice's programs run in a chain.
pub fn pin_pass_program(path: &std::path::Path) -> anyhow::Result<()> {
    use std::os::{fd::FromRawFd as _, unix::ffi::OsStrExt as _};
    const BPF_PROG_LOAD: libc::c_long = 5;
    const BPF_OBJ_PIN: libc::c_long = 6;
    const PROG_TYPE_SCHED_CLS: u32 = 3;
    // struct bpf_insn: r0 = 0 (TC_ACT_OK); exit.
    let insns: [u64; 2] = [0xb7, 0x95];
    let license = c"GPL";
    // union bpf_attr, BPF_PROG_LOAD: prog_type, insn_cnt, insns, license.
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&PROG_TYPE_SCHED_CLS.to_ne_bytes());
    attr[4..8].copy_from_slice(&(insns.len() as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    // SAFETY: a zeroed bpf_attr with the load fields set; the pointers stay
    // valid for the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_LOAD, attr.as_mut_ptr(), attr.len()) };
    anyhow::ensure!(
        fd >= 0,
        "loading a pass program: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a fresh fd the kernel just returned; closed on drop.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    // union bpf_attr, BPF_OBJ_PIN: pathname, bpf_fd.
    let mut attr = [0u8; 128];
    attr[0..8].copy_from_slice(&(c_path.as_ptr() as u64).to_ne_bytes());
    attr[8..12].copy_from_slice(&(std::os::fd::AsRawFd::as_raw_fd(&fd) as u32).to_ne_bytes());
    // SAFETY: as above.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_PIN, attr.as_mut_ptr(), attr.len()) };
    anyhow::ensure!(
        rc == 0,
        "pinning the pass program at {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    Ok(())
}

/// Attaches the program pinned at `pass` (see [`pin_pass_program`]) as a tcx
/// link first on `iface`'s `kind` hook in netns `ns`: another tool's program
/// ahead of sluice's. Detached when the link is dropped.
pub fn attach_tcx_first(
    ns: &str,
    iface: &'static str,
    kind: aya::programs::TcAttachType,
    pass: &std::path::Path,
) -> anyhow::Result<aya::programs::links::FdLink> {
    use aya::programs::{links::FdLink, tc::TcAttachOptions, LinkOrder};
    let pass = pass.to_owned();
    crate::ns::run_in(ns, move || -> anyhow::Result<FdLink> {
        let mut p = SchedClassifier::from_pin(&pass)?;
        let id =
            p.attach_with_options(iface, kind, TcAttachOptions::TcxOrder(LinkOrder::first()))?;
        Ok(FdLink::try_from(p.take_link(id)?)?)
    })
}

/// The tcx programs on `iface`'s `kind` hook in netns `ns`, in run order.
pub fn tcx_programs(
    ns: &str,
    iface: &'static str,
    kind: aya::programs::TcAttachType,
) -> anyhow::Result<Vec<u32>> {
    Ok(crate::ns::run_in(ns, move || {
        sluice::dataplane::hookview::tcx_programs(iface, kind)
    })?)
}

/// Attaches, in the netns at `netns`, an sk_lookup program that passes every
/// lookup and selects nothing (another tool's, for tests of what sluice's
/// verification says of it). Attached while the returned link is open.
pub fn attach_pass_sk_lookup(netns: &std::path::Path) -> anyhow::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd as _, FromRawFd as _};
    const BPF_PROG_LOAD: libc::c_long = 5;
    const BPF_LINK_CREATE: libc::c_long = 28;
    const PROG_TYPE_SK_LOOKUP: u32 = 30;
    const BPF_SK_LOOKUP: u32 = 36;
    // struct bpf_insn: r0 = 1 (SK_PASS); exit.
    let insns: [u64; 2] = [0x0000_0001_0000_00b7, 0x95];
    let license = c"GPL";
    // union bpf_attr, BPF_PROG_LOAD: prog_type, insn_cnt, insns, license,
    // …, expected_attach_type at 68.
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&PROG_TYPE_SK_LOOKUP.to_ne_bytes());
    attr[4..8].copy_from_slice(&(insns.len() as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    attr[68..72].copy_from_slice(&BPF_SK_LOOKUP.to_ne_bytes());
    // SAFETY: a zeroed bpf_attr with the load fields set; the pointers stay
    // valid for the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_LOAD, attr.as_mut_ptr(), attr.len()) };
    anyhow::ensure!(
        fd >= 0,
        "loading a pass sk_lookup program: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a fresh fd the kernel just returned; closed on drop.
    let prog = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
    let ns = std::fs::File::open(netns).with_context(|| format!("opening {}", netns.display()))?;
    // union bpf_attr, BPF_LINK_CREATE: prog_fd, target_fd, attach_type.
    let mut attr = [0u8; 64];
    attr[0..4].copy_from_slice(&(prog.as_raw_fd() as u32).to_ne_bytes());
    attr[4..8].copy_from_slice(&(ns.as_raw_fd() as u32).to_ne_bytes());
    attr[8..12].copy_from_slice(&BPF_SK_LOOKUP.to_ne_bytes());
    // SAFETY: as above.
    let link = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_CREATE,
            attr.as_mut_ptr(),
            attr.len(),
        )
    };
    anyhow::ensure!(
        link >= 0,
        "attaching the pass sk_lookup program: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: as above.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(link as i32) })
}

/// A tc hook (netns, device, direction) another tool changes behind
/// sluice's back, in tests.
pub struct Hook<'a> {
    /// An `ip netns` name.
    pub ns: &'a str,
    pub dev: &'a str,
    /// `ingress` or `egress`.
    pub dir: &'a str,
}

impl Hook<'_> {
    /// The program of the bpf filter at priority 1.
    pub fn program(&self) -> anyhow::Result<u32> {
        filter_program(self.ns, self.dev, self.dir)
    }

    /// `tc filter <verb>` of sluice's filter (its priority and handle), with
    /// the program pinned at `pin`.
    pub fn tc(&self, verb: &str, pin: Option<&std::path::Path>) -> anyhow::Result<()> {
        self.tc_handle(verb, "0x51150001", pin)
    }

    /// `tc filter <verb>` of the bpf filter at priority 1 and `handle`.
    pub fn tc_handle(
        &self,
        verb: &str,
        handle: &str,
        pin: Option<&std::path::Path>,
    ) -> anyhow::Result<()> {
        // Not `ip netns exec`: it mounts a sysfs of its own, without bpffs.
        let netns = format!("--net={}", crate::ns::netns_path(self.ns).display());
        let mut cmd = std::process::Command::new("nsenter");
        cmd.arg(&netns)
            .args(["tc", "filter", verb, "dev", self.dev, self.dir]);
        cmd.args(["prio", "1", "handle", handle, "protocol", "all", "bpf"]);
        if let Some(pin) = pin {
            cmd.arg("object-pinned").arg(pin).arg("da");
        }
        let out = cmd.output_bounded()?;
        anyhow::ensure!(
            out.status.success(),
            "tc filter {verb} on {} {} in {}: {}",
            self.dev,
            self.dir,
            self.ns,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// Waits until the filter runs program `ours` again.
    pub fn wait_program(&self, ours: u32) -> anyhow::Result<()> {
        crate::wait::until(
            &format!("sluice's filter on {} {} put back", self.dev, self.dir),
            crate::wait::DEADLINE,
            || match self.program() {
                Ok(id) if id == ours => Ok(()),
                other => Err(format!("{other:?}")),
            },
        )
    }
}

/// The ids of the sk_lookup programs attached in the netns at `netns`, as
/// the kernel lists them (`BPF_PROG_QUERY`): the kernel's answer, not
/// sluice's pins.
pub fn sk_lookup_programs(netns: &std::path::Path) -> anyhow::Result<Vec<u32>> {
    use std::os::fd::AsRawFd as _;
    const BPF_PROG_QUERY: libc::c_long = 16;
    const BPF_SK_LOOKUP: u32 = 36;
    let ns = std::fs::File::open(netns).with_context(|| format!("opening {}", netns.display()))?;
    let mut ids = [0u32; 64];
    // union bpf_attr, BPF_PROG_QUERY: target_fd, attach_type, query_flags,
    // attach_flags, prog_ids at 16, prog_cnt at 24.
    let mut attr = [0u8; 64];
    attr[0..4].copy_from_slice(&(ns.as_raw_fd() as u32).to_ne_bytes());
    attr[4..8].copy_from_slice(&BPF_SK_LOOKUP.to_ne_bytes());
    attr[16..24].copy_from_slice(&(ids.as_mut_ptr() as u64).to_ne_bytes());
    attr[24..28].copy_from_slice(&(ids.len() as u32).to_ne_bytes());
    // SAFETY: a zeroed bpf_attr with the query fields set; `ids` outlives
    // the call and holds `prog_cnt` entries.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_QUERY, attr.as_mut_ptr(), attr.len()) };
    anyhow::ensure!(
        rc == 0,
        "querying the sk_lookup programs of {}: {}",
        netns.display(),
        std::io::Error::last_os_error()
    );
    let n = u32::from_ne_bytes([attr[24], attr[25], attr[26], attr[27]]) as usize;
    Ok(ids[..n.min(ids.len())].to_vec())
}

//! What the running kernel offers the dataplane, probed once (never read
//! from the version string: distributions backport features). The loader
//! picks the programs' paths from it, `sluice status` and the build-info
//! metric show it, and a kernel lacking something sluice cannot do without
//! is refused with the feature named.
//!
//! Probes are raw `bpf(2)` calls that load nothing lasting: a three-insn
//! program that is closed at once, and a read-only query.

use std::{os::fd::FromRawFd as _, sync::OnceLock};

use serde::{Deserialize, Serialize};

/// The features the dataplane can use, each probed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Features {
    /// sk_lookup programs (Linux 5.9): steering to ztunnel's listeners.
    /// Required.
    pub sk_lookup: bool,
    /// tcx attachment of tc programs (6.6). Without it the programs are
    /// attached as cls_bpf filters (`tcfilter`).
    pub tcx: bool,
    /// `bpf_get_netns_cookie` in tc programs (6.15). Without it the tc
    /// programs find a packet's pod by its address instead (see
    /// `ebpf/src/tc.rs`).
    pub netns_cookie_in_tc: bool,
}

/// How sluice attaches its tc programs. Both run the same programs with the
/// same verdicts; they differ in what an enrollment costs and in who owns
/// the attachment:
///
/// - `ClsBpf` (the default, every kernel): a clsact qdisc and one netlink
///   filter per hook at sluice's fixed priority and handle. An attach takes
///   no RCU grace period, so a pod enrolls in about a millisecond and holds
///   RTNL for well under one. A filter is no BPF object: anything with
///   CAP_NET_ADMIN in the netns can delete it, which repair finds and mends.
/// - `Tcx` (Linux ≥ 6.6): a BPF link per hook, owned through its pin, placed
///   in the device's chain by order. Every attach and detach waits for an
///   RCU grace period under RTNL (tcx's program array swap): 10–20 ms each,
///   three or four per pod, which every netlink user on the node waits out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TcAttach {
    #[default]
    ClsBpf,
    Tcx,
}

impl TcAttach {
    pub fn as_str(self) -> &'static str {
        match self {
            TcAttach::ClsBpf => "cls_bpf",
            TcAttach::Tcx => "tcx",
        }
    }
}

impl std::str::FromStr for TcAttach {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cls_bpf" | "cls-bpf" => Ok(TcAttach::ClsBpf),
            "tcx" => Ok(TcAttach::Tcx),
            other => Err(format!("{other:?}: expected cls_bpf or tcx")),
        }
    }
}

/// Forces probed features off, for testing the fallbacks on a kernel that
/// has them: a comma-separated list of field names.
pub const DISABLE_ENV: &str = "SLUICE_DISABLE_KERNEL_FEATURES";

impl Features {
    /// This kernel's features (probed on first use), less those
    /// [`DISABLE_ENV`] turns off.
    pub fn get() -> Features {
        static PROBED: OnceLock<Features> = OnceLock::new();
        let mut f = *PROBED.get_or_init(probe);
        if let Ok(off) = std::env::var(DISABLE_ENV) {
            for name in off.split(',').map(str::trim) {
                match name {
                    "sk_lookup" => f.sk_lookup = false,
                    "tcx" => f.tcx = false,
                    "netns_cookie_in_tc" => f.netns_cookie_in_tc = false,
                    _ => {}
                }
            }
        }
        f
    }

    /// What sluice cannot run without, if the kernel lacks it.
    pub fn missing(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if !self.sk_lookup {
            out.push("sk_lookup programs (Linux ≥ 5.9)");
        }
        out
    }

    /// A short human form, for `status` and metrics.
    pub fn summary(&self) -> String {
        let on = |b: bool, name: &str| {
            if b {
                name.to_owned()
            } else {
                format!("no-{name}")
            }
        };
        [
            on(self.sk_lookup, "sk_lookup"),
            on(self.tcx, "tcx"),
            on(self.netns_cookie_in_tc, "netns_cookie_in_tc"),
        ]
        .join(",")
    }
}

/// The running kernel's release with the features sluice uses on it, as
/// `status` and the build-info metric show them: `6.1.0-27-cloud-amd64
/// (sk_lookup,tcx,no-netns_cookie_in_tc)`.
pub fn describe() -> String {
    format!("{} ({})", release(), Features::get().summary())
}

/// The running kernel's release (`uname -r`), or "unknown".
pub fn release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown".into())
}

fn probe() -> Features {
    Features {
        sk_lookup: loads(PROG_TYPE_SK_LOOKUP, ATTACH_SK_LOOKUP, None),
        tcx: tcx_queryable(),
        netns_cookie_in_tc: loads(PROG_TYPE_SCHED_CLS, 0, Some(HELPER_GET_NETNS_COOKIE)),
    }
}

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_QUERY: libc::c_long = 16;
const PROG_TYPE_SCHED_CLS: u32 = 3;
const PROG_TYPE_SK_LOOKUP: u32 = 30;
const ATTACH_SK_LOOKUP: u32 = 36;
const ATTACH_TCX_INGRESS: u32 = 46;
const HELPER_GET_NETNS_COOKIE: i32 = 122;

/// Whether the kernel loads a program of `prog_type` that returns 0, after
/// calling `helper` (with the context as its argument) when given.
fn loads(prog_type: u32, attach_type: u32, helper: Option<i32>) -> bool {
    // struct bpf_insn: code, regs (dst | src << 4), off, imm.
    let insn = |code: u8, imm: i32| -> u64 { u64::from(code) | (u64::from(imm as u32) << 32) };
    let mut insns = Vec::new();
    if let Some(h) = helper {
        insns.push(insn(0x85, h)); // call helper (r1 = ctx on entry)
    }
    insns.push(insn(0xb7, 0)); // r0 = 0
    insns.push(insn(0x95, 0)); // exit
    let license = c"GPL";
    // union bpf_attr, BPF_PROG_LOAD: prog_type, insn_cnt, insns, license,
    // log fields (unused), kern_version, prog_flags, prog_name[16],
    // prog_ifindex, expected_attach_type.
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&prog_type.to_ne_bytes());
    attr[4..8].copy_from_slice(&(insns.len() as u32).to_ne_bytes());
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    attr[68..72].copy_from_slice(&attach_type.to_ne_bytes());
    // SAFETY: `attr` is a zeroed bpf_attr with the load fields set; the
    // pointers stay valid for the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_LOAD, attr.as_mut_ptr(), attr.len()) };
    if fd < 0 {
        return false;
    }
    // SAFETY: a fresh fd the kernel just returned; closed on drop.
    drop(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) });
    true
}

/// Whether the kernel knows tcx: a read-only query of `lo`'s (ifindex 1)
/// tcx ingress programs succeeds; a kernel without tcx rejects the attach
/// type.
fn tcx_queryable() -> bool {
    // union bpf_attr, BPF_PROG_QUERY: target_ifindex, attach_type,
    // query_flags, attach_flags, prog_ids, prog_cnt.
    let mut attr = [0u8; 64];
    attr[0..4].copy_from_slice(&1u32.to_ne_bytes());
    attr[4..8].copy_from_slice(&ATTACH_TCX_INGRESS.to_ne_bytes());
    // SAFETY: a zeroed bpf_attr with the query fields set; no buffers.
    let r = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_QUERY, attr.as_mut_ptr(), attr.len()) };
    r == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_missing_sk_lookup_is_fatal_and_the_summary_names_each_feature() {
        let all = Features {
            sk_lookup: true,
            tcx: true,
            netns_cookie_in_tc: true,
        };
        assert!(all.missing().is_empty());
        assert_eq!(all.summary(), "sk_lookup,tcx,netns_cookie_in_tc");
        let old = Features {
            tcx: false,
            netns_cookie_in_tc: false,
            ..all
        };
        assert!(old.missing().is_empty(), "tcx and cookies have fallbacks");
        let ancient = Features {
            sk_lookup: false,
            ..old
        };
        assert_eq!(ancient.missing(), ["sk_lookup programs (Linux ≥ 5.9)"]);
        assert_eq!(old.summary(), "sk_lookup,no-tcx,no-netns_cookie_in_tc");
    }
}

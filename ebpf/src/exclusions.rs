//! A pod's exclusions from capture (`pod_exclusions`, written by user space
//! from the pod's `traffic.sidecar.istio.io/*` annotations when the node
//! allows them), decided at the SYN: an excluded connection goes where it
//! is addressed, in either direction, and its later packets pass as an
//! uncaptured flow's do. Outbound it leaves no hint; inbound it leaves a
//! `Bypass` one, as `bypass-inbound-capture` does (sk_lookup refuses an
//! unhinted SYN: fail closed), released with the handshake. A pod without exclusions costs
//! one map lookup per SYN.

use sluice_common::{ExcludedCounters, Role, PORT_DNS};

use crate::{
    dns::dns_on,
    maps::{EXCLUDED, POD_EXCLUSIONS},
    packet::Tcp,
    tc::listener_present,
};

/// Whether the pod's new outbound connection `t` stays out of capture. A
/// pod's captured DNS (TCP to port 53, with DNS capture on and ztunnel's
/// proxy listening) is not subject to its address ranges: only an
/// excluded port 53 takes it out, and user space turns the pod's DNS
/// capture off for that. Without the proxy, TCP to 53 is plain outbound
/// (row D4), and excluded as any other.
#[inline(always)]
pub fn outbound(cookie: u64, t: &Tcp) -> bool {
    if cfg!(feature = "bench-no-exclusions") {
        return false;
    }
    let a = t.daddr;
    let fam_port = (t.family as u64) << 16 | t.dport as u64;
    let a01 = a[0] as u64 | (a[1] as u64) << 32;
    let a23 = a[2] as u64 | (a[3] as u64) << 32;
    sluice_excluded_outbound(cookie, fam_port, a01, a23) != 0
}

/// Whether the pod's new inbound connection to `port` stays out of capture
/// (never HBONE's: the caller does not ask for it).
#[inline(always)]
pub fn inbound(cookie: u64, port: u16) -> bool {
    if cfg!(feature = "bench-no-exclusions") {
        return false;
    }
    sluice_excluded_inbound(cookie, port as u64) != 0
}

// The two checks are global functions (exported from the object, see
// `xtask`): the kernel's verifier checks a global function once, on its
// own, with only scalar arguments, instead of once for each state of its
// callers. Their loops over 64 entries would otherwise multiply the
// programs' verification past its limit.

/// `outbound`'s decision: `fam_port` is the family << 16 | the destination
/// port, `a01`/`a23` the destination's address words 0-1 and 2-3.
#[no_mangle]
#[inline(never)]
pub extern "C" fn sluice_excluded_outbound(cookie: u64, fam_port: u64, a01: u64, a23: u64) -> u64 {
    let Some(x) = (unsafe { POD_EXCLUSIONS.get(cookie) }) else {
        return 0;
    };
    let (family, port) = ((fam_port >> 16) as u8, fam_port as u16);
    if port == PORT_DNS && dns_on(cookie) && listener_present(cookie, Role::DnsTcp, family) {
        return 0;
    }
    let addr = [
        a01 as u32,
        (a01 >> 32) as u32,
        a23 as u32,
        (a23 >> 32) as u32,
    ];
    x.excludes_outbound(family, &addr, port) as u64
}

#[no_mangle]
#[inline(never)]
pub extern "C" fn sluice_excluded_inbound(cookie: u64, port: u64) -> u64 {
    unsafe { POD_EXCLUSIONS.get(cookie) }.is_some_and(|x| x.excludes_inbound(port as u16)) as u64
}

/// Adds one to a pod's excluded connections.
#[inline(always)]
pub fn count(cookie: u64, field: impl Fn(&mut ExcludedCounters) -> &mut u64) {
    crate::maps::bump(&EXCLUDED, cookie, field)
}

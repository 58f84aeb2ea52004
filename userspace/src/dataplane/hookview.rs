//! What the kernel runs at a cls_bpf hook, in the order it runs it, and where
//! sluice's filter stands there. A filter that is in place but runs after
//! another tool's is no capture: the other filter's verdict (`TC_ACT_OK`,
//! a redirect, a drop) ends the packet's walk before sluice's program sees
//! it. Whether a foreign program would end the walk cannot be known without
//! running it (and touching its maps), so any filter ahead of sluice's
//! counts as taking the hook.
//!
//! A dump lists chain 0's filters by priority, and within a priority in the
//! order `cls_bpf` runs them; a filter added at a priority goes to the head
//! of its list, so another tool's filter added at sluice's priority runs
//! before sluice's, and deleting and adding sluice's again puts it back in
//! front. (Other chains run only when a filter jumps to them.)

use std::io;

use aya::programs::TcAttachType;

use super::tcfilter::{HANDLE, PRIORITY};
use crate::podnet::rtnl::Rtnl;

/// One filter on a hook, as the kernel dumps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookFilter {
    pub prio: u16,
    pub handle: u32,
    /// The classifier (`bpf`, `u32`, `flower`, …).
    pub kind: String,
    /// The program a `bpf` filter runs.
    pub prog: Option<u32>,
}

impl HookFilter {
    fn is_ours(&self) -> bool {
        self.kind == "bpf" && self.prio == PRIORITY && self.handle == u32::from(HANDLE)
    }
}

impl std::fmt::Display for HookFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} filter pref {} handle {:#x}",
            self.kind, self.prio, self.handle
        )?;
        match self.prog {
            Some(id) => write!(f, " (program id {id})"),
            None => Ok(()),
        }
    }
}

/// Where sluice's filter stands on a hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Standing {
    /// No filter of sluice's (deleted, or its qdisc or device gone).
    Missing,
    /// Sluice's filter runs first, running the program of this id.
    First(u32),
    /// Sluice's filter is there (running `ours`), but `ahead` runs first.
    Behind { ours: u32, ahead: HookFilter },
}

/// Where sluice's filter stands among `filters` (in run order).
pub fn standing(filters: &[HookFilter]) -> Standing {
    let Some(pos) = filters.iter().position(HookFilter::is_ours) else {
        return Standing::Missing;
    };
    let ours = filters[pos].prog.unwrap_or(0);
    match pos {
        0 => Standing::First(ours),
        _ => Standing::Behind {
            ours,
            ahead: filters[0].clone(),
        },
    }
}

/// The filters of chain 0 on `iface`'s `kind` hook in the calling thread's
/// netns, in run order; empty without a clsact qdisc (or device).
pub fn hook_filters(iface: &str, kind: TcAttachType) -> io::Result<Vec<HookFilter>> {
    let Ok(index) = nix::net::if_::if_nametoindex(iface) else {
        return Ok(Vec::new());
    };
    hook_filters_over(&Rtnl::open()?, index, kind)
}

/// [`hook_filters`] of the device with index `index` in `nl`'s netns (no
/// netns entered, no socket made).
pub fn hook_filters_over(nl: &Rtnl, index: u32, kind: TcAttachType) -> io::Result<Vec<HookFilter>> {
    use netlink_packet_route::{
        tc::{TcAttribute, TcFilterBpfOption, TcOption},
        RouteNetlinkMessage,
    };
    let msg = super::tcfilter::hook_message(index, kind);
    let answer = match nl.dump(RouteNetlinkMessage::GetTrafficFilter(msg)) {
        Ok(a) => a,
        // No clsact qdisc on the device (any more).
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENODEV)) => {
            return Ok(Vec::new())
        }
        Err(e) => return Err(e),
    };
    Ok(answer
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewTrafficFilter(m) => Some(m),
            _ => None,
        })
        // Each classifier's first message names it, without a filter.
        .filter(|m| u32::from(m.header.handle) != 0)
        .filter(|m| {
            m.attributes
                .iter()
                .all(|a| !matches!(a, TcAttribute::Chain(c) if *c != 0))
        })
        .map(|m| {
            let mut f = HookFilter {
                prio: (m.header.info >> 16) as u16,
                handle: u32::from(m.header.handle),
                kind: String::new(),
                prog: None,
            };
            for a in &m.attributes {
                match a {
                    TcAttribute::Kind(k) => f.kind = k.clone(),
                    TcAttribute::Options(opts) => {
                        f.prog = opts.iter().find_map(|o| match o {
                            TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => Some(*id),
                            _ => None,
                        })
                    }
                    _ => {}
                }
            }
            f
        })
        .collect())
}

/// Where sluice's filter stands on `iface`'s `kind` hook in the calling
/// thread's netns.
pub fn standing_at(iface: &str, kind: TcAttachType) -> io::Result<Standing> {
    hook_filters(iface, kind).map(|f| standing(&f))
}

/// Whether `nl`'s netns has no device with index `index` (any other
/// answer, an error included, is not "gone").
pub fn device_gone(nl: &Rtnl, index: u32) -> bool {
    let mut get = netlink_packet_route::link::LinkMessage::default();
    get.header.index = index;
    matches!(
        nl.request(netlink_packet_route::RouteNetlinkMessage::GetLink(get)),
        Ok(None)
    )
}

/// [`standing_at`] of the device with index `index` in `nl`'s netns.
pub fn standing_over(nl: &Rtnl, index: u32, kind: TcAttachType) -> io::Result<Standing> {
    hook_filters_over(nl, index, kind).map(|f| standing(&f))
}

/// The tcx programs at `iface`'s `kind` hook in the calling thread's
/// netns, in the order they run (before every cls_bpf filter); empty on a
/// kernel without tcx (which answers EINVAL) or without the device.
pub fn tcx_programs(iface: &str, kind: TcAttachType) -> io::Result<Vec<u32>> {
    // Only a device the kernel does not know is a hook without programs:
    // the lookup needs a socket, and under EMFILE it fails otherwise.
    match nix::net::if_::if_nametoindex(iface) {
        Ok(index) => tcx_programs_at(index, kind),
        Err(nix::errno::Errno::ENODEV) => Ok(Vec::new()),
        Err(e) => Err(e.into()),
    }
}

/// [`tcx_programs`] of the device with index `index`.
pub fn tcx_programs_at(index: u32, kind: TcAttachType) -> io::Result<Vec<u32>> {
    tcx_query(index, kind, false).map(|(progs, _)| progs)
}

/// The program and link ids of the first tcx program at `iface`'s `kind`
/// hook in the calling thread's netns (link id 0: attached without a
/// link); `None` when none runs there (or the kernel has no tcx).
pub fn tcx_first(iface: &str, kind: TcAttachType) -> io::Result<Option<(u32, u32)>> {
    let index = match nix::net::if_::if_nametoindex(iface) {
        Ok(index) => index,
        Err(nix::errno::Errno::ENODEV) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let (progs, links) = tcx_query(index, kind, true)?;
    Ok(progs.first().copied().zip(links.first().copied()))
}

/// The tcx programs (and, with `links`, their link ids) at a device's hook;
/// none on a kernel without tcx (which answers EINVAL) or without the
/// device.
fn tcx_query(index: u32, kind: TcAttachType, links: bool) -> io::Result<(Vec<u32>, Vec<u32>)> {
    let tcx_type = match kind {
        TcAttachType::Egress => BPF_TCX_EGRESS,
        _ => BPF_TCX_INGRESS,
    };
    match query(index, tcx_type, links) {
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENODEV)) => {
            Ok(Default::default())
        }
        other => other,
    }
}

/// `BPF_PROG_QUERY`'s attach types for the hooks a pod depends on.
pub const BPF_SK_LOOKUP: u32 = 36;
pub const BPF_TCX_INGRESS: u32 = 46;
pub const BPF_TCX_EGRESS: u32 = 47;

/// The ids of the programs attached at `attach_type` to `target` (a netns
/// fd for sk_lookup, an interface index of the calling thread's netns for
/// tcx), in the order they run. An sk_lookup query needs Linux ≥ 5.9, a
/// tcx one ≥ 6.6 (older kernels answer EINVAL).
pub fn prog_query(target: u32, attach_type: u32) -> io::Result<Vec<u32>> {
    query(target, attach_type, false).map(|(progs, _)| progs)
}

/// `BPF_PROG_QUERY`: program ids and, with `links` (Linux ≥ 6.6: an older
/// kernel refuses the field), link ids, in run order.
fn query(target: u32, attach_type: u32, links: bool) -> io::Result<(Vec<u32>, Vec<u32>)> {
    const BPF_PROG_QUERY: libc::c_long = 16;
    let (mut progs, mut link_ids) = ([0u32; 64], [0u32; 64]);
    // union bpf_attr, query: target_fd (or ifindex), attach_type,
    // query_flags, attach_flags, prog_ids, prog_cnt, a hole,
    // prog_attach_flags, link_ids, link_attach_flags, revision. 64 bytes:
    // a tcx query writes `revision` at 56..64 whatever size it is given.
    let mut attr = [0u8; 64];
    attr[0..4].copy_from_slice(&target.to_ne_bytes());
    attr[4..8].copy_from_slice(&attach_type.to_ne_bytes());
    attr[16..24].copy_from_slice(&(progs.as_mut_ptr() as u64).to_ne_bytes());
    attr[24..28].copy_from_slice(&(progs.len() as u32).to_ne_bytes());
    if links {
        attr[40..48].copy_from_slice(&(link_ids.as_mut_ptr() as u64).to_ne_bytes());
    }
    // SAFETY: a zeroed bpf_attr with the query fields set; `progs` and
    // `link_ids` outlive the call and hold `prog_cnt` entries each.
    let r = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_QUERY, attr.as_mut_ptr(), attr.len()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let n = (u32::from_ne_bytes([attr[24], attr[25], attr[26], attr[27]]) as usize).min(64);
    let link_ids = if links {
        link_ids[..n].to_vec()
    } else {
        Vec::new()
    };
    Ok((progs[..n].to_vec(), link_ids))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter(prio: u16, handle: u32, prog: u32) -> HookFilter {
        HookFilter {
            prio,
            handle,
            kind: "bpf".into(),
            prog: Some(prog),
        }
    }

    #[test]
    fn sluice_counts_only_when_its_filter_runs_first() {
        let ours = filter(PRIORITY, u32::from(HANDLE), 7);
        assert_eq!(standing(&[]), Standing::Missing);
        assert_eq!(standing(&[filter(1, 2, 9)]), Standing::Missing);
        assert_eq!(standing(std::slice::from_ref(&ours)), Standing::First(7));
        assert_eq!(
            standing(&[ours.clone(), filter(2, 1, 9)]),
            Standing::First(7)
        );
        // Another tool's filter at sluice's priority, added after it.
        let ahead = filter(1, 2, 9);
        assert_eq!(
            standing(&[ahead.clone(), ours.clone()]),
            Standing::Behind { ours: 7, ahead }
        );
        // Another classifier than bpf at sluice's handle is not sluice's.
        let u32_at_ours = HookFilter {
            kind: "u32".into(),
            prog: None,
            ..ours
        };
        assert_eq!(standing(&[u32_at_ours]), Standing::Missing);
    }
}

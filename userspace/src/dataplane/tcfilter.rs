//! tc programs attached as cls_bpf filters (a clsact qdisc and a netlink
//! filter in direct-action mode): how sluice attaches by default, and the
//! only way on kernels without tcx (Linux < 6.6). The programs' verdicts mean the same on both hooks
//! (`TC_ACT_UNSPEC` is `TCX_NEXT`: the next filter runs).
//!
//! sluice keeps one filter per hook, at a fixed priority and handle, so it
//! is found, replaced and removed without remembering anything about it. A
//! netlink filter is no BPF object and cannot be pinned; the pod's pin
//! directory holds the program itself, pinned under the link's name, as the
//! record that the filter was attached (what `status`, repair and teardown
//! read, as they read tcx link pins).

use std::{
    io,
    os::fd::{AsFd as _, AsRawFd as _},
    path::Path,
};

use aya::programs::{
    links::Link as _,
    tc::{SchedClassifierLink, TcHandle},
    ProgramError, SchedClassifier, TcAttachType,
};

/// First among the hook's filters (lower runs first).
pub const PRIORITY: u16 = 1;
/// Ours at that priority ("5115" for sluice).
pub const HANDLE: TcHandle = TcHandle::new(0x5115, 1);

/// Attaches `prog` as sluice's filter on `iface`'s `kind` hook, in the
/// calling thread's netns; a filter of ours already there has its program
/// replaced in place (no moment without one). Two requests on one rtnetlink
/// socket: the clsact qdisc (there already is fine: another tc user, an
/// earlier attach), then the filter, created or replaced
/// (`NLM_F_CREATE | NLM_F_REPLACE`). The filter outlives this process.
pub fn attach(prog: &SchedClassifier, iface: &str, kind: TcAttachType) -> Result<(), ProgramError> {
    let index = nix::net::if_::if_nametoindex(iface)
        .map_err(|e| ProgramError::IOError(io::Error::from(e)))?;
    attach_over(&crate::podnet::rtnl::Rtnl::open()?, prog, index, kind)
}

/// [`attach`] on the interface of `index` in the netns of `nl` (a socket
/// made there, used from any thread).
pub fn attach_over(
    nl: &crate::podnet::rtnl::Rtnl,
    prog: &SchedClassifier,
    index: u32,
    kind: TcAttachType,
) -> Result<(), ProgramError> {
    use netlink_packet_core::{NLM_F_CREATE, NLM_F_REPLACE};
    use netlink_packet_route::{
        tc::{
            TcAttribute, TcBpfFlags, TcFilterBpfOption, TcHandle as NlHandle, TcMessage, TcOption,
        },
        RouteNetlinkMessage,
    };
    let fd = prog.fd()?;
    let name = prog
        .info()
        .ok()
        .and_then(|i| i.name_as_str().map(str::to_owned))
        .unwrap_or_else(|| "sluice".into());

    let mut qdisc = TcMessage::default();
    qdisc.header.index = index as i32;
    qdisc.header.handle = NlHandle {
        major: NlHandle::CLSACT.major,
        minor: 0,
    };
    qdisc.header.parent = NlHandle::CLSACT;
    qdisc.attributes.push(TcAttribute::Kind("clsact".into()));
    // Without NLM_F_EXCL a clsact already there is kept as it is, and a
    // qdisc of another kind on the hook (`ingress`: one slot holds either)
    // is refused with EINVAL. With NLM_F_EXCL both answer EEXIST, and a
    // filter for the egress hook would then land in the `ingress` qdisc's
    // one block: on ingress.
    match nl.change(RouteNetlinkMessage::NewQueueDiscipline(qdisc), NLM_F_CREATE) {
        // EINVAL has other causes too: say "taken" only when it is.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            return Err(match foreign_hook_qdisc(nl, index) {
                Ok(Some(_)) => hook_taken(),
                _ => ProgramError::IOError(e),
            });
        }
        r => r?,
    }

    let mut filter = our_filter(index, kind);
    filter.attributes.push(TcAttribute::Options(vec![
        TcOption::Bpf(TcFilterBpfOption::ProgFd(fd.as_fd().as_raw_fd() as u32)),
        TcOption::Bpf(TcFilterBpfOption::ProgName(name)),
        TcOption::Bpf(TcFilterBpfOption::Flags(TcBpfFlags::DirectAction)),
    ]));
    nl.change(
        RouteNetlinkMessage::NewTrafficFilter(filter),
        NLM_F_CREATE | NLM_F_REPLACE,
    )?;
    Ok(())
}

/// Why a filter cannot be attached where another tool's `ingress` qdisc
/// holds the device's hook (e.g. the bandwidth CNI plugin's egress shaping
/// on a host veth). sluice does not replace it: that would delete its
/// filters.
pub const HOOK_TAKEN: &str = "the device's ingress/egress hook holds a qdisc other than clsact \
     (an `ingress` qdisc: another tool's), which sluice leaves alone; cls_bpf filters need \
     clsact there (`--tc-attach tcx` needs no qdisc)";

/// Another tool's qdisc holds the hook ([`HOOK_TAKEN`]).
#[derive(Debug, thiserror::Error)]
#[error("{HOOK_TAKEN}")]
struct HookTaken;

/// The error of an attach where another tool's qdisc holds the hook.
fn hook_taken() -> ProgramError {
    ProgramError::IOError(io::Error::new(io::ErrorKind::InvalidInput, HookTaken))
}

/// Whether an attach failed because another tool's qdisc holds the hook.
pub fn is_hook_taken(e: &ProgramError) -> bool {
    matches!(e, ProgramError::IOError(io) if io.get_ref().is_some_and(|r| r.is::<HookTaken>()))
}

/// The kind of the qdisc in interface `index`'s clsact slot (the one slot
/// clsact and `ingress` share) in `nl`'s netns when it is not clsact
/// (`None`: clsact or nothing), so that sluice's filters cannot go there
/// ([`HOOK_TAKEN`]). One request, no dump.
pub fn foreign_hook_qdisc(
    nl: &crate::podnet::rtnl::Rtnl,
    index: u32,
) -> io::Result<Option<String>> {
    use netlink_packet_route::{
        tc::{TcAttribute, TcHandle as NlHandle, TcMessage},
        RouteNetlinkMessage,
    };
    let mut get = TcMessage::default();
    get.header.index = index as i32;
    get.header.parent = NlHandle::CLSACT;
    // The kernel sends the answer to RTNLGRP_TC, and to the asker only with
    // NLM_F_ECHO.
    let echo = netlink_packet_core::NLM_F_ECHO;
    // Nothing in the slot, or the device gone, reads as `None`.
    let reply = nl.request_with(RouteNetlinkMessage::GetQueueDiscipline(get), echo)?;
    let kind = match reply {
        Some(RouteNetlinkMessage::NewQueueDiscipline(m)) => {
            m.attributes.into_iter().find_map(|a| match a {
                TcAttribute::Kind(k) => Some(k),
                _ => None,
            })
        }
        _ => None,
    };
    Ok(kind.filter(|k| k != "clsact"))
}

/// A message naming sluice's bpf filter on interface `index`'s `kind` hook:
/// the clsact hook, sluice's handle, and in `tcm_info` TC_H_MAKE(priority
/// << 16, protocol), for every protocol.
fn our_filter(index: u32, kind: TcAttachType) -> netlink_packet_route::tc::TcMessage {
    use netlink_packet_route::tc::{TcAttribute, TcHandle as NlHandle};
    let mut msg = hook_message(index, kind);
    msg.header.handle = NlHandle::from(u32::from(HANDLE));
    msg.header.info = ((PRIORITY as u32) << 16) | u32::from((libc::ETH_P_ALL as u16).to_be());
    msg.attributes.push(TcAttribute::Kind("bpf".into()));
    msg
}

/// A tc message naming interface `index`'s `kind` hook of its clsact qdisc.
pub(super) fn hook_message(index: u32, kind: TcAttachType) -> netlink_packet_route::tc::TcMessage {
    use netlink_packet_route::tc::{TcHandle as NlHandle, TcMessage};
    let mut msg = TcMessage::default();
    msg.header.index = index as i32;
    msg.header.parent = NlHandle {
        major: NlHandle::CLSACT.major,
        minor: match kind {
            TcAttachType::Egress => NlHandle::MIN_EGRESS,
            _ => NlHandle::MIN_INGRESS,
        },
    };
    msg
}

/// Removes sluice's filter from `iface`'s `kind` hook, in the calling
/// thread's netns. A filter or interface that is gone is not an error.
pub fn detach(iface: &str, kind: TcAttachType) -> Result<(), ProgramError> {
    // Only an interface that is gone has nothing attached: a lookup that
    // failed otherwise (out of descriptors: if_nametoindex opens a socket)
    // must fail the detach, not leave the filter running.
    let ours = match SchedClassifierLink::attached(iface, kind, PRIORITY, HANDLE, None) {
        Ok(link) => link,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENODEV | libc::ENXIO)) => return Ok(()),
        Err(e) => return Err(ProgramError::IOError(e)),
    };
    match ours.detach() {
        Err(e)
            if matches!(
                os_error(&e),
                Some(libc::ENOENT | libc::ENODEV | libc::EINVAL)
            ) =>
        {
            Ok(())
        }
        r => r,
    }
}

/// Pins `prog` at `path`: the record that its filter is attached.
pub fn pin_record(prog: &SchedClassifier, path: &Path) -> io::Result<()> {
    let fd = prog.fd().map_err(io::Error::other)?;
    let path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // union bpf_attr, BPF_OBJ_PIN: pathname, bpf_fd, file_flags.
    let mut attr = [0u8; 16];
    attr[0..8].copy_from_slice(&(path.as_ptr() as u64).to_ne_bytes());
    attr[8..12].copy_from_slice(&(fd.as_fd().as_raw_fd() as u32).to_ne_bytes());
    const BPF_OBJ_PIN: libc::c_long = 6;
    // SAFETY: a zeroed bpf_attr with the pin fields set; the path and the fd
    // stay valid for the call.
    let r = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_PIN, attr.as_mut_ptr(), attr.len()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What a pin in a pod's directory holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pinned {
    /// A BPF link (tcx, sk_lookup): attached while pinned.
    Link,
    /// A program (its kernel id): the record of a cls_bpf filter. Unlike a
    /// link, the record does not keep the filter attached: anyone with
    /// CAP_NET_ADMIN in the netns can delete the filter;
    /// [`hookview::standing_at`](super::hookview::standing_at) says whether
    /// it is still there, and runs first.
    Program(u32),
}

/// What is pinned at `path`, if anything readable. (Opening a pin does not
/// say what it holds; the file type of the fd it gives does.)
pub fn pinned(path: &Path) -> Option<Pinned> {
    pinned_or_busy(path).ok().flatten()
}

/// [`pinned`], but a pin this process could not open for want of
/// resources (out of descriptors or memory) is an error, not "nothing
/// readable": a teardown must not drop the record of a filter it could not
/// look at.
pub fn pinned_or_busy(path: &Path) -> io::Result<Option<Pinned>> {
    let transient = |e: io::Error| match e.raw_os_error() {
        Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::EAGAIN | libc::EINTR) => Err(e),
        _ => Ok(None),
    };
    // A path with a NUL in it is no pin (InvalidInput: not transient).
    let fd = match super::relink::open_pin(path) {
        Ok(fd) => fd,
        Err(e) => return transient(e),
    };
    let kind = match std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())) {
        Ok(k) => k,
        Err(e) => return transient(e),
    };
    let kind = kind.to_string_lossy();
    Ok(if kind.contains("bpf-link") {
        Some(Pinned::Link)
    } else if kind.contains("bpf-prog") {
        prog_id(&fd).map(Pinned::Program)
    } else {
        None
    })
}

/// What the link pinned at `path` says of itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkInfo {
    /// The link's own kernel id.
    pub id: u32,
    /// The kernel id of the program it runs.
    pub prog: u32,
    /// For a tcx link, its device's index: 0 once detached (the device
    /// deleted, or `BPF_LINK_DETACH`).
    pub tcx_ifindex: u32,
}

/// [`LinkInfo`] of the link pinned at `path` (`None`: no link there, or it
/// cannot be read now).
pub fn link_info(path: &Path) -> Option<LinkInfo> {
    let fd = super::relink::open_pin(path).ok()?;
    // struct bpf_link_info: type, id, prog_id, then (8-aligned) the union,
    // whose tcx member begins with ifindex.
    let mut info = [0u32; 6];
    super::relink::obj_info(fd.as_fd(), &mut info)
        .ok()
        .map(|()| LinkInfo {
            id: info[1],
            prog: info[2],
            tcx_ifindex: info[4],
        })
}

/// The kernel id of the program open as `fd`.
fn prog_id(fd: &std::os::fd::OwnedFd) -> Option<u32> {
    // struct bpf_prog_info begins with type and id.
    let mut info = [0u32; 2];
    super::relink::obj_info(fd.as_fd(), &mut info)
        .ok()
        .map(|()| info[1])
}

/// The OS error at the bottom of `e`'s causes, if any.
fn os_error(e: &(dyn std::error::Error + 'static)) -> Option<i32> {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if let Some(io) = c.downcast_ref::<io::Error>() {
            if let Some(n) = io.raw_os_error() {
                return Some(n);
            }
        }
        cur = c.source();
    }
    None
}

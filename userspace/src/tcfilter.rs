//! tc programs attached as cls_bpf filters (a clsact qdisc and a netlink
//! filter in direct-action mode): how sluice attaches on kernels without tcx
//! (Linux < 6.6). The programs' verdicts mean the same on both hooks
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
    os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _},
    path::Path,
};

use aya::programs::{
    links::Link as _,
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
    ProgramError, SchedClassifier, TcAttachType,
};

/// First among the hook's filters (lower runs first).
pub const PRIORITY: u16 = 1;
/// Ours at that priority ("5115" for sluice).
pub const HANDLE: TcHandle = TcHandle::new(0x5115, 1);

/// Attaches `prog` as sluice's filter on `iface`'s `kind` hook, in the
/// calling thread's netns; a filter of ours already there is replaced.
pub fn attach(
    prog: &mut SchedClassifier,
    iface: &str,
    kind: TcAttachType,
) -> Result<(), ProgramError> {
    // The clsact qdisc may be there already (another tc user, an earlier
    // attach): that is fine.
    if let Err(e) = tc::qdisc_add_clsact(iface) {
        if os_error(&e) != Some(libc::EEXIST) {
            return Err(e.into());
        }
    }
    let options = TcAttachOptions::Netlink(NlOptions {
        priority: PRIORITY,
        handle: HANDLE,
        classid: None,
    });
    let id = match prog.attach_with_options(iface, kind, options) {
        Ok(id) => id,
        Err(e) if os_error(&e) == Some(libc::EEXIST) => {
            let ours = SchedClassifierLink::attached(iface, kind, PRIORITY, HANDLE, None)
                .map_err(ProgramError::IOError)?;
            prog.attach_to_link(ours)?
        }
        Err(e) => return Err(e),
    };
    // The filter must outlive this process: aya would remove it when the
    // program or the link handle is dropped.
    std::mem::forget(prog.take_link(id)?);
    Ok(())
}

/// Removes sluice's filter from `iface`'s `kind` hook, in the calling
/// thread's netns. A filter or interface that is gone is not an error.
pub fn detach(iface: &str, kind: TcAttachType) -> Result<(), ProgramError> {
    let Ok(ours) = SchedClassifierLink::attached(iface, kind, PRIORITY, HANDLE, None) else {
        return Ok(());
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
    /// A program: the record of a cls_bpf filter.
    Program,
}

/// What is pinned at `path`, if anything readable. (Opening a pin does not
/// say what it holds; the file type of the fd it gives does.)
pub fn pinned(path: &Path) -> Option<Pinned> {
    let cpath = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // union bpf_attr, BPF_OBJ_GET: pathname, bpf_fd (0), file_flags.
    let mut attr = [0u8; 16];
    attr[0..8].copy_from_slice(&(cpath.as_ptr() as u64).to_ne_bytes());
    const BPF_OBJ_GET: libc::c_long = 7;
    // SAFETY: a zeroed bpf_attr with the path set, valid for the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_GET, attr.as_mut_ptr(), attr.len()) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh fd the kernel just returned; closed on drop.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) };
    let kind = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()?;
    let kind = kind.to_string_lossy();
    if kind.contains("bpf-link") {
        Some(Pinned::Link)
    } else if kind.contains("bpf-prog") {
        Some(Pinned::Program)
    } else {
        None
    }
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

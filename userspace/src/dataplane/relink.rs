//! Pointing a pinned link at another program, atomically (`BPF_LINK_UPDATE`,
//! Linux ≥ 5.7; sk_lookup and tcx links support it): how a new sluice build
//! replaces the programs of pods enrolled by an older one without detaching
//! anything, so no packet meets a pod without capture. aya exposes the call
//! only through per-program-type wrappers that need the link's original
//! handle, which a pin does not give back; raw `bpf(2)` commands do. The
//! other raw commands on pinned objects live here too: detaching a link
//! (`BPF_LINK_DETACH`) and reading an object's info.

use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::Path,
};

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_LINK_DETACH: libc::c_long = 34;

fn bpf(cmd: libc::c_long, attr: &mut [u64; 2]) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a zeroed prefix of `union bpf_attr` laid out for
    // `cmd`; the kernel reads at most its size.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr(),
            std::mem::size_of_val(attr),
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Opens a pinned BPF object (here: a link) by its bpffs path.
pub(crate) fn open_pin(path: &Path) -> io::Result<OwnedFd> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a pin path"))?;
    // struct { __aligned_u64 pathname; __u32 bpf_fd; __u32 file_flags; }
    let mut attr = [c.as_ptr() as u64, 0];
    let fd = bpf(BPF_OBJ_GET, &mut attr)?;
    // SAFETY: BPF_OBJ_GET returned a new descriptor that we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Points the link pinned at `pin` at `prog` (any program of the link's
/// type and attach type). The switch is atomic for every packet.
pub fn update(pin: &Path, prog: BorrowedFd<'_>) -> io::Result<()> {
    let link = open_pin(pin)?;
    // struct { __u32 link_fd; __u32 new_prog_fd; __u32 flags; __u32 old_prog_fd; }
    let lo = link.as_raw_fd() as u32 as u64 | (prog.as_raw_fd() as u32 as u64) << 32;
    let mut attr = [lo, 0];
    bpf(BPF_LINK_UPDATE, &mut attr).map(drop)
}

/// Detaches the link pinned at `pin` (`BPF_LINK_DETACH`), whoever else
/// holds it open; the pin stays, to be removed by the caller.
pub fn detach(pin: &Path) -> io::Result<()> {
    let link = open_pin(pin)?;
    // struct { __u32 link_fd; }
    let mut attr = [link.as_raw_fd() as u32 as u64, 0];
    bpf(BPF_LINK_DETACH, &mut attr).map(drop)
}

/// `BPF_OBJ_GET_INFO_BY_FD` into `info` (the kernel fills what fits in its
/// length): a program's or a link's info, as `u32` words.
pub fn obj_info(fd: BorrowedFd<'_>, info: &mut [u32]) -> io::Result<()> {
    // struct { __u32 bpf_fd; __u32 info_len; __aligned_u64 info; }
    let len = std::mem::size_of_val(info) as u32 as u64;
    let mut attr = [
        fd.as_raw_fd() as u32 as u64 | len << 32,
        info.as_mut_ptr() as u64,
    ];
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).map(drop)
}

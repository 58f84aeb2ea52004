//! Copying every entry of one BPF map into another of the same key and value
//! size (the new one sized or flagged differently): how a build whose maps
//! changed size takes over the pinned state. Raw `bpf(2)` on byte buffers,
//! because the map types are only known at run time here (aya's typed maps
//! need them at compile time).

use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd},
};

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_ANY: u64 = 0;

/// `union bpf_attr` for the element commands:
/// `{ u32 map_fd; u32 pad; u64 key; u64 value_or_next_key; u64 flags; }`.
fn elem(
    cmd: libc::c_long,
    map: BorrowedFd<'_>,
    key: *const u8,
    value: *mut u8,
    flags: u64,
) -> io::Result<()> {
    let mut attr: [u64; 4] = [
        map.as_raw_fd() as u32 as u64,
        key as u64,
        value as u64,
        flags,
    ];
    // SAFETY: `attr` is laid out for the element commands; `key` and `value`
    // point to buffers of the map's key and (per-CPU) value size, or key is
    // null for the first GET_NEXT_KEY.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr(),
            std::mem::size_of_val(&attr),
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Bytes of one value as user space reads it: per-CPU maps hand over one
/// 8-byte-aligned slot per possible CPU.
pub fn value_bytes(value_size: u32, per_cpu: bool) -> io::Result<usize> {
    if !per_cpu {
        return Ok(value_size as usize);
    }
    let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?;
    Ok((value_size as usize).div_ceil(8) * 8 * cpus)
}

/// Copies every entry of `from` into `to`; returns how many. An entry that
/// does not fit (`to` full) is an error: nothing is dropped silently, but
/// for an `array`'s indexes past the end of a shorter `to` (a build with
/// fewer slots, such as fewer drop reasons: what it has no slot for, it
/// never counts).
pub fn copy(
    from: BorrowedFd<'_>,
    to: BorrowedFd<'_>,
    key_size: u32,
    value_bytes: usize,
    array: bool,
) -> io::Result<usize> {
    let mut key = vec![0u8; key_size as usize];
    let mut next = vec![0u8; key_size as usize];
    let mut value = vec![0u8; value_bytes];
    let mut n = 0;
    let mut first = true;
    loop {
        let prev = if first {
            std::ptr::null()
        } else {
            key.as_ptr()
        };
        match elem(BPF_MAP_GET_NEXT_KEY, from, prev, next.as_mut_ptr(), 0) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(n),
            Err(e) => return Err(e),
        }
        first = false;
        std::mem::swap(&mut key, &mut next);
        match elem(
            BPF_MAP_LOOKUP_ELEM,
            from,
            key.as_ptr(),
            value.as_mut_ptr(),
            0,
        ) {
            Ok(()) => {}
            // Deleted between the two calls.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
            Err(e) => return Err(e),
        }
        match elem(
            BPF_MAP_UPDATE_ELEM,
            to,
            key.as_ptr(),
            value.as_mut_ptr(),
            BPF_ANY,
        ) {
            Ok(()) => n += 1,
            // Arrays list their indexes in order: the rest are past it too.
            Err(e) if array && e.raw_os_error() == Some(libc::E2BIG) => return Ok(n),
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd as _, FromRawFd as _, OwnedFd};

    use super::*;

    const BPF_MAP_CREATE: libc::c_long = 0;

    /// A map of `kind` with u32 keys and u64 values (needs root).
    fn map(kind: u32, max_entries: u32) -> OwnedFd {
        // struct { u32 map_type, key_size, value_size, max_entries, map_flags; }
        let mut attr = [kind, 4, 8, max_entries, 0, 0, 0, 0];
        // SAFETY: `attr` is a zeroed prefix of `union bpf_attr` for BPF_MAP_CREATE.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_CREATE,
                attr.as_mut_ptr(),
                std::mem::size_of_val(&attr),
            )
        };
        assert!(
            fd >= 0,
            "creating a BPF map (root needed): {}",
            io::Error::last_os_error()
        );
        // SAFETY: a new descriptor we own.
        unsafe { OwnedFd::from_raw_fd(fd as i32) }
    }

    fn put(m: &OwnedFd, k: u32, v: u64) {
        let mut v = v;
        elem(
            BPF_MAP_UPDATE_ELEM,
            m.as_fd(),
            (&raw const k).cast(),
            (&raw mut v).cast(),
            BPF_ANY,
        )
        .unwrap();
    }

    fn get(m: &OwnedFd, k: u32) -> Option<u64> {
        let mut v = 0u64;
        elem(
            BPF_MAP_LOOKUP_ELEM,
            m.as_fd(),
            (&raw const k).cast(),
            (&raw mut v).cast(),
            0,
        )
        .ok()
        .map(|()| v)
    }

    /// A downgrade to a build with fewer array slots (fewer drop reasons)
    /// migrates: the slots it has are copied, the others it never counts.
    /// (The update past its end failed the migration, and the node stayed
    /// on the newer build.) A hash map that cannot hold every entry still
    /// fails the copy.
    #[test]
    fn a_shorter_array_takes_what_fits_and_a_full_hash_map_is_an_error() {
        const ARRAY: u32 = 2;
        const HASH: u32 = 1;
        let (from, to) = (map(ARRAY, 4), map(ARRAY, 2));
        for k in 0..4 {
            put(&from, k, 10 + u64::from(k));
        }
        assert_eq!(copy(from.as_fd(), to.as_fd(), 4, 8, true).unwrap(), 2);
        assert_eq!((get(&to, 0), get(&to, 1)), (Some(10), Some(11)));
        let (from, to) = (map(HASH, 4), map(HASH, 2));
        for k in 0..3 {
            put(&from, k, u64::from(k));
        }
        assert!(copy(from.as_fd(), to.as_fd(), 4, 8, false).is_err());
    }
}

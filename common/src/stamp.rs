//! The pinned stamp: which build pinned the dataplane (user space only).

/// `STAMP_MAGIC` marks a written [`Stamp`].
pub const STAMP_MAGIC: u64 = u64::from_be_bytes(*b"sluice01");
pub const STAMP_VERSION_LEN: usize = 48;

/// The single value of the pinned `stamp` map: which sluice build pinned
/// the dataplane, and the layout of the maps it pinned. User space only.
/// This layout is frozen: every build must be able to read every other's.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Stamp {
    pub magic: u64,
    /// Digest of every map's type, key and value size, max entries and flags.
    pub layout: u64,
    /// NUL-padded version of the build (`0.1.0+obj.1a2b3c4d`).
    pub version: [u8; STAMP_VERSION_LEN],
}

//! This build's map layout against the pinned maps': which maps changed,
//! which of those a migration carries over, and what this build cannot take
//! over at all.

use crate::dataplane::stamp::{self, Change, Layout};

use super::{error::LoadError, object::ebpf_object, pins::Pins};

/// Maps a migration does not copy: ztunnel's listeners and DNS proxy
/// sockets (re-registered from the pods' netns: the kernel reads no socket
/// map back to user space) and flow hints (each is needed for a handshake,
/// and honoured for seconds at most).
pub const REBUILT: [&str; 3] = ["listeners", "dns_listeners", "flow_hints"];

/// This build's layout and the pinned maps that differ from it.
pub struct Compared {
    pub ours: Layout,
    pub changes: Vec<Change>,
}

/// Compares the layout of `object`'s maps with the pinned maps'.
pub fn compare(pins: &Pins, object: &[u8]) -> Result<Compared, LoadError> {
    let layout_err = |what: &str, e: String| LoadError::Io {
        what: what.to_owned(),
        source: std::io::Error::other(e),
    };
    let ours = stamp::of_object(object)
        .map_err(|e| layout_err("reading this build's map layout", e.to_string()))?;
    let pinned = stamp::of_pinned(&pins.maps(), ours.keys())
        .map_err(|e| layout_err("reading the pinned maps' layout", e.to_string()))?;
    let changes = stamp::changes(&ours, &pinned);
    Ok(Compared { ours, changes })
}

impl Compared {
    /// A change no migration carries over (another type, key or value size
    /// of a map whose entries are copied), if any.
    pub fn blocking(&self) -> Option<&Change> {
        self.changes
            .iter()
            .find(|c| !c.copyable() && !REBUILT.contains(&c.map.as_str()))
    }
}

/// What in the pinned maps this build cannot open as its own types (another
/// map type, key or value size), if anything.
pub fn incompatible(pins: &Pins) -> Option<String> {
    let object = ebpf_object();
    let ours = stamp::of_object(&object).ok()?;
    let pinned = stamp::of_pinned(&pins.maps(), ours.keys()).ok()?;
    let bad: Vec<String> = stamp::changes(&ours, &pinned)
        .iter()
        .filter(|c| !c.copyable())
        .map(ToString::to_string)
        .collect();
    (!bad.is_empty()).then(|| bad.join("; "))
}

//! Which sluice build pinned the node's dataplane, and whether this build's
//! maps fit the pinned ones. The stamp (one entry of the pinned `stamp` map:
//! version and map-layout digest) is what `sluice status` shows; the layout
//! comparison itself is made against the kernel's view of every pinned map
//! (type, key and value size, max entries, flags), so it holds whatever wrote
//! the stamp.

use std::{collections::BTreeMap, path::Path};

use aya::maps::{Array, MapData, MapInfo};
use sluice_common::{Stamp, STAMP_MAGIC, STAMP_VERSION_LEN};

/// One map's shape, as the kernel creates it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapLayout {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub flags: u32,
}

/// Every map's layout, by map name.
pub type Layout = BTreeMap<String, MapLayout>;

/// The layout of the maps an eBPF object defines.
pub fn of_object(object: &[u8]) -> Result<Layout, aya_obj::ParseError> {
    let obj = aya_obj::Object::parse(object)?;
    Ok(obj
        .maps
        .iter()
        // Global data sections (`.rodata`: the feature flags) belong to the
        // programs, loaded with them each time, never pinned or migrated.
        .filter(|(name, _)| !name.starts_with('.'))
        .map(|(name, m)| {
            (
                name.clone(),
                MapLayout {
                    map_type: m.map_type(),
                    key_size: m.key_size(),
                    value_size: m.value_size(),
                    max_entries: m.max_entries(),
                    flags: m.map_flags(),
                },
            )
        })
        .collect())
}

/// The layout of the maps pinned in `dir` among `names` (a name with no pin
/// is left out).
pub fn of_pinned<'a>(
    dir: &Path,
    names: impl IntoIterator<Item = &'a String>,
) -> Result<Layout, aya::maps::MapError> {
    let mut out = Layout::new();
    for name in names {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        let info = MapInfo::from_pin(&path)?;
        out.insert(
            name.clone(),
            MapLayout {
                map_type: info.map_type()? as u32,
                key_size: info.key_size(),
                value_size: info.value_size(),
                max_entries: info.max_entries(),
                flags: info.map_flags(),
            },
        );
    }
    Ok(out)
}

/// A map whose pinned layout is not this build's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub map: String,
    pub pinned: MapLayout,
    pub ours: MapLayout,
}

impl Change {
    /// Entries can be copied byte for byte (only the size or flags differ).
    pub fn copyable(&self) -> bool {
        self.pinned.map_type == self.ours.map_type
            && self.pinned.key_size == self.ours.key_size
            && self.pinned.value_size == self.ours.value_size
    }
}

impl std::fmt::Display for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (p, o) = (self.pinned, self.ours);
        write!(f, "{}:", self.map)?;
        for (what, a, b) in [
            ("type", p.map_type, o.map_type),
            ("key size", p.key_size, o.key_size),
            ("value size", p.value_size, o.value_size),
            ("max entries", p.max_entries, o.max_entries),
            ("flags", p.flags, o.flags),
        ] {
            if a != b {
                write!(f, " {what} {a} → {b}")?;
            }
        }
        Ok(())
    }
}

/// The pinned maps whose layout differs from this build's.
pub fn changes(ours: &Layout, pinned: &Layout) -> Vec<Change> {
    ours.iter()
        .filter_map(|(name, o)| {
            let p = pinned.get(name)?;
            (p != o).then(|| Change {
                map: name.clone(),
                pinned: *p,
                ours: *o,
            })
        })
        .collect()
}

/// FNV-1a, 64 bits: a digest that is the same in every build (std's hasher
/// is not promised to be). Hand-rolled: eight lines, no dependency.
fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The layout's digest, as the stamp carries it.
pub fn digest(layout: &Layout) -> u64 {
    let text: String = layout
        .iter()
        .map(|(n, l)| {
            format!(
                "{n}:{}:{}:{}:{}:{};",
                l.map_type, l.key_size, l.value_size, l.max_entries, l.flags
            )
        })
        .collect();
    fnv1a(text.into_bytes())
}

/// This build's version: the crate version and a digest of its eBPF object
/// (two builds of one version with other programs differ).
pub fn version_of(object: &[u8]) -> String {
    format!(
        "{}+obj.{:08x}",
        env!("CARGO_PKG_VERSION"),
        fnv1a(object.iter().copied()) as u32
    )
}

/// What a stamp says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stamped {
    pub version: String,
    pub layout: u64,
}

impl std::fmt::Display for Stamped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "sluice {}, map layout {:016x}",
            self.version, self.layout
        )
    }
}

fn open(maps_dir: &Path) -> Option<Array<MapData, Stamp>> {
    let data = MapData::from_pin(maps_dir.join("stamp")).ok()?;
    Array::try_from(aya::maps::Map::Array(data)).ok()
}

/// The stamp pinned under `maps_dir`; `None` when there is none (nothing
/// loaded, or a build from before stamps).
pub fn read(maps_dir: &Path) -> Option<Stamped> {
    let s = open(maps_dir)?.get(&0, 0).ok()?;
    (s.magic == STAMP_MAGIC).then(|| Stamped {
        version: String::from_utf8_lossy(&s.version)
            .trim_end_matches('\0')
            .to_owned(),
        layout: s.layout,
    })
}

/// Writes the stamp for `object` (after it was loaded, upgraded in place or
/// migrated).
pub fn write(maps_dir: &Path, object: &[u8], layout: &Layout) -> std::io::Result<()> {
    let mut arr = open(maps_dir)
        .ok_or_else(|| std::io::Error::other("the pinned stamp map cannot be opened"))?;
    let v = version_of(object);
    let mut version = [0u8; STAMP_VERSION_LEN];
    let n = v.len().min(STAMP_VERSION_LEN);
    version[..n].copy_from_slice(&v.as_bytes()[..n]);
    let s = Stamp {
        magic: STAMP_MAGIC,
        layout: digest(layout),
        version,
    };
    arr.set(0, s, 0).map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(max: u32) -> MapLayout {
        MapLayout {
            map_type: 1,
            key_size: 8,
            value_size: 24,
            max_entries: max,
            flags: 0,
        }
    }

    #[test]
    fn only_maps_pinned_with_another_shape_are_changes() {
        let ours = Layout::from([
            ("a".into(), l(8192)),
            ("b".into(), l(1)),
            ("new".into(), l(1)),
        ]);
        let pinned = Layout::from([("a".into(), l(4096)), ("b".into(), l(1))]);
        let c = changes(&ours, &pinned);
        assert_eq!(c.len(), 1);
        assert!(c[0].copyable());
        assert_eq!(c[0].to_string(), "a: max entries 4096 → 8192");
        let mut wider = l(4096);
        wider.value_size = 32;
        let c = changes(&Layout::from([("a".into(), wider)]), &pinned);
        assert!(!c[0].copyable());
        assert_ne!(digest(&ours), digest(&pinned));
        assert_eq!(digest(&pinned), digest(&pinned.clone()));
    }
}

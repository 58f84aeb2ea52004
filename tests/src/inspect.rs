//! Reading state from outside, as an operator would: the programs pinned
//! under a bpf root (id and tag), and a process's `/proc/<pid>/status`.

use std::collections::BTreeMap;

use anyhow::Context as _;
use aya::programs::{SchedClassifier, SkLookup};
use sluice::loader::{Pins, PROG_STEER};

/// Kernel program id and tag of each program pinned under `pins`, by pin
/// name.
pub fn pinned_programs(pins: &Pins) -> anyhow::Result<BTreeMap<String, (u32, u64)>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(pins.progs())? {
        let path = e?.path();
        let name = path
            .file_name()
            .context("a pin without a name")?
            .to_string_lossy()
            .into_owned();
        let info = if name == PROG_STEER {
            SkLookup::from_pin(&path)?.info()?
        } else {
            SchedClassifier::from_pin(&path)?.info()?
        };
        out.insert(name, (info.id(), info.tag()));
    }
    Ok(out)
}

/// A KiB figure of `/proc/<pid>/status` (`field` with its colon, e.g. `VmRSS:`).
pub fn proc_status_kib(pid: u32, field: &str) -> anyhow::Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

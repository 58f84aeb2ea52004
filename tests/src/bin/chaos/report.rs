//! What a run tells: faults by kind, connections by outcome and owner,
//! checks run, violations and leaks (both must be empty), and the agent's
//! memory. Printed and written as JSON beside the bench results.

use std::{collections::BTreeMap, path::Path};

use serde::Serialize;
use sluice_tests::ns;

use crate::{
    check::Resources,
    ledger::{Tally, Violation},
    node::Node,
};

#[derive(Debug, Serialize)]
pub struct Report {
    pub seed: u64,
    /// Pods' TCP took the local route (`--local-route`).
    pub local_route: bool,
    pub duration_s: u64,
    pub replayed: bool,
    pub faults: BTreeMap<&'static str, u64>,
    pub connections: BTreeMap<&'static str, Tally>,
    pub invariant_checks: BTreeMap<&'static str, u64>,
    pub violations: Vec<Violation>,
    pub leaks: Vec<String>,
    /// App connections that left uncaptured while a tamper fault had
    /// removed the capture (owned by it; repaired within the bound).
    pub tamper_bypasses: u64,
    /// DNS queries that went to their resolver, each counted by the
    /// programs as passed through (no DNS socket of ztunnel's in the pod's
    /// map: row D4, by design).
    pub dns_passthrough: u64,
    pub agent: Resources,
    /// The self-test: how long after its injection the bypass was caught.
    pub bypass_caught_after_ms: Option<u64>,
    /// Where the schedule up to a violation was written (`--replay` it).
    pub schedule_file: Option<String>,
    /// A fault the runner itself could not make, which ended the run (the
    /// run fails; its figures cover it up to there).
    pub runner_error: Option<String>,
}

impl Report {
    pub fn write(&self, dir: &Path) -> anyhow::Result<std::path::PathBuf> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("chaos.json");
        std::fs::write(&path, serde_json::to_string_pretty(self)? + "\n")?;
        Ok(path)
    }
}

/// What the node still holds of sluice after every pod was deleted and
/// sluice uninstalled: pins, qdiscs or filters on the node's interfaces,
/// routes to pod addresses, pod netns, processes.
pub fn leaks(node: &Node, pod_netns_prefix: &str) -> Vec<String> {
    let mut leaks = Vec::new();
    if let Ok(entries) = walk(node.pins.root()) {
        leaks.extend(entries.into_iter().map(|p| format!("pin {p}")));
    }
    match ns::output(&node.node_ns, &["tc", "qdisc", "show"]) {
        Ok(q) => leaks.extend(
            q.lines()
                .filter(|l| l.contains("clsact") || l.contains("ingress"))
                .map(|l| format!("qdisc in the node netns: {l}")),
        ),
        Err(e) => leaks.push(format!("cannot read the node's qdiscs: {e}")),
    }
    for family in ["-4", "-6"] {
        if let Ok(r) = ns::output(&node.node_ns, &["ip", family, "route", "show"]) {
            leaks.extend(
                r.lines()
                    .filter(|l| l.starts_with("10.251.") || l.starts_with("fd00:251::"))
                    .map(|l| format!("route in the node netns: {l}")),
            );
        }
    }
    if let Ok(list) = std::fs::read_dir("/run/netns") {
        leaks.extend(
            list.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(pod_netns_prefix))
                .map(|n| format!("pod netns {n}")),
        );
    }
    let root = node.pins.root().display().to_string();
    for pid in processes_naming(&root) {
        leaks.push(format!("process {pid} still runs on {root}"));
    }
    leaks
}

/// Every file under `dir` (none when it is gone).
fn walk(dir: &Path) -> std::io::Result<Vec<String>> {
    let mut out = Vec::new();
    if !dir.exists() {
        return Ok(out);
    }
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            out.extend(walk(&p)?);
        } else {
            out.push(p.display().to_string());
        }
    }
    Ok(out)
}

/// Processes whose command line names `text`.
fn processes_naming(text: &str) -> Vec<u32> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != std::process::id())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(text))
        })
        .collect()
}

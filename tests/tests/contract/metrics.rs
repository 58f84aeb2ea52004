//! The metrics an operator reads are the ones the agent exports: every
//! metric family a running agent serves on /metrics is documented in the
//! README's metric tables and every documented one is served, and every
//! metric the Grafana dashboard (deploy/grafana) queries exists. A CNI
//! request through the agent shows in the CNI counters and latency
//! histogram.

use std::collections::BTreeSet;

use anyhow::ensure;
use libtest_mimic::Trial;
use sluice::{
    cni::spec::PodRef,
    control::{self, Request, Response},
};
use sluice_tests::{
    agent::{free_port, http_get, AgentProc},
    harness::Fixture,
    wait,
};

use crate::{trial, TestResult};

pub fn trials() -> Vec<Trial> {
    vec![trial(
        "metrics::exported_names_match_the_readme_and_the_dashboard",
        names_match,
    )]
}

/// `sluice_…` names in `text`, with the suffixes a sample or a query adds
/// to a family's name (`_total`, `_bucket`, `_sum`, `_count`) taken off.
fn families(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find("sluice_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let base = ["_total", "_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        out.insert(base.to_owned());
        rest = &tail[end..];
    }
    out
}

fn names_match() -> TestResult {
    let f = Fixture::new("met", None)?;
    let port = free_port()?;
    let addr = format!("127.0.0.1:{port}");
    let agent = AgentProc::start_with(&f.topo.pins, &["--metrics-addr", &addr])?;
    // A CNI CHECK for a pod the agent does not hold: answered, and counted.
    let check = Request::CniCheck {
        pod: PodRef {
            name: "web".into(),
            namespace: "shop".into(),
            uid: None,
        },
    };
    let answer = control::call(&agent.control, Some(f.topo.pins.root()), &check)?;
    ensure!(
        matches!(answer, Some(r) if !matches!(r, Response::Node(_))),
        "no answer to CHECK"
    );
    // The node condition's families appear with the readiness loop's first pass.
    let body = wait::until(
        "the first readiness pass in /metrics",
        wait::DEADLINE,
        || match http_get(port, "/metrics") {
            Ok((200, b)) if b.contains("sluice_node_condition_reason{") => Ok(b),
            other => Err(format!("{other:?}")),
        },
    )?;
    // The families: every `# TYPE` line (empty families included).
    let exported: BTreeSet<String> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect();
    ensure!(
        exported.len() >= 25,
        "only {} families: {body}",
        exported.len()
    );
    ensure!(
        body.lines()
            .any(|l| l.starts_with("sluice_cni_requests_total{") && l.contains("command=\"CHECK\"")),
        "the CHECK is not counted:\n{body}"
    );
    ensure!(
        body.lines()
            .any(|l| l.starts_with("sluice_build_info{") && l.contains("version=")),
        "no build info:\n{body}"
    );
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))?;
    let documented: BTreeSet<String> = readme
        .lines()
        .filter(|l| {
            // A metric table row: name, then its type.
            let cols: Vec<&str> = l.split('|').map(str::trim).collect();
            cols.len() > 3
                && cols[1].starts_with("`sluice_")
                && ["counter", "gauge", "histogram"].contains(&cols[2])
        })
        .flat_map(families)
        .collect();
    let undocumented: Vec<_> = exported.difference(&documented).collect();
    let missing: Vec<_> = documented.difference(&exported).collect();
    ensure!(
        undocumented.is_empty() && missing.is_empty(),
        "exported but not in README's metric tables: {undocumented:?}; in README but not exported: {missing:?}"
    );
    let dashboard = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/grafana/sluice-dashboard.json"
    ))?;
    let _: serde_json::Value = serde_json::from_str(&dashboard)?;
    let queried = families(&dashboard);
    let unknown: Vec<_> = queried.difference(&exported).collect();
    ensure!(
        unknown.is_empty(),
        "the dashboard queries metrics the agent does not export: {unknown:?}"
    );
    ensure!(queried.len() >= 20, "the dashboard shows only {queried:?}");
    Ok(())
}

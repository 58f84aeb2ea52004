//! The metrics an operator reads are the ones the agent exports: every
//! metric family a running agent serves on /metrics is documented in the
//! metric tables of docs/OPERATIONS.md and every documented one is served,
//! and every metric the Grafana dashboard (deploy/grafana) queries exists. A CNI
//! request through the agent shows in the CNI counters and latency
//! histogram.

use std::collections::BTreeSet;

use anyhow::ensure;
use libtest_mimic::Trial;
use sluice::{
    cni::spec::PodRef,
    control::{self, NodeAnswer, Request, Response},
};
use sluice_tests::{
    agent::{free_port, http_get, AgentProc},
    harness::Fixture,
    wait,
};

use crate::{trial, TestResult};

pub fn trials() -> Vec<Trial> {
    vec![
        trial(
            "metrics::exported_names_match_the_readme_and_the_dashboard",
            names_match,
        ),
        trial(
            "metrics::a_flood_on_the_scrape_port_leaves_the_probes_and_other_scrapers_alone",
            flood,
        ),
    ]
}

/// GET `path` from `from` (a loopback address) to 127.0.0.1:`port`.
fn get_from(from: std::net::Ipv4Addr, port: u16, path: &str) -> anyhow::Result<u16> {
    use std::io::{Read as _, Write as _};
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    s.bind(&std::net::SocketAddr::from((from, 0)).into())?;
    s.connect(&std::net::SocketAddr::from(([127, 0, 0, 1], port)).into())?;
    let mut s: std::net::TcpStream = s.into();
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    Ok(resp
        .split_whitespace()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("no status line: {resp:?}"))?
        .parse()?)
}

/// A pod of the node floods the scrape port (the node IP: here 127.0.0.1)
/// with connections that never send a request. The agent keeps at most
/// PER_PEER of them and closes the rest; meanwhile the health listener the
/// kubelet and the watchdog use answers, and another scraper is served.
fn flood() -> TestResult {
    const FLOOD: usize = 40;
    let f = Fixture::new("flood", None)?;
    let (scrape, health) = (free_port()?, free_port()?);
    let agent = AgentProc::start_with(
        &f.topo.pins,
        &[
            "--metrics-addr",
            &format!("127.0.0.1:{scrape}"),
            "--health-addr",
            &format!("127.0.0.1:{health}"),
        ],
    )?;
    let held: Vec<std::net::TcpStream> = (0..FLOOD)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", scrape)))
        .collect::<Result<_, _>>()?;
    for s in &held {
        s.set_nonblocking(true)?;
    }
    // The agent closes what is over the peer's share: those reads see EOF.
    let closed = wait::until(
        "the agent to close the flood's extra connections",
        wait::DEADLINE,
        || {
            let closed = held
                .iter()
                .filter(|s| {
                    let mut s: &std::net::TcpStream = s;
                    matches!(std::io::Read::read(&mut s, &mut [0u8; 1]), Ok(0))
                })
                .count();
            if closed >= FLOOD - sluice::agent::admin::PER_PEER {
                Ok(closed)
            } else {
                Err(closed)
            }
        },
    )?;
    println!("{closed} of {FLOOD} flood connections closed by the agent");
    // While the flood holds its share: the probes' listener answers (the
    // watchdog's own probe too), and another peer's scrape is served.
    ensure!(http_get(health, "/healthz")?.0 == 200, "healthz");
    let rt = tokio::runtime::Runtime::new()?;
    let probe = rt.block_on(sluice::watchdog::probe(
        ([127, 0, 0, 1], health).into(),
        std::time::Duration::from_secs(2),
    ));
    ensure!(
        matches!(probe, sluice::watchdog::Probe::Answered(_)),
        "the watchdog's probe: {probe:?}\n{}",
        agent.log()
    );
    let code = get_from(std::net::Ipv4Addr::new(127, 0, 0, 2), scrape, "/metrics")?;
    ensure!(code == 200, "a second scraper got {code}");
    drop(held);
    Ok(())
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
    let check = Request::CniCheck(control::CniCheck {
        pod: PodRef {
            name: "web".into(),
            namespace: "shop".into(),
            uid: None,
        },
    });
    let answer = control::call(&agent.control, Some(f.topo.pins.root()), &check)?;
    ensure!(
        matches!(answer, Some(r) if !matches!(r, Response::More(NodeAnswer::Node(_)))),
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
    let docs = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/OPERATIONS.md"
    ))?;
    let documented: BTreeSet<String> = docs
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
    // Every reason the programs count drops for is exported (zero or not)
    // and named in the docs' row for it.
    let drops_row = docs
        .lines()
        .find(|l| l.starts_with("| `sluice_dropped_packets_total{reason}`"))
        .ok_or_else(|| {
            anyhow::anyhow!("no docs/OPERATIONS.md row for sluice_dropped_packets_total")
        })?;
    for reason in sluice_common::DropReason::ALL.map(|r| r.as_str()) {
        ensure!(
            body.lines().any(|l| l.starts_with(&format!(
                "sluice_dropped_packets_total{{reason=\"{reason}\"}}"
            ))),
            "drop reason {reason} not exported:\n{body}"
        );
        ensure!(
            drops_row.contains(&format!("`{reason}`")),
            "drop reason {reason} not in docs/OPERATIONS.md's row: {drops_row}"
        );
    }
    let undocumented: Vec<_> = exported.difference(&documented).collect();
    let missing: Vec<_> = documented.difference(&exported).collect();
    ensure!(
        undocumented.is_empty() && missing.is_empty(),
        "exported but not in docs/OPERATIONS.md's metric tables: {undocumented:?}; documented there but not exported: {missing:?}"
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

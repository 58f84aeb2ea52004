//! The differential test: Istio's real in-pod rules (iptables-restore of the
//! reference file plus the policy route) in one topology, sluice in a twin,
//! the same connection matrix against both, compared row by row. Rows where
//! sluice is deliberately stricter are named as such.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use anyhow::ensure;
use libtest_mimic::Trial;
use sluice_common::{PodState, Role, MARK_ZTUNNEL};
use sluice_tests::{
    flow::{connect, udp, Held, Opts, Reached},
    harness::{Fixture, APP_PORT, REMOTE_PORT, UDP_PORT},
    istio,
    routed::Behind,
    standin::Bind,
    topology::Family,
};

use crate::{trial, TestResult};

pub fn trials() -> Vec<Trial> {
    let mut v = Vec::new();
    for fam in [Family::V4, Family::V6] {
        v.push(trial(
            format!("differential::{}::istio_rules_vs_sluice", fam.name()),
            move || differential(fam),
        ));
        v.push(trial(
            format!(
                "differential::{}::host_probes_istio_rules_vs_sluice",
                fam.name()
            ),
            move || host_probes(fam),
        ));
    }
    v
}

/// What one connection attempt came to, in terms both twins share.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Outcome {
    /// The ztunnel listener that accepted it, and the original destination it saw.
    captured: Option<(Role, SocketAddr)>,
    /// How it ended for the client.
    end: End,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum End {
    /// A service answered; `peer` is the address that service saw.
    Service {
        port: u16,
        peer: IpAddr,
    },
    Hbone,
    Udp {
        peer: IpAddr,
    },
    Refused,
    TimedOut,
    Error(String),
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some((role, dst)) = &self.captured {
            write!(f, "{}@{dst} → ", role.as_str())?;
        }
        match &self.end {
            End::Service { port, peer } => write!(f, ":{port} saw {peer}"),
            End::Hbone => write!(f, "hbone"),
            End::Udp { peer } => write!(f, "udp saw {peer}"),
            End::Refused => write!(f, "refused"),
            End::TimedOut => write!(f, "dropped (timeout)"),
            End::Error(e) => write!(f, "error: {e}"),
        }
    }
}

fn end_of(r: &Reached) -> End {
    match r {
        Reached::Reply(line) if line.starts_with("hbone") => End::Hbone,
        Reached::Reply(line) => parse_service(line).unwrap_or_else(|| End::Error(line.clone())),
        Reached::Refused => End::Refused,
        Reached::TimedOut => End::TimedOut,
        Reached::Error(e) => End::Error(e.clone()),
    }
}

/// "app:8080 peer=10.200.0.1:5555 local=…" → Service { 8080, 10.200.0.1 }
fn parse_service(line: &str) -> Option<End> {
    let mut it = line.split_whitespace();
    let port = it.next()?.strip_prefix("app:")?.parse().ok()?;
    let peer: SocketAddr = it.next()?.strip_prefix("peer=")?.parse().ok()?;
    Some(End::Service {
        port,
        peer: peer.ip(),
    })
}

/// The connection matrix: (row, flow) pairs; each flow runs against a fixture.
type Flow = Box<dyn Fn(&Fixture) -> Reached>;

fn matrix(fam: Family) -> Vec<(&'static str, Flow)> {
    let app = SocketAddr::new(fam.pod(), APP_PORT);
    let remote = SocketAddr::new(fam.client(), REMOTE_PORT);
    vec![
        (
            "I1 remote → pod:P",
            Box::new(move |f: &Fixture| connect(&f.topo.client, app, Opts::default())),
        ),
        (
            "I2 remote → pod:15008",
            Box::new(move |f: &Fixture| {
                connect(
                    &f.topo.client,
                    SocketAddr::new(fam.pod(), 15008),
                    Opts::default(),
                )
            }),
        ),
        (
            "I3 probe source → pod:P",
            Box::new(move |f: &Fixture| {
                connect(
                    &f.topo.client,
                    app,
                    Opts {
                        bind: Some(fam.probe()),
                        ..Opts::default()
                    },
                )
            }),
        ),
        (
            "I4 ztunnel (mark, spoofed src) → app",
            Box::new(move |f: &Fixture| {
                let o = Opts {
                    mark: Some(MARK_ZTUNNEL),
                    bind: Some(fam.client()),
                    transparent: true,
                    ..Opts::default()
                };
                connect(&f.topo.pod, app, o)
            }),
        ),
        (
            "O1 app → remote:P",
            Box::new(move |f: &Fixture| connect(&f.topo.pod, remote, Opts::default())),
        ),
        (
            "O2 app → loopback:P",
            Box::new(move |f: &Fixture| {
                connect(
                    &f.topo.pod,
                    SocketAddr::new(fam.loopback(), APP_PORT),
                    Opts::default(),
                )
            }),
        ),
        (
            "O2 app → own pod IP:P",
            Box::new(move |f: &Fixture| connect(&f.topo.pod, app, Opts::default())),
        ),
        (
            "O3 app → probe address",
            Box::new(move |f: &Fixture| {
                connect(
                    &f.topo.pod,
                    SocketAddr::new(fam.probe(), REMOTE_PORT),
                    Opts::default(),
                )
            }),
        ),
        (
            "O4 mark 0x539 → remote",
            Box::new(move |f: &Fixture| {
                connect(
                    &f.topo.pod,
                    remote,
                    Opts {
                        mark: Some(MARK_ZTUNNEL),
                        ..Opts::default()
                    },
                )
            }),
        ),
    ]
}

/// Rows where sluice differs on purpose, with the reason.
const DELIBERATE: &[(&str, &str)] = &[
    (
        "F1 app → remote:P, ztunnel gone",
        "stricter: sluice drops the SYN (the client retries and succeeds once ztunnel is back) where Istio's REDIRECT to a missing 15001 refuses it",
    ),
    (
        "I5 inbound conn. from before capture",
        "contract row I5: sluice keeps it; with Istio's rules applied mid-connection it stalls (conntrack meets the flow mid-stream)",
    ),
    (
        "I5 outbound conn. from before capture",
        "contract row I5: sluice keeps it; with Istio's rules applied mid-connection it is reset (conntrack meets the flow mid-stream as new, nat redirects it)",
    ),
];

fn observe(f: &Fixture, flow: &Flow) -> Outcome {
    f.standin().clear();
    let end = end_of(&flow(f));
    let acc = f.standin().accepted();
    Outcome {
        captured: acc.first().map(|a| (a.role, a.orig_dst)),
        end,
    }
}

fn udp_outcome(f: &Fixture, ns: &str, dst: SocketAddr) -> Outcome {
    let end = match udp(ns, dst) {
        Some(line) => line
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.strip_prefix("peer="))
            .and_then(|p| p.parse::<SocketAddr>().ok())
            .map(|p| End::Udp { peer: p.ip() })
            .unwrap_or(End::Error(line)),
        None => End::TimedOut,
    };
    let _ = f;
    Outcome {
        captured: None,
        end,
    }
}

fn differential(fam: Family) -> TestResult {
    let sluice = Fixture::new("dfs", Some(Bind::DualStack))?;
    let mut istio_twin = Fixture::new("dfi", Some(Bind::DualStack))?;
    // I5: connections from before capture, in both directions, in both twins.
    let app = SocketAddr::new(fam.pod(), APP_PORT);
    let remote = SocketAddr::new(fam.client(), REMOTE_PORT);
    let mut held = Vec::new();
    for f in [&istio_twin, &sluice] {
        held.push((
            Held::open(&f.topo.client, app)?,
            Held::open(&f.topo.pod, remote)?,
        ));
    }
    ensure!(sluice.enroll()?.state == PodState::Enabled);
    istio::apply(&istio_twin.topo.pod)?;

    let mut rows: Vec<(String, Outcome, Outcome)> = Vec::new();
    let pre = |h: &mut Held, f: &Fixture| {
        f.standin().clear();
        let end = end_of(&h.exchange());
        let captured = f.standin().accepted().first().map(|a| (a.role, a.orig_dst));
        Outcome { captured, end }
    };
    let [(mut ii, mut io), (mut si, mut so)]: [(Held, Held); 2] =
        held.try_into().map_err(|_| anyhow::anyhow!("two twins"))?;
    rows.push((
        "I5 inbound conn. from before capture".into(),
        pre(&mut ii, &istio_twin),
        pre(&mut si, &sluice),
    ));
    rows.push((
        "I5 outbound conn. from before capture".into(),
        pre(&mut io, &istio_twin),
        pre(&mut so, &sluice),
    ));
    for (name, flow) in matrix(fam) {
        rows.push((
            name.to_owned(),
            observe(&istio_twin, &flow),
            observe(&sluice, &flow),
        ));
    }
    rows.push((
        "O5 UDP app → remote".into(),
        udp_outcome(
            &istio_twin,
            &istio_twin.topo.pod,
            SocketAddr::new(fam.client(), UDP_PORT),
        ),
        udp_outcome(
            &sluice,
            &sluice.topo.pod,
            SocketAddr::new(fam.client(), UDP_PORT),
        ),
    ));
    rows.push((
        "O5 UDP remote → pod".into(),
        udp_outcome(
            &istio_twin,
            &istio_twin.topo.client,
            SocketAddr::new(fam.pod(), UDP_PORT),
        ),
        udp_outcome(
            &sluice,
            &sluice.topo.client,
            SocketAddr::new(fam.pod(), UDP_PORT),
        ),
    ));

    // F1: ztunnel gone (its listeners closed) in both twins.
    let mut sluice = sluice;
    sluice.standin = None;
    istio_twin.standin = None;
    // Closing the listeners takes them out of the socket map at once.
    sluice.wait_no_listeners()?;
    let short = Opts {
        timeout: Some(Duration::from_millis(1500)),
        ..Opts::default()
    };
    let f1_in = |f: &Fixture| Outcome {
        captured: None,
        end: end_of(&connect(&f.topo.client, app, short.clone())),
    };
    rows.push((
        "F1 remote → pod:P, ztunnel gone".into(),
        f1_in(&istio_twin),
        f1_in(&sluice),
    ));
    let f1_out = |f: &Fixture| Outcome {
        captured: None,
        end: end_of(&connect(&f.topo.pod, remote, short.clone())),
    };
    rows.push((DELIBERATE[0].0.into(), f1_out(&istio_twin), f1_out(&sluice)));

    println!("\n{} differential: Istio's rules vs sluice", fam.name());
    println!("| row | Istio rules | sluice | verdict |\n|---|---|---|---|");
    let mut mismatches = Vec::new();
    for (name, i, s) in &rows {
        let deliberate = DELIBERATE.iter().find(|(n, _)| n == name);
        let verdict = match (i == s, deliberate) {
            (true, _) => "same".to_string(),
            (false, Some((_, why))) => why.to_string(),
            (false, None) => {
                mismatches.push(name.clone());
                "MISMATCH".to_string()
            }
        };
        println!("| {name} | {i} | {s} | {verdict} |");
    }
    ensure!(
        mismatches.is_empty(),
        "rows differ from Istio's rules: {mismatches:?}"
    );
    // I5 for sluice: the old connections still reach their service, uncaptured.
    for (name, _, s) in rows.iter().filter(|r| r.0.starts_with("I5")) {
        ensure!(
            s.captured.is_none() && matches!(s.end, End::Service { .. }),
            "{name}: sluice must keep the connection, uncaptured; got {s}"
        );
    }
    // Fail closed means: dropped, in both directions — never reaching a service.
    for (name, _, s) in rows.iter().filter(|r| r.0.starts_with("F1")) {
        ensure!(
            s.end == End::TimedOut,
            "{name}: sluice must drop the SYN, got {s}"
        );
    }
    Ok(())
}

/// Kubelet's probes: Istio's host rule (SNAT of local sockets' TCP to a pod,
/// to 169.254.7.127) plus its in-pod rules in one twin, sluice with the
/// host-side program in the other; the client netns plays the node and a
/// netns behind it stands for forwarded (masqueraded) traffic.
fn host_probes(fam: Family) -> TestResult {
    let sluice = Fixture::new("dhs", Some(Bind::DualStack))?;
    let istio_twin = Fixture::new("dhi", Some(Bind::DualStack))?;
    let pod = |f: &Fixture, fam: Family| f.topo.pod_ip(fam);
    let (IpAddr::V4(v4), IpAddr::V6(v6)) =
        (pod(&istio_twin, Family::V4), pod(&istio_twin, Family::V6))
    else {
        anyhow::bail!("pod addresses of the wrong family");
    };
    // Before the masquerade rule of `Behind`, which the SNAT chain precedes.
    istio::apply_host_probe_snat(&istio_twin.topo.client, v4, v6)?;
    istio::apply(&istio_twin.topo.pod)?;
    ensure!(sluice.enroll_with_node()?.state == PodState::Enabled);
    let behind = [Behind::new(&istio_twin.topo)?, Behind::new(&sluice.topo)?];

    let app = SocketAddr::new(fam.pod(), APP_PORT);
    let node_socket = |f: &Fixture| {
        observe(
            f,
            &(Box::new(move |f: &Fixture| connect(&f.topo.client, app, Opts::default())) as Flow),
        )
    };
    let (i, s) = (node_socket(&istio_twin), node_socket(&sluice));
    println!("\n{} host probes: Istio's rules vs sluice", fam.name());
    println!("| row | Istio rules | sluice |\n|---|---|---|");
    println!("| I3h node socket → pod:P | {i} | {s} |");
    // Neither captures; the app sees the probe address under Istio (its
    // SNAT), the node's own address under sluice (no NAT: as without a mesh).
    ensure!(
        i == Outcome {
            captured: None,
            end: End::Service {
                port: APP_PORT,
                peer: fam.probe()
            }
        },
        "Istio twin, node socket: {i}"
    );
    ensure!(
        s == Outcome {
            captured: None,
            end: End::Service {
                port: APP_PORT,
                peer: fam.client()
            }
        },
        "sluice, node socket: {s}"
    );
    let forwarded = |f: &Fixture, b: &Behind| {
        let ns = b.ns.clone();
        observe(
            f,
            &(Box::new(move |_: &Fixture| connect(&ns, app, Opts::default())) as Flow),
        )
    };
    let (i, s) = (
        forwarded(&istio_twin, &behind[0]),
        forwarded(&sluice, &behind[1]),
    );
    println!("| I3f forwarded, masqueraded → pod:P | {i} | {s} |");
    ensure!(i == s, "forwarded: Istio {i}, sluice {s}");
    ensure!(
        i.captured == Some((Role::Inbound, app)),
        "forwarded traffic must be captured: {i}"
    );
    Ok(())
}

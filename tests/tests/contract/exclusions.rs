//! Per-pod exclusions (rows E1, E2): the `traffic.sidecar.istio.io/*`
//! annotations sidecar mode honours, applied to an ambient pod. An
//! excluded connection goes where it is addressed, in either direction;
//! the rest is captured as before; HBONE always reaches ztunnel. Decided
//! at the SYN, in any pod state. The verification of such a pod passes.

use std::net::{IpAddr, SocketAddr};

use anyhow::ensure;
use ipnet::IpNet;
use libtest_mimic::Trial;
use sluice::{
    exclusions::{Include, PodExclusions},
    options::PodOptions,
};
use sluice_common::Role;
use sluice_tests::{
    app::App,
    flow::{connect, Opts},
    harness::{Fixture, APP_PORT, REMOTE_PORT},
    standin::Bind,
    topology::{ip, Family},
    wait,
};

use crate::{lifecycle::sluice, local_route_trial, options::outcome, trial, TestResult};

/// A second port of the remote server, and of the app.
const OTHER_PORT: u16 = 9091;

pub fn trials() -> Vec<Trial> {
    let mut v = Vec::new();
    for fam in [Family::V4, Family::V6] {
        v.push(trial(
            format!(
                "exclusions::{}::e1_outbound_ports_and_ranges_exclude_included_ports_and_ranges_capture_exclude_wins",
                fam.name()
            ),
            move || outbound(fam),
        ));
        // Excluded SYNs the local route sends over `lo` leave by the pod's
        // interface (`lo`'s egress program sends them out).
        v.push(local_route_trial(
            format!(
                "exclusions::local_route::{}::e1_outbound_ports_and_ranges_exclude_included_ports_and_ranges_capture_exclude_wins",
                fam.name()
            ),
            move || outbound(fam),
        ));
        v.push(trial(
            format!(
                "exclusions::{}::e2_inbound_ports_exclude_include_decides_alone_hbone_stays_captured",
                fam.name()
            ),
            move || inbound(fam),
        ));
    }
    v
}

/// Another address of the client netns, in the pod's subnet.
fn second_remote(f: &Fixture, fam: Family) -> anyhow::Result<IpAddr> {
    let s = f.topo.subnet;
    let (addr, len) = match fam {
        Family::V4 => (format!("10.200.{s}.9"), 24),
        Family::V6 => (format!("fd00:200:{s}::9"), 64),
    };
    let cidr = format!("{addr}/{len}");
    let mut args = vec!["-n", &f.topo.client, "addr", "add", &cidr, "dev", "veth-c"];
    if fam == Family::V6 {
        args.push("nodad");
    }
    ip(&args)?;
    Ok(addr.parse()?)
}

fn host(a: IpAddr) -> IpNet {
    IpNet::from(a)
}

/// Where a connection from `from` went: `Some(role)` when ztunnel's
/// stand-in took it, `None` when it reached its destination directly.
fn went(f: &Fixture, from: &str, to: SocketAddr) -> anyhow::Result<Option<Role>> {
    let (role, reply) = outcome(f, &connect(from, to, Opts::default()))?;
    if role.is_none() {
        ensure!(
            reply.starts_with(&format!("app:{}", to.port())),
            "to {to}: neither captured nor the destination's reply: {reply}"
        );
    }
    Ok(role)
}

/// Enrolls the pod with exclusions `x`; its verification, which picks
/// destinations `x` leaves captured (or checks that nothing is), passes.
fn enroll(f: &Fixture, x: PodExclusions) -> anyhow::Result<()> {
    let e = f.enroll_with(PodOptions {
        exclusions: x,
        ..PodOptions::default()
    })?;
    if let Err(failed) = crate::verify::run(f, e.cookie)? {
        anyhow::bail!("the verification failed: {failed}");
    }
    Ok(())
}

/// One case: the pod enrolled with `x`; each connection from netns `from`
/// to a destination goes where the case says (`None`: direct), and the
/// pod's counters count the excluded ones (`excluded`: inbound, outbound).
struct Case<'a> {
    x: PodExclusions,
    want: Vec<(SocketAddr, Option<Role>, &'a str)>,
    excluded: (u64, u64),
}

fn run(f: &Fixture, from: &str, cases: Vec<Case>) -> TestResult {
    for c in cases {
        enroll(f, c.x.clone())?;
        for (to, role, what) in &c.want {
            let got = went(f, from, *to)?;
            ensure!(got == *role, "{what} ({to}, {:?}): {got:?}", c.x);
        }
        let rec = f.pod_record()?;
        ensure!(rec.exclusions == c.x, "in force: {:?}", rec.exclusions);
        let counted = (rec.excluded.inbound, rec.excluded.outbound);
        ensure!(counted == c.excluded, "counted {counted:?}, {:?}", c.x);
        cli_says(f, &rec)?;
        f.unenroll()?;
    }
    Ok(())
}

/// What `sluice status` says of the pod's exclusions: `-o json` carries
/// the set in force and the counters, `--pod` lists them on its
/// `exclusions:` line.
fn cli_says(f: &Fixture, rec: &sluice::dataplane::state::PodRecord) -> TestResult {
    let out = sluice(f, &["status", "-o", "json"])?;
    ensure!(out.ok, "status -o json: {}", out.stderr);
    let json: serde_json::Value = serde_json::from_str(&out.stdout)?;
    let pod = json["pods"]
        .as_array()
        .and_then(|pods| pods.iter().find(|p| p["uid"] == rec.uid))
        .ok_or_else(|| anyhow::anyhow!("status -o json has no pod {}: {json}", rec.uid))?;
    ensure!(
        pod["exclusions"] == serde_json::to_value(&rec.exclusions)?
            && pod["excluded"]["outbound"] == rec.excluded.outbound
            && pod["excluded"]["inbound"] == rec.excluded.inbound,
        "status -o json: {pod}"
    );
    let out = sluice(f, &["status", "--pod", &rec.uid])?;
    let line = out
        .stdout
        .lines()
        .find(|l| l.trim_start().starts_with("exclusions:"))
        .unwrap_or_default();
    let counted = format!(
        "connections excluded: inbound {}, outbound {}",
        rec.excluded.inbound, rec.excluded.outbound
    );
    ensure!(
        line.contains("traffic.sidecar.istio.io/") && line.contains(&counted),
        "status --pod: {}",
        out.stdout
    );
    Ok(())
}

fn outbound(fam: Family) -> TestResult {
    const CAPTURED: Option<Role> = Some(Role::Outbound);
    let f = Fixture::new("exo", Some(Bind::DualStack))?;
    let _other = App::start(&f.topo.client, OTHER_PORT);
    let (first, second) = (fam.client(), second_remote(&f, fam)?);
    let (remote, other_port, second) = (
        SocketAddr::new(first, REMOTE_PORT),
        SocketAddr::new(first, OTHER_PORT),
        SocketAddr::new(second, REMOTE_PORT),
    );
    let subnet = IpNet::new(first, if fam == Family::V4 { 24 } else { 64 })?.trunc();
    let cases = vec![
        // A port and an address excluded: those go direct, the rest is
        // captured.
        Case {
            x: PodExclusions {
                exclude_outbound_ports: vec![OTHER_PORT],
                exclude_outbound_ip_ranges: vec![host(second.ip())],
                ..Default::default()
            },
            want: vec![
                (remote, CAPTURED, "not excluded"),
                (other_port, None, "excluded port"),
                (second, None, "excluded range"),
            ],
            excluded: (0, 2),
        },
        // An include list restricts capture to its ranges; an exclusion
        // inside one wins.
        Case {
            x: PodExclusions {
                include_outbound_ip_ranges: Include::Only(vec![subnet]),
                exclude_outbound_ip_ranges: vec![host(second.ip())],
                ..Default::default()
            },
            want: vec![
                (remote, CAPTURED, "included"),
                (second, None, "excluded wins over included"),
            ],
            excluded: (0, 1),
        },
        Case {
            x: PodExclusions {
                include_outbound_ip_ranges: Include::Only(vec![host(first)]),
                ..Default::default()
            },
            want: vec![
                (remote, CAPTURED, "included"),
                (second, None, "outside the include list"),
            ],
            excluded: (0, 1),
        },
        // An included port is captured wherever it goes, with no range
        // included (`includeOutboundIPRanges: ""`); an excluded range wins.
        Case {
            x: PodExclusions {
                include_outbound_ip_ranges: Include::Only(vec![]),
                include_outbound_ports: vec![REMOTE_PORT],
                exclude_outbound_ip_ranges: vec![host(second.ip())],
                ..Default::default()
            },
            want: vec![
                (remote, CAPTURED, "included port"),
                (other_port, None, "no range included"),
                (second, None, "excluded range wins over included port"),
            ],
            excluded: (0, 2),
        },
    ];
    run(&f, &f.topo.pod, cases)
}

fn inbound(fam: Family) -> TestResult {
    let f = Fixture::new("exi", Some(Bind::DualStack))?;
    let other = App::start(&f.topo.pod, OTHER_PORT);
    let to = |port| SocketAddr::new(fam.pod(), port);
    let (app, other_port, hbone) = (to(APP_PORT), to(OTHER_PORT), to(15008));
    const HBONE: Option<Role> = Some(Role::Hbone);
    let cases = vec![
        Case {
            x: PodExclusions {
                exclude_inbound_ports: vec![OTHER_PORT],
                ..Default::default()
            },
            want: vec![
                (app, Some(Role::Inbound), "not excluded"),
                (other_port, None, "excluded port"),
                (hbone, HBONE, "HBONE"),
            ],
            excluded: (1, 0),
        },
        // Only the included ports are captured, an excluded one among them
        // too: sidecar mode applies the exclusions only under `*`.
        Case {
            x: PodExclusions {
                include_inbound_ports: Include::Only(vec![APP_PORT]),
                exclude_inbound_ports: vec![APP_PORT],
                ..Default::default()
            },
            want: vec![
                (app, Some(Role::Inbound), "included, also excluded"),
                (other_port, None, "not included"),
            ],
            excluded: (1, 0),
        },
        Case {
            x: PodExclusions {
                include_inbound_ports: Include::Only(vec![]),
                ..Default::default()
            },
            want: vec![
                (app, None, "nothing included"),
                (hbone, HBONE, "HBONE is never excluded"),
            ],
            excluded: (1, 0),
        },
    ];
    run(&f, &f.topo.client, cases)?;
    ensure!(
        other.peers().iter().any(|p| p.ip() == fam.client()),
        "the app did not see the client"
    );
    ztunnel_ports_stay_captured(&f, fam)
}

/// ztunnel's own ports are captured whatever an include list leaves out:
/// let through, a client would reach ztunnel's outbound listener (15001)
/// as if it were the pod's app. Captured, the connection goes to ztunnel's
/// inbound listener first (what the stand-in then does with a connection
/// addressed to its own port does not matter here).
fn ztunnel_ports_stay_captured(f: &Fixture, fam: Family) -> TestResult {
    enroll(
        f,
        PodExclusions {
            include_inbound_ports: Include::Only(vec![]),
            ..Default::default()
        },
    )?;
    f.standin().clear();
    let to = SocketAddr::new(fam.pod(), 15001);
    let _ = connect(&f.topo.client, to, Opts::default());
    let first = wait::until("a listener took the connection", wait::DEADLINE, || {
        f.standin()
            .accepted()
            .first()
            .map(|a| a.role)
            .ok_or_else(|| "none yet".to_string())
    })?;
    f.standin().clear();
    ensure!(first == Role::Inbound, "to {to}: first taken by {first:?}");
    f.unenroll()
}

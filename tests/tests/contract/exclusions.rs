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
};

use crate::{options::outcome, trial, TestResult};

/// A second port of the remote server, and of the app.
const OTHER_PORT: u16 = 9091;

pub fn trials() -> Vec<Trial> {
    let mut v = Vec::new();
    for fam in [Family::V4, Family::V6] {
        v.push(trial(
            format!(
                "exclusions::{}::e1_outbound_ports_and_ranges_exclude_include_restricts_exclude_wins",
                fam.name()
            ),
            move || outbound(fam),
        ));
        v.push(trial(
            format!(
                "exclusions::{}::e2_inbound_ports_exclude_include_restricts_hbone_stays_captured",
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

fn outbound(fam: Family) -> TestResult {
    const CAPTURED: Option<Role> = Some(Role::Outbound);
    let f = Fixture::new("exo", Some(Bind::DualStack))?;
    let other = App::start(&f.topo.client, OTHER_PORT);
    let (first, second) = (fam.client(), second_remote(&f, fam)?);
    let to = |a: IpAddr, port| SocketAddr::new(a, port);
    let pod = f.topo.pod.clone();

    // A port and an address excluded: those go direct, the rest is captured.
    enroll(
        &f,
        PodExclusions {
            exclude_outbound_ports: vec![OTHER_PORT],
            exclude_outbound_ip_ranges: vec![host(second)],
            ..Default::default()
        },
    )?;
    ensure!(
        went(&f, &pod, to(first, REMOTE_PORT))? == CAPTURED,
        "not excluded: captured"
    );
    ensure!(
        went(&f, &pod, to(first, OTHER_PORT))?.is_none(),
        "excluded port"
    );
    ensure!(
        went(&f, &pod, to(second, REMOTE_PORT))?.is_none(),
        "excluded range"
    );
    let rec = f.pod_record()?;
    ensure!(
        rec.excluded.outbound == 2 && rec.excluded.inbound == 0,
        "{:?}",
        rec.excluded
    );
    ensure!(
        rec.exclusions.exclude_outbound_ports == [OTHER_PORT],
        "{:?}",
        rec.exclusions
    );
    f.unenroll()?;

    // An include list restricts capture to its ranges; an exclusion inside
    // one wins.
    let subnet = IpNet::new(first, if fam == Family::V4 { 24 } else { 64 })?.trunc();
    enroll(
        &f,
        PodExclusions {
            include_outbound_ip_ranges: Include::Only(vec![subnet]),
            exclude_outbound_ip_ranges: vec![host(second)],
            ..Default::default()
        },
    )?;
    ensure!(
        went(&f, &pod, to(first, REMOTE_PORT))? == CAPTURED,
        "included: captured"
    );
    ensure!(
        went(&f, &pod, to(second, REMOTE_PORT))?.is_none(),
        "excluded wins over included"
    );
    f.unenroll()?;
    enroll(
        &f,
        PodExclusions {
            include_outbound_ip_ranges: Include::Only(vec![host(first)]),
            ..Default::default()
        },
    )?;
    ensure!(
        went(&f, &pod, to(first, REMOTE_PORT))? == CAPTURED,
        "included: captured"
    );
    ensure!(
        went(&f, &pod, to(second, REMOTE_PORT))?.is_none(),
        "outside the include list"
    );
    drop(other);
    Ok(())
}

fn inbound(fam: Family) -> TestResult {
    let f = Fixture::new("exi", Some(Bind::DualStack))?;
    let other = App::start(&f.topo.pod, OTHER_PORT);
    let client = f.topo.client.clone();
    let to = |port| SocketAddr::new(fam.pod(), port);

    enroll(
        &f,
        PodExclusions {
            exclude_inbound_ports: vec![OTHER_PORT],
            ..Default::default()
        },
    )?;
    ensure!(
        went(&f, &client, to(APP_PORT))? == Some(Role::Inbound),
        "not excluded"
    );
    ensure!(
        went(&f, &client, to(OTHER_PORT))?.is_none(),
        "excluded port"
    );
    ensure!(went(&f, &client, to(15008))? == Some(Role::Hbone), "HBONE");
    ensure!(
        other.peers().iter().any(|p| p.ip() == fam.client()),
        "the app saw the client"
    );
    let rec = f.pod_record()?;
    ensure!(
        rec.excluded.inbound == 1 && rec.excluded.outbound == 0,
        "{:?}",
        rec.excluded
    );
    f.unenroll()?;

    // Only the included ports are captured; an excluded one among them is not.
    enroll(
        &f,
        PodExclusions {
            include_inbound_ports: Include::Only(vec![APP_PORT, OTHER_PORT]),
            exclude_inbound_ports: vec![OTHER_PORT],
            ..Default::default()
        },
    )?;
    ensure!(
        went(&f, &client, to(APP_PORT))? == Some(Role::Inbound),
        "included"
    );
    ensure!(
        went(&f, &client, to(OTHER_PORT))?.is_none(),
        "excluded wins"
    );
    f.unenroll()?;
    enroll(
        &f,
        PodExclusions {
            include_inbound_ports: Include::Only(vec![]),
            ..Default::default()
        },
    )?;
    ensure!(
        went(&f, &client, to(APP_PORT))?.is_none(),
        "nothing included"
    );
    ensure!(
        went(&f, &client, to(15008))? == Some(Role::Hbone),
        "HBONE is never excluded"
    );
    Ok(())
}

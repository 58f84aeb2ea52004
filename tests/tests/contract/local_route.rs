//! The local route (`--local-route`, issue 42) beyond the contract rows,
//! which run on it too (`contract::local_route::*`): what it is for (a
//! captured connection gets loopback's MSS), what a pod can do to it, and
//! where it is not offered.

use std::{
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::ensure;
use libtest_mimic::Trial;
use sluice::{exclusions::PodExclusions, options::PodOptions};
use sluice_common::{PodState, Role};
use sluice_tests::{
    harness::{
        as_if_kernel, is_root, local_route_available, on_local_route, without_netns_cookie_in_tc,
        Fixture, REMOTE_PORT,
    },
    ns::{exec, output, run_in},
    standin::Bind,
    topology::{has_local_route_rule, Family},
    wait,
};

use crate::{local_route_trial, trial, TestResult};

pub fn trials() -> Vec<Trial> {
    let mut v = Vec::new();
    for fam in [Family::V4, Family::V6] {
        v.push(local_route_trial(
            format!(
                "local_route::{}::a_captured_connection_gets_loopbacks_mss",
                fam.name()
            ),
            move || captured_mss(fam),
        ));
        v.push(local_route_trial(
            format!(
                "local_route::{}::a_pod_that_deletes_the_rule_is_still_captured_and_repair_restores_it",
                fam.name()
            ),
            move || rule_deleted(fam),
        ));
        v.push(local_route_trial(
            format!(
                "local_route::{}::an_excluded_port_takes_the_interfaces_route_until_the_exclusion_goes",
                fam.name()
            ),
            move || excluded(fam),
        ));
        // (No pod goes on the local route here: not a checked variant.)
        v.push(
            trial(
                format!(
                    "local_route::{}::a_pod_with_connections_open_at_enrollment_keeps_its_interfaces_route",
                    fam.name()
                ),
                move || on_local_route(|| open_before(fam)),
            )
            .with_ignored_flag(!is_root() || !local_route_available()),
        );
    }
    v.push(local_route_trial(
        "local_route::a_node_that_turns_it_off_takes_its_pods_off",
        turned_off,
    ));
    v.push(trial(
        "local_route::not_offered_where_tc_programs_cannot_read_the_netns",
        || as_if_kernel(without_netns_cookie_in_tc(), not_offered),
    ));
    v
}

fn enabled(tag: &str) -> anyhow::Result<Fixture> {
    let f = Fixture::new(tag, Some(Bind::DualStack))?;
    let e = f.enroll()?;
    ensure!(e.state == PodState::Enabled, "expected Enabled, got {e:?}");
    Ok(f)
}

/// Connects from the pod to the "remote" server's address; the client
/// socket's MSS.
fn connect_mss(f: &Fixture, dst: SocketAddr) -> anyhow::Result<u32> {
    run_in(&f.topo.pod, move || -> anyhow::Result<u32> {
        let s = TcpStream::connect_timeout(&dst, Duration::from_secs(2))?;
        Ok(socket2::SockRef::from(&s).mss()?)
    })
}

/// The one connection the stand-in took is an outbound one to `dst` (its
/// accept is recorded by the stand-in's thread: waited for).
fn captured_once(f: &Fixture, dst: SocketAddr) -> TestResult {
    wait::until("the stand-in's accept", wait::DEADLINE, || {
        match f.standin().accepted().len() {
            0 => Err("none yet"),
            _ => Ok(()),
        }
    })?;
    let acc = f.standin().accepted();
    ensure!(
        acc.len() == 1,
        "expected one accepted connection, got {acc:?}"
    );
    ensure!(
        acc[0].role == Role::Outbound,
        "accepted by {:?}",
        acc[0].role
    );
    ensure!(acc[0].local == dst, "15001 took it for {}", acc[0].local);
    Ok(())
}

fn captured_mss(fam: Family) -> TestResult {
    let f = enabled("lr-mss")?;
    let dst = SocketAddr::new(fam.client(), REMOTE_PORT);
    let mss = connect_mss(&f, dst)?;
    // The veth's MTU is 1500: 1,460 (IPv4) or 1,440 (IPv6) at most over it.
    ensure!(
        mss > 1500,
        "the captured connection's MSS is {mss}: not loopback's"
    );
    captured_once(&f, dst)?;
    ensure!(
        f.pod_record()?.local_route.is_some(),
        "status does not show the local route"
    );
    Ok(())
}

/// A pod with NET_ADMIN deletes the rule: its TCP takes the interface's
/// route again and is captured there, as without the local route; a
/// repair puts the rule back.
fn rule_deleted(fam: Family) -> TestResult {
    let f = enabled("lr-del")?;
    let family = if fam == Family::V6 { "-6" } else { "-4" };
    exec(&f.topo.pod, &["ip", family, "rule", "del", "pref", "32763"])?;
    ensure!(!has_local_route_rule(&f.topo.pod, fam == Family::V6)?);
    let dst = SocketAddr::new(fam.client(), REMOTE_PORT);
    let mss = connect_mss(&f, dst)?;
    ensure!(mss <= 1460, "MSS {mss}: still over lo without the rule?");
    captured_once(&f, dst)?;
    let mut dp = f.dataplane()?;
    let cookie = f.pod_record()?.netns_cookie;
    sluice::podnet::enroll::repair(&mut dp, cookie, false)?;
    ensure!(
        has_local_route_rule(&f.topo.pod, fam == Family::V6)?,
        "the repair did not restore the rule"
    );
    Ok(())
}

/// A pod that excludes the remote server's port: its connection there has
/// a rule of its own to the main table (the interface's route and MSS, not
/// captured); once the exclusion goes, so does the rule, and the next
/// connection is captured over `lo`.
fn excluded(fam: Family) -> TestResult {
    let f = Fixture::new("lr-exc", Some(Bind::DualStack))?;
    let x = PodExclusions {
        exclude_outbound_ports: vec![REMOTE_PORT],
        ..Default::default()
    };
    let e = f.enroll_with(PodOptions {
        exclusions: x,
        ..PodOptions::default()
    })?;
    ensure!(e.state == PodState::Enabled, "expected Enabled, got {e:?}");
    let rules = || -> anyhow::Result<usize> {
        let family = if fam == Family::V6 { "-6" } else { "-4" };
        let shown = output(
            &f.topo.pod,
            &["ip", family, "rule", "show", "pref", "32762"],
        )?;
        Ok(shown.lines().filter(|l| l.contains("lookup main")).count())
    };
    // The port's rule and the probe address's.
    ensure!(rules()? == 2, "{} exclusion rules, want 2", rules()?);
    let dst = SocketAddr::new(fam.client(), REMOTE_PORT);
    let mss = connect_mss(&f, dst)?;
    ensure!(
        mss <= 1460,
        "the excluded connection's MSS is {mss}: routed over lo"
    );
    ensure!(
        f.standin().accepted().is_empty(),
        "the excluded connection was captured"
    );
    // Without its rule (a pod with NET_ADMIN deleted them), an excluded
    // connection goes over `lo`, and `lo`'s egress program sends it out.
    let family = if fam == Family::V6 { "-6" } else { "-4" };
    while exec(&f.topo.pod, &["ip", family, "rule", "del", "pref", "32762"]).is_ok() {}
    let r = sluice_tests::flow::connect(&f.topo.pod, dst, Default::default());
    ensure!(
        r.reply()
            .is_some_and(|l| l.starts_with(&format!("app:{REMOTE_PORT}"))),
        "the excluded connection without its rule: {r:?}"
    );
    ensure!(
        f.standin().accepted().is_empty(),
        "the excluded connection was captured"
    );
    let mut dp = f.dataplane()?;
    let cookie = e.cookie;
    ensure!(sluice::podnet::enroll::set_exclusions(
        &mut dp,
        cookie,
        &PodExclusions::default()
    )?);
    drop(dp);
    ensure!(
        rules()? == 1,
        "the exclusion rule stayed (the probe address's stays)"
    );
    ensure!(
        connect_mss(&f, dst)? > 1500,
        "not over lo once the exclusion went"
    );
    captured_once(&f, dst)
}

/// A pod enrolled with a connection open (it ran before: sluice installed
/// under it, or taken over from istio-cni) keeps its interface's route: the
/// rule would re-route that connection over `lo`.
fn open_before(fam: Family) -> TestResult {
    let f = Fixture::new("lr-open", Some(Bind::DualStack))?;
    let dst = SocketAddr::new(fam.client(), REMOTE_PORT);
    let mut held = sluice_tests::flow::Held::open(&f.topo.pod, dst)?;
    ensure!(f.enroll()?.state == PodState::Enabled);
    ensure!(
        f.pod_record()?.local_route.is_none(),
        "put on the local route"
    );
    for v6 in [false, true] {
        ensure!(
            !has_local_route_rule(&f.topo.pod, v6)?,
            "a local route rule (IPv6: {v6})"
        );
    }
    let r = held.exchange();
    ensure!(
        r.reply()
            .is_some_and(|l| l.starts_with(&format!("app:{REMOTE_PORT}"))),
        "the open connection: {r:?}"
    );
    Ok(())
}

/// The agent starts with `--local-route=false` after it was on: its pods
/// leave the local route (rules, route, entry), and their TCP is captured
/// by the interface's programs again.
fn turned_off() -> TestResult {
    let f = enabled("lr-off")?;
    ensure!(has_local_route_rule(&f.topo.pod, false)?);
    // A rule of the pod's own at the local route's priority stays.
    exec(
        &f.topo.pod,
        &["ip", "-4", "rule", "add", "pref", "32763", "lookup", "200"],
    )?;
    let mut dp = f.dataplane()?;
    dp.set_local_route(false);
    let left = sluice::podnet::enroll::leave_local_route(&mut dp);
    drop(dp);
    ensure!(left == 1, "{left} pods left the local route, want 1");
    for v6 in [false, true] {
        ensure!(
            !has_local_route_rule(&f.topo.pod, v6)?,
            "a local route rule (IPv6: {v6})"
        );
    }
    ensure!(
        f.pod_record()?.local_route.is_none(),
        "still on the local route"
    );
    let own = output(&f.topo.pod, &["ip", "-4", "rule", "show", "pref", "32763"])?;
    ensure!(
        own.contains("lookup 200"),
        "the pod's own rule went: {own:?}"
    );
    let dst = SocketAddr::new(Family::V4.client(), REMOTE_PORT);
    let mss = connect_mss(&f, dst)?;
    ensure!(mss <= 1460, "MSS {mss}: still over lo");
    captured_once(&f, dst)
}

fn not_offered() -> TestResult {
    let f = Fixture::new("lr-no", Some(Bind::DualStack))?;
    let mut dp = f.dataplane()?;
    ensure!(
        !dp.set_local_route(true),
        "offered without netns cookies in tc"
    );
    let e =
        sluice::podnet::enroll::enroll(&mut dp, &f.topo.pod_netns_path(), &f.uid, &f.workload())?;
    ensure!(e.state == PodState::Enabled, "{e:?}");
    for v6 in [false, true] {
        ensure!(
            !has_local_route_rule(&f.topo.pod, v6)?,
            "a local route rule (IPv6: {v6})"
        );
    }
    ensure!(f.pod_record()?.local_route.is_none());
    Ok(())
}

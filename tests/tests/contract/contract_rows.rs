//! One test per contract row and address family.

use sluice_tests::child::Bounded as _;
use std::{net::SocketAddr, time::Duration};

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use sluice_common::{PodState, Role, MARK_ZTUNNEL};
use sluice_tests::{
    flow::{connect, udp, Held, Opts, Reached},
    harness::{
        as_if_kernel, without_netns_cookie_in_tc, without_tcx, Fixture, APP_PORT, REMOTE_PORT,
        UDP_PORT,
    },
    standin::{Bind, StandIn},
    topology::Family,
    wait,
};

use crate::{local_route_trial, tcx_trial, trial, TestResult};

type Row = (&'static str, fn(Family) -> TestResult);

pub fn trials() -> Vec<Trial> {
    let rows: [Row; 13] = [
        ("i1_inbound_to_15006_with_original_destination", i1),
        ("i2_inbound_hbone_to_15008", i2),
        ("i3_kubelet_probe_reaches_app", i3),
        (
            "i4_ztunnel_spoofed_connection_reaches_app_and_replies_return",
            i4,
        ),
        ("i5_connections_from_before_enrollment_keep_working", i5),
        ("o1_outbound_to_15001_with_original_destination", o1),
        ("o2_loopback_and_own_pod_ip_not_captured", o2),
        ("o3_probe_address_not_captured", o3),
        ("o4_ztunnel_marked_socket_not_captured", o4),
        ("o5_udp_not_captured", o5),
        ("o6_replies_of_captured_inbound_not_recaptured", o6),
        ("f1_listener_missing_fails_closed_then_recovers", f1),
        ("f2_unenroll_removes_everything", f2),
    ];
    let mut v = Vec::new();
    for fam in [Family::V4, Family::V6] {
        for (name, f) in rows {
            v.push(trial(
                format!("contract::{}::{name}", fam.name()),
                move || f(fam),
            ));
            // The same rows where tc programs cannot learn a packet's netns
            // (Linux < 6.15): pods are found by their addresses.
            v.push(trial(
                format!("contract::no_netns_cookie_in_tc::{}::{name}", fam.name()),
                move || as_if_kernel(without_netns_cookie_in_tc(), || f(fam)),
            ));
            // And as on Linux < 6.6: no tcx, no netns cookies in tc.
            v.push(trial(
                format!("contract::no_tcx::{}::{name}", fam.name()),
                move || as_if_kernel(without_tcx(), || f(fam)),
            ));
            // Attached with tcx links (`--tc-attach tcx`), not filters.
            v.push(tcx_trial(
                format!("contract::tcx::{}::{name}", fam.name()),
                move || f(fam),
            ));
            // The pod's TCP on the local route (`--local-route`). (Not
            // I5: a pod with connections open is not offered it, see
            // `local_route::`.)
            if !name.starts_with("i5_") {
                v.push(local_route_trial(
                    format!("contract::local_route::{}::{name}", fam.name()),
                    move || f(fam),
                ));
            }
        }
    }
    v.push(trial(
        "contract::ipv4::i1_with_ipv4_only_listeners",
        i1_v4_only,
    ));
    v.push(trial(
        "contract::ipv6::x1_extension_headers_do_not_hide_tcp_from_capture",
        x1,
    ));
    v.push(trial(
        "contract::ipv6::x4_a_header_chain_too_long_to_read_never_leaves_the_pod",
        x4,
    ));
    v.push(trial(
        "contract::ipv6::x4_a_header_chain_too_long_to_read_never_enters_the_pod",
        x4_inbound,
    ));
    for fam in [Family::V4, Family::V6] {
        v.push(trial(
            format!(
                "contract::{}::x5_syn_from_an_address_added_after_enrollment_is_captured_or_dropped",
                fam.name()
            ),
            move || {
                // What this kernel does (in a VM with an older kernel too).
                let probed = sluice::dataplane::features::Features::get().netns_cookie_in_tc;
                x5(fam, if probed { Cookies::InTc } else { Cookies::None })
            },
        ));
        v.push(trial(
            format!(
                "contract::no_netns_cookie_in_tc::{}::x5_syn_from_an_address_added_after_enrollment_is_dropped",
                fam.name()
            ),
            move || as_if_kernel(without_netns_cookie_in_tc(), || x5(fam, Cookies::None)),
        ));
        v.push(trial(
            format!(
                "contract::{}::x3_spoofed_source_over_lo_is_not_exempt",
                fam.name()
            ),
            move || x3(fam),
        ));
        v.push(trial(
            format!(
                "contract::{}::x2_a_pod_claiming_a_neighbours_address_takes_nothing",
                fam.name()
            ),
            move || x2(fam),
        ));
        // X7 and X8 on kernels without netns cookies in tc too, where the
        // address is all that names a pod.
        for keyed in [false, true] {
            let prefix = if keyed { "no_netns_cookie_in_tc::" } else { "" };
            let on = move |f: fn(Family) -> TestResult| {
                move || {
                    if keyed {
                        as_if_kernel(without_netns_cookie_in_tc(), || f(fam))
                    } else {
                        f(fam)
                    }
                }
            };
            v.push(trial(
                format!(
                    "contract::{prefix}{}::x7_an_address_a_pod_dropped_or_a_link_local_one_is_not_its",
                    fam.name()
                ),
                on(x7),
            ));
            v.push(trial(
                format!(
                    "contract::{prefix}{}::x8_a_pod_cannot_publish_more_than_its_share_of_addresses",
                    fam.name()
                ),
                on(x8),
            ));
        }
        let x10_name = "x10_a_syn_with_a_neighbours_source_address_is_dropped";
        v.push(trial(
            format!("contract::{}::{x10_name}", fam.name()),
            move || x10(fam),
        ));
        v.push(trial(
            format!(
                "contract::no_netns_cookie_in_tc::{}::{x10_name}",
                fam.name()
            ),
            move || as_if_kernel(without_netns_cookie_in_tc(), || x10(fam)),
        ));
        // The hostile rows with the pod's TCP on the local route: its SYNs
        // meet `lo`'s egress program instead of the interface's.
        v.push(local_route_trial(
            format!("contract::local_route::{}::{x10_name}", fam.name()),
            move || x10(fam),
        ));
        v.push(local_route_trial(
            format!(
                "contract::local_route::{}::x3_spoofed_source_over_lo_is_not_exempt",
                fam.name()
            ),
            move || x3(fam),
        ));
        v.push(local_route_trial(
            format!(
                "contract::local_route::{}::x5_syn_from_an_address_added_after_enrollment_is_captured",
                fam.name()
            ),
            move || x5(fam, Cookies::InTc),
        ));
        let x9_name = "x9_the_runtimes_address_is_the_pods_whatever_another_pod_claimed";
        v.push(trial(
            format!("contract::{}::{x9_name}", fam.name()),
            move || x9(fam),
        ));
        v.push(trial(
            format!("contract::no_netns_cookie_in_tc::{}::{x9_name}", fam.name()),
            move || as_if_kernel(without_netns_cookie_in_tc(), || x9(fam)),
        ));
    }
    v
}

/// A fixture with the stand-in, enrolled and `Enabled` (on the local route
/// in a `local_route` variant, or the variant would test nothing new).
fn enabled(tag: &str, bind: Bind) -> anyhow::Result<Fixture> {
    let f = Fixture::new(tag, Some(bind))?;
    let e = f.enroll()?;
    ensure!(e.state == PodState::Enabled, "expected Enabled, got {e:?}");
    if sluice_tests::harness::local_route_on() {
        for v6 in [false, true] {
            ensure!(
                sluice_tests::topology::has_local_route_rule(&f.topo.pod, v6)?,
                "no local route rule (IPv6: {v6}) in the pod"
            );
        }
    }
    Ok(f)
}

fn sa(ip: std::net::IpAddr, port: u16) -> SocketAddr {
    SocketAddr::new(ip, port)
}

/// How the app prints a peer with this address: "10.0.0.1:" or "[fd00::1]:".
fn peer(ip: std::net::IpAddr) -> String {
    let s = sa(ip, 1).to_string();
    s[..s.len() - 1].to_owned()
}

fn expect_reply(r: &Reached, prefix: &str) -> TestResult {
    let line = r
        .reply()
        .with_context(|| format!("expected a reply, got {r:?}"))?;
    ensure!(
        line.starts_with(prefix),
        "reply {line:?} does not start with {prefix:?}"
    );
    Ok(())
}

fn i1(fam: Family) -> TestResult {
    let f = enabled("i1", Bind::DualStack)?;
    inbound_captured(&f, fam)
}

fn i1_v4_only() -> TestResult {
    let f = enabled("i1v4", Bind::V4Only)?;
    inbound_captured(&f, Family::V4)?;
    let rec = f.pod_record()?;
    ensure!(
        rec.listeners.iter().all(|l| l.ends_with("ipv4")),
        "IPv4-only listeners must not be registered for IPv6: {:?}",
        rec.listeners
    );
    Ok(())
}

fn inbound_captured(f: &Fixture, fam: Family) -> TestResult {
    let dst = sa(fam.pod(), APP_PORT);
    let r = connect(&f.topo.client, dst, Opts::default());
    // The app answers through ztunnel and sees the client's own address (I4).
    expect_reply(&r, &format!("app:{APP_PORT} peer={}", peer(fam.client())))?;
    let acc = f.standin().accepted();
    ensure!(
        acc.len() == 1,
        "expected one accepted connection, got {acc:?}"
    );
    let a = &acc[0];
    ensure!(a.role == Role::Inbound, "accepted by {:?}", a.role);
    ensure!(
        a.local == dst,
        "listener's local address {} != original destination {dst}",
        a.local
    );
    ensure!(
        a.peer.ip() == fam.client(),
        "listener's peer {} is not the client",
        a.peer
    );
    ensure!(f.pod_record()?.counters.captured_inbound == 1);
    Ok(())
}

fn i2(fam: Family) -> TestResult {
    let f = enabled("i2", Bind::DualStack)?;
    let dst = sa(fam.pod(), 15008);
    let r = connect(&f.topo.client, dst, Opts::default());
    expect_reply(
        &r,
        &format!("hbone local={dst} peer={}", peer(fam.client())),
    )?;
    let acc = f.standin().accepted();
    ensure!(
        acc.len() == 1 && acc[0].role == Role::Hbone,
        "accepted: {acc:?}"
    );
    ensure!(f.pod_record()?.counters.captured_hbone == 1);
    Ok(())
}

fn i3(fam: Family) -> TestResult {
    let f = enabled("i3", Bind::DualStack)?;
    let r = connect(
        &f.topo.client,
        sa(fam.pod(), APP_PORT),
        Opts {
            bind: Some(fam.probe()),
            ..Opts::default()
        },
    );
    expect_reply(&r, &format!("app:{APP_PORT} peer={}", peer(fam.probe())))?;
    ensure!(f.standin().accepted().is_empty(), "probe was captured");
    Ok(())
}

fn i4(fam: Family) -> TestResult {
    let f = enabled("i4", Bind::DualStack)?;
    // ztunnel's own connection to the app, spoofing the client's address.
    let r = connect(
        &f.topo.pod,
        sa(fam.pod(), APP_PORT),
        Opts {
            mark: Some(MARK_ZTUNNEL),
            bind: Some(fam.client()),
            transparent: true,
            ..Opts::default()
        },
    );
    expect_reply(&r, &format!("app:{APP_PORT} peer={}", peer(fam.client())))?;
    ensure!(
        f.standin().accepted().is_empty(),
        "ztunnel's own connection was captured"
    );
    ensure!(f.app.peers().iter().all(|p| p.ip() == fam.client()));
    Ok(())
}

fn i5(fam: Family) -> TestResult {
    let f = Fixture::new("i5", Some(Bind::DualStack))?;
    // Long-lived connections in both directions, opened before enrollment.
    let mut inbound = Held::open(&f.topo.client, sa(fam.pod(), APP_PORT))?;
    let mut outbound = Held::open(&f.topo.pod, sa(fam.client(), REMOTE_PORT))?;
    ensure!(f.enroll()?.state == PodState::Enabled);
    expect_reply(
        &inbound.exchange(),
        &format!("app:{APP_PORT} peer={}", peer(fam.client())),
    )?;
    expect_reply(
        &outbound.exchange(),
        &format!("app:{REMOTE_PORT} peer={}", peer(fam.pod())),
    )?;
    ensure!(
        f.standin().accepted().is_empty(),
        "pre-existing connection got captured"
    );
    // New connections are captured meanwhile.
    let r = connect(&f.topo.client, sa(fam.pod(), APP_PORT), Opts::default());
    expect_reply(&r, &format!("app:{APP_PORT}"))?;
    ensure!(f.standin().accepted().len() == 1);
    Ok(())
}

fn o1(fam: Family) -> TestResult {
    o1_on(&enabled("o1", Bind::DualStack)?, fam)
}

/// Row O1 on an enrolled fixture that has captured nothing yet.
fn o1_on(f: &Fixture, fam: Family) -> TestResult {
    let dst = sa(fam.client(), REMOTE_PORT);
    let r = connect(&f.topo.pod, dst, Opts::default());
    // ztunnel connected onwards from the pod's address.
    expect_reply(&r, &format!("app:{REMOTE_PORT} peer={}", peer(fam.pod())))?;
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
    ensure!(
        acc[0].local == dst,
        "15001's local address {} != original destination {dst}",
        acc[0].local
    );
    ensure!(acc[0].peer.ip() == fam.pod());
    ensure!(f.pod_record()?.counters.captured_outbound == 1);
    Ok(())
}

/// An app (or a client) that puts a hop-by-hop or destination options
/// header in front of its TCP: outbound it is still steered to 15001 (never
/// straight to the remote), inbound to 15006.
fn x1() -> TestResult {
    use sluice_tests::flow::Ipv6Ext;
    let fam = Family::V6;
    let f = enabled("x1", Bind::DualStack)?;
    for ext in [Ipv6Ext::HopByHop, Ipv6Ext::Destination] {
        let opts = || Opts {
            ipv6_ext: Some(ext),
            ..Opts::default()
        };
        // The reply would look the same uncaptured: what counts is that
        // ztunnel's listener took the connection.
        let dst = sa(fam.client(), REMOTE_PORT);
        let before = f.standin().accepted().len();
        let r = connect(&f.topo.pod, dst, opts());
        expect_reply(&r, &format!("app:{REMOTE_PORT} peer={}", peer(fam.pod())))
            .with_context(|| format!("outbound with {ext:?}"))?;
        let acc = f.standin().accepted();
        ensure!(
            acc.len() == before + 1
                && acc[before].role == Role::Outbound
                && acc[before].local == dst,
            "outbound with {ext:?} was not captured: {acc:?}"
        );
        let r = connect(&f.topo.client, sa(fam.pod(), APP_PORT), opts());
        expect_reply(&r, &format!("app:{APP_PORT} peer={}", peer(fam.client())))
            .with_context(|| format!("inbound with {ext:?}"))?;
        let acc = f.standin().accepted();
        ensure!(
            acc.len() == before + 2 && acc[before + 1].role == Role::Inbound,
            "inbound with {ext:?} was not captured: {acc:?}"
        );
    }
    Ok(())
}

/// Row X4 inbound: a SYN hidden behind a chain too long to read writes no
/// verdict of its own, so it would meet whatever older hint its tuple has
/// (the node's `Host` one, say): it is dropped at the pod's interface,
/// counted malformed, and the app never sees it.
fn x4_inbound() -> TestResult {
    use sluice_tests::sniff::send_dstopts_chain;
    let f = enabled("x4i", Bind::DualStack)?;
    let std::net::IpAddr::V6(pod) = f.topo.pod_ip(Family::V6) else {
        anyhow::bail!("the topology's v6 address is not v6");
    };
    send_dstopts_chain(&f.topo.client, pod, APP_PORT, 7)?;
    wait::until_seen(
        "the chain dropped at the pod's ingress",
        wait::DEADLINE,
        || {
            sluice::dataplane::state::Maps::open_pinned(&f.topo.pins.maps())
                .ok()
                .map(|m| m.drops(sluice_common::DropReason::Malformed))
        },
        |n| n.is_some_and(|n| n >= 1),
    )?;
    ensure!(f.app.peers().is_empty(), "the app saw {:?}", f.app.peers());
    Ok(())
}

/// An IPv6 packet whose extension-header chain is longer than the programs
/// walk (six) could hide a SYN around ztunnel: it never leaves an enrolled
/// pod, and is counted as a malformed drop. Released, the pod sends the
/// same packet out (so the sniffer would have seen it).
fn x4() -> TestResult {
    use sluice_tests::sniff::{send_dstopts_chain, Sniffer};
    let f = enabled("x4", Bind::DualStack)?;
    let (std::net::IpAddr::V6(pod), std::net::IpAddr::V6(client)) =
        (f.topo.pod_ip(Family::V6), f.topo.client_ip(Family::V6))
    else {
        anyhow::bail!("the topology's v6 addresses are not v6");
    };
    let sniffer = Sniffer::start(&f.topo.client)?;
    let hidden = |s: &sluice_tests::sniff::Seen| s.src == pod && s.next_header == 60;
    let malformed = || -> anyhow::Result<u64> {
        let maps = sluice::dataplane::state::Maps::open_pinned(&f.topo.pins.maps())?;
        Ok(maps.drops(sluice_common::DropReason::Malformed))
    };
    send_dstopts_chain(&f.topo.pod, client, REMOTE_PORT, 7)?;
    // A datagram behind it on the same path, which leaves (row O5): once the
    // client has it, the chain would have arrived too.
    let marker = b"sluice-x4-marker";
    sluice_tests::ns::run_in(&f.topo.pod, move || {
        let s = std::net::UdpSocket::bind("[::]:0")?;
        s.send_to(marker, sa(client.into(), UDP_PORT)).map(drop)
    })?;
    let mut seen = Vec::new();
    wait::until("the marker datagram at the client", wait::DEADLINE, || {
        seen.extend(sniffer.drain());
        if seen
            .iter()
            .any(|s| s.src == pod && s.payload.ends_with(marker))
        {
            Ok(())
        } else {
            Err(seen.len())
        }
    })?;
    ensure!(
        !seen.iter().any(hidden),
        "the chain left the enrolled pod: {seen:?}"
    );
    ensure!(malformed()? == 1, "malformed drops: {}", malformed()?);
    f.unenroll()?;
    send_dstopts_chain(&f.topo.pod, client, REMOTE_PORT, 7)?;
    wait::until("the chain from the released pod", wait::DEADLINE, || {
        let now = sniffer.drain();
        if now.iter().any(hidden) {
            Ok(())
        } else {
            Err(now)
        }
    })?;
    Ok(())
}

/// Whether the tc programs learn a packet's netns (Linux ≥ 6.15).
#[derive(Clone, Copy)]
enum Cookies {
    InTc,
    None,
}

/// The pod gains an address after it was enrolled (the agent publishes
/// addresses at enrollment and at ztunnel's ack). A SYN from it: where tc
/// learns the socket's netns, it is the pod's and captured; where it cannot
/// (the pod is found by source address), it names no pod, and the SYN is
/// dropped on the captured interface (counted `unknown_source`) instead of
/// leaving around ztunnel.
fn x5(fam: Family, cookies: Cookies) -> TestResult {
    let f = enabled("x5", Bind::DualStack)?;
    let (late, prefix) = match fam {
        Family::V4 => ("10.200.0.77".parse::<std::net::IpAddr>()?, "24"),
        Family::V6 => ("fd00:200::77".parse()?, "64"),
    };
    let cidr = format!("{late}/{prefix}");
    let mut args = vec!["-n", &f.topo.pod, "addr", "add", &cidr, "dev", "eth0"];
    if fam == Family::V6 {
        args.push("nodad");
    }
    sluice_tests::topology::ip(&args)?;
    let dst = sa(fam.client(), REMOTE_PORT);
    // The default connect timeout: under load, a new IPv6 address's first
    // SYN can wait for neighbour discovery longer than a second.
    let opts = Opts {
        bind: Some(late),
        ..Opts::default()
    };
    let r = connect(&f.topo.pod, dst, opts);
    let acc = f.standin().accepted();
    let unknown = sluice::dataplane::state::Maps::open_pinned(&f.topo.pins.maps())?
        .drops(sluice_common::DropReason::UnknownSource);
    match cookies {
        Cookies::InTc => {
            // (Which source ztunnel's onward connection uses is ztunnel's.)
            expect_reply(&r, &format!("app:{REMOTE_PORT} peer="))?;
            ensure!(
                acc.len() == 1 && acc[0].role == Role::Outbound && acc[0].local == dst,
                "not captured: {acc:?}"
            );
            ensure!(unknown == 0, "{unknown} unknown-source drops");
        }
        Cookies::None => {
            ensure!(matches!(r, Reached::TimedOut), "expected a drop, got {r:?}");
            ensure!(acc.is_empty(), "reached ztunnel: {acc:?}");
            ensure!(unknown >= 1, "no unknown-source drop counted");
        }
    }
    Ok(())
}

/// Pod B adds pod A's address to its own interface before it is enrolled
/// on the same node (one set of pins): the address stays A's in the
/// node-wide address map, and A's inbound traffic is still captured by A's
/// ztunnel listener.
fn x2(fam: Family) -> TestResult {
    let a = enabled("x2a", Bind::DualStack)?;
    let b = Fixture::in_subnet("x2b", Some(Bind::DualStack), 1)?;
    let stolen = match fam {
        Family::V4 => format!("{}/32", fam_pod(&a, fam)),
        Family::V6 => format!("{}/128", fam_pod(&a, fam)),
    };
    let mut args = vec!["-n", &b.topo.pod, "addr", "add", &stolen, "dev", "eth0"];
    if fam == Family::V6 {
        args.push("nodad");
    }
    sluice_tests::topology::ip(&args)?;
    let mut dp = a.dataplane()?;
    let e =
        sluice::podnet::enroll::enroll(&mut dp, &b.topo.pod_netns_path(), &b.uid, &b.workload())?;
    ensure!(e.state == PodState::Enabled, "{e:?}");
    let owner = dp
        .maps()
        .addrs_by_pod()
        .into_iter()
        .find(|(_, ks)| {
            ks.iter()
                .any(|k| *k == sluice::dataplane::state::addr_key(&fam_pod(&a, fam)))
        })
        .map(|(c, _)| c);
    let a_cookie = a.pod_record()?.netns_cookie;
    ensure!(
        owner == Some(a_cookie),
        "{} is mapped to pod {owner:?}, not to its owner {a_cookie}",
        fam_pod(&a, fam)
    );
    inbound_captured(&a, fam)
}

/// Pod A (with NET_ADMIN) adds an address, then deletes it: once its
/// addresses are published again (a link event, a repair), the address is no
/// longer A's, and pod B, enrolled later with it, gets it. A link-local
/// address is never anyone's. Before, the first claim stayed until A left,
/// and B's traffic went to A's ztunnel (issue: address ownership).
fn x7(fam: Family) -> TestResult {
    let a = enabled("x7a", Bind::DualStack)?;
    let b = Fixture::in_subnet("x7b", Some(Bind::DualStack), 1)?;
    let (taken, local) = match fam {
        Family::V4 => ("10.199.0.20/32", "169.254.10.10/32"),
        Family::V6 => ("fd00:199::20/128", "fe80::beef/128"),
    };
    let ip = |ns: &str, op: &str, addr: &str| {
        let mut args = vec!["-n", ns, "addr", op, addr, "dev", "eth0"];
        if fam == Family::V6 && op == "add" {
            args.push("nodad");
        }
        sluice_tests::topology::ip(&args)
    };
    let addr =
        |cidr: &str| -> std::net::IpAddr { cidr.split('/').next().unwrap().parse().unwrap() };
    let a_cookie = a.pod_record()?.netns_cookie;
    let a_netns = sluice::podnet::netns::Netns::open(&a.topo.pod_netns_path())?;
    let mut dp = a.dataplane()?;
    ip(&a.topo.pod, "add", taken)?;
    ip(&a.topo.pod, "add", local)?;
    sluice::podnet::enroll::refresh_addrs(dp.maps_mut(), &a_netns, a_cookie)?;
    ensure!(
        owner(&dp, addr(taken)) == Some(a_cookie),
        "{taken} not published for A"
    );
    ensure!(
        owner(&dp, addr(local)).is_none(),
        "link-local {local} was published"
    );
    ip(&a.topo.pod, "del", taken)?;
    sluice::podnet::enroll::refresh_addrs(dp.maps_mut(), &a_netns, a_cookie)?;
    ensure!(
        owner(&dp, addr(taken)).is_none(),
        "{taken} is still A's after A deleted it"
    );
    ip(&b.topo.pod, "add", taken)?;
    let e =
        sluice::podnet::enroll::enroll(&mut dp, &b.topo.pod_netns_path(), &b.uid, &b.workload())?;
    ensure!(e.state == PodState::Enabled, "{e:?}");
    let b_cookie = dp.maps().find_uid(&b.uid).context("B enrolled")?;
    ensure!(
        owner(&dp, addr(taken)) == Some(b_cookie),
        "{taken} is not B's: {:?}",
        owner(&dp, addr(taken))
    );
    Ok(())
}

/// Pod A (with NET_ADMIN), enrolled first, puts pod B's address on its own
/// interface before B exists. B is enrolled with the addresses the runtime
/// gave it: they are B's, A's claim is evicted and A cannot take it back,
/// and an address B adds itself is not published. B's inbound and outbound
/// reach B's ztunnel, never A's. Before, the first claim won: B was refused
/// its address, and its traffic went to A's listeners (issue 38, case 1).
fn x9(fam: Family) -> TestResult {
    let a = enabled("x9a", Bind::DualStack)?;
    let b = Fixture::in_subnet("x9b", Some(Bind::DualStack), 1)?;
    let (b4, b6) = (b.topo.pod_ip(Family::V4), b.topo.pod_ip(Family::V6));
    let b_ip = b.topo.pod_ip(fam);
    let add = |ns: &str, addr: String| {
        let mut args = vec!["-n", ns, "addr", "add", &addr, "dev", "eth0"];
        if fam == Family::V6 {
            args.push("nodad");
        }
        sluice_tests::topology::ip(&args)
    };
    let host = if fam == Family::V4 { 32 } else { 128 };
    let a_cookie = a.pod_record()?.netns_cookie;
    let a_netns = sluice::podnet::netns::Netns::open(&a.topo.pod_netns_path())?;
    let mut dp = a.dataplane()?;
    add(&a.topo.pod, format!("{b_ip}/{host}"))?;
    sluice::podnet::enroll::refresh_addrs(dp.maps_mut(), &a_netns, a_cookie)?;
    ensure!(owner(&dp, b_ip) == Some(a_cookie), "A did not claim {b_ip}");
    let runtime = sluice::podnet::enroll::PodAddrs::Runtime(vec![b4, b6]);
    let e = sluice::podnet::enroll::enroll_with_addrs(
        &mut dp,
        &b.topo.pod_netns_path(),
        &b.uid,
        &b.workload(),
        &Default::default(),
        &runtime,
    )?;
    ensure!(e.state == PodState::Enabled, "{e:?}");
    let b_cookie = dp.maps().find_uid(&b.uid).context("B enrolled")?;
    ensure!(
        owner(&dp, b_ip) == Some(b_cookie),
        "{b_ip} is not B's: {:?}",
        owner(&dp, b_ip)
    );
    // A link event of A's: its netns still holds the address.
    sluice::podnet::enroll::refresh_addrs(dp.maps_mut(), &a_netns, a_cookie)?;
    ensure!(owner(&dp, b_ip) == Some(b_cookie), "A took {b_ip} back");
    // An address B puts on its interface names nothing.
    let extra: std::net::IpAddr = match fam {
        Family::V4 => "10.197.0.9".parse()?,
        Family::V6 => "fd00:197::9".parse()?,
    };
    add(&b.topo.pod, format!("{extra}/{host}"))?;
    let b_netns = sluice::podnet::netns::Netns::open(&b.topo.pod_netns_path())?;
    sluice::podnet::enroll::refresh_addrs(dp.maps_mut(), &b_netns, b_cookie)?;
    ensure!(
        owner(&dp, extra).is_none(),
        "{extra}, B's own doing, was published"
    );
    drop(dp);
    let dst = sa(b_ip, APP_PORT);
    let r = connect(&b.topo.client, dst, Opts::default());
    expect_reply(&r, &format!("app:{APP_PORT} peer="))?;
    let out = sa(b.topo.client_ip(fam), REMOTE_PORT);
    let r = connect(&b.topo.pod, out, Opts::default());
    expect_reply(&r, &format!("app:{REMOTE_PORT} peer="))?;
    let acc = b.standin().accepted();
    ensure!(
        acc.len() == 2
            && acc
                .iter()
                .any(|c| c.role == Role::Inbound && c.local == dst)
            && acc
                .iter()
                .any(|c| c.role == Role::Outbound && c.local == out),
        "B's ztunnel accepted {acc:?}"
    );
    ensure!(
        a.standin().accepted().is_empty(),
        "A's ztunnel accepted B's: {:?}",
        a.standin().accepted()
    );
    Ok(())
}

/// Pod A (with NET_RAW/NET_ADMIN) opens a connection from its neighbour
/// B's address (IP_TRANSPARENT). It is dropped and counted
/// (`unknown_source`): neither A's ztunnel nor B's takes it. Before, on
/// kernels with netns cookies in tc, A's 15001 took it; on kernels
/// without, the address named B, and B's 15001 took A's connection, to be
/// opened under B's identity (issue 38, case 6).
fn x10(fam: Family) -> TestResult {
    let a = enabled("x10a", Bind::DualStack)?;
    let b = Fixture::in_subnet("x10b", Some(Bind::DualStack), 1)?;
    let mut dp = a.dataplane()?;
    let e =
        sluice::podnet::enroll::enroll(&mut dp, &b.topo.pod_netns_path(), &b.uid, &b.workload())?;
    ensure!(e.state == PodState::Enabled, "{e:?}");
    drop(dp);
    let drops = || -> anyhow::Result<u64> {
        Ok(
            sluice::dataplane::state::Maps::open_pinned(&a.topo.pins.maps())?
                .drops(sluice_common::DropReason::UnknownSource),
        )
    };
    let before = drops()?;
    let r = connect(
        &a.topo.pod,
        sa(fam.client(), REMOTE_PORT),
        // The default timeout: an IPv6 SYN can wait a second for neighbour
        // discovery before it reaches the egress program.
        Opts {
            bind: Some(b.topo.pod_ip(fam)),
            transparent: true,
            ..Opts::default()
        },
    );
    ensure!(
        matches!(r, Reached::TimedOut | Reached::Refused),
        "spoofed connection: {r:?}"
    );
    ensure!(
        a.standin().accepted().is_empty() && b.standin().accepted().is_empty(),
        "taken: A's ztunnel {:?}, B's {:?}",
        a.standin().accepted(),
        b.standin().accepted()
    );
    wait::until("an unknown-source drop", wait::DEADLINE, || match drops() {
        Ok(n) if n > before => Ok(()),
        other => Err(format!("{other:?}")),
    })?;
    // A's own connections are A's as before.
    o1_on(&a, fam)
}

/// Pod A (with NET_ADMIN) adds 40 addresses: at most its share
/// (`DEFAULT_MAX_POD_ADDRESSES`) is published, its own pod address kept among
/// them, the rest returned as over the cap; a pod enrolled next still gets
/// its address. Before, every address went into the node-wide map, and a pod
/// could fill it so that no new pod on the node could be enrolled.
fn x8(fam: Family) -> TestResult {
    let a = enabled("x8a", Bind::DualStack)?;
    let b = Fixture::in_subnet("x8b", Some(Bind::DualStack), 1)?;
    let cap = sluice::dataplane::state::DEFAULT_MAX_POD_ADDRESSES;
    let extra: Vec<String> = (1..=40)
        .map(|i| match fam {
            Family::V4 => format!("10.198.0.{i}/32"),
            Family::V6 => format!("fd00:198::{i:x}/128"),
        })
        .collect();
    let batch: String = extra
        .iter()
        .map(|a| {
            let dad = if fam == Family::V6 { " nodad" } else { "" };
            format!("addr add {a} dev eth0{dad}\n")
        })
        .collect();
    let file =
        std::env::temp_dir().join(format!("sluice-x8-{}-{}", std::process::id(), fam.name()));
    std::fs::write(&file, batch)?;
    let added = sluice_tests::topology::ip(&["-n", &a.topo.pod, "-batch", file.to_str().unwrap()]);
    let _ = std::fs::remove_file(&file);
    added?;
    let a_cookie = a.pod_record()?.netns_cookie;
    let a_netns = sluice::podnet::netns::Netns::open(&a.topo.pod_netns_path())?;
    let mut dp = a.dataplane()?;
    let over = sluice::podnet::enroll::refresh_addrs(dp.maps_mut(), &a_netns, a_cookie)?;
    let held = dp.maps().addrs_of(a_cookie);
    ensure!(
        held.len() == cap,
        "A holds {} addresses, its share is {cap}",
        held.len()
    );
    ensure!(
        over.len() >= extra.len() + 1 - cap,
        "over the cap: {over:?}"
    );
    let own = sluice::dataplane::state::addr_key(&fam_pod(&a, fam));
    ensure!(held.contains(&own), "A's own address lost its place");
    let e =
        sluice::podnet::enroll::enroll(&mut dp, &b.topo.pod_netns_path(), &b.uid, &b.workload())?;
    ensure!(e.state == PodState::Enabled, "{e:?}");
    let b_cookie = dp.maps().find_uid(&b.uid).context("B enrolled")?;
    let b_own = sluice::dataplane::state::addr_key(&fam_pod(&b, fam));
    ensure!(
        dp.maps().addrs_of(b_cookie).contains(&b_own),
        "B's address is not B's"
    );
    drop(dp);
    inbound_captured(&a, fam)
}

/// A process in the pod (with CAP_NET_ADMIN) connects to the app over lo
/// from a spoofed outside address without ztunnel's mark: it is not taken
/// for ztunnel's connection (no exemption hint is planted that a real
/// inbound connection with that tuple could later use): sk_lookup refuses it.
fn x3(fam: Family) -> TestResult {
    let f = enabled("x3", Bind::DualStack)?;
    let r = connect(
        &f.topo.pod,
        sa(fam.pod(), APP_PORT),
        Opts {
            bind: Some(fam.client()),
            transparent: true,
            timeout: Some(std::time::Duration::from_millis(1500)),
            ..Opts::default()
        },
    );
    ensure!(
        matches!(r, Reached::TimedOut | Reached::Refused),
        "spoofed connection over lo: {r:?}"
    );
    ensure!(
        f.app.peers().is_empty(),
        "it reached the app: {:?}",
        f.app.peers()
    );
    // ztunnel's own (marked) spoofed connection still reaches the app (I4).
    let r = connect(
        &f.topo.pod,
        sa(fam.pod(), APP_PORT),
        Opts {
            bind: Some(fam.client()),
            transparent: true,
            mark: Some(sluice_common::MARK_ZTUNNEL),
            ..Opts::default()
        },
    );
    expect_reply(&r, &format!("app:{APP_PORT} peer={}", peer(fam.client())))
}

/// The pod (netns cookie) the node-wide address map gives `ip` to.
fn owner(dp: &sluice::dataplane::loader::Dataplane, ip: std::net::IpAddr) -> Option<u64> {
    let key = sluice::dataplane::state::addr_key(&ip);
    dp.maps()
        .addrs_by_pod()
        .into_iter()
        .find(|(_, ks)| ks.contains(&key))
        .map(|(c, _)| c)
}

fn fam_pod(f: &Fixture, fam: Family) -> std::net::IpAddr {
    f.topo.pod_ip(fam)
}

fn o2(fam: Family) -> TestResult {
    let f = enabled("o2", Bind::DualStack)?;
    let r = connect(&f.topo.pod, sa(fam.loopback(), APP_PORT), Opts::default());
    expect_reply(&r, &format!("app:{APP_PORT} peer={}", peer(fam.loopback())))?;
    let r = connect(&f.topo.pod, sa(fam.pod(), APP_PORT), Opts::default());
    expect_reply(&r, &format!("app:{APP_PORT} peer={}", peer(fam.pod())))?;
    ensure!(
        f.standin().accepted().is_empty(),
        "in-pod traffic was captured"
    );
    Ok(())
}

fn o3(fam: Family) -> TestResult {
    let f = enabled("o3", Bind::DualStack)?;
    let r = connect(&f.topo.pod, sa(fam.probe(), REMOTE_PORT), Opts::default());
    expect_reply(&r, &format!("app:{REMOTE_PORT} peer={}", peer(fam.pod())))?;
    ensure!(
        f.standin().accepted().is_empty(),
        "traffic to the probe address was captured"
    );
    Ok(())
}

fn o4(fam: Family) -> TestResult {
    let f = enabled("o4", Bind::DualStack)?;
    let r = connect(
        &f.topo.pod,
        sa(fam.client(), REMOTE_PORT),
        Opts {
            mark: Some(MARK_ZTUNNEL),
            ..Opts::default()
        },
    );
    expect_reply(&r, &format!("app:{REMOTE_PORT} peer={}", peer(fam.pod())))?;
    ensure!(
        f.standin().accepted().is_empty(),
        "marked socket was captured"
    );
    Ok(())
}

fn o5(fam: Family) -> TestResult {
    let f = enabled("o5", Bind::DualStack)?;
    let out = udp(&f.topo.pod, sa(fam.client(), UDP_PORT)).context("no UDP reply outbound")?;
    ensure!(
        out.starts_with(&format!("udp:{UDP_PORT} peer={}", peer(fam.pod()))),
        "{out}"
    );
    let inb = udp(&f.topo.client, sa(fam.pod(), UDP_PORT)).context("no UDP reply inbound")?;
    ensure!(
        inb.starts_with(&format!("udp:{UDP_PORT} peer={}", peer(fam.client()))),
        "{inb}"
    );
    ensure!(f.standin().accepted().is_empty());
    Ok(())
}

fn o6(fam: Family) -> TestResult {
    let f = enabled("o6", Bind::DualStack)?;
    // The reply travels from ztunnel's accepted socket (mark inherited) out of
    // the pod to the client; it must not be taken for a new outbound flow.
    for _ in 0..3 {
        let r = connect(&f.topo.client, sa(fam.pod(), APP_PORT), Opts::default());
        expect_reply(&r, &format!("app:{APP_PORT}"))?;
    }
    let c = f.pod_record()?.counters;
    ensure!(c.captured_inbound == 3, "{c:?}");
    ensure!(c.captured_outbound == 0, "a reply was re-captured: {c:?}");
    ensure!(f
        .standin()
        .accepted()
        .iter()
        .all(|a| a.role == Role::Inbound));
    Ok(())
}

fn f1(fam: Family) -> TestResult {
    let mut f = Fixture::new("f1", None)?;
    let e = f.enroll()?;
    ensure!(
        e.state == PodState::Pending,
        "no ztunnel: expected Pending, got {e:?}"
    );
    let short = Opts {
        timeout: Some(Duration::from_millis(1500)),
        ..Opts::default()
    };
    // Pending: SYNs are dropped (not refused, not passed to the app).
    let r = connect(&f.topo.client, sa(fam.pod(), APP_PORT), short.clone());
    ensure!(r == Reached::TimedOut, "inbound while Pending: {r:?}");
    let r = connect(&f.topo.pod, sa(fam.client(), REMOTE_PORT), short.clone());
    ensure!(r == Reached::TimedOut, "outbound while Pending: {r:?}");
    ensure!(
        f.app.peers().is_empty() && f.remote.peers().is_empty(),
        "traffic bypassed ztunnel"
    );
    ensure!(f.pod_record()?.counters.dropped_fail_closed >= 2);

    // A client already retrying succeeds once ztunnel is back (SYN retransmit).
    let client = f.topo.client.clone();
    let dst = sa(fam.pod(), APP_PORT);
    let retrying = std::thread::spawn(move || {
        connect(
            &client,
            dst,
            Opts {
                timeout: Some(Duration::from_secs(10)),
                ..Opts::default()
            },
        )
    });
    // Its first SYN has been dropped (the counter moved): it is retrying.
    let dropped = f.pod_record()?.counters.dropped_fail_closed;
    f.wait_dropped_after(dropped)?;
    f.standin = Some(StandIn::start(&f.topo.pod, Bind::DualStack));
    ensure!(f.register()?.state == PodState::Enabled);
    let r = retrying.join().unwrap();
    expect_reply(&r, &format!("app:{APP_PORT} peer={}", peer(fam.client())))?;
    ensure!(f.standin().accepted().len() == 1, "retry was not captured");

    // Enabled but ztunnel gone (restarting): its sockets leave the map by
    // themselves and SYNs are dropped again, counted as missing-socket.
    f.standin = None;
    f.wait_no_listeners()?;
    let r = connect(&f.topo.client, sa(fam.pod(), APP_PORT), short);
    ensure!(r == Reached::TimedOut, "inbound with ztunnel gone: {r:?}");
    let c = f.pod_record()?.counters;
    ensure!(c.missing_socket >= 1, "{c:?}");
    ensure!(
        f.app.peers().len() == 1,
        "traffic reached the app without ztunnel"
    );
    Ok(())
}

fn f2(fam: Family) -> TestResult {
    let f = enabled("f2", Bind::DualStack)?;
    let cookie = f.pod_record()?.netns_cookie;
    ensure!(
        sluice_tests::topology::has_redirect_rule(&f.topo.pod)?,
        "no policy rule while enrolled"
    );
    f.unenroll()?;
    let r = connect(&f.topo.client, sa(fam.pod(), APP_PORT), Opts::default());
    expect_reply(&r, &format!("app:{APP_PORT} peer={}", peer(fam.client())))?;
    let r = connect(&f.topo.pod, sa(fam.client(), REMOTE_PORT), Opts::default());
    expect_reply(&r, &format!("app:{REMOTE_PORT} peer={}", peer(fam.pod())))?;
    ensure!(f.standin().accepted().is_empty(), "captured after unenroll");
    ensure!(!f.topo.pins.pod(cookie).exists(), "pod pins remain");
    // No tc program of ours on the pod's interfaces (tcx links, or the
    // cls_bpf filters of kernels without tcx).
    for (dev, hook) in [
        ("eth0", "ingress"),
        ("eth0", "egress"),
        ("lo", "ingress"),
        ("lo", "egress"),
    ] {
        let out = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &f.topo.pod,
                "tc",
                "filter",
                "show",
                "dev",
                dev,
                hook,
            ])
            .output_bounded()?;
        let shown = String::from_utf8_lossy(&out.stdout);
        ensure!(
            !shown.contains("sluice"),
            "a filter remains on {dev} {hook}: {shown}"
        );
    }
    let maps = sluice::dataplane::state::Maps::open_pinned(&f.topo.pins.maps())?;
    ensure!(!maps.cookies().contains(&cookie), "map entries remain");
    let rule = sluice_tests::topology::has_redirect_rule(&f.topo.pod)?;
    ensure!(!rule, "policy rule remains");
    for (v6, family) in [(false, "-4"), (true, "-6")] {
        let rule = sluice_tests::topology::has_local_route_rule(&f.topo.pod, v6)?;
        ensure!(!rule, "the local route's rule remains (IPv6: {v6})");
        // (A table never made is an error to `ip`, and empty.)
        let routes = std::process::Command::new("ip")
            .args(["-n", &f.topo.pod, family, "route", "show", "table", "101"])
            .output_bounded()?;
        let routes = String::from_utf8_lossy(&routes.stdout);
        ensure!(
            routes.trim().is_empty(),
            "the local route remains: {routes}"
        );
    }
    let accept = sluice_tests::ns::output(
        &f.topo.pod,
        &["cat", "/proc/sys/net/ipv4/tcp_fwmark_accept"],
    )?;
    ensure!(accept.trim() == "0", "tcp_fwmark_accept is {accept}");
    ensure!(sluice::status::read(&f.topo.pins)?.is_empty());
    Ok(())
}

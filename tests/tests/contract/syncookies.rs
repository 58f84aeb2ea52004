//! SYN cookies (issue 17): when a listener's accept queue overflows — or
//! always, with `net.ipv4.tcp_syncookies=2` — the kernel keeps no state for
//! a SYN and the client's ACK misses the established table, so the listener
//! lookup (and sk_lookup) runs again for it. Every captured and every exempt
//! connection must still complete, to the same listener as its SYN, and no
//! segment of a captured connection may leave the pod around ztunnel.

use sluice_tests::child::Bounded as _;
use std::net::{IpAddr, SocketAddr};

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use sluice::podnet::enroll;
use sluice_common::{DropReason, HintVerdict, PodState, Role};
use sluice_tests::{
    flow::{self, connect, Opts, Reached},
    harness::{
        as_if_kernel, without_netns_cookie_in_tc, without_tcx, Fixture, APP_PORT, REMOTE_PORT,
    },
    ns::{exec, run_in},
    sniff::{L4Sniffer, Segment},
    standin::Bind,
    topology::Family,
    wait,
};

use crate::{local_route_trial, trial, TestResult};

type Row = (&'static str, fn(Family) -> TestResult);

pub fn trials() -> Vec<Trial> {
    let rows: [Row; 6] = [
        (
            "a_pods_syn_cookie_flood_keeps_its_neighbours_hints",
            cookie_flood,
        ),
        (
            "a_handshake_without_a_cookie_releases_its_hints",
            hints_released,
        ),
        (
            "connects_to_the_pods_own_closed_port_hold_no_hints",
            closed_port_loop,
        ),
        (
            "captured_and_exempt_connections_complete_under_syn_cookies",
            under_cookies,
        ),
        (
            "a_spoofed_syn_over_lo_is_denied_over_a_kept_hint",
            lo_spoof_denied,
        ),
        (
            "a_steered_flow_stays_in_the_pod_once_its_listener_is_gone",
            steered_flow_stays,
        ),
    ];
    let mut v = Vec::new();
    for fam in [Family::V4, Family::V6] {
        for (name, f) in rows {
            v.push(trial(
                format!("syncookies::{}::{name}", fam.name()),
                move || f(fam),
            ));
            v.push(trial(
                format!("syncookies::no_netns_cookie_in_tc::{}::{name}", fam.name()),
                move || as_if_kernel(without_netns_cookie_in_tc(), || f(fam)),
            ));
            v.push(trial(
                format!("syncookies::no_tcx::{}::{name}", fam.name()),
                move || as_if_kernel(without_tcx(), || f(fam)),
            ));
            // On the local route: the cookie ACK makes the app's socket
            // (which takes its mark) and ztunnel's kept hint serves it.
            v.push(local_route_trial(
                format!("syncookies::local_route::{}::{name}", fam.name()),
                move || f(fam),
            ));
        }
        // Rerouting needs netns cookies in tc (refused without: options.rs).
        let name = format!(
            "syncookies::{}::a_rerouted_vms_connection_completes_under_syn_cookies",
            fam.name()
        );
        let refused = !sluice::dataplane::features::Features::get().netns_cookie_in_tc;
        if refused {
            eprintln!("skipping {name}: no bpf_get_netns_cookie in tc programs here");
        }
        v.push(trial(name, move || rerouted(fam)).with_ignored_flag(refused));
        let name = format!(
            "syncookies::{}::a_rerouted_vms_steered_flow_stays_in_the_pod_once_its_listener_is_gone",
            fam.name()
        );
        v.push(trial(name, move || steered_stays(fam, From::Vm)).with_ignored_flag(refused));
    }
    v
}

/// Every listener of netns `ns` answers every SYN with a cookie.
fn always_cookies(ns: &str) -> TestResult {
    exec(ns, &["sysctl", "-qw", "net.ipv4.tcp_syncookies=2"])
}

/// `TcpExt` counters of netns `ns` (`/proc/net/netstat`).
fn tcp_ext(ns: &str) -> anyhow::Result<std::collections::HashMap<String, u64>> {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns, "cat", "/proc/net/netstat"])
        .output_bounded()?;
    ensure!(out.status.success(), "reading /proc/net/netstat in {ns}");
    let text = String::from_utf8(out.stdout)?;
    let mut rows = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (names, values) = (rows.next(), rows.next());
    let (Some(names), Some(values)) = (names, values) else {
        anyhow::bail!("no TcpExt rows in /proc/net/netstat: {text}");
    };
    Ok(names
        .split_whitespace()
        .zip(values.split_whitespace())
        .skip(1)
        .filter_map(|(n, v)| Some((n.to_owned(), v.parse().ok()?)))
        .collect())
}

/// The cookie counters of netns `ns`: (sent, received, failed).
fn cookies(ns: &str) -> anyhow::Result<(u64, u64, u64)> {
    let c = tcp_ext(ns)?;
    let get = |n: &str| c.get(n).copied().with_context(|| format!("no TcpExt {n}"));
    Ok((
        get("SyncookiesSent")?,
        get("SyncookiesRecv")?,
        get("SyncookiesFailed")?,
    ))
}

fn sa(ip: IpAddr, port: u16) -> SocketAddr {
    SocketAddr::new(ip, port)
}

/// How the app prints a peer with this address: "10.0.0.1:" or "[fd00::1]:".
fn peer(ip: IpAddr) -> String {
    let s = sa(ip, 1).to_string();
    s[..s.len() - 1].to_owned()
}

/// `None` if `r` is a reply starting with `prefix`, else what it was.
fn replied(what: &str, r: &Reached, prefix: &str) -> Option<String> {
    match r.reply() {
        Some(line) if line.starts_with(prefix) => None,
        _ => Some(format!(
            "{what}: expected a reply starting {prefix:?}, got {r:?}"
        )),
    }
}

fn unhinted_drops(f: &Fixture) -> anyhow::Result<u64> {
    Ok(
        sluice::dataplane::state::Maps::open_pinned(&f.topo.pins.maps())?
            .drops(DropReason::Unhinted),
    )
}

/// Captured (inbound to 15006 and 15008, outbound to 15001) and exempt
/// (ztunnel's own spoofed-source connection to the app, the app to its own
/// pod IP, the probe address, a socket of the node) connections in a pod
/// netns whose listeners all answer with SYN cookies. Each completes at the
/// listener its SYN was steered to, is counted once, and nothing of the
/// app's outbound connection leaves the pod but through ztunnel.
/// Every problem is collected before the test fails, so a failure shows
/// all of them.
fn under_cookies(fam: Family) -> TestResult {
    let f = Fixture::new("sc", Some(Bind::DualStack))?;
    ensure!(f.enroll()?.state == PodState::Enabled);
    always_cookies(&f.topo.pod)?;
    let sniffer = L4Sniffer::start(&f.topo.client)?;
    let mut problems = Vec::new();

    // Outbound (O1): 15001, then ztunnel onwards to the remote.
    let remote = sa(fam.client(), REMOTE_PORT);
    let r = connect(&f.topo.pod, remote, Opts::default());
    problems.extend(replied(
        "outbound",
        &r,
        &format!("app:{REMOTE_PORT} peer={}", peer(fam.pod())),
    ));
    // Inbound (I1), through ztunnel's spoofed-source connection to the app
    // (I4), whose listener answers with a cookie too.
    let dst = sa(fam.pod(), APP_PORT);
    let r = connect(&f.topo.client, dst, Opts::default());
    problems.extend(replied(
        "inbound",
        &r,
        &format!("app:{APP_PORT} peer={}", peer(fam.client())),
    ));
    // HBONE (I2).
    let hbone = sa(fam.pod(), 15008);
    let r = connect(&f.topo.client, hbone, Opts::default());
    problems.extend(replied(
        "hbone",
        &r,
        &format!("hbone local={hbone} peer={}", peer(fam.client())),
    ));
    // Exempt: the app to its own pod IP over lo (O2), the probe address (I3).
    let r = connect(&f.topo.pod, dst, Opts::default());
    problems.extend(replied(
        "app to its own pod IP",
        &r,
        &format!("app:{APP_PORT} peer={}", peer(fam.pod())),
    ));
    let probe = Opts {
        bind: Some(fam.probe()),
        ..Opts::default()
    };
    let r = connect(&f.topo.client, dst, probe);
    problems.extend(replied(
        "probe address",
        &r,
        &format!("app:{APP_PORT} peer={}", peer(fam.probe())),
    ));

    let acc = f.standin().accepted();
    let roles: Vec<(Role, SocketAddr)> = acc.iter().map(|a| (a.role, a.local)).collect();
    let want = [
        (Role::Outbound, remote),
        (Role::Inbound, dst),
        (Role::Hbone, hbone),
    ];
    if roles != want {
        problems.push(format!("ztunnel accepted {roles:?}, expected {want:?}"));
    }
    // One count per connection, though its cookie ACK found the hint again.
    let c = f.pod_record()?.counters;
    if (c.captured_outbound, c.captured_inbound, c.captured_hbone) != (1, 1, 1) {
        problems.push(format!("counters: {c:?}"));
    }

    // Nothing of the app's own connection left the pod: every segment from
    // the pod to the remote's port is ztunnel's onward connection. A marker
    // datagram sent last on the same path bounds the wait.
    let onward: Vec<u16> = f.remote.peers().iter().map(|p| p.port()).collect();
    let marker = b"sluice-syncookie-marker";
    let to = sa(fam.client(), sluice_tests::harness::UDP_PORT);
    run_in(&f.topo.pod, move || {
        let any: SocketAddr = match to {
            SocketAddr::V4(_) => "0.0.0.0:0".parse().unwrap(),
            SocketAddr::V6(_) => "[::]:0".parse().unwrap(),
        };
        std::net::UdpSocket::bind(any)?
            .send_to(marker, to)
            .map(drop)
    })?;
    let mut seen: Vec<Segment> = Vec::new();
    wait::until("the marker datagram at the client", wait::DEADLINE, || {
        seen.extend(sniffer.drain());
        let arrived = seen
            .iter()
            .any(|s| s.proto == 17 && s.payload.windows(marker.len()).any(|w| w == marker));
        if arrived {
            Ok(())
        } else {
            Err(seen.len())
        }
    })?;
    let leaked: Vec<&Segment> = seen
        .iter()
        .filter(|s| {
            s.proto == 6
                && s.src.ip() == fam.pod()
                && s.dst == remote
                && !onward.contains(&s.src.port())
        })
        .collect();
    if !leaked.is_empty() {
        problems.push(format!(
            "segments of the app's connection left the pod uncaptured (ztunnel's onward ports {onward:?}): {leaked:?}"
        ));
    }

    // A socket of the node (kubelet, I3h) reaches the app directly.
    let node = Fixture::in_subnet("scn", Some(Bind::DualStack), 1)?;
    ensure!(node.enroll_with_node()?.state == PodState::Enabled);
    always_cookies(&node.topo.pod)?;
    let r = connect(
        &node.topo.client,
        sa(node.topo.pod_ip(fam), APP_PORT),
        Opts::default(),
    );
    problems.extend(replied(
        "node's own connection",
        &r,
        &format!("app:{APP_PORT} peer={}", peer(node.topo.client_ip(fam))),
    ));
    if !node.standin().accepted().is_empty() {
        problems.push(format!(
            "the node's connection was captured: {:?}",
            node.standin().accepted()
        ));
    }

    // The kernel did use cookies, and every cookie ACK reached the listener
    // that sent the cookie (a wrong listener fails the cookie check); none
    // was refused for want of a hint.
    for (what, ns) in [("pod", &f.topo.pod), ("node's pod", &node.topo.pod)] {
        let (sent, recv, failed) = cookies(ns)?;
        if sent == 0 || recv == 0 || failed != 0 {
            problems.push(format!(
                "{what}: SyncookiesSent {sent}, SyncookiesRecv {recv}, SyncookiesFailed {failed}"
            ));
        }
    }
    for (what, fx) in [("pod", &f), ("node's pod", &node)] {
        let n = unhinted_drops(fx)?;
        if n != 0 {
            problems.push(format!("{what}: {n} unhinted drops"));
        }
    }
    ensure!(problems.is_empty(), "{problems:#?}");
    Ok(())
}

/// A captured outbound connection whose SYN 15001 answered with a cookie
/// and whose ACK is lost (dropped in the pod's INPUT, as a full accept
/// queue would): the app takes it for open and sends. Then ztunnel goes
/// (its listeners close): the app's retransmissions find no socket, and
/// must stay in the pod (they keep meeting the INPUT rule), never be sent
/// on to the remote around ztunnel. (They left the pod: sk_lookup's refusal
/// read as "no socket of ztunnel's, so not ztunnel's flow".)
fn steered_flow_stays(fam: Family) -> TestResult {
    steered_stays(fam, From::App)
}

/// Who opens the steered connection: the pod's app, or a VM behind a
/// rerouted interface of the pod (its segments reach the pod's ingress).
#[derive(Clone, Copy)]
enum From {
    App,
    Vm,
}

/// [`steered_flow_stays`] from the app or from a rerouted VM.
fn steered_stays(fam: Family, from: From) -> TestResult {
    use std::io::Write as _;
    let mut f = Fixture::new("scs", Some(Bind::DualStack))?;
    let vm = match from {
        From::App => None,
        From::Vm => Some(crate::options::Vm::new(&f)?),
    };
    let reroute = vm
        .as_ref()
        .map(|_| vec!["tap0".to_string()])
        .unwrap_or_default();
    let e = f.enroll_with(sluice::options::PodOptions {
        reroute,
        ..Default::default()
    })?;
    ensure!(e.state == PodState::Enabled, "{e:?}");
    always_cookies(&f.topo.pod)?;
    let client_ns = vm.as_ref().map_or(f.topo.pod.clone(), |vm| vm.ns.clone());
    let tool = match fam {
        Family::V4 => "iptables",
        Family::V6 => "ip6tables",
    };
    // The steered segments keep their destination (sk_lookup picks 15001).
    let port = REMOTE_PORT.to_string();
    exec(
        &f.topo.pod,
        &[
            tool,
            "-w",
            "-A",
            "INPUT",
            "-p",
            "tcp",
            "--dport",
            &port,
            "--tcp-flags",
            "SYN,ACK",
            "ACK",
            "-j",
            "DROP",
        ],
    )?;
    // What the rule dropped: segments of the app's kept in the pod.
    let pod = f.topo.pod.clone();
    let dropped_in_pod = move || -> anyhow::Result<u64> {
        let out = sluice_tests::ns::output(&pod, &[tool, "-w", "-nvx", "-L", "INPUT"])?;
        out.lines()
            .nth(2)
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("no rule counter in {out}"))
    };
    let sniffer = L4Sniffer::start(&f.topo.client)?;
    let remote = sa(fam.client(), REMOTE_PORT);
    let stream = run_in(&client_ns, move || {
        let mut s =
            std::net::TcpStream::connect_timeout(&remote, std::time::Duration::from_secs(5))?;
        s.write_all(b"must not leave the pod")?;
        Ok::<_, std::io::Error>(s)
    })
    .context("connecting out of the pod")?;
    let app = stream.local_addr()?;
    f.standin = None;
    f.wait_no_listeners()?;
    let before = dropped_in_pod()?;
    wait::until_seen(
        "the app's retransmission kept in the pod",
        wait::DEADLINE,
        || dropped_in_pod().ok(),
        |n| n.is_some_and(|n| n > before),
    )?;
    let leaked: Vec<Segment> = sniffer
        .drain()
        .into_iter()
        .filter(|s| s.proto == 6 && s.src.port() == app.port() && s.dst == remote)
        .collect();
    drop(stream);
    ensure!(
        leaked.is_empty(),
        "segments of the app's steered connection left the pod: {leaked:?}"
    );
    Ok(())
}

/// Row I7 under SYN cookies: the VM's SYN is assigned to 15001 by the
/// reroute program (no lookup), so its ACK's lookup needs the hint the
/// program left, and the ACK must be delivered locally, not forwarded to
/// the remote around ztunnel.
fn rerouted(fam: Family) -> TestResult {
    let f = Fixture::new("scr", Some(Bind::DualStack))?;
    let vm = crate::options::Vm::new(&f)?;
    let e = f.enroll_with(sluice::options::PodOptions {
        reroute: vec!["tap0".into()],
        ..Default::default()
    })?;
    ensure!(e.state == PodState::Enabled, "{e:?}");
    always_cookies(&f.topo.pod)?;
    let sniffer = L4Sniffer::start(&f.topo.client)?;
    let mut problems = Vec::new();
    let remote = sa(fam.client(), REMOTE_PORT);
    let r = connect(&vm.ns, remote, Opts::default());
    problems.extend(replied(
        "the VM's connection",
        &r,
        &format!("app:{REMOTE_PORT}"),
    ));
    let acc = f.standin().accepted();
    let roles: Vec<(Role, SocketAddr)> = acc.iter().map(|a| (a.role, a.orig_dst)).collect();
    if roles != [(Role::Outbound, remote)] {
        problems.push(format!("ztunnel accepted {roles:?}"));
    }
    let c = f.pod_record()?.counters;
    if c.captured_outbound != 1 {
        problems.push(format!("counters: {c:?}"));
    }
    // The remote sees only ztunnel's connection, from the pod's address:
    // nothing from the VM's own address (10.202.*, fd00:202:*) arrived.
    // A datagram from the VM, which the pod forwards, bounds the wait.
    let vm_ip = match fam {
        Family::V4 => IpAddr::from([10, 202, f.topo.subnet, 2]),
        Family::V6 => format!("fd00:202:{}::2", f.topo.subnet).parse()?,
    };
    let marker = b"sluice-syncookie-vm-marker";
    let to = sa(fam.client(), sluice_tests::harness::UDP_PORT);
    run_in(&vm.ns, move || {
        std::net::UdpSocket::bind(SocketAddr::new(vm_ip, 0))?
            .send_to(marker, to)
            .map(drop)
    })?;
    let mut seen: Vec<Segment> = Vec::new();
    wait::until(
        "the VM's marker datagram at the client",
        wait::DEADLINE,
        || {
            seen.extend(sniffer.drain());
            let arrived = seen
                .iter()
                .any(|s| s.proto == 17 && s.payload.windows(marker.len()).any(|w| w == marker));
            if arrived {
                Ok(())
            } else {
                Err(seen.len())
            }
        },
    )?;
    let leaked: Vec<&Segment> = seen
        .iter()
        .filter(|s| s.proto == 6 && s.src.ip() == vm_ip)
        .collect();
    if !leaked.is_empty() {
        problems.push(format!(
            "the VM's TCP was forwarded around ztunnel: {leaked:?}"
        ));
    }
    let (sent, recv, failed) = cookies(&f.topo.pod)?;
    if sent == 0 || recv == 0 || failed != 0 {
        problems.push(format!(
            "SyncookiesSent {sent}, SyncookiesRecv {recv}, SyncookiesFailed {failed}"
        ));
    }
    let n = unhinted_drops(&f)?;
    if n != 0 {
        problems.push(format!("{n} unhinted drops"));
    }
    ensure!(problems.is_empty(), "{problems:#?}");
    Ok(())
}

/// Without SYN cookies a handshake answered from a request socket has no
/// more use for its SYNs' hints: the pod's programs release them (the
/// SYN-ACK leaving eth0 carries the request socket; the app's ACK of an
/// outbound handshake, and the SYN-ACK over lo of a connection to the pod's
/// own address, find one), so at a steady connection rate the LRU map holds
/// only handshakes in flight instead of evicting on every insert. Cookie
/// handshakes keep theirs (`under_cookies` completes only so). Inbound (the
/// client's SYN, and the stand-in's spoofed-source SYN to the app over lo:
/// the same tuple), outbound, and the app to its own pod address (row O2,
/// exempt: its `Local` hint).
fn hints_released(fam: Family) -> TestResult {
    let f = Fixture::new("release", Some(Bind::DualStack))?;
    ensure!(f.enroll()?.state == PodState::Enabled);
    let dst = sa(fam.pod(), APP_PORT);
    let r = connect(&f.topo.client, dst, Opts::default());
    ensure!(r.reply().is_some(), "inbound: {r:?}");
    let remote = sa(fam.client(), REMOTE_PORT);
    let r = connect(&f.topo.pod, remote, Opts::default());
    ensure!(r.reply().is_some(), "outbound: {r:?}");
    let acc = f.standin().accepted();
    ensure!(acc.len() == 2, "ztunnel accepted {acc:?}");
    let maps = sluice::dataplane::state::Maps::open_pinned(&f.topo.pins.maps())?;
    for a in &acc {
        let kept = maps.flow_hint(&flow::hint_key(a.peer, a.local));
        ensure!(
            kept.is_none(),
            "the {:?} connection from {} to {} left its hint: {kept:?}",
            a.role,
            a.peer,
            a.local
        );
    }
    let own = flow::Held::open(&f.topo.pod, dst)?;
    let kept = maps.flow_hint(&flow::hint_key(own.local_addr()?, dst));
    ensure!(
        kept.is_none(),
        "the pod's connection to its own address left its hint: {kept:?}"
    );
    ensure!(
        f.standin().accepted().len() == 2,
        "the pod's own connection was captured"
    );
    Ok(())
}

/// The pod connects to a closed port of its own address, 200 times (issue
/// 38, case 4: a loop of such connects, unprivileged, filled the node-wide
/// hint map and evicted the neighbours' SYN-cookie hints). Each SYN is
/// exempt (row O2, a `Local` hint) and answered with a reset over lo, which
/// releases its hint: none is left.
fn closed_port_loop(fam: Family) -> TestResult {
    let f = Fixture::new("closedloop", Some(Bind::DualStack))?;
    ensure!(f.enroll()?.state == PodState::Enabled);
    let dst = sa(fam.pod(), 9);
    let sources = run_in(&f.topo.pod, move || -> std::io::Result<Vec<SocketAddr>> {
        use socket2::{Domain, Socket, Type};
        let mut out = Vec::new();
        for _ in 0..200 {
            let s = Socket::new(Domain::for_address(dst), Type::STREAM, None)?;
            s.bind(&SocketAddr::new(dst.ip(), 0).into())?;
            let from = s.local_addr()?.as_socket().expect("an inet socket");
            let r = s.connect(&dst.into());
            if !matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused) {
                return Err(std::io::Error::other(format!("connect to {dst}: {r:?}")));
            }
            out.push(from);
        }
        Ok(out)
    })?;
    let maps = sluice::dataplane::state::Maps::open_pinned(&f.topo.pins.maps())?;
    let kept = sources
        .iter()
        .filter(|from| maps.flow_hint(&flow::hint_key(**from, dst)).is_some())
        .count();
    ensure!(kept == 0, "{kept} of 200 refused connects left their hint");
    ensure!(
        f.standin().accepted().is_empty(),
        "captured: {:?}",
        f.standin().accepted()
    );
    Ok(())
}

/// Issue 38, case 4, the SYN-cookie flood. The neighbour B answers with
/// SYN cookies: each of its inbound connections keeps its hint, which a
/// late ACK would need. Pod A, with nothing but a safe sysctl
/// (`tcp_syncookies=2`), then sends SYNs to its own listeners: three times as
/// many tuples as `flow_hints` holds, each answered with a cookie, so none
/// releases its hint. A's hints past its share go to the overflow map
/// (counted), and every hint of B's is still in `flow_hints`. Before the
/// shares, the flood evicted them all.
fn cookie_flood(fam: Family) -> TestResult {
    use socket2::{Domain, Socket, Type};
    let a = Fixture::new("hflood", Some(Bind::DualStack))?;
    let b = Fixture::in_subnet("hfloodb", Some(Bind::DualStack), 1)?;
    ensure!(a.enroll()?.state == PodState::Enabled);
    let mut dp = a.dataplane()?;
    let e = enroll::enroll(&mut dp, &b.topo.pod_netns_path(), &b.uid, &b.workload())?;
    ensure!(e.state == PodState::Enabled, "{e:?}");
    always_cookies(&a.topo.pod)?;
    always_cookies(&b.topo.pod)?;
    let to_b = sa(b.topo.pod_ip(fam), APP_PORT);
    let sources = run_in(
        &b.topo.client,
        move || -> std::io::Result<Vec<SocketAddr>> {
            (0..20)
                .map(|_| std::net::TcpStream::connect(to_b)?.local_addr())
                .collect()
        },
    )?;
    let kept = |dp: &sluice::dataplane::loader::Dataplane| {
        sources
            .iter()
            .filter(|from| dp.maps().flow_hint(&flow::hint_key(**from, to_b)).is_some())
            .count()
    };
    ensure!(
        kept(&dp) == sources.len(),
        "B's cookie handshakes kept no hint"
    );
    let before = dp.maps().hints_over_share();
    let own = a.topo.pod_ip(fam);
    const PORTS: [u16; 3] = [7000, 7001, 7002];
    let per_port = (sluice_common::FLOW_HINTS_ENTRIES * 3 / PORTS.len() as u32 + 1) as u16;
    run_in(&a.topo.pod, move || -> std::io::Result<()> {
        let domain = Domain::for_address(sa(own, 0));
        let _listeners = PORTS
            .iter()
            .map(|p| {
                let l = Socket::new(domain, Type::STREAM, None)?;
                l.bind(&sa(own, *p).into())?;
                l.listen(128)?;
                Ok(l)
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        // Each SYN is sent by `connect`; nothing waits for its answer.
        for dport in PORTS {
            for sport in 20_000..20_000 + per_port {
                let s = Socket::new(domain, Type::STREAM, None)?;
                s.set_reuse_address(true)?;
                s.set_nonblocking(true)?;
                s.bind(&sa(own, sport).into())?;
                match s.connect(&sa(own, dport).into()) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    })?;
    let over = dp.maps().hints_over_share() - before;
    let left = kept(&dp);
    ensure!(
        left == sources.len(),
        "A's flood ({over} hints past its share) evicted {} of B's {} hints",
        sources.len() - left,
        sources.len()
    );
    ensure!(over > 0, "none of A's hints was past its share");
    // Past its share, A still serves: a client's cookie handshakes hinted
    // in the overflow map (no `HINT_CHARGED`) complete and are answered
    // by ztunnel, as a pod under a SYN flood keeps serving. The share may
    // renew between two connections, so a round is one share and more.
    let to_a = sa(own, APP_PORT);
    let round = sluice_common::HINTS_PER_POD_PER_S as usize + 64;
    for _ in 0..5 {
        let sources = run_in(
            &a.topo.client,
            move || -> std::io::Result<Vec<SocketAddr>> {
                (0..round).map(|_| exchange_once(to_a)).collect()
            },
        )?;
        let over_share = sources.iter().any(|from| {
            dp.maps()
                .flow_hint(&flow::hint_key(*from, to_a))
                .is_some_and(|h| h.flags & sluice_common::HINT_CHARGED == 0)
        });
        if over_share {
            return Ok(());
        }
    }
    anyhow::bail!("no connection to A was hinted past its share")
}

/// Connects to `to`, exchanges one line, and says from where.
fn exchange_once(to: SocketAddr) -> std::io::Result<SocketAddr> {
    use std::io::{BufRead, BufReader, Write};
    let mut s = std::net::TcpStream::connect(to)?;
    writeln!(s, "hello")?;
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line)?;
    if line.is_empty() {
        return Err(std::io::Error::other(format!(
            "{to} closed without an answer"
        )));
    }
    s.local_addr()
}

/// Row X3 with a kept hint in the way. A real inbound connection from the
/// client, answered with a SYN cookie, leaves its `Inbound` hint (kept for
/// the cookie ACK). A process
/// in the pod (with CAP_NET_ADMIN: it also routes the client's address to
/// itself, so that it would get the answer) then connects to the app over
/// lo from the very same client address and port, without ztunnel's mark —
/// looking like ztunnel's spoofed-source connection. Its SYN must not be
/// steered to ztunnel's 15006 by that hint: the lo program removes it, and
/// sk_lookup refuses and counts the SYN (`unhinted`).
fn lo_spoof_denied(fam: Family) -> TestResult {
    let f = Fixture::new("lospoof", Some(Bind::DualStack))?;
    ensure!(f.enroll()?.state == PodState::Enabled);
    always_cookies(&f.topo.pod)?;
    let dst = sa(fam.pod(), APP_PORT);
    let r = connect(&f.topo.client, dst, Opts::default());
    ensure!(r.reply().is_some(), "inbound: {r:?}");
    let acc = f.standin().accepted();
    ensure!(acc.len() == 1 && acc[0].role == Role::Inbound, "{acc:?}");
    let client = acc[0].peer;
    let maps = || sluice::dataplane::state::Maps::open_pinned(&f.topo.pins.maps());
    let key = flow::hint_key(client, dst);
    let kept = maps()?.flow_hint(&key);
    ensure!(
        kept.is_some_and(|h| h.verdict == HintVerdict::Inbound as u32),
        "the inbound connection's hint is not kept: {kept:?}"
    );
    // ztunnel's accepted socket for that tuple is gone (the client closed
    // first), so the pod's SYN reaches the listener lookup.
    let tuple = format!("( sport = :{APP_PORT} and dport = :{} )", client.port());
    wait::until_seen(
        "ztunnel's socket of the inbound connection to close",
        wait::DEADLINE,
        || {
            std::process::Command::new("ip")
                .args(["netns", "exec", &f.topo.pod, "ss", "-Htan", &tuple])
                .output_bounded()
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
                .unwrap_or_else(|e| e.to_string())
        },
        |s| s.is_empty(),
    )?;
    let host = match fam {
        Family::V4 => format!("{}/32", client.ip()),
        Family::V6 => format!("{}/128", client.ip()),
    };
    sluice_tests::topology::ip(&[
        "-n",
        &f.topo.pod,
        "route",
        "add",
        "local",
        &host,
        "dev",
        "lo",
        "table",
        "local",
    ])?;
    let before = f.pod_record()?.counters;
    let drops_before = unhinted_drops(&f)?;
    let r = run_in(&f.topo.pod, move || spoofed_connect(client, dst));
    ensure!(
        matches!(r, Reached::TimedOut | Reached::Refused),
        "the spoofed connection over lo: {r:?}"
    );
    let acc = f.standin().accepted();
    ensure!(acc.len() == 1, "ztunnel accepted it: {acc:?}");
    ensure!(
        !f.app.peers().contains(&client),
        "it reached the app: {:?}",
        f.app.peers()
    );
    let after = maps()?.flow_hint(&key);
    ensure!(after.is_none(), "the lo SYN left the kept hint: {after:?}");
    // One SYN and its retransmits (1 s apart, within the 1.5 s timeout).
    let drops = unhinted_drops(&f)? - drops_before;
    ensure!(
        (1..=3).contains(&drops),
        "{drops} unhinted drops counted for the spoofed SYN"
    );
    let c = f.pod_record()?.counters;
    ensure!(
        c.captured_inbound == before.captured_inbound,
        "steered: {before:?} -> {c:?}"
    );
    Ok(())
}

/// Connects from `from` (not ours: transparent) to `to`, unmarked.
fn spoofed_connect(from: SocketAddr, to: SocketAddr) -> Reached {
    use socket2::{Domain, Socket, Type};
    let attempt = || -> std::io::Result<std::net::TcpStream> {
        let domain = if to.is_ipv4() {
            Domain::IPV4
        } else {
            Domain::IPV6
        };
        let s = Socket::new(domain, Type::STREAM, None)?;
        if to.is_ipv4() {
            s.set_ip_transparent(true)?;
        } else {
            flow::set_ipv6_transparent(&s)?;
        }
        s.bind(&from.into())?;
        s.connect_timeout(&to.into(), std::time::Duration::from_millis(1500))?;
        Ok(s.into())
    };
    match attempt() {
        Ok(s) => flow::exchange(s),
        Err(e) => flow::classify(e),
    }
}

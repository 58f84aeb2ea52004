//! Kubelet probes without istio-cni's host rules (row I3h): a connection a
//! socket of the node netns opens to a pod reaches the app uncaptured; one
//! the node only forwards and masquerades to its own address is captured.
//! The topology's client netns plays the node.

use sluice_tests::child::Bounded as _;
use std::net::SocketAddr;

use anyhow::{ensure, Context as _};
use aya::programs::{
    links::FdLink,
    tc::{TcAttachOptions, TcAttachType},
    LinkOrder, SchedClassifier,
};
use libtest_mimic::Trial;
use sluice::dataplane::loader::Program;
use sluice_common::{PodState, Role};
use sluice_tests::{
    agent::AgentProc,
    flow::{connect, Opts, Reached},
    harness::{as_if_kernel, without_netns_cookie_in_tc, without_tcx, Fixture, APP_PORT},
    ns::{netns_path, run_in},
    routed::{Behind, Bridged},
    standin::Bind,
    topology::Family,
};

use crate::{tcx_trial, trial, TestResult};

pub fn trials() -> Vec<Trial> {
    let mut v = Vec::new();
    for fam in [Family::V4, Family::V6] {
        v.push(trial(
            format!(
                "probes::{}::i3h_host_socket_reaches_app_forwarded_is_captured",
                fam.name()
            ),
            move || host_and_forwarded(fam),
        ));
        // Where tc cannot learn a socket's netns, having one on the host
        // side's egress is what says "the node's own".
        v.push(trial(
            format!(
                "probes::no_netns_cookie_in_tc::{}::i3h_host_socket_reaches_app_forwarded_is_captured",
                fam.name()
            ),
            move || as_if_kernel(without_netns_cookie_in_tc(), || host_and_forwarded(fam)),
        ));
        v.push(trial(
            format!(
                "probes::no_tcx::{}::i3h_host_socket_reaches_app_forwarded_is_captured",
                fam.name()
            ),
            move || as_if_kernel(without_tcx(), || host_and_forwarded(fam)),
        ));
        v.push(tcx_trial(
            format!(
                "probes::tcx::{}::i3h_host_socket_reaches_app_forwarded_is_captured",
                fam.name()
            ),
            move || host_and_forwarded(fam),
        ));
        v.push(trial(
            format!(
                "probes::{}::a_bridged_neighbours_connection_is_captured",
                fam.name()
            ),
            move || bridged_neighbour(fam),
        ));
        v.push(trial(
            format!(
                "probes::no_netns_cookie_in_tc::{}::a_bridged_neighbours_connection_is_captured",
                fam.name()
            ),
            move || as_if_kernel(without_netns_cookie_in_tc(), || bridged_neighbour(fam)),
        ));
        v.push(trial(
            format!(
                "probes::{}::i3h_host_socket_reaches_app_while_pending",
                fam.name()
            ),
            move || host_while_pending(fam),
        ));
    }
    v.push(trial(
        "probes::ipv4::host_side_filter_is_first_and_goes_with_the_pod",
        || host_link_lifecycle(false),
    ));
    v.push(trial(
        "probes::no_tcx::ipv4::host_side_filter_is_first_and_goes_with_the_pod",
        || as_if_kernel(without_tcx(), || host_link_lifecycle(false)),
    ));
    v.push(tcx_trial(
        "probes::tcx::ipv4::host_side_link_is_first_and_goes_with_the_pod",
        || host_link_lifecycle(true),
    ));
    v.push(trial(
        "probes::ipv4::host_veth_whose_hook_another_qdisc_holds_gets_no_filter",
        host_hook_taken,
    ));
    v.push(trial(
        "probes::ipv4::agent_node_netns_flag_attaches_and_reports",
        agent_node_netns,
    ));
    v
}

fn reply(r: &Reached) -> anyhow::Result<&str> {
    r.reply()
        .with_context(|| format!("expected a reply, got {r:?}"))
}

/// How the app prints a peer with this address: "10.0.0.1:" or "[fd00::1]:".
fn peer(ip: std::net::IpAddr) -> String {
    let s = SocketAddr::new(ip, 1).to_string();
    s[..s.len() - 1].to_owned()
}

fn host_and_forwarded(fam: Family) -> TestResult {
    let f = Fixture::new("i3h", Some(Bind::DualStack))?;
    let behind = Behind::new(&f.topo)?;
    let e = f.enroll_with_node()?;
    ensure!(e.state == PodState::Enabled, "expected Enabled, got {e:?}");
    let dst = SocketAddr::new(f.topo.pod_ip(fam), APP_PORT);
    let node_addr = peer(f.topo.client_ip(fam));

    // The node's own socket (kubelet): the app, directly.
    let r = connect(&f.topo.client, dst, Opts::default());
    let line = reply(&r)?;
    ensure!(
        line.starts_with(&format!("app:{APP_PORT} peer={node_addr}")),
        "host connection: {line:?}"
    );
    ensure!(
        f.standin().accepted().is_empty(),
        "the node's own connection was captured: {:?}",
        f.standin().accepted()
    );
    let bypassed = f.pod_record()?.counters.bypassed;
    ensure!(bypassed >= 1, "no bypass counted (saw {bypassed})");

    // A client behind the node, masqueraded to the same node address:
    // ztunnel takes it.
    let r = connect(&behind.ns, dst, Opts::default());
    let line = reply(&r)?;
    ensure!(
        line.starts_with(&format!("app:{APP_PORT} peer={node_addr}")),
        "forwarded connection: {line:?}"
    );
    let acc = f.standin().accepted();
    ensure!(acc.len() == 1, "expected one capture, got {acc:?}");
    ensure!(
        acc[0].role == Role::Inbound,
        "accepted by {:?}",
        acc[0].role
    );
    ensure!(
        acc[0].peer.ip() == f.topo.client_ip(fam),
        "captured, but not masqueraded as expected: {:?}",
        acc[0]
    );
    Ok(())
}

/// A pod on the pod's bridge (a bridge CNI) connects to it: the SYN reaches
/// the pod's host side still holding the neighbour's socket, which is not
/// the node's. Captured, as Istio's rules capture it; where tc cannot read
/// a socket's netns, a packet the node received (bridged or forwarded) is
/// told from one the node sent by its receiving interface. (Taken for the
/// node's own, it reached the app around ztunnel.)
fn bridged_neighbour(fam: Family) -> TestResult {
    let f = Fixture::new("brn", Some(Bind::DualStack))?;
    let neighbour = Bridged::new(&f.topo)?;
    let e = f.enroll_with_node()?;
    ensure!(e.state == PodState::Enabled, "expected Enabled, got {e:?}");
    let dst = SocketAddr::new(f.topo.pod_ip(fam), APP_PORT);
    let r = connect(&neighbour.ns, dst, Opts::default());
    let line = reply(&r)?;
    ensure!(line.starts_with(&format!("app:{APP_PORT}")), "{line:?}");
    let acc = f.standin().accepted();
    ensure!(
        acc.len() == 1 && acc[0].role == Role::Inbound && acc[0].peer.ip() == neighbour.ip(fam),
        "the bridged neighbour's connection was not captured: {acc:?}"
    );
    Ok(())
}

/// Istio exempts probes whatever the pod's state: with ztunnel absent, the
/// node's connection still reaches the app while a forwarded one fails
/// closed.
fn host_while_pending(fam: Family) -> TestResult {
    let f = Fixture::new("i3hp", None)?;
    let behind = Behind::new(&f.topo)?;
    let e = f.enroll_with_node()?;
    ensure!(e.state == PodState::Pending, "expected Pending, got {e:?}");
    let dst = SocketAddr::new(f.topo.pod_ip(fam), APP_PORT);
    let r = connect(&f.topo.client, dst, Opts::default());
    let line = reply(&r)?;
    ensure!(line.starts_with(&format!("app:{APP_PORT}")), "{line:?}");
    let r = connect(&behind.ns, dst, Opts::default());
    ensure!(
        r.reply().is_none(),
        "a forwarded connection reached a Pending pod: {r:?}"
    );
    ensure!(f.app.peers().len() == 1, "app peers: {:?}", f.app.peers());
    Ok(())
}

/// The host-side link is pinned with the pod's links, runs first on the
/// node's interface — ahead of a primary CNI's program that ends the chain
/// (`TC_ACT_OK`), which would otherwise hide every SYN from it — and leaves
/// with the pod.
/// `tcx`: sluice attaches tcx links (and so does the stand-in CNI), else
/// cls_bpf filters.
fn host_link_lifecycle(tcx: bool) -> TestResult {
    let f = Fixture::new("i3hl", Some(Bind::DualStack))?;
    let pins = f.topo.pins.clone();
    drop(f.dataplane()?); // loads and pins the programs
    let ids = sluice_tests::inspect::pinned_programs(&pins)?;
    let id = |name: &str| ids.get(name).map(|(id, _)| *id).context(name.to_owned());
    let host_id = id(Program::Host.name())?;
    // The stand-in "CNI" program: one that passes (ends the chain) and
    // writes no hint (each of sluice's own programs hints a SYN it sees, or
    // removes its tuple's hint). Pinned beside sluice's programs, so it goes
    // with them. Attached as the kernel allows: a tcx link, or a cls_bpf
    // filter at a later priority than sluice's.
    let cni_prog = pins.progs().join("cni_standin");
    sluice_tests::inspect::pin_pass_program(&cni_prog)?;
    let cni_id = SchedClassifier::from_pin(&cni_prog)?.info()?.id();
    let cni_link = run_in(&f.topo.client, move || -> anyhow::Result<Option<FdLink>> {
        let mut p = SchedClassifier::from_pin(&cni_prog)?;
        if !tcx {
            let _ = aya::programs::tc::qdisc_add_clsact("veth-c");
            let options = TcAttachOptions::Netlink(aya::programs::tc::NlOptions {
                priority: 100,
                ..Default::default()
            });
            let link = p.attach_with_options("veth-c", TcAttachType::Egress, options)?;
            // Stays until the veth goes with the topology.
            std::mem::forget(p.take_link(link)?);
            return Ok(None);
        }
        let link = p.attach_with_options(
            "veth-c",
            TcAttachType::Egress,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        )?;
        Ok(Some(FdLink::try_from(p.take_link(link)?)?))
    })?;
    let node_side = |ns: &str| -> anyhow::Result<Vec<u32>> {
        if !tcx {
            return Ok(
                sluice_tests::inspect::filter_programs(ns, "veth-c", "egress")?
                    .into_iter()
                    .map(|(_, id)| id)
                    .collect(),
            );
        }
        run_in(ns, || {
            SchedClassifier::query_tcx("veth-c", TcAttachType::Egress)
                .map(|(_, progs)| progs.iter().map(|p| p.id()).collect::<Vec<u32>>())
                .map_err(|e| e.to_string())
        })
        .map_err(anyhow::Error::msg)
    };
    ensure!(node_side(&f.topo.client)? == vec![cni_id]);

    let e = f.enroll_with_node()?;
    let pin = pins.pod(e.cookie).join("host_eth0");
    ensure!(
        pin.exists(),
        "no host-side link pinned at {}",
        pin.display()
    );
    let progs = node_side(&f.topo.client)?;
    ensure!(
        progs == vec![host_id, cni_id],
        "node side runs {progs:?}, want sluice_host ({host_id}) first"
    );
    let dst = SocketAddr::new(f.topo.pod_ip(Family::V4), APP_PORT);
    let r = connect(&f.topo.client, dst, Opts::default());
    ensure!(reply(&r)?.starts_with(&format!("app:{APP_PORT}")));
    ensure!(
        f.standin().accepted().is_empty(),
        "captured: the host-side program did not run before the CNI's"
    );

    f.unenroll()?;
    let progs = node_side(&f.topo.client)?;
    ensure!(
        progs == vec![cni_id],
        "after unenroll the node side runs {progs:?}"
    );
    drop(cni_link);
    Ok(())
}

/// Another tool's `ingress` qdisc on the pod's host-side veth (the
/// bandwidth CNI plugin's egress shaping puts one there): no cls_bpf
/// filter fits beside it. The pod is captured all the same, without the
/// host-side program — the node's own connections are captured too — the
/// qdisc stays, and what the pod should have (repair, CNI CHECK) has no
/// host-side link either: nothing is reported missing.
fn host_hook_taken() -> TestResult {
    let f = Fixture::new("i3hq", Some(Bind::DualStack))?;
    let tc = |args: &[&str]| -> anyhow::Result<String> {
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", &f.topo.client, "tc"])
            .args(args)
            .output_bounded()?;
        ensure!(
            out.status.success(),
            "tc {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    tc(&["qdisc", "add", "dev", "veth-c", "ingress"])?;
    let e = f.enroll_with_node()?;
    ensure!(e.state == PodState::Enabled, "expected Enabled, got {e:?}");
    let pin = f.topo.pins.pod(e.cookie).join("host_eth0");
    ensure!(
        !pin.exists(),
        "a host-side link is recorded at {}",
        pin.display()
    );
    let filters = tc(&["filter", "show", "dev", "veth-c", "ingress"])?;
    ensure!(
        filters.trim().is_empty(),
        "filters on the host veth: {filters}"
    );
    // Captured: the pod side is complete; only the exemption is lost.
    let dst = SocketAddr::new(f.topo.pod_ip(Family::V4), APP_PORT);
    let r = connect(&f.topo.client, dst, Opts::default());
    ensure!(reply(&r)?.starts_with(&format!("app:{APP_PORT}")));
    let acc = f.standin().accepted();
    ensure!(
        acc.len() == 1,
        "expected the node's connection captured, got {acc:?}"
    );
    let mut dp = f.dataplane()?;
    dp.set_node(sluice::podnet::hostside::Node::open(
        &sluice_tests::ns::netns_path(&f.topo.client),
    )?)?;
    let missing = sluice::podnet::enroll::missing_links(&dp, e.cookie)?;
    ensure!(missing.is_empty(), "reported missing: {missing:?}");
    ensure!(
        sluice::podnet::enroll::repair(&mut dp, e.cookie, false)?
            == sluice::podnet::enroll::Repair::Complete,
        "repair found something to do"
    );
    let qdiscs = tc(&["qdisc", "show", "dev", "veth-c"])?;
    ensure!(
        qdiscs.contains("qdisc ingress ffff:"),
        "the qdisc is gone: {qdiscs}"
    );
    Ok(())
}

/// The agent's `--node-netns`: its enrollments get the host-side link, its
/// status says how probes are exempt, and the node's connection reaches the
/// app of a pod still waiting for ztunnel.
fn agent_node_netns() -> TestResult {
    let f = Fixture::new("i3ha", None)?;
    let node = netns_path(&f.topo.client);
    let node_arg = node.to_str().context("netns path")?;
    let agent = AgentProc::start_with(&f.topo.pins, &["--node-netns", node_arg])?;
    let out = agent.enroll(&f.topo.pod_netns_path(), f.uid.as_str(), "default", "i3ha")?;
    ensure!(
        out.ok,
        "enroll: {} {}\n{}",
        out.stdout,
        out.stderr,
        agent.log()
    );
    let cookie = f.pod_record()?.netns_cookie;
    let pin = f.topo.pins.pod(cookie).join("host_eth0");
    ensure!(pin.exists(), "no host-side link at {}", pin.display());
    let status = agent.node_status()?;
    let probes = status["probes"].as_str().unwrap_or_default();
    ensure!(
        probes.contains(node_arg),
        "status does not name the node netns: {status}"
    );
    let text = agent.sluice(&["status"])?;
    ensure!(
        text.stdout.lines().any(|l| l.starts_with("probes:")),
        "no probes line in `sluice status`:\n{}",
        text.stdout
    );
    let dst = SocketAddr::new(f.topo.pod_ip(Family::V4), APP_PORT);
    let r = connect(&f.topo.client, dst, Opts::default());
    ensure!(reply(&r)?.starts_with(&format!("app:{APP_PORT}")), "{r:?}");
    Ok(())
}

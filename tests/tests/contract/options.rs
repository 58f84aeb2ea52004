//! Pod-level options Istio ambient users set (row I6):
//! `ambient.istio.io/bypass-inbound-capture: "true"` — inbound connections
//! reach the app as addressed, HBONE still reaches ztunnel, outbound is still
//! captured; compared with Istio's rules in "ingress mode" (its in-pod rules
//! without the inbound ones). And `istio.io/reroute-virtual-interfaces` (row
//! I7): TCP a VM sends into the pod through its tap is the pod's outbound.

use std::net::SocketAddr;

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use sluice::options::PodOptions;
use sluice_common::{PodState, Role};
use sluice_tests::{
    flow::{connect, Opts, Reached},
    harness::{as_if_kernel, without_netns_cookie_in_tc, Fixture, APP_PORT, REMOTE_PORT},
    istio,
    standin::Bind,
    topology::{ip, Family},
};

use crate::{trial, TestResult};

pub fn trials() -> Vec<Trial> {
    let mut v = Vec::new();
    for fam in [Family::V4, Family::V6] {
        v.push(trial(
            format!(
                "options::{}::i6_bypass_inbound_capture_vs_istio_ingress_mode",
                fam.name()
            ),
            move || bypass_inbound(fam),
        ));
        let name = format!(
            "options::{}::i7_reroute_virtual_interfaces_captures_a_vms_tcp_as_outbound",
            fam.name()
        );
        let refused = !sluice::dataplane::features::Features::get().netns_cookie_in_tc;
        if refused {
            eprintln!(
                "skipping {name}: this kernel has no bpf_get_netns_cookie in tc programs, so \
                 sluice refuses rerouting pods (the no_netns_cookie_in_tc row tests the refusal)"
            );
        }
        let t = trial(name, move || reroute(fam));
        v.push(if refused {
            t.with_ignored_flag(true)
        } else {
            t
        });
    }
    v.push(trial(
        "options::no_netns_cookie_in_tc::i7_reroute_is_refused_with_the_reason",
        reroute_refused,
    ));
    v
}

/// Where tc programs cannot learn a packet's netns, the reroute program
/// could not tell the VM's pod: a pod asking for it is refused, whole, with
/// the reason, and nothing of it stays.
fn reroute_refused() -> TestResult {
    let f = as_if_kernel(without_netns_cookie_in_tc(), || {
        Fixture::new("rrn", Some(Bind::DualStack))
    })?;
    let e = f
        .enroll_with(PodOptions {
            reroute: vec!["tap0".into()],
            ..PodOptions::default()
        })
        .expect_err("enrolled with reroute on a kernel that cannot tell its pod");
    ensure!(
        e.to_string()
            .contains("needs bpf_get_netns_cookie in tc programs (Linux ≥ 6.15)"),
        "{e}"
    );
    ensure!(
        sluice::status::read(&f.topo.pins)?.is_empty(),
        "something of the refused pod stayed"
    );
    Ok(())
}

/// What a flow came to: the listener that took it (if any), and the reply.
pub(crate) fn outcome(f: &Fixture, r: &Reached) -> anyhow::Result<(Option<Role>, String)> {
    let reply = r
        .reply()
        .with_context(|| format!("expected a reply, got {r:?}"))?;
    // "app:8080 peer=IP:PORT …" → "app:8080 peer=IP"; "hbone local=…" as is.
    let mut words = reply.split_whitespace();
    let service = words.next().unwrap_or_default();
    let seen = match words.next() {
        Some(w) if w.starts_with("peer=") => {
            let peer: SocketAddr = w["peer=".len()..].parse()?;
            format!("peer={}", peer.ip())
        }
        other => other.unwrap_or_default().to_owned(),
    };
    let role = f.standin().accepted().first().map(|a| a.role);
    f.standin().clear();
    Ok((role, format!("{service} {seen}")))
}

fn bypass_inbound(fam: Family) -> TestResult {
    let sluice = Fixture::new("byp", Some(Bind::DualStack))?;
    let e = sluice.enroll_with(PodOptions {
        bypass_inbound: true,
        ..PodOptions::default()
    })?;
    ensure!(e.state == PodState::Enabled, "{e:?}");
    let istio_twin = Fixture::new("bypi", Some(Bind::DualStack))?;
    istio::apply_ingress_mode(&istio_twin.topo.pod)?;

    let app = SocketAddr::new(fam.pod(), APP_PORT);
    let hbone = SocketAddr::new(fam.pod(), 15008);
    let remote = SocketAddr::new(fam.client(), REMOTE_PORT);
    let mut rows = Vec::new();
    for f in [&istio_twin, &sluice] {
        let inbound = outcome(f, &connect(&f.topo.client, app, Opts::default()))?;
        let to_hbone = outcome(f, &connect(&f.topo.client, hbone, Opts::default()))?;
        let outbound = outcome(f, &connect(&f.topo.pod, remote, Opts::default()))?;
        rows.push((inbound, to_hbone, outbound));
    }
    let (istio_rows, sluice_rows) = (&rows[0], &rows[1]);
    println!(
        "\n{} bypass-inbound-capture: Istio ingress mode | sluice",
        fam.name()
    );
    println!("inbound  {:?} | {:?}", istio_rows.0, sluice_rows.0);
    println!("hbone    {:?} | {:?}", istio_rows.1, sluice_rows.1);
    println!("outbound {:?} | {:?}", istio_rows.2, sluice_rows.2);
    ensure!(
        istio_rows == sluice_rows,
        "Istio {istio_rows:?}, sluice {sluice_rows:?}"
    );
    // And what both are: inbound direct (the app sees the client), HBONE to
    // ztunnel, outbound captured.
    ensure!(
        sluice_rows.0 == (None, format!("app:{APP_PORT} peer={}", fam.client())),
        "inbound: {:?}",
        sluice_rows.0
    );
    ensure!(
        sluice_rows.1 .0 == Some(Role::Hbone),
        "hbone: {:?}",
        sluice_rows.1
    );
    ensure!(
        sluice_rows.2 .0 == Some(Role::Outbound),
        "outbound: {:?}",
        sluice_rows.2
    );
    let rec = sluice.pod_record()?;
    ensure!(rec.bypass_inbound && rec.counters.bypassed >= 1, "{rec:?}");
    Ok(())
}

/// A "VM" netns behind the pod: a veth named `tap0` in the pod, the VM's
/// default route through it, as KubeVirt's virt-launcher sets up a VM.
pub(crate) struct Vm {
    pub(crate) ns: String,
}

impl Vm {
    pub(crate) fn new(f: &Fixture) -> anyhow::Result<Self> {
        let vm = Self {
            ns: f.topo.pod.replacen("slp-", "slv-", 1),
        };
        ip(&["netns", "add", &vm.ns])?;
        let (p, v) = (f.topo.pod.as_str(), vm.ns.as_str());
        let s = f.topo.subnet;
        ip(&[
            "link", "add", "tap0", "netns", p, "type", "veth", "peer", "name", "eth0", "netns", v,
        ])?;
        for (ns, dev) in [(p, "tap0"), (v, "eth0"), (v, "lo")] {
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        ip(&[
            "-n",
            p,
            "addr",
            "add",
            &format!("10.202.{s}.1/24"),
            "dev",
            "tap0",
        ])?;
        ip(&[
            "-n",
            v,
            "addr",
            "add",
            &format!("10.202.{s}.2/24"),
            "dev",
            "eth0",
        ])?;
        ip(&[
            "-n",
            p,
            "addr",
            "add",
            &format!("fd00:202:{s}::1/64"),
            "dev",
            "tap0",
            "nodad",
        ])?;
        ip(&[
            "-n",
            v,
            "addr",
            "add",
            &format!("fd00:202:{s}::2/64"),
            "dev",
            "eth0",
            "nodad",
        ])?;
        ip(&[
            "-n",
            v,
            "route",
            "add",
            "default",
            "via",
            &format!("10.202.{s}.1"),
        ])?;
        ip(&[
            "-n",
            v,
            "-6",
            "route",
            "add",
            "default",
            "via",
            &format!("fd00:202:{s}::1"),
        ])?;
        // The pod routes for its VM, and the remote side knows the way back:
        // uncaptured, the VM would reach the remote directly.
        let c = f.topo.client.as_str();
        let pod4 = f.topo.pod_ip(Family::V4).to_string();
        let pod6 = f.topo.pod_ip(Family::V6).to_string();
        ip(&[
            "-n",
            c,
            "route",
            "add",
            &format!("10.202.{s}.0/24"),
            "via",
            &pod4,
        ])?;
        ip(&[
            "-n",
            c,
            "-6",
            "route",
            "add",
            &format!("fd00:202:{s}::/64"),
            "via",
            &pod6,
        ])?;
        for sysctl in ["net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"] {
            sluice_tests::ns::exec(p, &["sysctl", "-qw", sysctl])?;
        }
        Ok(vm)
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.ns]);
    }
}

fn reroute(fam: Family) -> TestResult {
    let f = Fixture::new("rrt", Some(Bind::DualStack))?;
    let vm = Vm::new(&f)?;
    let remote = SocketAddr::new(fam.client(), REMOTE_PORT);
    // Before capture the VM reaches the remote through the pod, directly.
    let r = connect(&vm.ns, remote, Opts::default());
    ensure!(
        r.reply()
            .is_some_and(|l| l.starts_with(&format!("app:{REMOTE_PORT}"))),
        "the VM cannot reach the remote before capture: {r:?}"
    );
    let e = f.enroll_with(PodOptions {
        reroute: vec!["tap0".into()],
        ..PodOptions::default()
    })?;
    ensure!(e.state == PodState::Enabled, "{e:?}");
    let cookie = f.pod_record()?.netns_cookie;
    let pins = f.topo.pins.pod(cookie);
    ensure!(
        pins.join("reroute_tap0").exists() && !pins.join("ingress_tap0").exists(),
        "tap0 has not the reroute program"
    );
    // The VM's connection to a remote server: ztunnel's 15001 takes it, with
    // the remote as the original destination, and the VM gets the reply.
    let r = connect(&vm.ns, remote, Opts::default());
    let reply = r
        .reply()
        .with_context(|| format!("VM got no reply: {r:?}"))?;
    ensure!(
        reply.starts_with(&format!("app:{REMOTE_PORT}")),
        "{reply:?}"
    );
    let acc = f.standin().accepted();
    ensure!(acc.len() == 1, "expected one capture, got {acc:?}");
    ensure!(
        acc[0].role == Role::Outbound,
        "accepted by {:?}",
        acc[0].role
    );
    ensure!(
        acc[0].orig_dst == remote,
        "original destination {}",
        acc[0].orig_dst
    );
    let rec = f.pod_record()?;
    ensure!(rec.reroute == ["tap0"], "{rec:?}");
    // ztunnel gone: the VM's SYN is dropped, never forwarded around it.
    let mut f = f;
    f.standin = None;
    f.wait_no_listeners()?;
    let short = Opts {
        timeout: Some(std::time::Duration::from_millis(800)),
        ..Opts::default()
    };
    let r = connect(&vm.ns, remote, short);
    ensure!(
        r.reply().is_none(),
        "reached the remote without ztunnel: {r:?}"
    );
    Ok(())
}

//! `cargo xtask demo`: enroll a pod netns with sluice, send real traffic
//! (TCP both ways, DNS) through it, and show what ztunnel's listeners saw
//! next to `sluice status` and `sluice status --pod`.
//! Everything it creates (namespaces, veth, pins, routes) is removed at the end.

use std::net::SocketAddr;

use anyhow::ensure;
use sluice_common::MARK_ZTUNNEL;
use sluice_tests::{
    dns::{self, Client},
    flow::{connect, Opts, Reached},
    harness::{is_root, Fixture, APP_PORT, REMOTE_PORT},
    standin::Bind,
    topology::Family,
};

fn show(what: &str, r: &Reached) {
    match r {
        Reached::Reply(line) => println!("  {what:<44} → {line}"),
        other => println!("  {what:<44} → {other:?}"),
    }
}

fn main() -> anyhow::Result<()> {
    ensure!(
        is_root(),
        "the demo needs root (network namespaces, eBPF): run it with sudo"
    );
    println!("sluice demo: a pod netns, a client netns, and a ztunnel stand-in in the pod\n");
    let f = Fixture::new("demo", Some(Bind::DualStack))?;
    println!(
        "namespaces: pod={} (10.200.0.2, fd00:200::2, app on :{APP_PORT}), client={} (10.200.0.1, fd00:200::1, server on :{REMOTE_PORT})",
        f.topo.pod, f.topo.client
    );
    // A resolver in the client netns and ztunnel's DNS proxy (stand-in) on
    // the pod's localhost:15053, there before enrollment finds its sockets.
    let _resolver = dns::upstream(&f.topo.client, &[Family::V4.client(), Family::V6.client()]);
    let _proxy = dns::proxy(&f.topo.pod, SocketAddr::new(Family::V4.client(), 53));
    let e = f.enroll()?;
    println!(
        "enrolled pod {} (netns cookie {}): {} with listeners {:?}\n",
        f.uid,
        e.cookie,
        e.state.as_str(),
        e.roles
    );

    println!("connections:");
    for fam in [Family::V4, Family::V6] {
        let app = SocketAddr::new(fam.pod(), APP_PORT);
        let remote = SocketAddr::new(fam.client(), REMOTE_PORT);
        show(
            &format!("client → pod {app} (inbound)"),
            &connect(&f.topo.client, app, Opts::default()),
        );
        let hbone = SocketAddr::new(fam.pod(), 15008);
        show(
            &format!("client → pod {hbone} (HBONE)"),
            &connect(&f.topo.client, hbone, Opts::default()),
        );
        show(
            &format!("app → {remote} (outbound)"),
            &connect(&f.topo.pod, remote, Opts::default()),
        );
        let probe = Opts {
            bind: Some(fam.probe()),
            ..Opts::default()
        };
        show(
            &format!("kubelet probe → pod {app}"),
            &connect(&f.topo.client, app, probe),
        );
        let marked = Opts {
            mark: Some(MARK_ZTUNNEL),
            ..Opts::default()
        };
        show(
            &format!("mark 0x539 socket → {remote}"),
            &connect(&f.topo.pod, remote, marked),
        );
    }

    println!("\nDNS (the app asks the resolver; ztunnel's DNS proxy answers *.proxy.test itself):");
    for fam in [Family::V4, Family::V6] {
        let resolver = SocketAddr::new(fam.client(), 53);
        let qtype = if fam == Family::V4 {
            dns::TYPE_A
        } else {
            dns::TYPE_AAAA
        };
        for (client, how) in [(Client::UdpConnected, "UDP"), (Client::Tcp, "TCP")] {
            let what = format!("app → {resolver} {how} a.proxy.test");
            match dns::ask(&f.topo.pod, client, resolver, "a.proxy.test", qtype) {
                Ok(got) => println!(
                    "  {what:<44} → {:?} from {} (the proxy's answer, the resolver's address)",
                    got.answer.addrs, got.from
                ),
                Err(e) => println!("  {what:<44} → {e:#}"),
            }
        }
    }

    println!("\nwhat ztunnel's listeners accepted (local address = original destination):");
    println!(
        "  {:<9} {:<28} {:<28}",
        "LISTENER", "LOCAL (ORIG DST)", "PEER"
    );
    for a in f.standin().accepted() {
        println!(
            "  {:<9} {:<28} {:<28}",
            a.role.as_str(),
            a.local.to_string(),
            a.peer.to_string()
        );
    }

    println!("\nsluice status:");
    let pods = sluice::status::read(&f.topo.pins)?;
    for line in sluice::status::table(&pods, None).lines() {
        println!("  {line}");
    }
    println!("\nsluice status --pod default/{}:", f.uid);
    if let Some(e) = sluice::status::explain::explain(&format!("default/{}", f.uid), &pods, None) {
        for line in sluice::status::explain::render(&e, false).lines() {
            println!("  {line}");
        }
    }
    println!("\ncleaning up (unenroll, remove pins and namespaces)");
    Ok(())
}

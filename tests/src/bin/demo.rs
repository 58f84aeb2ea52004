//! `cargo xtask demo`: enroll a pod netns with sluice, send real traffic
//! through it, and show what ztunnel's listeners saw next to `sluice status`.
//! Everything it creates (namespaces, veth, pins, routes) is removed at the end.

use std::net::SocketAddr;

use anyhow::ensure;
use sluice_common::MARK_ZTUNNEL;
use sluice_tests::{
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
    for line in sluice::status::table(&pods).lines() {
        println!("  {line}");
    }
    println!("\ncleaning up (unenroll, remove pins and namespaces)");
    Ok(())
}

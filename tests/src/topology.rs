//! A test topology: a "client" netns and a "pod" netns joined by a veth, with
//! IPv4 and IPv6 addresses, plus a bpffs root of the test's own. Everything is
//! removed on drop, also when the test panics.

use crate::child::Bounded as _;
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
};

use sluice::dataplane::loader::Pins;
use sluice_common::{PROBE_ADDR_V4, PROBE_ADDR_V6};

use crate::ns::netns_path;

pub const CLIENT_V4: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 1);
pub const POD_V4: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 2);
pub const CLIENT_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, 0, 1);
pub const POD_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, 0, 2);

pub fn probe_v4() -> Ipv4Addr {
    Ipv4Addr::from(PROBE_ADDR_V4)
}
pub fn probe_v6() -> Ipv6Addr {
    Ipv6Addr::from(PROBE_ADDR_V6)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn client(self) -> IpAddr {
        match self {
            Family::V4 => CLIENT_V4.into(),
            Family::V6 => CLIENT_V6.into(),
        }
    }
    pub fn pod(self) -> IpAddr {
        match self {
            Family::V4 => POD_V4.into(),
            Family::V6 => POD_V6.into(),
        }
    }
    pub fn probe(self) -> IpAddr {
        match self {
            Family::V4 => probe_v4().into(),
            Family::V6 => probe_v6().into(),
        }
    }
    pub fn loopback(self) -> IpAddr {
        match self {
            Family::V4 => Ipv4Addr::LOCALHOST.into(),
            Family::V6 => Ipv6Addr::LOCALHOST.into(),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Family::V4 => "ipv4",
            Family::V6 => "ipv6",
        }
    }
}

pub struct Topology {
    pub client: String,
    pub pod: String,
    pub pins: Pins,
    /// Third octet / group of this topology's addresses: pods on one node
    /// (one bpffs root) need distinct addresses, as on a real node.
    pub subnet: u8,
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// Whether netns `ns` has the "deliver locally" policy rule (fwmark 0x111
/// lookup 100), as `ip rule` shows it.
pub fn has_redirect_rule(ns: &str) -> anyhow::Result<bool> {
    let out = Command::new("ip")
        .args(["-n", ns, "rule", "show"])
        .output_bounded()?;
    anyhow::ensure!(out.status.success(), "ip rule show failed");
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .any(|l| l.contains("fwmark 0x111/0xfff") && l.contains("lookup 100")))
}

/// Whether netns `ns` has the local route's rule (`--local-route`), for
/// IPv6 with `v6`.
pub fn has_local_route_rule(ns: &str, v6: bool) -> anyhow::Result<bool> {
    let family = if v6 { "-6" } else { "-4" };
    let out = Command::new("ip")
        .args(["-n", ns, family, "rule", "show"])
        .output_bounded()?;
    anyhow::ensure!(out.status.success(), "ip rule show failed");
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .any(|l| l.contains("iif lo") && l.contains("lookup 101")))
}

pub fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip").args(args).output_bounded()?;
    anyhow::ensure!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

impl Topology {
    /// Creates the two namespaces and the veth. `tag` keeps names readable.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        Self::with_subnet(tag, 0)
    }

    /// Same, with addresses 10.200.`subnet`.0/24 and fd00:200:`subnet`::/64.
    pub fn with_subnet(tag: &str, subnet: u8) -> anyhow::Result<Self> {
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}-{n}", std::process::id());
        let t = Self {
            client: format!("slc-{tag}-{id}"),
            pod: format!("slp-{tag}-{id}"),
            pins: Pins::new(PathBuf::from(format!("/sys/fs/bpf/sluice-test-{id}"))),
            subnet,
        };
        // From here on, Drop cleans up whatever was made.
        t.build()?;
        Ok(t)
    }

    fn build(&self) -> anyhow::Result<()> {
        let (c, p) = (self.client.as_str(), self.pod.as_str());
        ip(&["netns", "add", c])?;
        ip(&["netns", "add", p])?;
        ip(&[
            "link", "add", "veth-c", "netns", c, "type", "veth", "peer", "name", "eth0", "netns", p,
        ])?;
        for (ns, dev) in [(c, "veth-c"), (p, "eth0")] {
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
        }
        let v4 = |ip: IpAddr| format!("{ip}/24");
        let v6 = |ip: IpAddr| format!("{ip}/64");
        let (c4, p4) = (v4(self.client_ip(Family::V4)), v4(self.pod_ip(Family::V4)));
        let (c6, p6) = (v6(self.client_ip(Family::V6)), v6(self.pod_ip(Family::V6)));
        ip(&["-n", c, "addr", "add", &c4, "dev", "veth-c"])?;
        ip(&["-n", p, "addr", "add", &p4, "dev", "eth0"])?;
        ip(&["-n", c, "addr", "add", &c6, "dev", "veth-c", "nodad"])?;
        ip(&["-n", p, "addr", "add", &p6, "dev", "eth0", "nodad"])?;
        // The kubelet probe source lives on the client side, as on a node.
        ip(&["-n", c, "addr", "add", "169.254.7.127/32", "dev", "veth-c"])?;
        ip(&[
            "-n",
            c,
            "addr",
            "add",
            "fd16:9254:7127:1337:ffff:ffff:ffff:ffff/128",
            "dev",
            "veth-c",
            "nodad",
        ])?;
        ip(&["-n", p, "route", "add", "169.254.7.127/32", "dev", "eth0"])?;
        ip(&[
            "-n",
            p,
            "route",
            "add",
            "fd16:9254:7127:1337:ffff:ffff:ffff:ffff/128",
            "dev",
            "eth0",
        ])?;
        Ok(())
    }

    pub fn pod_ip(&self, fam: Family) -> IpAddr {
        match fam {
            Family::V4 => Ipv4Addr::new(10, 200, self.subnet, 2).into(),
            Family::V6 => Ipv6Addr::new(0xfd00, 0x200, self.subnet.into(), 0, 0, 0, 0, 2).into(),
        }
    }

    pub fn client_ip(&self, fam: Family) -> IpAddr {
        match fam {
            Family::V4 => Ipv4Addr::new(10, 200, self.subnet, 1).into(),
            Family::V6 => Ipv6Addr::new(0xfd00, 0x200, self.subnet.into(), 0, 0, 0, 0, 1).into(),
        }
    }

    pub fn pod_netns_path(&self) -> PathBuf {
        netns_path(&self.pod)
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        // Unenroll everything and drop the test's own bpffs root first, while
        // the netns still exists, then the namespaces (which take the veth).
        if let Err(e) = sluice::podnet::enroll::uninstall(&self.pins, None) {
            eprintln!("cleanup: uninstall {}: {e}", self.pins.root().display());
        }
        // Whatever the uninstall left (a test of a leak fails, and must not
        // leak itself): the root is the test's own.
        if self.pins.root().exists() {
            eprintln!(
                "cleanup: the uninstall left {}: removed",
                self.pins.root().display()
            );
            let _ = std::fs::remove_dir_all(self.pins.root());
        }
        for ns in [&self.pod, &self.client] {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

//! A client that reaches a pod only through the node: a netns "behind" the
//! topology's client netns (which then plays the node), whose connections
//! the node forwards and masquerades to its own address — what kube-proxy
//! does to NodePort traffic with `externalTrafficPolicy: Cluster`. Removed
//! on drop; the masquerade rules go with the node netns.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::{
    ns::exec as run,
    topology::{ip, Family, Topology},
};

pub struct Behind {
    pub ns: String,
    subnet: u8,
}

impl Behind {
    /// Builds the netns, its veth to the node (`veth-r` there) and the
    /// node's forwarding and masquerade (both families).
    pub fn new(topo: &Topology) -> anyhow::Result<Self> {
        let b = Self {
            ns: topo.client.replacen("slc-", "slr-", 1),
            subnet: topo.subnet,
        };
        ip(&["netns", "add", &b.ns])?;
        // From here on, Drop removes the netns (and the veth with it).
        b.build(&topo.client)?;
        Ok(b)
    }

    fn build(&self, node: &str) -> anyhow::Result<()> {
        let r = self.ns.as_str();
        ip(&[
            "link", "add", "veth-r", "netns", node, "type", "veth", "peer", "name", "eth0",
            "netns", r,
        ])?;
        ip(&["-n", r, "link", "set", "lo", "up"])?;
        ip(&["-n", r, "link", "set", "eth0", "up"])?;
        ip(&["-n", node, "link", "set", "veth-r", "up"])?;
        let (n4, r4) = (self.node_ip(Family::V4), self.ip(Family::V4));
        let (n6, r6) = (self.node_ip(Family::V6), self.ip(Family::V6));
        ip(&[
            "-n",
            node,
            "addr",
            "add",
            &format!("{n4}/24"),
            "dev",
            "veth-r",
        ])?;
        ip(&["-n", r, "addr", "add", &format!("{r4}/24"), "dev", "eth0"])?;
        ip(&[
            "-n",
            node,
            "addr",
            "add",
            &format!("{n6}/64"),
            "dev",
            "veth-r",
            "nodad",
        ])?;
        ip(&[
            "-n",
            r,
            "addr",
            "add",
            &format!("{r6}/64"),
            "dev",
            "eth0",
            "nodad",
        ])?;
        ip(&["-n", r, "route", "add", "default", "via", &n4.to_string()])?;
        ip(&[
            "-n",
            r,
            "-6",
            "route",
            "add",
            "default",
            "via",
            &n6.to_string(),
        ])?;
        for (tool, sysctl) in [
            ("iptables", "net.ipv4.ip_forward=1"),
            ("ip6tables", "net.ipv6.conf.all.forwarding=1"),
        ] {
            run(node, &["sysctl", "-qw", sysctl])?;
            run(
                node,
                &[
                    tool,
                    "-w",
                    "-t",
                    "nat",
                    "-A",
                    "POSTROUTING",
                    "-o",
                    "veth-c",
                    "-j",
                    "MASQUERADE",
                ],
            )?;
        }
        Ok(())
    }

    /// This client's own address.
    pub fn ip(&self, fam: Family) -> IpAddr {
        match fam {
            Family::V4 => Ipv4Addr::new(10, 201, self.subnet, 2).into(),
            Family::V6 => Ipv6Addr::new(0xfd00, 0x201, self.subnet.into(), 0, 0, 0, 0, 2).into(),
        }
    }

    /// The node's address on this client's side.
    fn node_ip(&self, fam: Family) -> IpAddr {
        match fam {
            Family::V4 => Ipv4Addr::new(10, 201, self.subnet, 1).into(),
            Family::V6 => Ipv6Addr::new(0xfd00, 0x201, self.subnet.into(), 0, 0, 0, 0, 1).into(),
        }
    }
}

impl Drop for Behind {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.ns]);
    }
}

/// A neighbour on the pod's L2: its own netns, whose veth's node side and
/// the pod's (`veth-c`) are ports of one bridge in the node netns (a
/// bridge CNI's `cni0`). Its packets to the pod are bridged, never routed:
/// no IP receive in the node netns orphans them, so they reach the pod's
/// host side still holding the neighbour's socket.
pub struct Bridged {
    pub ns: String,
    subnet: u8,
}

impl Bridged {
    pub fn new(topo: &Topology) -> anyhow::Result<Self> {
        let b = Self {
            ns: topo.client.replacen("slc-", "slb-", 1),
            subnet: topo.subnet,
        };
        ip(&["netns", "add", &b.ns])?;
        // From here on, Drop removes the netns (and the veth with it; the
        // bridge goes with the node netns).
        b.build(&topo.client)?;
        Ok(b)
    }

    fn build(&self, node: &str) -> anyhow::Result<()> {
        let n = self.ns.as_str();
        ip(&["-n", node, "link", "add", "br-s", "type", "bridge"])?;
        ip(&[
            "link", "add", "veth-b", "netns", node, "type", "veth", "peer", "name", "eth0",
            "netns", n,
        ])?;
        for dev in ["veth-b", "veth-c"] {
            ip(&["-n", node, "link", "set", dev, "master", "br-s"])?;
        }
        for dev in ["br-s", "veth-b"] {
            ip(&["-n", node, "link", "set", dev, "up"])?;
        }
        ip(&["-n", n, "link", "set", "lo", "up"])?;
        ip(&["-n", n, "link", "set", "eth0", "up"])?;
        let v4 = format!("{}/24", self.ip(Family::V4));
        let v6 = format!("{}/64", self.ip(Family::V6));
        ip(&["-n", n, "addr", "add", &v4, "dev", "eth0"])?;
        ip(&["-n", n, "addr", "add", &v6, "dev", "eth0", "nodad"])?;
        Ok(())
    }

    /// The neighbour's address, in the pod's subnet.
    pub fn ip(&self, fam: Family) -> IpAddr {
        match fam {
            Family::V4 => Ipv4Addr::new(10, 200, self.subnet, 3).into(),
            Family::V6 => Ipv6Addr::new(0xfd00, 0x200, self.subnet.into(), 0, 0, 0, 0, 3).into(),
        }
    }
}

impl Drop for Bridged {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.ns]);
    }
}

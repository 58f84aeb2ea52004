//! The links a pod has: what each attaches where, and the name of its pin
//! under `pods/<cookie>/`. Enrollment attaches them, repair completes them,
//! teardown and upgrades find them by these names.

use aya::programs::TcAttachType;

use crate::{
    dataplane::loader::programs::Program,
    podnet::hostside::{self, HostPeer, Node},
    podnet::netns::Netns,
};

/// The netns a tc hook is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The pod's.
    Pod,
    /// The node's (the host side of a pod's veth).
    Node,
}

/// A tc hook: a device and direction in the pod's or the node's netns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcHook<'a> {
    pub side: Side,
    pub iface: &'a str,
    pub kind: TcAttachType,
}

/// One link of a pod: what it attaches and its pin name under
/// `pods/<cookie>/`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkSpec {
    /// sk_lookup on the pod netns.
    Steer,
    /// tc egress on a pod interface.
    Egress(String),
    /// tc ingress on a pod interface.
    Ingress(String),
    /// tc egress on a pod interface without an Ethernet header.
    EgressL3(String),
    /// tc ingress on a pod interface without an Ethernet header.
    IngressL3(String),
    /// tc ingress on the pod's `lo`.
    Lo,
    /// tc egress on the pod's `lo` (a pod whose TCP takes the local route).
    LoOut,
    /// tc egress on the host side (node netns) of a pod interface.
    Host(HostPeer),
    /// tc ingress on a pod interface whose TCP is rerouted to 15001 (in
    /// place of `Ingress`).
    Reroute(String),
}

impl LinkSpec {
    /// The program the link runs.
    pub fn program(&self) -> Program {
        match self {
            LinkSpec::Steer => Program::Steer,
            LinkSpec::Egress(_) => Program::Egress,
            LinkSpec::Ingress(_) => Program::Ingress,
            LinkSpec::EgressL3(_) => Program::EgressL3,
            LinkSpec::IngressL3(_) => Program::IngressL3,
            LinkSpec::Lo => Program::Lo,
            LinkSpec::LoOut => Program::LoOut,
            LinkSpec::Host(_) => Program::Host,
            LinkSpec::Reroute(_) => Program::Reroute,
        }
    }

    /// Its pin name, as its program names its links (by the pod-side
    /// interface).
    pub fn pin_name(&self) -> String {
        let iface = match self {
            LinkSpec::Steer | LinkSpec::Lo | LinkSpec::LoOut => "",
            LinkSpec::Egress(i)
            | LinkSpec::Ingress(i)
            | LinkSpec::EgressL3(i)
            | LinkSpec::IngressL3(i)
            | LinkSpec::Reroute(i) => i,
            LinkSpec::Host(p) => &p.pod_iface,
        };
        self.program().link_pin(iface)
    }

    /// Where a tc link sits (`None` for the netns-wide sk_lookup link).
    pub fn tc_hook(&self) -> Option<TcHook<'_>> {
        let (side, iface, kind) = match self {
            LinkSpec::Steer => return None,
            LinkSpec::Egress(i) | LinkSpec::EgressL3(i) => {
                (Side::Pod, i.as_str(), TcAttachType::Egress)
            }
            LinkSpec::Ingress(i) | LinkSpec::IngressL3(i) | LinkSpec::Reroute(i) => {
                (Side::Pod, i.as_str(), TcAttachType::Ingress)
            }
            LinkSpec::Lo => (Side::Pod, "lo", TcAttachType::Ingress),
            LinkSpec::LoOut => (Side::Pod, "lo", TcAttachType::Egress),
            LinkSpec::Host(p) => (Side::Node, p.host_iface.as_str(), TcAttachType::Egress),
        };
        Some(TcHook { side, iface, kind })
    }
}

/// Every link a pod with interfaces `ifaces` (not `lo`; those in `l3`
/// without an Ethernet header), node-side peers `peers` and rerouted
/// interfaces `reroute` has, in attach order (`lo`'s egress last, with
/// `local_route`: the pod's TCP takes the local route). A rerouted L3
/// interface is refused before this is asked ([`reroute_on_l3`]).
pub fn expected_links(
    ifaces: &[String],
    l3: &[String],
    peers: &[HostPeer],
    reroute: &[String],
    local_route: bool,
) -> Vec<LinkSpec> {
    let mut v = vec![LinkSpec::Steer];
    for i in ifaces {
        if l3.contains(i) {
            v.push(LinkSpec::EgressL3(i.clone()));
            v.push(LinkSpec::IngressL3(i.clone()));
            continue;
        }
        v.push(LinkSpec::Egress(i.clone()));
        v.push(if reroute.contains(i) {
            LinkSpec::Reroute(i.clone())
        } else {
            LinkSpec::Ingress(i.clone())
        });
    }
    v.push(LinkSpec::Lo);
    v.extend(peers.iter().cloned().map(LinkSpec::Host));
    if local_route {
        v.push(LinkSpec::LoOut);
    }
    v
}

/// Every pod-side link a pod with interfaces `ifaces` (not `lo`) could
/// have, whatever its options and interface kinds: what a record's name is
/// matched against when it is removed (host-side links need the node's
/// view, [`LinkSpec::Host`]).
pub fn possible_pod_links(ifaces: &[String]) -> Vec<LinkSpec> {
    let mut v = vec![LinkSpec::Steer, LinkSpec::Lo, LinkSpec::LoOut];
    for i in ifaces {
        v.extend(
            [
                LinkSpec::Egress,
                LinkSpec::Ingress,
                LinkSpec::EgressL3,
                LinkSpec::IngressL3,
                LinkSpec::Reroute,
            ]
            .map(|spec| spec(i.clone())),
        );
    }
    v
}

/// The links of a pod in `netns` with interfaces `ifaces` (not `lo`) as they
/// are now, the host side found from `node`'s netns (none without it, or
/// when it cannot be found: only the host-side links are then missing).
pub fn links_now(
    netns: &Netns,
    ifaces: &[String],
    node: Option<&Node>,
    reroute: &[String],
    local_route: bool,
) -> Vec<LinkSpec> {
    let peers = node
        .map(|n| hostside::peers(netns, n, ifaces).unwrap_or_default())
        .unwrap_or_default();
    expected_links(ifaces, &l3_of(netns, ifaces), &peers, reroute, local_route)
}

/// Which of the pod's `ifaces` have no Ethernet header; none when that
/// cannot be read (the caller's next netlink step reports the netns).
pub fn l3_of(netns: &Netns, ifaces: &[String]) -> Vec<String> {
    netns
        .run(|| crate::podnet::netns::l3_interfaces(ifaces))
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default()
}

/// A rerouted interface without an Ethernet header, if any: the reroute
/// program parses Ethernet frames, so such a pod is refused.
pub fn reroute_on_l3<'a>(l3: &'a [String], reroute: &[String]) -> Option<&'a String> {
    l3.iter().find(|i| reroute.contains(i))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_names_say_the_link_and_its_program() {
        let host = HostPeer {
            pod_iface: "eth0".into(),
            host_iface: "veth1a2b".into(),
            host_index: 7,
        };
        let mut specs = possible_pod_links(&["net1.5".into()]);
        specs.push(LinkSpec::Host(host));
        let names: Vec<String> = specs.iter().map(LinkSpec::pin_name).collect();
        assert_eq!(
            names,
            [
                "steer",
                "lo",
                "lo_out",
                "egress_net1_5",
                "ingress_net1_5",
                "l3egress_net1_5",
                "l3ingress_net1_5",
                "reroute_net1_5",
                "host_eth0"
            ]
        );
        for s in &specs {
            assert_eq!(Program::of_link(&s.pin_name()), Some(s.program()), "{s:?}");
        }
    }
}

//! The node-side peers of a pod's interfaces, where its host-side links
//! attach: found when the dataplane knows the node's netns, less those whose
//! hook another tool's qdisc holds.

use crate::{
    dataplane::{
        features::TcAttach,
        loader::{Dataplane, Program},
        tcfilter,
    },
    podnet::{
        hostside::{self, HostPeer},
        netns::Netns,
        podview::PodView,
    },
};

/// The node-side peers of the pod's interfaces, when the dataplane knows the
/// node netns, and those left out because another tool's qdisc holds their
/// hook ("IFACE (KIND)"). A failure to find them costs only the host-side
/// probe exemption (the pod is captured as before): it is logged, not
/// fatal. With the pod's `view`, from its link dump. `say_held`: log a held
/// hook (an enrollment does; repairs and CHECK ask again, and stay quiet).
/// The peers found are recorded as pod `cookie`'s, for the node's tc watch.
pub fn host_peers(
    dp: &Dataplane,
    cookie: u64,
    netns: &Netns,
    view: Option<&PodView>,
    ifaces: &[String],
    say_held: bool,
) -> (Vec<HostPeer>, Vec<String>) {
    let Some(node) = dp.node().filter(|_| dp.has_program(Program::Host)) else {
        return (Vec::new(), Vec::new());
    };
    let found = match view {
        Some(v) => hostside::peers_over(netns, &v.nl, &v.links, node),
        None => hostside::peers(netns, node, ifaces),
    };
    let mut peers = found.unwrap_or_else(|e| {
        tracing::warn!(
            netns = %netns.path().display(),
            error = %e,
            "cannot find the host side of the pod's interfaces: host-originated probes are captured"
        );
        Vec::new()
    });
    // A host veth whose hook another tool's `ingress` qdisc holds takes no
    // filter of ours (the pod side would be refused; here only the probe
    // exemption is lost). Asked of every peer, so that enrollment, repair
    // and CNI CHECK expect the same links.
    let mut held = Vec::new();
    if dp.tc_attach() != TcAttach::Tcx {
        peers.retain(|p| match tcfilter::foreign_hook_qdisc(&node.nl, p.host_index) {
            Ok(None) => true,
            Ok(Some(kind)) => {
                held.push(format!("{} ({kind})", p.host_iface));
                // Said once, at enrollment; repair and CHECK ask again.
                if say_held {
                    tracing::warn!(
                        netns = %netns.path().display(),
                        host_iface = %p.host_iface,
                        qdisc = %kind,
                        "the pod's host-side veth has another tool's qdisc on its hook: no \
                         host-side program there, host-originated probes to the pod are captured"
                    );
                }
                false
            }
            // Unknown: attach as usual (a hook found taken then is skipped).
            Err(e) => {
                tracing::debug!(host_iface = %p.host_iface, error = %e, "asking for the host veth's qdisc");
                true
            }
        });
    }
    node.peers.record(cookie, &peers);
    (peers, held)
}

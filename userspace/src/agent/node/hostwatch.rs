//! The node side of the hook watch: one rtnetlink socket in the node's netns,
//! subscribed to its tc events, so that a change at a host-side veth's hook
//! (sluice's filter deleted, or its program swapped in place) is repaired as
//! soon as it is made, like one at the pod's own hooks. Each event names the
//! device by its index; the node's [`HostIndex`] turns that into the pod.
//! Events of devices no pod is known to own (other pods' enrollments, other
//! tools' devices) are dropped.

use std::sync::{atomic::AtomicUsize, Arc};

use tokio::{
    io::{unix::AsyncFd, Interest},
    sync::mpsc,
};
use tracing::{info, warn};

use super::rtevents::{Changed, Watch};
use crate::podnet::{hostside::HostIndex, netns::Netns};

/// rtnetlink's multicast group of tc events (`RTMGRP_TC`).
const RTMGRP_TC: u32 = 0x8;

/// What the node watch needs of the node: its netns, and whose each
/// host-side veth is.
pub(super) struct HostSide {
    pub(super) netns: Netns,
    pub(super) peers: HostIndex,
}

/// Opens the node's tc-event socket and relays each event on a known
/// host-side veth as that pod's tc change, until `tx` closes. `None` (and
/// a warning) when the socket cannot be opened: the periodic verification
/// remains.
pub(super) fn spawn(
    host: HostSide,
    tx: mpsc::UnboundedSender<(u64, Changed)>,
) -> Option<tokio::task::JoinHandle<()>> {
    // Not counted among the pods' link watches (`sluice status`).
    let uncounted = Arc::new(AtomicUsize::new(0));
    let opened = host
        .netns
        .run(|| Watch::open(&uncounted, RTMGRP_TC))
        .map_err(std::io::Error::other)
        .and_then(|r| r);
    // SAFETY: the AsyncFd owns the socket, so its fd stays open (and the
    // same) while registered.
    let fd = opened.and_then(|w| {
        unsafe { AsyncFd::register_with_interest(w, Interest::READABLE) }
            .map_err(std::io::Error::from)
    });
    match fd {
        Ok(fd) => {
            info!(netns = %host.netns.path().display(), "watching the host-side veths' tc hooks");
            Some(tokio::spawn(relay(fd, host.peers, tx)))
        }
        Err(e) => {
            warn!(error = %e, "cannot watch the node's tc hooks: a change at a host-side veth is found by the periodic verification only");
            None
        }
    }
}

/// The device index a tc message names: `tcmsg.tcm_ifindex`, at offset 4 of
/// the payload, after the 16-byte `nlmsghdr`.
fn device_of(msg: &[u8]) -> Option<u32> {
    let b = msg.get(20..24)?;
    Some(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
}

async fn relay(fd: AsyncFd<Watch>, peers: HostIndex, tx: mpsc::UnboundedSender<(u64, Changed)>) {
    let tc = Changed::TC;
    let mut buf: Vec<u8> = Vec::with_capacity(64);
    loop {
        let Ok(mut ready) = fd.readable().await else {
            return;
        };
        let mut due = std::collections::BTreeSet::new();
        loop {
            buf.clear();
            match fd.get_ref().recv(&mut buf) {
                Ok(()) => {
                    let heeded = buf
                        .get(4..6)
                        .and_then(|t| Changed::of_message_type(u16::from_ne_bytes([t[0], t[1]])));
                    if let Some(pod) = heeded.and(device_of(&buf)).and_then(|i| peers.pod_of(i)) {
                        due.insert(pod);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    ready.clear_ready();
                    break;
                }
                // Events were dropped for want of buffer: every pod.
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => due.extend(peers.pods()),
                Err(e) => {
                    warn!(error = %e, "the node's tc-event socket failed; verification every minute remains");
                    return;
                }
            }
        }
        for pod in due {
            if tx.send((pod, tc)).is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tc_message_names_its_device_after_the_headers() {
        let mut msg = vec![0u8; 36];
        msg[20..24].copy_from_slice(&7u32.to_ne_bytes());
        assert_eq!(device_of(&msg), Some(7));
        assert_eq!(device_of(&msg[..22]), None);
    }
}

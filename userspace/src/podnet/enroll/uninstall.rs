//! Taking sluice off the node: every pod unenrolled, in-flight connections
//! given a moment to finish, then the node-wide pins removed.

use std::fs;

use aya::programs::links::PinnedLink;

use crate::{
    dataplane::{
        loader::{remove_node_pins, Pins},
        state::{boottime_ns, Maps},
    },
    lifecycle::Event,
    podnet::{hostside, podlinks::LinkSpec},
};

use super::{
    error::EnrollError,
    reopen::open_pod_netns_unless_gone,
    teardown::{remove_stateless, teardown},
};

/// How long an uninstall lets connections in flight through ztunnel finish
/// between steering nothing new and removing the tc programs that carry
/// them (a request and its answer, not a long-lived connection: those end
/// with capture, as when ztunnel goes). A SYN dropped meanwhile is retried
/// by its client after a second, and then reaches the pod uncaptured.
pub const UNINSTALL_DRAIN: std::time::Duration = std::time::Duration::from_millis(500);

/// Unenrolls every pod and removes the node-wide pins. Works from whatever is
/// pinned, also when the maps cannot be opened (e.g. left by another version).
/// `node` as for `unenroll`. A pod whose teardown fails does not stop the
/// others'; it keeps its entry (Draining: it fails closed) and the node keeps
/// its pins, so that running the uninstall again finishes it.
pub fn uninstall(pins: &Pins, node: Option<&hostside::Node>) -> Result<usize, EnrollError> {
    if !pins.root().exists() {
        return Ok(0);
    }
    let mut n = 0;
    let mut left = Vec::new();
    let mut maps = Maps::open_pinned(&pins.maps()).ok();
    if let Some(maps) = maps.as_mut() {
        let cookies = maps.cookies();
        // First no pod takes new connections to ztunnel (its sk_lookup goes;
        // new SYNs from outside are dropped and retried), while the tc
        // programs still carry the connections ztunnel holds: those in
        // flight finish before the rest goes. (A pod this fails for is
        // set Draining again by its teardown.)
        for &cookie in &cookies {
            if let Err(e) = quiesce(pins, maps, cookie) {
                tracing::warn!(cookie, error = %e, "quiescing the pod before its teardown");
            }
        }
        if !cookies.is_empty() {
            std::thread::sleep(UNINSTALL_DRAIN);
        }
        for cookie in cookies {
            let torn = open_pod_netns_unless_gone(maps, cookie)
                .and_then(|netns| teardown(pins, maps, netns.as_ref(), node, cookie));
            match torn {
                Ok(()) => n += 1,
                Err(e) => left.push((cookie, e.to_string())),
            }
        }
    }
    // Pod directories with no map entry (interrupted enrolls, unreadable maps).
    if let Ok(entries) = fs::read_dir(pins.pods()) {
        for e in entries.flatten() {
            let Some(cookie) = e.file_name().to_str().and_then(|s| s.parse().ok()) else {
                continue;
            };
            if left.iter().any(|(c, _)| *c == cookie) {
                continue;
            }
            if let Err(e) = remove_stateless(pins, node, cookie) {
                left.push((cookie, e.to_string()));
            }
        }
    }
    if !left.is_empty() {
        return Err(EnrollError::UninstallIncomplete { removed: n, left });
    }
    remove_node_pins(pins).map_err(|e| EnrollError::Io {
        what: "removing node pins".into(),
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(n)
}

/// The first step of a pod's teardown, alone: `Draining` (new SYNs from
/// outside fail closed) and its sk_lookup link gone (nothing new reaches
/// ztunnel). Its tc programs stay.
fn quiesce(pins: &Pins, maps: &mut Maps, cookie: u64) -> Result<(), EnrollError> {
    maps.apply(cookie, Event::Drain, boottime_ns())?;
    let steer = pins.pod(cookie).join(LinkSpec::Steer.pin_name());
    if let Ok(link) = PinnedLink::from_pin(&steer) {
        drop(link.unpin());
    }
    Ok(())
}

//! Interfaces a pod gains after its enrollment (a Multus network, a device
//! the app creates) are captured as soon as the kernel announces them, not
//! at the next verification, and a change at the pod's tc hooks is repaired
//! as soon as it is made: one rtnetlink socket per held pod, opened in the
//! pod's netns and subscribed to its link, address, route, rule and tc
//! events. A tc event (a filter or chain added, replaced or deleted, a qdisc
//! deleted: another tool swapping the program of sluice's filter in place,
//! or deleting it) or a route or rule deleted (perhaps sluice's, which make
//! a redirected packet local) runs that pod's repair
//! (`Repairer::verify_one`), which reads what the kernel runs at each hook
//! and puts back what differs. A link or address event runs the repair when
//! an interface lacks its links; otherwise it publishes the pod's addresses
//! as they are now. A socket that overflowed (events lost) counts as all. The host side of each pod's veths is watched the
//! same way from one socket in the node's netns (`hostwatch`), and a pod's
//! pins from an inotify watch on the bpffs root (`pinwatch`). tcx
//! attachments send no netlink event: a foreign tcx program is found by the
//! verification every `VERIFY_EVERY`, which also covers a pod whose netns
//! could not be opened.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use tokio::{
    io::{unix::AsyncFd, Interest},
    sync::{mpsc, watch},
    task::JoinHandle,
};
use tracing::warn;

use super::{
    announce::Announcer,
    book::PodBook,
    hostwatch::{self, HostSide},
    pace::Pace,
    pinwatch,
    repair::Repairer,
    rtevents::{Changed, Watch},
};
use crate::podnet::podlinks::LinkSpec;

/// rtnetlink's multicast groups of link, tc, address, route and rule events
/// (`RTMGRP_LINK | RTMGRP_TC | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR`,
/// `RTMGRP_IPV4_ROUTE | RTMGRP_IPV4_RULE | RTMGRP_IPV6_ROUTE`, and
/// `RTNLGRP_IPV6_RULE` (group 19), which has no `RTMGRP_` name).
const RTMGRP_WATCHED: u32 = 0x1 | 0x8 | 0x10 | 0x100 | 0x40 | 0x80 | 0x400 | 1 << 18;

/// How often pods held since the last look get their socket.
const SUBSCRIBE_EVERY: Duration = Duration::from_millis(200);

pub(super) struct LinkWatch {
    book: Arc<PodBook>,
    repair: Arc<Repairer>,
    announcer: Arc<Announcer>,
    /// Link-event sockets open: one per watched pod.
    open: Arc<AtomicUsize>,
    /// The node's netns, watched from `run` on (when the agent knows it).
    host: std::sync::Mutex<Option<HostSide>>,
}

impl LinkWatch {
    pub(super) fn new(
        book: Arc<PodBook>,
        repair: Arc<Repairer>,
        announcer: Arc<Announcer>,
    ) -> Self {
        let host = book.dataplane().node().and_then(|n| {
            Some(HostSide {
                netns: n.netns.try_clone().ok()?,
                peers: n.peers.clone(),
            })
        });
        Self {
            book,
            announcer,
            repair,
            open: Arc::default(),
            host: std::sync::Mutex::new(host),
        }
    }

    /// How many link-event sockets are open (`sluice status`).
    pub(super) fn sockets(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Keeps a link-event socket for every held pod with an open netns and
    /// repairs the pods whose links changed, until `stop`.
    pub(super) async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let (tx, mut rx) = mpsc::unbounded_channel::<(u64, Changed)>();
        let mut watched: HashMap<u64, JoinHandle<()>> = HashMap::new();
        let mut tick = tokio::time::interval(SUBSCRIBE_EVERY);
        // A flapping pod's events are handled at growing gaps.
        let mut pace = Pace::default();
        let mut deferred: BTreeSet<u64> = BTreeSet::new();
        let host = self.host.lock().unwrap().take();
        let host_watch = host.and_then(|h| hostwatch::spawn(h, tx.clone()));
        // Held for the loop's life: dropping it ends the watch.
        let _pin_watch = pinwatch::spawn(self.book.dataplane().pins().pods(), tx.clone());
        loop {
            tokio::select! {
                _ = stop.changed() => break,
                _ = tick.tick() => {
                    let this = self.clone();
                    let have: BTreeSet<u64> = watched.keys().copied().collect();
                    let Ok(opened) = tokio::task::spawn_blocking(move || this.subscribe_new(&have)).await else {
                        continue;
                    };
                    self.update_watches(&mut watched, opened, &tx).await;
                    pace.keep_only(|c| watched.contains_key(&c));
                    deferred.retain(|c| watched.contains_key(c));
                }
                Some((cookie, what)) = rx.recv() => {
                    // Coalesce: a burst of events looks at each pod once.
                    let mut due = BTreeMap::from([(cookie, what)]);
                    while let Ok((c, w)) = rx.try_recv() {
                        let e = due.entry(c).or_default();
                        *e = e.or(w);
                    }
                    // Only watched pods: one not watched yet is verified
                    // when it is (the node's events of an enrollment come
                    // before that and would verify it twice).
                    due.retain(|c, _| watched.contains_key(c));
                    let now = std::time::Instant::now();
                    due.retain(|&c, _| match pace.admit(c, now) {
                        Ok(()) => {
                            deferred.remove(&c);
                            true
                        }
                        Err(wait) => {
                            // Looked at again once its gap has passed (as if
                            // for every kind: what came meanwhile is folded).
                            if deferred.insert(c) {
                                let tx = tx.clone();
                                tokio::spawn(async move {
                                    tokio::time::sleep(wait).await;
                                    let _ = tx.send((c, Changed::ALL));
                                });
                            }
                            false
                        }
                    });
                    if due.is_empty() {
                        continue;
                    }
                    let this = self.clone();
                    let _ = tokio::task::spawn_blocking(move || {
                        for (cookie, what) in due {
                            if what.tc || what.routing || this.has_unlinked_interface(cookie) {
                                this.repair.verify_one(cookie);
                            } else {
                                this.publish_addrs_of(cookie);
                            }
                        }
                    })
                    .await;
                }
            }
        }
        for (_, task) in watched.into_iter().chain(host_watch.map(|t| (0, t))) {
            task.abort();
        }
    }

    /// Opens a link-event socket in the netns of every held pod not in
    /// `have`; with each, whether the pod already has an interface without
    /// its capture link (one added between its enrollment and now).
    /// Blocking: enters each netns on a thread of its own.
    fn subscribe_new(&self, have: &BTreeSet<u64>) -> Subscriptions {
        let open = self.book.pods().open_netns();
        let mut out = Subscriptions {
            gone: have
                .iter()
                .copied()
                .filter(|c| !open.contains_key(c))
                .collect(),
            new: Vec::new(),
        };
        for (cookie, netns) in open {
            if have.contains(&cookie) {
                continue;
            }
            let dir = self.book.dataplane().pins().pod(cookie);
            let opened = netns.run(|| -> std::io::Result<(Watch, bool)> {
                let sock = Watch::open(&self.open, RTMGRP_WATCHED)?;
                // After subscribing: nothing added from here on is missed.
                Ok((sock, unlinked_here(&dir)?))
            });
            match opened {
                Ok(Ok((sock, unlinked))) => out.new.push((cookie, sock, unlinked)),
                // The pod is leaving, or its netns is gone: the next tick
                // tries again while the pod is still held.
                Ok(Err(e)) => warn!(cookie, error = %e, "cannot watch the pod's interfaces"),
                Err(e) => warn!(cookie, error = %e, "cannot watch the pod's interfaces"),
            }
        }
        out
    }

    /// Whether the pod has an interface without its egress link pinned.
    /// Link events come for much besides new interfaces (state changes,
    /// IPv6's per-interface notices when an address is added): only this
    /// calls for a repair; any other event has the pod's addresses
    /// published as they are now ([`Self::publish_addrs_of`]). An error
    /// says yes: the repair reports it.
    fn has_unlinked_interface(&self, cookie: u64) -> bool {
        let Some(netns) = self.book.pods().netns(cookie) else {
            return false;
        };
        let dir = self.book.dataplane().pins().pod(cookie);
        !matches!(netns.run(|| unlinked_here(&dir)), Ok(Ok(false)))
    }

    /// Publishes the pod's addresses as they are now, if it is still
    /// enrolled: an address added after enrollment names its pod to the
    /// programs from its event on (on kernels without netns cookies in tc,
    /// its SYNs are dropped until then, row X5; the ingress program tells
    /// inbound SYNs to it by it on every kernel). Blocking.
    fn publish_addrs_of(&self, cookie: u64) {
        let Some(netns) = self.book.pods().netns(cookie) else {
            return;
        };
        let mut guard = self.book.dataplane();
        if guard.maps().entry(cookie).is_none() {
            return;
        }
        match crate::podnet::enroll::refresh_addrs(guard.maps_mut(), &netns, cookie) {
            Ok(over) if !over.is_empty() => {
                let uid = guard.maps().meta(cookie).map(|m| m.uid);
                drop(guard);
                if let Some(uid) = uid {
                    self.announcer.too_many_addresses(&uid, &over);
                }
            }
            Ok(_) => {}
            Err(e) => warn!(cookie, error = %e, "cannot publish the pod's addresses"),
        }
    }

    async fn update_watches(
        &self,
        watched: &mut HashMap<u64, JoinHandle<()>>,
        subs: Subscriptions,
        tx: &mpsc::UnboundedSender<(u64, Changed)>,
    ) {
        for cookie in subs.gone {
            if let Some(task) = watched.remove(&cookie) {
                // Resolves once the task is dropped, its socket with it:
                // the count below never includes a socket still open.
                task.abort();
                let _ = task.await;
            }
        }
        for (cookie, sock, unlinked) in subs.new {
            // SAFETY: the AsyncFd owns the socket, so its fd stays open (and
            // the same) while registered.
            let fd = match unsafe { AsyncFd::register_with_interest(sock, Interest::READABLE) } {
                Ok(fd) => fd,
                Err(e) => {
                    warn!(cookie, error = %std::io::Error::from(e), "cannot watch the pod's interfaces");
                    continue;
                }
            };
            // Verified once now that it is watched: a change at its hooks
            // between its enrollment and this subscription sent no event
            // to anyone.
            let _ = tx.send((
                cookie,
                Changed {
                    links: unlinked,
                    tc: true,
                    routing: false,
                },
            ));
            watched.insert(cookie, tokio::spawn(relay(fd, cookie, tx.clone())));
        }
    }
}

/// Whether an interface of the calling thread's netns (not `lo`) has no
/// egress link pinned in the pod's pin directory `dir`.
fn unlinked_here(dir: &std::path::Path) -> std::io::Result<bool> {
    Ok(crate::podnet::netns::interfaces()?
        .into_iter()
        .filter(|i| i != "lo")
        .any(|i| {
            let (l2, l3) = (LinkSpec::Egress(i.clone()), LinkSpec::EgressL3(i));
            !dir.join(l2.pin_name()).exists() && !dir.join(l3.pin_name()).exists()
        }))
}

/// What one subscription pass found: pods no longer held, and new sockets
/// (with whether the pod needs a repair right away).
struct Subscriptions {
    gone: Vec<u64>,
    new: Vec<(u64, Watch, bool)>,
}

/// Sends `cookie` once per batch of events the socket delivers, with what
/// they were about. Only the kind of an event matters, not what it says:
/// each is read into a small buffer, truncated (a netlink datagram is
/// consumed whole whatever the buffer) to its first message's header, so a
/// thousand watched pods do not hold a thousand 64 KiB buffers.
async fn relay(fd: AsyncFd<Watch>, cookie: u64, tx: mpsc::UnboundedSender<(u64, Changed)>) {
    let mut buf: Vec<u8> = Vec::with_capacity(64);
    loop {
        let Ok(mut ready) = fd.readable().await else {
            return;
        };
        let mut changed: Option<Changed> = None;
        loop {
            buf.clear();
            match fd.get_ref().recv(&mut buf) {
                // nlmsghdr: length (4 bytes), then the message type.
                Ok(_) => {
                    let kind = Changed::of_message(&buf);
                    if let Some(kind) = kind {
                        changed = Some(changed.unwrap_or_default().or(kind));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    ready.clear_ready();
                    break;
                }
                // Events were dropped for want of buffer: any kind.
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => changed = Some(Changed::ALL),
                Err(e) => {
                    warn!(cookie, error = %e, "the pod's link-event socket failed; verification every minute remains");
                    return;
                }
            }
        }
        if let Some(what) = changed {
            if tx.send((cookie, what)).is_err() {
                return;
            }
        }
    }
}

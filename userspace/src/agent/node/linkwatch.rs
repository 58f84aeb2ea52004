//! Interfaces a pod gains after its enrollment (a Multus network, a device
//! the app creates) are captured as soon as the kernel announces them, not
//! at the next verification, and a change at the pod's tc hooks is repaired
//! as soon as it is made: one rtnetlink socket per held pod, opened in the
//! pod's netns and subscribed to its link, address and tc events. A tc event
//! (a filter or chain added, replaced or deleted, a qdisc deleted: another
//! tool swapping the program of sluice's filter in place, or deleting it) runs
//! that pod's repair (`Repairer::verify_one`), which reads what the kernel
//! runs at each hook and puts back what differs. A link or address event
//! runs the repair when an interface lacks its links; otherwise it publishes
//! the pod's addresses as they are now. A socket that overflowed (events
//! lost) counts as both. tcx attachments send no netlink event: a foreign
//! tcx program is found by the verification every `VERIFY_EVERY`, which
//! also covers a pod whose netns could not be opened.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    os::fd::{AsRawFd, RawFd},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
use tokio::{
    io::{unix::AsyncFd, Interest},
    sync::{mpsc, watch},
    task::JoinHandle,
};
use tracing::warn;

use super::{announce::Announcer, book::PodBook, pace::Pace, repair::Repairer};
use crate::podnet::podlinks::LinkSpec;

/// rtnetlink's multicast groups of link, tc and address events
/// (`RTMGRP_LINK | RTMGRP_TC | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR`).
const RTMGRP_LINK_TC_AND_ADDRS: u32 = 0x1 | 0x8 | 0x10 | 0x100;

/// What a batch of a pod's events was about.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Changed {
    /// A link or an address.
    links: bool,
    /// A qdisc, filter or chain (`RTM_*QDISC`, `RTM_*TFILTER`, `RTM_*CHAIN`).
    tc: bool,
}

impl Changed {
    const ALL: Changed = Changed {
        links: true,
        tc: true,
    };

    /// What an event of message type `t` is about; `None`: nothing to
    /// look at. `RTM_NEWQDISC` is left out: the kernel broadcasts one for
    /// every qdisc GET (a repair asks which qdisc holds a hook it cannot
    /// attach to), so heeding it would have a pod verify itself in a loop;
    /// and a qdisc added or changed takes nothing from sluice's filters
    /// (taking the hook from them starts with `RTM_DELQDISC`).
    fn of_message_type(t: u16) -> Option<Changed> {
        const RTM_NEWQDISC: u16 = 36;
        // RTM_DELQDISC..RTM_GETTFILTER is 37..=47; RTM_NEWCHAIN..RTM_GETCHAIN 100..=102.
        let tc = (37..=47).contains(&t) || (100..=102).contains(&t);
        (t != RTM_NEWQDISC).then_some(Changed { links: !tc, tc })
    }

    fn or(self, o: Changed) -> Changed {
        Changed {
            links: self.links || o.links,
            tc: self.tc || o.tc,
        }
    }
}
/// How often pods held since the last look get their socket.
const SUBSCRIBE_EVERY: Duration = Duration::from_millis(200);

pub(super) struct LinkWatch {
    book: Arc<PodBook>,
    repair: Arc<Repairer>,
    announcer: Arc<Announcer>,
    /// Link-event sockets open: one per watched pod.
    open: Arc<AtomicUsize>,
}

impl LinkWatch {
    pub(super) fn new(
        book: Arc<PodBook>,
        repair: Arc<Repairer>,
        announcer: Arc<Announcer>,
    ) -> Self {
        Self {
            book,
            announcer,
            repair,
            open: Arc::default(),
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
                            if what.tc || this.has_unlinked_interface(cookie) {
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
        for (_, task) in watched {
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
                let sock = Watch::open(&self.open)?;
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

/// A link-event socket, counted in `open` for as long as it exists (the
/// count is what `sluice status` shows: 0 means no socket is open).
struct Watch {
    sock: Socket,
    open: Arc<AtomicUsize>,
}

impl Watch {
    /// A non-blocking rtnetlink socket in the calling thread's netns,
    /// subscribed to its link events.
    fn open(open: &Arc<AtomicUsize>) -> std::io::Result<Self> {
        // Counted first: the count is never below the sockets open.
        open.fetch_add(1, Ordering::Relaxed);
        let mut w = Self {
            sock: Socket::new(NETLINK_ROUTE).inspect_err(|_| {
                open.fetch_sub(1, Ordering::Relaxed);
            })?,
            open: open.clone(),
        };
        w.sock.bind(&SocketAddr::new(0, RTMGRP_LINK_TC_AND_ADDRS))?;
        w.sock.set_non_blocking(true)?;
        Ok(w)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl AsRawFd for Watch {
    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
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
            match fd.get_ref().sock.recv(&mut buf, 0) {
                // nlmsghdr: length (4 bytes), then the message type.
                Ok(_) => {
                    let kind = match buf.get(4..6) {
                        Some(t) => Changed::of_message_type(u16::from_ne_bytes([t[0], t[1]])),
                        None => Some(Changed::ALL),
                    };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tc_messages_are_told_from_link_and_address_ones() {
        let tc = Changed {
            links: false,
            tc: true,
        };
        let links = Changed {
            links: true,
            tc: false,
        };
        // RTM_DELQDISC, RTM_NEWTFILTER, RTM_DELTFILTER, RTM_NEWCHAIN.
        for t in [37, 44, 45, 100] {
            assert_eq!(Changed::of_message_type(t), Some(tc), "{t}");
        }
        // RTM_NEWLINK, RTM_DELLINK, RTM_NEWADDR.
        for t in [16, 17, 20] {
            assert_eq!(Changed::of_message_type(t), Some(links), "{t}");
        }
        // What every qdisc GET broadcasts: not a change.
        assert_eq!(Changed::of_message_type(36), None);
        assert_eq!(tc.or(links), Changed::ALL);
    }
}

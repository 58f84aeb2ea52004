//! The agent's custody of ztunnel's in-pod listeners.
//!
//! A listener leaves the socket map the moment its socket closes. During a
//! ztunnel upgrade the old ztunnel may close its listeners before the agent
//! has registered the new ztunnel's (registration follows the new one's ack):
//! for that moment a pod would have no listener and its new connections
//! would be refused. So the agent keeps its own duplicate of every listener it
//! registered. The socket then outlives its owner's close and stays in the
//! map, queueing connections, until:
//!
//! - a newer listener for the same role replaces it in the map: the old
//!   duplicate is dropped, the socket closes, and the kernel moves its queued
//!   connections to the new listener of the same reuseport group
//!   (`net.ipv4.tcp_migrate_req=1`, set in every enrolled pod); or
//! - its owner no longer holds it (closed it, or exited: asked with kcmp(2))
//!   and no add for the pod is in flight to a newer ztunnel: then the pod
//!   really has no ztunnel. The listener is *withdrawn*: taken out of the map
//!   at once (the pod fails closed: new SYNs are dropped and retried by the
//!   client) but still held, so connections the kernel had already queued on
//!   it (handshake done, never accepted by the dead ztunnel) move to the next
//!   ztunnel's listener when that one replaces it. Held at most
//!   `--orphan-grace` (default 30 s); then it closes and those connections are reset.

use std::{
    collections::{BTreeMap, HashMap},
    os::fd::OwnedFd,
    sync::Mutex,
    time::{Duration, Instant},
};

use sluice_common::{ListenerKey, Role};

use crate::{
    dataplane::state::Maps,
    podnet::sockets::{owner_holds, Listener},
};

struct Held {
    role: Role,
    /// The families it serves: its keys in the socket map.
    families: Vec<u8>,
    pid: i32,
    owner_fd: i32,
    fd: OwnedFd,
    /// When it was taken out of the map because its owner let go of it.
    withdrawn: Option<Instant>,
}

impl Held {
    fn owner_holds(&self) -> bool {
        owner_holds(self.pid, self.owner_fd, &self.fd)
    }
}

/// Listener duplicates the agent holds, by pod uid.
pub struct Custody {
    held: Mutex<HashMap<String, Vec<Held>>>,
    /// How long withdrawn listeners are held.
    grace: Duration,
}

impl Custody {
    pub fn new(grace: Duration) -> Self {
        Self {
            held: Mutex::default(),
            grace,
        }
    }

    /// Takes the listeners just put in the map for `uid`; the ones they
    /// replace (same role) are released, after the map already points to the
    /// new ones.
    pub fn keep(&self, uid: &str, taken: Vec<Listener>) {
        if taken.is_empty() {
            return;
        }
        let replaced: Vec<Held> = {
            let mut held = self.held.lock().unwrap();
            let mine = held.entry(uid.to_owned()).or_default();
            let (gone, kept) = std::mem::take(mine)
                .into_iter()
                .partition(|h| taken.iter().any(|l| l.role == h.role));
            *mine = kept;
            mine.extend(taken.into_iter().map(|l| Held {
                role: l.role,
                families: l.families,
                pid: l.pid,
                owner_fd: l.owner_fd,
                fd: l.fd,
                withdrawn: None,
            }));
            gone
        };
        drop(replaced);
    }

    /// Puts back into the socket map, from the duplicates held for `uid`
    /// (the pod of netns `cookie`), the entries it lacks: taken out behind
    /// the agent's back (only root on the node can write the map), which
    /// nothing else would put back for the DNS proxy's sockets (the
    /// supervisor sends a pod without its capture listeners back to
    /// ztunnel). Withdrawn listeners, ones their owner no longer holds and
    /// ones of another netns (an earlier sandbox of the same pod) stay out,
    /// and a key the map has (a newer ztunnel's) is left alone. Returns the
    /// roles put back.
    pub fn restore(&self, uid: &str, cookie: u64, maps: &mut Maps) -> Vec<Role> {
        let held = self.held.lock().unwrap();
        let Some(mine) = held.get(uid) else {
            return Vec::new();
        };
        let mut restored = Vec::new();
        for h in mine.iter().filter(|h| h.withdrawn.is_none()) {
            use std::os::fd::AsFd as _;
            let here = crate::podnet::netns::socket_netns_cookie(h.fd.as_fd()).ok() == Some(cookie);
            if !here || !h.owner_holds() {
                continue;
            }
            for family in &h.families {
                let key = ListenerKey::new(cookie, h.role, *family);
                match maps.insert_listener_if_absent(key, &h.fd) {
                    Ok(true) if !restored.contains(&h.role) => restored.push(h.role),
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(%uid, role = ?h.role, error = %e, "could not put ztunnel's listener back in the socket map")
                    }
                }
            }
        }
        restored
    }

    /// Withdraws the listeners whose owner no longer holds them, for `only`
    /// one pod or all, skipping pods for which `in_flight` says an add to a
    /// (newer) ztunnel is under way: that ztunnel's listeners replace them
    /// first. Returns the newly withdrawn (pod uid, role), which the caller
    /// takes out of the socket map; they stay held until replaced or expired.
    pub fn withdraw_orphans(
        &self,
        only: Option<&str>,
        in_flight: impl Fn(&str) -> bool,
    ) -> Vec<(String, Role)> {
        let now = Instant::now();
        let mut held = self.held.lock().unwrap();
        let mut out = Vec::new();
        for (uid, hs) in held.iter_mut() {
            if only.is_some_and(|o| o != uid) || in_flight(uid) {
                continue;
            }
            for h in hs.iter_mut().filter(|h| h.withdrawn.is_none()) {
                if !h.owner_holds() {
                    h.withdrawn = Some(now);
                    out.push((uid.clone(), h.role));
                }
            }
        }
        out
    }

    /// Closes withdrawn listeners held longer than the grace (connections
    /// still queued on them are reset). Returns how many.
    pub fn expire(&self) -> usize {
        let grace = self.grace;
        let expired: Vec<Held> = {
            let mut held = self.held.lock().unwrap();
            let mut out = Vec::new();
            for hs in held.values_mut() {
                let (old, kept) = std::mem::take(hs)
                    .into_iter()
                    .partition(|h: &Held| h.withdrawn.is_some_and(|t| t.elapsed() >= grace));
                *hs = kept;
                out.extend(old);
            }
            held.retain(|_, hs| !hs.is_empty());
            out
        };
        expired.len()
    }

    /// Drops everything held (sluice is leaving the node).
    pub fn forget_all(&self) {
        let gone = std::mem::take(&mut *self.held.lock().unwrap());
        drop(gone);
    }

    /// The socket cookies of the listeners held for `uid` that are in the
    /// socket map (not withdrawn), by role: the sockets a verification of
    /// the pod expects sk_lookup to select. `None`: none held (a pod an
    /// earlier agent registered, before ztunnel's re-ack).
    pub fn cookies(&self, uid: &str) -> Option<Vec<(Role, u64)>> {
        let held = self.held.lock().unwrap();
        let mine: Vec<(Role, u64)> = held
            .get(uid)?
            .iter()
            .filter(|h| h.withdrawn.is_none())
            .filter_map(|h| {
                let cookie: u64 = crate::podnet::netns::getsockopt_raw(
                    std::os::fd::AsFd::as_fd(&h.fd),
                    libc::SOL_SOCKET,
                    libc::SO_COOKIE,
                )
                .ok()?;
                Some((h.role, cookie))
            })
            .collect();
        (!mine.is_empty()).then_some(mine)
    }

    /// Drops everything held for a pod that is no longer enrolled.
    pub fn forget(&self, uid: &str) {
        let gone = self.held.lock().unwrap().remove(uid);
        drop(gone);
    }

    /// The ztunnel processes whose listeners the pod has in the map and
    /// which still hold them.
    pub fn holders(&self, uid: &str) -> Vec<i32> {
        let held = self.held.lock().unwrap();
        let mut pids: Vec<i32> = held
            .get(uid)
            .into_iter()
            .flatten()
            .filter(|h| h.withdrawn.is_none() && h.owner_holds())
            .map(|h| h.pid)
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// For each ztunnel process (pid), how many pods' listeners it owns
    /// (withdrawn ones not counted: their owner is gone).
    pub fn pods_by_owner(&self) -> BTreeMap<i32, usize> {
        let held = self.held.lock().unwrap();
        let mut out = BTreeMap::new();
        for hs in held.values() {
            let mut pids: Vec<i32> = hs
                .iter()
                .filter(|h| h.withdrawn.is_none())
                .map(|h| h.pid)
                .collect();
            pids.sort_unstable();
            pids.dedup();
            for p in pids {
                *out.entry(p).or_default() += 1;
            }
        }
        out
    }
}

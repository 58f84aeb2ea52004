//! The socket maps: ztunnel's capture listeners, and its DNS proxy's
//! sockets (a map of their own, absent from pins of a build before DNS
//! capture).

use std::collections::{HashMap as StdHashMap, HashSet};

use aya::maps::{MapData, SockHash};
use sluice_common::{ListenerKey, Role, FAMILY_V4, FAMILY_V6};

use super::error::{merr, StateError};

pub struct ListenerMaps {
    listeners: SockHash<MapData, ListenerKey>,
    dns: Option<SockHash<MapData, ListenerKey>>,
}

impl ListenerMaps {
    pub fn new(
        listeners: SockHash<MapData, ListenerKey>,
        dns: Option<SockHash<MapData, ListenerKey>>,
    ) -> Self {
        Self { listeners, dns }
    }

    /// Registers a listener: the DNS proxy's sockets in `dns_listeners`,
    /// ztunnel's capture listeners in `listeners`.
    pub fn insert(
        &mut self,
        key: ListenerKey,
        fd: &impl std::os::fd::AsRawFd,
    ) -> Result<(), StateError> {
        if !key.is_dns() {
            return self
                .listeners
                .insert(key, fd.as_raw_fd(), 0)
                .map_err(merr("listeners"));
        }
        match &mut self.dns {
            Some(m) => m
                .insert(key, fd.as_raw_fd(), 0)
                .map_err(merr("dns_listeners")),
            // Pins of a build before DNS capture (adopted, not upgraded):
            // the pod resolves uncaptured, as `status` shows (pass-through).
            None => Ok(()),
        }
    }

    /// [`insert`](Self::insert), unless the key is there already: true when
    /// it was put in (no walk of the map to find out).
    pub fn insert_if_absent(
        &mut self,
        key: ListenerKey,
        fd: &impl std::os::fd::AsRawFd,
    ) -> Result<bool, StateError> {
        const BPF_NOEXIST: u64 = 1;
        let map = match (key.is_dns(), &mut self.dns) {
            (false, _) => &mut self.listeners,
            (true, Some(m)) => m,
            (true, None) => return Ok(false),
        };
        match map.insert(key, fd.as_raw_fd(), BPF_NOEXIST) {
            Ok(()) => Ok(true),
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::EEXIST) =>
            {
                Ok(false)
            }
            Err(e) => Err(merr(if key.is_dns() {
                "dns_listeners"
            } else {
                "listeners"
            })(e)),
        }
    }

    /// Takes a pod's listener for `role` (both families) out of its map.
    pub fn remove(&mut self, cookie: u64, role: Role) {
        for family in [FAMILY_V4, FAMILY_V6] {
            let key = ListenerKey::new(cookie, role, family);
            if role.is_dns() {
                if let Some(m) = &mut self.dns {
                    let _ = m.remove(&key);
                }
            } else {
                let _ = self.listeners.remove(&key);
            }
        }
    }

    /// Takes every listener of a pod out.
    pub fn remove_all(&mut self, cookie: u64) {
        for role in Role::ALL.into_iter().chain(Role::DNS) {
            self.remove(cookie, role);
        }
    }

    fn dns_keys(&self) -> impl Iterator<Item = ListenerKey> + '_ {
        self.dns
            .iter()
            .flat_map(|m| m.keys().filter_map(Result::ok))
    }

    /// Every key, DNS proxy's included.
    fn keys(&self) -> impl Iterator<Item = ListenerKey> + '_ {
        self.listeners
            .keys()
            .filter_map(Result::ok)
            .chain(self.dns_keys())
    }

    /// The pods whose DNS proxy has a socket registered (any family), in
    /// one walk of the socket map.
    pub fn pods_with_dns_listener(&self) -> HashSet<u64> {
        self.dns_keys().map(|k| k.netns_cookie).collect()
    }

    /// The pods that have a listener for every role, in one walk of the
    /// socket map.
    pub fn pods_with_every_listener(&self) -> HashSet<u64> {
        let mut roles: StdHashMap<u64, u8> = Default::default();
        for k in self.listeners.keys().filter_map(Result::ok) {
            *roles.entry(k.netns_cookie).or_default() |= 1 << k.role;
        }
        let all = Role::ALL.iter().fold(0u8, |m, r| m | 1 << *r as u8);
        roles
            .into_iter()
            .filter(|(_, m)| m & all == all)
            .map(|(c, _)| c)
            .collect()
    }

    /// Listener keys registered for a pod, DNS proxy's included (closed
    /// sockets have left by themselves).
    pub fn of(&self, cookie: u64) -> Vec<ListenerKey> {
        self.keys().filter(|k| k.netns_cookie == cookie).collect()
    }

    /// Every pod's listener keys, DNS proxy's included, in one walk of the
    /// socket maps.
    pub fn by_pod(&self) -> StdHashMap<u64, Vec<ListenerKey>> {
        let mut by_pod: StdHashMap<u64, Vec<ListenerKey>> = Default::default();
        for k in self.keys() {
            by_pod.entry(k.netns_cookie).or_default().push(k);
        }
        by_pod
    }

    /// The cookie of every capture listener.
    pub fn cookies(&self) -> impl Iterator<Item = u64> + '_ {
        self.listeners
            .keys()
            .filter_map(Result::ok)
            .map(|k| k.netns_cookie)
    }
}

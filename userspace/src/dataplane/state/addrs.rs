//! The node-wide address map: which pod each address belongs to, as the
//! ingress programs and the address-theft guard know pods.

use std::{collections::HashMap as StdHashMap, net::IpAddr};

use aya::maps::{HashMap, MapData};
use sluice_common::{AddrKey, FAMILY_V4, FAMILY_V6};

use super::error::{merr, StateError};

/// How many addresses one pod may have published by default: pods get one
/// or two from the runtime; the map is node-wide, so no pod may fill it.
pub const DEFAULT_MAX_POD_ADDRESSES: usize = 16;

pub struct AddrMap {
    map: HashMap<MapData, AddrKey, u64>,
    /// Each pod's entries, read once when the map is opened and then kept by
    /// this process's own writes (the map's one writer, as for the uid
    /// index): publishing a pod's addresses costs no walk of the node-wide map.
    held: StdHashMap<u64, Claim>,
}

/// Where a pod's published addresses came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddrSource {
    /// The container runtime gave them (CNI ADD's `prevResult`, the pod's
    /// `status.podIPs`): the pod's by right. They take the address from any
    /// other pod's claim, and the pod's netns is never read for more: an
    /// address a pod adds to its own interface names nothing.
    Runtime,
    /// Read from the pod's netns: a pod enrolled by hand, or one a starting
    /// agent adopted before the runtime's view reached it. Never taken from
    /// another enrolled pod.
    Netns,
}

struct Claim {
    keys: Vec<AddrKey>,
    source: AddrSource,
}

/// What publishing a pod's addresses left out or took.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Published {
    /// Another enrolled pod has them.
    pub refused: Vec<IpAddr>,
    /// Past the per-pod cap: not captured as the pod's.
    pub over_cap: Vec<IpAddr>,
    /// Taken from the pod (netns cookie) that claimed them before: the
    /// runtime gave them to this one.
    pub evicted: Vec<(IpAddr, u64)>,
}

impl AddrMap {
    pub fn new(map: HashMap<MapData, AddrKey, u64>) -> Self {
        let mut m = Self {
            map,
            held: Default::default(),
        };
        // Where the addresses came from is this process's knowledge: after a
        // restart, a pod's are the netns' until the runtime's view comes.
        m.held = m
            .by_pod()
            .into_iter()
            .map(|(c, keys)| {
                let claim = Claim {
                    keys,
                    source: AddrSource::Netns,
                };
                (c, claim)
            })
            .collect();
        m
    }

    /// Where pod `cookie`'s published addresses came from (`None`: it has none).
    pub fn source(&self, cookie: u64) -> Option<AddrSource> {
        self.held.get(&cookie).map(|c| c.source)
    }

    /// Publishes the addresses pod `cookie`'s netns holds: afterwards it
    /// holds exactly those of `addrs` it may have, at most `cap` of them. An
    /// address it held before and no longer has goes (a claim must not
    /// outlive the address: another pod may get it next). An address
    /// another enrolled pod (`enrolled` says which) already has is not taken
    /// over (a pod that adds a neighbour's address to its interface must not
    /// capture or blackhole the neighbour's traffic): it is returned,
    /// refused. One held by a cookie no longer enrolled is stale, and taken
    /// over. Link-local addresses are never published: every interface has
    /// one, and they say nothing of a pod. A pod whose addresses came from
    /// the runtime keeps them: its netns says nothing.
    pub fn set(
        &mut self,
        cookie: u64,
        addrs: &[IpAddr],
        cap: usize,
        enrolled: impl Fn(u64) -> bool,
    ) -> Result<Published, StateError> {
        if self.source(cookie) == Some(AddrSource::Runtime) {
            return Ok(Published::default());
        }
        self.publish(cookie, addrs, cap, AddrSource::Netns, |owner| {
            owner != cookie && enrolled(owner)
        })
    }

    /// Publishes the addresses the runtime gave pod `cookie` (at most `cap`
    /// of them, link-local ones never): they are its from now on, taken from
    /// any pod that claimed them before (returned, evicted: the runtime
    /// does not give one address to two live pods, so that claim is stale
    /// or stolen). Addresses it held before and the runtime no longer gives
    /// it go.
    pub fn claim(
        &mut self,
        cookie: u64,
        addrs: &[IpAddr],
        cap: usize,
    ) -> Result<Published, StateError> {
        self.publish(cookie, addrs, cap, AddrSource::Runtime, |_| false)
    }

    /// Makes `addrs` (up to `cap`) pod `cookie`'s, as `source`; an address
    /// another pod holds is refused where `refuse(owner)` says so, else
    /// taken from it.
    fn publish(
        &mut self,
        cookie: u64,
        addrs: &[IpAddr],
        cap: usize,
        source: AddrSource,
        refuse: impl Fn(u64) -> bool,
    ) -> Result<Published, StateError> {
        let held = self
            .held
            .remove(&cookie)
            .map(|c| c.keys)
            .unwrap_or_default();
        let mut wanted: Vec<AddrKey> = Vec::new();
        for k in addrs.iter().filter(|a| !link_local(a)).map(addr_key) {
            if !wanted.contains(&k) {
                wanted.push(k);
            }
        }
        // Past the cap, the addresses the pod already has come first: adding
        // addresses never takes the pod's own away.
        wanted.sort_by_key(|k| !held.contains(k));
        let mut out = Published::default();
        if wanted.len() > cap {
            out.over_cap = wanted.split_off(cap).iter().map(addr_of).collect();
        }
        for k in held {
            if !wanted.contains(&k) {
                let _ = self.map.remove(&k);
            }
        }
        let mut now = Vec::with_capacity(wanted.len());
        let mut result = Ok(());
        for key in wanted {
            if let Ok(owner) = self.map.get(&key, 0) {
                if owner != cookie && refuse(owner) {
                    out.refused.push(addr_of(&key));
                    continue;
                }
                if owner != cookie {
                    // No longer the old owner's.
                    if let Some(c) = self.held.get_mut(&owner) {
                        c.keys.retain(|k| *k != key);
                    }
                    if source == AddrSource::Runtime {
                        out.evicted.push((addr_of(&key), owner));
                    }
                }
            }
            if let Err(e) = self.map.insert(key, cookie, 0) {
                result = Err(merr("pod_addrs")(e));
                break;
            }
            now.push(key);
        }
        // A runtime claim stands even when empty: the netns is never read
        // for the pod again.
        if !now.is_empty() || source == AddrSource::Runtime {
            self.held.insert(cookie, Claim { keys: now, source });
        }
        result.map(|()| out)
    }

    /// Every pod's addresses, in one walk of the map.
    pub fn by_pod(&self) -> StdHashMap<u64, Vec<AddrKey>> {
        let mut out: StdHashMap<u64, Vec<AddrKey>> = Default::default();
        for (k, c) in self.map.iter().filter_map(Result::ok) {
            out.entry(c).or_default().push(k);
        }
        out
    }

    /// The addresses this process published as pod `cookie`'s (read at
    /// start from the map, then kept): no walk of the map.
    pub fn published(&self, cookie: u64) -> Vec<AddrKey> {
        self.held
            .get(&cookie)
            .map(|c| c.keys.clone())
            .unwrap_or_default()
    }

    pub fn of(&self, cookie: u64) -> Vec<AddrKey> {
        self.map
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, c)| *c == cookie)
            .map(|(k, _)| k)
            .collect()
    }

    pub fn remove(&mut self, cookie: u64) {
        self.held.remove(&cookie);
        for k in self.of(cookie) {
            let _ = self.map.remove(&k);
        }
    }

    /// The cookie of every entry.
    pub fn cookies(&self) -> impl Iterator<Item = u64> + '_ {
        self.map.iter().filter_map(Result::ok).map(|(_, c)| c)
    }
}

/// 169.254.0.0/16 and fe80::/10.
pub fn link_local(a: &IpAddr) -> bool {
    match a {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.segments()[0] & 0xffc0 == 0xfe80,
    }
}

/// The map key of an address: raw network-order words, as the programs read them.
pub fn addr_key(a: &IpAddr) -> AddrKey {
    let words = |b: &[u8]| {
        let mut w = [0u32; 4];
        for (i, c) in b.chunks(4).enumerate() {
            w[i] = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
        }
        w
    };
    match a {
        IpAddr::V4(v4) => AddrKey::new(FAMILY_V4, words(&v4.octets())),
        IpAddr::V6(v6) => AddrKey::new(FAMILY_V6, words(&v6.octets())),
    }
}

/// The address a map key holds (the inverse of [`addr_key`]).
pub fn addr_of(k: &AddrKey) -> IpAddr {
    let mut b = [0u8; 16];
    for (i, w) in k.addr.iter().enumerate() {
        b[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
    }
    if k.family == FAMILY_V4 {
        IpAddr::from([b[0], b[1], b[2], b[3]])
    } else {
        IpAddr::from(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_local_addresses_are_told_apart() {
        for a in ["169.254.7.127", "fe80::1", "febf::1"] {
            assert!(link_local(&a.parse().unwrap()), "{a}");
        }
        for a in ["10.244.1.7", "fd00::7", "fec0::1", "::1"] {
            assert!(!link_local(&a.parse().unwrap()), "{a}");
        }
    }

    #[test]
    fn addresses_round_trip_through_their_map_keys() {
        for a in ["10.244.1.7", "fd00:10:244::7", "::1"] {
            let ip: IpAddr = a.parse().unwrap();
            assert_eq!(addr_of(&addr_key(&ip)), ip);
        }
    }
}

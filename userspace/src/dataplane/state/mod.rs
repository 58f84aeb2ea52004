//! Typed access to the pinned maps: the shared pod-state map (the single
//! source of truth for enrollment), pod identities, listeners and counters.
//! Everything `status` reports is read from here, never from process memory.
//!
//! [`Maps::attach`] and [`Maps::apply`] are the only writers of a pod's
//! state and identity: the state machine (`lifecycle`) decides, they write.
//! The other maps each have a file of their own.

mod addrs;
mod counters;
mod error;
mod identity;
mod listeners;
mod options;
mod records;

use std::{
    collections::{HashMap as StdHashMap, HashSet},
    net::IpAddr,
    path::Path,
};

use aya::maps::{HashMap, Map, MapData};
use sluice_common::{
    AddrKey, Counters, DnsCounters, DropReason, FlowHint, FlowKey, ListenerKey, PodEntry, PodMeta,
    PodState, Role,
};

use crate::{
    lifecycle::{self, Applied, Event, IllegalTransition, Observer},
    options::PodOptions,
    uid::PodUid,
    workload::Workload,
};

pub use crate::workload::PodIdentity;
pub use addrs::{addr_key, addr_of, link_local, AddrSource, Published, DEFAULT_MAX_POD_ADDRESSES};
pub use counters::Retired;
pub use error::StateError;
pub use records::{DnsMode, DnsView, PodRecord};

use self::{
    addrs::AddrMap, counters::CounterMaps, error::merr, listeners::ListenerMaps,
    options::OptionMaps,
};

pub struct Maps {
    pod_state: HashMap<MapData, u64, PodEntry>,
    pod_meta: HashMap<MapData, u64, PodMeta>,
    addrs: AddrMap,
    listeners: ListenerMaps,
    counters: CounterMaps,
    flow_hints: HashMap<MapData, FlowKey, FlowHint>,
    /// `None` on pins of a build before it.
    flow_hints_overflow: Option<HashMap<MapData, FlowKey, FlowHint>>,
    options: OptionMaps,
    /// Told of every state change (the agent; none for the CLI).
    observer: Option<Observer>,
    /// uid → netns cookie of every pod in `pod_meta`, and each cookie's
    /// identity: read once when the maps are opened, then kept by this
    /// process's own inserts and removals (it is the maps' one writer: CLI
    /// commands go through a running agent), so an enrollment's "already
    /// enrolled?" costs no walk of the map, and telling the observer of an
    /// event that changed nothing (a served recheck, every pod, every 30 s)
    /// costs no map lookup.
    uids: StdHashMap<String, u64>,
    identities: StdHashMap<u64, PodIdentity>,
    /// At most this many addresses per pod in the node-wide address map.
    addr_cap: usize,
}

impl Maps {
    /// Opens the maps pinned under `dir` (no programs needed: `status` uses this).
    pub fn open_pinned(dir: &Path) -> Result<Self, StateError> {
        let open = |name: &'static str| -> Result<Map, StateError> {
            let data = MapData::from_pin(dir.join(name)).map_err(merr(name))?;
            Map::from_map_data(data).map_err(merr(name))
        };
        Self::from_maps(open)
    }

    /// Builds the typed maps from a source of untyped ones. Maps a build
    /// before them lacks are optional (`None` on such pins).
    pub fn from_maps(
        mut take: impl FnMut(&'static str) -> Result<Map, StateError>,
    ) -> Result<Self, StateError> {
        Ok(Self {
            pod_state: take("pod_state")?.try_into().map_err(merr("pod_state"))?,
            pod_meta: take("pod_meta")?.try_into().map_err(merr("pod_meta"))?,
            addrs: AddrMap::new(take("pod_addrs")?.try_into().map_err(merr("pod_addrs"))?),
            listeners: ListenerMaps::new(
                take("listeners")?.try_into().map_err(merr("listeners"))?,
                optional(take("dns_listeners")),
            ),
            counters: CounterMaps::new(
                take("counters")?.try_into().map_err(merr("counters"))?,
                optional(take("dns_counters")),
                optional(take("drops")),
                optional(take("hints_over_share")),
                optional(take("excluded")),
            ),
            flow_hints: take("flow_hints")?.try_into().map_err(merr("flow_hints"))?,
            flow_hints_overflow: optional(take("flow_hints_overflow")),
            options: OptionMaps::new(
                optional(take("pod_flags")),
                optional(take("pod_reroute")),
                optional(take("pod_exclusions")),
                optional(take("local_route")),
            ),
            observer: None,
            uids: Default::default(),
            identities: Default::default(),
            addr_cap: addrs::DEFAULT_MAX_POD_ADDRESSES,
        }
        .with_uid_index())
    }
}

impl Maps {
    /// Fills the uid and identity indexes from one walk of `pod_meta`.
    fn with_uid_index(mut self) -> Self {
        for (cookie, m) in self.pod_meta.iter().filter_map(Result::ok) {
            self.uids.insert(identity::uid_of(&m), cookie);
            self.identities.insert(cookie, identity::identity_of(&m));
        }
        self
    }

    /// Reports every later event the map takes to `o`.
    pub fn observe(&mut self, o: Observer) {
        self.observer = Some(o);
    }

    /// Records a new pod ([`Event::Attach`]: `Pending`): identity first, then
    /// state (the programs read only the state, so the pod is never
    /// half-visible).
    pub fn attach(
        &mut self,
        cookie: u64,
        uid: &PodUid,
        netns_path: &str,
        workload: &Workload,
        now_ns: u64,
    ) -> Result<(), StateError> {
        let meta = identity::meta_of(uid, netns_path, workload);
        self.change(cookie, Event::Attach, now_ns, Some(meta))
            .map(drop)
    }

    /// Tells the pod's row that `event` happened: the state machine
    /// ([`lifecycle::decide`]) picks its next state, which is written here
    /// (nothing when it stays). Returns the state the pod is in now.
    /// [`Event::TornDown`] removes every entry of the pod from every map
    /// (missing ones are fine).
    pub fn apply(
        &mut self,
        cookie: u64,
        event: Event,
        now_ns: u64,
    ) -> Result<Option<PodState>, StateError> {
        self.change(cookie, event, now_ns, None)
    }

    /// The one place a pod's state is written: asks the state machine,
    /// writes what it decided, and tells the observer. `meta` (new pods
    /// only) is written before the state.
    fn change(
        &mut self,
        cookie: u64,
        event: Event,
        now_ns: u64,
        meta: Option<PodMeta>,
    ) -> Result<Option<PodState>, StateError> {
        let before = self.pod_state.get(&cookie, 0).ok();
        let from = before.and_then(|e| e.state());
        let illegal = |illegal| IllegalTransition { cookie, illegal };
        // A new pod has no entry yet; an entry this build cannot read may
        // only be removed.
        let unreadable = before.is_some() && from.is_none();
        let fits = match event {
            Event::Attach => before.is_none() && meta.is_some(),
            Event::TornDown | Event::Drain => meta.is_none(),
            _ => !unreadable && meta.is_none(),
        };
        if !fits {
            return Err(illegal(lifecycle::Illegal {
                from,
                event: event.name(),
            })
            .into());
        }
        let to = lifecycle::decide(from, &event).map_err(illegal)?;
        if before.is_none() && to.is_none() {
            // Debris in the other maps goes all the same.
            self.remove_entries(cookie);
            return Ok(None);
        }
        if before.is_some() && from == to {
            self.tell(cookie, event, from, to);
            return Ok(to);
        }
        if let Some(m) = meta {
            self.pod_meta
                .insert(cookie, m, 0)
                .map_err(merr("pod_meta"))?;
            self.uids.insert(identity::uid_of(&m), cookie);
            self.identities.insert(cookie, identity::identity_of(&m));
            if before.is_none() {
                crate::fault::crash_point("enroll:identity");
            }
        }
        let pod = self.identity(cookie);
        match to {
            Some(state) => {
                let entry = match before {
                    Some(mut e) => {
                        e.state = state as u32;
                        e.generation = e.generation.wrapping_add(1);
                        e.changed_at_ns = now_ns;
                        e
                    }
                    None => PodEntry {
                        state: state as u32,
                        generation: 1,
                        enrolled_at_ns: now_ns,
                        changed_at_ns: now_ns,
                    },
                };
                self.pod_state
                    .insert(cookie, entry, 0)
                    .map_err(merr("pod_state"))?;
            }
            None => self.remove_entries(cookie),
        }
        if let Some(o) = &self.observer {
            o(&Applied {
                cookie,
                pod,
                event,
                from,
                to,
            });
        }
        Ok(to)
    }

    /// Tells the observer of an event that left the state as it was.
    fn tell(&self, cookie: u64, event: Event, from: Option<PodState>, to: Option<PodState>) {
        if let Some(o) = &self.observer {
            o(&Applied {
                cookie,
                pod: self.identity(cookie),
                event,
                from,
                to,
            });
        }
    }

    /// Removes what a pod with an identity but no state entry left in the
    /// maps: the debris of a process killed between a pod's identity and its
    /// state (written in that order, removed in the other). Its uid would
    /// read as enrolled for good. Only under the dataplane's lock, where no
    /// enrollment stands between the two writes. Whether there was any.
    pub fn sweep_stateless(&mut self, cookie: u64) -> bool {
        if self.entry(cookie).is_some() || self.pod_meta.get(&cookie, 0).is_err() {
            return false;
        }
        self.remove_entries(cookie);
        true
    }

    /// Removes every entry of the pod, the state last but its identity.
    fn remove_entries(&mut self, cookie: u64) {
        self.options.remove(cookie);
        self.listeners.remove_all(cookie);
        self.counters.remove_dns(cookie);
        let hints: Vec<FlowKey> = self
            .flow_hints
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, h)| h.netns_cookie == cookie)
            .map(|(k, _)| k)
            .collect();
        for k in hints {
            let _ = self.flow_hints.remove(&k);
        }
        self.addrs.remove(cookie);
        self.counters.remove(cookie);
        let _ = self.pod_state.remove(&cookie);
        let _ = self.pod_meta.remove(&cookie);
        self.uids.retain(|_, c| *c != cookie);
        self.identities.remove(&cookie);
    }

    /// Who the pod is, from memory (the map where memory has nothing, e.g.
    /// an entry another process wrote).
    fn identity(&self, cookie: u64) -> Option<PodIdentity> {
        self.identities
            .get(&cookie)
            .cloned()
            .or_else(|| self.meta(cookie))
    }
}

/// Readers, and the writers of the maps besides a pod's state.
impl Maps {
    pub fn entry(&self, cookie: u64) -> Option<PodEntry> {
        self.pod_state.get(&cookie, 0).ok()
    }

    /// Every pod's state entry, by netns cookie (cheap: one map walk).
    pub fn states(&self) -> Vec<(u64, PodEntry)> {
        self.pod_state.iter().filter_map(Result::ok).collect()
    }

    /// Netns cookie of the pod with this uid, if enrolled.
    pub fn find_uid(&self, uid: &PodUid) -> Option<u64> {
        // From memory; a hit is checked against the map (one lookup).
        let cookie = *self.uids.get(uid.as_str())?;
        self.meta(cookie)
            .is_some_and(|m| m.uid == uid.as_str())
            .then_some(cookie)
    }

    pub fn meta(&self, cookie: u64) -> Option<PodIdentity> {
        let m = self.pod_meta.get(&cookie, 0).ok()?;
        Some(identity::identity_of(&m))
    }

    /// Publishes pod `cookie`'s addresses to the ingress programs. An
    /// address another enrolled pod already has is not taken over: it is
    /// returned, refused (`AddrMap::set`).
    pub fn set_addrs(&mut self, cookie: u64, addrs: &[IpAddr]) -> Result<Published, StateError> {
        let pod_state = &self.pod_state;
        self.addrs.set(cookie, addrs, self.addr_cap, |owner| {
            pod_state.get(&owner, 0).is_ok()
        })
    }

    /// Publishes the addresses the runtime gave pod `cookie`: its from now
    /// on, taken from any pod that claimed them before (returned, evicted),
    /// never re-read from its netns (`AddrMap::claim`).
    pub fn claim_addrs(&mut self, cookie: u64, addrs: &[IpAddr]) -> Result<Published, StateError> {
        self.addrs.claim(cookie, addrs, self.addr_cap)
    }

    /// Where pod `cookie`'s published addresses came from.
    pub fn addr_source(&self, cookie: u64) -> Option<AddrSource> {
        self.addrs.source(cookie)
    }

    /// How many addresses one pod may have published (`--max-pod-addresses`).
    pub fn set_addr_cap(&mut self, cap: usize) {
        self.addr_cap = cap;
    }

    /// Every pod's addresses, in one walk of the address map.
    pub fn addrs_by_pod(&self) -> StdHashMap<u64, Vec<AddrKey>> {
        self.addrs.by_pod()
    }

    /// The addresses published as pod `cookie`'s, as this process
    /// recorded them (no walk of the node-wide map; [`Self::addrs_of`]
    /// reads the map).
    pub fn published_addrs(&self, cookie: u64) -> Vec<AddrKey> {
        self.addrs.published(cookie)
    }

    pub fn addrs_of(&self, cookie: u64) -> Vec<AddrKey> {
        self.addrs.of(cookie)
    }

    /// Registers a listener: the DNS proxy's sockets in `dns_listeners`,
    /// ztunnel's capture listeners in `listeners`.
    pub fn insert_listener(
        &mut self,
        key: ListenerKey,
        fd: &impl std::os::fd::AsRawFd,
    ) -> Result<(), StateError> {
        self.listeners.insert(key, fd)
    }

    /// [`insert_listener`](Self::insert_listener) unless the key is there:
    /// true when it was put in.
    pub fn insert_listener_if_absent(
        &mut self,
        key: ListenerKey,
        fd: &impl std::os::fd::AsRawFd,
    ) -> Result<bool, StateError> {
        self.listeners.insert_if_absent(key, fd)
    }

    /// Takes a pod's listener for `role` (both families) out of the socket map.
    pub fn remove_listener(&mut self, cookie: u64, role: Role) {
        self.listeners.remove(cookie, role)
    }

    /// The pods whose DNS proxy has a socket registered (any family), in
    /// one walk of the socket map.
    pub fn pods_with_dns_listener(&self) -> HashSet<u64> {
        self.listeners.pods_with_dns_listener()
    }

    /// The pods that have a listener for every role, in one walk of the
    /// socket map.
    pub fn pods_with_every_listener(&self) -> HashSet<u64> {
        self.listeners.pods_with_every_listener()
    }

    /// Listener keys registered for a pod, DNS proxy's included (closed
    /// sockets have left by themselves).
    pub fn listeners_of(&self, cookie: u64) -> Vec<ListenerKey> {
        self.listeners.of(cookie)
    }

    /// The flow hint the tc programs left for `key`, if any (expired or
    /// not), where the programs look: `flow_hints`, then the overflow map.
    pub fn flow_hint(&self, key: &FlowKey) -> Option<FlowHint> {
        self.flow_hints.get(key, 0).ok().or_else(|| {
            self.flow_hints_overflow
                .as_ref()
                .and_then(|m| m.get(key, 0).ok())
        })
    }

    /// Flow hints written past their pod's share, node-wide (see
    /// `sluice_common::HINTS_PER_POD_PER_S`).
    pub fn hints_over_share(&self) -> u64 {
        self.counters.hints_over_share()
    }

    /// What the pods whose counters went had counted (see [`Retired`]).
    pub fn retired_counters(&self) -> Retired {
        self.counters.retired()
    }

    /// Packets the programs dropped node-wide for `reason`, summed over CPUs.
    pub fn drops(&self, reason: DropReason) -> u64 {
        self.counters.drops(reason)
    }

    pub fn counters(&self, cookie: u64) -> Counters {
        self.counters.counters(cookie)
    }

    /// Connections the pod's exclusions kept out of capture.
    pub fn excluded(&self, cookie: u64) -> sluice_common::ExcludedCounters {
        self.counters.excluded(cookie)
    }

    pub fn dns_counters(&self, cookie: u64) -> DnsCounters {
        self.counters.dns_counters(cookie)
    }

    /// A pod's DNS mode: whether the programs capture its DNS (its
    /// `pod_flags` bit) and whether its proxy has a socket to send it to.
    pub fn dns_mode(&self, cookie: u64, has_proxy: bool) -> DnsMode {
        DnsMode::of(self.dns_on(cookie), has_proxy)
    }

    /// Writes a pod's options for the programs (nothing to write: no
    /// entry), DNS capture resolved against the node's default `node_dns`.
    pub fn set_options(
        &mut self,
        cookie: u64,
        o: &PodOptions,
        node_dns: bool,
    ) -> Result<(), StateError> {
        self.options.set(cookie, o, node_dns)
    }

    /// Whether the programs capture the pod's DNS (its `pod_flags` bit).
    pub fn dns_on(&self, cookie: u64) -> bool {
        self.options.dns_on(cookie)
    }

    /// Puts pod `cookie` on the local route, leaving by interface `uplink`,
    /// or (`None`) takes it off (its `local_route` entry).
    pub fn set_local_route(&mut self, cookie: u64, uplink: Option<u32>) -> Result<(), StateError> {
        self.options.set_local_route(cookie, uplink)
    }

    /// The interface index pod `cookie` leaves by when its TCP takes the
    /// local route; `None`: it does not.
    pub fn local_route(&self, cookie: u64) -> Option<u32> {
        self.options.local_route(cookie)
    }

    /// A pod's options as they were written at its enrollment.
    pub fn options(&self, cookie: u64) -> PodOptions {
        self.options.get(cookie)
    }

    /// Every cookie with any entry in a per-pod map (for cleanup and checks).
    pub fn cookies(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .pod_state
            .keys()
            .chain(self.pod_meta.keys())
            .filter_map(Result::ok)
            .chain(self.counters.cookies())
            .chain(self.addrs.cookies())
            .chain(self.listeners.cookies())
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// All enrolled pods, sorted by uid.
    pub fn pods(&self) -> Vec<PodRecord> {
        // One walk of the socket maps for all pods (not one per pod).
        let by_pod = self.listeners.by_pod();
        let addrs = self.addrs_by_pod();
        let mut pods: Vec<PodRecord> = self
            .pod_state
            .iter()
            .filter_map(Result::ok)
            .map(|(cookie, e)| {
                let (uid, netns, workload) = self
                    .meta(cookie)
                    .map(|m| (m.uid, m.netns, Some(m.workload)))
                    .unwrap_or_default();
                let keys = by_pod.get(&cookie).map(Vec::as_slice).unwrap_or_default();
                let has_proxy = keys.iter().any(ListenerKey::is_dns);
                let options = self.options(cookie);
                let dns = DnsView::new(
                    self.dns_mode(cookie, has_proxy),
                    options.dns,
                    &self.dns_counters(cookie),
                );
                PodRecord {
                    uid,
                    netns,
                    workload,
                    netns_cookie: cookie,
                    state: e.state(),
                    served: e.state() == Some(PodState::Served),
                    generation: e.generation,
                    enrolled_at_ns: e.enrolled_at_ns,
                    changed_at_ns: e.changed_at_ns,
                    listeners: records::listener_names(keys),
                    counters: self.counters(cookie),
                    dns,
                    addresses: addrs
                        .get(&cookie)
                        .map(|ks| ks.iter().map(addr_of).collect())
                        .unwrap_or_default(),
                    links: Vec::new(),
                    bypass_inbound: options.bypass_inbound,
                    reroute: options.reroute,
                    local_route: self.local_route(cookie),
                    exclusions: options.exclusions,
                    excluded: self.counters.excluded(cookie),
                }
            })
            .collect();
        pods.sort_by(|a, b| a.uid.cmp(&b.uid));
        pods
    }
}

/// A map a build before it lacks: `None` when it is absent or not of this
/// build's type.
fn optional<T: TryFrom<Map>>(m: Result<Map, StateError>) -> Option<T> {
    m.ok().and_then(|m| m.try_into().ok())
}

/// CLOCK_BOOTTIME in ns: the clock the pod-state timestamps use (monotonic,
/// survives agent restarts, same clock as bpf_ktime_get_boot_ns).
pub fn boottime_ns() -> u64 {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
        .expect("CLOCK_BOOTTIME is always available on Linux");
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}

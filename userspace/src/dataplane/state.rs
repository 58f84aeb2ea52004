//! Typed access to the pinned maps: the shared pod-state map (the single
//! source of truth for enrollment), pod identities, listeners and counters.
//! Everything `status` reports is read from here, never from process memory.

use std::path::Path;

use aya::maps::{HashMap, Map, MapData, MapError, PerCpuArray, PerCpuHashMap, SockHash};
use serde::Serialize;
use std::net::IpAddr;

use sluice_common::{
    AddrKey, Counters, DnsCounters, DropReason, FlowHint, FlowKey, ListenerKey, PodEntry, PodMeta,
    PodState, Role, FAMILY_V4, FAMILY_V6, NAMESPACE_LEN, NETNS_PATH_LEN, POD_NAME_LEN, POD_UID_LEN,
    REROUTE_LEN, SERVICE_ACCOUNT_LEN,
};

use crate::{
    lifecycle::{self, Applied, Event, IllegalTransition, Observer},
    options::{DnsChoice, PodOptions},
    uid::PodUid,
    workload::Workload,
};

pub use crate::workload::PodIdentity;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        source: MapError,
    },
    #[error("map {0} missing from the eBPF object")]
    Missing(&'static str),
    #[error(transparent)]
    Illegal(#[from] IllegalTransition),
}

fn merr(name: &'static str) -> impl FnOnce(MapError) -> StateError {
    move |source| StateError::Map { name, source }
}

pub struct Maps {
    pod_state: HashMap<MapData, u64, PodEntry>,
    pod_meta: HashMap<MapData, u64, PodMeta>,
    pod_addrs: HashMap<MapData, AddrKey, u64>,
    listeners: SockHash<MapData, ListenerKey>,
    counters: PerCpuHashMap<MapData, u64, Counters>,
    flow_hints: HashMap<MapData, FlowKey, FlowHint>,
    /// Per-pod options; `None` on pins of a build before it (a CLI adopting
    /// them: the agent's upgrade creates the map).
    pod_flags: Option<HashMap<MapData, u64, u32>>,
    pod_reroute: Option<HashMap<MapData, u64, [u8; REROUTE_LEN]>>,
    /// ztunnel's DNS proxy sockets and the DNS counters; `None` as `pod_flags`.
    dns_listeners: Option<SockHash<MapData, ListenerKey>>,
    dns_counters: Option<PerCpuHashMap<MapData, u64, DnsCounters>>,
    /// Node-wide drops by `DropReason`; `None` as `pod_flags`.
    drops: Option<PerCpuArray<MapData, u64>>,
    /// Told of every state change (the agent; none for the CLI).
    observer: Option<Observer>,
    /// uid → netns cookie of every pod in `pod_meta`: read once when the
    /// maps are opened, then kept by this process's own inserts and
    /// removals (it is the maps' one writer: CLI commands go through a
    /// running agent), so an enrollment's "already enrolled?" costs no walk
    /// of the map.
    uids: std::collections::HashMap<String, u64>,
}

/// One enrolled pod, as the maps describe it.
#[derive(Debug, Clone, Serialize)]
pub struct PodRecord {
    pub uid: String,
    pub netns: String,
    pub workload: Option<Workload>,
    pub netns_cookie: u64,
    /// `None` when the map holds a state this build does not know (`null`
    /// in JSON; the state's name otherwise).
    pub state: Option<PodState>,
    /// ztunnel knows the pod's workload (state `Served`): fully enrolled.
    pub served: bool,
    pub generation: u32,
    pub enrolled_at_ns: u64,
    pub changed_at_ns: u64,
    /// Registered listeners as "role/family", e.g. "inbound/ipv4".
    pub listeners: Vec<String>,
    pub counters: Counters,
    /// DNS capture: the pod's choice, whether it is on, and its counters.
    pub dns: DnsView,
    /// `ambient.istio.io/bypass-inbound-capture`: inbound not captured.
    pub bypass_inbound: bool,
    /// `istio.io/reroute-virtual-interfaces`: interfaces whose TCP is the
    /// pod's outbound.
    pub reroute: Vec<String>,
    /// The pod's addresses in the node-wide address map (what inbound
    /// capture and the address-theft guard know the pod by).
    pub addresses: Vec<IpAddr>,
    /// The pod's pinned links (`steer`, `egress_eth0`, `lo`, `host_eth0`…),
    /// from the bpffs (filled by `status::read`; empty from the maps alone).
    pub links: Vec<String>,
}

/// A pod's DNS capture as `status` shows it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct DnsView {
    /// `captured` (on, and ztunnel's DNS proxy has sockets in the pod),
    /// `pass-through` (on, but no proxy socket: queries go to the resolver
    /// uncaptured), or `off`.
    pub mode: DnsMode,
    /// Who decided: `node-default` (`--dns-capture`), or the pod's
    /// annotations (`on`, `off`).
    pub choice: DnsChoice,
    pub captured_udp: u64,
    pub captured_tcp: u64,
    pub passthrough: u64,
    pub replies_restored: u64,
    pub replies_unmapped: u64,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum DnsMode {
    Captured,
    PassThrough,
    Off,
}

impl DnsMode {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Captured => "captured",
            Self::PassThrough => "pass-through",
            Self::Off => "off",
        }
    }
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

    /// Builds the typed maps from a source of untyped ones.
    pub fn from_maps(
        mut take: impl FnMut(&'static str) -> Result<Map, StateError>,
    ) -> Result<Self, StateError> {
        Ok(Self {
            pod_state: take("pod_state")?.try_into().map_err(merr("pod_state"))?,
            pod_meta: take("pod_meta")?.try_into().map_err(merr("pod_meta"))?,
            pod_addrs: take("pod_addrs")?.try_into().map_err(merr("pod_addrs"))?,
            listeners: take("listeners")?.try_into().map_err(merr("listeners"))?,
            counters: take("counters")?.try_into().map_err(merr("counters"))?,
            flow_hints: take("flow_hints")?.try_into().map_err(merr("flow_hints"))?,
            pod_flags: take("pod_flags").ok().and_then(|m| m.try_into().ok()),
            pod_reroute: take("pod_reroute").ok().and_then(|m| m.try_into().ok()),
            dns_listeners: take("dns_listeners").ok().and_then(|m| m.try_into().ok()),
            dns_counters: take("dns_counters").ok().and_then(|m| m.try_into().ok()),
            drops: take("drops").ok().and_then(|m| m.try_into().ok()),
            observer: None,
            uids: Default::default(),
        }
        .with_uid_index())
    }

    /// Fills the uid index from one walk of `pod_meta`.
    fn with_uid_index(mut self) -> Self {
        self.uids = self
            .pod_meta
            .iter()
            .filter_map(Result::ok)
            .map(|(cookie, m)| (cstr(&m.uid), cookie))
            .collect();
        self
    }

    /// Reports every later event the map takes to `o`.
    pub fn observe(&mut self, o: Observer) {
        self.observer = Some(o);
    }

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
        self.pod_meta.get(&cookie, 0).ok().map(|m| PodIdentity {
            uid: cstr(&m.uid),
            netns: cstr(&m.netns_path),
            workload: Workload {
                name: cstr(&m.name),
                namespace: cstr(&m.namespace),
                service_account: cstr(&m.service_account),
            },
        })
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
        let mut meta = PodMeta {
            uid: [0; POD_UID_LEN],
            netns_path: [0; NETNS_PATH_LEN],
            name: [0; POD_NAME_LEN],
            namespace: [0; NAMESPACE_LEN],
            service_account: [0; SERVICE_ACCOUNT_LEN],
        };
        // Lengths were validated by PodUid, Workload and the enroll path check.
        fill(&mut meta.uid, uid.as_str());
        fill(&mut meta.netns_path, netns_path);
        fill(&mut meta.name, &workload.name);
        fill(&mut meta.namespace, &workload.namespace);
        fill(&mut meta.service_account, &workload.service_account);
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
            self.uids.insert(cstr(&m.uid), cookie);
        }
        let pod = self.meta(cookie);
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
                pod: self.meta(cookie),
                event,
                from,
                to,
            });
        }
    }

    /// Makes the pod's addresses known to the ingress programs. An address
    /// held by another cookie is taken over: that netns is gone (addresses are
    /// unique on a node) and its entry is stale.
    /// Publishes pod `cookie`'s addresses to the ingress programs. An
    /// address another enrolled pod already has is not taken over (a pod that
    /// adds a neighbour's address to its interface must not capture or
    /// blackhole the neighbour's traffic): it is returned, refused.
    pub fn set_addrs(&mut self, cookie: u64, addrs: &[IpAddr]) -> Result<Vec<IpAddr>, StateError> {
        let mut refused = Vec::new();
        for a in addrs {
            let key = addr_key(a);
            if let Ok(owner) = self.pod_addrs.get(&key, 0) {
                if owner != cookie && self.pod_state.get(&owner, 0).is_ok() {
                    refused.push(*a);
                    continue;
                }
            }
            self.pod_addrs
                .insert(key, cookie, 0)
                .map_err(merr("pod_addrs"))?;
        }
        Ok(refused)
    }

    /// Every pod's addresses, in one walk of the address map.
    pub fn addrs_by_pod(&self) -> std::collections::HashMap<u64, Vec<AddrKey>> {
        let mut out: std::collections::HashMap<u64, Vec<AddrKey>> = Default::default();
        for (k, c) in self.pod_addrs.iter().filter_map(Result::ok) {
            out.entry(c).or_default().push(k);
        }
        out
    }

    pub fn addrs_of(&self, cookie: u64) -> Vec<AddrKey> {
        self.pod_addrs
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, c)| *c == cookie)
            .map(|(k, _)| k)
            .collect()
    }

    /// Registers a listener: the DNS proxy's sockets in `dns_listeners`,
    /// ztunnel's capture listeners in `listeners`.
    pub fn insert_listener(
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
        match &mut self.dns_listeners {
            Some(m) => m
                .insert(key, fd.as_raw_fd(), 0)
                .map_err(merr("dns_listeners")),
            // Pins of a build before DNS capture (adopted, not upgraded):
            // the pod resolves uncaptured, as `status` shows (pass-through).
            None => Ok(()),
        }
    }

    /// Takes a pod's listener for `role` (both families) out of the socket map.
    pub fn remove_listener(&mut self, cookie: u64, role: Role) {
        for family in [FAMILY_V4, FAMILY_V6] {
            let key = ListenerKey::new(cookie, role, family);
            if role.is_dns() {
                if let Some(m) = &mut self.dns_listeners {
                    let _ = m.remove(&key);
                }
            } else {
                let _ = self.listeners.remove(&key);
            }
        }
    }

    /// The pods whose DNS proxy has a socket registered (any family), in
    /// one walk of the socket map.
    pub fn pods_with_dns_listener(&self) -> std::collections::HashSet<u64> {
        self.dns_listener_keys().map(|k| k.netns_cookie).collect()
    }

    fn dns_listener_keys(&self) -> impl Iterator<Item = ListenerKey> + '_ {
        self.dns_listeners
            .iter()
            .flat_map(|m| m.keys().filter_map(Result::ok))
    }

    /// The flow hint the tc programs left for `key`, if any (expired or not).
    pub fn flow_hint(&self, key: &FlowKey) -> Option<FlowHint> {
        self.flow_hints.get(key, 0).ok()
    }

    /// Packets the programs dropped node-wide for `reason`, summed over CPUs.
    pub fn drops(&self, reason: DropReason) -> u64 {
        self.drops
            .as_ref()
            .and_then(|m| m.get(&(reason as u32), 0).ok())
            .map_or(0, |per_cpu| per_cpu.iter().sum())
    }

    pub fn dns_counters(&self, cookie: u64) -> DnsCounters {
        let mut sum = DnsCounters::default();
        if let Some(Ok(per_cpu)) = self.dns_counters.as_ref().map(|m| m.get(&cookie, 0)) {
            for c in per_cpu.iter() {
                sum.add(c);
            }
        }
        sum
    }

    /// A pod's DNS mode: whether the programs capture its DNS (its
    /// `pod_flags` bit) and whether its proxy has a socket to send it to.
    pub fn dns_mode(&self, cookie: u64, has_proxy: bool) -> DnsMode {
        match (self.dns_on(cookie), has_proxy) {
            (false, _) => DnsMode::Off,
            (true, true) => DnsMode::Captured,
            (true, false) => DnsMode::PassThrough,
        }
    }

    /// A pod's DNS capture as `status` reports it; `choice` from its options.
    fn dns_view(&self, cookie: u64, has_proxy: bool, choice: DnsChoice) -> DnsView {
        let c = self.dns_counters(cookie);
        DnsView {
            mode: self.dns_mode(cookie, has_proxy),
            choice,
            captured_udp: c.captured_udp,
            captured_tcp: c.captured_tcp,
            passthrough: c.passthrough,
            replies_restored: c.replies_restored,
            replies_unmapped: c.replies_unmapped,
        }
    }

    /// The pods that have a listener for every role, in one walk of the
    /// socket map.
    pub fn pods_with_every_listener(&self) -> std::collections::HashSet<u64> {
        let mut roles: std::collections::HashMap<u64, u8> = Default::default();
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
    pub fn listeners_of(&self, cookie: u64) -> Vec<ListenerKey> {
        self.listeners
            .keys()
            .filter_map(Result::ok)
            .chain(self.dns_listener_keys())
            .filter(|k| k.netns_cookie == cookie)
            .collect()
    }

    pub fn counters(&self, cookie: u64) -> Counters {
        let mut sum = Counters::default();
        if let Ok(per_cpu) = self.counters.get(&cookie, 0) {
            for c in per_cpu.iter() {
                sum.add(c);
            }
        }
        sum
    }

    /// Writes a pod's options for the programs (nothing to write: no
    /// entry), DNS capture resolved against the node's default `node_dns`.
    pub fn set_options(
        &mut self,
        cookie: u64,
        o: &PodOptions,
        node_dns: bool,
    ) -> Result<(), StateError> {
        let flags = o.flags(node_dns);
        match &mut self.pod_flags {
            Some(m) if flags != 0 => m.insert(cookie, flags, 0).map_err(merr("pod_flags"))?,
            Some(m) => drop(m.remove(&cookie)),
            None if flags == 0 => {}
            None => return Err(StateError::Missing("pod_flags")),
        }
        match &mut self.pod_reroute {
            Some(m) if !o.reroute.is_empty() => m
                .insert(cookie, o.reroute_bytes(), 0)
                .map_err(merr("pod_reroute")),
            Some(m) => {
                let _ = m.remove(&cookie);
                Ok(())
            }
            None if o.reroute.is_empty() => Ok(()),
            None => Err(StateError::Missing("pod_reroute")),
        }
    }

    /// Whether the programs capture the pod's DNS (its `pod_flags` bit).
    pub fn dns_on(&self, cookie: u64) -> bool {
        self.pod_flags
            .as_ref()
            .and_then(|m| m.get(&cookie, 0).ok())
            .is_some_and(|f| f & sluice_common::POD_FLAG_DNS_CAPTURE != 0)
    }

    /// A pod's options as they were written at its enrollment.
    pub fn options(&self, cookie: u64) -> PodOptions {
        let flags = self
            .pod_flags
            .as_ref()
            .and_then(|m| m.get(&cookie, 0).ok())
            .unwrap_or(0);
        let reroute = self
            .pod_reroute
            .as_ref()
            .and_then(|m| m.get(&cookie, 0).ok());
        PodOptions::from_maps(flags, reroute.as_ref())
    }

    fn remove_entries(&mut self, cookie: u64) {
        if let Some(m) = &mut self.pod_flags {
            let _ = m.remove(&cookie);
        }
        if let Some(m) = &mut self.pod_reroute {
            let _ = m.remove(&cookie);
        }
        for role in Role::ALL.into_iter().chain(Role::DNS) {
            self.remove_listener(cookie, role);
        }
        if let Some(m) = &mut self.dns_counters {
            let _ = m.remove(&cookie);
        }
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
        for k in self.addrs_of(cookie) {
            let _ = self.pod_addrs.remove(&k);
        }
        let _ = self.counters.remove(&cookie);
        let _ = self.pod_state.remove(&cookie);
        let _ = self.pod_meta.remove(&cookie);
        self.uids.retain(|_, c| *c != cookie);
    }

    /// Every cookie with any entry in a per-pod map (for cleanup and checks).
    pub fn cookies(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .pod_state
            .keys()
            .chain(self.pod_meta.keys())
            .chain(self.counters.keys())
            .filter_map(Result::ok)
            .chain(self.pod_addrs.iter().filter_map(Result::ok).map(|(_, c)| c))
            .chain(
                self.listeners
                    .keys()
                    .filter_map(Result::ok)
                    .map(|k| k.netns_cookie),
            )
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// All enrolled pods, sorted by uid.
    pub fn pods(&self) -> Vec<PodRecord> {
        // One walk of the socket map for all pods (not one per pod).
        let mut by_pod: std::collections::HashMap<u64, Vec<ListenerKey>> = Default::default();
        let keys = self.listeners.keys().filter_map(Result::ok);
        for k in keys.chain(self.dns_listener_keys()) {
            by_pod.entry(k.netns_cookie).or_default().push(k);
        }
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
                let mut listeners: Vec<String> = keys
                    .iter()
                    .map(|k| {
                        let role = Role::ALL
                            .into_iter()
                            .chain(Role::DNS)
                            .find(|r| *r as u8 == k.role)
                            .map_or("unknown", Role::as_str);
                        let fam = if k.family == FAMILY_V4 {
                            "ipv4"
                        } else {
                            "ipv6"
                        };
                        format!("{role}/{fam}")
                    })
                    .collect();
                listeners.sort();
                let options = self.options(cookie);
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
                    listeners,
                    counters: self.counters(cookie),
                    dns: self.dns_view(cookie, has_proxy, options.dns),
                    addresses: addrs
                        .get(&cookie)
                        .map(|ks| ks.iter().map(addr_of).collect())
                        .unwrap_or_default(),
                    links: Vec::new(),
                    bypass_inbound: options.bypass_inbound,
                    reroute: options.reroute,
                }
            })
            .collect();
        pods.sort_by(|a, b| a.uid.cmp(&b.uid));
        pods
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

fn fill(dst: &mut [u8], s: &str) {
    dst[..s.len()].copy_from_slice(s.as_bytes());
}

fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// CLOCK_BOOTTIME in ns: the clock the pod-state timestamps use (monotonic,
/// survives agent restarts, same clock as bpf_ktime_get_boot_ns).
pub fn boottime_ns() -> u64 {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
        .expect("CLOCK_BOOTTIME is always available on Linux");
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_survive_the_fixed_size_fields_up_to_their_full_length() {
        let mut field = [0u8; sluice_common::POD_NAME_LEN];
        let longest = "a".repeat(sluice_common::POD_NAME_LEN);
        fill(&mut field, &longest);
        assert_eq!(
            cstr(&field),
            longest,
            "no room for a NUL: the field's length ends it"
        );
        let mut field = [0u8; sluice_common::POD_NAME_LEN];
        fill(&mut field, "cart-7d9f");
        assert_eq!(cstr(&field), "cart-7d9f");
    }

    #[test]
    fn addresses_round_trip_through_their_map_keys() {
        for a in ["10.244.1.7", "fd00:10:244::7", "::1"] {
            let ip: IpAddr = a.parse().unwrap();
            assert_eq!(addr_of(&addr_key(&ip)), ip);
        }
    }
}

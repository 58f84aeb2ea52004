//! The maps every program shares. All are pinned by name under
//! `/sys/fs/bpf/sluice/maps/` and created once per node; a pod only adds entries.

use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray, PerCpuHashMap, SockHash},
};
use sluice_common::{
    AddrKey, Budget, Counters, DnsCounters, DnsFlow, DnsFlowKey, DropReason, ExcludedCounters,
    Exclusions, FlowHint, FlowKey, ListenerKey, PodEntry, PodMeta, Stamp, DROP_REASONS,
    FLOW_HINTS_ENTRIES, REROUTE_LEN, VERIFY_HINTS_ENTRIES,
};

/// Upper bound on pods per node (Kubernetes' default max-pods is 110).
#[cfg(not(feature = "layout-variant"))]
const MAX_PODS: u32 = 4096;
/// The upgrade tests' build with another map layout (never shipped).
#[cfg(feature = "layout-variant")]
const MAX_PODS: u32 = 8192;

/// Which build pinned the dataplane (see [`Stamp`]). User space only; its
/// layout never changes.
#[map(name = "stamp")]
pub static STAMP: Array<Stamp> = Array::pinned(1, 0);

/// The shared pod-state map, the single source of truth for enrollment.
/// Key: pod netns cookie. Written by user space only.
#[map(name = "pod_state")]
pub static POD_STATE: HashMap<u64, PodEntry> = HashMap::pinned(MAX_PODS, 0);

/// ztunnel's in-pod listeners, by pod, role and family. Written by user space;
/// closed sockets leave by themselves.
#[map(name = "listeners")]
pub static LISTENERS: SockHash<ListenerKey> = SockHash::pinned(MAX_PODS * 6, 0);

/// Every address of every enrolled pod → its netns cookie. Written by user
/// space; read by the ingress programs, whose packets carry no socket to ask.
/// Not preallocated: a pod has one or two addresses, the bound is generous.
#[map(name = "pod_addrs")]
pub static POD_ADDRS: HashMap<AddrKey, u64> = HashMap::pinned(MAX_PODS * 8, BPF_F_NO_PREALLOC);

/// Per-pod counters. Per-CPU so the connection path never shares a cache line.
#[map(name = "counters")]
pub static COUNTERS: PerCpuHashMap<u64, Counters> = PerCpuHashMap::pinned(MAX_PODS, 0);

/// Hints from tc programs to sk_lookup about a connection's listener lookups.
/// LRU: a TCP hint is needed from its SYN until the handshake's last ACK
/// (one round trip; with SYN cookies that ACK runs the lookup again) and
/// honoured for `FLOW_HINT_TTL_NS`; older ones are left for the LRU to
/// evict (the next SYN of a tuple overwrites its hint). A handshake
/// answered from a request socket releases its hint; what a pod leaves
/// unreleased is bounded by its share (`hint_budget`, see `hints`).
/// `FLOW_HINTS_ENTRIES` (16384) entries, about 2 MiB preallocated (8192
/// measured ~1 MiB, 65536 8 MiB: `cargo xtask bench`, memory): 16 pods
/// each leaving their whole share behind within a hint's TTL fill it,
/// before a hint younger than its TTL is evicted; an evicted hint only
/// costs a late cookie ACK its connection (refused, counted `unhinted`).
#[map(name = "flow_hints")]
pub static FLOW_HINTS: LruHashMap<FlowKey, FlowHint> = LruHashMap::pinned(FLOW_HINTS_ENTRIES, 0);

/// The hints of pods past their share of `flow_hints` (see `hints`): only
/// those pods evict one another here. 8192 entries, ~1 MiB.
#[map(name = "flow_hints_overflow")]
pub static FLOW_HINTS_OVERFLOW: LruHashMap<FlowKey, FlowHint> = LruHashMap::pinned(8192, 0);

/// Each pod's flow hints left unreleased in the current window (key:
/// netns cookie), against `HINTS_PER_POD_PER_S`. LRU: a pod's entry goes
/// by itself once the pod is gone.
#[map(name = "hint_budget")]
pub static HINT_BUDGET: LruHashMap<u64, Budget> = LruHashMap::pinned(MAX_PODS, 0);

/// Entry 0: hints written to `flow_hints_overflow` (their pod was past its
/// share), node-wide. Per-CPU like `counters`.
#[map(name = "hints_over_share")]
pub static HINTS_OVER_SHARE: PerCpuArray<u64> = PerCpuArray::pinned(1, 0);

/// Who each pod is (uid, netns path, workload identity). User space only;
/// kept beside the state so that everything about enrollment lives in bpffs.
/// Not preallocated: entries are large and few.
#[map(name = "pod_meta")]
pub static POD_META: HashMap<u64, PodMeta> = HashMap::pinned(MAX_PODS, BPF_F_NO_PREALLOC);

/// Per-pod capture options from the pod's annotations (`POD_FLAG_*` bits),
/// by netns cookie; no entry means none. Written by user space.
#[map(name = "pod_flags")]
pub static POD_FLAGS: HashMap<u64, u32> = HashMap::pinned(MAX_PODS, BPF_F_NO_PREALLOC);

/// Each pod's exclusions from capture (see `exclusions`), by netns cookie;
/// no entry means none. Written by user space, one whole value per change.
/// Not preallocated: values are large (4.9 KiB) and only pods with
/// exclusions have one.
#[map(name = "pod_exclusions")]
pub static POD_EXCLUSIONS: HashMap<u64, Exclusions> = HashMap::pinned(MAX_PODS, BPF_F_NO_PREALLOC);

/// Per-pod connections kept out of capture by the pod's exclusions.
/// Per-CPU like `counters`.
#[map(name = "excluded")]
pub static EXCLUDED: PerCpuHashMap<u64, ExcludedCounters> = PerCpuHashMap::pinned(MAX_PODS, 0);

/// The interfaces of each pod whose TCP is rerouted to 15001
/// (`istio.io/reroute-virtual-interfaces`). User space only: it decides
/// which program each interface gets, also when a restarted agent repairs.
#[map(name = "pod_reroute")]
pub static POD_REROUTE: HashMap<u64, [u8; REROUTE_LEN]> =
    HashMap::pinned(MAX_PODS, BPF_F_NO_PREALLOC);

/// The pods whose app TCP takes the local route (`--local-route`), by
/// netns cookie: the index of the interface that a flow the local route
/// sent over `lo` but no socket of the pod terminates leaves by (a
/// connection from before enrollment, an excluded SYN the rules missed).
/// No entry: the pod's TCP leaves by its interface as without the option.
/// Written by user space.
#[map(name = "local_route")]
pub static LOCAL_ROUTE: HashMap<u64, u32> = HashMap::pinned(MAX_PODS, BPF_F_NO_PREALLOC);

/// The node's netns cookie (entry 0; 0 = not set): the host-side program
/// exempts SYNs whose socket lives there. Written by user space.
#[map(name = "node_netns")]
pub static NODE_NETNS: Array<u64> = Array::pinned(1, 0);

/// ztunnel's DNS proxy sockets (TCP listener, UDP socket), by pod, role
/// (`DnsTcp`/`DnsUdp`) and family. Apart from `listeners` so that map keeps
/// its size; written by user space, closed sockets leave by themselves.
#[map(name = "dns_listeners")]
pub static DNS_LISTENERS: SockHash<ListenerKey> = SockHash::pinned(MAX_PODS * 4, 0);

/// UDP DNS queries sent to the proxy, by the querying socket and DNS id →
/// the resolver they were addressed to: the proxy's answer gets that source
/// back (no conntrack to undo a NAT). LRU: an entry is needed for one
/// round trip; 8192 queries in flight per node is far beyond a node's
/// resolver load, and an answer whose entry was evicted is counted
/// (`replies_unmapped`). About 1 MiB preallocated.
#[map(name = "dns_flows")]
pub static DNS_FLOWS: LruHashMap<DnsFlowKey, DnsFlow> = LruHashMap::pinned(8192, 0);

/// Each pod's DNS queries captured in the current window (key: netns
/// cookie), against `DNS_QUERIES_PER_POD_PER_S`. LRU: a pod's entry goes
/// by itself once the pod is gone.
#[map(name = "dns_budget")]
pub static DNS_BUDGET: LruHashMap<u64, Budget> = LruHashMap::pinned(MAX_PODS, 0);

/// Per-pod DNS capture counters. Per-CPU like `counters`.
#[map(name = "dns_counters")]
pub static DNS_COUNTERS: PerCpuHashMap<u64, DnsCounters> = PerCpuHashMap::pinned(MAX_PODS, 0);

/// Packets dropped for what they are, by [`DropReason`] (node-wide: such a
/// packet may not say which pod sent it). Per-CPU like `counters`.
#[map(name = "drops")]
pub static DROPS: PerCpuArray<u64> = PerCpuArray::pinned(DROP_REASONS, 0);

/// Entry 0 is 1 while a tc program's socket lookup (`bpf_skc_lookup_tcp`)
/// runs on this CPU. Such a lookup runs sk_lookup too (the listener lookup
/// is the same function): sk_lookup then only answers — it counts nothing
/// and marks no hint used — and ignores hints' age, so that a segment of a
/// connection it steered is never taken for one it did not. tc runs with
/// bottom halves off, so no other lookup runs on the CPU meanwhile.
#[map(name = "tc_lookup")]
pub static TC_LOOKUP: PerCpuArray<u32> = PerCpuArray::pinned(1, 0);

/// `TC_LOOKUP` while a tc program's lookup runs, for a segment whose
/// source is its pod's address (egress, `lo`'s egress).
pub const TC_LOOKUP_ASKING: u32 = 1;
/// The same for a rerouted interface's segment (a VM's source address):
/// the hint it finds is this netns's pod's, which the reroute program wrote.
pub const TC_LOOKUP_ASKING_REROUTED: u32 = 3;
/// `TC_LOOKUP` once sk_lookup, asked by tc, refused a flow whose SYN it had
/// a steering hint for (the pod no longer steers, or its listener is gone,
/// e.g. ztunnel down while a SYN-cookie handshake waits for its ACK): the
/// lookup finds no socket, and the segment must not leave the pod.
pub const TC_LOOKUP_REFUSED_STEERED: u32 = 2;

/// The hints of verification runs of `sluice_steer` (lookups with remote
/// port 0; see `sluice_common::verify`): the agent writes one right before a
/// test run and removes it right after. Apart from `flow_hints` so that a
/// verification never evicts a real connection's hint.
#[map(name = "verify_hints")]
pub static VERIFY_HINTS: HashMap<FlowKey, FlowHint> =
    HashMap::pinned(VERIFY_HINTS_ENTRIES, BPF_F_NO_PREALLOC);

/// Adds one to the node-wide count of drops for `reason`.
#[inline(always)]
pub fn count_drop(reason: DropReason) {
    if let Some(c) = DROPS.get_ptr_mut(reason as u32) {
        // Per-CPU value: no other writer, a plain add is enough.
        unsafe { *c += 1 };
    }
}

/// Adds one to a pod's DNS counter, creating the entry on first use.
#[inline(always)]
pub fn count_dns(cookie: u64, field: impl Fn(&mut DnsCounters) -> &mut u64) {
    bump(&DNS_COUNTERS, cookie, field)
}

/// Adds one to a pod's counter, creating the entry on first use.
#[inline(always)]
pub fn count(cookie: u64, field: impl Fn(&mut Counters) -> &mut u64) {
    bump(&COUNTERS, cookie, field)
}

#[inline(always)]
pub fn bump<T: Default>(
    map: &PerCpuHashMap<u64, T>,
    cookie: u64,
    field: impl Fn(&mut T) -> &mut u64,
) {
    if let Some(c) = map.get_ptr_mut(cookie) {
        // Per-CPU value: no other writer, a plain add is enough.
        unsafe { *field(&mut *c) += 1 };
    } else {
        let mut c = T::default();
        *field(&mut c) = 1;
        let _ = map.insert(cookie, c, 0);
    }
}

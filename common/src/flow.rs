//! Flow hints: what a tc program decided at a SYN (or a DNS query), keyed by
//! the connection, for sk_lookup and the reply path to read.

/// What a tc program tells sk_lookup about one connection's listener lookups
/// (its SYN's, and with SYN cookies its ACK's).
///
/// sk_lookup programs cannot call bpf_get_netns_cookie (tc programs can), so
/// every SYN's path into a pod crosses one of our tc programs, which leaves
/// this hint — carrying the pod's netns cookie — for sk_lookup to read.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HintVerdict {
    /// The SYN came over the pod's `lo`: in-pod traffic, never captured.
    Local = 1,
    /// The SYN was redirected by the egress program: steer to 15001.
    Outbound = 2,
    /// The SYN arrived on the pod's interface: steer to 15006.
    Inbound = 3,
    /// The SYN arrived on the pod's interface for port 15008: steer to 15008.
    Hbone = 4,
    /// A socket of the node's own netns sent the SYN (kubelet's probes, any
    /// host process): the program on the host side of the pod's interface
    /// saw it leave; never captured (Istio's host-side probe rule).
    Host = 5,
    /// An inbound SYN of a pod that asked for no inbound capture
    /// (`ambient.istio.io/bypass-inbound-capture`): delivered as addressed.
    Bypass = 6,
    /// A DNS query (TCP SYN to port 53) redirected by the egress program:
    /// steer to the DNS proxy's TCP listener.
    DnsTcp = 7,
    /// A DNS query (UDP to port 53) redirected by the egress program: steer
    /// to the DNS proxy's UDP socket. One hint per datagram.
    DnsUdp = 8,
    /// Written by earlier builds where a SYN took a path that exempts and
    /// steers nothing (over `lo` from a source that is neither the pod's nor
    /// ztunnel's; to an address no pod has), over any older hint of its
    /// tuple. The programs now remove that hint instead (no entry for a
    /// refused SYN); sk_lookup still reads a `Deny` as no hint.
    Deny = 9,
}

impl HintVerdict {
    pub const fn from_u32(v: u32) -> Option<Self> {
        match v {
            1 => Some(Self::Local),
            2 => Some(Self::Outbound),
            3 => Some(Self::Inbound),
            4 => Some(Self::Hbone),
            5 => Some(Self::Host),
            6 => Some(Self::Bypass),
            7 => Some(Self::DnsTcp),
            8 => Some(Self::DnsUdp),
            9 => Some(Self::Deny),
            _ => None,
        }
    }
}

/// Key of the flow-hint map: the connection as sk_lookup sees it
/// (remote = the SYN's source, local = the SYN's destination). Pod addresses
/// are unique on a node, so the tuple alone names one pod.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowKey {
    /// Addresses as raw network-order words; IPv4 uses word 0 only.
    pub remote_addr: [u32; 4],
    pub local_addr: [u32; 4],
    /// Ports in host byte order.
    pub remote_port: u16,
    pub local_port: u16,
    pub family: u8,
    pub _pad: [u8; 3],
}

/// [`FlowHint::flags`]: sk_lookup has used this hint (its connection is
/// counted). TCP hints stay until they expire, because with SYN cookies the
/// connection's ACK runs the listener lookup again; the flag keeps the
/// per-pod counters at one per SYN.
pub const HINT_USED: u32 = 1 << 0;
/// [`FlowHint::flags`]: the pod's ingress program let the SYN of this
/// `Host` hint through. A `Host` hint exempts one SYN (the one the node's
/// socket sent): a later SYN of the tuple that the host side did not hint
/// again is captured as any other.
pub const HINT_HOST_TAKEN: u32 = 1 << 1;
/// [`FlowHint::flags`]: the hint counts against its pod's share
/// ([`HINTS_PER_POD_PER_S`]); releasing it gives that back.
pub const HINT_CHARGED: u32 = 1 << 2;
/// [`FlowHint::flags`]: written by `lo`'s egress program for a SYN the
/// local route sent over `lo` (`--local-route`). `lo`'s ingress program
/// keeps such a hint for one SYN of the tuple (and marks it
/// [`HINT_LO_TAKEN`]); it removes any other hint of a SYN that is not
/// exempt: a SYN can reach `lo`'s ingress without passing its egress (a
/// packet socket that bypasses the qdisc).
pub const HINT_LO_OUT: u32 = 1 << 3;
/// [`FlowHint::flags`]: `lo`'s ingress program let the SYN of this
/// [`HINT_LO_OUT`] hint through.
pub const HINT_LO_TAKEN: u32 = 1 << 4;

/// How many flow hints one pod may leave unreleased in `flow_hints` per
/// window ([`BUDGET_WINDOW_NS`]): hints no answer released (a SYN answered
/// with a SYN cookie, which keeps its hint for the ACK; a SYN nothing
/// answered; a UDP DNS query dropped before sk_lookup took its hint). A handshake answered from a request socket gives its hint
/// back at once, so a pod's connection rate is not bounded, only what it
/// leaves behind. Past it, the pod's hints go to `flow_hints_overflow`
/// (counted `sluice_flow_hints_over_share_total`): they work while that
/// map holds them, and cannot evict another pod's hints in `flow_hints`.
/// Within [`FLOW_HINT_TTL_NS`] one pod leaves at most four windows' worth
/// there, 1/16 of it.
pub const HINTS_PER_POD_PER_S: u32 = 256;
/// Entries of `flow_hints` (see the map's comment for the size).
pub const FLOW_HINTS_ENTRIES: u32 = 16384;

/// Value of the flow-hint map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowHint {
    /// A [`HintVerdict`] discriminant.
    pub verdict: u32,
    /// `HINT_*` bits; 0 when written.
    pub flags: u32,
    /// The pod (netns cookie) whose tc program wrote the hint.
    pub netns_cookie: u64,
    /// bpf_ktime_get_ns() when the hint was written.
    pub at_ns: u64,
}

/// Key of the DNS flow map: one UDP query in flight, as its answer will
/// identify it on the way back (to the pod's address and port, same DNS id).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DnsFlowKey {
    /// The querying socket's address (raw network-order words; IPv4: word 0).
    pub pod_addr: [u32; 4],
    pub family: u8,
    pub _pad: u8,
    /// The querying socket's port (host byte order).
    pub pod_port: u16,
    /// The DNS message id (host byte order).
    pub id: u16,
    pub _pad2: [u8; 2],
}

impl DnsFlowKey {
    /// The query from (or the answer to) `addr:port` of `family` with DNS
    /// message id `id`.
    pub const fn new(family: u8, addr: [u32; 4], port: u16, id: u16) -> Self {
        Self {
            pod_addr: addr,
            family,
            _pad: 0,
            pod_port: port,
            id,
            _pad2: [0; 2],
        }
    }
}

/// How many DNS queries one pod may have captured and not yet answered in
/// one window of a second (an answer within the window gives its query's
/// use back): `dns_flows` is node-wide, and a pod asking faster than its
/// proxy answers would otherwise evict every other pod's queries in
/// flight. Past it, the pod's queries are dropped (counted
/// `dns_over_budget`) until an answer or the next window. Across a window's
/// end a pod may have twice this in flight (the old window's are not given
/// back to the new one): 4,096 at most, half the shared map. A pod whose
/// proxy answers keeps up is held to no rate.
pub const DNS_QUERIES_PER_POD_PER_S: u32 = 2048;
/// The window of the per-pod budgets ([`DNS_QUERIES_PER_POD_PER_S`],
/// [`HINTS_PER_POD_PER_S`]): a fixed window, reset by the first use after
/// it ends.
pub const BUDGET_WINDOW_NS: u64 = 1_000_000_000;

/// Value of the per-pod budget maps (`dns_budget`, `hint_budget`; key: the
/// pod's netns cookie): what the pod used in the window that began at
/// `window_ns`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Budget {
    /// CLOCK_MONOTONIC (`bpf_ktime_get_ns`) when the window began.
    pub window_ns: u64,
    pub used: u32,
    /// Which window this is, counted from 1 (wrapping, never 0), so that a
    /// use given back is given to the window it was taken in.
    pub window: u32,
}

/// Value of the DNS flow map: where the query was addressed, so that the
/// proxy's answer can be given that address as its source.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DnsFlow {
    /// The resolver the app asked (raw network-order words; IPv4: word 0).
    pub resolver_addr: [u32; 4],
    /// The pod (netns cookie), for its counters.
    pub netns_cookie: u64,
    /// The resolver's port (host byte order; 53).
    pub resolver_port: u16,
    pub _pad: u16,
    /// The pod's `dns_budget` window the query's use was taken in
    /// ([`Budget::window`]): its answer gives the use back only in that
    /// window (0: none to give back).
    pub budget_window: u32,
}

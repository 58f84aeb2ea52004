//! Types and constants shared by sluice's kernel programs and user space.
//!
//! Everything here is `#[repr(C)]` plain old data: the same definition is the
//! layout of a map key or value on both sides of the kernel boundary. Every
//! port, mark and address that the dataplane depends on is defined once, here.
#![no_std]

/// ztunnel's in-pod listener for outbound traffic of the app.
pub const PORT_OUTBOUND: u16 = 15001;
/// ztunnel's in-pod listener for plaintext inbound traffic.
pub const PORT_INBOUND: u16 = 15006;
/// ztunnel's in-pod listener for inbound HBONE (mTLS tunnel) traffic.
pub const PORT_HBONE: u16 = 15008;
/// ztunnel's in-pod DNS proxy, on localhost (127.0.0.1 and ::1), TCP and UDP.
pub const PORT_DNS_PROXY: u16 = 15053;
/// The DNS port whose traffic DNS capture sends to [`PORT_DNS_PROXY`].
pub const PORT_DNS: u16 = 53;

/// Mark ztunnel sets (SO_MARK 1337) on every socket it owns: never captured.
pub const MARK_ZTUNNEL: u32 = 0x539;
/// Mark that makes a packet take the "deliver locally" policy route.
pub const MARK_REDIRECT: u32 = 0x111;
/// Only these bits of the packet mark belong to the mesh (Istio uses the same mask).
pub const MARK_MASK: u32 = 0xfff;

/// Policy routing table holding `local default dev lo` inside the pod netns.
pub const ROUTE_TABLE: u32 = 100;
/// Priority of the `fwmark 0x111/0xfff lookup 100` rule (the one Istio uses).
pub const RULE_PRIORITY: u32 = 32764;

/// Source address kubelet health probes are SNATed to on the node (IPv4).
pub const PROBE_ADDR_V4: [u8; 4] = [169, 254, 7, 127];
/// Source address kubelet health probes are SNATed to on the node (IPv6).
pub const PROBE_ADDR_V6: [u8; 16] = [
    0xfd, 0x16, 0x92, 0x54, 0x71, 0x27, 0x13, 0x37, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
];

/// A TCP flow hint left by a tc program is honoured by sk_lookup this long
/// after its SYN. A connection's listener lookup normally runs once, on the
/// SYN's path, microseconds after the hint was written; with SYN cookies
/// (the listener's queue overflowed, or `tcp_syncookies=2`) it runs again
/// for the client's ACK (and, if that ACK is lost or the accept queue is
/// full, for its retransmitted data), one round trip and some RTOs later.
/// Every SYN writes its own verdict over an older hint of its tuple, so the
/// bound only decides how late a cookie continuation may come before it is
/// refused (reset, fail closed), never which connection a hint is for.
pub const FLOW_HINT_TTL_NS: u64 = 3_000_000_000;

/// `AF_INET` / `AF_INET6` as stored in map keys.
pub const FAMILY_V4: u8 = 2;
pub const FAMILY_V6: u8 = 10;

/// Enrollment state of a pod, as stored in the shared pod-state map.
///
/// Programs only distinguish "steering" (`Enabled`, `Served`) from everything
/// else, which fails closed (new connections are dropped, never bypass
/// ztunnel).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize, serde::Deserialize))]
pub enum PodState {
    /// Capture attached, ztunnel has not (yet) given us its listeners.
    Pending = 1,
    /// Capture attached and steering to ztunnel's listeners.
    Enabled = 2,
    /// Being removed: capture still attached, new connections fail closed.
    Draining = 3,
    /// Steering, and ztunnel knows the pod's workload (from istiod's xDS):
    /// it can serve the pod's connections. Fully enrolled.
    Served = 4,
}

impl PodState {
    pub const ALL: [Self; 4] = [Self::Pending, Self::Enabled, Self::Served, Self::Draining];

    /// Whether the programs steer the pod's connections to ztunnel.
    pub const fn steers(self) -> bool {
        matches!(self, Self::Enabled | Self::Served)
    }

    pub const fn from_u32(v: u32) -> Option<Self> {
        match v {
            1 => Some(Self::Pending),
            2 => Some(Self::Enabled),
            3 => Some(Self::Draining),
            4 => Some(Self::Served),
            _ => None,
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Enabled => "Enabled",
            Self::Draining => "Draining",
            Self::Served => "Served",
        }
    }

    /// The state [`as_str`](Self::as_str) names.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == name)
    }
}

/// Value of the shared pod-state map (key: the pod netns cookie).
///
/// Written only by user space; read by every program on the connection path.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodEntry {
    /// A [`PodState`] discriminant. Kept as a raw `u32` so that a value the
    /// programs do not know (e.g. written by a newer agent) reads as "not
    /// Enabled" and fails closed instead of being undefined behaviour.
    pub state: u32,
    /// Bumped on every state change; lets readers detect a changed entry.
    pub generation: u32,
    /// CLOCK_BOOTTIME (ns) when the pod was enrolled.
    pub enrolled_at_ns: u64,
    /// CLOCK_BOOTTIME (ns) of the last state change.
    pub changed_at_ns: u64,
}

impl PodEntry {
    pub const fn state(&self) -> Option<PodState> {
        PodState::from_u32(self.state)
    }

    /// Whether the programs steer this pod's connections (any other value,
    /// known or not, fails closed).
    pub const fn steers(&self) -> bool {
        self.state == PodState::Enabled as u32 || self.state == PodState::Served as u32
    }
}

/// Which of ztunnel's in-pod listeners a connection is steered to.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Outbound = 1,
    Inbound = 2,
    Hbone = 3,
    /// ztunnel's DNS proxy, TCP (DNS capture only; not needed to steer).
    DnsTcp = 4,
    /// ztunnel's DNS proxy, UDP (DNS capture only; not needed to steer).
    DnsUdp = 5,
}

impl Role {
    /// The listeners every enrolled pod needs before it steers.
    pub const ALL: [Role; 3] = [Role::Outbound, Role::Inbound, Role::Hbone];
    /// The DNS proxy's sockets: optional (ztunnel may run without DNS proxy).
    pub const DNS: [Role; 2] = [Role::DnsTcp, Role::DnsUdp];

    pub const fn port(self) -> u16 {
        match self {
            Self::Outbound => PORT_OUTBOUND,
            Self::Inbound => PORT_INBOUND,
            Self::Hbone => PORT_HBONE,
            Self::DnsTcp | Self::DnsUdp => PORT_DNS_PROXY,
        }
    }

    pub const fn is_dns(self) -> bool {
        matches!(self, Self::DnsTcp | Self::DnsUdp)
    }

    pub const fn from_port(port: u16) -> Option<Self> {
        match port {
            PORT_OUTBOUND => Some(Self::Outbound),
            PORT_INBOUND => Some(Self::Inbound),
            PORT_HBONE => Some(Self::Hbone),
            _ => None,
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Outbound => "outbound",
            Self::Inbound => "inbound",
            Self::Hbone => "hbone",
            Self::DnsTcp => "dns-tcp",
            Self::DnsUdp => "dns-udp",
        }
    }
}

/// Key of the listener socket map: one socket per pod, role and address family.
///
/// A dual-stack `[::]` listener is registered under both families, so one
/// socket serves IPv4 and IPv6 lookups, exactly as it does without capture.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ListenerKey {
    pub netns_cookie: u64,
    pub role: u8,
    pub family: u8,
    pub _pad: [u8; 6],
}

impl ListenerKey {
    pub const fn new(netns_cookie: u64, role: Role, family: u8) -> Self {
        Self {
            netns_cookie,
            role: role as u8,
            family,
            _pad: [0; 6],
        }
    }

    /// A key of ztunnel's DNS proxy sockets (the `dns_listeners` map).
    pub const fn is_dns(&self) -> bool {
        self.role == Role::DnsTcp as u8 || self.role == Role::DnsUdp as u8
    }
}

/// Key of the pod-address map: one of a pod's addresses. Ingress packets
/// carry no socket, and bpf_get_netns_cookie() in tc answers from the packet's
/// socket, so the ingress programs find the pod by destination address.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AddrKey {
    pub family: u8,
    pub _pad: [u8; 3],
    /// Raw network-order words; IPv4 uses word 0 only.
    pub addr: [u32; 4],
}

impl AddrKey {
    pub const fn new(family: u8, addr: [u32; 4]) -> Self {
        Self {
            family,
            _pad: [0; 3],
            addr,
        }
    }
}

/// Why the tc programs dropped a packet for what it is rather than for a
/// pod's state: the index into the node-wide `drops` counter array. Such a
/// packet may not say which pod sent it, so these are not per pod.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// IPv6 whose extension-header chain is longer than the programs walk,
    /// or cut short: it could hide a TCP SYN, so it never leaves a captured
    /// interface.
    Malformed = 0,
    /// A SYN leaving a captured interface from an address no enrolled pod
    /// has, on a kernel whose tc programs cannot learn a packet's netns (so
    /// the address is all that names the pod); or a rerouted interface's
    /// SYN there.
    UnknownSource = 1,
    /// A TCP segment that reached a listener lookup in an enrolled pod with
    /// no fresh hint from a tc program (or a `Deny` one), which sk_lookup
    /// refused: a SYN on a path sluice does not know (an interface added
    /// after enrollment, a spoofed source over `lo`), a SYN-cookie ACK that
    /// came after its hint expired, a stray segment of a closed connection.
    /// Counted here because the pod is not always known.
    Unhinted = 2,
}

impl DropReason {
    pub const ALL: [DropReason; 3] = [
        DropReason::Malformed,
        DropReason::UnknownSource,
        DropReason::Unhinted,
    ];

    /// The metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            DropReason::Malformed => "malformed",
            DropReason::UnknownSource => "unknown_source",
            DropReason::Unhinted => "unhinted",
        }
    }
}

/// Entries of the `drops` array (one per [`DropReason`]).
pub const DROP_REASONS: u32 = DropReason::ALL.len() as u32;

/// Per-pod counters (per-CPU map, key: netns cookie), summed by user space.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize))]
pub struct Counters {
    /// Inbound connections assigned to the 15006 listener.
    pub captured_inbound: u64,
    /// Inbound connections assigned to the 15008 (HBONE) listener.
    pub captured_hbone: u64,
    /// Outbound connections assigned to the 15001 listener.
    pub captured_outbound: u64,
    /// Connections deliberately not captured (probes, in-pod traffic over lo).
    pub bypassed: u64,
    /// SYNs dropped because the pod is not `Enabled` (fail closed, row F1).
    pub dropped_fail_closed: u64,
    /// SYNs dropped because the pod is `Enabled` but the listener is gone
    /// (ztunnel restarting): also fail closed, counted apart to tell them apart.
    pub missing_socket: u64,
}

impl Counters {
    pub fn add(&mut self, o: &Counters) {
        self.captured_inbound += o.captured_inbound;
        self.captured_hbone += o.captured_hbone;
        self.captured_outbound += o.captured_outbound;
        self.bypassed += o.bypassed;
        self.dropped_fail_closed += o.dropped_fail_closed;
        self.missing_socket += o.missing_socket;
    }
}

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
    /// The SYN took a path that exempts and steers nothing (over `lo` from
    /// a source that is neither the pod's nor ztunnel's; to an address no
    /// pod has): sk_lookup treats it as no hint. Written, rather than
    /// nothing, so that an older hint of the same tuple (kept for SYN
    /// cookies) cannot speak for this connection.
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

/// Bits of a pod's entry in the `pod_flags` map (absent entry: none set).
pub const POD_FLAG_BYPASS_INBOUND: u32 = 1 << 0;
/// The pod's DNS (port 53) is captured to ztunnel's DNS proxy.
pub const POD_FLAG_DNS_CAPTURE: u32 = 1 << 1;
/// Size of a `pod_reroute` value: interface names, comma-separated,
/// NUL-padded (four 15-byte names fit).
pub const REROUTE_LEN: usize = 64;

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
    pub _pad: [u8; 6],
}

/// Per-pod DNS capture counters (a map of their own, so the older
/// `counters` map keeps its layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DnsCounters {
    /// UDP queries sent to the DNS proxy.
    pub captured_udp: u64,
    /// TCP connections to port 53 sent to the DNS proxy.
    pub captured_tcp: u64,
    /// Queries that went to their resolver uncaptured because the pod has
    /// no DNS proxy socket (ztunnel without DNS proxy) or does not steer.
    pub passthrough: u64,
    /// Proxy answers given the resolver's address back.
    pub replies_restored: u64,
    /// Proxy answers to a pod address with no recorded query (flow entry
    /// evicted or never made): delivered unchanged.
    pub replies_unmapped: u64,
}

impl DnsCounters {
    pub fn add(&mut self, o: &DnsCounters) {
        self.captured_udp += o.captured_udp;
        self.captured_tcp += o.captured_tcp;
        self.passthrough += o.passthrough;
        self.replies_restored += o.replies_restored;
        self.replies_unmapped += o.replies_unmapped;
    }
}

/// Length of the pod uid field in [`PodMeta`] (Kubernetes uids are 36 bytes).
pub const POD_UID_LEN: usize = 64;
/// Length of the netns path field in [`PodMeta`].
pub const NETNS_PATH_LEN: usize = 192;
/// Kubernetes name lengths (DNS subdomain / label) plus the NUL terminator.
pub const POD_NAME_LEN: usize = 254;
pub const NAMESPACE_LEN: usize = 64;
pub const SERVICE_ACCOUNT_LEN: usize = 254;

/// Who a pod is, for user space only (the programs never read it). Kept in a
/// pinned map beside the pod state so a new process can find every enrolled
/// pod without any file outside bpffs.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PodMeta {
    /// NUL-padded pod uid.
    pub uid: [u8; POD_UID_LEN],
    /// NUL-padded path of the netns the pod was enrolled with.
    pub netns_path: [u8; NETNS_PATH_LEN],
    /// The workload identity ztunnel needs in every ZDS add (NUL-padded),
    /// kept so that a restarted agent can send its snapshot.
    pub name: [u8; POD_NAME_LEN],
    pub namespace: [u8; NAMESPACE_LEN],
    pub service_account: [u8; SERVICE_ACCOUNT_LEN],
}

/// `STAMP_MAGIC` marks a written [`Stamp`].
pub const STAMP_MAGIC: u64 = u64::from_be_bytes(*b"sluice01");
pub const STAMP_VERSION_LEN: usize = 48;

/// The single value of the pinned `stamp` map: which sluice build pinned
/// the dataplane, and the layout of the maps it pinned. User space only.
/// This layout is frozen: every build must be able to read every other's.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Stamp {
    pub magic: u64,
    /// Digest of every map's type, key and value size, max entries and flags.
    pub layout: u64,
    /// NUL-padded version of the build (`0.1.0+obj.1a2b3c4d`).
    pub version: [u8; STAMP_VERSION_LEN],
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: all of these are repr(C), Copy, with explicit padding fields so
    // every byte is initialised.
    unsafe impl aya::Pod for PodEntry {}
    unsafe impl aya::Pod for ListenerKey {}
    unsafe impl aya::Pod for Counters {}
    unsafe impl aya::Pod for FlowKey {}
    unsafe impl aya::Pod for FlowHint {}
    unsafe impl aya::Pod for PodMeta {}
    unsafe impl aya::Pod for AddrKey {}
    unsafe impl aya::Pod for Stamp {}
    unsafe impl aya::Pod for DnsFlowKey {}
    unsafe impl aya::Pod for DnsFlow {}
    unsafe impl aya::Pod for DnsCounters {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn the_stamp_layout_never_changes() {
        assert_eq!(size_of::<Stamp>(), 64);
        assert_eq!(core::mem::offset_of!(Stamp, layout), 8);
        assert_eq!(core::mem::offset_of!(Stamp, version), 16);
    }

    #[test]
    fn map_layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<PodEntry>(), 24);
        assert_eq!(size_of::<ListenerKey>(), 16);
        assert_eq!(size_of::<Counters>(), 48);
        assert_eq!(size_of::<FlowKey>(), 16 + 16 + 2 + 2 + 1 + 3);
        assert_eq!(size_of::<FlowHint>(), 24);
        assert_eq!(size_of::<AddrKey>(), 20);
    }

    #[test]
    fn roles_and_ports_round_trip() {
        for r in Role::ALL {
            assert_eq!(Role::from_port(r.port()), Some(r));
        }
        assert_eq!(Role::from_port(80), None);
    }

    #[test]
    fn only_enabled_and_served_steer() {
        for s in PodState::ALL {
            let e = PodEntry {
                state: s as u32,
                generation: 0,
                enrolled_at_ns: 0,
                changed_at_ns: 0,
            };
            assert_eq!(e.steers(), s.steers(), "{s:?}");
            assert_eq!(
                s.steers(),
                matches!(s, PodState::Enabled | PodState::Served)
            );
            assert_eq!(PodState::from_name(s.as_str()), Some(s));
        }
    }

    #[test]
    fn unknown_state_is_not_enabled() {
        let e = PodEntry {
            state: 99,
            generation: 0,
            enrolled_at_ns: 0,
            changed_at_ns: 0,
        };
        assert!(!e.steers());
        assert_eq!(e.state(), None);
    }
}

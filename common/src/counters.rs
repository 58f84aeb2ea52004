//! Per-pod counters the programs bump and user space sums: connections
//! captured and dropped (by reason), and DNS capture's.

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
    /// A SYN or DNS query leaving a captured interface from a source that
    /// is not its pod's: another pod's address (a spoofed source), or, on a
    /// kernel whose tc programs cannot learn a packet's netns (so the
    /// address is all that names the pod), an address no enrolled pod has;
    /// or a rerouted interface's SYN there.
    UnknownSource = 1,
    /// A TCP segment that reached a listener lookup in an enrolled pod with
    /// no fresh hint from a tc program, which sk_lookup
    /// refused: a SYN on a path sluice does not know (an interface added
    /// after enrollment, a spoofed source over `lo`), a SYN-cookie ACK that
    /// came after its hint expired, a stray segment of a closed connection.
    /// Counted here because the pod is not always known.
    Unhinted = 2,
    /// A DNS query of a pod past its budget
    /// ([`crate::DNS_QUERIES_PER_POD_PER_S`]): not captured, so that one
    /// pod's flood cannot evict the node's other queries in flight.
    DnsOverBudget = 3,
}

impl DropReason {
    pub const ALL: [DropReason; 4] = [
        DropReason::Malformed,
        DropReason::UnknownSource,
        DropReason::Unhinted,
        DropReason::DnsOverBudget,
    ];

    /// The metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            DropReason::Malformed => "malformed",
            DropReason::UnknownSource => "unknown_source",
            DropReason::Unhinted => "unhinted",
            DropReason::DnsOverBudget => "dns_over_budget",
        }
    }
}

/// Entries of the `drops` array (one per [`DropReason`]).
pub const DROP_REASONS: u32 = DropReason::ALL.len() as u32;

/// Per-pod counters (per-CPU map, key: netns cookie), summed by user space.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
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

//! A pod's exclusions from capture (the `traffic.sidecar.istio.io/*`
//! annotations sidecar mode honours): the value of the `pod_exclusions` map,
//! read by the tc programs at a connection's SYN. One value per pod, written
//! whole, so a SYN never sees half of an old set and half of a new one.

/// The most ports, and the most address ranges, a pod may exclude or
/// include (each kind counted over all of its lists): what one SYN may cost.
pub const EXCLUSIONS_MAX: usize = 64;

/// `includeOutboundIPRanges` is set (and not `*`): only connections to one
/// of its ranges, or to a port of `includeOutboundPorts`, are captured.
pub const EXCL_OUT_INCLUDE: u32 = 1 << 0;
/// `includeInboundPorts` is set (and not `*`): only connections to one of
/// its ports are captured.
pub const EXCL_IN_INCLUDE: u32 = 1 << 1;

/// An address range: `addr` is the range's first address and `mask` its
/// netmask, both as raw network-order words the way the programs hold an
/// address (IPv4 in word 0, the rest 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IpRange {
    pub addr: [u32; 4],
    pub mask: [u32; 4],
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
    pub _pad: [u8; 3],
}

impl IpRange {
    /// Whether `addr` (of `family`) lies in the range. Without branches on
    /// purpose: a loop over ranges then leaves the eBPF verifier one state
    /// per iteration, not one per outcome of each comparison (which grows
    /// as 2^n over the iterations).
    #[inline(always)]
    pub fn contains(&self, family: u8, addr: &[u32; 4]) -> bool {
        let differs = ((self.family ^ family) as u32)
            | ((addr[0] & self.mask[0]) ^ self.addr[0])
            | ((addr[1] & self.mask[1]) ^ self.addr[1])
            | ((addr[2] & self.mask[2]) ^ self.addr[2])
            | ((addr[3] & self.mask[3]) ^ self.addr[3]);
        differs == 0
    }
}

/// Value of `pod_exclusions` (key: the pod's netns cookie): each list in
/// an array of its own with its length, so a walk indexes it by its loop
/// counter alone (a constant for the verifier at every step; an index
/// offset by a length read from the map loses its bound on 6.1's
/// verifier). The per-pod limit counts over all lists; each array holds it.
///
/// `includeOutboundPorts` shares `out_ports` with `excludeOutboundPorts`,
/// from its far end (`out_ports[63]` down): the two cannot meet, since all
/// ports together are at most [`EXCLUSIONS_MAX`], and the value keeps the
/// size of the builds before it, whose pinned map it must be able to
/// take over (its length is their padding, 0 in their entries).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exclusions {
    /// `EXCL_*` bits.
    pub flags: u32,
    /// Lengths of the lists below.
    pub n_out_ports: u8,
    pub n_in_ports: u8,
    pub n_in_included: u8,
    pub n_out_ranges: u8,
    pub n_out_included: u8,
    /// Length of `includeOutboundPorts`, at the far end of `out_ports`.
    pub n_out_included_ports: u8,
    pub _pad: [u8; 2],
    /// `excludeOutboundPorts` from the start; `includeOutboundPorts` from
    /// the end.
    pub out_ports: [u16; EXCLUSIONS_MAX],
    /// `excludeInboundPorts`.
    pub in_ports: [u16; EXCLUSIONS_MAX],
    /// `includeInboundPorts` (with `EXCL_IN_INCLUDE`).
    pub in_included: [u16; EXCLUSIONS_MAX],
    /// `excludeOutboundIPRanges`.
    pub out_ranges: [IpRange; EXCLUSIONS_MAX],
    /// `includeOutboundIPRanges` (with `EXCL_OUT_INCLUDE`).
    pub out_included: [IpRange; EXCLUSIONS_MAX],
}

const NO_RANGE: IpRange = IpRange {
    addr: [0; 4],
    mask: [0; 4],
    family: 0,
    _pad: [0; 3],
};

/// Whether `port` is among the first `n` of `ports`.
#[inline(always)]
fn has_port(ports: &[u16; EXCLUSIONS_MAX], n: u8, port: u16) -> bool {
    let mut i = 0;
    while i < EXCLUSIONS_MAX {
        if i >= n as usize {
            return false;
        }
        if ports[i] == port {
            return true;
        }
        i += 1;
    }
    false
}

/// Whether `port` is among the last `n` of `ports` (the list kept at the
/// array's far end).
#[inline(always)]
fn has_port_from_end(ports: &[u16; EXCLUSIONS_MAX], n: u8, port: u16) -> bool {
    let mut i = 0;
    while i < EXCLUSIONS_MAX {
        if i >= n as usize {
            return false;
        }
        if ports[EXCLUSIONS_MAX - 1 - i] == port {
            return true;
        }
        i += 1;
    }
    false
}

/// Whether `addr` lies in one of the first `n` of `ranges`.
#[inline(always)]
fn in_ranges(ranges: &[IpRange; EXCLUSIONS_MAX], n: u8, family: u8, addr: &[u32; 4]) -> bool {
    let mut i = 0;
    while i < EXCLUSIONS_MAX {
        if i >= n as usize {
            return false;
        }
        if ranges[i].contains(family, addr) {
            return true;
        }
        i += 1;
    }
    false
}

impl Exclusions {
    pub const EMPTY: Self = Self {
        flags: 0,
        n_out_ports: 0,
        n_in_ports: 0,
        n_in_included: 0,
        n_out_ranges: 0,
        n_out_included: 0,
        n_out_included_ports: 0,
        _pad: [0; 2],
        out_ports: [0; EXCLUSIONS_MAX],
        in_ports: [0; EXCLUSIONS_MAX],
        in_included: [0; EXCLUSIONS_MAX],
        out_ranges: [NO_RANGE; EXCLUSIONS_MAX],
        out_included: [NO_RANGE; EXCLUSIONS_MAX],
    };

    /// Whether a new outbound connection to `addr`:`port` stays out of
    /// capture, in the order of sidecar mode's rules: an excluded port or
    /// address range keeps it out; else an included port captures it; else
    /// an include list of ranges that leaves its address out keeps it out.
    #[inline(always)]
    pub fn excludes_outbound(&self, family: u8, addr: &[u32; 4], port: u16) -> bool {
        if has_port(&self.out_ports, self.n_out_ports, port)
            || in_ranges(&self.out_ranges, self.n_out_ranges, family, addr)
        {
            return true;
        }
        if self.flags & EXCL_OUT_INCLUDE == 0 {
            return false;
        }
        !has_port_from_end(&self.out_ports, self.n_out_included_ports, port)
            && !in_ranges(&self.out_included, self.n_out_included, family, addr)
    }

    /// Whether a new inbound connection to `port` stays out of capture:
    /// with an include list, whether it leaves the port out (the exclusions
    /// then count for nothing, as in sidecar mode, where they apply only
    /// under `*`); else whether the port is excluded. ztunnel's own ports
    /// never do: an include list that leaves them out would otherwise let
    /// a client reach ztunnel's in-pod listeners as if they were the app's
    /// (15001 would proxy for it as the pod).
    #[inline(always)]
    pub fn excludes_inbound(&self, port: u16) -> bool {
        if matches!(
            port,
            crate::PORT_OUTBOUND | crate::PORT_INBOUND | crate::PORT_HBONE | crate::PORT_DNS_PROXY
        ) {
            return false;
        }
        if self.flags & EXCL_IN_INCLUDE != 0 {
            return !has_port(&self.in_included, self.n_in_included, port);
        }
        has_port(&self.in_ports, self.n_in_ports, port)
    }
}

/// Connections a pod's exclusions kept out of capture (per-CPU map
/// `excluded`, key: netns cookie), summed by user space.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct ExcludedCounters {
    pub inbound: u64,
    pub outbound: u64,
}

impl ExcludedCounters {
    pub fn add(&mut self, o: &ExcludedCounters) {
        self.inbound += o.inbound;
        self.outbound += o.outbound;
    }
}

//! A pod as the maps know it: its enrollment state (the one value the
//! programs branch on), its option flags, and who it is (user space only).

/// Enrollment state of a pod, as stored in the shared pod-state map.
///
/// Programs only distinguish "steering" (`Enabled`, `Served`) from everything
/// else, which fails closed (new connections are dropped, never bypass
/// ztunnel).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
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

/// Bits of a pod's entry in the `pod_flags` map (absent entry: none set).
pub const POD_FLAG_BYPASS_INBOUND: u32 = 1 << 0;
/// The pod's DNS (port 53) is captured to ztunnel's DNS proxy.
pub const POD_FLAG_DNS_CAPTURE: u32 = 1 << 1;
/// Size of a `pod_reroute` value: interface names, comma-separated,
/// NUL-padded (four 15-byte names fit).
pub const REROUTE_LEN: usize = 64;

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

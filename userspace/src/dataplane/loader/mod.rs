//! Loads sluice's programs and maps once per node and pins them; later
//! processes adopt the pins. Enrolling a pod then costs only link attaches and
//! map writes (a per-pod load + verify would cost 65–100 ms).
//!
//! The agent's start also replaces the programs of another build in place,
//! and migrates maps of another size (`upgrade`).
//!
//! Layout under the bpffs root (default `/sys/fs/bpf/sluice`):
//! ```text
//! progs/<program name>              one pin per program (programs::Program)
//! maps/{pod_state,pod_meta,pod_addrs,pod_flags,pod_reroute,listeners,counters,flow_hints,node_netns,stamp,
//!      flow_hints_overflow,hint_budget,hints_over_share,
//!      dns_listeners,dns_flows,dns_budget,dns_counters,drops,tc_lookup,verify_hints}
//! maps_next/                        only during a migration
//! pods/<netns cookie>/{steer,egress_<if>,ingress_<if> or reroute_<if>,lo,host_<if>}   a pod's links
//! ```
//!
//! [`Dataplane`] is what a process holds: the program handles, the maps and
//! the node-wide settings that enrollments read.

mod adoption;
mod bpffs;
mod error;
mod handles;
mod layout;
mod load;
mod maps_next;
mod object;
mod pins;
pub mod programs;
#[cfg(test)]
mod tests;
mod upgrade;

use aya::programs::{SchedClassifier, SkLookup};

use crate::{
    dataplane::{
        features::{Features, TcAttach},
        state::{Maps, StateError},
    },
    podnet::hostside::{HostSideError, Node},
};

pub use adoption::Adoption;
pub use bpffs::{ensure_bpffs, remove_node_pins};
pub use error::LoadError;
pub use object::embedded_object;
pub use pins::{Pins, DEFAULT_ROOT};
pub use programs::Program;

use handles::Programs;

/// What an agent's start does besides adopting the pinned dataplane.
struct Upgrade<'a> {
    /// Where the host-side filters are (kernels without tcx).
    node: Option<&'a Node>,
}

/// The node's dataplane: the programs and the shared maps.
pub struct Dataplane {
    pins: Pins,
    programs: Programs,
    /// The node's netns, where the host side of pods' interfaces lives; set
    /// by [`Dataplane::set_node`]. Without it no host-side link is attached.
    node: Option<Node>,
    /// The node's DNS capture default (`--dns-capture`), for pods whose
    /// annotations do not choose; see [`Dataplane::set_dns_capture`].
    dns_capture: bool,
    maps: Maps,
    /// What this process found pinned when it started.
    adoption: Adoption,
    /// The kernel features the programs were loaded for (probed; fewer in
    /// tests of the fallbacks).
    features: Features,
    /// How new tc attachments are made ([`Dataplane::set_tc_attach`]); pods
    /// attached otherwise before keep theirs until re-enrolled.
    tc_attach: TcAttach,
    /// New pods' TCP takes the local route ([`Dataplane::set_local_route`]).
    local_route: bool,
    /// Set by an uninstall, under the lock it holds: nothing attaches any
    /// more (an enrollment that waited for the lock meanwhile would pin
    /// into the bpffs root the uninstall removed).
    retired: bool,
}

impl Dataplane {
    /// Adopts the pinned dataplane as it is, or loads and pins it if there
    /// is none (CLI commands working on the pins without an agent).
    pub fn load_or_adopt(pins: Pins) -> Result<Self, LoadError> {
        Self::open(pins, None, Features::get())
    }

    /// [`load_or_adopt`](Self::load_or_adopt) as if the kernel offered only
    /// `features` (tests of the fallbacks on a kernel that has more).
    pub fn load_or_adopt_with(pins: Pins, features: Features) -> Result<Self, LoadError> {
        Self::open(pins, None, features)
    }

    /// Like [`load_or_adopt`](Self::load_or_adopt), and replaces pinned
    /// programs of another build with this build's ([`Adoption::Upgraded`]).
    /// The agent's start: it owns the node's dataplane. Costs a load of this
    /// build's programs to compare tags (≈ 35 ms).
    /// `node`: the node's netns, where a kernel without tcx has the filters
    /// of the pods' host-side program to replace.
    pub fn load_adopt_or_upgrade(pins: Pins, node: Option<&Node>) -> Result<Self, LoadError> {
        Self::open(pins, Some(Upgrade { node }), Features::get())
    }

    fn open(pins: Pins, upgrade: Option<Upgrade>, features: Features) -> Result<Self, LoadError> {
        ensure_bpffs(pins.root())?;
        let _lock = bpffs::lock(&pins)?;
        if !pins.is_loaded() {
            let (programs, maps) = load::load(&pins, features)?;
            return Ok(Self::new(pins, programs, maps, Adoption::Loaded, features));
        }
        // Before the maps are opened as this build's types: a migration may
        // have to replace them first.
        let adoption = match upgrade {
            Some(Upgrade { node }) => upgrade::upgrade(&pins, features, node)
                .unwrap_or_else(|e| Adoption::Kept(crate::error_line(&e))),
            None => Adoption::Same,
        };
        let adopted = Programs::open(&pins, false)
            .and_then(|programs| Ok((programs, Maps::open_pinned(&pins.maps())?)));
        let (programs, maps) = adopted.map_err(|e| match layout::incompatible(&pins) {
            Some(why) => LoadError::Incompatible(why),
            None => e,
        })?;
        Ok(Self::new(pins, programs, maps, adoption, features))
    }

    fn new(
        pins: Pins,
        programs: Programs,
        maps: Maps,
        adoption: Adoption,
        features: Features,
    ) -> Self {
        Self {
            pins,
            programs,
            node: None,
            dns_capture: true,
            maps,
            adoption,
            features,
            tc_attach: TcAttach::default(),
            local_route: false,
            retired: false,
        }
    }

    /// Names the node's netns (where kubelet lives and the host side of pods'
    /// veths is): from now on enrollments also attach the host-side program
    /// there, and the programs learn its cookie.
    pub fn set_node(&mut self, node: Node) -> Result<(), HostSideError> {
        if !self.programs.has(Program::Host) {
            return Err(HostSideError::NoProgram);
        }
        node.publish(&self.pins.maps())?;
        self.node = Some(node);
        Ok(())
    }

    /// Chooses how new tc attachments are made; `Tcx` on a kernel without
    /// tcx falls back to cls_bpf filters. Returns the attach in use.
    pub fn set_tc_attach(&mut self, wanted: TcAttach) -> TcAttach {
        self.tc_attach = match wanted {
            TcAttach::Tcx if !self.features.tcx => TcAttach::ClsBpf,
            w => w,
        };
        self.tc_attach
    }

    /// Whether pods enrolled from now on have their TCP take the local route
    /// (`--local-route`; see `podnet::localroute`). Only where tc programs
    /// can read a packet's netns (the verdict on `lo` goes by it) and the
    /// pins have `lo`'s egress program. Returns whether it is on. Pods
    /// enrolled before keep what they have.
    pub fn set_local_route(&mut self, wanted: bool) -> bool {
        self.local_route =
            wanted && self.features.netns_cookie_in_tc && self.programs.has(Program::LoOut);
        self.local_route
    }

    /// Whether pods enrolled from now on have their TCP take the local route.
    pub fn local_route(&self) -> bool {
        self.local_route
    }

    /// From now on nothing attaches: sluice is being removed from the node.
    pub fn retire(&mut self) {
        self.retired = true;
    }

    pub fn is_retired(&self) -> bool {
        self.retired
    }

    /// Sets the node's DNS capture default and applies it to every enrolled
    /// pod that did not choose for itself (a pod enrolled under another
    /// default follows the new one, as istio-cni reconciles existing pods
    /// on upgrade). Returns how many pods changed.
    pub fn set_dns_capture(&mut self, on: bool) -> Result<usize, StateError> {
        self.dns_capture = on;
        let mut changed = 0;
        for (cookie, _) in self.maps.states() {
            let options = self.maps.options(cookie);
            if self.maps.dns_on(cookie) != options.dns.resolve(on) {
                self.maps.set_options(cookie, &options, on)?;
                changed += 1;
            }
        }
        Ok(changed)
    }

    /// Puts exclusions `x` in force for pod `cookie` (one write of its
    /// `pod_exclusions` entry, then its flags: an excluded port 53 turns
    /// its DNS capture off). Returns whether anything changed.
    pub fn set_exclusions(
        &mut self,
        cookie: u64,
        x: &crate::exclusions::PodExclusions,
    ) -> Result<bool, StateError> {
        let mut options = self.maps.options(cookie);
        if options.exclusions == *x {
            return Ok(false);
        }
        options.exclusions = x.clone();
        self.maps.set_options(cookie, &options, self.dns_capture)?;
        Ok(true)
    }

    /// How kubelet's probes reach pods without capture, in words.
    pub fn probes(&self) -> String {
        match &self.node {
            Some(n) => format!(
                "exempt when a socket of the node netns ({}, cookie {}) opens them, and from 169.254.7.127",
                n.netns.path().display(),
                n.cookie
            ),
            None => "exempt only from 169.254.7.127 / fd16:9254:7127:1337:ffff:ffff:ffff:ffff (istio-cni's host SNAT); other host connections are captured".into(),
        }
    }

    pub fn pins(&self) -> &Pins {
        &self.pins
    }

    pub fn maps(&self) -> &Maps {
        &self.maps
    }

    pub fn maps_mut(&mut self) -> &mut Maps {
        &mut self.maps
    }

    /// The node's netns, once [`set_node`](Self::set_node) named it.
    pub fn node(&self) -> Option<&Node> {
        self.node.as_ref()
    }

    /// The pins, the maps to write and the node's netns at once (a
    /// teardown needs all three).
    pub fn parts_mut(&mut self) -> (&Pins, &mut Maps, Option<&Node>) {
        (&self.pins, &mut self.maps, self.node.as_ref())
    }

    /// What this process found pinned when it started.
    pub fn adoption(&self) -> &Adoption {
        &self.adoption
    }

    /// The kernel features the programs were loaded for.
    pub fn features(&self) -> Features {
        self.features
    }

    /// How new tc attachments are made.
    pub fn tc_attach(&self) -> TcAttach {
        self.tc_attach
    }

    /// The node's DNS capture default.
    pub fn dns_capture(&self) -> bool {
        self.dns_capture
    }

    /// Whether the pins have `p` (pins of an older build may lack some).
    pub fn has_program(&self, p: Program) -> bool {
        self.programs.has(p)
    }

    /// The kernel id of each of this build's programs (what a verification
    /// expects at each hook, and the only programs it runs).
    pub fn program_ids(&self) -> std::collections::BTreeMap<Program, u32> {
        self.programs.ids()
    }

    pub fn steer_mut(&mut self) -> &mut SkLookup {
        self.programs.steer()
    }

    /// The tc program `p`; `None` when the pins lack it.
    pub fn tc_program_mut(&mut self, p: Program) -> Option<&mut SchedClassifier> {
        self.programs.tc(p)
    }

    /// The host-side program and the node's netns it attaches in; `None`
    /// without either.
    pub fn host_side_mut(&mut self) -> Option<(&Node, &mut SchedClassifier)> {
        Some((self.node.as_ref()?, self.programs.tc(Program::Host)?))
    }
}

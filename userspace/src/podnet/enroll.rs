//! Enrolling and unenrolling one pod netns: attach (and pin) the links, install
//! the pod-side routing, write the shared state; register ztunnel's listeners
//! when they exist. Every step is undone on failure: no half-enrolled pod.

use std::{fs, path::Path};

use aya::programs::{
    links::{FdLink, PinnedLink},
    tc::TcAttachOptions,
    LinkOrder, ProgramError, TcAttachType,
};
use sluice_common::{ListenerKey, PodState, Role, NETNS_PATH_LEN};

use crate::{
    dataplane::loader::{Dataplane, Pins, Program},
    dataplane::state::{boottime_ns, Maps, StateError},
    dataplane::tcfilter,
    fault::crash_point,
    lifecycle::Event,
    options::PodOptions,
    podnet::hostside::{self, HostPeer},
    podnet::netns::{addresses, interfaces, Netns, NetnsError},
    podnet::podlinks::{self, expected_links, LinkSpec, Side},
    podnet::podview::PodView,
    podnet::routes::{self, RouteError},
    podnet::sockets::{self, SocketError},
    uid::PodUid,
    workload::Workload,
};

#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("pod {uid} is already enrolled (netns cookie {cookie})")]
    AlreadyEnrolled { uid: PodUid, cookie: u64 },
    #[error("netns {path} is already enrolled as pod {uid}")]
    NetnsTaken { path: String, uid: String },
    #[error("no enrolled pod has uid {0}")]
    UnknownPod(PodUid),
    #[error(
        "istio.io/reroute-virtual-interfaces ({0}) needs bpf_get_netns_cookie in tc programs \
         (Linux ≥ 6.15), which this kernel lacks: the pod is not captured"
    )]
    RerouteUnsupported(String),
    #[error(
        "istio.io/reroute-virtual-interfaces names {0}, which has no Ethernet header: \
         only Ethernet interfaces can be rerouted; the pod is not captured"
    )]
    RerouteOnL3(String),
    #[error("the pod of netns cookie {0} is being torn down (Draining): it is not enabled again")]
    Draining(u64),
    #[error("netns {0} now belongs to another namespace than the enrolled pod's")]
    NetnsReplaced(String),
    #[error("netns path {0:?} is too long (max {max} bytes) or not UTF-8", max = NETNS_PATH_LEN - 1)]
    BadPath(String),
    #[error("netns {path} is {why}: sluice never captures it")]
    HostNetns { path: String, why: &'static str },
    #[error("netns {0} has no interface besides lo: nothing to capture")]
    NoInterface(String),
    #[error("attaching {what}: {source}")]
    Attach { what: String, source: ProgramError },
    #[error("pinning {what}: {reason}")]
    Pin { what: String, reason: String },
    #[error("pod routing: {0}")]
    Routes(#[from] RouteError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error("finding ztunnel's listeners: {0}")]
    Sockets(#[from] SocketError),
    #[error("taking over from istio-cni: {0}")]
    Migrate(#[from] crate::dataplane::migrate::MigrateError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

impl From<crate::podnet::podview::ViewError> for EnrollError {
    fn from(e: crate::podnet::podview::ViewError) -> Self {
        use crate::podnet::podview::ViewError;
        match e {
            ViewError::Netns(e) => e.into(),
            ViewError::Io { what, path, source } => EnrollError::Io {
                what: format!("{what} in {path}"),
                source,
            },
        }
    }
}

/// What enrolling (or re-registering) a pod achieved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enrolled {
    pub cookie: u64,
    pub state: PodState,
    /// Roles for which a ztunnel listener is registered.
    pub roles: Vec<Role>,
}

/// Enrolls the pod whose netns is at `netns_path` without an agent: attach
/// capture, then register ztunnel's listeners if they already exist in the
/// netns (`Enabled`); otherwise the pod stays `Pending` (fail closed).
pub fn enroll(
    dp: &mut Dataplane,
    netns_path: &Path,
    uid: &PodUid,
    workload: &Workload,
) -> Result<Enrolled, EnrollError> {
    enroll_with(dp, netns_path, uid, workload, &PodOptions::default())
}

/// [`enroll`] with the pod's capture options.
pub fn enroll_with(
    dp: &mut Dataplane,
    netns_path: &Path,
    uid: &PodUid,
    workload: &Workload,
    options: &PodOptions,
) -> Result<Enrolled, EnrollError> {
    let a = attach_pod(dp, netns_path, uid, workload, options)?;
    if let Err(e) = take_over(&a.netns) {
        back_out(dp, &a.netns, a.cookie);
        return Err(e);
    }
    register(dp.maps_mut(), &a.netns, a.cookie, None)
}

/// A pod whose capture was just attached (`Pending`).
pub struct Attached {
    pub netns: Netns,
    pub cookie: u64,
    /// Host-side veths left without the host-side program because another
    /// tool's qdisc holds their hook ("IFACE (KIND)"): the node's own
    /// connections to the pod are captured.
    pub host_hooks_held: Vec<String>,
}

/// Attaches capture to a pod netns and records the pod as `Pending`: from its
/// first link on, its new connections fail closed until listeners are
/// registered. Returns the open netns and its cookie. The pod may still
/// carry istio-cni's rules: [`take_over`] comes next.
pub fn attach_pod(
    dp: &mut Dataplane,
    netns_path: &Path,
    uid: &PodUid,
    workload: &Workload,
    options: &PodOptions,
) -> Result<Attached, EnrollError> {
    let path = netns_path
        .to_str()
        .filter(|p| p.len() < NETNS_PATH_LEN)
        .ok_or_else(|| EnrollError::BadPath(netns_path.display().to_string()))?
        .to_owned();
    let netns = Netns::open(netns_path)?;
    if let Some(why) = netns.host_like() {
        return Err(EnrollError::HostNetns { path, why });
    }
    // The reroute program tells a pod by its listener's netns alone.
    if !options.reroute.is_empty() && !dp.features().netns_cookie_in_tc {
        return Err(EnrollError::RerouteUnsupported(options.reroute.join(",")));
    }
    let view = PodView::open(&netns)?;
    if view.ifaces.is_empty() {
        return Err(EnrollError::NoInterface(path));
    }
    let cookie = view.cookie;
    if let Some(cookie) = dp.maps().find_uid(uid) {
        return Err(EnrollError::AlreadyEnrolled {
            uid: uid.clone(),
            cookie,
        });
    }
    if dp.maps().entry(cookie).is_some() {
        let owner = dp.maps().meta(cookie).map(|m| m.uid).unwrap_or_default();
        return Err(EnrollError::NetnsTaken { path, uid: owner });
    }
    // Pins without state can only be the remains of an interrupted enroll;
    // a fresh pod has none, and skips the teardown's netlink round trips.
    if dp.pins().pod(cookie).exists() {
        teardown_in(dp, &netns, cookie)?;
    }

    let host_hooks_held = match attach(dp, &netns, &view, uid, &path, workload, options) {
        Ok(held) => held,
        Err(e) => {
            let _ = teardown_in(dp, &netns, cookie);
            return Err(e);
        }
    };
    Ok(Attached {
        netns,
        cookie,
        host_hooks_held,
    })
}

/// Takes a pod over from istio-cni, if it was istio-cni's: with sluice's
/// capture attached ([`attach_pod`]), Istio's in-pod rules go without a
/// moment uncaptured. Returns the iptables tools whose rules were removed
/// (empty: not istio-cni's pod). Runs those tools (seconds at worst, killed
/// after [`crate::dataplane::migrate::CHILD_TIMEOUT`]): the agent calls it without the
/// dataplane, so other pods' enrollments go on meanwhile. On an error the
/// caller backs the pod out ([`back_out`]): both rule sets at once would
/// misroute outbound traffic, so the pod is left to Istio's rules, with the
/// reason.
pub fn take_over(netns: &Netns) -> Result<Vec<&'static str>, EnrollError> {
    let tools = crate::dataplane::migrate::istio_rules(netns)?;
    if !tools.is_empty() {
        crate::dataplane::migrate::remove_istio_rules(netns, &tools)?;
        tracing::info!(
            ?tools,
            "took the pod over from istio-cni: its in-pod iptables rules are removed"
        );
    }
    Ok(tools)
}

/// Removes everything [`attach_pod`] attached for the pod of `cookie`,
/// whatever the pod's state: an enrollment that could not finish.
/// Best effort: what cannot be removed now, the next start's repair finds.
pub fn back_out(dp: &mut Dataplane, netns: &Netns, cookie: u64) {
    if let Err(e) = teardown_in(dp, netns, cookie) {
        tracing::warn!(cookie, error = %e, "backing out an enrollment left something behind");
    }
}

/// The node-side peers of the pod's interfaces, when the dataplane knows the
/// node netns, and those left out because another tool's qdisc holds their
/// hook ("IFACE (KIND)"). A failure to find them costs only the host-side
/// probe exemption (the pod is captured as before): it is logged, not
/// fatal. With the pod's `view` (an enrollment), from its link dump.
fn host_peers(
    dp: &Dataplane,
    netns: &Netns,
    view: Option<&PodView>,
    ifaces: &[String],
) -> (Vec<HostPeer>, Vec<String>) {
    let Some(node) = dp.node().filter(|_| dp.has_program(Program::Host)) else {
        return (Vec::new(), Vec::new());
    };
    let found = match view {
        Some(v) => hostside::peers_over(netns, &v.nl, &v.links, node),
        None => hostside::peers(netns, node, ifaces),
    };
    let mut peers = found.unwrap_or_else(|e| {
        tracing::warn!(
            netns = %netns.path().display(),
            error = %e,
            "cannot find the host side of the pod's interfaces: host-originated probes are captured"
        );
        Vec::new()
    });
    // A host veth whose hook another tool's `ingress` qdisc holds takes no
    // filter of ours (the pod side would be refused; here only the probe
    // exemption is lost). Asked of every peer, so that enrollment, repair
    // and CNI CHECK expect the same links.
    let mut held = Vec::new();
    if dp.tc_attach() != crate::dataplane::features::TcAttach::Tcx {
        peers.retain(|p| match tcfilter::foreign_hook_qdisc(&node.nl, p.host_index) {
            Ok(None) => true,
            Ok(Some(kind)) => {
                held.push(format!("{} ({kind})", p.host_iface));
                // Said once, at enrollment; repair and CHECK ask again.
                if view.is_some() {
                    tracing::warn!(
                        netns = %netns.path().display(),
                        host_iface = %p.host_iface,
                        qdisc = %kind,
                        "the pod's host-side veth has another tool's qdisc on its hook: no \
                         host-side program there, host-originated probes to the pod are captured"
                    );
                }
                false
            }
            // Unknown: attach as usual (a hook found taken then is skipped).
            Err(e) => {
                tracing::debug!(host_iface = %p.host_iface, error = %e, "asking for the host veth's qdisc");
                true
            }
        });
    }
    (peers, held)
}

/// The pod's interfaces besides `lo`, read inside its netns.
fn pod_interfaces(netns: &Netns, path: &str) -> Result<Vec<String>, EnrollError> {
    let ifaces: Vec<String> = netns
        .run(interfaces)?
        .map_err(|source| EnrollError::Io {
            what: "listing interfaces".into(),
            source,
        })?
        .into_iter()
        .filter(|i| i != "lo")
        .collect();
    if ifaces.is_empty() {
        return Err(EnrollError::NoInterface(path.to_owned()));
    }
    Ok(ifaces)
}

/// Attaches the pod's capture, one step at a time; every step is durable
/// before the next begins (a link is pinned right after its attach), so a
/// process killed at any point leaves a prefix of these steps, which the
/// next agent completes ([`repair`]). The state entry comes first and says
/// `Pending`: from their first link on, the programs fail closed for the pod.
fn attach(
    dp: &mut Dataplane,
    netns: &Netns,
    view: &PodView,
    uid: &PodUid,
    path: &str,
    workload: &Workload,
    options: &PodOptions,
) -> Result<Vec<String>, EnrollError> {
    let cookie = view.cookie;
    let node_dns = dp.dns_capture();
    dp.maps_mut()
        .attach(cookie, uid, path, workload, boottime_ns())?;
    // Before any link: a pod that bypasses inbound capture never has its
    // inbound captured. (Killed right here, the pod is enrolled without its
    // options: captured fully, the fail-closed side.)
    dp.maps_mut().set_options(cookie, options, node_dns)?;
    crash_point("enroll:state");
    publish_addrs(dp.maps_mut(), netns, cookie, &view.addrs)?;
    crash_point("enroll:addrs");
    // The sysctl is a file of the pod's /proc/sys: the one step that enters
    // the netns; the rest goes over the view's socket.
    netns.run(|| routes::set_migrate_req(true))??;
    let indexes: Vec<u32> = view.ifaces.iter().map(|i| i.index).collect();
    routes::install_over(&view.nl, &indexes, view.lo, view.ipv6)?;
    crash_point("enroll:routes");
    let ifaces = &view.names();
    let dir = dp.pins().pod(cookie);
    fs::create_dir_all(&dir).map_err(|source| EnrollError::Io {
        what: format!("creating {}", dir.display()),
        source,
    })?;
    // With tcx (`--tc-attach tcx`) each attach swaps the device's program
    // array and waits for an RCU grace period under RTNL (≈ 10–20 ms here);
    // cls_bpf filters (the default) need none.
    let (peers, mut held) = host_peers(dp, netns, Some(view), ifaces);
    let l3 = &view.l3_names();
    if let Some(i) = podlinks::reroute_on_l3(l3, &options.reroute) {
        return Err(EnrollError::RerouteOnL3(i.clone()));
    }
    for spec in expected_links(ifaces, l3, &peers, &options.reroute) {
        match attach_link(dp, netns, Some(view), &dir, &spec) {
            // Taken since it was asked: the host side only costs the probe
            // exemption, never the pod.
            Err(EnrollError::Attach { source, .. })
                if matches!(spec, LinkSpec::Host(_)) && tcfilter::is_hook_taken(&source) =>
            {
                if let LinkSpec::Host(p) = &spec {
                    held.push(format!("{} (not clsact)", p.host_iface));
                }
                continue;
            }
            r => r?,
        }
        crash_point(&format!("enroll:link:{}", spec.pin_name()));
    }
    Ok(held)
}

/// Attaches one link and pins it under `dir`; pod-side filters over
/// `view`'s socket when there is one (an enrollment), else from inside
/// `netns` (a repair).
fn attach_link(
    dp: &mut Dataplane,
    netns: &Netns,
    view: Option<&PodView>,
    dir: &Path,
    spec: &LinkSpec,
) -> Result<(), EnrollError> {
    let path = dir.join(spec.pin_name());
    let tcx = dp.tc_attach() == crate::dataplane::features::TcAttach::Tcx;
    let pod = |iface, kind| Tc {
        over: view.and_then(|v| Some((&v.nl, v.index(iface)?))),
        ..Tc::new(iface, kind, tcx)
    };
    match spec {
        LinkSpec::Steer => {
            let aerr = |source| EnrollError::Attach {
                what: "sk_lookup".into(),
                source,
            };
            let steer = dp.steer_mut();
            let id = steer.attach(netns).map_err(aerr)?;
            pin(FdLink::from(steer.take_link(id).map_err(aerr)?), &path)
        }
        LinkSpec::Egress(i) => {
            pod(i, TcAttachType::Egress).attach(required(dp, spec)?, netns, &path)
        }
        LinkSpec::Ingress(i) => {
            pod(i, TcAttachType::Ingress).attach(required(dp, spec)?, netns, &path)
        }
        LinkSpec::Lo => pod("lo", TcAttachType::Ingress).attach(required(dp, spec)?, netns, &path),
        LinkSpec::EgressL3(i) | LinkSpec::IngressL3(i) => {
            let (prog, kind) = match spec {
                LinkSpec::EgressL3(_) => {
                    (dp.tc_program_mut(Program::EgressL3), TcAttachType::Egress)
                }
                _ => (dp.tc_program_mut(Program::IngressL3), TcAttachType::Ingress),
            };
            let Some(prog) = prog else {
                return Err(EnrollError::Pin {
                    what: spec.pin_name(),
                    reason: "the pinned dataplane predates the programs for interfaces without an Ethernet header".into(),
                });
            };
            pod(i, kind).attach(prog, netns, &path)
        }
        LinkSpec::Reroute(i) => {
            let Some(prog) = dp.tc_program_mut(Program::Reroute) else {
                return Err(EnrollError::Pin {
                    what: spec.pin_name(),
                    reason: "the pinned dataplane predates the reroute program".into(),
                });
            };
            pod(i, TcAttachType::Ingress).attach(prog, netns, &path)
        }
        // In the node netns, first in the chain: it only writes hints and
        // passes every packet on (TCX_NEXT), so the primary CNI's programs
        // on the same device still see everything.
        LinkSpec::Host(peer) => {
            let Some((node, prog)) = dp.host_side_mut() else {
                return Err(EnrollError::Pin {
                    what: spec.pin_name(),
                    reason: "no node netns or host-side program".into(),
                });
            };
            Tc {
                order: LinkOrder::first(),
                over: Some((&node.nl, peer.host_index)),
                ..Tc::new(&peer.host_iface, TcAttachType::Egress, tcx)
            }
            .attach(prog, &node.netns, &path)
        }
    }
}

/// The tc program of `spec`, one every build has.
fn required<'d>(
    dp: &'d mut Dataplane,
    spec: &LinkSpec,
) -> Result<&'d mut aya::programs::SchedClassifier, EnrollError> {
    dp.tc_program_mut(spec.program())
        .ok_or_else(|| EnrollError::Pin {
            what: spec.pin_name(),
            reason: "the pinned dataplane lacks its program".into(),
        })
}

/// One tc attachment: sluice's cls_bpf filter (`tcfilter`), or with
/// `--tc-attach tcx` a tcx link (at `order` in the device's chain).
struct Tc<'a> {
    iface: &'a str,
    kind: TcAttachType,
    order: LinkOrder,
    tcx: bool,
    /// A socket in the hook's netns and the interface's index there: a
    /// filter goes over it (no visit of the netns).
    over: Option<(&'a crate::podnet::rtnl::Rtnl, u32)>,
}

impl<'a> Tc<'a> {
    /// After the device's other programs.
    fn new(iface: &'a str, kind: TcAttachType, tcx: bool) -> Self {
        Self {
            iface,
            kind,
            order: LinkOrder::default(),
            tcx,
            over: None,
        }
    }

    /// Attaches `prog` in `ns` and pins at `path` the link, or the program
    /// as the filter's record. Interface names resolve in the calling
    /// thread's netns, so the attach runs inside `ns`; the pin is made
    /// outside it (bpffs refuses pins from a thread in another netns).
    fn attach(
        self,
        prog: &mut aya::programs::SchedClassifier,
        ns: &Netns,
        path: &Path,
    ) -> Result<(), EnrollError> {
        let what = || format!("tc {:?} on {}", self.kind, self.iface);
        let aerr = |source| EnrollError::Attach {
            what: what(),
            source,
        };
        let (iface, kind) = (self.iface, self.kind);
        if !self.tcx {
            // The record first: a filter is no BPF object and outlives this
            // process, so one attached without its record would be left
            // running by a teardown (which goes by the records). A record
            // without its filter counts as not attached ([`attached`]).
            tcfilter::pin_record(prog, path).map_err(|e| EnrollError::Pin {
                what: path.display().to_string(),
                reason: e.to_string(),
            })?;
            if let Some(name) = path.file_name() {
                crash_point(&format!("enroll:record:{}", name.to_string_lossy()));
            }
            let attached = match self.over {
                Some((nl, index)) => tcfilter::attach_over(nl, prog, index, kind),
                None => ns.run(|| tcfilter::attach(prog, iface, kind))?,
            };
            if let Err(e) = attached {
                let _ = fs::remove_file(path);
                return Err(aerr(e));
            }
            return Ok(());
        }
        let order = self.order;
        let link = ns.run(|| -> Result<FdLink, EnrollError> {
            let id = prog
                .attach_with_options(iface, kind, TcAttachOptions::TcxOrder(order))
                .map_err(aerr)?;
            let link = prog.take_link(id).map_err(aerr)?;
            FdLink::try_from(link).map_err(|e| EnrollError::Pin {
                what: what(),
                reason: crate::error_line(&e),
            })
        })??;
        pin(link, path)
    }
}

/// Whether `spec` is attached, as its pin at `path` records: a link (attached
/// while pinned), or the program standing for a cls_bpf filter, which counts
/// only while the kernel still runs that program in sluice's filter on the
/// hook (a filter can be deleted behind the record's back).
fn attached(dp: &Dataplane, netns: &Netns, spec: &LinkSpec, path: &Path) -> bool {
    match tcfilter::pinned(path) {
        None => false,
        Some(tcfilter::Pinned::Link) => true,
        Some(tcfilter::Pinned::Program(id)) => {
            let Some(hook) = spec.tc_hook() else {
                return false;
            };
            let ns = match hook.side {
                Side::Pod => netns,
                Side::Node => match dp.node() {
                    Some(node) => &node.netns,
                    None => return false,
                },
            };
            let running = ns.run(|| tcfilter::filter_program(hook.iface, hook.kind));
            matches!(running, Ok(Ok(Some(running))) if running == id)
        }
    }
}

/// What [`repair`] found and did for one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Repair {
    /// Every link, route and address entry was in place.
    Complete,
    /// Something was missing and is in place now.
    Repaired {
        /// Links attached again (pin names).
        relinked: Vec<String>,
        /// istio-cni's rules an interrupted take-over left, removed (by the
        /// tools that listed them).
        istio_rules: Vec<&'static str>,
    },
    /// The pod was being torn down (`Draining`): the teardown is finished.
    TornDown,
}

/// Verifies an enrolled pod link by link and completes what is missing:
/// routes and sysctls (idempotent), its addresses, and every link its
/// current interfaces call for; with `takeover`, also istio-cni's in-pod
/// rules that an enrollment killed before its last step left behind (a
/// process spawn per pod: the agent asks for it at start only). A pod caught
/// in its teardown (`Draining`) is torn down completely instead: it never
/// comes back to life.
pub fn repair(dp: &mut Dataplane, cookie: u64, takeover: bool) -> Result<Repair, EnrollError> {
    let draining = dp.maps().entry(cookie).and_then(|e| e.state()) == Some(PodState::Draining);
    if draining {
        let netns = open_pod_netns(dp.maps(), cookie).ok();
        let (pins, maps, node) = dp.parts_mut();
        teardown(pins, maps, netns.as_ref(), node, cookie)?;
        return Ok(Repair::TornDown);
    }
    let netns = open_pod_netns(dp.maps(), cookie)?;
    let path = dp.maps().meta(cookie).map(|m| m.netns).unwrap_or_default();
    refresh_addrs(dp.maps_mut(), &netns, cookie)?;
    let ifaces = pod_interfaces(&netns, &path)?;
    netns.run(|| routes::install(&ifaces))??;
    let dir = dp.pins().pod(cookie);
    fs::create_dir_all(&dir).map_err(|source| EnrollError::Io {
        what: format!("creating {}", dir.display()),
        source,
    })?;
    let mut relinked = Vec::new();
    let (peers, _) = host_peers(dp, &netns, None, &ifaces);
    let reroute = dp.maps().options(cookie).reroute;
    let l3 = podlinks::l3_of(&netns, &ifaces);
    for spec in expected_links(&ifaces, &l3, &peers, &reroute) {
        let pin_path = dir.join(spec.pin_name());
        if attached(dp, &netns, &spec, &pin_path) {
            continue;
        }
        // A pin that does not open as a link is debris.
        let _ = fs::remove_file(&pin_path);
        attach_link(dp, &netns, None, &dir, &spec)?;
        relinked.push(spec.pin_name());
    }
    let mut istio_rules = Vec::new();
    if takeover {
        istio_rules = crate::dataplane::migrate::istio_rules(&netns)?;
        if !istio_rules.is_empty() {
            crate::dataplane::migrate::remove_istio_rules(&netns, &istio_rules)?;
        }
    }
    Ok(if relinked.is_empty() && istio_rules.is_empty() {
        Repair::Complete
    } else {
        Repair::Repaired {
            relinked,
            istio_rules,
        }
    })
}

/// The links a pod should have and has not (read only: nothing attached):
/// what a CNI CHECK reports. Empty when its capture is complete.
pub fn missing_links(dp: &Dataplane, cookie: u64) -> Result<Vec<String>, EnrollError> {
    let netns = open_pod_netns(dp.maps(), cookie)?;
    let path = dp.maps().meta(cookie).map(|m| m.netns).unwrap_or_default();
    let dir = dp.pins().pod(cookie);
    let ifaces = pod_interfaces(&netns, &path)?;
    let (peers, _) = host_peers(dp, &netns, None, &ifaces);
    let reroute = dp.maps().options(cookie).reroute;
    let l3 = podlinks::l3_of(&netns, &ifaces);
    Ok(expected_links(&ifaces, &l3, &peers, &reroute)
        .into_iter()
        .filter(|spec| !attached(dp, &netns, spec, &dir.join(spec.pin_name())))
        .map(|spec| spec.pin_name())
        .collect())
}

/// Removes the pin directories of pods that have no state entry (maps lost
/// or replaced while pods were enrolled) and what they stand for
/// ([`remove_stateless`]). `node` as for [`unenroll`]. Returns how many
/// there were.
pub fn remove_orphan_pins(
    pins: &Pins,
    maps: &Maps,
    node: Option<&hostside::Node>,
) -> Result<usize, EnrollError> {
    let known = maps.cookies();
    let mut n = 0;
    if let Ok(entries) = fs::read_dir(pins.pods()) {
        for e in entries.flatten() {
            let Some(cookie) = e.file_name().to_str().and_then(|s| s.parse::<u64>().ok()) else {
                continue;
            };
            if !known.contains(&cookie) {
                remove_stateless(pins, node, cookie)?;
                n += 1;
            }
        }
    }
    Ok(n)
}

fn pin(link: FdLink, path: &Path) -> Result<(), EnrollError> {
    link.pin(path).map(drop).map_err(|e| EnrollError::Pin {
        what: path.display().to_string(),
        reason: crate::error_line(&e),
    })
}

/// Publishes the pod's current addresses to the ingress programs (attach
/// does; re-registration does it once more, addresses may have changed).
pub fn refresh_addrs(maps: &mut Maps, netns: &Netns, cookie: u64) -> Result<(), EnrollError> {
    let addrs = netns.run(addresses)?.map_err(|source| EnrollError::Io {
        what: "listing the pod's addresses".into(),
        source,
    })?;
    publish_addrs(maps, netns, cookie, &addrs)
}

/// Publishes `addrs`, read from the pod's `netns`, as the pod's addresses.
fn publish_addrs(
    maps: &mut Maps,
    netns: &Netns,
    cookie: u64,
    addrs: &[std::net::IpAddr],
) -> Result<(), EnrollError> {
    let refused = maps.set_addrs(cookie, addrs)?;
    if !refused.is_empty() {
        tracing::warn!(
            cookie,
            addresses = ?refused,
            netns = %netns.path().display(),
            "the pod has addresses another enrolled pod owns: not taken over"
        );
    }
    Ok(())
}

/// Registers the listeners ztunnel has opened in the pod netns and moves the
/// pod to `Enabled` once every role has a listener. With `pid`, only that process's sockets are taken (the ztunnel
/// that just acked: during an upgrade the old one's are about to close).
pub fn register(
    maps: &mut Maps,
    netns: &Netns,
    cookie: u64,
    pid: Option<i32>,
) -> Result<Enrolled, EnrollError> {
    // The duplicates close here: the map holds its own reference to each
    // socket, and loses it when ztunnel closes the socket.
    register_keeping(maps, netns, cookie, pid).map(|(e, _)| e)
}

/// [`register`], handing back the duplicated listener sockets it put in the
/// map. While the caller keeps them, ztunnel closing its own descriptor does
/// not close the socket, so its map entry stays until the caller drops them
/// (the agent keeps a ztunnel's listeners until a newer ztunnel's replace
/// them: see `agent::node`).
pub fn register_keeping(
    maps: &mut Maps,
    netns: &Netns,
    cookie: u64,
    pid: Option<i32>,
) -> Result<(Enrolled, Vec<sockets::Listener>), EnrollError> {
    if maps.entry(cookie).and_then(|e| e.state()) == Some(PodState::Draining) {
        return Err(EnrollError::Draining(cookie));
    }
    let taken = sockets::take_listeners(netns, cookie, pid)?;
    for l in &taken {
        for &family in &l.families {
            maps.insert_listener(ListenerKey::new(cookie, l.role, family), &l.fd)?;
        }
    }
    let registered = maps.listeners_of(cookie);
    let roles: Vec<Role> = Role::ALL
        .into_iter()
        .filter(|r| registered.iter().any(|k| k.role == *r as u8))
        .collect();
    let complete = roles.len() == Role::ALL.len();
    let state = maps
        .apply(cookie, Event::Registered { complete }, boottime_ns())?
        // Never `None`: the machine keeps the entry of a registered pod.
        .unwrap_or(PodState::Pending);
    Ok((
        Enrolled {
            cookie,
            state,
            roles,
        },
        taken,
    ))
}

/// Opens an enrolled pod's netns again, checking it is still the same one.
pub fn open_pod_netns(maps: &Maps, cookie: u64) -> Result<Netns, EnrollError> {
    let path = maps.meta(cookie).map(|m| m.netns).unwrap_or_default();
    let netns = Netns::open(Path::new(&path))?;
    if netns.cookie()? != cookie {
        return Err(EnrollError::NetnsReplaced(path));
    }
    Ok(netns)
}

/// Re-registers the listeners of an enrolled pod (after ztunnel (re)started).
pub fn register_uid(dp: &mut Dataplane, uid: &PodUid) -> Result<Enrolled, EnrollError> {
    let cookie = dp
        .maps()
        .find_uid(uid)
        .ok_or_else(|| EnrollError::UnknownPod(uid.clone()))?;
    let netns = open_pod_netns(dp.maps(), cookie)?;
    refresh_addrs(dp.maps_mut(), &netns, cookie)?;
    register(dp.maps_mut(), &netns, cookie, None)
}

/// Unenrolls a pod: nothing of it remains (links, pins, routes, map entries).
/// `node`: the node's netns, where cls_bpf attachment has a filter on the
/// host side of the pod's veth (without it, that inert filter goes with the
/// veth).
pub fn unenroll(
    pins: &Pins,
    maps: &mut Maps,
    node: Option<&hostside::Node>,
    uid: &PodUid,
) -> Result<(), EnrollError> {
    let cookie = maps
        .find_uid(uid)
        .ok_or_else(|| EnrollError::UnknownPod(uid.clone()))?;
    // The netns may be gone with the pod (its routes went with it), or its
    // path may now name another netns: only touch the one with our cookie.
    let netns = open_pod_netns(maps, cookie).ok();
    teardown(pins, maps, netns.as_ref(), node, cookie)
}

/// Removes everything of one pod. Idempotent; also the rollback of `enroll`.
fn teardown(
    pins: &Pins,
    maps: &mut Maps,
    netns: Option<&Netns>,
    node: Option<&hostside::Node>,
    cookie: u64,
) -> Result<(), EnrollError> {
    // Fail closed while links go away one by one; `Draining` is final: a
    // teardown cut short is finished by the next agent (`repair`).
    // (Debris without a readable state has nothing to fail closed.)
    maps.apply(cookie, Event::Drain, boottime_ns())?;
    crash_point("unenroll:draining");
    remove_pod_side(pins, netns, node, cookie)?;
    crash_point("unenroll:routes");
    maps.apply(cookie, Event::TornDown, 0)?;
    Ok(())
}

/// Removes a pod's links (and their pins) and, in its netns when that is
/// open, its filters and routes: all of a teardown but the state entry.
fn remove_pod_side(
    pins: &Pins,
    netns: Option<&Netns>,
    node: Option<&hostside::Node>,
    cookie: u64,
) -> Result<(), EnrollError> {
    let ifaces: Vec<String> = match netns {
        Some(ns) => ns
            .run(interfaces)?
            .unwrap_or_default()
            .into_iter()
            .filter(|i| i != "lo")
            .collect(),
        None => Vec::new(),
    };
    remove_links(pins, cookie, &Filters::new(netns, node, &ifaces))?;
    if let Some(netns) = netns {
        netns.run(|| routes::remove(&ifaces))??;
    }
    Ok(())
}

/// Removes what is left of a pod that has pins but no state entry (maps
/// lost or unreadable, an uninstall of another version's pins): its links
/// go with their pins, and its filters and routes with them when its netns
/// still exists, found by the cookie its pin directory is named after (cls_bpf
/// filters are no BPF objects: they run on until removed in their netns).
fn remove_stateless(
    pins: &Pins,
    node: Option<&hostside::Node>,
    cookie: u64,
) -> Result<(), EnrollError> {
    let netns = crate::podnet::podns::find_by_cookie(cookie);
    if netns.is_none() {
        tracing::debug!(
            cookie,
            "no netns has this cookie any more: its filters went with it"
        );
    }
    remove_pod_side(pins, netns.as_ref(), node, cookie)
}

/// What [`remove_links`] needs to remove a pod's cls_bpf filters: the netns
/// they are in and the pod's interfaces as they are now, against which each
/// record's name is matched. A filter on an interface that is gone went
/// with it.
struct Filters<'a> {
    netns: Option<&'a Netns>,
    node: Option<&'a hostside::Node>,
    ifaces: &'a [String],
    /// The host sides of the pod's interfaces, looked up at the first
    /// host-side record (most pods have none).
    peers: std::cell::OnceCell<Vec<HostPeer>>,
}

impl<'a> Filters<'a> {
    fn new(
        netns: Option<&'a Netns>,
        node: Option<&'a hostside::Node>,
        ifaces: &'a [String],
    ) -> Self {
        Self {
            netns,
            node,
            ifaces,
            peers: Default::default(),
        }
    }

    /// The link the record `name` stands for, if its interface is still there.
    fn spec(&self, name: &str) -> Option<LinkSpec> {
        let named = |s: &LinkSpec| s.pin_name() == name;
        if let Some(s) = podlinks::possible_pod_links(self.ifaces)
            .into_iter()
            .find(named)
        {
            return Some(s);
        }
        let peers = self.peers.get_or_init(|| match (self.netns, self.node) {
            (Some(ns), Some(node)) => hostside::peers(ns, node, self.ifaces).unwrap_or_default(),
            _ => Vec::new(),
        });
        peers.iter().cloned().map(LinkSpec::Host).find(named)
    }

    /// Removes the filter the record `name` stands for, where it can be
    /// reached.
    fn detach(&self, name: &str) -> Result<(), EnrollError> {
        let Some(spec) = self.spec(name) else {
            return Ok(());
        };
        let Some(hook) = spec.tc_hook() else {
            return Ok(());
        };
        let ns = match hook.side {
            Side::Pod => self.netns,
            Side::Node => self.node.map(|n| &n.netns),
        };
        let (iface, kind) = (hook.iface, hook.kind);
        let Some(ns) = ns else { return Ok(()) };
        ns.run(|| tcfilter::detach(iface, kind))?
            .map_err(|source| EnrollError::Attach {
                what: format!("removing the tc {kind:?} filter on {iface}"),
                source,
            })
    }
}

/// [`teardown`] of a pod whose netns is open, with the dataplane's node.
fn teardown_in(dp: &mut Dataplane, netns: &Netns, cookie: u64) -> Result<(), EnrollError> {
    let (pins, maps, node) = dp.parts_mut();
    teardown(pins, maps, Some(netns), node, cookie)
}

/// Unpins (and so detaches) every link of a pod and removes its directory.
/// sk_lookup goes first: while the tc programs of a `Draining` pod still drop
/// new SYNs from outside, connections over lo (ztunnel's to the app, for a
/// connection it already accepted) must not meet an sk_lookup whose `lo`
/// hint is already gone, which would refuse them.
fn remove_links(pins: &Pins, cookie: u64, filters: &Filters<'_>) -> Result<(), EnrollError> {
    let dir = pins.pod(cookie);
    if let Ok(entries) = fs::read_dir(&dir) {
        let mut entries: Vec<_> = entries.flatten().collect();
        entries.sort_by_key(|e| e.file_name() != "steer");
        for e in entries {
            match tcfilter::pinned(&e.path()) {
                // Unpinned and dropped: the last reference goes, the link
                // detaches.
                Some(tcfilter::Pinned::Link) => match PinnedLink::from_pin(e.path()) {
                    Ok(link) => drop(link.unpin()),
                    Err(_) => drop(fs::remove_file(e.path())),
                },
                Some(tcfilter::Pinned::Program(_)) => {
                    filters.detach(&e.file_name().to_string_lossy())?;
                    drop(fs::remove_file(e.path()));
                }
                None => drop(fs::remove_file(e.path())),
            }
            crash_point(&format!(
                "unenroll:link:{}",
                e.file_name().to_string_lossy()
            ));
        }
    }
    match fs::remove_dir(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(EnrollError::Io {
            what: format!("removing {}", dir.display()),
            source: e,
        }),
        _ => Ok(()),
    }
}

/// How long an uninstall lets connections in flight through ztunnel finish
/// between steering nothing new and removing the tc programs that carry
/// them (a request and its answer, not a long-lived connection: those end
/// with capture, as when ztunnel goes). A SYN dropped meanwhile is retried
/// by its client after a second, and then reaches the pod uncaptured.
pub const UNINSTALL_DRAIN: std::time::Duration = std::time::Duration::from_millis(500);

/// The first step of a pod's teardown, alone: `Draining` (new SYNs from
/// outside fail closed) and its sk_lookup link gone (nothing new reaches
/// ztunnel). Its tc programs stay.
fn quiesce(pins: &Pins, maps: &mut Maps, cookie: u64) -> Result<(), EnrollError> {
    maps.apply(cookie, Event::Drain, boottime_ns())?;
    let steer = pins.pod(cookie).join(LinkSpec::Steer.pin_name());
    if let Ok(link) = PinnedLink::from_pin(&steer) {
        drop(link.unpin());
    }
    Ok(())
}

/// Unenrolls every pod and removes the node-wide pins. Works from whatever is
/// pinned, also when the maps cannot be opened (e.g. left by another version).
/// `node` as for [`unenroll`].
pub fn uninstall(pins: &Pins, node: Option<&hostside::Node>) -> Result<usize, EnrollError> {
    if !pins.root().exists() {
        return Ok(0);
    }
    let mut n = 0;
    let mut maps = Maps::open_pinned(&pins.maps()).ok();
    if let Some(maps) = maps.as_mut() {
        let cookies = maps.cookies();
        // First no pod takes new connections to ztunnel (its sk_lookup goes;
        // new SYNs from outside are dropped and retried), while the tc
        // programs still carry the connections ztunnel holds: those in
        // flight finish before the rest goes.
        for &cookie in &cookies {
            quiesce(pins, maps, cookie)?;
        }
        if !cookies.is_empty() {
            std::thread::sleep(UNINSTALL_DRAIN);
        }
        for cookie in cookies {
            let netns = open_pod_netns(maps, cookie).ok();
            teardown(pins, maps, netns.as_ref(), node, cookie)?;
            n += 1;
        }
    }
    // Pod directories with no map entry (interrupted enrolls, unreadable maps).
    if let Ok(entries) = fs::read_dir(pins.pods()) {
        for e in entries.flatten() {
            if let Some(cookie) = e.file_name().to_str().and_then(|s| s.parse().ok()) {
                remove_stateless(pins, node, cookie)?;
            }
        }
    }
    crate::dataplane::loader::remove_node_pins(pins).map_err(|e| EnrollError::Io {
        what: "removing node pins".into(),
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(n)
}

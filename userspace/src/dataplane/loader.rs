//! Loads sluice's programs and maps once per node and pins them; later
//! processes adopt the pins. Enrolling a pod then costs only link attaches and
//! map writes (a per-pod load + verify would cost 65–100 ms).
//!
//! The agent's start also replaces the programs of another build in place,
//! and migrates maps of another size (see `upgrade`).
//!
//! Layout under the bpffs root (default `/sys/fs/bpf/sluice`):
//! ```text
//! progs/{steer,egress,ingress,lo,host,reroute}   the six programs
//! maps/{pod_state,pod_meta,pod_addrs,pod_flags,pod_reroute,listeners,counters,flow_hints,node_netns,stamp,
//!      dns_listeners,dns_flows,dns_counters,drops,tc_lookup}
//! maps_next/                        only during a migration
//! pods/<netns cookie>/{steer,egress_<if>,ingress_<if> or reroute_<if>,lo,host_<if>}   a pod's links
//! ```

use std::{
    fs,
    path::{Path, PathBuf},
};

use aya::{
    maps::MapData,
    programs::{ProgramError, SchedClassifier, SkLookup},
    Ebpf, EbpfLoader,
};

use crate::{
    dataplane::features::{Features, TcAttach},
    dataplane::state::{Maps, StateError},
};

/// The eBPF object built by `cargo xtask build-ebpf`, embedded at compile time.
static EMBEDDED_OBJECT: &[u8] = aya::include_bytes_aligned!(env!("SLUICE_EBPF_OBJECT"));

/// The object this process loads: the embedded one, or in a test build
/// (`fault-injection`) the file `SLUICE_EBPF_OBJECT_FILE` names — so the
/// upgrade tests can run "another build" of the programs.
fn ebpf_object() -> std::borrow::Cow<'static, [u8]> {
    #[cfg(feature = "fault-injection")]
    if let Some(path) = std::env::var_os("SLUICE_EBPF_OBJECT_FILE") {
        return std::borrow::Cow::Owned(fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "SLUICE_EBPF_OBJECT_FILE {}: {e}",
                Path::new(&path).display()
            )
        }));
    }
    std::borrow::Cow::Borrowed(EMBEDDED_OBJECT)
}

/// The object compiled into this binary.
pub fn embedded_object() -> &'static [u8] {
    EMBEDDED_OBJECT
}

pub const DEFAULT_ROOT: &str = "/sys/fs/bpf/sluice";
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Program names in the object, which are also their pin names under `progs/`.
pub const PROG_STEER: &str = "sluice_steer";
pub const PROG_EGRESS: &str = "sluice_egress";
pub const PROG_INGRESS: &str = "sluice_ingress";
pub const PROG_LO: &str = "sluice_lo";
pub const PROG_HOST: &str = "sluice_host";
pub const PROG_REROUTE: &str = "sluice_reroute";
pub const PROG_EGRESS_L3: &str = "sluice_egress_l3";
pub const PROG_INGRESS_L3: &str = "sluice_ingress_l3";

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("bpffs: {0}")]
    Bpffs(String),
    #[error("loading the eBPF object: {0}")]
    Object(#[from] aya::EbpfError),
    #[error("program {name}: {source}{hint}")]
    Program {
        name: &'static str,
        source: ProgramError,
        hint: &'static str,
    },
    #[error("pinning {path}: {source}")]
    Pin {
        path: PathBuf,
        source: aya::pin::PinError,
    },
    #[error(transparent)]
    State(#[from] StateError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error(
        "this sluice binary was built without its eBPF object (`cargo xtask build-ebpf` had not \
         run): it cannot load the dataplane; build the object and then sluice again"
    )]
    NoObject,
    #[error("sluice is not loaded on this node (nothing pinned under {0}); enroll a pod first")]
    NotLoaded(PathBuf),
    #[error(
        "the pinned dataplane's maps have a layout this build cannot take over ({0}); the \
         pinned build's programs keep capturing every enrolled pod. Deploy the previous build \
         or one that converts these maps"
    )]
    Incompatible(String),
    #[error("this kernel lacks what sluice needs: {}", .0.join(", "))]
    KernelTooOld(Vec<&'static str>),
}

/// An `EbpfLoader` whose programs' feature globals follow `features`.
fn loader_for(features: Features) -> EbpfLoader<'static> {
    static VALUES: [u8; 2] = [0, 1];
    let mut l = EbpfLoader::new();
    let cookie = &VALUES[usize::from(features.netns_cookie_in_tc)];
    l.override_global("NETNS_COOKIE_IN_TC", cookie, true);
    l
}

/// Where everything lives in bpffs.
#[derive(Debug, Clone)]
pub struct Pins {
    root: PathBuf,
}

impl Pins {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }
    pub fn root(&self) -> &Path {
        &self.root
    }
    pub fn progs(&self) -> PathBuf {
        self.root.join("progs")
    }
    pub fn maps(&self) -> PathBuf {
        self.root.join("maps")
    }
    pub fn pods(&self) -> PathBuf {
        self.root.join("pods")
    }
    pub fn pod(&self, cookie: u64) -> PathBuf {
        self.pods().join(cookie.to_string())
    }
    pub fn is_loaded(&self) -> bool {
        self.progs().join(PROG_STEER).exists()
    }
}

/// The node's dataplane: the programs and the shared maps.
pub struct Dataplane {
    pub pins: Pins,
    pub steer: SkLookup,
    pub egress: SchedClassifier,
    pub ingress: SchedClassifier,
    pub lo: SchedClassifier,
    /// The host-side program; `None` only on pins of a build before it that
    /// this (non-upgrading) process adopted.
    pub host: Option<SchedClassifier>,
    /// The reroute program (virtual interfaces); `None` as `host`.
    pub reroute: Option<SchedClassifier>,
    /// The egress and ingress programs for interfaces without an Ethernet
    /// header; `None` as `host`.
    pub egress_l3: Option<SchedClassifier>,
    pub ingress_l3: Option<SchedClassifier>,
    /// The node's netns, where the host side of pods' interfaces lives; set
    /// by [`Dataplane::set_node`]. Without it no host-side link is attached.
    pub node: Option<crate::podnet::hostside::Node>,
    /// The node's DNS capture default (`--dns-capture`), for pods whose
    /// annotations do not choose; see [`Dataplane::set_dns_capture`].
    pub dns_capture: bool,
    pub maps: Maps,
    /// What this process found pinned when it started.
    pub adoption: Adoption,
    /// The kernel features the programs were loaded for (probed; fewer in
    /// tests of the fallbacks).
    pub features: Features,
    /// How new tc attachments are made ([`Dataplane::set_tc_attach`]); pods
    /// attached otherwise before keep theirs until re-enrolled.
    pub tc_attach: TcAttach,
}

/// How a process came by the dataplane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adoption {
    /// Nothing was pinned: this process loaded and pinned its own build.
    Loaded,
    /// Adopted as pinned: this build's programs (same tags), or not
    /// compared (a CLI process; only the agent upgrades).
    Same,
    /// The pinned programs were another build's: every pod's links were
    /// pointed at this build's programs in place (`BPF_LINK_UPDATE`, atomic
    /// per link) and the program pins replaced.
    Upgraded {
        programs: Vec<&'static str>,
        links: usize,
    },
    /// The pinned maps had another layout (size or flags): this build's
    /// maps were created beside them, the state copied (listeners
    /// re-registered from the pods' netns), every pod link pointed at this
    /// build's programs and the map and program pins replaced.
    Migrated { maps: Vec<String>, links: usize },
    /// Another build's programs stay in place because this build's could not
    /// be loaded beside them (why).
    Kept(String),
}

impl std::fmt::Display for Adoption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Adoption::Loaded => f.write_str("loaded by this agent"),
            Adoption::Same => f.write_str("adopted (this build's programs)"),
            Adoption::Upgraded { programs, links } => write!(
                f,
                "upgraded in place at start: {} replaced, {links} pod links switched",
                programs.join(", ")
            ),
            Adoption::Migrated { maps, links } => write!(
                f,
                "migrated at start to this build's map layout ({}), {links} pod links switched",
                maps.join("; ")
            ),
            Adoption::Kept(why) => write!(f, "running another build's programs: {why}"),
        }
    }
}

/// The program each link pin of a pod runs (its pin name says its role).
fn program_of_link(pin_name: &str) -> Option<&'static str> {
    match pin_name {
        "steer" => Some(PROG_STEER),
        "lo" => Some(PROG_LO),
        n if n.starts_with("egress_") => Some(PROG_EGRESS),
        n if n.starts_with("ingress_") => Some(PROG_INGRESS),
        n if n.starts_with("host_") => Some(PROG_HOST),
        n if n.starts_with("reroute_") => Some(PROG_REROUTE),
        n if n.starts_with("l3egress_") => Some(PROG_EGRESS_L3),
        n if n.starts_with("l3ingress_") => Some(PROG_INGRESS_L3),
        _ => None,
    }
}

/// What an agent's start does besides adopting the pinned dataplane.
struct Upgrade<'a> {
    /// Where the host-side filters are (kernels without tcx).
    node: Option<&'a crate::podnet::hostside::Node>,
}

/// A replacement program is pinned under this suffix, then renamed over the
/// old pin (bpffs renames replace atomically), so the program pins are never
/// missing, even to a process killed in between.
const NEXT: &str = "_next";

/// Where a migration creates this build's maps before their pins replace the
/// old ones (under the bpffs root).
const MAPS_NEXT: &str = "maps_next";

/// Maps a migration does not copy: ztunnel's listeners (re-registered from
/// the pods' netns: a socket map cannot be read from user space) and flow
/// hints (each is needed for a handshake, and honoured for seconds at most).
const REBUILT: [&str; 2] = ["listeners", "flow_hints"];

/// Per-CPU map types (`BPF_MAP_TYPE_PERCPU_HASH`, `_PERCPU_ARRAY`,
/// `_LRU_PERCPU_HASH`): user space reads one value per possible CPU.
const PER_CPU: [u32; 3] = [5, 6, 10];

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
    pub fn load_adopt_or_upgrade(
        pins: Pins,
        node: Option<&crate::podnet::hostside::Node>,
    ) -> Result<Self, LoadError> {
        Self::open(pins, Some(Upgrade { node }), Features::get())
    }

    fn open(pins: Pins, upgrade: Option<Upgrade>, features: Features) -> Result<Self, LoadError> {
        ensure_bpffs(pins.root())?;
        let _lock = lock(&pins)?;
        if !pins.is_loaded() {
            return Self::load(pins, features);
        }
        // Before the maps are opened as this build's types: a migration may
        // have to replace them first.
        let adoption = if let Some(Upgrade { node }) = upgrade {
            match Self::upgrade(&pins, features, node) {
                Ok(a) => a,
                Err(e) => Adoption::Kept(crate::error_line(&e)),
            }
        } else {
            Adoption::Same
        };
        let mut dp =
            Self::adopt(pins.clone(), features).map_err(|e| match incompatible(&pins) {
                Some(why) => LoadError::Incompatible(why),
                None => e,
            })?;
        dp.adoption = adoption;
        Ok(dp)
    }

    /// Replaces pinned programs of another build with this build's, in place:
    /// loads this build's programs against the pinned maps, compares tags,
    /// points every pod link of a changed program at the new one, then swaps
    /// the program pins. When a pinned map has another size or flags than
    /// this build's, migrates first: this build's version of that map is
    /// created under `maps_next/`, the entries copied (ztunnel's listeners
    /// re-registered from the pods' netns; flow hints, needed for
    /// a handshake, not copied), every link is pointed at this build's
    /// programs, then the map pins are renamed over the old ones. Idempotent:
    /// a process killed midway leaves every link on a working build's
    /// programs, the old pinned maps authoritative until their renames, and
    /// the next start finishes.
    fn upgrade(
        pins: &Pins,
        features: Features,
        node: Option<&crate::podnet::hostside::Node>,
    ) -> Result<Adoption, LoadError> {
        let object = ebpf_object();
        if object.is_empty() {
            return Ok(Adoption::Same);
        }
        let next_dir = pins.root().join(MAPS_NEXT);
        // Leftovers of a replacement killed before its renames.
        for name in [
            PROG_STEER,
            PROG_EGRESS,
            PROG_INGRESS,
            PROG_LO,
            PROG_HOST,
            PROG_REROUTE,
            PROG_EGRESS_L3,
            PROG_INGRESS_L3,
        ] {
            let _ = fs::remove_file(pins.progs().join(format!("{name}{NEXT}")));
        }
        for e in fs::read_dir(&next_dir).into_iter().flatten().flatten() {
            let _ = fs::remove_file(e.path());
        }
        for pod in fs::read_dir(pins.pods()).into_iter().flatten().flatten() {
            for e in fs::read_dir(pod.path()).into_iter().flatten().flatten() {
                if e.file_name()
                    .to_string_lossy()
                    .starts_with(crate::dataplane::refilter::NEXT_PREFIX)
                {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
        let layout_err = |what: &str, e: String| LoadError::Io {
            what: what.to_owned(),
            source: std::io::Error::other(e),
        };
        let ours = crate::dataplane::stamp::of_object(&object)
            .map_err(|e| layout_err("reading this build's map layout", e.to_string()))?;
        let pinned = crate::dataplane::stamp::of_pinned(&pins.maps(), ours.keys())
            .map_err(|e| layout_err("reading the pinned maps' layout", e.to_string()))?;
        let changes = crate::dataplane::stamp::changes(&ours, &pinned);
        if let Some(c) = changes
            .iter()
            .find(|c| !c.copyable() && !REBUILT.contains(&c.map.as_str()))
        {
            return Ok(Adoption::Kept(format!(
                "the pinned maps have a layout this build cannot migrate ({c}); the pinned build keeps running"
            )));
        }
        if !changes.is_empty() {
            fs::create_dir_all(&next_dir).map_err(|source| LoadError::Io {
                what: format!("creating {}", next_dir.display()),
                source,
            })?;
        }
        let mut loader = loader_for(features);
        loader.default_map_pin_directory(pins.maps());
        for c in &changes {
            loader.map_pin_path(c.map.as_str(), next_dir.join(&c.map));
        }
        let mut ebpf = loader.load(&object)?;
        let perr = |name: &'static str| {
            move |source: ProgramError| LoadError::Program {
                hint: kernel_hint(&source),
                name,
                source,
            }
        };
        let missing = |name| perr(name)(ProgramError::NotLoaded);
        {
            let p: &mut SkLookup = ebpf
                .program_mut(PROG_STEER)
                .ok_or_else(|| missing(PROG_STEER))?
                .try_into()
                .map_err(perr(PROG_STEER))?;
            p.load().map_err(perr(PROG_STEER))?;
        }
        for name in [
            PROG_EGRESS,
            PROG_INGRESS,
            PROG_LO,
            PROG_HOST,
            PROG_REROUTE,
            PROG_EGRESS_L3,
            PROG_INGRESS_L3,
        ] {
            let p: &mut SchedClassifier = ebpf
                .program_mut(name)
                .ok_or_else(|| missing(name))?
                .try_into()
                .map_err(perr(name))?;
            p.load().map_err(perr(name))?;
        }
        if !changes.is_empty() {
            Self::fill_next(pins, &changes, &next_dir)?;
            crate::fault::crash_point("migrate_filled");
        }
        let tag = |name: &'static str| -> Result<u64, LoadError> {
            let p = ebpf.program(name).ok_or_else(|| missing(name))?;
            Ok(p.info().map_err(perr(name))?.tag())
        };
        let (steer, egress, ingress, lo) = pinned_programs(pins)?;
        // Pins of a build before a program have none: it counts as changed
        // (pinned, no link to switch).
        let optional_tag = |name: &'static str| -> Result<u64, LoadError> {
            match pinned_optional(pins, name) {
                Some(p) => Ok(p.info().map_err(perr(name))?.tag()),
                None => Ok(0),
            }
        };
        let pinned = [
            (PROG_STEER, steer.info().map_err(perr(PROG_STEER))?.tag()),
            (PROG_EGRESS, egress.info().map_err(perr(PROG_EGRESS))?.tag()),
            (
                PROG_INGRESS,
                ingress.info().map_err(perr(PROG_INGRESS))?.tag(),
            ),
            (PROG_LO, lo.info().map_err(perr(PROG_LO))?.tag()),
            (PROG_HOST, optional_tag(PROG_HOST)?),
            (PROG_REROUTE, optional_tag(PROG_REROUTE)?),
            (PROG_EGRESS_L3, optional_tag(PROG_EGRESS_L3)?),
            (PROG_INGRESS_L3, optional_tag(PROG_INGRESS_L3)?),
        ];
        // A program's tag ignores which maps it uses: after a migration every
        // program is replaced, since the new maps are only the new programs'.
        let mut changed = Vec::new();
        for (name, t) in pinned {
            if !changes.is_empty() || tag(name)? != t {
                changed.push(name);
            }
        }
        let stamp = |pins: &Pins| {
            if let Err(e) = crate::dataplane::stamp::write(&pins.maps(), &object, &ours) {
                tracing::warn!(error = %e, "could not write the dataplane stamp");
            }
        };
        if changed.is_empty() {
            stamp(pins);
            return Ok(Adoption::Same);
        }
        // Every pod's links of a changed program, each switched atomically:
        // a tcx or sk_lookup link by BPF_LINK_UPDATE, a cls_bpf filter
        // (kernels without tcx) replaced at its handle.
        let mut links = 0;
        let mut filters = crate::dataplane::refilter::Refilter::new(&pins.maps(), node);
        let pods = fs::read_dir(pins.pods()).map_err(|source| LoadError::Io {
            what: format!("listing {}", pins.pods().display()),
            source,
        })?;
        for pod in pods.flatten() {
            let cookie = pod.file_name().to_str().and_then(|c| c.parse::<u64>().ok());
            for link in fs::read_dir(pod.path()).into_iter().flatten().flatten() {
                let name = link.file_name();
                let Some(prog) = program_of_link(&name.to_string_lossy()) else {
                    continue;
                };
                if !changed.contains(&prog) {
                    continue;
                }
                let switched = match crate::dataplane::tcfilter::pinned(&link.path()) {
                    Some(crate::dataplane::tcfilter::Pinned::Link) => {
                        let p = ebpf.program(prog).ok_or_else(|| missing(prog))?;
                        let fd = p.fd().map_err(perr(prog))?;
                        crate::dataplane::relink::update(
                            &link.path(),
                            std::os::fd::AsFd::as_fd(fd),
                        )
                        .map_err(|source| LoadError::Io {
                            what: format!(
                                "pointing {} at this build's {prog}",
                                link.path().display()
                            ),
                            source,
                        })?;
                        true
                    }
                    Some(crate::dataplane::tcfilter::Pinned::Program(_)) => {
                        let p: &mut SchedClassifier = ebpf
                            .program_mut(prog)
                            .ok_or_else(|| missing(prog))?
                            .try_into()
                            .map_err(perr(prog))?;
                        let Some(cookie) = cookie else { continue };
                        filters
                            .switch(cookie, &link.path(), p)
                            .map_err(|e| LoadError::Io {
                                what: format!(
                                    "pointing the filter of {} at this build's {prog}",
                                    link.path().display()
                                ),
                                source: std::io::Error::other(e.to_string()),
                            })?
                    }
                    None => false,
                };
                if switched {
                    links += 1;
                    crate::fault::crash_point("upgrade_link");
                }
            }
        }
        crate::fault::crash_point("upgrade_links");
        // Then the program pins: new enrollments use this build's programs.
        for &name in &changed {
            let path = pins.progs().join(name);
            let next = pins.progs().join(format!("{name}{NEXT}"));
            let p = ebpf.program_mut(name).ok_or_else(|| missing(name))?;
            p.pin(&next).map_err(|source| LoadError::Pin {
                path: next.clone(),
                source,
            })?;
            crate::fault::crash_point("upgrade_pin_next");
            fs::rename(&next, &path).map_err(|source| LoadError::Io {
                what: format!("replacing {}", path.display()),
                source,
            })?;
            crate::fault::crash_point("upgrade_pin");
        }
        // Last the map pins (bpffs renames replace atomically).
        for c in &changes {
            let to = pins.maps().join(&c.map);
            fs::rename(next_dir.join(&c.map), &to).map_err(|source| LoadError::Io {
                what: format!("replacing {}", to.display()),
                source,
            })?;
            crate::fault::crash_point("migrate_map_pin");
        }
        let _ = fs::remove_dir(&next_dir);
        stamp(pins);
        Ok(if changes.is_empty() {
            Adoption::Upgraded {
                programs: changed,
                links,
            }
        } else {
            Adoption::Migrated {
                maps: changes.iter().map(ToString::to_string).collect(),
                links,
            }
        })
    }

    /// Fills this build's maps under `next_dir` from the pinned ones: a byte
    /// copy of every entry, then ztunnel's listeners of every pod, found
    /// again in its netns (a socket map cannot be read back from user space).
    fn fill_next(
        pins: &Pins,
        changes: &[crate::dataplane::stamp::Change],
        next_dir: &Path,
    ) -> Result<(), LoadError> {
        use std::os::fd::AsFd as _;
        let io = |what: String| move |source| LoadError::Io { what, source };
        for c in changes {
            if REBUILT.contains(&c.map.as_str()) {
                continue;
            }
            let open = |dir: &Path| {
                MapData::from_pin(dir.join(&c.map)).map_err(|e| LoadError::Io {
                    what: format!("opening map {}", c.map),
                    source: std::io::Error::other(e),
                })
            };
            let (from, to) = (open(&pins.maps())?, open(next_dir)?);
            let bytes = crate::dataplane::mapcopy::value_bytes(
                c.ours.value_size,
                PER_CPU.contains(&c.ours.map_type),
            )
            .map_err(io("counting CPUs".into()))?;
            let n = crate::dataplane::mapcopy::copy(
                from.fd().as_fd(),
                to.fd().as_fd(),
                c.ours.key_size,
                bytes,
            )
            .map_err(io(format!("copying map {} ({c})", c.map)))?;
            tracing::info!(map = %c.map, entries = n, "map migrated");
        }
        if changes.iter().any(|c| c.map == "listeners") {
            let changed = |n: &str| changes.iter().any(|c| c.map == n);
            let mut next = Maps::from_maps(|name| {
                let dir = if changed(name) {
                    next_dir.to_owned()
                } else {
                    pins.maps()
                };
                let data = MapData::from_pin(dir.join(name))
                    .map_err(|source| StateError::Map { name, source })?;
                aya::maps::Map::from_map_data(data)
                    .map_err(|source| StateError::Map { name, source })
            })?;
            for cookie in next.cookies() {
                let path = next.meta(cookie).map(|m| m.netns).unwrap_or_default();
                let Ok(ns) = crate::podnet::netns::Netns::open(Path::new(&path)) else {
                    continue;
                };
                if ns.cookie().ok() != Some(cookie) {
                    continue;
                }
                for l in
                    crate::podnet::sockets::take_listeners(&ns, cookie, None).unwrap_or_default()
                {
                    for &family in &l.families {
                        next.insert_listener(
                            sluice_common::ListenerKey::new(cookie, l.role, family),
                            &l.fd,
                        )?;
                    }
                }
            }
        }
        Ok(())
    }

    fn adopt(pins: Pins, features: Features) -> Result<Self, LoadError> {
        let (steer, egress, ingress, lo) = pinned_programs(&pins)?;
        Ok(Self {
            steer,
            egress,
            ingress,
            lo,
            host: pinned_optional(&pins, PROG_HOST),
            reroute: pinned_optional(&pins, PROG_REROUTE),
            egress_l3: pinned_optional(&pins, PROG_EGRESS_L3),
            ingress_l3: pinned_optional(&pins, PROG_INGRESS_L3),
            node: None,
            dns_capture: true,
            maps: Maps::open_pinned(&pins.maps())?,
            pins,
            adoption: Adoption::Same,
            features,
            tc_attach: TcAttach::default(),
        })
    }

    fn load(pins: Pins, features: Features) -> Result<Self, LoadError> {
        let object = ebpf_object();
        if object.is_empty() {
            return Err(LoadError::NoObject);
        }
        for d in [pins.progs(), pins.maps(), pins.pods()] {
            fs::create_dir_all(&d).map_err(|source| LoadError::Io {
                what: format!("creating {}", d.display()),
                source,
            })?;
        }
        let missing = features.missing();
        if !missing.is_empty() {
            return Err(LoadError::KernelTooOld(missing));
        }
        let mut ebpf = loader_for(features)
            .default_map_pin_directory(pins.maps())
            .load(&object)?;
        let result = (|| {
            let steer = load_prog::<SkLookup>(&mut ebpf, PROG_STEER, &pins)?;
            let egress = load_prog::<SchedClassifier>(&mut ebpf, PROG_EGRESS, &pins)?;
            let ingress = load_prog::<SchedClassifier>(&mut ebpf, PROG_INGRESS, &pins)?;
            let lo = load_prog::<SchedClassifier>(&mut ebpf, PROG_LO, &pins)?;
            let host = load_prog::<SchedClassifier>(&mut ebpf, PROG_HOST, &pins)?;
            let reroute = load_prog::<SchedClassifier>(&mut ebpf, PROG_REROUTE, &pins)?;
            let egress_l3 = load_prog::<SchedClassifier>(&mut ebpf, PROG_EGRESS_L3, &pins)?;
            let ingress_l3 = load_prog::<SchedClassifier>(&mut ebpf, PROG_INGRESS_L3, &pins)?;
            Ok((
                steer, egress, ingress, lo, host, reroute, egress_l3, ingress_l3,
            ))
        })();
        let (steer, egress, ingress, lo, host, reroute, egress_l3, ingress_l3) = match result {
            Ok(p) => p,
            Err(e) => {
                // Leave nothing half-loaded: the next attempt starts clean.
                let _ = remove_node_pins(&pins);
                return Err(e);
            }
        };
        let maps = Maps::from_maps(|name| ebpf.take_map(name).ok_or(StateError::Missing(name)))?;
        match crate::dataplane::stamp::of_object(&object) {
            Ok(layout) => {
                if let Err(e) = crate::dataplane::stamp::write(&pins.maps(), &object, &layout) {
                    tracing::warn!(error = %e, "could not write the dataplane stamp");
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not read this build's map layout"),
        }
        Ok(Self {
            pins,
            steer,
            egress,
            ingress,
            lo,
            host: Some(host),
            reroute: Some(reroute),
            egress_l3: Some(egress_l3),
            ingress_l3: Some(ingress_l3),
            node: None,
            dns_capture: true,
            maps,
            adoption: Adoption::Loaded,
            features,
            tc_attach: TcAttach::default(),
        })
    }
}

impl Dataplane {
    /// Names the node's netns (where kubelet lives and the host side of pods'
    /// veths is): from now on enrollments also attach the host-side program
    /// there, and the programs learn its cookie.
    pub fn set_node(
        &mut self,
        node: crate::podnet::hostside::Node,
    ) -> Result<(), crate::podnet::hostside::HostSideError> {
        if self.host.is_none() {
            return Err(crate::podnet::hostside::HostSideError::NoProgram);
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

    /// Sets the node's DNS capture default and applies it to every enrolled
    /// pod that did not choose for itself (a pod enrolled under another
    /// default follows the new one, as istio-cni reconciles existing pods
    /// on upgrade). Returns how many pods changed.
    pub fn set_dns_capture(
        &mut self,
        on: bool,
    ) -> Result<usize, crate::dataplane::state::StateError> {
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
}

/// What in the pinned maps this build cannot open as its own types (another
/// map type, key or value size), if anything.
fn incompatible(pins: &Pins) -> Option<String> {
    let object = ebpf_object();
    let ours = crate::dataplane::stamp::of_object(&object).ok()?;
    let pinned = crate::dataplane::stamp::of_pinned(&pins.maps(), ours.keys()).ok()?;
    let bad: Vec<String> = crate::dataplane::stamp::changes(&ours, &pinned)
        .iter()
        .filter(|c| !c.copyable())
        .map(ToString::to_string)
        .collect();
    (!bad.is_empty()).then(|| bad.join("; "))
}

/// A pinned tc program that pins of an older build may lack.
fn pinned_optional(pins: &Pins, name: &str) -> Option<SchedClassifier> {
    SchedClassifier::from_pin(pins.progs().join(name)).ok()
}

/// Handles on the four pinned programs every build has.
fn pinned_programs(
    pins: &Pins,
) -> Result<(SkLookup, SchedClassifier, SchedClassifier, SchedClassifier), LoadError> {
    let prog = |name: &'static str| pins.progs().join(name);
    let perr = |name| {
        move |source| LoadError::Program {
            name,
            source,
            hint: "",
        }
    };
    Ok((
        SkLookup::from_pin(prog(PROG_STEER)).map_err(perr(PROG_STEER))?,
        SchedClassifier::from_pin(prog(PROG_EGRESS)).map_err(perr(PROG_EGRESS))?,
        SchedClassifier::from_pin(prog(PROG_INGRESS)).map_err(perr(PROG_INGRESS))?,
        SchedClassifier::from_pin(prog(PROG_LO)).map_err(perr(PROG_LO))?,
    ))
}

trait Loadable: Sized {
    fn load_pin(ebpf: &mut Ebpf, name: &'static str, path: &Path) -> Result<Self, LoadError>;
}

fn kernel_hint(e: &ProgramError) -> &'static str {
    let s = format!("{e:?}");
    if s.contains("EINVAL") || s.contains("Invalid argument") {
        " (this kernel may lack a feature sluice needs: sk_lookup (≥ 5.9), tcx (≥ 6.6), bpf_get_netns_cookie for tc/sk_lookup)"
    } else {
        ""
    }
}

macro_rules! loadable {
    ($ty:ty) => {
        impl Loadable for $ty {
            fn load_pin(
                ebpf: &mut Ebpf,
                name: &'static str,
                path: &Path,
            ) -> Result<Self, LoadError> {
                let perr = |source: ProgramError| LoadError::Program {
                    hint: kernel_hint(&source),
                    name,
                    source,
                };
                let p: &mut $ty = ebpf
                    .program_mut(name)
                    .ok_or_else(|| perr(ProgramError::NotLoaded))?
                    .try_into()
                    .map_err(perr)?;
                p.load().map_err(perr)?;
                p.pin(path).map_err(|source| LoadError::Pin {
                    path: path.to_owned(),
                    source,
                })?;
                // A handle of our own from the pin: the Ebpf object can go.
                <$ty>::from_pin(path).map_err(perr)
            }
        }
    };
}
loadable!(SkLookup);
loadable!(SchedClassifier);

fn load_prog<T: Loadable>(
    ebpf: &mut Ebpf,
    name: &'static str,
    pins: &Pins,
) -> Result<T, LoadError> {
    T::load_pin(ebpf, name, &pins.progs().join(name))
}

/// Removes the node-wide pins (programs, maps) and the root, if no pod remains.
pub fn remove_node_pins(pins: &Pins) -> Result<(), LoadError> {
    let io = |what: String| move |source| LoadError::Io { what, source };
    for dir in [pins.progs(), pins.maps()] {
        if let Ok(entries) = fs::read_dir(&dir) {
            for e in entries.flatten() {
                fs::remove_file(e.path())
                    .map_err(io(format!("removing {}", e.path().display())))?;
            }
        }
        let _ = fs::remove_dir(&dir);
    }
    let _ = fs::remove_dir(pins.pods());
    let _ = fs::remove_dir(pins.root());
    Ok(())
}

/// Mounts bpffs on /sys/fs/bpf when nothing is mounted there (fresh machines
/// and some nodes come without it) and creates the root directory.
pub fn ensure_bpffs(root: &Path) -> Result<(), LoadError> {
    let base = Path::new("/sys/fs/bpf");
    let is_bpffs = |p: &Path| {
        nix::sys::statfs::statfs(p)
            .map(|s| s.filesystem_type().0 == BPF_FS_MAGIC)
            .unwrap_or(false)
    };
    if !is_bpffs(base) {
        nix::mount::mount(
            Some("bpf"),
            base,
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .map_err(|e| LoadError::Bpffs(format!("mounting bpffs on {}: {e}", base.display())))?;
    }
    fs::create_dir_all(root).map_err(|source| LoadError::Io {
        what: format!("creating {}", root.display()),
        source,
    })?;
    if !is_bpffs(root) {
        return Err(LoadError::Bpffs(format!(
            "{} is not on a bpffs",
            root.display()
        )));
    }
    Ok(())
}

/// Serialises loading between processes (two `sluice enroll` at once must not
/// both load): an exclusive flock on the root directory itself, so no lock
/// file is left anywhere.
fn lock(pins: &Pins) -> Result<nix::fcntl::Flock<fs::File>, LoadError> {
    let f = fs::File::open(pins.root()).map_err(|source| LoadError::Io {
        what: format!("opening {}", pins.root().display()),
        source,
    })?;
    nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, e)| {
        LoadError::Io {
            what: format!("locking {}", pins.root().display()),
            source: e.into(),
        }
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_builds_object_parses_and_its_stamp_map_is_frozen() {
        let object = super::embedded_object();
        assert!(
            !object.is_empty(),
            "built without the eBPF object: `cargo xtask build-ebpf`, then test again"
        );
        let layout = crate::dataplane::stamp::of_object(object).unwrap();
        let stamp = layout["stamp"];
        assert_eq!(
            (stamp.key_size, stamp.value_size, stamp.max_entries),
            (4, 64, 1)
        );
        for m in [
            "pod_state",
            "pod_meta",
            "pod_addrs",
            "listeners",
            "counters",
            "flow_hints",
        ] {
            assert!(layout.contains_key(m), "{m} missing from {layout:?}");
        }
    }

    /// A migration copies entries byte for byte: a build that changes a
    /// map's type, key or value size cannot take over a node running the
    /// previous one (it keeps that build running). Such a change must come
    /// with a conversion in `Dataplane::fill_next`; then update this table.
    #[test]
    fn map_entries_keep_their_layout() {
        let layout = crate::dataplane::stamp::of_object(super::embedded_object()).unwrap();
        let seen: std::collections::BTreeMap<&str, (u32, u32, u32)> = layout
            .iter()
            .map(|(n, l)| (n.as_str(), (l.map_type, l.key_size, l.value_size)))
            .collect();
        let want = std::collections::BTreeMap::from([
            ("counters", (5, 8, 48)),
            ("dns_counters", (5, 8, 40)),
            ("dns_flows", (9, 24, 32)),
            ("dns_listeners", (18, 16, 4)),
            ("drops", (6, 4, 8)),
            ("flow_hints", (9, 40, 24)),
            ("listeners", (18, 16, 4)),
            ("node_netns", (2, 4, 8)),
            ("pod_flags", (1, 8, 4)),
            ("pod_reroute", (1, 8, 64)),
            ("pod_addrs", (1, 20, 8)),
            ("pod_meta", (1, 8, 828)),
            ("pod_state", (1, 8, 24)),
            ("stamp", (2, 4, 64)),
            ("tc_lookup", (6, 4, 4)),
        ]);
        assert_eq!(
            seen, want,
            "a map's entry layout changed: see this test's comment"
        );
    }
}

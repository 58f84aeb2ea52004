//! Loads sluice's programs and maps once per node and pins them; later
//! processes adopt the pins. Enrolling a pod then costs only link attaches and
//! map writes (a per-pod load + verify would cost 65–100 ms).
//!
//! Layout under the bpffs root (default `/sys/fs/bpf/sluice`):
//! ```text
//! progs/{steer,egress,ingress,lo}   the four programs
//! maps/{pod_state,pod_meta,listeners,counters,flow_hints}
//! pods/<netns cookie>/{steer,egress_<if>,ingress_<if>,lo}   a pod's links
//! ```

use std::{
    fs,
    path::{Path, PathBuf},
};

use aya::{
    programs::{ProgramError, SchedClassifier, SkLookup},
    Ebpf, EbpfLoader,
};

use crate::state::{Maps, StateError};

/// The eBPF object built by `cargo xtask build-ebpf`, embedded at compile time.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(env!("SLUICE_EBPF_OBJECT"));

pub const DEFAULT_ROOT: &str = "/sys/fs/bpf/sluice";
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Program names in the object, which are also their pin names under `progs/`.
pub const PROG_STEER: &str = "sluice_steer";
pub const PROG_EGRESS: &str = "sluice_egress";
pub const PROG_INGRESS: &str = "sluice_ingress";
pub const PROG_LO: &str = "sluice_lo";

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

/// The node's dataplane: the four programs and the shared maps.
pub struct Dataplane {
    pub pins: Pins,
    pub steer: SkLookup,
    pub egress: SchedClassifier,
    pub ingress: SchedClassifier,
    pub lo: SchedClassifier,
    pub maps: Maps,
}

impl Dataplane {
    /// Adopts the pinned dataplane, or loads and pins it if there is none.
    pub fn load_or_adopt(pins: Pins) -> Result<Self, LoadError> {
        ensure_bpffs(pins.root())?;
        let _lock = lock(&pins)?;
        if pins.is_loaded() {
            return Self::adopt(pins);
        }
        Self::load(pins)
    }

    fn adopt(pins: Pins) -> Result<Self, LoadError> {
        let prog = |name: &'static str| pins.progs().join(name);
        let perr = |name| {
            move |source| LoadError::Program {
                name,
                source,
                hint: "",
            }
        };
        Ok(Self {
            steer: SkLookup::from_pin(prog(PROG_STEER)).map_err(perr(PROG_STEER))?,
            egress: SchedClassifier::from_pin(prog(PROG_EGRESS)).map_err(perr(PROG_EGRESS))?,
            ingress: SchedClassifier::from_pin(prog(PROG_INGRESS)).map_err(perr(PROG_INGRESS))?,
            lo: SchedClassifier::from_pin(prog(PROG_LO)).map_err(perr(PROG_LO))?,
            maps: Maps::open_pinned(&pins.maps())?,
            pins,
        })
    }

    fn load(pins: Pins) -> Result<Self, LoadError> {
        if EBPF_OBJECT.is_empty() {
            return Err(LoadError::NoObject);
        }
        for d in [pins.progs(), pins.maps(), pins.pods()] {
            fs::create_dir_all(&d).map_err(|source| LoadError::Io {
                what: format!("creating {}", d.display()),
                source,
            })?;
        }
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(pins.maps())
            .load(EBPF_OBJECT)?;
        let result = (|| {
            let steer = load_prog::<SkLookup>(&mut ebpf, PROG_STEER, &pins)?;
            let egress = load_prog::<SchedClassifier>(&mut ebpf, PROG_EGRESS, &pins)?;
            let ingress = load_prog::<SchedClassifier>(&mut ebpf, PROG_INGRESS, &pins)?;
            let lo = load_prog::<SchedClassifier>(&mut ebpf, PROG_LO, &pins)?;
            Ok((steer, egress, ingress, lo))
        })();
        let (steer, egress, ingress, lo) = match result {
            Ok(p) => p,
            Err(e) => {
                // Leave nothing half-loaded: the next attempt starts clean.
                let _ = remove_node_pins(&pins);
                return Err(e);
            }
        };
        let maps = Maps::from_maps(|name| ebpf.take_map(name).ok_or(StateError::Missing(name)))?;
        Ok(Self {
            pins,
            steer,
            egress,
            ingress,
            lo,
            maps,
        })
    }
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

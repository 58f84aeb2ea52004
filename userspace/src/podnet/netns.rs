//! Network namespace handles: open and validate a netns path, learn its cookie,
//! and run code inside it (setns affects only the calling thread, which goes
//! back at once: the rest of the process never changes namespace).

use std::{
    fs::File,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
};

use nix::sched::{setns, CloneFlags};

const NSFS_MAGIC: i64 = 0x6e73_6673;
/// `_IO(0xb7, 0x3)`: the kind of namespace an nsfs fd is (Linux ≥ 4.11).
const NS_GET_NSTYPE: libc::c_ulong = 0xb703;

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("netns {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0} is not a network namespace")]
    NotNetns(PathBuf),
    #[error("netns {path}: setns: {source}")]
    Enter { path: PathBuf, source: nix::Error },
    #[error("netns {path}: reading the netns cookie: {source}")]
    Cookie {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl NetnsError {
    /// Whether the path names no netns any more (removed, or left as a plain
    /// file), as opposed to an error that says nothing of it (EMFILE, say).
    pub fn is_gone(&self) -> bool {
        match self {
            NetnsError::Open { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
            NetnsError::NotNetns(_) => true,
            NetnsError::Enter { .. } | NetnsError::Cookie { .. } => false,
        }
    }
}

/// An open network namespace.
#[derive(Debug)]
pub struct Netns {
    file: File,
    path: PathBuf,
}

impl Netns {
    /// Opens `path` (e.g. `/run/netns/NAME` or `/proc/PID/ns/net`) and checks
    /// that it is a network namespace.
    pub fn open(path: &Path) -> Result<Self, NetnsError> {
        let file = File::open(path).map_err(|source| NetnsError::Open {
            path: path.to_owned(),
            source,
        })?;
        let st = nix::sys::statfs::fstatfs(&file).map_err(|e| NetnsError::Open {
            path: path.to_owned(),
            source: e.into(),
        })?;
        if st.filesystem_type().0 != NSFS_MAGIC {
            return Err(NetnsError::NotNetns(path.to_owned()));
        }
        let ns = Self {
            file,
            path: path.to_owned(),
        };
        // nsfs also holds the other namespace kinds.
        // SAFETY: NS_GET_NSTYPE takes no argument and returns the type.
        let kind = unsafe { libc::ioctl(ns.file.as_raw_fd(), NS_GET_NSTYPE) };
        if kind != libc::CLONE_NEWNET {
            return Err(NetnsError::NotNetns(path.to_owned()));
        }
        Ok(ns)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A second handle on the same namespace (a duplicated fd).
    pub fn try_clone(&self) -> std::io::Result<Self> {
        Ok(Self {
            file: self.file.try_clone()?,
            path: self.path.clone(),
        })
    }

    /// The namespace fd, e.g. to hand to ztunnel.
    pub fn into_fd(self) -> OwnedFd {
        self.file.into()
    }

    /// Runs `f` inside this netns, on the calling thread: setns(2) moves
    /// only that thread, and it goes back to the netns it was in when `f`
    /// returns (also by a panic). An enrollment enters the pod netns several
    /// times; a thread per visit cost about 100 µs each. `f` is synchronous,
    /// so nothing else runs on the thread meanwhile. (It must not pin to
    /// bpffs: pins are refused from a thread in another netns.)
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> Result<R, NetnsError> {
        let here = File::open(THREAD_NETNS).map_err(|source| NetnsError::Open {
            path: THREAD_NETNS.into(),
            source,
        })?;
        self.enter()?;
        let _back = GoBack(here);
        Ok(f())
    }

    /// Moves the calling thread into this netns.
    fn enter(&self) -> Result<(), NetnsError> {
        setns(self.file.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|source| {
            if source == nix::Error::EINVAL {
                NetnsError::NotNetns(self.path.clone())
            } else {
                NetnsError::Enter {
                    path: self.path.clone(),
                    source,
                }
            }
        })
    }

    /// Why this netns must never be captured, if it must not: it is the
    /// host's (pid 1's: also every hostNetwork pod's) or this process's own.
    pub fn host_like(&self) -> Option<&'static str> {
        use std::os::unix::fs::MetadataExt as _;
        let me = self.file.metadata().ok().map(|m| (m.dev(), m.ino()))?;
        host_like_id(me)
    }

    /// The kernel's netns cookie: the key the programs derive with
    /// bpf_get_netns_cookie() in this netns.
    pub fn cookie(&self) -> Result<u64, NetnsError> {
        let err = |source| NetnsError::Cookie {
            path: self.path.clone(),
            source,
        };
        let sock = self.run(udp_socket_here)?.map_err(err)?;
        socket_netns_cookie(sock.as_fd()).map_err(err)
    }
}

impl AsFd for Netns {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

use sluice_cni::hostns::host_like_id;
pub use sluice_cni::hostns::path_is_host_like;

/// The calling thread's own netns (`/proc/self` would be the main thread's).
const THREAD_NETNS: &str = "/proc/thread-self/ns/net";

/// Takes the thread back to the netns it left when a [`Netns::run`] ends.
struct GoBack(File);

impl Drop for GoBack {
    fn drop(&mut self) {
        if let Err(e) = setns(self.0.as_fd(), CloneFlags::CLONE_NEWNET) {
            // A thread stuck in a pod's netns would do its next work (the
            // API server, other pods) there: stop rather than go on wrong.
            eprintln!("sluice: cannot return to the thread's own netns ({e}): aborting");
            std::process::abort();
        }
    }
}

/// A UDP socket in the calling thread's netns (its cookie names the netns).
pub fn udp_socket_here() -> std::io::Result<OwnedFd> {
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// SO_NETNS_COOKIE of a socket: which netns it lives in (Linux ≥ 5.14).
pub fn socket_netns_cookie(fd: BorrowedFd<'_>) -> std::io::Result<u64> {
    const SO_NETNS_COOKIE: libc::c_int = 71;
    getsockopt_raw::<u64>(fd, libc::SOL_SOCKET, SO_NETNS_COOKIE)
}

/// Reads a fixed-size socket option.
pub fn getsockopt_raw<T: Copy + Default>(
    fd: BorrowedFd<'_>,
    level: libc::c_int,
    name: libc::c_int,
) -> std::io::Result<T> {
    let mut v = T::default();
    let mut len = std::mem::size_of::<T>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            name,
            &mut v as *mut T as *mut libc::c_void,
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(v)
}

/// Names of the network interfaces in the calling thread's netns.
pub fn interfaces() -> std::io::Result<Vec<String>> {
    let mut names: Vec<String> = nix::net::if_::if_nameindex()
        .map_err(std::io::Error::from)?
        .iter()
        .map(|i| i.name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    Ok(names)
}

/// Those of `ifaces` (in the calling thread's netns) whose packets carry no
/// Ethernet header (netkit in L3 mode, WireGuard, tun, IP tunnels: any
/// hardware type but Ethernet and loopback), by `SIOCGIFHWADDR`. An
/// interface gone meanwhile is left out.
pub fn l3_interfaces(ifaces: &[String]) -> std::io::Result<Vec<String>> {
    const ARPHRD_ETHER: u16 = 1;
    const ARPHRD_LOOPBACK: u16 = 772;
    // SAFETY: a plain socket, closed by OwnedFd.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut out = Vec::new();
    for name in ifaces {
        // SAFETY: ifreq is plain data; zeroed is a valid value.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        let bytes = name.as_bytes();
        if bytes.len() >= req.ifr_name.len() {
            continue;
        }
        for (d, s) in req.ifr_name.iter_mut().zip(bytes) {
            *d = *s as libc::c_char;
        }
        // SAFETY: SIOCGIFHWADDR reads ifr_name and writes ifr_hwaddr.
        let r = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFHWADDR, &mut req) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENODEV) {
                continue;
            }
            return Err(e);
        }
        // SAFETY: the union's hwaddr member is what SIOCGIFHWADDR fills.
        let kind = unsafe { req.ifr_ifru.ifru_hwaddr.sa_family };
        if kind != ARPHRD_ETHER && kind != ARPHRD_LOOPBACK {
            out.push(name.clone());
        }
    }
    Ok(out)
}

/// The addresses on every interface but `lo` in the calling thread's netns.
pub fn addresses() -> std::io::Result<Vec<std::net::IpAddr>> {
    let mut v = Vec::new();
    for ifa in nix::ifaddrs::getifaddrs().map_err(std::io::Error::from)? {
        if ifa.interface_name == "lo" {
            continue;
        }
        let Some(a) = ifa.address else { continue };
        if let Some(v4) = a.as_sockaddr_in() {
            v.push(std::net::IpAddr::V4(v4.ip()));
        } else if let Some(v6) = a.as_sockaddr_in6() {
            v.push(std::net::IpAddr::V6(v6.ip()));
        }
    }
    v.sort();
    v.dedup();
    Ok(v)
}

//! Finding ztunnel's in-pod listeners without ztunnel's cooperation.
//!
//! Upstream ztunnel opens 15001/15006/15008 inside the pod netns with SO_MARK
//! 1337 and tells nobody, and its DNS proxy on localhost:15053 (TCP and UDP).
//! We (1) list that netns's listening TCP sockets and bound UDP sockets with
//! NETLINK_SOCK_DIAG from inside it — which yields inode and mark, (2) find the
//! process holding that inode in /proc/<pid>/fd, (3) duplicate the fd with
//! pidfd_getfd, and (4) check on the duplicate itself that it lives in the pod
//! netns (SO_NETNS_COOKIE) and listens on the port: a socket of another netns
//! would be assigned "successfully" and never complete a handshake.

use std::{
    collections::BTreeMap,
    fs,
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
};

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_sock_diag::{
    constants::{AF_INET, AF_INET6, IPPROTO_TCP, IPPROTO_UDP},
    inet::{nlas::Nla, ExtensionFlags, InetRequest, InetResponse, SocketId, StateFlags},
    SockDiagMessage,
};
use netlink_sys::{protocols::NETLINK_SOCK_DIAG, Socket, SocketAddr};
use sluice_common::{Role, FAMILY_V4, FAMILY_V6, MARK_MASK, MARK_ZTUNNEL, PORT_DNS_PROXY};

use crate::podnet::netns::{getsockopt_raw, socket_netns_cookie, Netns, NetnsError};

#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("sock_diag: {0}")]
    Diag(String),
}

/// A listening socket seen in the pod netns (from sock_diag).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeenListener {
    pub role: Role,
    pub inode: u32,
    pub family: u8,
    /// The socket's cookie (what `SO_COOKIE` and a test run of sk_lookup
    /// name it by).
    pub cookie: u64,
}

/// One of ztunnel's listeners, duplicated into this process.
#[derive(Debug)]
pub struct Listener {
    pub role: Role,
    pub fd: OwnedFd,
    pub pid: i32,
    /// The descriptor number it has in `pid` (to ask later whether `pid`
    /// still holds it: [`owner_holds`]).
    pub owner_fd: i32,
    /// Families it serves: a `[::]` socket without IPV6_V6ONLY serves both.
    pub families: Vec<u8>,
}

/// The role of a socket ztunnel could own, by protocol and local port.
fn role_of(protocol: u8, port: u16) -> Option<Role> {
    match (protocol, port) {
        (IPPROTO_TCP, PORT_DNS_PROXY) => Some(Role::DnsTcp),
        (IPPROTO_UDP, PORT_DNS_PROXY) => Some(Role::DnsUdp),
        (IPPROTO_TCP, p) => Role::from_port(p),
        _ => None,
    }
}

/// Lists ztunnel's sockets in the netns, all with mark 0x539: TCP listeners
/// on 15001/15006/15008/15053, unconnected UDP sockets on 15053.
pub fn seen_listeners(netns: &Netns) -> Result<Vec<SeenListener>, SocketError> {
    let found = netns.run(|| -> Result<Vec<SeenListener>, SocketError> {
        let mut all = Vec::new();
        for family in [AF_INET, AF_INET6] {
            all.extend(dump_listeners(family, IPPROTO_TCP, StateFlags::LISTEN)?);
            // An unconnected UDP socket is in state CLOSE for sock_diag.
            all.extend(dump_listeners(family, IPPROTO_UDP, StateFlags::CLOSE)?);
        }
        Ok(all)
    })??;
    Ok(found)
}

fn dump_listeners(
    family: u8,
    protocol: u8,
    states: StateFlags,
) -> Result<Vec<SeenListener>, SocketError> {
    let mut out = Vec::new();
    dump(family, protocol, states, |r| {
        let mark = r.nlas.iter().find_map(|n| match n {
            Nla::Mark(m) => Some(*m),
            _ => None,
        });
        let port = r.header.socket_id.source_port;
        if let (Some(role), Some(mark)) = (role_of(protocol, port), mark) {
            if mark & MARK_MASK == MARK_ZTUNNEL {
                out.push(SeenListener {
                    role,
                    inode: r.header.inode,
                    cookie: diag_cookie(r.header.socket_id.cookie),
                    family: if family == AF_INET {
                        FAMILY_V4
                    } else {
                        FAMILY_V6
                    },
                });
            }
        }
    })?;
    Ok(out)
}

/// TCP sockets of the calling thread's netns in a state with a peer (not
/// listening, closed or in TIME_WAIT; handshakes a listener has not
/// finished count). The dump walks the node's whole established hash table.
pub fn open_tcp_connections() -> Result<usize, SocketError> {
    let peered = StateFlags::all() - StateFlags::LISTEN - StateFlags::TIME_WAIT - StateFlags::CLOSE;
    let mut n = 0;
    for family in [AF_INET, AF_INET6] {
        dump(family, IPPROTO_TCP, peered.clone(), |_| n += 1)?;
    }
    Ok(n)
}

/// One sock_diag dump from the calling thread's netns: `each` sees every
/// socket of `family` and `protocol` in one of `states`.
fn dump(
    family: u8,
    protocol: u8,
    states: StateFlags,
    mut each: impl FnMut(&InetResponse),
) -> Result<(), SocketError> {
    let derr = |e: std::io::Error| SocketError::Diag(e.to_string());
    let mut socket = Socket::new(NETLINK_SOCK_DIAG).map_err(derr)?;
    socket.bind_auto().map_err(derr)?;
    socket.connect(&SocketAddr::new(0, 0)).map_err(derr)?;
    let mut hdr = NetlinkHeader::default();
    hdr.flags = NLM_F_REQUEST | NLM_F_DUMP;
    let mut req = NetlinkMessage::new(
        hdr,
        SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol,
            extensions: ExtensionFlags::empty(),
            states,
            socket_id: if family == AF_INET {
                SocketId::new_v4()
            } else {
                SocketId::new_v6()
            },
        })
        .into(),
    );
    req.finalize();
    let mut buf = vec![0; req.buffer_len()];
    req.serialize(&mut buf);
    socket.send(&buf, 0).map_err(derr)?;

    let mut rx = vec![0u8; 64 * 1024];
    loop {
        let n = socket.recv(&mut &mut rx[..], 0).map_err(derr)?;
        let mut off = 0;
        while off < n {
            let msg = NetlinkMessage::<SockDiagMessage>::deserialize(&rx[off..n])
                .map_err(|e| SocketError::Diag(e.to_string()))?;
            let len = msg.header.length as usize;
            match msg.payload {
                NetlinkPayload::Done(_) => return Ok(()),
                NetlinkPayload::Error(e) => return Err(SocketError::Diag(format!("{e:?}"))),
                NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => each(&r),
                _ => {}
            }
            if len == 0 {
                break;
            }
            off += len;
        }
    }
}

/// sock_diag's `idiag_cookie`: two native-endian 32-bit halves, low first.
fn diag_cookie(c: [u8; 8]) -> u64 {
    let lo = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
    let hi = u32::from_ne_bytes([c[4], c[5], c[6], c[7]]);
    u64::from(hi) << 32 | u64::from(lo)
}

/// Where to look for the processes holding the sockets: only `pid` when
/// given (the ztunnel on the ZDS connection), else every process.
fn candidate_pids(only: Option<i32>) -> Vec<i32> {
    if let Some(pid) = only {
        return vec![pid];
    }
    fs::read_dir("/proc")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Maps socket inodes to every (pid, fd) that holds them, in /proc's order.
/// Every one, not the first: a child the holder is forking has copies of
/// its descriptors until it execs, and after pids wrap it comes first in
/// /proc; by the time its descriptor is duplicated it may be gone.
fn find_holders(inodes: &[u32], only_pid: Option<i32>) -> BTreeMap<u32, Vec<(i32, i32)>> {
    let mut found: BTreeMap<u32, Vec<(i32, i32)>> = BTreeMap::new();
    for pid in candidate_pids(only_pid) {
        let Ok(rd) = fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(target) = fs::read_link(e.path()) else {
                continue;
            };
            let t = target.to_string_lossy();
            let Some(ino) = t
                .strip_prefix("socket:[")
                .and_then(|s| s.strip_suffix(']'))
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if inodes.contains(&ino) {
                if let Some(fd) = e.file_name().to_str().and_then(|s| s.parse().ok()) {
                    found.entry(ino).or_default().push((pid, fd));
                }
            }
        }
    }
    found
}

fn pidfd_getfd(pid: i32, fd: i32) -> std::io::Result<OwnedFd> {
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    let dup = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if dup < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(unsafe { OwnedFd::from_raw_fd(dup as i32) })
}

/// Whether process `pid` still has `ours` (a duplicate) open as its
/// descriptor `owner_fd`: kcmp(2) compares the two open files. False once the
/// process closed it, reused the number for another file, or exited.
pub fn owner_holds(pid: i32, owner_fd: i32, ours: &OwnedFd) -> bool {
    const KCMP_FILE: libc::c_long = 0;
    let me = std::process::id() as libc::c_long;
    let same = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            pid as libc::c_long,
            me,
            KCMP_FILE,
            owner_fd as libc::c_long,
            ours.as_raw_fd() as libc::c_long,
        )
    };
    match same {
        0 => true,
        // 1 or 2: different files (the number now names something else).
        1.. => false,
        _ => match std::io::Error::last_os_error().raw_os_error() {
            // The process is gone, or has no such descriptor any more.
            Some(libc::ESRCH | libc::EBADF) => false,
            // kcmp unavailable (no CONFIG_KCMP, or not permitted): all that
            // can be told is whether the process still lives.
            _ => std::path::Path::new(&format!("/proc/{pid}")).exists(),
        },
    }
}

/// The socket's local port, and whether it is bound to the unspecified
/// address (`0.0.0.0` / `[::]`).
fn local_binding(fd: &OwnedFd) -> Option<(u16, bool)> {
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of_val(&ss) as libc::socklen_t;
    let rc = unsafe {
        libc::getsockname(
            fd.as_raw_fd(),
            &mut ss as *mut _ as *mut libc::sockaddr,
            &mut len,
        )
    };
    if rc != 0 {
        return None;
    }
    // sin_port and sin6_port sit at the same offset.
    let sin = unsafe { &*(&ss as *const _ as *const libc::sockaddr_in) };
    let unspecified = if ss.ss_family as i32 == libc::AF_INET6 {
        let sin6 = unsafe { &*(&ss as *const _ as *const libc::sockaddr_in6) };
        sin6.sin6_addr.s6_addr == [0; 16]
    } else {
        sin.sin_addr.s_addr == 0
    };
    Some((u16::from_be(sin.sin_port), unspecified))
}

/// Is the duplicate what the listing said: a socket of this pod's netns,
/// of the role's kind (a TCP listener, or an unconnected UDP socket), on
/// the role's port? A socket of another netns would be assigned
/// "successfully" and never answer.
fn verified(dup: &OwnedFd, role: Role, cookie: u64) -> bool {
    let same_netns = socket_netns_cookie(dup.as_fd()).ok() == Some(cookie);
    let int = |level, opt| getsockopt_raw::<libc::c_int>(dup.as_fd(), level, opt).ok();
    let kind_ok = if role == Role::DnsUdp {
        let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of_val(&ss) as libc::socklen_t;
        let connected = unsafe {
            libc::getpeername(
                dup.as_raw_fd(),
                &mut ss as *mut _ as *mut libc::sockaddr,
                &mut len,
            )
        } == 0;
        int(libc::SOL_SOCKET, libc::SO_TYPE) == Some(libc::SOCK_DGRAM) && !connected
    } else {
        int(libc::SOL_SOCKET, libc::SO_ACCEPTCONN) == Some(1)
    };
    let port_ok = local_binding(dup).map(|(p, _)| p) == Some(role.port());
    same_netns && kind_ok && port_ok
}

/// Lets ztunnel's DNS TCP listener (bound to localhost) complete handshakes
/// of connections addressed to the pod's resolver: sk_lookup hands it SYNs
/// whose local address is the resolver's, and without IP_TRANSPARENT the
/// kernel refuses to route an IPv4 SYN-ACK from an address that is not the
/// netns's own (IPv6 does not check). Istio's REDIRECT rewrites the
/// destination instead, so ztunnel never needed it; its accepted sockets
/// inherit the flag and only ever answer from the address they were asked
/// on. A socket option, so setting it on our duplicate sets it on
/// ztunnel's socket. Needs CAP_NET_ADMIN, which the agent has.
fn answer_as_resolver(dup: &OwnedFd, family: u8) -> std::io::Result<()> {
    let (level, name) = if family == FAMILY_V4 {
        (libc::SOL_IP, libc::IP_TRANSPARENT)
    } else {
        (libc::SOL_IPV6, libc::IPV6_TRANSPARENT)
    };
    let on: libc::c_int = 1;
    let rc = unsafe {
        libc::setsockopt(
            dup.as_raw_fd(),
            level,
            name,
            &on as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Duplicates ztunnel's listeners for this pod into our process, verified;
/// with `only_pid`, only that process's.
/// Returns at most one socket per role and family (any member of a reuseport
/// group will do: the kernel's reuseport selection runs after sk_lookup's
/// assignment).
pub fn take_listeners(
    netns: &Netns,
    cookie: u64,
    only_pid: Option<i32>,
) -> Result<Vec<Listener>, SocketError> {
    let mut seen = seen_listeners(netns)?;
    // Newest first (socket inodes grow with allocation): during an upgrade the
    // new ztunnel's sockets are the ones to keep.
    seen.sort_by_key(|s| std::cmp::Reverse(s.inode));
    let inodes: Vec<u32> = seen.iter().map(|s| s.inode).collect();
    let holders = find_holders(&inodes, only_pid);
    let mut out: Vec<Listener> = Vec::new();
    for s in &seen {
        let covered = |fam: u8| {
            out.iter()
                .any(|l: &Listener| l.role == s.role && l.families.contains(&fam))
        };
        let done = if s.family == FAMILY_V4 {
            covered(FAMILY_V4)
        } else {
            covered(FAMILY_V4) && covered(FAMILY_V6)
        };
        if done {
            continue;
        }
        // The first holder whose descriptor can still be duplicated; the
        // duplicate is checked, not the listing.
        let held = holders
            .get(&s.inode)
            .into_iter()
            .flatten()
            .find_map(|&(pid, fd)| pidfd_getfd(pid, fd).ok().map(|dup| (pid, fd, dup)))
            .filter(|(_, _, dup)| verified(dup, s.role, cookie));
        let Some((pid, fd, dup)) = held else {
            continue;
        };
        if s.role == Role::DnsTcp {
            if let Err(e) = answer_as_resolver(&dup, s.family) {
                // Unregistered, the pod's TCP DNS goes on to 15001 as
                // without DNS capture (pass-through), rather than to a
                // listener whose handshakes could not complete.
                tracing::warn!(cookie, error = %e, "ztunnel's DNS TCP listener left out: cannot make it transparent");
                continue;
            }
        }
        let mut families = if s.family == FAMILY_V4 {
            vec![FAMILY_V4]
        } else {
            // Only a `[::]` socket without IPV6_V6ONLY takes IPv4 too (the
            // DNS proxy's `[::1]` socket does not).
            let v6only =
                getsockopt_raw::<libc::c_int>(dup.as_fd(), libc::IPPROTO_IPV6, libc::IPV6_V6ONLY)
                    .unwrap_or(1);
            let wildcard = local_binding(&dup).is_some_and(|(_, any)| any);
            if v6only == 0 && wildcard {
                vec![FAMILY_V4, FAMILY_V6]
            } else {
                vec![FAMILY_V6]
            }
        };
        families.retain(|f| !covered(*f));
        if families.is_empty() {
            continue;
        }
        out.push(Listener {
            role: s.role,
            fd: dup,
            pid,
            owner_fd: fd,
            families,
        });
    }
    Ok(out)
}

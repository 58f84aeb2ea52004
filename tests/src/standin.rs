//! A ztunnel stand-in: opens 15001/15006/15008 inside the pod netns the way
//! upstream ztunnel does (SO_MARK 1337, SO_REUSEPORT, IP_TRANSPARENT, one
//! dual-stack `[::]` socket per port — or `0.0.0.0` when IPv6 is off), records
//! every accepted connection, and proxies like ztunnel: inbound to the app from
//! the client's own address (transparent, mark 1337), outbound to the original
//! destination (mark 1337). HBONE is answered directly (no mTLS here).

use std::{
    io::{BufRead, BufReader, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    sync::{Arc, Mutex},
};

use sluice_common::{Role, MARK_ZTUNNEL};
use socket2::{Domain, Socket, Type};

use crate::{
    app::canonical,
    flow::{self, Opts},
    ns::Ns,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bind {
    /// `[::]` without IPV6_V6ONLY, as upstream ztunnel with IPv6 enabled.
    DualStack,
    /// `0.0.0.0`, as upstream ztunnel with IPv6 disabled.
    V4Only,
}

/// One connection a listener accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Accepted {
    pub role: Role,
    pub local: SocketAddr,
    pub peer: SocketAddr,
    /// SO_ORIGINAL_DST when there is one (iptables REDIRECT), else the local
    /// address — the same rule upstream ztunnel applies.
    pub orig_dst: SocketAddr,
}

/// Called with every accepted connection (the ZDS peer prints them).
pub type OnAccept = Arc<dyn Fn(&Accepted) + Send + Sync>;

pub struct StandIn {
    pub accepted: Arc<Mutex<Vec<Accepted>>>,
    /// Connections accepted and not finished yet (a draining ztunnel waits
    /// for them). Counted as soon as accept returns.
    pub active: Arc<std::sync::atomic::AtomicUsize>,
    /// Written to stop the accept loops.
    stop: Arc<OwnedFd>,
    loops: Vec<std::thread::JoinHandle<()>>,
}

impl StandIn {
    pub fn start(pod_ns: &str, bind: Bind) -> Self {
        Self::start_in(Ns::Named(pod_ns.to_owned()), bind, None)
    }

    /// Opens the listeners in `ns` (named, or an fd as ztunnel gets over ZDS).
    pub fn start_in(ns: Ns, bind: Bind, on_accept: Option<OnAccept>) -> Self {
        let accepted = Arc::new(Mutex::new(Vec::new()));
        let active = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        // SAFETY: eventfd returns a new descriptor we own (checked below).
        let stop = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        assert!(stop >= 0, "eventfd: {}", std::io::Error::last_os_error());
        let stop = Arc::new(unsafe { OwnedFd::from_raw_fd(stop) });
        let mut loops = Vec::new();
        for role in Role::ALL {
            let active = active.clone();
            let (tx, rx) = std::sync::mpsc::channel();
            let acc = accepted.clone();
            let ns2 = ns.clone();
            let on_accept = on_accept.clone();
            let stop = stop.clone();
            loops.push(ns.spawn(move || {
                let l = listener(role.port(), bind).expect("stand-in listener");
                tx.send(()).unwrap();
                // Returning drops (closes) the listener, as ztunnel does.
                while let Some(c) = accept_or_stop(&l, &stop) {
                    active.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let a = Accepted {
                        role,
                        local: canonical(c.local_addr().unwrap()),
                        peer: canonical(c.peer_addr().unwrap()),
                        orig_dst: original_dst(&c)
                            .unwrap_or_else(|| canonical(c.local_addr().unwrap())),
                    };
                    acc.lock().unwrap().push(a.clone());
                    if let Some(f) = &on_accept {
                        f(&a);
                    }
                    let active = active.clone();
                    ns2.spawn(move || {
                        proxy(c, a);
                        active.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    });
                }
            }));
            rx.recv().expect("stand-in listener thread");
        }
        Self {
            accepted,
            active,
            stop,
            loops,
        }
    }

    /// Stops accepting and closes the listeners (close, not shutdown: another
    /// process holding a duplicate keeps the socket, as with ztunnel).
    /// Every connection accepted before is counted in `active` by then.
    pub fn close(&mut self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: an 8-byte write to our eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), one.as_ptr().cast(), 8) };
        for l in self.loops.drain(..) {
            let _ = l.join();
        }
    }

    pub fn accepted(&self) -> Vec<Accepted> {
        self.accepted.lock().unwrap().clone()
    }

    pub fn clear(&self) {
        self.accepted.lock().unwrap().clear();
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.close();
    }
}

/// The next connection on `l`, or `None` once `stop` is written.
fn accept_or_stop(l: &TcpListener, stop: &OwnedFd) -> Option<TcpStream> {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: l.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds; no timeout (woken by either).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return None;
        }
        if fds[1].revents != 0 {
            return None;
        }
        match l.accept() {
            Ok((c, _)) => return Some(c),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => return None,
        }
    }
}

fn listener(port: u16, bind: Bind) -> std::io::Result<TcpListener> {
    let (domain, addr) = match bind {
        Bind::DualStack => (Domain::IPV6, IpAddr::V6(Ipv6Addr::UNSPECIFIED)),
        Bind::V4Only => (Domain::IPV4, IpAddr::V4(Ipv4Addr::UNSPECIFIED)),
    };
    let s = Socket::new(domain, Type::STREAM, None)?;
    s.set_mark(MARK_ZTUNNEL)?;
    s.set_reuse_port(true)?;
    s.set_reuse_address(true)?;
    if bind == Bind::DualStack {
        s.set_only_v6(false)?;
        flow::set_ipv6_transparent(&s)?;
    } else {
        s.set_ip_transparent(true)?;
    }
    s.bind(&SocketAddr::new(addr, port).into())?;
    s.listen(1024)?;
    // Accepts follow poll(); never block past a stop request.
    s.set_nonblocking(true)?;
    Ok(s.into())
}

/// SO_ORIGINAL_DST (IPv4) or IP6T_SO_ORIGINAL_DST (IPv6); None without conntrack.
fn original_dst(c: &TcpStream) -> Option<SocketAddr> {
    const SO_ORIGINAL_DST: libc::c_int = 80;
    for level in [libc::SOL_IP, libc::SOL_IPV6] {
        let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of_val(&ss) as libc::socklen_t;
        let rc = unsafe {
            libc::getsockopt(
                c.as_raw_fd(),
                level,
                SO_ORIGINAL_DST,
                &mut ss as *mut _ as *mut libc::c_void,
                &mut len,
            )
        };
        if rc == 0 {
            return sockaddr(&ss).map(canonical);
        }
    }
    None
}

fn sockaddr(ss: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match ss.ss_family as i32 {
        libc::AF_INET => {
            let a = unsafe { &*(ss as *const _ as *const libc::sockaddr_in) };
            Some(SocketAddr::new(
                Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)).into(),
                u16::from_be(a.sin_port),
            ))
        }
        libc::AF_INET6 => {
            let a = unsafe { &*(ss as *const _ as *const libc::sockaddr_in6) };
            Some(SocketAddr::new(
                Ipv6Addr::from(a.sin6_addr.s6_addr).into(),
                u16::from_be(a.sin6_port),
            ))
        }
        _ => None,
    }
}

/// What ztunnel does with an accepted connection (runs in the pod netns).
fn proxy(c: TcpStream, a: Accepted) {
    let upstream = match a.role {
        // This stand-in opens no DNS proxy (tests/src/dns.rs has one).
        Role::DnsTcp | Role::DnsUdp => return,
        Role::Hbone => {
            let mut r = BufReader::new(c.try_clone().unwrap());
            let mut line = String::new();
            let _ = r.read_line(&mut line);
            let mut w = c;
            let _ = writeln!(w, "hbone local={} peer={}", a.local, a.peer);
            return;
        }
        // Inbound: to the app, from the client's own address (ztunnel's
        // transparent, spoofed-source connection: row I4).
        Role::Inbound => flow::try_connect(
            a.orig_dst,
            &Opts {
                mark: Some(MARK_ZTUNNEL),
                bind: Some(a.peer.ip()),
                transparent: true,
                ..Opts::default()
            },
        ),
        // Outbound: to the original destination, marked so it is not captured.
        Role::Outbound => flow::try_connect(
            a.orig_dst,
            &Opts {
                mark: Some(MARK_ZTUNNEL),
                ..Opts::default()
            },
        ),
    };
    match upstream {
        Ok(u) => relay(c, u),
        Err(e) => {
            let mut w = c;
            let _ = writeln!(w, "standin: upstream {}: {e}", a.orig_dst);
        }
    }
}

fn relay(a: TcpStream, b: TcpStream) {
    let (mut a2, mut b2) = (a.try_clone().unwrap(), b.try_clone().unwrap());
    let t = std::thread::spawn(move || {
        let _ = std::io::copy(&mut a2, &mut b2);
        let _ = b2.shutdown(std::net::Shutdown::Write);
    });
    let (mut a, mut b) = (a, b);
    let _ = std::io::copy(&mut b, &mut a);
    let _ = a.shutdown(std::net::Shutdown::Write);
    let _ = t.join();
}

//! Trivial TCP services for benchmarks: accept and close at once, read and
//! discard, or echo. The same sink stands behind every variant, so only the
//! redirection differs between them. Each counts the connections it
//! accepted, so a benchmark can check that its connections went where it
//! meant them to (captured, or not).

use std::{
    io::{Read, Write},
    net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener},
    os::fd::AsRawFd,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
};

use sluice_common::MARK_ZTUNNEL;
use socket2::{Domain, Socket, Type};

use crate::{flow::set_ipv6_transparent, ns::spawn_in};

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// accept(), close().
    AcceptClose,
    /// accept(), read until EOF, discard (bulk throughput).
    Discard,
    /// accept(), write back whatever is read until EOF (request/response).
    Echo,
}

pub struct Sink {
    fd: i32,
    accepted: Arc<AtomicU64>,
}

impl Sink {
    /// A plain dual-stack listener on `port` in netns `ns`.
    pub fn plain(ns: &str, port: u16, mode: Mode) -> Self {
        Self::start(ns, port, mode, false)
    }

    /// A listener the way ztunnel opens its in-pod ones (mark 1337,
    /// SO_REUSEPORT, transparent), so capture can deliver to it.
    pub fn ztunnel_like(ns: &str, port: u16, mode: Mode) -> Self {
        Self::start(ns, port, mode, true)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }

    fn start(ns: &str, port: u16, mode: Mode, ztunnel: bool) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        let accepted = Arc::new(AtomicU64::new(0));
        let count = accepted.clone();
        spawn_in(ns, move || {
            let s = Socket::new(Domain::IPV6, Type::STREAM, None).unwrap();
            s.set_only_v6(false).unwrap();
            s.set_reuse_address(true).unwrap();
            if ztunnel {
                s.set_mark(MARK_ZTUNNEL).unwrap();
                s.set_reuse_port(true).unwrap();
                set_ipv6_transparent(&s).unwrap();
            }
            s.bind(&SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port).into())
                .unwrap();
            s.listen(4096).unwrap();
            let l: TcpListener = s.into();
            tx.send(l.as_raw_fd()).unwrap();
            for c in l.incoming() {
                let Ok(mut c) = c else { break };
                count.fetch_add(1, Ordering::SeqCst);
                match mode {
                    Mode::AcceptClose => {}
                    Mode::Discard => {
                        std::thread::spawn(move || {
                            let mut buf = vec![0u8; 256 * 1024];
                            while matches!(c.read(&mut buf), Ok(n) if n > 0) {}
                        });
                    }
                    Mode::Echo => {
                        std::thread::spawn(move || {
                            let _ = c.set_nodelay(true);
                            let mut buf = vec![0u8; 64 * 1024];
                            while let Ok(n @ 1..) = c.read(&mut buf) {
                                if c.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                            }
                        });
                    }
                }
            }
        });
        Self {
            fd: rx.recv().unwrap(),
            accepted,
        }
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
    }
}

//! Trivial TCP services for benchmarks: accept and close at once, or read and
//! discard. The same sink stands behind every variant, so only the
//! redirection differs between them.

use std::{
    io::Read,
    net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener},
    os::fd::AsRawFd,
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
}

pub struct Sink {
    fd: i32,
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

    fn start(ns: &str, port: u16, mode: Mode, ztunnel: bool) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
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
                if mode == Mode::Discard {
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 256 * 1024];
                        while matches!(c.read(&mut buf), Ok(n) if n > 0) {}
                    });
                }
            }
        });
        Self {
            fd: rx.recv().unwrap(),
        }
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
    }
}

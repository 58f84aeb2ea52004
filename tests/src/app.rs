//! A trivial TCP service standing for an app (or a remote server): it answers
//! one line per connection saying which port it is and whom it saw, and keeps
//! the list of peers it accepted.

use std::{
    io::{BufRead, BufReader, Write},
    net::{Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd,
    sync::{Arc, Mutex},
};

use socket2::{Domain, Socket, Type};

use crate::ns::spawn_in;

/// Normalises v4-mapped IPv6 addresses (from dual-stack sockets) to IPv4.
pub fn canonical(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(v4.into(), v6.port()),
            None => a,
        },
        v4 => v4,
    }
}

pub struct App {
    pub port: u16,
    pub seen: Arc<Mutex<Vec<SocketAddr>>>,
    fd: i32,
}

impl App {
    /// Starts the app on `[::]:port` (dual-stack) inside netns `ns`.
    pub fn start(ns: &str, port: u16) -> Self {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let seen2 = seen.clone();
        spawn_in(ns, move || {
            let s = Socket::new(Domain::IPV6, Type::STREAM, None).unwrap();
            s.set_only_v6(false).unwrap();
            s.set_reuse_address(true).unwrap();
            s.bind(&SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port).into())
                .unwrap();
            s.listen(128).unwrap();
            let l: TcpListener = s.into();
            tx.send(l.as_raw_fd()).unwrap();
            for conn in l.incoming() {
                let c = match conn {
                    Ok(c) => c,
                    // A connection reset while it waited in the queue, or
                    // no descriptor free for it: the next one is served.
                    Err(e)
                        if matches!(
                            e.raw_os_error(),
                            Some(libc::ECONNABORTED | libc::EMFILE | libc::ENFILE | libc::EINTR)
                        ) =>
                    {
                        continue
                    }
                    // Shut down (`Drop`): the loop ends.
                    Err(_) => break,
                };
                // Reset between the accept and here: nobody to answer.
                let Ok(peer) = c.peer_addr() else { continue };
                seen2.lock().unwrap().push(canonical(peer));
                std::thread::spawn(move || serve(c, port));
            }
        });
        let fd = rx.recv().unwrap();
        Self { port, seen, fd }
    }

    pub fn peers(&self) -> Vec<SocketAddr> {
        self.seen.lock().unwrap().clone()
    }
}

/// Answers every line with who we are and whom we see, until the peer closes.
fn serve(c: TcpStream, port: u16) {
    let (Ok(peer), Ok(local), Ok(read)) = (c.peer_addr(), c.local_addr(), c.try_clone()) else {
        return;
    };
    let (peer, local) = (canonical(peer), canonical(local));
    let mut r = BufReader::new(read);
    let mut w = c;
    let mut line = String::new();
    while matches!(r.read_line(&mut line), Ok(n) if n > 0) {
        if writeln!(w, "app:{port} peer={peer} local={local}").is_err() {
            break;
        }
        line.clear();
    }
}

/// A UDP echo service (row O5: UDP is never captured).
pub struct UdpEcho {
    fd: i32,
}

impl UdpEcho {
    pub fn start(ns: &str, port: u16) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        spawn_in(ns, move || {
            let s = Socket::new(Domain::IPV6, Type::DGRAM, None).unwrap();
            s.set_only_v6(false).unwrap();
            s.bind(&SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port).into())
                .unwrap();
            let u: std::net::UdpSocket = s.into();
            tx.send(u.as_raw_fd()).unwrap();
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = u.recv_from(&mut buf) {
                if n == 0 {
                    break;
                }
                let _ = u.send_to(
                    format!("udp:{port} peer={}", canonical(from)).as_bytes(),
                    from,
                );
            }
        });
        Self {
            fd: rx.recv().unwrap(),
        }
    }
}

impl Drop for UdpEcho {
    fn drop(&mut self) {
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
    }
}

impl Drop for App {
    fn drop(&mut self) {
        // Wakes the accept loop, which then ends.
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
    }
}

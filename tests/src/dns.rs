//! DNS for the DNS capture tests: minimal wire-format messages (one
//! question; answers of A/AAAA records), a stand-in upstream resolver on
//! port 53, and a stand-in of ztunnel's DNS proxy on the pod's
//! localhost:15053 (TCP and UDP, SO_MARK 1337 on every socket, like the
//! in-pod socket factory), which answers names under `proxy.test` itself
//! and forwards the rest to the upstream from a marked socket.
//!
//! Hand-written on purpose: the tests need a dozen lines of the format, and
//! seeing every byte keeps the checks honest (a resolver crate would hide
//! the very source-address checks under test).

use std::{
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::Duration,
};

use sluice_common::{MARK_ZTUNNEL, PORT_DNS_PROXY};
use socket2::{Domain, Protocol, Socket, Type};

use crate::{app::canonical, ns::Ns};

pub const TYPE_A: u16 = 1;
pub const TYPE_AAAA: u16 = 28;
/// The zone the proxy stand-in answers itself.
pub const PROXY_ZONE: &str = "proxy.test";
/// A name whose proxy answer is larger than 512 bytes (60 records).
pub const BIG_NAME: &str = "big.proxy.test";
/// What the proxy answers for its zone, and the upstream for everything.
pub const PROXY_V4: Ipv4Addr = Ipv4Addr::new(10, 53, 0, 1);
pub const PROXY_V6: Ipv6Addr = Ipv6Addr::new(0xfd53, 0, 0, 0, 0, 0, 0, 1);
pub const UPSTREAM_V4: Ipv4Addr = Ipv4Addr::new(10, 53, 0, 2);
pub const UPSTREAM_V6: Ipv6Addr = Ipv6Addr::new(0xfd53, 0, 0, 0, 0, 0, 0, 2);
/// How long a server's socket read waits: bounds each stop request.
const READ_TIMEOUT: Duration = Duration::from_millis(200);
/// How long a client waits for an answer: a bound for a failing test, not
/// a speed requirement (answers take microseconds).
pub const ANSWER_WAIT: Duration = Duration::from_secs(5);

/// A query for `name`, type `qtype`, recursion desired, with an EDNS OPT
/// record advertising a 4096-byte UDP payload.
pub fn query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut m = Vec::with_capacity(64);
    m.extend_from_slice(&id.to_be_bytes());
    m.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 1]);
    for label in name.split('.').filter(|l| !l.is_empty()) {
        m.push(label.len() as u8);
        m.extend_from_slice(label.as_bytes());
    }
    m.push(0);
    m.extend_from_slice(&qtype.to_be_bytes());
    m.extend_from_slice(&1u16.to_be_bytes());
    // OPT: root name, type 41, class = payload size, ttl 0, no data.
    m.extend_from_slice(&[0, 0, 41, 0x10, 0x00, 0, 0, 0, 0, 0, 0]);
    m
}

/// A message's question: (name, type, end offset of the question).
pub fn question(m: &[u8]) -> Option<(String, u16, usize)> {
    let mut off = 12;
    let mut labels = Vec::new();
    loop {
        let len = *m.get(off)? as usize;
        off += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(m.get(off..off + len)?).into_owned());
        off += len;
    }
    let qtype = u16::from_be_bytes([*m.get(off)?, *m.get(off + 1)?]);
    Some((labels.join("."), qtype, off + 4))
}

/// The answer to `q` carrying `addrs` (those of the question's type).
pub fn answer(q: &[u8], addrs: &[IpAddr]) -> Option<Vec<u8>> {
    let (_, qtype, end) = question(q)?;
    let records: Vec<&IpAddr> = addrs
        .iter()
        .filter(|a| (qtype == TYPE_A) == a.is_ipv4())
        .collect();
    let mut m = q[..2].to_vec();
    m.extend_from_slice(&[0x81, 0x80, 0, 1]);
    m.extend_from_slice(&(records.len() as u16).to_be_bytes());
    m.extend_from_slice(&[0, 0, 0, 0]);
    m.extend_from_slice(&q[12..end]);
    for a in records {
        // Name: a pointer to the question's; class IN, TTL 60.
        m.extend_from_slice(&[0xc0, 12]);
        m.extend_from_slice(&qtype.to_be_bytes());
        m.extend_from_slice(&[0, 1, 0, 0, 0, 60]);
        match a {
            IpAddr::V4(v4) => {
                m.extend_from_slice(&4u16.to_be_bytes());
                m.extend_from_slice(&v4.octets());
            }
            IpAddr::V6(v6) => {
                m.extend_from_slice(&16u16.to_be_bytes());
                m.extend_from_slice(&v6.octets());
            }
        }
    }
    Some(m)
}

/// An answer as the tests compare it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub id: u16,
    pub addrs: Vec<IpAddr>,
    /// Bytes on the wire.
    pub size: usize,
}

/// Parses an answer made by [`answer`] (or any with A/AAAA records only).
pub fn parse_answer(m: &[u8]) -> Option<Answer> {
    let id = u16::from_be_bytes([*m.first()?, *m.get(1)?]);
    let count = u16::from_be_bytes([*m.get(6)?, *m.get(7)?]);
    let (_, _, mut off) = question(m)?;
    let mut addrs = Vec::new();
    for _ in 0..count {
        // A compressed name (2 bytes), type, class, TTL, length.
        let rtype = u16::from_be_bytes([*m.get(off + 2)?, *m.get(off + 3)?]);
        let len = u16::from_be_bytes([*m.get(off + 10)?, *m.get(off + 11)?]) as usize;
        let data = m.get(off + 12..off + 12 + len)?;
        match (rtype, len) {
            (TYPE_A, 4) => addrs.push(IpAddr::from(<[u8; 4]>::try_from(data).ok()?)),
            (TYPE_AAAA, 16) => addrs.push(IpAddr::from(<[u8; 16]>::try_from(data).ok()?)),
            _ => {}
        }
        off += 12 + len;
    }
    Some(Answer {
        id,
        addrs,
        size: m.len(),
    })
}

/// One query a stand-in received: from whom (as its socket saw the peer),
/// over which protocol, for which name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    pub peer: SocketAddr,
    pub tcp: bool,
    pub name: String,
}

/// Serves DNS on some sockets until dropped, recording every query.
pub struct Server {
    pub seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Server {
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    pub fn clear(&self) {
        self.seen.lock().unwrap().clear();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// How a server answers a query: the answer's bytes, or none.
type Responder = Arc<dyn Fn(&[u8]) -> Option<Vec<u8>> + Send + Sync>;

fn socket(addr: SocketAddr, ty: Type, mark: bool) -> std::io::Result<Socket> {
    let domain = if addr.is_ipv4() {
        Domain::IPV4
    } else {
        Domain::IPV6
    };
    let proto = if ty == Type::DGRAM {
        Protocol::UDP
    } else {
        Protocol::TCP
    };
    let s = Socket::new(domain, ty, Some(proto))?;
    if addr.is_ipv6() {
        s.set_only_v6(true)?;
    }
    if mark {
        // As ztunnel makes its in-pod sockets (INPOD_PORT_REUSE): the next
        // ztunnel binds beside the agent's duplicate of this one.
        s.set_mark(MARK_ZTUNNEL)?;
        s.set_reuse_port(true)?;
    }
    s.set_reuse_address(true)?;
    s.bind(&addr.into())?;
    s.set_read_timeout(Some(READ_TIMEOUT))?;
    Ok(s)
}

/// Serves `respond` on UDP and TCP at each of `addrs`, in netns `ns`.
fn serve(ns: Ns, addrs: Vec<SocketAddr>, mark: bool, respond: Responder) -> Server {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for addr in addrs {
        for tcp in [false, true] {
            let (seen, stop, respond) = (seen.clone(), stop.clone(), respond.clone());
            let (tx, rx) = std::sync::mpsc::channel();
            threads.push(ns.spawn(move || {
                let ty = if tcp { Type::STREAM } else { Type::DGRAM };
                let s = socket(addr, ty, mark).unwrap_or_else(|e| panic!("dns {addr}: {e}"));
                if tcp {
                    s.listen(64).expect("listen");
                    s.set_nonblocking(true).expect("nonblocking");
                }
                tx.send(()).unwrap();
                if tcp {
                    serve_tcp(s.into(), &seen, &stop, &respond);
                } else {
                    serve_udp(s.into(), &seen, &stop, &respond);
                }
            }));
            rx.recv().expect("dns server thread");
        }
    }
    Server {
        seen,
        stop,
        threads,
    }
}

fn serve_udp(s: UdpSocket, seen: &Mutex<Vec<Seen>>, stop: &AtomicBool, respond: &Responder) {
    let mut buf = [0u8; 4096];
    while !stop.load(Ordering::SeqCst) {
        let Ok((n, peer)) = s.recv_from(&mut buf) else {
            continue;
        };
        let Some((name, _, _)) = question(&buf[..n]) else {
            continue;
        };
        seen.lock().unwrap().push(Seen {
            peer: canonical(peer),
            tcp: false,
            name,
        });
        if let Some(a) = respond(&buf[..n]) {
            let _ = s.send_to(&a, peer);
        }
    }
}

fn serve_tcp(l: TcpListener, seen: &Mutex<Vec<Seen>>, stop: &AtomicBool, respond: &Responder) {
    while !stop.load(Ordering::SeqCst) {
        let Ok((mut c, peer)) = l.accept() else {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        };
        let _ = c.set_nonblocking(false);
        let _ = c.set_read_timeout(Some(READ_TIMEOUT * 5));
        let Some(q) = read_framed(&mut c) else {
            continue;
        };
        let Some((name, _, _)) = question(&q) else {
            continue;
        };
        seen.lock().unwrap().push(Seen {
            peer: canonical(peer),
            tcp: true,
            name,
        });
        if let Some(a) = respond(&q) {
            let _ = write_framed(&mut c, &a);
        }
    }
}

/// DNS over TCP: a two-byte length, then the message.
pub fn read_framed(c: &mut TcpStream) -> Option<Vec<u8>> {
    let mut len = [0u8; 2];
    c.read_exact(&mut len).ok()?;
    let mut m = vec![0u8; u16::from_be_bytes(len) as usize];
    c.read_exact(&mut m).ok()?;
    Some(m)
}

pub fn write_framed(c: &mut TcpStream, m: &[u8]) -> std::io::Result<()> {
    let mut out = (m.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(m);
    c.write_all(&out)
}

/// The upstream resolver: answers every query with UPSTREAM_V4/_V6, on
/// port 53 of `addrs`, in netns `ns`.
pub fn upstream(ns: &str, addrs: &[IpAddr]) -> Server {
    let respond: Responder =
        Arc::new(|q: &[u8]| answer(q, &[UPSTREAM_V4.into(), UPSTREAM_V6.into()]));
    let addrs = addrs.iter().map(|a| SocketAddr::new(*a, 53)).collect();
    serve(Ns::Named(ns.to_owned()), addrs, false, respond)
}

/// ztunnel's DNS proxy stand-in on 127.0.0.1:15053 and [::1]:15053 (TCP
/// and UDP, marked) in the pod netns `ns`: names under [`PROXY_ZONE`] are
/// answered with PROXY_V4/_V6 ([`BIG_NAME`] with 60 records), the rest
/// forwarded over UDP to `forward_to` from a marked socket.
pub fn proxy(ns: &str, forward_to: SocketAddr) -> Server {
    proxy_answering_after(ns, forward_to, Duration::ZERO)
}

/// [`proxy`], each answer sent `delay` after its query came (a proxy busy
/// with other pods' queries, or waiting on its upstream).
pub fn proxy_answering_after(ns: &str, forward_to: SocketAddr, delay: Duration) -> Server {
    proxy_in(Ns::Named(ns.to_owned()), forward_to, delay)
}

/// [`proxy_answering_after`] in a netns given by name or by an fd (as the
/// ZDS peer holds a pod's).
pub fn proxy_in(ns: Ns, forward_to: SocketAddr, delay: Duration) -> Server {
    let respond: Responder = Arc::new(move |q: &[u8]| {
        std::thread::sleep(delay);
        let (name, qtype, _) = question(q)?;
        if name == BIG_NAME {
            let many: Vec<IpAddr> = (0..60u8)
                .flat_map(|i| {
                    [
                        IpAddr::from(Ipv4Addr::new(10, 53, 1, i)),
                        IpAddr::from(Ipv6Addr::new(0xfd53, 1, 0, 0, 0, 0, 0, i.into())),
                    ]
                })
                .collect();
            return answer(q, &many);
        }
        if name.ends_with(PROXY_ZONE) {
            return answer(q, &[PROXY_V4.into(), PROXY_V6.into()]);
        }
        let _ = qtype;
        forward(q, forward_to)
    });
    let addrs = vec![
        SocketAddr::new(Ipv4Addr::LOCALHOST.into(), PORT_DNS_PROXY),
        SocketAddr::new(Ipv6Addr::LOCALHOST.into(), PORT_DNS_PROXY),
    ];
    serve(ns, addrs, true, respond)
}

/// A DNS proxy that takes every query on localhost:15053 (UDP and TCP, its
/// sockets marked as ztunnel's) and answers none: a proxy slower than its
/// pod asks.
pub fn silent_proxy(ns: &str) -> Server {
    let addrs = vec![
        SocketAddr::new(Ipv4Addr::LOCALHOST.into(), PORT_DNS_PROXY),
        SocketAddr::new(Ipv6Addr::LOCALHOST.into(), PORT_DNS_PROXY),
    ];
    serve(
        Ns::Named(ns.to_owned()),
        addrs,
        true,
        Arc::new(|_: &[u8]| None),
    )
}

/// The proxy's own upstream query: a marked UDP socket (runs in the pod
/// netns, on the proxy's thread).
fn forward(q: &[u8], to: SocketAddr) -> Option<Vec<u8>> {
    let any: SocketAddr = if to.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let s: UdpSocket = socket(any, Type::DGRAM, true).ok()?.into();
    // Within the client's own wait.
    s.set_read_timeout(Some(ANSWER_WAIT / 2)).ok()?;
    s.connect(to).ok()?;
    s.send(q).ok()?;
    let mut buf = [0u8; 4096];
    let n = s.recv(&mut buf).ok()?;
    Some(buf[..n].to_vec())
}

/// How a test client asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Client {
    /// A connected UDP socket (glibc, musl and Go's resolvers): the kernel
    /// delivers only datagrams from the address it is connected to.
    UdpConnected,
    /// An unconnected UDP socket (send_to / recv_from): the source of the
    /// answer is what the client checks.
    UdpUnconnected,
    Tcp,
}

/// What a client got: the answer and the address it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Got {
    pub answer: Answer,
    pub from: SocketAddr,
}

/// Asks `server` for `name` (type by the server's family unless given)
/// from netns `ns`; an error on no answer within [`ANSWER_WAIT`].
pub fn ask(
    ns: &str,
    client: Client,
    server: SocketAddr,
    name: &str,
    qtype: u16,
) -> anyhow::Result<Got> {
    let name = name.to_owned();
    crate::ns::run_in(ns, move || -> anyhow::Result<Got> {
        let id = (std::process::id() as u16) ^ 0x5a5a;
        let q = query(id, &name, qtype);
        let wait = Some(ANSWER_WAIT);
        let (bytes, from) = match client {
            Client::Tcp => {
                let mut c = TcpStream::connect_timeout(&server, ANSWER_WAIT)?;
                c.set_read_timeout(wait)?;
                write_framed(&mut c, &q)?;
                let from = c.peer_addr()?;
                let m = read_framed(&mut c).ok_or_else(|| anyhow::anyhow!("no TCP answer"))?;
                (m, from)
            }
            Client::UdpConnected | Client::UdpUnconnected => {
                let any: SocketAddr = if server.is_ipv4() {
                    (Ipv4Addr::UNSPECIFIED, 0).into()
                } else {
                    (Ipv6Addr::UNSPECIFIED, 0).into()
                };
                let s = UdpSocket::bind(any)?;
                s.set_read_timeout(wait)?;
                let mut buf = [0u8; 4096];
                if client == Client::UdpConnected {
                    s.connect(server)?;
                    s.send(&q)?;
                    let n = s.recv(&mut buf)?;
                    (buf[..n].to_vec(), s.peer_addr()?)
                } else {
                    s.send_to(&q, server)?;
                    let (n, from) = s.recv_from(&mut buf)?;
                    (buf[..n].to_vec(), from)
                }
            }
        };
        let answer = parse_answer(&bytes).ok_or_else(|| anyhow::anyhow!("unparsable answer"))?;
        anyhow::ensure!(answer.id == id, "answer id {} for query {id}", answer.id);
        Ok(Got {
            answer,
            from: canonical(from),
        })
    })
}

/// Queries answered per second over one connected UDP socket in netns `ns`
/// asking `server` for `name` over `window` (the DNS benchmark). Every
/// answer's id is checked; a query with no answer within the read timeout
/// is an error, not a slow sample.
pub fn query_rate(
    ns: &str,
    server: SocketAddr,
    name: &str,
    window: Duration,
) -> anyhow::Result<f64> {
    let name = name.to_owned();
    crate::ns::run_in(ns, move || -> anyhow::Result<f64> {
        let any: SocketAddr = if server.is_ipv4() {
            (Ipv4Addr::UNSPECIFIED, 0).into()
        } else {
            (Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let s = UdpSocket::bind(any)?;
        s.set_read_timeout(Some(ANSWER_WAIT))?;
        s.connect(server)?;
        let mut buf = [0u8; 4096];
        let start = std::time::Instant::now();
        let mut n: u64 = 0;
        while start.elapsed() < window {
            let id = n as u16;
            s.send(&query(id, &name, TYPE_A))?;
            let got = s.recv(&mut buf)?;
            let a =
                parse_answer(&buf[..got]).ok_or_else(|| anyhow::anyhow!("unparsable answer"))?;
            anyhow::ensure!(a.id == id, "answer id {} for query {id}", a.id);
            n += 1;
        }
        Ok(n as f64 / start.elapsed().as_secs_f64())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_round_trip_and_carry_only_the_questions_type() {
        let q = query(7, "a.proxy.test", TYPE_AAAA);
        assert_eq!(
            question(&q).map(|(n, t, _)| (n, t)),
            Some(("a.proxy.test".into(), TYPE_AAAA))
        );
        let a = answer(&q, &[PROXY_V4.into(), PROXY_V6.into()]).unwrap();
        let got = parse_answer(&a).unwrap();
        assert_eq!((got.id, got.addrs), (7, vec![IpAddr::from(PROXY_V6)]));
    }
}

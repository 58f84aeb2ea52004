//! Steady traffic for one pod while it lives: new connections out (from its
//! netns to the remote servers) and in (from the remote netns to its app),
//! DNS queries to the remote's resolver (captured to ztunnel's DNS proxy),
//! both families, and one long-lived connection out. Every app socket
//! binds a source port from [`APP_PORTS`], so the checks can tell it from
//! ztunnel's own. Outcomes go to the ledger.

use std::{
    io::{BufRead, BufReader, ErrorKind, Write},
    net::{IpAddr, SocketAddr, TcpStream},
    sync::{
        atomic::{AtomicBool, AtomicU32, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::Duration,
};

use sluice_common::MARK_ZTUNNEL;
use sluice_tests::{
    dns,
    flow::{try_connect, Opts},
    ns::spawn_in,
};

use crate::{
    ledger::Ledger,
    node::{Pod, APP_PORT, APP_PORTS, REMOTE_PORT, REMOTE_V4, REMOTE_V6},
};

/// Pause between two new connections of one kind.
const PACE: Duration = Duration::from_millis(150);
/// How often the long-lived connection exchanges a line.
const LONG_LIVED_PACE: Duration = Duration::from_millis(500);
const TIMEOUT: Duration = Duration::from_secs(3);

/// The next app source port (shared by every pod and direction: a port is
/// reused only after the whole range, long after its TIME_WAIT).
fn app_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let span = u32::from(APP_PORTS.end() - APP_PORTS.start()) + 1;
    APP_PORTS.start() + (NEXT.fetch_add(1, Ordering::Relaxed) % span) as u16
}

/// One pod's traffic threads.
pub struct Traffic {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Traffic {
    pub fn start(ledger: &Arc<Ledger>, pod: &Pod, remote_ns: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let remote_for = |ip: &IpAddr| -> IpAddr {
            let r = if ip.is_ipv4() { REMOTE_V4 } else { REMOTE_V6 };
            r.parse().expect("a remote address")
        };
        let out: Vec<SocketAddr> = pod
            .ips
            .iter()
            .map(|ip| SocketAddr::new(remote_for(ip), REMOTE_PORT))
            .collect();
        let pairs_in: Vec<(IpAddr, SocketAddr)> = pod
            .ips
            .iter()
            .map(|ip| (remote_for(ip), SocketAddr::new(*ip, APP_PORT)))
            .collect();
        let pod_ips = pod.ips.clone();
        let mut threads = Vec::new();
        let (l, s, uid, bypass) = (
            ledger.clone(),
            stop.clone(),
            pod.uid.clone(),
            pod.bypass.clone(),
        );
        threads.push(spawn_in(&pod.netns, move || {
            while !s.load(Ordering::SeqCst) && !l.stopping() {
                for (src, dst) in pod_ips.iter().zip(&out) {
                    let mark = bypass.load(Ordering::SeqCst).then_some(MARK_ZTUNNEL);
                    one(&l, "outbound", &uid, *src, *dst, mark);
                }
                std::thread::sleep(PACE);
            }
        }));
        let (l, s, uid) = (ledger.clone(), stop.clone(), pod.uid.clone());
        threads.push(spawn_in(remote_ns, move || {
            while !s.load(Ordering::SeqCst) && !l.stopping() {
                for (src, dst) in &pairs_in {
                    one(&l, "inbound", &uid, *src, *dst, None);
                }
                std::thread::sleep(PACE);
            }
        }));
        let (l, s, uid, bypass) = (
            ledger.clone(),
            stop.clone(),
            pod.uid.clone(),
            pod.bypass.clone(),
        );
        let resolvers: Vec<(IpAddr, SocketAddr)> = pod
            .ips
            .iter()
            .map(|ip| (*ip, SocketAddr::new(remote_for(ip), 53)))
            .collect();
        threads.push(spawn_in(&pod.netns, move || {
            while !s.load(Ordering::SeqCst) && !l.stopping() {
                for (src, resolver) in &resolvers {
                    let t0 = l.now();
                    let mark = bypass.load(Ordering::SeqCst).then_some(MARK_ZTUNNEL);
                    match query(*src, *resolver, mark) {
                        Ok(Some(r)) => l.attempt("dns", &uid, t0, r),
                        Ok(None) => {}
                        Err(e) => l.attempt("dns", &uid, t0, Err(e)),
                    }
                }
                std::thread::sleep(PACE);
            }
        }));
        let (l, s, uid) = (ledger.clone(), stop.clone(), pod.uid.clone());
        let (src, dst) = (
            pod.ips[0],
            SocketAddr::new(remote_for(&pod.ips[0]), REMOTE_PORT),
        );
        threads.push(spawn_in(&pod.netns, move || {
            long_lived(&l, &s, &uid, src, dst)
        }));
        Self { stop, threads }
    }

    /// Stops the threads and waits for their last connections.
    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// A connection from `src` (an app port) to `dst`, one line each way.
fn one(l: &Ledger, kind: &'static str, uid: &str, src: IpAddr, dst: SocketAddr, mark: Option<u32>) {
    let t0 = l.now();
    match open(src, dst, mark) {
        Ok(Some(s)) => l.attempt(kind, uid, t0, exchange(&s)),
        // The port is still taken (TIME_WAIT): not an attempt.
        Ok(None) => {}
        Err(e) => l.attempt(kind, uid, t0, Err(e)),
    }
}

/// A connection from an app port; `None` when the port is busy.
fn open(src: IpAddr, dst: SocketAddr, mark: Option<u32>) -> Result<Option<TcpStream>, String> {
    let opts = Opts {
        mark,
        bind: Some(src),
        src_port: Some(app_port()),
        timeout: Some(TIMEOUT),
        ..Opts::default()
    };
    match try_connect(dst, &opts) {
        Ok(s) => {
            let _ = s.set_read_timeout(Some(TIMEOUT));
            Ok(Some(s))
        }
        Err(e) if matches!(e.kind(), ErrorKind::AddrInUse | ErrorKind::AddrNotAvailable) => {
            Ok(None)
        }
        Err(e) => Err(format!("connect {dst}: {e}")),
    }
}

/// One DNS query over UDP from `src` (an app port) to `resolver`, as a
/// connected socket (glibc's resolver) asks it; `None` when the port is
/// busy. Answered through ztunnel's DNS proxy when captured.
fn query(
    src: IpAddr,
    resolver: SocketAddr,
    mark: Option<u32>,
) -> Result<Option<Result<(), String>>, String> {
    let s = match std::net::UdpSocket::bind(SocketAddr::new(src, app_port())) {
        Ok(s) => s,
        Err(e) if e.kind() == ErrorKind::AddrInUse => return Ok(None),
        Err(e) => return Err(format!("bind: {e}")),
    };
    if let Some(m) = mark {
        socket2::SockRef::from(&s)
            .set_mark(m)
            .map_err(|e| format!("SO_MARK: {e}"))?;
    }
    let qtype = if resolver.is_ipv4() {
        dns::TYPE_A
    } else {
        dns::TYPE_AAAA
    };
    let id = s.local_addr().map_or(0, |a| a.port());
    let ask = || -> std::io::Result<Vec<u8>> {
        s.set_read_timeout(Some(TIMEOUT))?;
        s.connect(resolver)?;
        s.send(&dns::query(id, "chaos.example", qtype))?;
        let mut buf = [0u8; 1500];
        let n = s.recv(&mut buf)?;
        Ok(buf[..n].to_vec())
    };
    Ok(Some(match ask() {
        Ok(m) => match dns::parse_answer(&m) {
            Some(a) if a.id == id => Ok(()),
            other => Err(format!("answer {other:?} to query {id}")),
        },
        Err(e) => Err(format!("query {resolver}: {e}")),
    }))
}

/// One line out, the server's line back (`app:` from the app itself).
fn exchange(s: &TcpStream) -> Result<(), String> {
    let mut w = s;
    writeln!(w, "chaos").map_err(|e| format!("write: {e}"))?;
    let mut line = String::new();
    BufReader::new(s)
        .read_line(&mut line)
        .map_err(|e| format!("read: {e}"))?;
    if line.starts_with("app:") {
        Ok(())
    } else {
        Err(format!("answered {:?}", line.trim()))
    }
}

/// One connection kept open, a line every [`LONG_LIVED_PACE`]; a failure
/// counts over the connection's whole life (a fault since it opened may
/// own it), and a new one opens.
fn long_lived(l: &Ledger, stop: &AtomicBool, uid: &str, src: IpAddr, dst: SocketAddr) {
    while !stop.load(Ordering::SeqCst) && !l.stopping() {
        let t0 = l.now();
        let s = match open(src, dst, None) {
            Ok(Some(s)) => s,
            Ok(None) => continue,
            Err(e) => {
                l.attempt("long-lived", uid, t0, Err(e));
                std::thread::sleep(LONG_LIVED_PACE);
                continue;
            }
        };
        let result = loop {
            if let Err(e) = exchange(&s) {
                break Err(e);
            }
            if stop.load(Ordering::SeqCst) || l.stopping() {
                break Ok(());
            }
            std::thread::sleep(LONG_LIVED_PACE);
        };
        l.attempt("long-lived", uid, t0, result);
    }
}

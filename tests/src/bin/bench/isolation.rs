//! Scenario `isolation`: one pod floods the node-wide maps it can write
//! without privileges, as issue 38 found (connects to its own closed port,
//! DNS queries from new connected sockets), while a neighbour on the same
//! node does its usual work. The keys are the neighbour's: the share of its
//! kept SYN-cookie hints that survive the flood, and of its DNS queries
//! answered from the resolver's address. Both should be 1.

use std::{
    net::{IpAddr, SocketAddr, TcpStream, UdpSocket},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{ensure, Context as _};
use rand::rngs::StdRng;
use sluice::{dataplane::loader::Dataplane, podnet::enroll, uid::PodUid};
use sluice_common::PodState;
use sluice_tests::{
    dns,
    ns::{exec, run_in, spawn_in},
    sink::{Mode, Sink},
    topology::{Family, Topology},
};

use crate::{workload, Config, Report};

/// The app port the neighbour's clients connect to (ztunnel's 15006 takes them).
const APP_PORT: u16 = 8080;
/// A port nothing listens on in the flooding pod.
const CLOSED_PORT: u16 = 9;
/// How long the neighbour's DNS proxy takes to answer.
/// Under the gap between its queries (`flood_window` over
/// `isolation_queries` + 1), so that they never queue at the stand-in.
const NEIGHBOUR_ANSWER_AFTER: Duration = Duration::from_millis(80);

/// A pod on the bench node with ztunnel-like listeners and a DNS proxy.
struct Pod {
    topo: Topology,
    _sinks: Vec<Sink>,
    _proxy: dns::Server,
}

impl Pod {
    /// `answer_after`: how long its DNS proxy takes to answer.
    fn new(tag: &str, subnet: u8, answer_after: Duration) -> anyhow::Result<Self> {
        let topo = Topology::with_subnet(tag, subnet)?;
        let resolver = SocketAddr::new(topo.client_ip(Family::V4), 53);
        let proxy = dns::proxy_answering_after(&topo.pod, resolver, answer_after);
        let sinks = [15001, 15006, 15008]
            .into_iter()
            .map(|port| Sink::ztunnel_like(&topo.pod, port, Mode::AcceptClose))
            .collect();
        Ok(Self {
            topo,
            _sinks: sinks,
            _proxy: proxy,
        })
    }

    fn ip(&self) -> IpAddr {
        self.topo.pod_ip(Family::V4)
    }

    fn resolver(&self) -> SocketAddr {
        SocketAddr::new(self.topo.client_ip(Family::V4), 53)
    }
}

pub fn isolation(report: &mut Report, cfg: &Config, _rng: &mut StdRng) -> anyhow::Result<()> {
    let flooder = Pod::new("isoa", 0, Duration::ZERO)?;
    // The neighbour's answers take as long as they would from a proxy busy
    // with the flood (one ztunnel serves the node) or from its upstream: a
    // query's entry must live that long.
    let neighbour = Pod::new("isob", 1, NEIGHBOUR_ANSWER_AFTER)?;
    // One node: both pods in the flooder's pins (DNS capture on by default).
    let mut dp = Dataplane::load_or_adopt(flooder.topo.pins.clone())?;
    for (p, name) in [(&flooder, "iso-flooder"), (&neighbour, "iso-neighbour")] {
        let e = enroll::enroll(
            &mut dp,
            &p.topo.pod_netns_path(),
            &PodUid::new(name)?,
            &workload(name),
        )?;
        ensure!(e.state == PodState::Enabled, "{name} not Enabled: {e:?}");
    }
    hint_flood(report, cfg, &dp, &flooder, &neighbour)?;
    let n = cfg.isolation_queries as f64;
    let (alone, _) = dns_flood(cfg, &flooder, &neighbour, false)?;
    let (answered, rate) = dns_flood(cfg, &flooder, &neighbour, true)?;
    eprintln!(
        "bench: isolation: neighbour DNS answered {alone} of {n} alone, {answered} under {rate:.0} flood queries/s"
    );
    report.put(
        "isolation_neighbour_dns_answered_ratio_alone",
        alone as f64 / n,
    );
    report.put(
        "isolation_neighbour_dns_answered_ratio",
        answered as f64 / n,
    );
    report.put("isolation_dns_flood_queries_per_s", rate);
    // Whether the neighbour's lost answers were evicted entries: the `lo`
    // program counts an answer whose query it no longer finds.
    let cookie = dp
        .maps()
        .find_uid(&PodUid::new("iso-neighbour")?)
        .context("the neighbour enrolled")?;
    let unmapped = dp.maps().dns_counters(cookie).replies_unmapped;
    report.put("isolation_neighbour_dns_unmapped", unmapped as f64);
    Ok(())
}

/// The neighbour's listener answers with SYN cookies (as under a SYN flood
/// of its own): each of its inbound connections keeps its hint, which a
/// late ACK needs (`FLOW_HINT_TTL_NS`). The flooder then connects to its
/// own address for `cfg.flood_window` (shorter than the hints' TTL), from a
/// few threads: first to a closed port, then, with its own listener
/// answering with SYN cookies too (`tcp_syncookies=2` is a safe sysctl),
/// to an open one. Every hint of the neighbour's still there is one a late
/// ACK would have found.
fn hint_flood(
    report: &mut Report,
    cfg: &Config,
    dp: &Dataplane,
    flooder: &Pod,
    neighbour: &Pod,
) -> anyhow::Result<()> {
    exec(
        &neighbour.topo.pod,
        &["sysctl", "-qw", "net.ipv4.tcp_syncookies=2"],
    )?;
    let n = cfg.isolation_conns;
    let closed = SocketAddr::new(flooder.ip(), CLOSED_PORT);
    let hints = neighbour_hints(dp, neighbour, n)?;
    let rate = flood(&flooder.topo.pod, cfg.flood_window, move || {
        connect_once(closed, true)
    })?;
    let kept = hints.kept(dp);
    report_hints(
        report,
        "hint_flood",
        "",
        "closed-port connects/s",
        rate,
        kept,
        n,
    );
    exec(
        &flooder.topo.pod,
        &["sysctl", "-qw", "net.ipv4.tcp_syncookies=2"],
    )?;
    let open = SocketAddr::new(flooder.ip(), OPEN_PORT);
    let stop = Arc::new(AtomicBool::new(false));
    let (bound, is_bound) = std::sync::mpsc::channel();
    let acceptor = {
        let stop = stop.clone();
        // Accepts (and drops) every connection: a full accept queue would
        // drop SYNs rather than answer them.
        spawn_in(&flooder.topo.pod, move || -> std::io::Result<()> {
            let l = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
            l.bind(&open.into())?;
            l.listen(4096)?;
            l.set_nonblocking(true)?;
            let _ = bound.send(());
            while !stop.load(Ordering::Relaxed) {
                if l.accept().is_err() {
                    std::thread::yield_now();
                }
            }
            Ok(())
        })
    };
    is_bound
        .recv_timeout(Duration::from_secs(5))
        .context("the flooder's listener")?;
    let hints = neighbour_hints(dp, neighbour, n)?;
    let rate = flood(&flooder.topo.pod, cfg.flood_window, move || {
        connect_once(open, false)
    });
    stop.store(true, Ordering::Relaxed);
    acceptor.join().expect("accept thread")?;
    let rate = rate?;
    let kept = hints.kept(dp);
    let what = "SYN-cookie connects/s to itself";
    report_hints(report, "cookie_flood", "_cookie_flood", what, rate, kept, n);
    Ok(())
}

/// One hint flood's keys: `isolation_{flood}_connects_per_s` and
/// `isolation_neighbour_hints_kept_ratio{suffix}` (the neighbour's `kept`
/// of `n` hints).
fn report_hints(
    report: &mut Report,
    flood: &str,
    suffix: &str,
    what: &str,
    rate: f64,
    kept: usize,
    n: usize,
) {
    eprintln!("bench: isolation: {rate:.0} {what}; {kept} of {n} neighbour hints kept");
    report.put(&format!("isolation_{flood}_connects_per_s"), rate);
    report.put(
        &format!("isolation_neighbour_hints_kept_ratio{suffix}"),
        kept as f64 / n as f64,
    );
}

/// A port the flooder listens on (never accepting).
const OPEN_PORT: u16 = 7000;

/// One connect to `to`: it must succeed, or be refused where `closed`.
fn connect_once(to: SocketAddr, closed: bool) -> std::io::Result<()> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    match s.connect(&to.into()) {
        Ok(()) if !closed => Ok(()),
        Err(e) if closed && e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(()),
        other => Err(std::io::Error::other(format!("connect to {to}: {other:?}"))),
    }
}

/// The neighbour's inbound connections whose hints are kept (SYN cookies).
struct Hints {
    dst: SocketAddr,
    sources: Vec<SocketAddr>,
}

impl Hints {
    fn kept(&self, dp: &Dataplane) -> usize {
        self.sources
            .iter()
            .filter(|from| {
                dp.maps()
                    .flow_hint(&sluice_tests::flow::hint_key(**from, self.dst))
                    .is_some()
            })
            .count()
    }
}

/// `n` inbound connections to the neighbour, answered with SYN cookies:
/// each keeps its hint.
fn neighbour_hints(dp: &Dataplane, neighbour: &Pod, n: usize) -> anyhow::Result<Hints> {
    let dst = SocketAddr::new(neighbour.ip(), APP_PORT);
    let sources = run_in(
        &neighbour.topo.client,
        move || -> std::io::Result<Vec<SocketAddr>> {
            (0..n)
                .map(|_| {
                    let s = TcpStream::connect_timeout(&dst, Duration::from_secs(3))?;
                    s.local_addr()
                })
                .collect()
        },
    )
    .context("the neighbour's inbound connections")?;
    let hints = Hints { dst, sources };
    let kept = hints.kept(dp);
    ensure!(
        kept == n,
        "only {kept} of {n} cookie handshakes kept their hint"
    );
    Ok(hints)
}

/// The flooder asks its resolver from new connected UDP sockets (as glibc
/// does), from a few threads, for `cfg.flood_window`; meanwhile the
/// neighbour asks `cfg.isolation_queries` times, spread over the window,
/// one connected socket each, its proxy answering after
/// [`NEIGHBOUR_ANSWER_AFTER`]. A neighbour's query is answered if its
/// socket gets the answer (a connected socket takes it only from the
/// resolver's address: one whose entry the flood evicted comes from the
/// proxy's, and is dropped) within [`NEIGHBOUR_WAIT`].
/// Without `flood`, the same queries alone: the method's control (all
/// answered). Returns the neighbour's queries answered and the flood's rate.
fn dns_flood(
    cfg: &Config,
    flooder: &Pod,
    neighbour: &Pod,
    flood: bool,
) -> anyhow::Result<(usize, f64)> {
    let threads = if flood { FLOOD_THREADS } else { 0 };
    let resolver = flooder.resolver();
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let flooding: Vec<_> = (0..threads)
        .map(|t| {
            let (stop, sent) = (stop.clone(), sent.clone());
            spawn_in(&flooder.topo.pod, move || -> std::io::Result<()> {
                let q = dns::query(t as u16, "flood.proxy.test", dns::TYPE_A);
                while !stop.load(Ordering::Relaxed) {
                    let s = UdpSocket::bind("0.0.0.0:0")?;
                    s.connect(resolver)?;
                    s.send(&q)?;
                    sent.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })
        })
        .collect();
    let want = neighbour.resolver();
    let n = cfg.isolation_queries;
    let gap = cfg.flood_window / (n as u32 + 1);
    let mut asks = Vec::new();
    for i in 0..n {
        std::thread::sleep(gap);
        asks.push(spawn_in(
            &neighbour.topo.pod,
            move || -> std::io::Result<bool> {
                let s = UdpSocket::bind("0.0.0.0:0")?;
                s.connect(want)?;
                s.set_read_timeout(Some(NEIGHBOUR_WAIT))?;
                s.send(&dns::query(i as u16, "a.proxy.test", dns::TYPE_A))?;
                let mut buf = [0u8; 512];
                Ok(s.recv(&mut buf).is_ok())
            },
        ));
    }
    std::thread::sleep(cfg.flood_window.saturating_sub(start.elapsed()));
    stop.store(true, Ordering::Relaxed);
    let took = start.elapsed();
    for t in flooding {
        t.join().expect("flood thread")?;
    }
    let mut answered = 0;
    for a in asks {
        answered += usize::from(a.join().expect("query thread")?);
    }
    let rate = sent.load(Ordering::Relaxed) as f64 / took.as_secs_f64();
    Ok((answered, rate))
}

/// How long a neighbour's query waits for its answer.
const NEIGHBOUR_WAIT: Duration = Duration::from_secs(1);

const FLOOD_THREADS: usize = 2;

/// Runs `one` in a loop in netns `ns` from [`FLOOD_THREADS`] threads for
/// `window`; returns how many ran per second.
fn flood(
    ns: &str,
    window: Duration,
    one: impl Fn() -> std::io::Result<()> + Send + Sync + Clone + 'static,
) -> anyhow::Result<f64> {
    let start = Instant::now();
    let threads: Vec<_> = (0..FLOOD_THREADS)
        .map(|_| {
            let one = one.clone();
            spawn_in(ns, move || -> std::io::Result<u64> {
                let mut n = 0;
                while start.elapsed() < window {
                    one()?;
                    n += 1;
                }
                Ok(n)
            })
        })
        .collect();
    let mut total = 0;
    for t in threads {
        total += t.join().expect("flood thread")?;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

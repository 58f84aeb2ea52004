//! A ZDS peer that behaves like upstream ztunnel, for tests: connects to the
//! agent's socket with backoff, says hello, requires exactly one fd with every
//! add, opens the pod's listeners in the netns it was handed (the stand-in),
//! acks with an empty Ack, and disconnects on protocol errors. Flags make it
//! misbehave on purpose. Every event is printed to stdout as a JSON line.
//!
//! sluice-zds-peer --socket PATH [--nack TEXT] [--no-ack] [--ack-without-listening] [--v4-only]
//!                 [--hello-version N] [--hold-acks-until FILE]
//!                 [--admin-workloads FILE | --no-admin] [--admin-port N]
//!                 [--dns-forward ADDR]
//!
//! Like ztunnel, it runs in a network namespace of its own (made at start,
//! gone when it exits) and serves an admin API there on 127.0.0.1:15000
//! (`--admin-port`): `/config_dump` lists, as xDS would, a workload for every
//! pod it holds (name, namespace and service account from the add, IPs from
//! the pod netns). `--admin-workloads FILE`: list what FILE holds instead (a
//! JSON array of workloads, read at every request; missing = empty), so a
//! test decides what ztunnel "knows". `--no-admin`: nothing listens.
//!
//! `--dns-forward ADDR`: also open ztunnel's DNS proxy (15053, UDP and TCP)
//! in every pod, forwarding what it does not answer itself to ADDR.
//!
//! `--ack-without-listening`: ack every add but open no listeners — a
//! ztunnel broken on its side of the exchange, not refusing the pod.
//!
//! `--hold-acks-until FILE`: open a pod's listeners (event `listening`) but
//! ack its add only once FILE exists — a ztunnel whose acks come late, so a
//! test can order "new listeners open" and "old ztunnel gone" before the
//! agent learns of the new ones.

use std::{
    collections::HashMap,
    io::Write,
    os::fd::{AsFd, AsRawFd, OwnedFd},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
use sluice::zds::{
    proto::{
        self, workload_request::Payload, Version, WorkloadRequest, WorkloadResponse, ZdsHello,
    },
    wire,
};
use sluice_tests::{
    admin, dns,
    ns::Ns,
    standin::{Accepted, Bind, OnAccept, StandIn},
};

struct Opts {
    socket: PathBuf,
    nack: Option<String>,
    no_ack: bool,
    ack_without_listening: bool,
    bind: Bind,
    hello_version: i32,
    hold_acks_until: Option<PathBuf>,
    admin: Admin,
    admin_port: u16,
    dns_forward: Option<std::net::SocketAddr>,
}

enum Admin {
    /// Every pod held, as a synced xDS would have it.
    Auto,
    /// The workloads in this file.
    File(PathBuf),
    None,
}

fn opts() -> Opts {
    let mut o = Opts {
        socket: PathBuf::new(),
        nack: None,
        no_ack: false,
        ack_without_listening: false,
        bind: Bind::DualStack,
        hello_version: Version::V1 as i32,
        hold_acks_until: None,
        admin: Admin::Auto,
        admin_port: 15000,
        dns_forward: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--socket" => o.socket = args.next().expect("--socket PATH").into(),
            "--nack" => o.nack = Some(args.next().expect("--nack TEXT")),
            "--no-ack" => o.no_ack = true,
            "--ack-without-listening" => o.ack_without_listening = true,
            "--v4-only" => o.bind = Bind::V4Only,
            "--hello-version" => o.hello_version = args.next().expect("N").parse().expect("number"),
            "--hold-acks-until" => o.hold_acks_until = Some(args.next().expect("FILE").into()),
            "--admin-workloads" => o.admin = Admin::File(args.next().expect("FILE").into()),
            "--no-admin" => o.admin = Admin::None,
            "--admin-port" => o.admin_port = args.next().expect("N").parse().expect("port"),
            "--dns-forward" => {
                o.dns_forward = Some(args.next().expect("ADDR").parse().expect("address"))
            }
            other => panic!("unknown flag {other}"),
        }
    }
    o
}

static OUT: Mutex<()> = Mutex::new(());

fn emit(v: serde_json::Value) {
    let _g = OUT.lock().unwrap();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

fn connect_with_backoff(path: &PathBuf) -> OwnedFd {
    let mut delay = Duration::from_millis(10);
    loop {
        let fd = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        if connect(fd.as_raw_fd(), &UnixAddr::new(path).unwrap()).is_ok() {
            return fd;
        }
        std::thread::sleep(delay);
        delay = (delay * 2).min(Duration::from_secs(1));
    }
}

/// A pod as this ztunnel holds it.
struct Pod {
    netns_ino: u64,
    _listeners: StandIn,
    /// Its DNS proxy (`--dns-forward`).
    _dns: Option<dns::Server>,
    /// As the auto admin lists it.
    workload: serde_json::Value,
}

static PODS: Mutex<Option<HashMap<String, Pod>>> = Mutex::new(None);

/// A netns of our own, as ztunnel has its pod's: before any thread exists,
/// so every thread is in it. Loopback up, for the admin API.
fn own_netns() {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
    let ok = std::process::Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "ip link set lo up");
}

fn start_admin(o: &Opts) {
    let workloads: admin::Workloads = match &o.admin {
        Admin::None => return,
        Admin::Auto => Arc::new(|| {
            PODS.lock()
                .unwrap()
                .iter()
                .flat_map(|p| p.values())
                .map(|p| p.workload.clone())
                .collect()
        }),
        Admin::File(f) => {
            let f = f.clone();
            Arc::new(move || {
                std::fs::read(&f)
                    .ok()
                    .and_then(|b| serde_json::from_slice(&b).ok())
                    .unwrap_or_default()
            })
        }
    };
    admin::serve(o.admin_port, workloads, |path| {
        emit(serde_json::json!({"event": "admin", "path": path}))
    })
    .expect("serving the admin API");
}

/// The pod's addresses, read inside its netns.
fn pod_ips(netns: &Arc<OwnedFd>) -> Vec<std::net::IpAddr> {
    let ns = Ns::Fd(netns.clone());
    std::thread::scope(|s| {
        s.spawn(|| {
            ns.enter().ok()?;
            sluice::podnet::netns::addresses().ok()
        })
        .join()
        .ok()
        .flatten()
        .unwrap_or_default()
    })
}

fn main() {
    let o = opts();
    own_netns();
    *PODS.lock().unwrap() = Some(HashMap::new());
    on_sigterm_drain();
    start_admin(&o);
    let on_accept: OnAccept = Arc::new(|a: &Accepted| {
        emit(
            serde_json::json!({"event": "accepted", "role": a.role.as_str(),
            "local": a.local.to_string(), "peer": a.peer.to_string()}),
        )
    });
    loop {
        // A draining ztunnel does not come back (upstream's connection loop
        // ends with its drain): the drain thread ends the process.
        if PODS.lock().unwrap().is_none() {
            loop {
                std::thread::park();
            }
        }
        let fd = connect_with_backoff(&o.socket);
        emit(serde_json::json!({"event": "connected"}));
        let hello = proto::encode(&ZdsHello {
            version: o.hello_version,
        });
        if wire::send(fd.as_fd(), &hello, None).is_err() {
            continue;
        }
        match session(&fd, &o, &on_accept) {
            Ok(()) => emit(serde_json::json!({"event": "disconnected"})),
            Err(e) => {
                // Upstream ztunnel exits the whole process on these.
                emit(serde_json::json!({"event": "protocol_error", "error": e}));
                std::process::exit(3);
            }
        }
    }
}

/// One connection; Ok(()) when the agent closed it (reconnect), Err on a
/// protocol error (exit).
fn session(fd: &OwnedFd, o: &Opts, on_accept: &OnAccept) -> Result<(), String> {
    let mut snapshot_done = false;
    loop {
        let dg = match wire::recv(fd.as_fd(), 1024) {
            Ok(d) => d,
            // The agent went away (closed, or killed with our connection
            // still in its backlog): reconnect, as ztunnel does.
            Err(wire::WireError::Closed | wire::WireError::Io(nix::Error::ECONNRESET)) => {
                return Ok(())
            }
            Err(e) => return Err(e.to_string()),
        };
        let req: WorkloadRequest = proto::decode(&dg.data).map_err(|e| e.to_string())?;
        let answer = match req.payload {
            Some(Payload::Add(add)) => {
                emit(
                    serde_json::json!({"event": "add", "uid": add.uid, "fds": dg.fds.len(),
                    "workload": add.workload_info.as_ref().map(|w| format!("{}/{}/{}", w.namespace, w.name, w.service_account))}),
                );
                if add.workload_info.is_none() {
                    return Err("add without workload_info".into());
                }
                let mut fds = dg.fds;
                if fds.len() != 1 {
                    // Upstream nacks fd-count errors and reconnects.
                    Some(WorkloadResponse::nack(&format!(
                        "expected 1 fd, got {}",
                        fds.len()
                    )))
                } else if o.no_ack {
                    None
                } else if let Some(t) = &o.nack {
                    Some(WorkloadResponse::nack(t))
                } else if o.ack_without_listening {
                    Some(WorkloadResponse::ack())
                } else {
                    let netns = fds.pop().unwrap();
                    let ino = nix::sys::stat::fstat(netns.as_raw_fd())
                        .map(|s| s.st_ino)
                        .unwrap_or(0);
                    let mut guard = PODS.lock().unwrap();
                    let Some(pods) = guard.as_mut() else {
                        return Ok(()); // draining
                    };
                    let same = pods.get(&add.uid).is_some_and(|p| p.netns_ino == ino);
                    if !same {
                        // New pod, or the same uid in a new netns: (re)start its proxy.
                        pods.remove(&add.uid);
                        let netns = Arc::new(netns);
                        let w = add.workload_info.as_ref().expect("checked above");
                        let workload = admin::workload(
                            &w.namespace,
                            &w.name,
                            &w.service_account,
                            &pod_ips(&netns),
                        );
                        let dns = o
                            .dns_forward
                            .map(|to| dns::proxy_in(Ns::Fd(netns.clone()), to, Duration::ZERO));
                        let listeners =
                            StandIn::start_in(Ns::Fd(netns), o.bind, Some(on_accept.clone()));
                        pods.insert(
                            add.uid.clone(),
                            Pod {
                                netns_ino: ino,
                                _listeners: listeners,
                                _dns: dns,
                                workload,
                            },
                        );
                    }
                    drop(guard);
                    emit(serde_json::json!({"event": "listening", "uid": add.uid}));
                    if let Some(gate) = &o.hold_acks_until {
                        // The test creates the file; the poll only paces the look.
                        while !gate.exists() {
                            std::thread::sleep(Duration::from_millis(5));
                        }
                    }
                    Some(WorkloadResponse::ack())
                }
            }
            Some(Payload::Del(del)) => {
                emit(serde_json::json!({"event": "del", "uid": del.uid, "fds": dg.fds.len()}));
                if let Some(p) = PODS.lock().unwrap().as_mut() {
                    p.remove(&del.uid);
                }
                Some(WorkloadResponse::ack())
            }
            Some(Payload::Keep(k)) => {
                emit(serde_json::json!({"event": "keep", "uid": k.uid}));
                if snapshot_done {
                    return Err("keep after snapshot_sent".into());
                }
                Some(WorkloadResponse::ack())
            }
            Some(Payload::SnapshotSent(_)) => {
                emit(serde_json::json!({"event": "snapshot_sent"}));
                if snapshot_done {
                    return Err("second snapshot_sent".into());
                }
                snapshot_done = true;
                Some(WorkloadResponse::ack())
            }
            None => return Err("empty request".into()),
        };
        if let Some(a) = answer {
            wire::send(fd.as_fd(), &proto::encode(&a), None).map_err(|e| e.to_string())?;
        }
    }
}

/// On SIGTERM, drain as ztunnel does: close every listener (queued
/// connections move to the new ztunnel's listeners in the same reuseport
/// group), let in-flight connections finish, exit.
fn on_sigterm_drain() {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    // Blocked here, before any other thread exists, so only the waiter sees it.
    set.thread_block().expect("blocking SIGTERM");
    std::thread::spawn(move || {
        let _ = set.wait();
        emit(serde_json::json!({"event": "terminating"}));
        let pods = PODS.lock().unwrap().take().unwrap_or_default();
        let active: Vec<_> = pods.values().map(|p| p._listeners.active.clone()).collect();
        // Closing joins the accept loops: every connection accepted until
        // now is counted in `active` from here on.
        drop(pods);
        // In-flight connections finish (bounded, as ztunnel's drain period
        // is); the poll only paces this check.
        let start = std::time::Instant::now();
        while active
            .iter()
            .any(|a| a.load(std::sync::atomic::Ordering::SeqCst) > 0)
            && start.elapsed() < Duration::from_secs(5)
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        std::process::exit(0);
    });
}

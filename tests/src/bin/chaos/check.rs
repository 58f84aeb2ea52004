//! The invariants, checked while the run goes on: no app connection of an
//! enrolled pod leaves or arrives without ztunnel (every 100 ms), a pod
//! reported Served has its capture in the kernel, every pod is Served again
//! within a bound after the last fault that touched it, and the agent's
//! memory and descriptors stay bounded (every second).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU32, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::Duration,
};

use serde::Serialize;
use sluice::dataplane::loader::{Pins, Program};
use sluice_common::PodState;
use sluice_tests::{inspect, sniff::L4Sniffer};

use crate::{
    ledger::{Ledger, Ms},
    node::APP_PORTS,
};

/// A pod reported Served with its capture incomplete longer than this is
/// a lie (the agent's hook watch repairs within about a second).
pub const REPAIR_BOUND: Duration = Duration::from_secs(3);
/// Every pod is Served again this long after the last fault that touched it.
pub const SERVED_BOUND: Duration = Duration::from_secs(20);
/// The agent's bounds.
const RSS_BOUND_KIB: u64 = 256 * 1024;
const FDS_BOUND: u64 = 1024;

/// The agent's resources over the run.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Resources {
    pub rss_start_kib: u64,
    pub rss_peak_kib: u64,
    pub fds_peak: u64,
}

/// What connections leave the pods and reach their apps: a sniffer in the
/// remote netns (every packet from a pod to the servers), and each live
/// pod's app's list of peers.
pub struct Traffic {
    sniffer: L4Sniffer,
    apps: BTreeMap<String, Arc<Mutex<Vec<SocketAddr>>>>,
    /// The pinned state, for the pods' DNS pass-through counters.
    pins: Pins,
    /// Per pod, how many of its pass-through count the queries seen
    /// leaving have used up.
    passthrough_used: BTreeMap<String, u64>,
}

pub type Watch = Arc<Mutex<Traffic>>;

impl Traffic {
    pub fn start(remote_ns: &str, pins: Pins) -> anyhow::Result<Watch> {
        Ok(Arc::new(Mutex::new(Self {
            sniffer: L4Sniffer::start(remote_ns)?,
            apps: BTreeMap::new(),
            pins,
            passthrough_used: BTreeMap::new(),
        })))
    }

    pub fn watch(&mut self, uid: &str, seen: Arc<Mutex<Vec<SocketAddr>>>) {
        self.apps.insert(uid.to_owned(), seen);
    }

    pub fn unwatch(&mut self, uid: &str) {
        self.apps.remove(uid);
        self.passthrough_used.remove(uid);
    }

    /// Looks at everything seen since the last call.
    pub fn check(&mut self, l: &Ledger) {
        l.counted("no bypass");
        let mut records = None;
        for s in self.sniffer.drain() {
            let syn = s.proto == 6 && s.flags & 0x02 != 0 && s.flags & 0x10 == 0;
            // DNS capture is on (the node's default): a query leaving from
            // an app port went around ztunnel's DNS proxy.
            let query = s.proto == 17 && s.dst.port() == 53;
            if !(syn || query) || !APP_PORTS.contains(&s.src.port()) {
                continue;
            }
            let Some(uid) = l.owner(&s.src.ip()) else {
                continue;
            };
            // Row D4: a pod without a DNS socket of ztunnel's in its map
            // sends its queries to their resolver, and the programs count
            // each (`passthrough`). One the count does not cover left some
            // other way.
            if query {
                let records = records
                    .get_or_insert_with(|| sluice::status::read(&self.pins).unwrap_or_default());
                let counted = records
                    .iter()
                    .find(|r| r.uid == uid)
                    .map_or(0, |r| r.dns.passthrough);
                let used = self.passthrough_used.entry(uid.clone()).or_default();
                if *used < counted {
                    *used += 1;
                    *l.dns_passthrough.lock().unwrap() += 1;
                    continue;
                }
            }
            let what = if syn { "SYN" } else { "DNS query" };
            let detail = format!("an app's {what} {} -> {} left the pod", s.src, s.dst);
            bypass(l, &uid, detail);
        }
        for (uid, seen) in &self.apps {
            let peers = std::mem::take(&mut *seen.lock().unwrap());
            for p in peers.iter().filter(|p| APP_PORTS.contains(&p.port())) {
                bypass(l, uid, format!("the app accepted {p} itself"));
            }
        }
    }
}

fn bypass(l: &Ledger, uid: &str, what: String) {
    if l.tampered(uid, l.now()) {
        *l.tamper_bypasses.lock().unwrap() += 1;
    } else {
        l.violate("no bypass", Some(uid), what);
    }
}

/// The checker thread; it returns the agent's resources at its end.
pub fn start(
    ledger: Arc<Ledger>,
    watch: Watch,
    pins: Pins,
    control: PathBuf,
    agent_pid: Arc<AtomicU32>,
) -> JoinHandle<Resources> {
    std::thread::spawn(move || {
        let mut res = Resources::default();
        let mut tick = 0u64;
        while !ledger.stopping() {
            watch.lock().unwrap().check(&ledger);
            if tick.is_multiple_of(10) {
                states(&ledger, &pins, &control);
                resources(&ledger, agent_pid.load(Ordering::SeqCst), &mut res);
            }
            tick += 1;
            std::thread::sleep(Duration::from_millis(100));
        }
        res
    })
}

/// Truthful state and the Served bound, for every live pod. The kernel is
/// asked outside the ledger's lock (a `tc` run per hook). A pod is reported
/// Served when its pinned state is `Served` and the agent does not say its
/// capture failed its last verification (the agent's readiness gate and
/// `sluice status` then say it is not served); an agent that does not
/// answer (restarting, out of descriptors, flooded) is taken to report
/// every pinned `Served` pod as served.
fn states(l: &Ledger, pins: &Pins, control: &Path) {
    // Unreadable while an agent restarts and takes the pins over: next time.
    let Ok(records) = sluice::status::read(pins) else {
        return;
    };
    let unverified = failed_verifications(control, pins);
    let programs = inspect::pinned_programs(pins).unwrap_or_default();
    let id = |p: Program| programs.get(p.name()).map(|(id, _)| *id);
    let ours = [Program::Steer, Program::Egress, Program::Ingress].map(id);
    let now = l.now();
    let mut violations = Vec::new();
    // The pods reported Served, with their netns.
    let reported: Vec<(String, String)> = l.with_pods(|pods| {
        let mut served = Vec::new();
        for (uid, p) in pods.iter_mut() {
            l.counted("truthful state");
            let record = records.iter().find(|r| &r.uid == uid);
            if record.and_then(|r| r.state) == Some(PodState::Served) && !unverified.contains(uid) {
                served.push((uid.clone(), p.netns.clone()));
                continue;
            }
            p.served_since = None;
            p.untrue_since = None;
            let since = now.saturating_sub(p.last_touch);
            if since > SERVED_BOUND.as_millis() as Ms {
                let state = record.map(|r| r.state);
                let detail = format!(
                    "not Served {since} ms after the last fault that touched it: {state:?}"
                );
                violations.push(("bounded", uid.clone(), detail));
            }
        }
        served
    });
    let checked: Vec<(String, Result<(), String>)> = reported
        .into_iter()
        .map(|(uid, netns)| (uid, capture_in_kernel(&netns, ours)))
        .collect();
    for (uid, outcome) in checked {
        match outcome {
            Ok(()) => l.served(&uid),
            Err(e) => {
                if let Some(ms) = l.untrue_for(&uid, now) {
                    if ms > REPAIR_BOUND.as_millis() as Ms {
                        let detail = format!("Served for {ms} ms with {e}");
                        violations.push(("truthful state", uid, detail));
                    }
                }
            }
        }
    }
    for (invariant, uid, detail) in violations {
        l.violate(invariant, Some(&uid), detail);
    }
}

/// The pods whose capture failed the agent's last verification of it, as
/// the agent answers `status`; none when it does not answer within 1 s.
fn failed_verifications(control: &Path, pins: &Pins) -> BTreeSet<String> {
    use sluice::control::{Envelope, NodeAnswer, Request, Response, VerifyOutcome};
    let envelope = Envelope {
        bpf_root: Some(pins.root().to_owned()),
        request: Request::Status,
    };
    let Ok(Response::More(NodeAnswer::Node(node))) = ask_within(control, &envelope) else {
        return BTreeSet::new();
    };
    node.verifications
        .into_iter()
        .filter(|v| v.outcome == VerifyOutcome::Failed)
        .map(|v| v.uid)
        .collect()
}

/// One request to the agent, every step bounded by 1 s: the connect too
/// (`SO_SNDTIMEO` bounds a unix connect's wait for the listener's backlog,
/// which a control flood fills), so the checker never stands still.
fn ask_within(
    control: &Path,
    envelope: &sluice::control::Envelope,
) -> anyhow::Result<sluice::control::Response> {
    use socket2::{Domain, SockAddr, Socket, Type};
    use std::io::{BufRead, BufReader, Write};
    let wait = Some(Duration::from_secs(1));
    let s = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    s.set_write_timeout(wait)?;
    s.set_read_timeout(wait)?;
    s.connect(&SockAddr::unix(control)?)?;
    let mut s = std::os::unix::net::UnixStream::from(std::os::fd::OwnedFd::from(s));
    let mut out = serde_json::to_vec(envelope)?;
    out.push(b'\n');
    s.write_all(&out)?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    Ok(serde_json::from_str(&line)?)
}

/// The kernel's own answer: sluice's sk_lookup program is attached in the
/// pod's netns, and its egress and ingress programs run first on the pod's
/// eth0 (the hooks the tamper faults change).
fn capture_in_kernel(
    netns: &str,
    [steer, egress, ingress]: [Option<u32>; 3],
) -> Result<(), String> {
    let attached = inspect::sk_lookup_programs(&sluice_tests::ns::netns_path(netns))
        .map_err(|e| format!("{e:#}"))?;
    if !steer.is_some_and(|s| attached.contains(&s)) {
        return Err(format!(
            "sk_lookup running {attached:?}, sluice's is {steer:?}"
        ));
    }
    for (dir, want) in [("egress", egress), ("ingress", ingress)] {
        let first = inspect::filter_programs(netns, "eth0", dir)
            .map_err(|e| format!("{dir}: {e}"))?
            .into_iter()
            .min_by_key(|(pref, _)| *pref)
            .map(|(_, id)| id);
        if first.is_none() || first != want {
            return Err(format!(
                "eth0 {dir} running {first:?} first, sluice's is {want:?}"
            ));
        }
    }
    Ok(())
}

fn resources(l: &Ledger, pid: u32, res: &mut Resources) {
    if pid == 0 {
        return;
    }
    l.counted("bounded");
    let Ok(rss) = inspect::proc_status_kib(pid, "VmRSS:") else {
        return;
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64);
    if res.rss_start_kib == 0 {
        res.rss_start_kib = rss;
    }
    res.rss_peak_kib = res.rss_peak_kib.max(rss);
    res.fds_peak = res.fds_peak.max(fds);
    if rss > RSS_BOUND_KIB || fds > FDS_BOUND {
        l.violate(
            "bounded",
            None,
            format!("the agent holds {rss} KiB and {fds} fds"),
        );
    }
}

//! The served check: an Enabled pod (captured, acked, listeners registered)
//! becomes Served once the ztunnel that acked it knows its workload from
//! istiod; a Served pod whose workload that ztunnel lost goes back to
//! Enabled. ztunnel's view is read from its admin API (`served::fetch`), only
//! while some pod waits (backing off from 100 ms to 5 s), after every ack,
//! and every `recheck` (30 s) for the pods already served; never on the
//! enrollment or ZDS path.
//!
//! Fallback: a ztunnel whose admin API does not answer for `FALLBACK_AFTER`
//! (an older ztunnel, another admin port, a pid hidden by the pid namespace)
//! gets its acks counted as served, and `status` and the metrics say so; it
//! keeps being asked, and its answer takes over as soon as it comes.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    sync::{atomic::AtomicBool, Arc, Mutex},
    time::{Duration, Instant},
};

use sluice_common::PodState;
use tokio::sync::{watch, Notify};
use tracing::{info, info_span, warn};

use super::book::PodBook;
use crate::{
    control::ServedCheck as CheckView,
    dataplane::state::{addr_of, boottime_ns},
    lifecycle::{Event, Ztunnel},
    metrics::Metrics,
    served::{fetch, Known, Mode, Wanted},
    zds::server::Hub,
};

/// First look after a pod starts waiting, doubled up to `WAIT_MAX`.
const WAIT_MIN: Duration = Duration::from_millis(100);
const WAIT_MAX: Duration = Duration::from_secs(5);
/// How often Served pods are checked again (workload removed from xDS), by
/// default.
pub const DEFAULT_RECHECK: Duration = Duration::from_secs(30);
/// The recheck's share of one core at most: a recheck whose reads took
/// longer than this share of `recheck` (a config_dump of a big mesh) waits
/// longer, so that steady checking stays within it. The agent times a read,
/// not its CPU: it is mostly ztunnel building and serialising the dump (at
/// 100k workloads ≈ 1 s of ztunnel's CPU against ≈ 150 ms of the agent's
/// parse, bench `served`), on the cores that carry traffic, while the agent
/// parses what has come so far. So a read counts for two cores busy for
/// its time.
const RECHECK_SHARE: u32 = 1000; // 0.1 %
const READ_CORES: u32 = 2;
/// But never longer than this between rechecks (a workload lost from xDS
/// is still noticed). Reached at 1.8 s a read (the bench's 100k-workload
/// dump: 1.1 to 1.8 s a read on 2 vCPUs).
const RECHECK_MAX: Duration = Duration::from_secs(60 * 60);
/// How long a ztunnel's admin API may fail, on `FALLBACK_FAILURES` asks in a
/// row, before its acks count as served. Longer than one ask may take
/// (`fetch::TIMEOUT`), so one slow dump on a big mesh never switches it.
pub const FALLBACK_AFTER: Duration = Duration::from_secs(10);
const FALLBACK_FAILURES: u32 = 3;
/// Asks further apart than this are not "in a row".
const IN_A_ROW: Duration = Duration::from_secs(11);

/// How the agent asks ztunnel.
#[derive(Debug, Clone)]
pub struct ServedConfig {
    pub mode: Mode,
    /// ztunnel's admin port, on localhost in its netns.
    pub admin_port: u16,
    /// How often Served pods are checked again.
    pub recheck: Duration,
}

impl Default for ServedConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Auto,
            admin_port: fetch::DEFAULT_ADMIN_PORT,
            recheck: DEFAULT_RECHECK,
        }
    }
}

/// What the agent last heard from one ztunnel's admin API.
#[derive(Debug, Clone, Default)]
struct Heard {
    failing_since: Option<Instant>,
    /// Failed asks in a row.
    failures: u32,
    last_ask: Option<Instant>,
    last_error: Option<String>,
    /// Its acks count as served (failing too long, or no pid to ask).
    fallback: bool,
}

pub(super) struct ServedChecker {
    cfg: ServedConfig,
    /// This node's name, when the agent knows it (workloads on other nodes
    /// do not count).
    node: Option<String>,
    wake: Notify,
    /// Check the Served pods too on the next pass (an ack came).
    recheck: AtomicBool,
    /// By ztunnel pid (0: unknown pid).
    heard: Mutex<BTreeMap<i32, Heard>>,
    /// The live ztunnels, whose pids are asked.
    hub: Arc<Hub>,
    metrics: Arc<Metrics>,
}

impl ServedChecker {
    pub(super) fn new(
        cfg: ServedConfig,
        node: Option<String>,
        hub: Arc<Hub>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            cfg,
            node,
            wake: Notify::new(),
            recheck: AtomicBool::new(false),
            heard: Mutex::new(BTreeMap::new()),
            hub,
            metrics,
        }
    }

    /// A pod started waiting to be served: look now.
    pub(super) fn wake(&self) {
        self.wake.notify_one();
    }

    /// A ztunnel (re)acked pods: check the Served ones against it too.
    pub(super) fn recheck_soon(&self) {
        self.recheck
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.wake.notify_one();
    }

    pub(super) fn mode(&self) -> Mode {
        self.cfg.mode
    }

    /// The check as `status` shows it for ztunnel `pid`.
    pub(super) fn view(&self, pid: i32) -> CheckView {
        if self.cfg.mode == Mode::Off {
            return CheckView::Off;
        }
        let heard = self.heard.lock().unwrap().get(&pid).cloned();
        match heard {
            None => CheckView::NotAsked,
            Some(h) => match (h.failing_since, h.fallback) {
                (None, _) => CheckView::Answering,
                (Some(_), false) => CheckView::Failing {
                    error: h.last_error.unwrap_or_default(),
                },
                (Some(_), true) => CheckView::AcksCountAsServed {
                    error: h.last_error.unwrap_or_default(),
                },
            },
        }
    }

    /// How many ztunnels' acks count as served for want of an answer.
    pub(super) fn fallbacks(&self) -> usize {
        self.heard
            .lock()
            .unwrap()
            .values()
            .filter(|h| h.fallback)
            .count()
    }

    /// What ztunnel `pid` says of `wanted`: `Some(known)`, or `None` when it
    /// did not answer and its acks do not count yet.
    fn ask(&self, pid: Option<i32>, wanted: &[Wanted]) -> Answer {
        if self.cfg.mode == Mode::Off {
            return Answer::AcksCount;
        }
        let key = pid.unwrap_or(0);
        let out = fetch::known(pid, self.cfg.admin_port, wanted, self.node.as_deref());
        self.metrics.served_check(out.is_ok());
        let mut heard = self.heard.lock().unwrap();
        let h = heard.entry(key).or_default();
        let now = Instant::now();
        let in_a_row = h.last_ask.is_some_and(|t| now - t <= IN_A_ROW);
        h.last_ask = Some(now);
        match out {
            Ok(known) => {
                if h.failing_since.take().is_some() {
                    info!(
                        pid = key,
                        "ztunnel's admin API answers: checking served pods again"
                    );
                }
                h.failures = 0;
                h.last_error = None;
                h.fallback = false;
                Answer::Known(known)
            }
            Err(e) => {
                let why = crate::error_line(&e);
                // Failures far apart (a recheck now and then) do not add
                // up; once in fallback, only an answer ends it.
                if !in_a_row && !h.fallback {
                    h.failing_since = None;
                    h.failures = 0;
                }
                let since = *h.failing_since.get_or_insert(now);
                h.failures += 1;
                if h.last_error.as_deref() != Some(why.as_str()) {
                    warn!(pid = key, error = %why, "cannot read ztunnel's workloads");
                }
                h.last_error = Some(why);
                // Without a pid nothing will ever answer: no reason to wait.
                let fallback = h.fallback
                    || pid.is_none()
                    || h.failures >= FALLBACK_FAILURES && now - since >= FALLBACK_AFTER;
                if fallback && !h.fallback {
                    warn!(
                        pid = key,
                        "counting ztunnel's acks as served (its admin API does not answer)"
                    );
                }
                h.fallback = fallback;
                if fallback {
                    Answer::AcksCount
                } else {
                    Answer::Unknown
                }
            }
        }
    }

    /// Forgets ztunnels that are gone (their pids may be reused).
    fn keep_only(&self, pids: &[i32]) {
        self.heard.lock().unwrap().retain(|p, _| pids.contains(p));
    }
}

enum Answer {
    Known(Known),
    /// Served means acked (check off, or the admin API silent too long).
    AcksCount,
    /// No answer yet: decide nothing.
    Unknown,
}

/// A pod the pass asks about.
struct Candidate {
    cookie: u64,
    uid: String,
    state: PodState,
    want: Wanted,
}

impl ServedChecker {
    /// Runs the served check on `book`'s pods until `stop`.
    pub(super) async fn run(self: Arc<Self>, book: Arc<PodBook>, mut stop: watch::Receiver<bool>) {
        let mut every = WAIT_MIN;
        let mut rechecked = Instant::now();
        let mut recheck_every = self.cfg.recheck;
        self.metrics.set_served_recheck(recheck_every);
        loop {
            tokio::select! {
                _ = stop.changed() => return,
                _ = self.wake.notified() => every = WAIT_MIN,
                _ = tokio::time::sleep(every) => {},
            }
            let recheck = rechecked.elapsed() >= recheck_every
                || self
                    .recheck
                    .swap(false, std::sync::atomic::Ordering::Relaxed);
            let (this, book) = (self.clone(), book.clone());
            let Ok((waiting, read)) =
                tokio::task::spawn_blocking(move || this.pass(&book, recheck)).await
            else {
                continue;
            };
            if recheck {
                rechecked = Instant::now();
                let next = recheck_period(self.cfg.recheck, read);
                if next != recheck_every {
                    info!(
                        every = ?next,
                        read = ?read,
                        "served pods are checked again at this period (each recheck reads ztunnel's whole config_dump)"
                    );
                    recheck_every = next;
                    self.metrics.set_served_recheck(next);
                }
            }
            every = if waiting {
                (every * 2).min(WAIT_MAX)
            } else {
                recheck_every
                    .saturating_sub(rechecked.elapsed())
                    .max(WAIT_MIN)
            };
        }
    }

    /// One pass: asks each ztunnel about its Enabled pods (and, on `recheck`,
    /// its Served ones) and moves them. Blocking. Returns whether some pod
    /// still waits to be served, and how long the reads of ztunnels' dumps
    /// took.
    fn pass(&self, book: &PodBook, recheck: bool) -> (bool, Duration) {
        let mut by_ztunnel: BTreeMap<Ztunnel, Vec<Candidate>> = BTreeMap::new();
        {
            let dp = book.dataplane();
            let mut addrs = dp.maps().addrs_by_pod();
            for p in book.pods().staying() {
                let Some(state) = dp.maps().entry(p.cookie).and_then(|e| e.state()) else {
                    continue;
                };
                if !(state == PodState::Enabled || recheck && state == PodState::Served) {
                    continue;
                }
                // Not acked since this agent started (adopted): its
                // ztunnel's snapshot add decides.
                let Some(ztunnel) = p.track.ztunnel else {
                    continue;
                };
                let ips = addrs
                    .remove(&p.cookie)
                    .unwrap_or_default()
                    .iter()
                    .map(addr_of)
                    .filter(routable)
                    .collect();
                let w = &p.identity.workload;
                by_ztunnel.entry(ztunnel).or_default().push(Candidate {
                    cookie: p.cookie,
                    uid: p.identity.uid.clone(),
                    state,
                    want: Wanted {
                        namespace: w.namespace.clone(),
                        name: w.name.clone(),
                        service_account: w.service_account.clone(),
                        ips,
                    },
                });
            }
        }
        let live: Vec<i32> = self.hub.all().iter().filter_map(|c| c.pid).collect();
        self.keep_only(&live);
        let mut read = Duration::ZERO;
        let mut waiting = false;
        for (ztunnel, pods) in by_ztunnel {
            let wanted: Vec<Wanted> = pods.iter().map(|c| c.want.clone()).collect();
            let started = Instant::now();
            let answer = self.ask(ztunnel.pid(), &wanted);
            read += started.elapsed();
            let mut dp = book.dataplane();
            for c in pods {
                // Another ztunnel acked the pod while this one was asked:
                // its answer says nothing about the pod now.
                if book.pods().ztunnel_of(&c.uid) != Some(ztunnel) {
                    waiting |= c.state == PodState::Enabled;
                    continue;
                }
                let served = match &answer {
                    Answer::Known(k) => {
                        k.contains(&(c.want.namespace.clone(), c.want.name.clone()))
                    }
                    Answer::AcksCount => true,
                    Answer::Unknown => {
                        waiting |= c.state == PodState::Enabled;
                        continue;
                    }
                };
                let span = info_span!("pod", uid = %c.uid, pod = %book.pod_name(&c.uid), cookie = c.cookie);
                let _e = span.enter();
                let event = match (c.state, served) {
                    (PodState::Enabled, true) => Event::ServedFound,
                    (PodState::Served, false) => Event::WorkloadLost,
                    (PodState::Enabled, false) => {
                        waiting = true;
                        continue;
                    }
                    _ => continue,
                };
                let entry = dp.maps().entry(c.cookie);
                // The machine leaves a pod that changed since it was read as
                // it is: the answer was about the pod as it was.
                let now = dp.maps_mut().apply(c.cookie, event, boottime_ns());
                let changed = now.map(|s| s != entry.and_then(|e| e.state()));
                match changed {
                    Ok(true) if c.state == PodState::Enabled => {
                        if let Some(e) = entry {
                            // Since it turned Enabled (acked): the wait for xDS.
                            let waited = boottime_ns().saturating_sub(e.changed_at_ns);
                            self.metrics.time_to_served(Duration::from_nanos(waited));
                        }
                        if matches!(answer, Answer::AcksCount) {
                            info!("served (ztunnel's ack counts: its workloads cannot be read)");
                        } else {
                            info!("ztunnel knows the pod's workload: served");
                        }
                    }
                    Ok(true) => {
                        warn!("ztunnel no longer knows the pod's workload: not served");
                        waiting = true;
                    }
                    Ok(false) => {}
                    Err(e) => warn!(error = %e, "could not record the served check"),
                }
            }
        }
        self.metrics.set_served_fallbacks(self.fallbacks());
        (waiting, read)
    }
}

/// When served pods are checked again after a recheck whose reads took
/// `read`: at the configured period, or, when that would take more than
/// 1/`RECHECK_SHARE` of a core (a read keeping `READ_CORES` busy), as much
/// later as keeps it within that (rounded up to whole seconds, so that the
/// period does not move at every recheck), up to `RECHECK_MAX`.
pub fn recheck_period(configured: Duration, read: Duration) -> Duration {
    let within =
        Duration::from_secs((read * RECHECK_SHARE * READ_CORES).as_secs_f64().ceil() as u64);
    configured.max(within.min(RECHECK_MAX))
}

/// Addresses istiod can list for a pod (not link-local, not loopback).
fn routable(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => !v4.is_link_local() && !v4.is_loopback(),
        IpAddr::V6(v6) => !v6.is_unicast_link_local() && !v6.is_loopback(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recheck_waits_longer_when_it_would_cost_more_than_its_share() {
        let ms = Duration::from_millis;
        let s = Duration::from_secs;
        // A small mesh: as configured.
        assert_eq!(recheck_period(s(30), ms(15)), s(30));
        // 10k workloads (a read ≈ 104 ms): every 208 s.
        assert_eq!(recheck_period(s(30), ms(104)), s(208));
        // 100k workloads (≈ 1.1 s): every 37 minutes.
        assert_eq!(recheck_period(s(30), ms(1100)), s(2200));
        // Never past an hour, never below what was asked for.
        assert_eq!(recheck_period(s(30), s(5)), s(3600));
        assert_eq!(recheck_period(s(1500), ms(1)), s(1500));
    }
}

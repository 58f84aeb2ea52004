//! One run's world: the node, its live pods with their traffic, and what
//! watches them. Pods come and go only through here, so the ledger and the
//! checks always know which addresses belong to an enrolled pod.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use sluice_tests::inspect::Hook;

use crate::{
    check::{self, Resources, Watch},
    ledger::{Ledger, PodEntry},
    node::{Node, Pod},
    traffic::Traffic,
};

/// How long the kubelet's retries of a pod's ADD or DEL may take before the
/// run calls it stuck.
pub const CNI_BOUND: Duration = Duration::from_secs(30);
/// How often a failed ADD or DEL is tried again.
const CNI_RETRY: Duration = Duration::from_millis(300);

/// A pod whose ADD or DEL the kubelet is still retrying: the run goes on
/// meanwhile (the fault that fails it is ended by a later event).
struct Retrying {
    pod: Pod,
    since: Instant,
    last: Option<Instant>,
}

impl Retrying {
    fn new(pod: Pod) -> Self {
        Self {
            pod,
            since: Instant::now(),
            last: None,
        }
    }

    fn due(&self) -> bool {
        self.last.is_none_or(|l| l.elapsed() >= CNI_RETRY)
    }
}

pub struct Live {
    pub pod: Pod,
    /// `None` once the run's traffic stopped.
    traffic: Option<Traffic>,
}

pub struct Run {
    pub node: Node,
    pub pods: Vec<Live>,
    pub ledger: Arc<Ledger>,
    pub watch: Watch,
    /// A pinned program that passes everything (the tamper faults' own).
    pub pass_pin: std::path::PathBuf,
    checker: Option<std::thread::JoinHandle<Resources>>,
    adding: Vec<Retrying>,
    deleting: Vec<Retrying>,
}

impl Run {
    /// `local_route`: the agent puts pods' TCP on the local route.
    pub fn start(initial_pods: usize, local_route: bool) -> anyhow::Result<Self> {
        let node = Node::start(local_route)?;
        let ledger = Arc::new(Ledger::new());
        let watch = check::Traffic::start(&node.remote_ns, node.pins.clone())?;
        let pass_pin = node.pins.root().with_file_name(format!(
            "{}-pass",
            node.pins
                .root()
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
        ));
        sluice_tests::inspect::pin_pass_program(&pass_pin)?;
        let mut run = Self {
            node,
            pods: Vec::new(),
            ledger,
            watch,
            pass_pin,
            checker: None,
            adding: Vec::new(),
            deleting: Vec::new(),
        };
        for _ in 0..initial_pods {
            run.add_pod()?;
        }
        run.settle_cni();
        anyhow::ensure!(
            run.pods.len() == initial_pods,
            "the first pods did not enroll: {:?}",
            run.ledger.violations()
        );
        run.checker = Some(check::start(
            run.ledger.clone(),
            run.watch.clone(),
            run.node.pins.clone(),
            run.node.agent.control.clone(),
            run.node.agent_pid.clone(),
        ));
        Ok(run)
    }

    /// A new pod: its sandbox, then sluice's ADD, tried now and retried
    /// while it fails; its traffic starts once the ADD succeeds.
    pub fn add_pod(&mut self) -> anyhow::Result<()> {
        let pod = self.node.sandbox()?;
        self.adding.push(Retrying::new(pod));
        self.retry();
        Ok(())
    }

    fn enrolled(&mut self, pod: Pod) {
        self.ledger
            .enrolled(&pod.uid, PodEntry::new(pod.netns.clone(), pod.ips.clone()));
        self.watch
            .lock()
            .unwrap()
            .watch(&pod.uid, pod.app.seen.clone());
        let traffic = Traffic::start(&self.ledger, &pod, &self.node.remote_ns);
        self.pods.push(Live {
            pod,
            traffic: Some(traffic),
        });
    }

    /// One more ADD or DEL for every pod the kubelet is retrying (each
    /// every [`CNI_RETRY`]); one still failing after [`CNI_BOUND`] is a
    /// violation, and its sandbox is removed.
    pub fn retry(&mut self) {
        // A call the runner gave up on (the agent is not answering) ends
        // the pass: the others would wait as long, and the schedule with
        // them.
        let mut stalled = false;
        for mut r in std::mem::take(&mut self.adding) {
            if stalled || !r.due() {
                self.adding.push(r);
                continue;
            }
            r.last = Some(Instant::now());
            let outcome = self.node.add(&r.pod);
            stalled = gave_up(&outcome);
            match outcome {
                Ok(add) if add.ok => self.enrolled(r.pod),
                outcome if r.since.elapsed() > CNI_BOUND => {
                    self.stuck(&r.pod, "ADD", outcome);
                    self.node.remove_pod(r.pod);
                }
                _ => self.adding.push(r),
            }
        }
        for mut r in std::mem::take(&mut self.deleting) {
            if stalled || !r.due() {
                self.deleting.push(r);
                continue;
            }
            r.last = Some(Instant::now());
            let outcome = self.node.del(&r.pod, &r.pod.container);
            stalled = gave_up(&outcome);
            match outcome {
                Ok(del) if del.ok => self.node.remove_pod(r.pod),
                outcome if r.since.elapsed() > CNI_BOUND => {
                    self.stuck(&r.pod, "DEL", outcome);
                    self.node.remove_pod(r.pod);
                }
                _ => self.deleting.push(r),
            }
        }
    }

    fn stuck(&self, pod: &Pod, what: &str, outcome: anyhow::Result<sluice_tests::cni::Invocation>) {
        let said = match outcome {
            Ok(inv) => inv.stdout,
            Err(e) => format!("{e:#}"),
        };
        self.ledger.violate(
            "bounded",
            Some(&pod.uid),
            format!("sluice-cni {what} still failing after {CNI_BOUND:?}: {said}"),
        );
    }

    /// Retries until no ADD or DEL is outstanding (each is bounded).
    pub fn settle_cni(&mut self) {
        while !self.adding.is_empty() || !self.deleting.is_empty() {
            self.retry();
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The live pod `slot` picks.
    pub fn pick(&self, slot: usize) -> Option<usize> {
        (!self.pods.is_empty()).then(|| slot % self.pods.len())
    }

    /// The pod's traffic stopped and checked, then its teardown; with
    /// `storm`, that many DELs at once first.
    pub fn delete_pod(&mut self, index: usize, storm: usize) -> anyhow::Result<()> {
        let mut live = self.pods.remove(index);
        if let Some(t) = live.traffic.take() {
            t.stop();
        }
        let uid = live.pod.uid.clone();
        {
            let mut w = self.watch.lock().unwrap();
            w.check(&self.ledger);
            w.unwatch(&uid);
        }
        self.ledger.gone(&uid);
        if storm > 0 {
            let node = &self.node;
            let pod = &live.pod;
            std::thread::scope(|s| {
                for _ in 0..storm {
                    s.spawn(|| node.del(pod, &pod.container));
                }
            });
        }
        self.deleting.push(Retrying::new(live.pod));
        self.retry();
        Ok(())
    }

    /// The pod's eth0 hook in `dir`, for the tamper faults.
    pub fn hook(&self, index: usize, dir: &'static str) -> Hook<'_> {
        Hook {
            ns: &self.pods[index].pod.netns,
            dev: "eth0",
            dir,
        }
    }

    /// Every pod's traffic and the checker stopped, what they saw checked a
    /// last time.
    pub fn stop_traffic(&mut self) -> Resources {
        self.ledger.stop();
        let res = self
            .checker
            .take()
            .and_then(|c| c.join().ok())
            .unwrap_or_default();
        for live in &mut self.pods {
            if let Some(t) = live.traffic.take() {
                t.stop();
            }
        }
        self.watch.lock().unwrap().check(&self.ledger);
        res
    }

    /// Every pod deleted as the runtime deletes it (a DEL failing past the
    /// bound is a violation).
    pub fn delete_all(&mut self) -> anyhow::Result<()> {
        self.settle_cni();
        while !self.pods.is_empty() {
            self.delete_pod(0, 0)?;
        }
        self.settle_cni();
        Ok(())
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        self.ledger.stop();
        for mut live in std::mem::take(&mut self.pods) {
            if let Some(t) = live.traffic.take() {
                t.stop();
            }
            let _ = self.node.del(&live.pod, &live.pod.container);
            self.node.remove_pod(live.pod);
        }
        for r in std::mem::take(&mut self.adding)
            .into_iter()
            .chain(std::mem::take(&mut self.deleting))
        {
            let _ = self.node.del(&r.pod, &r.pod.container);
            self.node.remove_pod(r.pod);
        }
        if let Some(c) = self.checker.take() {
            let _ = c.join();
        }
        let _ = std::fs::remove_file(&self.pass_pin);
    }
}

/// Whether the runner gave up on a `sluice-cni` call (see `CNI_CALL_BOUND`).
fn gave_up(outcome: &anyhow::Result<sluice_tests::cni::Invocation>) -> bool {
    outcome.as_ref().is_ok_and(|inv| inv.timed_out)
}

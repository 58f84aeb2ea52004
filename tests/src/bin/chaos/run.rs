//! One run's world: the node, its live pods with their traffic, and what
//! watches them. Pods come and go only through here, so the ledger and the
//! checks always know which addresses belong to an enrolled pod.

use std::{sync::Arc, time::Duration};

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
}

impl Run {
    pub fn start(initial_pods: usize) -> anyhow::Result<Self> {
        let node = Node::start()?;
        let ledger = Arc::new(Ledger::new());
        let watch = check::Traffic::start(&node.remote_ns)?;
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
        };
        for _ in 0..initial_pods {
            run.add_pod()?;
        }
        run.checker = Some(check::start(
            run.ledger.clone(),
            run.watch.clone(),
            run.node.pins.clone(),
            run.node.agent_pid.clone(),
        ));
        Ok(run)
    }

    /// A new pod, enrolled, its traffic running.
    pub fn add_pod(&mut self) -> anyhow::Result<()> {
        let pod = self.node.add_pod(CNI_BOUND)?;
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
        Ok(())
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
        self.node.delete_pod(live.pod, CNI_BOUND)
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

    /// Every pod deleted as the runtime deletes it; the first failure.
    pub fn delete_all(&mut self) -> anyhow::Result<()> {
        let mut first = Ok(());
        while !self.pods.is_empty() {
            let r = self.delete_pod(0, 0);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        self.ledger.stop();
        for mut live in std::mem::take(&mut self.pods) {
            if let Some(t) = live.traffic.take() {
                t.stop();
            }
            let _ = self.node.delete_pod(live.pod, Duration::from_secs(5));
        }
        if let Some(c) = self.checker.take() {
            let _ = c.join();
        }
        let _ = std::fs::remove_file(&self.pass_pin);
    }
}

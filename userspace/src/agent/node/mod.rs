//! The agent's node: the roles that hold this node's pods, each a type of
//! its own behind a narrow handle, wired here and nowhere else. The pods'
//! state lives in the pinned pod-state map, never only in memory.
//!
//! - `pods`: the pod table, one record per pod the agent holds;
//! - `book`: the dataplane behind its lock, beside the pod table: what every
//!   role reads and changes a pod through;
//! - `effects`: what each step of a pod's lifecycle asks of the other roles,
//!   run as the pinned map takes the step;
//! - `announce`: telling Kubernetes (annotations, readiness gates, Events);
//! - `served_check`: whether ztunnel knows the workloads of the pods it acked;
//! - `ztunnels`: the ZDS connections: adds, answers, listener registration
//!   and custody, the ZDS server's `Handler`;
//! - `repair`: verifying and completing every pod's capture;
//! - `verify_queue`: pods due for a verification of their capture;
//!   `retries`: when one its last verification left unsettled is due again;
//! - `supervise`: listeners gone → Pending, retries with backoff;
//! - `linkwatch`: interfaces a pod gains, captured as the kernel announces
//!   them, and changes at a pod's hooks, repaired at once (`hostwatch`: the
//!   host side's);
//! - `rtevents`: the rtnetlink event sockets both watches open;
//! - `enroller`: taking a pod in and letting it go, whoever asks;
//! - `relist`: reconciling with the Kubernetes API;
//! - `uninstall`: removing sluice from the node;
//! - `requests`: the control socket's requests.

use std::{future::Future, sync::Arc, time::Duration};

use tokio::sync::watch;

use super::{
    cluster::KubeCtx,
    custody::Custody,
    report::{self, Report},
};
use crate::{
    cni::install::CniInstall,
    dataplane::loader::Dataplane,
    metrics::Metrics,
    readiness,
    zds::server::{Handler, Hub},
};

mod announce;
mod book;
mod effects;
mod enroller;
mod exclusions;
mod hostwatch;
mod linkwatch;
mod pace;
mod pinwatch;
mod pods;
mod relist;
mod repair;
mod requests;
mod retries;
mod rtevents;
mod served_check;
mod supervise;
mod uninstall;
mod verify_queue;
mod ztunnels;

pub use relist::Relist;
pub use repair::{Repairer, FULL_PASS_EVERY};
pub use requests::Requests;
pub use served_check::{recheck_period, ServedConfig, DEFAULT_RECHECK, FALLBACK_AFTER};
pub use uninstall::{Uninstall, Uninstaller};

use announce::Announcer;
use book::{MapSource, PodBook};
use effects::EffectRunner;
use enroller::Enroller;
use linkwatch::LinkWatch;
use pods::PodTable;
use served_check::ServedChecker;
use supervise::Supervisor;
use ztunnels::Ztunnels;

/// How long the node's roles wait for what.
#[derive(Debug, Clone, Copy)]
pub struct Periods {
    /// How long the listeners of a ztunnel that died keep connections
    /// queued on them for the next ztunnel (see `custody`).
    pub orphan_grace: Duration,
    /// How often every pod's capture is verified, whatever else happens
    /// (`--verify-every`).
    pub verify_every: Duration,
}

impl Default for Periods {
    fn default() -> Self {
        Self {
            orphan_grace: Duration::from_secs(30),
            verify_every: repair::VERIFY_EVERY,
        }
    }
}

/// The node agent's roles, wired.
pub struct NodeAgent {
    book: Arc<PodBook>,
    report: Arc<Report>,
    announcer: Arc<Announcer>,
    served: Arc<ServedChecker>,
    ztunnels: Arc<Ztunnels>,
    repair: Arc<Repairer>,
    supervisor: Arc<Supervisor>,
    links: Arc<LinkWatch>,
    relist: Arc<Relist>,
    requests: Arc<Requests>,
    uninstall: Arc<Uninstaller>,
}

impl NodeAgent {
    /// `kube`: present when the agent runs in a cluster. `condition_type`:
    /// the node condition's type, as `status` reports it.
    pub fn new(
        dp: Dataplane,
        hub: Arc<Hub>,
        kube: Option<KubeCtx>,
        condition_type: &str,
        served: ServedConfig,
        periods: Periods,
    ) -> Arc<Self> {
        let pods = Arc::new(PodTable::default());
        let book = Arc::new(PodBook::new(dp, pods.clone()));
        let metrics = Arc::new(Metrics::new(Arc::new(MapSource(Arc::downgrade(&book)))));
        let report = Arc::new(Report::new(metrics.clone(), condition_type));
        let custody = Arc::new(Custody::new(periods.orphan_grace));
        let announcer = Arc::new(Announcer::new(kube.clone(), pods.clone()));
        let node_name = kube.as_ref().map(|k| k.node.clone());
        let served = Arc::new(ServedChecker::new(
            served,
            node_name,
            hub.clone(),
            metrics.clone(),
        ));
        let queue = Arc::new(verify_queue::VerifyQueue::default());
        book.observe(
            EffectRunner {
                pods,
                announcer: announcer.clone(),
                served: served.clone(),
                custody: custody.clone(),
                metrics: metrics.clone(),
                verify: queue.clone(),
            }
            .observer(),
        );
        let ztunnels = Ztunnels::new(
            hub,
            custody.clone(),
            book.clone(),
            announcer.clone(),
            metrics.clone(),
        );
        let repair = Arc::new(Repairer {
            book: book.clone(),
            announcer: announcer.clone(),
            metrics: metrics.clone(),
            queue,
            every: periods.verify_every,
            custody: custody.clone(),
            retries: Default::default(),
            passes: Default::default(),
        });
        let enroller = Arc::new(Enroller {
            book: book.clone(),
            ztunnels: ztunnels.clone(),
            announcer: announcer.clone(),
            metrics: metrics.clone(),
        });
        let relist = Arc::new(Relist::new(
            kube.clone(),
            book.clone(),
            enroller.clone(),
            announcer.clone(),
            metrics,
        ));
        let links = Arc::new(LinkWatch::new(
            book.clone(),
            repair.clone(),
            announcer.clone(),
        ));
        let uninstall = Arc::new(Uninstaller::new(
            kube.clone(),
            book.clone(),
            custody,
            report.clone(),
        ));
        Arc::new(Self {
            supervisor: Arc::new(Supervisor {
                book: book.clone(),
                ztunnels: ztunnels.clone(),
                repair: repair.clone(),
            }),
            requests: Arc::new(Requests {
                kube,
                book: book.clone(),
                enroller,
                ztunnels: ztunnels.clone(),
                served: served.clone(),
                relist: relist.clone(),
                links: links.clone(),
                uninstall: uninstall.clone(),
                report: report.clone(),
            }),
            book,
            report,
            announcer,
            served,
            ztunnels,
            repair,
            links,
            relist,
            uninstall,
        })
    }

    /// The control socket's requests.
    pub fn requests(&self) -> &Arc<Requests> {
        &self.requests
    }

    /// What the ZDS server tells the node (connections, snapshots, answers).
    pub fn zds_handler(&self) -> Arc<dyn Handler> {
        self.ztunnels.clone()
    }

    /// The ZDS connections this node's adds go to.
    pub fn hub(&self) -> Arc<Hub> {
        self.ztunnels.hub().clone()
    }

    pub fn report(&self) -> &Arc<Report> {
        &self.report
    }

    /// Verifying every pod's capture (at start, before anything is served).
    pub fn repair(&self) -> &Arc<Repairer> {
        &self.repair
    }

    /// Reconciling with the API (a pass at start, in tests).
    pub fn relist(&self) -> &Arc<Relist> {
        &self.relist
    }

    pub fn uninstall(&self) -> &Arc<Uninstaller> {
        &self.uninstall
    }

    pub fn pod_count(&self) -> usize {
        self.book.pod_count()
    }

    // The node's tasks, each until `stop`.

    /// Supervision and retries (see `supervise`).
    pub fn supervise(&self, stop: watch::Receiver<bool>) -> impl Future<Output = ()> + Send {
        self.supervisor.clone().run(stop)
    }

    /// Writes the pods' annotations and readiness gates (see `announce`).
    pub fn announce(&self, stop: watch::Receiver<bool>) -> impl Future<Output = ()> + Send {
        self.announcer.clone().run(self.book.clone(), stop)
    }

    /// The served check (see `served_check`).
    pub fn check_served(&self, stop: watch::Receiver<bool>) -> impl Future<Output = ()> + Send {
        self.served.clone().run(self.book.clone(), stop)
    }

    /// Verifying the capture of pods whose listeners were registered (see
    /// `repair`).
    pub fn verify_queued(&self, stop: watch::Receiver<bool>) -> impl Future<Output = ()> + Send {
        self.repair.clone().run(stop)
    }

    /// The pods' link events (see `linkwatch`).
    pub fn watch_links(&self, stop: watch::Receiver<bool>) -> impl Future<Output = ()> + Send {
        self.links.clone().run(stop)
    }

    /// Reconciling with the API's watch (see `relist`).
    pub fn relist_with_api(&self, stop: watch::Receiver<bool>) -> impl Future<Output = ()> + Send {
        self.relist.clone().run(stop)
    }
}

impl report::Inputs for NodeAgent {
    fn ztunnel_connected(&self) -> bool {
        self.ztunnels.hub().is_connected()
    }

    fn readiness_inputs(
        &self,
        cni: Option<&CniInstall>,
        pending_grace: Duration,
    ) -> readiness::Inputs {
        self.book
            .readiness_inputs(cni, pending_grace, self.ztunnels.hub())
    }
}

//! `sluice agent`: the node agent. Owns enrollment on the node, serves ZDS to
//! ztunnel, and keeps each pod's state in the pinned pod-state map (never only
//! in memory). It reports the node's readiness (`report`) and serves
//! metrics (`admin`). On SIGTERM it marks the node not ready, stops serving
//! and leaves capture in place — unless sluice is being uninstalled (its
//! DaemonSet marked, being deleted or gone, or `sluice uninstall`): then it
//! removes sluice from the node first (`node::Uninstaller`).
//!
//! `serve` reads top-down as the agent's life: open the dataplane, build the
//! node's roles (`node::NodeAgent`), verify the pods an earlier agent left,
//! bind the listeners, start the tasks, run until stopped, stop the tasks in
//! three waves (`Stops`). Beside it: `config` (what the agent is told),
//! `cluster` (its Kubernetes side), `daemonset` (the uninstall mark),
//! `incompatible` (holding a dataplane it cannot take over).

pub mod admin;
pub mod cluster;
pub mod config;
pub mod control_socket;
pub mod custody;
pub mod daemonset;
pub mod held_uninstall;
pub mod hold;
pub mod incompatible;
pub mod node;
pub mod report;
pub mod rival;

use std::sync::Arc;

use anyhow::Context as _;
use tokio::{
    signal::unix::{signal, Signal, SignalKind},
    sync::watch,
    task::JoinHandle,
};
use tracing::{info, warn};

pub use config::{Config, DEFAULT_HEALTH_ADDR, DEFAULT_METRICS_ADDR, DEFAULT_ZDS_SOCKET};

use crate::{
    dataplane::loader::{Adoption, Dataplane, LoadError},
    kube::uninstall::Reason,
    podnet::hostside,
    zds::server::{self, Hub},
};
use cluster::KubeCtx;
use daemonset::{DaemonSetMark, Moment};
use node::{NodeAgent, Uninstall};

/// The agent holds a descriptor per pod netns and per ztunnel listener it
/// registered (three per pod): lift the soft open-files limit to the hard one
/// so a full node does not run out at the common 1024.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(soft, hard, error = %e, "could not raise the open-files limit");
            }
        }
    }
}

pub fn run(cfg: Config) -> anyhow::Result<()> {
    raise_fd_limit();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    rt.block_on(serve(cfg))
}

async fn serve(cfg: Config) -> anyhow::Result<()> {
    // First: a SIGTERM that comes during startup (its sockets already bound,
    // its tasks not yet running) is kept for `until_stopped` rather than
    // killing the process midway (the signal's default action).
    let mut term = signal(SignalKind::terminate())?;
    if !cfg.take_over_node_agent && !rival::wait_until_gone(&cfg, &mut term).await? {
        return Ok(());
    }
    let node_netns = cfg.open_node_netns()?;
    let mut dp = match Dataplane::load_adopt_or_upgrade(cfg.pins.clone(), node_netns.as_ref()) {
        Ok(dp) => dp,
        Err(LoadError::Incompatible(why)) => return incompatible::hold(cfg, why, &mut term).await,
        Err(e) => return Err(e).context("loading the dataplane"),
    };
    set_up_dataplane(&mut dp, node_netns, &cfg);
    let kube = cluster_context(&cfg).await?;
    let node = build_node(&cfg, dp, kube.clone());
    verify_pods_left(&node).await?;
    let listeners = Listeners::bind(&cfg).await?;
    let stops = Stops::default();
    let client = kube.as_ref().map(|k| k.client.clone());
    let mark = client
        .clone()
        .zip(cfg.daemonset.clone())
        .map(|(c, ds)| DaemonSetMark::new(c, ds));
    // An agent started after the uninstall mark (a restart midway) finishes it.
    if let Some(m) = &mark {
        m.check(Moment::Start, node.uninstall()).await;
    }
    let mut tasks = Tasks::start(&cfg, &node, kube.as_ref(), mark.as_ref(), listeners, &stops);
    info!(pods = node.pod_count(), "sluice agent running");
    let signalled = until_stopped(&node, mark.as_deref(), &mut term).await;
    tasks.stop_serving(&stops).await;
    if let Uninstall::Started(r) = node.uninstall().state() {
        let mut asked = node.uninstall().watch();
        loop {
            node.uninstall().run(cfg.cni.as_ref(), r).await;
            if signalled {
                break;
            }
            // Exiting would only have the DaemonSet start the agent again,
            // unless the mark it acted on is cleared (an uninstall that
            // failed or was cancelled, then a `helm upgrade`). One that
            // failed runs again when asked again (`sluice uninstall`).
            info!("sluice removed from this node; waiting to be stopped");
            let marked = (r == Reason::Requested)
                .then(|| cfg.daemonset.clone())
                .flatten();
            asked.mark_unchanged();
            tokio::select! {
                _ = term.recv() => info!("SIGTERM"),
                _ = tokio::signal::ctrl_c() => info!("SIGINT"),
                _ = daemonset::until_unmarked(client.clone(), marked) => info!(
                    "the DaemonSet's uninstall mark was cleared: exiting, so that the agent starts again and installs sluice"
                ),
                _ = asked.wait_for(|u| matches!(u, Uninstall::Started(_))) => {
                    info!("uninstall asked again");
                    continue;
                }
            }
            break;
        }
    }
    tasks.stop_listening(&stops).await;
    match node.uninstall().state() {
        Uninstall::No => info!("agent stopped; capture stays in place (pins kept)"),
        u => info!(uninstall = %u, "agent stopped"),
    }
    Ok(())
}

/// Sets the loaded dataplane up for this node: its netns, then the DNS
/// capture default and the tc attach mode, before any pod is verified or
/// enrolled (pods enrolled under another default follow this one).
fn set_up_dataplane(dp: &mut Dataplane, node_netns: Option<hostside::Node>, cfg: &Config) {
    dp.maps_mut().set_addr_cap(cfg.max_pod_addresses);
    match &dp.adoption() {
        Adoption::Kept(_) => warn!(dataplane = %dp.adoption(), "dataplane"),
        a => info!(dataplane = %a, "dataplane"),
    }
    if let Some(node) = node_netns {
        if let Some(why) = dp.set_node(node).err() {
            warn!(error = %why, "host-originated probes stay captured");
        }
    }
    info!(probes = %dp.probes(), "kubelet probes");
    match dp.set_dns_capture(cfg.dns_capture) {
        Ok(changed) => info!(
            default = cfg.dns_capture,
            pods_changed = changed,
            "DNS capture"
        ),
        Err(e) => warn!(error = %e, "applying the DNS capture default to enrolled pods"),
    }
    let tc_attach = dp.set_tc_attach(cfg.tc_attach);
    if tc_attach != cfg.tc_attach {
        warn!(
            wanted = cfg.tc_attach.as_str(),
            used = tc_attach.as_str(),
            "--tc-attach tcx needs tcx (Linux ≥ 6.6), which this kernel lacks: attaching cls_bpf filters"
        );
    } else {
        info!(tc_attach = tc_attach.as_str(), "tc programs attach");
    }
    let local_route = dp.set_local_route(cfg.local_route);
    if cfg.local_route && !local_route {
        warn!("--local-route needs tc programs that can read a packet's netns (Linux ≥ 6.15), which this kernel lacks: pods' TCP keeps their interface's route");
    } else {
        info!(local_route, "pods' TCP route");
    }
    let left = crate::podnet::enroll::leave_local_route(dp);
    if left > 0 {
        info!(
            pods = left,
            "the local route is off: pods on it take their interface's route again"
        );
    }
}

/// The Kubernetes side, when the agent runs on a node (`--node-name`).
async fn cluster_context(cfg: &Config) -> anyhow::Result<Option<KubeCtx>> {
    let Some(node) = &cfg.node_name else {
        return Ok(None);
    };
    Ok(Some(KubeCtx {
        client: cluster::checked_client(node).await?,
        node: node.clone(),
        // Beside the control socket: host tmpfs, survives agent restarts.
        cni_records: cfg.control_socket.parent().map(|d| d.join("cni-pods")),
        selection: crate::kube::selection::Selection {
            excluded: cfg.excluded.clone(),
            enablement: cfg.enablement.clone(),
            exclusions: cfg.exclusions.clone(),
        },
        selection_file: Some(crate::cni::snapshot::path_for(&cfg.control_socket)),
    }))
}

/// The node's roles over the dataplane, with the build in the metrics.
fn build_node(cfg: &Config, dp: Dataplane, kube: Option<KubeCtx>) -> Arc<NodeAgent> {
    let stamp = crate::dataplane::stamp::read(&dp.pins().maps())
        .map_or_else(|| "none".into(), |s| s.to_string());
    let node = NodeAgent::new(
        dp,
        Arc::new(Hub::default()),
        kube,
        &cfg.report.condition_type,
        cfg.served.clone(),
        node::Periods {
            orphan_grace: cfg.orphan_grace,
            verify_every: cfg.verify_every,
        },
    );
    node.report()
        .metrics
        .set_build_info(&crate::dataplane::features::describe(), &stamp);
    node
}

/// Before anything is served: every pod left by an earlier agent is
/// completely captured, or its teardown finished (crash safety).
async fn verify_pods_left(node: &NodeAgent) -> anyhow::Result<()> {
    let repair = node.repair().clone();
    tokio::task::spawn_blocking(move || repair.verify_all(true))
        .await
        .context("verifying the pods' capture")
}

/// Runs until SIGTERM or SIGINT (true) or until an uninstall is asked
/// (false).
async fn until_stopped(node: &NodeAgent, mark: Option<&DaemonSetMark>, term: &mut Signal) -> bool {
    let mut asked = node.uninstall().watch();
    let signalled = tokio::select! {
        _ = term.recv() => { info!("SIGTERM"); true }
        _ = tokio::signal::ctrl_c() => { info!("SIGINT"); true }
        _ = asked.wait_for(|u| *u != Uninstall::No) => false,
    };
    // Stopped without being asked: an uninstall if the DaemonSet is going
    // (`kubectl delete daemonset`), else a restart or an upgrade.
    if signalled && node.uninstall().state() == Uninstall::No {
        if let Some(m) = mark {
            m.check(Moment::Stop, node.uninstall()).await;
        }
    }
    signalled
}

/// The listening sockets, bound before any task starts.
struct Listeners {
    admin: Vec<(tokio::net::TcpListener, admin::Audience)>,
    zds: std::os::fd::OwnedFd,
    control: std::os::unix::net::UnixListener,
}

impl Listeners {
    async fn bind(cfg: &Config) -> anyhow::Result<Self> {
        let mut admin = Vec::new();
        for (addr, audience) in cfg.admin_addrs() {
            let l = admin::bind(addr)
                .await
                .with_context(|| format!("binding the admin address {addr}"))?;
            admin.push((l, audience));
        }
        let zds = server::bind(&cfg.zds_socket)
            .with_context(|| format!("binding the ZDS socket {}", cfg.zds_socket.display()))?;
        let control = control_socket::bind(&cfg.control_socket).with_context(|| {
            format!(
                "binding the control socket {}",
                cfg.control_socket.display()
            )
        })?;
        Ok(Self {
            admin,
            zds,
            control,
        })
    }
}

/// The agent's tasks stop in three waves, each on its own signal.
struct Stops {
    /// The report stops first: the node is marked not ready while
    /// everything else still serves.
    report: watch::Sender<bool>,
    /// Then everything that serves ztunnel and the pods.
    serving: watch::Sender<bool>,
    /// The control and admin listeners stop last: they answer during an
    /// uninstall and after it.
    listening: watch::Sender<bool>,
}

impl Default for Stops {
    fn default() -> Self {
        Self {
            report: watch::Sender::new(false),
            serving: watch::Sender::new(false),
            listening: watch::Sender::new(false),
        }
    }
}

/// The agent's running tasks, by the wave that stops them (see [`Stops`]).
struct Tasks {
    report: JoinHandle<()>,
    serving: Vec<JoinHandle<()>>,
    listening: Vec<JoinHandle<()>>,
}

impl Tasks {
    fn start(
        cfg: &Config,
        node: &Arc<NodeAgent>,
        kube: Option<&KubeCtx>,
        mark: Option<&Arc<DaemonSetMark>>,
        listeners: Listeners,
        stops: &Stops,
    ) -> Self {
        let stop = stops.serving.subscribe();
        let listen_stop = stops.listening.subscribe();
        // As it stands before the control socket takes requests.
        let uninstalling = node.uninstall().state() != Uninstall::No;
        let zds = spawn(server::serve(
            listeners.zds,
            cfg.zds_socket.clone(),
            node.hub(),
            node.zds_handler(),
            stop.clone(),
        ));
        let control = spawn(control_socket::serve(
            listeners.control,
            cfg.control_socket.clone(),
            cfg.pins.root().to_owned(),
            node.requests().clone(),
            listen_stop.clone(),
        ));
        let mut serving = vec![
            zds,
            tokio::spawn(node.supervise(stop.clone())),
            tokio::spawn(node.announce(stop.clone())),
            tokio::spawn(node.check_served(stop.clone())),
            tokio::spawn(node.watch_links(stop.clone())),
            tokio::spawn(node.verify_queued(stop.clone())),
        ];
        let report = tokio::spawn(report::run(
            node.report().clone(),
            node.clone(),
            cfg.cni.clone(),
            cfg.report.clone(),
            kube.map(|k| report::NodeApi {
                client: k.client.clone(),
                node: k.node.clone(),
            }),
            stops.report.subscribe(),
        ));
        let mut listening = vec![control];
        listening.extend(listeners.admin.into_iter().map(|(l, audience)| {
            tokio::spawn(admin::serve(
                l,
                node.report().clone(),
                listen_stop.clone(),
                audience,
            ))
        }));
        serving.extend(in_step_with_cluster(cfg, node, mark, uninstalling, stop));
        Self {
            report,
            serving,
            listening,
        }
    }

    /// Stops the report (the node marked not ready), then everything that
    /// serves ztunnel and the pods.
    async fn stop_serving(&mut self, stops: &Stops) {
        let _ = stops.report.send(true);
        let _ = (&mut self.report).await;
        let _ = stops.serving.send(true);
        for t in self.serving.drain(..) {
            let _ = t.await;
        }
    }

    /// Stops the control and admin listeners.
    async fn stop_listening(self, stops: &Stops) {
        let _ = stops.listening.send(true);
        for t in self.listening {
            let _ = t.await;
        }
    }
}

/// The tasks that keep the node in step with its cluster: the relist, the
/// CNI config, the DaemonSet's uninstall mark (the last two not when
/// `uninstalling`).
fn in_step_with_cluster(
    cfg: &Config,
    node: &NodeAgent,
    mark: Option<&Arc<DaemonSetMark>>,
    uninstalling: bool,
    stop: watch::Receiver<bool>,
) -> Vec<JoinHandle<()>> {
    let mut tasks = vec![tokio::spawn(node.relist_with_api(stop.clone()))];
    // Removing the plugin is not part of stopping: pods must keep going
    // through it while the agent restarts (see `sluice uninstall-cni`).
    if let Some(c) = cfg.cni.clone().filter(|_| !uninstalling) {
        tasks.push(tokio::spawn(c.keep_installed(stop.clone())));
    }
    if let Some(m) = mark.filter(|_| !uninstalling) {
        tasks.push(tokio::spawn(
            m.clone().watch(node.uninstall().clone(), stop),
        ));
    }
    tasks
}

/// Spawns a task whose result nobody reads.
fn spawn<T: Send + 'static>(
    task: impl std::future::Future<Output = T> + Send + 'static,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let _ = task.await;
    })
}

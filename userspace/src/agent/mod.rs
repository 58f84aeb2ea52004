//! `sluice agent`: the node agent. Owns enrollment on the node, serves ZDS to
//! ztunnel, and keeps each pod's state in the pinned pod-state map (never only
//! in memory). It reports the node's readiness (`report`) and serves
//! metrics (`admin`). On SIGTERM it marks the node not ready, stops serving
//! and leaves capture in place — unless sluice is being uninstalled (its
//! DaemonSet marked, being deleted or gone, or `sluice uninstall`): then it
//! removes sluice from the node first (`node::uninstall`).

pub mod admin;
pub mod cluster;
pub mod control_socket;
pub mod custody;
pub mod node;
pub mod report;

use std::{net::SocketAddr, path::PathBuf, sync::Arc};

use anyhow::Context as _;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::{
    cni::install::CniInstall,
    dataplane::loader::{Dataplane, Pins},
    zds::server::{self, Hub},
};

pub const DEFAULT_ZDS_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:15030";
/// The node-only health listener's default (`--health-addr`).
pub const DEFAULT_HEALTH_ADDR: &str = "127.0.0.1:15032";

#[derive(Debug, Clone)]
pub struct Config {
    pub pins: Pins,
    pub zds_socket: PathBuf,
    pub control_socket: PathBuf,
    /// Keep `sluice-cni` in the node's CNI config (DaemonSet mode).
    pub cni: Option<CniInstall>,
    /// The node this agent runs on, when it runs in a cluster: CNI requests
    /// are then admitted against the API and pods annotated.
    pub node_name: Option<String>,
    /// The node condition's type, grace and heartbeat, and startup taints.
    pub report: report::ReportConfig,
    /// Where /metrics, /healthz and /readyz are served (`None`: not served).
    pub metrics_addr: Option<SocketAddr>,
    /// The node-only health listener (`--health-addr`), for the kubelet's
    /// probes and the watchdog.
    pub health_addr: Option<SocketAddr>,
    /// How pods are found served by ztunnel.
    pub served: node::ServedConfig,
    /// How long the listeners of a ztunnel that died keep connections queued
    /// on them for the next ztunnel (see `custody`).
    pub orphan_grace: std::time::Duration,
    /// The agents' DaemonSet (namespace, name), watched for uninstall (with
    /// `node_name`).
    pub daemonset: Option<(String, String)>,
    /// The node's netns, for host-originated probes (`None`: address-only).
    pub node_netns: Option<PathBuf>,
    /// Namespaces whose pods are never captured.
    pub excluded: std::collections::BTreeSet<String>,
    /// The node's DNS capture default (`--dns-capture`).
    pub dns_capture: bool,
    /// How tc programs are attached (`--tc-attach`).
    pub tc_attach: crate::dataplane::features::TcAttach,
}

/// The API client, once `node` is known to name this host (refused when it
/// names another; an API that cannot answer now is not waited for).
async fn checked_client(node: &str) -> anyhow::Result<::kube::Client> {
    let client = ::kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or KUBECONFIG)")?;
    let checked = tokio::time::timeout(
        crate::kube::API_TIMEOUT,
        crate::kube::node_identity::verify(client.clone(), node),
    )
    .await;
    match checked {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(wrong))) => return Err(wrong.into()),
        Ok(Err(e)) => warn!(error = %e, "could not check --node-name against the Node: going on"),
        Err(_) => warn!("checking --node-name against the Node timed out: going on"),
    }
    Ok(client)
}

/// How often the DaemonSet is read for the uninstall mark.
const DAEMONSET_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether the DaemonSet says uninstall; `None` also when it cannot be read
/// (capture stays on a doubt).
async fn uninstall_reason(
    client: &::kube::Client,
    (namespace, name): &(String, String),
) -> Option<crate::kube::uninstall::Reason> {
    let read = tokio::time::timeout(
        crate::kube::API_TIMEOUT,
        crate::kube::uninstall::decide(client.clone(), namespace, name),
    )
    .await;
    match read {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            warn!(daemonset = %name, error = %e, "cannot read the DaemonSet: taken as not uninstalling");
            None
        }
        Err(_) => {
            warn!(daemonset = %name, "reading the DaemonSet timed out: taken as not uninstalling");
            None
        }
    }
}

/// Reads the DaemonSet until it says uninstall, then asks the node.
async fn watch_daemonset(
    client: ::kube::Client,
    ds: (String, String),
    uninstall: Arc<node::Uninstaller>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        if let Some(r) = uninstall_reason(&client, &ds).await {
            info!(why = r.as_str(), "uninstall asked");
            uninstall.request(r);
            return;
        }
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(DAEMONSET_EVERY) => {}
        }
    }
}

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

/// No pods to sample (an agent holding an incompatible dataplane).
struct NoPods;

impl crate::metrics::Source for NoPods {
    fn sample(&self) -> crate::metrics::Sample {
        crate::metrics::Sample::default()
    }
}

/// The pinned dataplane is another build's that this one cannot take over:
/// capture stays exactly as that build left it (its programs keep running),
/// and the agent only reports why — node condition False
/// `DataplaneIncompatible`, `/readyz` 503 with the reason, `/healthz` 200 —
/// until it is stopped, instead of exiting into a restart loop.
async fn hold_incompatible(cfg: Config, why: String) -> anyhow::Result<()> {
    use crate::readiness::{Condition, Reason};
    tracing::error!(%why, "cannot take over the pinned dataplane; reporting only");
    let condition = Condition {
        ready: false,
        reason: Reason::DataplaneIncompatible,
        message: format!(
            "this sluice build cannot take over the dataplane pinned by another build ({why}); that build's capture stays in place, nothing new is enrolled"
        ),
    };
    let report = Arc::new(report::Report::new(
        Arc::new(crate::metrics::Metrics::new(Arc::new(NoPods))),
        &cfg.report.condition_type,
    ));
    report.hold(condition.clone());
    if let Some(node) = &cfg.node_name {
        match ::kube::Client::try_default().await {
            Ok(client) => {
                let w = crate::kube::condition::ConditionWriter::new(
                    client,
                    node,
                    &cfg.report.condition_type,
                    cfg.report.heartbeat,
                );
                if let Err(e) = w.write(&condition).await {
                    warn!(error = %e, "could not write the node condition");
                }
            }
            Err(e) => warn!(error = %e, "no Kubernetes API: the node condition is not written"),
        }
    }
    let (stop_tx, stop) = watch::channel(false);
    let mut admin_tasks = Vec::new();
    for (addr, audience) in admin_addrs(&cfg) {
        let l = admin::bind(addr)
            .await
            .with_context(|| format!("binding the admin address {addr}"))?;
        admin_tasks.push(tokio::spawn(admin::serve(
            l,
            report.clone(),
            stop.clone(),
            audience,
        )));
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
            // Kept fresh, so /healthz does not take it for a stuck loop.
            _ = tokio::time::sleep(std::time::Duration::from_secs(5)) => report.hold(condition.clone()),
        }
    }
    let _ = stop_tx.send(true);
    for t in admin_tasks {
        let _ = t.await;
    }
    Ok(())
}

async fn serve(cfg: Config) -> anyhow::Result<()> {
    let node = match &cfg.node_netns {
        Some(path) => Some(
            crate::podnet::hostside::Node::open(path)
                .with_context(|| format!("--node-netns {}", path.display()))?,
        ),
        None => None,
    };
    let mut dp = match Dataplane::load_adopt_or_upgrade(cfg.pins.clone(), node.as_ref()) {
        Ok(dp) => dp,
        Err(crate::dataplane::loader::LoadError::Incompatible(why)) => {
            return hold_incompatible(cfg, why).await
        }
        Err(e) => return Err(e).context("loading the dataplane"),
    };
    match &dp.adoption {
        crate::dataplane::loader::Adoption::Kept(_) => warn!(dataplane = %dp.adoption, "dataplane"),
        a => info!(dataplane = %a, "dataplane"),
    }
    if let Some(node) = node {
        if let Some(why) = dp.set_node(node).err() {
            warn!(error = %why, "host-originated probes stay captured");
        }
    }
    info!(probes = %dp.probes(), "kubelet probes");
    // Before any pod is verified or enrolled: pods enrolled under another
    // default follow this one.
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
    let hub = Arc::new(Hub::default());
    let kube = match &cfg.node_name {
        Some(node) => Some(cluster::KubeCtx {
            client: checked_client(node).await?,
            node: node.clone(),
            // Beside the control socket: host tmpfs, survives agent restarts.
            cni_records: cfg.control_socket.parent().map(|d| d.join("cni-pods")),
            excluded: cfg.excluded.clone(),
            selection_file: Some(crate::cni::snapshot::path_for(&cfg.control_socket)),
        }),
        None => None,
    };
    let api = kube.as_ref().map(|k| report::NodeApi {
        client: k.client.clone(),
        node: k.node.clone(),
    });
    let stamp = crate::dataplane::stamp::read(&dp.pins.maps())
        .map_or_else(|| "none".into(), |s| s.to_string());
    let kube_client = kube.as_ref().map(|k| k.client.clone());
    let node = node::NodeAgent::new(
        dp,
        hub.clone(),
        kube,
        &cfg.report.condition_type,
        cfg.served.clone(),
        cfg.orphan_grace,
    );
    node.report()
        .metrics
        .set_build_info(&crate::dataplane::features::describe(), &stamp);
    // Before anything is served: every pod left by an earlier agent is
    // completely captured, or its teardown finished (crash safety).
    {
        let repair = node.repair().clone();
        tokio::task::spawn_blocking(move || repair.verify_all(true))
            .await
            .context("verifying the pods' capture")?;
    }
    let mut admin = Vec::new();
    for (addr, audience) in admin_addrs(&cfg) {
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
    let (stop_tx, stop) = watch::channel(false);
    // The report stops first, on its own signal: the node is marked not
    // ready while everything else still serves.
    let (report_stop_tx, report_stop) = watch::channel(false);
    // The control and admin listeners stop last: they answer during an
    // uninstall and after it.
    let (listen_stop_tx, listen_stop) = watch::channel(false);
    // An agent started after the uninstall mark (a restart midway) finishes it.
    if let (Some(c), Some(ds)) = (&kube_client, &cfg.daemonset) {
        if let Some(r) = uninstall_reason(c, ds).await {
            node.uninstall().request(r);
        }
    }
    let uninstalling = node.uninstall().state() != node::Uninstall::No;

    let zds_task = tokio::spawn(server::serve(
        zds,
        cfg.zds_socket.clone(),
        hub,
        node.zds_handler(),
        stop.clone(),
    ));
    let control_task = tokio::spawn(control_socket::serve(
        control,
        cfg.control_socket.clone(),
        cfg.pins.root().to_owned(),
        node.requests().clone(),
        listen_stop.clone(),
    ));
    let reconcile_task = tokio::spawn(node.supervise(stop.clone()));
    let announce_task = tokio::spawn(node.announce(stop.clone()));
    let served_task = tokio::spawn(node.check_served(stop.clone()));
    let links_task = tokio::spawn(node.watch_links(stop.clone()));
    let report_task = tokio::spawn(report::run(
        node.report().clone(),
        node.clone(),
        cfg.cni.clone(),
        cfg.report.clone(),
        api,
        report_stop,
    ));
    let admin_tasks: Vec<_> = admin
        .into_iter()
        .map(|(l, audience)| {
            tokio::spawn(admin::serve(
                l,
                node.report().clone(),
                listen_stop.clone(),
                audience,
            ))
        })
        .collect();
    let api_task = tokio::spawn(node.relist_with_api(stop.clone()));
    // Removing the plugin is not part of stopping: pods must keep going
    // through it while the agent restarts (see `sluice uninstall-cni`).
    let cni_task = cfg
        .cni
        .clone()
        .filter(|_| !uninstalling)
        .map(|c| tokio::spawn(c.keep_installed(stop.clone())));
    let ds_task = match (&kube_client, &cfg.daemonset) {
        (Some(c), Some(ds)) if !uninstalling => Some(tokio::spawn(watch_daemonset(
            c.clone(),
            ds.clone(),
            node.uninstall().clone(),
            stop.clone(),
        ))),
        _ => None,
    };
    info!(pods = node.pod_count(), "sluice agent running");

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut asked = node.uninstall().watch();
    let signalled = tokio::select! {
        _ = term.recv() => { info!("SIGTERM"); true }
        _ = tokio::signal::ctrl_c() => { info!("SIGINT"); true }
        _ = asked.wait_for(|u| *u != node::Uninstall::No) => false,
    };
    // Stopped without being asked: an uninstall if the DaemonSet is going
    // (`kubectl delete daemonset`), else a restart or an upgrade.
    if signalled && node.uninstall().state() == node::Uninstall::No {
        if let (Some(c), Some(ds)) = (&kube_client, &cfg.daemonset) {
            if let Some(r) = uninstall_reason(c, ds).await {
                node.uninstall().request(r);
            }
        }
    }
    let _ = report_stop_tx.send(true);
    let _ = report_task.await;
    let _ = stop_tx.send(true);
    let _ = zds_task.await;
    let _ = reconcile_task.await;
    let _ = announce_task.await;
    let _ = served_task.await;
    let _ = links_task.await;
    let _ = api_task.await;
    if let Some(t) = cni_task {
        let _ = t.await;
    }
    if let Some(t) = ds_task {
        let _ = t.await;
    }
    if let node::Uninstall::Started(r) = node.uninstall().state() {
        node.uninstall().run(cfg.cni.as_ref(), r).await;
        if !signalled {
            // Exiting would only have the DaemonSet start the agent again.
            info!("sluice removed from this node; waiting to be stopped");
            tokio::select! {
                _ = term.recv() => info!("SIGTERM"),
                _ = tokio::signal::ctrl_c() => info!("SIGINT"),
            }
        }
    }
    let _ = listen_stop_tx.send(true);
    let _ = control_task.await;
    for t in admin_tasks {
        let _ = t.await;
    }
    match node.uninstall().state() {
        node::Uninstall::No => info!("agent stopped; capture stays in place (pins kept)"),
        u => info!(uninstall = %u, "agent stopped"),
    }
    Ok(())
}

/// The admin listeners to bind: the health one (node only) and the scrape
/// one (bounded per peer); the same address for both binds it once.
fn admin_addrs(cfg: &Config) -> Vec<(SocketAddr, admin::Audience)> {
    let mut out = Vec::new();
    if let Some(h) = cfg.health_addr {
        out.push((h, admin::Audience::Node));
    }
    if let Some(m) = cfg.metrics_addr.filter(|m| Some(*m) != cfg.health_addr) {
        out.push((m, admin::Audience::Scrapers));
    }
    out
}

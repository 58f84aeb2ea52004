//! An agent that only reports why it does not run: node condition False with
//! the reason, `/readyz` 503 saying it, `/healthz` 200 (no restart loop),
//! until it is stopped or what kept it out is gone.

use std::{future::Future, sync::Arc, time::Duration};

use anyhow::Context as _;
use tokio::sync::watch;
use tracing::warn;

use super::{
    admin,
    config::Config,
    daemonset::{DaemonSetMark, Moment},
    held_uninstall,
    report::Report,
};
use crate::{
    kube::{condition::ConditionWriter, uninstall::Reason},
    metrics::{Metrics, Sample, Source},
    readiness::Condition,
};

/// No pods to sample (an agent that only reports).
struct NoPods;

impl Source for NoPods {
    fn sample(&self) -> Sample {
        Sample::default()
    }
}

/// How a report-only agent's wait ended.
enum End {
    /// SIGTERM or SIGINT.
    Stopped,
    /// What kept it out is gone: it may start for real.
    Cleared,
    /// The DaemonSet asks for sluice to go from this node.
    Uninstall(Reason),
}

/// Whether a holding agent may remove sluice from its node when asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnUninstall {
    /// Nothing else of sluice's runs here (another build's dataplane left
    /// pinned): sluice-cni, the pins and the API marks go.
    Remove,
    /// Another node agent runs here (possibly another sluice, with the same
    /// pins, CNI entry and condition): nothing is touched.
    Leave,
}

/// Reports `condition` until SIGTERM (`term`, registered when the agent
/// started) or SIGINT (false) or until `until` completes (true: the agent
/// may start for real). With [`OnUninstall::Remove`], asked by its
/// DaemonSet to uninstall (the mark, or its deletion at SIGTERM), it removes
/// sluice from the node first ([`held_uninstall`]) and then waits to be
/// stopped, or for the mark to be cleared (false either way: the restart
/// starts afresh).
pub async fn report_only(
    cfg: &Config,
    condition: Condition,
    until: impl Future<Output = ()>,
    on_uninstall: OnUninstall,
    term: &mut tokio::signal::unix::Signal,
) -> anyhow::Result<bool> {
    let report = Arc::new(Report::new(
        Arc::new(Metrics::new(Arc::new(NoPods))),
        &cfg.report.condition_type,
    ));
    report.hold(condition.clone());
    let client = match &cfg.node_name {
        Some(node) => api_client(cfg, node, &condition).await,
        None => None,
    };
    let mark = client
        .clone()
        .zip(cfg.daemonset.clone())
        .filter(|_| on_uninstall == OnUninstall::Remove)
        .map(|(c, ds)| DaemonSetMark::new(c, ds));
    let (stop_tx, stop) = watch::channel(false);
    let mut admin_tasks = Vec::new();
    for (addr, audience) in cfg.admin_addrs() {
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
    tokio::pin!(until);
    let asked = async {
        match &mark {
            Some(m) => m.asked().await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(asked);
    let mut end = loop {
        tokio::select! {
            _ = term.recv() => break End::Stopped,
            _ = tokio::signal::ctrl_c() => break End::Stopped,
            _ = &mut until => break End::Cleared,
            r = &mut asked => break End::Uninstall(r),
            // Kept fresh, so /healthz does not take it for a stuck loop.
            _ = tokio::time::sleep(Duration::from_secs(5)) => report.hold(condition.clone()),
        }
    };
    let mut stopped = matches!(end, End::Stopped);
    if let (End::Stopped, Some(m)) = (&end, &mark) {
        if let Some(r) = m.read(Moment::Stop).await {
            end = End::Uninstall(r);
        }
    }
    if let End::Uninstall(why) = end {
        let api = client.clone().map(|client| held_uninstall::NodeApi {
            client,
            node: cfg.node_name.clone().unwrap_or_default(),
            condition_type: cfg.report.condition_type.clone(),
        });
        let node = cfg.open_node_netns();
        let _ = held_uninstall::remove(why, cfg.cni.as_ref(), cfg.pins.clone(), node, api.as_ref())
            .await;
        report.set_uninstalled();
        if !stopped {
            // Exiting would only have the DaemonSet start the agent again,
            // unless the mark it acted on is cleared.
            let marked = (why == Reason::Requested)
                .then(|| cfg.daemonset.clone())
                .flatten();
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
                _ = super::daemonset::until_unmarked(client, marked) => {}
            }
        }
        stopped = true;
    }
    let _ = stop_tx.send(true);
    for t in admin_tasks {
        let _ = t.await;
    }
    Ok(!stopped)
}

/// A client for the API, the node condition written with it (none without
/// one).
async fn api_client(cfg: &Config, node: &str, condition: &Condition) -> Option<kube::Client> {
    match kube::Client::try_default().await {
        Ok(client) => {
            write_condition(cfg, client.clone(), node, condition).await;
            Some(client)
        }
        Err(e) => {
            warn!(error = %e, "no Kubernetes API: the node condition is not written");
            None
        }
    }
}

/// Writes `condition` on the Node, once.
async fn write_condition(cfg: &Config, client: kube::Client, node: &str, condition: &Condition) {
    let w = ConditionWriter::new(
        client,
        node,
        &cfg.report.condition_type,
        cfg.report.heartbeat,
    );
    if let Err(e) = w.write(condition).await {
        warn!(error = %e, "could not write the node condition");
    }
}

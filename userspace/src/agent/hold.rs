//! An agent that only reports why it does not run: node condition False with
//! the reason, `/readyz` 503 saying it, `/healthz` 200 (no restart loop),
//! until it is stopped or what kept it out is gone.

use std::{future::Future, sync::Arc, time::Duration};

use anyhow::Context as _;
use tokio::sync::watch;
use tracing::warn;

use super::{admin, config::Config, report::Report};
use crate::{
    kube::condition::ConditionWriter,
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

/// Reports `condition` until SIGTERM (`term`, registered when the agent
/// started) or SIGINT (false) or until `until` completes (true: the agent
/// may start for real).
pub async fn report_only(
    cfg: &Config,
    condition: Condition,
    until: impl Future<Output = ()>,
    term: &mut tokio::signal::unix::Signal,
) -> anyhow::Result<bool> {
    let report = Arc::new(Report::new(
        Arc::new(Metrics::new(Arc::new(NoPods))),
        &cfg.report.condition_type,
    ));
    report.hold(condition.clone());
    if let Some(node) = &cfg.node_name {
        write_condition(cfg, node, &condition).await;
    }
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
    let cleared = loop {
        tokio::select! {
            _ = term.recv() => break false,
            _ = tokio::signal::ctrl_c() => break false,
            _ = &mut until => break true,
            // Kept fresh, so /healthz does not take it for a stuck loop.
            _ = tokio::time::sleep(Duration::from_secs(5)) => report.hold(condition.clone()),
        }
    };
    let _ = stop_tx.send(true);
    for t in admin_tasks {
        let _ = t.await;
    }
    Ok(cleared)
}

/// Writes `condition` on the Node, once (nothing without an API).
async fn write_condition(cfg: &Config, node: &str, condition: &Condition) {
    match kube::Client::try_default().await {
        Ok(client) => {
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
        Err(e) => warn!(error = %e, "no Kubernetes API: the node condition is not written"),
    }
}

//! The pinned dataplane is another build's that this one cannot take over:
//! capture stays exactly as that build left it (its programs keep running),
//! and the agent only reports why — node condition False
//! `DataplaneIncompatible`, `/readyz` 503 with the reason, `/healthz` 200 —
//! until it is stopped, instead of exiting into a restart loop.

use std::{sync::Arc, time::Duration};

use anyhow::Context as _;
use tokio::sync::watch;
use tracing::warn;

use super::{admin, config::Config, report::Report};
use crate::{
    kube::condition::ConditionWriter,
    metrics::{Metrics, Sample, Source},
    readiness::{Condition, Reason},
};

/// No pods to sample (an agent holding an incompatible dataplane).
struct NoPods;

impl Source for NoPods {
    fn sample(&self) -> Sample {
        Sample::default()
    }
}

/// Reports `why` until SIGTERM or SIGINT.
pub async fn hold(cfg: Config, why: String) -> anyhow::Result<()> {
    tracing::error!(%why, "cannot take over the pinned dataplane; reporting only");
    let condition = Condition {
        ready: false,
        reason: Reason::DataplaneIncompatible,
        message: format!(
            "this sluice build cannot take over the dataplane pinned by another build ({why}); that build's capture stays in place, nothing new is enrolled"
        ),
    };
    let report = Arc::new(Report::new(
        Arc::new(Metrics::new(Arc::new(NoPods))),
        &cfg.report.condition_type,
    ));
    report.hold(condition.clone());
    if let Some(node) = &cfg.node_name {
        write_condition(&cfg, node, &condition).await;
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
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
            // Kept fresh, so /healthz does not take it for a stuck loop.
            _ = tokio::time::sleep(Duration::from_secs(5)) => report.hold(condition.clone()),
        }
    }
    let _ = stop_tx.send(true);
    for t in admin_tasks {
        let _ = t.await;
    }
    Ok(())
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

//! `sluice watchdog`: runs beside the agent and marks the node condition
//! False (AgentNotRunning) when the agent stops answering /readyz.

use std::{net::SocketAddr, time::Duration};

use super::common::{
    current_thread_runtime, init_tracing, kube_client, parse_duration, Globals, ReadinessArgs,
};
use crate::{
    agent::DEFAULT_HEALTH_ADDR,
    kube::condition::{ConditionWriter, DEFAULT_HEARTBEAT},
    watchdog,
};

#[derive(clap::Args)]
pub struct Args {
    /// This node's name.
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// The agent's --health-addr (or --metrics-addr).
    #[arg(long, default_value = DEFAULT_HEALTH_ADDR)]
    agent_addr: SocketAddr,
    #[command(flatten)]
    readiness: ReadinessArgs,
    /// Probe period (also each probe's timeout).
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    interval: Duration,
    /// Probes in a row without an answer before the node is marked.
    #[arg(long, default_value_t = watchdog::DEFAULT_FAILURES,
          value_parser = clap::value_parser!(u32).range(1..))]
    failures: u32,
}

pub fn run(g: Globals, args: Args) -> anyhow::Result<()> {
    init_tracing(g.log_format);
    current_thread_runtime()?.block_on(watch(args))
}

/// Probes the agent until SIGTERM or Ctrl-C.
async fn watch(args: Args) -> anyhow::Result<()> {
    let client = kube_client().await?;
    let writer = ConditionWriter::new(
        client,
        &args.node_name,
        &args.readiness.condition_type,
        DEFAULT_HEARTBEAT,
    );
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let cfg = watchdog::Config {
        agent_addr: args.agent_addr,
        interval: args.interval,
        failures: args.failures,
    };
    let task = tokio::spawn(watchdog::run(cfg, writer, stop));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    let _ = stop_tx.send(true);
    let _ = task.await;
    Ok(())
}

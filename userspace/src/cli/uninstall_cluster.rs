//! `sluice uninstall-cluster`: the Helm pre-delete hook. Has every agent
//! remove sluice from its node, then clears sluice's marks across the cluster.

use std::time::Duration;

use super::common::{
    current_thread_runtime, init_tracing, kube_client, parse_duration, Globals, ReadinessArgs,
};
use crate::kube::uninstall::Cluster;

#[derive(clap::Args)]
pub struct Args {
    /// The agents' DaemonSet.
    #[arg(long)]
    daemonset: String,
    #[arg(long, env = "POD_NAMESPACE", default_value = "istio-system")]
    namespace: String,
    /// Label selector of the agent pods.
    #[arg(long)]
    selector: String,
    #[command(flatten)]
    readiness: ReadinessArgs,
    /// Taints to remove from every node (e.g. the NodeReadinessRule's;
    /// repeatable).
    #[arg(long = "taint", value_name = "KEY")]
    taints: Vec<String>,
    /// The NodeReadinessRule to delete first (the chart's, when enabled):
    /// with it in place, every node would be tainted as its condition goes.
    #[arg(long, value_name = "NAME")]
    node_readiness_rule: Option<String>,
    /// How long to wait for the nodes; the API objects are cleared after
    /// it either way, and the nodes still pending are named.
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    timeout: Duration,
}

pub fn run(g: Globals, args: Args) -> anyhow::Result<()> {
    init_tracing(g.log_format);
    current_thread_runtime()?.block_on(uninstall_cluster(&args))
}

async fn uninstall_cluster(args: &Args) -> anyhow::Result<()> {
    let client = kube_client().await?;
    let cluster = Cluster {
        daemonset: &args.daemonset,
        namespace: &args.namespace,
        selector: &args.selector,
        condition_type: &args.readiness.condition_type,
        taints: &args.taints,
        readiness_rule: args.node_readiness_rule.as_deref(),
    };
    let left = cluster.uninstall(client, args.timeout).await?;
    if !left.is_empty() {
        tracing::warn!(
            nodes = ?left,
            "these nodes did not remove sluice in time: run `sluice uninstall` on each"
        );
    }
    Ok(())
}

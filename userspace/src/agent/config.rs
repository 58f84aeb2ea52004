//! What `sluice agent` is told: its sockets and pins, the cluster it runs in
//! (if any), how it reports and checks, and where it serves its admin
//! endpoints. `cli::agent` builds it from the flags.

use std::{net::SocketAddr, path::PathBuf};

use super::{admin::Audience, node::ServedConfig, report::ReportConfig};
use crate::{cni::install::CniInstall, dataplane::loader::Pins};

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
    pub report: ReportConfig,
    /// Where /metrics, /healthz and /readyz are served (`None`: not served).
    pub metrics_addr: Option<SocketAddr>,
    /// The node-only health listener (`--health-addr`), for the kubelet's
    /// probes and the watchdog.
    pub health_addr: Option<SocketAddr>,
    /// How pods are found served by ztunnel.
    pub served: ServedConfig,
    /// How long the listeners of a ztunnel that died keep connections queued
    /// on them for the next ztunnel (see `custody`).
    pub orphan_grace: std::time::Duration,
    /// How often every pod's capture is verified besides the events that
    /// trigger it (`--verify-every`).
    pub verify_every: std::time::Duration,
    /// The agents' DaemonSet (namespace, name), watched for uninstall (with
    /// `node_name`).
    pub daemonset: Option<(String, String)>,
    /// The node's netns, for host-originated probes (`None`: address-only).
    pub node_netns: Option<PathBuf>,
    /// Namespaces whose pods are never captured.
    pub excluded: std::collections::BTreeSet<String>,
    /// Which pods are in the mesh (`--enablement-selectors`).
    pub enablement: crate::kube::enablement::Enablement,
    /// Which pods' exclusion annotations are honoured (`--pod-exclusions`).
    pub exclusions: crate::exclusions::Policy,
    /// The node's DNS capture default (`--dns-capture`).
    pub dns_capture: bool,
    /// How tc programs are attached (`--tc-attach`).
    pub tc_attach: crate::dataplane::features::TcAttach,
    /// New pods' TCP takes the local route (`--local-route`).
    pub local_route: bool,
    /// Start even when another node agent serves ztunnel here (replacing
    /// its ZDS socket) instead of waiting for it to go.
    pub take_over_node_agent: bool,
    /// `--max-pod-addresses`: a pod's share of the node-wide address map.
    pub max_pod_addresses: usize,
}

impl Config {
    /// The node's netns (`--node-netns`), for host-originated probes.
    pub fn open_node_netns(&self) -> anyhow::Result<Option<crate::podnet::hostside::Node>> {
        use anyhow::Context as _;
        self.node_netns
            .as_ref()
            .map(|path| {
                crate::podnet::hostside::Node::open(path)
                    .with_context(|| format!("--node-netns {}", path.display()))
            })
            .transpose()
    }

    /// The admin listeners to bind: the health one (node only) and the
    /// scrape one (bounded per peer); the same address for both binds it once.
    pub fn admin_addrs(&self) -> Vec<(SocketAddr, Audience)> {
        let mut out = Vec::new();
        if let Some(h) = self.health_addr {
            out.push((h, Audience::Node));
        }
        if let Some(m) = self.metrics_addr.filter(|m| Some(*m) != self.health_addr) {
            out.push((m, Audience::Scrapers));
        }
        out
    }
}

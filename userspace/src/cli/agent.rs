//! `sluice agent`: the node agent. Serves ZDS to ztunnel, enrolls pods
//! through it, keeps sluice-cni installed and reports the node's readiness.

use std::{collections::BTreeSet, net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::Context as _;

use super::common::{init_tracing, parse_duration, CniDirs, Globals, ReadinessArgs};
use crate::{
    agent::{
        self, report::ReportConfig, DEFAULT_HEALTH_ADDR, DEFAULT_METRICS_ADDR, DEFAULT_ZDS_SOCKET,
    },
    dataplane::features::TcAttach,
    served,
};

// A flag given twice takes its last value: the chart's agent.extraArgs
// come last and override what the chart set.
#[derive(clap::Args)]
#[command(args_override_self = true)]
pub struct Args {
    /// Where ztunnel connects (its INPOD_UDS).
    #[arg(long, default_value = DEFAULT_ZDS_SOCKET, env = "SLUICE_ZDS_SOCKET")]
    zds_socket: PathBuf,
    /// Keep sluice-cni installed in the node's primary CNI conflist.
    #[arg(long)]
    install_cni: bool,
    /// This node's name: the agent then uses the Kubernetes API (in-cluster
    /// config or KUBECONFIG) to admit CNI requests and annotate pods.
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    #[command(flatten)]
    cni: CniDirs,
    #[command(flatten)]
    readiness: ReadinessArgs,
    /// Where /metrics, /healthz and /readyz are served for Prometheus
    /// ("off": nowhere); at most 4 connections per peer address.
    #[arg(long, default_value = DEFAULT_METRICS_ADDR, env = "SLUICE_METRICS_ADDR")]
    metrics_addr: String,
    /// Where the same are served for the node only — the kubelet's
    /// probes and the watchdog — apart from the scrape listener any pod
    /// of the node can reach ("off": nowhere).
    #[arg(long, default_value = DEFAULT_HEALTH_ADDR, env = "SLUICE_HEALTH_ADDR")]
    health_addr: String,
    /// Remove this taint from the node once the condition is True (for
    /// clusters without node-readiness-controller; repeatable). Never adds taints.
    #[arg(long = "untaint", value_name = "KEY")]
    untaint: Vec<String>,
    /// How long a pod may stay Pending before the node is reported not ready.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pending_grace: Duration,
    /// Rewrite an unchanged node condition this often.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    heartbeat: Duration,
    /// How a pod is found served: `auto` asks ztunnel's admin API whether
    /// it has the pod's workload (acks count when it does not answer);
    /// `off` counts ztunnel's ack as served.
    #[arg(long, value_enum, default_value_t = served::Mode::Auto, env = "SLUICE_SERVED_CHECK")]
    served_check: served::Mode,
    /// ztunnel's admin port (ProxyConfig proxyAdminPort), on localhost in
    /// ztunnel's network namespace.
    #[arg(long, default_value_t = served::fetch::DEFAULT_ADMIN_PORT, env = "SLUICE_ZTUNNEL_ADMIN_PORT")]
    ztunnel_admin_port: u16,
    /// How often pods already served are checked again (a workload
    /// removed from xDS makes its pod not served); longer, up to 20 min,
    /// when reading ztunnel's config_dump that often would take more than
    /// 0.1 % of a core (a big mesh).
    #[arg(long, default_value = "30s", value_parser = parse_duration, env = "SLUICE_SERVED_RECHECK")]
    served_recheck: Duration,
    /// When ztunnel dies, its listeners leave the socket map at once (the
    /// pod fails closed) but the agent holds them this long, so that
    /// connections already queued on them (handshake done) move to the
    /// next ztunnel's listeners instead of being reset. While held, no
    /// other process can bind ztunnel's ports in the pod. 0s: close at once.
    #[arg(long, default_value = "30s", value_parser = parse_duration, env = "SLUICE_ORPHAN_GRACE")]
    orphan_grace: Duration,
    /// How often every pod's capture is verified by running it (the
    /// programs at its hooks on synthetic packets), give or take a tenth,
    /// besides after every registration, repair and change at its hooks.
    /// tcx attachments and sk_lookup links send no event: a foreign one is
    /// found within this period. Every tenth pass also surveys and repairs
    /// each pod's sysctls (which the runs do not use and no event announces).
    #[arg(long, default_value = "60s", value_parser = parse_duration, env = "SLUICE_VERIFY_EVERY")]
    verify_every: Duration,
    /// The agents' DaemonSet, read every 5 s and at SIGTERM: marked
    /// `sluice.dev/uninstall` (the Helm pre-delete hook), being deleted or
    /// gone, the agent removes sluice from its node. Needs --node-name.
    #[arg(long, requires = "node_name")]
    daemonset: Option<String>,
    /// The DaemonSet's namespace (the agent's own).
    #[arg(long, env = "POD_NAMESPACE", default_value = "istio-system")]
    namespace: String,
    /// The node's network namespace: where kubelet and other host
    /// processes live and the host side of pods' veths is. Connections
    /// its own sockets open to a pod (kubelet's HTTP/TCP probes) are not
    /// captured; forwarded ones are. The default is the agent's own
    /// (a hostNetwork pod). `off`: only probes from 169.254.7.127 (what
    /// istio-cni's host rules SNAT them to) are exempt.
    #[arg(long, default_value = "/proc/self/ns/net", env = "SLUICE_NODE_NETNS")]
    node_netns: String,
    /// Namespaces whose pods are never captured, comma-separated (istio-cni's
    /// `excludeNamespaces`); the agent's own namespace is always one. Their
    /// pods never reach the agent: they start while it is down.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kube-system",
        env = "SLUICE_EXCLUDE_NAMESPACES"
    )]
    exclude_namespaces: Vec<String>,
    /// Which pods are in the mesh (istio-cni's `ambient.enablementSelectors`):
    /// a JSON list of `{"podSelector": …, "namespaceSelector": …}` label
    /// selectors; a pod is captured when any entry matches both it and its
    /// namespace. The default is Istio's: the pod or its namespace labelled
    /// `istio.io/dataplane-mode=ambient`, and the pod not `none`.
    #[arg(long, default_value = crate::kube::enablement::DEFAULT, env = "SLUICE_ENABLEMENT_SELECTORS")]
    enablement_selectors: crate::kube::enablement::Enablement,
    /// Capture pods' DNS (UDP and TCP to port 53) to ztunnel's DNS proxy
    /// on the pod's localhost:15053, as istio-cni's `ambient.dnsCapture`
    /// (default on). A pod's `ambient.istio.io/dns-capture` annotation
    /// wins; pods enrolled earlier follow a changed default on restart.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "SLUICE_DNS_CAPTURE")]
    dns_capture: bool,
    /// Whether ambient pods' `traffic.sidecar.istio.io/*` exclusion
    /// annotations (excludeOutboundPorts, excludeOutboundIPRanges,
    /// includeOutboundIPRanges, includeOutboundPorts, excludeInboundPorts,
    /// includeInboundPorts)
    /// are honoured: `off` (the default: such pods are captured fully and
    /// get a PodExclusionsIgnored Warning Event) or `annotations`. Excluded
    /// traffic bypasses ztunnel: no mTLS, no policy, no telemetry.
    #[arg(long, default_value = "off", env = "SLUICE_POD_EXCLUSIONS")]
    pod_exclusions: crate::exclusions::PodExclusionsMode,
    /// With --pod-exclusions annotations: only pods of these namespaces
    /// (comma-separated) have their exclusions honoured; empty: all.
    #[arg(long, value_delimiter = ',', env = "SLUICE_POD_EXCLUSIONS_NAMESPACES")]
    pod_exclusions_namespaces: Vec<String>,
    /// How tc programs are attached to pods: `cls_bpf` (a clsact qdisc
    /// and a filter per hook; a pod enrolls in about a millisecond) or
    /// `tcx` (BPF links, Linux ≥ 6.6; every attach waits for an RCU
    /// grace period under RTNL, 10–20 ms, three or four per pod). tcx on
    /// a kernel without it falls back to cls_bpf. Pods attached the other
    /// way keep their attachments.
    #[arg(long, default_value = "cls_bpf", env = "SLUICE_TC_ATTACH")]
    tc_attach: TcAttach,
    /// Route pods' app TCP over their `lo` (a policy rule and a local route
    /// in the pod), so that a captured connection gets loopback's segment
    /// size: outbound bulk through ztunnel as fast as without capture.
    /// Needs Linux ≥ 6.15 (off, with a warning, where the kernel lacks
    /// it); applies to pods enrolled from then on with one interface
    /// besides `lo`. Off by default (see docs/PERFORMANCE.md).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, env = "SLUICE_LOCAL_ROUTE")]
    local_route: bool,
    /// Start even when another node agent (istio-cni's) already serves
    /// ztunnel on --zds-socket, replacing its socket. Without it the agent
    /// reports `AnotherNodeAgent` and starts once the other is gone.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, env = "SLUICE_TAKE_OVER_NODE_AGENT")]
    take_over_node_agent: bool,
    /// At most this many of a pod's addresses are published to the programs
    /// (the node-wide address map is bounded per pod, so no pod can fill it
    /// for its neighbours); past it, a TooManyAddresses Warning Event.
    #[arg(long, default_value_t = crate::dataplane::state::DEFAULT_MAX_POD_ADDRESSES as u16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    max_pod_addresses: u16,
    /// With --install-cni: how often the CNI config is checked besides
    /// the inotify watch that sees the primary CNI's rewrites at once.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    cni_recheck: Duration,
}

pub fn run(g: Globals, args: Args) -> anyhow::Result<()> {
    one_malloc_arena();
    init_tracing(g.log_format);
    let mut excluded: BTreeSet<String> = args
        .exclude_namespaces
        .into_iter()
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty())
        .collect();
    excluded.insert(args.namespace.clone());
    anyhow::ensure!(
        args.served_recheck >= Duration::from_secs(1),
        "--served-recheck {:?}: at least 1s (each recheck reads ztunnel's whole config_dump)",
        args.served_recheck
    );
    anyhow::ensure!(
        args.verify_every >= Duration::from_secs(1),
        "--verify-every {:?}: at least 1s (each pass runs every pod's capture)",
        args.verify_every
    );
    anyhow::ensure!(
        args.untaint.is_empty() || args.node_name.is_some(),
        "--untaint needs --node-name (the taint is removed from this node's Node object)"
    );
    let metrics_addr = listen_addr("--metrics-addr", &args.metrics_addr, DEFAULT_METRICS_ADDR)?;
    let health_addr = listen_addr("--health-addr", &args.health_addr, DEFAULT_HEALTH_ADDR)?;
    let cni = if args.install_cni {
        let mut i = args.cni.install(&g.control_socket)?;
        i.exclude_namespaces = excluded.iter().cloned().collect();
        i.recheck = args.cni_recheck;
        Some(i)
    } else {
        None
    };
    let node_netns = args.node_netns;
    agent::run(agent::Config {
        pins: g.pins,
        zds_socket: args.zds_socket,
        control_socket: g.control_socket,
        cni,
        node_name: args.node_name,
        report: ReportConfig {
            condition_type: args.readiness.condition_type,
            pending_grace: args.pending_grace,
            heartbeat: args.heartbeat,
            untaint: args.untaint,
        },
        metrics_addr,
        health_addr,
        served: agent::node::ServedConfig {
            mode: args.served_check,
            admin_port: args.ztunnel_admin_port,
            recheck: args.served_recheck,
        },
        orphan_grace: args.orphan_grace,
        verify_every: args.verify_every,
        daemonset: args.daemonset.map(|d| (args.namespace, d)),
        node_netns: (node_netns != "off").then(|| PathBuf::from(node_netns)),
        excluded,
        enablement: args.enablement_selectors,
        exclusions: crate::exclusions::Policy {
            mode: args.pod_exclusions,
            namespaces: args
                .pod_exclusions_namespaces
                .iter()
                .map(|n| n.trim().to_owned())
                .filter(|n| !n.is_empty())
                .collect(),
        },
        dns_capture: args.dns_capture,
        tc_attach: args.tc_attach,
        local_route: args.local_route,
        take_over_node_agent: args.take_over_node_agent,
        max_pod_addresses: args.max_pod_addresses.into(),
    })
}

/// A listener flag's value: `off` (none) or IP:PORT.
fn listen_addr(flag: &str, value: &str, default: &str) -> anyhow::Result<Option<SocketAddr>> {
    match value {
        "off" => Ok(None),
        a => Ok(Some(a.parse::<SocketAddr>().with_context(|| {
            format!("{flag} {a:?}: expected IP:PORT (e.g. {default}) or off")
        })?)),
    }
}

/// The agent's memory is mostly small, long-lived per-pod state touched from
/// whichever runtime or blocking thread serves a request; glibc gives each
/// such thread an arena of its own (up to 8 per core), which held ≈ 2.6 MiB
/// more at 1,000 pods (18.3 vs 15.6 MiB RSS, `cargo xtask bench` memory
/// scenario). Nothing of the agent allocates on a packet's path, so one
/// shared arena costs no contention that matters. Before any thread starts.
fn one_malloc_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc's allocator settings; called while
    // the process has one thread.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

//! The `sluice` command.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use sluice::{
    agent::{
        self, report::ReportConfig, DEFAULT_HEALTH_ADDR, DEFAULT_METRICS_ADDR, DEFAULT_ZDS_SOCKET,
    },
    cni::install,
    control::{self, Request, Response, DEFAULT_CONTROL_SOCKET},
    enroll,
    kube::condition::{ConditionWriter, DEFAULT_HEARTBEAT},
    loader::{Dataplane, Pins, DEFAULT_ROOT},
    readiness::DEFAULT_CONDITION_TYPE,
    state::Maps,
    status,
    uid::PodUid,
    watchdog,
    workload::Workload,
};

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "eBPF redirection dataplane for Istio ambient mode"
)]
struct Cli {
    /// bpffs directory holding sluice's programs, maps and per-pod links.
    #[arg(long, global = true, default_value = DEFAULT_ROOT, env = "SLUICE_BPF_ROOT")]
    bpf_root: PathBuf,
    /// The agent's control socket: `enroll`/`unenroll` go through a running
    /// agent (which also tells ztunnel), else work on the pins directly.
    #[arg(long, global = true, default_value = DEFAULT_CONTROL_SOCKET, env = "SLUICE_CONTROL_SOCKET")]
    control_socket: PathBuf,
    /// The procfs mount used to set pod sysctls (accept_local,
    /// tcp_migrate_req). In a non-privileged container /proc/sys is
    /// read-only: mount the host's /proc (e.g. at /host/proc) and name it here.
    #[arg(long, global = true, default_value = "/proc", env = "SLUICE_PROC_DIR")]
    proc_dir: PathBuf,
    /// Log lines of the long-running commands (agent, watchdog): `json` (one
    /// object per line, with the span fields: pod uid, netns, ztunnel pid),
    /// `text`, or `auto` (text on a terminal, json otherwise — in a pod).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Auto, env = "SLUICE_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

// Parsed once per process: the agent's many flags making its variant large
// cost nothing worth a Box.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Capture a pod netns: attach the programs and register ztunnel's
    /// listeners if they exist (else the pod stays Pending: fail closed).
    Enroll {
        /// Path of the pod's network namespace (e.g. /run/netns/NAME, /proc/PID/ns/net).
        #[arg(long)]
        netns: PathBuf,
        /// Pod uid.
        #[arg(long)]
        uid: String,
        /// Pod name, as ztunnel knows the workload (default: the uid).
        #[arg(long)]
        name: Option<String>,
        /// Pod namespace.
        #[arg(long, default_value = "default")]
        namespace: String,
        /// Pod service account.
        #[arg(long, default_value = "default")]
        service_account: String,
    },
    /// Register ztunnel's listeners for an enrolled pod (after ztunnel (re)started).
    Register {
        #[arg(long)]
        uid: String,
    },
    /// Remove a pod's capture entirely: links, pins, routes and map entries.
    Unenroll {
        #[arg(long)]
        uid: String,
    },
    /// Show the node (condition, ztunnel; from the agent if one runs) and the
    /// enrolled pods (from the pinned maps; no daemon needed).
    Status {
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
        output: Output,
        /// One pod end to end (NAMESPACE/NAME or its uid): captured or why
        /// not, state, ztunnel's listeners, links, addresses, options,
        /// counters, and what is missing before it is fully enrolled.
        #[arg(long)]
        pod: Option<String>,
    },
    /// Remove sluice from this node: sluice-cni from the CNI config and bin
    /// dir, every pod's capture (pods keep working, uncaptured), all pins.
    /// Through the running agent when there is one (it also clears its node
    /// condition and this node's pod annotations), else directly.
    Uninstall {
        #[command(flatten)]
        cni: CniDirs,
    },
    /// The Helm pre-delete hook: marks the agents' DaemonSet for uninstall,
    /// waits until every node running an agent has removed sluice (its node
    /// condition gone), then clears sluice's annotations, readiness-gate
    /// conditions, node conditions and taints across the cluster.
    UninstallCluster {
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
        /// How long to wait for the nodes; the API objects are cleared after
        /// it either way, and the nodes still pending are named.
        #[arg(long, default_value = "120s", value_parser = parse_duration)]
        timeout: Duration,
    },
    /// Run the node agent: serve ZDS to ztunnel and enroll pods through it.
    Agent {
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
        #[arg(long, value_enum, default_value_t = sluice::served::Mode::Auto, env = "SLUICE_SERVED_CHECK")]
        served_check: sluice::served::Mode,
        /// ztunnel's admin port (ProxyConfig proxyAdminPort), on localhost in
        /// ztunnel's network namespace.
        #[arg(long, default_value_t = sluice::served::fetch::DEFAULT_ADMIN_PORT, env = "SLUICE_ZTUNNEL_ADMIN_PORT")]
        ztunnel_admin_port: u16,
        /// How often pods already served are checked again (a workload
        /// removed from xDS makes its pod not served).
        #[arg(long, default_value = "30s", value_parser = parse_duration, env = "SLUICE_SERVED_RECHECK")]
        served_recheck: Duration,
        /// When ztunnel dies, its listeners leave the socket map at once (the
        /// pod fails closed) but the agent holds them this long, so that
        /// connections already queued on them (handshake done) move to the
        /// next ztunnel's listeners instead of being reset. While held, no
        /// other process can bind ztunnel's ports in the pod. 0s: close at once.
        #[arg(long, default_value = "30s", value_parser = parse_duration, env = "SLUICE_ORPHAN_GRACE")]
        orphan_grace: Duration,
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
        /// Capture pods' DNS (UDP and TCP to port 53) to ztunnel's DNS proxy
        /// on the pod's localhost:15053, as istio-cni's `ambient.dnsCapture`
        /// (default on). A pod's `ambient.istio.io/dns-capture` annotation
        /// wins; pods enrolled earlier follow a changed default on restart.
        #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "SLUICE_DNS_CAPTURE")]
        dns_capture: bool,
        /// How tc programs are attached to pods: `cls_bpf` (a clsact qdisc
        /// and a filter per hook; a pod enrolls in about a millisecond) or
        /// `tcx` (BPF links, Linux ≥ 6.6; every attach waits for an RCU
        /// grace period under RTNL, 10–20 ms, three or four per pod). tcx on
        /// a kernel without it falls back to cls_bpf. Pods attached the other
        /// way keep their attachments.
        #[arg(long, default_value = "cls_bpf", env = "SLUICE_TC_ATTACH")]
        tc_attach: sluice::features::TcAttach,
        /// With --install-cni: how often the CNI config is checked besides
        /// the inotify watch that sees the primary CNI's rewrites at once.
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        cni_recheck: Duration,
    },
    /// Mark the node condition False (AgentNotRunning) when the agent stops
    /// answering /readyz: covers agent crashes. Runs beside the agent.
    Watchdog {
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
    },
    /// Remove sluice-cni from the node's CNI config and bin dir (when sluice
    /// is being removed from the node, not on an agent restart).
    UninstallCni {
        #[command(flatten)]
        cni: CniDirs,
    },
}

#[derive(clap::Args)]
struct CniDirs {
    /// The node's CNI config directory.
    #[arg(long, default_value = install::DEFAULT_CONF_DIR, env = "SLUICE_CNI_CONF_DIR")]
    cni_conf_dir: PathBuf,
    /// The node's CNI plugin directory.
    #[arg(long, default_value = install::DEFAULT_BIN_DIR, env = "SLUICE_CNI_BIN_DIR")]
    cni_bin_dir: PathBuf,
}

impl CniDirs {
    fn install(self, agent_socket: &std::path::Path) -> anyhow::Result<install::CniInstall> {
        let exe = std::env::current_exe().context("locating the sluice binary")?;
        Ok(install::CniInstall {
            conf_dir: self.cni_conf_dir,
            bin_dir: self.cni_bin_dir,
            plugin: exe.with_file_name(install::PLUGIN_TYPE),
            agent_socket: agent_socket.to_owned(),
            exclude_namespaces: Vec::new(),
            recheck: install::RECHECK,
        })
    }
}

#[derive(clap::Args)]
struct ReadinessArgs {
    /// The node condition's type (True = this node can enroll pods).
    #[arg(long, default_value = DEFAULT_CONDITION_TYPE, env = "SLUICE_CONDITION_TYPE")]
    condition_type: String,
}

/// "500ms", "10s", "2m".
fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map(|i| s.split_at(i))
        .ok_or_else(|| format!("{s:?}: add a unit (ms, s, m)"))?;
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a number and a unit, e.g. 10s"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        _ => Err(format!("{s:?}: unit must be ms, s or m")),
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    Auto,
    Text,
    Json,
}

fn init_tracing(format: LogFormat) {
    use std::io::IsTerminal as _;
    let json = match format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => !std::io::stderr().is_terminal(),
    };
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        fmt.json().init();
    } else {
        fmt.init();
    }
}

fn current_thread_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Table,
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice: {}", sluice::one_line(&e));
            ExitCode::FAILURE
        }
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

fn run(cli: Cli) -> anyhow::Result<()> {
    let pins = Pins::new(&cli.bpf_root);
    sluice::sysctl::use_proc_dir(&cli.proc_dir);
    match cli.cmd {
        Cmd::Enroll {
            netns,
            uid,
            name,
            namespace,
            service_account,
        } => {
            let uid = PodUid::new(&uid)?;
            let name = name.unwrap_or_else(|| uid.to_string());
            let workload = Workload::new(&name, &namespace, &service_account)?;
            let req = Request::Enroll {
                netns: netns.clone(),
                uid: uid.to_string(),
                workload: workload.clone(),
            };
            if let Some(resp) = control::call(&cli.control_socket, Some(pins.root()), &req)? {
                return print_agent(resp);
            }
            let mut dp = Dataplane::load_or_adopt(pins)?;
            let e = enroll::enroll(&mut dp, &netns, &uid, &workload)?;
            println!(
                "enrolled pod {uid} (netns {}, cookie {}): {}{}",
                netns.display(),
                e.cookie,
                e.state.as_str(),
                if e.roles.len() < 3 {
                    " — ztunnel's listeners not found yet; new connections fail closed until `sluice register`"
                } else {
                    ""
                }
            );
        }
        Cmd::Register { uid } => {
            let uid = PodUid::new(&uid)?;
            let mut dp = Dataplane::load_or_adopt(pins)?;
            let e = enroll::register_uid(&mut dp, &uid)?;
            println!(
                "pod {uid}: {} ({} of 3 listeners)",
                e.state.as_str(),
                e.roles.len()
            );
        }
        Cmd::Unenroll { uid } => {
            let uid = PodUid::new(&uid)?;
            let req = Request::Unenroll {
                uid: uid.to_string(),
            };
            if let Some(resp) = control::call(&cli.control_socket, Some(pins.root()), &req)? {
                return print_agent(resp);
            }
            anyhow::ensure!(
                pins.is_loaded(),
                "no enrolled pod has uid {uid} (sluice is not loaded on this node)"
            );
            let mut maps = Maps::open_pinned(&pins.maps()).context("opening pinned maps")?;
            enroll::unenroll(&pins, &mut maps, this_netns_as_node().as_ref(), &uid)?;
            println!("unenrolled pod {uid}");
        }
        Cmd::Status { output, pod } => {
            let pods = status::read(&pins)?;
            // The pods come from the pins whatever the agent says.
            let asked = control::call_within(
                &cli.control_socket,
                Some(pins.root()),
                &Request::Status,
                Duration::from_secs(3),
            );
            let (agent, agent_error) = match asked {
                Ok(None) => (None, None),
                Ok(Some(Response::Node(n))) => (Some(n), None),
                Ok(Some(Response::Error { message })) => (None, Some(message)),
                Ok(Some(other)) => (None, Some(format!("unexpected answer: {other:?}"))),
                Err(e) => (None, Some(sluice::one_line(&e))),
            };
            let node = status::NodeView {
                programs_loaded: pins.is_loaded(),
                kernel: sluice::features::describe(),
                stamp: sluice::stamp::read(&pins.maps()).map(|s| s.to_string()),
                agent,
                agent_error,
            };
            let waiting = node.agent.as_ref().map_or(&[][..], |a| &a.waiting[..]);
            let incomplete = node.agent.as_ref().map_or(&[][..], |a| &a.incomplete[..]);
            if let Some(query) = pod {
                let Some(e) = sluice::explain::explain(&query, &pods, node.agent.as_ref()) else {
                    let agent = if node.agent.is_some() {
                        "nor does the agent's last reconcile with the API list it"
                    } else {
                        "and no agent answered to say whether it should be"
                    };
                    anyhow::bail!("pod {query} is not enrolled on this node, {agent}");
                };
                match output {
                    Output::Table => {
                        print!("{}", sluice::explain::render(&e, node.agent.is_some()))
                    }
                    Output::Json => println!("{}", serde_json::to_string_pretty(&e)?),
                }
                return Ok(());
            }
            match output {
                Output::Table => print!(
                    "{}\n{}",
                    status::node_lines(&node),
                    status::table(&pods, waiting, incomplete)
                ),
                Output::Json => println!("{}", status::json(&node, &pods)),
            }
        }
        Cmd::UninstallCni { cni } => {
            cni.install(&cli.control_socket)?.uninstall()?;
            println!("removed sluice-cni from the node's CNI config");
        }
        Cmd::Agent {
            zds_socket,
            install_cni,
            node_name,
            cni,
            readiness,
            metrics_addr,
            health_addr,
            untaint,
            pending_grace,
            heartbeat,
            served_check,
            ztunnel_admin_port,
            served_recheck,
            orphan_grace,
            daemonset,
            namespace,
            node_netns,
            exclude_namespaces,
            cni_recheck,
            dns_capture,
            tc_attach,
        } => {
            one_malloc_arena();
            init_tracing(cli.log_format);
            let mut excluded: std::collections::BTreeSet<String> = exclude_namespaces
                .into_iter()
                .map(|n| n.trim().to_owned())
                .filter(|n| !n.is_empty())
                .collect();
            excluded.insert(namespace.clone());
            anyhow::ensure!(
                served_recheck >= Duration::from_secs(1),
                "--served-recheck {served_recheck:?}: at least 1s (each recheck reads ztunnel's whole config_dump)"
            );
            anyhow::ensure!(
                untaint.is_empty() || node_name.is_some(),
                "--untaint needs --node-name (the taint is removed from this node's Node object)"
            );
            let metrics_addr = match metrics_addr.as_str() {
                "off" => None,
                a => Some(a.parse::<SocketAddr>().with_context(|| {
                    format!("--metrics-addr {a:?}: expected IP:PORT (e.g. {DEFAULT_METRICS_ADDR}) or off")
                })?),
            };
            let health_addr = match health_addr.as_str() {
                "off" => None,
                a => Some(a.parse::<SocketAddr>().with_context(|| {
                    format!(
                        "--health-addr {a:?}: expected IP:PORT (e.g. {DEFAULT_HEALTH_ADDR}) or off"
                    )
                })?),
            };
            let cni = if install_cni {
                let mut i = cni.install(&cli.control_socket)?;
                i.exclude_namespaces = excluded.iter().cloned().collect();
                i.recheck = cni_recheck;
                Some(i)
            } else {
                None
            };
            agent::run(agent::Config {
                pins,
                zds_socket,
                control_socket: cli.control_socket,
                cni,
                node_name,
                report: ReportConfig {
                    condition_type: readiness.condition_type,
                    pending_grace,
                    heartbeat,
                    untaint,
                },
                metrics_addr,
                health_addr,
                served: agent::node::ServedConfig {
                    mode: served_check,
                    admin_port: ztunnel_admin_port,
                    recheck: served_recheck,
                },
                orphan_grace,
                daemonset: daemonset.map(|d| (namespace, d)),
                node_netns: (node_netns != "off").then(|| PathBuf::from(node_netns)),
                excluded,
                dns_capture,
                tc_attach,
            })?;
        }
        Cmd::Watchdog {
            node_name,
            agent_addr,
            readiness,
            interval,
            failures,
        } => {
            init_tracing(cli.log_format);
            current_thread_runtime()?.block_on(async {
                let client = kube::Client::try_default().await.context(
                    "connecting to the Kubernetes API (in-cluster config or KUBECONFIG)",
                )?;
                let writer = ConditionWriter::new(
                    client,
                    &node_name,
                    &readiness.condition_type,
                    DEFAULT_HEARTBEAT,
                );
                let (stop_tx, stop) = tokio::sync::watch::channel(false);
                let cfg = watchdog::Config {
                    agent_addr,
                    interval,
                    failures,
                };
                let task = tokio::spawn(watchdog::run(cfg, writer, stop));
                let mut term =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
                let _ = stop_tx.send(true);
                let _ = task.await;
                anyhow::Ok(())
            })?;
        }
        Cmd::Uninstall { cni } => {
            if let Some(resp) =
                control::call(&cli.control_socket, Some(pins.root()), &Request::Uninstall)?
            {
                return uninstall_via_agent(&cli.control_socket, pins.root(), resp);
            }
            cni.install(&cli.control_socket)?.uninstall()?;
            let n = enroll::uninstall(&pins, this_netns_as_node().as_ref())?;
            println!("removed sluice from this node ({n} pods unenrolled; sluice-cni removed)");
        }
        Cmd::UninstallCluster {
            daemonset,
            namespace,
            selector,
            readiness,
            taints,
            timeout,
        } => {
            init_tracing(cli.log_format);
            current_thread_runtime()?.block_on(uninstall_cluster(
                &daemonset,
                &namespace,
                &selector,
                &readiness.condition_type,
                &taints,
                timeout,
            ))?;
        }
    }
    Ok(())
}

/// Waits for the agent's uninstall to finish (read from its status).
fn uninstall_via_agent(
    socket: &std::path::Path,
    root: &std::path::Path,
    first: Response,
) -> anyhow::Result<()> {
    if let Response::Error { message } | Response::Refused { message } = first {
        anyhow::bail!(message);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    while std::time::Instant::now() < deadline {
        if let Ok(Some(Response::Node(n))) = control::call(socket, Some(root), &Request::Status) {
            if n.uninstall.starts_with("done") {
                println!(
                    "removed sluice from this node via the agent: {}",
                    n.uninstall
                );
                return Ok(());
            }
            if n.uninstall.starts_with("failed") {
                anyhow::bail!("the agent's uninstall {}", n.uninstall);
            }
            last = n.uninstall;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    anyhow::bail!("the agent did not finish the uninstall within 60 s (last: {last:?})")
}

async fn uninstall_cluster(
    daemonset: &str,
    namespace: &str,
    selector: &str,
    condition_type: &str,
    taints: &[String],
    timeout: Duration,
) -> anyhow::Result<()> {
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or KUBECONFIG)")?;
    let cluster = sluice::kube::uninstall::Cluster {
        daemonset,
        namespace,
        selector,
        condition_type,
        taints,
    };
    let left = cluster.uninstall(client, timeout).await?;
    if !left.is_empty() {
        tracing::warn!(
            nodes = ?left,
            "these nodes did not remove sluice in time: run `sluice uninstall` on each"
        );
    }
    Ok(())
}

/// Prints what the agent answered; its errors become ours.
fn print_agent(resp: Response) -> anyhow::Result<()> {
    match resp {
        Response::Enrolled {
            uid,
            cookie,
            state,
            note,
        } => {
            println!("enrolled pod {uid} via the agent (netns cookie {cookie}): {state}");
            if let Some(n) = note {
                println!("  {n}");
            }
            Ok(())
        }
        Response::Unenrolled { uid } => {
            println!("unenrolled pod {uid} via the agent");
            Ok(())
        }
        Response::Skipped { reason } => {
            println!("not enrolled: {reason}");
            Ok(())
        }
        Response::Error { message } | Response::Refused { message } => {
            Err(anyhow::anyhow!(message))
        }
        other @ (Response::Node(_) | Response::Uninstalling) => Err(anyhow::anyhow!(
            "unexpected answer from the agent: {other:?}"
        )),
    }
}

/// This process's netns as the node's, for commands that remove pods
/// without an agent: run on the node (as the agent's container is), it is
/// where the host side of the pods' veths is, and their host-side cls_bpf
/// filters (kernels without tcx) are removed there. Anywhere else it holds
/// no pod's peer and nothing is touched.
fn this_netns_as_node() -> Option<sluice::hostside::Node> {
    sluice::hostside::Node::open(std::path::Path::new("/proc/self/ns/net")).ok()
}

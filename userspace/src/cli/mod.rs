//! The `sluice` command line: the parser, the global options and one module
//! per subcommand (its flags and what it does). `main.rs` only calls [`main`].

mod agent;
mod check_node;
mod common;
mod enroll;
mod features;
mod register;
mod status;
mod unenroll;
mod uninstall;
mod uninstall_cluster;
mod uninstall_cni;
mod watchdog;

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};

use common::{Globals, LogFormat};

use crate::{control::DEFAULT_CONTROL_SOCKET, dataplane::loader::DEFAULT_ROOT};

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "eBPF redirection dataplane for Istio ambient mode"
)]
pub struct Cli {
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
    /// Parse the command line and exit without running it (status 0: it
    /// parses; 2: it does not, with clap's reason): the install's dry run,
    /// as `cargo xtask check-deploy` runs every command the chart renders.
    #[arg(long, global = true)]
    check_args: bool,
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the agent's many flags making its variant large
// cost nothing worth a Box.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub enum Command {
    /// Capture a pod netns: attach the programs and register ztunnel's
    /// listeners if they exist (else the pod stays Pending: fail closed).
    Enroll(enroll::Args),
    /// Register ztunnel's listeners for an enrolled pod (after ztunnel (re)started).
    Register(register::Args),
    /// Remove a pod's capture entirely: links, pins, routes and map entries.
    Unenroll(unenroll::Args),
    /// Show the node (condition, ztunnel; from the agent if one runs) and the
    /// enrolled pods (from the pinned maps; no daemon needed).
    Status(status::Args),
    /// Remove sluice from this node: sluice-cni from the CNI config and bin
    /// dir, every pod's capture (pods keep working, uncaptured), all pins.
    /// Through the running agent when there is one (it also clears its node
    /// condition and this node's pod annotations), else directly.
    Uninstall(uninstall::Args),
    /// The Helm pre-delete hook: marks the agents' DaemonSet for uninstall,
    /// waits until every node running an agent has removed sluice (its node
    /// condition gone), then clears sluice's annotations, readiness-gate
    /// conditions, node conditions and taints across the cluster.
    UninstallCluster(uninstall_cluster::Args),
    /// Run the node agent: serve ZDS to ztunnel and enroll pods through it.
    Agent(agent::Args),
    /// Mark the node condition False (AgentNotRunning) when the agent stops
    /// answering /readyz: covers agent crashes. Runs beside the agent.
    Watchdog(watchdog::Args),
    /// Remove sluice-cni from the node's CNI config and bin dir (when sluice
    /// is being removed from the node, not on an agent restart).
    UninstallCni(uninstall_cni::Args),
    /// Probe the kernel features the dataplane uses and print them on one
    /// line (the probe the agent runs; no pins, no agent). With --require,
    /// exit 1 when one sluice cannot run without is missing.
    Features(features::Args),
    /// Say what would stop or weaken sluice on this node before installing
    /// it (kernel, bpffs, the CNI config, other tools' qdiscs on host veths,
    /// istio-cni, Cilium's settings). Exit 0: nothing; 2: warnings; 1: a
    /// failure. Changes nothing.
    CheckNode(check_node::Args),
}

/// The whole command: parses the command line and runs it; an error is one
/// line on stderr (`sluice: …`) and exit status 1.
pub fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sluice: {}", crate::one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// Runs one parsed command line: the global options, then the subcommand.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    if cli.check_args {
        println!("sluice: the command line parses");
        return Ok(ExitCode::SUCCESS);
    }
    crate::podnet::sysctl::use_proc_dir(&cli.proc_dir);
    let g = Globals {
        pins: crate::dataplane::loader::Pins::new(&cli.bpf_root),
        control_socket: cli.control_socket,
        log_format: cli.log_format,
    };
    match cli.command {
        Command::Enroll(args) => enroll::run(g, args)?,
        Command::Register(args) => register::run(g, args)?,
        Command::Unenroll(args) => unenroll::run(g, args)?,
        Command::Status(args) => status::run(g, args)?,
        Command::Uninstall(args) => uninstall::run(g, args)?,
        Command::UninstallCluster(args) => uninstall_cluster::run(g, args)?,
        Command::Agent(args) => agent::run(g, args)?,
        Command::Watchdog(args) => watchdog::run(g, args)?,
        Command::UninstallCni(args) => uninstall_cni::run(g, args)?,
        Command::Features(args) => return Ok(features::run(args)),
        Command::CheckNode(args) => return check_node::run(g, args),
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn check_args_parses_and_runs_nothing() {
        let ok = ["sluice", "--check-args", "agent", "--pending-grace=1m30s"];
        let cli = Cli::try_parse_from(ok).unwrap();
        assert!(cli.check_args);
        // An agent would need root, bpffs and a node: it is not started.
        assert_eq!(run(cli).unwrap(), ExitCode::SUCCESS);
        let bad = ["sluice", "--check-args", "agent", "--pending-grace=10"];
        assert!(Cli::try_parse_from(bad).is_err());
        // The chart's extraArgs come last and may repeat a flag it set.
        let again = ["sluice", "agent", "--orphan-grace=30s", "--orphan-grace=1m"];
        assert!(Cli::try_parse_from(again).is_ok());
    }

    #[test]
    fn features_takes_require_and_the_output_format() {
        let cli = Cli::try_parse_from(["sluice", "features", "--require", "-o", "json"]).unwrap();
        let Command::Features(args) = cli.command else {
            panic!("not parsed as features");
        };
        assert!(args.require);
        assert_eq!(args.output, common::Output::Json);
        let cli = Cli::try_parse_from(["sluice", "features"]).unwrap();
        let Command::Features(args) = cli.command else {
            panic!("not parsed as features");
        };
        assert!(!args.require);
        assert_eq!(args.output, common::Output::Table);
    }
}

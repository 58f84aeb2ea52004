//! What several subcommands share: the global options once parsed, the
//! flattened flag groups (CNI directories, the node condition's type), the
//! duration parser, logging and runtime setup, and printing the agent's answers.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Context as _;
use clap::ValueEnum;

use crate::{
    cni::install, control::Response, dataplane::loader::Pins, podnet::hostside,
    readiness::DEFAULT_CONDITION_TYPE,
};

/// The global options every subcommand runs with.
pub struct Globals {
    pub pins: Pins,
    pub control_socket: PathBuf,
    pub log_format: LogFormat,
}

#[derive(clap::Args)]
pub struct CniDirs {
    /// The node's CNI config directory.
    #[arg(long, default_value = install::DEFAULT_CONF_DIR, env = "SLUICE_CNI_CONF_DIR")]
    cni_conf_dir: PathBuf,
    /// The node's CNI plugin directory.
    #[arg(long, default_value = install::DEFAULT_BIN_DIR, env = "SLUICE_CNI_BIN_DIR")]
    cni_bin_dir: PathBuf,
    /// Write sluice's own conflist, sorting before the primary's, instead of
    /// editing the primary's file (istio-cni's `istioOwnedCNIConfig`). On by
    /// default: a primary CNI that rewrites its file at boot cannot drop
    /// sluice-cni from the chain the runtime reads.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "SLUICE_OWNED_CNI_CONFIG")]
    owned_cni_config: bool,
    /// The owned conflist's file name; it must sort before the primary's.
    #[arg(long, default_value = install::owned_default(), env = "SLUICE_OWNED_CNI_CONFIG_FILENAME")]
    owned_cni_config_filename: install::FileName,
}

impl CniDirs {
    pub fn install(self, agent_socket: &Path) -> anyhow::Result<install::CniInstall> {
        let exe = std::env::current_exe().context("locating the sluice binary")?;
        let mut i = install::CniInstall::new(
            self.cni_conf_dir,
            self.cni_bin_dir,
            exe.with_file_name(install::PLUGIN_TYPE),
            agent_socket.to_owned(),
        );
        i.owned = self
            .owned_cni_config
            .then_some(self.owned_cni_config_filename);
        Ok(i)
    }
}

#[derive(clap::Args)]
pub struct ReadinessArgs {
    /// The node condition's type (True = this node can enroll pods).
    #[arg(long, default_value = DEFAULT_CONDITION_TYPE, env = "SLUICE_CONDITION_TYPE")]
    pub condition_type: String,
}

/// "500ms", "10s", "2m", "1m30s", "1h": a number and a unit, repeated
/// (humantime's forms). A bare number is refused: its unit would be a guess.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{s:?}: add a unit (ms, s, m, h), e.g. {s}s"));
    }
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?}: {e} (expected e.g. 500ms, 10s, 1m30s, 1h)"))
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Auto,
    Text,
    Json,
}

/// `-o`/`--output` of the commands that print a report.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

pub fn init_tracing(format: LogFormat) {
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

pub fn current_thread_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")
}

/// Connects to the Kubernetes API the way `kube` finds it.
pub async fn kube_client() -> anyhow::Result<kube::Client> {
    kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or KUBECONFIG)")
}

/// Prints what the agent answered; its errors become ours.
pub fn print_agent(resp: Response) -> anyhow::Result<()> {
    match resp {
        Response::Enrolled {
            uid,
            cookie,
            state,
            note,
        } => {
            let state = state.map_or("Unknown", sluice_common::PodState::as_str);
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
        other @ Response::More(_) => Err(anyhow::anyhow!(
            "unexpected answer from the agent: {other:?}"
        )),
    }
}

/// This process's netns as the node's, for commands that remove pods
/// without an agent: run on the node (as the agent's container is), it is
/// where the host side of the pods' veths is, and their host-side cls_bpf
/// filters (kernels without tcx) are removed there. Anywhere else it holds
/// no pod's peer and nothing is touched.
pub fn this_netns_as_node() -> Option<hostside::Node> {
    hostside::Node::open(Path::new("/proc/self/ns/net")).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_the_usual_forms_and_refuse_a_bare_number() {
        for (s, want) in [
            ("500ms", Duration::from_millis(500)),
            ("10s", Duration::from_secs(10)),
            ("2m", Duration::from_secs(120)),
            ("1m30s", Duration::from_secs(90)),
            ("1h", Duration::from_secs(3600)),
            ("0s", Duration::ZERO),
        ] {
            assert_eq!(parse_duration(s), Ok(want), "{s}");
        }
        for bad in ["", "10", "ten seconds", "5x", "-1s"] {
            let e = parse_duration(bad).unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
    }
}

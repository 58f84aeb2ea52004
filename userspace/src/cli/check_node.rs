//! `sluice check-node`: what would stop or weaken sluice on this node,
//! before it is installed (`preflight`). Exit 0: nothing; 2: warnings only;
//! 1: a failure. Changes nothing; run it as root, as the agent runs.

use std::{path::PathBuf, process::ExitCode};

use super::common::{CniDirs, Globals, Output};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    cni: CniDirs,
    /// The netns whose veths are the pods' host sides (the node's).
    #[arg(long, default_value = "/proc/self/ns/net")]
    node_netns: PathBuf,
    /// The ZDS socket ztunnel connects to (another node agent listening
    /// there is reported).
    #[arg(long, default_value = crate::agent::DEFAULT_ZDS_SOCKET)]
    zds_socket: PathBuf,
    /// `table`: one line per finding; `json`: the findings and the status.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
    output: Output,
}

pub fn run(g: Globals, args: Args) -> anyhow::Result<ExitCode> {
    let cni = args.cni.install(&g.control_socket)?;
    let features = crate::dataplane::features::Features::get();
    let findings = crate::preflight::run(&crate::preflight::Node {
        features: &features,
        bpf_root: g.pins.root(),
        cni: &cni,
        node_netns: &args.node_netns,
        zds_socket: &args.zds_socket,
        proc: std::path::Path::new("/proc"),
    });
    let status = crate::preflight::status(&findings);
    match args.output {
        Output::Table => {
            for f in &findings {
                println!("{:<5} {:<12} {}", f.level.to_string(), f.check, f.detail);
            }
        }
        Output::Json => println!(
            "{}",
            serde_json::json!({ "findings": findings, "status": status })
        ),
    }
    Ok(ExitCode::from(status))
}

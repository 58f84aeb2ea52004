//! The `sluice` command.

use std::{path::PathBuf, process::ExitCode};

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use sluice::{
    enroll,
    loader::{Dataplane, Pins, DEFAULT_ROOT},
    state::Maps,
    status,
    uid::PodUid,
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
    #[command(subcommand)]
    cmd: Cmd,
}

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
    /// Show enrolled pods from the pinned maps (no daemon needed).
    Status {
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Unenroll every pod and remove all of sluice's pins from this node.
    Uninstall,
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
            eprintln!("sluice: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, without repeating a cause that a
/// message already quotes.
fn one_line(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !msg.contains(&c) {
            msg.push_str(": ");
            msg.push_str(&c);
        }
    }
    msg.replace('\n', " ")
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let pins = Pins::new(&cli.bpf_root);
    match cli.cmd {
        Cmd::Enroll { netns, uid } => {
            let uid = PodUid::new(&uid)?;
            let mut dp = Dataplane::load_or_adopt(pins)?;
            let e = enroll::enroll(&mut dp, &netns, &uid)?;
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
            anyhow::ensure!(
                pins.is_loaded(),
                "no enrolled pod has uid {uid} (sluice is not loaded on this node)"
            );
            let mut maps = Maps::open_pinned(&pins.maps()).context("opening pinned maps")?;
            enroll::unenroll(&pins, &mut maps, &uid)?;
            println!("unenrolled pod {uid}");
        }
        Cmd::Status { output } => {
            let pods = status::read(&pins)?;
            match output {
                Output::Table => print!("{}", status::table(&pods)),
                Output::Json => println!("{}", status::json(&pods)),
            }
        }
        Cmd::Uninstall => {
            let n = enroll::uninstall(&pins)?;
            println!("removed sluice from this node ({n} pods unenrolled)");
        }
    }
    Ok(())
}

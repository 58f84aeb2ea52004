//! `sluice uninstall`: remove sluice from this node (sluice-cni, every pod's
//! capture, all pins), through the running agent when there is one.

use std::{path::Path, time::Duration};

use super::common::{this_netns_as_node, CniDirs, Globals};
use crate::control::{self, NodeAnswer, Request, Response};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    cni: CniDirs,
}

pub fn run(g: Globals, args: Args) -> anyhow::Result<()> {
    let Globals {
        pins,
        control_socket,
        ..
    } = g;
    if let Some(resp) = control::call(&control_socket, Some(pins.root()), &Request::Uninstall)? {
        return via_agent(&control_socket, pins.root(), resp);
    }
    args.cni.install(&control_socket)?.uninstall()?;
    let n = crate::podnet::enroll::uninstall(&pins, this_netns_as_node().as_ref())?;
    println!("removed sluice from this node ({n} pods unenrolled; sluice-cni removed)");
    Ok(())
}

/// Waits for the agent's uninstall to finish (read from its status).
fn via_agent(socket: &Path, root: &Path, first: Response) -> anyhow::Result<()> {
    if let Response::Error { message } | Response::Refused { message } = first {
        anyhow::bail!(message);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    while std::time::Instant::now() < deadline {
        if let Ok(Some(Response::More(NodeAnswer::Node(n)))) =
            control::call(socket, Some(root), &Request::Status)
        {
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

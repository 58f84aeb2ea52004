//! `sluice uninstall-cni`: take sluice-cni out of the node's CNI config and
//! bin dir (when sluice leaves the node, not on an agent restart).

use super::common::{CniDirs, Globals};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    cni: CniDirs,
}

pub fn run(g: Globals, args: Args) -> anyhow::Result<()> {
    args.cni.install(&g.control_socket)?.uninstall()?;
    println!("removed sluice-cni from the node's CNI config");
    Ok(())
}

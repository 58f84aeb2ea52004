//! `sluice register`: find ztunnel's listeners again for a pod already
//! enrolled (after ztunnel (re)started), without an agent.

use super::common::Globals;
use crate::{dataplane::loader::Dataplane, uid::PodUid};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    uid: String,
}

pub fn run(g: Globals, args: Args) -> anyhow::Result<()> {
    let uid = PodUid::new(&args.uid)?;
    let mut dp = Dataplane::load_or_adopt(g.pins)?;
    let e = crate::podnet::enroll::register_uid(&mut dp, &uid)?;
    println!(
        "pod {uid}: {} ({} of 3 listeners)",
        e.state.as_str(),
        e.roles.len()
    );
    Ok(())
}

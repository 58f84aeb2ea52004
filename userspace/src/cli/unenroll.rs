//! `sluice unenroll`: remove one pod's capture entirely (links, pins, routes,
//! map entries), through the running agent or, with none, on the pins directly.

use anyhow::Context as _;

use super::common::{print_agent, this_netns_as_node, Globals};
use crate::{
    control::{self, Request},
    dataplane::state::Maps,
    uid::PodUid,
};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    uid: String,
}

pub fn run(g: Globals, args: Args) -> anyhow::Result<()> {
    let Globals {
        pins,
        control_socket,
        ..
    } = g;
    let uid = PodUid::new(&args.uid)?;
    let req = Request::Unenroll {
        uid: uid.to_string(),
    };
    if let Some(resp) = control::call(&control_socket, Some(pins.root()), &req)? {
        return print_agent(resp);
    }
    anyhow::ensure!(
        pins.is_loaded(),
        "no enrolled pod has uid {uid} (sluice is not loaded on this node)"
    );
    let mut maps = Maps::open_pinned(&pins.maps()).context("opening pinned maps")?;
    crate::podnet::enroll::unenroll(&pins, &mut maps, this_netns_as_node().as_ref(), &uid)?;
    println!("unenrolled pod {uid}");
    Ok(())
}

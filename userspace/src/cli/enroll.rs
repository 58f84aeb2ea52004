//! `sluice enroll`: capture one pod's netns, through the running agent (which
//! also tells ztunnel) or, with none, on the pins directly.

use std::path::PathBuf;

use super::common::{print_agent, Globals};
use crate::{
    control::{self, Request},
    dataplane::loader::Dataplane,
    uid::PodUid,
    workload::Workload,
};

#[derive(clap::Args)]
pub struct Args {
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
}

pub fn run(g: Globals, args: Args) -> anyhow::Result<()> {
    let Args {
        netns,
        uid,
        name,
        namespace,
        service_account,
    } = args;
    let uid = PodUid::new(&uid)?;
    let name = name.unwrap_or_else(|| uid.to_string());
    let workload = Workload::new(&name, &namespace, &service_account)?;
    let req = Request::Enroll {
        netns: netns.clone(),
        uid: uid.to_string(),
        workload: workload.clone(),
    };
    if let Some(resp) = control::call(&g.control_socket, Some(g.pins.root()), &req)? {
        return print_agent(resp);
    }
    let mut dp = Dataplane::load_or_adopt(g.pins)?;
    let e = crate::podnet::enroll::enroll(&mut dp, &netns, &uid, &workload)?;
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
    Ok(())
}

//! `sluice status`: the node (from the agent, if one answers) and the enrolled
//! pods (from the pinned maps), or one pod end to end with `--pod`.

use std::time::Duration;

use super::common::{Globals, Output};
use crate::{
    control::{self, NodeAnswer, Request, Response},
    status::explain,
    status::{self, NodeView},
};

#[derive(clap::Args)]
pub struct Args {
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
    output: Output,
    /// One pod end to end (NAMESPACE/NAME or its uid): captured or why
    /// not, state, ztunnel's listeners, links, addresses, options,
    /// counters, and what is missing before it is fully enrolled.
    #[arg(long)]
    pod: Option<String>,
}

pub fn run(g: Globals, args: Args) -> anyhow::Result<()> {
    let Args { output, pod } = args;
    let pins = g.pins;
    let pods = status::read(&pins)?;
    // The pods come from the pins whatever the agent says.
    let asked = control::call_within(
        &g.control_socket,
        Some(pins.root()),
        &Request::Status,
        Duration::from_secs(3),
    );
    let (agent, agent_error) = match asked {
        Ok(None) => (None, None),
        Ok(Some(Response::More(NodeAnswer::Node(n)))) => (Some(n), None),
        Ok(Some(Response::Error { message })) => (None, Some(message)),
        Ok(Some(other)) => (None, Some(format!("unexpected answer: {other:?}"))),
        Err(e) => (None, Some(crate::one_line(&e))),
    };
    let node = NodeView {
        programs_loaded: pins.is_loaded(),
        kernel: crate::dataplane::features::describe(),
        stamp: crate::dataplane::stamp::read(&pins.maps()).map(|s| s.to_string()),
        agent,
        agent_error,
    };
    if let Some(query) = pod {
        let Some(e) = explain::explain(&query, &pods, node.agent.as_ref()) else {
            let agent = if node.agent.is_some() {
                "nor does the agent's last reconcile with the API list it"
            } else {
                "and no agent answered to say whether it should be"
            };
            anyhow::bail!("pod {query} is not enrolled on this node, {agent}");
        };
        match output {
            Output::Table => print!("{}", explain::render(&e, node.agent.is_some())),
            Output::Json => println!("{}", serde_json::to_string_pretty(&e)?),
        }
        return Ok(());
    }
    match output {
        Output::Table => print!(
            "{}\n{}",
            status::node_lines(&node),
            status::table(&pods, node.agent.as_ref())
        ),
        Output::Json => println!("{}", status::json(&node, &pods)),
    }
    Ok(())
}

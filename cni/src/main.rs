//! `sluice-cni`: the chained CNI plugin. Reads the network config on stdin and
//! the `CNI_*` environment, asks the sluice agent, prints the result (or a CNI
//! error object) on stdout.

use std::{io::Read, process::ExitCode};

use sluice_cni::{
    plugin,
    spec::{Env, NetConf},
    wire,
};

fn main() -> ExitCode {
    let mut stdin = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut stdin);
    let version = NetConf::parse(&stdin)
        .map(|c| c.cni_version)
        .unwrap_or_else(|_| "1.0.0".into());
    let result = Env::from_vars(|k| std::env::var(k).ok())
        .and_then(|env| plugin::run(&env, &stdin, &wire::call));
    match result {
        Ok(out) => {
            if let Some(out) = out {
                println!("{out}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("{}", e.to_json(&version));
            ExitCode::FAILURE
        }
    }
}

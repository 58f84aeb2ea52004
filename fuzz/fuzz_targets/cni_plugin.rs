//! The CNI plugin as a runtime invokes it: the command, CNI_ARGS and the
//! network config on stdin (prevResult included) come from the input, the
//! agent's answer too. Whatever they are, the plugin answers with JSON or a
//! spec-shaped error, never a panic.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use sluice_cni::{
    plugin,
    spec::Env,
    wire::{Answer, PluginRequest},
};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    // CNI_ARGS, then NUL, then stdin.
    let (args, stdin) = match rest.iter().position(|&b| b == 0) {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (&[][..], rest),
    };
    let command = ["ADD", "DEL", "CHECK", "VERSION"][usize::from(selector & 3)];
    let args = String::from_utf8_lossy(args).into_owned();
    let vars = [
        ("CNI_COMMAND", command.to_string()),
        ("CNI_CONTAINERID", "c0ffee".into()),
        ("CNI_NETNS", "/nonexistent/netns".into()),
        ("CNI_IFNAME", "eth0".into()),
        ("CNI_ARGS", args),
    ];
    let env = match Env::from_vars(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())) {
        Ok(e) => e,
        Err(e) => {
            assert!(serde_json::from_str::<serde_json::Value>(&e.to_json("1.0.0")).is_ok());
            return;
        }
    };
    let answer = selector >> 2;
    let call = |_: &Path, _: &PluginRequest| -> anyhow::Result<Option<Answer>> {
        Ok(match answer % 5 {
            0 => None,
            1 => Some(Answer::Skipped {
                reason: "not ambient".into(),
            }),
            2 => Some(Answer::Error {
                message: "boom".into(),
            }),
            3 => Some(Answer::Refused {
                message: "forged".into(),
            }),
            _ => return Err(anyhow::anyhow!("connection reset")),
        })
    };
    match plugin::run(&env, stdin, &call) {
        Ok(Some(out)) => {
            serde_json::from_str::<serde_json::Value>(&out).expect("the plugin prints JSON");
        }
        Ok(None) => {}
        Err(e) => {
            serde_json::from_str::<serde_json::Value>(&e.to_json("1.0.0"))
                .expect("errors are JSON");
        }
    }
});

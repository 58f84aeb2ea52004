//! sluice: an eBPF redirection dataplane for Istio ambient mode.
//!
//! Data path, in the order a pod meets it: [`dataplane::loader`] (programs and maps, once
//! per node) → [`podnet::enroll`] (per pod: links, routes, state) → [`podnet::sockets`]
//! (ztunnel's listeners into the socket map) → [`dataplane::state`] (the pinned maps that
//! `status` reads). The `sluice` command's parser and subcommands are
//! [`cli`].

pub mod accept_errors;
pub mod agent;
pub mod cli;
pub mod cni;
pub mod control;
pub mod dataplane;
pub mod exclusions;
pub mod fault;
pub mod kube;
pub mod lifecycle;
pub mod metrics;
pub mod options;
pub mod podnet;
pub mod preflight;
pub mod readiness;
pub mod served;
pub mod status;
pub mod uid;
pub mod unixsock;
pub mod watchdog;
pub mod workload;
pub mod zds;

/// An error and its causes on one line, without repeating a cause that a
/// message already quotes (typed errors here often embed their source).
pub fn one_line(e: &anyhow::Error) -> String {
    error_line(e.as_ref())
}

/// [`one_line`] for any error type.
pub fn error_line(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let c_msg = c.to_string();
        if !msg.contains(&c_msg) {
            msg.push_str(": ");
            msg.push_str(&c_msg);
        }
        cause = c.source();
    }
    msg.replace('\n', " ")
}

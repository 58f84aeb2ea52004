//! `sluice status`: what the pinned maps say, as a table or JSON. Needs no
//! running daemon: a fresh process opens the pins and reads. The node-level
//! lines (condition, ztunnel) come from the agent when one runs.

pub mod explain;

use std::fmt::Write as _;

use serde::Serialize;
use sluice_common::PodState;

use crate::{
    control::{IncompletePod, NodeStatus, PodVerification, ServedCheck, VerifyOutcome},
    dataplane::loader::Pins,
    dataplane::state::{boottime_ns, Maps, PodRecord},
};

/// The node as `status` shows it: `agent` is `None` when no agent answered,
/// and `agent_error` says why when one listens but did not answer.
#[derive(Debug, Clone, Serialize)]
pub struct NodeView {
    pub programs_loaded: bool,
    /// The kernel release and the features the dataplane uses (probed).
    pub kernel: String,
    /// Which build pinned the dataplane (version, map layout digest), from
    /// the pinned stamp; `None` for a build from before stamps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stamp: Option<String>,
    pub agent: Option<NodeStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_error: Option<String>,
}

/// Everything `status -o json` prints.
#[derive(Debug, Serialize)]
pub struct Status<'a> {
    pub node: &'a NodeView,
    pub pods: &'a [PodRecord],
}

/// The lines above the pod table.
pub fn node_lines(n: &NodeView) -> String {
    let mut out = String::new();
    let loaded = if n.programs_loaded {
        "loaded"
    } else {
        "not loaded"
    };
    let _ = writeln!(out, "programs:   {loaded}");
    let _ = writeln!(out, "kernel:     {}", n.kernel);
    if let Some(s) = &n.stamp {
        let _ = writeln!(out, "stamp:      {s}");
    }
    match (&n.agent, &n.agent_error) {
        (None, Some(e)) => {
            let _ = writeln!(out, "agent:      not answering ({e})");
        }
        (None, None) => {
            let _ = writeln!(
                out,
                "agent:      not running (no node condition; ztunnel connection unknown)"
            );
        }
        (Some(a), _) => {
            let _ = writeln!(out, "agent:      running");
            if !a.dataplane.is_empty() {
                let _ = writeln!(out, "dataplane:  {}", a.dataplane);
            }
            if !a.probes.is_empty() {
                let _ = writeln!(out, "probes:     {}", a.probes);
            }
            if let Some(t) = a.tc_attach {
                let _ = writeln!(out, "tc attach:  {}", t.as_str());
            }
            let zt = if a.ztunnel_connected {
                "connected"
            } else {
                "not connected"
            };
            let procs: Vec<String> = a
                .ztunnels
                .iter()
                .map(|z| {
                    let conn = if z.connected { "" } else { ", disconnected" };
                    let check = match &z.served_check {
                        ServedCheck::NotAsked | ServedCheck::Off => String::new(),
                        ServedCheck::Answering => ", workloads readable".into(),
                        ServedCheck::Failing { error } => {
                            format!(", workloads unreadable ({error})")
                        }
                        ServedCheck::AcksCountAsServed { error } => {
                            format!(", acks count as served: workloads unreadable ({error})")
                        }
                    };
                    format!(
                        "pid {} owns listeners of {} pods{conn}{check}",
                        z.pid, z.pods
                    )
                })
                .collect();
            if procs.is_empty() {
                let _ = writeln!(out, "ztunnel:    {zt}");
            } else {
                let _ = writeln!(out, "ztunnel:    {zt} ({})", procs.join("; "));
            }
            let check = match a.served_check {
                crate::served::Mode::Auto => "ztunnel's admin API (config_dump workloads)",
                crate::served::Mode::Off => "off (--served-check=off: ztunnel's ack counts)",
            };
            let _ = writeln!(out, "served:     {check}");
            if let Some(cni) = &a.cni {
                let _ = writeln!(out, "cni:        {cni}");
            }
            for w in &a.waiting {
                let _ = writeln!(out, "retrying:   {}: {}", w.uid, w.last_error);
            }
            for i in &a.incomplete {
                let _ = writeln!(out, "incomplete: {}: {}", i.uid, incomplete_line(i));
            }
            match &a.condition {
                Some(c) => {
                    let _ = writeln!(
                        out,
                        "condition:  {}={} reason={}: {}",
                        a.condition_type,
                        c.status(),
                        c.reason.as_str(),
                        c.message
                    );
                }
                None => {
                    let _ = writeln!(out, "condition:  {} not computed yet", a.condition_type);
                }
            }
        }
    }
    out
}

/// Reads every enrolled pod from the pins, with its pinned links; no pins
/// means no pods.
pub fn read(pins: &Pins) -> Result<Vec<PodRecord>, crate::dataplane::state::StateError> {
    if !pins.maps().join("pod_state").exists() {
        return Ok(Vec::new());
    }
    let mut pods = Maps::open_pinned(&pins.maps())?.pods();
    for p in &mut pods {
        p.links = pinned_links(pins, p.netns_cookie);
    }
    Ok(pods)
}

/// The names of a pod's pinned links (`pods/<cookie>/…`), sorted.
fn pinned_links(pins: &Pins, cookie: u64) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(pins.pod(cookie))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// A pod's links by hook: `sk_lookup eth0:in,out,host lo:in` (a
/// `reroute_<if>` link is that interface's `reroute`).
pub fn links_summary(links: &[String]) -> String {
    let mut by_if: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    let mut out = Vec::new();
    for l in links {
        match l.as_str() {
            "steer" => out.push("sk_lookup".to_string()),
            "lo" => by_if.entry("lo").or_default().push("in"),
            other => {
                let (hook, dev) = other.split_once('_').unwrap_or((other, "?"));
                let hook = match hook {
                    "egress" => "out",
                    "ingress" => "in",
                    h => h,
                };
                by_if.entry(dev).or_default().push(hook);
            }
        }
    }
    for (dev, mut hooks) in by_if {
        hooks.sort();
        out.push(format!("{dev}:{}", hooks.join(",")));
    }
    if out.is_empty() {
        "-".into()
    } else {
        out.join(" ")
    }
}

/// Which of ztunnel's sockets the pod has (any family), as
/// `15001/15006/15008/dns` with `-` for each missing one.
pub fn listeners_summary(listeners: &[String]) -> String {
    let has = |role: &str| listeners.iter().any(|l| l.starts_with(role));
    let part = |role: &str, label: &'static str| if has(role) { label } else { "-" };
    [
        part("outbound/", "15001"),
        part("inbound/", "15006"),
        part("hbone/", "15008"),
        part("dns-", "dns"),
    ]
    .join("/")
}

/// `namespace/name`, or `-` for a pod recorded without its workload.
pub fn pod_name(p: &PodRecord) -> String {
    p.workload
        .as_ref()
        .map_or("-".into(), |w| format!("{}/{}", w.namespace, w.name))
}

pub(crate) fn age(ns: u64, now: u64) -> String {
    let s = now.saturating_sub(ns) / 1_000_000_000;
    match s {
        0..=119 => format!("{s}s"),
        120..=7199 => format!("{}m", s / 60),
        _ => format!("{}h", s / 3600),
    }
}

/// Whether ztunnel can serve the pod: "yes (verified 12s ago)", "no
/// (waiting 12s)" for a steering pod ztunnel does not know, "no (not
/// verified yet)" or "no (unverified: CASE)" for one whose capture has not
/// passed a verification yet or failed its last one, "-"
/// for a pod not steering. `v`: the agent's last verification of the pod
/// (`None` without an agent: plain "yes").
fn served(p: &PodRecord, now: u64, v: Option<&PodVerification>) -> String {
    match (p.state, v) {
        (Some(PodState::Served), None) => "yes".into(),
        (Some(PodState::Served), Some(v)) => match v.outcome {
            VerifyOutcome::Failed => format!("no (unverified: {})", v.case),
            // The readiness gate stays `False` until the first verification
            // passes: the column says the same.
            VerifyOutcome::NotYet => "no (not verified yet)".into(),
            VerifyOutcome::Verified => format!("yes (verified {} ago)", ago(v)),
            VerifyOutcome::Partial => format!("yes (verified in part {} ago)", ago(v)),
        },
        (Some(PodState::Enabled), _) => format!("no ({})", age(p.changed_at_ns, now)),
        _ => "-".into(),
    }
}

fn ago(v: &PodVerification) -> String {
    let s = v.age_s.unwrap_or(0) * 1_000_000_000;
    age(0, s)
}

/// The verification line of a pod: what it found, and how long ago.
pub fn verification_line(v: &PodVerification) -> String {
    match v.outcome {
        VerifyOutcome::NotYet => "not verified yet".into(),
        VerifyOutcome::Verified => format!("verified {} ago: every case passed", ago(v)),
        VerifyOutcome::Partial => format!(
            "verified in part {} ago (only looked at: {})",
            ago(v),
            v.case
        ),
        VerifyOutcome::Failed => format!(
            "FAILED {} ago: {}: {}; its traffic may bypass ztunnel",
            ago(v),
            v.case,
            v.detail
        ),
    }
}

/// What a pod with an incomplete capture lacks, and why, in one line.
pub fn incomplete_line(i: &IncompletePod) -> String {
    format!(
        "capture incomplete, lacks {} ({})",
        i.missing.join(", "),
        i.reason
    )
}

/// The human table. From the agent's report (`None`: no agent): the pods
/// it retries and why, those whose capture a repair could not complete
/// (the ERROR column), and its verifications (the SERVED column).
pub fn table(pods: &[PodRecord], agent: Option<&NodeStatus>) -> String {
    let waiting = agent.map_or(&[][..], |a| &a.waiting[..]);
    let incomplete = agent.map_or(&[][..], |a| &a.incomplete[..]);
    let verified = agent.map_or(&[][..], |a| &a.verifications[..]);
    let now = boottime_ns();
    let mut rows = vec![[
        "POD".to_string(),
        "UID".into(),
        "STATE".into(),
        "SERVED".into(),
        "SINCE".into(),
        "AGE".into(),
        "LISTENERS".into(),
        "DNS".into(),
        "LINKS".into(),
        "IN".into(),
        "HBONE".into(),
        "OUT".into(),
        "BYPASS".into(),
        "DROPPED".into(),
        "NO-SOCKET".into(),
        "ERROR".into(),
    ]];
    for p in pods {
        let c = &p.counters;
        let error = waiting
            .iter()
            .find(|w| w.uid == p.uid)
            .map(|w| w.last_error.clone())
            .or_else(|| {
                incomplete
                    .iter()
                    .find(|i| i.uid == p.uid)
                    .map(incomplete_line)
            })
            .unwrap_or_else(|| "-".into());
        rows.push([
            pod_name(p),
            p.uid.clone(),
            p.state.map_or("Unknown", PodState::as_str).into(),
            served(p, now, verified.iter().find(|v| v.uid == p.uid)),
            age(p.changed_at_ns, now),
            age(p.enrolled_at_ns, now),
            listeners_summary(&p.listeners),
            p.dns.mode.as_str().into(),
            links_summary(&p.links),
            c.captured_inbound.to_string(),
            c.captured_hbone.to_string(),
            c.captured_outbound.to_string(),
            c.bypassed.to_string(),
            c.dropped_fail_closed.to_string(),
            c.missing_socket.to_string(),
            error,
        ]);
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(v, w)| format!("{v:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    if pods.is_empty() {
        out.push_str("(no pods enrolled)\n");
    }
    out
}

/// The JSON form: `{"node": {...}, "pods": [...]}`.
pub fn json(node: &NodeView, pods: &[PodRecord]) -> String {
    serde_json::to_string_pretty(&Status { node, pods }).expect("status records always serialise")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_and_listeners_read_at_a_glance() {
        let links: Vec<String> = ["egress_eth0", "host_eth0", "ingress_eth0", "lo", "steer"]
            .map(String::from)
            .into();
        assert_eq!(links_summary(&links), "sk_lookup eth0:host,in,out lo:in");
        assert_eq!(links_summary(&[]), "-");
        let l: Vec<String> = ["hbone/ipv4", "outbound/ipv6", "dns-udp/ipv4"]
            .map(String::from)
            .into();
        assert_eq!(listeners_summary(&l), "15001/-/15008/dns");
    }
}

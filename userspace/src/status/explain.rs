//! `sluice status --pod NAMESPACE/NAME` (or a pod uid): one pod, end to end —
//! whether the agent captures it and if not why, its state, ztunnel's
//! sockets, its links and addresses, its options and counters, and what is
//! missing before it is fully enrolled. The pins answer for enrolled pods;
//! the agent, when one runs, adds why a pod is not captured and the last
//! error of one it retries.

use std::fmt::Write as _;

use serde::Serialize;
use sluice_common::{PodState, Role};

use crate::{
    control::{ExclusionNotice, NodeStatus, PodVerification, SkippedPod, VerifyOutcome},
    dataplane::state::{boottime_ns, PodRecord},
    status,
};

/// Where the pod stands, in the terms of "fully enrolled".
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Verdict {
    /// Captured, acked by ztunnel, and ztunnel serves it.
    FullyEnrolled,
    /// Served, but its capture has not been verified by running it yet:
    /// not fully enrolled (its readiness gate is False until it is).
    NotYetVerified,
    /// Captured and steering to ztunnel's listeners, but ztunnel does not
    /// know its workload from istiod yet.
    NotServed,
    /// Captured; its new connections fail closed until ztunnel takes it
    /// (`missing`: ztunnel's listeners not in the pod).
    WaitingForZtunnel { missing: Vec<String> },
    /// Enrolled, but its capture lacks links a repair could not attach
    /// (`missing`, for `reason`): part of its traffic bypasses ztunnel.
    CaptureIncomplete {
        missing: Vec<String>,
        reason: String,
    },
    /// Steering, but running its capture on synthetic packets did not give
    /// the captured verdicts (`case`, and what the kernel did instead): its
    /// traffic may bypass ztunnel; its readiness gate is False.
    CaptureUnverified { case: String, detail: String },
    /// Its capture is being removed.
    Draining,
    /// On this node, left uncaptured by the agent, for `reason`.
    NotCaptured { reason: String },
}

/// Everything `--pod` shows.
#[derive(Debug, Serialize)]
pub struct Explanation<'a> {
    #[serde(flatten)]
    pub verdict: Verdict,
    /// The pins' record, for an enrolled pod.
    pub pod: Option<&'a PodRecord>,
    /// The agent's last error for a pod it retries.
    pub last_error: Option<&'a str>,
    /// The agent's last verification of the pod's capture.
    pub verification: Option<&'a PodVerification>,
    /// Why the pod's exclusion annotations are not in force as written.
    pub exclusion_notice: Option<&'a ExclusionNotice>,
}

/// Which pod `query` names: its uid, or `namespace/name`.
fn names(query: &str, uid: &str, namespace: &str, name: &str) -> bool {
    query == uid || query.split_once('/') == Some((namespace, name))
}

/// Explains the pod `query` names, from the enrolled `pods` and the agent's
/// report; `None` when neither knows it.
pub fn explain<'a>(
    query: &str,
    pods: &'a [PodRecord],
    agent: Option<&'a NodeStatus>,
) -> Option<Explanation<'a>> {
    let named = |p: &&PodRecord| {
        let (ns, name) = p
            .workload
            .as_ref()
            .map_or(("", ""), |w| (w.namespace.as_str(), w.name.as_str()));
        names(query, &p.uid, ns, name)
    };
    // By name, the pod of that name now over a predecessor still being
    // torn down (a StatefulSet's next pod).
    let pod = pods
        .iter()
        .filter(named)
        .min_by_key(|p| p.state == Some(PodState::Draining));
    let skipped: Option<&SkippedPod> = agent.and_then(|a| {
        a.skipped
            .iter()
            .find(|s| names(query, &s.uid, &s.namespace, &s.name))
    });
    let incomplete = pod.and_then(|p| {
        agent?
            .incomplete
            .iter()
            .find(|i| i.uid == p.uid && p.state != Some(PodState::Draining))
    });
    let verification = pod.and_then(|p| agent?.verifications.iter().find(|v| v.uid == p.uid));
    let steers = pod.is_some_and(|p| matches!(p.state, Some(PodState::Enabled | PodState::Served)));
    let failed = verification.filter(|v| steers && v.outcome == VerifyOutcome::Failed);
    let not_yet = verification.is_some_and(|v| v.outcome == VerifyOutcome::NotYet);
    let verdict = match (pod, skipped, incomplete) {
        (Some(_), _, Some(i)) => Verdict::CaptureIncomplete {
            missing: i.missing.clone(),
            reason: i.reason.clone(),
        },
        (Some(_), _, None) if failed.is_some() => {
            let v = failed.expect("checked");
            Verdict::CaptureUnverified {
                case: v.case.clone(),
                detail: v.detail.clone(),
            }
        }
        (Some(p), _, None) => match p.state {
            Some(PodState::Served) if not_yet => Verdict::NotYetVerified,
            Some(PodState::Served) => Verdict::FullyEnrolled,
            Some(PodState::Enabled) => Verdict::NotServed,
            Some(PodState::Draining) => Verdict::Draining,
            _ => Verdict::WaitingForZtunnel {
                missing: missing_listeners(p),
            },
        },
        (None, Some(s), _) => Verdict::NotCaptured {
            reason: s.reason.clone(),
        },
        (None, None, _) => return None,
    };
    let last_error = pod.and_then(|p| {
        agent?
            .waiting
            .iter()
            .find(|w| w.uid == p.uid)
            .map(|w| w.last_error.as_str())
    });
    let exclusion_notice =
        pod.and_then(|p| agent?.exclusion_notices.iter().find(|n| n.uid == p.uid));
    Some(Explanation {
        verdict,
        pod,
        last_error,
        verification,
        exclusion_notice,
    })
}

/// ztunnel's capture listeners the pod lacks (in every family).
fn missing_listeners(p: &PodRecord) -> Vec<String> {
    Role::ALL
        .iter()
        .filter(|r| {
            !p.listeners
                .iter()
                .any(|l| l.starts_with(&format!("{}/", r.as_str())))
        })
        .map(|r| format!("{} ({})", r.as_str(), r.port()))
        .collect()
}

/// The human form.
pub fn render(e: &Explanation, agent_running: bool) -> String {
    let mut out = String::new();
    let mut line = |k: &str, v: String| {
        let _ = writeln!(out, "{:<11} {v}", format!("{k}:"));
    };
    let verdict = match &e.verdict {
        Verdict::FullyEnrolled => "fully enrolled: captured, acked by ztunnel, served by it".into(),
        Verdict::NotYetVerified => "captured, acked and served, but its capture is not verified by running it yet: not fully enrolled (readiness gate False until it is)".into(),
        Verdict::NotServed => {
            "captured and steering to ztunnel, which does not know the workload yet (not served)"
                .into()
        }
        Verdict::WaitingForZtunnel { missing } if missing.is_empty() => {
            "captured, waiting for ztunnel's ack: new connections fail closed".into()
        }
        Verdict::WaitingForZtunnel { missing } => format!(
            "captured, waiting for ztunnel: new connections fail closed; missing listeners: {}",
            missing.join(", ")
        ),
        Verdict::CaptureIncomplete { missing, reason } => format!(
            "captured in part: lacks {} ({reason}); part of its traffic bypasses ztunnel",
            missing.join(", ")
        ),
        Verdict::CaptureUnverified { case, detail } => format!(
            "captured, but its capture failed verification: {case}: {detail}; its traffic may bypass ztunnel (readiness gate False; the agent repairs and verifies again)"
        ),
        Verdict::Draining => "capture being removed".into(),
        Verdict::NotCaptured { reason } => format!("not captured: {reason}"),
    };
    line("verdict", verdict);
    if let Some(err) = e.last_error {
        line("retrying", err.to_owned());
    }
    if let Some(v) = e.verification {
        line("verified", status::verification_line(v));
    }
    let Some(p) = e.pod else {
        return out;
    };
    let now = boottime_ns();
    line("pod", status::pod_name(p));
    line("uid", p.uid.clone());
    if let Some(w) = &p.workload {
        line("identity", format!("service account {}", w.service_account));
    }
    line(
        "state",
        format!(
            "{} for {} (enrolled {} ago)",
            p.state.map_or("Unknown", PodState::as_str),
            status::age(p.changed_at_ns, now),
            status::age(p.enrolled_at_ns, now)
        ),
    );
    line("netns", format!("{} (cookie {})", p.netns, p.netns_cookie));
    let addrs: Vec<String> = p.addresses.iter().map(ToString::to_string).collect();
    line("addresses", or_none(addrs.join(" ")));
    line(
        "listeners",
        format!(
            "{} ({})",
            status::listeners_summary(&p.listeners),
            or_none(p.listeners.join(" "))
        ),
    );
    line("links", status::links_summary(&p.links));
    line(
        "options",
        format!(
            "bypass-inbound-capture {}, reroute-virtual-interfaces {}, DNS {} (chosen by {})",
            if p.bypass_inbound { "yes" } else { "no" },
            or_none(p.reroute.join(",")),
            p.dns.mode.as_str(),
            p.dns.choice.as_str()
        ),
    );
    line(
        "tcp route",
        match p.local_route {
            Some(i) => format!("local (over lo; uncaptured flows leave by interface {i})"),
            None => "the interface's".into(),
        },
    );
    line("exclusions", exclusions_line(p));
    if let Some(n) = e.exclusion_notice {
        line(&format!("exclusions {}", n.kind), n.detail.clone());
    }
    let c = &p.counters;
    line(
        "counters",
        format!(
            "inbound {}, hbone {}, outbound {}, bypassed {}, dropped (fail closed) {}, no socket {}",
            c.captured_inbound,
            c.captured_hbone,
            c.captured_outbound,
            c.bypassed,
            c.dropped_fail_closed,
            c.missing_socket
        ),
    );
    let d = &p.dns;
    line(
        "dns",
        format!(
            "captured udp {}, tcp {}, passed through {}, answers restored {}, unmapped {}",
            d.captured_udp, d.captured_tcp, d.passthrough, d.replies_restored, d.replies_unmapped
        ),
    );
    if !agent_running {
        line(
            "agent",
            "not answering: retries and selection unknown".into(),
        );
    }
    out
}

/// The exclusions in force, in the annotations' syntax, and what they kept
/// out of capture.
fn exclusions_line(p: &PodRecord) -> String {
    let lines = p.exclusions.lines();
    if lines.is_empty() {
        return "none (all traffic captured)".into();
    }
    let listed: Vec<String> = lines.iter().map(|(a, v)| format!("{a}={v}")).collect();
    format!(
        "{} (bypassing ztunnel; connections excluded: inbound {}, outbound {})",
        listed.join(" "),
        p.excluded.inbound,
        p.excluded.outbound
    )
}

fn or_none(s: String) -> String {
    if s.is_empty() {
        "none".into()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::WaitingPod;

    fn record(state: &'static str, listeners: &[&str]) -> PodRecord {
        PodRecord {
            uid: "u-cart".into(),
            netns: "/run/netns/cart".into(),
            workload: crate::workload::Workload::new("cart", "shop", "cart-sa").ok(),
            netns_cookie: 7,
            state: PodState::from_name(state),
            served: state == "Served",
            generation: 1,
            enrolled_at_ns: 0,
            changed_at_ns: 0,
            listeners: listeners.iter().map(|s| s.to_string()).collect(),
            counters: Default::default(),
            dns: crate::dataplane::state::DnsView {
                mode: crate::dataplane::state::DnsMode::Off,
                choice: Default::default(),
                captured_udp: 0,
                captured_tcp: 0,
                passthrough: 0,
                replies_restored: 0,
                replies_unmapped: 0,
            },
            bypass_inbound: false,
            reroute: vec![],
            local_route: None,
            exclusions: Default::default(),
            excluded: Default::default(),
            addresses: vec![],
            links: vec![],
        }
    }

    #[test]
    fn a_served_pod_whose_capture_is_incomplete_is_not_fully_enrolled() {
        let served = [record("Served", &["inbound/ipv4"])];
        let mut agent = node(vec![], vec![]);
        agent.incomplete = vec![crate::control::IncompletePod {
            uid: "u-cart".into(),
            missing: vec!["egress_eth0".into()],
            reason: "another tool's qdisc holds the hook".into(),
        }];
        let e = explain("shop/cart", &served, Some(&agent)).unwrap();
        assert_eq!(
            e.verdict,
            Verdict::CaptureIncomplete {
                missing: vec!["egress_eth0".into()],
                reason: "another tool's qdisc holds the hook".into()
            }
        );
        let text = render(&e, true);
        assert!(text.contains("lacks egress_eth0"), "{text}");
    }

    /// The gate says "not verified yet" for a Served pod whose capture has
    /// not run yet; so does the verdict. By name, the pod of that name now
    /// is explained, not a predecessor being torn down.
    #[test]
    fn a_served_pod_not_yet_verified_is_not_fully_enrolled_and_a_name_finds_the_live_pod() {
        let mut old = record("Draining", &[]);
        old.uid = "u-old".into();
        let pods = [old, record("Served", &["inbound/ipv4"])];
        let mut agent = node(vec![], vec![]);
        agent.verifications = vec![PodVerification {
            uid: "u-cart".into(),
            outcome: VerifyOutcome::NotYet,
            case: String::new(),
            detail: String::new(),
            age_s: None,
        }];
        let e = explain("shop/cart", &pods, Some(&agent)).unwrap();
        assert_eq!(e.verdict, Verdict::NotYetVerified);
        assert!(render(&e, true).contains("not fully enrolled"));
        agent.verifications[0].outcome = VerifyOutcome::Verified;
        let e = explain("shop/cart", &pods, Some(&agent)).unwrap();
        assert_eq!(e.verdict, Verdict::FullyEnrolled);
        assert_eq!(
            explain("u-old", &pods, Some(&agent)).unwrap().verdict,
            Verdict::Draining
        );
    }

    #[test]
    fn the_exclusions_in_force_and_why_annotations_are_not_are_explained() {
        let mut served = record("Served", &["inbound/ipv4"]);
        let text = render(
            &explain("shop/cart", &[served.clone()], None).unwrap(),
            true,
        );
        assert!(
            text.contains("exclusions: none (all traffic captured)"),
            "{text}"
        );
        served.exclusions.exclude_outbound_ports = vec![5432];
        served.excluded.outbound = 3;
        let mut agent = node(vec![], vec![]);
        agent.exclusion_notices = vec![crate::control::ExclusionNotice {
            uid: "u-cart".into(),
            namespace: "shop".into(),
            name: "cart".into(),
            kind: "invalid".into(),
            detail: "bad entry \"x\"".into(),
        }];
        let pods = [served];
        let e = explain("shop/cart", &pods, Some(&agent)).unwrap();
        let text = render(&e, true);
        assert!(
            text.contains("traffic.sidecar.istio.io/excludeOutboundPorts=5432 (bypassing ztunnel; connections excluded: inbound 0, outbound 3)"),
            "{text}"
        );
        assert!(text.contains("exclusions invalid: bad entry"), "{text}");
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(json["pod"]["exclusions"]["exclude_outbound_ports"][0], 5432);
        assert_eq!(json["exclusion_notice"]["kind"], "invalid");
    }

    fn node(skipped: Vec<SkippedPod>, waiting: Vec<WaitingPod>) -> NodeStatus {
        let mut n: NodeStatus = serde_json::from_value(serde_json::json!({
            "condition_type": "t", "condition": null, "ztunnel_connected": false
        }))
        .unwrap();
        n.skipped = skipped;
        n.waiting = waiting;
        n
    }

    #[test]
    fn a_pod_is_found_by_name_or_uid_and_its_verdict_says_what_is_missing() {
        let pods = [record("Pending", &["inbound/ipv4", "hbone/ipv6"])];
        let agent = node(
            vec![],
            vec![WaitingPod {
                uid: "u-cart".into(),
                last_error: "ztunnel nacked add: no workload".into(),
                ztunnel_refused: true,
            }],
        );
        for q in ["shop/cart", "u-cart"] {
            let e = explain(q, &pods, Some(&agent)).expect("found");
            assert_eq!(
                e.verdict,
                Verdict::WaitingForZtunnel {
                    missing: vec!["outbound (15001)".into()]
                }
            );
            assert_eq!(e.last_error, Some("ztunnel nacked add: no workload"));
            let text = render(&e, true);
            assert!(
                text.contains("missing listeners: outbound (15001)"),
                "{text}"
            );
            assert!(text.contains("retrying:"), "{text}");
        }
        assert!(explain("shop/other", &pods, Some(&agent)).is_none());
        assert!(explain("cart", &pods, None).is_none());
        let served = [record("Served", &["inbound/ipv4"])];
        assert_eq!(
            explain("shop/cart", &served, None).unwrap().verdict,
            Verdict::FullyEnrolled
        );
    }

    #[test]
    fn a_pod_the_agent_leaves_uncaptured_says_why() {
        let agent = node(
            vec![SkippedPod {
                namespace: "shop".into(),
                name: "plain".into(),
                uid: "u-plain".into(),
                reason: "pod is labelled istio.io/dataplane-mode=none".into(),
            }],
            vec![],
        );
        let e = explain("shop/plain", &[], Some(&agent)).expect("found");
        let text = render(&e, true);
        assert_eq!(
            text.trim(),
            "verdict:    not captured: pod is labelled istio.io/dataplane-mode=none"
        );
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(json["verdict"], "not_captured");
        assert_eq!(
            json["reason"],
            "pod is labelled istio.io/dataplane-mode=none"
        );
    }
}

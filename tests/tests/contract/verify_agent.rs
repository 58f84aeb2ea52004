//! Each way a pod's capture can break silently (issue 40), made behind a
//! running agent's back: the pod is not served meanwhile (a failed
//! verification is counted, or, for a capture listener gone, the pod may go
//! back to `Pending`), the agent puts the capture back, the pod is verified
//! again, and its traffic reaches ztunnel in both directions again.

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use sluice::dataplane::state::{Maps, PodRecord};
use sluice_common::{PodState, Role};
use sluice_tests::{
    agent::{metric_sum, AgentProc, PeerProc, FAILED_VERIFICATIONS},
    flow::{connect as tcp, Opts},
    harness::{Fixture, APP_PORT},
    inspect::Hook,
    ns::netns_path,
    topology::Family,
    wait,
};

use crate::{
    agent::{enroll_enabled, inbound_accepts, outbound_through_peer, peer_with},
    trial, TestResult,
};

pub fn trials() -> Vec<Trial> {
    vec![
        trial(
            "verify::through_the_agent::each_break_is_reported_repaired_and_captured_again",
            breaks,
        ),
        trial(
            "verify::through_the_agent::a_rule_and_route_removed_in_the_pod_are_put_back_at_their_event",
            routing_removed,
        ),
        trial(
            "verify::through_the_agent::accept_local_cleared_in_the_pod_is_set_again_by_a_full_pass",
            accept_local_cleared,
        ),
    ]
}

/// How a break keeps the pod from being served until it is put back.
#[derive(Clone, Copy, Debug)]
enum Reported {
    /// A verification failed (`sluice_capture_verifications_total{result="failed"}`):
    /// its readiness gate is `False` until one passes.
    Failed,
    /// Either that, or the pod left `Served`
    /// (`sluice_pod_transitions_total{from="Served"}`): a capture listener
    /// gone sends it back to ztunnel (the supervisor, within 200 ms), unless
    /// the agent's repair put the listener back from its duplicate first.
    FailedOrLeftServed,
}

/// A pod enrolled through an agent that verifies every second, with the
/// peer's DNS proxy (DNS capture is on by default, so the DNS cases run).
struct Setup {
    f: Fixture,
    agent: AgentProc,
    peer: PeerProc,
    metrics_port: u16,
    cookie: u64,
}

impl Setup {
    /// `node`: the client netns is the node's (`--node-netns`), so that the
    /// host side of the pod's veth is sluice's too; its connections to the
    /// pod are then the node's own (kubelet probes), not captured.
    fn new(tag: &str, node: bool) -> anyhow::Result<Self> {
        let f = Fixture::new(tag, None)?;
        let node_path = netns_path(&f.topo.client);
        let node_flags = ["--node-netns", node_path.to_str().context("netns path")?];
        let extra: &[&str] = if node { &node_flags } else { &[] };
        let (agent, metrics_port) = AgentProc::start_verifying(&f.topo.pins, extra)?;
        Self::enrolled(f, agent, metrics_port)
    }

    /// Without the node netns, verifying every `every`.
    fn with_period(tag: &str, every: &str) -> anyhow::Result<Self> {
        let f = Fixture::new(tag, None)?;
        let metrics_port = sluice_tests::agent::free_port()?;
        let addr = format!("127.0.0.1:{metrics_port}");
        let agent = AgentProc::start_with(
            &f.topo.pins,
            &["--verify-every", every, "--metrics-addr", &addr],
        )?;
        Self::enrolled(f, agent, metrics_port)
    }

    /// The peer started, the pod enrolled, verified and served.
    fn enrolled(f: Fixture, agent: AgentProc, metrics_port: u16) -> anyhow::Result<Self> {
        let resolver = format!("{}:53", f.topo.client_ip(Family::V4));
        let peer = peer_with(&agent, &["--dns-forward", &resolver])?;
        enroll_enabled(&agent, &f)?;
        let cookie = f.pod_record()?.netns_cookie;
        let s = Self {
            f,
            agent,
            peer,
            metrics_port,
            cookie,
        };
        s.verified()?;
        ensure!(
            dns_listed(&s.f.pod_record()?),
            "the peer's DNS proxy is not registered: {:?}",
            s.f.pod_record()?.listeners
        );
        Ok(s)
    }

    /// Waits until `back` holds (`what` put back), then requires the pod's
    /// outbound through ztunnel again.
    fn put_back(&self, what: &str, back: impl Fn() -> Result<(), String>) -> TestResult {
        wait::until(&format!("{what} put back"), wait::DEADLINE, back)
            .with_context(|| self.agent.log())?;
        outbound_through_peer(
            &self.f.topo.pod,
            self.f.topo.client_ip(Family::V4),
            &self.peer,
            &format!("after {what} was put back"),
        )
    }

    fn reported(&self, how: Reported) -> anyhow::Result<u64> {
        match how {
            Reported::Failed => metric_sum(self.metrics_port, FAILED_VERIFICATIONS),
            Reported::FailedOrLeftServed => Ok(self.reported(Reported::Failed)?
                + metric_sum(
                    self.metrics_port,
                    "sluice_pod_transitions_total{from=\"Served\"",
                )?),
        }
    }

    /// Waits until the pod's last verification passed and it is `Served`.
    fn verified(&self) -> TestResult {
        let uid = self.f.uid.as_str();
        wait::until("the pod verified and served", wait::DEADLINE, || {
            let status = self.agent.node_status().map_err(|e| e.to_string())?;
            let v = status["verifications"]
                .as_array()
                .and_then(|a| a.iter().find(|v| v["uid"] == uid).cloned());
            match (v, self.f.pod_record()) {
                (Some(v), Ok(r))
                    if v["outcome"] == "verified" && r.state == Some(PodState::Served) =>
                {
                    Ok(())
                }
                (v, r) => Err(format!("{v:?} {:?}", r.map(|r| r.state))),
            }
        })
        .with_context(|| self.agent.log())
    }

    /// Makes the break `what`, waits until it is reported as `how`, then
    /// until the pod is verified and served again, with its DNS proxy
    /// registered, and its outbound reaching ztunnel.
    fn check(&self, what: &str, make: impl FnOnce() -> TestResult, how: Reported) -> TestResult {
        let before = self.reported(how)?;
        make().with_context(|| format!("breaking: {what}"))?;
        wait::until(
            &format!("{what}: reported ({how:?})"),
            wait::DEADLINE,
            || match self.reported(how) {
                Ok(n) if n > before => Ok(()),
                other => Err(format!("{other:?}")),
            },
        )
        .with_context(|| self.agent.log())?;
        self.verified().with_context(|| format!("after {what}"))?;
        ensure!(
            dns_listed(&self.f.pod_record()?),
            "after {what}: the DNS proxy is not registered again"
        );
        outbound_through_peer(
            &self.f.topo.pod,
            self.f.topo.client_ip(Family::V4),
            &self.peer,
            &format!("after {what}"),
        )
    }

    /// A connection from the client netns to the pod's app port is
    /// answered; true when the kernel captured it (and the peer accepted
    /// it), false when it let it through as the node's own.
    fn inbound(&self, what: &str) -> anyhow::Result<bool> {
        let before = self.f.pod_record()?.counters;
        let accepts = inbound_accepts(&self.peer);
        let r = tcp(
            &self.f.topo.client,
            std::net::SocketAddr::new(self.f.topo.pod_ip(Family::V4), APP_PORT),
            Opts::default(),
        );
        ensure!(r.reply().is_some(), "inbound after {what}: {r:?}");
        // The SYN's counters were written before its answer came.
        let after = self.f.pod_record()?.counters;
        if after.captured_inbound > before.captured_inbound {
            self.peer.wait_for(
                &format!("the inbound connection after {what} accepted by the peer"),
                |_| inbound_accepts(&self.peer) > accepts,
            )?;
            return Ok(true);
        }
        ensure!(
            after.bypassed > before.bypassed,
            "inbound after {what}: neither captured nor let through: {before:?} -> {after:?}"
        );
        Ok(false)
    }
}

fn dns_listed(r: &PodRecord) -> bool {
    r.listeners.iter().any(|l| l.starts_with("dns"))
}

fn breaks() -> TestResult {
    let s = Setup::new("vbk", false)?;
    let dir = s.f.topo.pins.pod(s.cookie);
    let (pod, cookie) = (s.f.topo.pod.as_str(), s.cookie);
    let egress = Hook {
        ns: pod,
        dev: "eth0",
        dir: "egress",
    };
    let ingress = Hook {
        ns: pod,
        dev: "eth0",
        dir: "ingress",
    };
    let remove = |role: Role| -> TestResult {
        Maps::open_pinned(&s.f.topo.pins.maps())?.remove_listener(cookie, role);
        Ok(())
    };
    let captured_in = |what: &str| -> TestResult {
        ensure!(s.inbound(what)?, "inbound after {what} not captured");
        Ok(())
    };
    let what = "the egress filter's program swapped in place";
    s.check(
        what,
        || egress.tc("replace", Some(&dir.join("ingress_eth0"))),
        Reported::Failed,
    )?;
    captured_in(what)?;
    let what = "the egress filter moved to the ingress hook";
    s.check(
        what,
        || {
            ingress.tc("replace", Some(&dir.join("egress_eth0")))?;
            egress.tc("del", None)
        },
        Reported::Failed,
    )?;
    captured_in(what)?;
    let what = "the sk_lookup link detached";
    s.check(
        what,
        || Ok(std::fs::remove_file(dir.join("steer"))?),
        Reported::Failed,
    )?;
    captured_in(what)?;
    let what = "ztunnel's inbound listener gone from the socket map";
    s.check(what, || remove(Role::Inbound), Reported::FailedOrLeftServed)?;
    captured_in(what)?;
    let what = "ztunnel's DNS socket gone from the socket map";
    s.check(what, || remove(Role::DnsUdp), Reported::Failed)?;
    captured_in(what)?;
    drop(s);

    // The host side, with the client netns as the node: its connections to
    // the pod are the node's own again once sluice's program is back.
    let s = Setup::new("vbh", true)?;
    let host = Hook {
        ns: &s.f.topo.client,
        dev: "veth-c",
        dir: "egress",
    };
    let what = "the host-side filter deleted";
    s.check(what, || host.tc("del", None), Reported::Failed)?;
    ensure!(
        !s.inbound(what)?,
        "a connection of the node's own was captured after {what}"
    );
    Ok(())
}

/// The pod's policy rule and local route, which make a redirected packet
/// local, removed in its netns (what a pod holding `NET_ADMIN` can do to
/// its own traffic): the programs still pass every verification, but the
/// deletions are announced (`RTM_DELRULE`, `RTM_DELROUTE`), and the pod's
/// repair at their event puts both back, with no periodic pass in the test's
/// time (`--verify-every 10m`); outbound reaches ztunnel again.
fn routing_removed() -> TestResult {
    let s = Setup::with_period("vrt", "10m")?;
    let pod = s.f.topo.pod.as_str();
    let (rule, route) = (Routing::Rule, Routing::Route);
    ensure!(
        rule.shown(pod)? && route.shown(pod)?,
        "no rule or route to remove"
    );
    wait::until("the pod watched", wait::DEADLINE, || {
        let n = s.agent.node_status().map_err(|e| e.to_string())?;
        match n["link_watches"].as_u64() {
            Some(w) if w >= 1 => Ok(()),
            seen => Err(format!("{seen:?}")),
        }
    })?;
    // Twice: the first may be put back by the repair a pod's watch makes
    // once at its start, which the second finds done (it comes before any
    // of the pod's events), so that only an event can put it back.
    for round in ["first", "second"] {
        sluice_tests::topology::ip(&["-n", pod, "rule", "del", "table", "100"])?;
        sluice_tests::topology::ip(&["-n", pod, "route", "flush", "table", "100"])?;
        s.put_back(&format!("the rule and route ({round} time)"), || {
            match (rule.shown(pod), route.shown(pod)) {
                (Ok(true), Ok(true)) => Ok(()),
                seen => Err(format!("{seen:?}")),
            }
        })?;
    }
    Ok(())
}

/// `accept_local` cleared on the pod's interface: no event announces it
/// and the verification's runs do not use it, so the next full pass (one in
/// `FULL_PASS_EVERY`, here within 10 s) sets it again.
fn accept_local_cleared() -> TestResult {
    let s = Setup::with_period("val", "1s")?;
    let pod = s.f.topo.pod.as_str();
    let accept_local = || -> anyhow::Result<String> {
        Ok(
            sluice_tests::ns::output(pod, &["sysctl", "-n", "net.ipv4.conf.eth0.accept_local"])?
                .trim()
                .to_owned(),
        )
    };
    ensure!(accept_local()? == "1", "accept_local: {}", accept_local()?);
    // After the verifications that enrolling queued: from here on only the
    // periodic passes verify the pod.
    let total = "sluice_capture_verifications_total{";
    let two_more = metric_sum(s.metrics_port, total)? + 2;
    wait::until(
        "two more verifications",
        wait::DEADLINE,
        || match metric_sum(s.metrics_port, total) {
            Ok(n) if n >= two_more => Ok(()),
            other => Err(format!("{other:?}")),
        },
    )?;
    sluice_tests::ns::output(pod, &["sysctl", "-w", "net.ipv4.conf.eth0.accept_local=0"])?;
    s.put_back("accept_local", || match accept_local() {
        Ok(v) if v == "1" => Ok(()),
        seen => Err(format!("{seen:?}")),
    })
}

/// sluice's policy rule and route in a pod's netns.
#[derive(Debug, Clone, Copy)]
enum Routing {
    Rule,
    Route,
}

impl Routing {
    /// Whether the pod's netns has it.
    fn shown(self, pod: &str) -> anyhow::Result<bool> {
        let (what, want) = match self {
            Routing::Rule => (["rule", "show", "table", "100"], "lookup 100"),
            Routing::Route => (["route", "show", "table", "100"], "local default"),
        };
        let out = std::process::Command::new("ip")
            .args(["-n", pod])
            .args(what)
            .output()?;
        ensure!(out.status.success(), "ip {what:?}: {out:?}");
        Ok(String::from_utf8_lossy(&out.stdout).contains(want))
    }
}

//! `sluice watchdog`: the crash cover for the node condition. The agent marks
//! its node not ready when it stops cleanly; a crashed or hung agent cannot,
//! and node-readiness-controller only compares the status it last saw. The
//! watchdog (a second container in the agent's pod: no privileges, no host
//! mounts) asks the agent's `/readyz` every `interval`; after `failures`
//! probes in a row get no usable answer, it writes the condition False with
//! reason `AgentNotRunning`, once per outage. 200 and 503 are the agent
//! speaking for itself (ready / not ready); anything else — no answer, or a
//! 500 from an agent whose readiness loop is stuck — counts as silence.

use std::{net::SocketAddr, time::Duration};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    sync::watch,
};
use tracing::{info, warn};

use crate::{kube::condition::ConditionWriter, readiness::Condition};

pub const DEFAULT_FAILURES: u32 = 3;

/// One probe of the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// The agent answered with this HTTP status.
    Answered(u16),
    /// No HTTP answer (refused, reset, timed out, garbage).
    Silent(String),
}

/// GET /readyz on `addr`, within `timeout`.
pub async fn probe(addr: SocketAddr, timeout: Duration) -> Probe {
    let ask = async {
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(b"GET /readyz HTTP/1.1\r\nHost: sluice\r\nConnection: close\r\n\r\n")
            .await?;
        let mut head = Vec::new();
        s.take(64 * 1024).read_to_end(&mut head).await?;
        Ok::<_, std::io::Error>(head)
    };
    match tokio::time::timeout(timeout, ask).await {
        Err(_) => Probe::Silent(format!("no answer within {}ms", timeout.as_millis())),
        Ok(Err(e)) => Probe::Silent(e.to_string()),
        Ok(Ok(head)) => match status_code(&head) {
            Some(code) => Probe::Answered(code),
            None => Probe::Silent("not an HTTP answer".into()),
        },
    }
}

/// The status code of an HTTP/1.x response.
fn status_code(resp: &[u8]) -> Option<u16> {
    let line = resp.split(|b| *b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split_whitespace();
    parts.next()?.starts_with("HTTP/1.").then_some(())?;
    parts.next()?.parse().ok()
}

/// Counts silent probes in a row; says when the agent counts as gone.
#[derive(Debug)]
pub struct Tracker {
    needed: u32,
    silent: u32,
    /// Written for the current outage already.
    marked: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Alive,
    /// Silent, but not for long enough yet (or already marked).
    Waiting,
    /// Mark the node now.
    Gone,
}

impl Tracker {
    pub fn new(failures: u32) -> Self {
        Self {
            needed: failures.max(1),
            silent: 0,
            marked: false,
        }
    }

    pub fn observe(&mut self, p: &Probe) -> Verdict {
        match p {
            Probe::Answered(200 | 503) => {
                self.silent = 0;
                self.marked = false;
                Verdict::Alive
            }
            Probe::Answered(_) | Probe::Silent(_) => {
                self.silent = self.silent.saturating_add(1);
                if self.silent >= self.needed && !self.marked {
                    self.marked = true;
                    Verdict::Gone
                } else {
                    Verdict::Waiting
                }
            }
        }
    }

    /// A write failed: try again on the next silent probe.
    pub fn unmark(&mut self) {
        self.marked = false;
    }
}

pub struct Config {
    pub agent_addr: SocketAddr,
    pub interval: Duration,
    pub failures: u32,
}

/// Runs until `stop`.
pub async fn run(cfg: Config, writer: ConditionWriter, mut stop: watch::Receiver<bool>) {
    let mut tracker = Tracker::new(cfg.failures);
    info!(agent = %cfg.agent_addr, interval_ms = cfg.interval.as_millis() as u64, failures = cfg.failures, "watching the agent");
    // Probes start every `interval` (each times out within it), so an agent
    // that stops answering is marked within (failures + 1) × interval.
    let mut ticks = tokio::time::interval(cfg.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = ticks.tick() => {}
        }
        let p = probe(cfg.agent_addr, cfg.interval).await;
        match tracker.observe(&p) {
            Verdict::Alive | Verdict::Waiting => {}
            Verdict::Gone => {
                let silent = cfg.interval * tracker.needed;
                warn!(?p, "the agent is not answering: marking the node not ready");
                let gone = Condition::agent_not_running(silent);
                match tokio::time::timeout(crate::kube::API_TIMEOUT, writer.write(&gone)).await {
                    Ok(Ok(())) => info!("node condition set to AgentNotRunning"),
                    Ok(Err(e)) => {
                        warn!(error = %e, "could not write the node condition; will retry");
                        tracker.unmark();
                    }
                    Err(_) => {
                        warn!("the API server did not answer; will retry");
                        tracker.unmark();
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn marks_the_node_when_the_agent_stops_answering() {
        use http::Method;
        use serde_json::json;

        use crate::kube::mock;

        // A stand-in agent that answers 503 twice, then goes away.
        let agent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = agent.local_addr().unwrap();
        let serving = tokio::spawn(async move {
            for _ in 0..2 {
                let (mut s, _) = agent.accept().await.unwrap();
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(b"HTTP/1.1 503 Service Unavailable\r\n\r\n")
                    .await;
            }
        });
        let (client, mut h) = mock::client();
        let writer = ConditionWriter::new(
            client,
            "node-a",
            "sluice.dev/RedirectionReady",
            Duration::from_secs(60),
        );
        let (stop_tx, stop) = watch::channel(false);
        let cfg = Config {
            agent_addr: addr,
            interval: Duration::from_millis(50),
            failures: 3,
        };
        let task = tokio::spawn(run(cfg, writer, stop));
        serving.await.unwrap();
        let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a", "resourceVersion": "4"},
            "status": {"conditions": [{"type": "sluice.dev/RedirectionReady", "status": "True",
                "reason": "RedirectionReady", "lastTransitionTime": "2026-11-22T01:00:00Z"}]}});
        let (req, send) = h.next_request().await.unwrap();
        assert_eq!(req.method(), Method::GET);
        mock::reply(send, 200, &node);
        let (req, send) = h.next_request().await.unwrap();
        assert_eq!(
            (req.method(), req.uri().path()),
            (&Method::PATCH, "/api/v1/nodes/node-a/status")
        );
        let body = mock::body(req).await;
        let c = &body["status"]["conditions"][0];
        assert_eq!(
            (c["status"].as_str(), c["reason"].as_str()),
            (Some("False"), Some("AgentNotRunning"))
        );
        assert_eq!(
            c["message"],
            "the sluice agent has not answered its readiness check for 150ms"
        );
        mock::reply(send, 200, &node);
        // Once per outage: more silent probes, no more writes.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(h.poll_request().is_pending(), "one write per outage");
        stop_tx.send(true).unwrap();
        task.await.unwrap();
    }

    #[test]
    fn reads_the_status_line() {
        assert_eq!(
            status_code(b"HTTP/1.1 503 Service Unavailable\r\n"),
            Some(503)
        );
        assert_eq!(status_code(b"HTTP/1.0 200 OK\r\n\r\nready"), Some(200));
        assert_eq!(status_code(b"SSH-2.0-OpenSSH\r\n"), None);
        assert_eq!(status_code(b""), None);
    }

    #[test]
    fn gone_after_n_silent_probes_once_per_outage() {
        let silent = Probe::Silent("refused".into());
        let mut t = Tracker::new(3);
        assert_eq!(t.observe(&silent), Verdict::Waiting);
        assert_eq!(t.observe(&silent), Verdict::Waiting);
        assert_eq!(t.observe(&silent), Verdict::Gone);
        assert_eq!(t.observe(&silent), Verdict::Waiting, "marked once");
        // A 503 is an answer: the agent is alive and speaks for itself.
        assert_eq!(t.observe(&Probe::Answered(503)), Verdict::Alive);
        assert_eq!(t.observe(&silent), Verdict::Waiting, "count starts over");
        t.observe(&silent);
        assert_eq!(t.observe(&silent), Verdict::Gone, "a new outage is marked");
        t.unmark();
        assert_eq!(
            t.observe(&silent),
            Verdict::Gone,
            "a failed write is retried"
        );
        // An agent whose readiness loop is stuck answers 500: it cannot
        // speak for the node, so that counts as silence.
        let mut t = Tracker::new(2);
        assert_eq!(t.observe(&Probe::Answered(500)), Verdict::Waiting);
        assert_eq!(t.observe(&Probe::Answered(500)), Verdict::Gone);
        assert_eq!(t.observe(&Probe::Answered(200)), Verdict::Alive);
    }
}

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

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::rt::TokioIo;
use tokio::{net::TcpStream, sync::watch};
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

/// GET /readyz on `addr`, within `timeout` (hyper's HTTP/1 client on one
/// connection: no pool, no retries, so every probe is a fresh connection).
pub async fn probe(addr: SocketAddr, timeout: Duration) -> Probe {
    let ask = async {
        let stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        let conn = tokio::spawn(conn);
        let req = http::Request::get("/readyz")
            .header(http::header::HOST, "sluice")
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let resp = send.send_request(req).await.map_err(|e| e.to_string());
        conn.abort();
        resp.map(|r| r.status().as_u16())
    };
    match tokio::time::timeout(timeout, ask).await {
        Err(_) => Probe::Silent(format!("no answer within {}ms", timeout.as_millis())),
        Ok(Err(e)) => Probe::Silent(e),
        Ok(Ok(code)) => Probe::Answered(code),
    }
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
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

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

    /// A stand-in agent that answers every connection with `reply` (or
    /// holds it open without a word when `None`).
    async fn stand_in(reply: Option<&'static [u8]>) -> SocketAddr {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    let _ = s.read(&mut buf).await;
                    match reply {
                        Some(r) => drop(s.write_all(r).await),
                        None => std::future::pending().await,
                    }
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn a_probe_tells_an_answer_from_silence() {
        let t = Duration::from_millis(300);
        let unready = stand_in(Some(b"HTTP/1.1 503 Service Unavailable\r\n\r\n")).await;
        assert_eq!(probe(unready, t).await, Probe::Answered(503));
        let ready = stand_in(Some(b"HTTP/1.0 200 OK\r\ncontent-length: 5\r\n\r\nready")).await;
        assert_eq!(probe(ready, t).await, Probe::Answered(200));
        let not_http = stand_in(Some(b"SSH-2.0-OpenSSH\r\n")).await;
        assert!(matches!(probe(not_http, t).await, Probe::Silent(_)));
        let hung = stand_in(None).await;
        assert_eq!(
            probe(hung, t).await,
            Probe::Silent("no answer within 300ms".into())
        );
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

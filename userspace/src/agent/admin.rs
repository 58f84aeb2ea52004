//! The admin listeners: `/metrics` (Prometheus text), `/healthz` (the agent
//! serves and its readiness loop runs) and `/readyz` (the node condition is
//! True and fresh; 503 with the reason otherwise), on two addresses:
//! - `--health-addr` (127.0.0.1): for the kubelet's probes and the watchdog,
//!   which only the node reaches;
//! - `--metrics-addr` (the node's IP): for Prometheus, where any pod of the
//!   node can connect, so each peer address gets at most [`PER_PEER`]
//!   connections: a pod flooding it cannot take the slots Prometheus needs,
//!   and cannot touch the health listener at all.
//!
//! Plain HTTP/1.1, GET only. They say no pod names, bound their connections
//! and drop clients that do not send their request.

use std::{convert::Infallible, net::SocketAddr, sync::Arc, time::Duration};

use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::{body::Incoming, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    net::TcpListener,
    sync::{watch, Semaphore},
};
use tracing::info;

use super::report::{Report, STALE};

/// Connections served at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 32;
/// Connections one peer address may hold at once on the scrape listener;
/// more are closed at once.
pub const PER_PEER: usize = 4;

/// Who connects to a listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Audience {
    /// The node only (127.0.0.1): the kubelet's probes, the watchdog.
    Node,
    /// Anyone who reaches the node's IP: bounded per peer.
    Scrapers,
}
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// `/healthz` fails when the readiness loop has not run for this long (the
/// kubelet then restarts the agent).
const STUCK: Duration = Duration::from_secs(60);

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

pub async fn serve(
    listener: TcpListener,
    report: Arc<Report>,
    mut stop: watch::Receiver<bool>,
    audience: Audience,
) {
    if let Ok(a) = listener.local_addr() {
        info!(addr = %a, ?audience, "admin listener: /metrics /healthz /readyz");
    }
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let peers: Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>> =
        Arc::default();
    let mut errors = crate::accept_errors::AcceptErrors::default();
    loop {
        let permit = tokio::select! {
            _ = stop.changed() => return,
            p = slots.clone().acquire_owned() => p.expect("the semaphore is never closed"),
        };
        let (stream, peer) = tokio::select! {
            _ = stop.changed() => return,
            r = listener.accept() => match r {
                Ok(s) => {
                    errors.ok();
                    s
                }
                Err(e) => {
                    // Out of fds, usually: do not spin.
                    errors.failed("admin", e).await;
                    continue;
                }
            },
        };
        let peer = peer.ip();
        if audience == Audience::Scrapers {
            let mut held = peers.lock().unwrap();
            let n = held.entry(peer).or_default();
            if *n >= PER_PEER {
                // Closed unanswered: this peer holds its share already.
                drop(stream);
                continue;
            }
            *n += 1;
        }
        let report = report.clone();
        let peers = peers.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let report = report.clone();
                async move { Ok::<_, Infallible>(answer(report, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), svc)
                .await;
            if audience == Audience::Scrapers {
                let mut held = peers.lock().unwrap();
                if let Some(n) = held.get_mut(&peer) {
                    *n -= 1;
                    if *n == 0 {
                        held.remove(&peer);
                    }
                }
            }
            drop(permit);
        });
    }
}

async fn answer(report: Arc<Report>, req: Request<Incoming>) -> Response<Full<bytes::Bytes>> {
    let reply = |code: StatusCode, ctype: &str, body: String| {
        Response::builder()
            .status(code)
            .header("content-type", ctype)
            .body(Full::new(body.into()))
            .expect("static response parts are valid")
    };
    let text = "text/plain; charset=utf-8";
    if req.method() != Method::GET {
        return reply(StatusCode::METHOD_NOT_ALLOWED, text, "GET only\n".into());
    }
    match req.uri().path() {
        "/metrics" => {
            // The scrape walks the pinned maps, under the dataplane lock.
            let r = report.clone();
            match tokio::task::spawn_blocking(move || r.metrics.render()).await {
                Ok(body) => reply(StatusCode::OK, OPENMETRICS, body),
                Err(_) => reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    text,
                    "scrape failed\n".into(),
                ),
            }
        }
        "/healthz" | "/readyz" if report.is_uninstalled() => {
            reply(StatusCode::OK, text, "uninstalled\n".into())
        }
        "/healthz" => match report.age() {
            Some(age) if age > STUCK => reply(
                StatusCode::SERVICE_UNAVAILABLE,
                text,
                format!("unhealthy: no readiness pass for {}s\n", age.as_secs()),
            ),
            _ => reply(StatusCode::OK, text, "ok\n".into()),
        },
        "/readyz" => match (report.condition(), report.age()) {
            // 500, not 503: the agent cannot speak for the node now, so the
            // watchdog must (it takes a 503 as the agent's own answer).
            (Some(_), Some(age)) if age > STALE => reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                text,
                format!("not ready: no readiness pass for {}s\n", age.as_secs()),
            ),
            (Some(c), _) if c.ready => reply(StatusCode::OK, text, "ready\n".into()),
            (Some(c), _) => reply(
                StatusCode::SERVICE_UNAVAILABLE,
                text,
                format!("not ready: {}\n", c.reason.as_str()),
            ),
            (None, _) => reply(
                StatusCode::SERVICE_UNAVAILABLE,
                text,
                "not ready: starting\n".into(),
            ),
        },
        _ => reply(StatusCode::NOT_FOUND, text, "not found\n".into()),
    }
}

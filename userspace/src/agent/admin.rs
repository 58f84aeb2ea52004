//! The admin listener (`--metrics-addr`): `/metrics` (Prometheus text),
//! `/healthz` (the agent serves) and `/readyz` (the node condition is True;
//! 503 with the reason otherwise). Plain HTTP/1.1, GET only.

use std::{convert::Infallible, net::SocketAddr, sync::Arc};

use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::{body::Incoming, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::{net::TcpListener, sync::watch};
use tracing::{info, warn};

use super::report::Report;

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

pub async fn serve(listener: TcpListener, report: Arc<Report>, mut stop: watch::Receiver<bool>) {
    if let Ok(a) = listener.local_addr() {
        info!(addr = %a, "admin listener: /metrics /healthz /readyz");
    }
    loop {
        let (stream, _) = tokio::select! {
            _ = stop.changed() => return,
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    warn!(error = %e, "admin accept failed");
                    continue;
                }
            },
        };
        let report = report.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let report = report.clone();
                async move { Ok::<_, Infallible>(answer(&report, &req)) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn answer(report: &Report, req: &Request<Incoming>) -> Response<Full<bytes::Bytes>> {
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
        "/metrics" => reply(StatusCode::OK, OPENMETRICS, report.metrics.render()),
        "/healthz" => reply(StatusCode::OK, text, "ok\n".into()),
        "/readyz" => match report.condition() {
            Some(c) if c.ready => reply(StatusCode::OK, text, format!("ready: {}\n", c.message)),
            Some(c) => reply(
                StatusCode::SERVICE_UNAVAILABLE,
                text,
                format!("not ready: {}: {}\n", c.reason.as_str(), c.message),
            ),
            None => reply(
                StatusCode::SERVICE_UNAVAILABLE,
                text,
                "not ready: starting\n".into(),
            ),
        },
        _ => reply(StatusCode::NOT_FOUND, text, "not found\n".into()),
    }
}

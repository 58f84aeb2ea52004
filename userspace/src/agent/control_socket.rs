//! The agent's end of the control socket (protocol: [`crate::control`]):
//! binds it root-only, reads one request per connection, refuses requests
//! for another bpf root, and hands the rest to the node's [`Requests`].

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::Arc,
};

use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt},
    net::UnixListener,
    sync::watch,
};
use tracing::warn;

use super::node::Requests;
use crate::{
    accept_errors::AcceptErrors,
    control::{wrong_root, Envelope, Response},
};

/// The largest request line (enroll requests are well under 1 KiB).
const MAX_REQUEST: u64 = 64 * 1024;
/// How long a client has to send its request.
const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

pub fn bind(path: &Path) -> std::io::Result<std::os::unix::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    let fd = crate::unixsock::bind_private(path, nix::sys::socket::SockType::Stream, 128)?;
    Ok(std::os::unix::net::UnixListener::from(fd))
}

pub async fn serve(
    listener: std::os::unix::net::UnixListener,
    path: PathBuf,
    root: PathBuf,
    requests: Arc<Requests>,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let listener = UnixListener::from_std(listener)?;
    let mut errors = AcceptErrors::default();
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    errors.ok();
                    let (requests, root) = (requests.clone(), root.clone());
                    tokio::spawn(async move {
                        if let Err(e) = handle(stream, &root, requests).await {
                            warn!(error = %e, "control connection failed");
                        }
                    });
                }
                // Out of descriptors, say: the socket keeps serving once
                // they are back.
                Err(e) => errors.failed("control socket", e).await,
            },
        }
    }
    let _ = std::fs::remove_file(&path);
    Ok(())
}

async fn handle(
    stream: tokio::net::UnixStream,
    root: &Path,
    requests: Arc<Requests>,
) -> std::io::Result<()> {
    let (r, mut w) = stream.into_split();
    let mut line = String::new();
    // One bounded line within a deadline: a client that sends too much or
    // nothing costs one task for at most READ_TIMEOUT.
    let mut reader = tokio::io::BufReader::new(r.take(MAX_REQUEST + 1));
    let read = reader.read_line(&mut line);
    let resp = match tokio::time::timeout(READ_TIMEOUT, read).await {
        Err(_) => Response::Error {
            message: format!("no complete request within {}s", READ_TIMEOUT.as_secs()),
        },
        Ok(Err(e)) => return Err(e),
        Ok(Ok(n)) if n as u64 > MAX_REQUEST => Response::Error {
            message: format!("request over {} KiB", MAX_REQUEST >> 10),
        },
        Ok(Ok(_)) => parse_and_handle(&line, root, requests).await,
    };
    let mut out = serde_json::to_vec(&resp).expect("responses always serialise");
    out.push(b'\n');
    w.write_all(&out).await
}

async fn parse_and_handle(line: &str, root: &Path, requests: Arc<Requests>) -> Response {
    match crate::control::parse_envelope(line) {
        Ok(Envelope {
            bpf_root: Some(asked),
            ..
        }) if wrong_root(root, &asked).is_some() => Response::Error {
            message: wrong_root(root, &asked).unwrap_or_default(),
        },
        Ok(env) => requests.handle(env.request).await,
        Err(message) => Response::Error { message },
    }
}

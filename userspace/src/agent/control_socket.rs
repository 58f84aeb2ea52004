//! The agent's end of the control socket (protocol: [`crate::control`]):
//! binds it root-only, reads one request per connection, refuses requests
//! for another bpf root, and hands the rest to the node.

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::Arc,
};

use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt},
    net::UnixListener,
    sync::watch,
};
use tracing::warn;

use super::node::Node;
use crate::control::{wrong_root, Envelope, Response};

pub fn bind(path: &Path) -> std::io::Result<std::os::unix::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let l = std::os::unix::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    l.set_nonblocking(true)?;
    Ok(l)
}

pub async fn serve(
    listener: std::os::unix::net::UnixListener,
    path: PathBuf,
    root: PathBuf,
    node: Arc<Node>,
    mut stop: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let listener = UnixListener::from_std(listener)?;
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => {
                let (stream, _) = accepted?;
                let (node, root) = (node.clone(), root.clone());
                tokio::spawn(async move {
                    if let Err(e) = handle(stream, &root, node).await {
                        warn!(error = %e, "control connection failed");
                    }
                });
            }
        }
    }
    let _ = std::fs::remove_file(&path);
    Ok(())
}

async fn handle(
    stream: tokio::net::UnixStream,
    root: &Path,
    node: Arc<Node>,
) -> std::io::Result<()> {
    let (r, mut w) = stream.into_split();
    let mut line = String::new();
    tokio::io::BufReader::new(r).read_line(&mut line).await?;
    let resp = match serde_json::from_str::<Envelope>(&line) {
        Ok(Envelope {
            bpf_root: Some(asked),
            ..
        }) if wrong_root(root, &asked).is_some() => Response::Error {
            message: wrong_root(root, &asked).unwrap_or_default(),
        },
        Ok(env) => node.handle(env.request).await,
        Err(e) => Response::Error {
            message: format!("bad request: {e}"),
        },
    };
    let mut out = serde_json::to_vec(&resp).expect("responses always serialise");
    out.push(b'\n');
    w.write_all(&out).await
}

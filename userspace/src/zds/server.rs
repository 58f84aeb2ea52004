//! The ZDS server: accepts ztunnel's connections on a SOCK_SEQPACKET socket,
//! and runs each one as a task that owns it, so requests on one connection are
//! strictly serialised (send, await ack, next). Knows nothing of pod state: the
//! [`Handler`] supplies the snapshot and hears about outcomes.
//!
//! Conversation per connection: ztunnel sends hello → we send `add` (or `keep`)
//! for every pod, then `snapshot_sent` → afterwards `add`s for new pods go to the
//! newest ztunnel (by process start, see [`super::age`]) and `del`s to every
//! live one.

use std::{
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use tokio::{
    io::unix::AsyncFd,
    sync::{mpsc, oneshot, watch},
};
use tracing::{debug, info, info_span, warn, Instrument as _};

use super::{
    proto::{
        self, workload_response, Version, WorkloadRequest, WorkloadResponse, ZdsHello, MAX_REQUEST,
    },
    wire::{self, Datagram, WireError},
};

/// Upstream uses 5 s for both the write and the ack.
pub const DEADLINE: Duration = Duration::from_secs(5);
/// Nack texts can exceed 1 KiB (ztunnel with backtraces on).
const ACK_BUFFER: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    #[error("timed out after {0:?} waiting for ztunnel")]
    Timeout(Duration),
    #[error("connection lost")]
    Closed,
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("request is {0} bytes, over the {MAX_REQUEST}-byte limit")]
    TooLarge(usize),
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl ZdsError {
    /// Whether the connection can no longer be trusted for lock-step.
    fn is_fatal(&self) -> bool {
        !matches!(self, ZdsError::TooLarge(_))
    }
}

/// ztunnel's answer to a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Ack,
    Nack(String),
}

/// One entry of the snapshot sent on a new connection.
pub enum SnapshotEntry {
    /// `add` with the pod's netns fd (that netns's `cookie`).
    Add {
        uid: String,
        cookie: u64,
        workload: proto::Workload,
        netns: OwnedFd,
    },
    /// `keep`: the pod exists but its netns cannot be opened any more.
    Keep { uid: String },
}

/// What the agent provides to (and learns from) the server.
pub trait Handler: Send + Sync + 'static {
    /// The pods to hand to a newly connected ztunnel.
    fn snapshot(&self) -> Vec<SnapshotEntry>;
    /// ztunnel answered (or failed to answer) a snapshot's `add` for `uid`
    /// (with the netns of `cookie`) on a connection whose peer is `pid`.
    fn add_outcome(
        &self,
        uid: &str,
        cookie: u64,
        pid: Option<i32>,
        outcome: &Result<Answer, ZdsError>,
    );
    /// A snapshot's `add` for `uid` was never sent (the snapshot stopped
    /// before it): the attempt failed without being made.
    fn add_not_sent(&self, uid: &str, why: &str);
    /// The pods to add on a connection that just went live, beyond its
    /// snapshot's (`sent`, by uid and netns cookie): those enrolled while
    /// it went out, whose add went to the connection newest then.
    fn joined(&self, sent: &[(String, Option<u64>)]) -> Vec<SnapshotEntry>;
    /// A connection finished its snapshot and is live.
    fn connected(&self, id: u64, pid: Option<i32>);
    /// Whether pod `uid`, in a snapshot (added with the netns of `cookie`,
    /// or kept), has left since (unenrolled, or enrolled again in another
    /// netns): its `del` went only to the connections live then.
    fn left(&self, uid: &str, cookie: Option<u64>) -> bool;
    /// A connection is gone.
    fn disconnected(&self, id: u64);
}

struct Job {
    req: WorkloadRequest,
    fd: Option<OwnedFd>,
    reply: oneshot::Sender<Result<Answer, ZdsError>>,
}

/// A live (post-snapshot) connection.
pub struct Conn {
    pub id: u64,
    pub pid: Option<i32>,
    /// Its process's start time (`None`: unknown, older than any known).
    started: Option<u64>,
    tx: mpsc::Sender<Job>,
}

impl Conn {
    /// Sends a request on this connection and waits for ztunnel's answer.
    pub async fn request(
        &self,
        req: WorkloadRequest,
        fd: Option<OwnedFd>,
    ) -> Result<Answer, ZdsError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Job { req, fd, reply })
            .await
            .map_err(|_| ZdsError::Closed)?;
        rx.await.map_err(|_| ZdsError::Closed)?
    }
}

/// The live connections, oldest first.
#[derive(Default)]
pub struct Hub {
    conns: Mutex<Vec<Arc<Conn>>>,
    /// Every open connection's peer pid, from its hello on (a connection
    /// in its snapshot is not live yet, but its acks already count).
    attached: Mutex<Vec<(u64, i32)>>,
    next_id: AtomicU64,
}

impl Hub {
    /// The connection of the newest ztunnel process; of one process, its
    /// latest connection. An old ztunnel that reconnected after the new one
    /// (across an agent restart) is not it.
    pub fn newest(&self) -> Option<Arc<Conn>> {
        let conns = self.conns.lock().unwrap();
        conns.iter().max_by_key(|c| (c.started, c.id)).cloned()
    }

    pub fn all(&self) -> Vec<Arc<Conn>> {
        self.conns.lock().unwrap().clone()
    }

    pub fn is_connected(&self) -> bool {
        !self.conns.lock().unwrap().is_empty()
    }

    /// Whether a connection of process `pid` is open (live or still
    /// taking its snapshot).
    pub fn attached(&self, pid: i32) -> bool {
        self.attached.lock().unwrap().iter().any(|(_, p)| *p == pid)
    }

    fn attach(&self, id: u64, pid: Option<i32>) {
        if let Some(pid) = pid {
            self.attached.lock().unwrap().push((id, pid));
        }
    }

    fn add(&self, c: Arc<Conn>) {
        self.conns.lock().unwrap().push(c);
    }

    fn remove(&self, id: u64) {
        self.conns.lock().unwrap().retain(|c| c.id != id);
        self.attached.lock().unwrap().retain(|(i, _)| *i != id);
    }
}

/// Binds the ZDS socket (replacing a stale one, root only) and listens.
pub fn bind(path: &Path) -> std::io::Result<OwnedFd> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // Root only, whatever the umask: a peer here receives pods' netns fds.
    crate::unixsock::bind_private(path, nix::sys::socket::SockType::SeqPacket, 16)
}

/// Accepts connections until `shutdown` flips, each served by its own task.
pub async fn serve(
    listener: OwnedFd,
    path: PathBuf,
    hub: Arc<Hub>,
    handler: Arc<dyn Handler>,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let listener = async_fd(listener)?;
    info!(socket = %path.display(), "ZDS server listening");
    let mut errors = crate::accept_errors::AcceptErrors::default();
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            ready = listener.readable() => {
                let mut guard = ready?;
                match nix::sys::socket::accept4(
                    listener.as_raw_fd(),
                    nix::sys::socket::SockFlag::SOCK_CLOEXEC | nix::sys::socket::SockFlag::SOCK_NONBLOCK,
                ) {
                    Ok(raw) => {
                        errors.ok();
                        // SAFETY: accept4 returned a new fd that we now own.
                        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
                        let id = hub.next_id.fetch_add(1, Ordering::Relaxed) + 1;
                        let pid = peer_pid(&fd);
                        let span = info_span!("zds", conn = id, pid = pid.unwrap_or(0));
                        let (hub, handler) = (hub.clone(), handler.clone());
                        tokio::spawn(
                            async move {
                                match async_fd(fd) {
                                    Ok(fd) => connection(fd, id, pid, hub, handler).await,
                                    Err(e) => warn!(error = %e, "ZDS connection setup failed"),
                                }
                            }
                            .instrument(span),
                        );
                    }
                    Err(nix::Error::EAGAIN) => guard.clear_ready(),
                    // The socket stays readable: back off instead of spinning.
                    Err(e) => errors.failed("ZDS socket", e).await,
                }
            }
        }
    }
    let _ = std::fs::remove_file(&path);
    Ok(())
}

fn async_fd(fd: OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: the AsyncFd owns the fd, so it stays open while registered.
    unsafe { AsyncFd::register(fd) }.map_err(std::io::Error::from)
}

fn peer_pid(fd: &OwnedFd) -> Option<i32> {
    nix::sys::socket::getsockopt(fd, nix::sys::socket::sockopt::PeerCredentials)
        .ok()
        .map(|c| c.pid())
        .filter(|p| *p > 0)
}

async fn recv(fd: &AsyncFd<OwnedFd>, max: usize) -> Result<Datagram, ZdsError> {
    loop {
        let mut guard = fd.readable().await?;
        match wire::recv(fd.get_ref().as_fd(), max) {
            Err(e) if e.would_block() => guard.clear_ready(),
            other => return Ok(other?),
        }
    }
}

async fn send(fd: &AsyncFd<OwnedFd>, data: &[u8], netns: Option<&OwnedFd>) -> Result<(), ZdsError> {
    loop {
        let mut guard = fd.writable().await?;
        match wire::send(fd.get_ref().as_fd(), data, netns.map(|f| f.as_fd())) {
            Err(e) if e.would_block() => guard.clear_ready(),
            other => return Ok(other?),
        }
    }
}

async fn deadline<T>(
    f: impl std::future::Future<Output = Result<T, ZdsError>>,
) -> Result<T, ZdsError> {
    tokio::time::timeout(DEADLINE, f)
        .await
        .unwrap_or(Err(ZdsError::Timeout(DEADLINE)))
}

/// One request, lock-step: send (with the fd for `add`), then wait for the ack.
async fn exchange(
    fd: &AsyncFd<OwnedFd>,
    req: &WorkloadRequest,
    netns: Option<&OwnedFd>,
) -> Result<Answer, ZdsError> {
    let data = proto::encode(req);
    if data.len() > MAX_REQUEST {
        return Err(ZdsError::TooLarge(data.len()));
    }
    if req.carries_fd() != netns.is_some() {
        return Err(ZdsError::Protocol(format!(
            "{} must carry exactly the netns fd",
            req.kind()
        )));
    }
    deadline(send(fd, &data, netns)).await?;
    let dg = deadline(recv(fd, ACK_BUFFER)).await?;
    parse_answer(&dg.data, dg.fds.len())
}

/// ztunnel's answer to a request, from the datagram's bytes and how many
/// fds came with it (none may).
pub fn parse_answer(data: &[u8], fds: usize) -> Result<Answer, ZdsError> {
    if fds != 0 {
        return Err(ZdsError::Protocol(format!("ack came with {fds} fds")));
    }
    let resp: WorkloadResponse =
        proto::decode(data).map_err(|e| ZdsError::Protocol(format!("undecodable ack: {e}")))?;
    match resp.payload {
        Some(workload_response::Payload::Ack(a)) if a.error.is_empty() => Ok(Answer::Ack),
        Some(workload_response::Payload::Ack(a)) => Ok(Answer::Nack(a.error)),
        None => Err(ZdsError::Protocol("response without an ack".into())),
    }
}

/// ztunnel's hello, checked: no fds, decodable. Its version: the one it
/// says. Another than 1 is served as 1 (with a warning), as istio-cni
/// does: a connection closed at its hello is reconnected at once, and the
/// two would spin.
pub fn parse_hello(data: &[u8], fds: usize) -> Result<i32, ZdsError> {
    if fds != 0 {
        return Err(ZdsError::Protocol(format!("hello came with {fds} fds")));
    }
    let hello: ZdsHello =
        proto::decode(data).map_err(|e| ZdsError::Protocol(format!("undecodable hello: {e}")))?;
    Ok(hello.version)
}

async fn connection(
    fd: AsyncFd<OwnedFd>,
    id: u64,
    pid: Option<i32>,
    hub: Arc<Hub>,
    handler: Arc<dyn Handler>,
) {
    match run_connection(&fd, id, pid, &hub, &handler).await {
        Ok(()) => info!("ztunnel disconnected"),
        Err(e) => warn!(error = %e, "closing ZDS connection"),
    }
    hub.remove(id);
    handler.disconnected(id);
}

/// Sends the snapshot's entries until one fails the connection; what is
/// left of `entries` was not sent.
/// Sends the snapshot's entries; `sent`: the pods it named (with the
/// cookie of the netns an `add` carried).
async fn send_entries(
    fd: &AsyncFd<OwnedFd>,
    pid: Option<i32>,
    handler: &Arc<dyn Handler>,
    entries: &mut impl Iterator<Item = SnapshotEntry>,
    sent: &mut Vec<(String, Option<u64>)>,
) -> Result<(), ZdsError> {
    for e in entries {
        match e {
            SnapshotEntry::Add {
                uid,
                cookie,
                workload,
                netns,
            } => {
                let out = exchange(fd, &WorkloadRequest::add(&uid, &workload), Some(&netns)).await;
                handler.add_outcome(&uid, cookie, pid, &out);
                sent.push((uid, Some(cookie)));
                match out {
                    Err(e) if e.is_fatal() => return Err(e),
                    _ => {}
                }
            }
            SnapshotEntry::Keep { uid } => {
                if let Answer::Nack(t) = exchange(fd, &WorkloadRequest::keep(&uid), None).await? {
                    warn!(%uid, nack = %t, "ztunnel nacked keep");
                }
                sent.push((uid, None));
            }
        }
    }
    Ok(())
}

async fn run_connection(
    fd: &AsyncFd<OwnedFd>,
    id: u64,
    pid: Option<i32>,
    hub: &Arc<Hub>,
    handler: &Arc<dyn Handler>,
) -> Result<(), ZdsError> {
    // ztunnel speaks first.
    let hello = deadline(recv(fd, MAX_REQUEST)).await?;
    let version = parse_hello(&hello.data, hello.fds.len())?;
    if version != Version::V1 as i32 {
        warn!(
            version,
            "ztunnel speaks another ZDS version than 1: served as 1"
        );
    }
    hub.attach(id, pid);
    info!("ztunnel connected; sending snapshot");

    // The handler walks the pinned maps (and may wait for an enrollment):
    // off the async workers.
    let h = handler.clone();
    let entries = tokio::task::spawn_blocking(move || h.snapshot())
        .await
        .map_err(|e| ZdsError::Protocol(format!("building the snapshot failed: {e}")))?;
    let n = entries.len();
    let mut entries = entries.into_iter();
    let mut sent = Vec::new();
    if let Err(e) = send_entries(fd, pid, handler, &mut entries, &mut sent).await {
        // Each add the snapshot promised gets an answer, so that its pod
        // is retried (the handler counts it in flight).
        let why = format!("not sent: ztunnel's snapshot stopped: {e}");
        let mut unsent = 0;
        for entry in entries {
            if let SnapshotEntry::Add { uid, .. } = entry {
                handler.add_not_sent(&uid, &why);
                unsent += 1;
            }
        }
        if unsent > 0 {
            warn!(pods = unsent, error = %e, "snapshot stopped: its adds not sent are retried");
        }
        return Err(e);
    }
    if let Answer::Nack(t) = exchange(fd, &WorkloadRequest::snapshot_sent(), None).await? {
        warn!(nack = %t, "ztunnel nacked snapshot_sent");
    }
    info!(pods = n, "snapshot sent");

    let (tx, mut rx) = mpsc::channel::<Job>(64);
    let started = pid.and_then(super::age::started);
    hub.add(Arc::new(Conn {
        id,
        pid,
        started,
        tx,
    }));
    handler.connected(id, pid);
    // A pod unenrolled while the snapshot went out had its `del` sent only
    // to the connections live then, not this one (live from now on).
    for (uid, _) in sent.iter().filter(|(u, c)| handler.left(u, *c)) {
        match exchange(fd, &WorkloadRequest::del(uid), None).await {
            Ok(Answer::Ack) => info!(%uid, "a pod that left during the snapshot: del sent"),
            Ok(Answer::Nack(t)) => warn!(%uid, nack = %t, "ztunnel nacked del"),
            Err(e) if e.is_fatal() => return Err(e),
            Err(e) => warn!(%uid, error = %e, "del failed"),
        }
    }
    // A pod enrolled while the snapshot went out had its add sent to the
    // connection newest then (an older ztunnel about to drain, or none):
    // this one serves it from now on. (One enrolled since this connection
    // went live may get its add twice: ztunnel takes a repeated add of the
    // same netns as done.)
    let (h, named) = (handler.clone(), sent.clone());
    let joined = tokio::task::spawn_blocking(move || h.joined(&named))
        .await
        .map_err(|e| {
            ZdsError::Protocol(format!("listing the pods enrolled meanwhile failed: {e}"))
        })?;
    if !joined.is_empty() {
        info!(
            pods = joined.len(),
            "adding the pods enrolled while the snapshot went out"
        );
    }
    let mut joined = joined.into_iter();
    if let Err(e) = send_entries(fd, pid, handler, &mut joined, &mut Vec::new()).await {
        for entry in joined {
            if let SnapshotEntry::Add { uid, .. } = entry {
                handler.add_not_sent(&uid, &format!("not sent: ztunnel's connection failed: {e}"));
            }
        }
        return Err(e);
    }
    loop {
        tokio::select! {
            job = rx.recv() => {
                let Some(job) = job else { return Ok(()) };
                debug!(kind = job.req.kind(), "request");
                let out = exchange(fd, &job.req, job.fd.as_ref()).await;
                let fatal = out.as_ref().err().filter(|e| e.is_fatal()).map(|e| e.to_string());
                let _ = job.reply.send(out);
                if let Some(e) = fatal {
                    return Err(ZdsError::Protocol(format!("after a failed request: {e}")));
                }
            }
            // Between requests ztunnel has nothing to say: data is a protocol
            // error, EOF a disconnect.
            got = recv(fd, ACK_BUFFER) => {
                return match got {
                    Err(ZdsError::Wire(WireError::Closed)) => Ok(()),
                    Err(e) => Err(e),
                    Ok(_) => Err(ZdsError::Protocol("unsolicited message".into())),
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(id: u64, started: Option<u64>) -> Arc<Conn> {
        let (tx, _) = mpsc::channel(1);
        Arc::new(Conn {
            id,
            pid: None,
            started,
            tx,
        })
    }

    /// The old ztunnel reconnected last (id 3): the adds still go to the
    /// new process; one process's latest connection wins; unknown start
    /// times fall back to connection order.
    #[test]
    fn the_newest_is_the_newest_process_not_the_last_connection() {
        let hub = Hub::default();
        hub.add(conn(2, Some(200)));
        hub.add(conn(3, Some(100)));
        assert_eq!(hub.newest().map(|c| c.id), Some(2));
        hub.add(conn(4, Some(200)));
        assert_eq!(hub.newest().map(|c| c.id), Some(4));
        let unknown = Hub::default();
        unknown.add(conn(1, None));
        unknown.add(conn(2, None));
        assert_eq!(unknown.newest().map(|c| c.id), Some(2));
    }
}

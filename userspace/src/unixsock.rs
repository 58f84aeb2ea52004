//! Binding the agent's unix sockets so that their path only ever names a
//! root-only socket, whatever the umask: bound under a temporary name
//! beside it, made 0600, listening, then renamed over the path (a rename
//! is atomic, and a connection by path reaches the inode it names). A
//! chmod after binding at the path would leave a moment in which anyone
//! could connect.

use std::{
    os::{fd::OwnedFd, unix::fs::PermissionsExt as _},
    path::Path,
};

use nix::sys::socket::{
    bind, listen, socket, AddressFamily, Backlog, SockFlag, SockType, UnixAddr,
};

/// A non-blocking, close-on-exec unix socket of `ty` listening at `path`
/// with mode 0600, replacing a stale socket there.
pub fn bind_private(path: &Path, ty: SockType, backlog: i32) -> std::io::Result<OwnedFd> {
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other(format!("{} names no file", path.display())))?;
    let tmp = path.with_file_name(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&tmp);
    let fd = socket(
        AddressFamily::Unix,
        ty,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    let bound = (|| -> std::io::Result<()> {
        bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &UnixAddr::new(&tmp)?)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
        listen(&fd, Backlog::new(backlog).map_err(std::io::Error::from)?)?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = bound {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(fd)
}

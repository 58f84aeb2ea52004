//! One ZDS message per SOCK_SEQPACKET datagram, the netns fd as SCM_RIGHTS.
//! Blocking-agnostic: these work on any fd; `server` drives them from tokio.

use std::{
    io::{IoSlice, IoSliceMut},
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
};

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

/// The most fds one SCM_RIGHTS message carries (the kernel's `SCM_MAX_FD`).
const SCM_MAX_FD: usize = 253;

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("peer closed the connection")]
    Closed,
    #[error("datagram truncated (larger than {0} bytes)")]
    Truncated(usize),
    #[error("control data truncated")]
    ControlTruncated,
    #[error("{0}")]
    Io(#[from] nix::Error),
}

impl WireError {
    pub fn would_block(&self) -> bool {
        matches!(self, WireError::Io(nix::Error::EAGAIN))
    }
}

/// A received datagram and the fds that came with it.
pub struct Datagram {
    pub data: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// Receives one datagram into a buffer of `max` bytes; truncation is an error.
pub fn recv(fd: BorrowedFd<'_>, max: usize) -> Result<Datagram, WireError> {
    let mut buf = vec![0u8; max];
    // Room for as many fds as one datagram can carry (SCM_MAX_FD) and a
    // credentials message: the kernel installs the fds it passes before
    // saying the room was short, and a truncated list cannot be read back
    // to close them. Every fd a peer sends is owned here, and closed with
    // the datagram unless its reader keeps it.
    let mut cmsg = nix::cmsg_space!([RawFd; SCM_MAX_FD], libc::ucred);
    let (bytes, flags, fds) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<()>(
            fd.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )?;
        let mut fds = Vec::new();
        for c in msg.cmsgs().map_err(WireError::Io)? {
            if let ControlMessageOwned::ScmRights(r) = c {
                // SAFETY: the kernel just installed these fds for us.
                fds.extend(r.into_iter().map(|f| unsafe { OwnedFd::from_raw_fd(f) }));
            }
        }
        (msg.bytes, msg.flags, fds)
    };
    if flags.contains(MsgFlags::MSG_TRUNC) {
        return Err(WireError::Truncated(max));
    }
    if flags.contains(MsgFlags::MSG_CTRUNC) {
        return Err(WireError::ControlTruncated);
    }
    if bytes == 0 && fds.is_empty() {
        return Err(WireError::Closed);
    }
    buf.truncate(bytes);
    Ok(Datagram { data: buf, fds })
}

/// Sends one datagram, with `fd` as SCM_RIGHTS when given.
pub fn send(
    sock: BorrowedFd<'_>,
    data: &[u8],
    fd: Option<BorrowedFd<'_>>,
) -> Result<(), WireError> {
    let iov = [IoSlice::new(data)];
    let raw = fd.map(|f| [f.as_raw_fd()]);
    let cmsgs: Vec<ControlMessage<'_>> = raw
        .as_ref()
        .map(|r| ControlMessage::ScmRights(r))
        .into_iter()
        .collect();
    sendmsg::<()>(sock.as_raw_fd(), &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd as _;

    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};

    use super::*;

    /// A peer that sends more fds than a message of ours carries (ztunnel
    /// sends none) leaves none of them open in the agent: each is closed
    /// with the datagram. Before, past four the receive failed with the
    /// fds already installed and never closed.
    #[test]
    fn every_fd_a_peer_sends_is_closed_with_its_datagram() {
        let (ours, peer) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap();
        let (read_end, write_end) = nix::unistd::pipe2(nix::fcntl::OFlag::O_NONBLOCK).unwrap();
        let raw = [write_end.as_raw_fd(); 6];
        let cmsgs = [ControlMessage::ScmRights(&raw)];
        let iov = [IoSlice::new(b"ack")];
        sendmsg::<()>(peer.as_raw_fd(), &iov, &cmsgs, MsgFlags::empty(), None).unwrap();
        drop(write_end);
        let got = recv(ours.as_fd(), 64).unwrap();
        assert_eq!((got.data.as_slice(), got.fds.len()), (&b"ack"[..], 6));
        drop(got);
        // Every copy of the pipe's write end is closed: its reader sees EOF.
        let mut b = [0u8; 1];
        assert_eq!(nix::unistd::read(read_end.as_raw_fd(), &mut b), Ok(0));
    }
}

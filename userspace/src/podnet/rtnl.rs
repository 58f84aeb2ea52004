//! A blocking rtnetlink socket in the calling thread's netns, one request at
//! a time: the handful of requests an enrollment or a repair makes need no
//! async runtime (what `rtnetlink` offers) and must run on the thread that
//! entered the pod's or the node's netns.

use std::io;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{protocols::NETLINK_ROUTE, Socket};

pub struct Rtnl {
    sock: Socket,
    /// The last request's sequence number: an answer to an earlier request
    /// cut short (an error mid-dump) is skipped, not taken for this one's.
    seq: std::sync::atomic::AtomicU32,
}

impl std::fmt::Debug for Rtnl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rtnl").finish_non_exhaustive()
    }
}

impl Rtnl {
    /// A socket bound in the calling thread's netns (it stays in that netns
    /// whatever the thread does next).
    pub fn open() -> io::Result<Self> {
        let mut sock = Socket::new(NETLINK_ROUTE)?;
        sock.bind_auto()?;
        sock.connect(&netlink_sys::SocketAddr::new(0, 0))?;
        Ok(Self {
            sock,
            seq: Default::default(),
        })
    }

    /// Sends one request and returns its one answer; `Ok(None)` when the
    /// kernel answers ENODEV/ENOENT (no such link, filter or id).
    pub fn request(&self, msg: RouteNetlinkMessage) -> io::Result<Option<RouteNetlinkMessage>> {
        self.request_with(msg, 0)
    }

    /// A change (`flags` e.g. `NLM_F_CREATE | NLM_F_EXCL` besides REQUEST
    /// and ACK) whose every error is returned: ENOENT or ENODEV from a
    /// create (an unknown qdisc or classifier kind, an interface gone
    /// meanwhile) is a failure, not "nothing there".
    pub fn change(&self, msg: RouteNetlinkMessage, flags: u16) -> io::Result<()> {
        self.exchange(msg, flags, false).map(drop)
    }

    /// Deletes one entry (a rule, a route, …): `false` when there was none
    /// (ESRCH, ENOENT, ENODEV; EAFNOSUPPORT or EOPNOTSUPP: a family the
    /// kernel has not, IPv6 off at boot). Not [`Rtnl::request`], which
    /// reads ENOENT as an empty answer, as a delete's success also is.
    pub fn delete(&self, msg: RouteNetlinkMessage) -> io::Result<bool> {
        const NONE: [i32; 5] = [
            libc::ESRCH,
            libc::ENOENT,
            libc::ENODEV,
            libc::EAFNOSUPPORT,
            libc::EOPNOTSUPP,
        ];
        match self.change(msg, 0) {
            Err(e) if e.raw_os_error().is_some_and(|c| NONE.contains(&c)) => Ok(false),
            r => r.map(|()| true),
        }
    }

    /// [`Rtnl::request`] with `flags` besides REQUEST and ACK.
    pub fn request_with(
        &self,
        msg: RouteNetlinkMessage,
        flags: u16,
    ) -> io::Result<Option<RouteNetlinkMessage>> {
        self.exchange(msg, flags, true)
    }

    /// The cookie of the netns the socket lives in: requests on it act
    /// there, whichever netns the calling thread is in.
    pub fn netns_cookie(&self) -> io::Result<u64> {
        crate::podnet::netns::socket_netns_cookie(std::os::fd::AsFd::as_fd(&self.sock))
    }

    /// Sends `msg` with `flags`; returns its sequence number.
    fn send(&self, msg: RouteNetlinkMessage, flags: u16) -> io::Result<u32> {
        let seq = self
            .seq
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        header.sequence_number = seq;
        let mut nl = NetlinkMessage::new(header, NetlinkPayload::from(msg));
        nl.finalize();
        let mut buf = vec![0u8; nl.buffer_len()];
        nl.serialize(&mut buf);
        self.sock.send(&buf, 0)?;
        Ok(seq)
    }

    /// A dump request (e.g. every link): all the messages of its answer.
    pub fn dump(&self, msg: RouteNetlinkMessage) -> io::Result<Vec<RouteNetlinkMessage>> {
        let seq = self.send(msg, NLM_F_REQUEST | NLM_F_DUMP)?;
        let mut out = Vec::new();
        self.receive(seq, |payload| match payload {
            NetlinkPayload::InnerMessage(inner) => {
                out.push(inner);
                None
            }
            NetlinkPayload::Error(e) if e.code.is_some() => Some(Err(e.to_io())),
            NetlinkPayload::Done(_) => Some(Ok(())),
            _ => None,
        })?;
        Ok(out)
    }

    /// Sends one request and reads its answer; `missing_is_none`: ENODEV
    /// and ENOENT read as `Ok(None)`.
    fn exchange(
        &self,
        msg: RouteNetlinkMessage,
        flags: u16,
        missing_is_none: bool,
    ) -> io::Result<Option<RouteNetlinkMessage>> {
        let seq = self.send(msg, NLM_F_REQUEST | NLM_F_ACK | flags)?;
        let mut answer = None;
        self.receive(seq, |payload| match payload {
            NetlinkPayload::InnerMessage(inner) => {
                answer = Some(inner);
                None
            }
            NetlinkPayload::Error(e) => Some(match e.code {
                None => Ok(answer.take()),
                Some(c) if missing_is_none && [libc::ENODEV, libc::ENOENT].contains(&-c.get()) => {
                    Ok(None)
                }
                Some(_) => Err(e.to_io()),
            }),
            NetlinkPayload::Done(_) => Some(Ok(answer.take())),
            _ => None,
        })
    }

    /// Reads the answer to request `seq`, handing each of its messages to
    /// `each` until it returns the outcome; messages of other requests (an
    /// earlier one cut short) are skipped.
    fn receive<T>(
        &self,
        seq: u32,
        mut each: impl FnMut(NetlinkPayload<RouteNetlinkMessage>) -> Option<io::Result<T>>,
    ) -> io::Result<T> {
        loop {
            let mut rbuf: Vec<u8> = Vec::with_capacity(1 << 16);
            let n = self.sock.recv(&mut rbuf, 0)?;
            let mut off = 0;
            while off < n {
                let m = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&rbuf[off..n])
                    .map_err(|e| io::Error::other(e.to_string()))?;
                let len = m.header.length as usize;
                if m.header.sequence_number == seq {
                    if let Some(outcome) = each(m.payload) {
                        return outcome;
                    }
                }
                if len == 0 {
                    break;
                }
                off += len;
            }
        }
    }
}

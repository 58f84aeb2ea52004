//! Clients: open a connection from inside a netns, exchange one line, and say
//! what happened.

use std::{
    io::{BufRead, BufReader, Write},
    net::{IpAddr, SocketAddr, TcpStream},
    time::Duration,
};

use socket2::{Domain, Socket, Type};

use crate::ns::run_in;

#[derive(Clone, Debug, Default)]
pub struct Opts {
    /// SO_MARK on the client socket.
    pub mark: Option<u32>,
    /// Source address to bind (IP_TRANSPARENT when `transparent`).
    pub bind: Option<IpAddr>,
    pub transparent: bool,
    /// Source port to bind (with `bind`'s address, or any).
    pub src_port: Option<u16>,
    /// Connect timeout (default 3 s: enough for two SYN retransmits' worth
    /// of a dropped first SYN to be visible, see `Reached::TimedOut`).
    pub timeout: Option<Duration>,
    /// An IPv6 extension header on every segment (sticky setsockopt), as an
    /// app may add to hide its TCP from a parser that stops at the fixed header.
    pub ipv6_ext: Option<Ipv6Ext>,
}

/// Which IPv6 extension header [`Opts::ipv6_ext`] adds (an empty PadN option).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ipv6Ext {
    HopByHop,
    Destination,
}

/// The outcome of one connection attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reached {
    /// Connected and got this line back.
    Reply(String),
    /// Connection refused (RST to the SYN).
    Refused,
    /// No answer to the SYN in time (dropped).
    TimedOut,
    /// Anything else.
    Error(String),
}

impl Reached {
    pub fn reply(&self) -> Option<&str> {
        match self {
            Reached::Reply(s) => Some(s),
            _ => None,
        }
    }
}

/// Connects from netns `ns` to `dst`, sends a line, reads the answer.
pub fn connect(ns: &str, dst: SocketAddr, opts: Opts) -> Reached {
    run_in(ns, move || connect_here(dst, &opts))
}

/// Same as [`connect`], in the calling thread's netns.
pub fn connect_here(dst: SocketAddr, opts: &Opts) -> Reached {
    match try_connect(dst, opts) {
        Ok(s) => exchange(s),
        Err(e) => classify(e),
    }
}

pub fn try_connect(dst: SocketAddr, opts: &Opts) -> std::io::Result<TcpStream> {
    let domain = if dst.is_ipv4() {
        Domain::IPV4
    } else {
        Domain::IPV6
    };
    let s = Socket::new(domain, Type::STREAM, None)?;
    if let Some(m) = opts.mark {
        s.set_mark(m)?;
    }
    if opts.transparent {
        if dst.is_ipv4() {
            s.set_ip_transparent(true)?;
        } else {
            set_ipv6_transparent(&s)?;
        }
    }
    if opts.bind.is_some() || opts.src_port.is_some() {
        let any: IpAddr = if dst.is_ipv4() {
            std::net::Ipv4Addr::UNSPECIFIED.into()
        } else {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        };
        let src = SocketAddr::new(opts.bind.unwrap_or(any), opts.src_port.unwrap_or(0));
        s.bind(&src.into())?;
    }
    if let Some(ext) = opts.ipv6_ext {
        set_ipv6_ext(&s, ext)?;
    }
    let timeout = opts.timeout.unwrap_or(Duration::from_secs(3));
    s.connect_timeout(&dst.into(), timeout)?;
    let s: TcpStream = s.into();
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    Ok(s)
}

/// Adds an IPv6 extension header holding one PadN option to every segment.
pub fn set_ipv6_ext(s: &Socket, ext: Ipv6Ext) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let opt = match ext {
        Ipv6Ext::HopByHop => libc::IPV6_HOPOPTS,
        Ipv6Ext::Destination => libc::IPV6_DSTOPTS,
    };
    // Next header (the kernel fills it), length 0 (8 bytes), PadN of 4.
    let hdr: [u8; 8] = [0, 0, 1, 4, 0, 0, 0, 0];
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_IPV6,
            opt,
            hdr.as_ptr() as *const libc::c_void,
            hdr.len() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

pub fn set_ipv6_transparent(s: &Socket) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let one: libc::c_int = 1;
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_IPV6,
            libc::IPV6_TRANSPARENT,
            &one as *const _ as *const libc::c_void,
            std::mem::size_of_val(&one) as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

pub fn exchange(mut s: TcpStream) -> Reached {
    if let Err(e) = writeln!(s, "hello") {
        return Reached::Error(e.to_string());
    }
    let mut line = String::new();
    match BufReader::new(s).read_line(&mut line) {
        Ok(0) => Reached::Error("closed without a reply".into()),
        Ok(_) => Reached::Reply(line.trim_end().to_owned()),
        Err(e) => Reached::Error(e.to_string()),
    }
}

pub fn classify(e: std::io::Error) -> Reached {
    match e.kind() {
        std::io::ErrorKind::ConnectionRefused => Reached::Refused,
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Reached::TimedOut,
        _ => Reached::Error(e.to_string()),
    }
}

/// Sends one UDP datagram from netns `ns` and returns the reply, if any.
pub fn udp(ns: &str, dst: SocketAddr) -> Option<String> {
    run_in(ns, move || {
        let bind: SocketAddr = if dst.is_ipv4() {
            "0.0.0.0:0".parse().unwrap()
        } else {
            "[::]:0".parse().unwrap()
        };
        let u = std::net::UdpSocket::bind(bind).ok()?;
        u.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        u.send_to(b"ping", dst).ok()?;
        let mut buf = [0u8; 512];
        let (n, _) = u.recv_from(&mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    })
}

/// A connection opened now and used later: for connections that must exist
/// before capture is attached (row I5).
pub struct Held {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Held {
    /// Opens a connection from netns `ns` to `dst` and exchanges one line.
    pub fn open(ns: &str, dst: SocketAddr) -> std::io::Result<Self> {
        let s = run_in(ns, move || try_connect(dst, &Opts::default()))?;
        let mut h = Self {
            reader: BufReader::new(s.try_clone()?),
            writer: s,
        };
        match h.exchange() {
            Reached::Reply(_) => Ok(h),
            other => Err(std::io::Error::other(format!("first exchange: {other:?}"))),
        }
    }

    /// The connection's own address.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.writer.local_addr()
    }

    /// Sends a line and reads the answer.
    pub fn exchange(&mut self) -> Reached {
        if let Err(e) = writeln!(self.writer, "again") {
            return Reached::Error(e.to_string());
        }
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) => Reached::Error("closed".into()),
            Ok(_) => Reached::Reply(line.trim_end().to_owned()),
            Err(e) => Reached::Error(e.to_string()),
        }
    }
}

/// The flow-hint key sk_lookup uses for a connection from `from` to `to`
/// (remote = source, local = destination).
pub fn hint_key(from: SocketAddr, to: SocketAddr) -> sluice_common::FlowKey {
    let (r, l) = (
        sluice::dataplane::state::addr_key(&from.ip()),
        sluice::dataplane::state::addr_key(&to.ip()),
    );
    sluice_common::FlowKey {
        remote_addr: r.addr,
        local_addr: l.addr,
        remote_port: from.port(),
        local_port: to.port(),
        family: r.family,
        _pad: [0; 3],
    }
}

//! Running a program the kernel holds on a synthetic input
//! (`BPF_PROG_TEST_RUN`), by its id: what verifying a pod's capture runs.
//! aya 0.14 has no test run for sk_lookup programs, and runs others only
//! on a program object it loaded itself (not one found by id at a hook), so
//! three raw `bpf(2)` commands do it, as `relink` does.
//!
//! A tc test run's skb gets a dummy socket of the calling thread's netns
//! (what `bpf_get_netns_cookie` then names) and the netns' `lo` as its
//! device; an sk_lookup run looks up in the calling thread's netns. So
//! both run on a thread inside the netns of the hook they stand for.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;

fn bpf(cmd: libc::c_long, attr: &mut [u8]) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a zeroed prefix of `union bpf_attr` laid out for
    // `cmd`, whose pointers stay valid for the call; the kernel reads at
    // most its size.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// A program by its kernel id (`BPF_PROG_GET_FD_BY_ID`; needs CAP_SYS_ADMIN).
pub fn prog_by_id(id: u32) -> io::Result<OwnedFd> {
    let mut attr = [0u8; 16];
    attr[0..4].copy_from_slice(&id.to_ne_bytes());
    let fd = bpf(BPF_PROG_GET_FD_BY_ID, &mut attr)?;
    // SAFETY: a fresh fd the kernel just returned; closed on drop.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `union bpf_attr`'s `test` member, at the offsets the UAPI gives it.
struct TestAttr([u8; 80]);

impl TestAttr {
    fn new(prog: &OwnedFd) -> Self {
        let mut a = Self([0; 80]);
        a.u32_at(0, prog.as_raw_fd() as u32);
        a
    }
    fn u32_at(&mut self, off: usize, v: u32) {
        self.0[off..off + 4].copy_from_slice(&v.to_ne_bytes());
    }
    fn u64_at(&mut self, off: usize, v: u64) {
        self.0[off..off + 8].copy_from_slice(&v.to_ne_bytes());
    }
    fn retval(&self) -> u32 {
        u32::from_ne_bytes([self.0[4], self.0[5], self.0[6], self.0[7]])
    }
    fn data_in(&mut self, data: &[u8]) {
        self.u32_at(8, data.len() as u32);
        self.u64_at(16, data.as_ptr() as u64);
    }
    fn ctx(&mut self, ctx_in: &[u8], ctx_out: &mut [u8]) {
        self.u32_at(40, ctx_in.len() as u32);
        self.u32_at(44, ctx_out.len() as u32);
        self.u64_at(48, ctx_in.as_ptr() as u64);
        self.u64_at(56, ctx_out.as_mut_ptr() as u64);
    }
    /// Runs the program `n` times (`repeat`); `duration()` is then the
    /// kernel's mean per run.
    fn repeat(&mut self, n: u32) {
        self.u32_at(32, n);
    }
    fn duration(&self) -> u32 {
        u32::from_ne_bytes([self.0[36], self.0[37], self.0[38], self.0[39]])
    }
    fn run(&mut self) -> io::Result<u32> {
        bpf(BPF_PROG_TEST_RUN, &mut self.0)?;
        Ok(self.retval())
    }
}

/// The `struct __sk_buff` fields a tc test run takes in and gives back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SkbCtx {
    pub mark: u32,
    pub cb: [u32; 5],
}

/// Offsets in `struct __sk_buff` (stable UAPI).
const SKB_MARK: usize = 8;
const SKB_CB: usize = 48;
/// Larger than any kernel's `struct __sk_buff` (192 bytes on 6.x): the
/// kernel writes back its whole struct and refuses a smaller buffer.
const SKB_OUT: usize = 256;

/// The `struct __sk_buff` prefix a tc test run takes: `ctx`'s mark and
/// control block.
fn skb_in(ctx: SkbCtx) -> [u8; SKB_CB + 20] {
    let mut ctx_in = [0u8; SKB_CB + 20];
    ctx_in[SKB_MARK..SKB_MARK + 4].copy_from_slice(&ctx.mark.to_ne_bytes());
    for (i, w) in ctx.cb.iter().enumerate() {
        ctx_in[SKB_CB + 4 * i..SKB_CB + 4 * i + 4].copy_from_slice(&w.to_ne_bytes());
    }
    ctx_in
}

/// Runs tc program `prog` on the frame `data` (from its Ethernet header),
/// with `ctx`'s mark and control block. Returns its verdict and the control
/// block it left. Run it from a thread in the hook's netns.
pub fn run_tc(prog: &OwnedFd, data: &[u8], ctx: SkbCtx) -> io::Result<(i32, SkbCtx)> {
    let ctx_in = skb_in(ctx);
    let mut ctx_out = [0u8; SKB_OUT];
    let mut attr = TestAttr::new(prog);
    attr.data_in(data);
    attr.ctx(&ctx_in, &mut ctx_out);
    let verdict = attr.run()? as i32;
    let word = |off: usize| {
        u32::from_ne_bytes([
            ctx_out[off],
            ctx_out[off + 1],
            ctx_out[off + 2],
            ctx_out[off + 3],
        ])
    };
    let mut out = SkbCtx {
        mark: word(SKB_MARK),
        cb: [0; 5],
    };
    for (i, w) in out.cb.iter_mut().enumerate() {
        *w = word(SKB_CB + 4 * i);
    }
    Ok((verdict, out))
}

/// Runs tc program `prog` on `data` `n` times in the kernel (for the
/// bench: the input must be one the program writes no map for, such as a
/// verification's). Returns its verdict and the kernel's mean ns per run.
pub fn time_tc(prog: &OwnedFd, data: &[u8], ctx: SkbCtx, n: u32) -> io::Result<(i32, u32)> {
    let ctx_in = skb_in(ctx);
    let mut ctx_out = [0u8; SKB_OUT];
    let mut attr = TestAttr::new(prog);
    attr.data_in(data);
    attr.ctx(&ctx_in, &mut ctx_out);
    attr.repeat(n);
    let verdict = attr.run()? as i32;
    Ok((verdict, attr.duration()))
}

/// One listener lookup, as `struct bpf_sk_lookup` describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookup {
    pub protocol: u8,
    pub remote: std::net::SocketAddr,
    pub local: std::net::SocketAddr,
}

/// Offsets in `struct bpf_sk_lookup` (stable UAPI); its size on 6.x.
const LK_FAMILY: usize = 8;
const LK_PROTOCOL: usize = 12;
const LK_REMOTE4: usize = 16;
const LK_REMOTE6: usize = 20;
const LK_REMOTE_PORT: usize = 36;
const LK_LOCAL4: usize = 40;
const LK_LOCAL6: usize = 44;
const LK_LOCAL_PORT: usize = 60;
/// Up to `local_port`: the kernel refuses anything after it set (and
/// `sk`), and writes back the selected socket's cookie at offset 0.
const LK_IN: usize = 64;
const LK_OUT: usize = 128;

/// Runs sk_lookup program `prog` alone on `lookup`. Returns its verdict
/// (`SK_PASS` 1, `SK_DROP` 0) and the cookie of the socket it selected
/// (0: none). Run it from a thread in the netns the lookup stands for. A
/// reuseport listener must be assigned without reuseport selection, or the
/// kernel answers EOPNOTSUPP.
pub fn run_sk_lookup(prog: &OwnedFd, lookup: &Lookup) -> io::Result<(u32, u64)> {
    use std::net::{IpAddr, SocketAddr};
    let mut ctx_in = [0u8; LK_IN];
    let (family, v6) = match lookup.local {
        SocketAddr::V4(_) => (libc::AF_INET as u32, false),
        SocketAddr::V6(_) => (libc::AF_INET6 as u32, true),
    };
    ctx_in[LK_FAMILY..LK_FAMILY + 4].copy_from_slice(&family.to_ne_bytes());
    ctx_in[LK_PROTOCOL..LK_PROTOCOL + 4].copy_from_slice(&u32::from(lookup.protocol).to_ne_bytes());
    let mut put_ip = |ip: IpAddr, at4: usize, at6: usize| match ip {
        IpAddr::V4(a) if !v6 => ctx_in[at4..at4 + 4].copy_from_slice(&a.octets()),
        IpAddr::V6(a) if v6 => ctx_in[at6..at6 + 16].copy_from_slice(&a.octets()),
        _ => {}
    };
    put_ip(lookup.remote.ip(), LK_REMOTE4, LK_REMOTE6);
    put_ip(lookup.local.ip(), LK_LOCAL4, LK_LOCAL6);
    // remote_port is in network order, local_port in host order.
    ctx_in[LK_REMOTE_PORT..LK_REMOTE_PORT + 2].copy_from_slice(&lookup.remote.port().to_be_bytes());
    ctx_in[LK_LOCAL_PORT..LK_LOCAL_PORT + 4]
        .copy_from_slice(&u32::from(lookup.local.port()).to_ne_bytes());
    let mut ctx_out = [0u8; LK_OUT];
    let mut attr = TestAttr::new(prog);
    attr.ctx(&ctx_in, &mut ctx_out);
    let verdict = attr.run()?;
    let mut c = [0u8; 8];
    c.copy_from_slice(&ctx_out[0..8]);
    Ok((verdict, u64::from_ne_bytes(c)))
}

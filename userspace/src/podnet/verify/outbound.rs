//! The outbound cases of a verification: a SYN (and a DNS query) the pod
//! sends, through the program that gives it its verdict: the interface's
//! egress program, and on the local route `lo`'s too.

use std::{net::IpAddr, net::SocketAddr, os::fd::OwnedFd};

use sluice_common::{HintVerdict, Role, MARK_ZTUNNEL, PORT_DNS};

use crate::dataplane::testrun::Lookup;

use super::{packets, tcp, Failed, Run, APP_PORT, TC_ACT_REDIRECT, TC_NEXT};

impl Run<'_> {
    /// An outbound SYN from `addr`: the egress program redirects it into
    /// the pod with the outbound verdict, and sk_lookup gives it 15001; with
    /// ztunnel's mark the same SYN is passed on untouched.
    pub(super) fn outbound(
        &mut self,
        egress: &OwnedFd,
        steer: &OwnedFd,
        addr: IpAddr,
    ) -> Result<(), Failed> {
        let preferred = packets::remote(addr.is_ipv6(), APP_PORT);
        let Some(to) = self.plan.exclusions.captured_outbound(preferred) else {
            // The pod's exclusions leave nothing captured: the SYN leaves
            // untouched.
            let syn = packets::tcp_syn(SocketAddr::new(addr, 0), preferred);
            let case = format!("excluded outbound from {addr}");
            return self.tc_case(&case, egress, &syn, 0, TC_NEXT, None);
        };
        let conn = tcp(SocketAddr::new(addr, 0), to);
        let syn = packets::tcp_syn(conn.remote, conn.local);
        let case = format!("outbound from {addr}");
        let want = HintVerdict::Outbound;
        self.tc_case(&case, egress, &syn, 0, TC_ACT_REDIRECT, Some(want))?;
        self.lookup_case(&case, steer, &conn, want, Some(Role::Outbound))?;
        let case = format!("ztunnel's own SYN from {addr}");
        self.tc_case(&case, egress, &syn, MARK_ZTUNNEL, TC_NEXT, None)
    }

    /// A DNS query over UDP from `addr`: redirected to the DNS proxy's
    /// socket.
    pub(super) fn dns(
        &mut self,
        egress: &OwnedFd,
        steer: &OwnedFd,
        addr: IpAddr,
    ) -> Result<(), Failed> {
        let conn = Lookup {
            protocol: libc::IPPROTO_UDP as u8,
            remote: SocketAddr::new(addr, 0),
            local: packets::remote(addr.is_ipv6(), PORT_DNS),
        };
        let case = format!("DNS query from {addr}");
        let want = HintVerdict::DnsUdp;
        let query = packets::udp_dns(conn.remote, conn.local);
        self.tc_case(&case, egress, &query, 0, TC_ACT_REDIRECT, Some(want))?;
        self.lookup_case(&case, steer, &conn, want, Some(Role::DnsUdp))
    }

    /// A DNS query over TCP from `addr`: its SYN goes to the DNS proxy's
    /// listener.
    pub(super) fn dns_tcp(
        &mut self,
        egress: &OwnedFd,
        steer: &OwnedFd,
        addr: IpAddr,
    ) -> Result<(), Failed> {
        let conn = tcp(
            SocketAddr::new(addr, 0),
            packets::remote(addr.is_ipv6(), PORT_DNS),
        );
        let case = format!("DNS over TCP from {addr}");
        let want = HintVerdict::DnsTcp;
        let syn = packets::tcp_syn(conn.remote, conn.local);
        self.tc_case(&case, egress, &syn, 0, TC_ACT_REDIRECT, Some(want))?;
        self.lookup_case(&case, steer, &conn, want, Some(Role::DnsTcp))
    }

    /// On the local route: the SYN an app's connection to a remote
    /// address sends over `lo` gets the outbound verdict from `lo`'s egress
    /// program (run in the pod's netns, which the program takes the SYN's
    /// pod from, as from its socket's), and stays on `lo` for sk_lookup; a
    /// SYN of ztunnel's is passed on untouched.
    pub(super) fn local_route(&mut self, lo_out: &OwnedFd, addr: IpAddr) -> Result<(), Failed> {
        let preferred = packets::remote(addr.is_ipv6(), APP_PORT);
        // The pod's exclusions leave nothing captured: their rules keep
        // its SYNs off `lo`.
        let Some(to) = self.plan.exclusions.captured_outbound(preferred) else {
            return Ok(());
        };
        let syn = packets::tcp_syn(SocketAddr::new(addr, 0), to);
        let case = format!("outbound over the local route from {addr}");
        self.tc_case(&case, lo_out, &syn, 0, TC_NEXT, Some(HintVerdict::Outbound))?;
        let case = format!("ztunnel's own SYN over lo from {addr}");
        self.tc_case(&case, lo_out, &syn, MARK_ZTUNNEL, TC_NEXT, None)
    }
}

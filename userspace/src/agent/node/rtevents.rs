//! rtnetlink event sockets, as the pod and node watches open them, and what
//! an event is about, told from its message type alone.

use std::{
    os::fd::{AsRawFd, RawFd},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
};

use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
use sluice_common::{LOCAL_ROUTE_TABLE, ROUTE_TABLE};

const RTM_DELROUTE: u16 = 25;
const RTM_DELRULE: u16 = 33;
/// The main routing table's id.
const RT_TABLE_MAIN: u32 = 254;

/// What a batch of a pod's events was about.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Changed {
    /// A link or an address.
    pub(super) links: bool,
    /// A qdisc, filter or chain (`RTM_*QDISC`, `RTM_*TFILTER`, `RTM_*CHAIN`).
    pub(super) tc: bool,
    /// A route or policy rule deleted (`RTM_DELROUTE`, `RTM_DELRULE`):
    /// perhaps sluice's, which make a redirected packet local.
    pub(super) routing: bool,
}

impl Changed {
    pub(super) const ALL: Changed = Changed {
        links: true,
        tc: true,
        routing: true,
    };
    pub(super) const TC: Changed = Changed {
        links: false,
        tc: true,
        routing: false,
    };

    /// What an event of message type `t` is about; `None`: nothing to
    /// look at. `RTM_NEWQDISC` is left out: the kernel broadcasts one for
    /// every qdisc GET (a repair asks which qdisc holds a hook it cannot
    /// attach to), so heeding it would have a pod verify itself in a loop;
    /// and a qdisc added or changed takes nothing from sluice's filters
    /// (taking the hook from them starts with `RTM_DELQDISC`). Of routes
    /// and rules only deletions count, and only in sluice's table (see
    /// [`Changed::of_message`]): a repair's own additions would have it
    /// repair again, and an address or interface removed takes its own
    /// routes with it (its address event says so).
    pub(super) fn of_message_type(t: u16) -> Option<Changed> {
        const RTM_NEWQDISC: u16 = 36;
        // RTM_NEWROUTE..RTM_GETROUTE is 24..=26; RTM_NEWRULE..RTM_GETRULE 32..=34.
        if t == RTM_DELROUTE || t == RTM_DELRULE {
            return Some(Changed {
                routing: true,
                ..Changed::default()
            });
        }
        if (24..=26).contains(&t) || (32..=34).contains(&t) {
            return None;
        }
        // RTM_DELQDISC..RTM_GETTFILTER is 37..=47; RTM_NEWCHAIN..RTM_GETCHAIN 100..=102.
        let tc = (37..=47).contains(&t) || (100..=102).contains(&t);
        (t != RTM_NEWQDISC).then_some(Changed {
            links: !tc,
            tc,
            routing: false,
        })
    }

    /// What the event in datagram `msg` is about (see
    /// [`Changed::of_message_type`]); a datagram too short to tell counts
    /// as every kind. A route or rule deleted counts only in sluice's table:
    /// `rtmsg` and `fib_rule_hdr` both carry the table in their fifth byte,
    /// after the 16-byte `nlmsghdr`.
    pub(super) fn of_message(msg: &[u8]) -> Option<Changed> {
        let Some(t) = msg.get(4..6) else {
            return Some(Changed::ALL);
        };
        let t = u16::from_ne_bytes([t[0], t[1]]);
        // sluice's tables, and the main table of the local route's
        // exclusion rules (`lookup main`).
        let ours = |table: u32| {
            table == ROUTE_TABLE
                || table == LOCAL_ROUTE_TABLE
                || (t == RTM_DELRULE && table == RT_TABLE_MAIN)
        };
        let other_table =
            |m: &[u8]| ROUTE_TABLE < 256 && m.get(20).is_some_and(|&table| !ours(u32::from(table)));
        if (t == RTM_DELROUTE || t == RTM_DELRULE) && other_table(msg) {
            return None;
        }
        Self::of_message_type(t)
    }

    pub(super) fn or(self, o: Changed) -> Changed {
        Changed {
            links: self.links || o.links,
            tc: self.tc || o.tc,
            routing: self.routing || o.routing,
        }
    }
}

/// A link-event socket, counted in `open` for as long as it exists (the
/// count is what `sluice status` shows: 0 means no socket is open).
pub(super) struct Watch {
    sock: Socket,
    open: Arc<AtomicUsize>,
}

impl Watch {
    /// A non-blocking rtnetlink socket in the calling thread's netns,
    /// subscribed to its events of `groups`.
    pub(super) fn open(open: &Arc<AtomicUsize>, groups: u32) -> std::io::Result<Self> {
        // Counted first: the count is never below the sockets open.
        open.fetch_add(1, Ordering::Relaxed);
        let mut w = Self {
            sock: Socket::new(NETLINK_ROUTE).inspect_err(|_| {
                open.fetch_sub(1, Ordering::Relaxed);
            })?,
            open: open.clone(),
        };
        w.sock.bind(&SocketAddr::new(0, groups))?;
        w.sock.set_non_blocking(true)?;
        Ok(w)
    }
}

impl Watch {
    /// Reads one datagram into `buf`, truncated to its capacity (a netlink
    /// datagram is consumed whole whatever the buffer).
    pub(super) fn recv(&self, buf: &mut Vec<u8>) -> std::io::Result<()> {
        self.sock.recv(buf, 0).map(drop)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }
}

impl AsRawFd for Watch {
    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tc_messages_are_told_from_link_address_and_routing_ones() {
        let tc = Changed::TC;
        let links = Changed {
            links: true,
            ..Changed::default()
        };
        // RTM_DELQDISC, RTM_NEWTFILTER, RTM_DELTFILTER, RTM_NEWCHAIN.
        for t in [37, 44, 45, 100] {
            assert_eq!(Changed::of_message_type(t), Some(tc), "{t}");
        }
        // RTM_NEWLINK, RTM_DELLINK, RTM_NEWADDR.
        for t in [16, 17, 20] {
            assert_eq!(Changed::of_message_type(t), Some(links), "{t}");
        }
        // What every qdisc GET broadcasts: not a change.
        assert_eq!(Changed::of_message_type(36), None);
        // RTM_DELROUTE, RTM_DELRULE; not RTM_NEWROUTE, RTM_NEWRULE.
        let routing = Changed::of_message_type(25);
        assert!(routing.is_some_and(|c| c.routing && !c.tc && !c.links));
        assert_eq!(Changed::of_message_type(33), routing);
        assert_eq!(Changed::of_message_type(24), None);
        assert_eq!(Changed::of_message_type(32), None);
        assert_eq!(tc.or(links).or(routing.unwrap()), Changed::ALL);
        // A deletion in sluice's tables (a rule of the local route's
        // exclusions in main too), and in another (an address's own
        // routes in `local`, 255; a route in main); a datagram too short
        // to tell.
        let deleted = |t: u16, table: u8| {
            let mut m = vec![0u8; 28];
            m[4..6].copy_from_slice(&t.to_ne_bytes());
            m[20] = table;
            Changed::of_message(&m)
        };
        assert_eq!(deleted(25, ROUTE_TABLE as u8), routing);
        assert_eq!(deleted(33, ROUTE_TABLE as u8), routing);
        assert_eq!(deleted(25, LOCAL_ROUTE_TABLE as u8), routing);
        assert_eq!(deleted(33, LOCAL_ROUTE_TABLE as u8), routing);
        assert_eq!(deleted(33, 254), routing);
        assert_eq!(deleted(25, 255), None);
        assert_eq!(deleted(25, 254), None);
        assert_eq!(Changed::of_message(&[0; 4]), Some(Changed::ALL));
    }
}

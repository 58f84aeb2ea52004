//! Verifying a pod's capture by running it: ask the kernel what runs at
//! every hook the pod depends on, in the order it runs it, then run the
//! programs it holds there (by id) on synthetic packets and check the
//! verdicts a captured pod's traffic must get. Records are not trusted: a
//! filter swapped, moved or shadowed, a link detached, a listener gone from
//! the socket map all show here as a failed case.
//!
//! Nothing a verification does changes real traffic: the programs tell its
//! runs apart and write no map (`sluice_common::verify`); the one map it
//! writes, `verify_hints`, only its own sk_lookup runs read, and the entry
//! is removed right after each run.

pub mod packets;

use packets::{flow_key, tcp};

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    os::fd::{AsRawFd, OwnedFd},
    path::PathBuf,
};

use aya::{
    maps::{HashMap, MapData},
    programs::TcAttachType,
};
use sluice_common::{
    FlowHint, FlowKey, HintVerdict, Role, MARK_MASK, MARK_REDIRECT, MARK_ZTUNNEL, PORT_DNS,
    PORT_HBONE, VERIFY_CB_COOKIE_HI, VERIFY_CB_COOKIE_LO, VERIFY_CB_VERDICT, VERIFY_MAGIC,
};

use crate::{
    dataplane::{
        features::TcAttach,
        hookview::{self, Standing},
        loader::{Dataplane, Program},
        state::{addr_of, link_local},
        testrun::{self, Lookup, SkbCtx},
    },
    podnet::{
        enroll::host_peers,
        hostside::HostPeer,
        netns::Netns,
        podlinks::{expected_links, LinkSpec},
        podview::PodView,
        rtnl::Rtnl,
        sockets,
    },
};

/// `TCX_NEXT` (cls_bpf's `TC_ACT_UNSPEC`): the programs' "not mine, go on".
const TC_NEXT: i32 = -1;
const TC_ACT_REDIRECT: i32 = 7;
const SK_PASS: u32 = 1;
/// The app port the inbound cases connect to (any port but HBONE's).
const APP_PORT: u16 = 80;

/// What verifying one pod needs, copied under the node-wide lock.
pub struct Plan {
    pub cookie: u64,
    pub netns: Netns,
    /// The addresses the programs know as the pod's.
    pub addrs: Vec<IpAddr>,
    /// DNS capture is on for the pod.
    pub dns: bool,
    /// Interfaces whose TCP is rerouted to 15001.
    pub reroute: Vec<String>,
    /// The pod's TCP takes the local route (`lo`'s egress has a program).
    pub local_route: bool,
    /// The pod asked for no inbound capture (`bypass-inbound-capture`):
    /// its inbound SYNs but HBONE's go where they are addressed.
    pub bypass_inbound: bool,
    /// The exclusions in force: the cases pick a destination they leave
    /// captured, or check that the programs exclude it.
    pub exclusions: crate::exclusions::PodExclusions,
    /// This build's programs, by kernel id: what must run at each hook, and
    /// the only programs a verification runs.
    pub ours: BTreeMap<Program, u32>,
    /// tc programs attach as tcx links (else as cls_bpf filters).
    pub tcx: bool,
    /// Where `verify_hints` is pinned.
    pub maps_dir: PathBuf,
    /// The node's netns and the host side of the pod's veths there, when
    /// the agent knows the node (`--node-netns`).
    pub host: Option<HostPlan>,
    /// ztunnel's sockets registered for the pod, by role and socket cookie,
    /// as the agent holds them; `None`: listed with sock_diag in the pod's
    /// netns (a walk of the socket tables the agent's duplicates spare).
    pub listeners: Option<Vec<(Role, u64)>>,
    /// The pod's netns over a socket made inside it, for every run's question.
    pub view: PodView,
}

/// The host side of a pod's veths: where the host-side program runs.
pub struct HostPlan {
    pub netns: Netns,
    pub peers: Vec<HostPeer>,
}

/// A verification that passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// Cases run (hooks looked at, programs run).
    pub cases: usize,
    /// What could not be run and was only looked at, and why (e.g. an
    /// interface without an Ethernet header).
    pub unrun: Vec<String>,
}

/// The first case that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{case}: {detail}")]
pub struct Failed {
    /// Which case (`egress eth0`, `inbound 10.0.0.2:80`, …).
    pub case: String,
    /// What the kernel did instead.
    pub detail: String,
}

fn failed(case: impl Into<String>, detail: impl Into<String>) -> Failed {
    Failed {
        case: case.into(),
        detail: detail.into(),
    }
}

/// The plan of pod `cookie`'s verification; `None` when it is not enrolled
/// or its netns cannot be opened.
pub fn plan(dp: &Dataplane, cookie: u64) -> Option<Plan> {
    let maps = dp.maps();
    let path = maps.meta(cookie)?.netns;
    let netns = Netns::open(std::path::Path::new(&path)).ok()?;
    // One visit of the netns: its socket's cookie shows it is still the
    // pod's, its link dump names the interfaces (for the runs too) and their
    // host-side peers.
    let view = PodView::open_links(&netns)
        .ok()
        .filter(|v| v.cookie == cookie)?;
    let options = maps.options(cookie);
    let host = match dp.node().filter(|_| dp.has_program(Program::Host)) {
        Some(node) => {
            let (peers, _held) = host_peers(dp, cookie, &netns, Some(&view), &view.names(), false);
            Some(HostPlan {
                netns: node.netns.try_clone().ok()?,
                peers,
            })
        }
        None => None,
    };
    Some(Plan {
        cookie,
        netns,
        addrs: maps
            .published_addrs(cookie)
            .iter()
            .map(addr_of)
            .filter(|a| !link_local(a))
            .collect(),
        dns: maps.dns_on(cookie),
        reroute: options.reroute,
        local_route: maps.local_route(cookie).is_some(),
        bypass_inbound: options.bypass_inbound,
        exclusions: options.exclusions,
        ours: dp.program_ids(),
        tcx: dp.tc_attach() == TcAttach::Tcx,
        maps_dir: dp.pins().maps(),
        host,
        listeners: None,
        view,
    })
}

/// Verifies one pod. Blocking: enters its netns on the calling thread.
pub fn verify(plan: &Plan) -> Result<Verified, Failed> {
    let listeners = match &plan.listeners {
        Some(held) => held.clone(),
        None => sockets::seen_listeners(&plan.netns)
            .map_err(|e| failed("listeners", format!("cannot list ztunnel's sockets: {e}")))?
            .into_iter()
            .map(|l| (l.role, l.cookie))
            .collect(),
    };
    let hints = HashMap::<MapData, FlowKey, FlowHint>::try_from(aya::maps::Map::HashMap(
        MapData::from_pin(plan.maps_dir.join("verify_hints")).map_err(|e| {
            failed(
                "verify_hints",
                format!("the pinned dataplane has no verification map ({e})"),
            )
        })?,
    ))
    .map_err(|e| failed("verify_hints", e.to_string()))?;
    let mut run = Run {
        plan,
        listeners,
        hints,
        cases: 0,
        unrun: Vec::new(),
    };
    plan.netns
        .run(|| run.all())
        .map_err(|e| failed("netns", e.to_string()))??;
    if let Some(host) = &plan.host {
        host.netns
            .run(|| run.host(&host.peers))
            .map_err(|e| failed("node netns", e.to_string()))??;
    }
    Ok(Verified {
        cases: run.cases,
        unrun: run.unrun,
    })
}

/// One verification in progress, inside the pod's netns.
struct Run<'a> {
    plan: &'a Plan,
    /// ztunnel's sockets in the netns: their roles and cookies.
    listeners: Vec<(Role, u64)>,
    hints: HashMap<MapData, FlowKey, FlowHint>,
    cases: usize,
    unrun: Vec<String>,
}

/// The programs that run first at an Ethernet interface's hooks (ours,
/// once the hook checks passed).
struct Runnable {
    ingress: u32,
    egress: u32,
    lo_out: Option<u32>, // `lo`'s egress program, on the local route
}

impl Run<'_> {
    fn all(&mut self) -> Result<(), Failed> {
        let steer = self.steer()?;
        let runnable = self.hooks()?;
        let Some(runnable) = runnable else {
            self.unrun
                .push("no Ethernet interface: no program was run".into());
            return Ok(());
        };
        let open = |id: u32, what: &str| {
            testrun::prog_by_id(id)
                .map_err(|e| failed(what.to_owned(), format!("program id {id}: {e}")))
        };
        let (ingress, egress) = (
            open(runnable.ingress, "ingress")?,
            open(runnable.egress, "egress")?,
        );
        let steer = open(steer, "sk_lookup")?;
        let lo_out = match runnable.lo_out {
            Some(id) => Some(open(id, "egress lo")?),
            None => None,
        };
        let addrs = self.plan.addrs.clone();
        for addr in addrs {
            self.inbound(&ingress, &steer, addr, APP_PORT, Role::Inbound)?;
            self.inbound(&ingress, &steer, addr, PORT_HBONE, Role::Hbone)?;
            self.outbound(&egress, lo_out.as_ref(), &steer, addr)?;
            // Without ztunnel's DNS proxy the queries pass through (no
            // capture to verify); with it, they must reach it.
            if self.plan.dns && self.has(Role::DnsUdp) {
                self.dns(&egress, &steer, addr)?;
            }
            if self.plan.dns && self.has(Role::DnsTcp) {
                self.dns_tcp(&egress, &steer, addr)?;
            }
        }
        Ok(())
    }

    /// On the host side of each of the pod's veths, in the node's netns:
    /// sluice's host-side program runs first, and a SYN a socket of the
    /// node sends to each of the pod's addresses (a kubelet probe) is
    /// hinted as the node's own and passed on.
    fn host(&mut self, peers: &[HostPeer]) -> Result<(), Failed> {
        let want = self.plan.ours.get(&Program::Host).copied().unwrap_or(0);
        let nl = Rtnl::open().map_err(|e| failed("node netns", e.to_string()))?;
        for peer in peers {
            self.cases += 1;
            let case = format!("host side {}", peer.host_iface);
            let first = self
                .first_at(&nl, peer.host_index, TcAttachType::Egress)
                .map_err(|d| failed(case.clone(), d))?;
            if first != want {
                return Err(failed(
                    case,
                    format!("program id {first} runs first; sluice's (id {want}) must"),
                ));
            }
            let prog = testrun::prog_by_id(want)
                .map_err(|e| failed(case.clone(), format!("program id {want}: {e}")))?;
            for addr in self.plan.addrs.clone() {
                let probe = packets::tcp_syn(
                    packets::remote(addr.is_ipv6(), 0),
                    SocketAddr::new(addr, APP_PORT),
                );
                let case = format!("probe to {addr} at {}", peer.host_iface);
                self.tc_case(&case, &prog, &probe, 0, TC_NEXT, Some(HintVerdict::Host))?;
            }
        }
        Ok(())
    }

    /// The netns' sk_lookup programs: only sluice's. Returns its id.
    fn steer(&mut self) -> Result<u32, Failed> {
        self.cases += 1;
        let ours = self.plan.ours.get(&Program::Steer).copied().unwrap_or(0);
        let ns = std::fs::File::open("/proc/thread-self/ns/net")
            .map_err(|e| failed("sk_lookup", e.to_string()))?;
        let ids = hookview::prog_query(ns.as_raw_fd() as u32, hookview::BPF_SK_LOOKUP)
            .map_err(|e| failed("sk_lookup", format!("cannot ask the kernel: {e}")))?;
        if ids != [ours] {
            return Err(failed(
                "sk_lookup",
                format!("the netns runs {ids:?}; only sluice's program (id {ours}) must run there"),
            ));
        }
        Ok(ours)
    }

    /// What runs first at each of the pod's tc hooks is this build's
    /// program for it. Returns the programs to run, from an Ethernet
    /// interface (`None`: the pod has none).
    fn hooks(&mut self) -> Result<Option<Runnable>, Failed> {
        // The plan's socket in the pod's netns for every question about it.
        let view = &self.plan.view;
        let (ifaces, l3) = (view.names(), view.l3_names());
        let (mut ingress, mut egress, mut lo_out) = (None, None, None);
        for spec in expected_links(&ifaces, &l3, &[], &self.plan.reroute, self.plan.local_route) {
            let Some(hook) = spec.tc_hook() else {
                continue;
            };
            self.cases += 1;
            let want = self.plan.ours.get(&spec.program()).copied().unwrap_or(0);
            let case = || {
                let dir = match hook.kind {
                    TcAttachType::Egress => "egress",
                    _ => "ingress",
                };
                format!("{dir} {}", hook.iface)
            };
            let first = view
                .index(hook.iface)
                .ok_or_else(|| "no such device".to_owned())
                .and_then(|index| self.first_at(&view.nl, index, hook.kind))
                .map_err(|d| failed(case(), d))?;
            if first != want {
                return Err(failed(
                    case(),
                    format!("program id {first} runs first; sluice's (id {want}) must"),
                ));
            }
            match &spec {
                LinkSpec::Ingress(_) => ingress = ingress.or(Some(want)),
                LinkSpec::Egress(_) => egress = egress.or(Some(want)),
                LinkSpec::LoOut => lo_out = Some(want),
                LinkSpec::EgressL3(i) => self.unrun.push(format!(
                    "{i}: no Ethernet header, its programs were not run"
                )),
                _ => {}
            }
        }
        Ok(ingress.zip(egress).map(|(ingress, egress)| Runnable {
            ingress,
            egress,
            lo_out,
        }))
    }

    /// The id of the program that runs first at `iface`'s `kind` hook, or
    /// why there is none of sluice's to run.
    /// `nl`: a socket in the calling thread's netns, where the device with
    /// index `index` is.
    fn first_at(&self, nl: &Rtnl, index: u32, kind: TcAttachType) -> Result<u32, String> {
        // tcx runs before cls_bpf.
        let tcx = hookview::tcx_programs_at(index, kind)
            .map_err(|e| format!("cannot ask the kernel for its tcx programs: {e}"))?;
        if let Some(&first) = tcx.first() {
            return Ok(first);
        }
        // A device deleted since the plan's dump has no hooks either: named
        // as such, not as a hook without sluice's program.
        let missing = |what: &str| match hookview::device_gone(nl, index) {
            true => format!("the interface (index {index}) is gone"),
            false => what.to_owned(),
        };
        if self.plan.tcx {
            return Err(missing("no tcx program"));
        }
        match hookview::standing_over(nl, index, kind) {
            Ok(Standing::First(id)) => Ok(id),
            Ok(Standing::Missing) => Err(missing("no filter of sluice's")),
            Ok(Standing::Behind { ahead, .. }) => {
                Err(format!("{ahead} runs before sluice's filter"))
            }
            Err(e) => Err(format!("cannot dump its filters: {e}")),
        }
    }

    /// An inbound SYN to `addr:port`: the ingress program hints it for
    /// `role` and passes it on, and sk_lookup gives it ztunnel's listener
    /// (or, for a pod that bypasses inbound capture, passes it on).
    fn inbound(
        &mut self,
        ingress: &OwnedFd,
        steer: &OwnedFd,
        addr: IpAddr,
        port: u16,
        role: Role,
    ) -> Result<(), Failed> {
        // A port the pod's exclusions leave captured; with none, the
        // preferred one, which the programs must then pass uncaptured.
        let captured = match role {
            Role::Hbone => Some(port),
            _ => self.plan.exclusions.captured_inbound_port(port),
        };
        let conn = tcp(
            packets::remote(addr.is_ipv6(), 0),
            SocketAddr::new(addr, captured.unwrap_or(port)),
        );
        let case = format!("{} {}", role_name(role), conn.local);
        let (want, to) = match role {
            Role::Hbone => (HintVerdict::Hbone, Some(role)),
            _ if self.plan.bypass_inbound || captured.is_none() => (HintVerdict::Bypass, None),
            _ => (HintVerdict::Inbound, Some(role)),
        };
        let syn = packets::tcp_syn(conn.remote, conn.local);
        self.tc_case(&case, ingress, &syn, 0, TC_NEXT, Some(want))?;
        self.lookup_case(&case, steer, &conn, want, to)
    }

    /// An outbound SYN from `addr`: the egress program redirects it into the
    /// pod with the outbound verdict (`lo`'s on the local route, `lo_out`,
    /// leaves it on `lo`), and sk_lookup gives it 15001; with ztunnel's
    /// mark the same SYN is passed on untouched.
    fn outbound(
        &mut self,
        egress: &OwnedFd,
        lo_out: Option<&OwnedFd>,
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
        let want = HintVerdict::Outbound;
        for (prog, over, verdict) in [
            (lo_out, " over lo", TC_NEXT),
            (Some(egress), "", TC_ACT_REDIRECT),
        ] {
            let Some(prog) = prog else { continue };
            let case = format!("outbound{over} from {addr}");
            self.tc_case(&case, prog, &syn, 0, verdict, Some(want))?;
            let case = format!("ztunnel's own SYN{over} from {addr}");
            self.tc_case(&case, prog, &syn, MARK_ZTUNNEL, TC_NEXT, None)?;
        }
        let case = format!("outbound from {addr}");
        self.lookup_case(&case, steer, &conn, want, Some(Role::Outbound))
    }

    /// A DNS query over UDP from `addr`: redirected to the DNS proxy's
    /// socket.
    fn dns(&mut self, egress: &OwnedFd, steer: &OwnedFd, addr: IpAddr) -> Result<(), Failed> {
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
    fn dns_tcp(&mut self, egress: &OwnedFd, steer: &OwnedFd, addr: IpAddr) -> Result<(), Failed> {
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

    /// Whether ztunnel has a socket for `role` in the pod's netns.
    fn has(&self, role: Role) -> bool {
        self.listeners.iter().any(|(r, _)| *r == role)
    }

    /// Runs a tc program on `frame` (with `mark`) and checks its verdict
    /// and the hint it would have left (`None`: none).
    fn tc_case(
        &mut self,
        case: &str,
        prog: &OwnedFd,
        frame: &[u8],
        mark: u32,
        verdict: i32,
        hint: Option<HintVerdict>,
    ) -> Result<(), Failed> {
        self.cases += 1;
        let mut cb = [0u32; 5];
        cb[0] = VERIFY_MAGIC;
        let (got, out) = testrun::run_tc(prog, frame, SkbCtx { mark, cb })
            .map_err(|e| failed(case, format!("test run: {e}")))?;
        let hinted = HintVerdict::from_u32(out.cb[VERIFY_CB_VERDICT]);
        let cookie =
            u64::from(out.cb[VERIFY_CB_COOKIE_HI]) << 32 | u64::from(out.cb[VERIFY_CB_COOKIE_LO]);
        let redirected = verdict != TC_ACT_REDIRECT || out.mark & MARK_MASK == MARK_REDIRECT;
        if got != verdict || hinted != hint || !redirected {
            return Err(failed(
                case,
                format!(
                    "verdict {got} with hint {hinted:?} (mark {:#x}); a captured pod's gets {verdict} with {hint:?}",
                    out.mark
                ),
            ));
        }
        if hint.is_some() && cookie != self.plan.cookie {
            return Err(failed(
                case,
                format!(
                    "hinted for netns {cookie}, not the pod's ({})",
                    self.plan.cookie
                ),
            ));
        }
        Ok(())
    }

    /// Runs sk_lookup on `lookup` (the remote end's port 0) hinted
    /// `verdict`: it must select one of ztunnel's `role` sockets (`None`:
    /// pass the lookup on, selecting nothing).
    fn lookup_case(
        &mut self,
        case: &str,
        steer: &OwnedFd,
        lookup: &Lookup,
        verdict: HintVerdict,
        role: Option<Role>,
    ) -> Result<(), Failed> {
        self.cases += 1;
        let key = flow_key(lookup.remote, lookup.local);
        let hint = FlowHint {
            verdict: verdict as u32,
            flags: 0,
            netns_cookie: self.plan.cookie,
            at_ns: 0,
        };
        self.hints
            .insert(key, hint, 0)
            .map_err(|e| failed(case, format!("writing its verification hint: {e}")))?;
        let ran = testrun::run_sk_lookup(steer, lookup);
        let _ = self.hints.remove(&key);
        let (got, cookie) = ran.map_err(|e| failed(case, format!("sk_lookup test run: {e}")))?;
        let wanted: Vec<u64> = self
            .listeners
            .iter()
            .filter(|(r, _)| Some(*r) == role)
            .map(|(_, c)| *c)
            .collect();
        let right = match role {
            Some(_) => wanted.contains(&cookie),
            None => cookie == 0,
        };
        if got != SK_PASS || !right {
            let should = match role {
                Some(r) => format!("ztunnel's {} sockets are {wanted:?}", role_name(r)),
                None => "it must pass the lookup on, selecting nothing".into(),
            };
            return Err(failed(
                case,
                format!("sk_lookup answered {got} selecting socket {cookie}; {should}"),
            ));
        }
        Ok(())
    }
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Outbound => "outbound",
        Role::Inbound => "inbound",
        Role::Hbone => "HBONE",
        Role::DnsTcp => "DNS TCP",
        Role::DnsUdp => "DNS UDP",
    }
}

//! DNS capture (rows D1–D5): a pod's queries to port 53 reach ztunnel's DNS
//! proxy on its localhost:15053, and the answers come back from the address
//! the app asked, as istio-cni's DNS rules (REDIRECT + conntrack) make it.
//! The proxy is a stand-in with SO_MARK 1337 on every socket (as ztunnel's
//! in-pod socket factory), the resolver a stand-in in the client netns.

use sluice_tests::child::Bounded as _;
use std::net::{IpAddr, SocketAddr};

use anyhow::{ensure, Context as _};
use ipnet::IpNet;
use libtest_mimic::Trial;
use sluice::{
    dataplane::state::DnsMode,
    exclusions::PodExclusions,
    options::{DnsChoice, PodOptions},
    podnet::{enroll, verify},
};
use sluice_common::PodState;
use sluice_tests::{
    agent::{AgentProc, PeerProc},
    dns::{
        self, Client, Got, BIG_NAME, PROXY_V4, PROXY_V6, TYPE_A, TYPE_AAAA, UPSTREAM_V4,
        UPSTREAM_V6,
    },
    harness::{as_if_kernel, peer_bin, steering, without_netns_cookie_in_tc, without_tcx, Fixture},
    istio,
    standin::Bind,
    topology::Family,
    wait,
};

use crate::{local_route_trial, trial, TestResult};

pub fn trials() -> Vec<Trial> {
    let mut v = Vec::new();
    for fam in [Family::V4, Family::V6] {
        let name = |row: &str| format!("dns::{}::{row}", fam.name());
        v.push(trial(
            name("d1_d2_queries_reach_the_proxy_answers_come_from_the_resolver"),
            move || captured(fam),
        ));
        v.push(trial(
            format!(
                "dns::no_netns_cookie_in_tc::{}::d1_d2_queries_reach_the_proxy_answers_come_from_the_resolver",
                fam.name()
            ),
            move || as_if_kernel(without_netns_cookie_in_tc(), || captured(fam)),
        ));
        v.push(trial(
            format!(
                "dns::no_tcx::{}::d1_d2_queries_reach_the_proxy_answers_come_from_the_resolver",
                fam.name()
            ),
            move || as_if_kernel(without_tcx(), || captured(fam)),
        ));
        v.push(local_route_trial(
            format!(
                "dns::local_route::{}::d1_d2_queries_reach_the_proxy_answers_come_from_the_resolver",
                fam.name()
            ),
            move || captured(fam),
        ));
        v.push(trial(
            name("d1_dig_gets_the_proxys_answer_over_udp_and_tcp"),
            move || dig(fam),
        ));
        v.push(trial(name("d1_istio_dns_rules_vs_sluice"), move || {
            differential(fam)
        }));
        v.push(trial(
            name("d4_no_proxy_socket_passes_through_to_the_resolver"),
            move || pass_through(fam),
        ));
        let d6 = "d6_a_query_with_a_neighbours_source_address_is_dropped";
        v.push(trial(name(d6), move || spoofed(fam)));
        v.push(trial(
            format!("dns::no_netns_cookie_in_tc::{}::{d6}", fam.name()),
            move || as_if_kernel(without_netns_cookie_in_tc(), || spoofed(fam)),
        ));
    }
    v.push(trial(
        "dns::d7_a_pods_queries_past_its_budget_are_dropped_its_neighbours_answered",
        over_budget,
    ));
    v.push(trial(
        "dns::no_netns_cookie_in_tc::d7_a_pods_queries_past_its_budget_are_dropped_its_neighbours_answered",
        || as_if_kernel(without_netns_cookie_in_tc(), over_budget),
    ));
    v.push(trial(
        "dns::d7_answered_queries_are_not_held_to_the_budget",
        answered_queries_are_not_held_to_the_budget,
    ));
    v.push(trial(
        "dns::d7_queries_dropped_before_their_lookup_leave_no_more_than_the_pods_hint_share",
        dropped_before_lookup,
    ));
    v.push(trial(
        "dns::d5_annotations_and_the_node_default_choose",
        switches,
    ));
    v.push(trial(
        "dns::d5_agent_restart_applies_a_new_node_default_to_enrolled_pods",
        agent_restart,
    ));
    v.push(trial(
        "dns::the_verification_runs_queries_to_the_proxy_and_names_a_missing_socket",
        verified,
    ));
    v.push(trial(
        "dns::e3_exclusions_leave_dns_captured_unless_port_53_is_excluded",
        excluded_53,
    ));
    v
}

/// A fixture with the stand-in ztunnel's capture listeners and DNS proxy in
/// the pod netns and a resolver in the client netns, enrolled with `options`
/// on a node whose DNS capture default is `node_default`. The proxy is
/// started first: enrollment registers the sockets it finds.
struct DnsPod {
    f: Fixture,
    resolver: dns::Server,
    proxy: Option<dns::Server>,
}

impl DnsPod {
    fn new(tag: &str, proxy: bool) -> anyhow::Result<Self> {
        let f = Fixture::new(tag, Some(Bind::DualStack))?;
        let resolver = dns::upstream(&f.topo.client, &[Family::V4.client(), Family::V6.client()]);
        let proxy =
            proxy.then(|| dns::proxy(&f.topo.pod, SocketAddr::new(Family::V4.client(), 53)));
        Ok(Self { f, resolver, proxy })
    }

    fn enroll(&self, options: PodOptions, node_default: bool) -> anyhow::Result<()> {
        let mut dp = self.f.dataplane()?;
        dp.set_dns_capture(node_default)?;
        let e = enroll::enroll_with(
            &mut dp,
            &self.f.topo.pod_netns_path(),
            &self.f.uid,
            &self.f.workload(),
            &options,
        )?;
        ensure!(e.state == PodState::Enabled, "{e:?}");
        self.f.count_local_route(&dp, e.cookie);
        Ok(())
    }

    /// The app asks the resolver (the client netns's address, port 53).
    fn ask(&self, fam: Family, client: Client, name: &str) -> anyhow::Result<Got> {
        let server = SocketAddr::new(fam.client(), 53);
        dns::ask(&self.f.topo.pod, client, server, name, qtype(fam))
            .with_context(|| format!("{client:?} query for {name} to {server}"))
    }

    fn mode(&self) -> anyhow::Result<DnsMode> {
        Ok(self.f.pod_record()?.dns.mode)
    }
}

/// Row E3: a pod's exclusions leave its DNS captured — an address range
/// holding the resolver, another port excluded — unless they name port 53,
/// which turns its DNS capture off (UDP and TCP go to the resolver). With
/// no DNS proxy to capture to (row D4), TCP to 53 is plain outbound, and
/// the resolver's range takes it out of capture as any other connection.
fn excluded_53() -> TestResult {
    let fam = Family::V4;
    let resolver_range = IpNet::new(fam.client(), 24)?.trunc();
    let cases = [
        ("dnex", true, vec![9090], DnsMode::Captured),
        ("dnex53", true, vec![53, 9090], DnsMode::Off),
        ("dnexnp", false, vec![9090], DnsMode::PassThrough),
    ];
    for (tag, proxy, ports, want) in cases {
        let p = DnsPod::new(tag, proxy)?;
        p.enroll(
            PodOptions {
                exclusions: PodExclusions {
                    exclude_outbound_ports: ports.clone(),
                    exclude_outbound_ip_ranges: vec![resolver_range],
                    ..PodExclusions::default()
                },
                ..PodOptions::default()
            },
            true,
        )?;
        ensure!(p.mode()? == want, "{ports:?}: {:?}", p.f.pod_record()?.dns);
        for client in CLIENTS {
            let got = p.ask(fam, client, "a.proxy.test")?;
            let by_proxy = got.answer.addrs == [proxy_addr(fam)];
            ensure!(
                by_proxy == (want == DnsMode::Captured),
                "{ports:?}, {client:?}: answered {got:?}"
            );
        }
        // The TCP query is excluded unless the proxy captures it.
        let excluded = p.f.pod_record()?.excluded.outbound;
        let want_excluded = u64::from(want != DnsMode::Captured);
        ensure!(
            excluded == want_excluded,
            "{tag}: {excluded} excluded, want {want_excluded}"
        );
    }
    Ok(())
}

fn qtype(fam: Family) -> u16 {
    match fam {
        Family::V4 => TYPE_A,
        Family::V6 => TYPE_AAAA,
    }
}

fn proxy_addr(fam: Family) -> IpAddr {
    match fam {
        Family::V4 => PROXY_V4.into(),
        Family::V6 => PROXY_V6.into(),
    }
}

const CLIENTS: [Client; 3] = [Client::UdpConnected, Client::UdpUnconnected, Client::Tcp];

/// Rows D1 (UDP) and D2 (TCP): the proxy answers, from the resolver's
/// address; an EDNS answer over 512 bytes arrives whole; the proxy's own
/// upstream query (mark 0x539) reaches the resolver uncaptured (D3).
fn captured(fam: Family) -> TestResult {
    let p = DnsPod::new("dns", true)?;
    p.enroll(PodOptions::default(), true)?;
    ensure!(p.mode()? == DnsMode::Captured, "{:?}", p.f.pod_record()?);
    let resolver = SocketAddr::new(fam.client(), 53);
    for client in CLIENTS {
        let got = p.ask(fam, client, "a.proxy.test")?;
        ensure!(
            got.answer.addrs == [proxy_addr(fam)] && got.from == resolver,
            "{client:?}: {got:?} (want the proxy's answer from {resolver})"
        );
    }
    for client in [Client::UdpConnected, Client::Tcp] {
        let big = p.ask(fam, client, BIG_NAME)?;
        ensure!(
            big.answer.size > 512 && big.answer.addrs.len() == 60 && big.from == resolver,
            "{client:?}: EDNS-sized answer {} bytes, {} records, from {}",
            big.answer.size,
            big.answer.addrs.len(),
            big.from
        );
    }
    ensure!(
        p.resolver.seen().is_empty(),
        "the resolver saw queries the proxy answers itself: {:?}",
        p.resolver.seen()
    );
    // A name the proxy forwards: its marked upstream query leaves the pod
    // uncaptured and reaches the resolver from the pod's address.
    let fwd = p.ask(fam, Client::UdpConnected, "svc.example")?;
    let upstream_addr = match fam {
        Family::V4 => IpAddr::from(UPSTREAM_V4),
        Family::V6 => IpAddr::from(UPSTREAM_V6),
    };
    ensure!(
        fwd.answer.addrs == [upstream_addr] && fwd.from == resolver,
        "{fwd:?}"
    );
    let seen = p.resolver.seen();
    ensure!(
        seen.len() == 1
            && seen[0].name == "svc.example"
            && seen[0].peer.ip() == Family::V4.pod()
            && !seen[0].tcp,
        "the resolver saw {seen:?}"
    );
    let proxy_seen = p.proxy.as_ref().map(|s| s.seen()).unwrap_or_default();
    ensure!(
        proxy_seen.iter().all(|s| s.peer.ip() == fam.pod()),
        "the proxy saw queries from other than the app's address: {proxy_seen:?}"
    );
    let d = p.f.pod_record()?.dns;
    ensure!(
        d.captured_udp >= 4 && d.captured_tcp >= 2 && d.replies_restored >= 4,
        "{d:?}"
    );
    // Every query was answered: the node-wide map of queries in flight
    // holds none of them (an answered query's entry is released).
    let flows: aya::maps::HashMap<_, sluice_common::DnsFlowKey, sluice_common::DnsFlow> =
        aya::maps::Map::from_map_data(aya::maps::MapData::from_pin(
            p.f.topo.pins.maps().join("dns_flows"),
        )?)?
        .try_into()?;
    let held = flows.keys().count();
    ensure!(held == 0, "{held} answered queries still held in dns_flows");
    Ok(())
}

/// Row D1 with a real resolver client: dig (BIND's, connected UDP sockets)
/// accepts the captured answer, over UDP and TCP.
fn dig(fam: Family) -> TestResult {
    let p = DnsPod::new("dig", true)?;
    p.enroll(PodOptions::default(), true)?;
    let server = format!("@{}", fam.client());
    let rtype = if fam == Family::V4 { "A" } else { "AAAA" };
    for transport in ["+notcp", "+tcp"] {
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", &p.f.topo.pod, "dig"])
            .args([&server, "a.proxy.test", rtype, transport])
            .args(["+short", "+tries=1", "+time=2"])
            .output_bounded()
            .context("running dig (bind9-dnsutils; cargo xtask setup installs it)")?;
        let text = String::from_utf8_lossy(&out.stdout);
        ensure!(
            out.status.success() && text.trim() == proxy_addr(fam).to_string(),
            "dig {transport}: status {}, stdout {text:?}, stderr {:?}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Row D1 against istio-cni's DNS rules in a twin pod netns: the same
/// answers from the same sources for every client, and the proxy's own
/// query reaches the resolver from the same address.
fn differential(fam: Family) -> TestResult {
    let sluice = DnsPod::new("dnss", true)?;
    sluice.enroll(PodOptions::default(), true)?;
    let istio_twin = DnsPod::new("dnsi", true)?;
    istio::apply_with_dns_capture(&istio_twin.f.topo.pod)?;
    let mut rows = Vec::new();
    for p in [&istio_twin, &sluice] {
        let mut row = Vec::new();
        for client in CLIENTS {
            for name in ["a.proxy.test", BIG_NAME, "svc.example"] {
                let got = p.ask(fam, client, name)?;
                let first = got.answer.addrs.first().copied();
                row.push((client, name, first, got.answer.addrs.len(), got.from));
            }
        }
        let upstream: Vec<(IpAddr, bool, String)> = p
            .resolver
            .seen()
            .into_iter()
            .map(|s| (s.peer.ip(), s.tcp, s.name))
            .collect();
        rows.push((row, upstream));
    }
    println!("\n{} DNS capture: Istio | sluice", fam.name());
    for (i, s) in rows[0].0.iter().zip(&rows[1].0) {
        println!("{i:?} | {s:?}");
    }
    println!("resolver saw {:?} | {:?}", rows[0].1, rows[1].1);
    ensure!(
        rows[0] == rows[1],
        "Istio {:?}\nsluice {:?}",
        rows[0],
        rows[1]
    );
    Ok(())
}

/// Pod A, whose proxy answers nothing, sends more queries in a burst than
/// its budget (`DNS_QUERIES_PER_POD_PER_S` unanswered a second; no
/// privileges needed): those past it are dropped and counted
/// (`dns_over_budget`), so it cannot evict the node's other queries in
/// flight from the node-wide `dns_flows`; its neighbour B, asking
/// meanwhile, is answered from its resolver. (Issue 38, case 3.)
fn over_budget() -> TestResult {
    let a = DnsPod::new("dnsbud", false)?;
    let _silent = dns::silent_proxy(&a.f.topo.pod);
    let b = Fixture::in_subnet("dnsbudb", Some(Bind::DualStack), 1)?;
    let b_resolver = SocketAddr::new(b.topo.client_ip(Family::V4), 53);
    let _b_upstream = dns::upstream(&b.topo.client, &[b_resolver.ip()]);
    let _b_proxy = dns::proxy(&b.topo.pod, b_resolver);
    a.enroll(PodOptions::default(), true)?;
    let mut dp = a.f.dataplane()?;
    let e = enroll::enroll(&mut dp, &b.topo.pod_netns_path(), &b.uid, &b.workload())?;
    ensure!(e.state == PodState::Enabled, "{e:?}");
    let over = |dp: &sluice::dataplane::loader::Dataplane| {
        dp.maps().drops(sluice_common::DropReason::DnsOverBudget)
    };
    let before = over(&dp);
    let budget = sluice_common::DNS_QUERIES_PER_POD_PER_S as usize;
    let to = SocketAddr::new(Family::V4.client(), 53);
    // Sends never wait for answers: the burst takes far less than the
    // budget's one-second window.
    sluice_tests::ns::run_in(&a.f.topo.pod, move || -> std::io::Result<()> {
        let s = std::net::UdpSocket::bind("0.0.0.0:0")?;
        s.connect(to)?;
        for i in 0..budget * 2 {
            s.send(&dns::query(i as u16, "burst.proxy.test", qtype(Family::V4)))?;
        }
        Ok(())
    })?;
    let dropped = over(&dp) - before;
    ensure!(
        dropped > 0 && dropped <= budget as u64,
        "{dropped} of {} queries dropped past a budget of {budget}",
        budget * 2
    );
    let got = dns::ask(
        &b.topo.pod,
        Client::UdpConnected,
        b_resolver,
        "b.proxy.test",
        TYPE_A,
    )?;
    ensure!(
        got.from == b_resolver && got.answer.addrs == [proxy_addr(Family::V4)],
        "the neighbour's query: {got:?}"
    );
    Ok(())
}

/// A pod whose proxy answers each query before the next asks more than its
/// budget within one window: every query is answered from the resolver's
/// address and none is dropped (an answer gives its query's use back; the
/// budget bounds queries in flight, not the rate a pod asks at). Before,
/// the budget was a rate: a busy pod's 4,097th query of a second was
/// dropped, and its resolver waited out its timeout.
fn answered_queries_are_not_held_to_the_budget() -> TestResult {
    let a = DnsPod::new("dnsrate", true)?;
    a.enroll(PodOptions::default(), true)?;
    let dp = a.f.dataplane()?;
    let over = || dp.maps().drops(sluice_common::DropReason::DnsOverBudget);
    let before = over();
    let queries = sluice_common::DNS_QUERIES_PER_POD_PER_S as usize + 1_000;
    let resolver = SocketAddr::new(Family::V4.client(), 53);
    let started = std::time::Instant::now();
    sluice_tests::ns::run_in(&a.f.topo.pod, move || -> anyhow::Result<()> {
        let s = std::net::UdpSocket::bind("0.0.0.0:0")?;
        s.set_read_timeout(Some(dns::ANSWER_WAIT))?;
        s.connect(resolver)?;
        let mut buf = [0u8; 4096];
        for i in 0..queries {
            let id = i as u16;
            s.send(&dns::query(id, "rate.proxy.test", TYPE_A))?;
            let n = s
                .recv(&mut buf)
                .with_context(|| format!("no answer to query {i} of {queries}"))?;
            let got = dns::parse_answer(&buf[..n]).context("unparsable answer")?;
            ensure!(got.id == id, "answer id {} for query {id}", got.id);
        }
        Ok(())
    })?;
    let dropped = over() - before;
    ensure!(
        dropped == 0,
        "{dropped} of {queries} answered queries dropped as over budget \
         (asked in {:?})",
        started.elapsed()
    );
    // Every query was answered before the next: nothing of the budget is
    // left in use, however many windows the queries took.
    let budget =
        aya::maps::HashMap::<_, u64, sluice_common::Budget>::try_from(aya::maps::Map::LruHashMap(
            aya::maps::MapData::from_pin(a.f.topo.pins.maps().join("dns_budget"))?,
        ))?;
    let used: Vec<u32> = budget
        .iter()
        .map(|e| e.map(|(_, b)| b.used))
        .collect::<Result<_, _>>()?;
    ensure!(
        used.iter().all(|u| *u == 0),
        "budget uses left after {queries} answered queries: {used:?}"
    );
    Ok(())
}

/// Pod A (NET_ADMIN in its netns) drops its own captured queries before
/// sk_lookup takes their hints: a raw-table rule on the redirected
/// datagram. Those hints stay behind, as a SYN nothing answers does, so
/// they are paid from A's hint share (`HINTS_PER_POD_PER_S` a window) and
/// past it go to the overflow map: A cannot turn `flow_hints` over under
/// its neighbours' kept SYN-cookie hints. Before, a DNS hint was paid from
/// no share: A left up to its DNS budget (2,048) there every second.
fn dropped_before_lookup() -> TestResult {
    let a = DnsPod::new("dnsdrop", true)?;
    a.enroll(PodOptions::default(), true)?;
    let dp = a.f.dataplane()?;
    sluice_tests::ns::exec(
        &a.f.topo.pod,
        &[
            "iptables",
            "-t",
            "raw",
            "-A",
            "PREROUTING",
            "-p",
            "udp",
            "--dport",
            "53",
            "-j",
            "DROP",
        ],
    )?;
    let over_before = dp.maps().hints_over_share();
    let resolver = SocketAddr::new(Family::V4.client(), 53);
    // One socket a query: each leaves a hint of its own tuple.
    let queries = sluice_common::DNS_QUERIES_PER_POD_PER_S as usize;
    sluice_tests::ns::run_in(&a.f.topo.pod, move || -> std::io::Result<()> {
        for i in 0..queries {
            let s = std::net::UdpSocket::bind("0.0.0.0:0")?;
            s.send_to(
                &dns::query(i as u16, "dropped.proxy.test", TYPE_A),
                resolver,
            )?;
        }
        Ok(())
    })?;
    let pod = sluice::dataplane::state::addr_key(&a.f.topo.pod_ip(Family::V4));
    let hints = aya::maps::HashMap::<_, sluice_common::FlowKey, sluice_common::FlowHint>::try_from(
        aya::maps::Map::LruHashMap(aya::maps::MapData::from_pin(
            a.f.topo.pins.maps().join("flow_hints"),
        )?),
    )?;
    let mut left = 0;
    for e in hints.iter() {
        let (k, h) = e?;
        if k.remote_addr == pod.addr
            && k.local_port == 53
            && h.verdict == sluice_common::HintVerdict::DnsUdp as u32
        {
            left += 1;
        }
    }
    let over = dp.maps().hints_over_share() - over_before;
    // The queries may span the end of a window: two shares at most.
    let share = 2 * sluice_common::HINTS_PER_POD_PER_S as usize;
    ensure!(
        left <= share,
        "{left} of {queries} dropped queries' hints left in flow_hints (share {share})"
    );
    ensure!(
        over > 0 && left + over as usize >= queries / 2,
        "{over} hints past the share, {left} within it, for {queries} queries"
    );
    Ok(())
}

/// Pod A (with NET_RAW/NET_ADMIN) sends a DNS query from its neighbour
/// B's address and port (IP_TRANSPARENT). It is dropped and counted
/// (`unknown_source`): neither proxy gets it. Before, on kernels without
/// netns cookies in tc, the address named B: B's proxy took A's query and
/// answered it to B's socket on that port (issue 38, case 6).
fn spoofed(fam: Family) -> TestResult {
    use socket2::{Domain, Socket, Type};
    let a = DnsPod::new("dnssp", true)?;
    let b = Fixture::in_subnet("dnsspb", Some(Bind::DualStack), 1)?;
    let b_proxy = dns::proxy(
        &b.topo.pod,
        SocketAddr::new(b.topo.client_ip(Family::V4), 53),
    );
    a.enroll(PodOptions::default(), true)?;
    let mut dp = a.f.dataplane()?;
    let e = enroll::enroll(&mut dp, &b.topo.pod_netns_path(), &b.uid, &b.workload())?;
    ensure!(e.state == PodState::Enabled, "{e:?}");
    let drops = |dp: &sluice::dataplane::loader::Dataplane| {
        dp.maps().drops(sluice_common::DropReason::UnknownSource)
    };
    let before = drops(&dp);
    let from = SocketAddr::new(b.topo.pod_ip(fam), 40053);
    let to = SocketAddr::new(fam.client(), 53);
    let q = dns::query(7, "spoofed.example.", qtype(fam));
    sluice_tests::ns::run_in(&a.f.topo.pod, move || -> std::io::Result<()> {
        let s = Socket::new(Domain::for_address(to), Type::DGRAM, None)?;
        if to.is_ipv4() {
            s.set_ip_transparent(true)?;
        } else {
            sluice_tests::flow::set_ipv6_transparent(&s)?;
        }
        s.bind(&from.into())?;
        s.send_to(&q, &to.into())?;
        Ok(())
    })?;
    // (An IPv6 datagram may wait for neighbour discovery first.)
    wait::until("an unknown-source drop", wait::DEADLINE, || {
        let n = drops(&dp);
        if n > before {
            Ok(())
        } else {
            Err(n)
        }
    })?;
    drop(dp);
    let proxy = a.proxy.as_ref().context("A's proxy")?;
    ensure!(
        b_proxy.seen().is_empty() && proxy.seen().is_empty(),
        "a proxy took the spoofed query: B's {:?}, A's {:?}",
        b_proxy.seen(),
        proxy.seen()
    );
    // A's own queries are captured as before.
    let got = a.ask(fam, Client::UdpConnected, "own.example.")?;
    ensure!(
        proxy.seen().len() == 1,
        "A's query: {got:?}, proxy saw {:?}",
        proxy.seen()
    );
    Ok(())
}

/// Row D4: DNS capture on, but ztunnel opened no DNS proxy socket (run with
/// `DNS_CAPTURE=false`): queries reach the resolver as without capture
/// (pass-through, counted), where Istio's REDIRECT would answer with a port
/// unreachable. `status` says so.
fn pass_through(fam: Family) -> TestResult {
    let p = DnsPod::new("dnsp", false)?;
    p.enroll(PodOptions::default(), true)?;
    ensure!(p.mode()? == DnsMode::PassThrough, "{:?}", p.f.pod_record()?);
    let resolver = SocketAddr::new(fam.client(), 53);
    for client in CLIENTS {
        let got = p.ask(fam, client, "a.proxy.test")?;
        ensure!(
            got.from == resolver && !got.answer.addrs.contains(&proxy_addr(fam)),
            "{client:?}: {got:?}"
        );
    }
    let seen = p.resolver.seen();
    ensure!(
        seen.len() == 3 && seen.iter().all(|s| s.peer.ip() == fam.pod()),
        "the resolver saw {seen:?}"
    );
    let d = p.f.pod_record()?.dns;
    ensure!(d.passthrough >= 3 && d.captured_udp == 0, "{d:?}");
    Ok(())
}

/// Row D5: `ambient.istio.io/dns-capture` and `bypass-dns-capture` against
/// the node's default, both ways; a new default reaches enrolled pods that
/// did not choose, and only those.
fn switches() -> TestResult {
    let fam = Family::V4;
    let cases = [
        ("dnon", DnsChoice::NodeDefault, true, DnsMode::Captured),
        ("dnoff", DnsChoice::NodeDefault, false, DnsMode::Off),
        ("dnpon", DnsChoice::On, false, DnsMode::Captured),
        ("dnpoff", DnsChoice::Off, true, DnsMode::Off),
    ];
    for (tag, dns, node_default, want) in cases {
        let p = DnsPod::new(tag, true)?;
        p.enroll(
            PodOptions {
                dns,
                ..PodOptions::default()
            },
            node_default,
        )?;
        let what = format!("{dns:?} on a node defaulting to {node_default}");
        let view = p.f.pod_record()?.dns;
        ensure!(view.mode == want && view.choice == dns, "{what}: {view:?}");
        let got = p.ask(fam, Client::UdpConnected, "a.proxy.test")?;
        let by_proxy = got.answer.addrs == [proxy_addr(fam)];
        ensure!(
            by_proxy == (want == DnsMode::Captured),
            "{what}: answered {got:?}"
        );
        // The other default: only a pod without a choice of its own follows.
        let mut dp = p.f.dataplane()?;
        let changed = dp.set_dns_capture(!node_default)?;
        let follows = dns == DnsChoice::NodeDefault;
        ensure!(changed == usize::from(follows), "{what}: {changed} changed");
        let flipped = p.mode()? != want;
        ensure!(flipped == follows, "{what}: mode {:?}", p.mode()?);
    }
    Ok(())
}

/// Row D5 through the agent: a pod enrolled while `--dns-capture` is false
/// has no DNS capture; the agent restarted with true captures its DNS
/// (Istio reconciles existing pods on upgrade). The stand-in ztunnel opens
/// no DNS proxy, so the pod is pass-through: on, with nothing to send to.
fn agent_restart() -> TestResult {
    let f = Fixture::new("dnsag", None)?;
    let mut agent = AgentProc::start_with(&f.topo.pins, &[])?;
    agent.set_env("SLUICE_DNS_CAPTURE", Some("false"));
    agent.restart()?;
    let peer = PeerProc::start(&peer_bin(), &agent.zds, &[])?;
    let pid = peer.pid().context("peer has no pid")?;
    agent.wait_ztunnel(pid, "the agent to report the peer connected", |z| {
        z["connected"] == true
    })?;
    let out = agent.enroll(&f.topo.pod_netns_path(), f.uid.as_str(), "default", "app")?;
    ensure!(steering(&out.stdout), "{}", out.stdout);
    let mode = |a: &AgentProc| -> Option<String> {
        let s = a.status_json().ok()?;
        s["pods"].as_array()?.iter().find_map(|p| {
            (p["uid"] == f.uid.as_str()).then(|| p["dns"]["mode"].as_str().map(str::to_owned))?
        })
    };
    ensure!(mode(&agent).as_deref() == Some("off"), "{:?}", mode(&agent));
    agent.set_env("SLUICE_DNS_CAPTURE", None);
    agent.restart()?;
    wait::until_seen(
        "the restarted agent (default on) to turn the pod's DNS capture on",
        wait::DEADLINE,
        || mode(&agent),
        |m| m.as_deref() == Some("pass-through"),
    )?;
    Ok(())
}

/// With DNS capture on and ztunnel's DNS proxy in the pod, the
/// verification runs a query over UDP and one over TCP to the proxy's
/// sockets; the proxy's UDP socket gone from the socket map (the proxy
/// still holding it) fails the UDP case.
fn verified() -> TestResult {
    let p = DnsPod::new("dvf", true)?;
    p.enroll(PodOptions::default(), true)?;
    let cookie = p.f.pod_record()?.netns_cookie;
    let run = || -> anyhow::Result<Result<verify::Verified, verify::Failed>> {
        let dp = p.f.dataplane()?;
        let plan = verify::plan(&dp, cookie).context("no verification plan")?;
        ensure!(plan.dns, "the plan says DNS capture is off");
        Ok(verify::verify(&plan))
    };
    let with = run()?.map_err(|e| anyhow::anyhow!("with the proxy: {e}"))?;
    sluice::dataplane::state::Maps::open_pinned(&p.f.topo.pins.maps())?
        .remove_listener(cookie, sluice_common::Role::DnsUdp);
    match run()? {
        Err(e) if e.case.starts_with("DNS query from") => {}
        other => {
            anyhow::bail!("the proxy's UDP socket gone from the map: {other:?} (before: {with:?})")
        }
    }
    Ok(())
}

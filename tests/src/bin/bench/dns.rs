//! Scenario `dns`: DNS queries through capture, as before.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr},
};

use anyhow::Context as _;
use rand::rngs::StdRng;
use sluice_tests::{
    istio,
    sink::{Mode, Sink},
    topology::{Family, Topology},
};

use crate::{enroll_enabled, median, ratio, Config, Report, Variant};

/// A pod netns with ztunnel's DNS proxy (the stand-in, answering itself)
/// behind each variant's DNS capture, and its capture listeners.
struct DnsSetup {
    variant: Variant,
    _proxy: sluice_tests::dns::Server,
    _sinks: Vec<Sink>,
    topo: Topology,
}

impl DnsSetup {
    fn new(variant: Variant) -> anyhow::Result<Self> {
        let topo = Topology::new(&format!("d{}", &variant.name()[..1]))?;
        let resolver = SocketAddr::new(Family::V4.client(), 53);
        let proxy = sluice_tests::dns::proxy(&topo.pod, resolver);
        let sinks = [15001, 15006, 15008]
            .into_iter()
            .map(|port| Sink::ztunnel_like(&topo.pod, port, Mode::AcceptClose))
            .collect();
        match variant {
            // (`Hooks` is the `cpu` scenario's alone, `LocalRoute` the
            // `cpu` and `bulk` scenarios'.)
            Variant::None | Variant::Hooks | Variant::LocalRoute => {}
            Variant::Iptables => istio::apply_with_dns_capture(&topo.pod)?,
            // DNS capture is on by default.
            Variant::Sluice => enroll_enabled(&topo, "bench-dns", None, false)?,
        }
        Ok(Self {
            variant,
            _proxy: proxy,
            _sinks: sinks,
            topo,
        })
    }

    /// Where the app sends its queries: the resolver (captured to the
    /// proxy), or, with no capture, the proxy itself.
    fn server(&self) -> SocketAddr {
        match self.variant {
            Variant::None | Variant::Hooks => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 15053),
            _ => SocketAddr::new(Family::V4.client(), 53),
        }
    }
}

/// DNS queries per second from one connected UDP socket, through
/// capture to the DNS proxy (sluice, Istio's rules) vs straight to the same
/// proxy (none), interleaved round by round.
pub fn dns_queries(report: &mut Report, cfg: &Config, _rng: &mut StdRng) -> anyhow::Result<()> {
    let setups: Vec<DnsSetup> = Variant::ALL
        .iter()
        .map(|v| DnsSetup::new(*v))
        .collect::<Result<_, _>>()?;
    let rate = |s: &DnsSetup, window| {
        sluice_tests::dns::query_rate(&s.topo.pod, s.server(), "a.proxy.test", window)
            .with_context(|| format!("DNS queries, {}", s.variant.name()))
    };
    for s in &setups {
        rate(s, std::time::Duration::from_millis(300))?;
    }
    let mut rounds = Vec::new();
    for round in 0..cfg.dns_rounds {
        let mut r = BTreeMap::new();
        for s in &setups {
            r.insert(s.variant, rate(s, cfg.rate_window)?);
        }
        eprintln!("bench: round {} dns {r:?}", round + 1);
        rounds.push(r);
    }
    for v in Variant::ALL {
        report.put(
            &format!("dns_queries_per_s_{}", v.name()),
            median(rounds.iter().map(|r| r[&v]).collect()),
        );
    }
    report.put(
        "dns_rate_ratio_sluice_vs_direct",
        ratio(&rounds, Variant::Sluice, Variant::None),
    );
    report.put(
        "dns_rate_ratio_iptables_vs_direct",
        ratio(&rounds, Variant::Iptables, Variant::None),
    );
    report.put(
        "dns_rate_ratio_sluice_vs_iptables",
        ratio(&rounds, Variant::Sluice, Variant::Iptables),
    );
    Ok(())
}

//! Scenario `exclusions`: what a pod's exclusions cost a new connection.
//! The pod's egress program runs in the kernel (`BPF_PROG_TEST_RUN`,
//! repeated) on an outbound SYN, as a verification's (which writes no map,
//! so a million runs change nothing), once for the pod without exclusions
//! and once with 64 excluded address ranges none of which holds the
//! destination (the most a SYN walks), alternating rounds.

use anyhow::ensure;
use rand::rngs::StdRng;
use sluice::{
    dataplane::{
        loader::{Dataplane, Pins, Program},
        testrun::{self, SkbCtx},
    },
    exclusions::PodExclusions,
    podnet::{enroll, netns::Netns, verify::packets},
    uid::PodUid,
};
use sluice_common::VERIFY_MAGIC;

use crate::{ns_path, percentile, pods::with_bare_pods, workload, Config, Report};

pub fn exclusions(report: &mut Report, cfg: &Config, _rng: &mut StdRng) -> anyhow::Result<()> {
    with_bare_pods("ex", 1, |pods, pins| measure(report, cfg, pods, pins))
}

fn measure(
    report: &mut Report,
    cfg: &Config,
    pods: &crate::pods::BarePods,
    pins: &Pins,
) -> anyhow::Result<()> {
    let mut dp = Dataplane::load_or_adopt(pins.clone())?;
    let p = &pods[0];
    let a = enroll::attach_pod(
        &mut dp,
        &ns_path(&p.name),
        &PodUid::new(&p.name)?,
        &workload(&p.name),
        &Default::default(),
        &enroll::PodAddrs::Netns,
    )?;
    let cookie = a.cookie;
    let src = dp
        .maps()
        .published_addrs(cookie)
        .iter()
        .map(sluice::dataplane::state::addr_of)
        .find(std::net::IpAddr::is_ipv4)
        .ok_or_else(|| anyhow::anyhow!("the bench pod has no IPv4 address"))?;
    let syn = packets::tcp_syn(
        std::net::SocketAddr::new(src, 0),
        packets::remote(false, 80),
    );
    let egress = testrun::prog_by_id(dp.program_ids()[&Program::Egress])?;
    let netns = Netns::open(&ns_path(&p.name))?;
    let sixty_four = PodExclusions {
        exclude_outbound_ip_ranges: (0..64)
            .map(|i| format!("10.{i}.0.0/16").parse())
            .collect::<Result<_, _>>()?,
        ..Default::default()
    };
    let ctx = SkbCtx {
        mark: 0,
        cb: [VERIFY_MAGIC, 0, 0, 0, 0],
    };
    let runs: u32 = if cfg.smoke { 10_000 } else { 1_000_000 };
    let rounds = if cfg.smoke { 2 } else { 9 };
    let (mut none, mut with) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        for (x, into) in [
            (&PodExclusions::default(), &mut none),
            (&sixty_four, &mut with),
        ] {
            dp.set_exclusions(cookie, x)?;
            let (verdict, ns) = netns.run(|| testrun::time_tc(&egress, &syn, ctx, runs))??;
            // Pending (no ztunnel): the SYN is dropped after the
            // exclusions are looked at, in both cases.
            ensure!(
                verdict == 2,
                "the bench SYN got verdict {verdict}, not a drop"
            );
            into.push(ns as f64);
        }
    }
    let (none, with) = (percentile(none, 0.5), percentile(with, 0.5));
    report.put("exclusions_syn_ns_none", none);
    report.put("exclusions_ns_per_syn_64", with);
    report.put("exclusions_ns_added_per_syn_64", with - none);
    Ok(())
}

//! Scenario `exclusions`: what a pod's exclusions cost a new connection.
//! The pod's egress program runs in the kernel (`BPF_PROG_TEST_RUN`,
//! repeated) on an outbound SYN, as a verification's (which writes no map,
//! so a million runs change nothing), once for the pod without exclusions
//! and once with 64 excluded address ranges none of which holds the
//! destination (the most a SYN walks), alternating rounds. What the checks
//! cost a pod without exclusions is measured against the same program
//! built without them (`cargo xtask bench` builds it), loaded over the same
//! pinned maps and run on the same SYN in the same rounds.

use std::{
    os::fd::{AsFd as _, OwnedFd},
    path::PathBuf,
};

use anyhow::{ensure, Context as _};
use aya::{programs::SchedClassifier, EbpfLoader};
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
        // A new pod, as at its CNI ADD.
        enroll::AppStarted::No,
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
    let without = match without_checks(&dp, pins) {
        Ok(w) => Some(w),
        Err(e) => {
            eprintln!("exclusions: no build without the checks to compare with: {e:#}");
            None
        }
    };
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
    let no_exclusions = PodExclusions::default();
    let (mut none, mut with, mut unchecked) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let mut runs_of = vec![
            (&no_exclusions, &egress, &mut none),
            (&sixty_four, &egress, &mut with),
        ];
        if let Some(w) = &without {
            runs_of.push((&no_exclusions, w, &mut unchecked));
        }
        for (x, prog, into) in runs_of {
            dp.set_exclusions(cookie, x)?;
            let (verdict, ns) = netns.run(|| testrun::time_tc(prog, &syn, ctx, runs))??;
            // Pending (no ztunnel): the SYN is dropped after the
            // exclusions are looked at, in every case.
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
    // NaN (null) without the comparison build.
    let unchecked = if unchecked.is_empty() {
        f64::NAN
    } else {
        percentile(unchecked, 0.5)
    };
    report.put("exclusions_syn_ns_without_checks", unchecked);
    report.put("exclusions_ns_added_per_syn_none", none - unchecked);
    Ok(())
}

/// The egress program of the build without the exclusion checks
/// (target/ebpf-no-exclusions, beside this binary's target dir), loaded
/// over the node's pinned maps, neither pinned nor attached: only run.
fn without_checks(dp: &Dataplane, pins: &Pins) -> anyhow::Result<OwnedFd> {
    let exe = std::env::current_exe()?;
    let target = exe
        .parent()
        .and_then(std::path::Path::parent)
        .context("the bench binary is not in a target dir")?;
    let path: PathBuf = target.join("ebpf-no-exclusions/bpfel-unknown-none/release/sluice-ebpf");
    let object = std::fs::read(&path).with_context(|| format!("{}", path.display()))?;
    let cookie_in_tc = [u8::from(dp.features().netns_cookie_in_tc)];
    let mut ebpf = EbpfLoader::new()
        .override_global("NETNS_COOKIE_IN_TC", &cookie_in_tc, true)
        .default_map_pin_directory(pins.maps())
        .load(&object)?;
    let prog: &mut SchedClassifier = ebpf
        .program_mut(Program::Egress.name())
        .context("no egress program")?
        .try_into()?;
    prog.load()?;
    Ok(prog.fd()?.as_fd().try_clone_to_owned()?)
}

//! Scenario `verify`: what verifying a pod's capture by running it costs the
//! agent. Pods enrolled as the agent enrolls them (with the host side), each
//! with the ztunnel stand-in's listeners registered, so every case runs to
//! its end (a pod without listeners fails at its first case and would
//! flatter the figure). Each round makes two passes over every pod, as the
//! agent's periodic passes do: one as most are, the plan read (under the
//! agent's lock), then the hook queries and test runs in the pod's netns
//! (`verify_us_cpu_per_pod`); then a full one, as one in `FULL_PASS_EVERY`
//! is, which first surveys each pod's interfaces and links and makes the
//! repair pass over it (`_full`). The CPU share per period counts one full
//! pass in `FULL_PASS_EVERY`.

use std::time::Instant;

use anyhow::{ensure, Context as _};
use rand::rngs::StdRng;
use sluice::{
    agent::node::FULL_PASS_EVERY,
    dataplane::loader::{Dataplane, Pins},
    podnet::{enroll, verify},
    uid::PodUid,
};
use sluice_common::Role;
use sluice_tests::{
    ns::Ns,
    standin::{Bind, StandIn},
};

use crate::{
    ns_path, percentile,
    pods::{with_bare_pods, RtnlProbe},
    workload, Config, Report,
};

/// The agent's default period (`--verify-every`), for the CPU share.
const PERIOD_S: f64 = 60.0;

pub fn verification(report: &mut Report, cfg: &Config, _rng: &mut StdRng) -> anyhow::Result<()> {
    with_bare_pods("vf", cfg.verify_pods, |pods, pins| {
        verify_in(report, cfg, pods, pins)
    })
}

fn verify_in(
    report: &mut Report,
    cfg: &Config,
    pods: &crate::pods::BarePods,
    pins: &Pins,
) -> anyhow::Result<()> {
    let mut dp = Dataplane::load_or_adopt(pins.clone())?;
    dp.set_node(pods.node()?)?;
    let mut standins = Vec::new();
    let mut cookies = Vec::new();
    for p in pods.iter() {
        let uid = PodUid::new(&p.name)?;
        enroll::attach_pod(
            &mut dp,
            &ns_path(&p.name),
            &uid,
            &workload(&p.name),
            &Default::default(),
            &enroll::PodAddrs::Netns,
            // A new pod, as at its CNI ADD.
            enroll::AppStarted::No,
        )?;
        standins.push(StandIn::start_in(
            Ns::Named(p.name.clone()),
            Bind::DualStack,
            None,
        ));
        let e = enroll::register_uid(&mut dp, &uid)
            .with_context(|| format!("registering {}", p.name))?;
        cookies.push(e.cookie);
    }
    // What the agent holds of ztunnel's listeners (its custody duplicates):
    // their cookies, found once here as the agent finds them at
    // registration.
    let mut held = Vec::new();
    for &cookie in &cookies {
        let plan = verify::plan(&dp, cookie).context("no verification plan")?;
        let seen = sluice::podnet::sockets::seen_listeners(&plan.netns)?;
        held.push(Some(
            seen.iter().map(|l| (l.role, l.cookie)).collect::<Vec<_>>(),
        ));
    }
    let n = cookies.len();
    // The agent's path (its duplicates name the sockets), then the
    // fallback that lists them with sock_diag (after an agent restart,
    // before ztunnel's re-ack).
    for (suffix, listeners) in [("", held), ("_sock_diag", vec![None; n])] {
        let mut verify_cpu_us = Vec::new();
        let mut full_cpu_us = Vec::new();
        let mut survey_cpu_us = Vec::new();
        let mut wall_us = Vec::new();
        let (mut light_pass_ms, mut full_pass_ms) = (Vec::new(), Vec::new());
        for _ in 0..cfg.verify_passes {
            // A pass as most are: each pod verified, nothing else.
            let mut light_pass = 0;
            for (&cookie, held) in cookies.iter().zip(&listeners) {
                let (c0, t0) = (thread_cpu_ns(), Instant::now());
                verify_one(&dp, cookie, held)?;
                let (cpu, wall) = (thread_cpu_ns() - c0, t0.elapsed());
                verify_cpu_us.push(cpu as f64 / 1e3);
                wall_us.push(wall.as_secs_f64() * 1e6);
                light_pass += cpu;
            }
            // A full pass (one in FULL_PASS_EVERY): first the survey of
            // each pod's interfaces and links (without the agent's lock),
            // then the repair pass over it (under the lock), which finds
            // nothing to put back here, then the verification.
            let mut full_pass = 0;
            for (&cookie, held) in cookies.iter().zip(&listeners) {
                let c0 = thread_cpu_ns();
                let survey = enroll::survey_plan(&dp, cookie)
                    .context("no survey plan")
                    .and_then(|p| Ok(enroll::survey(&p)?))?;
                survey_cpu_us.push((thread_cpu_ns() - c0) as f64 / 1e3);
                let repaired = enroll::repair_surveyed(&mut dp, cookie, false, Some(&survey))?;
                ensure!(
                    matches!(repaired, enroll::Repair::Complete),
                    "pod {cookie}: the repair put something back: {repaired:?}"
                );
                drop(survey);
                verify_one(&dp, cookie, held)?;
                let cpu = thread_cpu_ns() - c0;
                full_cpu_us.push(cpu as f64 / 1e3);
                full_pass += cpu;
            }
            light_pass_ms.push(light_pass as f64 / 1e6);
            full_pass_ms.push(full_pass as f64 / 1e6);
        }
        report.put(
            &format!("verify_us_cpu_per_pod{suffix}"),
            percentile(verify_cpu_us, 0.5),
        );
        report.put(
            &format!("verify_us_cpu_per_pod_full{suffix}"),
            percentile(full_cpu_us, 0.5),
        );
        if suffix.is_empty() {
            report.put(
                "verify_us_cpu_per_pod_survey",
                percentile(survey_cpu_us, 0.5),
            );
        }
        report.put(
            &format!("verify_us_wall_per_pod{suffix}"),
            percentile(wall_us, 0.5),
        );
        let (light, full) = (
            percentile(light_pass_ms, 0.5),
            percentile(full_pass_ms, 0.5),
        );
        report.put(&format!("verify_cpu_ms_pass_{n}_pods{suffix}"), light);
        report.put(&format!("verify_cpu_ms_full_pass_{n}_pods{suffix}"), full);
        // One pass per period, one in FULL_PASS_EVERY full, as a share of
        // one core, in percent.
        let every = FULL_PASS_EVERY as f64;
        let per_period = (light * (every - 1.0) + full) / every;
        report.put(
            &format!("verify_cpu_share_{n}_pods{suffix}"),
            per_period / (PERIOD_S * 1e3) * 100.0,
        );
    }
    rtnl_per_pod(report, cfg, &dp, &cookies)?;
    drop(standins);
    Ok(())
}

/// One verification as the agent makes it: the plan (under its lock), then
/// the hook queries and runs; `held`: ztunnel's sockets as the agent's
/// duplicates name them (`None`: listed with sock_diag).
fn verify_one(dp: &Dataplane, cookie: u64, held: &Option<Vec<(Role, u64)>>) -> anyhow::Result<()> {
    let mut plan = verify::plan(dp, cookie).context("no verification plan")?;
    plan.listeners = held.clone();
    let v = verify::verify(&plan);
    ensure!(v.is_ok(), "pod {cookie} failed its verification: {v:?}");
    Ok(())
}

/// `verify_rtnl_ms_per_pod`: how long a verification holds RTNL (its
/// filter dumps and tcx queries take it), estimated as the enrollment's
/// `rtnl_ms_per_pod`: the RTNL probe's waiting beyond its idle median
/// while one pass verifies every pod, less its waiting for a CPU, per pod.
fn rtnl_per_pod(
    report: &mut Report,
    cfg: &Config,
    dp: &sluice::dataplane::loader::Dataplane,
    cookies: &[u64],
) -> anyhow::Result<()> {
    let probe_ns = format!("slb-vrtnl-{}", std::process::id());
    sluice_tests::topology::ip(&["netns", "add", &probe_ns])?;
    let result = (|| -> anyhow::Result<f64> {
        let idle = RtnlProbe::start(&probe_ns);
        std::thread::sleep(cfg.rtnl_idle);
        let idle = idle.stop()?;
        ensure!(!idle.lat.is_empty(), "the RTNL probe made no request");
        let idle_median = percentile(idle.lat, 0.5);
        let probe = RtnlProbe::start(&probe_ns);
        let mut res = Ok(());
        for &cookie in cookies {
            let ran = verify::plan(dp, cookie)
                .context("no verification plan")
                .map(|plan| verify::verify(&plan));
            if !matches!(ran, Ok(Ok(_))) {
                res = Err(anyhow::anyhow!("pod {cookie}: {ran:?}"));
                break;
            }
        }
        let run = probe.stop()?;
        res?;
        Ok(run.waited_ms(idle_median) / cookies.len() as f64)
    })();
    let _ = sluice_tests::topology::ip(&["netns", "del", &probe_ns]);
    report.put("verify_rtnl_ms_per_pod", result?);
    Ok(())
}

/// CPU time of the calling thread (user and system), in ns.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to write to.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

//! Scenario `served`: the served check at mesh scale (the mesh's size and
//! ten times it: 10,000 and 100,000 workloads), the time to Served, and a
//! node-start burst of pods to Served.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::Instant,
};

use anyhow::{ensure, Context as _};
use rand::rngs::StdRng;
use sluice::{
    control::{self, Request},
    dataplane::loader::Pins,
    dataplane::state::Maps,
    podnet::enroll,
    served::{fetch, Wanted},
    uid::PodUid,
};
use sluice_tests::{
    admin,
    agent::{AgentProc, PeerProc},
    harness::peer_bin,
    wait,
};

use crate::{ns_path, percentile, pods::BarePods, workload, Config, Report};

const SERVED_PODS: usize = 5;

/// The served check against a ztunnel whose config_dump lists
/// 10,000 workloads (smoke: 1,000): the cost of one check in the agent (wall time, CPU of
/// this process, which does exactly what the agent does: enter ztunnel's
/// netns, GET, parse as it streams) and, through a real agent, the time from
/// enrollment to Served as the pinned map records it.
pub fn served(report: &mut Report, cfg: &Config, _rng: &mut StdRng) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("sluice-bench-served-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let pods = crate::pods::bare_pods("sv", SERVED_PODS + cfg.served_burst)?;
    let result = served_in(report, cfg, &dir, &pods);
    drop(pods);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn served_in(
    report: &mut Report,
    cfg: &Config,
    dir: &std::path::Path,
    pods: &BarePods,
) -> anyhow::Result<()> {
    // One check's cost at the mesh's size and at ten times it (the bench
    // pods' workloads among the last ones).
    let file = check_cost(report, dir, pods, cfg.mesh_workloads, cfg.served_checks)?;
    let file_10x = check_cost(
        report,
        dir,
        pods,
        cfg.mesh_workloads * 10,
        cfg.served_checks.div_ceil(4),
    )?;
    let k = cfg.mesh_workloads / 1000;
    // Through a real agent and the stand-in: pods one at a time, then the
    // burst; at ten times the mesh, the burst alone (another agent, after
    // the first one's capture is gone).
    through_agent(report, &file, k, pods, true)?;
    through_agent(report, &file_10x, k * 10, pods, false)
}

/// Enrollment to Served through a real agent and a ztunnel stand-in
/// serving the workloads of `file` (`k` thousand): the first
/// [`SERVED_PODS`] pods one at a time (with `one_by_one`), then the others
/// at once ([`burst`]). Every capture is removed after.
fn through_agent(
    report: &mut Report,
    file: &std::path::Path,
    k: usize,
    pods: &BarePods,
    one_by_one: bool,
) -> anyhow::Result<()> {
    let pins = Pins::new(format!(
        "/sys/fs/bpf/sluice-bench-sv-{}",
        std::process::id()
    ));
    // What the stand-in serves: the mesh without the burst's pods until
    // they are all enrolled (xDS has not told ztunnel of them yet).
    let live = file.with_extension("live.json");
    let burst_names: Vec<&str> = pods[SERVED_PODS..]
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    let mut mesh: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(file)?)?;
    mesh.retain(|w| !burst_names.iter().any(|n| w["name"] == *n));
    std::fs::write(&live, serde_json::to_vec(&mesh)?)?;
    let publish = || -> anyhow::Result<()> {
        let next = file.with_extension("next.json");
        std::fs::copy(file, &next)?;
        std::fs::rename(&next, &live)?;
        Ok(())
    };
    let result = (|| -> anyhow::Result<()> {
        let agent = AgentProc::start(&pins)?;
        let _peer = PeerProc::start(
            &peer_bin(),
            &agent.zds,
            &["--admin-workloads", live.to_str().unwrap()],
        )?;
        wait::until(
            "the stand-in connected",
            wait::DEADLINE,
            || match control::call(&agent.control, Some(pins.root()), &Request::Status) {
                Ok(Some(control::Response::More(control::NodeAnswer::Node(n))))
                    if n.ztunnel_connected =>
                {
                    Ok(())
                }
                other => Err(format!("{other:?}")),
            },
        )?;
        if one_by_one {
            one_at_a_time(report, &agent, &pins, &pods[..SERVED_PODS], k)?;
        }
        burst(report, &agent, &pins, &pods[SERVED_PODS..], k, publish)
    })();
    let _ = enroll::uninstall(&pins, None);
    result
}

/// `pods` enrolled one after another, each waited for until Served: the
/// time from enrollment to Served as the pinned map records it.
fn one_at_a_time(
    report: &mut Report,
    agent: &AgentProc,
    pins: &Pins,
    pods: &[crate::pods::BarePod],
    k: usize,
) -> anyhow::Result<()> {
    let mut ms = Vec::new();
    for (i, p) in pods.iter().enumerate() {
        let uid = format!("sv-{i}");
        enroll_through(agent, pins, p, &uid)?;
        let maps = Maps::open_pinned(&pins.maps())?;
        let e = wait::until("the pod Served", wait::DEADLINE, || {
            served_entry(&maps, &uid)
        })?;
        ms.push((e.changed_at_ns - e.enrolled_at_ns) as f64 / 1e6);
    }
    report.put(
        &format!("time_to_served_ms_p50_{k}k_workloads"),
        percentile(ms.clone(), 0.5),
    );
    report.put(
        &format!("time_to_served_ms_max_{k}k_workloads"),
        percentile(ms, 1.0),
    );
    Ok(())
}

/// Enrolls `pod` as `uid` through the agent (answered once ztunnel acked).
fn enroll_through(
    agent: &AgentProc,
    pins: &Pins,
    pod: &crate::pods::BarePod,
    uid: &str,
) -> anyhow::Result<()> {
    let resp = control::call(
        &agent.control,
        Some(pins.root()),
        &Request::Enroll {
            netns: ns_path(&pod.name),
            uid: uid.to_owned(),
            workload: workload(&pod.name),
        },
    )?
    .context("agent not listening")?;
    ensure!(
        matches!(resp, control::Response::Enrolled { .. }),
        "{resp:?}"
    );
    Ok(())
}

/// Pod `uid`'s pinned entry once it is Served.
fn served_entry(maps: &Maps, uid: &str) -> Result<sluice_common::PodEntry, String> {
    let cookie = maps.find_uid(&PodUid::new(uid).map_err(|e| e.to_string())?);
    match cookie.and_then(|c| maps.entry(c)) {
        Some(e) if e.state() == Some(sluice_common::PodState::Served) => Ok(e),
        other => Err(format!("{other:?}")),
    }
}

/// A node's start: `pods` enrolled through the agent all at once (one
/// thread each, as the runtime's CNI ADDs come), acked by ztunnel, which
/// learns their workloads only once they all are (`publish`: it then lists
/// them in its config_dump, among `k` thousand): from that moment to each
/// pod Served, from the pinned map's timestamps (issue 42's target: the
/// last within 1 s).
fn burst(
    report: &mut Report,
    agent: &AgentProc,
    pins: &Pins,
    pods: &[crate::pods::BarePod],
    k: usize,
    publish: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let n = pods.len();
    let uids: Vec<String> = (0..n).map(|i| format!("svb-{i}")).collect();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let calls: Vec<_> = pods
            .iter()
            .zip(&uids)
            .map(|(p, uid)| s.spawn(move || enroll_through(agent, pins, p, uid)))
            .collect();
        for c in calls {
            c.join()
                .map_err(|_| anyhow::anyhow!("an enrolling thread panicked"))??;
        }
        Ok(())
    })?;
    let known_at = sluice::dataplane::state::boottime_ns();
    publish()?;
    let maps = Maps::open_pinned(&pins.maps())?;
    let entries = wait::until(
        &format!("{n} pods enrolled at once Served"),
        wait::DEADLINE,
        || {
            uids.iter()
                .map(|uid| served_entry(&maps, uid).map_err(|e| format!("{uid}: {e}")))
                .collect::<Result<Vec<_>, _>>()
        },
    )?;
    ensure!(
        entries.iter().all(|e| e.changed_at_ns >= known_at),
        "a pod was Served before ztunnel knew its workload (acks counted as served?)"
    );
    let ms: Vec<f64> = entries
        .iter()
        .map(|e| (e.changed_at_ns - known_at) as f64 / 1e6)
        .collect();
    let first = entries.iter().map(|e| e.enrolled_at_ns).min().unwrap_or(0);
    report.put(
        &format!("served_burst_{n}_enroll_ms_{k}k_workloads"),
        known_at.saturating_sub(first) as f64 / 1e6,
    );
    report.put(
        &format!("served_burst_{n}_after_known_ms_p50_{k}k_workloads"),
        percentile(ms.clone(), 0.5),
    );
    report.put(
        &format!("served_burst_{n}_after_known_ms_max_{k}k_workloads"),
        percentile(ms, 1.0),
    );
    Ok(())
}

/// One served check, as the agent makes it, against a ztunnel stand-in
/// whose config_dump lists `n` workloads (and no agent to talk to: it only
/// serves its admin API), `checks` times: the agent's CPU and wall time per
/// check, the dump's size, and the stand-in's CPU per dump (it builds and
/// serialises the dump at every request, as ztunnel does). Returns the file
/// of workloads it served.
fn check_cost(
    report: &mut Report,
    dir: &std::path::Path,
    pods: &BarePods,
    n: usize,
    checks: usize,
) -> anyhow::Result<std::path::PathBuf> {
    let k = n / 1000;
    let mut mesh: Vec<serde_json::Value> = (0..n - pods.len())
        .map(|i| {
            let ip = IpAddr::V4(Ipv4Addr::new(
                10,
                100 + (i / 65536) as u8,
                (i / 256 % 256) as u8,
                (i % 256) as u8,
            ));
            admin::workload(
                &format!("ns-{}", i % 100),
                &format!("w-{i}"),
                "default",
                &[ip],
            )
        })
        .collect();
    for (i, p) in pods.iter().enumerate() {
        let ip = IpAddr::V4(Ipv4Addr::new(10, 210, 0, i as u8));
        mesh.push(admin::workload("bench", &p.name, "default", &[ip]));
    }
    let file = dir.join(format!("workloads-{k}k.json"));
    std::fs::write(&file, serde_json::to_vec(&mesh)?)?;
    let bytes = admin::dump(mesh).len() as f64;
    report.put(&format!("served_dump_bytes_{k}k"), bytes);
    report.put(
        &format!("config_dump_mib_{k}k_workloads"),
        bytes / (1024.0 * 1024.0),
    );
    let mut peer = PeerProc::start(
        &peer_bin(),
        &dir.join(format!("no-agent-{k}k.sock")),
        &["--admin-workloads", file.to_str().unwrap()],
    )?;
    let pid = peer.pid().context("peer pid")? as i32;
    let wanted = [Wanted {
        namespace: "bench".into(),
        name: pods[0].name.clone(),
        service_account: "default".into(),
        ips: vec![IpAddr::V4(Ipv4Addr::new(10, 210, 0, 0))],
    }];
    wait::until("the admin stand-in to answer", wait::DEADLINE, || {
        fetch::known(Some(pid), fetch::DEFAULT_ADMIN_PORT, &wanted, None).map_err(|e| e.to_string())
    })?;
    let (mut wall, cpu0, peer0) = (Vec::new(), cpu_ms_self(), cpu_ms_of(pid)?);
    for _ in 0..checks {
        let t = Instant::now();
        let known = fetch::known(Some(pid), fetch::DEFAULT_ADMIN_PORT, &wanted, None)?;
        wall.push(t.elapsed().as_secs_f64() * 1e3);
        ensure!(known.len() == 1, "the pod not found among {n} workloads");
    }
    let agent_ms = (cpu_ms_self() - cpu0) / checks as f64;
    let standin_ms = (cpu_ms_of(pid)? - peer0) / checks as f64;
    let wall_ms = percentile(wall, 0.5);
    report.put(&format!("served_check_cpu_ms_{k}k"), agent_ms);
    report.put(&format!("served_standin_cpu_ms_per_dump_{k}k"), standin_ms);
    report.put(&format!("served_check_ms_{k}k"), wall_ms);
    // Steady checking (no pod waiting): one read per recheck, at the period
    // the agent picks after a read that took this long; the CPU of both
    // sides as a share of one core, in percent.
    let period = sluice::agent::node::recheck_period(
        sluice::agent::node::DEFAULT_RECHECK,
        std::time::Duration::from_secs_f64(wall_ms / 1e3),
    );
    report.put(&format!("served_recheck_s_{k}k"), period.as_secs_f64());
    report.put(
        &format!("served_steady_cpu_share_{k}k"),
        (agent_ms + standin_ms) / (period.as_secs_f64() * 1e3) * 100.0,
    );
    peer.kill();
    Ok(file)
}

/// CPU time (user + system) process `pid` has used, in ms (clock ticks:
/// 10 ms resolution).
fn cpu_ms_of(pid: i32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // After the command's closing parenthesis: fields 3 onwards.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .context("an unparsable /proc/PID/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?.unwrap_or(100) as f64;
    Ok(ticks * 1e3 / hz)
}

/// CPU time (user + system) this process has used, in ms.
fn cpu_ms_self() -> f64 {
    let r = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF);
    r.map(|r| {
        let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 * 1e3 + tv.tv_usec() as f64 / 1e3;
        t(r.user_time()) + t(r.system_time())
    })
    .unwrap_or(0.0)
}

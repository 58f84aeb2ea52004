//! Enrollment lifecycle through the `sluice` binary, as an operator uses it:
//! capture outlives the process that set it up, a new process reports it, and
//! every bad input gets one clear error line and leaves nothing behind.

use sluice_tests::child::Bounded as _;
use std::{net::SocketAddr, path::Path, process::Command};

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use sluice_common::PodState;
use sluice_tests::{
    flow::{connect, Opts},
    harness::{as_if_kernel, sluice_bin, without_tcx, Fixture, APP_PORT, REMOTE_PORT},
    standin::Bind,
    topology::{ip, Family},
};

use crate::{tcx_trial, trial, TestResult};
use sluice_tests::istio::Backend;

pub fn trials() -> Vec<Trial> {
    vec![
        trial(
            "lifecycle::takeover_check_counts_a_netns_nf_tables_tables",
            nf_tables_counted,
        ),
        trial("lifecycle::takeover_from_istio_cni", || {
            takeover_from_istio_cni(Backend::Default, ["iptables-nft", "ip6tables-nft"])
        }),
        trial(
            "lifecycle::pod_sysctls_through_a_host_procfs_when_proc_sys_is_read_only",
            sysctls_with_read_only_proc_sys,
        ),
        trial("lifecycle::takeover_from_istio_cni_legacy_iptables", || {
            takeover_from_istio_cni(Backend::Legacy, ["iptables-legacy", "ip6tables-legacy"])
        }),
        trial(
            "lifecycle::capture_outlives_the_enrolling_process",
            outlives_process,
        ),
        trial(
            "lifecycle::a_teardown_a_repair_finishes_keeps_the_pods_counts_in_the_totals",
            counts_kept_when_a_repair_finishes_a_teardown,
        ),
        trial(
            "lifecycle::bad_input_gives_one_error_and_leaves_nothing",
            bad_input,
        ),
        trial(
            "lifecycle::failed_enroll_rolls_back_everything",
            failed_enroll_rolls_back,
        ),
        trial(
            "lifecycle::a_pod_interface_whose_hook_another_qdisc_holds_is_refused_and_left_alone",
            pod_hook_taken,
        ),
        trial(
            "lifecycle::unenroll_after_the_netns_is_gone",
            unenroll_after_netns_gone,
        ),
        trial(
            "lifecycle::uninstall_with_the_maps_lost_removes_every_pods_filters_and_routes",
            uninstall_with_maps_lost,
        ),
        trial(
            "lifecycle::pins_without_state_go_with_their_pods_filters_and_routes",
            stateless_pins,
        ),
        trial(
            "lifecycle::uninstall_removes_the_maps_of_a_migration_that_failed",
            uninstall_after_failed_migration,
        ),
        trial(
            "lifecycle::a_hung_iptables_tool_is_killed_and_the_enroll_backs_out",
            hung_iptables,
        ),
        trial(
            "lifecycle::no_tcx::a_filter_deleted_behind_sluices_back_is_found_and_attached_again",
            || as_if_kernel(without_tcx(), deleted_filter),
        ),
        trial(
            "lifecycle::a_filter_deleted_behind_sluices_back_is_found_and_attached_again",
            deleted_filter,
        ),
        trial(
            "lifecycle::a_hook_another_qdisc_took_after_enrollment_is_reported_missing_until_freed",
            hook_taken_after_enrollment,
        ),
        trial(
            "lifecycle::an_interface_without_an_ethernet_header_is_captured",
            l3_interface,
        ),
        trial(
            "lifecycle::no_tcx::an_interface_without_an_ethernet_header_is_captured",
            || as_if_kernel(without_tcx(), l3_interface),
        ),
        trial(
            "lifecycle::no_netns_cookie_in_tc::an_interface_without_an_ethernet_header_is_captured",
            || {
                as_if_kernel(
                    sluice_tests::harness::without_netns_cookie_in_tc(),
                    l3_interface,
                )
            },
        ),
        trial(
            "lifecycle::a_filter_after_sluices_on_the_hook_still_runs",
            || programs_after_sluice(false),
        ),
        tcx_trial(
            "lifecycle::tcx::a_program_after_sluices_on_the_hook_still_runs",
            || programs_after_sluice(true),
        ),
        tcx_trial(
            "lifecycle::tcx::an_interface_without_an_ethernet_header_is_captured",
            l3_interface,
        ),
        trial(
            "lifecycle::no_tcx::a_filter_after_sluices_on_the_hook_still_runs",
            || as_if_kernel(without_tcx(), || programs_after_sluice(false)),
        ),
    ]
}

pub(crate) struct Out {
    pub(crate) ok: bool,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

/// A control socket no agent listens on: these tests run the CLI alone.
const NO_AGENT: &str = "/nonexistent/sluice-lifecycle/agent.sock";

pub(crate) fn sluice(f: &Fixture, args: &[&str]) -> anyhow::Result<Out> {
    // Every path is the test's own: no agent that may run on this machine
    // (on the default control socket) may serve these commands.
    let out = Command::new(sluice_bin())
        .arg("--bpf-root")
        .arg(f.topo.pins.root())
        .arg("--control-socket")
        .arg(NO_AGENT)
        .args(args)
        .output_bounded()
        .with_context(|| format!("running {}", sluice_bin().display()))?;
    Ok(Out {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

fn outlives_process() -> TestResult {
    let f = Fixture::new("life", Some(Bind::DualStack))?;
    let netns = f.topo.pod_netns_path();
    // The enrolling process exits; nothing of ours keeps running.
    let out = sluice(
        &f,
        &[
            "enroll",
            "--netns",
            netns.to_str().unwrap(),
            "--uid",
            f.uid.as_str(),
        ],
    )?;
    ensure!(out.ok, "enroll failed: {}", out.stderr);
    ensure!(out.stdout.contains("Enabled"), "{}", out.stdout);
    ensure!(
        inbound_captured(&f)?,
        "not captured after the process exited"
    );
    // A new process reads it all back from the pins.
    let out = sluice(&f, &["status", "-o", "json"])?;
    ensure!(out.ok, "status failed: {}", out.stderr);
    let v: serde_json::Value = serde_json::from_str(&out.stdout)?;
    ensure!(
        v["node"]["programs_loaded"] == true && v["node"]["agent"].is_null(),
        "{v}"
    );
    let pod = &v["pods"][0];
    ensure!(pod["uid"] == f.uid.as_str(), "{v}");
    ensure!(pod["state"] == "Enabled", "{v}");
    ensure!(pod["netns"] == netns.to_str().unwrap(), "{v}");
    ensure!(pod["counters"]["captured_inbound"] == 1, "{v}");
    ensure!(pod["listeners"].as_array().map(Vec::len) == Some(6), "{v}");
    // One pod end to end: steering, not served (no ztunnel to ask), every
    // link in place; by uid, in both forms.
    let one = sluice(&f, &["status", "--pod", f.uid.as_str()])?;
    ensure!(
        one.ok
            && one
                .stdout
                .contains("verdict:    captured and steering to ztunnel")
            && one
                .stdout
                .contains("links:      sk_lookup eth0:in,out lo:in")
            && one.stdout.contains("listeners:  15001/15006/15008/-")
            && one.stdout.contains("agent:      not answering"),
        "{}{}",
        one.stdout,
        one.stderr
    );
    let one: serde_json::Value = serde_json::from_str(
        &sluice(&f, &["status", "--pod", f.uid.as_str(), "-o", "json"])?.stdout,
    )?;
    let links = one["pod"]["links"].as_array().cloned().unwrap_or_default();
    ensure!(
        one["verdict"] == "not_served"
            && links.len() == 4
            && one["pod"]["addresses"]
                .as_array()
                .is_some_and(|a| a.contains(&"10.200.0.2".into())),
        "{one}"
    );
    let none = sluice(&f, &["status", "--pod", "shop/nothing"])?;
    ensure!(
        !none.ok
            && none
                .stderr
                .contains("pod shop/nothing is not enrolled on this node"),
        "{}",
        none.stderr
    );
    let table = sluice(&f, &["status"])?;
    ensure!(
        table.stdout.contains(f.uid.as_str()) && table.stdout.contains("Enabled"),
        "{}",
        table.stdout
    );
    let out = sluice(&f, &["unenroll", "--uid", f.uid.as_str()])?;
    ensure!(out.ok, "unenroll failed: {}", out.stderr);
    let after: serde_json::Value =
        serde_json::from_str(&sluice(&f, &["status", "-o", "json"])?.stdout)?;
    ensure!(after["pods"] == serde_json::json!([]), "{after}");
    Ok(())
}

/// Asserts a failed command printed exactly one error line containing `needle`.
fn fails_with(out: &Out, needle: &str) -> TestResult {
    ensure!(!out.ok, "expected failure, got success: {}", out.stdout);
    let lines: Vec<&str> = out.stderr.lines().collect();
    ensure!(lines.len() == 1, "expected one error line, got {lines:?}");
    ensure!(
        lines[0].starts_with("sluice: ") && lines[0].contains(needle),
        "{:?} lacks {needle:?}",
        lines[0]
    );
    Ok(())
}

fn bad_input() -> TestResult {
    let f = Fixture::new("bad", Some(Bind::DualStack))?;
    let netns = f.topo.pod_netns_path();
    let netns = netns.to_str().unwrap();
    let uid = f.uid.as_str();

    fails_with(
        &sluice(
            &f,
            &[
                "enroll",
                "--netns",
                "/run/netns/sluice-no-such-netns",
                "--uid",
                uid,
            ],
        )?,
        "No such file",
    )?;
    fails_with(
        &sluice(
            &f,
            &["enroll", "--netns", "/proc/self/ns/uts", "--uid", uid],
        )?,
        "is not a network namespace",
    )?;
    fails_with(
        &sluice(&f, &["enroll", "--netns", "/etc/hostname", "--uid", uid])?,
        "is not a network namespace",
    )?;
    fails_with(
        &sluice(&f, &["enroll", "--netns", netns, "--uid", "bad/uid"])?,
        "characters other than",
    )?;
    fails_with(
        &sluice(&f, &["unenroll", "--uid", "nobody"])?,
        "no enrolled pod has uid nobody",
    )?;
    ensure!(
        !f.topo.pins.pods().exists() || std::fs::read_dir(f.topo.pins.pods())?.next().is_none()
    );

    ensure!(sluice(&f, &["enroll", "--netns", netns, "--uid", uid])?.ok);
    fails_with(
        &sluice(&f, &["enroll", "--netns", netns, "--uid", uid])?,
        "already enrolled",
    )?;
    fails_with(
        &sluice(&f, &["enroll", "--netns", netns, "--uid", "other-pod"])?,
        "already enrolled as pod",
    )?;
    fails_with(
        &sluice(&f, &["unenroll", "--uid", "other-pod"])?,
        "no enrolled pod has uid other-pod",
    )?;
    fails_with(
        &sluice(&f, &["register", "--uid", "other-pod"])?,
        "no enrolled pod has uid other-pod",
    )?;
    // The failed attempts changed nothing: one pod, still Enabled and capturing.
    let rec = f.pod_record()?;
    ensure!(rec.state == Some(PodState::Enabled), "{rec:?}");
    ensure!(std::fs::read_dir(f.topo.pins.pods())?.count() == 1);
    let r = connect(
        &f.topo.client,
        SocketAddr::new(Family::V4.pod(), APP_PORT),
        Opts::default(),
    );
    ensure!(
        r.reply().is_some() && f.standin().accepted().len() == 1,
        "{r:?}"
    );
    Ok(())
}

/// The take-over check runs the iptables tools in a pod netns that has
/// iptables tables (here a legacy one, as istio-cni's rules would make); one
/// that never answers is killed after its timeout, and the enrollment backs
/// out completely with the reason (nothing half-applied, nothing left
/// running).
fn hung_iptables() -> TestResult {
    let f = Fixture::new("hang", None)?;
    sluice_tests::ns::exec(&f.topo.pod, &["iptables-legacy", "-t", "nat", "-L", "-n"])?;
    let dir = std::path::PathBuf::from(format!("/tmp/sluice-hang-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let pidfile = dir.join("pid");
    let result = (|| -> TestResult {
        for tool in ["iptables-nft-save", "iptables-legacy-save", "iptables-save"] {
            let path = dir.join(tool);
            std::fs::write(
                &path,
                format!(
                    "#!/bin/sh\necho $$ > {}\nexec sleep 600\n",
                    pidfile.display()
                ),
            )?;
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        }
        let netns = f.topo.pod_netns_path();
        let out = Command::new(sluice_bin())
            .arg("--bpf-root")
            .arg(f.topo.pins.root())
            .arg("--control-socket")
            .arg(NO_AGENT)
            .args([
                "enroll",
                "--netns",
                netns.to_str().unwrap(),
                "--uid",
                f.uid.as_str(),
            ])
            .env(
                "PATH",
                format!(
                    "{}:{}",
                    dir.display(),
                    std::env::var("PATH").unwrap_or_default()
                ),
            )
            .output_bounded()?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(
            !out.status.success() && stderr.contains("did not finish within"),
            "enroll with a hung iptables-save: {stderr}"
        );
        ensure!(
            std::fs::read_dir(f.topo.pins.pods())?.next().is_none(),
            "pod pins left behind"
        );
        ensure!(
            !sluice_tests::topology::has_redirect_rule(&f.topo.pod)?,
            "policy rule left behind"
        );
        let pid = std::fs::read_to_string(&pidfile)?.trim().to_owned();
        sluice_tests::wait::until(
            "the hung tool to be gone",
            sluice_tests::wait::DEADLINE,
            || {
                let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|s| !s.contains(") Z "));
                (!alive)
                    .then_some(())
                    .ok_or(format!("pid {pid} still runs"))
            },
        )?;
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn failed_enroll_rolls_back() -> TestResult {
    // A netns with only lo: attaching fails after state, the sk_lookup link
    // and the routes were written; all of it must be undone.
    let f = Fixture::new("rb", None)?;
    let lonely = format!("{}-lo", f.topo.pod);
    ip(&["netns", "add", &lonely])?;
    let result = (|| -> TestResult {
        let path = format!("/run/netns/{lonely}");
        let out = sluice(&f, &["enroll", "--netns", &path, "--uid", "lonely"])?;
        fails_with(&out, "has no interface besides lo")?;
        ensure!(
            std::fs::read_dir(f.topo.pins.pods())?.next().is_none(),
            "pod pins left behind"
        );
        let maps = sluice::dataplane::state::Maps::open_pinned(&f.topo.pins.maps())?;
        ensure!(
            maps.cookies().is_empty(),
            "map entries left behind: {:?}",
            maps.cookies()
        );
        let name = lonely.clone();
        ensure!(
            !sluice_tests::topology::has_redirect_rule(&name)?,
            "policy rule left behind"
        );
        Ok(())
    })();
    ip(&["netns", "del", &lonely])?;
    result
}

/// Another tool's `ingress` qdisc on the pod's interface (one slot holds
/// it or clsact): cls_bpf filters cannot go beside it — a filter meant for
/// egress would land in its one block, on ingress, and outbound would go
/// uncaptured while status said otherwise. The pod is refused with the
/// reason, the steps before the filter are undone, and the qdisc stays.
fn pod_hook_taken() -> TestResult {
    let f = Fixture::new("hook", Some(Bind::DualStack))?;
    ip(&[
        "netns",
        "exec",
        &f.topo.pod,
        "tc",
        "qdisc",
        "add",
        "dev",
        "eth0",
        "ingress",
    ])?;
    let path = f.topo.pod_netns_path();
    let out = sluice(
        &f,
        &[
            "enroll",
            "--netns",
            &path.to_string_lossy(),
            "--uid",
            f.uid.as_str(),
        ],
    )?;
    fails_with(&out, "holds a qdisc other than clsact")?;
    if let Some(left) = capture_left(&f)? {
        anyhow::bail!("the refused pod kept {left}");
    }
    let maps = sluice::dataplane::state::Maps::open_pinned(&f.topo.pins.maps())?;
    ensure!(
        maps.cookies().is_empty(),
        "map entries left behind: {:?}",
        maps.cookies()
    );
    let qdiscs = Command::new("ip")
        .args([
            "netns",
            "exec",
            &f.topo.pod,
            "tc",
            "qdisc",
            "show",
            "dev",
            "eth0",
        ])
        .output_bounded()?;
    let qdiscs = String::from_utf8_lossy(&qdiscs.stdout);
    ensure!(
        qdiscs.contains("qdisc ingress ffff:"),
        "the other tool's qdisc is gone: {qdiscs}"
    );
    Ok(())
}

fn unenroll_after_netns_gone() -> TestResult {
    let f = Fixture::new("gone", Some(Bind::DualStack))?;
    let cookie = f.enroll()?.cookie;
    ensure!(f.topo.pins.pod(cookie).exists());
    // The pod's netns goes away with the pod (the pinned links keep nothing alive).
    ip(&["netns", "del", &f.topo.pod])?;
    let out = sluice(&f, &["unenroll", "--uid", f.uid.as_str()])?;
    ensure!(out.ok, "unenroll failed: {}", out.stderr);
    ensure!(!f.topo.pins.pod(cookie).exists(), "pins left behind");
    let maps = sluice::dataplane::state::Maps::open_pinned(&f.topo.pins.maps())?;
    ensure!(maps.cookies().is_empty());
    Ok(())
}

/// An enrolled pod's interface whose hook another tool's `ingress` qdisc
/// took afterwards, holding sluice's ingress filter: the shape a build
/// that made its qdisc with `NLM_F_EXCL` left such a pod in (its egress
/// filter went into that qdisc's one block and the ingress filter replaced
/// it). The ingress filter still runs on ingress and counts; the egress one
/// is missing (CNI CHECK's view), and a repair cannot attach it: it fails
/// with the reason and leaves the other tool's qdisc. Once the hook is free
/// again, the repair completes the capture.
fn hook_taken_after_enrollment() -> TestResult {
    use sluice::podnet::enroll::{self, Repair};
    let f = Fixture::new("htak", Some(Bind::DualStack))?;
    let e = f.enroll()?;
    let tc = |args: &[&str]| sluice_tests::ns::exec(&f.topo.pod, &[&["tc"], args].concat());
    let record = f.topo.pins.pod(e.cookie).join("ingress_eth0");
    let record = record.to_str().context("pin path")?;
    tc(&["qdisc", "del", "dev", "eth0", "clsact"])?;
    tc(&["qdisc", "add", "dev", "eth0", "ingress"])?;
    // Not `ip netns exec`: it mounts a sysfs of its own, without bpffs.
    let netns = format!("--net={}", f.topo.pod_netns_path().display());
    let filter = "filter add dev eth0 parent ffff: prio 1 handle 0x51150001 protocol all bpf";
    let out = std::process::Command::new("nsenter")
        .arg(&netns)
        .arg("tc")
        .args(filter.split(' '))
        .args(["object-pinned", record, "da"])
        .output_bounded()?;
    ensure!(
        out.status.success(),
        "adding the filter: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut dp = f.dataplane()?;
    let missing = enroll::missing_links(&dp, e.cookie)?;
    ensure!(
        missing == ["egress_eth0"],
        "missing {missing:?}, want [egress_eth0]"
    );
    let failed = enroll::repair(&mut dp, e.cookie, false);
    let why = match failed {
        Err(e) => sluice::error_line(&e),
        Ok(r) => anyhow::bail!("repair over a taken hook: {r:?}"),
    };
    ensure!(
        why.contains("on eth0") && why.contains("holds a qdisc other than clsact"),
        "the repair's error does not say where and why: {why}"
    );
    // An upgrade (the filters pointed at another build's programs in
    // place) leaves both hooks as they are and goes on.
    let running = || sluice_tests::inspect::filter_programs(&f.topo.pod, "eth0", "ingress");
    let before = running()?;
    let mut upgrade = sluice::dataplane::refilter::Refilter::new(&f.topo.pins.maps(), None);
    let pod_dir = f.topo.pins.pod(e.cookie);
    for (record, prog) in [
        ("egress_eth0", sluice::dataplane::loader::Program::Egress),
        ("ingress_eth0", sluice::dataplane::loader::Program::Lo),
    ] {
        let prog = dp
            .tc_program_mut(prog)
            .context("a tc program every build has")?;
        let switched = upgrade.switch(e.cookie, &pod_dir.join(record), prog)?;
        ensure!(!switched, "{record} switched over a taken hook");
    }
    ensure!(
        running()? == before,
        "the filter in the other tool's qdisc changed: {before:?} -> {:?}",
        running()?
    );
    let qdiscs = sluice_tests::ns::output(&f.topo.pod, &["tc", "qdisc", "show", "dev", "eth0"])?;
    ensure!(
        qdiscs.contains("qdisc ingress ffff:"),
        "the other tool's qdisc is gone: {qdiscs}"
    );

    tc(&["qdisc", "del", "dev", "eth0", "ingress"])?;
    let repaired = enroll::repair(&mut dp, e.cookie, false)?;
    ensure!(
        repaired
            == Repair::Repaired {
                relinked: vec!["egress_eth0".into(), "ingress_eth0".into()],
                istio_rules: vec![],
            },
        "{repaired:?}"
    );
    let missing = enroll::missing_links(&dp, e.cookie)?;
    ensure!(missing.is_empty(), "still missing: {missing:?}");
    drop(dp);
    let before = f.standin().accepted().len();
    let r = connect(
        &f.topo.pod,
        SocketAddr::new(Family::V4.client(), REMOTE_PORT),
        Opts::default(),
    );
    ensure!(r.reply().is_some(), "outbound after the repair: {r:?}");
    ensure!(
        f.standin().accepted().len() == before + 1,
        "outbound not captured after the repair"
    );
    Ok(())
}

/// A bpf filter, the policy rule or a pin of sluice's still in the pod, if any.
fn capture_left(f: &Fixture) -> anyhow::Result<Option<String>> {
    for (iface, dir) in [("eth0", "egress"), ("eth0", "ingress"), ("lo", "ingress")] {
        let filters = sluice_tests::inspect::filter_programs(&f.topo.pod, iface, dir)?;
        if !filters.is_empty() {
            return Ok(Some(format!("bpf filters on {iface} {dir}: {filters:?}")));
        }
    }
    if sluice_tests::topology::has_redirect_rule(&f.topo.pod)? {
        return Ok(Some("the policy rule".into()));
    }
    let pods = std::fs::read_dir(f.topo.pins.pods())
        .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
        .unwrap_or_default();
    Ok((!pods.is_empty()).then(|| format!("pod pin directories {pods:?}")))
}

/// An inbound connection to the pod's app, and whether the stand-in
/// ztunnel took it (captured).
fn inbound_captured(f: &Fixture) -> anyhow::Result<bool> {
    let before = f.standin().accepted().len();
    let r = connect(
        &f.topo.client,
        SocketAddr::new(Family::V4.pod(), APP_PORT),
        Opts::default(),
    );
    ensure!(
        r.reply().is_some_and(|l| l.starts_with("app:8080")),
        "{r:?}"
    );
    Ok(f.standin().accepted().len() > before)
}

/// An enrolled pod whose maps are lost (here their pins are removed, as a
/// bpffs remounted or another version's uninstall would leave it): `sluice
/// uninstall` still removes its cls_bpf filters and routes, finding the pod
/// netns by the cookie its pin directory is named after. A filter is no BPF
/// object: left, it would go on capturing a pod that no agent serves.
fn uninstall_with_maps_lost() -> TestResult {
    let f = Fixture::new("lost", Some(Bind::DualStack))?;
    f.enroll()?;
    ensure!(inbound_captured(&f)?, "not captured to begin with");
    std::fs::remove_file(f.topo.pins.maps().join("pod_state"))?;
    ensure!(
        sluice::dataplane::state::Maps::open_pinned(&f.topo.pins.maps()).is_err(),
        "the maps still open: the test's premise does not hold"
    );
    let out = sluice(&f, &["uninstall"])?;
    ensure!(out.ok, "uninstall failed: {}{}", out.stdout, out.stderr);
    if let Some(left) = capture_left(&f)? {
        anyhow::bail!("left in the pod after the uninstall: {left}");
    }
    ensure!(!inbound_captured(&f)?, "still captured after the uninstall");
    Ok(())
}

/// A migration that failed (or was killed) before its renames leaves this
/// build's maps under `maps_next/` (the next start's upgrade removes them);
/// an uninstall in between must remove them too, and with them the root.
fn uninstall_after_failed_migration() -> TestResult {
    let f = Fixture::new("mnx", Some(Bind::DualStack))?;
    f.enroll()?;
    let next = f.topo.pins.root().join("maps_next");
    std::fs::create_dir_all(&next)?;
    // A second pin of a real map stands in for one the migration created.
    aya::maps::MapData::from_pin(f.topo.pins.maps().join("pod_state"))?
        .pin(next.join("pod_state"))?;
    let out = sluice(&f, &["uninstall"])?;
    ensure!(out.ok, "uninstall failed: {}{}", out.stdout, out.stderr);
    ensure!(
        !f.topo.pins.root().exists(),
        "left after the uninstall: {:?}",
        std::fs::read_dir(f.topo.pins.root())?
            .flatten()
            .map(|e| e.path())
            .collect::<Vec<_>>()
    );
    Ok(())
}

/// The node's pins lost while a pod was enrolled (all but the pods'): the
/// next dataplane loads afresh, with empty maps, and finds the pod's pins
/// without a state entry. Its start (and every verification) removes them, and with them the
/// pod's filters and routes, in the netns found by the directory's cookie.
/// A setting of the pod's own that the local route also sets stays: the
/// pod was never on it (the removal found none of its rules).
fn stateless_pins() -> TestResult {
    let f = Fixture::new("orph", Some(Bind::DualStack))?;
    let accept = |ns: &str| {
        sluice_tests::ns::output(ns, &["cat", "/proc/sys/net/ipv4/tcp_fwmark_accept"])
            .map(|v| v.trim().to_owned())
    };
    sluice_tests::ns::exec(
        &f.topo.pod,
        &["sysctl", "-qw", "net.ipv4.tcp_fwmark_accept=1"],
    )?;
    let cookie = f.enroll()?.cookie;
    for dir in [f.topo.pins.maps(), f.topo.pins.progs()] {
        std::fs::remove_dir_all(dir)?;
    }
    let dp = f.dataplane()?;
    ensure!(
        dp.maps().cookies().is_empty() && f.topo.pins.pod(cookie).exists(),
        "fresh maps with the pod's pins left is the test's premise"
    );
    let n = sluice::podnet::enroll::remove_orphan_pins(dp.pins(), dp.maps(), dp.node())?;
    ensure!(n == 1, "{n} pods without state, want 1");
    drop(dp);
    if let Some(left) = capture_left(&f)? {
        anyhow::bail!("left in the pod: {left}");
    }
    ensure!(!inbound_captured(&f)?, "still captured");
    let own = accept(&f.topo.pod)?;
    ensure!(own == "1", "the pod's own tcp_fwmark_accept is {own}");
    Ok(())
}

/// A pod istio-cni captured (Istio's real rules in its netns) is taken over:
/// sluice's capture first, then Istio's chains go; traffic is then captured
/// by sluice (the 15001 listener sees the original destination as its local
/// address — with Istio's REDIRECT it would be 127.0.0.1:15001).
fn takeover_from_istio_cni(backend: Backend, tools: [&str; 2]) -> TestResult {
    let f = Fixture::new("mig", Some(sluice_tests::standin::Bind::DualStack))?;
    sluice_tests::istio::apply_with(&f.topo.pod, backend)?;
    let netns = f.topo.pod_netns_path();
    let ns = sluice::podnet::netns::Netns::open(&netns)?;
    let found = sluice::dataplane::migrate::istio_rules(&ns)?;
    ensure!(found == tools, "Istio's rules not detected: {found:?}");
    ensure!(f.enroll()?.state == sluice_common::PodState::Enabled);
    ensure!(
        sluice::dataplane::migrate::istio_rules(&ns)?.is_empty(),
        "Istio's chains remain"
    );
    for fam in [Family::V4, Family::V6] {
        let remote = SocketAddr::new(fam.client(), sluice_tests::harness::REMOTE_PORT);
        let r = connect(&f.topo.pod, remote, Opts::default());
        ensure!(r.reply().is_some(), "{r:?}");
        let acc = f.standin().accepted();
        let last = acc.last().context("not captured")?;
        ensure!(
            last.local == remote,
            "captured by Istio's REDIRECT, not sluice: {last:?}"
        );
        let r = connect(
            &f.topo.client,
            SocketAddr::new(fam.pod(), APP_PORT),
            Opts::default(),
        );
        ensure!(
            r.reply().is_some_and(|l| l.starts_with("app:8080")),
            "{r:?}"
        );
    }
    ensure!(f.pod_record()?.counters.captured_outbound == 2);
    // Unenrolling leaves the pod with neither rule set.
    f.unenroll()?;
    ensure!(!sluice_tests::topology::has_redirect_rule(&f.topo.pod)?);
    Ok(())
}

/// As in a non-privileged container: /proc/sys is read-only, so enrolling
/// fails cleanly (nothing left attached) — unless `--proc-dir` names a
/// writable procfs mount (the DaemonSet's hostPath of the host's /proc), whose
/// net sysctls answer for the pod netns all the same.
fn sysctls_with_read_only_proc_sys() -> TestResult {
    let f = Fixture::new("ro", Some(Bind::DualStack))?;
    let netns = f.topo.pod_netns_path();
    let host_proc = std::env::temp_dir().join(format!("sluice-hostproc-{}", std::process::id()));
    std::fs::create_dir_all(&host_proc)?;
    // The mounts live in a private mount namespace that ends with the command.
    let enroll = |proc_dir: Option<&Path>| -> anyhow::Result<Out> {
        let mut script = format!(
            "mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && \
             mount --bind /proc {hp} && exec {bin} --bpf-root {root} --control-socket {no_agent}",
            hp = host_proc.display(),
            bin = sluice_bin().display(),
            root = f.topo.pins.root().display(),
            no_agent = NO_AGENT,
        );
        if let Some(p) = proc_dir {
            script.push_str(&format!(" --proc-dir {}", p.display()));
        }
        script.push_str(&format!(
            " enroll --netns {} --uid {}",
            netns.display(),
            f.uid
        ));
        let out = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .output_bounded()?;
        Ok(Out {
            ok: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    };
    let host_migrate = || std::fs::read_to_string("/proc/sys/net/ipv4/tcp_migrate_req");
    let host_before = host_migrate()?;
    let result = (|| -> TestResult {
        let out = enroll(None)?;
        ensure!(!out.ok, "enrolled with a read-only /proc/sys?");
        ensure!(
            out.stderr.contains("tcp_migrate_req") && out.stderr.contains("Read-only file system"),
            "{}",
            out.stderr
        );
        ensure!(
            f.pod_record().is_err(),
            "a failed enroll left the pod enrolled"
        );
        let out = enroll(Some(&host_proc))?;
        ensure!(out.ok, "{} {}", out.stdout, out.stderr);
        let sysctl = |name: &str| -> anyhow::Result<String> {
            let o = Command::new("ip")
                .args(["netns", "exec", &f.topo.pod, "cat"])
                .arg(format!("/proc/sys/{name}"))
                .output_bounded()?;
            Ok(String::from_utf8_lossy(&o.stdout).trim().to_owned())
        };
        ensure!(sysctl("net/ipv4/tcp_migrate_req")? == "1");
        ensure!(sysctl("net/ipv4/conf/eth0/accept_local")? == "1");
        // The host's own value was not touched.
        ensure!(
            host_migrate()? == host_before,
            "the host's tcp_migrate_req changed"
        );
        let pod = SocketAddr::new(Family::V4.pod(), APP_PORT);
        let r = connect(&f.topo.client, pod, Opts::default());
        ensure!(
            r.reply().is_some_and(|l| l.starts_with("app:8080")),
            "{r:?}"
        );
        ensure!(f.standin().accepted().len() == 1, "not captured");
        Ok(())
    })();
    let _ = std::fs::remove_dir(&host_proc);
    result
}

/// The take-over check answers a pod netns without iptables tables from one
/// netlink dump and two proc files (no iptables tool runs for it), and sees
/// the tables an iptables-nft or iptables-legacy rule set makes there.
fn nf_tables_counted() -> TestResult {
    use sluice::dataplane::migrate::{legacy_tables, nf_tables_count, LEGACY_V4, LEGACY_V6};
    let f = Fixture::new("nft", None)?;
    let netns = sluice::podnet::netns::Netns::open(&f.topo.pod_netns_path())?;
    let seen = || -> anyhow::Result<(Option<usize>, bool, bool)> {
        let (n, v4, v6) = netns.run(|| {
            (
                nf_tables_count(),
                legacy_tables(LEGACY_V4),
                legacy_tables(LEGACY_V6),
            )
        })?;
        Ok((n, v4?, v6?))
    };
    ensure!(
        seen()? == (Some(0), false, false),
        "a fresh pod netns shows (nf_tables, legacy v4, legacy v6) {:?}",
        seen()?
    );
    let tool = |tool: &str| -> TestResult {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &f.topo.pod,
                tool,
                "-t",
                "nat",
                "-N",
                "ISTIO_OUTPUT",
            ])
            .output_bounded()?;
        ensure!(out.status.success(), "{tool}: {out:?}");
        Ok(())
    };
    tool("iptables-nft")?;
    let (n, _, _) = seen()?;
    ensure!(
        n.is_some_and(|n| n >= 1),
        "after iptables-nft made a chain: {n:?}"
    );
    tool("ip6tables-legacy")?;
    let (_, v4, v6) = seen()?;
    ensure!(
        v6 && !v4,
        "after ip6tables-legacy made a chain: legacy v4 {v4}, v6 {v6}"
    );
    Ok(())
}

/// Kernels without tcx: sluice's cls_bpf filter deleted behind its back
/// (`tc filter del` by anything holding CAP_NET_ADMIN in the pod) leaves its
/// record pinned. The record alone must not count: CHECK's `missing_links`
/// names the filter, repair attaches it again, and outbound is captured
/// again.
/// An L3 device (here a tun device; netkit in L3 mode and WireGuard alike)
/// carries packets that start with their IP header: it gets the L3 variants
/// of the capture programs, and a connection routed through it reaches
/// ztunnel's outbound listener with its original destination. Nothing reads
/// the tun device, so a SYN that left by it uncaptured would be lost.
fn l3_interface() -> TestResult {
    use sluice_common::Role;
    let f = Fixture::new("l3", Some(Bind::DualStack))?;
    let pod = f.topo.pod.as_str();
    // The tun driver is a module on distribution kernels (the VMs): its
    // device node appears once it is loaded.
    if !Path::new("/dev/net/tun").exists() {
        let _ = Command::new("modprobe").arg("tun").status();
    }
    ip(&["-n", pod, "tuntap", "add", "mode", "tun", "name", "tun0"])?;
    ip(&["-n", pod, "addr", "add", "10.198.0.1/24", "dev", "tun0"])?;
    ip(&["-n", pod, "link", "set", "tun0", "up"])?;
    let e = f.enroll()?;
    ensure!(e.state == sluice_common::PodState::Enabled, "{e:?}");
    let dir = f.topo.pins.pod(e.cookie);
    for pin in ["l3egress_tun0", "l3ingress_tun0", "egress_eth0"] {
        ensure!(dir.join(pin).exists(), "no {pin} pinned");
    }
    ensure!(
        !dir.join("egress_tun0").exists(),
        "tun0 got the Ethernet program"
    );
    let dst = SocketAddr::new([10, 198, 0, 5].into(), REMOTE_PORT);
    let r = connect(pod, dst, Opts::default());
    let acc = f.standin().accepted();
    ensure!(
        acc.iter()
            .any(|a| a.role == Role::Outbound && a.local == dst),
        "the connection over tun0 was not captured: {r:?}, ztunnel accepted {acc:?}; pod counters {:?}",
        f.pod_record().map(|p| p.counters)
    );
    Ok(())
}

/// sluice's pod-side programs are appended after the device's others and
/// pass what is not theirs on (`TCX_NEXT`; cls_bpf: the next filter): a
/// program attached after them on the pod's egress still runs for the
/// packets sluice lets through (UDP that is not DNS, other protocols). The observer is
/// a second attachment of `sluice_lo` (a tcx link after sluice's, or a
/// cls_bpf filter at priority 100), its runs counted by the kernel's
/// program statistics while the test holds them enabled.
fn programs_after_sluice(tcx: bool) -> TestResult {
    use aya::programs::{
        tc::TcAttachOptions, LinkOrder, ProgramInfo, SchedClassifier, TcAttachType,
    };
    let f = Fixture::new("order", Some(Bind::DualStack))?;
    let e = f.enroll()?;
    ensure!(e.state == sluice_common::PodState::Enabled, "{e:?}");
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)?;
    let prog_pin = f
        .topo
        .pins
        .progs()
        .join(sluice::dataplane::loader::Program::Lo.name());
    let pod = f.topo.pod.clone();
    // Held (tcx) or left on the veth (cls_bpf) until the topology goes.
    let _link = sluice_tests::ns::run_in(&pod, move || -> anyhow::Result<_> {
        let mut p = SchedClassifier::from_pin(&prog_pin)?;
        let options = if tcx {
            TcAttachOptions::TcxOrder(LinkOrder::default())
        } else {
            TcAttachOptions::Netlink(aya::programs::tc::NlOptions {
                priority: 100,
                ..Default::default()
            })
        };
        let id = p.attach_with_options("eth0", TcAttachType::Egress, options)?;
        Ok(p.take_link(id)?)
    })?;
    let runs = || -> anyhow::Result<u64> {
        Ok(ProgramInfo::from_pin(
            f.topo
                .pins
                .progs()
                .join(sluice::dataplane::loader::Program::Lo.name()),
        )?
        .run_count())
    };
    let before = runs()?;
    let dst = SocketAddr::new(Family::V4.client(), sluice_tests::harness::UDP_PORT);
    // Three datagrams the DNS path passes on, three IP packets of an
    // experimental protocol (253) the capture path passes on.
    sluice_tests::ns::run_in(&pod, move || -> std::io::Result<()> {
        use socket2::{Domain, Protocol, Socket, Type};
        let udp = std::net::UdpSocket::bind("0.0.0.0:0")?;
        let raw = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::from(253)))?;
        for _ in 0..3 {
            udp.send_to(b"after sluice", dst)?;
            raw.send_to(b"after sluice", &SocketAddr::new(dst.ip(), 0).into())?;
        }
        Ok(())
    })?;
    let after = runs()?;
    ensure!(
        after >= before + 6,
        "the program after sluice's ran {} times for 6 packets (sluice ended the chain)",
        after - before
    );
    Ok(())
}

fn deleted_filter() -> TestResult {
    use sluice::podnet::enroll::{self, Repair};
    let f = Fixture::new("fdel", Some(Bind::DualStack))?;
    let e = f.enroll()?;
    ensure!(e.state == sluice_common::PodState::Enabled, "{e:?}");
    let dst = SocketAddr::new(Family::V4.client(), REMOTE_PORT);
    let outbound = || {
        let r = connect(&f.topo.pod, dst, Opts::default());
        r.reply().map(str::to_owned).ok_or(r)
    };
    outbound().map_err(|r| anyhow::anyhow!("outbound before: {r:?}"))?;
    ensure!(
        f.standin().accepted().len() == 1,
        "not captured to begin with"
    );

    sluice_tests::ns::exec(
        &f.topo.pod,
        &["tc", "filter", "del", "dev", "eth0", "egress"],
    )?;
    // The deletion took effect: outbound leaves around the stand-in now.
    outbound().map_err(|r| anyhow::anyhow!("outbound without the filter: {r:?}"))?;
    ensure!(
        f.standin().accepted().len() == 1,
        "captured although the egress filter was deleted: the test's premise does not hold"
    );

    let mut dp = f.dataplane()?;
    let missing = enroll::missing_links(&dp, e.cookie)?;
    ensure!(
        missing == ["egress_eth0"],
        "CHECK's view of the pod: missing {missing:?}, want [egress_eth0] (the record alone was taken for the filter)"
    );
    let repaired = enroll::repair(&mut dp, e.cookie, false)?;
    ensure!(
        repaired
            == Repair::Repaired {
                relinked: vec!["egress_eth0".into()],
                istio_rules: vec![],
            },
        "{repaired:?}"
    );
    let missing = enroll::missing_links(&dp, e.cookie)?;
    ensure!(
        missing.is_empty(),
        "still missing after repair: {missing:?}"
    );
    drop(dp);
    outbound().map_err(|r| anyhow::anyhow!("outbound after repair: {r:?}"))?;
    ensure!(
        f.standin().accepted().len() == 2,
        "outbound not captured after repair: {:?}",
        f.standin().accepted()
    );
    Ok(())
}

/// A pod's teardown cut short (Draining) and finished by a repair, as the
/// agent's repairer finishes it: what its counters said stays in the maps'
/// totals of gone pods, so the metrics' node totals never go back while the
/// agent runs. (Only an unenroll kept them; the repairer's finish dropped
/// them, and the totals fell, which Prometheus reads as a counter reset.)
fn counts_kept_when_a_repair_finishes_a_teardown() -> TestResult {
    let f = Fixture::new("rkc", Some(Bind::DualStack))?;
    ensure!(f.enroll()?.state == PodState::Enabled);
    ensure!(inbound_captured(&f)?, "not captured");
    let mut dp = f.dataplane()?;
    let cookie = f.pod_record()?.netns_cookie;
    let counted = dp.maps().counters(cookie).captured_inbound;
    ensure!(counted == 1, "captured_inbound {counted}");
    let before = dp.maps().retired_counters().kernel.captured_inbound;
    dp.maps_mut().apply(
        cookie,
        sluice::lifecycle::Event::Drain,
        sluice::dataplane::state::boottime_ns(),
    )?;
    sluice::podnet::enroll::repair(&mut dp, cookie, false)?;
    ensure!(
        dp.maps().entry(cookie).is_none(),
        "the teardown was not finished"
    );
    let after = dp.maps().retired_counters().kernel.captured_inbound;
    ensure!(
        after == before + counted,
        "retired captured_inbound {before} → {after}"
    );
    Ok(())
}

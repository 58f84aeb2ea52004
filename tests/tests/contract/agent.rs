//! The node agent and ZDS, with the agent and a ztunnel-like peer as real
//! processes, pods in real namespaces, real unix sockets.

use sluice_tests::child::Bounded as _;
use std::{
    net::SocketAddr,
    os::fd::{AsFd, AsRawFd, OwnedFd},
    path::Path,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use anyhow::{ensure, Context as _};
use libtest_mimic::Trial;
use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
use sluice::zds::{proto, wire};
use sluice_common::PodState;
use sluice_tests::{
    agent::{free_port, http_get, AgentProc, Out, PeerProc},
    app::App,
    flow::{connect as tcp, Opts, Reached},
    harness::{as_if_kernel, steering, without_tcx, Fixture, APP_PORT, REMOTE_PORT},
    ns::spawn_in,
    topology::Family,
    wait,
};

use crate::{needs_fault_injection, tcx_trial, trial, TestResult};

const PEER: &str = env!("CARGO_BIN_EXE_sluice-zds-peer");
/// "Another build" of the programs: the `upgrade-variant` feature (same maps
/// and behaviour, different instructions), built by `cargo xtask test`.
const VARIANT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../target/ebpf-variant/bpfel-unknown-none/release/sluice-ebpf"
);

pub fn trials() -> Vec<Trial> {
    vec![
        trial(
            "agent::happy_path_enroll_through_agent_and_ztunnel",
            happy_path,
        ),
        trial(
            "agent::ztunnel_gone_mid_add_leaves_the_pod_retried_for_the_next_one",
            gone_mid_add,
        ),
        trial(
            "agent::logs_are_json_lines_with_the_pods_span_off_a_terminal",
            json_logs,
        ),
        trial(
            "agent::snapshot_on_reconnect_adds_every_pod_then_snapshot_sent",
            snapshot,
        ),
        trial(
            "agent::ztunnel_restart_under_traffic_fails_closed_then_recovers",
            restart,
        ),
        trial("agent::ztunnel_upgrade_refuses_no_connection", upgrade),
        trial(
            "agent::ztunnel_upgrade_old_gone_before_new_acks_refuses_no_connection",
            upgrade_old_gone_first,
        ),
        trial(
            "agent::a_ztunnel_upgrade_across_an_agent_kill_keeps_pods_on_the_new_ztunnel",
            upgrade_across_agent_kill,
        ),
        trial(
            "agent::a_ztunnel_upgrade_across_an_agent_kill_with_both_acks_at_once_ends_on_the_new_ztunnel",
            upgrade_across_agent_kill_acks_together,
        ),
        trial(
            "agent::a_slow_iptables_tool_holds_up_only_its_own_pod",
            slow_takeover_check,
        ),
        trial(
            "agent::a_pod_whose_own_nft_rules_iptables_cannot_parse_is_enrolled",
            unparsable_nft_rules,
        ),
        needs_fault_injection(trial(
            "agent::a_pods_repair_held_in_its_netlink_work_holds_up_only_that_pod",
            held_repair,
        )),
        trial("agent::port_hijack_after_ztunnel_died_gets_nothing", hijack),
        trial("agent::bad_peers_leave_the_agent_serving", bad_peers),
        trial(
            "agent::peer_that_never_acks_or_nacks_keeps_pod_pending",
            stubborn_peers,
        ),
        trial(
            "agent::sigterm_leaves_capture_in_place_and_restart_adopts",
            sigterm,
        ),
        trial(
            "agent::sigkill_and_restart_under_load_loses_no_connection",
            sigkill_restart,
        ),
        trial(
            "agent::a_capture_a_repair_cannot_complete_is_reported_until_it_is_completed",
            incomplete_capture,
        ),
        needs_fault_injection(trial(
            "agent::restart_over_another_builds_programs_replaces_them_in_place_under_load",
            programs_replaced,
        )),
        {
            let t = needs_fault_injection(trial(
                "agent::upgrade_to_another_build_and_back_under_load_loses_no_connection",
                another_build,
            ));
            if Path::new(VARIANT).exists() {
                t
            } else {
                eprintln!(
                    "skipping the upgrade-to-another-build test: {VARIANT} is missing (`cargo xtask build-ebpf --variant` builds it; `cargo xtask test` does)"
                );
                t.with_ignored_flag(true)
            }
        },
        {
            let t = needs_fault_injection(trial(
                "agent::migrate_to_another_map_layout_and_back_under_load_loses_no_connection",
                another_layout,
            ));
            if Path::new(LAYOUT).exists() {
                t
            } else {
                eprintln!(
                    "skipping the map-layout migration test: {LAYOUT} is missing (`cargo xtask build-ebpf --variant` builds it; `cargo xtask test` does)"
                );
                t.with_ignored_flag(true)
            }
        },
        {
            let t = needs_fault_injection(tcx_trial(
                "agent::tcx::upgrade_over_a_pod_gone_while_no_agent_ran_switches_the_others",
                upgrade_over_a_gone_pod,
            ));
            t.with_ignored_flag(!Path::new(VARIANT).exists())
        },
        {
            let t = needs_fault_injection(trial(
                "agent::upgrade_over_a_pod_gone_while_no_agent_ran_switches_the_others",
                upgrade_over_a_gone_pod,
            ));
            if Path::new(VARIANT).exists() {
                t
            } else {
                t.with_ignored_flag(true)
            }
        },
        // tcx links are pointed at the new programs with BPF_LINK_UPDATE.
        needs_fault_injection(tcx_trial(
            "agent::tcx::restart_over_another_builds_programs_replaces_them_in_place_under_load",
            programs_replaced,
        )),
        {
            let t = needs_fault_injection(tcx_trial(
                "agent::tcx::upgrade_to_another_build_and_back_under_load_loses_no_connection",
                another_build,
            ));
            if Path::new(VARIANT).exists() {
                t
            } else {
                t.with_ignored_flag(true)
            }
        },
        // As on kernels without tcx (cls_bpf filters, no netns cookies in tc).
        needs_fault_injection(trial(
            "agent::no_tcx::restart_over_another_builds_programs_replaces_them_in_place_under_load",
            || as_if_kernel(without_tcx(), programs_replaced),
        )),
        {
            let t = needs_fault_injection(trial(
                "agent::no_tcx::upgrade_to_another_build_and_back_under_load_loses_no_connection",
                || as_if_kernel(without_tcx(), another_build),
            ));
            if Path::new(VARIANT).exists() {
                t
            } else {
                t.with_ignored_flag(true)
            }
        },
        {
            let t = needs_fault_injection(trial(
                "agent::no_tcx::migrate_to_another_map_layout_and_back_under_load_loses_no_connection",
                || as_if_kernel(without_tcx(), another_layout),
            ));
            if Path::new(LAYOUT).exists() {
                t
            } else {
                t.with_ignored_flag(true)
            }
        },
        trial("agent::host_and_own_netns_are_never_captured", never_host),
        trial(
            "agent::pod_netns_discovery_skips_pod_processes_in_the_host_netns",
            discovery_skips_host,
        ),
        trial(
            "agent::pinned_maps_it_cannot_take_over_are_reported_not_crash_looped_on",
            incompatible_maps,
        ),
        trial(
            "agent::another_node_agent_on_the_zds_socket_is_reported_and_waited_for",
            another_node_agent,
        ),
        trial("agent::unenroll_sends_del_and_removes_capture", unenroll),
        trial(
            "agent::uninstall_removes_everything_and_pods_keep_working",
            uninstall,
        ),
        trial("agent::lifts_its_soft_open_files_limit", fd_limit),
        trial(
            "agent::sockets_are_root_only_whatever_the_umask",
            sockets_root_only,
        ),
        trial(
            "agent::control_socket_survives_fd_exhaustion_and_bad_clients",
            control_survives,
        ),
        trial(
            "agent::cli_for_another_bpf_root_is_refused_by_the_agent",
            other_root,
        ),
        trial(
            "agent::an_interface_added_after_enrollment_is_captured_at_once",
            interface_added,
        ),
        trial(
            "agent::a_filter_whose_program_another_tool_swapped_is_repaired_at_once",
            filter_swapped,
        ),
        trial(
            "agent::a_host_side_filter_deleted_or_swapped_is_put_back_at_once",
            host_filter_put_back,
        ),
        trial(
            "agent::another_tools_filter_ahead_of_sluices_is_found_and_sluice_put_first",
            foreign_filter_ahead,
        ),
        tcx_trial(
            "agent::tcx::another_tools_tcx_program_ahead_of_sluices_is_found_and_sluice_put_first",
            foreign_tcx_ahead,
        ),
        tcx_trial(
            "agent::tcx::an_interface_deleted_and_made_again_under_its_name_is_captured_again",
            interface_made_again,
        ),
        trial(
            "agent::no_netns_cookie_in_tc::an_interface_added_after_enrollment_is_captured_at_once",
            || {
                sluice_tests::harness::as_if_kernel(
                    sluice_tests::harness::without_netns_cookie_in_tc(),
                    interface_added,
                )
            },
        ),
        trial(
            "agent::runs_with_the_daemonset_capabilities_and_read_only_proc_sys",
            daemonset_privileges,
        ),
    ]
}

pub(crate) fn enroll(agent: &AgentProc, f: &Fixture) -> anyhow::Result<Out> {
    agent.enroll(
        &f.topo.pod_netns_path(),
        f.uid.as_str(),
        "ambient",
        f.uid.as_str(),
    )
}

/// Starts the ZDS peer and waits until the agent reports it connected (its
/// snapshot acked), as a ztunnel that is up when pods arrive.
pub(crate) fn peer(agent: &AgentProc) -> anyhow::Result<PeerProc> {
    peer_with(agent, &[])
}

/// Starts a ZDS peer that holds its first ack until the returned gate file
/// exists, and waits until it holds it (`what`): the add it holds has its
/// listeners open, and its snapshot stays in flight.
pub(crate) fn held_peer(
    agent: &AgentProc,
    what: &str,
) -> anyhow::Result<(PeerProc, std::path::PathBuf)> {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let gate = agent.dir.join(format!("ztunnel-may-ack-{n}"));
    let gate_arg = gate.to_str().context("path")?.to_owned();
    let p = PeerProc::start(
        Path::new(PEER),
        &agent.zds,
        &["--hold-acks-until", &gate_arg],
    )?;
    p.wait_for(what, |e| e.iter().any(|e| e["event"] == "listening"))?;
    Ok((p, gate))
}

pub(crate) fn peer_with(agent: &AgentProc, flags: &[&str]) -> anyhow::Result<PeerProc> {
    let p = PeerProc::start(Path::new(PEER), &agent.zds, flags)?;
    let pid = p.pid().context("peer has no pid")?;
    agent.wait_ztunnel(pid, "the agent to report the peer connected", |z| {
        z["connected"] == true
    })?;
    Ok(p)
}

/// Enrolls through the agent and requires it steering (Enabled or Served), with the agent's log if not.
pub(crate) fn enroll_enabled(agent: &AgentProc, f: &Fixture) -> TestResult {
    let out = enroll(agent, f)?;
    ensure!(
        out.ok && steering(&out.stdout),
        "enroll: {} {}\n{}",
        out.stdout,
        out.stderr,
        agent.log()
    );
    Ok(())
}

/// The pod's state's name, as `status -o json` has it.
fn state(f: &Fixture) -> Option<&'static str> {
    f.pod_record()
        .ok()
        .and_then(|r| r.state)
        .map(PodState::as_str)
}

fn inbound(f: &Fixture) -> Reached {
    tcp(
        &f.topo.client,
        SocketAddr::new(f.topo.pod_ip(Family::V4), APP_PORT),
        Opts::default(),
    )
}

fn happy_path() -> TestResult {
    let f = Fixture::new("ag", None)?;
    let agent = AgentProc::start(&f.topo.pins)?;
    let peer = peer(&agent)?;
    peer.wait_snapshot()?;
    let out = enroll(&agent, &f)?;
    ensure!(
        out.ok && steering(&out.stdout),
        "enroll: {} {}\n{}",
        out.stdout,
        out.stderr,
        agent.log()
    );
    let add = peer
        .events()
        .into_iter()
        .find(|e| e["event"] == "add")
        .context("no add")?;
    ensure!(
        add["fds"] == 1 && add["workload"] == format!("ambient/{}/app-sa", f.uid),
        "{add}"
    );
    ensure!(inbound(&f)
        .reply()
        .is_some_and(|l| l.starts_with("app:8080")));
    let out_conn = tcp(
        &f.topo.pod,
        SocketAddr::new(f.topo.client_ip(Family::V4), REMOTE_PORT),
        Opts::default(),
    );
    ensure!(
        out_conn.reply().is_some_and(|l| l.starts_with("app:9090")),
        "{out_conn:?}"
    );
    peer.wait_for("inbound and outbound accepted by the peer", |_| {
        peer.accepted_roles(&["inbound", "outbound"])
    })?;
    // The served check asks ztunnel on its own schedule: waited for.
    wait::until("the pod shown Served", wait::DEADLINE, || {
        let status = agent.sluice(&["status"]).map_err(|e| e.to_string())?;
        if status.stdout.contains("Served") {
            Ok(())
        } else {
            Err(status.stdout)
        }
    })?;
    Ok(())
}

fn snapshot() -> TestResult {
    let a = Fixture::in_subnet("sa", None, 1)?;
    let b = Fixture::in_subnet("sb", None, 2)?;
    let agent = AgentProc::start(&a.topo.pins)?;
    let mut p1 = peer(&agent)?;
    for f in [&a, &b] {
        let out = enroll(&agent, f)?;
        ensure!(
            out.ok && steering(&out.stdout),
            "{} {}",
            out.stdout,
            out.stderr
        );
    }
    p1.kill();
    let p2 = peer(&agent)?;
    p2.wait_snapshot()?;
    let ev: Vec<String> = p2
        .events()
        .iter()
        .filter(|e| {
            ["add", "del", "keep", "snapshot_sent"].contains(&e["event"].as_str().unwrap_or(""))
        })
        .map(|e| {
            format!(
                "{}:{}",
                e["event"].as_str().unwrap(),
                e["uid"].as_str().unwrap_or("")
            )
        })
        .collect();
    // One add per enrolled pod (any order), then snapshot_sent, nothing else.
    ensure!(ev.len() == 3 && ev[2] == "snapshot_sent:", "{ev:?}");
    let mut adds = ev[..2].to_vec();
    adds.sort();
    let mut want = vec![format!("add:{}", a.uid), format!("add:{}", b.uid)];
    want.sort();
    ensure!(adds == want, "{adds:?}");
    ensure!(p2.count("protocol_error") == 0);
    // Both pods are back to Served with the new peer's listeners.
    a.wait_state("Served")?;
    b.wait_state_in(&a.topo.pins, "Served")?;
    let (ra, rb) = (inbound(&a), inbound(&b));
    ensure!(
        ra.reply().is_some() && rb.reply().is_some(),
        "{ra:?} {rb:?}\n{}",
        agent.log()
    );
    Ok(())
}

/// Clients opening one connection after another, into the pod (to the app,
/// through ztunnel's inbound listener) and out of it (to the remote server,
/// through its outbound listener), until stopped. Each must be answered
/// within 4 s, SYN retransmits included.
struct Clients {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicUsize>,
    failures: Arc<Mutex<Vec<Failure>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

/// A connection that was not answered.
#[derive(Clone, Debug)]
struct Failure {
    direction: &'static str,
    /// The handshake completed (a listener had taken the connection) and the
    /// exchange failed afterwards; otherwise the connect itself failed.
    established: bool,
    /// The client's address, as the listener that took it saw it.
    local: Option<SocketAddr>,
    what: String,
    /// Connections completed before this one.
    after: usize,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} after {} ok: {}",
            self.direction,
            if self.established {
                "established, then"
            } else {
                "connect"
            },
            self.after,
            self.what
        )
    }
}

impl Clients {
    fn start(f: &Fixture) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicUsize::new(0));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let flows = [
            (
                "inbound",
                &f.topo.client,
                SocketAddr::new(f.topo.pod_ip(Family::V4), APP_PORT),
                format!("app:{APP_PORT}"),
            ),
            (
                "outbound",
                &f.topo.pod,
                SocketAddr::new(f.topo.client_ip(Family::V4), REMOTE_PORT),
                format!("app:{REMOTE_PORT}"),
            ),
        ];
        let threads = flows
            .into_iter()
            .map(|(direction, ns, dst, want)| {
                let (s, o, fl) = (stop.clone(), ok.clone(), failures.clone());
                spawn_in(ns, move || {
                    let opts = Opts {
                        timeout: Some(Duration::from_secs(4)),
                        ..Opts::default()
                    };
                    while !s.load(Ordering::Relaxed) {
                        let (local, r) = match sluice_tests::flow::try_connect(dst, &opts) {
                            Ok(c) => (c.local_addr().ok(), sluice_tests::flow::exchange(c)),
                            Err(e) => (None, sluice_tests::flow::classify(e)),
                        };
                        match r {
                            Reached::Reply(l) if l.starts_with(&want) => {
                                o.fetch_add(1, Ordering::SeqCst);
                            }
                            other => fl.lock().unwrap().push(Failure {
                                direction,
                                established: local.is_some(),
                                local,
                                what: format!("{other:?}"),
                                after: o.load(Ordering::SeqCst),
                            }),
                        }
                    }
                })
            })
            .collect();
        Self {
            stop,
            ok,
            failures,
            threads,
        }
    }

    fn ok(&self) -> usize {
        self.ok.load(Ordering::SeqCst)
    }

    /// Waits until `more` further connections have completed.
    fn wait_more(&self, more: usize, what: &str) -> TestResult {
        let want = self.ok() + more;
        wait::until_seen(
            &format!("{more} more connections to complete ({what})"),
            wait::DEADLINE,
            || (self.ok(), self.failures()),
            |(ok, _)| *ok >= want,
        )
        .map(drop)
    }

    fn failures(&self) -> Vec<String> {
        self.failures
            .lock()
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    /// Stops the loops, prints what `name` cost, and fails on any failed
    /// connection (with the agent's log).
    fn finish_without_failures(self, name: &str, agent: &AgentProc) -> TestResult {
        let (ok, failures) = self.finish();
        println!(
            "{name}: {ok} connections completed, {} failed {failures:?}",
            failures.len()
        );
        ensure!(failures.is_empty(), "{failures:?}\n{}", agent.log());
        Ok(())
    }

    /// Stops the loops: (completed, failures).
    fn finish(mut self) -> (usize, Vec<Failure>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        (self.ok(), self.failures.lock().unwrap().clone())
    }
}

pub(crate) fn inbound_accepts(p: &PeerProc) -> usize {
    p.events()
        .iter()
        .filter(|e| e["event"] == "accepted" && e["role"] == "inbound")
        .count()
}

fn restart() -> TestResult {
    let f = Fixture::new("rs", None)?;
    let agent = AgentProc::start(&f.topo.pins)?;
    let mut p1 = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    let clients = Clients::start(&f);
    clients.wait_more(20, "before the crash")?;
    p1.kill(); // crash: listeners gone at once
    f.wait_state("Pending")?;
    // A new connection meets the outage: its SYNs are dropped (fail closed).
    // (The clients may be waiting on connections queued on the dead
    // ztunnel's listener, so a probe of its own.)
    let dropped = f.pod_record()?.counters.dropped_fail_closed;
    let probe = tcp(
        &f.topo.client,
        SocketAddr::new(f.topo.pod_ip(Family::V4), APP_PORT),
        Opts {
            timeout: Some(Duration::from_millis(500)),
            ..Opts::default()
        },
    );
    ensure!(probe == Reached::TimedOut, "while Pending: {probe:?}");
    // The agent still holds the dead ztunnel's listeners: nothing else in
    // the pod can take their ports meanwhile.
    let squat = sluice_tests::ns::run_in(&f.topo.pod, || {
        std::net::TcpListener::bind("0.0.0.0:15006").map(drop)
    });
    ensure!(
        squat
            .as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::AddrInUse),
        "binding 15006 in the pod while ztunnel is down: {squat:?}"
    );
    f.wait_dropped_after(dropped)?;
    let p2 = peer(&agent)?;
    f.wait_state("Served")?;
    clients.wait_more(20, "after ztunnel came back")?;
    let (ok, failures) = clients.finish();
    let via_ztunnel = inbound_accepts(&p1) + inbound_accepts(&p2);
    let at_app = f.app.peers().len();
    // Which failed connections the dead ztunnel had accepted (it saw the
    // client's address as its peer).
    let taken_by_p1: std::collections::HashSet<String> = p1
        .events()
        .iter()
        .filter(|e| e["event"] == "accepted")
        .filter_map(|e| {
            e["peer"]
                .as_str()
                .map(|p| p.trim_start_matches("::ffff:").to_owned())
        })
        .collect();
    // A connection the dead ztunnel held is reset (or closed) when it dies;
    // its accept event may not have been printed before the kill.
    let (accepted, not_accepted): (Vec<_>, Vec<_>) = failures.iter().partition(|x| {
        x.local
            .is_some_and(|l| taken_by_p1.contains(&l.to_string()))
            || (x.established
                && (x.what.contains("reset by peer") || x.what.contains("closed without a reply")))
    });
    println!(
        "ztunnel restart: {ok} connections completed, {} failed, all accepted by the ztunnel that died {:?}; app accepted {at_app}, all through ztunnel ({via_ztunnel}); dropped-fail-closed {}, missing-socket {}",
        failures.len(),
        accepted.iter().map(ToString::to_string).collect::<Vec<_>>(),
        f.pod_record()?.counters.dropped_fail_closed,
        f.pod_record()?.counters.missing_socket
    );
    // Only a connection the dead ztunnel had accepted (it held it, being
    // proxied, when it died) may fail. A connection still queued on its
    // listener moves to the new ztunnel's (never reset, never left without an
    // answer); a new one waits (its SYNs are dropped until then) and succeeds.
    ensure!(
        not_accepted.is_empty(),
        "connections the dead ztunnel never accepted failed: {not_accepted:?}\np2: {:?}\n{}",
        p2.events(),
        agent.log()
    );
    // A connection ztunnel accepted just before it died never reaches the app,
    // so `<=`; more at the app than through ztunnel would mean a bypass.
    ensure!(
        at_app <= via_ztunnel,
        "{at_app} app connections but only {via_ztunnel} via ztunnel: some bypassed it"
    );
    ensure!(
        ok > 0 && inbound_accepts(&p2) > 0,
        "no connection completed after the restart"
    );
    Ok(())
}

/// A ztunnel upgrade in the usual order: the new ztunnel connects, takes the
/// pod from its snapshot and opens its listeners; the agent registers them;
/// then the old one drains and exits. No connection may fail.
fn upgrade() -> TestResult {
    let f = Fixture::new("up", None)?;
    let agent = AgentProc::start(&f.topo.pins)?;
    let mut old = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    let clients = Clients::start(&f);
    clients.wait_more(20, "through the old ztunnel")?;
    let new = peer(&agent)?;
    wait_owns_pod(&agent, &new)?;
    old.terminate();
    finish_upgrade("ztunnel upgrade", &f, &agent, clients, &old, &new)
}

/// The other order: the new ztunnel has opened its listeners but not acked
/// yet (so the agent has not registered them) when the old one drains and
/// exits. The agent holds the old listeners until the new ones replace them;
/// connections that arrive meanwhile queue on the old socket and move to the
/// new listener when it closes. No connection may fail.
fn upgrade_old_gone_first() -> TestResult {
    let f = Fixture::new("uq", None)?;
    let agent = AgentProc::start(&f.topo.pins)?;
    let mut old = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    let clients = Clients::start(&f);
    clients.wait_more(20, "through the old ztunnel")?;
    let (new, gate) = held_peer(&agent, "the new ztunnel to open the pod's listeners")?;
    old.terminate();
    old_pid_gone(&agent)?;
    // The old ztunnel is gone; the agent still holds its listeners, so the
    // pod is Served and connections keep being accepted by the kernel.
    ensure!(
        state(&f) == Some("Served"),
        "{:?}\n{}",
        state(&f),
        agent.log()
    );
    std::fs::write(&gate, "")?;
    wait_owns_pod(&agent, &new)?;
    finish_upgrade(
        "ztunnel upgrade, old gone first",
        &f,
        &agent,
        clients,
        &old,
        &new,
    )
}

/// Chaos seed 1795815962517742895 (agent kill, ztunnel upgrade new first):
/// the agent comes back in the middle of a ztunnel upgrade, and both
/// ztunnels reconnect, in any order. Here the old one reconnects first and
/// acks the snapshot after the new one has acked it (its ack held until the
/// new one owns the pod). The pod must stay on the new one's listeners:
/// going back to the old one, which drains next, lost a DNS query queued on
/// its socket when it closed. When the old one has drained, the pod has
/// never left Served.
fn upgrade_across_agent_kill() -> TestResult {
    upgrade_across_agent_restart(false)
}

/// The same, with both ztunnels' acks released at once: whichever the agent
/// takes first, the pod ends on the new one's listeners.
fn upgrade_across_agent_kill_acks_together() -> TestResult {
    upgrade_across_agent_restart(true)
}

fn upgrade_across_agent_restart(together: bool) -> TestResult {
    let f = Fixture::new(if together { "uat" } else { "uak" }, None)?;
    let port = free_port()?;
    let metrics = format!("127.0.0.1:{port}");
    let mut agent = AgentProc::start_with(&f.topo.pins, &["--metrics-addr", &metrics])?;
    let gate = |who: &str| agent.dir.join(format!("{who}-ztunnel-may-ack"));
    let (old_gate, new_gate) = (gate("old"), gate("new"));
    let arg = |p: &Path| -> anyhow::Result<String> { Ok(p.to_str().context("path")?.to_owned()) };
    std::fs::write(&old_gate, "")?;
    let mut old = peer_with(&agent, &["--hold-acks-until", &arg(&old_gate)?])?;
    enroll_enabled(&agent, &f)?;
    wait::until("the pod Served", wait::DEADLINE, || match state(&f) {
        Some("Served") => Ok(()),
        other => Err(other),
    })?;
    agent.kill()?;
    std::fs::remove_file(&old_gate)?;
    agent.restart()?;
    // The agent's ack deadline (5 s) runs from here: the rest is quick.
    let listening = |p: &PeerProc, n: usize, what: &str| {
        p.wait_for(what, |e| {
            e.iter().filter(|e| e["event"] == "listening").count() >= n
        })
    };
    listening(&old, 2, "the old ztunnel to get the snapshot's add")?;
    let new = PeerProc::start(
        Path::new(PEER),
        &agent.zds,
        &["--hold-acks-until", &arg(&new_gate)?],
    )?;
    let acks = || sluice_tests::agent::metric_sum(port, "sluice_zds_answers_total{answer=\"ack\"}");
    if together {
        listening(&new, 1, "the new ztunnel to get the snapshot's add")?;
        std::fs::write(&new_gate, "")?;
        std::fs::write(&old_gate, "")?;
        wait::until("both acks taken", wait::DEADLINE, || match acks() {
            Ok(n) if n >= 2 => Ok(()),
            other => Err(format!("{other:?}")),
        })?;
    } else {
        std::fs::write(&new_gate, "")?;
        wait_owns_pod(&agent, &new)?;
        std::fs::write(&old_gate, "")?;
        let older = "sluice_zds_older_acks_total";
        wait::until(
            "the old ztunnel's ack seen as older",
            wait::DEADLINE,
            || match sluice_tests::agent::metric_sum(port, older) {
                Ok(n) if n >= 1 => Ok(()),
                other => Err(format!("{other:?}")),
            },
        )?;
    }
    let owners = |a: &AgentProc| -> anyhow::Result<Vec<(u64, u64)>> {
        let n = a.node_status()?;
        Ok(n["ztunnels"]
            .as_array()
            .context("ztunnels")?
            .iter()
            .map(|z| {
                (
                    z["pid"].as_u64().unwrap_or(0),
                    z["pods"].as_u64().unwrap_or(0),
                )
            })
            .collect())
    };
    let (old_pid, new_pid) = (
        u64::from(old.pid().context("pid")?),
        u64::from(new.pid().context("pid")?),
    );
    // With both acks taken, the new ztunnel owns the pod. (Were the old
    // one's registration still to come and to take the pod back, its drain
    // below would take the pod out of Served, which is checked.)
    wait::until("the new ztunnel owning the pod", wait::DEADLINE, || {
        let seen = owners(&agent).map_err(|e| e.to_string())?;
        match seen.contains(&(new_pid, 1)) && !seen.contains(&(old_pid, 1)) {
            true => Ok(()),
            false => Err(format!("{seen:?} (old {old_pid}, new {new_pid})")),
        }
    })?;
    old.terminate();
    wait::until("the old ztunnel gone", wait::DEADLINE, || {
        let seen = owners(&agent).map_err(|e| e.to_string())?;
        match seen.iter().any(|(p, _)| *p == old_pid) {
            false => Ok(()),
            true => Err(format!("{seen:?}")),
        }
    })?;
    let (_, text) = http_get(port, "/metrics")?;
    let left_served: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("sluice_pod_transitions_total{from=\"Served\""))
        .filter(|l| !l.ends_with(" 0"))
        .collect();
    ensure!(
        left_served.is_empty() && state(&f) == Some("Served"),
        "the pod left Served: {left_served:?}, now {:?}\n{}",
        state(&f),
        agent.log()
    );
    ensure!(owners(&agent)?.contains(&(new_pid, 1)));
    Ok(())
}

/// A ztunnel that dies between the agent's add and its answer: the pod is
/// not left "in flight" with the dead connection. It stays Pending (fail
/// closed) and the next ztunnel's snapshot takes it to steering, with its
/// listeners owned by that ztunnel.
fn gone_mid_add() -> TestResult {
    let f = Fixture::new("gma", None)?;
    let agent = AgentProc::start(&f.topo.pins)?;
    let never = agent.dir.join("never");
    let never_arg = never.to_str().context("path")?.to_owned();
    let mut first = peer_with(&agent, &["--hold-acks-until", &never_arg])?;
    let enrolling = {
        let (netns, uid) = (f.topo.pod_netns_path(), f.uid.as_str().to_owned());
        let (bin, root, control) = (
            sluice_tests::harness::sluice_bin(),
            agent.root.clone(),
            agent.control.clone(),
        );
        std::thread::spawn(move || {
            std::process::Command::new(bin)
                .arg("--bpf-root")
                .arg(root)
                .arg("--control-socket")
                .arg(control)
                .args(["enroll", "--netns", netns.to_str().unwrap(), "--uid", &uid])
                .output_bounded()
        })
    };
    first.wait_for("the first ztunnel to get the add", |e| {
        e.iter().any(|e| e["event"] == "listening")
    })?;
    first.kill();
    let out = enrolling
        .join()
        .map_err(|_| anyhow::anyhow!("enroll thread panicked"))??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        stdout.contains("Pending"),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(state(&f) == Some("Pending"), "{:?}", state(&f));
    let second = peer(&agent)?;
    wait_owns_pod(&agent, &second)?;
    wait::until(
        "the pod steering through the second ztunnel",
        wait::DEADLINE,
        || match state(&f) {
            Some("Enabled" | "Served") => Ok(()),
            other => Err(other),
        },
    )?;
    ensure!(
        inbound(&f).reply().is_some(),
        "not captured after the second ztunnel"
    );
    second.wait_for("the second ztunnel to take the connection", |_| {
        second.accepted_roles(&["inbound"])
    })?;
    Ok(())
}

fn wait_owns_pod(agent: &AgentProc, z: &PeerProc) -> TestResult {
    let pid = z.pid().context("no pid")?;
    agent.wait_ztunnel(pid, "the new ztunnel to own the pod's listeners", |z| {
        z["pods"] == 1
    })
}

/// With the old ztunnel gone: the new one takes connections, and no client
/// connection failed at any point.
fn finish_upgrade(
    name: &str,
    f: &Fixture,
    agent: &AgentProc,
    clients: Clients,
    old: &PeerProc,
    new: &PeerProc,
) -> TestResult {
    let before = inbound_accepts(new);
    new.wait_for(
        "the new ztunnel to take connections after the old one left",
        |_| inbound_accepts(new) >= before + 20,
    )?;
    let (ok, failures) = clients.finish();
    println!(
        "{name}: {ok} connections completed, {} failed {failures:?}; old accepted {}, new accepted {}",
        failures.len(),
        inbound_accepts(old),
        inbound_accepts(new)
    );
    ensure!(
        failures.is_empty(),
        "{} connections failed during the upgrade: {failures:?}\n{}",
        failures.len(),
        agent.log()
    );
    ensure!(state(f) == Some("Served"));
    Ok(())
}

/// After the old peer exited: the agent's view of it, which must still own
/// the pod's listeners (held by the agent) but no longer be connected.
fn old_pid_gone(agent: &AgentProc) -> anyhow::Result<u32> {
    wait::until(
        "the old ztunnel to be disconnected, its listeners still held",
        wait::DEADLINE,
        || {
            let n = agent.node_status().map_err(|e| e.to_string())?;
            let zs = n["ztunnels"].as_array().cloned().unwrap_or_default();
            zs.iter()
                .find(|z| z["connected"] == false && z["pods"] == 1)
                .and_then(|z| z["pid"].as_u64())
                .map(|p| p as u32)
                .ok_or_else(|| n["ztunnels"].to_string())
        },
    )
}

fn hijack() -> TestResult {
    let f = Fixture::new("hj", None)?;
    // The dead ztunnel's listeners are closed at once (held by default, and
    // then nothing else can bind their ports).
    let agent = AgentProc::start_with(&f.topo.pins, &["--orphan-grace", "0s"])?;
    let mut p = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    p.kill();
    f.wait_state("Pending")?;
    // An app in the pod binds ztunnel's inbound port (Istio #49078).
    let squatter = App::start(&f.topo.pod, 15006);
    let r = tcp(
        &f.topo.client,
        SocketAddr::new(f.topo.pod_ip(Family::V4), APP_PORT),
        Opts {
            timeout: Some(Duration::from_millis(1500)),
            ..Opts::default()
        },
    );
    ensure!(r == Reached::TimedOut, "{r:?}");
    ensure!(
        squatter.peers().is_empty(),
        "captured traffic reached the squatter"
    );
    ensure!(f.app.peers().is_empty());
    // Looking for listeners again finds none: only a mark-1337 socket would do.
    let again = f.register()?;
    ensure!(
        again.state == sluice_common::PodState::Pending && again.roles.is_empty(),
        "{again:?}"
    );
    Ok(())
}

fn raw_client(zds: &Path) -> anyhow::Result<OwnedFd> {
    let fd = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    connect(fd.as_raw_fd(), &UnixAddr::new(zds)?)?;
    Ok(fd)
}

/// Whether the agent closed this connection within a second.
fn closed_by_agent(fd: &OwnedFd) -> bool {
    let tv = nix::sys::time::TimeVal::new(1, 0);
    let _ = nix::sys::socket::setsockopt(fd, nix::sys::socket::sockopt::ReceiveTimeout, &tv);
    matches!(wire::recv(fd.as_fd(), 1024), Err(wire::WireError::Closed))
}

fn bad_peers() -> TestResult {
    let f = Fixture::new("bp", None)?;
    let agent = AgentProc::start(&f.topo.pins)?;
    let hello = proto::encode(&proto::ZdsHello {
        version: proto::Version::V1 as i32,
    });
    // Garbage, oversize, an fd where none belongs: each connection is
    // closed by the agent.
    type Send = Box<dyn Fn(&OwnedFd) -> anyhow::Result<()>>;
    let cases: Vec<(&str, Send)> = vec![
        (
            "garbage datagram",
            Box::new(|fd| Ok(wire::send(fd.as_fd(), &[0xff, 0xff, 0xff, 0x01], None)?)),
        ),
        (
            "oversize datagram",
            Box::new(|fd| Ok(wire::send(fd.as_fd(), &vec![0x08; 4096], None)?)),
        ),
        (
            "hello with an fd",
            Box::new(move |fd| {
                let extra = std::fs::File::open("/dev/null")?;
                Ok(wire::send(fd.as_fd(), &hello, Some(extra.as_fd()))?)
            }),
        ),
    ];
    for (name, send) in &cases {
        let fd = raw_client(&agent.zds)?;
        send(&fd)?;
        ensure!(
            closed_by_agent(&fd),
            "{name}: the agent kept the connection"
        );
    }
    // And then a ztunnel is served as if nothing happened, one that says
    // another ZDS version too: it is served as version 1, as istio-cni
    // does (closed at its hello, ztunnel would reconnect at once, again
    // and again).
    let _p = peer_with(&agent, &["--hello-version", "2"])?;
    let out = enroll(&agent, &f)?;
    ensure!(
        out.ok && steering(&out.stdout),
        "{} {}\n{}",
        out.stdout,
        out.stderr,
        agent.log()
    );
    ensure!(inbound(&f).reply().is_some());
    Ok(())
}

fn stubborn_peers() -> TestResult {
    let f = Fixture::new("st", None)?;
    let agent = AgentProc::start(&f.topo.pins)?;
    // Never acks: the add times out (5 s), the pod stays Pending, fails closed.
    let mut silent = PeerProc::start(Path::new(PEER), &agent.zds, &["--no-ack"])?;
    silent.wait_snapshot()?;
    let out = enroll(&agent, &f)?;
    ensure!(
        out.ok && out.stdout.contains("Pending") && out.stdout.contains("timed out"),
        "{}{}",
        out.stdout,
        out.stderr
    );
    ensure!(state(&f) == Some("Pending"));
    silent.kill();
    // Nacks forever: Pending, the nack text reported, retried with backoff.
    let mut nacker = PeerProc::start(
        Path::new(PEER),
        &agent.zds,
        &["--nack", "no workload config for this pod"],
    )?;
    nacker.wait_for("three adds (retries with backoff)", |e| {
        e.iter().filter(|e| e["event"] == "add").count() >= 3
    })?;
    ensure!(state(&f) == Some("Pending"));
    // The nack's text is what the agent reports for the pod.
    let n = agent.node_status()?;
    ensure!(
        n["waiting"]
            .as_array()
            .is_some_and(|w| w.iter().any(|w| w["uid"] == f.uid.as_str()
                && w["last_error"]
                    .as_str()
                    .is_some_and(|e| e.contains("no workload config for this pod")))),
        "nack text not reported: {n}"
    );
    let r = tcp(
        &f.topo.client,
        SocketAddr::new(f.topo.pod_ip(Family::V4), APP_PORT),
        Opts {
            timeout: Some(Duration::from_millis(1200)),
            ..Opts::default()
        },
    );
    ensure!(
        r == Reached::TimedOut && f.app.peers().is_empty(),
        "Pending pod let traffic through: {r:?}"
    );
    nacker.kill();
    // A ztunnel that works takes the pod from its snapshot.
    let _good = peer(&agent)?;
    f.wait_state("Served")?;
    Ok(())
}

fn sigterm() -> TestResult {
    let f = Fixture::new("tm", None)?;
    let mut agent = AgentProc::start(&f.topo.pins)?;
    let p = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    ensure!(agent.terminate(), "agent did not exit cleanly on SIGTERM");
    // Capture stays: pins, state, traffic through ztunnel.
    ensure!(state(&f) == Some("Served"));
    let before = inbound_accepts(&p);
    ensure!(inbound(&f).reply().is_some());
    p.wait_for("the connection accepted by the peer", |_| {
        inbound_accepts(&p) == before + 1
    })?;
    // A new agent adopts the pins; ztunnel reconnects and gets a snapshot.
    agent.restart()?;
    p.wait_for("a second snapshot", |e| {
        e.iter().filter(|e| e["event"] == "snapshot_sent").count() >= 2
    })?;
    f.wait_state("Served")?;
    ensure!(p.count("protocol_error") == 0);
    Ok(())
}

/// The agent killed outright (no SIGTERM handling) and started again, while
/// connections flow both ways: capture lives in the kernel, ztunnel keeps its
/// listeners and reconnects, and no connection fails.
fn sigkill_restart() -> TestResult {
    let f = Fixture::new("sk", None)?;
    let mut agent = AgentProc::start(&f.topo.pins)?;
    let p = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    let clients = Clients::start(&f);
    clients.wait_more(20, "before the kill")?;
    agent.kill()?;
    clients.wait_more(20, "with no agent running")?;
    agent.restart()?;
    p.wait_for("a second snapshot (ztunnel reconnected)", |e| {
        e.iter().filter(|e| e["event"] == "snapshot_sent").count() >= 2
    })?;
    f.wait_state("Served")?;
    clients.wait_more(20, "after the restart")?;
    clients.finish_without_failures("agent SIGKILL and restart", &agent)?;
    Ok(())
}

/// Another tool's `ingress` qdisc takes the pod interface's hook while no
/// agent runs (the clsact it replaced took sluice's filters with it): the
/// starting agent's repair cannot attach them again. The agent says so:
/// status lists the pod as incomplete with the links it lacks, the gauge
/// counts it, and the other tool's qdisc stays. With that qdisc gone, the
/// next repair (the next start) completes the capture and the pod is
/// listed no more.
fn incomplete_capture() -> TestResult {
    let f = Fixture::new("ic", None)?;
    let port = free_port()?;
    let metrics = format!("127.0.0.1:{port}");
    let mut agent = AgentProc::start_with(&f.topo.pins, &["--metrics-addr", &metrics])?;
    let _p = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    let uid = f.uid.as_str().to_owned();
    let tc = |args: &[&str]| {
        let mut cmd = vec!["tc", "qdisc"];
        cmd.extend(args);
        sluice_tests::ns::exec(&f.topo.pod, &cmd)
    };
    agent.kill()?;
    tc(&["del", "dev", "eth0", "clsact"])?;
    tc(&["add", "dev", "eth0", "ingress"])?;
    agent.restart()?;
    let listed = |n: &serde_json::Value| -> Option<Vec<String>> {
        let i = n["incomplete"]
            .as_array()?
            .iter()
            .find(|i| i["uid"] == uid)?;
        serde_json::from_value(i["missing"].clone()).ok()
    };
    let missing = wait::until("the pod listed as incomplete", wait::DEADLINE, || {
        let n = agent.node_status().map_err(|e| e.to_string())?;
        listed(&n).ok_or(n.to_string())
    })?;
    ensure!(
        missing == ["egress_eth0", "ingress_eth0"],
        "lacks {missing:?}, want egress_eth0 and ingress_eth0"
    );
    // The node captures: its condition stays True and names the pod.
    wait::until("the node condition naming the pod", wait::DEADLINE, || {
        let n = agent.node_status().map_err(|e| e.to_string())?;
        let c = &n["condition"];
        (c["ready"] == true && c["reason"] == "PodsCaptureIncomplete")
            .then_some(())
            .ok_or(c.to_string())
    })?;
    let text = agent.sluice(&["status"])?.stdout;
    ensure!(
        text.contains(&format!(
            "incomplete: {uid}: capture incomplete, lacks egress_eth0"
        )) && text.contains("holds a qdisc other than clsact"),
        "status does not say what the pod lacks and why:\n{text}"
    );
    let (_, scraped) = http_get(port, "/metrics")?;
    ensure!(
        scraped
            .lines()
            .any(|l| l == "sluice_pods_capture_incomplete 1"),
        "the gauge does not count the pod:\n{scraped}"
    );
    let qdiscs = sluice_tests::ns::output(&f.topo.pod, &["tc", "qdisc", "show", "dev", "eth0"])?;
    ensure!(
        qdiscs.contains("qdisc ingress ffff:"),
        "the other tool's qdisc is gone: {qdiscs}"
    );

    agent.kill()?;
    tc(&["del", "dev", "eth0", "ingress"])?;
    agent.restart()?;
    wait::until(
        "the next start's repair attaching eth0's filters",
        wait::DEADLINE,
        || {
            let mut seen = Vec::new();
            for hook in ["egress", "ingress"] {
                seen.push(
                    sluice_tests::inspect::filter_programs(&f.topo.pod, "eth0", hook)
                        .map_err(|e| e.to_string())?,
                );
            }
            seen.iter()
                .all(|f| !f.is_empty())
                .then_some(())
                .ok_or(format!("{seen:?}"))
        },
    )?;
    let n = agent.node_status()?;
    ensure!(listed(&n).is_none(), "still listed as incomplete: {n}");
    Ok(())
}

/// `sluice uninstall` with an agent running, while connections flow both
/// ways: sluice-cni's owned conflist goes (the primary's, never written, is
/// byte for byte as it was) and the plugin leaves the bin
/// dir, every pod's capture and every pin goes, no connection fails (the pod
/// is never blackholed: it keeps working, uncaptured), and the agent stays up
/// answering `uninstalled` without installing anything again.
fn uninstall() -> TestResult {
    let f = Fixture::new("ui", None)?;
    let dir = std::path::PathBuf::from(format!("/tmp/sluice-uninstall-{}", std::process::id()));
    let (conf_dir, bin_dir) = (dir.join("net.d"), dir.join("bin"));
    std::fs::create_dir_all(&conf_dir)?;
    let _cleanup = RemoveDir(dir.clone());
    let primary = conf_dir.join("10-ptp.conflist");
    let original = r#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"ptp","ipam":{"type":"host-local","subnet":"10.99.0.0/24"}}]}"#;
    std::fs::write(&primary, original)?;
    let port = free_port()?;
    let metrics = format!("127.0.0.1:{port}");
    let cni_flags = [
        "--cni-conf-dir",
        conf_dir.to_str().context("path")?,
        "--cni-bin-dir",
        bin_dir.to_str().context("path")?,
    ];
    let mut flags = vec!["--install-cni", "--metrics-addr", &metrics];
    flags.extend(cni_flags);
    let mut agent = AgentProc::start_with(&f.topo.pins, &flags)?;
    let owned = conf_dir.join("02-sluice.conflist");
    wait::until("sluice-cni installed", wait::DEADLINE, || {
        let conf = std::fs::read_to_string(&owned).unwrap_or_default();
        (conf.contains("sluice-cni") && bin_dir.join("sluice-cni").exists())
            .then_some(())
            .ok_or(conf)
    })?;
    let p = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    let clients = Clients::start(&f);
    clients.wait_more(20, "before the uninstall")?;
    let mut args = vec!["uninstall"];
    args.extend(cni_flags);
    let out = agent.sluice(&args)?;
    ensure!(out.ok, "sluice uninstall: {}{}", out.stdout, out.stderr);
    ensure!(out.stdout.contains("via the agent"), "{}", out.stdout);
    let through_ztunnel = inbound_accepts(&p);
    clients.wait_more(20, "after the uninstall")?;
    clients.finish_without_failures("uninstall under load", &agent)?;
    // Uncaptured now: straight to the app, not through ztunnel.
    ensure!(inbound(&f).reply().is_some());
    ensure!(
        inbound_accepts(&p) == through_ztunnel,
        "connections still went through ztunnel after the uninstall"
    );
    ensure!(
        !sluice_tests::topology::has_redirect_rule(&f.topo.pod)?,
        "the pod's policy rule is still there"
    );
    // What istio-cni's agent starts from: no program left at the pod's hooks.
    for dir in ["ingress", "egress"] {
        let left = sluice_tests::inspect::filter_programs(&f.topo.pod, "eth0", dir)?;
        ensure!(left.is_empty(), "{dir} filters left on the pod: {left:?}");
    }
    // The primary's file was never written; the owned one is gone.
    let now = std::fs::read_to_string(&primary)?;
    ensure!(now == original, "the primary conflist changed: {now}");
    ensure!(!owned.exists(), "the owned conflist is left");
    ensure!(!bin_dir.join("sluice-cni").exists(), "plugin binary left");
    let left: Vec<_> = walk(f.topo.pins.root());
    ensure!(left.is_empty(), "pins left: {left:?}");
    // The agent stays, says so, refuses work and installs nothing again.
    let n = agent.node_status()?;
    ensure!(
        n["uninstall"]
            .as_str()
            .is_some_and(|u| u.starts_with("done")),
        "{n}"
    );
    ensure!(http_get(port, "/readyz")? == (200, "uninstalled\n".into()));
    let again = enroll(&agent, &f)?;
    ensure!(
        !again.ok && again.stderr.contains("being removed"),
        "{}{}",
        again.stdout,
        again.stderr
    );
    ensure!(agent.terminate(), "agent did not exit cleanly");
    ensure!(std::fs::read_to_string(&primary)? == original && !owned.exists());
    ensure!(walk(f.topo.pins.root()).is_empty());
    Ok(())
}

/// The agent runs inside a netns that plays the node (never the machine's
/// own). Its own netns — by its /run/netns name or as /proc/PID/ns/net — is
/// refused through the control socket, and by the CLI working on the pins
/// directly; nothing is attached there and the "node" keeps its traffic. A
/// real pod still enrolls through the same agent.
fn never_host() -> TestResult {
    let f = Fixture::new("hn", None)?;
    let node = f.topo.client.clone();
    let agent = AgentProc::start_wrapped(&f.topo.pins, &["ip", "netns", "exec", &node], &[])?;
    let pid = agent.pid().context("agent pid")?;
    for path in [format!("/run/netns/{node}"), format!("/proc/{pid}/ns/net")] {
        let out = agent.enroll(Path::new(&path), "pod-hn-node", "default", "node")?;
        ensure!(
            !out.ok
                && out.stderr.contains("sluice's own network namespace")
                && out.stderr.contains(&path),
            "enrolling {path} through the agent: {}{}",
            out.stdout,
            out.stderr
        );
    }
    // The CLI without an agent (another control socket), run in the node netns.
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &node])
        .arg(sluice_tests::harness::sluice_bin())
        .arg("--bpf-root")
        .arg(f.topo.pins.root())
        .arg("--control-socket")
        .arg(agent.dir.join("nobody-listens.sock"))
        .args([
            "enroll",
            "--uid",
            "pod-hn-node",
            "--netns",
            &format!("/run/netns/{node}"),
        ])
        .output_bounded()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && stderr.contains("sluice's own network namespace"),
        "the CLI enrolling its own netns: {stderr}"
    );
    ensure!(
        !sluice_tests::topology::has_redirect_rule(&node)?,
        "a policy rule appeared in the node netns"
    );
    ensure!(
        walk(&f.topo.pins.pods()).is_empty(),
        "links pinned: {:?}",
        walk(&f.topo.pins.pods())
    );
    // The node's own traffic is untouched (client → app, uncaptured).
    ensure!(inbound(&f).reply().is_some_and(|r| r.starts_with("app:")));
    let out = enroll(&agent, &f)?;
    ensure!(out.ok, "a real pod: {}{}", out.stdout, out.stderr);
    Ok(())
}

/// A pod's cgroup holds a process in the host's network namespace (as a
/// runtime shim can), started first so that it is found first: discovery
/// takes the pod's netns from the other process, never the host's.
fn discovery_skips_host() -> TestResult {
    let f = Fixture::new("dh", None)?;
    let uid = "5c1d2e3f-0000-4000-8000-00000000dh01";
    let cg = ["/sys/fs/cgroup/pids", "/sys/fs/cgroup"]
        .iter()
        .map(|r| Path::new(r).join(format!("sluice-test-pod{uid}")))
        .find(|d| std::fs::create_dir(d).is_ok() && d.join("cgroup.procs").exists())
        .context("no writable cgroup hierarchy (pids v1 or v2) to make a pod cgroup in")?;
    let mut shim = std::process::Command::new("sleep").arg("60").spawn()?;
    let mut app = std::process::Command::new("ip")
        .args(["netns", "exec", &f.topo.pod, "sleep", "60"])
        .spawn()?;
    let result = (|| -> TestResult {
        // `ip netns exec` enters the pod netns before it execs sleep: wait
        // until it has, or discovery would rightly skip it as a host process.
        use std::os::unix::fs::MetadataExt as _;
        let ino = |p: &Path| std::fs::metadata(p).map(|m| m.ino()).ok();
        let pod_ns = ino(&f.topo.pod_netns_path());
        let app_ns = std::path::PathBuf::from(format!("/proc/{}/ns/net", app.id()));
        wait::until("the app process in the pod netns", wait::DEADLINE, || {
            let now = ino(&app_ns);
            if now.is_some() && now == pod_ns {
                Ok(())
            } else {
                Err(now)
            }
        })?;
        for p in [shim.id(), app.id()] {
            std::fs::write(cg.join("cgroup.procs"), p.to_string())?;
        }
        let ips = [f.topo.pod_ip(Family::V4)];
        let found = sluice::podnet::podns::find(uid, &ips).context("no netns found")?;
        let want = f.topo.pod_netns_path();
        ensure!(
            found == want,
            "found {}, want {}",
            found.display(),
            want.display()
        );
        Ok(())
    })();
    let _ = shim.kill();
    let _ = app.kill();
    let _ = shim.wait();
    let _ = app.wait();
    let _ = std::fs::remove_dir(&cg);
    result
}

/// Files under `dir` (bpffs pins), recursively.
pub(crate) fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

struct RemoveDir(std::path::PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// "Another build" whose maps have another size (`layout-variant`: twice the
/// pods per node), built by `cargo xtask test`.
const LAYOUT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../target/ebpf-layout/bpfel-unknown-none/release/sluice-ebpf"
);

fn max_entries(f: &Fixture, map: &str) -> anyhow::Result<u32> {
    Ok(aya::maps::MapInfo::from_pin(f.topo.pins.maps().join(map))?.max_entries())
}

/// How long an agent may take to reach a crash point (its whole start-up).
const CRASH_WITHIN: Duration = Duration::from_secs(60);

/// Runs an agent over the pins that kills itself at crash point `step`.
fn crash_agent_at(agent: &AgentProc, f: &Fixture, step: &str, object: Option<&str>) -> TestResult {
    use std::os::unix::process::ExitStatusExt as _;
    let mut cmd = std::process::Command::new(sluice_tests::harness::sluice_bin());
    cmd.arg("--bpf-root")
        .arg(f.topo.pins.root())
        .arg("--control-socket")
        .arg(agent.dir.join("crashing.sock"))
        .arg("agent")
        .arg("--zds-socket")
        .arg(agent.dir.join("crashing-zds.sock"))
        .args(["--metrics-addr", "off", "--health-addr", "off"])
        .env("SLUICE_CRASH_AT", step)
        .envs(sluice_tests::harness::as_if_kernel_env())
        .stderr(std::process::Stdio::null());
    if let Some(o) = object {
        cmd.env("SLUICE_EBPF_OBJECT_FILE", o);
    }
    // An agent that never reaches the crash point (an object without it, a
    // changed start-up) would otherwise run forever.
    let st = cmd
        .status_within(CRASH_WITHIN)
        .with_context(|| format!("the agent never reached crash point {step}"))?;
    ensure!(st.signal() == Some(libc::SIGKILL), "{step}: {st}");
    Ok(())
}

/// A rollout to a build whose maps are sized differently, then back, while
/// connections flow both ways: each new agent creates its maps beside the
/// pinned ones, copies the state, re-registers ztunnel's listeners, points
/// every link at its programs and replaces the pins — and on the way back two
/// agents are killed midway first. No connection fails; the pod stays Served.
fn another_layout() -> TestResult {
    let f = Fixture::new("ml", None)?;
    let mut agent = AgentProc::start(&f.topo.pins)?;
    // With ztunnel's DNS proxy too: its sockets are in a socket map, which
    // a migration cannot copy (the kernel reads none back to user space).
    let resolver = format!("{}:53", Family::V4.client());
    let _p = peer_with(&agent, &["--dns-forward", &resolver])?;
    enroll_enabled(&agent, &f)?;
    let dns_mode = |a: &AgentProc| -> Option<String> {
        a.status_json().ok()?["pods"][0]["dns"]["mode"]
            .as_str()
            .map(str::to_owned)
    };
    ensure!(
        dns_mode(&agent).as_deref() == Some("captured"),
        "{:?}",
        dns_mode(&agent)
    );
    let ours = max_entries(&f, "pod_state")?;
    let stamp_before = sluice::dataplane::stamp::read(&f.topo.pins.maps()).context("no stamp")?;
    let clients = Clients::start(&f);
    clients.wait_more(20, "before the migration")?;
    for (step, object, want) in [
        ("migration", Some(LAYOUT), ours * 2),
        ("migration back", None, ours),
    ] {
        ensure!(
            agent.terminate(),
            "{step}: the old agent did not exit cleanly"
        );
        if object.is_none() {
            for crash in ["migrate_filled", "migrate_map_pin"] {
                crash_agent_at(&agent, &f, crash, object)?;
                clients.wait_more(5, crash)?;
            }
        }
        agent.set_env("SLUICE_EBPF_OBJECT_FILE", object);
        agent.restart()?;
        for (map, per_pod) in [
            ("pod_state", 1),
            ("pod_meta", 1),
            ("counters", 1),
            ("pod_addrs", 8),
        ] {
            let n = max_entries(&f, map)?;
            ensure!(
                n == want * per_pod,
                "{step}: {map} holds {n} entries at most, want {}",
                want * per_pod
            );
        }
        ensure!(
            max_entries(&f, "listeners")? == want * 6,
            "{step}: listeners not migrated"
        );
        let shown = agent.node_status()?["dataplane"].to_string();
        ensure!(shown.contains("migrated at start"), "{step}: {shown}");
        ensure!(
            dns_mode(&agent).as_deref() == Some("captured"),
            "{step}: DNS {:?}",
            dns_mode(&agent)
        );
        // `sluice status` names the build that pinned the dataplane.
        let built = match object {
            Some(o) => sluice::dataplane::stamp::version_of(&std::fs::read(o)?),
            None => {
                sluice::dataplane::stamp::version_of(sluice::dataplane::loader::embedded_object())
            }
        };
        let out = agent.sluice(&["status", "-o", "json"])?;
        let status: serde_json::Value = serde_json::from_str(&out.stdout)?;
        ensure!(
            status["node"]["stamp"]
                .as_str()
                .is_some_and(|s| s.contains(&built)),
            "{step}: stamp {} is not build {built}",
            status["node"]["stamp"]
        );
        let rec = f.pod_record()?;
        ensure!(
            rec.state == Some(PodState::Served) && rec.listeners.len() >= 3,
            "{step}: {rec:?}"
        );
        links_follow_pins(&f)?;
        ensure!(
            !f.topo.pins.root().join("maps_next").exists(),
            "{step}: maps_next left behind"
        );
        clients.wait_more(20, step)?;
    }
    let stamp_after = sluice::dataplane::stamp::read(&f.topo.pins.maps()).context("no stamp")?;
    ensure!(
        stamp_after == stamp_before,
        "{stamp_before} → {stamp_after}"
    );
    clients.finish_without_failures("map-layout migration and back", &agent)?;
    Ok(())
}

/// Pins a fresh hash map (8-byte keys, 16-byte values) at `path`: a map of
/// a shape no build of sluice has, made with raw bpf(2).
fn pin_foreign_map(path: &Path) -> TestResult {
    use std::os::fd::{FromRawFd as _, OwnedFd};
    // BPF_MAP_CREATE: map_type HASH, key 8, value 16, 16 entries.
    let mut attr = [0u32; 16];
    attr[..4].copy_from_slice(&[1, 8, 16, 16]);
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            0,
            attr.as_mut_ptr(),
            std::mem::size_of_val(&attr),
        )
    };
    ensure!(
        fd >= 0,
        "BPF_MAP_CREATE: {}",
        std::io::Error::last_os_error()
    );
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // BPF_OBJ_PIN: pathname, bpf_fd.
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
    let mut pin = [c.as_ptr() as u64, fd.as_raw_fd() as u64];
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            6,
            pin.as_mut_ptr(),
            std::mem::size_of_val(&pin),
        )
    };
    ensure!(r == 0, "BPF_OBJ_PIN: {}", std::io::Error::last_os_error());
    Ok(())
}

/// A node whose pins hold a map this build cannot open or migrate (another
/// value size): the agent does not exit into a restart loop and leaves the
/// pinned capture alone; it says why on /readyz (and in the node condition)
/// while /healthz stays 200, and connections keep being captured.
fn incompatible_maps() -> TestResult {
    let f = Fixture::new("im", None)?;
    let port = free_port()?;
    let metrics = format!("127.0.0.1:{port}");
    let mut agent = AgentProc::start_with(&f.topo.pins, &["--metrics-addr", &metrics])?;
    let p = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    ensure!(agent.terminate());
    let meta = f.topo.pins.maps().join("pod_meta");
    std::fs::remove_file(&meta)?;
    pin_foreign_map(&meta)?;
    agent.restart_reporting_only()?;
    let (code, body) = wait::until("/readyz to say why", wait::DEADLINE, || {
        match http_get(port, "/readyz") {
            Ok((503, b)) if b.contains("DataplaneIncompatible") => Ok((503, b)),
            other => Err(format!("{other:?}")),
        }
    })?;
    println!("/readyz {code}: {}", body.trim());
    ensure!(http_get(port, "/healthz")?.0 == 200, "healthz");
    ensure!(agent.pid().is_some(), "the agent exited:\n{}", agent.log());
    // The pinned build's capture is untouched: still through ztunnel.
    let before = inbound_accepts(&p);
    ensure!(inbound(&f).reply().is_some());
    p.wait_for("the connection accepted by ztunnel", |_| {
        inbound_accepts(&p) == before + 1
    })?;
    ensure!(
        agent.log().contains("pod_meta: value size 16 → 828"),
        "the log does not name the map:\n{}",
        agent.log()
    );
    Ok(())
}

/// Another node agent (istio-cni's) already serves ztunnel on the ZDS socket:
/// the agent neither takes the socket nor starts; it says why on /readyz
/// (and in the node condition), and starts once the other is gone.
fn another_node_agent() -> TestResult {
    let f = Fixture::new("ra", None)?;
    let port = free_port()?;
    let metrics = format!("127.0.0.1:{port}");
    let mut agent = AgentProc::start_with(&f.topo.pins, &["--metrics-addr", &metrics])?;
    ensure!(
        agent.terminate(),
        "the agent did not exit cleanly on SIGTERM:\n{}",
        agent.log()
    );
    // The other agent: a listener on the socket path (this test process).
    let _ = std::fs::remove_file(&agent.zds);
    let other = std::os::unix::net::UnixListener::bind(&agent.zds)?;
    agent.restart_reporting_only()?;
    let (_, body) = wait::until(
        "/readyz to name the other agent",
        wait::DEADLINE,
        || match http_get(port, "/readyz") {
            Ok((503, b)) if b.contains("AnotherNodeAgent") => Ok((503, b)),
            other => Err(format!("{other:?}")),
        },
    )?;
    println!("/readyz: {}", body.trim());
    let me = format!("pid {}", std::process::id());
    ensure!(
        agent.log().contains(&me),
        "the log does not name {me}:\n{}",
        agent.log()
    );
    ensure!(agent.pid().is_some(), "the agent exited:\n{}", agent.log());
    ensure!(
        !agent.control.exists(),
        "the agent started beside the other one"
    );
    // The other goes: the agent starts and serves ztunnel itself.
    drop(other);
    wait::until("the agent to start", wait::DEADLINE, || {
        match (agent.control.exists(), http_get(port, "/readyz")) {
            (true, Ok((_, b))) if !b.contains("AnotherNodeAgent") => Ok(()),
            seen => Err(format!("{seen:?}")),
        }
    })?;
    let p = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    drop(p);
    Ok(())
}

/// Every link of the pod runs the pinned program of its role; returns the
/// link → program id map.
fn links_follow_pins(f: &Fixture) -> anyhow::Result<std::collections::BTreeMap<String, u32>> {
    let pinned = sluice_tests::inspect::pinned_programs(&f.topo.pins)?;
    let links = link_programs(f)?;
    for (link, id) in &links {
        let prog = match link.as_str() {
            "steer" => sluice::dataplane::loader::Program::Steer.name(),
            "lo" => sluice::dataplane::loader::Program::Lo.name(),
            l if l.starts_with("egress_") => sluice::dataplane::loader::Program::Egress.name(),
            _ => sluice::dataplane::loader::Program::Ingress.name(),
        };
        ensure!(
            *id == pinned[prog].0,
            "link {link} runs program {id}, the pinned {prog} is {}",
            pinned[prog].0
        );
    }
    Ok(links)
}

/// A DaemonSet rollout to a build whose programs differ (every one of the
/// four), then back (a downgrade), while connections flow both ways: each
/// new agent points every pod link at its own programs in place before it
/// serves; no connection fails.
fn another_build() -> TestResult {
    let f = Fixture::new("ab", None)?;
    let mut agent = AgentProc::start(&f.topo.pins)?;
    let _p = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    let ours = sluice_tests::inspect::pinned_programs(&f.topo.pins)?;
    let clients = Clients::start(&f);
    clients.wait_more(20, "before the upgrade")?;
    let mut seen = vec![links_follow_pins(&f)?];
    for (step, object) in [("upgrade", Some(VARIANT)), ("downgrade", None)] {
        ensure!(
            agent.terminate(),
            "{step}: the old agent did not exit cleanly"
        );
        agent.set_env("SLUICE_EBPF_OBJECT_FILE", object);
        agent.restart()?;
        let now = sluice_tests::inspect::pinned_programs(&f.topo.pins)?;
        for (name, (id, tag)) in &now {
            let (_, our_tag) = ours[name];
            // Upgraded: the variant's tag; downgraded: this build's again.
            ensure!(
                (*tag == our_tag) == object.is_none(),
                "{step}: {name} has tag {tag:x} (this build's: {our_tag:x})"
            );
            ensure!(
                seen.iter().all(|links| !links.values().any(|l| l == id)),
                "{step}: {name} is not a new program"
            );
        }
        let links = links_follow_pins(&f)?;
        let shown = agent.node_status()?["dataplane"].to_string();
        ensure!(
            shown.contains("upgraded in place at start")
                && shown.contains(&format!("{} pod links switched", links.len())),
            "{step}: {shown}"
        );
        seen.push(links);
        clients.wait_more(20, step)?;
    }
    clients.finish_without_failures("upgrade to another build and back", &agent)?;
    Ok(())
}

/// Pod b's interface goes while no agent runs (its pod deleted: CNI DEL
/// succeeds without the agent), which detaches its tcx links. The next
/// agent, of another build, must still point every other pod's links at
/// its programs and serve: a detached link has nothing to switch. (The
/// first one stopped the upgrade, ENOLINK, with pods on either build.)
fn upgrade_over_a_gone_pod() -> TestResult {
    let a = Fixture::new("uga", None)?;
    let b = Fixture::in_subnet("ugb", None, 1)?;
    let mut agent = AgentProc::start(&a.topo.pins)?;
    let _p = peer(&agent)?;
    enroll_enabled(&agent, &a)?;
    enroll_enabled(&agent, &b)?;
    ensure!(agent.terminate(), "the agent did not exit cleanly");
    sluice_tests::topology::ip(&["-n", &b.topo.pod, "link", "del", "eth0"])?;
    agent.set_env("SLUICE_EBPF_OBJECT_FILE", Some(VARIANT));
    agent.restart()?;
    let shown = agent.node_status()?["dataplane"].to_string();
    ensure!(
        shown.contains("upgraded in place at start"),
        "{shown}\n{}",
        agent.log()
    );
    links_follow_pins(&a)?;
    ensure!(
        inbound(&a).reply().is_some(),
        "pod a after the upgrade\n{}",
        agent.log()
    );
    Ok(())
}

/// The program id each of the pod's pinned links runs, by link pin name: a
/// link's own, or (kernels without tcx) the one the kernel's filter for a
/// record runs.
fn link_programs(f: &Fixture) -> anyhow::Result<std::collections::BTreeMap<String, u32>> {
    let dir = f.topo.pins.pod(f.pod_record()?.netns_cookie);
    let mut out = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(dir)? {
        let path = e?.path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let id = match sluice::dataplane::tcfilter::pinned(&path) {
            Some(sluice::dataplane::tcfilter::Pinned::Program(recorded)) => {
                let (iface, dir) = match name.split_once('_') {
                    Some(("egress", i)) => (i, "egress"),
                    Some((_, i)) => (i, "ingress"),
                    None => ("lo", "ingress"),
                };
                let runs = sluice_tests::inspect::filter_program(&f.topo.pod, iface, dir)?;
                ensure!(
                    recorded == runs,
                    "the record {name} holds program {recorded}, its filter runs {runs}"
                );
                runs
            }
            _ => aya::programs::links::FdLink::from(aya::programs::links::PinnedLink::from_pin(
                &path,
            )?)
            .info()?
            .program_id(),
        };
        out.insert(name, id);
    }
    Ok(out)
}

/// An agent that starts over programs of another build (here: the egress
/// and ingress pins swapped, so both tags differ from its own) points every
/// pod link at its own programs in place, swaps the pins, and no connection
/// fails meanwhile.
fn programs_replaced() -> TestResult {
    use sluice::dataplane::loader::Program;
    const PROG_EGRESS: &str = Program::Egress.name();
    const PROG_INGRESS: &str = Program::Ingress.name();
    let f = Fixture::new("pr", None)?;
    let mut agent = AgentProc::start(&f.topo.pins)?;
    let _p = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    let own = sluice_tests::inspect::pinned_programs(&f.topo.pins)?;
    let clients = Clients::start(&f);
    clients.wait_more(20, "before the restart")?;
    ensure!(agent.terminate(), "agent did not exit cleanly");
    let progs = f.topo.pins.progs();
    std::fs::rename(progs.join(PROG_EGRESS), progs.join("swap"))?;
    std::fs::rename(progs.join(PROG_INGRESS), progs.join(PROG_EGRESS))?;
    std::fs::rename(progs.join("swap"), progs.join(PROG_INGRESS))?;
    let links_before = link_programs(&f)?;
    // Two agents killed midway through the replacement, before they serve
    // (after the first link switched; after the first new program pin,
    // before its rename): capture holds, and the agent below finishes.
    for step in ["upgrade_link", "upgrade_pin_next"] {
        crash_agent_at(&agent, &f, step, None)?;
        ensure!(
            f.topo.pins.progs().join(PROG_EGRESS).exists()
                && f.topo.pins.progs().join(PROG_INGRESS).exists(),
            "{step}: a program pin is missing"
        );
        clients.wait_more(5, step)?;
    }
    agent.restart()?;
    // Started: the replacement ran before the agent served anything.
    let now = sluice_tests::inspect::pinned_programs(&f.topo.pins)?;
    for name in [PROG_EGRESS, PROG_INGRESS] {
        ensure!(
            now[name].1 == own[name].1,
            "{name}: pinned tag {:x}, this build's {:x}",
            now[name].1,
            own[name].1
        );
        ensure!(now[name].0 != own[name].0, "{name}: not a new program");
    }
    let links = link_programs(&f)?;
    for (link, id) in &links {
        let prog = match link.as_str() {
            "steer" => sluice::dataplane::loader::Program::Steer.name(),
            "lo" => sluice::dataplane::loader::Program::Lo.name(),
            l if l.starts_with("egress_") => PROG_EGRESS,
            _ => PROG_INGRESS,
        };
        ensure!(
            *id == now[prog].0,
            "link {link} runs program {id}, the pinned {prog} is {}",
            now[prog].0
        );
        if prog == PROG_EGRESS || prog == PROG_INGRESS {
            ensure!(*id != links_before[link], "link {link} was not updated");
        }
    }
    let n = agent.node_status()?;
    let shown = n["dataplane"].as_str().unwrap_or_default();
    ensure!(
        shown.starts_with("upgraded in place at start") && shown.contains("2 pod links switched"),
        "{n}"
    );
    clients.wait_more(20, "after the programs were replaced")?;
    clients.finish_without_failures("programs replaced", &agent)?;
    Ok(())
}

/// Another tool replaces the program of sluice's egress filter in a
/// captured pod with sluice's own ingress program, in place (`tc filter
/// replace … handle 0x51150001 bpf object-pinned …`): the pod's outbound
/// connections would go around ztunnel. The tc event has the pod repaired
/// at once, not at the next verification a minute later (the wait's
/// deadline is a third of that): the filter runs sluice's egress program
/// again, and an outbound connection reaches ztunnel's listener.
fn filter_swapped() -> TestResult {
    let f = Fixture::new("fsw", None)?;
    let agent = AgentProc::start(&f.topo.pins)?;
    let p = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    let dir = f.topo.pins.pod(f.pod_record()?.netns_cookie);
    let hook = sluice_tests::inspect::Hook {
        ns: &f.topo.pod,
        dev: "eth0",
        dir: "egress",
    };
    let ours = hook.program()?;
    let swap = || hook.tc("replace", Some(&dir.join("ingress_eth0")));
    // Right after the enrollment (the pod may not be watched yet: it is
    // verified once when it is), then again while it is watched: only the
    // tc event can put it back within the deadline.
    swap()?;
    hook.wait_program(ours).with_context(|| agent.log())?;
    swap()?;
    hook.wait_program(ours).with_context(|| agent.log())?;
    outbound_through_peer(
        &f.topo.pod,
        f.topo.client_ip(Family::V4),
        &p,
        "after the repair",
    )
}

/// The host side is watched as the pod's is: sluice's filter on the pod's
/// node-side veth, deleted or its program swapped by another tool, is put
/// back at once (the periodic verification comes only after the deadline).
fn host_filter_put_back() -> TestResult {
    let f = Fixture::new("hfp", None)?;
    let node = sluice_tests::ns::netns_path(&f.topo.client);
    let node_arg = node.to_str().context("netns path")?;
    let agent = AgentProc::start_with(&f.topo.pins, &["--node-netns", node_arg])?;
    let _p = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    let dir = f.topo.pins.pod(f.pod_record()?.netns_cookie);
    let hook = sluice_tests::inspect::Hook {
        ns: &f.topo.client,
        dev: "veth-c",
        dir: "egress",
    };
    let ours = hook.program()?;
    // The first put-back may be the pod's verification when its watch
    // opens; the others can only come from the node's tc watch.
    hook.tc("del", None)?;
    hook.wait_program(ours).with_context(|| agent.log())?;
    hook.tc("replace", Some(&dir.join("ingress_eth0")))?;
    hook.wait_program(ours).with_context(|| agent.log())?;
    hook.tc("del", None)?;
    hook.wait_program(ours).with_context(|| agent.log())
}

/// Another tool's filter added at sluice's priority runs ahead of sluice's
/// (the kernel puts a new filter at the head of its priority) and, passing
/// every packet, would end the walk before sluice's program: the pod's
/// outbound would bypass ztunnel while every record says attached. The
/// repair finds sluice's filter behind and puts it first again.
fn foreign_filter_ahead() -> TestResult {
    let f = Fixture::new("ffa", None)?;
    let agent = AgentProc::start(&f.topo.pins)?;
    let p = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    let hook = sluice_tests::inspect::Hook {
        ns: &f.topo.pod,
        dev: "eth0",
        dir: "egress",
    };
    let ours = hook.program()?;
    let pass = f.topo.pins.progs().join("foreign_pass");
    sluice_tests::inspect::pin_pass_program(&pass)?;
    let first = || {
        sluice_tests::inspect::filter_programs(&f.topo.pod, "eth0", "egress")
            .map(|all| all.first().map(|(_, id)| *id))
    };
    for round in ["right after enrollment", "while watched"] {
        hook.tc_handle("add", "0x2", Some(&pass))?;
        wait::until(
            &format!("sluice's filter first again ({round})"),
            wait::DEADLINE,
            || match first() {
                Ok(Some(id)) if id == ours => Ok(()),
                other => Err(format!("{other:?}")),
            },
        )
        .with_context(|| agent.log())?;
        outbound_through_peer(
            &f.topo.pod,
            f.topo.client_ip(Family::V4),
            &p,
            &format!("with the foreign filter behind sluice's ({round})"),
        )?;
        hook.tc_handle("del", "0x2", None)?;
    }
    Ok(())
}

/// With `--tc-attach tcx`: another tool's tcx program attached first on the
/// pod's egress hook (a pass-all, which would let the pod's SYNs leave
/// uncaptured) is found by the next verification (no netlink event
/// announces a tcx attach; the period here is 1 s), which counts it as a
/// failed verification while the repair detaches sluice's link and attaches
/// it again, first; the pod's outbound reaches ztunnel again with the other
/// program still there, behind sluice's.
fn foreign_tcx_ahead() -> TestResult {
    use aya::programs::TcAttachType;
    let f = Fixture::new("fta", None)?;
    let (agent, port) = AgentProc::start_verifying(&f.topo.pins, &[])?;
    let p = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    let egress = f
        .topo
        .pins
        .pod(f.pod_record()?.netns_cookie)
        .join("egress_eth0");
    let ours = || {
        sluice::dataplane::tcfilter::link_info(&egress)
            .map(|i| i.prog)
            .context("no egress link")
    };
    let first = || {
        sluice_tests::inspect::tcx_programs(&f.topo.pod, "eth0", TcAttachType::Egress)
            .map(|ids| ids.first().copied())
    };
    ensure!(
        first()? == Some(ours()?),
        "sluice's program is not first after enrollment"
    );
    let failed =
        || sluice_tests::agent::metric_sum(port, sluice_tests::agent::FAILED_VERIFICATIONS);
    let before = failed()?;
    let pass = f.topo.pins.progs().join("foreign_tcx_pass");
    sluice_tests::inspect::pin_pass_program(&pass)?;
    let foreign =
        sluice_tests::inspect::attach_tcx_first(&f.topo.pod, "eth0", TcAttachType::Egress, &pass)?;
    wait::until("sluice's program first again", wait::DEADLINE, || {
        match (first(), ours()) {
            (Ok(Some(a)), Ok(b)) if a == b => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .with_context(|| agent.log())?;
    wait::until("the break counted", wait::DEADLINE, || match failed() {
        Ok(n) if n > before => Ok(()),
        other => Err(format!("{other:?}")),
    })
    .with_context(|| agent.log())?;
    let all = sluice_tests::inspect::tcx_programs(&f.topo.pod, "eth0", TcAttachType::Egress)?;
    ensure!(
        all.len() == 2,
        "the other tool's program is gone too: {all:?}"
    );
    outbound_through_peer(
        &f.topo.pod,
        f.topo.client_ip(Family::V4),
        &p,
        "with the foreign tcx program behind sluice's",
    )?;
    drop(foreign);
    Ok(())
}

/// A second interface `net1` in netns `pod`, a veth whose peer
/// (10.199.0.2/24) is in netns `client`, both up (no address in the pod).
fn add_net1(pod: &str, client: &str) -> TestResult {
    use sluice_tests::topology::ip;
    ip(&[
        "link",
        "add",
        "net1",
        "netns",
        pod,
        "type",
        "veth",
        "peer",
        "name",
        "net1-peer",
        "netns",
        client,
    ])?;
    ip(&[
        "-n",
        client,
        "addr",
        "add",
        "10.199.0.2/24",
        "dev",
        "net1-peer",
    ])?;
    ip(&["-n", client, "link", "set", "net1-peer", "up"])?;
    ip(&["-n", pod, "link", "set", "net1", "up"])
}

/// Waits until the pod's pin directory `dir` has net1's capture links.
fn wait_net1_pinned(dir: &Path) -> TestResult {
    wait::until("net1's capture links pinned", wait::DEADLINE, || {
        let pins: Vec<String> = std::fs::read_dir(dir)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        if pins.iter().any(|n| n == "egress_net1") && pins.iter().any(|n| n == "ingress_net1") {
            Ok(())
        } else {
            Err(pins)
        }
    })
}

/// With `--tc-attach tcx`: a pod's interface deleted and made again under
/// its name leaves sluice's pinned tcx link detached (the kernel detaches a
/// link whose device goes); the repair at the new interface's event finds
/// it detached and attaches the program to the new device, and the pod's
/// outbound over it reaches ztunnel.
fn interface_made_again() -> TestResult {
    use aya::programs::TcAttachType;
    use sluice_tests::topology::ip;
    let f = Fixture::new("ima", None)?;
    let agent = AgentProc::start(&f.topo.pins)?;
    let p = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    let dir = f.topo.pins.pod(f.pod_record()?.netns_cookie);
    let (pod, client) = (f.topo.pod.as_str(), f.topo.client.as_str());
    let egress = dir.join("egress_net1");
    let ours_first = || {
        let info = sluice::dataplane::tcfilter::link_info(&egress);
        let first = sluice_tests::inspect::tcx_programs(pod, "net1", TcAttachType::Egress)
            .map(|ids| ids.first().copied());
        match (info, first) {
            (Some(i), Ok(Some(id))) if i.tcx_ifindex != 0 && i.prog == id => Ok(()),
            other => Err(format!("{other:?}")),
        }
    };
    for round in ["added", "made again"] {
        add_net1(pod, client)?;
        ip(&["-n", pod, "addr", "add", "10.199.0.1/24", "dev", "net1"])?;
        wait_net1_pinned(&dir)?;
        wait::until(
            &format!("sluice's program on net1 ({round})"),
            wait::DEADLINE,
            ours_first,
        )
        .with_context(|| agent.log())?;
        outbound_through_peer(
            pod,
            [10, 199, 0, 2].into(),
            &p,
            &format!("over net1 ({round})"),
        )?;
        ip(&["-n", pod, "link", "del", "net1"])?;
    }
    Ok(())
}

/// A connection from netns `pod` to the remote app at `to` gets the app's
/// answer and is one more outbound connection the peer accepted.
pub(crate) fn outbound_through_peer(
    pod: &str,
    to: std::net::IpAddr,
    p: &PeerProc,
    what: &str,
) -> TestResult {
    let outbound = |p: &PeerProc| {
        p.events()
            .iter()
            .filter(|e| e["event"] == "accepted" && e["role"] == "outbound")
            .count()
    };
    let before = outbound(p);
    let r = tcp(pod, SocketAddr::new(to, REMOTE_PORT), Opts::default());
    ensure!(
        r.reply().is_some_and(|l| l.starts_with("app:9090")),
        "outbound {what}: {r:?}"
    );
    p.wait_for(
        &format!("the outbound connection {what} accepted by the peer"),
        |_| outbound(p) > before,
    )
}

/// A second interface (a Multus network, say) added to an enrolled pod is
/// captured when the kernel announces it, not at the next verification a
/// minute later (the wait's deadline is a third of that): its links are
/// pinned, and the pod's connection over it reaches ztunnel's outbound
/// listener.
fn interface_added() -> TestResult {
    use sluice_tests::topology::ip;
    let f = Fixture::new("ia", None)?;
    let agent = AgentProc::start(&f.topo.pins)?;
    let p = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    let dir = f.topo.pins.pod(f.pod_record()?.netns_cookie);
    ensure!(
        !dir.join("egress_net1").exists(),
        "net1 linked before it exists"
    );
    let (pod, client) = (f.topo.pod.as_str(), f.topo.client.as_str());
    add_net1(pod, client)?;
    wait_net1_pinned(&dir)?;
    // An address added to an interface already up (no link event, only the
    // address's) names the pod to the programs from its event on, not from
    // the next verification or ztunnel's next ack (without netns cookies in
    // tc, a SYN from an unpublished address is dropped).
    ip(&["-n", pod, "addr", "add", "10.199.0.1/24", "dev", "net1"])?;
    let late: std::net::IpAddr = [10, 199, 0, 1].into();
    wait::until("net1's address published", wait::DEADLINE, || {
        let addrs = f.pod_record().map(|r| r.addresses).unwrap_or_default();
        if addrs.contains(&late) {
            Ok(())
        } else {
            Err(addrs)
        }
    })?;
    outbound_through_peer(pod, [10, 199, 0, 2].into(), &p, "over net1")
}

fn unenroll() -> TestResult {
    let f = Fixture::new("ue", None)?;
    let agent = AgentProc::start(&f.topo.pins)?;
    let p = peer(&agent)?;
    enroll_enabled(&agent, &f)?;
    let out = agent.sluice(&["unenroll", "--uid", f.uid.as_str()])?;
    ensure!(
        out.ok && out.stdout.contains("via the agent"),
        "{} {}",
        out.stdout,
        out.stderr
    );
    ensure!(p
        .events()
        .iter()
        .any(|e| e["event"] == "del" && e["uid"] == f.uid.as_str() && e["fds"] == 0));
    ensure!(f.pod_record().is_err(), "pod still in status");
    let r = inbound(&f);
    ensure!(
        r.reply().is_some_and(|l| l.starts_with("app:8080")) && inbound_accepts(&p) == 0,
        "{r:?}"
    );
    let out = agent.sluice(&["unenroll", "--uid", f.uid.as_str()])?;
    ensure!(
        !out.ok && out.stderr.contains("no enrolled pod"),
        "{}",
        out.stderr
    );
    Ok(())
}

/// The agent holds an fd per pod netns and per registered listener: started
/// with a low soft open-files limit, it lifts it to the hard one.
fn fd_limit() -> TestResult {
    let f = Fixture::new("fdl", None)?;
    let agent =
        AgentProc::start_wrapped(&f.topo.pins, &["prlimit", "--nofile=256:4096", "--"], &[])?;
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", agent.pid().context("pid")?))?;
    let files: Vec<&str> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .context("no open-files limit")?
        .split_whitespace()
        .collect();
    ensure!(
        files.get(3) == Some(&"4096") && files.get(4) == Some(&"4096"),
        "soft limit not raised to the hard one: {files:?}"
    );
    Ok(())
}

/// Started with umask 000, the agent's ZDS socket (whose directory it shares
/// with ztunnel) and control socket are still 0600: no other user can pose
/// as ztunnel and receive pods' netns fds.
fn sockets_root_only() -> TestResult {
    use std::os::unix::fs::PermissionsExt as _;
    let f = Fixture::new("um", None)?;
    let agent = AgentProc::start_wrapped(
        &f.topo.pins,
        &["sh", "-c", "umask 000 && exec \"$@\"", "sh"],
        &[],
    )?;
    let umask = std::fs::read_to_string(format!("/proc/{}/status", agent.pid().context("pid")?))?;
    ensure!(
        umask.contains("Umask:\t0000"),
        "the agent did not run under umask 000: {umask}"
    );
    for sock in [&agent.zds, &agent.control] {
        let mode = std::fs::metadata(sock)?.permissions().mode() & 0o777;
        ensure!(mode == 0o600, "{}: mode {mode:o}", sock.display());
    }
    Ok(())
}

/// Out of descriptors (accept fails with EMFILE), the control socket keeps
/// serving once they are back; an oversized request and a silent client each
/// get an error and cost nothing else.
fn control_survives() -> TestResult {
    use std::io::{BufRead as _, Write as _};
    use std::os::unix::net::UnixStream;
    let f = Fixture::new("cs", None)?;
    let port = free_port()?;
    let addr = format!("127.0.0.1:{port}");
    // A hard limit the agent cannot lift.
    let agent = AgentProc::start_wrapped(
        &f.topo.pins,
        &["prlimit", "--nofile=64:64", "--"],
        &["--metrics-addr", &addr],
    )?;
    let pid = agent.pid().context("pid")?;
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count();
    // More waiting clients than the agent has descriptors left.
    let held: Vec<UnixStream> = (0..(64 - open + 16))
        .map(|_| UnixStream::connect(&agent.control))
        .collect::<Result<_, _>>()?;
    let failures = wait::until("accepts failing and counted", wait::DEADLINE, || {
        let (_, text) = http_get(port, "/metrics").map_err(|e| e.to_string())?;
        let n: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("sluice_accept_failures_total "))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        if n >= 1.0 {
            Ok(n)
        } else {
            Err(format!("{n} accept failures"))
        }
    })?;
    drop(held);
    // The agent itself answers (not the CLI's fallback to the pins).
    let n = wait::until(
        "the agent answering again",
        wait::DEADLINE,
        || match agent.node_status() {
            Ok(n) if n.is_object() => Ok(n),
            other => Err(format!("{other:?}")),
        },
    )?;
    ensure!(n["condition_type"].is_string(), "{n}");
    let ask = |bytes: &[u8]| -> anyhow::Result<String> {
        let mut s = UnixStream::connect(&agent.control)?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(20)))?;
        s.write_all(bytes)?;
        let mut line = String::new();
        std::io::BufReader::new(s).read_line(&mut line)?;
        Ok(line)
    };
    let big = ask(&vec![b'a'; 100 * 1024])?;
    ensure!(big.contains("request over 64 KiB"), "{big}");
    // A silent client: others are served meanwhile, it gets a deadline.
    let mut silent = UnixStream::connect(&agent.control)?;
    ensure!(agent.node_status()?.is_object());
    silent.set_read_timeout(Some(std::time::Duration::from_secs(20)))?;
    let mut line = String::new();
    std::io::BufReader::new(&mut silent).read_line(&mut line)?;
    ensure!(line.contains("no complete request within 5s"), "{line}");
    println!("accept failures counted while out of descriptors: {failures}");
    Ok(())
}

/// A CLI call that names another bpf root than the agent's, on the agent's
/// control socket, is refused with the reason; nothing reaches either root.
fn other_root() -> TestResult {
    let f = Fixture::new("or", None)?;
    let agent = AgentProc::start(&f.topo.pins)?;
    let other = format!("/sys/fs/bpf/sluice-other-root-{}", std::process::id());
    let out = std::process::Command::new(sluice_tests::harness::sluice_bin())
        .args(["--bpf-root", &other, "--control-socket"])
        .arg(&agent.control)
        .args(["enroll", "--uid", f.uid.as_str(), "--netns"])
        .arg(f.topo.pod_netns_path())
        .output_bounded()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && stderr.contains("owns bpf root") && stderr.contains(&other),
        "not refused: {stderr}"
    );
    ensure!(
        f.pod_record().is_err(),
        "the agent enrolled the pod into its own maps"
    );
    ensure!(
        !Path::new(&other).exists(),
        "the CLI fell back to pinning under {other}"
    );
    Ok(())
}

/// Capability numbers (linux/capability.h) of the ones a manifest may list.
fn cap_number(name: &str) -> Option<u32> {
    Some(match name {
        "net_admin" => 12,
        "net_raw" => 13,
        "sys_ptrace" => 19,
        "sys_admin" => 21,
        "perfmon" => 38,
        "bpf" => 39,
        _ => return None,
    })
}

/// The agent container of deploy/daemonset.yaml: its added capabilities (as
/// setpriv names them) and whether it sets sysctls through a host procfs.
fn daemonset_agent() -> anyhow::Result<(Vec<String>, bool)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/daemonset.yaml");
    let ds: serde_json::Value = serde_yaml::from_str(&std::fs::read_to_string(path)?)?;
    let agent = ds["spec"]["template"]["spec"]["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "agent"))
        .context("no agent container")?;
    ensure!(
        agent["securityContext"]["privileged"] == false,
        "the agent runs privileged"
    );
    let caps = agent["securityContext"]["capabilities"]["add"]
        .as_array()
        .context("no capabilities")?
        .iter()
        .filter_map(|c| c.as_str())
        .map(|c| c.to_ascii_lowercase())
        .collect();
    let host_proc = agent["args"]
        .as_array()
        .is_some_and(|a| a.iter().any(|x| x == "--proc-dir=/host/proc"));
    Ok((caps, host_proc))
}

/// The agent as deploy/daemonset.yaml runs it: only the capabilities it
/// lists (setpriv bounding set), /proc/sys read-only as in any non-privileged
/// container, and the host's procfs under another path for `--proc-dir`. It
/// loads the programs, takes a pod through ZDS to Enabled, and traffic is
/// captured.
fn daemonset_privileges() -> TestResult {
    let (caps, host_proc) = daemonset_agent()?;
    ensure!(
        host_proc,
        "the DaemonSet does not pass --proc-dir=/host/proc"
    );
    let f = Fixture::new("cap", None)?;
    let hp = std::env::temp_dir().join(format!("sluice-cap-proc-{}", std::process::id()));
    std::fs::create_dir_all(&hp)?;
    let bounding = format!(
        "-all,{}",
        caps.iter()
            .map(|c| format!("+{c}"))
            .collect::<Vec<_>>()
            .join(",")
    );
    let script = format!(
        "mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && \
         mount --bind /proc {hp} && exec setpriv --bounding-set {bounding} --inh-caps -all \
         --ambient-caps -all -- \"$@\" --proc-dir {hp}",
        hp = hp.display()
    );
    let wrapper = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        &script,
        "sh",
    ];
    let result = (|| -> TestResult {
        let agent = AgentProc::start_wrapped(&f.topo.pins, &wrapper, &[])?;
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", agent.pid().context("no pid")?))?;
        let bnd = status
            .lines()
            .find(|l| l.starts_with("CapBnd:"))
            .unwrap_or_default()
            .to_owned();
        let peer = peer(&agent)?;
        enroll_enabled(&agent, &f)?;
        ensure!(inbound(&f)
            .reply()
            .is_some_and(|l| l.starts_with("app:8080")));
        peer.wait_for("an inbound connection accepted by the peer", |_| {
            peer.accepted_roles(&["inbound"])
        })?;
        // The agent really ran with the DaemonSet's list and nothing more.
        let mask = u64::from_str_radix(bnd.trim_start_matches("CapBnd:").trim(), 16)?;
        let want = caps.iter().try_fold(0u64, |m, c| {
            cap_number(c)
                .map(|n| m | 1 << n)
                .with_context(|| format!("unknown capability {c}"))
        })?;
        ensure!(mask == want, "{bnd}, want {want:016x} for {caps:?}");
        Ok(())
    })();
    let _ = std::fs::remove_dir(&hp);
    result
}

/// Off a terminal (a pod's stderr, here a file) the agent logs one JSON
/// object per line, and an enrollment's lines carry the pod's span fields;
/// `--log-format text` (here its env form) gives plain text.
fn json_logs() -> TestResult {
    let f = Fixture::new("jlog", None)?;
    let mut agent = AgentProc::start(&f.topo.pins)?;
    let out = enroll(&agent, &f)?;
    ensure!(out.ok, "{} {}", out.stdout, out.stderr);
    let uid = f.uid.as_str().to_owned();
    sluice_tests::wait::until(
        "a JSON log line in the pod's span",
        sluice_tests::wait::DEADLINE,
        || {
            let log = agent.log();
            // Only whole lines: the agent may be writing the last one.
            let whole = &log[..log.rfind('\n').map_or(0, |i| i + 1)];
            let mut in_span = false;
            for line in whole.lines().filter(|l| !l.trim().is_empty()) {
                let v: serde_json::Value =
                    serde_json::from_str(line).map_err(|e| format!("not JSON ({e}): {line}"))?;
                if v["level"].as_str().is_none() || v["fields"]["message"].as_str().is_none() {
                    return Err(format!("no level or message: {line}"));
                }
                // The pod's span names it by uid and namespace/name.
                in_span |= v["span"]["uid"] == uid.as_str()
                    && v["span"]["pod"] == format!("ambient/{uid}").as_str();
            }
            in_span
                .then_some(())
                .ok_or_else(|| format!("no line in span uid={uid} yet"))
        },
    )?;
    agent.terminate();
    agent.set_env("SLUICE_LOG_FORMAT", Some("text"));
    let before = agent.log().len();
    agent.restart()?;
    let log = agent.log();
    let first = log[before..]
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default();
    ensure!(
        serde_json::from_str::<serde_json::Value>(first).is_err() && first.contains("INFO"),
        "--log-format text gave {first:?}"
    );
    Ok(())
}

/// The istio-cni take-over check runs the iptables tools in a pod netns
/// that has nf_tables tables. A tool that takes its time (a busy xtables
/// lock) holds up that pod's enrollment only: the check runs without the
/// dataplane held, so another pod's enrollment completes meanwhile. The
/// stand-in tool blocks on a FIFO until the test releases it (the agent
/// would kill it after 5 s: by then b's enrollment is long done).
fn slow_takeover_check() -> TestResult {
    use std::os::unix::fs::PermissionsExt as _;
    let a = Fixture::in_subnet("ta", None, 1)?;
    let b = Fixture::in_subnet("tb", None, 2)?;
    let dir = std::path::PathBuf::from(format!("/tmp/sluice-slowipt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let result = (|| -> TestResult {
        let (fifo, pidfile) = (dir.join("release"), dir.join("pid"));
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600))?;
        // The first tool run blocks until released; the later ones answer
        // at once (no Istio chains either way).
        let script = format!(
            "#!/bin/sh\n[ -e {pid} ] && exit 0\necho $$ > {pid}\ncat {fifo} > /dev/null\nexit 0\n",
            pid = pidfile.display(),
            fifo = fifo.display()
        );
        for tool in ["iptables", "ip6tables"] {
            for variant in ["-nft-save", "-legacy-save", "-save"] {
                let path = dir.join(format!("{tool}{variant}"));
                std::fs::write(&path, &script)?;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
            }
        }
        // Pod a has an nf_tables table, so its check runs the tools.
        sluice_tests::ns::exec(
            &a.topo.pod,
            &["iptables-nft", "-t", "filter", "-N", "SLUICE_TEST"],
        )?;
        let mut agent = AgentProc::start(&a.topo.pins)?;
        let path = format!(
            "{}:{}",
            dir.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        agent.set_env("PATH", Some(&path));
        agent.restart()?;
        let _peer = peer(&agent)?;
        std::thread::scope(|s| -> TestResult {
            let first = s.spawn(|| enroll(&agent, &a));
            let pid = wait::until("pod a's iptables tool to run", wait::DEADLINE, || {
                std::fs::read_to_string(&pidfile)
                    .ok()
                    .and_then(|p| p.trim().parse::<i32>().ok())
                    .ok_or("no pid yet")
            })?;
            let out = enroll(&agent, &b)?;
            ensure!(
                out.ok && steering(&out.stdout),
                "b: {} {}\n{}",
                out.stdout,
                out.stderr,
                agent.log()
            );
            let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| !s.contains(") Z "));
            ensure!(
                alive && !first.is_finished(),
                "b's enrollment waited for a's iptables tool (tool alive: {alive}, a finished: {})\n{}",
                first.is_finished(),
                agent.log()
            );
            // Released (a writer opens the FIFO): a's check finds no Istio
            // chains and its enrollment completes.
            drop(open_fifo_writer(&fifo)?);
            ensure_steering("a", &first.join().expect("enroll thread panicked")?, &agent)?;
            Ok(())
        })?;
        ensure!(sluice::status::read(&a.topo.pins)?.len() == 2);
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The pod holds nftables rules of its own in a table of iptables' names
/// that `iptables-nft-save` cannot parse (it exits 3): the take-over check
/// cannot read the whole rule set, finds no Istio chains in what it read,
/// and the pod is enrolled. Refusing it would leave a pod that uses its own
/// nftables uncaptured for good.
fn unparsable_nft_rules() -> TestResult {
    let a = Fixture::new("tf", None)?;
    for rule in [
        &["add", "table", "ip", "filter"][..],
        &[
            "add",
            "chain",
            "ip",
            "filter",
            "INPUT",
            "{ type filter hook input priority 0; }",
        ],
        &[
            "add", "rule", "ip", "filter", "INPUT", "meta", "cpu", "0", "counter",
        ],
    ] {
        sluice_tests::ns::exec(&a.topo.pod, &[&["nft"][..], rule].concat())?;
    }
    let save = sluice_tests::ns::exec(&a.topo.pod, &["iptables-nft-save"]);
    ensure!(save.is_err(), "iptables-nft-save read the rules: {save:?}");
    let agent = AgentProc::start(&a.topo.pins)?;
    let _peer = peer(&agent)?;
    ensure_steering("the pod", &enroll(&agent, &a)?, &agent)
}

/// Issue 38, case 5: a repair reads the pod's interfaces and checks each of
/// its links over netlink, linear in its interface count (with 800
/// interfaces in one pod, other pods' enrollments took up to 330 ms while
/// that ran under the node-wide lock). Pod a's repair, after an interface
/// is added to it, is held in that work (a pause point of the
/// fault-injection build); pod b's enrollment through the same agent
/// completes meanwhile. Released, a's repair attaches the new interface's
/// links.
fn held_repair() -> TestResult {
    use sluice_tests::topology::ip;
    let a = Fixture::in_subnet("hra", None, 1)?;
    let b = Fixture::in_subnet("hrb", None, 2)?;
    let pause = Pause::new("hr", "survey")?;
    let agent = pause.agent(&a.topo.pins)?;
    let _peer = peer(&agent)?;
    enroll_enabled(&agent, &a)?;
    let pins = a.topo.pins.pod(a.pod_record()?.netns_cookie);
    let pod = a.topo.pod.as_str();
    ip(&[
        "-n", pod, "link", "add", "d0", "type", "veth", "peer", "name", "d1",
    ])?;
    ip(&["-n", pod, "link", "set", "d0", "up"])?;
    pause.wait_held("a's repair held in its netlink work")?;
    std::thread::scope(|s| -> TestResult {
        let second = s.spawn(|| enroll(&agent, &b));
        let waited = wait::until(
            "b's enrollment done while a's repair is held",
            wait::DEADLINE,
            || second.is_finished().then_some(()).ok_or("b waits"),
        );
        pause.release()?;
        waited.with_context(|| agent.log())?;
        ensure_steering(
            "b",
            &second.join().expect("enroll thread panicked")?,
            &agent,
        )
    })?;
    wait::until("d0's links pinned once released", wait::DEADLINE, || {
        let have = |n: &str| pins.join(n).exists();
        (have("egress_d0") && have("ingress_d0"))
            .then_some(())
            .ok_or("not yet")
    })?;
    // The routing the repair completes: accept_local, found off in the
    // survey's link dump, is on.
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", pod, "sysctl", "-n"])
        .arg("net.ipv4.conf.d0.accept_local")
        .output_bounded()?;
    let on = String::from_utf8_lossy(&out.stdout);
    ensure!(on.trim() == "1", "d0's accept_local: {on:?}");
    Ok(())
}

/// A pause point of the fault-injection build (`SLUICE_PAUSE_AT`): its
/// directory and the FIFO that releases the held thread. Dropped, it
/// releases a thread still held and removes the directory.
pub(crate) struct Pause {
    dir: std::path::PathBuf,
    step: &'static str,
}

impl Pause {
    pub(crate) fn new(tag: &str, step: &'static str) -> anyhow::Result<Self> {
        let dir =
            std::path::PathBuf::from(format!("/tmp/sluice-pause-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let p = Self { dir, step };
        nix::unistd::mkfifo(&p.fifo(), nix::sys::stat::Mode::from_bits_truncate(0o600))?;
        Ok(p)
    }

    fn fifo(&self) -> std::path::PathBuf {
        self.dir.join(format!("{}.release", self.step))
    }

    /// An agent that holds the first thread reaching the step.
    pub(crate) fn agent(
        &self,
        pins: &sluice::dataplane::loader::Pins,
    ) -> anyhow::Result<AgentProc> {
        let mut agent = AgentProc::start(pins)?;
        agent.set_env("SLUICE_PAUSE_AT", Some(self.step));
        agent.set_env("SLUICE_PAUSE_DIR", self.dir.to_str());
        agent.restart()?;
        Ok(agent)
    }

    /// Waits until a thread is held at the step.
    pub(crate) fn wait_held(&self, what: &str) -> TestResult {
        let paused = self.dir.join(format!("{}.paused", self.step));
        wait::until(what, wait::DEADLINE, || {
            paused.exists().then_some(()).ok_or("not held yet")
        })?;
        Ok(())
    }

    /// Releases the held thread.
    pub(crate) fn release(&self) -> TestResult {
        release(&self.fifo())
    }
}

impl Drop for Pause {
    fn drop(&mut self) {
        // Never leave the agent held: a reader still there takes this open.
        let _ = open_fifo_writer(&self.fifo());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Opens `fifo` for writing once its reader (a held pause point) has it
/// open, which releases the reader.
fn release(fifo: &Path) -> TestResult {
    wait::until("the pause point's reader", wait::DEADLINE, || {
        open_fifo_writer(fifo).map(drop)
    })?;
    Ok(())
}

/// Opens `fifo` for writing without waiting: that releases a reader
/// blocked in its own open; with none there it fails (ENXIO).
fn open_fifo_writer(fifo: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(fifo)
}

/// `who`'s enrollment said it steers; else its output and the agent's log.
pub(crate) fn ensure_steering(who: &str, out: &Out, agent: &AgentProc) -> TestResult {
    ensure!(
        out.ok && steering(&out.stdout),
        "{who}: {} {}\n{}",
        out.stdout,
        out.stderr,
        agent.log()
    );
    Ok(())
}

//! Istio's real in-pod rules (the reference file), applied with
//! iptables-restore / ip6tables-restore and the policy route inside a netns,
//! for the differential test and the benchmarks.

use std::{
    io::Write,
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{ensure, Context as _};

use crate::{ns::netns_path, topology::ip};

pub fn reference_rules_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/istio-inpod-rules.txt")
}

/// The reference rule set, and its IPv6 form (the same rules with v6 addresses).
pub fn rules() -> anyhow::Result<(String, String)> {
    let p = reference_rules_path();
    let v4 = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    let v6 = v4
        .replace("127.0.0.1/32", "::1/128")
        .replace(
            "169.254.7.127/32",
            "fd16:9254:7127:1337:ffff:ffff:ffff:ffff/128",
        )
        .replace("--on-ip 0.0.0.0", "--on-ip ::");
    Ok((v4, v6))
}

fn restore(bin: &str, ns: &str, rules: &str) -> anyhow::Result<()> {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, bin])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {bin}"))?;
    child.stdin.take().unwrap().write_all(rules.as_bytes())?;
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "{bin} in {ns}: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// The iptables backend istio-cni used on a node.
#[derive(Debug, Clone, Copy)]
pub enum Backend {
    /// The host's default `iptables-restore` (nf_tables here).
    Default,
    /// `iptables-legacy-restore` (x_tables), for hosts still on legacy.
    Legacy,
}

/// Applies Istio's rules and policy routing in netns `ns`, as istio-cni does.
pub fn apply(ns: &str) -> anyhow::Result<()> {
    apply_with(ns, Backend::Default)
}

/// Istio's rules for a pod annotated `ambient.istio.io/bypass-inbound-capture:
/// "true"` ("ingress mode"): the reference set without its inbound
/// (`ISTIO_PRERT`) rules, as istio-cni writes it.
pub fn apply_ingress_mode(ns: &str) -> anyhow::Result<()> {
    ensure!(netns_path(ns).exists(), "no netns {ns}");
    let (v4, v6) = rules()?;
    let strip = |r: &str| -> String {
        r.lines()
            .filter(|l| !l.starts_with("-A ISTIO_PRERT"))
            .map(|l| format!("{l}\n"))
            .collect()
    };
    restore("iptables-restore", ns, &strip(&v4))?;
    restore("ip6tables-restore", ns, &strip(&v6))?;
    policy_route(ns)
}

/// istio-cni's DNS capture rules (`cni.ambient.dnsCapture`), as its
/// `AppendInpodRules` adds them to the reference set: the pod's UDP to port
/// 53 leaving through a non-loopback interface, and its TCP to port 53 not
/// bound for localhost, both without ztunnel's mark, are redirected to the
/// DNS proxy on 15053 (placed before the lo and 15001 rules); ztunnel's own
/// DNS flows get a conntrack zone of their own so its upstream query and
/// the pod's redirected query cannot collide.
const DNS_NAT: &[&str] = &[
    "-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark 0x539/0xfff -m udp --dport 53 -j REDIRECT --to-ports 15053",
    "-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m tcp --dport 53 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15053",
];
const DNS_RAW: &str = "*raw
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A OUTPUT -p udp -m mark --mark 0x539/0xfff -m udp --dport 53 -j CT --zone 1
-A PREROUTING -p udp -m mark ! --mark 0x539/0xfff -m udp --sport 53 -j CT --zone 1
COMMIT
";

/// The reference rules with istio-cni's DNS capture rules added.
fn with_dns(rules: &str) -> String {
    let mut out = String::new();
    let mut in_nat = false;
    let mut placed = false;
    for l in rules.lines() {
        if l == "*nat" {
            in_nat = true;
        }
        // In front of the first rule that could accept or redirect the
        // query otherwise (Istio's order: after the probe-address accept).
        let late = l.starts_with("-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111");
        if in_nat && late && !placed {
            for r in DNS_NAT {
                out.push_str(r);
                out.push('\n');
            }
            placed = true;
        }
        out.push_str(l);
        out.push('\n');
    }
    out.push_str(DNS_RAW);
    out
}

/// Istio's rules with DNS capture on (`cni.ambient.dnsCapture: true`).
pub fn apply_with_dns_capture(ns: &str) -> anyhow::Result<()> {
    ensure!(netns_path(ns).exists(), "no netns {ns}");
    let (v4, v6) = rules()?;
    let (v4, v6) = (
        with_dns(&v4),
        with_dns(&v6).replace("127.0.0.1/32", "::1/128"),
    );
    ensure!(
        v4.contains("--to-ports 15053") && v6.contains("::1/128 -p tcp -m tcp --dport 53"),
        "the DNS rules were not placed"
    );
    restore("iptables-restore", ns, &v4)?;
    restore("ip6tables-restore", ns, &v6)?;
    policy_route(ns)
}

/// Same, with the given iptables backend.
pub fn apply_with(ns: &str, backend: Backend) -> anyhow::Result<()> {
    ensure!(netns_path(ns).exists(), "no netns {ns}");
    let (v4, v6) = rules()?;
    let (r4, r6) = match backend {
        Backend::Default => ("iptables-restore", "ip6tables-restore"),
        Backend::Legacy => ("iptables-legacy-restore", "ip6tables-legacy-restore"),
    };
    restore(r4, ns, &v4)?;
    restore(r6, ns, &v6)?;
    policy_route(ns)
}

/// istio-cni's policy routing: marked packets are delivered locally.
fn policy_route(ns: &str) -> anyhow::Result<()> {
    ip(&[
        "-n",
        ns,
        "rule",
        "add",
        "fwmark",
        "0x111/0xfff",
        "pref",
        "32764",
        "lookup",
        "100",
    ])?;
    ip(&[
        "-n",
        ns,
        "route",
        "add",
        "local",
        "0.0.0.0/0",
        "dev",
        "lo",
        "table",
        "100",
    ])?;
    ip(&[
        "-n",
        ns,
        "-6",
        "rule",
        "add",
        "fwmark",
        "0x111/0xfff",
        "pref",
        "32764",
        "lookup",
        "100",
    ])?;
    ip(&[
        "-n", ns, "-6", "route", "add", "local", "::/0", "dev", "lo", "table", "100",
    ])?;
    Ok(())
}

/// istio-cni's host-side probe rule in the node netns `ns`: TCP that a local
/// socket sends to an enrolled pod is SNATed to the probe address. Istio
/// matches the pod addresses with an ipset (`istio-inpod-probes-v4/-v6`);
/// here `-d` names the one pod.
pub fn apply_host_probe_snat(
    ns: &str,
    pod_v4: std::net::Ipv4Addr,
    pod_v6: std::net::Ipv6Addr,
) -> anyhow::Result<()> {
    let rules = [
        ("iptables", pod_v4.to_string() + "/32", "169.254.7.127"),
        (
            "ip6tables",
            pod_v6.to_string() + "/128",
            "fd16:9254:7127:1337:ffff:ffff:ffff:ffff",
        ),
    ];
    for (tool, dst, to) in rules {
        let run = |args: &[&str]| -> anyhow::Result<()> {
            crate::ns::exec(ns, &[&[tool, "-w", "-t", "nat"][..], args].concat())
        };
        run(&["-N", "ISTIO_POSTRT"])?;
        run(&["-A", "POSTROUTING", "-j", "ISTIO_POSTRT"])?;
        run(&[
            "-A",
            "ISTIO_POSTRT",
            "-p",
            "tcp",
            "-m",
            "owner",
            "--socket-exists",
            "-d",
            &dst,
            "-j",
            "SNAT",
            "--to-source",
            to,
        ])?;
    }
    Ok(())
}

/// istio-cni's in-pod rules as its node agent builds them today
/// (`cni/pkg/iptables` `AppendInpodRules`, default settings: IPv6 on, DNS
/// capture on, not ingress mode): inbound is a nat `REDIRECT` to 15006 (no
/// TPROXY, unlike the older reference file above), outbound a nat
/// `REDIRECT` to 15001, DNS to 15053 with ztunnel's DNS flows in conntrack
/// zone 1, in the `iptables-restore` form istio-cni feeds `--noflush`.
pub fn istio_cni_rules(v6: bool) -> String {
    let (lo, probe) = if v6 {
        ("::1/128", "fd16:9254:7127:1337:ffff:ffff:ffff:ffff")
    } else {
        ("127.0.0.1/32", "169.254.7.127")
    };
    let mark = "0x539/0xfff";
    let tproxy_mark = "0x111/0xfff";
    format!(
        "* mangle
-N ISTIO_PRERT
-N ISTIO_OUTPUT
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_PRERT -m mark --mark {mark} -j CONNMARK --set-xmark {tproxy_mark}
-A ISTIO_OUTPUT -m connmark --mark {tproxy_mark} -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
COMMIT
* nat
-N ISTIO_PRERT
-N ISTIO_OUTPUT
-A OUTPUT -j ISTIO_OUTPUT
-A PREROUTING -j ISTIO_PRERT
-A ISTIO_PRERT -s {probe} -p tcp -m tcp -j ACCEPT
-A ISTIO_OUTPUT -d {probe} -p tcp -m tcp -j ACCEPT
-A ISTIO_PRERT ! -d {lo} -p tcp ! --dport 15008 -m mark ! --mark {mark} -j REDIRECT --to-ports 15006
-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark {mark} -m udp --dport 53 -j REDIRECT --to-port 15053
-A ISTIO_OUTPUT ! -d {lo} -p tcp --dport 53 -m mark ! --mark {mark} -j REDIRECT --to-ports 15053
-A ISTIO_OUTPUT -p tcp -m mark --mark {tproxy_mark} -j ACCEPT
-A ISTIO_OUTPUT ! -d {lo} -o lo -j ACCEPT
-A ISTIO_OUTPUT ! -d {lo} -p tcp -m mark ! --mark {mark} -j REDIRECT --to-ports 15001
COMMIT
* raw
-N ISTIO_PRERT
-N ISTIO_OUTPUT
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -p udp -m mark --mark {mark} -m udp --dport 53 -j CT --zone 1
-A ISTIO_PRERT -p udp -m mark ! --mark {mark} -m udp --sport 53 -j CT --zone 1
COMMIT
"
    )
}

/// Captures the pod in netns `ns` the way istio-cni's node agent does today
/// (`CreateInpodRules`), with nothing more: from a thread in the pod netns,
/// the policy routing over netlink (`local default dev lo table 100`,
/// replaced, and `fwmark 0x111/0xfff lookup 100` at 32764, both families);
/// then its state check, `iptables-save` and `ip6tables-save` (a fresh netns
/// has no rules, so nothing more is checked); then `iptables-restore
/// --noflush -v` and `ip6tables-restore --noflush -v` with
/// [`istio_cni_rules`]. Each tool runs as istio-cni runs it in a pod
/// (`UsePodScopedXtablesLock`): forked from a thread of its own in the pod
/// netns that has unshared its mount namespace, made `/` private and
/// bind-mounted `/dev/null` over `/etc/nsswitch.conf` (nf_tables needs no
/// xtables lock). No `ip netns exec`, no `ip` command.
pub fn apply_istio_cni(ns: &str) -> anyhow::Result<()> {
    let path = netns_path(ns);
    ensure!(path.exists(), "no netns {ns}");
    let netns =
        std::fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let netns = std::sync::Arc::new(netns);
    let n2 = netns.clone();
    std::thread::spawn(move || -> anyhow::Result<()> {
        nix::sched::setns(&*n2, nix::sched::CloneFlags::CLONE_NEWNET)?;
        istio_cni_routes()?;
        for save in ["iptables-save", "ip6tables-save"] {
            // The state check: a clean netns shows no rules.
            sandboxed(&n2, save, &[], None)?;
        }
        sandboxed(
            &n2,
            "iptables-restore",
            &["--noflush", "-v"],
            Some(istio_cni_rules(false)),
        )?;
        sandboxed(
            &n2,
            "ip6tables-restore",
            &["--noflush", "-v"],
            Some(istio_cni_rules(true)),
        )?;
        Ok(())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("istio-cni replica thread panicked"))?
}

/// istio-cni's `AddLoopbackRoutes` and `AddInpodMarkIPRule`, over netlink
/// in the calling thread's netns.
fn istio_cni_routes() -> anyhow::Result<()> {
    use netlink_packet_route::{
        route::{RouteScope, RouteType},
        rule::{RuleAction, RuleAttribute},
    };
    use rtnetlink::RouteMessageBuilder;
    use std::net::{Ipv4Addr, Ipv6Addr};
    let v6 = std::fs::read_to_string("/proc/sys/net/ipv6/conf/lo/disable_ipv6")
        .map(|v| v.trim() != "1")
        .unwrap_or(true);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    rt.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection()?;
        tokio::spawn(conn);
        let lo = nix::net::if_::if_nametoindex("lo")?;
        let r4 = RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(Ipv4Addr::UNSPECIFIED, 0)
            .table_id(100)
            .output_interface(lo)
            .kind(RouteType::Local)
            .scope(RouteScope::Host)
            .build();
        handle.route().add(r4).replace().execute().await?;
        if v6 {
            let r6 = RouteMessageBuilder::<Ipv6Addr>::new()
                .destination_prefix(Ipv6Addr::UNSPECIFIED, 0)
                .table_id(100)
                .output_interface(lo)
                .kind(RouteType::Local)
                .scope(RouteScope::Host)
                .build();
            handle.route().add(r6).replace().execute().await?;
        }
        let mut r = handle
            .rule()
            .add()
            .v4()
            .fw_mark(0x111)
            .priority(32764)
            .table_id(100)
            .action(RuleAction::ToTable);
        r.message_mut()
            .attributes
            .push(RuleAttribute::FwMask(0xfff));
        ignore_exists(r.execute().await)?;
        let mut r = handle
            .rule()
            .add()
            .v6()
            .fw_mark(0x111)
            .priority(32764)
            .table_id(100)
            .action(RuleAction::ToTable);
        r.message_mut()
            .attributes
            .push(RuleAttribute::FwMask(0xfff));
        ignore_exists(r.execute().await)?;
        anyhow::Ok(())
    })
}

fn ignore_exists(r: Result<(), rtnetlink::Error>) -> anyhow::Result<()> {
    match r {
        Err(rtnetlink::Error::NetlinkError(m))
            if m.code.map(|c| -c.get()) == Some(libc::EEXIST) =>
        {
            Ok(())
        }
        other => Ok(other?),
    }
}

/// Runs `bin` as istio-cni's `runInSandbox` does: on a new thread in the
/// pod netns `netns` with a mount namespace of its own (`/` private,
/// `/dev/null` over `/etc/nsswitch.conf`), which ends with the thread. Like
/// istio-cni, a sandbox that cannot be set up runs the tool without it.
fn sandboxed(
    netns: &std::sync::Arc<std::fs::File>,
    bin: &'static str,
    args: &'static [&'static str],
    stdin: Option<String>,
) -> anyhow::Result<String> {
    let netns = netns.clone();
    std::thread::spawn(move || -> anyhow::Result<String> {
        use nix::mount::{mount, MsFlags};
        nix::sched::setns(&*netns, nix::sched::CloneFlags::CLONE_NEWNET)?;
        // Mounts only once `/` is private in a namespace of this thread's
        // own: they must never reach the host's.
        let private = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).and_then(|()| {
            mount(
                None::<&str>,
                "/",
                None::<&str>,
                MsFlags::MS_PRIVATE | MsFlags::MS_REC,
                None::<&str>,
            )
        });
        if private.is_ok() {
            let _ = mount(
                Some("/dev/null"),
                "/etc/nsswitch.conf",
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_RDONLY,
                None::<&str>,
            );
        }
        let mut child = Command::new(bin)
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("running {bin}"))?;
        if let Some(input) = stdin {
            child.stdin.take().unwrap().write_all(input.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        ensure!(
            out.status.success(),
            "{bin}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("{bin} sandbox thread panicked"))?
}

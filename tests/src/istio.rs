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

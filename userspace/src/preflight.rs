//! `sluice check-node`'s checks: what would stop or weaken sluice on this
//! node, found before it is installed. Each check reads the node and says
//! ok, warn (sluice runs, something is weaker or will change) or fail
//! (sluice cannot capture pods here as configured). Nothing is changed.

use std::{
    fmt,
    path::{Path, PathBuf},
};

use serde::Serialize;

use crate::{cni::install::CniInstall, dataplane::features::Features};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Level::Ok => "ok",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        })
    }
}

/// One check's finding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub check: &'static str,
    pub level: Level,
    pub detail: String,
}

fn finding(check: &'static str, level: Level, detail: impl Into<String>) -> Finding {
    Finding {
        check,
        level,
        detail: detail.into(),
    }
}

/// Where the checks look.
pub struct Node<'a> {
    pub features: &'a Features,
    /// The bpffs directory sluice pins under (`--bpf-root`).
    pub bpf_root: &'a Path,
    pub cni: &'a CniInstall,
    /// The netns whose veths are the pods' host sides.
    pub node_netns: &'a Path,
    /// The ZDS socket ztunnel connects to.
    pub zds_socket: &'a Path,
    /// The node's procfs (another node agent, Cilium's agent).
    pub proc: &'a Path,
}

/// Every check, in order.
pub fn run(n: &Node) -> Vec<Finding> {
    let mut out = vec![kernel(n.features), bpffs(n.bpf_root)];
    out.extend(cni_config(n.cni));
    out.push(host_veths(n.node_netns));
    out.extend(istio_cni(n));
    out.extend(cilium(n));
    out
}

/// The exit status: 0 all ok, 2 a warning, 1 a failure.
pub fn status(findings: &[Finding]) -> u8 {
    match findings.iter().map(|f| f.level).max() {
        Some(Level::Fail) => 1,
        Some(Level::Warn) => 2,
        _ => 0,
    }
}

fn kernel(f: &Features) -> Finding {
    let missing = f.missing();
    if missing.is_empty() {
        finding("kernel", Level::Ok, f.summary())
    } else {
        finding(
            "kernel",
            Level::Fail,
            format!(
                "missing {} (the dataplane does not load; run it privileged, as the agent runs: unprivileged every probe fails)",
                missing.join(", ")
            ),
        )
    }
}

fn bpffs(root: &Path) -> Finding {
    // The root itself may not exist before the agent's first start.
    let mount = root
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("/"));
    match nix::sys::statfs::statfs(mount) {
        Ok(s) if s.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC => finding(
            "bpffs",
            Level::Ok,
            format!("{} is on bpffs", mount.display()),
        ),
        Ok(_) => finding(
            "bpffs",
            Level::Fail,
            format!(
                "{} is not on a bpffs mount: pins would not outlive the agent (mount -t bpf bpf /sys/fs/bpf, or mount the host's into the agent's pod)",
                mount.display()
            ),
        ),
        Err(e) => finding("bpffs", Level::Fail, format!("{}: {e}", mount.display())),
    }
}

fn cni_config(cni: &CniInstall) -> Vec<Finding> {
    let mut out = Vec::new();
    match cni.survey() {
        Err(e) => out.push(finding("cni config", Level::Fail, e.to_string())),
        Ok(s) => {
            match (&s.primary, &s.primary_error) {
                (Some(p), None) => out.push(finding(
                    "cni config",
                    Level::Ok,
                    format!("primary {p}: {}", s.primary_plugins.join(", ")),
                )),
                (Some(p), Some(e)) => out.push(finding(
                    "cni config",
                    Level::Fail,
                    format!("primary {p} does not parse: {e}"),
                )),
                (None, _) => out.push(finding(
                    "cni config",
                    Level::Fail,
                    format!(
                        "no primary network config in {} (the primary CNI writes it; sluice waits for it)",
                        cni.conf_dir.display()
                    ),
                )),
            }
            if let Some(why) = s.owned_sorts_after {
                out.push(finding("cni config", Level::Warn, why));
            }
            if !s.backed_up.is_empty() {
                out.push(finding(
                    "cni config",
                    Level::Fail,
                    format!(
                        "{} in {}: a CNI renames other configs away (Cilium's cni.exclusive=true does): it would rename sluice's too; set cni.exclusive=false",
                        s.backed_up.join(", "),
                        cni.conf_dir.display()
                    ),
                ));
            }
        }
    }
    if !cni.bin_dir.is_dir() {
        out.push(finding(
            "cni bin dir",
            Level::Warn,
            format!(
                "{} does not exist (the agent creates it; is it the runtime's CNI bin dir?)",
                cni.bin_dir.display()
            ),
        ));
    }
    out
}

fn host_veths(netns: &Path) -> Finding {
    let held = match crate::podnet::netns::Netns::open(netns)
        .map_err(|e| e.to_string())
        .and_then(|ns| foreign_qdiscs(&ns))
    {
        Ok(h) => h,
        Err(e) => return finding("host veths", Level::Warn, format!("could not look: {e}")),
    };
    if held.is_empty() {
        return finding("host veths", Level::Ok, "no other tool's qdisc on a veth");
    }
    finding(
        "host veths",
        Level::Warn,
        format!(
            "another tool's qdisc holds the hook of {}: with cls_bpf filters (the default) sluice cannot attach there and those pods' probes are exempt only from 169.254.7.127; --tc-attach tcx (Linux ≥ 6.6) attaches beside it",
            held.join(", ")
        ),
    )
}

/// The veths of `ns` whose clsact slot holds another qdisc (`ingress`).
fn foreign_qdiscs(ns: &crate::podnet::netns::Netns) -> Result<Vec<String>, String> {
    use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkInfo};
    let view = crate::podnet::podview::PodView::open(ns).map_err(|e| e.to_string())?;
    let mut held = Vec::new();
    for m in &view.links {
        let veth = m.attributes.iter().any(|a| {
            matches!(a, LinkAttribute::LinkInfo(i) if i.iter().any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth))))
        });
        if !veth {
            continue;
        }
        let name = view
            .ifaces
            .iter()
            .find(|i| i.index == m.header.index)
            .map(|i| i.name.clone())
            .unwrap_or_default();
        let kind = crate::dataplane::tcfilter::foreign_hook_qdisc(&view.nl, m.header.index)
            .map_err(|e| format!("{name}: {e}"))?;
        if let Some(k) = kind {
            held.push(format!("{name} ({k})"));
        }
    }
    Ok(held)
}

fn istio_cni(n: &Node) -> Vec<Finding> {
    let mut out = Vec::new();
    if let Some(rival) = crate::agent::rival::listening_on(n.zds_socket, n.proc) {
        out.push(finding(
            "istio-cni",
            Level::Warn,
            format!("{rival}: sluice does not start beside it unless takeOverNodeAgent; remove istio/cni first (docs/INSTALL.md)"),
        ));
    }
    if let Ok(s) = n.cni.survey() {
        if !s.istio.is_empty() {
            out.push(finding(
                "istio-cni",
                Level::Warn,
                format!(
                    "istio-cni is chained in {}: sluice's owned conflist leaves it out and removes istio-cni's own file at start",
                    s.istio.join(", ")
                ),
            ));
        }
    }
    if out.is_empty() {
        out.push(finding("istio-cni", Level::Ok, "not on this node"));
    }
    out
}

/// Cilium's agent reads its ConfigMap from files (`--config-dir`, mounted
/// at /tmp/cilium/config-map): read through its procfs root.
fn cilium(n: &Node) -> Vec<Finding> {
    let Some(dir) = cilium_config_dir(n.proc) else {
        return Vec::new();
    };
    let read = |key: &str| {
        std::fs::read_to_string(dir.join(key))
            .ok()
            .map(|v| v.trim().to_owned())
    };
    let mut out = Vec::new();
    match read("cni-exclusive").as_deref() {
        Some("true") => out.push(finding(
            "cilium",
            Level::Fail,
            "cni-exclusive=true: Cilium renames every other CNI config, sluice's included (set cni.exclusive=false)",
        )),
        Some(_) => out.push(finding("cilium", Level::Ok, "cni-exclusive=false")),
        None => {}
    }
    match read("bpf-lb-sock-hostns-only").as_deref() {
        Some("true") => out.push(finding("cilium", Level::Ok, "bpf-lb-sock-hostns-only=true")),
        _ => out.push(finding(
            "cilium",
            Level::Warn,
            "socket LB runs in pod namespaces (bpf-lb-sock-hostns-only is not true): a pod's connect() to a Service reaches ztunnel already translated to one backend, so Service-level policy and routing see the pod, not the Service (set socketLB.hostNamespaceOnly=true)",
        )),
    }
    out
}

/// The config dir of a running `cilium-agent` under `proc`, if any.
pub fn cilium_config_dir(proc: &Path) -> Option<PathBuf> {
    std::fs::read_dir(proc).ok()?.flatten().find_map(|e| {
        e.file_name().to_str()?.parse::<u32>().ok()?;
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        (comm.trim() == "cilium-agent")
            .then(|| e.path().join("root/tmp/cilium/config-map"))
            .filter(|d| d.is_dir())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worst_finding_sets_the_status() {
        let f = |level| finding("x", level, "");
        assert_eq!(status(&[f(Level::Ok)]), 0);
        assert_eq!(status(&[f(Level::Ok), f(Level::Warn)]), 2);
        assert_eq!(status(&[f(Level::Warn), f(Level::Fail), f(Level::Ok)]), 1);
    }

    #[test]
    fn cilium_settings_are_read_through_its_agents_procfs_root() {
        let proc = std::env::temp_dir().join(format!("sluice-fakeproc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&proc);
        let agent = proc.join("4242");
        let conf = agent.join("root/tmp/cilium/config-map");
        std::fs::create_dir_all(&conf).unwrap();
        std::fs::create_dir_all(proc.join("17")).unwrap();
        std::fs::write(proc.join("17/comm"), "bash\n").unwrap();
        std::fs::write(agent.join("comm"), "cilium-agent\n").unwrap();
        std::fs::write(conf.join("cni-exclusive"), "true").unwrap();
        assert_eq!(cilium_config_dir(&proc), Some(conf.clone()));
        let cni = CniInstall::new(
            proc.join("net.d"),
            proc.join("bin"),
            proc.join("x"),
            proc.join("s"),
        );
        let features = Features {
            sk_lookup: true,
            tcx: true,
            netns_cookie_in_tc: true,
        };
        let node = Node {
            features: &features,
            bpf_root: Path::new("/sys/fs/bpf/x"),
            cni: &cni,
            node_netns: Path::new("/proc/self/ns/net"),
            zds_socket: &proc.join("zds.sock"),
            proc: &proc,
        };
        let found = cilium(&node);
        assert_eq!(found[0].level, Level::Fail, "{found:?}");
        assert_eq!(found[1].level, Level::Warn, "{found:?}");
        std::fs::write(conf.join("cni-exclusive"), "false").unwrap();
        std::fs::write(conf.join("bpf-lb-sock-hostns-only"), "true\n").unwrap();
        assert!(cilium(&node).iter().all(|f| f.level == Level::Ok));
        std::fs::remove_dir_all(&proc).unwrap();
    }
}

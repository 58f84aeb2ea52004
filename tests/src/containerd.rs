//! A private containerd (Debian's, with its CRI plugin and runc) for the CNI
//! chain under a real container runtime. Its root, state, sockets, CNI dirs
//! and cgroup parent are the test's own, under one directory; it runs in a
//! netns of the test's that plays the node (entered with setns only: a new
//! mount namespace would hide the host's cgroup mounts from runc), so the CNI
//! plugins it runs put their host-side veths there. Pod sandboxes are made
//! and removed through the CRI API, as kubelet does, and their sandbox image
//! is built here from Debian's static `catatonit` (no registry).

use crate::child::Bounded as _;
use std::{
    fs,
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
};

use anyhow::{bail, ensure, Context as _};
use k8s_cri::v1::{
    runtime_service_client::RuntimeServiceClient, LinuxPodSandboxConfig,
    LinuxSandboxSecurityContext, ListPodSandboxRequest, NamespaceOption, PodSandboxConfig,
    PodSandboxMetadata, PodSandboxStatusRequest, RemovePodSandboxRequest, RunPodSandboxRequest,
    StatusRequest, StopPodSandboxRequest, VersionRequest,
};
use sha2::{Digest as _, Sha256};
use tonic::transport::Channel;

use crate::{cni::REFERENCE_PLUGINS, ns::netns_path, wait};

/// The sandbox ("pause") image every pod gets.
pub const IMAGE: &str = "localhost/sluice-pause:test";
const PAUSE: &str = "/usr/bin/catatonit";

/// What the runtime needs on this machine, with the Debian package of each.
const NEEDS: [(&str, &str); 5] = [
    ("containerd", "containerd"),
    ("containerd-shim-runc-v2", "containerd"),
    ("ctr", "containerd"),
    ("runc", "runc"),
    ("catatonit", "catatonit"),
];

/// Why the runtime tests cannot run here, if they cannot.
pub fn unavailable() -> Option<String> {
    if !nix::unistd::Uid::effective().is_root() {
        return Some("needs root".into());
    }
    let missing: Vec<&str> = NEEDS
        .iter()
        .filter(|(bin, _)| which(bin).is_none())
        .map(|(_, pkg)| *pkg)
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "needs Debian's {} (`cargo xtask setup` installs them)",
            missing.join(", ")
        )
    })
}

fn which(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|d| d.join(bin))
        .find(|p| p.is_file())
}

/// One private containerd; stopped, and everything it made removed, on drop.
pub struct Containerd {
    pub dir: PathBuf,
    /// Where it looks for CNI configs and plugins.
    pub conf_dir: PathBuf,
    pub bin_dir: PathBuf,
    child: Option<Child>,
    rt: tokio::runtime::Runtime,
    client: Option<RuntimeServiceClient<Channel>>,
    cgroup_parent: String,
}

/// A sandbox the runtime made: its id, the netns path it gave the CNI
/// plugins, and the pod's address.
#[derive(Debug, Clone)]
pub struct Sandbox {
    pub id: String,
    pub netns: PathBuf,
    pub ip: std::net::IpAddr,
}

impl Sandbox {
    /// The netns's name under /run/netns (where containerd puts it).
    pub fn netns_name(&self) -> &str {
        self.netns
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
    }
}

impl Containerd {
    /// Prepares the directories (CNI bin dir: the reference plugins; the
    /// conf dir is the caller's to fill) without starting anything.
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        // Unix socket paths must stay under 108 bytes.
        let dir = PathBuf::from(format!("/tmp/slcr-{}-{tag}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let (conf_dir, bin_dir) = (dir.join("net.d"), dir.join("bin"));
        for d in [&dir, &conf_dir, &bin_dir] {
            fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        for e in fs::read_dir(REFERENCE_PLUGINS)? {
            let e = e?;
            std::os::unix::fs::symlink(e.path(), bin_dir.join(e.file_name()))?;
        }
        Ok(Self {
            conf_dir,
            bin_dir,
            child: None,
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?,
            client: None,
            cgroup_parent: format!("slcr-{}-{tag}", std::process::id()),
            dir,
        })
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("run/containerd.sock")
    }

    /// Starts containerd in netns `node` (it reads the CNI conf dir as it is
    /// now, and reloads on renames within it), waits for its CRI to answer,
    /// and imports the sandbox image.
    pub fn start(&mut self, node: &str) -> anyhow::Result<()> {
        let runc = which("runc").context("runc not found")?;
        fs::write(self.dir.join("config.toml"), self.config(&runc))?;
        fs::create_dir_all(self.dir.join("run"))?;
        let log = fs::File::create(self.dir.join("containerd.log"))?;
        let ns = fs::File::open(netns_path(node))?;
        let fd = ns.as_raw_fd();
        let mut cmd = Command::new(which("containerd").context("containerd not found")?);
        cmd.arg("--config")
            .arg(self.dir.join("config.toml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // SAFETY: setns is async-signal-safe; the fd stays open until spawn returns.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        self.child = Some(cmd.spawn().context("starting containerd")?);
        drop(ns);
        let sock = self.socket();
        let client = wait::until("containerd's CRI to answer", wait::DEADLINE, || {
            self.rt
                .block_on(async {
                    let mut c = connect(&sock).await.map_err(|e| e.to_string())?;
                    c.version(VersionRequest {
                        version: "v1".into(),
                    })
                    .await
                    .map_err(|e| e.to_string())?;
                    Ok::<_, String>(c)
                })
                .map_err(|e| (e, self.log()))
        })?;
        self.client = Some(client);
        self.import_image()
    }

    /// containerd's log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
    }

    fn config(&self, runc: &Path) -> String {
        let d = self.dir.display();
        // Pod netns go to /run/netns (kubelet's default, not under our dir):
        // the tests reach them by name; `cleanup` removes any left.
        format!(
            r#"version = 2
root = "{d}/root"
state = "{d}/state"
plugin_dir = ""
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
# Exit at start rather than serve a socket without CRI.
required_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "{d}/run/containerd.sock"
[ttrpc]
  address = "{d}/run/containerd-ttrpc.sock"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{IMAGE}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  disable_apparmor = true
  # A session without CAP_SYS_RESOURCE cannot give the pause process -998.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "{snapshotter}"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        Root = "{d}/runc"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{bin}"
    conf_dir = "{conf}"
    max_conf_num = 1
"#,
            runc = runc.display(),
            snapshotter = self.snapshotter(),
            bin = self.bin_dir.display(),
            conf = self.conf_dir.display(),
        )
    }

    /// How image layers are unpacked: overlayfs, unless the directory is on
    /// an overlayfs itself (a test VM's root), which cannot be an overlay's
    /// upper layer; then plain copies.
    fn snapshotter(&self) -> &'static str {
        const OVERLAYFS_SUPER_MAGIC: i64 = 0x794c_7630;
        match nix::sys::statfs::statfs(&self.dir) {
            Ok(st) if st.filesystem_type().0 == OVERLAYFS_SUPER_MAGIC => "native",
            _ => "overlayfs",
        }
    }

    /// Builds the sandbox image (an OCI layout: one layer holding the static
    /// pause binary) and imports it with `ctr`.
    fn import_image(&self) -> anyhow::Result<()> {
        let tar = self.dir.join("pause.tar");
        pause_image(&self.dir.join("image"), &tar)?;
        let out = Command::new(which("ctr").context("ctr not found")?)
            .arg("--address")
            .arg(self.socket())
            .args(["-n", "k8s.io", "images", "import", "--snapshotter"])
            .arg(self.snapshotter())
            .arg(&tar)
            .output_bounded()?;
        ensure!(
            out.status.success(),
            "ctr images import: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    fn client(&self) -> anyhow::Result<RuntimeServiceClient<Channel>> {
        self.client.clone().context("containerd not started")
    }

    /// RunPodSandbox for pod `namespace/name` with `uid`, as kubelet asks for
    /// it (the pod's netns, ipc shared); `Err` carries the runtime's message
    /// (a failing CNI plugin's among it).
    pub fn run_pod(&self, namespace: &str, name: &str, uid: &str) -> anyhow::Result<Sandbox> {
        let config = PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: name.into(),
                uid: uid.into(),
                namespace: namespace.into(),
                attempt: 0,
            }),
            hostname: name.into(),
            linux: Some(LinuxPodSandboxConfig {
                cgroup_parent: format!("/{}", self.cgroup_parent),
                security_context: Some(LinuxSandboxSecurityContext {
                    namespace_options: Some(NamespaceOption {
                        network: 0, // POD
                        pid: 1,     // CONTAINER
                        ipc: 0,     // POD
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut c = self.client()?;
        let id = self
            .rt
            .block_on(c.run_pod_sandbox(RunPodSandboxRequest {
                config: Some(config),
                runtime_handler: String::new(),
            }))
            .map_err(|s| anyhow::anyhow!("RunPodSandbox {namespace}/{name}: {}", s.message()))?
            .into_inner()
            .pod_sandbox_id;
        self.sandbox(&id)
    }

    /// The sandbox `id` as the runtime reports it (verbose status: the netns
    /// path is only in its info).
    pub fn sandbox(&self, id: &str) -> anyhow::Result<Sandbox> {
        let mut c = self.client()?;
        let st = self
            .rt
            .block_on(c.pod_sandbox_status(PodSandboxStatusRequest {
                pod_sandbox_id: id.into(),
                verbose: true,
            }))?
            .into_inner();
        let ip = st
            .status
            .as_ref()
            .and_then(|s| s.network.as_ref())
            .map(|n| n.ip.parse())
            .context("no pod address in the sandbox status")??;
        let info: serde_json::Value = serde_json::from_str(
            st.info
                .get("info")
                .context("no info in the verbose sandbox status")?,
        )?;
        let netns = info["runtimeSpec"]["linux"]["namespaces"]
            .as_array()
            .and_then(|a| a.iter().find(|n| n["type"] == "network"))
            .and_then(|n| n["path"].as_str())
            .context("no network namespace in the sandbox's runtime spec")?;
        Ok(Sandbox {
            id: id.into(),
            netns: netns.into(),
            ip,
        })
    }

    /// StopPodSandbox (CNI DEL while the netns still exists) and
    /// RemovePodSandbox, as kubelet does when a pod goes.
    pub fn remove_pod(&self, id: &str) -> anyhow::Result<()> {
        let mut c = self.client()?;
        self.rt
            .block_on(async {
                c.stop_pod_sandbox(StopPodSandboxRequest {
                    pod_sandbox_id: id.into(),
                })
                .await?;
                c.remove_pod_sandbox(RemovePodSandboxRequest {
                    pod_sandbox_id: id.into(),
                })
                .await?;
                Ok::<_, tonic::Status>(())
            })
            .map_err(|s| anyhow::anyhow!("removing sandbox {id}: {}", s.message()))
    }

    /// The CNI networks containerd has loaded, as its CRI status reports
    /// them (`crictl info`'s `cniconfig`: each network's config source).
    pub fn cni_networks(&self) -> anyhow::Result<String> {
        let mut c = self.client()?;
        let info = self
            .rt
            .block_on(c.status(StatusRequest { verbose: true }))?
            .into_inner()
            .info;
        let conf = info
            .get("cniconfig")
            .context("no cniconfig in the CRI status")?;
        // The sources are JSON strings inside JSON: compare them unescaped
        // and without whitespace.
        let v: serde_json::Value = serde_json::from_str(conf)?;
        let sources: Vec<String> = v["Networks"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|n| n["Config"]["Source"].as_str())
            .map(|s| s.split_whitespace().collect())
            .collect();
        Ok(sources.join("\n"))
    }

    /// The ids of the sandboxes the runtime has.
    pub fn sandboxes(&self) -> anyhow::Result<Vec<String>> {
        let mut c = self.client()?;
        Ok(self
            .rt
            .block_on(c.list_pod_sandbox(ListPodSandboxRequest { filter: None }))?
            .into_inner()
            .items
            .into_iter()
            .map(|s| s.id)
            .collect())
    }

    /// Sandbox and container ids containerd ever recorded here (from its
    /// state on disk: also after a crash).
    fn recorded_ids(&self) -> Vec<String> {
        [
            "root/io.containerd.grpc.v1.cri/sandboxes",
            "state/io.containerd.runtime.v2.task/k8s.io",
        ]
        .iter()
        .filter_map(|d| fs::read_dir(self.dir.join(d)).ok())
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
    }

    /// Stops everything this instance made and removes it: sandboxes through
    /// the CRI (each gets its CNI DEL), containerd itself, then whatever a
    /// crash would leave (shims, pause processes, mounts, pod netns, CNI
    /// cache entries, shim sockets, cgroups), all found from what is
    /// provably ours.
    fn cleanup(&mut self) {
        if let Ok(ids) = self.sandboxes() {
            for id in ids {
                let _ = self.remove_pod(&id);
            }
        }
        self.client = None;
        let ids = self.recorded_ids();
        if let Some(mut c) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let exited = wait::until("containerd to exit", wait::DEADLINE, || {
                c.try_wait().ok().flatten().map(|_| ()).ok_or("running")
            });
            if exited.is_err() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        let sock = self.socket();
        // Shims of this instance name its socket; pause processes live in
        // its cgroup parent.
        let needle = format!("-address {}", sock.display());
        for p in fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let cmdline = fs::read(p.path().join("cmdline"))
                .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
                .unwrap_or_default();
            let in_cgroup = fs::read_to_string(p.path().join("cgroup"))
                .is_ok_and(|c| c.contains(&format!("/{}/", self.cgroup_parent)));
            if (cmdline.contains("containerd-shim") && cmdline.contains(&needle)) || in_cgroup {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        // Mounts under our directory, deepest first.
        let prefix = format!("{}/", self.dir.display());
        let mut mounts: Vec<String> = fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split_whitespace().nth(4).map(str::to_owned))
            .filter(|m| m.starts_with(&prefix))
            .collect();
        mounts.sort_by(|a, b| b.cmp(a));
        for m in mounts {
            let _ = nix::mount::umount2(m.as_str(), nix::mount::MntFlags::MNT_DETACH);
        }
        // CNI's result cache names each sandbox's netns; shim sockets are
        // named by a hash of our socket and the id.
        for id in &ids {
            for f in fs::read_dir("/var/lib/cni/results")
                .into_iter()
                .flatten()
                .flatten()
            {
                if !f.file_name().to_string_lossy().contains(&format!("-{id}-")) {
                    continue;
                }
                if let Ok(v) = serde_json::from_slice::<serde_json::Value>(
                    &fs::read(f.path()).unwrap_or_default(),
                ) {
                    let sandboxes = v["result"]["interfaces"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|i| i["sandbox"].as_str())
                        .filter(|s| s.contains("/netns/cni-"));
                    for ns in sandboxes {
                        let _ = nix::mount::umount2(ns, nix::mount::MntFlags::MNT_DETACH);
                        let _ = fs::remove_file(ns);
                    }
                }
                let _ = fs::remove_file(f.path());
            }
            let hash = Sha256::digest(format!("{}/k8s.io/{id}", sock.display()));
            let _ = fs::remove_file(format!("/run/containerd/s/{}", hex(&hash)));
        }
        for d in [
            "/run/containerd/s",
            "/run/containerd",
            "/var/lib/cni/results",
        ] {
            let _ = fs::remove_dir(d);
        }
        // Our cgroup parent in every hierarchy, deepest first.
        for h in fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
        {
            remove_cgroup_tree(&h.path().join(&self.cgroup_parent));
        }
        remove_cgroup_tree(&Path::new("/sys/fs/cgroup").join(&self.cgroup_parent));
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        self.cleanup();
    }
}

async fn connect(sock: &Path) -> anyhow::Result<RuntimeServiceClient<Channel>> {
    let sock = sock.to_owned();
    let channel = tonic::transport::Endpoint::try_from("http://[::]")?
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let sock = sock.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(sock).await?,
                ))
            }
        }))
        .await?;
    Ok(RuntimeServiceClient::new(channel))
}

fn remove_cgroup_tree(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup_tree(&e.path());
            }
        }
        let _ = fs::remove_dir(dir);
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes an OCI image layout for [`IMAGE`] under `work` and tars it to
/// `out`: one uncompressed layer with the static pause binary, run as
/// `catatonit -P` (pause mode).
fn pause_image(work: &Path, out: &Path) -> anyhow::Result<()> {
    let blobs = work.join("blobs/sha256");
    let rootfs = work.join("rootfs");
    fs::create_dir_all(&blobs)?;
    fs::create_dir_all(&rootfs)?;
    fs::copy(PAUSE, rootfs.join("catatonit")).with_context(|| format!("copying {PAUSE}"))?;
    let layer = work.join("layer.tar");
    tar(&rootfs, &layer, &["catatonit"])?;
    let blob = |bytes: &[u8]| -> anyhow::Result<(String, usize)> {
        let digest = hex(&Sha256::digest(bytes));
        fs::write(blobs.join(&digest), bytes)?;
        Ok((digest, bytes.len()))
    };
    let (layer_digest, layer_size) = blob(&fs::read(&layer)?)?;
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": ["/catatonit", "-P"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{layer_digest}")]},
    });
    let (config_digest, config_size) = blob(config.to_string().as_bytes())?;
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": format!("sha256:{config_digest}"), "size": config_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": format!("sha256:{layer_digest}"), "size": layer_size}],
    });
    let (manifest_digest, manifest_size) = blob(manifest.to_string().as_bytes())?;
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": format!("sha256:{manifest_digest}"), "size": manifest_size,
                       "platform": {"architecture": "amd64", "os": "linux"},
                       "annotations": {"io.containerd.image.name": IMAGE,
                                       "org.opencontainers.image.ref.name": "test"}}],
    });
    fs::write(work.join("index.json"), index.to_string())?;
    fs::write(work.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#)?;
    tar(work, out, &["oci-layout", "index.json", "blobs"])
}

fn tar(dir: &Path, out: &Path, what: &[&str]) -> anyhow::Result<()> {
    let st = Command::new("tar")
        .arg("-C")
        .arg(dir)
        .args(["--owner=0", "--group=0", "--numeric-owner", "-cf"])
        .arg(out)
        .args(what)
        .status()?;
    if !st.success() {
        bail!("tar of {} failed: {st}", dir.display());
    }
    Ok(())
}

//! Shared test fixtures: a topology with an app, a remote server and
//! (optionally) the ztunnel stand-in, enrolled with sluice.

use std::path::PathBuf;

use sluice::{
    dataplane::features::{Features, TcAttach},
    dataplane::loader::Dataplane,
    dataplane::state::{Maps, PodRecord},
    podnet::enroll::{self, Enrolled},
    uid::PodUid,
    workload::Workload,
};

use crate::{
    app::{App, UdpEcho},
    standin::{Bind, StandIn},
    topology::Topology,
    wait,
};

pub const APP_PORT: u16 = 8080;
pub const REMOTE_PORT: u16 = 9090;
pub const UDP_PORT: u16 = 5353;

pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

thread_local! {
    static AS_IF_KERNEL: std::cell::Cell<Option<Features>> = const { std::cell::Cell::new(None) };
    static TC_ATTACH: std::cell::Cell<TcAttach> = const { std::cell::Cell::new(TcAttach::ClsBpf) };
    static LOCAL_ROUTE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Pods a [`Fixture`] put on the local route on this thread.
    static ON_LOCAL_ROUTE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// How many pods [`Fixture`] enrollments on this thread put on the local
/// route since the count was last taken (a `local_route` variant that put
/// none tested nothing new).
pub fn take_local_route_count() -> u32 {
    ON_LOCAL_ROUTE.replace(0)
}

/// Runs `f` with every [`Fixture`] and agent it makes on this thread
/// putting pods' TCP on the local route (`--local-route`). A test of it on
/// a kernel that cannot offer it is skipped by the caller
/// ([`local_route_available`]).
pub fn on_local_route<R>(f: impl FnOnce() -> R) -> R {
    // Reset also when `f` panics: the thread runs other tests next.
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            LOCAL_ROUTE.set(false);
        }
    }
    LOCAL_ROUTE.set(true);
    let _reset = Reset;
    f()
}

/// Whether [`on_local_route`] is in force on this thread.
pub fn local_route_on() -> bool {
    LOCAL_ROUTE.get()
}

/// Whether this kernel can offer the local route (tc programs that read a
/// packet's netns: Linux ≥ 6.15).
pub fn local_route_available() -> bool {
    Features::get().netns_cookie_in_tc
}

/// Runs `f` with every [`Fixture`] and agent it makes on this thread
/// attaching tc programs with tcx links instead of the default cls_bpf
/// filters (`--tc-attach tcx`). A test of it on a kernel without tcx is
/// skipped by the caller ([`tcx_available`]).
pub fn attaching_with_tcx<R>(f: impl FnOnce() -> R) -> R {
    // Reset also when `f` panics: the thread runs other tests next.
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            TC_ATTACH.set(TcAttach::ClsBpf);
        }
    }
    TC_ATTACH.set(TcAttach::Tcx);
    let _reset = Reset;
    f()
}

/// Whether this kernel has tcx (else the tcx variants are skipped).
pub fn tcx_available() -> bool {
    Features::get().tcx
}

/// Runs `f` with every [`Fixture`] it makes on this thread loading its
/// dataplane as if the kernel offered only `features`: the fallbacks for
/// older kernels, tested on this one.
pub fn as_if_kernel<R>(features: Features, f: impl FnOnce() -> R) -> R {
    // Reset also when `f` panics: the thread runs other tests next.
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            AS_IF_KERNEL.set(None);
        }
    }
    AS_IF_KERNEL.set(Some(features));
    let _reset = Reset;
    f()
}

/// The environment that makes a `sluice` process see the kernel as
/// [`as_if_kernel`] set it on this thread (the features it turns off), and
/// attach as [`attaching_with_tcx`] chose.
pub fn as_if_kernel_env() -> Vec<(&'static str, String)> {
    let mut env: Vec<(&'static str, String)> = features_env().into_iter().collect();
    if TC_ATTACH.get() == TcAttach::Tcx {
        env.push(("SLUICE_TC_ATTACH", "tcx".into()));
    }
    if LOCAL_ROUTE.get() {
        env.push(("SLUICE_LOCAL_ROUTE", "true".into()));
    }
    env
}

fn features_env() -> Option<(&'static str, String)> {
    let (f, real) = (AS_IF_KERNEL.get()?, Features::get());
    let off: Vec<&str> = [
        ("sk_lookup", f.sk_lookup, real.sk_lookup),
        ("tcx", f.tcx, real.tcx),
        (
            "netns_cookie_in_tc",
            f.netns_cookie_in_tc,
            real.netns_cookie_in_tc,
        ),
    ]
    .into_iter()
    .filter(|(_, on, real)| !on && *real)
    .map(|(name, ..)| name)
    .collect();
    (!off.is_empty()).then(|| (sluice::dataplane::features::DISABLE_ENV, off.join(",")))
}

/// This kernel's features without `bpf_get_netns_cookie` in tc programs
/// (as on Linux < 6.15).
pub fn without_netns_cookie_in_tc() -> Features {
    Features {
        netns_cookie_in_tc: false,
        ..Features::get()
    }
}

/// This kernel's features as on Linux < 6.6: no tcx (cls_bpf filters), and
/// so no netns cookies in tc either.
pub fn without_tcx() -> Features {
    Features {
        tcx: false,
        ..without_netns_cookie_in_tc()
    }
}

/// A pod netns with an app on 8080, a "remote" server on 9090 in the client
/// netns, UDP echo services on both sides, and optionally the stand-in.
pub struct Fixture {
    pub uid: PodUid,
    /// The kernel features its dataplane is loaded with (`None`: the probed
    /// ones), from [`as_if_kernel`] when it was made.
    features: Option<Features>,
    /// How its dataplane attaches tc programs ([`attaching_with_tcx`]).
    tc_attach: TcAttach,
    /// Its pods' TCP takes the local route ([`on_local_route`]).
    local_route: bool,
    pub app: App,
    pub remote: App,
    pub standin: Option<StandIn>,
    _udp: (UdpEcho, UdpEcho),
    // Last: dropped after the services, it removes the namespaces.
    pub topo: Topology,
}

impl Fixture {
    pub fn new(tag: &str, standin: Option<Bind>) -> anyhow::Result<Self> {
        Self::in_subnet(tag, standin, 0)
    }

    /// A fixture whose addresses are in subnet `n` (see [`Topology::with_subnet`]).
    pub fn in_subnet(tag: &str, standin: Option<Bind>, n: u8) -> anyhow::Result<Self> {
        let topo = Topology::with_subnet(tag, n)?;
        Ok(Self {
            uid: PodUid::new(&format!("pod-{tag}"))?,
            features: AS_IF_KERNEL.get(),
            tc_attach: TC_ATTACH.get(),
            local_route: LOCAL_ROUTE.get(),
            app: App::start(&topo.pod, APP_PORT),
            remote: App::start(&topo.client, REMOTE_PORT),
            standin: standin.map(|b| StandIn::start(&topo.pod, b)),
            _udp: (
                UdpEcho::start(&topo.pod, UDP_PORT),
                UdpEcho::start(&topo.client, UDP_PORT),
            ),
            topo,
        })
    }

    pub fn dataplane(&self) -> anyhow::Result<Dataplane> {
        let pins = self.topo.pins.clone();
        let mut dp = match self.features {
            Some(f) => Dataplane::load_or_adopt_with(pins, f)?,
            None => Dataplane::load_or_adopt(pins)?,
        };
        dp.set_tc_attach(self.tc_attach);
        dp.set_local_route(self.local_route);
        Ok(dp)
    }

    pub fn enroll(&self) -> anyhow::Result<Enrolled> {
        self.enroll_with(sluice::options::PodOptions::default())
    }

    /// Enrolls with the pod's capture options (its annotations).
    pub fn enroll_with(&self, options: sluice::options::PodOptions) -> anyhow::Result<Enrolled> {
        let mut dp = self.dataplane()?;
        let e = enroll::enroll_with(
            &mut dp,
            &self.topo.pod_netns_path(),
            &self.uid,
            &self.workload(),
            &options,
        )?;
        self.count_local_route(&dp, e.cookie);
        Ok(e)
    }

    /// Counts pod `cookie` for [`take_local_route_count`] when it is on the
    /// local route (for enrollments made with [`Fixture::dataplane`]).
    pub fn count_local_route(&self, dp: &Dataplane, cookie: u64) {
        if dp.maps().local_route(cookie).is_some() {
            ON_LOCAL_ROUTE.set(ON_LOCAL_ROUTE.get() + 1);
        }
    }

    /// Enrolls with the client netns as the node's: its sockets' connections
    /// to the pod are the host's own (kubelet's), exempt from capture.
    pub fn enroll_with_node(&self) -> anyhow::Result<Enrolled> {
        let mut dp = self.dataplane()?;
        dp.set_node(sluice::podnet::hostside::Node::open(
            &crate::ns::netns_path(&self.topo.client),
        )?)?;
        let e = enroll::enroll(
            &mut dp,
            &self.topo.pod_netns_path(),
            &self.uid,
            &self.workload(),
        )?;
        self.count_local_route(&dp, e.cookie);
        Ok(e)
    }

    pub fn workload(&self) -> Workload {
        Workload::new(self.uid.as_str(), "default", "default").expect("valid workload")
    }

    pub fn register(&self) -> anyhow::Result<Enrolled> {
        let mut dp = self.dataplane()?;
        Ok(enroll::register_uid(&mut dp, &self.uid)?)
    }

    /// Unenrolls the pod, with the client netns as the node's (where a
    /// kernel without tcx has the host-side filter to remove).
    pub fn unenroll(&self) -> anyhow::Result<()> {
        let mut maps = Maps::open_pinned(&self.topo.pins.maps())?;
        let node = sluice::podnet::hostside::Node::open(&crate::ns::netns_path(&self.topo.client))?;
        enroll::unenroll(&self.topo.pins, &mut maps, Some(&node), &self.uid)?;
        // Detached by the time unenroll returns, not later in the kernel's
        // deferred work: an sk_lookup program outliving the tc programs
        // would refuse the pod's inbound SYNs meanwhile.
        let left = crate::inspect::sk_lookup_programs(&self.topo.pod_netns_path())?;
        anyhow::ensure!(
            left.is_empty(),
            "sk_lookup programs left in the pod's netns after unenroll: {left:?}"
        );
        Ok(())
    }

    pub fn pod_record(&self) -> anyhow::Result<PodRecord> {
        self.pod_record_in(&self.topo.pins)
    }

    /// This pod's record in the pins at `pins` (pods enrolled by a shared agent).
    pub fn pod_record_in(
        &self,
        pins: &sluice::dataplane::loader::Pins,
    ) -> anyhow::Result<PodRecord> {
        let pods = sluice::status::read(pins)?;
        pods.into_iter()
            .find(|p| p.uid == self.uid.as_str())
            .ok_or_else(|| anyhow::anyhow!("pod {} not in status", self.uid))
    }

    /// Waits until this pod's state in its pins is `want`.
    pub fn wait_state(&self, want: &str) -> anyhow::Result<()> {
        self.wait_state_in(&self.topo.pins, want)
    }

    /// Waits until this pod's state in the pins at `pins` (an agent shared
    /// by several fixtures) is `want`.
    pub fn wait_state_in(
        &self,
        pins: &sluice::dataplane::loader::Pins,
        want: &str,
    ) -> anyhow::Result<()> {
        wait::until(
            &format!("pod {} to be {want}", self.uid),
            wait::DEADLINE,
            || match self.pod_record_in(pins).map(|r| r.state) {
                Ok(Some(s)) if s.as_str() == want => Ok(()),
                other => Err(format!("{other:?}")),
            },
        )
    }

    /// Waits until the pod has no listener in the socket map (closing a
    /// listener takes it out at once; this reads that state).
    pub fn wait_no_listeners(&self) -> anyhow::Result<()> {
        wait::until_seen(
            "the closed listeners out of the socket map",
            wait::DEADLINE,
            || self.pod_record().map(|r| r.listeners).ok(),
            |l| l.as_ref().is_some_and(|l| l.is_empty()),
        )
        .map(drop)
    }

    /// Waits until the kernel has dropped a SYN to this pod (fail closed)
    /// since `dropped` was read: a client is retrying.
    pub fn wait_dropped_after(&self, dropped: u64) -> anyhow::Result<()> {
        wait::until_seen(
            "a SYN dropped (fail closed)",
            wait::DEADLINE,
            || {
                self.pod_record()
                    .map(|r| r.counters.dropped_fail_closed)
                    .ok()
            },
            |d| d.is_some_and(|d| d > dropped),
        )
        .map(drop)
    }

    pub fn standin(&self) -> &StandIn {
        self.standin
            .as_ref()
            .expect("fixture started without the stand-in")
    }
}

/// The ZDS peer binary beside the running test or bench binary.
pub fn peer_bin() -> PathBuf {
    sluice_bin().with_file_name("sluice-zds-peer")
}

/// The `sluice` binary built beside the test executable (`cargo xtask test`
/// builds it first).
pub fn sluice_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/<test> or target/<profile>/<bin> → target/<profile>/sluice
    let mut dir = exe.parent().expect("target dir layout");
    if dir.ends_with("deps") {
        dir = dir.parent().expect("target dir layout");
    }
    let bin = dir.join("sluice");
    assert!(
        bin.exists(),
        "{} is missing: build it with `cargo build -p sluice` (cargo xtask test does)",
        bin.display()
    );
    bin
}

/// Whether the `sluice` binary was built with the `fault-injection` feature
/// (crash points; another build's object through SLUICE_EBPF_OBJECT_FILE):
/// the crash and upgrade tests need it, and `cargo xtask test` builds it so.
/// A plain `cargo build` does not: those tests are then skipped, with why.
pub fn has_fault_injection() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        let marker = b"sluice-fault-injection-build-v1";
        std::fs::read(sluice_bin()).is_ok_and(|b| b.windows(marker.len()).any(|w| w == marker))
    })
}

/// Whether an enrollment's answer (or a status line) shows the pod steering
/// to ztunnel: Enabled, or already Served (the served check runs apart from
/// the enrollment and may be quicker than the answer).
pub fn steering(text: &str) -> bool {
    text.contains("Enabled") || text.contains("Served")
}

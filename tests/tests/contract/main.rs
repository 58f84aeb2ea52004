//! The behaviour contract (docs/ARCHITECTURE.md), row by row, in real namespaces with
//! the real programs in the kernel. Each row has an IPv4 and an IPv6 test.
//! Needs root: without it every test is reported as ignored (skipped), with
//! the reason, never as passed.

mod agent;
mod chaos;
mod cni;
mod cni_emfile;
mod contract_rows;
mod crash;
mod cycles;
mod differential;
mod dns;
mod exclusions;
mod kube;
mod kube_exclusions;
mod lifecycle;
mod local_route;
mod metrics;
mod options;
mod probes;
mod readiness;
mod runtime;
mod served;
mod snapshot;
mod syncookies;
mod uninstall;
mod verify;
mod verify_agent;

use libtest_mimic::{Arguments, Failed, Trial};
use sluice_tests::harness::{
    attaching_with_tcx, has_fault_injection, is_root, local_route_available, on_local_route,
    sluice_bin, take_local_route_count, tcx_available,
};

pub type TestResult = anyhow::Result<()>;

pub fn trial(name: impl Into<String>, f: impl FnOnce() -> TestResult + Send + 'static) -> Trial {
    Trial::test(name, move || {
        f().map_err(|e| Failed::from(format!("{e:#}")))
    })
    .with_ignored_flag(!is_root())
}

/// [`trial`] attaching tc programs with tcx links (`--tc-attach tcx`)
/// instead of the default cls_bpf filters; skipped on a kernel without tcx.
pub fn tcx_trial(
    name: impl Into<String>,
    f: impl FnOnce() -> TestResult + Send + 'static,
) -> Trial {
    trial(name, move || attaching_with_tcx(f)).with_ignored_flag(!is_root() || !tcx_available())
}

/// [`trial`] with pods' TCP on the local route (`--local-route`); skipped
/// on a kernel that cannot offer it (Linux < 6.15). It fails when none of
/// its fixtures' pods was put on the local route (it would test nothing
/// new).
pub fn local_route_trial(
    name: impl Into<String>,
    f: impl FnOnce() -> TestResult + Send + 'static,
) -> Trial {
    trial(name, move || {
        take_local_route_count();
        on_local_route(f)?;
        anyhow::ensure!(
            take_local_route_count() > 0,
            "no pod of this local-route variant was put on the local route"
        );
        Ok(())
    })
    .with_ignored_flag(!is_root() || !local_route_available())
}

/// `t`, skipped when the `sluice` binary has no crash points (a plain
/// `cargo build`; `cargo xtask test` builds it with them).
pub fn needs_fault_injection(t: Trial) -> Trial {
    if has_fault_injection() {
        t
    } else {
        t.with_ignored_flag(true)
    }
}

fn main() {
    let args = Arguments::from_args();
    if !has_fault_injection() {
        eprintln!(
            "skipping the crash and upgrade tests: {} has no crash points (`cargo build -p sluice --bins --features fault-injection` builds them; `cargo xtask test` does)",
            sluice_bin().display()
        );
    }
    if !is_root() {
        eprintln!("skipping the dataplane tests: they need root (network namespaces, eBPF)");
    } else {
        if !tcx_available() {
            eprintln!(
                "skipping the tcx variants (`::tcx::`): this kernel has no tcx (Linux < 6.6)"
            );
        }
        if !local_route_available() {
            eprintln!("skipping the local route variants (`::local_route::`): this kernel's tc programs cannot read a packet's netns (Linux < 6.15)");
        }
    }
    let mut trials = Vec::new();
    trials.extend(contract_rows::trials());
    trials.extend(differential::trials());
    trials.extend(lifecycle::trials());
    trials.extend(local_route::trials());
    trials.extend(probes::trials());
    trials.extend(options::trials());
    trials.extend(exclusions::trials());
    trials.extend(kube_exclusions::trials());
    trials.extend(dns::trials());
    trials.extend(chaos::trials());
    trials.extend(agent::trials());
    trials.extend(crash::trials());
    trials.extend(cni::trials());
    trials.extend(cni_emfile::trials());
    trials.extend(runtime::trials());
    trials.extend(kube::trials());
    trials.extend(readiness::trials());
    trials.extend(served::trials());
    trials.extend(cycles::trials());
    trials.extend(metrics::trials());
    trials.extend(syncookies::trials());
    trials.extend(verify::trials());
    trials.extend(verify_agent::trials());
    trials.extend(uninstall::trials());
    trials.extend(snapshot::trials());
    libtest_mimic::run(&args, trials).exit();
}

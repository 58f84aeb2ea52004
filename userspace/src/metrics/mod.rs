//! The agent's Prometheus metrics (text format, `sluice_` prefix). Event
//! counts (enrollments, ZDS answers) are counted as they happen; pod states
//! and the kernel's per-pod counters are read from the pinned maps at each
//! scrape, so they say what the dataplane says, not what the agent believes.

mod labels;
mod scrape;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use prometheus_client::{
    encoding::text::encode,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{exponential_buckets, Histogram},
    },
    registry::{Registry, Unit},
};

pub use labels::{CniCommand, CniResult, Failure, Labels, ReconcileError};
use scrape::MapCollector;
pub use scrape::{Sample, Source};

use crate::readiness::Reason;

pub struct Metrics {
    registry: Registry,
    enrollments: Counter,
    failures: Family<Labels, Counter>,
    attach_seconds: Histogram,
    zds_answers: Family<Labels, Counter>,
    zds_older_acks: Counter,
    ztunnel_connected: Gauge,
    node_ready: Gauge,
    node_reason: Family<Labels, Gauge>,
    transitions: Family<Labels, Counter>,
    time_to_served: Histogram,
    served_checks: Family<Labels, Counter>,
    verifications: Family<Labels, Counter>,
    served_fallbacks: Gauge,
    served_recheck: Gauge,
    captured_late: Counter,
    repairs: Counter,
    repair_errors: Counter,
    claims_evicted: Counter,
    build_info: Family<Vec<(&'static str, String)>, Gauge>,
    cni_requests: Family<Labels, Counter>,
    cni_seconds: Family<Labels, Histogram>,
    teardown_seconds: Histogram,
    reconcile_errors: Family<Labels, Counter>,
}

impl Metrics {
    pub fn new(source: Arc<dyn Source>) -> Self {
        let mut m = Self {
            enrollments: Counter::default(),
            failures: Family::default(),
            attach_seconds: Histogram::new(exponential_buckets(0.005, 2.0, 10)),
            zds_answers: Family::default(),
            zds_older_acks: Counter::default(),
            ztunnel_connected: Gauge::default(),
            node_ready: Gauge::default(),
            node_reason: Family::default(),
            transitions: Family::default(),
            // 10 ms … ≈ 160 s.
            time_to_served: Histogram::new(exponential_buckets(0.01, 2.0, 15)),
            served_checks: Family::default(),
            verifications: Family::default(),
            served_fallbacks: Gauge::default(),
            served_recheck: Gauge::default(),
            captured_late: Counter::default(),
            repairs: Counter::default(),
            repair_errors: Counter::default(),
            claims_evicted: Counter::default(),
            build_info: Family::default(),
            cni_requests: Family::default(),
            // 1 ms … ≈ 16 s.
            cni_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 15))
            }),
            teardown_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 12)),
            reconcile_errors: Family::default(),
            registry: Registry::with_prefix("sluice"),
        };
        m.register_enrollment();
        m.register_node();
        m.registry
            .register_collector(Box::new(MapCollector(source)));
        m.init_label_values();
        m
    }

    /// What happens to pods: enrollments and their failures, ztunnel's
    /// answers, state changes, time to served, repairs, teardowns.
    fn register_enrollment(&mut self) {
        self.registry.register(
            "enrollments",
            "Pods whose capture was attached",
            self.enrollments.clone(),
        );
        self.registry.register(
            "enrollment_failures",
            "Failed enrollment attempts, by reason (attach, ztunnel_nack, zds_error, no_listeners, netns_unavailable)",
            self.failures.clone(),
        );
        self.registry.register_with_unit(
            "enrollment_attach",
            "Time to attach a pod's capture (programs, routes, state)",
            Unit::Seconds,
            self.attach_seconds.clone(),
        );
        self.registry.register(
            "zds_answers",
            "ztunnel's answers to add/del requests, by answer (ack, nack)",
            self.zds_answers.clone(),
        );
        self.registry.register(
            "zds_older_acks",
            "Acks from a ztunnel older than the one whose listeners the pod has (an old ztunnel that reconnected during an upgrade): the pod stays on the newer one's",
            self.zds_older_acks.clone(),
        );
        self.registry.register(
            "pod_transitions",
            "Pod state changes, by from and to state (`none`: not enrolled)",
            self.transitions.clone(),
        );
        self.registry.register_with_unit(
            "time_to_served",
            "From a pod's Enabled (ztunnel acked, listeners registered) until ztunnel was found to know its workload (Served)",
            Unit::Seconds,
            self.time_to_served.clone(),
        );
        self.registry.register(
            "captured_after_start",
            "Running ambient pods captured by the API reconcile rather than at their CNI ADD (the plugin was not in the conflist when their sandbox was made, they were labelled later, or they ran before sluice)",
            self.captured_late.clone(),
        );
        self.registry.register(
            "capture_repairs",
            "Enrolled pods whose capture verification found incomplete (a link or filter gone, an interface added) and completed",
            self.repairs.clone(),
        );
        self.registry.register(
            "capture_repair_errors",
            "Verifications of a pod's capture that could not complete it (out of descriptors, its netns unreadable, a kernel error): the pod is tried again after 1 s, 2 s, 4 s… up to the verification period",
            self.repair_errors.clone(),
        );
        self.registry.register(
            "address_claims_evicted",
            "Addresses the runtime gave a pod that another pod had claimed (a stale claim, or a pod that put a neighbour's address on its interface): the claim was removed",
            self.claims_evicted.clone(),
        );
        self.registry.register_with_unit(
            "teardown",
            "Time to remove a pod's capture (links, routes, map entries, pins)",
            Unit::Seconds,
            self.teardown_seconds.clone(),
        );
    }

    /// The node: ztunnel's connection, the node condition, the served
    /// check, the build, the plugin's requests and the API reconcile.
    fn register_node(&mut self) {
        self.registry.register(
            "ztunnel_connected",
            "1 when a ztunnel is connected and acked its snapshot",
            self.ztunnel_connected.clone(),
        );
        self.registry.register(
            "node_ready",
            "1 when the node condition is True",
            self.node_ready.clone(),
        );
        self.registry.register(
            "node_condition_reason",
            "1 for the node condition's current reason, 0 for the others",
            self.node_reason.clone(),
        );
        self.registry.register(
            "served_checks",
            "Reads of ztunnel's workloads (admin config_dump), by result (answered, failed)",
            self.served_checks.clone(),
        );
        self.registry.register(
            "capture_verifications",
            "Verifications of a pod's capture by running it (the programs at its hooks on synthetic packets), by result (verified, partial: some interfaces only looked at, failed)",
            self.verifications.clone(),
        );
        self.registry.register(
            "served_recheck_seconds",
            "How often served pods are checked again, in seconds: --served-recheck, or longer on a mesh whose config_dump reads would take more than 0.1 % of a core that often",
            self.served_recheck.clone(),
        );
        self.registry.register(
            "served_check_fallback",
            "ztunnels whose admin API does not answer, so their acks count as served (0 when the check works)",
            self.served_fallbacks.clone(),
        );
        self.registry.register(
            "build_info",
            "1, labelled with the agent's version, the kernel release and the features the dataplane uses on it, and the pinned dataplane's stamp",
            self.build_info.clone(),
        );
        self.registry.register(
            "cni_requests",
            "CNI requests the plugin forwarded, by command (ADD, DEL, CHECK) and result (ok, skipped, error)",
            self.cni_requests.clone(),
        );
        self.registry.register_with_unit(
            "cni_request",
            "Time the agent took to answer a CNI request, by command",
            Unit::Seconds,
            self.cni_seconds.clone(),
        );
        self.registry.register(
            "reconcile_errors",
            "What a reconcile pass with the API could not do, by reason (api, no_process, bad_annotation, enroll, unenroll)",
            self.reconcile_errors.clone(),
        );
    }

    pub fn enrolled(&self, attach: std::time::Duration) {
        self.enrollments.inc();
        self.attach_seconds.observe(attach.as_secs_f64());
    }

    /// A running pod was captured by the reconcile, not at its CNI ADD.
    pub fn captured_after_start(&self) {
        self.captured_late.inc();
    }

    /// An address the runtime gave a pod was taken from another pod's claim.
    pub fn address_claim_evicted(&self) {
        self.claims_evicted.inc();
    }

    /// An enrolled pod's capture was found incomplete and completed.
    pub fn capture_repaired(&self) {
        self.repairs.inc();
    }

    pub fn capture_repair_error(&self) {
        self.repair_errors.inc();
    }

    pub fn failed(&self, why: Failure) {
        self.failures
            .get_or_create(&vec![("reason", why.label())])
            .inc();
    }

    /// A pod's state changed (`None`: not enrolled).
    pub fn transition(&self, from: Option<&'static str>, to: Option<&'static str>) {
        self.transitions
            .get_or_create(&vec![
                ("from", from.unwrap_or("none")),
                ("to", to.unwrap_or("none")),
            ])
            .inc();
    }

    pub fn zds_answer(&self, ack: bool) {
        let answer = if ack { "ack" } else { "nack" };
        self.zds_answers
            .get_or_create(&vec![("answer", answer)])
            .inc();
    }

    pub fn older_ack(&self) {
        self.zds_older_acks.inc();
    }

    pub fn time_to_served(&self, d: std::time::Duration) {
        self.time_to_served.observe(d.as_secs_f64());
    }

    pub fn served_check(&self, answered: bool) {
        let result = if answered { "answered" } else { "failed" };
        self.served_checks
            .get_or_create(&vec![("result", result)])
            .inc();
    }

    /// One verification of a pod's capture: `verified`, `partial` or
    /// `failed`.
    pub fn capture_verification(&self, result: &'static str) {
        self.verifications
            .get_or_create(&vec![("result", result)])
            .inc();
    }

    pub fn set_served_recheck(&self, every: std::time::Duration) {
        self.served_recheck.set(every.as_secs() as i64);
    }

    pub fn set_served_fallbacks(&self, n: usize) {
        self.served_fallbacks.set(n as i64);
    }

    pub fn set_ztunnel_connected(&self, up: bool) {
        self.ztunnel_connected.set(up.into());
    }

    pub fn set_condition(&self, ready: bool, reason: Reason) {
        self.node_ready.set(ready.into());
        for r in Reason::ALL {
            self.node_reason
                .get_or_create(&vec![("reason", r.as_str())])
                .set((r == reason).into());
        }
    }

    /// The exposition text.
    /// Every label value a family can take starts at 0, so each series
    /// exists from the first scrape (`rate()` and alerts see a 0, not an
    /// absent series) and every family shows in /metrics.
    fn init_label_values(&self) {
        use CniCommand::*;
        for f in [
            Failure::Attach,
            Failure::Nack,
            Failure::Zds,
            Failure::NoListeners,
            Failure::Netns,
        ] {
            let _ = self.failures.get_or_create(&vec![("reason", f.label())]);
        }
        for a in ["ack", "nack"] {
            let _ = self.zds_answers.get_or_create(&vec![("answer", a)]);
        }
        for r in ["answered", "failed"] {
            let _ = self.served_checks.get_or_create(&vec![("result", r)]);
        }
        for r in ["verified", "partial", "failed"] {
            let _ = self.verifications.get_or_create(&vec![("result", r)]);
        }
        for cmd in [Add, Del, Check] {
            for result in [CniResult::Ok, CniResult::Skipped, CniResult::Error] {
                let _ = self
                    .cni_requests
                    .get_or_create(&vec![("command", cmd.label()), ("result", result.label())]);
            }
            let _ = self
                .cni_seconds
                .get_or_create(&vec![("command", cmd.label())]);
        }
        for r in [
            ReconcileError::Api,
            ReconcileError::NoProcess,
            ReconcileError::BadAnnotation,
            ReconcileError::Enroll,
            ReconcileError::Unenroll,
            ReconcileError::Exclusions,
        ] {
            let _ = self
                .reconcile_errors
                .get_or_create(&vec![("reason", r.label())]);
        }
        // Every enrollment starts with this one.
        let _ = self
            .transitions
            .get_or_create(&vec![("from", "none"), ("to", "Pending")]);
    }

    /// The agent's build, the kernel and the dataplane stamp (set once).
    pub fn set_build_info(&self, kernel: &str, stamp: &str) {
        self.build_info
            .get_or_create(&vec![
                ("version", env!("CARGO_PKG_VERSION").to_string()),
                ("kernel", kernel.to_string()),
                ("stamp", stamp.to_string()),
            ])
            .set(1);
    }

    pub fn cni_request(&self, cmd: CniCommand, result: CniResult, took: std::time::Duration) {
        let labels = vec![("command", cmd.label()), ("result", result.label())];
        self.cni_requests.get_or_create(&labels).inc();
        self.cni_seconds
            .get_or_create(&vec![("command", cmd.label())])
            .observe(took.as_secs_f64());
    }

    pub fn torn_down(&self, took: std::time::Duration) {
        self.teardown_seconds.observe(took.as_secs_f64());
    }

    pub fn reconcile_error(&self, why: ReconcileError) {
        self.reconcile_errors
            .get_or_create(&vec![("reason", why.label())])
            .inc();
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("encoding to a String cannot fail");
        out
    }
}

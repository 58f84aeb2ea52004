//! The agent's Prometheus metrics (text format, `sluice_` prefix). Event
//! counts (enrollments, ZDS answers) are counted as they happen; pod states
//! and the kernel's per-pod counters are read from the pinned maps at each
//! scrape, so they say what the dataplane says, not what the agent believes.

use std::{fmt, sync::Arc};

use prometheus_client::{
    collector::Collector,
    encoding::{text::encode, DescriptorEncoder, EncodeMetric},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::{ConstGauge, Gauge},
        histogram::{exponential_buckets, Histogram},
    },
    registry::{Registry, Unit},
};

use sluice_common::Counters;

use crate::readiness::Reason;

type Labels = Vec<(&'static str, &'static str)>;

/// What the maps say at scrape time.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// Pods by state name (Pending, Enabled, Served, Draining, Unknown).
    pub pods: Vec<(&'static str, u64)>,
    /// The kernel counters of enrolled pods plus those of pods since removed.
    pub kernel: Counters,
    /// The DNS capture counters, the same way.
    pub dns: sluice_common::DnsCounters,
    /// Enrolled pods by DNS mode (captured, pass-through, off).
    pub dns_modes: Vec<(&'static str, u64)>,
    /// Node-wide drops by reason (`DropReason`).
    pub drops: Vec<(&'static str, u64)>,
    /// Enrolled pods whose capture the last repair could not complete.
    pub capture_incomplete: u64,
}

/// Where samples come from (the agent's node view).
pub trait Source: Send + Sync + 'static {
    fn sample(&self) -> Sample;
}

/// Why an enrollment attempt failed, as a label.
#[derive(Debug, Clone, Copy)]
pub enum Failure {
    /// Attaching capture (netns, links, routes, takeover) failed.
    Attach,
    /// ztunnel refused the pod.
    Nack,
    /// The ZDS exchange failed (timeout, connection closed).
    Zds,
    /// ztunnel acked but its listeners did not appear.
    NoListeners,
}

impl Failure {
    fn label(self) -> &'static str {
        match self {
            Failure::Attach => "attach",
            Failure::Nack => "ztunnel_nack",
            Failure::Zds => "zds_error",
            Failure::NoListeners => "no_listeners",
        }
    }
}

pub struct Metrics {
    registry: Registry,
    enrollments: Counter,
    failures: Family<Labels, Counter>,
    attach_seconds: Histogram,
    zds_answers: Family<Labels, Counter>,
    ztunnel_connected: Gauge,
    node_ready: Gauge,
    node_reason: Family<Labels, Gauge>,
    transitions: Family<Labels, Counter>,
    time_to_served: Histogram,
    served_checks: Family<Labels, Counter>,
    served_fallbacks: Gauge,
    captured_late: Counter,
    repairs: Counter,
    build_info: Family<Vec<(&'static str, String)>, Gauge>,
    cni_requests: Family<Labels, Counter>,
    cni_seconds: Family<Labels, Histogram>,
    teardown_seconds: Histogram,
    reconcile_errors: Family<Labels, Counter>,
}

/// A CNI command the plugin forwarded to the agent.
#[derive(Debug, Clone, Copy)]
pub enum CniCommand {
    Add,
    Del,
    Check,
}

impl CniCommand {
    fn label(self) -> &'static str {
        match self {
            Self::Add => "ADD",
            Self::Del => "DEL",
            Self::Check => "CHECK",
        }
    }
}

/// How the agent answered a CNI request.
#[derive(Debug, Clone, Copy)]
pub enum CniResult {
    /// Captured (ADD), released or nothing to do (DEL), in order (CHECK).
    Ok,
    /// Not captured on purpose (not ambient, excluded…): ADD only.
    Skipped,
    /// An error the plugin hands the runtime.
    Error,
}

impl CniResult {
    fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Skipped => "skipped",
            Self::Error => "error",
        }
    }
}

/// Why a pass of the reconcile with the API did not do all it meant to.
#[derive(Debug, Clone, Copy)]
pub enum ReconcileError {
    /// Listing pods or namespaces failed.
    Api,
    /// An ambient pod without capture has no process on the node yet.
    NoProcess,
    /// A pod annotation is malformed.
    BadAnnotation,
    /// Capturing a running pod failed.
    Enroll,
    /// Releasing a pod failed.
    Unenroll,
}

impl ReconcileError {
    fn label(self) -> &'static str {
        match self {
            Self::Api => "api",
            Self::NoProcess => "no_process",
            Self::BadAnnotation => "bad_annotation",
            Self::Enroll => "enroll",
            Self::Unenroll => "unenroll",
        }
    }
}

impl Metrics {
    pub fn new(source: Arc<dyn Source>) -> Self {
        let mut registry = Registry::with_prefix("sluice");
        let m = Self {
            enrollments: Counter::default(),
            failures: Family::default(),
            attach_seconds: Histogram::new(exponential_buckets(0.005, 2.0, 10)),
            zds_answers: Family::default(),
            ztunnel_connected: Gauge::default(),
            node_ready: Gauge::default(),
            node_reason: Family::default(),
            transitions: Family::default(),
            // 10 ms … ≈ 160 s.
            time_to_served: Histogram::new(exponential_buckets(0.01, 2.0, 15)),
            served_checks: Family::default(),
            served_fallbacks: Gauge::default(),
            captured_late: Counter::default(),
            repairs: Counter::default(),
            build_info: Family::default(),
            cni_requests: Family::default(),
            // 1 ms … ≈ 16 s.
            cni_seconds: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 15))
            }),
            teardown_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 12)),
            reconcile_errors: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "enrollments",
            "Pods whose capture was attached",
            m.enrollments.clone(),
        );
        registry.register(
            "enrollment_failures",
            "Failed enrollment attempts, by reason (attach, ztunnel_nack, zds_error, no_listeners)",
            m.failures.clone(),
        );
        registry.register_with_unit(
            "enrollment_attach",
            "Time to attach a pod's capture (programs, routes, state)",
            Unit::Seconds,
            m.attach_seconds.clone(),
        );
        registry.register(
            "zds_answers",
            "ztunnel's answers to add/del requests, by answer (ack, nack)",
            m.zds_answers.clone(),
        );
        registry.register(
            "ztunnel_connected",
            "1 when a ztunnel is connected and acked its snapshot",
            m.ztunnel_connected.clone(),
        );
        registry.register(
            "node_ready",
            "1 when the node condition is True",
            m.node_ready.clone(),
        );
        registry.register(
            "node_condition_reason",
            "1 for the node condition's current reason, 0 for the others",
            m.node_reason.clone(),
        );
        registry.register(
            "pod_transitions",
            "Pod state changes, by from and to state (`none`: not enrolled)",
            m.transitions.clone(),
        );
        registry.register_with_unit(
            "time_to_served",
            "From a pod's Enabled (ztunnel acked, listeners registered) until ztunnel was found to know its workload (Served)",
            Unit::Seconds,
            m.time_to_served.clone(),
        );
        registry.register(
            "served_checks",
            "Reads of ztunnel's workloads (admin config_dump), by result (answered, failed)",
            m.served_checks.clone(),
        );
        registry.register(
            "served_check_fallback",
            "ztunnels whose admin API does not answer, so their acks count as served (0 when the check works)",
            m.served_fallbacks.clone(),
        );
        registry.register(
            "captured_after_start",
            "Running ambient pods captured by the API reconcile rather than at their CNI ADD (the plugin was not in the conflist when their sandbox was made, they were labelled later, or they ran before sluice)",
            m.captured_late.clone(),
        );
        registry.register(
            "capture_repairs",
            "Enrolled pods whose capture verification found incomplete (a link or filter gone, an interface added) and completed",
            m.repairs.clone(),
        );
        registry.register(
            "build_info",
            "1, labelled with the agent's version, the kernel release and the features the dataplane uses on it, and the pinned dataplane's stamp",
            m.build_info.clone(),
        );
        registry.register(
            "cni_requests",
            "CNI requests the plugin forwarded, by command (ADD, DEL, CHECK) and result (ok, skipped, error)",
            m.cni_requests.clone(),
        );
        registry.register_with_unit(
            "cni_request",
            "Time the agent took to answer a CNI request, by command",
            Unit::Seconds,
            m.cni_seconds.clone(),
        );
        registry.register_with_unit(
            "teardown",
            "Time to remove a pod's capture (links, routes, map entries, pins)",
            Unit::Seconds,
            m.teardown_seconds.clone(),
        );
        registry.register(
            "reconcile_errors",
            "What a reconcile pass with the API could not do, by reason (api, no_process, bad_annotation, enroll, unenroll)",
            m.reconcile_errors.clone(),
        );
        registry.register_collector(Box::new(MapCollector(source)));
        m.init_label_values();
        Self { registry, ..m }
    }

    pub fn enrolled(&self, attach: std::time::Duration) {
        self.enrollments.inc();
        self.attach_seconds.observe(attach.as_secs_f64());
    }

    /// A running pod was captured by the reconcile, not at its CNI ADD.
    pub fn captured_after_start(&self) {
        self.captured_late.inc();
    }

    /// An enrolled pod's capture was found incomplete and completed.
    pub fn capture_repaired(&self) {
        self.repairs.inc();
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

    pub fn time_to_served(&self, d: std::time::Duration) {
        self.time_to_served.observe(d.as_secs_f64());
    }

    pub fn served_check(&self, answered: bool) {
        let result = if answered { "answered" } else { "failed" };
        self.served_checks
            .get_or_create(&vec![("result", result)])
            .inc();
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
        ] {
            let _ = self.failures.get_or_create(&vec![("reason", f.label())]);
        }
        for a in ["ack", "nack"] {
            let _ = self.zds_answers.get_or_create(&vec![("answer", a)]);
        }
        for r in ["answered", "failed"] {
            let _ = self.served_checks.get_or_create(&vec![("result", r)]);
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

/// Pod states and kernel counters, read at each scrape.
struct MapCollector(Arc<dyn Source>);

impl fmt::Debug for MapCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MapCollector")
    }
}

impl Collector for MapCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), fmt::Error> {
        let s = self.0.sample();
        let pods = ConstGauge::new(0i64);
        let mut m = enc.encode_descriptor(
            "pods",
            "Enrolled pods by state, from the pinned pod-state map",
            None,
            pods.metric_type(),
        )?;
        for (state, n) in &s.pods {
            let labels = [("state", *state)];
            ConstGauge::new(*n as i64).encode(m.encode_family(&labels)?)?;
        }
        let incomplete = ConstGauge::new(s.capture_incomplete as i64);
        incomplete.encode(enc.encode_descriptor(
            "pods_capture_incomplete",
            "Enrolled pods whose capture lacks links the last repair could not attach (part of their traffic bypasses ztunnel)",
            None,
            incomplete.metric_type(),
        )?)?;
        let k = &s.kernel;
        let captured = [
            ("inbound", k.captured_inbound),
            ("hbone", k.captured_hbone),
            ("outbound", k.captured_outbound),
        ];
        counters(
            &mut enc,
            "captured_connections",
            "Connections the kernel steered to ztunnel, by listener",
            "listener",
            &captured,
        )?;
        let failures = ConstCounter::new(
            crate::accept_errors::TOTAL.load(std::sync::atomic::Ordering::Relaxed),
        );
        let m = enc.encode_descriptor(
            "accept_failures",
            "Failed accepts on the agent's sockets (control, ZDS, admin), e.g. out of descriptors",
            None,
            failures.metric_type(),
        )?;
        failures.encode(m)?;
        let d = &s.dns;
        counters(
            &mut enc,
            "dns_queries",
            "DNS queries (UDP datagrams, TCP connections to port 53) of pods with DNS capture: sent to ztunnel's DNS proxy, or passed through to the resolver because the pod has no proxy socket or does not steer",
            "result",
            &[
                ("captured_udp", d.captured_udp),
                ("captured_tcp", d.captured_tcp),
                ("passthrough", d.passthrough),
            ],
        )?;
        counters(
            &mut enc,
            "dns_answers",
            "UDP answers of the DNS proxy: given the resolver's address back (restored), or with no recorded query, e.g. evicted from the flow map (unmapped)",
            "result",
            &[
                ("restored", d.replies_restored),
                ("unmapped", d.replies_unmapped),
            ],
        )?;
        let mut m = enc.encode_descriptor(
            "dns_pods",
            "Enrolled pods by DNS capture mode",
            None,
            pods.metric_type(),
        )?;
        for (mode, n) in &s.dns_modes {
            ConstGauge::new(*n as i64).encode(m.encode_family(&[("mode", *mode)])?)?;
        }
        counters(
            &mut enc,
            "bypassed_connections",
            "Connections deliberately not captured (probes, in-pod loopback)",
            "reason",
            &[("probe_or_local", k.bypassed)],
        )?;
        counters(
            &mut enc,
            "dropped_syns",
            "SYNs dropped to fail closed: pod not steering (Pending, Draining), or steering with ztunnel's listener gone",
            "reason",
            &[
                ("not_enabled", k.dropped_fail_closed),
                ("no_listener", k.missing_socket),
            ],
        )?;
        counters(
            &mut enc,
            "dropped_packets",
            "Packets the programs dropped for what they are, not for a pod's state (node-wide): malformed = IPv6 whose extension headers hide what it carries; unknown_source = a SYN from an address no pod has (kernels without netns cookies in tc); unhinted = a TCP segment to a listener that no tc program steered or exempted (an unknown path, a spoofed source over lo, a SYN-cookie ACK after its hint expired)",
            "reason",
            &s.drops,
        )?;
        Ok(())
    }
}

fn counters(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    label: &'static str,
    values: &[(&'static str, u64)],
) -> Result<(), fmt::Error> {
    let proto = ConstCounter::new(0u64);
    let mut m = enc.encode_descriptor(name, help, None, proto.metric_type())?;
    for (v, n) in values {
        let labels = [(label, *v)];
        ConstCounter::new(*n).encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed;
    impl Source for Fixed {
        fn sample(&self) -> Sample {
            Sample {
                pods: vec![("Enabled", 2), ("Pending", 1)],
                kernel: Counters {
                    captured_inbound: 7,
                    dropped_fail_closed: 3,
                    ..Default::default()
                },
                dns: sluice_common::DnsCounters {
                    captured_udp: 5,
                    replies_unmapped: 1,
                    ..Default::default()
                },
                dns_modes: vec![("captured", 2), ("off", 1)],
                drops: vec![("malformed", 4), ("unhinted", 2)],
                capture_incomplete: 1,
            }
        }
    }

    #[test]
    fn renders_prefixed_names_with_units_and_labels() {
        let m = Metrics::new(Arc::new(Fixed));
        m.enrolled(std::time::Duration::from_millis(40));
        m.failed(Failure::Nack);
        m.zds_answer(true);
        m.set_condition(false, Reason::ZtunnelDisconnected);
        m.time_to_served(std::time::Duration::from_millis(300));
        m.served_check(false);
        m.set_served_fallbacks(1);
        let text = m.render();
        for line in [
            "sluice_enrollments_total 1",
            "sluice_enrollment_failures_total{reason=\"ztunnel_nack\"} 1",
            "sluice_enrollment_attach_seconds_count 1",
            "sluice_zds_answers_total{answer=\"ack\"} 1",
            "sluice_node_ready 0",
            "sluice_node_condition_reason{reason=\"ZtunnelDisconnected\"} 1",
            "sluice_node_condition_reason{reason=\"RedirectionReady\"} 0",
            "sluice_pods{state=\"Enabled\"} 2",
            "sluice_pods_capture_incomplete 1",
            "sluice_captured_connections_total{listener=\"inbound\"} 7",
            "sluice_dropped_syns_total{reason=\"not_enabled\"} 3",
            "sluice_dropped_packets_total{reason=\"malformed\"} 4",
            "sluice_dropped_packets_total{reason=\"unhinted\"} 2",
            "sluice_dns_queries_total{result=\"captured_udp\"} 5",
            "sluice_dns_answers_total{result=\"unmapped\"} 1",
            "sluice_dns_pods{mode=\"captured\"} 2",
            "sluice_time_to_served_seconds_count 1",
            "sluice_served_checks_total{result=\"failed\"} 1",
            "sluice_served_check_fallback 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(text.ends_with("# EOF\n"));
    }
}

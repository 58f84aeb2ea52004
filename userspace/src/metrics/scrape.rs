//! What the pinned maps say at each scrape: the pod states and the kernel's
//! counters, encoded as constant metrics (never cached by the agent).

use std::{fmt, sync::Arc};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};
use sluice_common::Counters;

/// What the maps say at scrape time.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// Pods by state name (Pending, Enabled, Served, Draining, Unknown).
    pub pods: Vec<(&'static str, u64)>,
    /// The kernel counters of enrolled pods plus those of pods since removed.
    pub kernel: Counters,
    /// The DNS capture counters, the same way.
    pub dns: sluice_common::DnsCounters,
    /// Connections kept out of capture by pod exclusions, the same way.
    pub excluded: sluice_common::ExcludedCounters,
    /// Enrolled pods by DNS mode (captured, pass-through, off).
    pub dns_modes: Vec<(&'static str, u64)>,
    /// Node-wide drops by reason (`DropReason`).
    pub drops: Vec<(&'static str, u64)>,
    /// Node-wide flow hints written past their pod's share.
    pub hints_over_share: u64,
    /// Enrolled pods whose capture the last repair could not complete.
    pub capture_incomplete: u64,
    /// Held pods whose last verification failed (not served meanwhile).
    pub capture_unverified: u64,
    /// Enrolled pods whose TCP takes the local route (`--local-route`).
    pub local_route: u64,
}

/// Where samples come from (the agent's node view).
pub trait Source: Send + Sync + 'static {
    fn sample(&self) -> Sample;
}

/// Pod states and kernel counters, read at each scrape.
pub struct MapCollector(pub Arc<dyn Source>);

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
        for (name, help, n) in [
            ("pods_capture_incomplete", "Enrolled pods whose capture lacks links the last repair could not attach (part of their traffic bypasses ztunnel)", s.capture_incomplete),
            ("pods_capture_unverified", "Enrolled pods whose last verification of their capture failed (their traffic may bypass ztunnel; their readiness gate is False)", s.capture_unverified),
            ("pods_local_route", "Enrolled pods whose TCP takes the local route over lo (--local-route): captured connections get loopback's segment size", s.local_route),
        ] {
            gauge(&mut enc, name, help, n)?;
        }
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
        counter(
            &mut enc,
            "accept_failures",
            "Failed accepts on the agent's sockets (control, ZDS, admin), e.g. out of descriptors",
            crate::accept_errors::TOTAL.load(std::sync::atomic::Ordering::Relaxed),
        )?;
        counter(
            &mut enc,
            "flow_hints_over_share",
            "Flow hints written to the overflow map because their pod had left more than its share (256 a second) unreleased: SYN-cookie handshakes or unanswered SYNs, its own or a flood against it (node-wide)",
            s.hints_over_share,
        )?;
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
            "connections_excluded",
            "New connections (SYNs) kept out of capture by pods' exclusion annotations (traffic.sidecar.istio.io/*, with --pod-exclusions annotations): they bypass ztunnel",
            "direction",
            &[
                ("inbound", s.excluded.inbound),
                ("outbound", s.excluded.outbound),
            ],
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

/// One unlabelled counter.
fn counter(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), fmt::Error> {
    let c = ConstCounter::new(value);
    c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)
}

/// One unlabelled gauge.
fn gauge(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), fmt::Error> {
    let g = ConstGauge::new(value as i64);
    g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)
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

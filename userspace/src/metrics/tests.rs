//! The exposition: names, units and labels as scrapers see them.

use super::*;
use sluice_common::Counters;

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
            excluded: sluice_common::ExcludedCounters {
                inbound: 2,
                outbound: 9,
            },
            drops: vec![("malformed", 4), ("unhinted", 2)],
            hints_over_share: 6,
            capture_incomplete: 1,
            capture_unverified: 3,
            local_route: 2,
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
        "sluice_pods_capture_unverified 3",
        "sluice_pods_local_route 2",
        "sluice_captured_connections_total{listener=\"inbound\"} 7",
        "sluice_dropped_syns_total{reason=\"not_enabled\"} 3",
        "sluice_dropped_packets_total{reason=\"malformed\"} 4",
        "sluice_dropped_packets_total{reason=\"unhinted\"} 2",
        "sluice_flow_hints_over_share_total 6",
        "sluice_dns_queries_total{result=\"captured_udp\"} 5",
        "sluice_dns_answers_total{result=\"unmapped\"} 1",
        "sluice_dns_pods{mode=\"captured\"} 2",
        "sluice_connections_excluded_total{direction=\"inbound\"} 2",
        "sluice_connections_excluded_total{direction=\"outbound\"} 9",
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

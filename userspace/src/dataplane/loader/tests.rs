//! The embedded object's map layout, which a migration depends on.

#[test]
fn this_builds_object_parses_and_its_stamp_map_is_frozen() {
    let object = super::embedded_object();
    assert!(
        !object.is_empty(),
        "built without the eBPF object: `cargo xtask build-ebpf`, then test again"
    );
    let layout = crate::dataplane::stamp::of_object(object).unwrap();
    let stamp = layout["stamp"];
    assert_eq!(
        (stamp.key_size, stamp.value_size, stamp.max_entries),
        (4, 64, 1)
    );
    for m in [
        "pod_state",
        "pod_meta",
        "pod_addrs",
        "listeners",
        "counters",
        "flow_hints",
    ] {
        assert!(layout.contains_key(m), "{m} missing from {layout:?}");
    }
}

/// A migration copies entries byte for byte: a build that changes a
/// map's type, key or value size cannot take over a node running the
/// previous one (it keeps that build running). Such a change must come
/// with a conversion in `maps_next::fill`; then update this table.
#[test]
fn map_entries_keep_their_layout() {
    let layout = crate::dataplane::stamp::of_object(super::embedded_object()).unwrap();
    let seen: std::collections::BTreeMap<&str, (u32, u32, u32)> = layout
        .iter()
        .map(|(n, l)| (n.as_str(), (l.map_type, l.key_size, l.value_size)))
        .collect();
    let want = std::collections::BTreeMap::from([
        ("counters", (5, 8, 48)),
        ("dns_budget", (9, 8, 16)),
        ("dns_counters", (5, 8, 40)),
        ("dns_flows", (9, 24, 32)),
        ("dns_listeners", (18, 16, 4)),
        ("drops", (6, 4, 8)),
        ("excluded", (5, 8, 16)),
        ("flow_hints", (9, 40, 24)),
        ("flow_hints_overflow", (9, 40, 24)),
        ("hint_budget", (9, 8, 16)),
        ("hints_over_share", (6, 4, 8)),
        ("listeners", (18, 16, 4)),
        ("local_route", (1, 8, 4)),
        ("node_netns", (2, 4, 8)),
        ("pod_exclusions", (1, 8, 5004)),
        ("pod_flags", (1, 8, 4)),
        ("pod_reroute", (1, 8, 64)),
        ("pod_addrs", (1, 20, 8)),
        ("pod_meta", (1, 8, 828)),
        ("pod_state", (1, 8, 24)),
        ("stamp", (2, 4, 64)),
        ("tc_lookup", (6, 4, 4)),
        ("verify_hints", (1, 40, 24)),
    ]);
    assert_eq!(
        seen, want,
        "a map's entry layout changed: see this test's comment"
    );
}

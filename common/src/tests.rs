//! Layouts the kernel and every build agree on, and the state rules.

use super::*;
use core::mem::size_of;

#[test]
fn the_stamp_layout_never_changes() {
    assert_eq!(size_of::<Stamp>(), 64);
    assert_eq!(core::mem::offset_of!(Stamp, layout), 8);
    assert_eq!(core::mem::offset_of!(Stamp, version), 16);
}

#[test]
fn map_layouts_have_no_implicit_padding() {
    assert_eq!(size_of::<PodEntry>(), 24);
    assert_eq!(size_of::<ListenerKey>(), 16);
    assert_eq!(size_of::<Counters>(), 48);
    assert_eq!(size_of::<FlowKey>(), 16 + 16 + 2 + 2 + 1 + 3);
    assert_eq!(size_of::<FlowHint>(), 24);
    assert_eq!(size_of::<AddrKey>(), 20);
    assert_eq!(size_of::<IpRange>(), 36);
    assert_eq!(
        size_of::<Exclusions>(),
        12 + 3 * 2 * EXCLUSIONS_MAX + 2 * 36 * EXCLUSIONS_MAX
    );
    assert_eq!(size_of::<ExcludedCounters>(), 16);
}

#[test]
fn roles_and_ports_round_trip() {
    for r in Role::ALL {
        assert_eq!(Role::from_port(r.port()), Some(r));
    }
    assert_eq!(Role::from_port(80), None);
}

#[test]
fn only_enabled_and_served_steer() {
    for s in PodState::ALL {
        let e = PodEntry {
            state: s as u32,
            generation: 0,
            enrolled_at_ns: 0,
            changed_at_ns: 0,
        };
        assert_eq!(e.steers(), s.steers(), "{s:?}");
        assert_eq!(
            s.steers(),
            matches!(s, PodState::Enabled | PodState::Served)
        );
        assert_eq!(PodState::from_name(s.as_str()), Some(s));
    }
}

#[test]
fn unknown_state_is_not_enabled() {
    let e = PodEntry {
        state: 99,
        generation: 0,
        enrolled_at_ns: 0,
        changed_at_ns: 0,
    };
    assert!(!e.steers());
    assert_eq!(e.state(), None);
}

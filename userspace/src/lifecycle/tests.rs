use super::*;
use PodState::*;

const STATES: [Option<PodState>; 5] = [
    None,
    Some(Pending),
    Some(Enabled),
    Some(Served),
    Some(Draining),
];

/// The whole state table, written out: every state × every event that can
/// change it (`Err`: refused).
fn expected(from: Option<PodState>, event: &Event) -> Result<Option<PodState>, ()> {
    let e = event.name();
    Ok(match (from, e) {
        (None, "attach") => Some(Pending),
        (None, "drain" | "torn down") => None,
        (None, _) => return Err(()),
        (Some(_), "attach") => return Err(()),
        (Some(Draining), "listeners registered" | "listeners incomplete") => return Err(()),
        (Some(Served), "listeners registered") => Some(Served),
        (Some(_), "listeners registered") => Some(Enabled),
        (Some(_), "listeners incomplete") => Some(Pending),
        (Some(Draining), "listeners gone") => Some(Draining),
        (Some(_), "listeners gone") => Some(Pending),
        (Some(Enabled | Served), "served found") => Some(Served),
        (Some(Enabled | Served), "workload lost") => Some(Enabled),
        (s, "served found" | "workload lost") => s,
        (Some(_), "drain") => Some(Draining),
        (Some(Draining), "torn down") => None,
        (Some(_), "torn down") => return Err(()),
        _ => unreachable!("{e}"),
    })
}

#[test]
fn every_state_and_event() {
    for from in STATES {
        for event in Event::state_changing() {
            let got = decide(from, &event).map_err(|_| ());
            assert_eq!(
                got,
                expected(from, &event),
                "{} on {}",
                name(from),
                event.name()
            );
        }
    }
}

#[test]
fn track_only_events_never_change_the_state() {
    let z = Ztunnel::new(Some(9));
    for from in STATES {
        for event in [
            Event::UnenrollRequested,
            Event::AddSent,
            Event::RetryDue(Instant::now()),
            Event::Wait { why: "x".into() },
            Event::AddFailed {
                cause: Cause::Other,
                why: "x".into(),
            },
            Event::Acked(z),
            Event::SandboxOwned("c".into()),
            Event::Checked(None),
        ] {
            assert_eq!(decide(from, &event), Ok(from), "{}", event.name());
            assert!(!event.touches_state(), "{}", event.name());
            assert!(step_track(&Track::default(), &event, Instant::now()).is_ok());
        }
    }
    for event in Event::state_changing() {
        assert!(event.touches_state(), "{}", event.name());
        assert!(
            step_track(&Track::default(), &event, Instant::now()).is_err(),
            "{} must go through the map",
            event.name()
        );
    }
}

#[test]
fn only_a_steering_pod_becomes_served_and_draining_never_comes_back() {
    assert_eq!(
        decide(Some(Pending), &Event::ServedFound),
        Ok(Some(Pending))
    );
    assert!(decide(None, &Event::ServedFound).is_err());
    for event in Event::state_changing() {
        if let Ok(Some(to)) = decide(Some(Draining), &event) {
            assert_eq!(to, Draining, "{}", event.name());
        }
    }
    let e = IllegalTransition {
        cookie: 7,
        illegal: decide(Some(Draining), &Event::Attach).unwrap_err(),
    };
    assert!(e.to_string().contains("attach in state Draining"), "{e}");
}

/// The table in docs/ARCHITECTURE.md is this machine's.
#[test]
fn the_documented_table_is_the_codes() {
    let doc = include_str!("../../../docs/ARCHITECTURE.md");
    let rows: Vec<Vec<String>> = doc
        .split("<!-- state table -->")
        .nth(1)
        .expect("docs/ARCHITECTURE.md has a `<!-- state table -->` marker")
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().trim_matches('`').to_owned())
                .collect()
        })
        .collect();
    let events = Event::state_changing();
    let header: Vec<&str> = std::iter::once("state")
        .chain(events.iter().map(Event::name))
        .collect();
    assert_eq!(rows[0], header, "the table's columns");
    assert_eq!(rows.len(), 2 + STATES.len(), "a row for each state");
    for (row, from) in rows[2..].iter().zip(STATES) {
        assert_eq!(row[0], name(from));
        for (cell, event) in row[1..].iter().zip(&events) {
            let want = match decide(from, event) {
                Ok(to) if to == from => "·".to_owned(),
                Ok(to) => name(to).to_owned(),
                Err(_) => "✗".to_owned(),
            };
            assert_eq!(*cell, want, "{} on {}", name(from), event.name());
        }
    }
}

fn apply(state: &mut Option<PodState>, track: &mut Track, event: Event, at: Instant) -> Step {
    let s = step(*state, track, &event, at).unwrap();
    *state = s.state;
    *track = s.track.clone();
    s
}

fn waiting(t: &Track) -> Option<&Retry> {
    match &t.plan {
        Plan::Retry(r) => Some(r),
        _ => None,
    }
}

#[test]
fn a_failed_attempt_backs_off_and_says_why() {
    let (mut s, mut t) = (Some(Pending), Track::default());
    let now = Instant::now();
    let due = |s: &mut _, t: &mut _, at| {
        apply(s, t, Event::RetryDue(at), at)
            .effects
            .contains(&Effect::SendAdd)
    };
    assert!(due(&mut s, &mut t, now), "a new pod is due at once");
    assert!(!due(&mut s, &mut t, now), "not twice while in flight");
    let nack = Event::AddFailed {
        cause: Cause::ZtunnelRefused,
        why: "nack".into(),
    };
    apply(&mut s, &mut t, nack, now);
    assert!(!due(&mut s, &mut t, now), "backing off");
    assert_eq!(waiting(&t).unwrap().cause, Cause::ZtunnelRefused);
    assert!(due(&mut s, &mut t, now + RETRY_MIN));
    let reset = Event::AddFailed {
        cause: Cause::Other,
        why: "add failed: connection reset".into(),
    };
    apply(&mut s, &mut t, reset, now + RETRY_MIN);
    // The backoff doubled: one minimum interval is not enough any more.
    assert!(!due(&mut s, &mut t, now + RETRY_MIN * 2));
    let r = waiting(&t).unwrap();
    assert_eq!(
        r.last_error.as_deref(),
        Some("add failed: connection reset")
    );
    assert_eq!(
        r.cause,
        Cause::Other,
        "the last failure decides whose it is"
    );
    apply(&mut s, &mut t, Event::Acked(Ztunnel::new(Some(42))), now);
    let st = apply(&mut s, &mut t, Event::Registered { complete: true }, now);
    assert_eq!(s, Some(Enabled));
    assert_eq!(
        st.effects,
        [
            Effect::Announce,
            Effect::CheckServed,
            Effect::RecheckServed,
            Effect::Verify
        ]
    );
    assert_eq!(t.plan, Plan::Idle);
    assert_eq!(t.ztunnel, Some(Ztunnel::Pid(42)));
}

/// A verification's outcome is the track's; what changes whether the pod
/// passes (or which case fails) is reported, and nothing else is.
#[test]
fn a_verification_is_reported_when_it_passes_or_fails_anew() {
    let now = Instant::now();
    let t = Track::default();
    assert_eq!(t.verification, Verification::NotYet);
    let report = |t: &Track, v: Verification| {
        let s = step_track(t, &Event::Verified(v), now).unwrap();
        let reported = s.effects == [Effect::ReportVerification];
        assert!(reported || s.effects.is_empty(), "{:?}", s.effects);
        (s.track, reported)
    };
    let passed = Verification::Verified { unrun: Vec::new() };
    let (t, r) = report(&t, passed.clone());
    assert!(r, "first pass: the gate may turn True");
    assert_eq!(t.verified_at, Some(now));
    let (t, r) = report(&t, passed.clone());
    assert!(!r, "passing again is no news");
    let swapped = |case: &str| Verification::Failed {
        case: case.into(),
        detail: "program id 9 runs first".into(),
    };
    let (t, r) = report(&t, swapped("egress eth0"));
    assert!(r);
    let (t, r) = report(&t, swapped("egress eth0"));
    assert!(!r, "the same case failing again");
    let (t, r) = report(&t, swapped("ingress eth0"));
    assert!(r, "another case");
    let (t, r) = report(&t, passed);
    assert!(r && matches!(t.verification, Verification::Verified { .. }));
    // Not a state change: refused by the map, taken by the track.
    assert!(!Event::Verified(Verification::NotYet).touches_state());
}

#[test]
fn listeners_gone_waits_again_from_the_start() {
    let (mut s, mut t) = (Some(Served), Track::default());
    let st = apply(&mut s, &mut t, Event::ListenersGone, Instant::now());
    assert_eq!(s, Some(Pending));
    assert_eq!(st.effects, [Effect::Announce]);
    let r = waiting(&t).unwrap();
    assert_eq!(
        r.last_error.as_deref(),
        Some("ztunnel's listeners are gone")
    );
    assert!(r.due.is_none() && !r.in_flight);
}

#[test]
fn a_leaving_pod_is_never_offered_again() {
    let (mut s, mut t) = (Some(Pending), Track::default());
    let now = Instant::now();
    apply(&mut s, &mut t, Event::UnenrollRequested, now);
    assert_eq!((s, &t.plan), (Some(Pending), &Plan::Leaving));
    for _ in 0..2 {
        let st = apply(&mut s, &mut t, Event::RetryDue(now + RETRY_MAX), now);
        assert!(st.effects.is_empty());
        // A late answer or a snapshot cannot bring it back.
        for e in [
            Event::AddFailed {
                cause: Cause::ZtunnelRefused,
                why: "late nack".into(),
            },
            Event::AddSent,
            Event::Wait { why: "x".into() },
            Event::Registered { complete: true },
            Event::ListenersGone,
        ] {
            apply(&mut s, &mut t, e, now);
            assert_eq!(t.plan, Plan::Leaving);
        }
    }
    apply(&mut s, &mut t, Event::Drain, now);
    let st = apply(&mut s, &mut t, Event::TornDown, now);
    assert_eq!(s, None);
    assert_eq!(st.effects, [Effect::Announce, Effect::Forget]);
}

#[test]
fn an_incomplete_capture_is_reported_when_its_links_change() {
    let (mut s, mut t) = (Some(Served), Track::default());
    let now = Instant::now();
    let lacks = |reason: &str| {
        Event::Checked(Some(Incomplete {
            missing: vec!["egress_eth0".into()],
            reason: reason.into(),
        }))
    };
    let report = |st: Step| st.effects == [Effect::ReportCompleteness];
    assert!(report(apply(&mut s, &mut t, lacks("hook taken"), now)));
    assert!(!report(apply(&mut s, &mut t, lacks("other words"), now)));
    assert_eq!(t.incomplete.as_ref().unwrap().reason, "other words");
    assert!(report(apply(&mut s, &mut t, Event::Checked(None), now)));
    assert!(!report(apply(&mut s, &mut t, Event::Checked(None), now)));
    assert_eq!(s, Some(Served), "completeness is not a state");
}

#[test]
fn entering_draining_has_the_teardown_finished() {
    for from in [Pending, Enabled, Served] {
        let (mut s, mut t) = (Some(from), Track::default());
        let st = apply(&mut s, &mut t, Event::Drain, Instant::now());
        assert_eq!(s, Some(Draining));
        assert!(st.effects.contains(&Effect::FinishTeardown), "{from:?}");
        // Already Draining: no second one.
        let st = apply(&mut s, &mut t, Event::Drain, Instant::now());
        assert!(!st.effects.contains(&Effect::FinishTeardown));
    }
}

//! `sluice status`: what the pinned maps say, as a table or JSON. Needs no
//! running daemon: a fresh process opens the pins and reads.

use std::fmt::Write as _;

use crate::{
    loader::Pins,
    state::{boottime_ns, Maps, PodRecord},
};

/// Reads every enrolled pod from the pins; no pins means no pods.
pub fn read(pins: &Pins) -> Result<Vec<PodRecord>, crate::state::StateError> {
    if !pins.maps().join("pod_state").exists() {
        return Ok(Vec::new());
    }
    Ok(Maps::open_pinned(&pins.maps())?.pods())
}

fn age(ns: u64, now: u64) -> String {
    let s = now.saturating_sub(ns) / 1_000_000_000;
    match s {
        0..=119 => format!("{s}s"),
        120..=7199 => format!("{}m", s / 60),
        _ => format!("{}h", s / 3600),
    }
}

/// The human table.
pub fn table(pods: &[PodRecord]) -> String {
    let now = boottime_ns();
    let mut rows = vec![[
        "UID".to_string(),
        "STATE".into(),
        "AGE".into(),
        "LISTENERS".into(),
        "IN".into(),
        "HBONE".into(),
        "OUT".into(),
        "BYPASS".into(),
        "DROPPED".into(),
        "NO-SOCKET".into(),
        "NETNS".into(),
    ]];
    for p in pods {
        let c = &p.counters;
        rows.push([
            p.uid.clone(),
            p.state.unwrap_or("Unknown").into(),
            age(p.enrolled_at_ns, now),
            format!("{}/6", p.listeners.len()),
            c.captured_inbound.to_string(),
            c.captured_hbone.to_string(),
            c.captured_outbound.to_string(),
            c.bypassed.to_string(),
            c.dropped_fail_closed.to_string(),
            c.missing_socket.to_string(),
            p.netns.clone(),
        ]);
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .zip(&widths)
            .map(|(v, w)| format!("{v:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    if pods.is_empty() {
        out.push_str("(no pods enrolled)\n");
    }
    out
}

/// The JSON form: an array of pods.
pub fn json(pods: &[PodRecord]) -> String {
    serde_json::to_string_pretty(pods).expect("status records always serialise")
}

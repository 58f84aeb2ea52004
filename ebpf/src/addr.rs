//! Address classification on raw network-order words (as both the sk_lookup
//! context and packet headers hold them).

use sluice_common::{FAMILY_V4, PROBE_ADDR_V4, PROBE_ADDR_V6};

const fn word(b: &[u8], i: usize) -> u32 {
    u32::from_ne_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

const PROBE_V4: u32 = word(&PROBE_ADDR_V4, 0);
const PROBE_V6: [u32; 4] = [
    word(&PROBE_ADDR_V6, 0),
    word(&PROBE_ADDR_V6, 4),
    word(&PROBE_ADDR_V6, 8),
    word(&PROBE_ADDR_V6, 12),
];
const LOOPBACK_V6: [u32; 4] = [0, 0, 0, word(&[0, 0, 0, 1], 0)];

/// 127.0.0.0/8 or ::1.
#[inline(always)]
pub fn is_loopback(family: u8, a: &[u32; 4]) -> bool {
    if family == FAMILY_V4 {
        // First octet in memory order is the low byte of the native word.
        a[0].to_ne_bytes()[0] == 127
    } else {
        *a == LOOPBACK_V6
    }
}

/// The address kubelet probes come from (169.254.7.127 / fd16:9254:7127:1337:ffff:ffff:ffff:ffff).
#[inline(always)]
pub fn is_probe(family: u8, a: &[u32; 4]) -> bool {
    if family == FAMILY_V4 {
        a[0] == PROBE_V4
    } else {
        *a == PROBE_V6
    }
}

//! Per-pod budgets on the node-wide LRU maps (issue 38, case 3 and 4): a
//! pod's share is counted in a fixed window per pod (`sluice_common::Budget`,
//! keyed by netns cookie), so that one pod's flood is cut off at its share
//! instead of evicting its neighbours' entries.
//!
//! Racy across CPUs (plain adds, no atomics): a few uses more or fewer
//! than the budget may count, never a flood. The window bounds any drift.

use aya_ebpf::{helpers::bpf_ktime_get_ns, maps::LruHashMap};
use sluice_common::{Budget, BUDGET_WINDOW_NS};

/// Takes one use of the pod's budget in `map` (at most `limit` a window):
/// false, taking nothing, once they are spent.
#[inline(always)]
pub fn take(map: &LruHashMap<u64, Budget>, cookie: u64, limit: u32) -> bool {
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(b) = map.get_ptr_mut(cookie) else {
        let fresh = Budget {
            window_ns: now,
            used: 1,
            _pad: 0,
        };
        let _ = map.insert(cookie, fresh, 0);
        return true;
    };
    let b = unsafe { &mut *b };
    if now.wrapping_sub(b.window_ns) >= BUDGET_WINDOW_NS {
        b.window_ns = now;
        b.used = 1;
        return true;
    }
    if b.used >= limit {
        return false;
    }
    b.used += 1;
    true
}

/// Gives one use back to the pod's budget in `map` (what it took has been
/// released). A use taken in an earlier window is already forgotten.
#[inline(always)]
pub fn give_back(map: &LruHashMap<u64, Budget>, cookie: u64) {
    if let Some(b) = map.get_ptr_mut(cookie) {
        let b = unsafe { &mut *b };
        b.used = b.used.saturating_sub(1);
    }
}

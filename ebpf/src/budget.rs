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
/// the window it was taken in ([`Budget::window`]), or `None`, taking
/// nothing, once they are spent.
#[inline(always)]
pub fn take(map: &LruHashMap<u64, Budget>, cookie: u64, limit: u32) -> Option<u32> {
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(b) = map.get_ptr_mut(cookie) else {
        let fresh = Budget {
            window_ns: now,
            used: 1,
            window: 1,
        };
        let _ = map.insert(cookie, fresh, 0);
        return Some(1);
    };
    let b = unsafe { &mut *b };
    if now.wrapping_sub(b.window_ns) >= BUDGET_WINDOW_NS {
        b.window_ns = now;
        b.used = 1;
        b.window = b.window.wrapping_add(1).max(1);
        return Some(b.window);
    }
    if b.used >= limit {
        return None;
    }
    b.used += 1;
    Some(b.window)
}

/// Gives one use back to the pod's budget in `map` (what it took has been
/// released), whichever window it was taken in.
#[inline(always)]
pub fn give_back(map: &LruHashMap<u64, Budget>, cookie: u64) {
    if let Some(b) = map.get_ptr_mut(cookie) {
        let b = unsafe { &mut *b };
        b.used = b.used.saturating_sub(1);
    }
}

/// Gives one use back to the pod's budget in `map` if it was taken in the
/// window still running (`window`, from [`take`]): a use of an earlier
/// window was forgotten when the window reset, and giving it to this one
/// would let the pod hold more than its budget unanswered.
#[inline(always)]
pub fn give_back_in(map: &LruHashMap<u64, Budget>, cookie: u64, window: u32) {
    if let Some(b) = map.get_ptr_mut(cookie) {
        let b = unsafe { &mut *b };
        if b.window == window {
            b.used = b.used.saturating_sub(1);
        }
    }
}

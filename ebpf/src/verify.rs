//! Where a tc program's side effects go: the maps, for real traffic; for a
//! verification's test run (see `sluice_common::verify`), nowhere but the
//! test skb's control block, so that verifying a pod changes nothing any
//! real packet meets (no hint, no counter, no LRU entry evicted).

use aya_ebpf::programs::TcContext;
use sluice_common::{
    Counters, DnsCounters, DropReason, ExcludedCounters, FlowKey, HintVerdict, VERIFY_CB_COOKIE_HI,
    VERIFY_CB_COOKIE_LO, VERIFY_CB_VERDICT, VERIFY_MAGIC,
};

use crate::{
    hints,
    maps::{count, count_dns, count_drop},
};

#[derive(Clone, Copy)]
pub struct Writes {
    verifying: bool,
}

impl Writes {
    /// A packet from source port `sport`: a verification run's when that is
    /// 0 and its `cb[0]` holds the magic.
    #[inline(always)]
    pub fn of(ctx: &TcContext, sport: u16) -> Self {
        let verifying = sport == 0 && unsafe { (*ctx.skb.skb).cb[0] } == VERIFY_MAGIC;
        Self { verifying }
    }

    #[inline(always)]
    pub fn verifying(self) -> bool {
        self.verifying
    }

    #[inline(always)]
    pub fn count(self, cookie: u64, field: impl Fn(&mut Counters) -> &mut u64) {
        if !self.verifying {
            count(cookie, field)
        }
    }

    #[inline(always)]
    pub fn count_dns(self, cookie: u64, field: impl Fn(&mut DnsCounters) -> &mut u64) {
        if !self.verifying {
            count_dns(cookie, field)
        }
    }

    #[inline(always)]
    pub fn count_excluded(self, cookie: u64, field: impl Fn(&mut ExcludedCounters) -> &mut u64) {
        if !self.verifying {
            crate::exclusions::count(cookie, field)
        }
    }

    #[inline(always)]
    pub fn count_drop(self, reason: DropReason) {
        if !self.verifying {
            count_drop(reason)
        }
    }

    /// [`hints::put_charged_hint`], or the verdict in the test skb's `cb`.
    #[inline(always)]
    pub fn put_charged_hint(
        self,
        ctx: &TcContext,
        cookie: u64,
        key: &FlowKey,
        verdict: HintVerdict,
        flags: u32,
    ) {
        if self.verifying {
            report(ctx, cookie, verdict)
        } else {
            hints::put_charged_hint(cookie, key, verdict, flags)
        }
    }

    /// [`hints::put_hint`], or the verdict in the test skb's `cb`.
    #[inline(always)]
    pub fn put_hint(self, ctx: &TcContext, cookie: u64, key: &FlowKey, verdict: HintVerdict) {
        if self.verifying {
            report(ctx, cookie, verdict)
        } else {
            hints::put_hint(cookie, key, verdict)
        }
    }

    #[inline(always)]
    pub fn forget_hint(self, key: &FlowKey) {
        if !self.verifying {
            hints::forget_hint(key)
        }
    }
}

#[inline(always)]
fn report(ctx: &TcContext, cookie: u64, verdict: HintVerdict) {
    let skb = ctx.skb.skb;
    unsafe {
        (*skb).cb[VERIFY_CB_VERDICT] = verdict as u32;
        (*skb).cb[VERIFY_CB_COOKIE_LO] = cookie as u32;
        (*skb).cb[VERIFY_CB_COOKIE_HI] = (cookie >> 32) as u32;
    }
}

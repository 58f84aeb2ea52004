//! The programs' counters: per pod, per pod for DNS, and node-wide drops;
//! per CPU, summed when read.

use aya::maps::{MapData, PerCpuArray, PerCpuHashMap};
use sluice_common::{Counters, DnsCounters, DropReason, ExcludedCounters};

pub struct CounterMaps {
    counters: PerCpuHashMap<MapData, u64, Counters>,
    /// `None` on pins of a build before it, as `drops`.
    dns: Option<PerCpuHashMap<MapData, u64, DnsCounters>>,
    /// Node-wide drops by `DropReason`.
    drops: Option<PerCpuArray<MapData, u64>>,
    /// Node-wide hints written past their pod's share (entry 0).
    over_share: Option<PerCpuArray<MapData, u64>>,
    /// Connections kept out of capture by pod exclusions.
    excluded: Option<PerCpuHashMap<MapData, u64, ExcludedCounters>>,
    /// What the pods whose counters these maps removed had counted, however
    /// they went (an unenroll, a teardown the repairer finished): node
    /// totals that never go back while the agent runs. (An uninstall opens
    /// maps of its own; the agent exits after it.)
    retired: Retired,
}

/// Counts of pods gone, summed.
#[derive(Debug, Clone, Copy, Default)]
pub struct Retired {
    pub kernel: Counters,
    pub dns: DnsCounters,
    pub excluded: ExcludedCounters,
}

impl CounterMaps {
    pub fn new(
        counters: PerCpuHashMap<MapData, u64, Counters>,
        dns: Option<PerCpuHashMap<MapData, u64, DnsCounters>>,
        drops: Option<PerCpuArray<MapData, u64>>,
        over_share: Option<PerCpuArray<MapData, u64>>,
        excluded: Option<PerCpuHashMap<MapData, u64, ExcludedCounters>>,
    ) -> Self {
        Self {
            counters,
            dns,
            drops,
            over_share,
            excluded,
            retired: Retired::default(),
        }
    }

    /// What the pods whose counters were removed had counted.
    pub fn retired(&self) -> Retired {
        self.retired
    }

    pub fn excluded(&self, cookie: u64) -> ExcludedCounters {
        let mut sum = ExcludedCounters::default();
        if let Some(Ok(per_cpu)) = self.excluded.as_ref().map(|m| m.get(&cookie, 0)) {
            for c in per_cpu.iter() {
                sum.add(c);
            }
        }
        sum
    }

    pub fn counters(&self, cookie: u64) -> Counters {
        let mut sum = Counters::default();
        if let Ok(per_cpu) = self.counters.get(&cookie, 0) {
            for c in per_cpu.iter() {
                sum.add(c);
            }
        }
        sum
    }

    pub fn dns_counters(&self, cookie: u64) -> DnsCounters {
        let mut sum = DnsCounters::default();
        if let Some(Ok(per_cpu)) = self.dns.as_ref().map(|m| m.get(&cookie, 0)) {
            for c in per_cpu.iter() {
                sum.add(c);
            }
        }
        sum
    }

    /// Packets the programs dropped node-wide for `reason`, summed over CPUs.
    pub fn drops(&self, reason: DropReason) -> u64 {
        self.drops
            .as_ref()
            .and_then(|m| m.get(&(reason as u32), 0).ok())
            .map_or(0, |per_cpu| per_cpu.iter().sum())
    }

    /// Flow hints the programs wrote to the overflow map because their pod
    /// was past its share, node-wide, summed over CPUs.
    pub fn hints_over_share(&self) -> u64 {
        self.over_share
            .as_ref()
            .and_then(|m| m.get(&0, 0).ok())
            .map_or(0, |per_cpu| per_cpu.iter().sum())
    }

    pub fn remove_dns(&mut self, cookie: u64) {
        let last = self.dns_counters(cookie);
        if let Some(m) = &mut self.dns {
            if m.remove(&cookie).is_ok() {
                self.retired.dns.add(&last);
            }
        }
    }

    pub fn remove(&mut self, cookie: u64) {
        let (kernel, excluded) = (self.counters(cookie), self.excluded(cookie));
        if self.counters.remove(&cookie).is_ok() {
            self.retired.kernel.add(&kernel);
        }
        if let Some(m) = &mut self.excluded {
            if m.remove(&cookie).is_ok() {
                self.retired.excluded.add(&excluded);
            }
        }
    }

    /// The cookie of every pod with counters.
    pub fn cookies(&self) -> impl Iterator<Item = u64> + '_ {
        let excluded = self
            .excluded
            .iter()
            .flat_map(|m| m.keys().filter_map(Result::ok));
        self.counters.keys().filter_map(Result::ok).chain(excluded)
    }
}

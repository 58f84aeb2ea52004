//! The faults a run injects and when: drawn from a seed, or read back from a
//! file a failed run wrote (`--replay`), so the same schedule runs again.

use std::time::Duration;

use rand::{rngs::StdRng, Rng as _, SeedableRng as _};
use serde::{Deserialize, Serialize};

/// One fault. `slot` picks a live pod at the moment the fault is applied
/// (`slot % live pods`, in the order they were added): the same schedule
/// picks the same pods again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Fault {
    /// SIGKILL the agent, start it again.
    AgentKill,
    /// SIGTERM the agent, start it again.
    AgentTerm,
    /// SIGTERM the agent and start it over another build's programs (the
    /// upgrade tests' variant object), or back over this build's.
    AgentUpgrade,
    /// Lower the agent's descriptor limit to a few above what it holds
    /// (EMFILE on its next opens); `FdRestore` puts it back.
    FdLimit,
    FdRestore,
    /// Many connections to the agent's control socket at once, some
    /// sending half a request, held for a second.
    ControlFlood,
    /// SIGKILL the ztunnel peer (its proxied connections die with it),
    /// start a new one.
    PeerKill,
    /// Start a new peer, then SIGTERM the old one (ztunnel's rolling
    /// upgrade: the new listeners join the old ones' reuseport groups).
    PeerUpgradeNewFirst,
    /// SIGTERM the old peer, then start a new one (a gap without ztunnel).
    PeerUpgradeOldFirst,
    /// ztunnel's rolling upgrade across an agent restart (a node's
    /// DaemonSets rolled together): SIGKILL the agent, start a new peer,
    /// start the agent again; both peers reconnect, in any order; the old
    /// one is SIGTERMed once the new one has its snapshot.
    PeerUpgradeAcrossAgentRestart,
    /// The peer replaced by one that nacks every add; `PeerHeal` ends it.
    PeerNack,
    /// The peer replaced by one that opens the listeners but holds its
    /// acks; `PeerHeal` releases them.
    PeerHoldAcks,
    PeerHeal,
    /// A new pod: ptp ADD, then sluice-cni ADD, retried as the kubelet does.
    PodAdd,
    /// A pod's traffic stops, then sluice-cni DEL, ptp DEL, netns removed.
    PodDelete {
        slot: usize,
    },
    /// Several sluice-cni DELs for one pod at once, then its delete.
    DelStorm {
        slot: usize,
    },
    /// A late DEL for a sandbox the pod had before (another container id,
    /// a netns gone, same pod uid): the live capture must stay.
    StaleDel {
        slot: usize,
    },
    /// Behind sluice's back: a pod's egress filter deleted.
    FilterDelete {
        slot: usize,
    },
    /// Behind sluice's back: a pod's egress filter's program replaced by one
    /// that passes everything.
    ProgramReplace {
        slot: usize,
    },
    /// Behind sluice's back: a pod's pins under `pods/` removed.
    PinsRemoved {
        slot: usize,
    },
    /// A dummy interface added to a pod (`IfaceRemove` removes it).
    IfaceAdd {
        slot: usize,
    },
    IfaceRemove {
        slot: usize,
    },
    /// An address the runtime did not give the pod, added to its eth0.
    AddressAdd {
        slot: usize,
    },
    /// A pod floods the node-wide flow-hint map for 2 s: connections to its
    /// own closed port from two threads, each leaving a hint (what issue 38
    /// found a pod can do without privileges).
    HintFlood {
        slot: usize,
    },
    /// Another tool's `ingress` qdisc on a pod's host-side veth.
    ForeignQdisc {
        slot: usize,
    },
    /// Every core busy for `secs` seconds.
    CpuHog {
        secs: u64,
    },
    /// The runner's self-test: a pod's app connections go out with
    /// ztunnel's mark, which no capture touches: a bypass the invariants
    /// must catch.
    InjectBypass {
        slot: usize,
    },
}

impl Fault {
    /// The kind, as the report counts it.
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::AgentKill => "agent-kill",
            Fault::AgentTerm => "agent-term",
            Fault::AgentUpgrade => "agent-upgrade",
            Fault::FdLimit => "fd-limit",
            Fault::FdRestore => "fd-restore",
            Fault::ControlFlood => "control-flood",
            Fault::PeerNack => "peer-nack",
            Fault::PeerHoldAcks => "peer-hold-acks",
            Fault::PeerHeal => "peer-heal",
            Fault::PinsRemoved { .. } => "pins-removed",
            Fault::IfaceAdd { .. } => "iface-add",
            Fault::IfaceRemove { .. } => "iface-remove",
            Fault::AddressAdd { .. } => "address-add",
            Fault::HintFlood { .. } => "hint-flood",
            Fault::PeerKill => "peer-kill",
            Fault::PeerUpgradeNewFirst => "peer-upgrade-new-first",
            Fault::PeerUpgradeOldFirst => "peer-upgrade-old-first",
            Fault::PeerUpgradeAcrossAgentRestart => "peer-upgrade-across-agent-restart",
            Fault::PodAdd => "pod-add",
            Fault::PodDelete { .. } => "pod-delete",
            Fault::DelStorm { .. } => "del-storm",
            Fault::StaleDel { .. } => "stale-del",
            Fault::FilterDelete { .. } => "filter-delete",
            Fault::ProgramReplace { .. } => "program-replace",
            Fault::ForeignQdisc { .. } => "foreign-qdisc",
            Fault::CpuHog { .. } => "cpu-hog",
            Fault::InjectBypass { .. } => "inject-bypass",
        }
    }
}

/// A fault and when it is applied, from the start of the traffic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub at_ms: u64,
    pub fault: Fault,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schedule {
    pub seed: u64,
    pub duration_ms: u64,
    /// The agent puts pods' TCP on the local route (`--local-route`): odd
    /// seeds, where the kernel offers it (schedules written before it: off).
    #[serde(default)]
    pub local_route: bool,
    pub events: Vec<Event>,
}

/// Faults start after this much steady traffic (heal events may come up
/// to 5 s into the settling time).
const WARMUP_MS: u64 = 3_000;
/// The last this much of a run has no new faults: the pods settle and the
/// final checks see them Served.
const SETTLE_MS: u64 = 10_000;
/// Pods a run keeps at least (deletes are drawn only above it) and at most
/// (adds only below it): a 2-core machine carries about this many pods'
/// traffic while faults land.
pub const MIN_PODS: usize = 2;
pub const MAX_PODS: usize = 6;

impl Schedule {
    /// The schedule seed `seed` draws for a run of `duration`: a fault every
    /// 0.2–3 s, about one in four of them on top of the one before (under
    /// 100 ms later), none in the warm-up and the settling time.
    pub fn draw(seed: u64, duration: Duration, initial_pods: usize) -> Self {
        let duration_ms = duration.as_millis() as u64;
        let mut rng = StdRng::seed_from_u64(seed);
        let mut events = Vec::new();
        let mut pods = initial_pods;
        let mut at = WARMUP_MS;
        loop {
            at += if rng.random_ratio(1, 4) {
                rng.random_range(0..100)
            } else {
                rng.random_range(200..3_000)
            };
            if at + SETTLE_MS >= duration_ms {
                break;
            }
            let fault = draw_fault(&mut rng, pods);
            match fault {
                Fault::PodAdd => pods += 1,
                Fault::PodDelete { .. } | Fault::DelStorm { .. } => pods -= 1,
                _ => {}
            }
            // A fault that lasts is ended by its own event, 1–5 s later:
            // other faults land in between.
            let heal = match fault {
                Fault::PeerNack | Fault::PeerHoldAcks => Some(Fault::PeerHeal),
                Fault::FdLimit => Some(Fault::FdRestore),
                Fault::IfaceAdd { slot } => Some(Fault::IfaceRemove { slot }),
                _ => None,
            };
            if let Some(heal) = heal {
                let at_ms = at + rng.random_range(1_000..5_000);
                events.push(Event { at_ms, fault: heal });
            }
            events.push(Event { at_ms: at, fault });
        }
        events.sort_by_key(|e| e.at_ms);
        Self {
            seed,
            duration_ms,
            // From the seed alone, not its draws: a seed's faults are the
            // same either way.
            local_route: seed % 2 == 1
                && sluice::dataplane::features::Features::get().netns_cookie_in_tc,
            events,
        }
    }

    /// Only the self-test's bypass, at `at`.
    pub fn bypass_only(seed: u64, duration: Duration, at: Duration) -> Self {
        Self {
            seed,
            duration_ms: duration.as_millis() as u64,
            local_route: false,
            events: vec![Event {
                at_ms: at.as_millis() as u64,
                fault: Fault::InjectBypass { slot: 0 },
            }],
        }
    }

    /// The events up to `ms` (what a violation at `ms` had seen).
    pub fn until(&self, ms: u64) -> Self {
        Self {
            events: self
                .events
                .iter()
                .filter(|e| e.at_ms <= ms)
                .cloned()
                .collect(),
            ..self.clone()
        }
    }
}

/// One fault, weighted: the ordinary operations of a node (pods come and
/// go, ztunnel upgrades) more often than the rare ones.
fn draw_fault(rng: &mut StdRng, pods: usize) -> Fault {
    let slot = rng.random_range(0..64);
    loop {
        let fault = match rng.random_range(0..100) {
            0..=10 => Fault::PodAdd,
            11..=19 => Fault::PodDelete { slot },
            20..=22 => Fault::DelStorm { slot },
            23..=25 => Fault::StaleDel { slot },
            26..=32 => Fault::AgentKill,
            33..=35 => Fault::AgentTerm,
            36..=39 => Fault::AgentUpgrade,
            40..=42 => Fault::FdLimit,
            43..=45 => Fault::ControlFlood,
            46..=51 => Fault::PeerKill,
            52..=56 => Fault::PeerUpgradeNewFirst,
            57..=59 => Fault::PeerUpgradeOldFirst,
            60..=62 => Fault::PeerNack,
            63..=65 => Fault::PeerHoldAcks,
            66..=72 => Fault::FilterDelete { slot },
            73..=78 => Fault::ProgramReplace { slot },
            79..=81 => Fault::PinsRemoved { slot },
            82..=85 => Fault::IfaceAdd { slot },
            86..=88 => Fault::AddressAdd { slot },
            89..=90 => Fault::ForeignQdisc { slot },
            91..=93 => Fault::HintFlood { slot },
            94..=95 => Fault::PeerUpgradeAcrossAgentRestart,
            _ => Fault::CpuHog {
                secs: rng.random_range(1..5),
            },
        };
        let deletes = matches!(fault, Fault::PodDelete { .. } | Fault::DelStorm { .. });
        match fault {
            Fault::PodAdd if pods >= MAX_PODS => continue,
            _ if deletes && pods <= MIN_PODS => continue,
            f => return f,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_draws_the_same_schedule_and_keeps_the_pod_bounds() {
        let a = Schedule::draw(7, Duration::from_secs(300), 4);
        assert_eq!(a, Schedule::draw(7, Duration::from_secs(300), 4));
        assert_ne!(a, Schedule::draw(8, Duration::from_secs(300), 4));
        let mut pods = 4;
        for e in &a.events {
            assert!(e.at_ms >= WARMUP_MS && e.at_ms + SETTLE_MS / 2 < a.duration_ms);
            match e.fault {
                Fault::PodAdd => pods += 1,
                Fault::PodDelete { .. } | Fault::DelStorm { .. } => pods -= 1,
                _ => {}
            }
            assert!((MIN_PODS..=MAX_PODS).contains(&pods), "{pods} pods");
        }
        let text = serde_json::to_string(&a).unwrap();
        assert_eq!(serde_json::from_str::<Schedule>(&text).unwrap(), a);
    }
}

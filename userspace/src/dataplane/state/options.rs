//! Per-pod options as the programs read them: flags (DNS capture, inbound
//! bypass), the rerouted interfaces, the exclusions, and whether the pod's
//! TCP takes the local route. Absent from pins of a build before them (a
//! CLI adopting those: the agent's upgrade creates the maps).

use aya::maps::{HashMap, MapData};
use sluice_common::{Exclusions, REROUTE_LEN};

use crate::options::PodOptions;

use super::error::{merr, StateError};

pub struct OptionMaps {
    flags: Option<HashMap<MapData, u64, u32>>,
    reroute: Option<HashMap<MapData, u64, [u8; REROUTE_LEN]>>,
    exclusions: Option<HashMap<MapData, u64, Exclusions>>,
    /// `local_route`: the pod's interface index, for pods whose TCP takes
    /// the local route (`--local-route`).
    local_route: Option<HashMap<MapData, u64, u32>>,
}

impl OptionMaps {
    pub fn new(
        flags: Option<HashMap<MapData, u64, u32>>,
        reroute: Option<HashMap<MapData, u64, [u8; REROUTE_LEN]>>,
        exclusions: Option<HashMap<MapData, u64, Exclusions>>,
        local_route: Option<HashMap<MapData, u64, u32>>,
    ) -> Self {
        Self {
            flags,
            reroute,
            exclusions,
            local_route,
        }
    }

    /// Puts pod `cookie` on the local route, leaving by interface `uplink`
    /// (its index), or (`None`) takes it off.
    pub fn set_local_route(&mut self, cookie: u64, uplink: Option<u32>) -> Result<(), StateError> {
        match (&mut self.local_route, uplink) {
            (Some(m), Some(i)) => m.insert(cookie, i, 0).map_err(merr("local_route")),
            (Some(m), None) => {
                let _ = m.remove(&cookie);
                Ok(())
            }
            (None, None) => Ok(()),
            (None, Some(_)) => Err(StateError::Missing("local_route")),
        }
    }

    /// The interface index pod `cookie` leaves by when its TCP takes the
    /// local route; `None`: it does not.
    pub fn local_route(&self, cookie: u64) -> Option<u32> {
        self.local_route.as_ref()?.get(&cookie, 0).ok()
    }

    /// Writes a pod's options (nothing to write: no entry), DNS capture
    /// resolved against the node's default `node_dns`.
    pub fn set(&mut self, cookie: u64, o: &PodOptions, node_dns: bool) -> Result<(), StateError> {
        // The exclusions first: an excluded port 53 also clears the DNS
        // flag, and its TCP is then excluded by port already.
        match &mut self.exclusions {
            Some(m) if !o.exclusions.is_empty() => m
                .insert(cookie, o.exclusions.to_value(), 0)
                .map_err(merr("pod_exclusions"))?,
            Some(m) => drop(m.remove(&cookie)),
            None if o.exclusions.is_empty() => {}
            None => return Err(StateError::Missing("pod_exclusions")),
        }
        let flags = o.flags(node_dns);
        match &mut self.flags {
            Some(m) if flags != 0 => m.insert(cookie, flags, 0).map_err(merr("pod_flags"))?,
            Some(m) => drop(m.remove(&cookie)),
            None if flags == 0 => {}
            None => return Err(StateError::Missing("pod_flags")),
        }
        match &mut self.reroute {
            Some(m) if !o.reroute.is_empty() => m
                .insert(cookie, o.reroute_bytes(), 0)
                .map_err(merr("pod_reroute")),
            Some(m) => {
                let _ = m.remove(&cookie);
                Ok(())
            }
            None if o.reroute.is_empty() => Ok(()),
            None => Err(StateError::Missing("pod_reroute")),
        }
    }

    /// Whether the programs capture the pod's DNS (its `pod_flags` bit).
    pub fn dns_on(&self, cookie: u64) -> bool {
        self.flags
            .as_ref()
            .and_then(|m| m.get(&cookie, 0).ok())
            .is_some_and(|f| f & sluice_common::POD_FLAG_DNS_CAPTURE != 0)
    }

    /// A pod's options as they were written at its enrollment.
    pub fn get(&self, cookie: u64) -> PodOptions {
        let flags = self
            .flags
            .as_ref()
            .and_then(|m| m.get(&cookie, 0).ok())
            .unwrap_or(0);
        let reroute = self.reroute.as_ref().and_then(|m| m.get(&cookie, 0).ok());
        let exclusions = self
            .exclusions
            .as_ref()
            .and_then(|m| m.get(&cookie, 0).ok());
        PodOptions::from_maps(flags, reroute.as_ref(), exclusions.as_ref())
    }

    pub fn remove(&mut self, cookie: u64) {
        if let Some(m) = &mut self.flags {
            let _ = m.remove(&cookie);
        }
        if let Some(m) = &mut self.reroute {
            let _ = m.remove(&cookie);
        }
        if let Some(m) = &mut self.exclusions {
            let _ = m.remove(&cookie);
        }
        if let Some(m) = &mut self.local_route {
            let _ = m.remove(&cookie);
        }
    }
}

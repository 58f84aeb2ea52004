//! Per-pod capture options, from the pod annotations Istio ambient users
//! already set. Parsed from the API's view of the pod (CNI carries no
//! annotations); written to pinned maps at enrollment, before any link, so
//! that a restarted agent repairs the pod with the same options.

use sluice_common::{Exclusions, POD_FLAG_BYPASS_INBOUND, POD_FLAG_DNS_CAPTURE, REROUTE_LEN};

use crate::exclusions::PodExclusions;

/// `ambient.istio.io/bypass-inbound-capture: "true"`: the pod's inbound
/// connections are not captured (outbound still are) — Istio's "ingress
/// mode", for pods that must see their clients directly.
pub const BYPASS_INBOUND_CAPTURE: &str = "ambient.istio.io/bypass-inbound-capture";
/// `istio.io/reroute-virtual-interfaces: "tap0,tap1"`: TCP arriving on these
/// interfaces of the pod (a VM's, KubeVirt) is the pod's outbound, captured
/// to 15001.
pub const REROUTE_VIRTUAL_INTERFACES: &str = "istio.io/reroute-virtual-interfaces";

/// `ambient.istio.io/dns-capture: "true"|"false"` (either case): the pod's
/// DNS is (not) captured to ztunnel's DNS proxy, whatever the node's
/// default. Another value leaves the node's default, as in istio-cni.
pub const DNS_CAPTURE: &str = "ambient.istio.io/dns-capture";
/// `ambient.istio.io/bypass-dns-capture` (any value): no DNS capture for the
/// pod; wins over `dns-capture`.
pub const BYPASS_DNS_CAPTURE: &str = "ambient.istio.io/bypass-dns-capture";

/// `pod_flags` bits only user space reads: the pod's own DNS choice, kept
/// so that a restarted agent with another node default can tell a pod's
/// choice from the old default.
const FLAG_DNS_POD_ON: u32 = 1 << 30;
const FLAG_DNS_POD_OFF: u32 = 1 << 31;

/// Who decides whether a pod's DNS is captured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DnsChoice {
    /// The node's setting (`--dns-capture`).
    #[default]
    NodeDefault,
    /// The pod's annotations: on.
    On,
    /// The pod's annotations: off.
    Off,
}

impl DnsChoice {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::NodeDefault => "node-default",
            Self::On => "on",
            Self::Off => "off",
        }
    }

    /// Whether the pod's DNS is captured on a node whose default is `node`.
    pub fn resolve(self, node: bool) -> bool {
        match self {
            Self::NodeDefault => node,
            Self::On => true,
            Self::Off => false,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodOptions {
    pub bypass_inbound: bool,
    /// Interface names, as the annotation lists them (valid names only).
    pub reroute: Vec<String>,
    pub dns: DnsChoice,
    /// The exclusions in force (what the node's policy made of the pod's
    /// exclusion annotations; never parsed here, see `exclusions`).
    pub exclusions: PodExclusions,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionsError {
    #[error("{REROUTE_VIRTUAL_INTERFACES}: {0:?} is not an interface name")]
    BadInterface(String),
    #[error("{REROUTE_VIRTUAL_INTERFACES}: the list is longer than {REROUTE_LEN} bytes")]
    TooLong,
}

impl PodOptions {
    /// From the pod's annotations. Booleans read as istio-cni reads them
    /// (Go's `strconv.ParseBool`: `1`, `t`, `T`, `TRUE`, `true`, `True` and
    /// the six falses); any other value counts as absent. A reroute list with a name that is not an interface name is an
    /// error: the pod is not enrolled half-configured.
    pub fn from_annotations<'a>(
        mut get: impl FnMut(&str) -> Option<&'a str>,
    ) -> Result<Self, OptionsError> {
        let reroute = match get(REROUTE_VIRTUAL_INTERFACES) {
            None => Vec::new(),
            Some(list) => parse_interfaces(list)?,
        };
        let dns = if get(BYPASS_DNS_CAPTURE).is_some() {
            DnsChoice::Off
        } else {
            match get(DNS_CAPTURE).and_then(parse_bool) {
                Some(true) => DnsChoice::On,
                Some(false) => DnsChoice::Off,
                None => DnsChoice::NodeDefault,
            }
        };
        Ok(Self {
            bypass_inbound: get(BYPASS_INBOUND_CAPTURE).and_then(parse_bool) == Some(true),
            reroute,
            dns,
            exclusions: PodExclusions::default(),
        })
    }

    /// The `pod_flags` map value on a node whose DNS capture default is
    /// `node_dns`. An excluded port 53 turns the pod's DNS capture off.
    pub fn flags(&self, node_dns: bool) -> u32 {
        let mut f = 0;
        if self.bypass_inbound {
            f |= POD_FLAG_BYPASS_INBOUND;
        }
        if self.dns.resolve(node_dns) && !self.exclusions.excludes_dns() {
            f |= POD_FLAG_DNS_CAPTURE;
        }
        f | match self.dns {
            DnsChoice::NodeDefault => 0,
            DnsChoice::On => FLAG_DNS_POD_ON,
            DnsChoice::Off => FLAG_DNS_POD_OFF,
        }
    }

    /// The `pod_reroute` map value: the names, comma-separated, NUL-padded.
    pub fn reroute_bytes(&self) -> [u8; REROUTE_LEN] {
        let mut out = [0u8; REROUTE_LEN];
        let joined = self.reroute.join(",");
        out[..joined.len()].copy_from_slice(joined.as_bytes());
        out
    }

    pub fn from_maps(
        flags: u32,
        reroute: Option<&[u8; REROUTE_LEN]>,
        exclusions: Option<&Exclusions>,
    ) -> Self {
        let reroute = reroute
            .map(|b| {
                let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
                String::from_utf8_lossy(&b[..end])
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        let dns = if flags & FLAG_DNS_POD_OFF != 0 {
            DnsChoice::Off
        } else if flags & FLAG_DNS_POD_ON != 0 {
            DnsChoice::On
        } else {
            DnsChoice::NodeDefault
        };
        Self {
            bypass_inbound: flags & POD_FLAG_BYPASS_INBOUND != 0,
            reroute,
            dns,
            exclusions: exclusions
                .map(PodExclusions::from_value)
                .unwrap_or_default(),
        }
    }
}

/// "tap0, tap1" → ["tap0", "tap1"]; Linux interface names only (1–15
/// bytes, no '/', ':', ',' or whitespace), at most REROUTE_LEN bytes joined.
fn parse_interfaces(list: &str) -> Result<Vec<String>, OptionsError> {
    let names: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    for n in &names {
        let ok = n.len() <= 15
            && n != "."
            && n != ".."
            && n.bytes()
                .all(|b| b.is_ascii_graphic() && !b"/:,".contains(&b));
        if !ok {
            return Err(OptionsError::BadInterface(n.clone()));
        }
    }
    if names.join(",").len() > REROUTE_LEN {
        return Err(OptionsError::TooLong);
    }
    Ok(names)
}

/// A boolean annotation's value as Go's `strconv.ParseBool` reads it (what
/// istio-cni's `CheckBooleanAnnotation` uses); `None`: not a boolean.
fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(pairs: &[(&str, &str)]) -> Result<PodOptions, OptionsError> {
        PodOptions::from_annotations(|k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| *v))
    }

    #[test]
    fn booleans_read_as_istio_reads_them_and_options_round_trip_through_the_maps() {
        for (value, want) in [
            ("true", true),
            ("True", true),
            ("TRUE", true),
            ("1", true),
            ("t", true),
            ("tRuE", false),
            ("yes", false),
            ("0", false),
            ("false", false),
        ] {
            let o = from(&[(BYPASS_INBOUND_CAPTURE, value)]).unwrap();
            assert_eq!(o.bypass_inbound, want, "{value:?}");
        }
        let o = from(&[
            (BYPASS_INBOUND_CAPTURE, "true"),
            (REROUTE_VIRTUAL_INTERFACES, " tap0, k6t-eth0,,"),
        ])
        .unwrap();
        assert_eq!(o.reroute, ["tap0", "k6t-eth0"]);
        for node_dns in [true, false] {
            assert_eq!(
                PodOptions::from_maps(o.flags(node_dns), Some(&o.reroute_bytes()), None),
                o
            );
        }
        assert_eq!(from(&[]).unwrap(), PodOptions::default());
    }

    #[test]
    fn the_pods_dns_choice_wins_over_the_nodes_and_bypass_wins_over_both() {
        let cases: [(&[(&str, &str)], DnsChoice); 8] = [
            (&[], DnsChoice::NodeDefault),
            (&[(DNS_CAPTURE, "true")], DnsChoice::On),
            (&[(DNS_CAPTURE, "FALSE")], DnsChoice::Off),
            (&[(DNS_CAPTURE, "maybe")], DnsChoice::NodeDefault),
            (&[(BYPASS_DNS_CAPTURE, "")], DnsChoice::Off),
            (
                &[(BYPASS_DNS_CAPTURE, "x"), (DNS_CAPTURE, "true")],
                DnsChoice::Off,
            ),
            (&[(DNS_CAPTURE, "True")], DnsChoice::On),
            (&[(DNS_CAPTURE, "0")], DnsChoice::Off),
        ];
        for (annotations, want) in cases {
            let o = from(annotations).unwrap();
            assert_eq!(o.dns, want, "{annotations:?}");
            for node in [true, false] {
                let on = o.flags(node) & POD_FLAG_DNS_CAPTURE != 0;
                let expect = match want {
                    DnsChoice::NodeDefault => node,
                    DnsChoice::On => true,
                    DnsChoice::Off => false,
                };
                assert_eq!(on, expect, "{annotations:?} on a node with default {node}");
                // The choice survives the map, so a new default applies
                // only to pods without one.
                assert_eq!(PodOptions::from_maps(o.flags(node), None, None).dns, want);
            }
        }
    }

    #[test]
    fn dns_choice_names_are_its_json_form() {
        for c in [DnsChoice::NodeDefault, DnsChoice::On, DnsChoice::Off] {
            assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
        }
    }

    #[test]
    fn bad_interface_lists_are_refused() {
        for bad in ["eth0/x", "a:b", "waytoolonginterfacename", "..", "tab\tx"] {
            assert!(
                matches!(
                    from(&[(REROUTE_VIRTUAL_INTERFACES, bad)]),
                    Err(OptionsError::BadInterface(_))
                ),
                "{bad:?}"
            );
        }
        let many = ["abcdefghijklmno"; 5].join(",");
        assert_eq!(
            from(&[(REROUTE_VIRTUAL_INTERFACES, &many)]),
            Err(OptionsError::TooLong)
        );
    }
}

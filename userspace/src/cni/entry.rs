//! sluice-cni's entry in a plugin chain, and how sluice recognises its own
//! entries and files: `"sluice": {"convertedFrom": …}` marks a `.conf` that
//! sluice turned into a `.conflist` (in-place mode); `"sluice":
//! {"ownedFrom": …}` marks the conflist sluice owns.

use serde_json::Value;

pub const PLUGIN_TYPE: &str = "sluice-cni";
/// istio-cni's plugin type: its entries are left out of sluice's copy.
pub const ISTIO_PLUGIN_TYPE: &str = "istio-cni";
/// istio-cni's default owned conflist (`cni.istioOwnedCNIConfigFilename`).
pub const ISTIO_OWNED_DEFAULT: &str = "02-istio-cni.conflist";

pub fn is_ours(v: &Value) -> bool {
    v.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE)
}

pub fn is_istio(v: &Value) -> bool {
    v.get("type").and_then(Value::as_str) == Some(ISTIO_PLUGIN_TYPE)
}

/// A marker field of sluice's own entry (`/sluice/<field>`).
pub fn marker<'a>(entry: &'a Value, field: &str) -> Option<&'a str> {
    entry.get("sluice")?.get(field)?.as_str()
}

/// Whether a parsed config is a conflist sluice owns (any name: an owned
/// file left under an old `--owned-cni-config-filename` is one too).
pub fn is_owned_conflist(v: &Value) -> bool {
    super::conf_dir::plugins(v)
        .into_iter()
        .any(|p| is_ours(p) && marker(p, "ownedFrom").is_some())
}

/// What sluice's entry says: where the plugin finds the agent, and the
/// namespaces it never asks about.
pub struct Entry<'a> {
    pub agent_socket: &'a std::path::Path,
    pub exclude_namespaces: &'a [String],
}

impl Entry<'_> {
    /// The entry, with `marker` as its `sluice` field when given.
    pub fn json(&self, marker: Option<Value>) -> Value {
        let mut e = serde_json::json!({
            "type": PLUGIN_TYPE,
            "agentSocket": self.agent_socket,
        });
        if !self.exclude_namespaces.is_empty() {
            e["excludeNamespaces"] = serde_json::json!(self.exclude_namespaces);
        }
        if let Some(m) = marker {
            e["sluice"] = m;
        }
        e
    }
}

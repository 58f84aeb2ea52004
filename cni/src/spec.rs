//! The CNI spec as far as a chained plugin needs it: network config on stdin,
//! `CNI_*` environment, `CNI_ARGS` (Kubernetes pod identity), and the error
//! object printed on failure. Versions 1.1.0, 1.0.0, 0.4.0 and 0.3.x.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub const SUPPORTED_VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// Well-known CNI error codes (spec "Error" section).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    IncompatibleVersion = 1,
    UnsupportedField = 2,
    InvalidEnv = 4,
    DecodeFailure = 6,
    InvalidConfig = 7,
    TryAgainLater = 11,
    /// Plugin-specific: capture could not be attached.
    EnrollFailed = 100,
}

/// A CNI error, printed as JSON on stdout with a non-zero exit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg}: {details}")]
pub struct CniError {
    pub code: Code,
    pub msg: String,
    pub details: String,
}

impl CniError {
    pub fn new(code: Code, msg: impl Into<String>, details: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
            details: details.into(),
        }
    }

    pub fn to_json(&self, cni_version: &str) -> String {
        serde_json::json!({
            "cniVersion": cni_version,
            "code": self.code as u32,
            "msg": self.msg,
            "details": self.details,
        })
        .to_string()
    }
}

/// The network config handed to a chained plugin.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NetConf {
    pub cni_version: String,
    pub name: String,
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// The previous plugin's result; returned unchanged on ADD.
    #[serde(default)]
    pub prev_result: Option<serde_json::Value>,
    /// Where the agent listens (plugin-specific).
    #[serde(default)]
    pub agent_socket: Option<String>,
    /// Namespaces whose pods never reach the agent (istio-cni's
    /// `exclude_namespaces`): they start whatever the agent's state.
    #[serde(default)]
    pub exclude_namespaces: Vec<String>,
}

impl NetConf {
    pub fn parse(stdin: &[u8]) -> Result<Self, CniError> {
        let c: NetConf = serde_json::from_slice(stdin).map_err(|e| {
            CniError::new(
                Code::DecodeFailure,
                "cannot decode the network config",
                e.to_string(),
            )
        })?;
        if !SUPPORTED_VERSIONS.contains(&c.cni_version.as_str()) {
            return Err(CniError::new(
                Code::IncompatibleVersion,
                "unsupported cniVersion",
                format!(
                    "{} (supported: {})",
                    c.cni_version,
                    SUPPORTED_VERSIONS.join(", ")
                ),
            ));
        }
        Ok(c)
    }

    /// The pod's IPs from prevResult (`ips[].address`, e.g. "10.0.0.5/24").
    pub fn pod_ips(&self) -> Vec<String> {
        self.prev_result
            .as_ref()
            .and_then(|r| r.get("ips"))
            .and_then(|v| v.as_array())
            .map(|ips| {
                ips.iter()
                    .filter_map(|i| i.get("address")?.as_str())
                    .filter_map(|a| a.split('/').next())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Version,
    /// CNI 1.1: release what attachments no longer valid hold.
    Gc,
    /// CNI 1.1: whether the plugin can take ADDs.
    Status,
}

impl Command {
    /// Commands about no one container: they come without
    /// `CNI_CONTAINERID`, `CNI_NETNS` and `CNI_IFNAME`.
    fn is_plugin_wide(self) -> bool {
        matches!(self, Command::Version | Command::Gc | Command::Status)
    }
}

/// The `CNI_*` environment of one invocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Env {
    pub command: Command,
    pub container_id: String,
    /// Empty on DEL when the runtime no longer has the netns.
    pub netns: String,
    pub ifname: String,
    pub args: BTreeMap<String, String>,
}

impl Env {
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, CniError> {
        let need = |k: &str| {
            get(k).filter(|v| !v.is_empty()).ok_or_else(|| {
                CniError::new(
                    Code::InvalidEnv,
                    format!("{k} is not set"),
                    "required by the CNI spec",
                )
            })
        };
        let command = match need("CNI_COMMAND")?.as_str() {
            "ADD" => Command::Add,
            "DEL" => Command::Del,
            "CHECK" => Command::Check,
            "VERSION" => Command::Version,
            "GC" => Command::Gc,
            "STATUS" => Command::Status,
            other => {
                return Err(CniError::new(
                    Code::InvalidEnv,
                    "unknown CNI_COMMAND",
                    other.to_owned(),
                ));
            }
        };
        if command.is_plugin_wide() {
            return Ok(Self {
                command,
                container_id: String::new(),
                netns: String::new(),
                ifname: String::new(),
                args: BTreeMap::new(),
            });
        }
        Ok(Self {
            command,
            container_id: need("CNI_CONTAINERID")?,
            netns: if command == Command::Del {
                get("CNI_NETNS").unwrap_or_default()
            } else {
                need("CNI_NETNS")?
            },
            ifname: need("CNI_IFNAME")?,
            args: parse_args(&get("CNI_ARGS").unwrap_or_default()),
        })
    }

    /// The Kubernetes pod this invocation is for, from `CNI_ARGS`.
    pub fn pod(&self) -> Option<PodRef> {
        Some(PodRef {
            name: self.args.get("K8S_POD_NAME")?.clone(),
            namespace: self.args.get("K8S_POD_NAMESPACE")?.clone(),
            uid: self.args.get("K8S_POD_UID").cloned(),
        })
    }
}

/// `K1=V1;K2=V2` → map.
pub fn parse_args(s: &str) -> BTreeMap<String, String> {
    s.split(';')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodRef {
    pub name: String,
    pub namespace: String,
    /// Runtimes that pass K8S_POD_UID (containerd ≥ 1.6, CRI-O) give it.
    pub uid: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<Env, CniError> {
        let m: BTreeMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Env::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn reads_pod_identity_from_cni_args() {
        let e = env(&[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_NETNS", "/run/netns/x"),
            ("CNI_IFNAME", "eth0"),
            (
                "CNI_ARGS",
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart-1;K8S_POD_UID=u-1",
            ),
        ])
        .unwrap();
        assert_eq!(
            e.pod(),
            Some(PodRef {
                name: "cart-1".into(),
                namespace: "shop".into(),
                uid: Some("u-1".into())
            })
        );
    }

    #[test]
    fn missing_env_is_invalid_env() {
        let err = env(&[("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", "c1")]).unwrap_err();
        assert_eq!(err.code, Code::InvalidEnv);
        assert!(err.msg.contains("CNI_NETNS"), "{err:?}");
        // DEL may come without a netns.
        assert!(env(&[
            ("CNI_COMMAND", "DEL"),
            ("CNI_CONTAINERID", "c1"),
            ("CNI_IFNAME", "eth0")
        ])
        .is_ok());
    }

    #[test]
    fn config_errors_are_spec_shaped() {
        assert_eq!(
            NetConf::parse(b"{nope").unwrap_err().code,
            Code::DecodeFailure
        );
        let old = br#"{"cniVersion":"0.2.0","name":"n","type":"sluice-cni"}"#;
        assert_eq!(
            NetConf::parse(old).unwrap_err().code,
            Code::IncompatibleVersion
        );
        let e = CniError::new(Code::TryAgainLater, "m", "d");
        let v: serde_json::Value = serde_json::from_str(&e.to_json("1.0.0")).unwrap();
        assert_eq!(v["code"], 11);
        assert_eq!(v["cniVersion"], "1.0.0");
    }

    #[test]
    fn pod_ips_come_from_prev_result() {
        let c = NetConf::parse(
            br#"{"cniVersion":"1.0.0","name":"n","type":"sluice-cni",
                "prevResult":{"ips":[{"address":"10.1.0.5/24"},{"address":"fd00::5/64"}]}}"#,
        )
        .unwrap();
        assert_eq!(c.pod_ips(), ["10.1.0.5", "fd00::5"]);
    }
}

//! The workload identity ztunnel matches a pod against (ZDS `WorkloadInfo`).
//! Upstream ztunnel exits on an `add` without it, so it is always complete.

use serde::{Deserialize, Serialize};
use sluice_common::{NAMESPACE_LEN, POD_NAME_LEN, SERVICE_ACCOUNT_LEN};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workload {
    pub name: String,
    pub namespace: String,
    pub service_account: String,
}

/// Who a pod is, as recorded in the pinned `pod_meta` map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodIdentity {
    pub uid: String,
    pub netns: String,
    pub workload: Workload,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WorkloadError {
    #[error("workload {field} is empty")]
    Empty { field: &'static str },
    #[error("workload {field} is longer than {max} bytes")]
    TooLong { field: &'static str, max: usize },
}

impl Workload {
    pub fn new(name: &str, namespace: &str, service_account: &str) -> Result<Self, WorkloadError> {
        for (field, v, len) in [
            ("name", name, POD_NAME_LEN),
            ("namespace", namespace, NAMESPACE_LEN),
            ("service account", service_account, SERVICE_ACCOUNT_LEN),
        ] {
            if v.is_empty() {
                return Err(WorkloadError::Empty { field });
            }
            if v.len() >= len {
                return Err(WorkloadError::TooLong {
                    field,
                    max: len - 1,
                });
            }
        }
        Ok(Self {
            name: name.into(),
            namespace: namespace.into(),
            service_account: service_account.into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_three_fields_are_required_and_bounded() {
        assert!(Workload::new("p", "ns", "sa").is_ok());
        assert_eq!(
            Workload::new("", "ns", "sa"),
            Err(WorkloadError::Empty { field: "name" })
        );
        assert!(matches!(
            Workload::new("p", &"n".repeat(64), "sa"),
            Err(WorkloadError::TooLong {
                field: "namespace",
                ..
            })
        ));
    }
}

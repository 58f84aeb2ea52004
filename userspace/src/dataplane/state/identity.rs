//! A pod's identity as `pod_meta` holds it: fixed-size fields, NUL-padded
//! when shorter.

use sluice_common::{
    PodMeta, NAMESPACE_LEN, NETNS_PATH_LEN, POD_NAME_LEN, POD_UID_LEN, SERVICE_ACCOUNT_LEN,
};

use crate::{
    uid::PodUid,
    workload::{PodIdentity, Workload},
};

/// The `pod_meta` entry of a pod. Lengths were validated by `PodUid`,
/// `Workload` and the enroll path check.
pub fn meta_of(uid: &PodUid, netns_path: &str, workload: &Workload) -> PodMeta {
    let mut meta = PodMeta {
        uid: [0; POD_UID_LEN],
        netns_path: [0; NETNS_PATH_LEN],
        name: [0; POD_NAME_LEN],
        namespace: [0; NAMESPACE_LEN],
        service_account: [0; SERVICE_ACCOUNT_LEN],
    };
    fill(&mut meta.uid, uid.as_str());
    fill(&mut meta.netns_path, netns_path);
    fill(&mut meta.name, &workload.name);
    fill(&mut meta.namespace, &workload.namespace);
    fill(&mut meta.service_account, &workload.service_account);
    meta
}

/// The identity a `pod_meta` entry holds.
pub fn identity_of(m: &PodMeta) -> PodIdentity {
    PodIdentity {
        uid: uid_of(m),
        netns: cstr(&m.netns_path),
        workload: Workload {
            name: cstr(&m.name),
            namespace: cstr(&m.namespace),
            service_account: cstr(&m.service_account),
        },
    }
}

pub fn uid_of(m: &PodMeta) -> String {
    cstr(&m.uid)
}

fn fill(dst: &mut [u8], s: &str) {
    dst[..s.len()].copy_from_slice(s.as_bytes());
}

fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_survive_the_fixed_size_fields_up_to_their_full_length() {
        let mut field = [0u8; sluice_common::POD_NAME_LEN];
        let longest = "a".repeat(sluice_common::POD_NAME_LEN);
        fill(&mut field, &longest);
        assert_eq!(
            cstr(&field),
            longest,
            "no room for a NUL: the field's length ends it"
        );
        let mut field = [0u8; sluice_common::POD_NAME_LEN];
        fill(&mut field, "cart-7d9f");
        assert_eq!(cstr(&field), "cart-7d9f");
    }
}

//! Reading ztunnel's `/config_dump` for the few pods the agent asks about.
//!
//! The dump lists every workload of the mesh (megabytes at 10,000 workloads),
//! so it is parsed as it streams in: each workload is read into five small
//! fields and dropped unless it is one the agent asked about; every other key
//! of the dump, and every other field of a workload, is skipped without being
//! built.
//!
//! Which workload is "the pod" follows ztunnel itself: it matches a ZDS add to
//! its xDS workloads by name, namespace and service account (`WorkloadInfo`
//! in upstream's `find_by_info`), not by uid (istiod's uid is
//! `cluster//Pod/ns/name`, ZDS carries the Kubernetes uid). On top of that the
//! workload must list one of the pod's current IPs (a workload left over from
//! an earlier pod of the same name has other IPs, and inbound connections to
//! the new ones would fail; "one of", not "all": a secondary interface, e.g.
//! Multus, carries addresses istiod never lists) and, when both say, be on
//! this node.

use std::{
    cell::RefCell,
    collections::{HashMap, HashSet},
    fmt,
    io::Read,
    net::IpAddr,
};

use serde::{
    de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor},
    Deserialize, Deserializer,
};

/// A pod the agent asks about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    pub namespace: String,
    pub name: String,
    pub service_account: String,
    /// The pod's routable addresses (link-local ones are never in xDS).
    /// Empty: matched by name, namespace and service account alone.
    pub ips: Vec<IpAddr>,
}

/// The pods (by namespace, name) ztunnel's dump shows it can serve.
pub type Known = HashSet<(String, String)>;

/// One workload, as much of it as the check reads.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Workload {
    #[serde(default)]
    name: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    service_account: String,
    #[serde(default)]
    workload_ips: Vec<IpAddr>,
    /// Omitted by ztunnel when empty.
    #[serde(default)]
    node: String,
}

struct Query<'a> {
    wanted: HashMap<(&'a str, &'a str), &'a Wanted>,
    node: Option<&'a str>,
    /// The asked pods found so far.
    found: RefCell<Known>,
}

/// The parse's "error" once every asked pod is found: the rest of the dump
/// cannot change the answer, so it is not read (ztunnel stops sending it
/// when the connection closes).
const ALL_FOUND: &str = "every asked pod found";

impl Query<'_> {
    /// Records workload `w` if it serves an asked pod; whether every asked
    /// pod is found now.
    fn take(&self, w: &Workload) -> bool {
        let mut found = self.found.borrow_mut();
        found.extend(self.serves(w));
        found.len() == self.wanted.len()
    }

    fn serves(&self, w: &Workload) -> Option<(String, String)> {
        let want = self.wanted.get(&(w.namespace.as_str(), w.name.as_str()))?;
        let node_ok = match self.node {
            Some(n) if !w.node.is_empty() => w.node == n,
            _ => true,
        };
        (want.service_account == w.service_account
            && node_ok
            && (want.ips.is_empty() || want.ips.iter().any(|ip| w.workload_ips.contains(ip))))
        .then(|| (w.namespace.clone(), w.name.clone()))
    }
}

/// Which of `wanted` the dump read from `r` shows as served. `node`: this
/// node's name, when the agent knows it. Reading stops at the workload
/// that completes the answer (every asked pod found); a pod not found
/// costs a read to the end.
pub fn known(r: impl Read, wanted: &[Wanted], node: Option<&str>) -> serde_json::Result<Known> {
    let q = Query {
        wanted: wanted
            .iter()
            .map(|w| ((w.namespace.as_str(), w.name.as_str()), w))
            .collect(),
        node,
        found: RefCell::default(),
    };
    let mut de =
        serde_json::Deserializer::from_reader(std::io::BufReader::with_capacity(64 * 1024, r));
    match DumpSeed(&q).deserialize(&mut de) {
        Ok(()) => de.end()?,
        Err(e) if e.is_data() && e.to_string().starts_with(ALL_FOUND) => {}
        Err(e) => return Err(e),
    }
    Ok(q.found.into_inner())
}

/// The dump's top level: an object; only `workloads` is read.
struct DumpSeed<'q, 'a>(&'q Query<'a>);

impl<'de> DeserializeSeed<'de> for DumpSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for DumpSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("ztunnel's config_dump (a JSON object)")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<(), A::Error> {
        let mut seen = false;
        while let Some(key) = m.next_key::<String>()? {
            if key == "workloads" {
                m.next_value_seed(WorkloadsSeed(self.0))?;
                seen = true;
            } else {
                m.next_value::<IgnoredAny>()?;
            }
        }
        if seen {
            Ok(())
        } else {
            Err(serde::de::Error::missing_field("workloads"))
        }
    }
}

/// `workloads`: an array (current ztunnel) or an object keyed by
/// `network/IP` (ztunnel before 1.22).
struct WorkloadsSeed<'q, 'a>(&'q Query<'a>);

impl<'de> DeserializeSeed<'de> for WorkloadsSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for WorkloadsSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list or map of workloads")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<(), A::Error> {
        while let Some(w) = s.next_element::<Workload>()? {
            if self.0.take(&w) {
                return Err(serde::de::Error::custom(ALL_FOUND));
            }
        }
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<(), A::Error> {
        while let Some((_, w)) = m.next_entry::<IgnoredAny, Workload>()? {
            if self.0.take(&w) {
                return Err(serde::de::Error::custom(ALL_FOUND));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn want(name: &str, ips: &[&str]) -> Wanted {
        Wanted {
            namespace: "shop".into(),
            name: name.into(),
            service_account: "cart".into(),
            ips: ips.iter().map(|i| i.parse().unwrap()).collect(),
        }
    }

    /// A workload as upstream ztunnel prints it (fields in its order).
    fn workload(name: &str, ips: &[&str], node: &str) -> serde_json::Value {
        json!({"workloadIps": ips, "protocol": "HBONE", "networkMode": "Standard",
            "uid": format!("Kubernetes//Pod/shop/{name}"), "name": name, "namespace": "shop",
            "trustDomain": "cluster.local", "serviceAccount": "cart", "node": node,
            "status": "Healthy", "clusterId": "Kubernetes",
            "capacity": 1, "services": ["shop/cart.shop.svc.cluster.local"],
            "authorizationPolicies": [], "locality": {"region": "r"}})
    }

    fn dump(workloads: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec_pretty(&json!({
            "certificates": [{"identity": "spiffe://x", "state": "Available"}],
            "config": {"proxyMode": "Shared"},
            "policies": [], "services": [], "stagedServices": {},
            "staticConfig": {}, "version": {"version": "1.28"},
            "workloadState": {"uid-1": {"state": "Up", "info": {"name": "a"}}},
            "workloads": workloads,
        }))
        .unwrap()
    }

    fn names(k: Known) -> Vec<String> {
        let mut v: Vec<String> = k.into_iter().map(|(_, n)| n).collect();
        v.sort();
        v
    }

    #[test]
    fn finds_the_asked_pods_by_name_namespace_account_and_ips() {
        let d = dump(json!([
            workload("a", &["10.0.0.1"], "n1"),
            workload("b", &["10.0.0.2", "fd00::2"], "n1"),
            workload("old", &["10.0.0.9"], "n1"),
            workload("elsewhere", &["10.0.0.4"], "n2"),
        ]));
        let wanted = [
            // A secondary interface's address istiod does not list.
            want("a", &["10.0.0.1", "192.168.50.1"]),
            want("b", &["10.0.0.2", "fd00::2"]),
            // Recreated with a new IP: the dump still has the old one.
            want("old", &["10.0.0.3"]),
            want("elsewhere", &["10.0.0.4"]),
            want("absent", &["10.0.0.5"]),
        ];
        let k = known(&d[..], &wanted, Some("n1")).unwrap();
        assert_eq!(names(k), ["a", "b"]);
        // Without a node name, the node is not compared.
        let k = known(&d[..], &wanted, None).unwrap();
        assert_eq!(names(k), ["a", "b", "elsewhere"]);
    }

    #[test]
    fn reading_stops_once_every_asked_pod_is_found() {
        let d = dump(json!([
            workload("a", &["10.0.0.1"], "n1"),
            workload("b", &["10.0.0.2"], "n1"),
        ]));
        // Cut right after the first workload: what follows is never read,
        // so a dump broken there still answers for "a".
        let b = d
            .windows(5)
            .position(|w| w == b"/b\",\n")
            .expect("workload b's uid");
        let start_of_b = d[..b].iter().rposition(|c| *c == b'{').unwrap();
        let cut = &d[..start_of_b];
        let k = known(cut, &[want("a", &["10.0.0.1"])], None).unwrap();
        assert_eq!(names(k), ["a"]);
        // Asking for "b" too needs the rest: the cut dump is an error.
        assert!(known(cut, &[want("a", &[]), want("b", &[])], None).is_err());
        // And a whole dump answers both.
        let k = known(&d[..], &[want("a", &[]), want("b", &[])], None).unwrap();
        assert_eq!(names(k), ["a", "b"]);
    }

    #[test]
    fn another_service_account_is_another_workload() {
        let d = dump(json!([workload("a", &["10.0.0.1"], "n1")]));
        let mut w = want("a", &["10.0.0.1"]);
        w.service_account = "other".into();
        assert!(known(&d[..], &[w], None).unwrap().is_empty());
    }

    #[test]
    fn reads_the_older_map_shape() {
        let d = dump(json!({"/10.0.0.1": workload("a", &["10.0.0.1"], "n1")}));
        let k = known(&d[..], &[want("a", &["10.0.0.1"])], None).unwrap();
        assert_eq!(names(k), ["a"]);
    }

    #[test]
    fn something_else_is_an_error_not_an_empty_answer() {
        for bad in [
            &b"<html>not found</html>"[..],
            b"{\"services\": []}",
            b"[]",
            b"{\"workloads\": [1]}",
        ] {
            assert!(
                known(bad, &[want("a", &[])], None).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        // An empty mesh is an answer.
        assert!(known(&dump(json!([]))[..], &[want("a", &[])], None)
            .unwrap()
            .is_empty());
    }
}

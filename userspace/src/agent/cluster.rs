//! The agent's Kubernetes side, when it runs on a node (`--node-name`): CNI
//! requests are admitted against the API (selection, forged-DEL check) and the
//! pods' `ambient.istio.io/redirection` annotation follows their state.

use std::{collections::BTreeMap, sync::Arc};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::{
    api::{Api, ListParams},
    runtime::{reflector, watcher},
};
use sluice_common::PodState;
use tracing::warn;

use crate::{
    cni::spec::PodRef,
    kube::{
        annotate, gate,
        selection::{self, Verdict},
        verify::{self, Found},
    },
    uid::PodUid,
    workload::Workload,
};

#[derive(Clone)]
pub struct KubeCtx {
    pub client: kube::Client,
    pub node: String,
    /// Where the netns paths of pods that came through CNI but were not
    /// ambient then are kept (one file per pod uid), so the pod can be
    /// captured later — also after an agent restart, and for runtimes with no
    /// process left in the pod. `None`: not recorded.
    pub cni_records: Option<std::path::PathBuf>,
    /// Which pods are in the mesh (`--exclude-namespaces`,
    /// `--enablement-selectors`).
    pub selection: selection::Selection,
    /// Where the namespaces' selection is kept for the CNI plugin to decide
    /// while the agent is down (see `cni::snapshot`). `None`: not written.
    pub selection_file: Option<std::path::PathBuf>,
}

/// The API client, once `node` is known to name this host (refused when it
/// names another; an API that cannot answer now is not waited for).
pub async fn checked_client(node: &str) -> anyhow::Result<kube::Client> {
    use anyhow::Context as _;
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or KUBECONFIG)")?;
    let checked = tokio::time::timeout(
        crate::kube::API_TIMEOUT,
        crate::kube::node_identity::verify(client.clone(), node),
    )
    .await;
    match checked {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(wrong))) => return Err(wrong.into()),
        Ok(Err(e)) => warn!(error = %e, "could not check --node-name against the Node: going on"),
        Err(_) => warn!("checking --node-name against the Node timed out: going on"),
    }
    Ok(client)
}

/// What a pod's annotation and readiness gate show: its state, what its
/// capture lacks, and whether ztunnel has taken it since it was attached.
#[derive(Debug, Clone, Copy, Default)]
pub struct Shown {
    pub state: Option<PodState>,
    pub capture: gate::Capture,
    pub acked: bool,
}

/// What to do with a pod a CNI ADD names.
pub enum Admission {
    Enroll {
        uid: PodUid,
        workload: Workload,
        options: Box<crate::options::PodOptions>,
    },
    Skip(String),
}

impl KubeCtx {
    /// Remembers the netns the runtime gave a pod we did not capture. The
    /// uid names a file: only a validated one (no `/`, no `..` path).
    pub fn record_netns(&self, uid: &PodUid, netns: &std::path::Path) {
        let uid = uid.as_str();
        let Some(dir) = &self.cni_records else { return };
        let write = std::fs::create_dir_all(dir)
            .and_then(|_| std::fs::write(dir.join(uid), netns.as_os_str().as_encoded_bytes()));
        if let Err(e) = write {
            warn!(%uid, error = %e, "could not record the pod's netns path");
        }
    }

    /// The recorded netns path of pod `uid`, if it still names a netns.
    pub fn recorded_netns(&self, uid: &PodUid) -> Option<std::path::PathBuf> {
        let p = std::fs::read_to_string(self.cni_records.as_ref()?.join(uid.as_str())).ok()?;
        let path = std::path::PathBuf::from(p);
        crate::podnet::netns::Netns::open(&path)
            .is_ok()
            .then_some(path)
    }

    /// Removes the files the CNI plugin read (the selection snapshot, the
    /// recorded netns paths): sluice is leaving the node.
    pub fn forget_plugin_files(&self) {
        if let Some(f) = &self.selection_file {
            let _ = std::fs::remove_file(f);
        }
        if let Some(d) = &self.cni_records {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    /// Forgets the records of pods that are not on this node any more.
    pub fn prune_records(&self, live: &std::collections::BTreeSet<String>) {
        let Some(dir) = &self.cni_records else { return };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            if !live.contains(&*e.file_name().to_string_lossy()) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// Namespace labels by namespace name.
pub type NamespaceLabels = BTreeMap<String, BTreeMap<String, String>>;

/// This node's pods and every namespace, as kube-runtime reflectors keep them:
/// one LIST each at start (and again when a watch expires), then the watch's
/// events. The reconcile reads these stores on every pass instead of listing
/// the API per event.
#[derive(Clone)]
pub struct ApiView {
    pods: reflector::Store<Pod>,
    namespaces: reflector::Store<Namespace>,
}

impl ApiView {
    /// Whether both stores hold their first complete LIST.
    pub fn is_ready(&self) -> bool {
        use futures::FutureExt as _;
        let ready = async {
            self.pods.wait_until_ready().await.is_ok()
                && self.namespaces.wait_until_ready().await.is_ok()
        };
        ready.now_or_never() == Some(true)
    }

    /// The stores' current contents.
    pub fn snapshot(&self) -> (Vec<Arc<Pod>>, NamespaceLabels) {
        let namespaces = self
            .namespaces
            .state()
            .iter()
            .filter_map(|n| {
                let labels = n.metadata.labels.clone().unwrap_or_default();
                Some((n.metadata.name.clone()?, labels))
            })
            .collect();
        (self.pods.state(), namespaces)
    }
}

impl KubeCtx {
    /// Starts the reflectors behind an [`ApiView`]. The returned future
    /// drives their watches (kube-rs retries failures with backoff, each
    /// reported to `failed`) and sends on `changed` after every event.
    pub fn reflect(
        &self,
        changed: tokio::sync::mpsc::Sender<()>,
        failed: impl Fn(&watcher::Error) + Send + 'static,
    ) -> (
        ApiView,
        impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        use futures::StreamExt as _;
        use kube::runtime::{reflector::store, WatchStreamExt as _};
        // Managed fields are most of a pod's bytes and nothing sluice reads.
        fn slim<K: kube::Resource>(o: &mut K) {
            o.meta_mut().managed_fields = None;
        }
        let (pods, pod_writer) = store();
        let (namespaces, ns_writer) = store();
        let pod_events = watcher(
            Api::<Pod>::all(self.client.clone()),
            watcher::Config::default().fields(&format!("spec.nodeName={}", self.node)),
        )
        .default_backoff()
        .modify(slim)
        .reflect(pod_writer)
        .map(|e| e.map(|_| ()));
        let ns_events = watcher(
            Api::<Namespace>::all(self.client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .modify(slim)
        .reflect(ns_writer)
        .map(|e| e.map(|_| ()));
        let drive = async move {
            let mut all = std::pin::pin!(futures::stream::select(pod_events, ns_events));
            while let Some(event) = all.next().await {
                if let Err(e) = &event {
                    failed(e);
                }
                if changed.try_send(()).is_err() && changed.is_closed() {
                    return;
                }
            }
        };
        (ApiView { pods, namespaces }, drive)
    }

    /// The pods scheduled on this node and every namespace's labels, listed
    /// once (the reconcile loop reads an [`ApiView`] instead).
    pub async fn observe(&self) -> anyhow::Result<(Vec<Arc<Pod>>, NamespaceLabels)> {
        let on_node = ListParams::default().fields(&format!("spec.nodeName={}", self.node));
        let pods = Api::<Pod>::all(self.client.clone())
            .list(&on_node)
            .await?
            .items
            .into_iter()
            .map(Arc::new)
            .collect();
        let namespaces = Api::<Namespace>::all(self.client.clone())
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter_map(|n| Some((n.metadata.name?, n.metadata.labels.unwrap_or_default())))
            .collect();
        Ok((pods, namespaces))
    }

    /// Keeps the CNI plugin's selection snapshot in step with the
    /// namespaces' labels: the namespaces whose pods wait for the agent
    /// (excluded namespaces never do).
    pub fn write_selection(&self, namespaces: &NamespaceLabels) {
        let Some(path) = &self.selection_file else {
            return;
        };
        let ambient = self.selection.waiting_namespaces(namespaces);
        match crate::cni::snapshot::write_if_changed(path, &ambient) {
            Ok(true) => {
                tracing::info!(path = %path.display(), namespaces = ?ambient, "ambient namespaces written for the CNI plugin")
            }
            Ok(false) => {}
            Err(e) => {
                warn!(path = %path.display(), error = %e, "could not write the CNI plugin's selection snapshot")
            }
        }
    }

    /// CNI ADD: the pod must exist on this node; it is enrolled when Istio's
    /// selection says ambient, with its real service account.
    pub async fn admit_add(&self, pod: &PodRef) -> anyhow::Result<Admission> {
        let found = verify::fetch(self.client.clone(), &pod.namespace, &pod.name)
            .await?
            .ok_or_else(|| {
                anyhow::anyhow!("pod {}/{} is not in the API (yet)", pod.namespace, pod.name)
            })?;
        match verify::classify(Some(&found), pod.uid.as_deref(), &self.node) {
            Found::Live => {}
            Found::OtherNode(n) => anyhow::bail!(
                "pod {}/{} is scheduled on {n}, not {}",
                pod.namespace,
                pod.name,
                self.node
            ),
            other => return Ok(Admission::Skip(format!("pod is {other:?}"))),
        }
        let ns = Api::<Namespace>::all(self.client.clone())
            .get(&pod.namespace)
            .await?;
        match selection::select(
            &found,
            ns.metadata.labels.as_ref(),
            &self.node,
            &self.selection,
        ) {
            Verdict::Skip(s) => Ok(Admission::Skip(s.reason().into())),
            Verdict::Enroll => {
                let uid = found
                    .metadata
                    .uid
                    .as_deref()
                    .ok_or_else(|| anyhow::anyhow!("pod has no uid"))?;
                let sa = found
                    .spec
                    .as_ref()
                    .and_then(|s| s.service_account_name.clone())
                    .unwrap_or_else(|| "default".into());
                Ok(Admission::Enroll {
                    uid: PodUid::new(uid)?,
                    workload: Workload::new(&pod.name, &pod.namespace, &sa)?,
                    options: selection::new_pod_options(&found, &self.selection)
                        .map(Box::new)
                        .map_err(|e| anyhow::anyhow!("pod {}/{}: {e}", pod.namespace, pod.name))?,
                })
            }
        }
    }

    /// CNI DEL: refused for a running pod whose captured sandbox is alive.
    pub async fn admit_del(&self, pod: &PodRef, sandbox_alive: bool) -> anyhow::Result<()> {
        let found = verify::fetch(self.client.clone(), &pod.namespace, &pod.name).await?;
        let what = verify::classify(found.as_ref(), pod.uid.as_deref(), &self.node);
        verify::del_allowed(&what, sandbox_alive)
            .map_err(|e| anyhow::anyhow!("pod {}/{}: {e}", pod.namespace, pod.name))
    }

    /// Sets the pod's redirection annotation for its state (none removes
    /// it) and, for pods with the `sluice.dev/redirected` readiness gate,
    /// that condition: on pod `namespace/name` only while it is the pod of
    /// `uid`.
    pub async fn publish(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        shown: Shown,
    ) -> kube::Result<()> {
        let Shown {
            state,
            capture,
            acked,
        } = shown;
        annotate::write(self.client.clone(), namespace, name, uid, state, acked).await?;
        gate::write(self.client.clone(), namespace, name, uid, state, capture).await?;
        Ok(())
    }
}

/// Whether a listed pod's annotation or readiness-gate condition disagrees
/// with `state` and `capture` (a write was lost, or someone else changed
/// them). A gated pod without the condition counts as False already.
pub fn out_of_step(pod: &Pod, state: Option<PodState>, capture: gate::Capture) -> bool {
    let annotation = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(annotate::REDIRECTION))
        .map(String::as_str);
    if !annotate::in_step(annotation, state) {
        return true;
    }
    if !gate::has_gate(pod) {
        return false;
    }
    let shown = gate::current(pod).map(|c| c.status.as_str());
    let want = gate::condition_for(state, capture).0;
    shown.unwrap_or("False") != want
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::kube::mock::{self, reply};

    /// A static pod's sandbox comes with the kubelet's uid for it (a hash of
    /// its manifest) as `K8S_POD_UID`; the API holds its mirror, of another
    /// uid, which records the kubelet's. Such a pod in an ambient namespace
    /// is captured, under the mirror's uid (the one ztunnel knows it by).
    /// Before, the two uids differing read as "another incarnation" and the
    /// pod started uncaptured. Another uid is still another incarnation.
    #[tokio::test]
    async fn a_static_pod_in_an_ambient_namespace_is_captured_under_its_mirrors_uid() {
        let mirror = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "etcd-node-a", "namespace": "shop", "uid": "api-uid",
                "annotations": {"kubernetes.io/config.mirror": "kubelet-hash"}},
            "spec": {"nodeName": "node-a", "containers": [{"name": "etcd"}]},
            "status": {"phase": "Running"}});
        let ambient = json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "shop", "labels": {"istio.io/dataplane-mode": "ambient"}}});
        let (client, mut handle) = mock::client();
        let answers = [mirror.clone(), ambient, mirror];
        let server = tokio::spawn(async move {
            for body in answers {
                let (_, send) = handle.next_request().await.unwrap();
                reply(send, 200, &body);
            }
        });
        let k = KubeCtx {
            client,
            node: "node-a".into(),
            cni_records: None,
            selection: Default::default(),
            selection_file: None,
        };
        let named = |uid: &str| PodRef {
            name: "etcd-node-a".into(),
            namespace: "shop".into(),
            uid: Some(uid.into()),
        };
        match k.admit_add(&named("kubelet-hash")).await.unwrap() {
            Admission::Enroll { uid, .. } => assert_eq!(uid.as_str(), "api-uid"),
            Admission::Skip(why) => panic!("the static pod was skipped: {why}"),
        }
        match k.admit_add(&named("another-hash")).await.unwrap() {
            Admission::Skip(why) => assert!(why.contains("Gone"), "{why}"),
            Admission::Enroll { .. } => panic!("another incarnation was captured"),
        }
        server.await.unwrap();
    }

    fn pod(annotation: Option<&str>, gate: Option<Option<&str>>) -> Pod {
        let mut p = json!({"metadata": {"name": "cart", "namespace": "shop"},
            "spec": {"containers": [{"name": "app"}]}, "status": {"conditions": []}});
        if let Some(a) = annotation {
            p["metadata"]["annotations"] = json!({annotate::REDIRECTION: a});
        }
        if let Some(shown) = gate {
            p["spec"]["readinessGates"] = json!([{"conditionType": gate::GATE}]);
            if let Some(status) = shown {
                p["status"]["conditions"] = json!([{"type": gate::GATE, "status": status}]);
            }
        }
        serde_json::from_value(p).unwrap()
    }

    #[test]
    fn out_of_step_compares_annotation_and_gate_with_the_map() {
        use gate::Capture::{Complete, Incomplete};
        let (pending, enabled) = (Some(PodState::Pending), Some(PodState::Served));
        assert!(!out_of_step(&pod(Some("enabled"), None), enabled, Complete));
        assert!(
            out_of_step(&pod(Some("pending"), None), enabled, Complete),
            "lost write"
        );
        assert!(
            out_of_step(&pod(None, None), enabled, Complete),
            "annotation missing"
        );
        assert!(
            out_of_step(&pod(Some("enabled"), None), None, Complete),
            "released pod"
        );
        assert!(!out_of_step(&pod(None, None), None, Complete), "never ours");
        // Gated pods: the condition must say the same.
        assert!(out_of_step(
            &pod(Some("enabled"), Some(Some("False"))),
            enabled,
            Complete
        ));
        assert!(out_of_step(
            &pod(Some("enabled"), Some(None)),
            enabled,
            Complete
        ));
        assert!(!out_of_step(
            &pod(Some("enabled"), Some(Some("True"))),
            enabled,
            Complete
        ));
        assert!(out_of_step(
            &pod(Some("pending"), Some(Some("True"))),
            pending,
            Complete
        ));
        // Absent reads as False: no write for a gated pod not yet ours.
        assert!(!out_of_step(&pod(None, Some(None)), None, Complete));
        // Captured but not served: the annotation says enabled, the gate False.
        let unserved = Some(PodState::Enabled);
        assert!(!out_of_step(
            &pod(Some("enabled"), Some(Some("False"))),
            unserved,
            Complete
        ));
        assert!(out_of_step(
            &pod(Some("enabled"), Some(Some("True"))),
            unserved,
            Complete
        ));
        // A served pod whose capture is incomplete: the gate must be False.
        assert!(out_of_step(
            &pod(Some("enabled"), Some(Some("True"))),
            enabled,
            Incomplete
        ));
        assert!(!out_of_step(
            &pod(Some("enabled"), Some(Some("False"))),
            enabled,
            Incomplete
        ));
    }
}

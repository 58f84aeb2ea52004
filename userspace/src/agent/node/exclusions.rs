//! Keeping enrolled pods' exclusions (`traffic.sidecar.istio.io/*`) in
//! step with their annotations and the node's policy, at each reconcile
//! pass: a changed annotation is in force for the pod's new connections
//! within a pass (which the pod watch wakes), a malformed one changes
//! nothing; what is in force, and why an annotation is not, is announced
//! once per change.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
};

use k8s_openapi::api::core::v1::Pod;
use tracing::{info, warn};

use super::{announce::Announcer, enroller::Enroller};
use crate::{
    control::ExclusionNotice,
    dataplane::state::PodRecord,
    exclusions::{Decision, PodExclusions},
    kube::{
        events::{PodRef, Reason},
        selection::Selection,
    },
    metrics::{Metrics, ReconcileError},
};

pub(super) struct Exclusions {
    enroller: Arc<Enroller>,
    announcer: Arc<Announcer>,
    metrics: Arc<Metrics>,
    /// Enrolled pods whose exclusion annotations are not in force as
    /// written, by uid: each announced once per distinct notice.
    notices: Mutex<HashMap<String, ExclusionNotice>>,
    /// The exclusions last announced in force, by uid (pods with none
    /// left out): each change announced once.
    announced: Mutex<HashMap<String, PodExclusions>>,
}

impl Exclusions {
    pub(super) fn new(
        enroller: Arc<Enroller>,
        announcer: Arc<Announcer>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            enroller,
            announcer,
            metrics,
            notices: Mutex::default(),
            announced: Mutex::default(),
        }
    }

    /// Enrolled pods whose exclusion annotations are not in force as
    /// written, with why.
    pub(super) fn notices(&self) -> Vec<ExclusionNotice> {
        let mut v: Vec<ExclusionNotice> = self.notices.lock().unwrap().values().cloned().collect();
        v.sort_by(|a, b| a.uid.cmp(&b.uid));
        v
    }

    /// Puts each enrolled pod's exclusions in step with its annotations
    /// and the node's policy (an annotation changed on a running pod
    /// applies to its new connections within a pass), and announces what
    /// is not in force as written, once per distinct notice.
    pub(super) async fn sync(&self, sel: &Selection, pods: &[Arc<Pod>], records: &[PodRecord]) {
        let by_uid: HashMap<&str, &Pod> = pods
            .iter()
            .filter_map(|p| Some((p.metadata.uid.as_deref()?, p.as_ref())))
            .collect();
        let mut live = HashSet::new();
        for r in records {
            let Some(pod) = by_uid.get(r.uid.as_str()) else {
                continue;
            };
            live.insert(r.uid.clone());
            let decision = crate::kube::selection::exclusions(pod, sel);
            let target = decision.target(&r.exclusions);
            let who = PodRef {
                namespace: pod.metadata.namespace.clone().unwrap_or_default(),
                name: pod.metadata.name.clone().unwrap_or_default(),
                uid: r.uid.clone(),
            };
            let in_force = if target == r.exclusions {
                target
            } else {
                match self.enroller.set_exclusions(&who.uid, target.clone()).await {
                    Ok(_) => target,
                    Err(e) => {
                        let e = crate::one_line(&e);
                        warn!(uid = %who.uid, error = %e, "putting the pod's exclusions in force failed; will retry");
                        self.metrics.reconcile_error(ReconcileError::Exclusions);
                        r.exclusions.clone()
                    }
                }
            };
            self.announce_in_force(&who, in_force);
            self.notice(&who, &decision);
        }
        self.notices
            .lock()
            .unwrap()
            .retain(|uid, _| live.contains(uid));
        self.announced
            .lock()
            .unwrap()
            .retain(|uid, _| live.contains(uid));
    }

    /// Announces the exclusions in force for a pod when they are not what
    /// was last announced (a pod captured with some, a change, all gone).
    fn announce_in_force(&self, who: &PodRef, in_force: PodExclusions) {
        {
            let mut announced = self.announced.lock().unwrap();
            if announced.get(&who.uid).cloned().unwrap_or_default() == in_force {
                return;
            }
            if in_force.is_empty() {
                announced.remove(&who.uid);
            } else {
                announced.insert(who.uid.clone(), in_force.clone());
            }
        }
        let lines = in_force.lines();
        let note = if lines.is_empty() {
            "no exclusions in force any more: all of the pod's new connections are captured"
                .to_owned()
        } else {
            let listed: Vec<String> = lines.iter().map(|(a, v)| format!("{a}={v}")).collect();
            format!(
                "exclusions in force for new connections (this traffic bypasses ztunnel: no mTLS, policy or telemetry): {}",
                listed.join(" ")
            )
        };
        info!(uid = %who.uid, %note, "pod exclusions");
        self.announcer
            .event(who.clone(), Reason::PodExclusionsApplied, note);
    }

    /// Records (and announces, when new) why the pod's exclusion
    /// annotations are not in force as written; forgets a notice that no
    /// longer holds.
    fn notice(&self, who: &PodRef, decision: &Decision) {
        let (kind, reason, detail) = match decision {
            Decision::None | Decision::Apply(_) => {
                self.notices.lock().unwrap().remove(&who.uid);
                return;
            }
            Decision::Ignored(why) => (
                "ignored",
                Reason::PodExclusionsIgnored,
                format!("exclusion annotations ignored, the pod is captured fully: {why}"),
            ),
            Decision::Invalid(e) => (
                "invalid",
                Reason::InvalidPodExclusions,
                format!("exclusion annotations not applied, the exclusions in force stay as they were: {e}"),
            ),
        };
        let notice = ExclusionNotice {
            uid: who.uid.clone(),
            namespace: who.namespace.clone(),
            name: who.name.clone(),
            kind: kind.into(),
            detail: detail.clone(),
        };
        let new = self
            .notices
            .lock()
            .unwrap()
            .insert(who.uid.clone(), notice.clone())
            .is_none_or(|old| old != notice);
        if new {
            warn!(uid = %who.uid, %detail, "pod exclusions");
            if kind == "invalid" {
                self.metrics.reconcile_error(ReconcileError::BadAnnotation);
            }
            self.announcer.event(who.clone(), reason, detail);
        }
    }
}

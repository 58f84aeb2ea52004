//! Publishing Events with series: a repeat of the same event (the object,
//! type, reason, action and note) within [`SERIES_TTL`] patches the first
//! one's `series` (its count and last time), as client-go and kube-rs do;
//! an event with another note is an Event of its own.
//!
//! Not kube-rs' `Recorder`, on purpose: it keys a series on the reason and
//! action alone, so an event whose note changed (another malformed entry,
//! another failed verification case) was folded into the first note's
//! Event and never shown. The wire behaviour is otherwise the same: a
//! `create`, then merge patches of `series`.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::{
        core::v1::ObjectReference,
        events::v1::{Event, EventSeries},
    },
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::api::{Api, Patch, PatchParams, PostParams};

/// How long a repeat still joins an Event's series.
pub const SERIES_TTL: Duration = Duration::from_secs(6 * 60);
/// Events remembered for their series at most (the oldest go first).
const CACHED: usize = 4096;

/// What an Event says, apart from whom it is about.
pub struct Said<'a> {
    pub warning: bool,
    pub reason: &'a str,
    pub action: &'a str,
    pub note: &'a str,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    regarding: (
        Option<String>,
        Option<String>,
        Option<String>,
        Option<String>,
    ),
    warning: bool,
    reason: String,
    action: String,
    note: String,
}

pub struct Recorder {
    client: kube::Client,
    controller: String,
    instance: String,
    sent: HashMap<Key, (Event, Instant)>,
}

impl Recorder {
    pub fn new(client: kube::Client, controller: &str, instance: &str) -> Self {
        Self {
            client,
            controller: controller.to_owned(),
            instance: instance.to_owned(),
            sent: HashMap::new(),
        }
    }

    /// Creates the event, or adds one to the series of the same event sent
    /// within [`SERIES_TTL`].
    pub async fn publish(
        &mut self,
        said: Said<'_>,
        regarding: &ObjectReference,
    ) -> kube::Result<()> {
        let now = Instant::now();
        self.sent
            .retain(|_, (_, at)| now.duration_since(*at) < SERIES_TTL);
        let key = Key {
            regarding: (
                regarding.kind.clone(),
                regarding.namespace.clone(),
                regarding.name.clone(),
                regarding.uid.clone(),
            ),
            warning: said.warning,
            reason: said.reason.to_owned(),
            action: said.action.to_owned(),
            note: said.note.to_owned(),
        };
        let ns = regarding.namespace.as_deref().unwrap_or("default");
        let api: Api<Event> = Api::namespaced(self.client.clone(), ns);
        let time = MicroTime(Timestamp::now());
        if let Some((event, at)) = self.sent.get_mut(&key) {
            let count = event.series.as_ref().map_or(2, |s| s.count + 1);
            event.series = Some(EventSeries {
                count,
                last_observed_time: time,
            });
            let name = event.metadata.name.clone().unwrap_or_default();
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&*event))
                .await?;
            *at = now;
            return Ok(());
        }
        let event = self.event(&said, regarding, time);
        api.create(&PostParams::default(), &event).await?;
        if self.sent.len() >= CACHED {
            let oldest = self
                .sent
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                self.sent.remove(&k);
            }
        }
        self.sent.insert(key, (event, now));
        Ok(())
    }

    fn event(&self, said: &Said<'_>, regarding: &ObjectReference, time: MicroTime) -> Event {
        let object = regarding.name.as_deref().unwrap_or(&self.controller);
        Event {
            action: Some(said.action.to_owned()),
            reason: Some(said.reason.to_owned()),
            note: Some(said.note.to_owned()),
            type_: Some(if said.warning { "Warning" } else { "Normal" }.to_owned()),
            event_time: Some(time.clone()),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            metadata: ObjectMeta {
                namespace: regarding.namespace.clone(),
                name: Some(format!("{object}.{:x}", time.0.as_nanosecond())),
                ..Default::default()
            },
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::mock;

    #[tokio::test]
    async fn a_repeat_joins_the_series_and_another_note_is_an_event_of_its_own() {
        let (client, mut api) = mock::client();
        let seen = tokio::spawn(async move {
            let mut seen = Vec::new();
            for _ in 0..4 {
                let (req, send) = api.next_request().await.unwrap();
                let (method, path) = (req.method().to_string(), req.uri().path().to_owned());
                let body = mock::body(req).await;
                mock::reply(send, 200, &body);
                seen.push((method, path, body));
            }
            seen
        });
        let mut r = Recorder::new(client, "sluice.dev/agent", "sluice-node-a");
        let pod = ObjectReference {
            kind: Some("Pod".into()),
            namespace: Some("shop".into()),
            name: Some("cart".into()),
            uid: Some("u-1".into()),
            ..Default::default()
        };
        let said = |note| Said {
            warning: true,
            reason: "InvalidPodExclusions",
            action: "Exclude",
            note,
        };
        for note in ["bad \"db\"", "bad \"db\"", "bad 15001", "bad \"db\""] {
            r.publish(said(note), &pod).await.unwrap();
        }
        let seen = seen.await.unwrap();
        let verbs: Vec<&str> = seen.iter().map(|(m, _, _)| m.as_str()).collect();
        assert_eq!(verbs, ["POST", "PATCH", "POST", "PATCH"]);
        assert_eq!(seen[1].2["series"]["count"], 2);
        assert_eq!(seen[2].2["note"], "bad 15001");
        assert_eq!(
            seen[3].2["series"]["count"], 3,
            "the first note's series goes on"
        );
        assert!(seen[1]
            .1
            .ends_with(seen[0].2["metadata"]["name"].as_str().unwrap()));
        assert_eq!(seen[0].2["type"], "Warning");
        assert_eq!(seen[0].2["reportingInstance"], "sluice-node-a");
        assert!(seen[0]
            .1
            .starts_with("/apis/events.k8s.io/v1/namespaces/shop/events"));
    }
}

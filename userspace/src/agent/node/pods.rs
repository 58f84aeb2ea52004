//! The pods the agent holds, by uid: each one's netns cookie and its netns,
//! opened once (at enrollment, or when a starting agent adopts the pod) and
//! carried from then on, so the agent neither reopens a pod's netns by path
//! for every add and registration nor walks the identity map to find a uid.
//! The pod's state is not here: it lives in the pinned pod-state map.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use crate::netns::Netns;

#[derive(Default)]
pub(super) struct PodTable {
    by_uid: Mutex<HashMap<String, (u64, Arc<Netns>)>>,
}

impl PodTable {
    pub(super) fn insert(&self, uid: &str, cookie: u64, netns: Netns) {
        self.by_uid
            .lock()
            .unwrap()
            .insert(uid.to_owned(), (cookie, Arc::new(netns)));
    }

    pub(super) fn remove(&self, uid: &str) {
        self.by_uid.lock().unwrap().remove(uid);
    }

    pub(super) fn contains(&self, uid: &str) -> bool {
        self.by_uid.lock().unwrap().contains_key(uid)
    }

    pub(super) fn cookie(&self, uid: &str) -> Option<u64> {
        self.by_uid.lock().unwrap().get(uid).map(|(c, _)| *c)
    }

    /// The open netns of the pod with this cookie.
    pub(super) fn netns(&self, cookie: u64) -> Option<Arc<Netns>> {
        self.by_uid
            .lock()
            .unwrap()
            .values()
            .find(|(c, _)| *c == cookie)
            .map(|(_, n)| n.clone())
    }
}

//! Pods due for a verification of their capture, queued by the effect
//! runner (which runs under the dataplane lock and must not verify there)
//! and taken by the repairer's loop.

use std::{collections::BTreeSet, sync::Mutex};

use tokio::sync::Notify;

#[derive(Default)]
pub(super) struct VerifyQueue {
    due: Mutex<BTreeSet<u64>>,
    wake: Notify,
}

impl VerifyQueue {
    /// Queues pod `cookie` (once, however often asked before it is taken).
    pub(super) fn push(&self, cookie: u64) {
        self.due.lock().unwrap().insert(cookie);
        self.wake.notify_one();
    }

    /// Waits until a pod is queued; takes every queued pod.
    pub(super) async fn take(&self) -> BTreeSet<u64> {
        loop {
            let due = std::mem::take(&mut *self.due.lock().unwrap());
            if !due.is_empty() {
                return due;
            }
            self.wake.notified().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_pod_queued_twice_is_taken_once() {
        let q = VerifyQueue::default();
        q.push(7);
        q.push(7);
        q.push(9);
        assert_eq!(q.take().await, BTreeSet::from([7, 9]));
        q.push(7);
        assert_eq!(q.take().await, BTreeSet::from([7]));
    }
}

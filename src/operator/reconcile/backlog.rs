//! How many Ats wait in kube-runtime's queue for a reconcile that has not started, from the
//! retriggers (wakeups, a first look at every At, failed writes): at most `LIMIT`; the rest wait
//! in the retrigger queue, at a few bytes each.
//!
//! The runtime's scheduler takes every request it is handed at once, into a `HashMap`, a
//! `DelayQueue` and a `HashSet` that never give back what they grew to: after a new leader's
//! first look handed it 20,000 Ats to write, it held about 290 bytes per At for the rest of the
//! leadership (heaptrack of a replica, docs/src/performance/measurements.md, "Memory per
//! cached At"). With at most `LIMIT` handed over and not started, those maps stay at that size;
//! `LIMIT` is more than the reconciles that run at once, so the runtime never waits for work.
//! With Lease shards each shard's leadership has a backlog of its own.
//!
//! A key leaves the backlog when its reconcile starts, when the runtime drops its request (the
//! At was gone from the cache: `controller::Error::ObjectNotFound`) or when the At is forgotten
//! (deleted). A key already waiting is not handed over again: the runtime would merge the two
//! requests into one reconcile. Should a key ever not leave (a path not foreseen), it counts no
//! more after `STALE`: the backlog can slow the retriggers down, never stop them.

use crate::operator::key::AtKey;
use futures::{Stream, StreamExt};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Ats handed to the runtime whose reconcile has not started, at most: eight times the
/// reconciles that run at once by default (`--concurrency` 32). A reconcile that starts leaves
/// the backlog, so this bounds what waits, never what runs.
pub const LIMIT: usize = 256;
/// A key handed over this long ago counts no more (its reconcile started unseen).
pub const STALE: Duration = Duration::from_secs(30);

/// The Ats handed to the runtime and not started yet, and when each was handed over.
pub struct Backlog {
    waiting: Mutex<HashMap<AtKey, Instant>>,
    /// Told when a key leaves.
    room: Notify,
    limit: usize,
}

impl Default for Backlog {
    fn default() -> Self {
        Backlog::new(LIMIT)
    }
}

impl Backlog {
    /// A backlog of at most `limit` Ats (at least one).
    pub fn new(limit: usize) -> Self {
        Backlog {
            waiting: Mutex::default(),
            room: Notify::new(),
            limit: limit.max(1),
        }
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, HashMap<AtKey, Instant>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `at`'s reconcile started, the runtime dropped its request, or the At is gone.
    pub fn left(&self, at: &AtKey) {
        let mut waiting = self.waiting();
        if waiting.remove(at).is_some() {
            crate::operator::spare::shrink_if_sparse(&mut waiting);
            drop(waiting);
            self.room.notify_one();
        }
    }

    /// Ats waiting now.
    pub fn len(&self) -> usize {
        self.waiting().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `None` when there is room for one more at `now` (dropping keys older than `STALE`
    /// first); else the instant the oldest key will be stale.
    fn full_until(&self, now: Instant) -> Option<Instant> {
        let mut waiting = self.waiting();
        if waiting.len() < self.limit {
            return None;
        }
        waiting.retain(|_, since| now.saturating_duration_since(*since) < STALE);
        if waiting.len() < self.limit {
            return None;
        }
        waiting.values().min().map(|oldest| *oldest + STALE)
    }

    /// Until there is room for one more key.
    async fn room(&self) {
        loop {
            // Registered before looking, so a key leaving meanwhile is not missed.
            let left = self.room.notified();
            let Some(stale) = self.full_until(Instant::now()) else {
                return;
            };
            tokio::select! {
                _ = left => {}
                _ = tokio::time::sleep_until(stale) => {}
            }
        }
    }

    /// Whether `at` is to be handed over now (it was not waiting already); it then waits.
    fn admit(&self, at: &AtKey, now: Instant) -> bool {
        let mut waiting = self.waiting();
        if waiting.contains_key(at) {
            return false;
        }
        waiting.insert(at.clone(), now);
        true
    }

    /// The keys of `keys`, each handed over while fewer than the limit wait; a key waiting
    /// already is dropped (its waiting request covers it).
    pub fn gate(
        self: Arc<Self>,
        keys: impl Stream<Item = AtKey> + Send + 'static,
    ) -> impl Stream<Item = AtKey> + Send + 'static {
        futures::stream::unfold((self, Box::pin(keys)), |(backlog, mut keys)| async move {
            loop {
                backlog.room().await;
                let at = keys.next().await?;
                if backlog.admit(&at, Instant::now()) {
                    return Some((at, (backlog, keys)));
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::pin;
    use tokio::sync::mpsc;

    /// What `stream` yields without waiting.
    async fn ready<T>(stream: impl Stream<Item = T>) -> Vec<T> {
        let mut stream = pin!(stream);
        let mut out = Vec::new();
        while let Ok(Some(item)) =
            tokio::time::timeout(Duration::from_millis(1), stream.next()).await
        {
            out.push(item);
        }
        out
    }

    fn key(i: usize) -> AtKey {
        AtKey::new("ns", &format!("at-{i}"))
    }

    /// A backlog of `limit` gating an open channel.
    fn gated(
        limit: usize,
    ) -> (
        Arc<Backlog>,
        mpsc::UnboundedSender<AtKey>,
        impl Stream<Item = AtKey>,
    ) {
        let backlog = Arc::new(Backlog::new(limit));
        let (sender, mut receiver) = mpsc::unbounded_channel();
        let keys = futures::stream::poll_fn(move |cx| receiver.poll_recv(cx));
        (backlog.clone(), sender, backlog.gate(keys))
    }

    #[tokio::test(start_paused = true)]
    async fn hands_over_at_most_the_limit_then_one_more_for_each_that_starts() {
        let (backlog, sender, gate) = gated(3);
        let mut gate = Box::pin(gate);
        for i in 0..10 {
            sender.send(key(i)).unwrap();
        }
        let first: Vec<AtKey> = ready(gate.as_mut()).await;
        assert_eq!(first, [key(0), key(1), key(2)]);
        assert_eq!(backlog.len(), 3);
        backlog.left(&key(1));
        assert_eq!(ready(gate.as_mut()).await, [key(3)]);
        backlog.left(&key(0));
        backlog.left(&key(2));
        assert_eq!(ready(gate.as_mut()).await, [key(4), key(5)]);
        // A key that did not wait leaves nothing.
        backlog.left(&key(9));
        assert!(ready(gate.as_mut()).await.is_empty());
        assert_eq!(backlog.len(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_waiting_already_is_not_handed_over_twice_but_is_once_it_started() {
        let (backlog, sender, gate) = gated(10);
        let mut gate = Box::pin(gate);
        for at in [key(1), key(1), key(2), key(1)] {
            sender.send(at).unwrap();
        }
        assert_eq!(ready(gate.as_mut()).await, [key(1), key(2)]);
        backlog.left(&key(1));
        sender.send(key(1)).unwrap();
        assert_eq!(ready(gate.as_mut()).await, [key(1)]);
        assert_eq!(backlog.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn keys_that_never_leave_count_no_more_after_stale() {
        let (backlog, sender, gate) = gated(2);
        let mut gate = Box::pin(gate);
        for i in 0..5 {
            sender.send(key(i)).unwrap();
        }
        assert_eq!(ready(gate.as_mut()).await, [key(0), key(1)]);
        tokio::time::advance(STALE - Duration::from_millis(10)).await;
        assert!(ready(gate.as_mut()).await.is_empty());
        tokio::time::advance(Duration::from_millis(10)).await;
        assert_eq!(ready(gate.as_mut()).await, [key(2), key(3)]);
        assert_eq!(backlog.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn the_gate_ends_when_its_keys_end() {
        let (_backlog, sender, gate) = gated(2);
        sender.send(key(0)).unwrap();
        drop(sender);
        let all: Vec<AtKey> = gate.collect().await;
        assert_eq!(all, [key(0)]);
    }

    #[test]
    fn a_backlog_holds_one_key_at_least() {
        let backlog = Backlog::new(0);
        assert!(backlog.full_until(Instant::now()).is_none());
        assert!(backlog.admit(&key(0), Instant::now()));
        assert!(backlog.full_until(Instant::now()).is_some());
    }
}

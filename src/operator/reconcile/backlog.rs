//! How many of the Ats cnat hands to kube-runtime's controller itself (`Scheduler::reconcile_now`)
//! wait in the runtime's queue for a reconcile that has not started; the rest wait in cnat's.
//! See docs/src/design/decisions.md, "A bounded backlog for kube-runtime's queue".

use crate::operator::key::AtKey;
use crate::sync::lock;
use futures::{Stream, StreamExt};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::warn;

/// Ats handed to the runtime whose reconcile has not started, at most: eight times the default
/// `--concurrency` (32). A reconcile that starts leaves, so this bounds what waits, not what runs.
pub const LIMIT: usize = 256;
/// The backlog for a reconcile loop running `concurrency` reconciles at once (0: no limit):
/// `LIMIT`, or eight times the concurrency where that is more; no limit with none.
pub fn limit_for(concurrency: u16) -> usize {
    match concurrency {
        0 => usize::MAX,
        n => LIMIT.max(8 * usize::from(n)),
    }
}

/// A full backlog from which no key left for this long, while no reconcile ran, is emptied
/// (keys whose reconcile started unseen: a path not foreseen); the gate then goes on.
pub const STALE: Duration = Duration::from_secs(60);

/// The Ats handed to the runtime and not started yet.
pub struct Backlog {
    state: Mutex<State>,
    /// Told when a key leaves.
    room: Notify,
}

#[derive(Default)]
struct State {
    waiting: HashSet<AtKey>,
    /// Since when the backlog was full with no key leaving and no reconcile ending.
    stuck_since: Option<Instant>,
    /// Reconciles running now (`Running` guards).
    running: usize,
    /// Keys waiting at most.
    limit: usize,
}

/// A reconcile running, from its start (when its key left the backlog) until dropped.
pub struct Running(Arc<Backlog>);

impl Drop for Running {
    fn drop(&mut self) {
        let mut state = self.0.state();
        state.running = state.running.saturating_sub(1);
        // A reconcile ended: the loop moves, however slowly; a full backlog looks again.
        state.stuck_since = None;
        drop(state);
        self.0.room.notify_one();
    }
}

impl Backlog {
    /// A backlog of at most `limit` Ats (at least one).
    pub fn new(limit: usize) -> Self {
        let backlog = Backlog {
            state: Mutex::default(),
            room: Notify::new(),
        };
        backlog.set_limit(limit);
        backlog
    }

    /// At most `limit` Ats wait from now on (at least one).
    pub fn set_limit(&self, limit: usize) {
        self.state().limit = limit.max(1);
        self.room.notify_one();
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// `at` no longer waits: its reconcile started (`started`) or the runtime dropped its request
    /// (`Scheduler::request_dropped`). An At deleted meanwhile still waits until one of those.
    pub fn left(&self, at: &AtKey) {
        let mut state = self.state();
        if state.waiting.remove(at) {
            state.stuck_since = None;
            drop(state);
            self.room.notify_one();
        }
    }

    /// `at`'s reconcile starts: it leaves the backlog, and counts as running until the guard is
    /// dropped.
    pub fn started(self: &Arc<Self>, at: &AtKey) -> Running {
        self.left(at);
        self.state().running += 1;
        Running(self.clone())
    }

    /// Ats waiting now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.state().waiting.len()
    }

    /// `None` when there is room for one more at `now`; else until when it waits for a key to
    /// leave before it is emptied (`STALE`).
    fn full_until(&self, now: Instant) -> Option<Instant> {
        let mut state = self.state();
        if state.waiting.len() < state.limit {
            return None;
        }
        if state.running > 0 {
            // Reconciles run (slowly: an API server that does not answer): the wait starts over
            // once none does (`Running::drop`), or it is looked at again after `STALE`.
            state.stuck_since = None;
            return Some(now + STALE);
        }
        let since = *state.stuck_since.get_or_insert(now);
        if now.saturating_duration_since(since) < STALE {
            return Some(since + STALE);
        }
        warn!(
            waiting = state.waiting.len(),
            after = ?STALE,
            "no At handed to the reconcile loop started its reconcile; counting them no more"
        );
        state.waiting = HashSet::new();
        state.stuck_since = None;
        None
    }

    /// Until there is room for one more key.
    async fn room(&self) {
        loop {
            let left = self.room.notified();
            tokio::pin!(left);
            // Registered before looking, so a key leaving meanwhile is not missed.
            left.as_mut().enable();
            let Some(stuck) = self.full_until(Instant::now()) else {
                return;
            };
            tokio::select! {
                _ = left => {}
                _ = tokio::time::sleep_until(stuck) => {}
            }
        }
    }

    /// The keys of `keys`, each new one handed over once fewer than the limit wait; one that
    /// waits already is passed on at once, uncounted (the runtime keeps one request per At).
    pub fn gate(
        self: Arc<Self>,
        keys: impl Stream<Item = AtKey> + Send + 'static,
    ) -> impl Stream<Item = AtKey> + Send + 'static {
        futures::stream::unfold((self, Box::pin(keys)), |(backlog, mut keys)| async move {
            let at = keys.next().await?;
            if !backlog.state().waiting.contains(&at) {
                backlog.room().await;
                backlog.state().waiting.insert(at.clone());
            }
            Some((at, (backlog, keys)))
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
    async fn a_key_waiting_already_is_passed_on_at_once_uncounted() {
        let (backlog, sender, gate) = gated(2);
        let mut gate = Box::pin(gate);
        for at in [key(1), key(1), key(2), key(1), key(3), key(2)] {
            sender.send(at).unwrap();
        }
        // Key 3 waits for room; key 2 behind it waits in the queue.
        assert_eq!(ready(gate.as_mut()).await, [key(1), key(1), key(2), key(1)]);
        assert_eq!(backlog.len(), 2);
        backlog.left(&key(1));
        assert_eq!(ready(gate.as_mut()).await, [key(3), key(2)]);
        assert_eq!(backlog.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_backlog_nothing_leaves_is_emptied_after_stale() {
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
    async fn a_backlog_keys_leave_is_not_emptied_however_long_each_waits() {
        let (backlog, sender, gate) = gated(2);
        let mut gate = Box::pin(gate);
        for i in 0..4 {
            sender.send(key(i)).unwrap();
        }
        assert_eq!(ready(gate.as_mut()).await, [key(0), key(1)]);
        tokio::time::advance(STALE - Duration::from_secs(10)).await;
        backlog.left(&key(0));
        assert_eq!(ready(gate.as_mut()).await, [key(2)]);
        // Key 1 waited past STALE, but a key left since: nothing is dropped.
        tokio::time::advance(STALE - Duration::from_secs(10)).await;
        assert!(ready(gate.as_mut()).await.is_empty());
        assert_eq!(backlog.len(), 2);
        // Full with nothing leaving for STALE: emptied.
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(ready(gate.as_mut()).await, [key(3)]);
        assert_eq!(backlog.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_backlog_is_not_emptied_while_reconciles_run_however_slowly() {
        let (backlog, sender, gate) = gated(2);
        let mut gate = Box::pin(gate);
        for i in 0..4 {
            sender.send(key(i)).unwrap();
        }
        assert_eq!(ready(gate.as_mut()).await, [key(0), key(1)]);
        // Key 0's reconcile starts and hangs; key 2 takes its place.
        let running = backlog.started(&key(0));
        assert_eq!(ready(gate.as_mut()).await, [key(2)]);
        tokio::time::advance(3 * STALE).await;
        assert!(ready(gate.as_mut()).await.is_empty());
        // It ends: the wait starts over, and is emptied only after STALE with none running.
        drop(running);
        assert!(ready(gate.as_mut()).await.is_empty());
        tokio::time::advance(STALE - Duration::from_millis(10)).await;
        assert!(ready(gate.as_mut()).await.is_empty());
        tokio::time::advance(Duration::from_millis(10)).await;
        assert_eq!(ready(gate.as_mut()).await, [key(3)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_backlog_with_a_reconcile_running_waits_for_a_later_instant_never_a_past_one() {
        let (backlog, sender, gate) = gated(1);
        let mut gate = Box::pin(gate);
        sender.send(key(0)).unwrap();
        assert_eq!(ready(gate.as_mut()).await, [key(0)]);
        let other = backlog.started(&key(9));
        for _ in 0..3 {
            tokio::time::advance(STALE).await;
            let now = Instant::now();
            assert!(backlog.full_until(now).is_some_and(|until| until > now));
        }
        drop(other);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reconcile_that_ends_starts_the_wait_over() {
        let (backlog, sender, gate) = gated(1);
        let mut gate = Box::pin(gate);
        sender.send(key(0)).unwrap();
        sender.send(key(1)).unwrap();
        assert_eq!(ready(gate.as_mut()).await, [key(0)]);
        // Another At's reconcile runs and ends just before STALE: the loop moved.
        tokio::time::advance(STALE - Duration::from_secs(1)).await;
        drop(backlog.started(&key(9)));
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(ready(gate.as_mut()).await.is_empty());
        tokio::time::advance(STALE).await;
        assert_eq!(ready(gate.as_mut()).await, [key(1)]);
    }

    #[test]
    fn the_limit_is_eight_times_the_concurrency_256_at_least_none_without_one() {
        assert_eq!(limit_for(32), LIMIT);
        assert_eq!(limit_for(1), LIMIT);
        assert_eq!(limit_for(100), 800);
        assert_eq!(limit_for(0), usize::MAX);
    }

    #[tokio::test(start_paused = true)]
    async fn the_gate_ends_when_its_keys_end() {
        let (_backlog, sender, gate) = gated(2);
        sender.send(key(0)).unwrap();
        drop(sender);
        let all: Vec<AtKey> = gate.collect().await;
        assert_eq!(all, [key(0)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_backlog_holds_one_key_at_least() {
        let (backlog, sender, gate) = gated(0);
        let mut gate = Box::pin(gate);
        sender.send(key(0)).unwrap();
        sender.send(key(1)).unwrap();
        assert_eq!(ready(gate.as_mut()).await, [key(0)]);
        backlog.left(&key(0));
        assert_eq!(ready(gate.as_mut()).await, [key(1)]);
    }
}

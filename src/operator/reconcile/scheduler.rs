//! The one way an At is looked at again (now, later, after a failed reconcile, when the API
//! server answers again, when the At cache has caught up) and the one retry policy.
//! See docs/src/design/architecture.md, "The reconcile loop".

use super::apiserver_bugs;
use super::backlog::{self, Backlog};
use super::error::Error;
use super::queue::Queue;
use super::wakeups::Wakeups;
use crate::operator::cache::freshness::Freshness;
use crate::operator::key::AtKey;
use crate::operator::reachability::{self, Reachability};
use crate::operator::shrink::{remove, shrink_if_sparse};
use crate::sync::lock;
use backon::{BackoffBuilder, ExponentialBuilder};
use kube::runtime::controller::Action;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::{debug, warn};

/// When an At whose pod create was put off (the At cache behind) is reconciled again at the
/// latest; normally sooner, as soon as the cache has caught up (`wake_deferred`).
pub const RECHECK_BEHIND: Duration = Duration::from_secs(1);

/// When each At of one leadership is looked at again.
pub struct Scheduler {
    /// When settled Ats (and failed queued writes) are looked at again.
    wakeups: Arc<Wakeups>,
    /// Ats to reconcile now, outside the runtime's own requeues.
    reconcile_now: Queue<AtKey>,
    /// The Ats handed to the runtime whose reconcile has not started.
    backlog: Arc<Backlog>,
    /// Consecutive failures per At.
    pub(super) failures: Mutex<HashMap<AtKey, u32>>,
    /// Ats whose last attempt got no answer from the API server: looked at when it answers.
    unreachable: Reachability<AtKey>,
    /// Ats whose pod create was put off because the At cache was behind.
    deferred: Mutex<HashSet<AtKey>>,
}

impl Default for Scheduler {
    fn default() -> Self {
        Scheduler {
            wakeups: Arc::default(),
            reconcile_now: Queue::default(),
            backlog: Arc::new(Backlog::new(backlog::LIMIT)),
            failures: Mutex::default(),
            unreachable: Reachability::default(),
            deferred: Mutex::default(),
        }
    }
}

impl Scheduler {
    /// Ats handed to the runtime wait in the runtime's queue `limit` at a time (`backlog::limit_for` the
    /// loop's concurrency; `backlog::LIMIT` unless set).
    pub fn set_backlog_limit(&self, limit: usize) {
        self.backlog.set_limit(limit);
    }

    /// The wake-up index (`Wakeups::run` hands what falls due to `wake_up`).
    pub fn wakeups(&self) -> &Arc<Wakeups> {
        &self.wakeups
    }

    /// Reconciles `at` now.
    pub fn wake_up(&self, at: AtKey) {
        // Fails only once the loop has ended, when nothing is left to wake.
        let _ = self.reconcile_now.send(at);
    }

    /// Reconciles `at` after `left`, or earlier if it waits for an earlier instant already.
    pub fn after(&self, at: AtKey, left: Duration) {
        self.wakeups.set_earlier_in(at, left);
    }

    /// Ats to reconcile again, for `Controller::reconcile_on`, at most the backlog's limit waiting
    /// at once (each must be passed to `reconcile_starts` when it starts); `None` if taken.
    pub fn reconcile_now(&self) -> Option<impl futures::Stream<Item = AtKey> + use<>> {
        Some(self.backlog.clone().gate(self.reconcile_now.take()?))
    }

    /// `at`'s reconcile starts: it no longer waits in the runtime's queue, and runs until the
    /// guard is dropped.
    pub fn reconcile_starts(&self, at: &AtKey) -> backlog::Running {
        self.backlog.started(at)
    }

    /// The runtime dropped its request for `at` (the At was gone): it no longer waits in the
    /// runtime's queue.
    pub fn request_dropped(&self, at: &AtKey) {
        self.backlog.left(at);
    }

    /// A reconcile of `at` failed: it is retried by the runtime's requeue after the backoff.
    pub fn failed_reconcile(&self, at: &AtKey, error: &Error) -> Action {
        Action::requeue(self.retry(at, error, "reconcile"))
    }

    /// A queued status write of `at` failed: `at` is reconciled again after the backoff (or
    /// earlier, if it is due earlier).
    pub fn failed_write(&self, at: &AtKey, error: &Error) {
        let delay = self.retry(at, error, "writing status");
        self.after(at.clone(), delay);
    }

    /// `at` succeeded: its backoff starts over.
    pub fn succeeded(&self, at: &AtKey) {
        remove(&self.failures, at);
    }

    /// One more failure of `at`: how many in a row that makes.
    pub(super) fn failed(&self, at: &AtKey) -> u32 {
        let mut failures = lock(&self.failures);
        let count = failures.entry(at.clone()).or_insert(0);
        *count += 1;
        *count
    }

    /// Ats waiting for the API server to answer again.
    #[cfg(test)]
    pub fn unreachable(&self) -> &Reachability<AtKey> {
        &self.unreachable
    }

    /// Counts one more failure of `at`, lets one without an answer wait for the API server, logs
    /// `error` (`what` failed) and returns the backoff before the next attempt.
    fn retry(&self, at: &AtKey, error: &Error, what: &str) -> Duration {
        let attempt = self.failed(at);
        let delay = retry_delay(attempt);
        let api_error = error.api_error();
        let unanswered = api_error.is_some_and(reachability::unanswered);
        if unanswered {
            self.unreachable.wait(at.clone());
        }
        if api_error.is_some_and(|e| apiserver_bugs::quiet(e, attempt)) {
            debug!(at = %at, %error, retry_in = ?delay, unanswered, attempt, "{what} failed on the API server's own error; retrying");
        } else {
            warn!(at = %at, %error, retry_in = ?delay, unanswered, "{what} failed");
        }
        delay
    }

    /// Runs until dropped: while Ats wait for an unreachable API server, calls `ask` every
    /// `reachability::PROBE_EVERY`; its first answer reconciles them all again at once.
    pub async fn probe<F>(&self, ask: impl FnMut() -> F)
    where
        F: std::future::Future<Output = bool>,
    {
        let every = reachability::PROBE_EVERY;
        self.unreachable
            .probe(every, ask, |at| self.wake_up(at))
            .await;
    }

    /// `at`'s pod create is put off because the At cache is behind (`ats`): it is reconciled
    /// again once the cache has caught up, and after `RECHECK_BEHIND` at the latest.
    pub fn behind(&self, at: AtKey, ats: &Freshness) -> Action {
        lock(&self.deferred).insert(at);
        // Caught up since the look that put it off: `wake_deferred` may have found nothing.
        if ats.is_caught_up() {
            self.wake_deferred_now();
        }
        Action::requeue(RECHECK_BEHIND)
    }

    /// Runs until dropped: each time the At cache (`ats`) has caught up, reconciles the Ats
    /// whose pod create was put off meanwhile.
    pub async fn wake_deferred(&self, ats: &Freshness) {
        let mut words = ats.subscribe();
        while words.changed().await.is_ok() {
            if ats.is_caught_up() {
                self.wake_deferred_now();
            }
        }
        // The follower is gone (its replica is stopping): nothing catches up any more.
        std::future::pending::<()>().await;
    }

    fn wake_deferred_now(&self) {
        let deferred: Vec<AtKey> = lock(&self.deferred).drain().collect();
        for at in deferred {
            self.wake_up(at);
        }
    }

    /// Drops everything kept for `at`: its backoff, its wake-up, a put-off create.
    pub fn forget(&self, at: &AtKey) {
        remove(&self.failures, at);
        lock(&self.deferred).remove(at);
        self.wakeups.clear(at);
    }

    /// Drops what is kept for Ats `known` does not hold any more; returns those of them that
    /// had failures counted.
    pub fn retain(&self, known: impl Fn(&AtKey) -> bool) -> Vec<AtKey> {
        let dropped = {
            let mut failures = lock(&self.failures);
            let dropped: Vec<AtKey> = failures.keys().filter(|at| !known(at)).cloned().collect();
            failures.retain(|at, _| known(at));
            shrink_if_sparse(&mut failures);
            dropped
        };
        lock(&self.deferred).retain(|at| known(at));
        self.wakeups.retain(known);
        dropped
    }

    /// Entries kept now: failures, wake-ups (for tests of forgetting).
    #[cfg(test)]
    pub fn kept(&self) -> (usize, usize) {
        (lock(&self.failures).len(), self.wakeups.len())
    }
}

/// The one backoff: 0.5 s doubling to 5 minutes, with jitter, without end.
pub fn backoff() -> ExponentialBuilder {
    ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(Duration::from_secs(300))
        .with_jitter()
        .without_max_times()
}

/// Delay before retry number `attempt` (1-based) by `backoff`.
pub fn retry_delay(attempt: u32) -> Duration {
    backoff()
        .build()
        .nth(attempt.saturating_sub(1) as usize)
        .unwrap_or(Duration::from_secs(300))
}

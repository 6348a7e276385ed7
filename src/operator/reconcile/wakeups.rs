//! Which watched Ats need a reconcile now, and when the rest must be looked at: one ordered
//! index of the next `HORIZON` instead of a reconcile (and a runtime timer) per At.
//! See docs/src/design/decisions.md, "The wake-up index".

use super::decide::{decide, Call, PodObservation};
use crate::api::At;
use crate::operator::key::AtKey;
use crate::operator::policy::RunPolicy;
use crate::operator::shrink::shrink_if_sparse;
use crate::sync::lock;
use chrono::{DateTime, Utc};
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// How far ahead the index holds Ats.
pub const HORIZON: Duration = Duration::from_secs(3600);

/// How often the cache is looked through for Ats whose time came within the horizon.
pub const LOOK_AHEAD_EVERY: Duration = Duration::from_secs(1800);

// Each At is indexed well before its instant: at least half an hour.
const _: () = assert!(HORIZON.as_secs() >= LOOK_AHEAD_EVERY.as_secs() + 1800);

/// Whether an entry for `when` is kept in the index at `now`: only within the horizon.
pub fn within_horizon(when: Instant, now: Instant) -> bool {
    when.checked_duration_since(now)
        .is_none_or(|left| left <= HORIZON)
}

/// When a watched At needs its next reconcile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// Now: something to write, a pod to create or look up.
    Now,
    /// Nothing to do until this much time has passed.
    After(Duration),
    /// Nothing to do until the At (or its pod) changes.
    OnChange,
}

/// Decides from the At alone, as its reconcile would with no pod in the cache: a pod that
/// appears triggers its At's reconcile by itself.
pub fn wake(at: &At, now: DateTime<Utc>, policy: &RunPolicy) -> Wake {
    let decision = decide(at, &PodObservation::NotCached, now, policy);
    if decision.call != Call::Nothing || decision.status.is_some() || decision.retry {
        return Wake::Now;
    }
    match decision.requeue {
        Some(left) => Wake::After(left),
        None => Wake::OnChange,
    }
}

/// Instants at which Ats must be reconciled, earliest first; one entry per At.
#[derive(Default)]
pub struct Wakeups {
    index: Mutex<Index>,
    changed: Notify,
}

/// Both maps share one key per At (`AtKey`: its namespace and name in one string), not a
/// reference each, nor an `ObjectRef` (name and namespace allocated apart).
#[derive(Default)]
struct Index {
    by_time: BTreeMap<(Instant, u64), AtKey>,
    by_at: HashMap<AtKey, (Instant, u64)>,
    next_id: u64,
}

impl Wakeups {
    /// `at` is reconciled at `when` (replacing an earlier entry for it); beyond the horizon it
    /// waits in no index, for the look-ahead.
    pub fn set(&self, at: AtKey, when: Instant) {
        self.put(at, when, |_| true);
    }

    /// `at` is reconciled at `when`, or earlier if it already waits for an earlier instant (a
    /// failed write's retry must not put off the At's due time).
    pub fn set_earlier(&self, at: AtKey, when: Instant) {
        self.put(at, when, |set| when < set);
    }

    /// `set`, `left` from now (a wait past what an instant holds is beyond the horizon too).
    pub fn set_in(&self, at: AtKey, left: Duration) {
        match Instant::now().checked_add(left) {
            Some(when) => self.set(at, when),
            None => self.clear(&at),
        }
    }

    /// `set_earlier`, `left` from now.
    pub fn set_earlier_in(&self, at: AtKey, left: Duration) {
        if let Some(when) = Instant::now().checked_add(left) {
            self.set_earlier(at, when);
        }
    }

    /// Sets `at`'s entry to `when` unless it has one that `replaces` says to keep; a `when`
    /// beyond the horizon leaves it without one.
    fn put(&self, at: AtKey, when: Instant, replaces: impl Fn(Instant) -> bool) {
        let mut index = lock(&self.index);
        if let Some(&old) = index.by_at.get(&at) {
            if !replaces(old.0) {
                return;
            }
            // Removed first: `insert` would keep the old key, a second copy of the same one.
            index.by_at.remove(&at);
            index.by_time.remove(&old);
        }
        if !within_horizon(when, Instant::now()) {
            shrink_if_sparse(&mut index.by_at);
            return;
        }
        let id = index.next_id;
        index.next_id += 1;
        index.by_at.insert(at.clone(), (when, id));
        index.by_time.insert((when, id), at);
        drop(index);
        self.changed.notify_one();
    }

    /// `at` needs no wakeup (it is being reconciled now, or was deleted).
    pub fn clear(&self, at: &AtKey) {
        let mut index = lock(&self.index);
        if let Some(key) = index.by_at.remove(at) {
            index.by_time.remove(&key);
            shrink_if_sparse(&mut index.by_at);
        }
    }

    /// Keeps only the Ats `known` holds.
    pub fn retain(&self, known: impl Fn(&AtKey) -> bool) {
        let mut index = lock(&self.index);
        let gone: Vec<AtKey> = index.by_at.keys().filter(|k| !known(k)).cloned().collect();
        for at in gone {
            if let Some(entry) = index.by_at.remove(&at) {
                index.by_time.remove(&entry);
            }
        }
        shrink_if_sparse(&mut index.by_at);
    }

    /// When `at` is to be reconciled, if it waits in the index.
    pub fn when(&self, at: &AtKey) -> Option<Instant> {
        let index = lock(&self.index);
        index.by_at.get(at).map(|(when, _)| *when)
    }

    /// Entries now.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        lock(&self.index).by_at.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes and returns every At due at `now`, and the next instant after them.
    pub fn take_due(&self, now: Instant) -> (Vec<AtKey>, Option<Instant>) {
        let mut index = lock(&self.index);
        let mut due = Vec::new();
        while let Some(entry) = index.by_time.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let at = entry.remove();
            index.by_at.remove(&at);
            due.push(at);
        }
        shrink_if_sparse(&mut index.by_at);
        let next = index.by_time.keys().next().map(|(when, _)| *when);
        (due, next)
    }

    /// Runs until dropped: hands each At to `wake_up` when its instant comes.
    pub async fn run(&self, mut wake_up: impl FnMut(AtKey)) {
        loop {
            // Registered before looking, so an entry set meanwhile is not missed.
            let changed = self.changed.notified();
            let (due, next) = self.take_due(Instant::now());
            due.into_iter().for_each(&mut wake_up);
            match next {
                Some(next) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(next) => {}
                        _ = changed => {}
                    }
                }
                None => changed.await,
            }
        }
    }
}

#[cfg(test)]
mod tests;

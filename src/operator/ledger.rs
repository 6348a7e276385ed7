//! What the leader remembers of each At between reconciles, in one place with one `forget`:
//! the resourceVersion its last status write replaced (a cache still showing it is stale), its
//! consecutive failures (for the backoff), when it is looked at again (`Wakeups`), and whether a
//! version of it is quarantined after a panic. Every map is keyed by `AtKey` and gives its
//! spare room back after a burst.

use crate::api::Phase;
use crate::operator::contain::Quarantine;
use crate::operator::key::AtKey;
use crate::operator::reconcile::wakeups::Wakeups;
use crate::operator::spare::shrink_if_sparse;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The per-At memory of one leadership (the quarantine outlives it: it is the replica's).
pub struct Ledger {
    /// The resourceVersion our last status write replaced, and the phase it wrote.
    superseded: Mutex<HashMap<AtKey, (String, Phase)>>,
    /// Consecutive failed reconciles.
    pub(crate) failures: Mutex<HashMap<AtKey, u32>>,
    /// When settled Ats (and failed follow-up writes) are looked at again.
    wakeups: Arc<Wakeups>,
    /// At versions whose handling panicked: skipped until they change (see `contain`).
    quarantine: Arc<Quarantine>,
}

impl Ledger {
    pub fn new(quarantine: Arc<Quarantine>) -> Self {
        Ledger {
            superseded: Mutex::default(),
            failures: Mutex::default(),
            wakeups: Arc::default(),
            quarantine,
        }
    }

    /// When Ats are looked at again.
    pub fn wakeups(&self) -> &Arc<Wakeups> {
        &self.wakeups
    }

    /// The replica's quarantine.
    pub fn quarantine(&self) -> &Quarantine {
        &self.quarantine
    }

    /// Drops everything kept for `at`: its backoff, its last write, its quarantine, its wakeup.
    pub fn forget(&self, at: &AtKey) {
        remove(&self.failures, at);
        remove(&self.superseded, at);
        self.quarantine.remove(at);
        self.wakeups.clear(at);
    }

    /// Drops what is kept for Ats `known` does not hold any more.
    pub fn retain(&self, known: impl Fn(&AtKey) -> bool) {
        let dropped: Vec<AtKey> = {
            let failures = lock(&self.failures);
            let superseded = lock(&self.superseded);
            failures
                .keys()
                .chain(superseded.keys())
                .filter(|k| !known(k))
                .cloned()
                .collect()
        };
        for at in dropped {
            self.forget(&at);
        }
        self.wakeups.retain(known);
    }

    /// Entries kept now: failures, last writes, wakeups (for tests of forgetting).
    pub fn kept(&self) -> (usize, usize, usize) {
        let failures = lock(&self.failures).len();
        let superseded = lock(&self.superseded).len();
        (failures, superseded, self.wakeups.len())
    }

    /// The phase our last write gave `at` if the version seen is the one that write replaced
    /// (the cache is behind it); else `None`, and the record goes.
    pub fn stale(&self, at: &AtKey, resource_version: Option<&str>) -> Option<Phase> {
        let mut superseded = lock(&self.superseded);
        let written = superseded
            .get(at)
            .filter(|(rv, _)| Some(rv.as_str()) == resource_version)
            .map(|(_, phase)| *phase);
        if written.is_none() && superseded.remove(at).is_some() {
            shrink_if_sparse(&mut superseded);
        }
        written
    }

    /// Our status write of `phase` replaces `resource_version` of `at`.
    pub fn written(&self, at: AtKey, resource_version: String, phase: Phase) {
        lock(&self.superseded).insert(at, (resource_version, phase));
    }

    /// The write recorded for `at` did not land.
    pub fn unwritten(&self, at: &AtKey) {
        remove(&self.superseded, at);
    }

    /// One more failure of `at`: how many in a row that makes.
    pub fn failed(&self, at: &AtKey) -> u32 {
        let mut failures = lock(&self.failures);
        let count = failures.entry(at.clone()).or_insert(0);
        *count += 1;
        *count
    }

    /// `at` succeeded: its backoff starts over.
    pub fn succeeded(&self, at: &AtKey) {
        remove(&self.failures, at);
    }

    /// Whether this version of `at` is quarantined after a panic.
    pub fn quarantined(&self, at: &AtKey, resource_version: Option<&str>) -> bool {
        self.quarantine.holds(at, resource_version)
    }
}

fn lock<T>(map: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    map.lock().unwrap_or_else(|e| e.into_inner())
}

/// Removes `at`'s entry from a per-At map, giving back the map's spare room once it is mostly
/// empty (after a burst).
fn remove<V>(map: &Mutex<HashMap<AtKey, V>>, at: &AtKey) {
    let mut map = lock(map);
    if map.remove(at).is_some() {
        shrink_if_sparse(&mut map);
    }
}

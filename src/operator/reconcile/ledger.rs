//! What the leader remembers of each At between reconciles, with one `forget`: the version its
//! last status write replaced, its own PENDING write, quarantine, the At a look decoded.
//! See docs/src/design/architecture.md, "The reconcile loop".

use crate::api::{At, Phase};
use crate::operator::key::AtKey;
use crate::operator::quarantine::Quarantine;
use crate::operator::shrink::{remove, shrink_if_sparse};
use crate::sync::lock;
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};

/// The per-At memory of one leadership (the quarantine outlives it: it is the replica's).
pub struct Ledger {
    /// The resourceVersion our last status write replaced, and the phase it wrote.
    superseded: Mutex<HashMap<AtKey, (String, Phase)>>,
    /// At versions whose handling panicked: skipped until they change (see `quarantine`).
    quarantine: Arc<Quarantine>,
    /// Ats a look found work for, as it decoded them, until their reconcile takes them.
    decoded: Mutex<HashMap<AtKey, Arc<At>>>,
    /// Per At, the version this leadership's last status write made (or found) leaving the At
    /// PENDING: a hash of the At's key, to a hash of that resourceVersion.
    pending_written: Mutex<HashMap<u64, u64>>,
    hasher: RandomState,
}

/// Ats kept in `pending_written` at most; past this they are dropped all at once (pod creates
/// from those versions then read the At first, as for any other version). Entries go with
/// `forget`; those of Ats a relist found gone stay until then, or until the leadership ends.
pub const MAX_PENDING_WRITTEN: usize = 1 << 20;

/// Decoded Ats kept for their reconcile at most; past this a reconcile decodes its At again
/// (when a burst falls due at once, most wait in the runtime's queue, which holds only keys).
pub const MAX_DECODED: usize = 1024;

impl Ledger {
    pub fn new(quarantine: Arc<Quarantine>) -> Self {
        Ledger {
            superseded: Mutex::default(),
            quarantine,
            decoded: Mutex::default(),
            pending_written: Mutex::default(),
            hasher: RandomState::new(),
        }
    }

    /// The replica's quarantine.
    pub fn quarantine(&self) -> &Quarantine {
        &self.quarantine
    }

    /// Drops everything kept for `at`: its last write, its quarantine, its decoded copy.
    pub fn forget(&self, at: &AtKey) {
        remove(&self.superseded, at);
        remove(&self.decoded, at);
        remove(&self.pending_written, &self.hasher.hash_one(at));
        self.quarantine.remove(at);
    }

    /// Drops what is kept for Ats `known` does not hold any more.
    pub fn retain(&self, known: impl Fn(&AtKey) -> bool) {
        let dropped: Vec<AtKey> = {
            let superseded = lock(&self.superseded);
            let decoded = lock(&self.decoded);
            superseded
                .keys()
                .chain(decoded.keys())
                .filter(|k| !known(k))
                .cloned()
                .collect()
        };
        for at in dropped {
            self.forget(&at);
        }
    }

    /// Last writes kept now (for tests of forgetting).
    #[cfg(test)]
    pub fn kept(&self) -> usize {
        lock(&self.superseded).len()
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

    /// This leadership's status write left `at` PENDING at `resource_version`, which the API
    /// server held when the precondition passed: nobody else created a pod from it since.
    pub fn pending_written(&self, at: &AtKey, resource_version: &str) {
        let (key, version) = (
            self.hasher.hash_one(at),
            self.hasher.hash_one(resource_version),
        );
        let mut written = lock(&self.pending_written);
        if written.len() >= MAX_PENDING_WRITTEN && !written.contains_key(&key) {
            written.clear();
            written.shrink_to_fit();
        }
        written.insert(key, version);
    }

    /// Whether `resource_version` of `at` is the one this leadership's own last write left
    /// PENDING (and nothing has been decided on it since: `replaced`).
    pub fn pending_confirmed(&self, at: &AtKey, resource_version: Option<&str>) -> bool {
        resource_version.is_some_and(|version| {
            let key = self.hasher.hash_one(at);
            let version = self.hasher.hash_one(version);
            lock(&self.pending_written).get(&key) == Some(&version)
        })
    }

    /// A write or a pod create was decided on `resource_version` of `at`: that version no longer
    /// confirms anything.
    pub fn replaced(&self, at: &AtKey, resource_version: &str) {
        let (key, version) = (
            self.hasher.hash_one(at),
            self.hasher.hash_one(resource_version),
        );
        let mut written = lock(&self.pending_written);
        if written.get(&key) == Some(&version) {
            written.remove(&key);
            shrink_if_sparse(&mut written);
        }
    }

    /// The write recorded for `at` did not land.
    pub fn unwritten(&self, at: &AtKey) {
        remove(&self.superseded, at);
    }

    /// Keeps `at`, as a look that found work decoded it, for its reconcile (`take_decoded`).
    pub fn keep_decoded(&self, at: Arc<At>) {
        let key = AtKey::from(at.as_ref());
        let mut decoded = lock(&self.decoded);
        if decoded.len() < MAX_DECODED || decoded.contains_key(&key) {
            decoded.insert(key, at);
        }
    }

    /// The At kept for `at`'s reconcile, if it is the version the cache holds now.
    pub fn take_decoded(&self, at: &AtKey, resource_version: Option<&str>) -> Option<Arc<At>> {
        let kept = remove(&self.decoded, at)?;
        (kept.metadata.resource_version.as_deref() == resource_version).then_some(kept)
    }

    /// Whether this version of `at` is quarantined after a panic.
    pub fn quarantined(&self, at: &AtKey, resource_version: Option<&str>) -> bool {
        self.quarantine.holds(at, resource_version)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(name: &str, version: &str) -> Arc<At> {
        let mut at = At::new(name, crate::api::AtSpec::default());
        at.metadata.namespace = Some("default".into());
        at.metadata.resource_version = Some(version.into());
        Arc::new(at)
    }

    #[test]
    fn a_pending_write_confirms_its_version_until_a_decision_on_it_or_the_at_is_forgotten() {
        let ledger = Ledger::new(Arc::default());
        let (a, b) = (AtKey::new("default", "a"), AtKey::new("default", "b"));
        ledger.pending_written(&a, "7");
        assert!(ledger.pending_confirmed(&a, Some("7")));
        assert!(!ledger.pending_confirmed(&a, Some("8")), "another version");
        assert!(!ledger.pending_confirmed(&a, None));
        assert!(!ledger.pending_confirmed(&b, Some("7")), "another At");
        ledger.replaced(&a, "6");
        assert!(
            ledger.pending_confirmed(&a, Some("7")),
            "an older version replaced"
        );
        ledger.replaced(&a, "7");
        assert!(!ledger.pending_confirmed(&a, Some("7")), "decided on once");
        // A newer write replaces the older one; forgetting the At drops it.
        ledger.pending_written(&a, "7");
        ledger.pending_written(&a, "9");
        assert!(!ledger.pending_confirmed(&a, Some("7")));
        assert!(ledger.pending_confirmed(&a, Some("9")));
        ledger.forget(&a);
        assert!(!ledger.pending_confirmed(&a, Some("9")));
        assert!(lock(&ledger.pending_written).is_empty());
    }

    #[test]
    fn a_decoded_at_goes_to_the_reconcile_of_the_same_version_once_and_is_bounded() {
        let ledger = Ledger::new(Arc::default());
        let key = AtKey::new("default", "a");
        ledger.keep_decoded(at("a", "1"));
        assert!(
            ledger.take_decoded(&key, Some("2")).is_none(),
            "another version"
        );
        assert!(
            ledger.take_decoded(&key, Some("1")).is_none(),
            "taken, even unused"
        );
        ledger.keep_decoded(at("a", "1"));
        ledger.keep_decoded(at("a", "2"));
        let taken = ledger
            .take_decoded(&key, Some("2"))
            .expect("the newer version");
        assert_eq!(taken.metadata.resource_version.as_deref(), Some("2"));
        assert!(ledger.take_decoded(&key, Some("2")).is_none(), "once");

        for i in 0..MAX_DECODED + 10 {
            ledger.keep_decoded(at(&format!("at-{i}"), "1"));
        }
        assert_eq!(lock(&ledger.decoded).len(), MAX_DECODED);
        let last = AtKey::new("default", &format!("at-{}", MAX_DECODED + 9));
        assert!(
            ledger.take_decoded(&last, Some("1")).is_none(),
            "past the bound"
        );
        let first = AtKey::new("default", "at-0");
        ledger.forget(&first);
        assert!(
            ledger.take_decoded(&first, Some("1")).is_none(),
            "forgotten"
        );
        ledger.retain(|_| false);
        assert!(lock(&ledger.decoded).is_empty(), "a sweep drops them too");
    }
}

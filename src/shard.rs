//! Ats split into list shards by a label, so that a replica that starts lists them with several
//! requests at once. Pure; shared by the mutating webhook (which labels each At it admits) and
//! the At cache (which lists each shard, and the Ats without a shard, at the same time).
//!
//! Why: kube-apiserver encodes one list response on one goroutine. Measured on v1.24 with
//! 100,000 PENDING Ats on this project's 2-core machine (README, "How the first list got
//! fast"), one list at `resourceVersion=0` took 8.0-9.3 s to arrive, four shard lists at once
//! 4.8-7.1 s: the server encodes them on both cores.
//!
//! The lists together hold every At exactly once whatever the labels say: one list per shard
//! value `0`..`SHARDS-1`, and one of every At whose label is missing or anything else (Ats
//! stored before the webhook labelled them, created while it was not called, or labelled by
//! hand). So a wrong or missing label makes the list slower, never incomplete.

use std::collections::BTreeMap;
use std::hash::Hasher;

/// The label that names an At's list shard.
pub const LABEL: &str = "cnat.programming-kubernetes.info/shard";

/// How many shards the mutating webhook spreads Ats over.
pub const SHARDS: usize = 4;

/// The shard for an At, from `seed`: its `namespace/name`, or anything unique to it when it has
/// no name yet (a create with `generateName`). The same seed always gets the same shard
/// (FNV-1a, which does not change between releases).
pub fn assign(seed: &str) -> String {
    let mut hash = fnv::FnvHasher::default();
    hash.write(seed.as_bytes());
    (hash.finish() % SHARDS as u64).to_string()
}

/// The label selectors of the lists that together return every At once: shard `i` for `i` in
/// `0..SHARDS`, then every other At.
pub fn selectors() -> Vec<String> {
    let values: Vec<String> = (0..SHARDS).map(|i| i.to_string()).collect();
    (0..SHARDS)
        .map(|i| format!("{LABEL}={i}"))
        .chain([format!("{LABEL} notin ({})", values.join(","))])
        .collect()
}

/// Which of `selectors()` selects an At with these labels.
pub fn list_of(labels: Option<&BTreeMap<String, String>>) -> usize {
    labels
        .and_then(|labels| labels.get(LABEL))
        .and_then(|value| (0..SHARDS).find(|i| *value == i.to_string()))
        .unwrap_or(SHARDS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(value: Option<&str>) -> BTreeMap<String, String> {
        let mut labels = BTreeMap::from([("app".to_owned(), "x".to_owned())]);
        if let Some(value) = value {
            labels.insert(LABEL.to_owned(), value.to_owned());
        }
        labels
    }

    #[test]
    fn every_assigned_shard_is_listed_by_its_own_selector() {
        let mut seen = [0usize; SHARDS];
        for i in 0..10_000 {
            let shard = assign(&format!("default/at-{i:06}"));
            let list = list_of(Some(&labels(Some(&shard))));
            assert!(list < SHARDS, "{shard}");
            assert_eq!(selectors()[list], format!("{LABEL}={shard}"));
            seen[list] += 1;
        }
        // Spread evenly enough to list in parallel (each within 10% of a quarter).
        for count in seen {
            assert!((2250..=2750).contains(&count), "{seen:?}");
        }
    }

    #[test]
    fn the_same_seed_gets_the_same_shard_in_every_release() {
        // FNV-1a of these seeds, fixed: a change would move Ats between shards on an upgrade.
        assert_eq!(assign("default/at-000000"), assign("default/at-000000"));
        assert_eq!(
            ["a", "default/x", "", "ns/at-1"].map(assign),
            ["0", "1", "1", "0"]
        );
    }

    #[test]
    fn ats_without_a_shard_or_with_another_value_go_to_the_last_list() {
        assert_eq!(list_of(None), SHARDS);
        for value in [None, Some(""), Some("4"), Some("00"), Some(" 1"), Some("x")] {
            assert_eq!(list_of(Some(&labels(value))), SHARDS, "{value:?}");
        }
        assert_eq!(
            selectors().last().unwrap(),
            &format!("{LABEL} notin (0,1,2,3)")
        );
        assert_eq!(selectors().len(), SHARDS + 1);
    }
}

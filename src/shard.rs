//! Ats split into list shards by a label, so that a replica that starts lists them with several
//! requests at once. Pure; shared by the mutating webhook (which labels each At it admits) and
//! the At cache (which lists each shard, and the Ats without a shard, at the same time).
//!
//! Why: kube-apiserver encodes a list response on one goroutine. Measured on v1.24 with
//! 100,000 PENDING Ats on this project's 2-core machine (docs/src/design/decisions.md,
//! "List shards"), one list at `resourceVersion=0` took 8.0-9.3 s to arrive, the five lists of four
//! shards at once 4.8-7.1 s: the server encodes them on both cores.
//!
//! The lists together hold every At exactly once whatever the labels say: one list per shard
//! value `0`..`SHARDS-1`, and one of every At whose label is missing or anything else (Ats
//! stored before the webhook labelled them, created while it was not called, or labelled by
//! hand). So a wrong or missing label makes the list slower, never incomplete.

use std::collections::BTreeMap;

/// The label that names an At's list shard.
pub const LABEL: &str = "cnat.programming-kubernetes.info/shard";

/// How many shards the mutating webhook spreads Ats over.
pub const SHARDS: usize = 4;

/// The shard for an At, from `seed`: its `namespace/name`, or anything unique to it when it has
/// no name yet (a create with `generateName`). The same seed always gets the same shard (XXH3,
/// whose output its specification fixes), and names that differ in one character spread over
/// every shard.
pub fn assign(seed: &str) -> String {
    (xxhash_rust::xxh3::xxh3_64(seed.as_bytes()) % SHARDS as u64).to_string()
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
        // Fixed (the reference xxhash library gives the same): a change would move new Ats to
        // other shards than their like after an upgrade.
        assert_eq!(
            ["a", "default/x", "", "ns/at-1"].map(assign),
            ["3", "0", "2", "2"]
        );
    }

    #[test]
    fn names_that_differ_only_in_high_bits_of_a_character_still_spread() {
        // Characters that agree in their two lowest bits (which a hash like FNV-1a with `% 4`
        // would put in one shard).
        let chars = "aeimquy";
        let mut seen = [0usize; SHARDS];
        for a in chars.chars() {
            for b in chars.chars() {
                let list = list_of(Some(&labels(Some(&assign(&format!("default/job-{a}{b}"))))));
                seen[list] += 1;
            }
        }
        assert!(seen.iter().all(|n| *n >= 6), "{seen:?}");
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

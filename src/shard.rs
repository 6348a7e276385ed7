//! Ats split by a shard label: list shard `value % SHARDS`, Lease shard `value % N`. Pure.
//! Whatever the labels say, every At is in exactly one list and one Lease shard.
//! See docs/src/design/decisions.md, "List shards" and "Lease shards".

use std::collections::BTreeMap;

/// The label that names an At's shard (and, copied by the leader, its pod's).
pub const LABEL: &str = "cnat.programming-kubernetes.info/shard";

/// How many list shards the cache lists at once (`selectors()`).
pub const SHARDS: usize = 4;

/// How many values the label takes: the most Lease shards there can be.
pub const VALUES: usize = 60;

/// The shard label's value for an At, from `seed`: its `namespace/name`, or anything unique to
/// it before it has a name (`generateName`). Stable: XXH3's output is fixed by its specification.
pub fn assign(seed: &str) -> String {
    (xxhash_rust::xxh3::xxh3_64(seed.as_bytes()) % VALUES as u64).to_string()
}

/// The shard label's value in these labels, when it is one `assign` gives (`"7"`, not `"07"`).
pub fn value_of(labels: Option<&BTreeMap<String, String>>) -> Option<u8> {
    let text = labels?.get(LABEL)?;
    let value: u8 = text.parse().ok()?;
    (usize::from(value) < VALUES && value.to_string() == *text).then_some(value)
}

/// What an update may do to the shard label (the validating webhook checks it): a value `assign`
/// gives never changes nor goes, so an At never moves between Lease shards (`operator::reconcile`'s
/// own-write shortcut relies on this); an At without one may get `assign(seed())`'s, nothing
/// else. `seed` makes the At's `namespace/name` (only when needed).
pub fn change_problem(
    seed: impl FnOnce() -> String,
    old: Option<&BTreeMap<String, String>>,
    new: Option<&BTreeMap<String, String>>,
) -> Option<String> {
    fn text(labels: Option<&BTreeMap<String, String>>) -> Option<&str> {
        labels?.get(LABEL).map(String::as_str)
    }
    let (was, now) = (text(old), text(new));
    if was == now {
        return None;
    }
    let field = format!("metadata.labels[{LABEL}]");
    if value_of(old).is_some() {
        let was = was.unwrap_or_default();
        return Some(match now {
            Some(now) => format!(
                "{field}: cannot change from {was:?} to {now:?}: cnat sets it when the At is created and the At stays in that shard; leave the label as it is"
            ),
            None => format!(
                "{field}: cannot be removed (it is {was:?}): cnat sets it when the At is created and the At stays in that shard; leave the label as it is"
            ),
        });
    }
    value_of(new)?;
    let assigned = assign(&seed());
    (now != Some(assigned.as_str())).then(|| {
        format!(
            "{field}: {:?} is not this At's shard: cnat sets the label ({assigned:?} for this At); leave it out",
            now.unwrap_or_default()
        )
    })
}

/// `label <operator> (values)`, `operator` being `in` or `notin`.
fn requirement(operator: &str, values: impl Iterator<Item = usize>) -> String {
    let values: Vec<String> = values.map(|v| v.to_string()).collect();
    format!("{LABEL} {operator} ({})", values.join(","))
}

/// The label selectors of the lists that together return every At once: list shard `i` for
/// `i` in `0..SHARDS`, then every other At.
pub fn selectors() -> Vec<String> {
    (0..SHARDS)
        .map(|i| requirement("in", (i..VALUES).step_by(SHARDS)))
        .chain([requirement("notin", 0..VALUES)])
        .collect()
}

/// Which of `selectors()` selects an At with these labels.
pub fn list_of(labels: Option<&BTreeMap<String, String>>) -> usize {
    list_of_value(value_of(labels))
}

/// Which of `selectors()` selects an At whose label has this value (`value_of`).
pub fn list_of_value(value: Option<u8>) -> usize {
    value.map_or(SHARDS, |value| usize::from(value) % SHARDS)
}

/// The Ats split among `count` Leases (`cnat run --shards`): shard `i` holds the Ats whose
/// label value is `i` modulo `count`, and shard 0 also every At without such a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shards {
    count: usize,
}

/// `--shards` out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--shards {0}: give 1 (one Lease, the default) to {VALUES} (the values of the label {LABEL}); 2-6 fit most clusters")]
pub struct ShardCountError(pub usize);

impl Shards {
    pub fn new(count: usize) -> Result<Shards, ShardCountError> {
        if (1..=VALUES).contains(&count) {
            Ok(Shards { count })
        } else {
            Err(ShardCountError(count))
        }
    }

    pub fn count(&self) -> usize {
        self.count
    }

    /// The shard an At with these labels is in.
    pub fn of(&self, labels: Option<&BTreeMap<String, String>>) -> usize {
        value_of(labels).map_or(0, |value| usize::from(value) % self.count)
    }

    /// The label selector of shard `shard`'s Ats and their pods: `None` for one shard (every
    /// At); shard 0's also selects every At without a value.
    pub fn selector(&self, shard: usize) -> Option<String> {
        let theirs = |of: usize| (0..VALUES).filter(move |v| v % self.count == of);
        match shard {
            _ if self.count == 1 => None,
            0 => Some(requirement(
                "notin",
                (0..VALUES).filter(|v| v % self.count != 0),
            )),
            shard => Some(requirement("in", theirs(shard))),
        }
    }
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

    /// Whether `selector` (one `in`/`notin` requirement on `LABEL`, as this module writes them)
    /// selects these labels, read as kube-apiserver reads it.
    fn selects(selector: &str, labels: &BTreeMap<String, String>) -> bool {
        let (negated, rest) = match selector.strip_prefix(&format!("{LABEL} notin (")) {
            Some(rest) => (true, rest),
            None => (
                false,
                selector
                    .strip_prefix(&format!("{LABEL} in ("))
                    .expect("an in or notin requirement"),
            ),
        };
        let values: Vec<&str> = rest.strip_suffix(')').unwrap().split(',').collect();
        let listed = labels
            .get(LABEL)
            .is_some_and(|v| values.contains(&v.as_str()));
        listed != negated
    }

    fn odd_values() -> Vec<Option<&'static str>> {
        vec![
            None,
            Some(""),
            Some("60"),
            Some("00"),
            Some("07"),
            Some(" 1"),
            Some("x"),
            Some("-1"),
            Some("255"),
            Some("1000"),
        ]
    }

    #[test]
    fn every_assigned_shard_is_listed_by_its_own_selector() {
        let mut seen = [0usize; SHARDS];
        for i in 0..10_000 {
            let value = assign(&format!("default/at-{i:06}"));
            let list = list_of(Some(&labels(Some(&value))));
            assert!(list < SHARDS, "{value}");
            assert!(
                selects(&selectors()[list], &labels(Some(&value))),
                "{value}"
            );
            seen[list] += 1;
        }
        // Spread evenly enough to list in parallel (each within 10% of a quarter).
        for count in seen {
            assert!((2250..=2750).contains(&count), "{seen:?}");
        }
    }

    #[test]
    fn every_value_and_every_odd_label_is_in_exactly_one_list() {
        let values: Vec<String> = (0..VALUES).map(|v| v.to_string()).collect();
        let all = values.iter().map(|v| Some(v.as_str())).chain(odd_values());
        for value in all {
            let labels = labels(value);
            let selecting: Vec<usize> = (0..=SHARDS)
                .filter(|i| selects(&selectors()[*i], &labels))
                .collect();
            assert_eq!(selecting, vec![list_of(Some(&labels))], "{value:?}");
        }
    }

    #[test]
    fn the_same_seed_gets_the_same_value_in_every_release() {
        // Fixed (Python's xxhash gives the same: `xxh3_64_intdigest(seed) % 60`): a change would
        // move new Ats to other shards than their like after an upgrade.
        assert_eq!(
            ["a", "default/x", "", "ns/at-1"].map(assign),
            ["19", "44", "58", "58"]
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
    fn ats_without_a_value_go_to_the_last_list_and_lease_shard_0() {
        assert_eq!(list_of(None), SHARDS);
        let shards = Shards::new(3).unwrap();
        for value in odd_values() {
            assert_eq!(list_of(Some(&labels(value))), SHARDS, "{value:?}");
            assert_eq!(shards.of(Some(&labels(value))), 0, "{value:?}");
        }
        assert_eq!(selectors().len(), SHARDS + 1);
        // Values builds before Lease shards gave (0-3) read as they did.
        for old in 0..4 {
            let labels = labels(Some(&old.to_string()));
            assert_eq!(list_of(Some(&labels)), old);
        }
    }

    #[test]
    fn each_at_is_in_exactly_the_lease_shard_whose_selector_selects_it() {
        let values: Vec<String> = (0..VALUES).map(|v| v.to_string()).collect();
        for count in 1..=VALUES {
            let shards = Shards::new(count).unwrap();
            let all = values.iter().map(|v| Some(v.as_str())).chain(odd_values());
            for value in all {
                let labels = labels(value);
                let selecting: Vec<usize> = (0..count)
                    .filter(|i| shards.selector(*i).is_none_or(|s| selects(&s, &labels)))
                    .collect();
                assert_eq!(
                    selecting,
                    vec![shards.of(Some(&labels))],
                    "{count} {value:?}"
                );
            }
        }
    }

    #[test]
    fn lease_shards_split_the_values_within_one_of_even() {
        for count in 1..=VALUES {
            let shards = Shards::new(count).unwrap();
            let mut sizes = vec![0usize; count];
            for value in 0..VALUES {
                sizes[shards.of(Some(&labels(Some(&value.to_string()))))] += 1;
            }
            let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(max - min <= 1, "{count}: {sizes:?}");
            if VALUES.is_multiple_of(count) {
                assert_eq!(min, max, "{count}: {sizes:?}");
            }
        }
    }

    #[test]
    fn shard_counts_outside_1_to_60_are_refused_with_the_range() {
        for bad in [0, 61, 1000] {
            let error = Shards::new(bad).unwrap_err().to_string();
            assert!(
                error.starts_with(&format!("--shards {bad}: give 1")),
                "{error}"
            );
            assert!(error.contains("to 60"), "{error}");
        }
        assert_eq!(Shards::new(1).unwrap().selector(0), None);
        assert_eq!(
            Shards::new(2).unwrap().selector(1).unwrap(),
            format!("{LABEL} in (1,3,5,7,9,11,13,15,17,19,21,23,25,27,29,31,33,35,37,39,41,43,45,47,49,51,53,55,57,59)")
        );
    }

    #[test]
    fn a_shard_value_is_kept_and_only_the_assigned_one_may_be_added() {
        let seed = "ns/x";
        let ours = assign(seed);
        let other = ((ours.parse::<usize>().unwrap() + 1) % VALUES).to_string();
        let with = |v: &str| labels(Some(v));
        let without = labels(None);
        fn allowed(
            old: Option<&BTreeMap<String, String>>,
            new: Option<&BTreeMap<String, String>>,
        ) -> bool {
            change_problem(|| "ns/x".to_owned(), old, new).is_none()
        }
        // Unchanged, whatever it holds; other labels come and go.
        for value in [ours.as_str(), "07", "x"] {
            assert!(allowed(Some(&with(value)), Some(&with(value))), "{value}");
        }
        assert!(allowed(None, None));
        assert!(allowed(Some(&without), None));
        // A value `assign` gives never changes and is not removed.
        for old in [ours.as_str(), other.as_str(), "0", "59"] {
            for new in [
                Some(with("1")),
                Some(with("x")),
                Some(without.clone()),
                None,
            ] {
                let problem = change_problem(|| seed.to_owned(), Some(&with(old)), new.as_ref());
                assert!(
                    problem
                        .as_ref()
                        .is_some_and(|p| p.contains(&format!("{old:?}"))
                            && p.starts_with(&format!("metadata.labels[{LABEL}]: cannot"))
                            && p.ends_with("leave the label as it is")),
                    "{old} -> {new:?}: {problem:?}"
                );
            }
        }
        // Without one: the assigned value may come, no other value; anything that is no value
        // (removed, another text) leaves the At where it was.
        for old in [
            None,
            Some(without.clone()),
            Some(with("07")),
            Some(with("x")),
        ] {
            assert!(allowed(old.as_ref(), Some(&with(&ours))), "{old:?}");
            assert!(allowed(old.as_ref(), Some(&with("60"))), "{old:?}");
            assert!(allowed(old.as_ref(), None), "{old:?}");
            let problem =
                change_problem(|| seed.to_owned(), old.as_ref(), Some(&with(&other))).unwrap();
            assert_eq!(
                problem,
                format!("metadata.labels[{LABEL}]: {other:?} is not this At's shard: cnat sets the label ({ours:?} for this At); leave it out")
            );
        }
    }
}

//! The bounds on every number in an At's spec, shared by the CRD schema (`api`), the admission
//! rules and `cnat check` (`admission::validation`), and the state machine, which gives an At
//! stored before these bounds existed a terminal reason instead of doing arithmetic on it. Pure.
//!
//! Each bound is the one Kubernetes uses for the same field: a pod's `activeDeadlineSeconds`
//! must be between 1 and 2147483647 (the API server refuses the pod otherwise), and a Job's
//! `ttlSecondsAfterFinished` is an int32; a CronJob's `startingDeadlineSeconds` has no upper
//! bound in Kubernetes, so it gets the same 2147483647 (68 years), which keeps every instant
//! cnat computes from it within what it can represent.

use crate::api::AtSpec;

/// The largest value of every seconds field: `2^31 - 1`, about 68 years.
pub const MAX_SECONDS: i64 = i32::MAX as i64;

/// One numeric field's allowed range and what it means, for messages.
struct Bound {
    field: &'static str,
    value: Option<i64>,
    min: i64,
    meaning: &'static str,
}

fn bounds(spec: &AtSpec) -> [Bound; 3] {
    [
        Bound {
            field: "spec.startingDeadlineSeconds",
            value: spec.starting_deadline_seconds,
            min: 0,
            meaning: "seconds after the schedule during which the command may still start",
        },
        Bound {
            field: "spec.activeDeadlineSeconds",
            value: spec.active_deadline_seconds,
            min: 1,
            meaning: "the command's time limit in seconds",
        },
        Bound {
            field: "spec.ttlSecondsAfterFinished",
            value: spec.ttl_seconds_after_finished.map(i64::from),
            min: 0,
            meaning: "seconds to keep the At once Done",
        },
    ]
}

/// Every numeric field of `spec` outside its range, each message naming the field, the value,
/// the range and the fix. `changed(field)` says which fields to check (an update is checked only
/// for what it changes).
pub fn problems(spec: &AtSpec, changed: impl Fn(&str) -> bool) -> Vec<String> {
    bounds(spec)
        .into_iter()
        .filter(|b| changed(b.field))
        .filter_map(|b| {
            let value = b.value.filter(|v| *v < b.min || *v > MAX_SECONDS)?;
            Some(format!(
                "{}: {value} is out of range: it must be between {} and {MAX_SECONDS} ({}); remove it for no limit",
                b.field, b.min, b.meaning
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(starting: Option<i64>, active: Option<i64>, ttl: Option<i32>) -> AtSpec {
        AtSpec {
            starting_deadline_seconds: starting,
            active_deadline_seconds: active,
            ttl_seconds_after_finished: ttl,
            ..AtSpec::default()
        }
    }

    #[test]
    fn the_ends_of_every_range_pass() {
        let all = |_: &str| true;
        assert!(problems(&spec(None, None, None), all).is_empty());
        assert!(problems(&spec(Some(0), Some(1), Some(0)), all).is_empty());
        let max = Some(MAX_SECONDS);
        assert!(problems(&spec(max, max, Some(i32::MAX)), all).is_empty());
    }

    #[test]
    fn values_past_either_end_name_field_value_range_and_fix() {
        let found = problems(&spec(Some(10_000_000_000_000), Some(0), Some(-1)), |_| true);
        assert_eq!(
            found,
            [
                "spec.startingDeadlineSeconds: 10000000000000 is out of range: it must be between 0 and 2147483647 (seconds after the schedule during which the command may still start); remove it for no limit",
                "spec.activeDeadlineSeconds: 0 is out of range: it must be between 1 and 2147483647 (the command's time limit in seconds); remove it for no limit",
                "spec.ttlSecondsAfterFinished: -1 is out of range: it must be between 0 and 2147483647 (seconds to keep the At once Done); remove it for no limit",
            ]
        );
        let extremes = spec(Some(i64::MIN), Some(i64::MAX), Some(i32::MIN));
        assert_eq!(problems(&extremes, |_| true).len(), 3);
    }

    #[test]
    fn only_the_fields_asked_for_are_checked() {
        let bad = spec(Some(-1), Some(-1), None);
        let found = problems(&bad, |field| field == "spec.activeDeadlineSeconds");
        assert_eq!(found.len(), 1);
        assert!(found[0].starts_with("spec.activeDeadlineSeconds: -1"));
    }
}

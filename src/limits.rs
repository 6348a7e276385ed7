//! The bounds on every number and size in an At's spec, shared by the CRD schema (`api`), the
//! admission rules, `cnat check` and the state machine. Pure. See docs/src/guide/at-api.md,
//! "Limits", and docs/src/guide/schedules.md, "Deadlines and clean-up".

use crate::api::AtSpec;

pub mod bounds;

pub use bounds::*;

/// One size of `spec`: the field, how big it is, how big it may be, in what unit, and the fix.
struct Size {
    field: &'static str,
    size: usize,
    max: usize,
    unit: &'static str,
    fix: &'static str,
}

fn sizes(spec: &AtSpec) -> [Size; 11] {
    let template = &spec.template;
    let chars = |s: Option<&String>| s.map_or(0, |s| s.chars().count());
    let items = |n: Option<usize>| n.unwrap_or(0);
    let metadata = template.metadata.as_ref();
    let shorter = "shorten it";
    let fewer = "remove some";
    [
        Size {
            field: "spec.command",
            size: spec.command.len(),
            max: MAX_COMMAND,
            unit: "bytes",
            fix: "put a longer script in the image and run it from there",
        },
        Size {
            field: "spec.schedule",
            size: chars(Some(&spec.schedule)),
            max: MAX_SCHEDULE,
            unit: "characters",
            fix: "give one time, e.g. 2019-04-12T10:12:00Z",
        },
        Size {
            field: "spec.timeZone",
            size: chars(spec.time_zone.as_ref()),
            max: MAX_TIME_ZONE,
            unit: "characters",
            fix: "give an IANA name, e.g. Europe/Berlin",
        },
        Size {
            field: "spec.template.image",
            size: chars(template.image.as_ref()),
            max: MAX_IMAGE,
            unit: "characters",
            fix: shorter,
        },
        Size {
            field: "spec.template.serviceAccountName",
            size: chars(template.service_account_name.as_ref()),
            max: MAX_NAME,
            unit: "characters",
            fix: shorter,
        },
        Size {
            field: "spec.template.env",
            size: items(template.env.as_ref().map(Vec::len)),
            max: MAX_ENV,
            unit: "variables",
            fix: "pass fewer, or read them from one Secret or ConfigMap key",
        },
        Size {
            field: "spec.template.nodeSelector",
            size: items(template.node_selector.as_ref().map(|m| m.len())),
            max: MAX_ENTRIES,
            unit: "entries",
            fix: fewer,
        },
        Size {
            field: "spec.template.metadata.labels",
            size: items(metadata.and_then(|m| m.labels.as_ref()).map(|m| m.len())),
            max: MAX_ENTRIES,
            unit: "entries",
            fix: fewer,
        },
        Size {
            field: "spec.template.metadata.annotations",
            size: items(
                metadata
                    .and_then(|m| m.annotations.as_ref())
                    .map(|m| m.len()),
            ),
            max: MAX_ENTRIES,
            unit: "entries",
            fix: fewer,
        },
        Size {
            field: "spec.template.tolerations",
            size: items(template.tolerations.as_ref().map(Vec::len)),
            max: MAX_TOLERATIONS,
            unit: "items",
            fix: fewer,
        },
        Size {
            field: "spec.template.imagePullSecrets",
            size: items(template.image_pull_secrets.as_ref().map(Vec::len)),
            max: MAX_PULL_SECRETS,
            unit: "items",
            fix: fewer,
        },
    ]
}

/// Every size of `spec` over its bound (the whole spec: [`MAX_SPEC_BYTES`]), each message naming
/// field, size, bound and fix; `changed(field)` says which to check (`"spec"`: the whole spec).
pub fn size_problems(spec: &AtSpec, changed: impl Fn(&str) -> bool) -> Vec<String> {
    let mut problems: Vec<String> = sizes(spec)
        .into_iter()
        .filter(|s| s.size > s.max && changed(s.field))
        .map(|s| {
            format!(
                "{}: {} {}, more than the {} an At may have; {}",
                s.field, s.size, s.unit, s.max, s.fix
            )
        })
        .collect();
    if problems.is_empty() && changed("spec") {
        let bytes = json_bytes(spec);
        if bytes > MAX_SPEC_BYTES {
            problems.push(format!(
                "spec: {bytes} bytes as JSON, more than the {MAX_SPEC_BYTES} an At may hold (each replica keeps every At in memory); make the command or the pod settings shorter"
            ));
        }
    }
    problems
}

/// How many bytes `value` takes as compact JSON, counted as it is written: no copy is made.
fn json_bytes(value: &impl serde::Serialize) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing to a counter cannot fail, and an At's spec always serializes.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

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

/// Every numeric field of `spec` outside its range, each message naming field, value, range and
/// fix; `changed(field)` says which to check (an update only for what it changes).
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
    fn sizes_at_their_bounds_pass_and_one_more_is_refused_with_the_bound_and_the_fix() {
        use crate::api::PodMetadata;
        use k8s_openapi::api::core::v1::{EnvVar, LocalObjectReference, Toleration};
        let all = |_: &str| true;
        let map = |n: usize| (0..n).map(|i| (format!("k{i}"), "v".to_owned())).collect();
        let full = |extra: usize| {
            let mut spec = AtSpec {
                command: "x".repeat(MAX_COMMAND - 1000 + extra),
                schedule: "1".repeat(MAX_SCHEDULE + extra),
                time_zone: Some("z".repeat(MAX_TIME_ZONE + extra)),
                ..AtSpec::default()
            };
            let t = &mut spec.template;
            t.image = Some("i".repeat(MAX_IMAGE + extra));
            t.service_account_name = Some("s".repeat(MAX_NAME + extra));
            t.env = Some(vec![EnvVar::default(); MAX_ENV + extra]);
            t.node_selector = Some(map(MAX_ENTRIES + extra));
            t.metadata = Some(PodMetadata {
                labels: Some(map(MAX_ENTRIES + extra)),
                annotations: Some(map(MAX_ENTRIES + extra)),
            });
            t.tolerations = Some(vec![Toleration::default(); MAX_TOLERATIONS + extra]);
            t.image_pull_secrets = Some(vec![
                LocalObjectReference::default();
                MAX_PULL_SECRETS + extra
            ]);
            spec
        };
        assert_eq!(size_problems(&full(0), all), Vec::<String>::new());
        let over = size_problems(&full(1), all);
        assert_eq!(over.len(), 10, "{over:#?}");
        assert!(over.iter().any(|p| p
            == "spec.template.env: 1025 variables, more than the 1024 an At may have; pass fewer, or read them from one Secret or ConfigMap key"));
        // The command in bytes (what exec takes): 32,768 four-byte characters are over.
        let wide = AtSpec {
            command: "\u{1F600}".repeat(32_768),
            ..AtSpec::default()
        };
        let found = size_problems(&wide, all);
        assert_eq!(found.len(), 1);
        assert!(
            found[0].starts_with("spec.command: 131072 bytes"),
            "{found:?}"
        );
        // The whole spec, when no field is over: four env values of 64 KiB.
        let value = EnvVar {
            name: "V".into(),
            value: Some("v".repeat(65_536)),
            value_from: None,
        };
        let mut heavy = AtSpec::default();
        heavy.template.env = Some(vec![value; 4]);
        assert_eq!(
            json_bytes(&heavy),
            serde_json::to_vec(&heavy).unwrap().len()
        );
        let found = size_problems(&heavy, all);
        assert_eq!(found.len(), 1);
        assert!(
            found[0].starts_with("spec: 262")
                && found[0].contains("more than the 262144 an At may hold"),
            "{found:?}"
        );
        let long = AtSpec {
            command: "x".repeat(MAX_COMMAND + 1),
            ..AtSpec::default()
        };
        assert_eq!(
            size_problems(&long, all),
            ["spec.command: 131072 bytes, more than the 131071 an At may have; put a longer script in the image and run it from there"]
        );
        // Only what changed is checked: an At admitted before keeps its sizes.
        assert!(
            size_problems(&long, |field| field != "spec.command" && field != "spec").is_empty()
        );
    }

    #[test]
    fn only_the_fields_asked_for_are_checked() {
        let bad = spec(Some(-1), Some(-1), None);
        let found = problems(&bad, |field| field == "spec.activeDeadlineSeconds");
        assert_eq!(found.len(), 1);
        assert!(found[0].starts_with("spec.activeDeadlineSeconds: -1"));
    }
}

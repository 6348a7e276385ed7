//! The rules an At must follow, shared by the validating webhook and `cnat check`. Pure: every
//! message names the field, the bad value and the fix, and all problems are reported together.

use crate::api::{At, AtSpec, Phase};
use crate::{operator::pod, schedule};
use kube::{Resource, ResourceExt};

mod image;
mod pod_settings;

pub use image::image_problem;

/// Characters that `generateName` adds to a prefix.
const GENERATED_SUFFIX: &str = "xxxxx";

/// Everything wrong with `at`, given the stored version `old` on an update. An update is
/// checked only for what it changes in the spec, so metadata edits of an At admitted earlier are
/// never refused, but for its shard label (`shard::change_problem`).
pub fn spec_problems(at: &At, old: Option<&At>) -> Vec<String> {
    let mut problems = Vec::new();
    if let Some(old) = old {
        problems.extend(relabel_problem(at, old.metadata.labels.as_ref()));
    }
    let (new, was) = (&at.spec, old.map(|o| &o.spec));
    let changed = |same: &dyn Fn(&AtSpec) -> bool| was.is_none_or(|w| !same(w));
    if old.is_none() {
        problems.extend(name_problem(at));
    }
    let t = &new.template;
    let sizes = crate::limits::size_problems(new, |field| match field {
        "spec.command" => changed(&|w| w.command == new.command),
        "spec.schedule" => changed(&|w| w.schedule == new.schedule),
        "spec.timeZone" => changed(&|w| w.time_zone == new.time_zone),
        "spec.template.image" => changed(&|w| w.template.image == t.image),
        "spec.template.serviceAccountName" => {
            changed(&|w| w.template.service_account_name == t.service_account_name)
        }
        "spec.template.env" => changed(&|w| w.template.env == t.env),
        "spec.template.nodeSelector" => changed(&|w| w.template.node_selector == t.node_selector),
        "spec.template.metadata.labels" | "spec.template.metadata.annotations" => {
            changed(&|w| w.template.metadata == t.metadata)
        }
        "spec.template.tolerations" => changed(&|w| w.template.tolerations == t.tolerations),
        "spec.template.imagePullSecrets" => {
            changed(&|w| w.template.image_pull_secrets == t.image_pull_secrets)
        }
        "spec" => changed(&|w| w == new),
        // A field added to `limits` without a line here is checked whether it changed or not.
        other => {
            debug_assert!(false, "limits::size_problems asked about {other}");
            true
        }
    });
    if !sizes.is_empty() {
        // Sizes first, alone but for immutability: the other rules would quote the oversized
        // values back.
        problems.extend(sizes);
        problems.extend(old.and_then(|old| immutability_problem(at, old)));
        return problems;
    }
    if changed(&|w| w.schedule == new.schedule && w.time_zone == new.time_zone) {
        if let Err(err) = schedule::parse(&new.schedule, new.time_zone.as_deref()) {
            problems.push(err.to_string());
        }
    }
    if changed(&|w| w.command == new.command) && new.command.trim().is_empty() {
        problems.push(format!(
            "spec.command: {:?} runs nothing; give the shell command to run, e.g. \"echo YAY\"",
            new.command
        ));
    }
    if let Some(image) = &new.template.image {
        if changed(&|w| w.template.image == new.template.image) {
            problems.extend(image_problem(image));
        }
    }
    problems.extend(pod_settings::problems(new, was));
    problems.extend(old.and_then(|old| immutability_problem(at, old)));
    problems
}

/// Problems with a status update: a phase never goes back, so a finished At never runs again.
pub fn status_problems(at: &At, old: &At) -> Vec<String> {
    let rank = |a: &At| a.status.as_ref().map_or(0, |s| s.phase as u8);
    match (phase(old), phase(at)) {
        (Some(was), Some(now)) if rank(at) < rank(old) => vec![format!(
            "status.phase: cannot go back from {was} to {now}: an At runs at most once; create a new At to run the command again"
        )],
        (Some(was), None) => vec![format!(
            "status.phase: cannot be removed once {was}; an At runs at most once"
        )],
        _ => Vec::new(),
    }
}

/// One message for a list of problems, as a denial or `cnat check` prints it: one line for one
/// problem, a list for several.
pub fn summary(at: &At, problems: &[String]) -> String {
    let name = display_name(at);
    match problems {
        [one] => format!("At {name} is invalid: {one}"),
        many => {
            let list: String = many.iter().map(|p| format!("\n- {p}")).collect();
            format!("At {name} has {} problems:{list}", many.len())
        }
    }
}

fn phase(at: &At) -> Option<Phase> {
    at.status.as_ref().map(|s| s.phase)
}

fn display_name(at: &At) -> String {
    let name = match at.meta().name.as_deref() {
        Some(name) if !name.is_empty() => name.to_owned(),
        _ => format!("{}…", at.meta().generate_name.as_deref().unwrap_or("")),
    };
    match at.namespace() {
        Some(ns) => format!("{ns}/{name}"),
        None => name,
    }
}

/// The pod name and label derived from the name (or from `generateName` plus its suffix).
fn name_problem(at: &At) -> Option<String> {
    let meta = at.meta();
    let name = match (meta.name.as_deref(), meta.generate_name.as_deref()) {
        (Some(name), _) if !name.is_empty() => name.to_owned(),
        (_, Some(prefix)) => format!("{prefix}{GENERATED_SUFFIX}"),
        _ => return Some("metadata.name is missing; give the At a name".into()),
    };
    pod::check_name(&name)
        .err()
        .map(|err| match meta.name.as_deref() {
            Some(n) if !n.is_empty() => err.to_string(),
            _ => format!("metadata.generateName: with the 5 characters it adds, {err}"),
        })
}

/// A change to the shard label that `shard::change_problem` refuses, given the stored copy's
/// labels.
pub fn relabel_problem(
    at: &At,
    old: Option<&std::collections::BTreeMap<String, String>>,
) -> Option<String> {
    let seed = || format!("{}/{}", at.namespace().unwrap_or_default(), at.name_any());
    crate::shard::change_problem(seed, old, at.metadata.labels.as_ref())
}

fn immutability_problem(at: &At, old: &At) -> Option<String> {
    let phase = phase(old).filter(|p| *p != Phase::Pending)?;
    (at.spec != old.spec).then(|| {
        format!(
            "spec: cannot change once the At is {phase}: its command already ran or is running, and changing the spec cannot undo that; create a new At instead"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{AtSpec, AtStatus};

    fn at(name: &str, schedule: &str, command: &str, image: &str) -> At {
        let mut at = At::new(
            name,
            AtSpec {
                schedule: schedule.into(),
                command: command.into(),
                template: crate::api::AtPodTemplate {
                    image: Some(image.into()),
                    ..Default::default()
                },
                ..AtSpec::default()
            },
        );
        at.metadata.namespace = Some("default".into());
        at
    }

    fn book() -> At {
        at("example-at", "2019-04-12T10:12:00Z", "echo YAY", "busybox")
    }

    fn with_phase(mut at: At, phase: Phase) -> At {
        at.status = Some(AtStatus {
            phase,
            ..AtStatus::default()
        });
        at
    }

    #[test]
    fn the_book_example_is_valid() {
        assert_eq!(spec_problems(&book(), None), Vec::<String>::new());
    }

    #[test]
    fn schedules_are_checked_by_the_parser() {
        let problems = spec_problems(&at("x", "tomorrow noon", "true", "busybox"), None);
        assert_eq!(
            problems,
            [
                r#"spec.schedule: "tomorrow noon" is not an RFC 3339 time (expected e.g. 2019-04-12T10:12:00Z)"#
            ]
        );
    }

    #[test]
    fn empty_and_blank_commands_are_refused() {
        for command in ["", "  ", "\n\t"] {
            let problems =
                spec_problems(&at("x", "2019-04-12T10:12:00Z", command, "busybox"), None);
            assert_eq!(problems.len(), 1, "{command:?}");
            assert!(
                problems[0].starts_with("spec.command: ") && problems[0].contains("runs nothing")
            );
        }
    }

    #[test]
    fn names_that_cannot_make_a_pod_are_refused() {
        let long = "a".repeat(64);
        let problems = spec_problems(&at(&long, "2019-04-12T10:12:00Z", "true", "busybox"), None);
        assert_eq!(problems.len(), 1);
        assert!(problems[0].starts_with("metadata.name: ") && problems[0].contains("at most 63"));
    }

    #[test]
    fn generate_name_is_checked_with_its_suffix() {
        let mut generated = book();
        generated.metadata.name = None;
        generated.metadata.generate_name = Some("nightly-".into());
        assert_eq!(spec_problems(&generated, None), Vec::<String>::new());
        generated.metadata.generate_name = Some("n".repeat(59));
        let problems = spec_problems(&generated, None);
        assert!(
            problems[0].starts_with("metadata.generateName: "),
            "{problems:?}"
        );
        assert!(summary(&generated, &problems)
            .starts_with(&format!("At default/{}… is invalid", "n".repeat(59))));
    }

    #[test]
    fn all_problems_are_reported_together() {
        let bad = at(&"a".repeat(70), "tomorrow", " ", "Not An Image");
        let problems = spec_problems(&bad, None);
        let fields: Vec<&str> = problems
            .iter()
            .map(|p| p.split([':', ' ']).next().unwrap())
            .collect();
        assert_eq!(
            fields,
            [
                "metadata.name",
                "spec.schedule",
                "spec.command",
                "spec.template.image"
            ]
        );
        let message = summary(&bad, &problems);
        let lines: Vec<&str> = message.lines().collect();
        assert_eq!(
            lines[0],
            format!("At default/{} has 4 problems:", "a".repeat(70))
        );
        let starts: Vec<&str> = lines[1..].iter().map(|l| &l[..4]).collect();
        assert_eq!(starts, ["- me", "- sp", "- sp", "- sp"]);
        assert_eq!(summary(&bad, &problems[1..2]).lines().count(), 1);
    }

    #[test]
    fn the_spec_is_frozen_once_running_or_done() {
        let mut changed = book();
        changed.spec.command = "echo NAY".into();
        assert_eq!(
            spec_problems(&changed, Some(&with_phase(book(), Phase::Pending))),
            Vec::<String>::new()
        );
        assert_eq!(spec_problems(&changed, Some(&book())), Vec::<String>::new());
        for phase in [Phase::Running, Phase::Done] {
            let problems = spec_problems(&changed, Some(&with_phase(book(), phase)));
            assert_eq!(problems.len(), 1);
            assert!(
                problems[0].contains(&format!("cannot change once the At is {phase}")),
                "{problems:?}"
            );
            // Metadata changes (labels, annotations) stay allowed.
            let mut labelled = with_phase(book(), phase);
            labelled.metadata.labels = Some([("team".into(), "a".into())].into());
            assert_eq!(
                spec_problems(&labelled, Some(&with_phase(book(), phase))),
                Vec::<String>::new()
            );
        }
    }

    #[test]
    fn an_update_is_checked_only_for_what_it_changes() {
        // Admitted earlier under other rules (or with the webhook off): a bad schedule, an
        // empty command, a name too long for today's rules.
        let long = "a".repeat(70);
        let old = at(&long, "tomorrow", " ", "busybox");
        assert_eq!(spec_problems(&old, None).len(), 3);
        let mut labelled = old.clone();
        labelled.metadata.labels = Some([("team".into(), "a".into())].into());
        labelled.metadata.finalizers = Some(vec!["example.com/keep".into()]);
        assert_eq!(spec_problems(&labelled, Some(&old)), Vec::<String>::new());
        // Changing the schedule re-checks the schedule only.
        let mut rescheduled = old.clone();
        rescheduled.spec.schedule = "next week".into();
        let problems = spec_problems(&rescheduled, Some(&old));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].starts_with("spec.schedule"));
        // Setting a time zone re-checks the schedule with it.
        let mut zoned = at("x", "2026-03-29T02:30:00", "true", "busybox");
        let before = zoned.clone();
        zoned.spec.time_zone = Some("Europe/Berlin".into());
        let problems = spec_problems(&zoned, Some(&before));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("does not exist in Europe/Berlin"));
    }

    #[test]
    fn status_never_goes_back() {
        let done = with_phase(book(), Phase::Done);
        let pending = with_phase(book(), Phase::Pending);
        let running = with_phase(book(), Phase::Running);
        assert_eq!(status_problems(&running, &pending), Vec::<String>::new());
        assert_eq!(status_problems(&done, &running), Vec::<String>::new());
        assert_eq!(status_problems(&done, &done), Vec::<String>::new());
        assert_eq!(status_problems(&pending, &book()), Vec::<String>::new());
        let back = status_problems(&pending, &done);
        assert_eq!(back.len(), 1);
        assert!(
            back[0].starts_with("status.phase: cannot go back from Done to Pending"),
            "{back:?}"
        );
        assert!(status_problems(&book(), &running)[0].contains("cannot be removed once Running"));
    }
}

//! `cnat check`: the validating webhook's rules, offline, for CI pipelines and GitOps repos. It
//! reads YAML or JSON manifests (several documents per file, `List` objects, whole directories),
//! checks every At in them with exactly the webhook's rules, and ignores other kinds.

use crate::admission::validation;
use crate::api::{At, GROUP};
use crate::conversion;
use serde_json::Value;
use std::io::Read;
use std::path::{Path, PathBuf};

/// What a check found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// How many Ats were checked.
    pub checked: usize,
    /// One message per invalid At or unreadable input, prefixed with where it came from.
    pub problems: Vec<String>,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Checks every At in `paths`: files, directories (their `.yaml`, `.yml` and `.json` files,
/// recursively), or `-` for `stdin`.
pub fn check_paths(paths: &[PathBuf], mut stdin: impl Read) -> Report {
    let mut report = Report::default();
    for path in paths {
        if path.as_os_str() == "-" {
            let mut text = String::new();
            match stdin.read_to_string(&mut text) {
                Ok(_) => check_text("<stdin>", &text, &mut report),
                Err(e) => report.problems.push(format!("<stdin>: {e}")),
            }
        } else {
            check_path(path, &mut report);
        }
    }
    report
}

fn check_path(path: &Path, report: &mut Report) {
    if path.is_dir() {
        match manifests_in(path) {
            Ok(files) => files.iter().for_each(|file| check_path(file, report)),
            Err(e) => report.problems.push(format!("{}: {e}", path.display())),
        }
        return;
    }
    match std::fs::read_to_string(path) {
        Ok(text) => check_text(&path.display().to_string(), &text, report),
        Err(e) => report.problems.push(format!("{}: {e}", path.display())),
    }
}

fn manifests_in(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let manifest = path
            .extension()
            .is_some_and(|e| e == "yaml" || e == "yml" || e == "json");
        if path.is_dir() || manifest {
            found.push(path);
        }
    }
    found.sort();
    Ok(found)
}

/// Checks the Ats in one text of YAML documents (JSON is YAML too).
pub fn check_text(source: &str, text: &str, report: &mut Report) {
    match serde_saphyr::from_multiple::<Value>(text) {
        Ok(documents) => documents
            .into_iter()
            .for_each(|doc| check_document(source, doc, report)),
        Err(e) => report
            .problems
            .push(format!("{source}: not YAML or JSON: {e}")),
    }
}

fn check_document(source: &str, document: Value, report: &mut Report) {
    let kind = document["kind"].as_str().unwrap_or_default();
    if kind.ends_with("List") {
        if let Value::Array(items) = document["items"].clone() {
            items
                .into_iter()
                .for_each(|item| check_document(source, item, report));
        }
        return;
    }
    let group = document["apiVersion"]
        .as_str()
        .unwrap_or_default()
        .split('/')
        .next()
        .unwrap_or_default();
    if kind != "At" || group != GROUP {
        return;
    }
    report.checked += 1;
    let name = document["metadata"]["name"]
        .as_str()
        .unwrap_or("<no name>")
        .to_owned();
    // A v1alpha1 At is checked as the API server will store it: as v1, by the same rules.
    let older = document["apiVersion"] == conversion::V1ALPHA1;
    let at = conversion::convert(0, document, conversion::V1)
        .map_err(|e| e.to_string())
        .and_then(|v1| serde_json::from_value::<At>(v1).map_err(|e| e.to_string()));
    match at {
        Ok(at) => {
            let problems = validation::spec_problems(&at, None);
            if !problems.is_empty() {
                let summary = validation::summary(&at, &problems);
                let summary = match older {
                    true => conversion::in_v1alpha1_terms(&summary),
                    false => summary,
                };
                report.problems.push(format!("{source}: {summary}"));
            }
        }
        Err(e) => report
            .problems
            .push(format!("{source}: At {name} is not a valid At: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOOK: &str = "apiVersion: cnat.programming-kubernetes.info/v1alpha1\nkind: At\nmetadata: {name: example-at}\nspec:\n  schedule: \"2019-04-12T10:12:00Z\"\n  command: \"echo YAY\"\n";

    fn check(text: &str) -> Report {
        let mut report = Report::default();
        check_text("t.yaml", text, &mut report);
        report
    }

    #[test]
    fn the_book_example_passes() {
        assert_eq!(
            check(BOOK),
            Report {
                checked: 1,
                problems: vec![]
            }
        );
    }

    #[test]
    fn bad_ats_get_the_webhook_message_other_kinds_are_ignored() {
        let text = format!(
            "{BOOK}---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: c}}\n---\n{}",
            BOOK.replace("example-at", "bad")
                .replace("2019-04-12T10:12:00Z", "tomorrow noon")
        );
        let report = check(&text);
        assert_eq!(report.checked, 2);
        assert_eq!(
            report.problems,
            [
                r#"t.yaml: At bad is invalid: spec.schedule: "tomorrow noon" is not an RFC 3339 time (expected e.g. 2019-04-12T10:12:00Z)"#
            ]
        );
    }

    #[test]
    fn both_versions_have_their_pod_settings_checked_in_their_own_terms() {
        let older = BOOK.replace("command:", "image: \"UPPER:case\"\n  command:");
        let report = check(&older);
        assert_eq!(report.checked, 1);
        assert!(
            report.problems[0].contains("spec.image: \"UPPER:case\""),
            "{:?}",
            report.problems
        );
        let v1 = BOOK
            .replace("v1alpha1", "v1")
            .replace("command:", "template: {image: \"UPPER:case\"}\n  command:");
        let report = check(&v1);
        assert_eq!(report.checked, 1);
        assert!(
            report.problems[0].contains("spec.template.image: \"UPPER:case\""),
            "{:?}",
            report.problems
        );
        assert!(check(&BOOK.replace("v1alpha1", "v1")).ok());
        let unknown = check(&BOOK.replace("v1alpha1", "v2"));
        assert!(
            unknown.problems[0].contains("apiVersion \"cnat.programming-kubernetes.info/v2\""),
            "{:?}",
            unknown.problems
        );
    }

    #[test]
    fn lists_and_json_are_read() {
        let list = r#"{"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "cnat.programming-kubernetes.info/v1alpha1", "kind": "At", "metadata": {"name": "a"},
             "spec": {"schedule": "2019-04-12T10:12:00Z", "command": " "}}]}"#;
        let report = check(list);
        assert_eq!(report.checked, 1);
        assert!(
            report.problems[0].contains("spec.command"),
            "{:?}",
            report.problems
        );
    }

    #[test]
    fn unreadable_input_is_a_problem_not_a_panic() {
        assert!(check("a: [unclosed").problems[0].starts_with("t.yaml: not YAML or JSON"));
        let missing = check("apiVersion: cnat.programming-kubernetes.info/v1alpha1\nkind: At\nmetadata: {name: m}\nspec: {schedule: x}\n");
        assert!(
            missing.problems[0].contains("At m is not a valid At: missing field `command`"),
            "{:?}",
            missing.problems
        );
        assert_eq!(check(""), Report::default());
        let report = check_paths(&[PathBuf::from("/nonexistent/ats.yaml")], std::io::empty());
        assert!(
            report.problems[0].starts_with("/nonexistent/ats.yaml: No such file"),
            "{:?}",
            report.problems
        );
    }
}

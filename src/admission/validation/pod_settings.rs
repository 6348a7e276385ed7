//! Rules for the pod settings an At may carry (deadlines, TTL, resources, env, service account,
//! node selector, tolerations, pull secrets). Each field is checked only when it is new or
//! changed; each message names the field, the bad value and the fix.

use crate::api::AtSpec;
use crate::limits;
use crate::operator::pod::is_dns_subdomain;
use crate::operator::policy::is_quantity;
use k8s_openapi::api::core::v1::{EnvVar, Toleration};
use std::collections::BTreeMap;

/// Problems with the pod settings of `new`, skipping fields equal in `was`.
pub fn problems(new: &AtSpec, was: Option<&AtSpec>) -> Vec<String> {
    let mut problems = Vec::new();
    let changed = |same: &dyn Fn(&AtSpec) -> bool| was.is_none_or(|w| !same(w));
    problems.extend(limits::problems(new, |field| match field {
        "spec.startingDeadlineSeconds" => {
            changed(&|w| w.starting_deadline_seconds == new.starting_deadline_seconds)
        }
        "spec.activeDeadlineSeconds" => {
            changed(&|w| w.active_deadline_seconds == new.active_deadline_seconds)
        }
        _ => changed(&|w| w.ttl_seconds_after_finished == new.ttl_seconds_after_finished),
    }));
    if changed(&|w| w.template.resources == new.template.resources) {
        if let Some(resources) = &new.template.resources {
            for (kind, map) in [
                ("requests", &resources.requests),
                ("limits", &resources.limits),
            ] {
                problems.extend(quantity_problems(kind, map.as_ref()));
            }
            if resources.claims.as_ref().is_some_and(|c| !c.is_empty()) {
                problems.push("spec.template.resources.claims: not supported (cnat's pods have no resource claims); remove it".into());
            }
        }
    }
    if changed(&|w| w.template.env == new.template.env) {
        for (i, var) in new.template.env.iter().flatten().enumerate() {
            problems.extend(env_problem(i, var));
        }
    }
    if changed(&|w| w.template.service_account_name == new.template.service_account_name) {
        if let Some(sa) = &new.template.service_account_name {
            if !is_dns_subdomain(sa) {
                problems.push(format!(
                    "spec.template.serviceAccountName: {sa:?} is not a valid service account name (lowercase letters, digits, '-' and '.'); name an existing ServiceAccount in the At's namespace, or remove the field to run without an API token"
                ));
            }
        }
    }
    if changed(&|w| w.template.node_selector == new.template.node_selector) {
        problems.extend(label_problems(
            "spec.template.nodeSelector",
            new.template.node_selector.as_ref(),
        ));
    }
    if changed(&|w| w.template.metadata == new.template.metadata) {
        if let Some(metadata) = &new.template.metadata {
            problems.extend(label_problems(
                "spec.template.metadata.labels",
                metadata.labels.as_ref(),
            ));
            problems.extend(annotation_problems(metadata.annotations.as_ref()));
        }
    }
    if changed(&|w| w.template.tolerations == new.template.tolerations) {
        for (i, toleration) in new.template.tolerations.iter().flatten().enumerate() {
            problems.extend(toleration_problem(i, toleration));
        }
    }
    if changed(&|w| w.template.image_pull_secrets == new.template.image_pull_secrets) {
        for (i, secret) in new.template.image_pull_secrets.iter().flatten().enumerate() {
            if !is_dns_subdomain(&secret.name) {
                problems.push(format!(
                    "spec.template.imagePullSecrets[{i}].name: {:?} is not a valid Secret name; name a Secret of type kubernetes.io/dockerconfigjson in the At's namespace",
                    secret.name
                ));
            }
        }
    }
    problems
}

fn quantity_problems(
    kind: &str,
    map: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
) -> Vec<String> {
    map.into_iter()
        .flatten()
        .filter(|(_, q)| !is_quantity(&q.0))
        .map(|(name, q)| {
            format!(
                "spec.template.resources.{kind}.{name}: {:?} is not a quantity (expected e.g. cpu: 100m, memory: 64Mi)",
                q.0
            )
        })
        .collect()
}

fn env_problem(i: usize, var: &EnvVar) -> Option<String> {
    let field = format!("spec.template.env[{i}]");
    if var.name.is_empty() || var.name.contains('=') {
        return Some(format!(
            "{field}.name: {:?} is not a variable name (non-empty, without '='), e.g. GREETING",
            var.name
        ));
    }
    let name = &var.name;
    match (&var.value, &var.value_from) {
        (Some(_), Some(_)) => Some(format!(
            "{field} ({name}): has both value and valueFrom; keep one"
        )),
        (_, Some(from)) if from.file_key_ref.is_some() => Some(format!(
            "{field} ({name}): valueFrom.fileKeyRef needs the EnvFiles feature gate (alpha since Kubernetes 1.34), which cnat does not support; use secretKeyRef or configMapKeyRef"
        )),
        (_, Some(from)) => {
            let sources = [
                from.secret_key_ref.is_some(),
                from.config_map_key_ref.is_some(),
                from.field_ref.is_some(),
                from.resource_field_ref.is_some(),
            ]
            .iter()
            .filter(|s| **s)
            .count();
            (sources != 1).then(|| {
                format!(
                    "{field} ({name}): valueFrom needs exactly one of secretKeyRef, configMapKeyRef, fieldRef or resourceFieldRef, it has {sources}"
                )
            })
        }
        _ => None,
    }
}

/// A label name part: at most 63 characters, alphanumeric at both ends, `-_.` inside.
fn is_label_part(value: &str) -> bool {
    let bytes = value.as_bytes();
    value.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && bytes.first().is_none_or(u8::is_ascii_alphanumeric)
        && bytes.last().is_none_or(u8::is_ascii_alphanumeric)
}

fn is_label_key(key: &str) -> bool {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    !name.is_empty() && is_label_part(name) && prefix.is_none_or(is_dns_subdomain)
}

/// Problems with the labels (or label selector) at `field`.
fn label_problems(field: &str, labels: Option<&BTreeMap<String, String>>) -> Vec<String> {
    let mut problems = Vec::new();
    for (key, value) in labels.into_iter().flatten() {
        if !is_label_key(key) {
            problems.push(format!(
                "{field}: {key:?} is not a label key (e.g. kubernetes.io/arch or disktype)"
            ));
        } else if !is_label_part(value) {
            problems.push(format!(
                "{field}.{key}: {value:?} is not a label value (at most 63 letters, digits, '-', '_' or '.', alphanumeric at both ends)"
            ));
        }
    }
    problems
}

/// The API server's limit on all of an object's annotations together (keys and values).
const ANNOTATIONS_MAX_BYTES: usize = 256 * 1024;

fn annotation_problems(annotations: Option<&BTreeMap<String, String>>) -> Vec<String> {
    let field = "spec.template.metadata.annotations";
    let mut problems: Vec<String> = annotations
        .into_iter()
        .flatten()
        .filter(|(key, _)| !is_label_key(key))
        .map(|(key, _)| {
            format!("{field}: {key:?} is not an annotation key (e.g. example.com/owner or note)")
        })
        .collect();
    let size: usize = annotations
        .into_iter()
        .flatten()
        .map(|(k, v)| k.len() + v.len())
        .sum();
    if size > ANNOTATIONS_MAX_BYTES {
        problems.push(format!(
            "{field}: {size} bytes in all, but a pod's annotations may have at most {ANNOTATIONS_MAX_BYTES}; shorten them"
        ));
    }
    problems
}

fn toleration_problem(i: usize, t: &Toleration) -> Option<String> {
    let field = format!("spec.template.tolerations[{i}]");
    let operator = t.operator.as_deref().unwrap_or("Equal");
    let effect = t.effect.as_deref().unwrap_or("");
    let key = t.key.as_deref().unwrap_or("");
    let value = t.value.as_deref().unwrap_or("");
    if !matches!(operator, "Equal" | "Exists") {
        return Some(format!(
            "{field}.operator: {operator:?} must be Equal or Exists"
        ));
    }
    if !matches!(effect, "" | "NoSchedule" | "PreferNoSchedule" | "NoExecute") {
        return Some(format!(
            "{field}.effect: {effect:?} must be NoSchedule, PreferNoSchedule, NoExecute, or empty for all effects"
        ));
    }
    if operator == "Exists" && !value.is_empty() {
        return Some(format!(
            "{field}: operator Exists matches any value; remove value {value:?} or use operator Equal"
        ));
    }
    if key.is_empty() && operator != "Exists" {
        return Some(format!(
            "{field}: an empty key matches every taint only with operator Exists; set a key or operator: Exists"
        ));
    }
    if !key.is_empty() && !is_label_key(key) {
        return Some(format!(
            "{field}.key: {key:?} is not a taint key (e.g. node-role.kubernetes.io/batch)"
        ));
    }
    if t.toleration_seconds.is_some() && effect != "NoExecute" {
        return Some(format!(
            "{field}.tolerationSeconds: only applies with effect NoExecute; remove it or set effect: NoExecute"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A spec with `extra` written flat, as v1alpha1 has it (shorter to read), converted to v1.
    fn spec(extra: serde_json::Value) -> AtSpec {
        use crate::conversion::{convert, V1, V1ALPHA1};
        let mut base = json!({"schedule": "2019-04-12T10:12:00Z", "command": "true"});
        json_patch::merge(&mut base, &extra);
        let v1 = convert(0, json!({"apiVersion": V1ALPHA1, "spec": base}), V1).unwrap();
        serde_json::from_value(v1["spec"].clone()).unwrap()
    }

    #[test]
    fn good_settings_pass() {
        let good = spec(json!({
            "startingDeadlineSeconds": 0, "activeDeadlineSeconds": 1, "ttlSecondsAfterFinished": 0,
            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"cpu": 1, "memory": "1Gi"}},
            "env": [{"name": "A", "value": "1"}, {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
                    {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
            "serviceAccountName": "backup-runner",
            "nodeSelector": {"kubernetes.io/arch": "arm64", "disktype": "ssd", "empty": ""},
            "tolerations": [{"key": "batch", "operator": "Exists", "effect": "NoSchedule"},
                            {"key": "k", "value": "v"}, {"operator": "Exists"},
                            {"key": "k", "effect": "NoExecute", "tolerationSeconds": 30}],
            "imagePullSecrets": [{"name": "registry-creds"}],
        }));
        assert_eq!(problems(&good, None), Vec::<String>::new());
    }

    #[test]
    fn pod_labels_and_annotations_must_be_what_a_pod_takes() {
        let with = |metadata: serde_json::Value| -> AtSpec {
            serde_json::from_value(
                json!({"schedule": "2019-04-12T10:12:00Z", "command": "true",
                                          "template": {"metadata": metadata}}),
            )
            .unwrap()
        };
        let good = with(json!({"labels": {"team": "a", "example.com/cost": "x-1"},
                               "annotations": {"sidecar.istio.io/inject": "false", "note": "any text: ok"}}));
        assert_eq!(problems(&good, None), Vec::<String>::new());
        for (metadata, expected) in [
            (
                json!({"labels": {"bad key!": "x"}}),
                r#"spec.template.metadata.labels: "bad key!" is not a label key"#,
            ),
            (
                json!({"labels": {"team": "a b"}}),
                r#"spec.template.metadata.labels.team: "a b" is not a label value"#,
            ),
            (
                json!({"annotations": {"/x": "y"}}),
                r#"spec.template.metadata.annotations: "/x" is not an annotation key"#,
            ),
            (
                json!({"annotations": {"big": "x".repeat(300 * 1024)}}),
                "spec.template.metadata.annotations: 307203 bytes in all, but a pod's annotations may have at most 262144",
            ),
        ] {
            let found = problems(&with(metadata.clone()), None);
            assert!(
                found.len() == 1 && found[0].starts_with(expected),
                "{metadata}: {found:?}"
            );
        }
        // Unchanged on an update: not checked again.
        let bad = with(json!({"labels": {"team": "a b"}}));
        assert_eq!(problems(&bad, Some(&bad)), Vec::<String>::new());
    }

    #[test]
    fn each_bad_setting_is_named_with_its_value_and_fix() {
        for (extra, expected) in [
            (
                json!({"startingDeadlineSeconds": -1}),
                "spec.startingDeadlineSeconds: -1 is out of range: it must be between 0 and 2147483647",
            ),
            (
                json!({"activeDeadlineSeconds": 0}),
                "spec.activeDeadlineSeconds: 0 is out of range: it must be between 1 and 2147483647",
            ),
            (
                json!({"ttlSecondsAfterFinished": -5}),
                "spec.ttlSecondsAfterFinished: -5 is out of range: it must be between 0 and 2147483647",
            ),
            (
                json!({"startingDeadlineSeconds": 10_000_000_000_000_i64}),
                "spec.startingDeadlineSeconds: 10000000000000 is out of range",
            ),
            (
                json!({"activeDeadlineSeconds": 2147483648_i64}),
                "spec.activeDeadlineSeconds: 2147483648 is out of range",
            ),
            (
                json!({"resources": {"limits": {"memory": "1GB"}}}),
                r#"spec.template.resources.limits.memory: "1GB" is not a quantity"#,
            ),
            (
                json!({"resources": {"requests": {"cpu": "lots"}}}),
                r#"spec.template.resources.requests.cpu: "lots" is not a quantity"#,
            ),
            (
                json!({"resources": {"claims": [{"name": "gpu"}]}}),
                "spec.template.resources.claims: not supported",
            ),
            (
                json!({"env": [{"name": ""}]}),
                r#"spec.template.env[0].name: "" is not a variable name"#,
            ),
            (
                json!({"env": [{"name": "A=B"}]}),
                r#"spec.template.env[0].name: "A=B""#,
            ),
            (
                json!({"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]}),
                "spec.template.env[0] (A): has both value and valueFrom",
            ),
            (
                json!({"env": [{"name": "A", "valueFrom": {}}]}),
                "needs exactly one of secretKeyRef",
            ),
            // A source of a newer Kubernetes (1.34+, behind a gate) than the oldest supported.
            (
                json!({"env": [{"name": "A", "valueFrom": {"fileKeyRef": {"key": "k", "path": "p", "volumeName": "v"}}}]}),
                "spec.template.env[0] (A): valueFrom.fileKeyRef needs the EnvFiles feature gate",
            ),
            (
                json!({"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}, "fileKeyRef": {"key": "k", "path": "p", "volumeName": "v"}}}]}),
                "spec.template.env[0] (A): valueFrom.fileKeyRef needs the EnvFiles feature gate",
            ),
            (
                json!({"serviceAccountName": "Backup_Runner"}),
                r#"spec.template.serviceAccountName: "Backup_Runner" is not a valid service account name"#,
            ),
            (
                json!({"nodeSelector": {"bad key!": "x"}}),
                r#"spec.template.nodeSelector: "bad key!" is not a label key"#,
            ),
            (
                json!({"nodeSelector": {"disktype": "-ssd"}}),
                r#"spec.template.nodeSelector.disktype: "-ssd" is not a label value"#,
            ),
            (
                json!({"tolerations": [{"key": "k", "operator": "In"}]}),
                r#"spec.template.tolerations[0].operator: "In" must be Equal or Exists"#,
            ),
            (
                json!({"tolerations": [{"key": "k", "effect": "Never"}]}),
                r#"spec.template.tolerations[0].effect: "Never""#,
            ),
            (
                json!({"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}),
                "operator Exists matches any value",
            ),
            (
                json!({"tolerations": [{"value": "v"}]}),
                "an empty key matches every taint only with operator Exists",
            ),
            (
                json!({"tolerations": [{"key": "k", "tolerationSeconds": 5}]}),
                "only applies with effect NoExecute",
            ),
            (
                json!({"imagePullSecrets": [{"name": ""}]}),
                r#"spec.template.imagePullSecrets[0].name: "" is not a valid Secret name"#,
            ),
        ] {
            let found = problems(&spec(extra.clone()), None);
            assert_eq!(found.len(), 1, "{extra}: {found:?}");
            assert!(found[0].contains(expected), "{extra}: {}", found[0]);
        }
    }

    #[test]
    fn an_update_is_checked_only_for_what_it_changes() {
        // Admitted long ago under looser rules (or with the webhook off).
        let old = spec(json!({"activeDeadlineSeconds": 0, "env": [{"name": ""}]}));
        assert_eq!(problems(&old, Some(&old)), Vec::<String>::new());
        let mut touched = old.clone();
        touched.ttl_seconds_after_finished = Some(-1);
        let found = problems(&touched, Some(&old));
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].starts_with("spec.ttlSecondsAfterFinished"));
    }
}

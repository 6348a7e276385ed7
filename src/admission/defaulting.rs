//! Defaults the mutating webhook applies, as RFC 6902 JSON patches. Pure and idempotent: the
//! patch is the difference between the object and its defaulted form, so a reinvoked webhook
//! gets an empty patch. See docs/src/operating/admission-webhooks.md, "Mutating" and "Why a new
//! At shows Pending".

use crate::shard;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// What is being written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The At itself (`ats`), on CREATE or UPDATE.
    Object { create: bool },
    /// The status subresource (`ats/status`).
    Status,
}

/// The JSON patch that applies cnat's defaults to `object` (an At as JSON, in `version`), in
/// the request's own terms: a blank image removed, the phase as that version spells it. It
/// touches nothing else (the object may come without its metadata).
pub fn patch(object: &Value, target: Target, version: &str) -> json_patch::Patch {
    let older = version == "v1alpha1";
    let mut defaulted = object.clone();
    match target {
        Target::Object { create } => {
            drop_blank_image(&mut defaulted, older);
            if create {
                default_phase(&mut defaulted, older);
            }
        }
        Target::Status => default_phase(&mut defaulted, older),
    }
    json_patch::diff(object, &defaulted)
}

/// The JSON patch that gives an At with these `labels` its shard label (`shard::LABEL`): on an
/// update whose stored copy (`old`'s labels) has a value, that value again if it was removed,
/// else nothing; otherwise, unless the label holds a value, the one `shard::assign` gives `seed`.
pub fn shard_label(
    labels: Option<&BTreeMap<String, String>>,
    old: Option<&BTreeMap<String, String>>,
    seed: &str,
) -> json_patch::Patch {
    let present = labels.is_some_and(|labels| labels.contains_key(shard::LABEL));
    let value = match shard::value_of(old) {
        Some(kept) if !present => kept.to_string(),
        Some(_) => return json_patch::Patch(Vec::new()),
        None if shard::value_of(labels).is_some() => return json_patch::Patch(Vec::new()),
        None => shard::assign(seed),
    };
    // No `labels` key when there are none: the patch then adds the whole map.
    let before = match labels {
        Some(labels) => json!({"metadata": {"labels": labels}}),
        None => json!({"metadata": {}}),
    };
    let mut after = labels.cloned().unwrap_or_default();
    after.insert(shard::LABEL.to_owned(), value);
    json_patch::diff(&before, &json!({"metadata": {"labels": after}}))
}

/// An image that is `null` or blank names none: it is removed, and the operator's default image,
/// chosen when the pod is made, runs the command. The image is not filled in here.
fn drop_blank_image(at: &mut Value, older: bool) {
    let spec = at.get_mut("spec");
    let template = if older {
        spec
    } else {
        spec.and_then(|spec| spec.get_mut("template"))
    };
    let Some(template) = template.and_then(Value::as_object_mut) else {
        return;
    };
    let blank = template.get("image").is_some_and(|image| {
        image.as_str().is_some_and(|s| s.trim().is_empty()) || image.is_null()
    });
    if blank {
        template.remove("image");
    }
}

fn default_phase(at: &mut Value, older: bool) {
    let Some(object) = at.as_object_mut() else {
        return;
    };
    let status = object.entry("status").or_insert_with(|| json!({}));
    if status.is_null() {
        *status = json!({});
    }
    if let Some(status) = status.as_object_mut() {
        let pending = if older { "PENDING" } else { "Pending" };
        status.entry("phase").or_insert_with(|| json!(pending));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn applied(object: &Value, patch: &json_patch::Patch) -> Value {
        let mut out = object.clone();
        json_patch::patch(&mut out, patch).unwrap();
        out
    }

    fn at(spec: Value, status: Option<Value>) -> Value {
        let mut at = json!({"apiVersion": "cnat.programming-kubernetes.info/v1alpha1", "kind": "At",
                            "metadata": {"name": "x"}, "spec": spec});
        if let Some(status) = status {
            at["status"] = status;
        }
        at
    }

    #[test]
    fn create_defaults_the_phase_not_the_image_and_is_idempotent() {
        // As the API server hands it over: v1alpha1's schema default for the image applied.
        let object = at(
            json!({"schedule": "2019-04-12T10:12:00Z", "command": "echo YAY", "image": "busybox"}),
            None,
        );
        let patch = patch(&object, Target::Object { create: true }, "v1alpha1");
        let defaulted = applied(&object, &patch);
        assert_eq!(defaulted["spec"]["image"], "busybox");
        assert_eq!(defaulted["status"], json!({"phase": "PENDING"}));
        assert_eq!(defaulted["spec"]["command"], "echo YAY");
        let ops = serde_json::to_value(&patch).unwrap();
        assert_eq!(
            ops,
            json!([{"op": "add", "path": "/status", "value": {"phase": "PENDING"}}])
        );
        // In v1 terms, the same: an At without an image keeps none (the operator's runs it).
        let mut v1 = object.clone();
        v1["apiVersion"] = json!(crate::conversion::V1);
        v1["spec"]["template"] = json!({"env": []});
        v1["spec"].as_object_mut().unwrap().remove("image");
        let v1_patch = super::patch(&v1, Target::Object { create: true }, "v1");
        assert_eq!(
            serde_json::to_value(&v1_patch).unwrap(),
            json!([{"op": "add", "path": "/status", "value": {"phase": "Pending"}}])
        );
        // Reinvoked on its own output, the webhook changes nothing.
        assert!(
            super::patch(&defaulted, Target::Object { create: true }, "v1alpha1")
                .0
                .is_empty()
        );
    }

    #[test]
    fn given_values_are_kept() {
        let object = at(
            json!({"schedule": "s", "command": "c", "image": "alpine:3"}),
            Some(json!({"phase": "DONE"})),
        );
        assert!(patch(&object, Target::Object { create: true }, "v1alpha1")
            .0
            .is_empty());
        assert!(patch(&object, Target::Status, "v1alpha1").0.is_empty());
    }

    #[test]
    fn blank_or_null_images_are_dropped_for_the_operators_default() {
        for image in [json!(""), json!("  "), Value::Null] {
            let object = at(
                json!({"schedule": "s", "command": "c", "image": image}),
                None,
            );
            let defaulted = applied(
                &object,
                &patch(&object, Target::Object { create: false }, "v1alpha1"),
            );
            assert!(defaulted["spec"].get("image").is_none(), "{image}");
            assert_eq!(defaulted["spec"]["command"], "c");
            // Only the image is touched: no metadata added (the webhook's object has none).
            let ops =
                serde_json::to_value(patch(&object, Target::Object { create: false }, "v1alpha1"))
                    .unwrap();
            assert_eq!(
                ops,
                json!([{"op": "remove", "path": "/spec/image"}]),
                "{image}"
            );
            // In v1, the same in spec.template.
            let v1 =
                json!({"spec": {"schedule": "s", "command": "c", "template": {"image": image}}});
            let ops =
                serde_json::to_value(patch(&v1, Target::Object { create: false }, "v1")).unwrap();
            assert_eq!(
                ops,
                json!([{"op": "remove", "path": "/spec/template/image"}]),
                "{image}"
            );
            assert!(
                defaulted.get("status").is_none(),
                "updates of the object leave status alone"
            );
        }
    }

    #[test]
    fn status_writes_without_a_phase_get_pending() {
        for status in [json!({}), Value::Null, json!({"message": "hi"})] {
            let object = at(
                json!({"schedule": "s", "command": "c", "image": "busybox"}),
                Some(status.clone()),
            );
            let defaulted = applied(&object, &patch(&object, Target::Status, "v1alpha1"));
            assert_eq!(defaulted["status"]["phase"], "PENDING", "{status}");
            assert_eq!(defaulted["spec"], object["spec"]);
        }
    }

    #[test]
    fn an_at_without_a_shard_label_gets_one_and_keeps_its_other_labels() {
        let seed = "default/x";
        for labels in [
            None,
            Some(BTreeMap::new()),
            Some(BTreeMap::from([("app".to_owned(), "a".to_owned())])),
        ] {
            let mut object = json!({"metadata": {"name": "x"}, "spec": {}});
            if let Some(labels) = &labels {
                object["metadata"]["labels"] = json!(labels);
            }
            let patched = applied(&object, &shard_label(labels.as_ref(), None, seed));
            let mut expected = labels.clone().unwrap_or_default();
            expected.insert(shard::LABEL.to_owned(), shard::assign(seed));
            assert_eq!(patched["metadata"]["labels"], json!(expected), "{labels:?}");
            assert_eq!(patched["spec"], json!({}));
        }
    }

    #[test]
    fn a_shard_value_is_kept_any_other_text_replaced_and_a_removed_value_put_back() {
        let seed = "default/x";
        let with = |value: &str| BTreeMap::from([(shard::LABEL.to_owned(), value.to_owned())]);
        let label_after = |labels: Option<BTreeMap<String, String>>, old: Option<&str>| {
            let mut object = json!({"metadata": {}});
            if let Some(labels) = &labels {
                object["metadata"]["labels"] = json!(labels);
            }
            let old = old.map(with);
            let patch = shard_label(labels.as_ref(), old.as_ref(), seed);
            applied(&object, &patch)["metadata"]["labels"][shard::LABEL].clone()
        };
        // Created, or updated from a copy without a value: a value stays, other text goes.
        for old in [None, Some(""), Some("x"), Some("07")] {
            for value in ["0", "9", "59"] {
                assert_eq!(label_after(Some(with(value)), old), json!(value));
            }
            for text in ["", "not-a-shard", "07", "60"] {
                assert_eq!(
                    label_after(Some(with(text)), old),
                    json!(shard::assign(seed)),
                    "{text}"
                );
            }
        }
        // Updated from a copy with a value: a removed label comes back with it; a changed one is
        // left for the validating webhook to refuse.
        for new in [None, Some(BTreeMap::new())] {
            assert_eq!(label_after(new, Some("9")), json!("9"));
        }
        assert_eq!(label_after(Some(with("8")), Some("9")), json!("8"));
        assert_eq!(label_after(Some(with("x")), Some("9")), json!("x"));
    }

    #[test]
    fn odd_shapes_do_not_panic() {
        for object in [
            json!(null),
            json!([]),
            json!({"spec": 3}),
            json!({"status": "x"}),
        ] {
            let _ = patch(&object, Target::Object { create: true }, "v1alpha1");
            let _ = patch(&object, Target::Status, "v1alpha1");
        }
    }
}

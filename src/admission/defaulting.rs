//! Defaults the mutating webhook applies, as RFC 6902 JSON patches. Pure and idempotent: the
//! patch is the difference between the object and its defaulted form, so a reinvoked webhook
//! (or an already defaulted object) gets an empty patch.
//!
//! The apiserver drops `.status` from a CREATE after mutating admission, so the phase added
//! there is not what makes a new At show `PENDING`: the CRD's schema default for `status` is
//! (applied whenever the object is read). The webhook still defaults the phase on `ats/status`
//! writes that leave it out, and on API servers that keep status on create.

use crate::api::DEFAULT_IMAGE;
use serde_json::{json, Value};

/// What is being written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The At itself (`ats`), on CREATE or UPDATE.
    Object { create: bool },
    /// The status subresource (`ats/status`).
    Status,
}

/// The JSON patch that applies cnat's defaults to `object` (an At as JSON).
pub fn patch(object: &Value, target: Target) -> json_patch::Patch {
    let mut defaulted = object.clone();
    match target {
        Target::Object { create } => {
            default_image(&mut defaulted);
            if create {
                default_phase(&mut defaulted);
            }
        }
        Target::Status => default_phase(&mut defaulted),
    }
    json_patch::diff(object, &defaulted)
}

fn default_image(at: &mut Value) {
    let Some(spec) = at.get_mut("spec").and_then(Value::as_object_mut) else {
        return;
    };
    let blank = spec
        .get("image")
        .is_none_or(|image| image.as_str().is_some_and(|s| s.trim().is_empty()) || image.is_null());
    if blank {
        spec.insert("image".into(), json!(DEFAULT_IMAGE));
    }
}

fn default_phase(at: &mut Value) {
    let Some(object) = at.as_object_mut() else {
        return;
    };
    let status = object.entry("status").or_insert_with(|| json!({}));
    if status.is_null() {
        *status = json!({});
    }
    if let Some(status) = status.as_object_mut() {
        status.entry("phase").or_insert_with(|| json!("PENDING"));
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
    fn create_defaults_image_and_phase_and_is_idempotent() {
        let object = at(
            json!({"schedule": "2019-04-12T10:12:00Z", "command": "echo YAY"}),
            None,
        );
        let patch = patch(&object, Target::Object { create: true });
        let defaulted = applied(&object, &patch);
        assert_eq!(defaulted["spec"]["image"], "busybox");
        assert_eq!(defaulted["status"], json!({"phase": "PENDING"}));
        assert_eq!(defaulted["spec"]["command"], "echo YAY");
        let ops = serde_json::to_value(&patch).unwrap();
        assert_eq!(
            ops,
            json!([
                {"op": "add", "path": "/spec/image", "value": "busybox"},
                {"op": "add", "path": "/status", "value": {"phase": "PENDING"}},
            ])
        );
        // Reinvoked on its own output, the webhook changes nothing.
        assert!(super::patch(&defaulted, Target::Object { create: true })
            .0
            .is_empty());
    }

    #[test]
    fn given_values_are_kept() {
        let object = at(
            json!({"schedule": "s", "command": "c", "image": "alpine:3"}),
            Some(json!({"phase": "DONE"})),
        );
        assert!(patch(&object, Target::Object { create: true }).0.is_empty());
        assert!(patch(&object, Target::Status).0.is_empty());
    }

    #[test]
    fn blank_or_null_images_get_the_default() {
        for image in [json!(""), json!("  "), Value::Null] {
            let object = at(
                json!({"schedule": "s", "command": "c", "image": image}),
                None,
            );
            let defaulted = applied(&object, &patch(&object, Target::Object { create: false }));
            assert_eq!(defaulted["spec"]["image"], "busybox", "{image}");
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
            let defaulted = applied(&object, &patch(&object, Target::Status));
            assert_eq!(defaulted["status"]["phase"], "PENDING", "{status}");
            assert_eq!(defaulted["spec"], object["spec"]);
        }
    }

    #[test]
    fn odd_shapes_do_not_panic() {
        for object in [
            json!(null),
            json!([]),
            json!({"spec": 3}),
            json!({"status": "x"}),
        ] {
            let _ = patch(&object, Target::Object { create: true });
            let _ = patch(&object, Target::Status);
        }
    }
}

//! Conversion between the At's API versions, `v1alpha1` and `v1` (pure: JSON in, JSON out), and
//! the `ConversionReview` the API server sends to the conversion webhook.
//!
//! The two versions say the same things in different places: `v1` groups the pod's settings
//! in `spec.template` and spells the phase in CamelCase. The one thing `v1alpha1` cannot say,
//! `spec.template.metadata` (the pod's labels and annotations), travels in the annotation
//! [`POD_METADATA_ANNOTATION`] as JSON, as Kubernetes' own conversions keep fields an older
//! version lacks. So both round trips, `v1alpha1 -> v1 -> v1alpha1` and `v1 -> v1alpha1 -> v1`,
//! give back the object they started from (property tests in `conversion/tests.rs`).
//!
//! The conversion works on the JSON as stored, not on typed structs: it moves what is there,
//! `null`s and fields it does not know included, fills in no defaults (the API server applies
//! the target version's defaults after conversion), and never fails on a partial object.

use kube::core::conversion::{ConversionRequest, ConversionResponse, ConversionReview};
use kube::core::Status;
use serde_json::{Map, Value};
use thiserror::Error;

/// `apiVersion` of the first version, served and deprecated.
pub const V1ALPHA1: &str = "cnat.programming-kubernetes.info/v1alpha1";
/// `apiVersion` of the version kept and stored.
pub const V1: &str = "cnat.programming-kubernetes.info/v1";
/// On a `v1alpha1` object: the `v1` object's `spec.template.metadata`, as JSON.
pub const POD_METADATA_ANNOTATION: &str =
    "cnat.programming-kubernetes.info/v1-spec.template.metadata";
/// The `v1alpha1` spec fields that `v1` holds in `spec.template`, with the same names.
pub const POD_FIELDS: [&str; 7] = [
    "image",
    "resources",
    "env",
    "serviceAccountName",
    "nodeSelector",
    "tolerations",
    "imagePullSecrets",
];
/// The phases, as `v1alpha1` and as `v1` spell them.
const PHASES: [(&str, &str); 3] = [
    ("PENDING", "Pending"),
    ("RUNNING", "Running"),
    ("DONE", "Done"),
];

/// Why an object could not be converted.
#[derive(Debug, Error, PartialEq)]
pub enum ConversionError {
    #[error("cnat cannot convert to {0:?}: it converts At objects between {V1ALPHA1} and {V1}")]
    UnknownTarget(String),
    #[error("object {index} ({name}) has apiVersion {version:?}: cnat converts At objects between {V1ALPHA1} and {V1}")]
    UnknownSource {
        index: usize,
        name: String,
        version: String,
    },
    #[error("object {index} is not a JSON object but {found}")]
    NotAnObject { index: usize, found: &'static str },
}

/// `object` (the `index`th of a request) as `desired` (`V1ALPHA1` or `V1`).
pub fn convert(index: usize, object: Value, desired: &str) -> Result<Value, ConversionError> {
    if desired != V1 && desired != V1ALPHA1 {
        return Err(ConversionError::UnknownTarget(desired.to_owned()));
    }
    let Value::Object(mut object) = object else {
        return Err(ConversionError::NotAnObject {
            index,
            found: kind_of(&object),
        });
    };
    let version = object
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    match version {
        v if v == desired => {}
        V1ALPHA1 => up(&mut object),
        V1 => down(&mut object),
        other => {
            return Err(ConversionError::UnknownSource {
                index,
                name: name_of(&object),
                version: other.to_owned(),
            })
        }
    }
    object.insert("apiVersion".into(), Value::String(desired.to_owned()));
    Ok(Value::Object(object))
}

/// `v1alpha1` to `v1`, in place.
fn up(object: &mut Map<String, Value>) {
    if let Some(Value::Object(spec)) = object.get_mut("spec") {
        let mut template = Map::new();
        for field in POD_FIELDS {
            if let Some(value) = spec.remove(field) {
                template.insert(field.to_owned(), value);
            }
        }
        spec.insert("template".into(), Value::Object(template));
    }
    // The pod's metadata, when this object was v1 before: only an annotation that this code
    // wrote (what it would write again, byte for byte) is taken, so that any other value stays
    // where it is and the round trip gives it back unchanged.
    let carried = annotations(object)
        .and_then(|a| a.get(POD_METADATA_ANNOTATION))
        .and_then(Value::as_str)
        .and_then(|text| {
            let value: Value = serde_json::from_str(text).ok()?;
            (serde_json::to_string(&value).ok()? == text).then_some(value)
        });
    if let Some(metadata) = carried {
        remove_annotation(object);
        if let Some(Value::Object(spec)) = object.get_mut("spec") {
            if let Some(Value::Object(template)) = spec.get_mut("template") {
                template.insert("metadata".into(), metadata);
            }
        }
    }
    phase(object, true);
}

/// `v1` to `v1alpha1`, in place.
fn down(object: &mut Map<String, Value>) {
    let mut carried = None;
    if let Some(Value::Object(spec)) = object.get_mut("spec") {
        // (A template that is not an object, which the schema does not let through, is dropped.)
        if let Some(Value::Object(mut template)) = spec.remove("template") {
            carried = template.remove("metadata");
            // Every other field of the template is a pod field: v1alpha1 has them in `spec`.
            spec.extend(template);
        }
    }
    if let Some(metadata) = carried {
        let text = serde_json::to_string(&metadata).unwrap_or_default();
        let meta = object
            .entry("metadata")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(meta) = meta {
            let annotations = meta
                .entry("annotations")
                .or_insert_with(|| Value::Object(Map::new()));
            if !annotations.is_object() {
                *annotations = Value::Object(Map::new());
            }
            if let Value::Object(annotations) = annotations {
                annotations.insert(POD_METADATA_ANNOTATION.into(), Value::String(text));
            }
        }
    }
    phase(object, false);
}

/// Respells `status.phase` by `PHASES`, to v1's spelling when `to_v1`, else to v1alpha1's; a
/// value not in the table stays as it is.
fn phase(object: &mut Map<String, Value>, to_v1: bool) {
    let Some(Value::Object(status)) = object.get_mut("status") else {
        return;
    };
    let Some(Value::String(phase)) = status.get_mut("phase") else {
        return;
    };
    if let Some((_, to)) = PHASES
        .into_iter()
        .map(|(old, new)| if to_v1 { (old, new) } else { (new, old) })
        .find(|(from, _)| from == phase)
    {
        *phase = to.to_owned();
    }
}

fn annotations(object: &Map<String, Value>) -> Option<&Map<String, Value>> {
    object.get("metadata")?.get("annotations")?.as_object()
}

/// Removes the carried annotation, and the annotations map when it held nothing else.
fn remove_annotation(object: &mut Map<String, Value>) {
    let Some(Value::Object(meta)) = object.get_mut("metadata") else {
        return;
    };
    let Some(Value::Object(annotations)) = meta.get_mut("annotations") else {
        return;
    };
    annotations.remove(POD_METADATA_ANNOTATION);
    if annotations.is_empty() {
        meta.remove("annotations");
    }
}

fn name_of(object: &Map<String, Value>) -> String {
    let meta = object.get("metadata");
    let field = |f: &str| meta.and_then(|m| m.get(f)).and_then(Value::as_str);
    match (field("namespace"), field("name")) {
        (Some(ns), Some(name)) => format!("{ns}/{name}"),
        (None, Some(name)) => name.to_owned(),
        _ => "no name".to_owned(),
    }
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The answer to a `ConversionReview` body (`apiextensions.k8s.io/v1`): every object converted,
/// or a `Failure` naming the first that could not be, or, for a body that is not a
/// ConversionReview, a `Failure` saying why. Never panics.
pub fn review(body: &[u8]) -> ConversionReview {
    let mut request = match serde_json::from_slice::<ConversionReview>(body)
        .map_err(|e| format!("the body is not a ConversionReview: {e}"))
        .and_then(|review| {
            ConversionRequest::from_review(review)
                .map_err(|_| "the ConversionReview has no request".to_owned())
        }) {
        Ok(request) => request,
        Err(message) => {
            return ConversionResponse::invalid(Status::failure(&message, "BadRequest"))
                .into_review()
        }
    };
    let desired = request.desired_api_version.clone();
    let objects = std::mem::take(&mut request.objects);
    let response = ConversionResponse::for_request(request);
    let converted: Result<Vec<Value>, ConversionError> = objects
        .into_iter()
        .enumerate()
        .map(|(index, object)| convert(index, object, &desired))
        .collect();
    match converted {
        Ok(objects) => response.success(objects),
        Err(error) => response.failure(Status::failure(&error.to_string(), "BadRequest")),
    }
    .into_review()
}

#[cfg(test)]
mod tests;

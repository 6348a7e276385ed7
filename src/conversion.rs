//! Conversion between the At's API versions, `v1alpha1` and `v1`, on the JSON as stored (pure);
//! its children answer the `ConversionReview` the API server sends to the conversion webhook.
//! See docs/src/guide/at-api.md, "Conversion".

use serde_json::{Map, Value};
use thiserror::Error;

/// `apiVersion` of the first version, served and deprecated.
pub const V1ALPHA1: &str = "cnat.programming-kubernetes.info/v1alpha1";
/// `apiVersion` of the version kept and stored.
pub const V1: &str = "cnat.programming-kubernetes.info/v1";
/// On a `v1alpha1` object: what its `v1` form holds that `v1alpha1` cannot (`spec.template`'s
/// `metadata` and `imagePullPolicy`, no image, this annotation's own `v1` value), as JSON.
pub const CARRIED_ANNOTATION: &str = "cnat.programming-kubernetes.info/v1-fields";
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
    #[error("object {index}: {why}")]
    TooLarge { index: usize, why: String },
}

/// `message` (about a `v1` object, as cnat's rules word it) as a `v1alpha1` writer reads it: in
/// that version's field paths and phase spellings.
pub fn in_v1alpha1_terms(message: &str) -> String {
    let mut message = message
        .replace(
            "spec.template.metadata",
            &format!("metadata.annotations[{CARRIED_ANNOTATION}].{POD_METADATA}"),
        )
        .replace(
            "spec.template.imagePullPolicy",
            &format!("metadata.annotations[{CARRIED_ANNOTATION}].{IMAGE_PULL_POLICY}"),
        )
        .replace("spec.template.", "spec.");
    // Only where the rules name a phase ("once the At is Running", "from Done to Pending").
    for (older, newer) in PHASES {
        for before in ["is ", "from ", "to ", "once "] {
            message = message.replace(&format!("{before}{newer}"), &format!("{before}{older}"));
        }
    }
    message
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

/// `v1alpha1` to `v1`, in place (`apiVersion` untouched).
pub(crate) fn up(object: &mut Map<String, Value>) {
    let Some(Value::Object(spec)) = object.get_mut("spec") else {
        // No spec (the schema requires one): nothing to move, and the annotation stays.
        return phase(object, true);
    };
    let mut template = Map::new();
    for field in POD_FIELDS {
        if let Some(value) = spec.remove(field) {
            template.insert(field.to_owned(), value);
        }
    }
    // What this object held as v1 and v1alpha1 cannot: only an envelope as `down` writes it is
    // opened, so any other value stays where it is and comes back unchanged.
    let envelope = carried_annotation(object).and_then(envelope);
    if let Some(Envelope {
        fields,
        no_image,
        annotation,
    }) = envelope
    {
        for (field, value) in fields {
            template.insert(field.to_owned(), value);
        }
        if no_image && template.get("image").is_none_or(|i| i == V1ALPHA1_IMAGE) {
            template.remove("image");
        }
        set_annotation(object, annotation);
    }
    if let Some(Value::Object(spec)) = object.get_mut("spec") {
        spec.insert("template".into(), Value::Object(template));
    }
    phase(object, true);
}

/// `v1` to `v1alpha1`, in place (`apiVersion` untouched).
pub(crate) fn down(object: &mut Map<String, Value>) {
    let mut carried = Map::new();
    if let Some(Value::Object(spec)) = object.get_mut("spec") {
        // (A template that is not an object, which the schema does not let through, is dropped.)
        if let Some(Value::Object(mut template)) = spec.remove("template") {
            for (field, key) in V1_ONLY {
                if let Some(value) = template.remove(field) {
                    carried.insert(key.into(), value);
                }
            }
            if template.get("image").is_none_or(Value::is_null) {
                carried.insert(NO_IMAGE.into(), Value::Bool(true));
            }
            // Every other field of the template is a pod field: v1alpha1 has them in `spec`.
            spec.extend(template);
        }
    }
    let annotation = carried_annotation(object).map(str::to_owned);
    // An annotation of this name that `up` would not open stays as it is; one it would open
    // (a v1 object carrying what looks like an envelope) goes into the envelope itself.
    let wrap = !carried.is_empty() || annotation.as_deref().and_then(envelope).is_some();
    if wrap {
        if let Some(annotation) = annotation {
            carried.insert(ANNOTATION.into(), Value::String(annotation));
        }
        let text = serde_json::to_string(&Value::Object(carried)).unwrap_or_default();
        set_annotation(object, Some(text));
    }
    phase(object, false);
}

/// The longest value of [`CARRIED_ANNOTATION`] opened as an envelope: more than an At's pod
/// metadata can hold, as long as the longest string a review may hold (`streaming::MAX_TOKEN`).
const MAX_ENVELOPE: usize = 2 << 20;

/// Keys of the envelope in [`CARRIED_ANNOTATION`].
const POD_METADATA: &str = "podMetadata";
const IMAGE_PULL_POLICY: &str = "imagePullPolicy";
const NO_IMAGE: &str = "noImage";
const ANNOTATION: &str = "annotation";

/// `v1alpha1`'s schema default for `spec.image` (frozen), which the API server writes into an At
/// that a `v1alpha1` write leaves without one.
const V1ALPHA1_IMAGE: &str = "busybox";

/// The fields of `v1`'s `spec.template` that `v1alpha1` has not, with their keys in the envelope.
const V1_ONLY: [(&str, &str); 2] = [
    ("metadata", POD_METADATA),
    ("imagePullPolicy", IMAGE_PULL_POLICY),
];

/// What a `v1alpha1` object carries for `v1`: the template's fields `v1alpha1` has not (in
/// [`V1_ONLY`]'s order), whether the `v1` object named no image, and the annotation's own value.
#[derive(Debug, PartialEq)]
struct Envelope {
    fields: Vec<(&'static str, Value)>,
    no_image: bool,
    annotation: Option<String>,
}

/// `text` as an envelope, if it is exactly what `down` writes: serde_json's own output, byte
/// for byte, of an object with `podMetadata`, `imagePullPolicy`, `noImage` and/or `annotation`,
/// each shaped as `down` writes it (`annotation` alone only when it is an envelope itself).
fn envelope(text: &str) -> Option<Envelope> {
    // A made-up value longer than any envelope would otherwise be read into a tree many times
    // its size; an envelope is an object.
    if text.len() > MAX_ENVELOPE || !text.starts_with('{') {
        return None;
    }
    let value: Value = serde_json::from_str(text).ok()?;
    if serde_json::to_string(&value).ok()? != text {
        return None;
    }
    let Value::Object(mut fields) = value else {
        return None;
    };
    let mut carried = Vec::new();
    for (field, key) in V1_ONLY {
        if let Some(value) = fields.remove(key) {
            let shaped = match key {
                POD_METADATA => pod_metadata_shape(&value),
                _ => image_pull_policy_shape(&value),
            };
            if !shaped {
                return None;
            }
            carried.push((field, value));
        }
    }
    let no_image = match fields.remove(NO_IMAGE) {
        None => false,
        Some(Value::Bool(true)) => true,
        Some(_) => return None,
    };
    let annotation = match fields.remove(ANNOTATION) {
        None => None,
        Some(Value::String(annotation)) => Some(annotation),
        Some(_) => return None,
    };
    let needed =
        !carried.is_empty() || no_image || annotation.as_deref().and_then(envelope).is_some();
    (fields.is_empty() && needed).then_some(Envelope {
        fields: carried,
        no_image,
        annotation,
    })
}

/// Whether `value` is what v1's `spec.template.imagePullPolicy` can hold.
fn image_pull_policy_shape(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::String(policy) => policy.parse::<crate::api::ImagePullPolicy>().is_ok(),
        _ => false,
    }
}

/// Whether `value` is what v1's `spec.template.metadata` can hold.
fn pod_metadata_shape(value: &Value) -> bool {
    let strings = |v: &Value| match v {
        Value::Null => true,
        Value::Object(map) => map.values().all(Value::is_string),
        _ => false,
    };
    match value {
        Value::Null => true,
        Value::Object(map) => map
            .iter()
            .all(|(k, v)| (k == "labels" || k == "annotations") && strings(v)),
        _ => false,
    }
}

/// Respells `status.phase` by `PHASES`, to v1's spelling when `to_v1`, else to v1alpha1's; a
/// value not in the table stays as it is.
fn phase(object: &mut Map<String, Value>, to_v1: bool) {
    if let Some(Value::Object(status)) = object.get_mut("status") {
        respell(status, to_v1);
    }
}

/// [`phase`], on the status itself.
fn respell(status: &mut Map<String, Value>, to_v1: bool) {
    let Some(Value::String(phase)) = status.get_mut("phase") else {
        return;
    };
    if let Some(to) = respelled(phase, to_v1) {
        *phase = to.to_owned();
    }
}

/// `phase` in v1's spelling when `to_v1`, else in v1alpha1's, by `PHASES`; `None` for a value
/// not in the table.
fn respelled(phase: &str, to_v1: bool) -> Option<&'static str> {
    PHASES
        .into_iter()
        .map(|(old, new)| if to_v1 { (old, new) } else { (new, old) })
        .find(|(from, _)| *from == phase)
        .map(|(_, to)| to)
}

/// The value of the carried annotation on `object`, if it has one.
fn carried_annotation(object: &Map<String, Value>) -> Option<&str> {
    object
        .get("metadata")?
        .get("annotations")?
        .get(CARRIED_ANNOTATION)?
        .as_str()
}

/// Sets the carried annotation to `value`, or removes it (and the annotations map when it then
/// holds nothing, as the API server never stores an empty one).
fn set_annotation(object: &mut Map<String, Value>, value: Option<String>) {
    let meta = object
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    let Value::Object(meta) = meta else {
        return;
    };
    match value {
        Some(value) => {
            let annotations = meta
                .entry("annotations")
                .or_insert_with(|| Value::Object(Map::new()));
            if !annotations.is_object() {
                *annotations = Value::Object(Map::new());
            }
            if let Value::Object(annotations) = annotations {
                annotations.insert(CARRIED_ANNOTATION.into(), Value::String(value));
            }
        }
        None => {
            if let Some(Value::Object(annotations)) = meta.get_mut("annotations") {
                annotations.remove(CARRIED_ANNOTATION);
                if annotations.is_empty() {
                    meta.remove("annotations");
                }
            }
        }
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

pub mod parts;
pub mod streaming;
pub mod typed;

#[cfg(test)]
mod tests;

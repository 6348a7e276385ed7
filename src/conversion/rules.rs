//! The rules every conversion path shares: the versions, the carried annotation's envelope,
//! the phases' spellings and the errors. Pure.

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
pub(super) const PHASES: [(&str, &str); 3] = [
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

/// The longest value of [`CARRIED_ANNOTATION`] opened as an envelope: more than an At's pod
/// metadata can hold, as long as the longest string a review may hold (`streaming::MAX_TOKEN`).
const MAX_ENVELOPE: usize = 2 << 20;

/// Keys of the envelope in [`CARRIED_ANNOTATION`].
pub(super) const POD_METADATA: &str = "podMetadata";
pub(super) const IMAGE_PULL_POLICY: &str = "imagePullPolicy";
pub(super) const NO_IMAGE: &str = "noImage";
pub(super) const ANNOTATION: &str = "annotation";

/// `v1alpha1`'s schema default for `spec.image` (frozen), which the API server writes into an At
/// that a `v1alpha1` write leaves without one.
pub(super) const V1ALPHA1_IMAGE: &str = "busybox";

/// The fields of `v1`'s `spec.template` that `v1alpha1` has not, with their keys in the envelope.
pub(super) const V1_ONLY: [(&str, &str); 2] = [
    ("metadata", POD_METADATA),
    ("imagePullPolicy", IMAGE_PULL_POLICY),
];

/// What a `v1alpha1` object carries for `v1`: the template's fields `v1alpha1` has not (in
/// [`V1_ONLY`]'s order), whether the `v1` object named no image, and the annotation's own value.
#[derive(Debug, PartialEq)]
pub(super) struct Envelope {
    pub(super) fields: Vec<(&'static str, Value)>,
    pub(super) no_image: bool,
    pub(super) annotation: Option<String>,
}

/// `text` as an envelope, if it is exactly what `down` writes: serde_json's own output, byte
/// for byte, of an object with `podMetadata`, `imagePullPolicy`, `noImage` and/or `annotation`,
/// each shaped as `down` writes it (`annotation` alone only when it is an envelope itself).
pub(super) fn envelope(text: &str) -> Option<Envelope> {
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

/// Respells `status.phase` (in `status`) by `PHASES`, to v1's spelling when `to_v1`, else to
/// v1alpha1's; a value not in the table stays as it is.
pub(super) fn respell(status: &mut Map<String, Value>, to_v1: bool) {
    let Some(Value::String(phase)) = status.get_mut("phase") else {
        return;
    };
    if let Some(to) = respelled(phase, to_v1) {
        *phase = to.to_owned();
    }
}

/// `phase` in v1's spelling when `to_v1`, else in v1alpha1's, by `PHASES`; `None` for a value
/// not in the table.
pub(super) fn respelled(phase: &str, to_v1: bool) -> Option<&'static str> {
    PHASES
        .into_iter()
        .map(|(old, new)| if to_v1 { (old, new) } else { (new, old) })
        .find(|(from, _)| *from == phase)
        .map(|(_, to)| to)
}

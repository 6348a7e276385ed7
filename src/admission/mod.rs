//! Admission: the rules an At must follow before the API server stores it, the webhooks that
//! apply them, and the same rules offline.
//! See docs/src/design/architecture.md, "The webhooks behind the Service".

pub mod access_review;
pub mod check;
pub mod conversion_webhook;
pub mod defaulting;
pub mod mutating_review;
pub mod review;
pub mod validating_review;
pub mod validation;
pub mod webhook;

/// The AdmissionReviews captured from kube-apiserver v1.24 (`tests/fixtures`), for unit tests.
#[cfg(test)]
pub(crate) const CAPTURED_REVIEWS: [&str; 10] = [
    "mutating-create.json",
    "mutating-create-dryrun.json",
    "mutating-delete.json",
    "mutating-update.json",
    "mutating-update-status.json",
    "validating-create.json",
    "validating-create-dryrun.json",
    "validating-delete.json",
    "validating-update.json",
    "validating-update-status.json",
];

/// One of `CAPTURED_REVIEWS`' reviews.
#[cfg(test)]
pub(crate) fn captured_review(name: &str) -> serde_json::Value {
    let path = format!(
        "{}/tests/fixtures/admission-review-k8s-1.24/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let capture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    capture["review"].clone()
}

//! The hot paths' inputs and operations, shared by `hot_paths` (instruction counts under
//! callgrind) and `allocations` (allocation counts): each input is made outside what is
//! measured, and each `setup` runs its operation once first, so that one-time work (lazily
//! built tables) is not counted as the operation's. (`webhook` uses `review` alone.)

#![allow(dead_code, unused_imports)] // each bench uses a part

use cnat::admission::review::ReviewError;
use cnat::admission::webhook::Verdict;
use cnat::api::{At, AtStatus};
pub use cnat::conversion::streaming::{Answered, Broken};
use cnat::operator::cache::{CacheError, CachedAt};
use cnat::operator::policy::RunPolicy;
pub use cnat::operator::reconcile::decide::Call;
use cnat::operator::reconcile::decide::{self, Decision, PodObservation};
use serde_json::Value;
use std::hint::black_box;

/// The captured AdmissionReviews of kube-apiserver v1.24 (`v1alpha1` writes).
const VALIDATING: &str =
    include_str!("../../tests/fixtures/admission-review-k8s-1.24/validating-create.json");
const MUTATING: &str =
    include_str!("../../tests/fixtures/admission-review-k8s-1.24/mutating-create.json");

/// The review as the API server sent it (`v1alpha1`), or as it sends it for a `v1` write.
pub fn review(fixture: &str, version: &str) -> Vec<u8> {
    let capture: Value = serde_json::from_str(fixture).expect("a captured review");
    let mut review = capture["review"].clone();
    if version == "v1" {
        let request = &mut review["request"];
        for field in ["kind", "resource", "requestKind", "requestResource"] {
            if request[field].is_object() {
                request[field]["version"] = "v1".into();
            }
        }
        for field in ["object", "oldObject"] {
            if request[field].is_object() {
                request[field] =
                    cnat::conversion::convert(0, request[field].take(), cnat::conversion::V1)
                        .expect("the captured At converts");
            }
        }
    }
    serde_json::to_vec(&review).expect("JSON")
}

pub fn validating_review(version: &str) -> Vec<u8> {
    review(VALIDATING, version)
}

pub fn mutating_review(version: &str) -> Vec<u8> {
    review(MUTATING, version)
}

/// The captured At as `v1`, named `at-N`, pending.
pub fn at_json(n: usize) -> Value {
    let capture: Value = serde_json::from_str(VALIDATING).expect("a captured review");
    let mut at = cnat::conversion::convert(
        0,
        capture["review"]["request"]["object"].clone(),
        cnat::conversion::V1,
    )
    .expect("the captured At converts");
    at["metadata"]["name"] = format!("at-{n:03}").into();
    at["metadata"]["resourceVersion"] = format!("{}", 1000 + n).into();
    at["metadata"]["uid"] = format!("00000000-0000-0000-0000-{n:012}").into();
    at["status"] = serde_json::json!({"phase": "Pending"});
    at
}

/// A ConversionReview of `n` stored `v1alpha1` Ats to `v1`, as the API server sends a list's.
pub fn conversion_review(n: usize) -> Vec<u8> {
    let objects: Vec<Value> = (0..n)
        .map(|i| {
            // As 0.1.0 stored them: with v1alpha1's schema default for the image.
            let mut at = at_json(i);
            at["spec"]["template"]["image"] = "busybox".into();
            cnat::conversion::convert(i, at, cnat::conversion::V1ALPHA1)
                .expect("v1 converts to v1alpha1")
        })
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
        "request": {"uid": "bench", "desiredAPIVersion": "cnat.programming-kubernetes.info/v1",
            "objects": objects}
    }))
    .expect("JSON")
}

pub fn pending_at() -> At {
    serde_json::from_value(at_json(0)).expect("an At")
}

pub fn at_text() -> String {
    at_json(0).to_string()
}

pub fn cached_at() -> CachedAt {
    CachedAt::decode_text(&at_text())
}

/// A decision's input: the At, the instant, and the operator's defaults.
pub struct Decide {
    pub at: At,
    pub now: chrono::DateTime<chrono::Utc>,
    pub policy: RunPolicy,
}

/// A due, pending At with no pod yet, decided on 2026-11-26 (the captured At is long due).
pub fn decide_input() -> Decide {
    Decide {
        at: pending_at(),
        now: chrono::DateTime::parse_from_rfc3339("2026-11-26T00:00:00Z")
            .expect("a time")
            .to_utc(),
        policy: RunPolicy::default(),
    }
}

/// The status a due, pending At's decision writes (its pod to be created), and the version it
/// was decided on.
pub fn decided_status() -> (String, AtStatus) {
    let input = decide_input();
    let decision = decide_pending(&input);
    let status = decision
        .status
        .expect("a due At's decision writes a status");
    (
        input.at.metadata.resource_version.unwrap_or_default(),
        status,
    )
}

pub fn validate(body: &[u8]) -> Result<Verdict, ReviewError> {
    black_box(cnat::admission::webhook::validating(black_box(body)))
}

pub fn mutate(body: &[u8]) -> Result<Verdict, ReviewError> {
    black_box(cnat::admission::webhook::mutating(black_box(body)))
}

/// The answer to a ConversionReview, and what was written.
pub fn convert(body: &[u8]) -> (Result<Answered, Broken>, Vec<u8>) {
    let mut out = Vec::with_capacity(body.len() + 4096);
    let answered = cnat::conversion::streaming::answer(black_box(body), &mut out);
    black_box((answered, out))
}

pub fn decide_pending(input: &Decide) -> Decision {
    black_box(decide::decide(
        black_box(&input.at),
        &PodObservation::Missing,
        input.now,
        &input.policy,
    ))
}

pub fn cache_insert(text: &str) -> CachedAt {
    black_box(CachedAt::decode_text(black_box(text)))
}

pub fn cache_read(cached: &CachedAt) -> Result<At, CacheError> {
    black_box(black_box(cached).at())
}

/// The patch of one status write, serialized as it is sent.
pub fn status_patch(version: &str, status: &AtStatus) -> Vec<u8> {
    let patch = cnat::operator::reconcile::writer::status_patch(Some(version), black_box(status));
    black_box(serde_json::to_vec(&patch).expect("a JSON patch"))
}

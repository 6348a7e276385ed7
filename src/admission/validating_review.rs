//! What the validating webhook reads of a review its typed paths could not take (too large, an
//! object that does not decode as an At, another kind): decoded once, the objects within a budget
//! each (`serving::bounded`), so a made-up body costs a bounded multiple of what it holds.

use crate::admission::review::{Envelope, ReviewError};
use crate::serving::bounded::{self, Budget};
use k8s_openapi::api::authentication::v1::UserInfo;
use kube::core::admission::Operation;
use kube::core::{GroupVersionKind, GroupVersionResource, TypeMeta};
use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// What one object of a review may take in memory, decoded (as `mutating_review`'s fields).
pub const OBJECT_BUDGET: usize = 8 << 20;

/// The request's fields the validating webhook uses.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Request {
    pub uid: String,
    pub kind: GroupVersionKind,
    pub resource: GroupVersionResource,
    #[serde(default)]
    pub sub_resource: Option<String>,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    pub operation: Operation,
    #[serde(deserialize_with = "identity")]
    pub user_info: UserInfo,
    #[serde(default, deserialize_with = "object")]
    pub object: Option<Value>,
    #[serde(default, deserialize_with = "object")]
    pub old_object: Option<Value>,
    #[serde(default)]
    pub dry_run: bool,
}

/// An object, or `null` (`None`), decoded within [`OBJECT_BUDGET`]; anything else is refused
/// at its first byte.
fn object<'de, D: Deserializer<'de>>(value: D) -> Result<Option<Value>, D::Error> {
    let budget = Budget::new(OBJECT_BUDGET);
    Ok(bounded::object_or_null(value, &budget)?.map(Value::Object))
}

/// What a review's `userInfo` may take in memory, decoded: many times the largest identity the
/// escalation guard asks about (`access_review::MAX_USER_INFO_BYTES`), which denies more.
pub const IDENTITY_BUDGET: usize = 1 << 20;

/// The `userInfo`, decoded within [`IDENTITY_BUDGET`].
fn identity<'de, D: Deserializer<'de>>(value: D) -> Result<UserInfo, D::Error> {
    use serde::de::{DeserializeSeed, Error};
    let budget = Budget::new(IDENTITY_BUDGET);
    let value = budget.value().deserialize(value)?;
    UserInfo::deserialize(value).map_err(D::Error::custom)
}

/// The review's type fields and its request, from an `admission.k8s.io/v1` AdmissionReview.
pub fn decode(body: &[u8]) -> Result<(TypeMeta, Request), ReviewError> {
    Envelope::from_slice(body)?.split()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_capture_reads_as_kube_s_full_decode() {
        use kube::core::admission::{AdmissionRequest, AdmissionReview};
        use kube::core::DynamicObject;
        for name in crate::admission::CAPTURED_REVIEWS {
            let body = serde_json::to_vec(&crate::admission::captured_review(name)).unwrap();
            let kube: AdmissionReview<DynamicObject> = serde_json::from_slice(&body).unwrap();
            let kube: AdmissionRequest<DynamicObject> = kube.try_into().unwrap();
            let (types, ours) = decode(&body).unwrap();
            assert_eq!(types, kube.types, "{name}");
            assert_eq!(
                (
                    &ours.uid,
                    &ours.kind,
                    &ours.sub_resource,
                    &ours.name,
                    &ours.namespace
                ),
                (
                    &kube.uid,
                    &kube.kind,
                    &kube.sub_resource,
                    &kube.name,
                    &kube.namespace
                ),
                "{name}"
            );
            assert_eq!(
                (&ours.operation, ours.dry_run),
                (&kube.operation, kube.dry_run),
                "{name}"
            );
            assert_eq!(ours.user_info, kube.user_info, "{name}");
            // The objects as they are in the review, nulls included.
            let review = crate::admission::captured_review(name);
            let raw = |field: &str| Some(review["request"][field].clone()).filter(|o| !o.is_null());
            assert_eq!(ours.object, raw("object"), "{name}");
            assert_eq!(ours.old_object, raw("oldObject"), "{name}");
        }
    }

    #[test]
    fn objects_of_the_wrong_shape_or_past_the_budget_are_refused_while_decoding() {
        let review = crate::admission::captured_review("validating-update.json");
        for bad in [
            Value::Array(vec![0.into(); 100_000]),
            Value::from(7),
            Value::from("x"),
        ] {
            let mut broken = review.clone();
            broken["request"]["oldObject"] = bad;
            let refused = decode(&serde_json::to_vec(&broken).unwrap())
                .unwrap_err()
                .to_string();
            assert!(refused.contains("expected a JSON object"), "{refused}");
        }
        let mut huge = review.clone();
        huge["request"]["object"]["metadata"]["managedFields"] =
            serde_json::json!([{"fieldsV1": vec![0; 200_000]}]);
        let refused = decode(&serde_json::to_vec(&huge).unwrap())
            .unwrap_err()
            .to_string();
        assert!(refused.contains("more than any At needs"), "{refused}");
        let mut crowd = review.clone();
        crowd["request"]["userInfo"]["groups"] = Value::Array(vec!["".into(); 100_000]);
        let refused = decode(&serde_json::to_vec(&crowd).unwrap())
            .unwrap_err()
            .to_string();
        assert!(refused.contains("more than any At needs"), "{refused}");
        let mut null = review.clone();
        null["request"]["oldObject"] = Value::Null;
        assert!(decode(&serde_json::to_vec(&null).unwrap())
            .unwrap()
            .1
            .old_object
            .is_none());
    }
}

//! What the mutating webhook reads of an AdmissionReview; the rest is skipped while parsing (the
//! API server has checked the object's metadata before any webhook sees it).
//! See docs/src/design/decisions.md, "Lean admission decoding".

use crate::admission::review::{Envelope, ReviewError};
use crate::serving::bounded::Budget;
use kube::core::admission::Operation;
use kube::core::GroupVersionKind;
use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// The request's fields the mutating webhook uses.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Request {
    pub uid: String,
    pub kind: GroupVersionKind,
    #[serde(default)]
    pub sub_resource: Option<String>,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    pub operation: Operation,
    #[serde(default)]
    pub object: Option<Object>,
    /// On an update: the stored object, of which only the labels are read.
    #[serde(default)]
    pub old_object: Option<OldObject>,
}

/// The stored object's fields the defaults depend on.
#[derive(Debug, Default, Deserialize)]
pub struct OldObject {
    #[serde(default)]
    pub metadata: Metadata,
}

/// The object's fields the defaults depend on.
#[derive(Debug, Default, Deserialize)]
pub struct Object {
    #[serde(default)]
    pub metadata: Metadata,
    /// Present (`null` included) or absent, as in the object.
    #[serde(default, deserialize_with = "present")]
    spec: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    status: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
pub struct Metadata {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub labels: Option<BTreeMap<String, String>>,
}

/// A field as it is (present either way): an object decoded within [`FIELD_BUDGET`]; a list
/// (no At's spec or status is one) skipped as it is read, an empty list standing for it (nothing
/// defaults inside it, the defaults leave it alone, and the API server's schema refuses it); `null`
/// and other values as they are.
fn present<'de, D: Deserializer<'de>>(value: D) -> Result<Option<Value>, D::Error> {
    struct Field<'a>(&'a Budget);
    impl<'de> Visitor<'de> for Field<'_> {
        type Value = Value;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Value, A::Error> {
            self.0.value().visit_map(map)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(Value::Array(Vec::new()))
        }
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
            self.0.value().visit_bool(v)
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
            self.0.value().visit_i64(v)
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
            self.0.value().visit_u64(v)
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
            self.0.value().visit_f64(v)
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
            self.0.value().visit_str(v)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
    }
    let budget = Budget::new(FIELD_BUDGET);
    value.deserialize_any(Field(&budget)).map(Some)
}

/// What an object's spec or status may take in memory, decoded: many times what any At needs,
/// and a bound on a made-up one.
pub const FIELD_BUDGET: usize = 8 << 20;

impl Object {
    /// `spec` and `status` as they were in the object (absent ones absent), at the paths the
    /// defaults' JSON patch uses; taken out of the object.
    pub fn take_data(&mut self) -> Value {
        let mut data = Map::new();
        for (key, value) in [("spec", self.spec.take()), ("status", self.status.take())] {
            if let Some(value) = value {
                data.insert(key.to_owned(), value);
            }
        }
        Value::Object(data)
    }
}

/// The request inside an `admission.k8s.io/v1` AdmissionReview body.
pub fn decode(body: &[u8]) -> Result<Request, ReviewError> {
    Envelope::from_slice(body)?.request()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::admission::{AdmissionRequest, AdmissionReview};
    use kube::core::DynamicObject;

    /// What kube's full decode gives for the same body.
    fn full(body: &[u8]) -> AdmissionRequest<DynamicObject> {
        let review: AdmissionReview<DynamicObject> = serde_json::from_slice(body).unwrap();
        review.try_into().unwrap()
    }

    #[test]
    fn every_capture_reads_as_kube_s_full_decode() {
        for name in crate::admission::CAPTURED_REVIEWS {
            let body = serde_json::to_vec(&crate::admission::captured_review(name)).unwrap();
            let (ours, kube) = (decode(&body).unwrap(), full(&body));
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
            assert_eq!(ours.operation, kube.operation, "{name}");
            assert_eq!(
                ours.old_object.map(|old| old.metadata.labels),
                kube.old_object.map(|old| old.metadata.labels),
                "{name}"
            );
            assert_eq!(ours.object.is_some(), kube.object.is_some(), "{name}");
            if let (Some(mut ours), Some(kube)) = (ours.object, &kube.object) {
                assert_eq!(ours.metadata.name, kube.metadata.name, "{name}");
                assert_eq!(ours.metadata.labels, kube.metadata.labels, "{name}");
                let mut data = kube.data.clone();
                data.as_object_mut()
                    .unwrap()
                    .retain(|k, _| k == "spec" || k == "status");
                assert_eq!(ours.take_data(), data, "{name}");
            }
        }
    }

    #[test]
    fn a_null_status_stays_null_and_an_absent_one_absent() {
        let mut review = crate::admission::captured_review("mutating-create.json");
        review["request"]["object"]["status"] = Value::Null;
        let body = serde_json::to_vec(&review).unwrap();
        let data = decode(&body).unwrap().object.unwrap().take_data();
        assert_eq!(data["status"], Value::Null);
        assert!(data.as_object().unwrap().contains_key("status"));
        review["request"]["object"]
            .as_object_mut()
            .unwrap()
            .remove("status");
        let body = serde_json::to_vec(&review).unwrap();
        let data = decode(&body).unwrap().object.unwrap().take_data();
        assert!(!data.as_object().unwrap().contains_key("status"));
    }

    #[test]
    fn what_kube_refuses_to_decode_is_refused() {
        let review = crate::admission::captured_review("mutating-create.json");
        for field in ["apiVersion", "kind"] {
            let mut without = review.clone();
            without.as_object_mut().unwrap().remove(field);
            let refused = decode(&serde_json::to_vec(&without).unwrap())
                .unwrap_err()
                .to_string();
            assert!(
                refused.contains(&format!("missing field `{field}`")),
                "{refused}"
            );
        }
        let mut without = review.clone();
        without.as_object_mut().unwrap().remove("request");
        assert_eq!(
            decode(&serde_json::to_vec(&without).unwrap())
                .unwrap_err()
                .to_string(),
            "the AdmissionReview has no request"
        );
        for (path, bad) in [
            ("uid", Value::Null),
            ("operation", "PATCH".into()),
            ("kind", "At".into()),
        ] {
            let mut broken = review.clone();
            broken["request"][path] = bad;
            let body = serde_json::to_vec(&broken).unwrap();
            assert!(decode(&body).is_err(), "{path}");
        }
        let mut labels = review.clone();
        labels["request"]["object"]["metadata"]["labels"] = serde_json::json!({"a": 1});
        assert!(decode(&serde_json::to_vec(&labels).unwrap()).is_err());
        // A spec or status that is a list is skipped as it is read, however long.
        for field in ["spec", "status"] {
            let mut array = review.clone();
            array["request"]["object"][field] = Value::Array(vec![0.into(); 100_000]);
            let body = serde_json::to_vec(&array).unwrap();
            let mut object = decode(&body).unwrap().object.unwrap();
            assert_eq!(
                object.take_data()[field],
                Value::Array(Vec::new()),
                "{field}"
            );
        }
        let mut huge = review.clone();
        huge["request"]["object"]["spec"]["x"] = Value::Array(vec![0.into(); 200_000]);
        let refused = decode(&serde_json::to_vec(&huge).unwrap())
            .unwrap_err()
            .to_string();
        assert!(refused.contains("more than any At needs"), "{refused}");
        assert!(decode(b"not json").is_err());
    }
}

//! An At's metadata as the cache decodes it: `ObjectMeta` without `managedFields` and
//! `annotations`, which nothing here reads and which are most of an At's bytes; the decoder
//! skips them without building them (serde's `IgnoredAny`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::Deserialize;
use std::fmt;

/// `ObjectMeta` but for `managedFields` and `annotations` (always `None`).
pub struct KeptMeta(pub ObjectMeta);

/// The keys of `ObjectMeta` the cache keeps; any other is skipped.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "camelCase")]
enum Key {
    Name,
    Namespace,
    Uid,
    ResourceVersion,
    Generation,
    GenerateName,
    CreationTimestamp,
    DeletionTimestamp,
    DeletionGracePeriodSeconds,
    Finalizers,
    Labels,
    OwnerReferences,
    SelfLink,
    #[serde(other)]
    Skipped,
}

impl<'de> Deserialize<'de> for KeptMeta {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(MetaVisitor)
    }
}

struct MetaVisitor;

impl<'de> Visitor<'de> for MetaVisitor {
    type Value = KeptMeta;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object's metadata")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<KeptMeta, A::Error> {
        let mut m = ObjectMeta::default();
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Name => m.name = map.next_value()?,
                Key::Namespace => m.namespace = map.next_value()?,
                Key::Uid => m.uid = map.next_value()?,
                Key::ResourceVersion => m.resource_version = map.next_value()?,
                Key::Generation => m.generation = map.next_value()?,
                Key::GenerateName => m.generate_name = map.next_value()?,
                Key::CreationTimestamp => m.creation_timestamp = map.next_value()?,
                Key::DeletionTimestamp => m.deletion_timestamp = map.next_value()?,
                Key::DeletionGracePeriodSeconds => {
                    m.deletion_grace_period_seconds = map.next_value()?
                }
                Key::Finalizers => m.finalizers = map.next_value()?,
                Key::Labels => m.labels = map.next_value()?,
                Key::OwnerReferences => m.owner_references = map.next_value()?,
                Key::SelfLink => m.self_link = map.next_value()?,
                Key::Skipped => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(KeptMeta(m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_every_field_but_managed_fields_and_annotations() {
        let json = serde_json::json!({
            "name": "a", "namespace": "ns", "uid": "u", "resourceVersion": "7",
            "generation": 2, "generateName": "a-", "selfLink": "/x",
            "creationTimestamp": "2026-11-25T00:00:00Z",
            "deletionTimestamp": "2026-11-25T01:00:00Z", "deletionGracePeriodSeconds": 0,
            "finalizers": ["f"], "labels": {"team": "a"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "c", "uid": "o"}],
            "annotations": {"big": "x"},
            "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}],
            "somethingNew": {"nested": [1, 2]},
        });
        let kept = KeptMeta::deserialize(&json).unwrap().0;
        let mut expected: ObjectMeta = serde_json::from_value(json).unwrap();
        expected.annotations = None;
        expected.managed_fields = None;
        assert_eq!(kept, expected);
        // A field of the wrong type is an error, as with `ObjectMeta`.
        let bad = serde_json::json!({"name": 5});
        assert!(KeptMeta::deserialize(&bad).is_err());
    }
}

//! A `v1alpha1` At decoded straight into typed fields and converted to the `v1` [`At`]: the
//! validating webhook's path for `v1alpha1` reviews. It gives the very `At` that
//! [`super::convert`] and a decode of its result give, or fails, leaving the object to the JSON
//! path (`validating_review`), which says why it is not an At.

use super::rules::{envelope, respell, Envelope, CARRIED_ANNOTATION, V1ALPHA1, V1ALPHA1_IMAGE};
use crate::api::{At, AtPodTemplate, AtSpec, AtStatus, ImagePullPolicy, PodMetadata};
use k8s_openapi::api::core::v1::{EnvVar, LocalObjectReference, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::{NamespaceResourceScope, Resource};
use serde::{Deserialize, Deserializer};
use std::borrow::Cow;
use std::collections::BTreeMap;

/// An At as `v1alpha1` writes it: the pod's settings in `spec` itself, the phase in capitals.
#[derive(Debug, Deserialize)]
pub struct AtV1alpha1 {
    /// The object's own version: anything but `v1alpha1` is left to the slower path, which
    /// reads the object as that version says (or refuses it).
    #[serde(rename = "apiVersion")]
    pub api_version: String,
    pub metadata: ObjectMeta,
    pub spec: SpecV1alpha1,
    #[serde(default, deserialize_with = "status_in_v1_spelling")]
    pub status: Option<AtStatus>,
}

/// `v1alpha1`'s spec: `v1`'s, with the fields of `v1`'s `spec.template` (but its `metadata`) in
/// it. The serde attributes are `AtSpec`'s and `AtPodTemplate`'s.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpecV1alpha1 {
    schedule: String,
    #[serde(default)]
    time_zone: Option<String>,
    command: String,
    #[serde(default)]
    starting_deadline_seconds: Option<i64>,
    #[serde(default)]
    active_deadline_seconds: Option<i64>,
    #[serde(default)]
    ttl_seconds_after_finished: Option<i32>,
    #[serde(default)]
    image: Option<String>,
    #[serde(default)]
    resources: Option<ResourceRequirements>,
    #[serde(default)]
    env: Option<Vec<EnvVar>>,
    #[serde(default)]
    service_account_name: Option<String>,
    #[serde(default)]
    node_selector: Option<BTreeMap<String, String>>,
    #[serde(default)]
    tolerations: Option<Vec<Toleration>>,
    #[serde(default)]
    image_pull_secrets: Option<Vec<LocalObjectReference>>,
}

/// The status with its phase respelled as `v1` spells it, or `None` for none or `null`.
fn status_in_v1_spelling<'de, D: Deserializer<'de>>(d: D) -> Result<Option<AtStatus>, D::Error> {
    use serde::de::Error;
    let Some(mut status) = Option::<serde_json::Value>::deserialize(d)? else {
        return Ok(None);
    };
    if let serde_json::Value::Object(status) = &mut status {
        respell(status, true);
    }
    AtStatus::deserialize(status)
        .map(Some)
        .map_err(D::Error::custom)
}

impl AtV1alpha1 {
    /// The `v1` At, or `None` where the carried `v1` fields are not what `v1` can hold (the slow
    /// path then says so).
    pub fn into_v1(self) -> Option<At> {
        let AtV1alpha1 {
            api_version,
            mut metadata,
            spec,
            status,
        } = self;
        if api_version != V1ALPHA1 {
            return None;
        }
        let mut template = AtPodTemplate {
            metadata: None,
            image: spec.image,
            image_pull_policy: None,
            resources: spec.resources,
            env: spec.env,
            service_account_name: spec.service_account_name,
            node_selector: spec.node_selector,
            tolerations: spec.tolerations,
            image_pull_secrets: spec.image_pull_secrets,
        };
        let carried = metadata
            .annotations
            .as_ref()
            .and_then(|annotations| annotations.get(CARRIED_ANNOTATION))
            .and_then(|text| envelope(text));
        if let Some(Envelope {
            fields,
            no_image,
            annotation,
        }) = carried
        {
            if no_image
                && template
                    .image
                    .as_deref()
                    .is_none_or(|image| image == V1ALPHA1_IMAGE)
            {
                template.image = None;
            }
            for (field, value) in fields {
                match field {
                    "metadata" => {
                        template.metadata = Option::<PodMetadata>::deserialize(value).ok()?;
                    }
                    _ => {
                        template.image_pull_policy =
                            Option::<ImagePullPolicy>::deserialize(value).ok()?;
                    }
                }
            }
            let annotations = metadata.annotations.get_or_insert_default();
            match annotation {
                Some(annotation) => {
                    annotations.insert(CARRIED_ANNOTATION.to_owned(), annotation);
                }
                None => {
                    annotations.remove(CARRIED_ANNOTATION);
                    if annotations.is_empty() {
                        metadata.annotations = None;
                    }
                }
            }
        }
        Some(At {
            metadata,
            spec: AtSpec {
                schedule: spec.schedule,
                time_zone: spec.time_zone,
                command: spec.command,
                starting_deadline_seconds: spec.starting_deadline_seconds,
                active_deadline_seconds: spec.active_deadline_seconds,
                ttl_seconds_after_finished: spec.ttl_seconds_after_finished,
                template,
            },
            status,
        })
    }
}

/// What kube's `AdmissionRequest` needs of an object type.
impl Resource for AtV1alpha1 {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        At::kind(&())
    }
    fn group(_: &()) -> Cow<'_, str> {
        At::group(&())
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1alpha1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        At::plural(&())
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

//! An AdmissionReview as it arrives, decoded straight from the bytes into its request (kube's
//! flattened type fields would make serde buffer it whole and decode it twice). kube's rules:
//! `apiVersion` and `kind` required, a request needed, a `response` or any other field ignored.

use kube::core::admission::AdmissionRequest;
use kube::core::{Resource, TypeMeta};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use thiserror::Error;

/// Why a body is not an AdmissionReview cnat can review (the webhook answers 400 with it).
#[derive(Debug, Error)]
pub enum ReviewError {
    #[error("the body is not an admission.k8s.io/v1 AdmissionReview: {0}")]
    NotAReview(#[from] serde_json::Error),
    #[error("the AdmissionReview has no request")]
    NoRequest,
}

/// A review whose request decodes as `R`: kube's `AdmissionRequest`, or the part of it a
/// webhook reads (`mutating_review`).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Envelope<R> {
    api_version: String,
    kind: String,
    /// Absent is `None` (serde's rule for an `Option` field).
    request: Option<R>,
}

impl<R: DeserializeOwned> Envelope<R> {
    /// The review in `body`, or why it is not one.
    pub fn from_slice(body: &[u8]) -> Result<Self, ReviewError> {
        Ok(serde_json::from_slice(body)?)
    }

    /// The request, or why there is none.
    pub fn request(self) -> Result<R, ReviewError> {
        self.split().map(|(_, request)| request)
    }

    /// The review's type fields and its request, or why there is no request.
    pub fn split(self) -> Result<(TypeMeta, R), ReviewError> {
        let types = TypeMeta {
            api_version: self.api_version,
            kind: self.kind,
        };
        let request = self.request.ok_or(ReviewError::NoRequest)?;
        Ok((types, request))
    }
}

impl<T: Resource> Envelope<AdmissionRequest<T>>
where
    AdmissionRequest<T>: DeserializeOwned,
{
    /// The request, with the review's type fields as kube's conversion sets them.
    pub fn admission_request(self) -> Result<AdmissionRequest<T>, ReviewError> {
        let (types, mut request) = self.split()?;
        request.types = types;
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::admission::AdmissionReview;
    use kube::core::DynamicObject;

    fn fixture(name: &str) -> Vec<u8> {
        serde_json::to_vec(&crate::admission::captured_review(name)).unwrap()
    }

    fn decode(body: &[u8]) -> Result<AdmissionRequest<DynamicObject>, String> {
        decode_review(body).map_err(|e| e.to_string())
    }

    fn decode_review(body: &[u8]) -> Result<AdmissionRequest<DynamicObject>, ReviewError> {
        Envelope::from_slice(body)?.admission_request()
    }

    #[test]
    fn the_envelope_reads_every_capture_as_kube_s_admission_review_does() {
        for name in crate::admission::CAPTURED_REVIEWS {
            let body = fixture(name);
            let kube: AdmissionReview<DynamicObject> = serde_json::from_slice(&body).unwrap();
            let kube: AdmissionRequest<DynamicObject> = kube.try_into().unwrap();
            let ours = decode(&body).unwrap();
            assert_eq!(ours.types, kube.types, "{name}");
            assert_eq!(ours.uid, kube.uid, "{name}");
            assert_eq!(ours.object, kube.object, "{name}");
            assert_eq!(ours.old_object, kube.old_object, "{name}");
            assert_eq!(ours.user_info, kube.user_info, "{name}");
            assert_eq!(
                (
                    &ours.kind,
                    &ours.sub_resource,
                    &ours.namespace,
                    &ours.name,
                    ours.dry_run
                ),
                (
                    &kube.kind,
                    &kube.sub_resource,
                    &kube.namespace,
                    &kube.name,
                    kube.dry_run
                ),
                "{name}"
            );
        }
    }

    #[test]
    fn the_envelope_refuses_what_kube_s_admission_review_refuses() {
        let review: serde_json::Value =
            serde_json::from_slice(&fixture("mutating-create.json")).unwrap();
        let without = |field: &str| {
            let mut review = review.clone();
            review.as_object_mut().unwrap().remove(field);
            serde_json::to_vec(&review).unwrap()
        };
        for field in ["apiVersion", "kind"] {
            let body = without(field);
            assert!(serde_json::from_slice::<AdmissionReview<DynamicObject>>(&body).is_err());
            let refused = decode(&body).unwrap_err();
            assert!(
                refused.starts_with(
                    "the body is not an admission.k8s.io/v1 AdmissionReview: missing field `"
                ) && refused.contains(field),
                "{refused}"
            );
        }
        assert_eq!(
            decode(&without("request")).unwrap_err(),
            "the AdmissionReview has no request"
        );
        assert!(decode(b"[]").is_err());
        assert!(decode(b"{\"apiVersion\": 1, \"kind\": \"AdmissionReview\"}").is_err());
    }
}

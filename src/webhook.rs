//! The admission webhooks' HTTP side: AdmissionReview in, AdmissionReview out, over TLS, on
//! every replica. The rules live in `validation` and `defaulting`; this module decodes,
//! dispatches, always echoes the request uid, and answers bad input with a 400, never a panic.

use crate::api::{At, GROUP};
use crate::defaulting::{self, Target};
use crate::validation;
use axum::body::Bytes;
use axum::extract::DefaultBodyLimit;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use axum_server::tls_rustls::{RustlsAcceptor, RustlsConfig};
use axum_server::Handle;
use base64::Engine;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use kube::core::{DynamicObject, Resource};
use std::net::SocketAddr;
use std::time::Duration;
use tracing::debug;

/// Path of the validating webhook (kube-apiserver appends `?timeout=...`).
pub const VALIDATING_PATH: &str = "/validating";
/// Path of the mutating webhook.
pub const MUTATING_PATH: &str = "/mutating";
/// An AdmissionReview holds the object and the old object, each up to etcd's 1.5 MiB.
pub const MAX_BODY: usize = 4 << 20;
/// A client that has not finished its TLS handshake by then is dropped (no slowloris).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// A client that has not sent its request headers by then is dropped.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// The webhook routes.
pub fn router() -> Router {
    Router::new()
        .route(
            VALIDATING_PATH,
            post(|body: Bytes| async move { respond(validating(&body)) }),
        )
        .route(
            MUTATING_PATH,
            post(|body: Bytes| async move { respond(mutating(&body)) }),
        )
        .layer(DefaultBodyLimit::max(MAX_BODY))
}

/// Serves the webhooks over TLS on `addr` until `handle` shuts the server down.
pub async fn serve(
    addr: SocketAddr,
    tls: RustlsConfig,
    handle: Handle<SocketAddr>,
) -> std::io::Result<()> {
    let acceptor = RustlsAcceptor::new(tls).handshake_timeout(HANDSHAKE_TIMEOUT);
    let mut server = axum_server::bind(addr)
        .acceptor(acceptor)
        .handle(handle)
        .http1_only();
    server
        .http_builder()
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT);
    server.serve(router().into_make_service()).await
}

/// The HTTP answer: the AdmissionReview, or 400 with the reason the body is not one.
fn respond(review: Result<AdmissionResponse, String>) -> Response {
    match review {
        Ok(response) => {
            debug!(uid = %response.uid, allowed = response.allowed, reason = %response.result.message, "admission review");
            (
                [(header::CONTENT_TYPE, "application/json")],
                encode(response),
            )
                .into_response()
        }
        Err(message) => (StatusCode::BAD_REQUEST, format!("{message}\n")).into_response(),
    }
}

/// The AdmissionReview JSON for `response`. kube-core 4.2 writes `response.patch` as an array of
/// numbers (kube-rs/kube#1781); the API's `[]byte` is a base64 string, so it is re-encoded.
fn encode(response: AdmissionResponse) -> Vec<u8> {
    if response.patch.is_none() {
        return serde_json::to_vec(&response.into_review()).unwrap_or_default();
    }
    let mut review = serde_json::to_value(response.into_review()).unwrap_or_default();
    if let Some(patch) = review.pointer_mut("/response/patch") {
        let bytes: Vec<u8> = serde_json::from_value(patch.take()).unwrap_or_default();
        *patch = base64::engine::general_purpose::STANDARD
            .encode(bytes)
            .into();
    }
    serde_json::to_vec(&review).unwrap_or_default()
}

/// The request inside an `admission.k8s.io/v1` AdmissionReview.
fn decode(body: &[u8]) -> Result<AdmissionRequest<DynamicObject>, String> {
    let review: AdmissionReview<DynamicObject> = serde_json::from_slice(body)
        .map_err(|e| format!("the body is not an admission.k8s.io/v1 AdmissionReview: {e}"))?;
    review
        .try_into()
        .map_err(|_| "the AdmissionReview has no request".to_owned())
}

/// The validating webhook for an AdmissionReview body: denies an invalid At, a spec change
/// after it started, and a status phase that goes back. Bodies that hold an At decode straight
/// into one (the fast path); anything else is decoded generically to say why it is refused.
pub fn validating(body: &[u8]) -> Result<AdmissionResponse, String> {
    let typed = serde_json::from_slice::<AdmissionReview<At>>(body)
        .ok()
        .and_then(|r| r.try_into().ok());
    match typed {
        Some(request) if concerns_ats(&request) => Ok(validate(&request)),
        _ => decode(body).map(|request| refuse(&request)),
    }
}

fn validate(request: &AdmissionRequest<At>) -> AdmissionResponse {
    let response = AdmissionResponse::from(request);
    let (true, Some(at)) = (writes(request), request.object.as_ref()) else {
        return refuse_untyped(request, response);
    };
    let old = request.old_object.as_ref();
    let problems = match (is_status(request), old) {
        (true, Some(old)) => validation::status_problems(at, old),
        (true, None) => Vec::new(),
        (false, old) => validation::spec_problems(at, old),
    };
    if problems.is_empty() {
        response
    } else {
        response.deny(validation::summary(at, &problems))
    }
}

/// A review the fast path could not take: not an At, or an At that does not decode as one.
fn refuse(request: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
    let response = AdmissionResponse::from(request);
    if !concerns_ats(request) {
        let kind = &request.kind;
        return response.deny(format!(
            "cnat reviews only {GROUP}/v1alpha1 At objects, not {}/{} {}; check the webhook's rules",
            kind.group, kind.version, kind.kind
        ));
    }
    match request.object.as_ref().filter(|_| writes(request)) {
        Some(object) => match as_at(object) {
            Ok(_) => response,
            Err(why) => response.deny(why),
        },
        None => refuse_untyped(request, response),
    }
}

/// Deletes and connects are not reviewed; a create or update without an object is refused.
fn refuse_untyped<T: Resource>(
    request: &AdmissionRequest<T>,
    response: AdmissionResponse,
) -> AdmissionResponse {
    if writes(request) {
        response.deny("the AdmissionReview has no object to review")
    } else {
        response
    }
}

/// The mutating webhook for an AdmissionReview body: defaults `spec.image` and the phase, as an
/// idempotent JSON patch. It works on the raw object, to see which fields are absent.
pub fn mutating(body: &[u8]) -> Result<AdmissionResponse, String> {
    decode(body).map(|request| mutate(&request))
}

fn mutate(request: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
    let response = AdmissionResponse::from(request);
    let Some(object) = request
        .object
        .as_ref()
        .filter(|_| concerns_ats(request) && writes(request))
    else {
        return response;
    };
    let Ok(object) = serde_json::to_value(object) else {
        return response;
    };
    let target = if is_status(request) {
        Target::Status
    } else {
        Target::Object {
            create: request.operation == Operation::Create,
        }
    };
    let patch = defaulting::patch(&object, target);
    if patch.0.is_empty() {
        return response;
    }
    match response.clone().with_patch(patch) {
        Ok(patched) => patched,
        Err(error) => response.deny(format!("cnat could not encode its defaults: {error}")),
    }
}

fn concerns_ats<T: Resource>(request: &AdmissionRequest<T>) -> bool {
    request.kind.group == GROUP && request.kind.kind == "At"
}

fn writes<T: Resource>(request: &AdmissionRequest<T>) -> bool {
    matches!(request.operation, Operation::Create | Operation::Update)
}

fn is_status<T: Resource>(request: &AdmissionRequest<T>) -> bool {
    request.sub_resource.as_deref() == Some("status")
}

fn as_at(object: &DynamicObject) -> Result<At, String> {
    let value = serde_json::to_value(object).map_err(|e| e.to_string())?;
    serde_json::from_value(value).map_err(|e| format!("the object is not a valid At: {e}"))
}

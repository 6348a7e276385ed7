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
use kube::core::DynamicObject;
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
            post(|body: Bytes| async move { answer(&body, validate) }),
        )
        .route(
            MUTATING_PATH,
            post(|body: Bytes| async move { answer(&body, mutate) }),
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

/// Decodes an AdmissionReview and answers it with `review`; 400 when it is not one.
fn answer(
    body: &[u8],
    review: fn(&AdmissionRequest<DynamicObject>) -> AdmissionResponse,
) -> Response {
    match decode(body) {
        Ok(request) => {
            let response = review(&request);
            debug!(uid = %request.uid, operation = ?request.operation, name = %request.name,
                   allowed = response.allowed, reason = %response.result.message, "admission review");
            let json = encode(response);
            ([(header::CONTENT_TYPE, "application/json")], json).into_response()
        }
        Err(message) => (StatusCode::BAD_REQUEST, format!("{message}\n")).into_response(),
    }
}

/// The AdmissionReview JSON for `response`. kube-core 4.2 writes `response.patch` as an array of
/// numbers (kube-rs/kube#1781); the API's `[]byte` is a base64 string, so it is re-encoded.
fn encode(response: AdmissionResponse) -> Vec<u8> {
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
pub fn decode(body: &[u8]) -> Result<AdmissionRequest<DynamicObject>, String> {
    let review: AdmissionReview<DynamicObject> = serde_json::from_slice(body)
        .map_err(|e| format!("the body is not an admission.k8s.io/v1 AdmissionReview: {e}"))?;
    review
        .try_into()
        .map_err(|_| "the AdmissionReview has no request".to_owned())
}

/// The validating webhook: denies an invalid At, a spec change after it started, and a status
/// phase that goes back.
pub fn validate(request: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
    let response = AdmissionResponse::from(request);
    let at = match subject(request) {
        Subject::Skip => return response,
        Subject::Unreadable(why) => return response.deny(why),
        Subject::At(at) => at,
    };
    let old = request.old_object.as_ref().and_then(|o| as_at(o).ok());
    let problems = if is_status(request) {
        old.map(|old| validation::status_problems(&at, &old))
            .unwrap_or_default()
    } else {
        validation::spec_problems(&at, old.as_ref())
    };
    if problems.is_empty() {
        response
    } else {
        response.deny(validation::summary(&at, &problems))
    }
}

/// The mutating webhook: defaults `spec.image` and the phase, as an idempotent JSON patch.
pub fn mutate(request: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
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

enum Subject {
    /// Not a write of an At: nothing to check.
    Skip,
    /// An At that cannot be read as one, with the reason.
    Unreadable(String),
    At(At),
}

fn subject(request: &AdmissionRequest<DynamicObject>) -> Subject {
    if !concerns_ats(request) {
        let kind = &request.kind;
        return Subject::Unreadable(format!(
            "cnat reviews only {GROUP}/v1alpha1 At objects, not {}/{} {}; check the webhook's rules",
            kind.group, kind.version, kind.kind
        ));
    }
    match (writes(request), request.object.as_ref()) {
        (false, _) => Subject::Skip,
        (true, None) => Subject::Unreadable("the AdmissionReview has no object to review".into()),
        (true, Some(object)) => match as_at(object) {
            Ok(at) => Subject::At(at),
            Err(why) => Subject::Unreadable(why),
        },
    }
}

fn concerns_ats(request: &AdmissionRequest<DynamicObject>) -> bool {
    request.kind.group == GROUP && request.kind.kind == "At"
}

fn writes(request: &AdmissionRequest<DynamicObject>) -> bool {
    matches!(request.operation, Operation::Create | Operation::Update)
}

fn is_status(request: &AdmissionRequest<DynamicObject>) -> bool {
    request.sub_resource.as_deref() == Some("status")
}

fn as_at(object: &DynamicObject) -> Result<At, String> {
    let value = serde_json::to_value(object).map_err(|e| e.to_string())?;
    serde_json::from_value(value).map_err(|e| format!("the object is not a valid At: {e}"))
}

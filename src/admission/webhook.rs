//! The admission webhooks' HTTP side: decodes, dispatches to the rules, always echoes the
//! request uid, and answers bad input with a 400, never a panic.
//! See docs/src/design/architecture.md, "The webhooks behind the Service".

use crate::admission::access_review::AccessReviewer;
use crate::admission::conversion_webhook;
use crate::admission::defaulting::{self, Target};
use crate::admission::mutating_review;
use crate::admission::review::{Envelope, ReviewError};
use crate::admission::validating_review;
use crate::admission::validation;
use crate::api::{At, GROUP};
use crate::conversion::typed::AtV1alpha1;
use crate::observability::metrics::{AdmissionLabels, Metrics};
use crate::serving::drain::{self, Draining};
use crate::serving::guard::{self, Slot, Slots};
use crate::serving::tls;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use axum_server::tls_rustls::{RustlsAcceptor, RustlsConfig};
use axum_server::Handle;
use base64::Engine;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, Operation};
use kube::core::GroupVersionKind;
use opentelemetry::trace::Status;
use opentelemetry_http::HeaderExtractor;
use serde::Deserialize;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{debug, info_span, Instrument};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Path of the validating webhook (kube-apiserver appends `?timeout=...`).
pub const VALIDATING_PATH: &str = "/validating";
/// Path of the mutating webhook.
pub const MUTATING_PATH: &str = "/mutating";
/// Path of the conversion webhook (ConversionReviews of At objects, `crate::conversion`).
pub const CONVERT_PATH: &str = "/convert";
/// An AdmissionReview holds the object and the old object, each up to etcd's largest object.
pub const MAX_BODY: usize = 4 << 20;
/// The admission bodies being read and decoded at once on a replica, in KiB, and from one
/// client address: a client that sends large reviews waits for its own earlier ones.
pub const BODY_BUDGET_KIB: usize = 16 << 10;
pub const BODY_BUDGET_PER_CLIENT_KIB: usize = 4 << 10;
/// The last part of the body budget, kept for addresses holding at most [`BODY_LIGHT_KIB`]
/// with it: a few addresses sending large bodies slowly cannot take it all.
pub const BODY_RESERVE_KIB: usize = 4 << 10;
pub const BODY_LIGHT_KIB: usize = 512;
/// The largest body the validating webhook decodes straight into typed structs (some of kube's
/// types hold JSON values, `managedFields` and `options`, that a made-up body can blow up); a
/// larger body takes the bounded path.
pub const FAST_PATH_BODY: usize = 256 << 10;
/// How long an admission review waits for room in the body budget before it is answered 429.
pub const BODY_WAIT: Duration = Duration::from_secs(2);
/// An admission review's whole body must come within this of its head (kube-apiserver sends it
/// at once from memory): a client that sends it slowly is answered 408 and holds nothing after.
pub const BODY_DEADLINE: Duration = Duration::from_secs(3);
/// A client that has not finished its TLS handshake by then is dropped: a backstop, as the
/// first request must come within `guard::Limits::first_request_within`.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// A client that has not sent its request headers by then is dropped.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// A webhook's pure entry point: AdmissionReview body in, verdict out.
type Review = fn(&[u8]) -> Result<Verdict, ReviewError>;

/// What every request shares: the metrics, the escalation guard (`None`: turned off), and
/// whether the replica is draining (shutting down).
#[derive(Clone)]
pub struct Shared {
    pub metrics: Arc<Metrics>,
    pub reviewer: Option<Arc<AccessReviewer>>,
    pub draining: Draining,
    /// Admission reviews only from clients that presented a certificate the client CA signed
    /// (`--webhook-client-ca`); conversions from anyone (kube-apiserver's carry none).
    pub certified_only: bool,
}

/// What the routes share: `Shared`, and the budgets of this server.
#[derive(Clone)]
struct Served {
    shared: Shared,
    bodies: Arc<Slots>,
    conversions: Arc<Slots>,
}

/// The webhook routes. The caller's address (for the per-client budgets) comes from
/// `ConnectInfo<SocketAddr>`, as `serve` sets it.
pub fn router(shared: Shared) -> Router {
    let served = Served {
        shared,
        bodies: Slots::with_reserve(
            BODY_BUDGET_KIB,
            BODY_BUDGET_PER_CLIENT_KIB,
            BODY_LIGHT_KIB,
            BODY_RESERVE_KIB,
        ),
        conversions: conversion_webhook::slots(),
    };
    let route = |name: &'static str, review: Review| {
        post(
            move |State(served): State<Served>, request: axum::extract::Request| async move {
                if served.shared.certified_only && !certified(&request) {
                    return (
                        StatusCode::FORBIDDEN,
                        "cnat: the admission webhooks take reviews only from clients with a certificate the CA in --webhook-client-ca signed (chart webhook.clientCASecret)\n",
                    )
                        .into_response();
                }
                let received = tokio::time::Instant::now();
                let client = guard::client_of(&request);
                let headers = request.headers().clone();
                let timeout = call_timeout(request.uri());
                match read_body(&served.bodies, client, request).await {
                    Ok((body, _budget)) => {
                        let call = Call {
                            client,
                            timeout,
                            received,
                        };
                        admit(name, review, &served.shared, call, &headers, &body).await
                    }
                    Err(refused) => refused,
                }
            },
        )
    };
    Router::new()
        .route(VALIDATING_PATH, route("validating", validating))
        .route(MUTATING_PATH, route("mutating", mutating))
        .route(
            CONVERT_PATH,
            post(
                |State(served): State<Served>, request: axum::extract::Request| async move {
                    let client = guard::client_of(&request);
                    let metrics = served.shared.metrics.clone();
                    let connection = guard::connection_of(&request);
                    conversion_webhook::convert(
                        &served.conversions,
                        metrics,
                        client,
                        connection,
                        request.into_body(),
                    )
                    .await
                },
            ),
        )
        .with_state(served)
}

/// Whether the caller presented a client certificate (which the TLS handshake verified).
fn certified(request: &axum::extract::Request) -> bool {
    request.extensions().get::<tls::ClientCertificate>() == Some(&tls::ClientCertificate(true))
}

/// The body of an admission request, charged to the body budget as it arrives, or the answer
/// that refuses it: 413 past [`MAX_BODY`], 429 when no room comes within [`BODY_WAIT`], 408
/// when it has not come within [`BODY_DEADLINE`]. Once read, the connection is marked answering.
async fn read_body(
    budget: &Arc<Slots>,
    client: IpAddr,
    request: axum::extract::Request,
) -> Result<(Bytes, Option<Slot>), Response> {
    use futures::StreamExt;
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let too_large = || {
        (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "cnat: an AdmissionReview is at most {} MiB\n",
                MAX_BODY >> 20
            ),
        )
            .into_response()
    };
    if declared.is_some_and(|length| length > MAX_BODY) {
        return Err(too_large());
    }
    let connection = guard::connection_of(&request);
    let started = tokio::time::Instant::now();
    let deadline = started + BODY_DEADLINE;
    let mut held: Option<Slot> = None;
    let mut body = bytes::BytesMut::new();
    let mut chunks = request.into_body().into_data_stream();
    loop {
        let chunk = match tokio::time::timeout_at(deadline, chunks.next()).await {
            Err(_) => {
                return Err((
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "cnat: the AdmissionReview's body did not arrive within {:?}\n",
                        BODY_DEADLINE
                    ),
                )
                    .into_response())
            }
            Ok(None) => break,
            Ok(Some(Err(_))) => return Err(StatusCode::BAD_REQUEST.into_response()),
            Ok(Some(Ok(chunk))) => chunk,
        };
        let size = body.len() + chunk.len();
        if size > MAX_BODY {
            return Err(too_large());
        }
        let (kib, charged) = (size.div_ceil(1024), held.as_ref().map_or(0, Slot::units));
        if kib > charged {
            let wait = deadline.min(tokio::time::Instant::now() + BODY_WAIT);
            let Some(more) = budget.wait_n(client, kib - charged, wait).await else {
                return Err(guard::busy(
                    "cnat: too many admission review bytes in flight on this replica (from this client, or in all); retry\n".into(),
                ));
            };
            match &mut held {
                Some(held) => held.merge(more),
                None => held = Some(more),
            }
        }
        // Grown as it arrives, never by what the client declares.
        body.extend_from_slice(&chunk);
    }
    if let Some(connection) = connection {
        connection.set(guard::Stage::Answering);
    }
    Ok((body.freeze(), held))
}

/// kube-apiserver's default timeout for a webhook call (`timeoutSeconds`).
const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// A review refused as busy is answered 429 only while this much is left of its call's timeout
/// (the resend's second, its round trip, and the second kube-apiserver may round the timeout
/// up by), and within [`RESEND_WITHIN`] of its first refusal.
const RESEND_MARGIN: Duration = Duration::from_secs(3);
const RESEND_WITHIN: Duration = Duration::from_secs(8);

/// The timeout kube-apiserver gives this call: the `timeout` it puts in the URL (`?timeout=5s`,
/// Go's duration format), else [`DEFAULT_CALL_TIMEOUT`].
pub fn call_timeout(uri: &axum::http::Uri) -> Duration {
    let given = (uri.query().unwrap_or_default().split('&'))
        .find_map(|pair| pair.strip_prefix("timeout="))
        .and_then(|value| {
            let (minutes, seconds) = match value.split_once('m') {
                Some((minutes, seconds)) => (minutes.parse::<f64>().ok()?, seconds),
                None => (0.0, value),
            };
            let seconds = match seconds {
                "" => 0.0,
                seconds => seconds.strip_suffix('s')?.parse::<f64>().ok()?,
            };
            Duration::try_from_secs_f64(minutes * 60.0 + seconds).ok()
        });
    given.unwrap_or(DEFAULT_CALL_TIMEOUT)
}

/// Who called, the timeout kube-apiserver gave the call, and when its request arrived.
#[derive(Debug, Clone, Copy)]
struct Call {
    client: IpAddr,
    timeout: Duration,
    received: tokio::time::Instant,
}

/// Whether a review refused as busy, whose first request refused so arrived `busy` ago, is
/// answered 429 for kube-apiserver to resend it within `timeout` (else it is denied).
fn resend(busy: Option<Duration>, timeout: Duration) -> bool {
    let window = timeout.min(RESEND_WITHIN);
    busy.is_some_and(|busy| busy.saturating_add(RESEND_MARGIN) < window)
}

/// Runs `review` on `body` inside an `admission` span, asks the escalation guard when the
/// review says so, and counts it.
async fn admit(
    webhook: &'static str,
    review: Review,
    shared: &Shared,
    call: Call,
    headers: &HeaderMap,
    body: &[u8],
) -> Response {
    let client = call.client;
    let metrics = &shared.metrics;
    let started = Instant::now();
    // Attributes known only after decoding go straight to the OpenTelemetry span: recording
    // them as tracing fields would make the JSON log layer re-serialize the span each time.
    let span = info_span!("admission", webhook, "otel.kind" = "server");
    let caller = opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.extract(&HeaderExtractor(headers))
    });
    crate::observability::telemetry::continue_trace(&span, caller);
    let mut verdict = span.in_scope(|| review(body));
    if let (Ok(v), Some(reviewer)) = (verdict.as_mut(), &shared.reviewer) {
        if let Some((user, namespace)) = v.access.take().filter(|_| v.response.allowed) {
            // A cached answer (nearly always) without a future or entering the span again.
            let checked = match reviewer.cached_for(client, &user, &namespace) {
                Some(checked) => checked,
                None => {
                    reviewer
                        .check_received(client, &user, &namespace, call.received)
                        .instrument(span.clone())
                        .await
                }
            };
            if let Err(denial) = checked {
                let at = format!("{namespace}/{}", v.name);
                // Busy: 429 while kube-apiserver has time to resend, then denied: a failed call
                // would let it through under `failurePolicy: Ignore`. Not counted as an admission.
                if resend(denial.busy_for(), call.timeout) {
                    span.set_attribute("busy", true);
                    return guard::busy(format!("At {at}: {denial}\n"));
                }
                v.response = v.response.clone().deny(format!("At {at}: {denial}"));
            }
        }
    }
    let operation = match &verdict {
        Ok(verdict) => {
            describe(&span, verdict);
            verdict.operation
        }
        Err(why) => {
            span.set_status(Status::error(why.to_string()));
            "UNKNOWN"
        }
    };
    let allowed = verdict.as_ref().is_ok_and(|v| v.response.allowed);
    let took = started.elapsed();
    span.set_attribute("latency.ms", took.as_secs_f64() * 1e3);
    metrics.admitted(
        AdmissionLabels {
            webhook,
            operation,
            allowed,
        },
        took,
    );
    span.in_scope(|| respond(verdict.map(|v| v.response)))
}

fn describe(span: &tracing::Span, verdict: &Verdict) {
    span.set_attribute("operation", verdict.operation);
    span.set_attribute("kind", verdict.kind.clone());
    span.set_attribute("at.name", verdict.name.clone());
    if let Some(namespace) = &verdict.namespace {
        span.set_attribute("at.namespace", namespace.clone());
    }
    span.set_attribute("allowed", verdict.response.allowed);
    if !verdict.response.allowed {
        span.set_attribute("denial.reason", verdict.response.result.message.clone());
    }
}

/// A webhook's answer, with what it was about.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// `CREATE`, `UPDATE`, `DELETE` or `CONNECT`.
    pub operation: &'static str,
    /// `group/version/Kind` of the object under review.
    pub kind: String,
    pub namespace: Option<String>,
    pub name: String,
    pub response: AdmissionResponse,
    /// Who must be allowed to create pods in which namespace for this to pass: set when an At
    /// is created or its spec changed (dry runs included), for the escalation guard.
    pub access: Option<(k8s_openapi::api::authentication::v1::UserInfo, String)>,
}

impl Verdict {
    fn about(
        kind: &GroupVersionKind,
        operation: &Operation,
        namespace: Option<String>,
        name: String,
        response: AdmissionResponse,
    ) -> Self {
        Verdict {
            operation: match operation {
                Operation::Create => "CREATE",
                Operation::Update => "UPDATE",
                Operation::Delete => "DELETE",
                Operation::Connect => "CONNECT",
            },
            kind: format!("{}/{}/{}", kind.group, kind.version, kind.kind),
            namespace,
            name,
            response,
            access: None,
        }
    }
}

/// Serves the webhooks over TLS on `addr` until `handle` shuts the server down, within `limits`
/// (see `serving::guard`).
pub async fn serve(
    listener: std::net::TcpListener,
    config: RustlsConfig,
    handle: Handle<SocketAddr>,
    shared: Shared,
    limits: guard::Limits,
) -> std::io::Result<()> {
    let acceptor = tls::Certified(
        RustlsAcceptor::new(config)
            .handshake_timeout(HANDSHAKE_TIMEOUT)
            .acceptor(guard::Capped::new(
                // TCP_NODELAY: an answer goes out as the TLS layer writes it, not held back waiting
                // for the ACK of the one before (Nagle), which shows as tail latency.
                axum_server::accept::NoDelayAcceptor::new(),
                &limits,
            )),
    );
    let server = guard::http1_server(listener, acceptor, handle, HEADER_TIMEOUT)?;
    let draining = shared.draining.clone();
    let app = guard::guarded(router(shared), limits, "admission requests").layer(
        axum::middleware::from_fn_with_state(draining, drain::close_connections),
    );
    server
        .serve(app.into_make_service_with_connect_info::<SocketAddr>())
        .await
}

/// The HTTP answer: the AdmissionReview, or 400 with the reason the body is not one.
fn respond(review: Result<AdmissionResponse, ReviewError>) -> Response {
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
/// numbers (kube-rs/kube#1781); the API's `[]byte` is a base64 string, so the patch is written
/// beside the rest of the response instead.
fn encode(mut response: AdmissionResponse) -> Vec<u8> {
    #[derive(serde::Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Review<'a> {
        api_version: &'static str,
        kind: &'static str,
        response: Answer<'a>,
    }
    #[derive(serde::Serialize)]
    struct Answer<'a> {
        #[serde(flatten)]
        response: &'a AdmissionResponse,
        #[serde(skip_serializing_if = "Option::is_none")]
        patch: Option<String>,
    }
    let patch = response
        .patch
        .take()
        .map(|bytes| base64::engine::general_purpose::STANDARD.encode(bytes));
    let review = Review {
        api_version: "admission.k8s.io/v1",
        kind: "AdmissionReview",
        response: Answer {
            response: &response,
            patch,
        },
    };
    serde_json::to_vec(&review).unwrap_or_default()
}

/// The validating webhook for an AdmissionReview body: denies an invalid At, a spec change
/// after it started, and a status phase that goes back; says whose permission to create pods a
/// create or spec change needs (the escalation guard). A review the typed paths do not take is
/// decoded within bounds (`validating_review`) and judged by the same rules.
pub fn validating(body: &[u8]) -> Result<Verdict, ReviewError> {
    let small = body.len() <= FAST_PATH_BODY;
    if small && names_v1alpha1(body) {
        if let Some(request) = typed_v1alpha1(body) {
            return Ok(judge(&request, true));
        }
    } else if small {
        let typed = Envelope::<AdmissionRequest<At>>::from_slice(body)
            .and_then(Envelope::admission_request)
            .ok()
            .filter(|r| r.kind.version != "v1alpha1" && concerns_ats(&r.kind));
        if let Some(request) = typed {
            return Ok(judge(&request, false));
        }
    }
    let (types, request) = validating_review::decode(body)?;
    Ok(judge_lean(types, request))
}

/// A review of a `v1alpha1` At, its objects decoded typed and converted to `v1` as they are
/// read (`conversion::typed`); `None` for any other review, or an object that path refuses.
fn typed_v1alpha1(body: &[u8]) -> Option<AdmissionRequest<At>> {
    let request = Envelope::<AdmissionRequest<AtV1alpha1>>::from_slice(body)
        .and_then(Envelope::admission_request)
        .ok()
        .filter(|r| r.kind.version == "v1alpha1" && concerns_ats(&r.kind))?;
    let v1 = |object: Option<AtV1alpha1>| match object {
        None => Some(None),
        Some(object) => object.into_v1().map(Some),
    };
    Some(AdmissionRequest {
        object: v1(request.object)?,
        old_object: v1(request.old_object)?,
        types: request.types,
        uid: request.uid,
        kind: request.kind,
        resource: request.resource,
        sub_resource: request.sub_resource,
        request_kind: request.request_kind,
        request_resource: request.request_resource,
        request_sub_resource: request.request_sub_resource,
        name: request.name,
        namespace: request.namespace,
        operation: request.operation,
        user_info: request.user_info,
        dry_run: request.dry_run,
        options: request.options,
    })
}

/// Whether `body` looks like a review of a `v1alpha1` object, as kube-apiserver writes its
/// `kind` (without spaces). Only a choice of path: every path judges by the same rules.
fn names_v1alpha1(body: &[u8]) -> bool {
    static FINDER: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(br#""version":"v1alpha1""#));
    FINDER.find(body).is_some()
}

/// The verdict on a decoded At review; `older` for a `v1alpha1` one (messages then name its
/// fields).
fn judge(request: &AdmissionRequest<At>, older: bool) -> Verdict {
    let mut response = validate(request);
    if older && !response.result.message.is_empty() {
        // The rules name v1's fields; a v1alpha1 writer has them in `spec` itself.
        response.result.message = crate::conversion::in_v1alpha1_terms(&response.result.message);
    }
    let (namespace, name) = (request.namespace.clone(), request.name.clone());
    let mut verdict = Verdict::about(&request.kind, &request.operation, namespace, name, response);
    verdict.access = runs_pod_for(request);
    verdict
}

/// The verdict on a review the fast path could not take.
fn judge_lean(types: kube::core::TypeMeta, mut request: validating_review::Request) -> Verdict {
    let mut response = allowed(&request.uid);
    response.types = types.clone();
    if !concerns_ats(&request.kind) {
        let kind = &request.kind;
        return verdict_on(&request, response.deny(format!(
            "cnat reviews only {GROUP} At objects (v1, v1alpha1), not {}/{} {}; check the webhook's rules",
            kind.group, kind.version, kind.kind
        )));
    }
    if !writes(&request.operation) {
        return verdict_on(&request, response);
    }
    let Some(object) = request.object.take() else {
        return verdict_on(
            &request,
            response.deny("the AdmissionReview has no object to review"),
        );
    };
    let older = request.kind.version == "v1alpha1";
    let old = request.old_object.as_ref().map(at_of);
    if let (Operation::Update, Some(Err(_))) = (&request.operation, &old) {
        return judge_unreadable_update(&request, &object, response, older);
    }
    let at = match as_at(object) {
        Ok(at) => at,
        Err(why) => return verdict_on(&request, response.deny(why)),
    };
    let request = AdmissionRequest {
        types,
        uid: request.uid,
        kind: request.kind,
        resource: request.resource,
        sub_resource: request.sub_resource,
        request_kind: None,
        request_resource: None,
        request_sub_resource: None,
        name: request.name,
        namespace: request.namespace,
        operation: request.operation,
        user_info: request.user_info,
        object: Some(at),
        old_object: old.and_then(Result::ok),
        dry_run: request.dry_run,
        options: None,
    };
    judge(&request, older)
}

/// The verdict `response` gives on `request`, a review the fast path could not take.
fn verdict_on(request: &validating_review::Request, response: AdmissionResponse) -> Verdict {
    let (namespace, name) = (request.namespace.clone(), request.name.clone());
    Verdict::about(&request.kind, &request.operation, namespace, name, response)
}

/// An update of an At whose stored copy does not decode as one: the spec stays frozen once the
/// stored copy says it started (or says nothing readable as "not started"), a spec change is
/// checked whole and by the escalation guard, and metadata and status edits pass but for a
/// change of the shard label.
fn judge_unreadable_update(
    request: &validating_review::Request,
    object: &serde_json::Value,
    response: AdmissionResponse,
    older: bool,
) -> Verdict {
    let verdict = |response| verdict_on(request, response);
    let in_terms = |message: String| match older {
        true => crate::conversion::in_v1alpha1_terms(&message),
        false => message,
    };
    let old = request.old_object.as_ref();
    let spec_of = |object: &serde_json::Value| {
        crate::conversion::convert(0, object.clone(), crate::conversion::V1)
            .ok()
            .and_then(|v1| v1.get("spec").cloned())
    };
    let (new_spec, old_spec) = (spec_of(object), old.and_then(spec_of));
    let spec_changes = new_spec.is_none() || new_spec != old_spec;
    if is_status(request.sub_resource.as_deref()) {
        // A phase never goes back, here too: else a status write could reopen the spec.
        let rank = |at: Option<&serde_json::Value>| {
            let phase = at?.pointer("/status/phase")?.as_str()?;
            PHASE_RANKS
                .iter()
                .find(|(p, _)| *p == phase)
                .map(|(_, rank)| *rank)
        };
        let (was, now) = (rank(old), rank(Some(object)));
        if was.is_some_and(|was| now.is_none_or(|now| now < was)) {
            return verdict(response.deny(in_terms(format!(
                "status.phase: cannot go back or be removed (it was {}): an At runs at most once; create a new At to run the command again",
                old.and_then(|o| o.pointer("/status/phase")).map_or_else(String::new, |p| p.to_string())
            ))));
        }
        return verdict(response);
    }
    let labels = |object: Option<&serde_json::Value>| {
        let labels = object?.pointer("/metadata/labels")?;
        serde_json::from_value::<std::collections::BTreeMap<String, String>>(labels.clone()).ok()
    };
    let seed = || {
        let namespace = request.namespace.as_deref().unwrap_or_default();
        format!("{namespace}/{}", request.name)
    };
    let (new_labels, old_labels) = (labels(Some(object)), labels(old));
    if let Some(problem) =
        crate::shard::change_problem(seed, old_labels.as_ref(), new_labels.as_ref())
    {
        return verdict(response.deny(problem));
    }
    if !spec_changes {
        return verdict(response);
    }
    // Not started: no status, or a status whose phase is absent or Pending; anything else
    // (another phase, or a status or phase cnat cannot read) may have run.
    let status = old
        .and_then(|old| old.get("status"))
        .filter(|s| !s.is_null());
    let phase = status
        .and_then(|status| status.get("phase"))
        .filter(|p| !p.is_null());
    let not_started = match (status, phase) {
        (None, _) => true,
        (Some(status), None) => status.is_object(),
        (Some(_), Some(phase)) => matches!(phase.as_str(), Some("Pending" | "PENDING")),
    };
    if !not_started {
        let phase = phase.map_or_else(|| "unreadable".to_owned(), |p| p.to_string());
        return verdict(response.deny(in_terms(format!(
            "spec: cannot change: the stored At does not decode as an At and its status.phase is {phase}, so its command may have run, and changing the spec cannot undo that; create a new At instead"
        ))));
    }
    let at = match as_at(object.clone()) {
        Ok(at) => at,
        Err(why) => return verdict(response.deny(why)),
    };
    let problems = validation::spec_problems(&at, None);
    let response = match problems.is_empty() {
        true => response,
        false => response.deny(in_terms(validation::summary(&at, &problems))),
    };
    let namespace = request
        .namespace
        .clone()
        .or_else(|| at.metadata.namespace.clone());
    let Some(namespace) = namespace else {
        return verdict(response.deny("the AdmissionReview names no namespace for the At"));
    };
    let mut verdict = verdict(response);
    verdict.access = Some((request.user_info.clone(), namespace));
    verdict
}

/// The phases in the order an At goes through them, in both versions' spelling.
const PHASE_RANKS: [(&str, u8); 6] = [
    ("Pending", 0),
    ("PENDING", 0),
    ("Running", 1),
    ("RUNNING", 1),
    ("Done", 2),
    ("DONE", 2),
];

/// Whose permission to create pods, where, an At write needs: a create, or an update that
/// changes the spec (the pod it will run); not a status write, a delete or a label edit.
fn runs_pod_for(
    request: &AdmissionRequest<At>,
) -> Option<(k8s_openapi::api::authentication::v1::UserInfo, String)> {
    if is_status(request.sub_resource.as_deref()) {
        return None;
    }
    let at = request.object.as_ref()?;
    let spec_changes = match (&request.operation, request.old_object.as_ref()) {
        (Operation::Create, _) => true,
        (Operation::Update, Some(old)) => old.spec != at.spec,
        _ => false,
    };
    let namespace = request
        .namespace
        .clone()
        .or_else(|| at.metadata.namespace.clone())?;
    spec_changes.then(|| (request.user_info.clone(), namespace))
}

fn validate(request: &AdmissionRequest<At>) -> AdmissionResponse {
    let response = AdmissionResponse::from(request);
    let (true, Some(at)) = (writes(&request.operation), request.object.as_ref()) else {
        // Deletes and connects are not reviewed; a create or update without an object is refused.
        return match writes(&request.operation) {
            true => response.deny("the AdmissionReview has no object to review"),
            false => response,
        };
    };
    let old = request.old_object.as_ref();
    let problems = match (is_status(request.sub_resource.as_deref()), old) {
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

/// The mutating webhook for an AdmissionReview body: drops a blank `spec.template.image`,
/// defaults the phase and labels the At with its list shard, as an idempotent JSON patch, on
/// the raw object, to see which fields are absent.
pub fn mutating(body: &[u8]) -> Result<Verdict, ReviewError> {
    let mut request = mutating_review::decode(body)?;
    let response = mutate(&mut request);
    let (namespace, name) = (request.namespace, request.name);
    let verdict = Verdict::about(&request.kind, &request.operation, namespace, name, response);
    Ok(verdict)
}

fn mutate(request: &mut mutating_review::Request) -> AdmissionResponse {
    let response = allowed(&request.uid);
    let reviewed = concerns_ats(&request.kind) && writes(&request.operation);
    let Some(object) = request.object.as_mut().filter(|_| reviewed) else {
        return response;
    };
    let target = if is_status(request.sub_resource.as_deref()) {
        Target::Status
    } else {
        Target::Object {
            create: request.operation == Operation::Create,
        }
    };
    // The object's spec and status, at the same paths as in the object: all the defaults live
    // there.
    let mut patch = defaulting::patch(&object.take_data(), target, &request.kind.version);
    if target != Target::Status {
        // `namespace/name`, or the request's uid for a create with `generateName` (no name yet).
        let seed = match object.metadata.name.as_deref().filter(|n| !n.is_empty()) {
            Some(name) => format!(
                "{}/{name}",
                request.namespace.as_deref().unwrap_or_default()
            ),
            None => request.uid.clone(),
        };
        let labels = object.metadata.labels.as_ref();
        let old = request.old_object.as_ref();
        let old = old.and_then(|old| old.metadata.labels.as_ref());
        patch
            .0
            .extend(defaulting::shard_label(labels, old, &seed).0);
    }
    if patch.0.is_empty() {
        return response;
    }
    match response.clone().with_patch(patch) {
        Ok(patched) => patched,
        Err(error) => response.deny(format!("cnat could not encode its defaults: {error}")),
    }
}

/// An allowing answer to the request `uid` (kube's `AdmissionResponse::from` needs the whole
/// request, and the type cannot be built field by field outside kube).
fn allowed(uid: &str) -> AdmissionResponse {
    let mut response = AdmissionResponse::invalid("");
    response.uid = uid.to_owned();
    response.allowed = true;
    response.result = Default::default();
    response
}

fn concerns_ats(kind: &GroupVersionKind) -> bool {
    kind.group == GROUP && kind.kind == "At"
}

fn writes(operation: &Operation) -> bool {
    matches!(operation, Operation::Create | Operation::Update)
}

fn is_status(sub_resource: Option<&str>) -> bool {
    sub_resource == Some("status")
}

/// `object` as a v1 At (converted first when it is a v1alpha1 one).
fn as_at(object: serde_json::Value) -> Result<At, String> {
    let value = crate::conversion::convert(0, object, crate::conversion::V1)
        .map_err(|e| format!("the object is not a valid At: {e}"))?;
    serde_json::from_value(value).map_err(|e| format!("the object is not a valid At: {e}"))
}

/// As [`as_at`], for an object kept as it is (read in place when it is a v1 one).
fn at_of(object: &serde_json::Value) -> Result<At, String> {
    match object.get("apiVersion").and_then(serde_json::Value::as_str) {
        Some(crate::conversion::V1) => {
            At::deserialize(object).map_err(|e| format!("the object is not a valid At: {e}"))
        }
        _ => as_at(object.clone()),
    }
}

#[cfg(test)]
mod tests;

//! The admission webhooks over real TLS: an in-process server with a generated CA, a real HTTPS
//! client trusting only that CA, and the AdmissionReview requests kube-apiserver v1.24 sent
//! (tests/fixtures/admission-review-k8s-1.24).

use crate::support;

use axum_server::tls_rustls::RustlsConfig;
use base64::Engine;
use cnat::admission::access_review::{self, AccessReviewer};
use cnat::admission::webhook;
use cnat::observability::metrics::Metrics;
use cnat::serving::drain::Draining;
use cnat::serving::guard::Limits;
use cnat::serving::tls::{self, CertFiles};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use support::https::{client, post, Https};

struct Server {
    addr: SocketAddr,
    handle: axum_server::Handle<SocketAddr>,
    dir: PathBuf,
    files: CertFiles,
    config: RustlsConfig,
    draining: Draining,
}

async fn server(name: &str) -> Server {
    server_with(name, None).await
}

/// The webhook server with the escalation guard asking `reviewer`.
async fn server_with(name: &str, reviewer: Option<Arc<AccessReviewer>>) -> Server {
    server_limited(name, reviewer, Limits::default()).await
}

/// The webhook server within `limits`.
async fn server_limited(
    name: &str,
    reviewer: Option<Arc<AccessReviewer>>,
    limits: Limits,
) -> Server {
    let dir = std::env::temp_dir().join(format!("cnat-webhook-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let files = tls::generate("cnat-webhook", "cnat-system", 1)
        .unwrap()
        .write(&dir)
        .unwrap();
    let config = RustlsConfig::from_config(tls::server_config(&files).unwrap());
    let handle = axum_server::Handle::new();
    let draining = Draining::default();
    tokio::spawn(webhook::serve(
        cnat::serving::listen::bind("127.0.0.1:0".parse().unwrap()).unwrap(),
        config.clone(),
        handle.clone(),
        webhook::Shared {
            metrics: Arc::new(Metrics::new(Default::default())),
            reviewer,
            draining: draining.clone(),
            certified_only: false,
        },
        limits,
    ));
    let addr = handle.listening().await.expect("listening");
    Server {
        addr,
        handle,
        dir,
        files,
        config,
        draining,
    }
}

fn trusting(server: &Server) -> Https {
    client(&server.dir.join("ca.crt"), rustls::DEFAULT_VERSIONS)
}

/// Starts the certificate reloader, checking every 50 ms; cancel the token to stop it.
fn reloading(server: &Server) -> tokio_util::sync::CancellationToken {
    let stop = tokio_util::sync::CancellationToken::new();
    let interval = Duration::from_millis(50);
    tokio::spawn(tls::reload_on_change(
        server.files.clone(),
        server.config.clone(),
        interval,
        stop.clone(),
    ));
    stop
}

/// A captured request: its path (with `?timeout=10s`) and its AdmissionReview.
fn fixture(name: &str) -> (String, Value) {
    let path = format!(
        "{}/tests/fixtures/admission-review-k8s-1.24/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let capture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    (
        capture["path"].as_str().unwrap().to_owned(),
        capture["review"].clone(),
    )
}

/// Posts `review` and returns the AdmissionReview response, checking the envelope and the uid.
async fn review(client: &Https, addr: SocketAddr, path: &str, review: &Value) -> Value {
    let (status, body) = post(client, addr, path, serde_json::to_vec(review).unwrap())
        .await
        .unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let answer: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(answer["kind"], "AdmissionReview");
    assert_eq!(
        answer["response"]["uid"], review["request"]["uid"],
        "the uid must be echoed"
    );
    answer["response"].clone()
}

/// The object after applying the response's JSON patch.
fn patched(request: &Value, response: &Value) -> Value {
    let mut object = request["request"]["object"].clone();
    if let Some(encoded) = response["patch"].as_str() {
        assert_eq!(response["patchType"], "JSONPatch");
        // The API's []byte: a base64 string, not an array of numbers.
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        json_patch::patch(&mut object, &patch).unwrap();
    }
    object
}

#[tokio::test]
async fn every_captured_request_is_answered_with_its_uid() {
    let server = server("fixtures").await;
    let client = trusting(&server);
    // (fixture, allowed, what the object looks like after mutation)
    for (name, allowed) in [
        ("mutating-create.json", true),
        ("validating-create.json", true),
        ("mutating-create-dryrun.json", true),
        ("validating-create-dryrun.json", false),
        ("mutating-update.json", true),
        ("validating-update.json", true),
        ("mutating-update-status.json", true),
        ("validating-update-status.json", true),
        ("mutating-delete.json", true),
        ("validating-delete.json", true),
    ] {
        let (path, request) = fixture(name);
        let response = review(&client, server.addr, &path, &request).await;
        assert_eq!(response["allowed"], allowed, "{name}: {response}");
    }
}

#[tokio::test]
async fn the_mutating_webhook_defaults_the_phase_idempotently_and_leaves_the_image_to_the_operator()
{
    let server = server("mutate").await;
    let client = trusting(&server);
    let (path, mut request) = fixture("mutating-create.json");
    request["request"]["object"]
        .as_object_mut()
        .unwrap()
        .remove("status");
    let response = review(&client, server.addr, &path, &request).await;
    let object = patched(&request, &response);
    assert_eq!(
        object["spec"],
        json!({"command": "echo YAY", "schedule": "2019-04-12T10:12:00Z"}),
        "no image: the operator's default runs the command"
    );
    assert_eq!(object["status"], json!({"phase": "PENDING"}));

    // Reinvocation on the mutated object patches nothing.
    request["request"]["object"] = object;
    let again = review(&client, server.addr, &path, &request).await;
    assert_eq!(again["allowed"], true);
    assert!(again.get("patch").is_none(), "{again}");

    // A status write without a phase gets PENDING; the spec is left alone.
    let (path, mut status) = fixture("mutating-update-status.json");
    status["request"]["object"]["status"] = json!({"message": "hi"});
    let response = review(&client, server.addr, &path, &status).await;
    let object = patched(&status, &response);
    assert_eq!(
        object["status"],
        json!({"message": "hi", "phase": "PENDING"})
    );
    assert_eq!(object["spec"], status["request"]["object"]["spec"]);
}

#[tokio::test]
async fn bad_schedules_are_denied_with_the_fix() {
    let server = server("schedules").await;
    let client = trusting(&server);
    let (path, base) = fixture("validating-create.json");
    let huge = "9".repeat(100_000);
    for (schedule, allowed) in [
        ("2019-04-12T10:12:00Z", true),
        ("2019-04-12T12:12:00+02:00", true),
        ("2019-04-12T10:12:00.123456Z", true),
        ("2016-12-31T23:59:60Z", true),
        ("2024-02-29T00:00:00Z", true),
        ("2023-02-29T00:00:00Z", false),
        ("2019-04-12T10:12:00", false),
        ("tomorrow noon", false),
        ("", false),
        ("   ", false),
        (huge.as_str(), false),
    ] {
        let mut request = base.clone();
        request["request"]["object"]["spec"]["schedule"] = schedule.into();
        let response = review(&client, server.addr, &path, &request).await;
        assert_eq!(response["allowed"], allowed, "{:.40}: {response}", schedule);
        if !allowed {
            let message = response["status"]["message"].as_str().unwrap();
            assert!(
                message.starts_with("At capture/example-at is invalid: spec.schedule"),
                "{message:.200}"
            );
            assert!(
                message.contains("2019-04-12T10:12:00Z") && message.len() < 400,
                "{message:.200}"
            );
        }
    }
    let (path, request) = fixture("validating-create-dryrun.json");
    let response = review(&client, server.addr, &path, &request).await;
    assert_eq!(
        response["status"]["message"],
        r#"At capture/dry is invalid: spec.schedule: "tomorrow" is not an RFC 3339 time (expected e.g. 2019-04-12T10:12:00Z)"#
    );
}

#[tokio::test]
async fn several_problems_are_reported_together() {
    let server = server("problems").await;
    let client = trusting(&server);
    let (path, mut request) = fixture("validating-create.json");
    let object = &mut request["request"]["object"];
    object["spec"] = json!({"schedule": "noon", "command": " ", "image": "Not/An Image"});
    let response = review(&client, server.addr, &path, &request).await;
    let message = response["status"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("At capture/example-at has 3 problems:\n- spec.schedule"),
        "{message}"
    );
    assert!(
        message.contains("\n- spec.command") && message.contains("\n- spec.image"),
        "{message}"
    );
}

#[tokio::test]
async fn a_started_at_cannot_change_and_its_phase_cannot_go_back() {
    let server = server("immutable").await;
    let client = trusting(&server);
    let (path, mut request) = fixture("validating-update.json");
    request["request"]["oldObject"]["status"] = json!({"phase": "RUNNING"});
    let response = review(&client, server.addr, &path, &request).await;
    assert_eq!(response["allowed"], false);
    let message = response["status"]["message"].as_str().unwrap();
    assert!(
        // The captured review is a v1alpha1 one: its writer reads v1alpha1's phase names.
        message.contains("spec: cannot change once the At is RUNNING"),
        "{message}"
    );

    let (path, mut request) = fixture("validating-update-status.json");
    request["request"]["oldObject"]["status"] = json!({"phase": "DONE"});
    let response = review(&client, server.addr, &path, &request).await;
    assert_eq!(response["allowed"], false);
    assert!(response["status"]["message"]
        .as_str()
        .unwrap()
        .contains("cannot go back from DONE to RUNNING"));
}

#[tokio::test]
async fn bad_bodies_get_clear_answers_and_the_server_keeps_serving() {
    let server = server("bad").await;
    let client = trusting(&server);
    let (path, request) = fixture("validating-create.json");
    for (body, expected) in [
        (
            b"{not json".to_vec(),
            "not an admission.k8s.io/v1 AdmissionReview",
        ),
        (
            b"{\"kind\": \"Pod\"}".to_vec(),
            "not an admission.k8s.io/v1 AdmissionReview",
        ),
        (
            serde_json::to_vec(
                &json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}),
            )
            .unwrap(),
            "has no request",
        ),
    ] {
        let (status, answer) = post(&client, server.addr, &path, body).await.unwrap();
        assert_eq!(status, 400);
        assert!(
            String::from_utf8_lossy(&answer).contains(expected),
            "{}",
            String::from_utf8_lossy(&answer)
        );
    }
    let (status, _) = post(
        &client,
        server.addr,
        &path,
        vec![b' '; webhook::MAX_BODY + 1],
    )
    .await
    .unwrap();
    assert_eq!(status, 413);

    // Not an At: denied with a message that points at the webhook's rules; uid still echoed.
    let mut pod = request.clone();
    pod["request"]["kind"] = json!({"group": "", "version": "v1", "kind": "Pod"});
    let response = review(&client, server.addr, &path, &pod).await;
    assert_eq!(response["allowed"], false);
    assert!(response["status"]["message"]
        .as_str()
        .unwrap()
        .contains("check the webhook's rules"));

    // An At that does not even decode as one.
    let mut broken = request.clone();
    broken["request"]["object"]["spec"] = json!({"schedule": 42});
    let response = review(&client, server.addr, &path, &broken).await;
    assert!(response["status"]["message"]
        .as_str()
        .unwrap()
        .starts_with("the object is not a valid At"));

    assert_eq!(
        review(&client, server.addr, &path, &request).await["allowed"],
        true
    );
}

/// From SIGTERM on, each answer closes its connection, so kube-apiserver retires its keep-alive
/// connections to a replica before the replica stops (a POST on a connection closed under it
/// is not resent).
#[tokio::test]
async fn a_draining_replica_closes_each_connection_after_its_answer() {
    use http_body_util::{BodyExt, Full};
    let server = server("draining").await;
    let client = trusting(&server);
    let connection_header = || async {
        let request = http::Request::post(format!(
            "https://localhost:{}/validating",
            server.addr.port()
        ))
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from_static(b"{}")))
        .unwrap();
        let response = client.request(request).await.unwrap();
        let header = response.headers().get("connection").cloned();
        let _ = response.into_body().collect().await.unwrap();
        header
    };
    assert_eq!(connection_header().await, None, "kept alive while serving");
    server.draining.start();
    assert_eq!(
        connection_header()
            .await
            .as_ref()
            .and_then(|h| h.to_str().ok()),
        Some("close")
    );
}

#[tokio::test]
async fn tls_1_2_and_1_3_are_served_over_http_1_1() {
    let server = server("versions").await;
    let (path, request) = fixture("validating-create.json");
    for version in [&rustls::version::TLS12, &rustls::version::TLS13] {
        let client = client(&server.dir.join("ca.crt"), &[version]);
        assert_eq!(
            review(&client, server.addr, &path, &request).await["allowed"],
            true,
            "{version:?}"
        );
    }
}

#[tokio::test]
async fn a_rotated_certificate_is_served_without_a_restart_or_dropped_connections() {
    let server = server("rotate").await;
    let stop = reloading(&server);
    let (path, request) = fixture("validating-create.json");
    let old_ca = server.dir.join("ca.crt");
    let kept = client(&old_ca, rustls::DEFAULT_VERSIONS);
    assert_eq!(
        review(&kept, server.addr, &path, &request).await["allowed"],
        true
    );
    assert_eq!(server.handle.connection_count(), 1);

    // Rotate like a Secret volume does: new files swapped in under the same names.
    let new_dir = server.dir.join("rotated");
    tls::generate("cnat-webhook", "cnat-system", 1)
        .unwrap()
        .write(&new_dir)
        .unwrap();
    for file in ["tls.crt", "tls.key"] {
        let staged = server.dir.join(format!(".{file}.new"));
        std::fs::copy(new_dir.join(file), &staged).unwrap();
        std::fs::rename(&staged, server.dir.join(file)).unwrap();
    }
    let fresh = client(&new_dir.join("ca.crt"), rustls::DEFAULT_VERSIONS);
    let mut served = false;
    for _ in 0..100 {
        if post(
            &fresh,
            server.addr,
            &path,
            serde_json::to_vec(&request).unwrap(),
        )
        .await
        .is_ok()
        {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(served, "the new certificate was never served");
    // The connection opened before the rotation still works...
    assert_eq!(
        review(&kept, server.addr, &path, &request).await["allowed"],
        true
    );
    // ...but new connections present the new certificate only.
    let stranger = client(&old_ca, rustls::DEFAULT_VERSIONS);
    let err = post(
        &stranger,
        server.addr,
        &path,
        serde_json::to_vec(&request).unwrap(),
    )
    .await
    .unwrap_err();
    assert!(err.contains("InvalidCertificate"), "{err}");
    stop.cancel();
}

/// A TLS connection to `server` from `from`, trusting its CA (no client certificate).
async fn tls_from(
    server: &Server,
    from: &str,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let config = support::https::trusting_config(&server.dir.join("ca.crt"));
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    let tcp = socket.connect(server.addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .unwrap()
}

/// POSTs `body` to `path` on a kept connection and reads the answer: its status, or the error.
async fn exchange(
    tls: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    path: &str,
    body: &[u8],
) -> std::io::Result<u16> {
    use tokio::io::AsyncWriteExt;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: cnat\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    tls.write_all(head.as_bytes()).await?;
    tls.write_all(body).await?;
    crate::support::https::read_answer(tls).await
}

#[tokio::test]
async fn a_tls_client_that_sends_no_request_is_closed_at_the_first_request_deadline() {
    use tokio::io::AsyncReadExt;
    let server = server("no-request").await;
    let within = Limits::default().first_request_within;
    let started = std::time::Instant::now();
    let mut silent = tls_from(&server, "127.0.0.1").await;
    // One that makes a request at once, and then idles past that deadline.
    let mut kept = tls_from(&server, "127.0.0.1").await;
    let (path, request) = fixture("validating-create.json");
    let body = serde_json::to_vec(&request).unwrap();
    assert_eq!(exchange(&mut kept, &path, &body).await.unwrap(), 200);
    let mut buf = [0u8; 16];
    let closed = tokio::time::timeout(within + Duration::from_secs(2), silent.read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "still open: {closed:?}"
    );
    assert!(started.elapsed() >= within - Duration::from_millis(100));
    // The kept one may idle up to the header timeout: its next review goes through.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(started.elapsed() > within);
    assert_eq!(exchange(&mut kept, &path, &body).await.unwrap(), 200);
    server.handle.shutdown();
}

#[tokio::test]
async fn when_every_place_is_taken_a_client_holding_fewer_gets_one_of_the_heaviest_s() {
    // (Pending connections are not closed for their deadline within this test.)
    let limits = Limits {
        max_connections: 4,
        first_request_within: Duration::from_secs(60),
        ..Limits::default()
    };
    let server = server_limited("fair", None, limits).await;
    let (path, request) = fixture("validating-create.json");
    let body = serde_json::to_vec(&request).unwrap();
    // Another address takes every place with connections kept idle after one request each.
    let mut idle = Vec::new();
    for _ in 0..4 {
        let mut tls = tls_from(&server, "127.0.0.2").await;
        assert_eq!(exchange(&mut tls, &path, &body).await.unwrap(), 200);
        idle.push(tls);
    }
    // A fifth from it is closed at once: it holds no fewer than anyone.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut fifth = socket.connect(server.addr).await.unwrap();
    let mut buf = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(2), {
        use tokio::io::AsyncReadExt;
        fifth.read(&mut buf)
    })
    .await;
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{read:?}");
    // The API server's address gets a place (4 > 0 + 1), and a second one (3 > 1 + 1), each in
    // place of one of the other's idle connections; a third would not be fairer (2, 2).
    let mut apiserver = Vec::new();
    for _ in 0..2 {
        let mut tls = tls_from(&server, "127.0.0.1").await;
        assert_eq!(exchange(&mut tls, &path, &body).await.unwrap(), 200);
        apiserver.push(tls);
    }
    let mut closed = 0;
    for tls in &mut idle {
        closed += usize::from(exchange(tls, &path, &body).await.is_err());
    }
    assert_eq!(closed, 2, "two idle connections made room");
    // The API server's kept connections go on.
    for tls in &mut apiserver {
        assert_eq!(exchange(tls, &path, &body).await.unwrap(), 200);
    }
    server.handle.shutdown();
}

#[tokio::test]
async fn a_connection_whose_client_does_not_read_its_answer_makes_room_after_the_answer_limit() {
    use tokio::io::AsyncWriteExt;
    let limits = Limits {
        max_connections: 2,
        answer_within: Duration::from_secs(1),
        ..Limits::default()
    };
    let server = server_limited("unread", None, limits).await;
    // Two connections from another address each ask for a conversion whose answer (about 24
    // MB) is far more than the sockets hold, and never read it.
    let object = json!({
        "apiVersion": "cnat.programming-kubernetes.info/v1alpha1", "kind": "At",
        "metadata": {"name": "backup", "namespace": "team-a"},
        "spec": {"schedule": "2026-11-24T10:00:00Z", "command": "x".repeat(2000)}
    });
    let review = serde_json::to_vec(&json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
        "request": {"uid": "u", "desiredAPIVersion": "cnat.programming-kubernetes.info/v1",
            "objects": vec![object; 12_000]}
    }))
    .unwrap();
    let review = Arc::new(review);
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let mut tls = tls_from(&server, "127.0.0.2").await;
        let review = review.clone();
        // (The server stops reading the body once its answer cannot be written.)
        stalled.push(tokio::spawn(async move {
            let head = format!(
                "POST /convert?timeout=30s HTTP/1.1\r\nHost: cnat\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                review.len()
            );
            let _ = tls.write_all(head.as_bytes()).await;
            let _ = tls.write_all(&review).await;
            tokio::time::sleep(Duration::from_secs(60)).await;
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // While they are answered (within the limit), nobody takes their places.
    let (path, request) = fixture("validating-create.json");
    let body = serde_json::to_vec(&request).unwrap();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let mut early = socket.connect(server.addr).await.unwrap();
    let mut buf = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(2), {
        use tokio::io::AsyncReadExt;
        early.read(&mut buf)
    })
    .await;
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{read:?}");
    // Past the limit, one of them makes room.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut tls = tls_from(&server, "127.0.0.1").await;
    assert_eq!(exchange(&mut tls, &path, &body).await.unwrap(), 200);
    stalled.iter().for_each(|task| task.abort());
    server.handle.shutdown();
}

#[tokio::test]
async fn a_client_that_never_finishes_its_handshake_is_dropped() {
    use tokio::io::AsyncReadExt;
    let server = server("slowloris").await;
    let mut idle = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let mut buf = [0u8; 16];
    let closed = tokio::time::timeout(
        webhook::HANDSHAKE_TIMEOUT + Duration::from_secs(2),
        idle.read(&mut buf),
    )
    .await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "still open: {closed:?}"
    );
    // And the server still serves others.
    let (path, request) = fixture("validating-create.json");
    assert_eq!(
        review(&trusting(&server), server.addr, &path, &request).await["allowed"],
        true
    );
}

#[tokio::test]
async fn a_broken_new_certificate_is_refused_and_the_old_one_kept() {
    let server = server("broken").await;
    let stop = reloading(&server);
    std::fs::write(&server.files.cert, "-----BEGIN CERTIFICATE-----\ngarbage\n").unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await; // several reload attempts
                                                          // A new connection, trusting only the original CA, still gets the original certificate.
    let (path, request) = fixture("validating-create.json");
    let fresh = trusting(&server);
    assert_eq!(
        review(&fresh, server.addr, &path, &request).await["allowed"],
        true
    );
    stop.cancel();
}

mod escalation_guard {
    //! The validating webhook asks the API server (the fake, answering with the captured
    //! SubjectAccessReviews) whether the requester may create pods where the At would run one.

    use super::*;
    use support::apiserver::ApiServer;

    async fn guarded(name: &str) -> (Server, ApiServer) {
        let api = ApiServer::new();
        let metrics = Arc::new(Metrics::new(Default::default()));
        // Without background refreshes, so the counts of reviews below are exact.
        let settings = access_review::Settings {
            keep_warm: std::time::Duration::ZERO,
            ..access_review::Settings::default()
        };
        let reviewer = AccessReviewer::new(api.client(), settings, metrics);
        (server_with(name, Some(Arc::new(reviewer))).await, api)
    }

    /// The captured request, as `user`.
    fn as_user(name: &str, user: &str) -> (String, Value) {
        let (path, mut request) = fixture(name);
        request["request"]["userInfo"]["username"] = user.into();
        (path, request)
    }

    #[tokio::test]
    async fn a_review_the_guard_is_too_busy_to_check_is_answered_429_for_the_api_server_to_resend()
    {
        use http_body_util::BodyExt;
        let (server, api) = guarded("busy").await;
        let client = trusting(&server);
        // One address asking about new identities past its share (20 a second).
        let mut busy = None;
        for n in 0..100 {
            let (path, request) = as_user("validating-create.json", &format!("made-up-{n}"));
            let body = bytes::Bytes::from(serde_json::to_vec(&request).unwrap());
            let post =
                http::Request::post(format!("https://localhost:{}{path}", server.addr.port()))
                    .header("content-type", "application/json")
                    .body(http_body_util::Full::new(body))
                    .unwrap();
            let response = client.request(post).await.unwrap();
            if response.status() == 429 {
                busy = Some(response);
                break;
            }
            assert_eq!(response.status(), 200);
        }
        let response = busy.expect("no review was refused as busy");
        // kube-apiserver resends it after a second, within the webhook's timeout.
        assert_eq!(response.headers()["retry-after"], "1");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&body);
        assert!(text.contains("too many identities at once"), "{text}");
        // With no time left to resend within the call's timeout: denied, never left to fail the
        // call (which `failurePolicy: Ignore` would let through).
        let (path, request) = as_user("validating-create.json", "made-up-late");
        let path = format!("{}?timeout=2s", path.split('?').next().unwrap());
        let response = review(&client, server.addr, &path, &request).await;
        assert_eq!(response["allowed"], false, "{response}");
        let message = response["status"]["message"].as_str().unwrap();
        assert!(message.contains("too many identities at once"), "{message}");
        assert!(api.count("POST subjectaccessreviews") <= 21);
    }

    #[tokio::test]
    async fn a_user_who_may_not_create_pods_may_not_create_an_at() {
        let (server, api) = guarded("guard").await;
        let client = trusting(&server);
        let (path, request) = as_user("validating-create.json", "alice");
        let namespace = request["request"]["namespace"].as_str().unwrap().to_owned();
        api.deny_pods("alice", &namespace);

        let response = review(&client, server.addr, &path, &request).await;
        assert_eq!(response["allowed"], false, "{response}");
        let message = response["status"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!(
                "alice may not create pods in namespace {namespace}"
            )),
            "{message}"
        );
        // Someone who may: allowed. The question carried the requester's identity.
        let (path, bob) = as_user("validating-create.json", "bob");
        let response = review(&client, server.addr, &path, &bob).await;
        assert_eq!(response["allowed"], true, "{response}");
        assert_eq!(api.count("POST subjectaccessreviews"), 2);

        // A burst from alice: answered from the cache.
        for _ in 0..5 {
            let response = review(&client, server.addr, &path, &request).await;
            assert_eq!(response["allowed"], false);
        }
        assert_eq!(api.count("POST subjectaccessreviews"), 2);
    }

    #[tokio::test]
    async fn a_dry_run_gets_the_same_answer() {
        let (server, api) = guarded("guard-dryrun").await;
        let client = trusting(&server);
        // The captured dry run is of an invalid At; make it valid, so only the guard decides.
        let (path, mut request) = as_user("validating-create-dryrun.json", "alice");
        let (_, valid) = fixture("validating-create.json");
        request["request"]["object"]["spec"] = valid["request"]["object"]["spec"].clone();
        assert_eq!(request["request"]["dryRun"], true);
        let namespace = request["request"]["namespace"].as_str().unwrap().to_owned();
        api.deny_pods("alice", &namespace);
        let response = review(&client, server.addr, &path, &request).await;
        assert_eq!(response["allowed"], false, "{response}");
        assert_eq!(api.count("POST subjectaccessreviews"), 1);
    }

    #[tokio::test]
    async fn status_writes_deletes_and_metadata_edits_are_not_asked_about() {
        let (server, api) = guarded("guard-skip").await;
        let client = trusting(&server);
        for name in ["validating-update-status.json", "validating-delete.json"] {
            let (path, request) = as_user(name, "alice");
            let namespace = request["request"]["namespace"].as_str().unwrap().to_owned();
            api.deny_pods("alice", &namespace);
            let response = review(&client, server.addr, &path, &request).await;
            assert_eq!(response["allowed"], true, "{name}: {response}");
        }
        // An update that only adds a label (the spec is unchanged).
        let (path, mut request) = as_user("validating-update.json", "alice");
        request["request"]["object"]["spec"] = request["request"]["oldObject"]["spec"].clone();
        request["request"]["object"]["metadata"]["labels"] = json!({"team": "a"});
        let response = review(&client, server.addr, &path, &request).await;
        assert_eq!(response["allowed"], true, "{response}");
        assert_eq!(api.count("POST subjectaccessreviews"), 0);
        // An update that changes the spec (the captured one changes the command) is asked about.
        let (path, request) = as_user("validating-update.json", "alice");
        assert_ne!(
            request["request"]["object"]["spec"],
            request["request"]["oldObject"]["spec"]
        );
        let response = review(&client, server.addr, &path, &request).await;
        assert_eq!(response["allowed"], false, "{response}");
        assert_eq!(api.count("POST subjectaccessreviews"), 1);
    }
}

#[tokio::test]
async fn a_trickled_body_is_cut_off_at_the_deadline_and_holds_a_request_slot_until_then() {
    let limits = Limits {
        max_in_flight: 1,
        request_timeout: Duration::from_millis(500),
        ..Limits::default()
    };
    let server = server_limited("trickle", None, limits).await;
    let (path, body) = fixture("validating-create.json");
    let length = serde_json::to_vec(&body).unwrap().len();
    let (pieces, trickle) = tokio::sync::mpsc::channel(4);
    pieces.send(bytes::Bytes::from_static(b"{")).await.unwrap();
    let trickled = tokio::spawn({
        let (ca, path) = (server.dir.join("ca.crt"), path.clone());
        let addr = server.addr;
        async move { support::https::post_trickled(&ca, addr, &path, length, trickle).await }
    });
    // While it holds the one request slot, another request is refused at once, not queued.
    let https = trusting(&server);
    let mut refused = false;
    for _ in 0..50 {
        let (status, answer) = support::https::post(
            &https,
            server.addr,
            &path,
            serde_json::to_vec(&body).unwrap(),
        )
        .await
        .unwrap();
        if status == 429 {
            assert!(String::from_utf8_lossy(&answer).contains("too many admission requests"));
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(refused, "a second request beyond the cap was not refused");
    // The trickler is answered 408 at the deadline although its body never completed.
    let status = tokio::time::timeout(Duration::from_secs(10), trickled)
        .await
        .expect("cut off")
        .unwrap();
    assert_eq!(status, Ok(408));
    drop(pieces);
    // And the slot is free again.
    let answer = review(&https, server.addr, &path, &body).await;
    assert_eq!(answer["allowed"], true);
    server.handle.shutdown();
}

#[tokio::test]
async fn admission_bodies_are_charged_as_they_arrive_and_must_arrive_within_the_deadline() {
    use cnat::admission::webhook::BODY_DEADLINE;
    let server = server("body-deadline").await;
    let (path, body) = fixture("validating-create.json");
    // Eight requests that announce 4 MiB each (twice what one address may have in flight) and
    // send one byte.
    let started = std::time::Instant::now();
    let mut trickling = Vec::new();
    for _ in 0..8 {
        let (pieces, trickle) = tokio::sync::mpsc::channel(4);
        pieces.send(bytes::Bytes::from_static(b"{")).await.unwrap();
        let (ca, addr, path) = (server.dir.join("ca.crt"), server.addr, path.clone());
        trickling.push((
            pieces,
            tokio::spawn(async move {
                support::https::post_trickled_answer(&ca, addr, &path, 4 << 20, trickle).await
            }),
        ));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // They hold what they sent, not what they announced: a review from the same address goes
    // through at once.
    let https = trusting(&server);
    let answer = review(&https, server.addr, &path, &body).await;
    assert_eq!(answer["allowed"], true, "{answer}");
    assert!(started.elapsed() < BODY_DEADLINE);
    // Each is answered 408 at the deadline, its body never complete.
    for (_pieces, answer) in trickling {
        let (status, text) = tokio::time::timeout(Duration::from_secs(10), answer)
            .await
            .expect("cut off")
            .unwrap()
            .unwrap();
        assert_eq!(status, 408, "{}", String::from_utf8_lossy(&text));
        assert!(String::from_utf8_lossy(&text).contains("did not arrive within 3s"));
    }
    let took = started.elapsed();
    assert!(
        took >= BODY_DEADLINE && took < BODY_DEADLINE + Duration::from_secs(2),
        "{took:?}"
    );
    server.handle.shutdown();
}

#[tokio::test]
async fn a_conversion_whose_body_falls_behind_the_rate_is_cut_off_after_the_grace() {
    use cnat::admission::conversion_webhook::GRACE;
    let server = server("convert-trickle").await;
    let (pieces, trickle) = tokio::sync::mpsc::channel(4);
    let head = br#"{"apiVersion":"apiextensions.k8s.io/v1","kind":"ConversionReview","request":{"uid":"slow","desiredAPIVersion":"cnat.programming-kubernetes.info/v1","objects":["#;
    let started = std::time::Instant::now();
    let answer = tokio::spawn({
        let (ca, addr) = (server.dir.join("ca.crt"), server.addr);
        async move {
            support::https::post_trickled_answer(
                &ca,
                addr,
                "/convert?timeout=30s",
                1 << 20,
                trickle,
            )
            .await
        }
    });
    pieces.send(bytes::Bytes::from_static(head)).await.unwrap();
    // One space every 100 ms, for up to 20 s.
    let feeding = tokio::spawn(async move {
        for _ in 0..200 {
            if pieces.send(bytes::Bytes::from_static(b" ")).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let answered = tokio::time::timeout(Duration::from_secs(15), answer)
        .await
        .expect("cut off, not held for the 30 s deadline")
        .unwrap();
    let took = started.elapsed();
    assert!(
        took >= GRACE && took < GRACE + Duration::from_secs(3),
        "{took:?}"
    );
    let (_, body) = answered.expect("an answer, not a transport error");
    assert!(
        !String::from_utf8_lossy(&body).contains(r#""status":"Success""#),
        "{}",
        String::from_utf8_lossy(&body)
    );
    feeding.abort();
    server.handle.shutdown();
}

#[tokio::test]
async fn connections_beyond_the_cap_are_closed_while_admissions_go_on() {
    use tokio::io::AsyncReadExt;
    let limits = Limits {
        max_connections: 2,
        ..Limits::default()
    };
    let server = server_limited("capped", None, limits).await;
    let (path, body) = fixture("validating-create.json");
    // A client that keeps its connection (as kube-apiserver does) is admitted...
    let https = trusting(&server);
    assert_eq!(
        review(&https, server.addr, &path, &body).await["allowed"],
        true
    );
    // ... one idle connection takes the other place ...
    let _idle = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // ... and a third is closed at once.
    let mut third = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let mut buf = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(5), third.read(&mut buf))
        .await
        .expect("closed, not left hanging");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    // The admitted client goes on over its kept connection.
    for _ in 0..5 {
        assert_eq!(
            review(&https, server.addr, &path, &body).await["allowed"],
            true
        );
    }
    server.handle.shutdown();
}

#[tokio::test]
async fn the_conversion_webhook_converts_and_answers_what_it_cannot_with_a_failure() {
    let server = server("convert").await;
    let client = trusting(&server);
    let convert = |body: Vec<u8>| {
        let client = client.clone();
        async move {
            let (status, answer) = post(&client, server.addr, "/convert?timeout=30s", body)
                .await
                .unwrap();
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
            let answer: Value = serde_json::from_slice(&answer).unwrap();
            assert_eq!(answer["apiVersion"], "apiextensions.k8s.io/v1");
            assert_eq!(answer["kind"], "ConversionReview");
            answer["response"].clone()
        }
    };
    let request = |desired: &str| {
        serde_json::to_vec(&json!({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
            "request": {"uid": "f00d", "desiredAPIVersion": desired, "objects": [{
                "apiVersion": "cnat.programming-kubernetes.info/v1alpha1", "kind": "At",
                "metadata": {"name": "backup", "namespace": "team-a"},
                "spec": {"schedule": "2026-11-24T10:00:00Z", "command": "true",
                    "image": "busybox", "serviceAccountName": "backup"},
                "status": {"phase": "PENDING"}
            }]}
        }))
        .unwrap()
    };

    let converted = convert(request("cnat.programming-kubernetes.info/v1")).await;
    assert_eq!(converted["uid"], "f00d");
    assert_eq!(converted["result"]["status"], "Success");
    assert_eq!(
        converted["convertedObjects"],
        json!([{
            "apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "At",
            "metadata": {"name": "backup", "namespace": "team-a"},
            "spec": {"schedule": "2026-11-24T10:00:00Z", "command": "true",
                "template": {"image": "busybox", "serviceAccountName": "backup"}},
            "status": {"phase": "Pending"}
        }])
    );

    let unknown = convert(request("cnat.programming-kubernetes.info/v2")).await;
    assert_eq!(unknown["uid"], "f00d");
    assert_eq!(unknown["result"]["status"], "Failure");
    assert_eq!(
        unknown["result"]["message"],
        "cnat cannot convert to \"cnat.programming-kubernetes.info/v2\": it converts At objects between cnat.programming-kubernetes.info/v1alpha1 and cnat.programming-kubernetes.info/v1"
    );

    let garbage = convert(b"{\"request\":".to_vec()).await;
    assert_eq!(garbage["result"]["status"], "Failure");
    assert!(garbage["result"]["message"]
        .as_str()
        .unwrap()
        .starts_with("the body is not a ConversionReview"));

    // And the server goes on converting.
    let again = convert(request("cnat.programming-kubernetes.info/v1")).await;
    assert_eq!(again["result"]["status"], "Success");

    // The API server sends an unpaged list's objects in one review: far beyond an
    // AdmissionReview's 4 MiB.
    let at = json!({"apiVersion": "cnat.programming-kubernetes.info/v1alpha1", "kind": "At",
        "metadata": {"name": "x", "namespace": "team-a", "annotations": {"note": "n".repeat(1000)}},
        "spec": {"schedule": "2026-11-24T10:00:00Z", "command": "true", "image": "busybox"}});
    let many = json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
        "request": {"uid": "big", "desiredAPIVersion": "cnat.programming-kubernetes.info/v1",
            "objects": vec![at; 6000]}});
    let body = serde_json::to_vec(&many).unwrap();
    assert!(body.len() > webhook::MAX_BODY, "{} bytes", body.len());
    let big = convert(body).await;
    assert_eq!(big["result"]["status"], "Success", "{}", big["result"]);
    assert_eq!(big["convertedObjects"].as_array().unwrap().len(), 6000);
}

/// A CA and a client certificate it signed, for `name` (PEM: CA, certificate, key).
fn client_pki(name: &str) -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut client = CertificateParams::new(Vec::<String>::new()).unwrap();
    client.distinguished_name.push(DnType::CommonName, name);
    client.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let cert = client.signed_by(&key, &Issuer::new(ca, ca_key)).unwrap();
    (ca_cert.pem(), cert.pem(), key.serialize_pem())
}

#[tokio::test]
async fn with_a_client_ca_only_the_api_server_s_certificate_gets_admission_and_anyone_conversion() {
    let dir = std::env::temp_dir().join(format!("cnat-webhook-client-ca-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let served = tls::generate("cnat-webhook", "cnat-system", 1)
        .unwrap()
        .write(&dir)
        .unwrap();
    let (ca, cert, key) = client_pki("kube-apiserver");
    std::fs::write(dir.join("client-ca.crt"), &ca).unwrap();
    let files = CertFiles {
        client_ca: Some(dir.join("client-ca.crt")),
        ..served
    };
    let config = RustlsConfig::from_config(tls::server_config(&files).unwrap());
    let handle = axum_server::Handle::new();
    tokio::spawn(webhook::serve(
        cnat::serving::listen::bind("127.0.0.1:0".parse().unwrap()).unwrap(),
        config,
        handle.clone(),
        webhook::Shared {
            metrics: Arc::new(Metrics::new(Default::default())),
            reviewer: None,
            draining: Draining::default(),
            certified_only: true,
        },
        Limits::default(),
    ));
    let addr = handle.listening().await.unwrap();
    let (path, body) = fixture("validating-create.json");
    let body = serde_json::to_vec(&body).unwrap();
    // kube-apiserver with its client certificate: reviewed.
    let apiserver = support::https::client_with_certificate(&dir.join("ca.crt"), &cert, &key);
    let (status, answer) = post(&apiserver, addr, &path, body.clone()).await.unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    // Any other pod: refused before its body is read.
    let anyone = client(&dir.join("ca.crt"), rustls::DEFAULT_VERSIONS);
    for path in [path.as_str(), "/mutating?timeout=5s"] {
        let (status, answer) = post(&anyone, addr, path, body.clone()).await.unwrap();
        assert_eq!(status, 403, "{path}");
        assert!(String::from_utf8_lossy(&answer).contains("--webhook-client-ca"));
    }
    // A certificate from another CA: not even a handshake.
    let (_, stranger, stranger_key) = client_pki("some-pod");
    let stranger =
        support::https::client_with_certificate(&dir.join("ca.crt"), &stranger, &stranger_key);
    assert!(post(&stranger, addr, &path, body.clone()).await.is_err());
    // Conversions come without a certificate (kube-apiserver presents none for them).
    let review = serde_json::to_vec(&json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
        "request": {"uid": "c1", "desiredAPIVersion": "cnat.programming-kubernetes.info/v1", "objects": []}
    }))
    .unwrap();
    let (status, answer) = post(&anyone, addr, "/convert?timeout=30s", review)
        .await
        .unwrap();
    assert_eq!(status, 200);
    let answer: Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(answer["response"]["uid"], "c1");
    handle.shutdown();
}

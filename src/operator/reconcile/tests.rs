//! The reconciler's API calls against a scripted mock API server (kube's tower-test pattern),
//! answering with bodies captured from a real kube-apiserver (tests/fixtures/api-k8s-1.24).

use super::*;
use crate::api::{AtSpec, AtStatus, Phase};
use crate::observability::metrics::Metrics;
use crate::operator::cache::freshness::{Following, Freshness, SILENCE};
use crate::operator::policy::RunPolicy;
use crate::operator::slow_start;
use decide::PodObservation;
use futures::StreamExt;
use http::{Request, Response};
use k8s_openapi::api::core::v1::Pod;
use kube::client::Body;
use kube::runtime::events::Reporter;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::reflector::Store;
use kube::runtime::{reflector, watcher};
use serde_json::Value;
use std::time::Duration;

const NOW: &str = "2026-11-22T02:10:00Z";
const AT_UID: &str = "4c4a2a4f-0d1e-4a59-9d0e-6c9d3c2a7a01";
const PODS: &str = "/api/v1/namespaces/default/pods";
const POD: &str = "/api/v1/namespaces/default/pods/example-at-pod";
const STATUS: &str =
    "/apis/cnat.programming-kubernetes.info/v1/namespaces/default/ats/example-at/status";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/default/events";
/// The At itself: its GETs (the quorum read before a pod create) are answered from the
/// harness's `stored` copy, outside the script.
const AT: &str = "/apis/cnat.programming-kubernetes.info/v1/namespaces/default/ats/example-at";

fn fixture(name: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/api-k8s-1.24/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The captured pod, renamed to this At's pod, optionally controlled by it and ended.
/// The key the harness's leader signs its pods with.
fn signing_key() -> crate::operator::signing::Key {
    crate::operator::signing::Key::from_bytes(&[7; 32]).unwrap()
}

/// The example At's pod as the API server returns it: controlled by (and, as cnat made it,
/// signed for) the At `owner_uid`, `ended` with that phase and exit code.
fn pod_fixture(owner_uid: Option<&str>, ended: Option<(&str, i32)>) -> Value {
    let mut pod = fixture("pod-created.json");
    pod["metadata"]["name"] = "example-at-pod".into();
    pod["metadata"]["namespace"] = "default".into();
    if let Some(uid) = owner_uid {
        pod["metadata"]["ownerReferences"] = serde_json::json!([{
            "apiVersion": "cnat.programming-kubernetes.info/v1", "kind": "At",
            "name": "example-at", "uid": uid, "controller": true,
        }]);
        pod["metadata"]["annotations"][crate::operator::pod::SIGNATURE] =
            signing_key().sign(uid, "example-at-pod").into();
    }
    if let Some((phase, exit_code)) = ended {
        pod["status"]["phase"] = phase.into();
        pod["status"]["containerStatuses"] = serde_json::json!([{
            "name": "command", "image": "busybox", "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": exit_code, "reason": "Error", "message": "boom",
                                     "finishedAt": "2026-11-22T02:09:59Z"}},
        }]);
    }
    pod
}

fn example_at(status: Option<AtStatus>) -> At {
    let mut at = At::new(
        "example-at",
        AtSpec {
            schedule: "2019-04-12T10:12:00Z".into(),
            command: "echo YAY".into(),
            template: crate::api::AtPodTemplate {
                image: Some("busybox".into()),
                ..Default::default()
            },
            ..AtSpec::default()
        },
    );
    at.metadata.namespace = Some("default".into());
    at.metadata.uid = Some(AT_UID.into());
    at.metadata.resource_version = Some("100".into());
    at.metadata.generation = Some(1);
    at.status = status;
    at
}

fn running_status() -> AtStatus {
    let now = DateTime::parse_from_rfc3339(NOW).unwrap().to_utc();
    let decided = decide(
        &example_at(None),
        &PodObservation::NotCached,
        now,
        &RunPolicy::default(),
    );
    assert_eq!(decided.call, Call::CreatePod);
    decided.status.unwrap()
}

/// A scripted "answer" that is none: the connection closes.
const NO_ANSWER: u16 = 0;

/// One expected request and the answer the mock API server gives.
struct Exchange {
    method: &'static str,
    path: &'static str,
    code: u16,
    body: Value,
}

fn answer(method: &'static str, path: &'static str, code: u16, body: Value) -> Exchange {
    Exchange {
        method,
        path,
        code,
        body,
    }
}

/// What the reconciler sent.
#[derive(Debug)]
struct Sent {
    method: String,
    path: String,
    query: String,
    content_type: String,
    body: Value,
}

struct Harness {
    ctx: Arc<Context>,
    metrics: Arc<Metrics>,
    pods: reflector::store::Writer<Pod>,
    server: tokio::task::JoinHandle<Vec<Sent>>,
    /// Requests the mock API server answered so far.
    answered: Arc<std::sync::atomic::AtomicUsize>,
    /// Runs the context's wakeups; it holds a handle to the context until aborted.
    wakeups: tokio::task::JoinHandle<()>,
    /// The API server's copy of the example At (`None`: it does not exist); `reconcile` sets it
    /// to the At it is given unless a test set it first.
    stored: Arc<std::sync::Mutex<Option<Option<Value>>>>,
    /// Reads of the example At the mock API server answered from `stored`.
    reads: Arc<std::sync::atomic::AtomicUsize>,
    /// The At cache's freshness, as the follower would say it.
    freshness: Freshness,
    /// Keeps `freshness` caught up, as a live watch's bookmarks do.
    bookmarks: tokio::task::JoinHandle<()>,
}

/// A context whose client talks to a mock API server that answers `script` in order and
/// records every request; anything unscripted gets a 500 and fails the test's count check.
fn harness(script: Vec<Exchange>) -> Harness {
    harness_at(
        script,
        Arc::new(|| DateTime::parse_from_rfc3339(NOW).unwrap().to_utc()),
    )
}

fn harness_at(script: Vec<Exchange>, clock: Clock) -> Harness {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = answered.clone();
    let stored: Arc<std::sync::Mutex<Option<Option<Value>>>> = Arc::default();
    let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (held, read) = (stored.clone(), reads.clone());
    let server = tokio::spawn(async move {
        let mut script = script.into_iter();
        let mut sent = Vec::new();
        while let Some((request, respond)) = handle.next_request().await {
            let (parts, body) = request.into_parts();
            let bytes = body.collect_bytes().await.unwrap();
            if parts.method == http::Method::GET && parts.uri.path() == AT {
                let copy = held.lock().unwrap().clone().flatten();
                let (code, reply) = match copy {
                    Some(at) => (200, at),
                    None => (404, fixture("status-404-not-found.json")),
                };
                let response = Response::builder()
                    .status(code)
                    .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                    .unwrap();
                respond.send_response(response);
                read.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                continue;
            }
            let exchange = script.next();
            if exchange.as_ref().is_some_and(|e| e.code == NO_ANSWER) {
                // The connection closes unanswered, as when the API server is down.
                sent.push(Sent {
                    method: parts.method.to_string(),
                    path: parts.uri.path().to_owned(),
                    query: String::new(),
                    content_type: String::new(),
                    body: Value::Null,
                });
                respond.send_error(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
                continue;
            }
            let (code, reply) = match &exchange {
                Some(e) if e.method == parts.method.as_str() && e.path == parts.uri.path() => {
                    (e.code, e.body.clone())
                }
                _ => (
                    500,
                    serde_json::json!({"kind": "Status", "code": 500, "message": "unscripted"}),
                ),
            };
            sent.push(Sent {
                method: parts.method.to_string(),
                path: parts.uri.path().to_owned(),
                query: parts.uri.query().unwrap_or_default().to_owned(),
                content_type: parts
                    .headers
                    .get(http::header::CONTENT_TYPE)
                    .map(|v| v.to_str().unwrap().to_owned())
                    .unwrap_or_default(),
                body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
            });
            let response = Response::builder()
                .status(code)
                .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                .unwrap();
            respond.send_response(response);
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        sent
    });
    let client = Client::new(service, "default");
    let (store, pods) = reflector::store();
    let metrics = Arc::new(Metrics::new(Default::default()));
    let reporter = Reporter {
        controller: "cnat".into(),
        instance: Some("cnat-0".into()),
    };
    let events = EventSink::start(client.clone(), reporter);
    // A live watch, heard from (a bookmark) every minute, unless a test says otherwise.
    let freshness = Freshness::default();
    freshness.heard(Following::Watching);
    let bookmarks = tokio::spawn({
        let freshness = freshness.clone();
        async move {
            loop {
                freshness.heard(Following::Watching);
                tokio::time::sleep(Duration::from_secs(60)).await;
            }
        }
    });
    let caches = Caches {
        pods: store,
        ats: freshness.clone(),
    };
    let ctx = Arc::new(
        Context::new(
            client,
            caches,
            events,
            clock,
            metrics.clone(),
            RunPolicy::default(),
            Arc::default(),
        )
        .with_signing(crate::operator::signing::Signing::new(signing_key())),
    );
    // As in production, status writes that follow pod creates go through the writer, and
    // wakeups (retries of failed writes among them) reconcile again.
    tokio::spawn(ctx.writer.queued_writes().unwrap());
    let wakeups = tokio::spawn({
        let ctx = ctx.clone();
        async move {
            ctx.scheduler
                .wakeups()
                .run(|at| ctx.scheduler.wake_up(at))
                .await
        }
    });
    Harness {
        ctx,
        metrics,
        pods,
        server,
        answered,
        wakeups,
        stored,
        reads,
        freshness,
        bookmarks,
    }
}

impl Harness {
    fn cache_pod(&mut self, pod: Value) {
        let pod: Pod = serde_json::from_value(pod).unwrap();
        self.pods.apply_watcher_event(&watcher::Event::Apply(pod));
    }

    async fn reconcile(&self, at: At) -> Result<Action, Error> {
        self.store_unless_set(&at);
        reconcile(Arc::new(at), self.ctx.clone()).await
    }

    /// The API server holds `at` (unless a test said otherwise first).
    fn store_unless_set(&self, at: &At) {
        let mut stored = self.stored.lock().unwrap();
        if stored.is_none() {
            *stored = Some(Some(serde_json::to_value(at).unwrap()));
        }
    }

    /// The API server holds `at` from now on (`None`: no such At).
    fn store(&self, at: Option<&At>) {
        *self.stored.lock().unwrap() = Some(at.map(|at| serde_json::to_value(at).unwrap()));
    }

    /// Reads of the At the API server answered.
    fn reads(&self) -> usize {
        self.reads.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How long until the next reconcile of the example At, as the wake-up index holds it
    /// (exact under paused time).
    fn wakes_in(&self) -> Option<Duration> {
        let when = self
            .ctx
            .scheduler
            .wakeups()
            .when(&AtKey::from(&example_at(None)))?;
        Some(when.saturating_duration_since(tokio::time::Instant::now()))
    }

    /// Stops the mock server and returns what was sent, checking it followed the script.
    async fn finish(self, expected: usize) -> Vec<Sent> {
        let reads = self.reads.clone();
        self.wakeups.abort();
        self.bookmarks.abort();
        let _ = self.wakeups.await;
        drop(self.ctx);
        let sent = tokio::time::timeout(Duration::from_secs(5), self.server)
            .await
            .unwrap()
            .unwrap();
        let summary: Vec<_> = sent
            .iter()
            .map(|s| format!("{} {}", s.method, s.path))
            .collect();
        assert_eq!(sent.len(), expected, "requests: {summary:#?}");
        // Every pod create was confirmed: by a quorum read of its At, or by this leader's own
        // PENDING write of the version decided on.
        let creates = sent
            .iter()
            .filter(|s| s.method == "POST" && s.path == PODS)
            .count();
        let reads = reads.load(std::sync::atomic::Ordering::SeqCst);
        let metrics = self.metrics.encode();
        let own = counted(
            &metrics,
            "cnat_pod_create_confirmations_total{by=\"own_write\"}",
        );
        assert!(
            reads + own >= creates,
            "{creates} pod creates, {reads} reads, {own} own writes"
        );
        sent
    }
}

/// The value of the sample `name` (with its labels) in a scrape.
fn counted(metrics: &str, name: &str) -> usize {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0)
}

fn created_event() -> Value {
    serde_json::json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e", "namespace": "default"}, "eventTime": "2026-11-22T02:10:00.000000Z"})
}

fn at_response(status: &AtStatus) -> Value {
    let mut at = serde_json::to_value(example_at(Some(status.clone()))).unwrap();
    at["metadata"]["resourceVersion"] = "101".into();
    at
}

fn assert_status_patch(sent: &Sent, phase: Phase) -> AtStatus {
    assert_eq!(
        (sent.method.as_str(), sent.path.as_str()),
        ("PATCH", STATUS)
    );
    assert_eq!(sent.content_type, "application/merge-patch+json");
    assert!(sent.query.contains("fieldManager=cnat"), "{}", sent.query);
    assert_eq!(
        sent.body["metadata"]["resourceVersion"], "100",
        "status writes are guarded by resourceVersion"
    );
    assert_eq!(
        sent.body.as_object().unwrap().len(),
        2,
        "only metadata.resourceVersion and status: {}",
        sent.body
    );
    let status: AtStatus = serde_json::from_value(sent.body["status"].clone()).unwrap();
    assert_eq!(status.phase, phase);
    status
}

fn assert_event(sent: &Sent, type_: &str, reason: &str) {
    assert_eq!((sent.method.as_str(), sent.path.as_str()), ("POST", EVENTS));
    assert_eq!(sent.body["type"], type_);
    assert_eq!(sent.body["reason"], reason);
    assert_eq!(sent.body["regarding"]["kind"], "At");
    assert_eq!(sent.body["regarding"]["name"], "example-at");
    assert_eq!(sent.body["regarding"]["uid"], AT_UID);
    assert_eq!(sent.body["reportingController"], "cnat");
}

/// The slow-start window after the reconcile: `entered` creates let in, none left in it, and
/// `open` wide (`FIRST`, one wider after an answer, narrowed after an overloaded one).
fn assert_window(h: &Harness, open: usize, entered: u64, case: &str) {
    let window = h.ctx.writer.priority().window.window();
    assert_eq!(
        (window.open, window.in_flight, window.entered),
        (open, 0, entered),
        "{case}"
    );
}

#[tokio::test]
async fn a_due_at_creates_its_pod_before_writing_running() {
    let status = running_status();
    let h = harness(vec![
        answer("POST", PODS, 201, pod_fixture(Some(AT_UID), None)),
        answer("PATCH", STATUS, 200, at_response(&status)),
        answer("POST", EVENTS, 201, created_event()),
    ]);
    let action = h.reconcile(example_at(None)).await.unwrap();
    assert_eq!(action, Action::await_change());
    // No later look: the pod's own watch event brings the next reconcile.
    assert_eq!(h.wakes_in(), None);
    let metrics = h.metrics.clone();
    let sent = h.finish(3).await;

    let pod: Pod = serde_json::from_value(sent[0].body.clone()).unwrap();
    assert_eq!(sent[0].path, PODS);
    assert!(sent[0].query.contains("fieldManager=cnat"));
    assert_eq!(pod.metadata.name.as_deref(), Some("example-at-pod"));
    assert!(pod::is_controlled_by(&pod, AT_UID));
    let container = &pod.spec.as_ref().unwrap().containers[0];
    assert_eq!(
        container.command.clone().unwrap(),
        ["/bin/sh", "-c", "echo YAY"]
    );

    let written = assert_status_patch(&sent[1], Phase::Running);
    assert_eq!(written.pod_name.as_deref(), Some("example-at-pod"));
    assert_event(&sent[2], "Normal", "PodCreated");

    // The pod came (NOW - schedule) late; one successful reconcile.
    let late = (DateTime::parse_from_rfc3339(NOW).unwrap()
        - DateTime::parse_from_rfc3339("2019-04-12T10:12:00Z").unwrap())
    .num_seconds();
    let metrics = metrics.encode();
    assert!(
        metrics.contains("\ncnat_run_lateness_seconds_count 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!("\ncnat_run_lateness_seconds_sum {late}.0\n")),
        "{metrics}"
    );
    assert!(
        metrics.contains("\ncnat_reconciles_total{result=\"ok\"} 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("\ncnat_reconcile_duration_seconds_count 1\n"),
        "{metrics}"
    );
}

/// A cache that is behind (a relist, a stuck watch, a new leader's) can show as PENDING and due
/// an At the API server holds as DONE, deleted, changed, or another At by that name: its pod is
/// created only once a quorum read of the At confirms what the cache showed.
#[tokio::test]
async fn a_due_at_s_pod_is_created_only_when_the_api_server_confirms_the_at() {
    let cached = example_at(None);
    let with = |change: &dyn Fn(&mut At)| {
        let mut at = cached.clone();
        at.metadata.resource_version = Some("200".into());
        change(&mut at);
        at
    };
    let done = with(&|at| {
        at.status = Some(AtStatus {
            phase: Phase::Done,
            pod_name: Some("example-at-pod".into()),
            ..AtStatus::default()
        })
    });
    let other = with(&|at| at.metadata.uid = Some("another-uid".into()));
    let changed = with(&|at| at.spec.schedule = "2999-01-01T00:00:00Z".into());
    let moved = with(&|at| {
        at.metadata.labels = Some([(crate::shard::LABEL.to_owned(), "7".to_owned())].into())
    });
    let going = with(&|at| {
        at.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            NOW.parse().unwrap(),
        ))
    });
    let cases = [
        ("DONE", Some(&done)),
        ("deleted", None),
        ("another At by that name", Some(&other)),
        ("its spec changed", Some(&changed)),
        ("its first shard label value came", Some(&moved)),
        ("being deleted", Some(&going)),
    ];
    for (case, stored) in cases {
        let h = harness(vec![]);
        h.store(stored);
        let action = h.reconcile(cached.clone()).await.unwrap();
        assert_eq!(action, Action::await_change(), "{case}");
        assert_eq!(h.reads(), 1, "{case}: one quorum read");
        assert_window(
            &h,
            slow_start::FIRST,
            0,
            &format!("{case}: not confirmed, not sent"),
        );
        let metrics = h.metrics.encode();
        assert!(
            metrics.contains("\ncnat_pod_creates_unconfirmed_total 1\n"),
            "{case}: {metrics}"
        );
        h.finish(0).await;
    }

    // The API server's copy is newer but the same At, spec and phase (our own PENDING write
    // landed meanwhile): confirmed, the pod is created.
    let written = with(&|at| {
        at.status = Some(AtStatus {
            phase: Phase::Pending,
            ..AtStatus::default()
        })
    });
    let h = harness(vec![
        answer("POST", PODS, 201, pod_fixture(Some(AT_UID), None)),
        answer("PATCH", STATUS, 200, at_response(&running_status())),
        answer("POST", EVENTS, 201, created_event()),
    ]);
    h.store(Some(&written));
    h.reconcile(cached).await.unwrap();
    assert_eq!(h.reads(), 1);
    let metrics = h.metrics.encode();
    assert!(
        metrics.contains("\ncnat_pod_creates_unconfirmed_total 0\n"),
        "{metrics}"
    );
    let sent = h.finish(3).await;
    assert_eq!(sent[0].path, PODS);
}

/// The version this leader's own PENDING write made needs no read before its pod: the API
/// server answered that write, and no pod was made from it since, and its shard label value
/// cannot change. Any other version, or an At without a value (it may still get one and move
/// to another shard), is read.
#[tokio::test(start_paused = true)]
async fn a_pod_created_from_this_leader_s_own_pending_write_needs_no_read() {
    for labelled in [true, false] {
        own_pending_write(labelled).await;
    }
}

async fn own_pending_write(labelled: bool) {
    let now = Arc::new(std::sync::Mutex::new(
        DateTime::parse_from_rfc3339(NOW).unwrap().to_utc(),
    ));
    let clock: Clock = Arc::new({
        let now = now.clone();
        move || *now.lock().unwrap()
    });
    let mut at = example_at(None);
    at.spec.schedule = "2026-11-22T02:11:00Z".into();
    if labelled {
        at.metadata.labels = Some([(crate::shard::LABEL.to_owned(), "7".to_owned())].into());
    }
    let pending = AtStatus {
        phase: Phase::Pending,
        ..AtStatus::default()
    };
    let h = harness_at(
        vec![
            answer("PATCH", STATUS, 200, at_response(&pending)),
            answer("POST", EVENTS, 201, created_event()),
            answer("POST", PODS, 201, pod_fixture(Some(AT_UID), None)),
            answer("PATCH", STATUS, 200, at_response(&running_status())),
            answer("POST", EVENTS, 201, created_event()),
        ],
        clock,
    );
    h.reconcile(at.clone()).await.unwrap();
    // The written version (101, as the mock answers) comes back through the watch, due.
    tokio::time::sleep(Duration::from_secs(1)).await;
    at.status = Some(pending);
    at.metadata.resource_version = Some("101".into());
    *now.lock().unwrap() = DateTime::parse_from_rfc3339("2026-11-22T02:11:00Z")
        .unwrap()
        .to_utc();
    h.reconcile(at.clone()).await.unwrap();
    let metrics = h.metrics.encode();
    let own = "cnat_pod_create_confirmations_total{by=\"own_write\"}";
    if !labelled {
        assert_eq!(h.reads(), 1, "an At without a shard value is read");
        assert_eq!(counted(&metrics, own), 0, "{metrics}");
        h.finish(5).await;
        return;
    }
    assert_eq!(h.reads(), 0, "no read");
    assert_eq!(counted(&metrics, own), 1, "{metrics}");
    let sent = h.finish(5).await;
    assert_eq!(sent[2].path, PODS);

    // The same version in a new leadership (another ledger), or another version: read first.
    for version in ["101", "102"] {
        let due = *now.lock().unwrap();
        let h = harness_at(
            vec![
                answer("POST", PODS, 201, pod_fixture(Some(AT_UID), None)),
                answer("PATCH", STATUS, 200, at_response(&running_status())),
                answer("POST", EVENTS, 201, created_event()),
            ],
            Arc::new(move || due),
        );
        at.metadata.resource_version = Some(version.into());
        h.reconcile(at.clone()).await.unwrap();
        assert_eq!(h.reads(), 1, "{version}");
        let metrics = h.metrics.encode();
        let read = "cnat_pod_create_confirmations_total{by=\"read\"}";
        assert_eq!(counted(&metrics, read), 1, "{metrics}");
        h.finish(3).await;
    }
}

/// An At cache that is behind (listing, no watch open, its watch silent) creates no pod: the
/// At is reconciled again as soon as the cache has caught up (or after a second).
#[tokio::test(start_paused = true)]
async fn no_pod_is_created_from_an_at_cache_that_is_behind() {
    let h = harness(vec![
        answer("POST", PODS, 201, pod_fixture(Some(AT_UID), None)),
        answer("PATCH", STATUS, 200, at_response(&running_status())),
        answer("POST", EVENTS, 201, created_event()),
    ]);
    h.bookmarks.abort();
    let mut reconcile_now = h.ctx.scheduler.reconcile_now().unwrap().boxed();
    let waker = tokio::spawn({
        let ctx = h.ctx.clone();
        async move { ctx.scheduler.wake_deferred(&ctx.calls.caches.ats).await }
    });
    let at = example_at(None);
    for behind in [Following::Listing, Following::Connecting] {
        h.freshness.set(behind, false);
        let action = h.reconcile(at.clone()).await.unwrap();
        assert_eq!(
            action,
            Action::requeue(Duration::from_secs(1)),
            "{behind:?}"
        );
        assert_eq!(h.reads(), 0);
    }
    // A watch silent past the bound is behind too.
    h.freshness.heard(Following::Watching);
    tokio::time::sleep(SILENCE + Duration::from_secs(1)).await;
    h.reconcile(at.clone()).await.unwrap();
    let metrics = h.metrics.encode();
    assert_eq!(
        counted(&metrics, "cnat_pod_creates_deferred_total"),
        3,
        "{metrics}"
    );

    // The watch says something: the At is reconciled again at once, and its pod created.
    h.freshness.heard(Following::Watching);
    let woken = tokio::time::timeout(Duration::from_millis(1), reconcile_now.next()).await;
    assert_eq!(woken.unwrap(), Some(AtKey::from(&at)));
    h.reconcile(at).await.unwrap();
    assert_eq!(h.reads(), 1);
    waker.abort();
    h.finish(3).await;
}

#[tokio::test(start_paused = true)]
async fn an_existing_pod_of_this_at_is_adopted_not_created_twice() {
    let h = harness(vec![
        answer("POST", PODS, 409, fixture("status-409-already-exists.json")),
        answer("GET", POD, 200, pod_fixture(Some(AT_UID), None)),
        answer("PATCH", STATUS, 200, at_response(&running_status())),
        answer("POST", EVENTS, 201, created_event()),
    ]);
    let action = h.reconcile(example_at(None)).await.unwrap();
    assert_eq!(action, Action::await_change());
    assert_eq!(h.wakes_in(), Some(RunPolicy::default().running_recheck));
    assert_window(&h, slow_start::FIRST + 1, 1, "409: an answer");
    let sent = h.finish(4).await;
    let written = assert_status_patch(&sent[2], Phase::Running);
    assert_eq!(written.pod_name.as_deref(), Some("example-at-pod"));
    assert_event(&sent[3], "Normal", "PodCreated");
}

/// A pod by the At's pod name that cnat did not create: not controlled by the At, or
/// controlled by it (anyone who may create pods there can write that reference) but without
/// cnat's signature, or with one made under another key.
#[tokio::test(start_paused = true)]
async fn a_foreign_pod_with_the_name_blocks_the_at_with_a_clear_condition() {
    let unsigned = {
        let mut pod = pod_fixture(Some(AT_UID), None);
        pod["metadata"]["annotations"] = serde_json::json!({});
        pod
    };
    let forged = {
        let mut pod = pod_fixture(Some(AT_UID), None);
        let other = crate::operator::signing::Key::from_bytes(&[8; 32]).unwrap();
        pod["metadata"]["annotations"][pod::SIGNATURE] =
            other.sign(AT_UID, "example-at-pod").into();
        pod
    };
    for foreign in [pod_fixture(None, None), unsigned, forged] {
        a_foreign_pod_blocks(foreign).await;
    }
}

async fn a_foreign_pod_blocks(foreign: Value) {
    let h = harness(vec![
        answer("POST", PODS, 409, fixture("status-409-already-exists.json")),
        answer("GET", POD, 200, foreign),
        answer("PATCH", STATUS, 200, at_response(&running_status())),
        answer("POST", EVENTS, 201, created_event()),
    ]);
    let action = h.reconcile(example_at(None)).await.unwrap();
    assert_eq!(action, Action::await_change());
    assert_eq!(h.wakes_in(), Some(decide::CONFLICT_RECHECK));
    let sent = h.finish(4).await;
    let written = assert_status_patch(&sent[2], Phase::Pending);
    let conflict = written
        .conditions
        .iter()
        .find(|c| c.type_ == decide::POD_CREATED)
        .unwrap();
    assert_eq!(
        (conflict.status.as_str(), conflict.reason.as_str()),
        ("False", "PodNameConflict")
    );
    assert_event(&sent[3], "Warning", "PodNameConflict");
}

#[tokio::test]
async fn a_pod_the_api_server_rejects_is_reported_in_status() {
    let h = harness(vec![
        answer(
            "POST",
            PODS,
            422,
            fixture("status-422-invalid-pod-name.json"),
        ),
        answer("PATCH", STATUS, 200, at_response(&running_status())),
        answer("POST", EVENTS, 201, created_event()),
    ]);
    assert_eq!(
        h.reconcile(example_at(None)).await.unwrap(),
        Action::await_change()
    );
    // No later look: the same pod would be rejected again until the At changes.
    assert_eq!(h.wakes_in(), None);
    assert_window(&h, slow_start::FIRST + 1, 1, "422: an answer");
    let sent = h.finish(3).await;
    let written = assert_status_patch(&sent[1], Phase::Pending);
    let message = written.message.unwrap();
    assert!(
        message.starts_with(
            "the API server rejected pod example-at-pod as invalid: Pod \"Bad_Name\" is invalid"
        ),
        "{message}"
    );
    assert_event(&sent[2], "Warning", "PodInvalid");
}

#[tokio::test]
async fn a_pod_refused_by_quota_or_policy_is_shown_and_retried_with_backoff() {
    for (file, reason) in [
        (
            "status-403-forbidden-quota-requires-limits.json",
            "quota_needs_resources",
        ),
        ("status-403-forbidden-quota-exceeded.json", "quota_exceeded"),
        ("status-403-forbidden-pod-security.json", "pod_security"),
    ] {
        let h = harness(vec![
            answer("POST", PODS, 403, fixture(file)),
            answer("PATCH", STATUS, 200, at_response(&running_status())),
            answer("POST", EVENTS, 201, created_event()),
        ]);
        let error = h.reconcile(example_at(None)).await.unwrap_err();
        assert!(
            matches!(error, Error::PodRefused { .. }),
            "{file}: backoff, not a plain requeue: {error}"
        );
        assert_window(&h, slow_start::FIRST + 1, 1, file);
        let metrics = h.metrics.clone();
        let sent = h.finish(3).await;
        let written = assert_status_patch(&sent[1], Phase::Pending);
        assert_eq!(written.reason.as_deref(), Some("PodForbidden"), "{file}");
        let server_said = fixture(file)["message"].as_str().unwrap().to_owned();
        let message = written.message.unwrap();
        assert!(message.contains(&server_said), "{file}: {message}");
        assert!(
            message.contains("cnat retries with backoff"),
            "{file}: {message}"
        );
        assert_event(&sent[2], "Warning", "PodForbidden");
        // The error policy counts it: the next retry waits longer.
        assert!(error.to_string().contains("example-at-pod"), "{error}");
        let counted = format!("cnat_pods_refused_total{{reason=\"{reason}\"}} 1\n");
        let metrics = metrics.encode();
        assert!(metrics.contains(&counted), "{file}: {metrics}");
    }
}

#[tokio::test]
async fn a_running_at_whose_pod_is_gone_is_confirmed_with_the_api_server_then_failed() {
    let h = harness(vec![
        answer("GET", POD, 404, fixture("status-404-not-found.json")),
        answer("PATCH", STATUS, 200, at_response(&running_status())),
        answer("POST", EVENTS, 201, created_event()),
    ]);
    let action = h
        .reconcile(example_at(Some(running_status())))
        .await
        .unwrap();
    assert_eq!(action, Action::await_change());
    // DONE: nothing more to look at.
    assert_eq!(h.wakes_in(), None);
    let sent = h.finish(3).await;
    let written = assert_status_patch(&sent[1], Phase::Done);
    assert_eq!(written.outcome, Some(crate::api::Outcome::Failed));
    assert!(written
        .message
        .unwrap()
        .contains("was deleted before the command finished"));
    assert_event(&sent[2], "Warning", "PodLost");
}

#[tokio::test]
async fn a_cached_pod_that_ran_ends_the_at_without_extra_reads() {
    let mut h = harness(vec![
        answer("PATCH", STATUS, 200, at_response(&running_status())),
        answer("POST", EVENTS, 201, created_event()),
    ]);
    h.cache_pod(pod_fixture(Some(AT_UID), Some(("Failed", 3))));
    h.reconcile(example_at(Some(running_status())))
        .await
        .unwrap();
    let sent = h.finish(2).await;
    let written = assert_status_patch(&sent[0], Phase::Done);
    assert_eq!(written.exit_code, Some(3));
    assert_eq!(
        written.message.as_deref(),
        Some("the command in pod example-at-pod exited with code 3: Error: boom")
    );
    assert_eq!(
        written.completion_time.unwrap().to_rfc3339(),
        "2026-11-22T02:09:59+00:00"
    );
    assert_event(&sent[1], "Warning", "CommandFailed");
}

/// A RUNNING At started a minute before `NOW`, and its running pod with a 30 s deadline.
fn past_its_deadline() -> (AtStatus, Value) {
    let mut status = running_status();
    status.start_time = Some(
        DateTime::parse_from_rfc3339("2026-11-22T02:09:00Z")
            .unwrap()
            .to_utc(),
    );
    let mut pod = pod_fixture(Some(AT_UID), None);
    pod["spec"]["activeDeadlineSeconds"] = 30.into();
    pod["status"]["phase"] = "Running".into();
    (status, pod)
}

#[tokio::test]
async fn a_pod_past_its_deadline_is_deleted_as_seen_then_the_at_is_done() {
    let (status, pod) = past_its_deadline();
    let mut deleted = pod.clone();
    deleted["metadata"]["deletionTimestamp"] = NOW.into();
    let mut h = harness(vec![
        answer("DELETE", POD, 200, deleted),
        answer("PATCH", STATUS, 200, at_response(&status)),
        answer("POST", EVENTS, 201, created_event()),
    ]);
    h.cache_pod(pod.clone());
    h.reconcile(example_at(Some(status))).await.unwrap();
    let sent = h.finish(3).await;
    // Only the pod as seen: its uid and version.
    assert_eq!(sent[0].method, "DELETE");
    assert_eq!(
        sent[0].body["preconditions"],
        serde_json::json!({
            "uid": pod["metadata"]["uid"],
            "resourceVersion": pod["metadata"]["resourceVersion"],
        })
    );
    let written = assert_status_patch(&sent[1], Phase::Done);
    assert_eq!(written.reason.as_deref(), Some("DeadlineExceeded"));
    assert_eq!(written.outcome, Some(crate::api::Outcome::Failed));
    assert_event(&sent[2], "Warning", "DeadlineExceeded");
}

#[tokio::test]
async fn a_pod_that_ended_before_cnat_could_delete_it_is_recorded_as_it_ended() {
    let (status, pod) = past_its_deadline();
    let mut succeeded = pod_fixture(Some(AT_UID), Some(("Succeeded", 0)));
    succeeded["spec"]["activeDeadlineSeconds"] = 30.into();
    succeeded["metadata"]["resourceVersion"] = "999".into();
    let mut h = harness(vec![
        // The cache's copy is behind: the pod ended meanwhile.
        answer(
            "DELETE",
            POD,
            409,
            fixture("status-409-conflict-stale-resourceversion.json"),
        ),
        answer("GET", POD, 200, succeeded),
        answer("PATCH", STATUS, 200, at_response(&status)),
        answer("POST", EVENTS, 201, created_event()),
    ]);
    h.cache_pod(pod);
    h.reconcile(example_at(Some(status))).await.unwrap();
    let sent = h.finish(4).await;
    let written = assert_status_patch(&sent[2], Phase::Done);
    assert_eq!(
        (written.reason.as_deref(), written.outcome),
        (Some("Succeeded"), Some(crate::api::Outcome::Succeeded))
    );
    assert_event(&sent[3], "Normal", "Succeeded");
}

#[tokio::test(start_paused = true)]
async fn a_running_pod_in_the_cache_needs_no_request_at_all() {
    let mut h = harness(vec![]);
    h.cache_pod(pod_fixture(Some(AT_UID), None));
    assert_eq!(
        h.reconcile(example_at(Some(running_status())))
            .await
            .unwrap(),
        Action::await_change()
    );
    assert_eq!(h.wakes_in(), Some(RunPolicy::default().running_recheck));
    h.finish(0).await;
}

#[tokio::test]
async fn a_status_conflict_waits_for_the_newer_version_without_an_event() {
    let h = harness(vec![
        answer("POST", PODS, 201, pod_fixture(Some(AT_UID), None)),
        answer(
            "PATCH",
            STATUS,
            409,
            fixture("status-409-conflict-stale-resourceversion.json"),
        ),
    ]);
    assert_eq!(
        h.reconcile(example_at(None)).await.unwrap(),
        Action::await_change()
    );
    // No later look: the newer version's watch event brings the next reconcile.
    assert_eq!(h.wakes_in(), None);
    let metrics = h.metrics.clone();
    h.finish(2).await;
    let metrics = metrics.encode();
    let conflict = r#"cnat_status_writes_total{phase="RUNNING",result="conflict"}"#;
    assert_eq!(counted(&metrics, conflict), 1, "{metrics}");
    let written = r#"cnat_status_writes_total{phase="RUNNING",result="written"} 0"#;
    assert!(metrics.lines().any(|l| l == written), "{metrics}");
}

#[tokio::test]
async fn a_stale_cached_at_is_not_acted_on_twice() {
    let status = running_status();
    let h = harness(vec![
        answer("POST", PODS, 201, pod_fixture(Some(AT_UID), None)),
        answer("PATCH", STATUS, 200, at_response(&status)),
        answer("POST", EVENTS, 201, created_event()),
    ]);
    h.reconcile(example_at(None)).await.unwrap();
    // The pod's watch event arrives before the At's: the cache still shows resourceVersion 100.
    assert_eq!(
        h.reconcile(example_at(None)).await.unwrap(),
        Action::await_change()
    );
    h.finish(3).await;
}

#[tokio::test(start_paused = true)]
async fn a_future_at_is_written_pending_once_and_requeued_for_the_exact_remaining_time() {
    let mut future = example_at(None);
    future.spec.schedule = "2026-11-22T02:10:42.5Z".into();
    let h = harness(vec![
        answer("PATCH", STATUS, 200, at_response(&running_status())),
        answer("POST", EVENTS, 201, created_event()),
    ]);
    let action = h.reconcile(future.clone()).await.unwrap();
    // Its wake-up waits in the index, not in the runtime's queue.
    assert_eq!(action, Action::await_change());
    assert_eq!(h.wakes_in(), Some(Duration::from_millis(42_500)));
    let metrics = h.metrics.clone();
    let sent = h.finish(2).await;
    let written = assert_status_patch(&sent[0], Phase::Pending);
    assert_event(&sent[1], "Normal", "Scheduled");
    let metrics = metrics.encode();
    for (result, count) in [("written", 1), ("conflict", 0), ("failed", 0)] {
        let line =
            format!(r#"cnat_status_writes_total{{phase="PENDING",result="{result}"}} {count}"#);
        assert!(metrics.lines().any(|l| l == line), "{line} in {metrics}");
    }

    // The written version comes back through the watch: nothing more to write or say.
    let h = harness(vec![]);
    future.status = Some(written);
    future.metadata.resource_version = Some("101".into());
    assert_eq!(h.reconcile(future).await.unwrap(), Action::await_change());
    assert_eq!(h.wakes_in(), Some(Duration::from_millis(42_500)));
    h.finish(0).await;
}

#[tokio::test]
async fn api_errors_name_the_at_and_retry_with_growing_backoff() {
    let h = harness(vec![answer(
        "POST",
        PODS,
        503,
        serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "etcdserver: request timed out", "reason": "ServiceUnavailable", "code": 503}),
    )]);
    let at = Arc::new(example_at(None));
    h.store_unless_set(&at);
    // A window of four with one create of another At in it: the 503 cuts it to half the two
    // in flight, never below two.
    let window = h.ctx.writer.priority().window.clone();
    let (a, b) = (window.enter().await, window.enter().await);
    a.answered(slow_start::Reply::Answered);
    let other = window.enter().await;
    b.answered(slow_start::Reply::Answered);
    assert_eq!((window.window().open, window.window().in_flight), (4, 1));
    let error = reconcile(at.clone(), h.ctx.clone()).await.unwrap_err();
    assert!(matches!(error, Error::CreatePod { .. }));
    drop(other);
    assert_window(&h, slow_start::FIRST, 4, "503: overloaded, halved");
    let message = error.to_string();
    assert!(
        message.starts_with("At default/example-at: creating pod example-at-pod: "),
        "{message}"
    );
    assert!(
        message.contains("etcdserver: request timed out"),
        "{message}"
    );

    for _ in 0..3 {
        error_policy(at.clone(), &error, h.ctx.clone());
    }
    assert_eq!(
        h.ctx.scheduler.failures.lock().unwrap()["default/example-at"],
        3
    );
    let metrics = h.metrics.encode();
    assert!(
        metrics.contains("\ncnat_reconciles_total{result=\"error\"} 1\n"),
        "{metrics}"
    );
    assert!(!metrics.contains("result=\"ok\""), "{metrics}");
    assert!(
        metrics.contains("\ncnat_run_lateness_seconds_count 0\n"),
        "{metrics}"
    );
    h.finish(1).await;
}

#[tokio::test]
async fn a_failed_event_does_not_fail_the_reconcile() {
    let h = harness(vec![
        answer("POST", PODS, 201, pod_fixture(Some(AT_UID), None)),
        answer("PATCH", STATUS, 200, at_response(&running_status())),
        answer(
            "POST",
            EVENTS,
            403,
            serde_json::json!({"kind": "Status", "code": 403, "reason": "Forbidden", "message": "forbidden"}),
        ),
    ]);
    assert_eq!(
        h.reconcile(example_at(None)).await.unwrap(),
        Action::await_change()
    );
    assert_eq!(h.wakes_in(), None);
    h.finish(3).await;
}

#[test]
fn retry_delays_grow_from_half_a_second_to_five_minutes() {
    let delays: Vec<Duration> = (1..=20).map(scheduler::retry_delay).collect();
    // Jitter adds up to one more base delay on top of each.
    assert!(
        delays[0] >= Duration::from_millis(500) && delays[0] <= Duration::from_secs(1),
        "{delays:?}"
    );
    assert!(
        delays[3] >= Duration::from_secs(4) && delays[3] <= Duration::from_secs(8),
        "{delays:?}"
    );
    assert!(
        delays[19] >= Duration::from_secs(300) && delays[19] <= Duration::from_secs(600),
        "{delays:?}"
    );
}

#[tokio::test]
async fn success_resets_the_backoff() {
    let h = harness(vec![
        answer("POST", PODS, 201, pod_fixture(Some(AT_UID), None)),
        answer("PATCH", STATUS, 200, at_response(&running_status())),
        answer("POST", EVENTS, 201, created_event()),
    ]);
    h.ctx
        .scheduler
        .failures
        .lock()
        .unwrap()
        .insert(AtKey::new("default", "example-at"), 5);
    h.reconcile(example_at(None)).await.unwrap();
    // The pod was created, but the status write is still queued: until it is written, the
    // failures in a row stand (a write that fails again backs off further).
    let written = async {
        while !h.ctx.scheduler.failures.lock().unwrap().is_empty() {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), written)
        .await
        .expect("the backoff is reset once the status is written");
    h.finish(3).await;
}

#[tokio::test(start_paused = true)]
async fn a_queued_status_write_that_fails_again_counts_on() {
    let h = pod_created_then_status_write_fails();
    // Two failures in a row already (earlier writes of this status).
    h.ctx
        .scheduler
        .failures
        .lock()
        .unwrap()
        .insert(AtKey::new("default", "example-at"), 2);
    let mut reconcile_now = Box::pin(h.ctx.scheduler.reconcile_now().unwrap());
    h.reconcile(example_at(None)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), reconcile_now.next())
        .await
        .expect("retried")
        .unwrap();
    assert_eq!(
        h.ctx.scheduler.failures.lock().unwrap()["default/example-at"],
        3
    );
    drop(reconcile_now);
    h.finish(2).await;
}

/// A pod create that succeeds, then a status write that fails (503).
fn pod_created_then_status_write_fails() -> Harness {
    harness(vec![
        answer("POST", PODS, 201, pod_fixture(Some(AT_UID), None)),
        answer(
            "PATCH",
            STATUS,
            503,
            serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "etcdserver: request timed out", "reason": "ServiceUnavailable", "code": 503}),
        ),
    ])
}

#[tokio::test(start_paused = true)]
async fn the_requeue_is_shortened_by_the_time_the_reconcile_took() {
    use std::sync::atomic::{AtomicI64, Ordering};
    // Every look at the clock is 100 ms later than the one before.
    let ticks = AtomicI64::new(0);
    let clock: Clock = Arc::new(move || {
        let start = DateTime::parse_from_rfc3339(NOW).unwrap().to_utc();
        start + chrono::Duration::milliseconds(100 * ticks.fetch_add(1, Ordering::SeqCst))
    });
    let mut future = example_at(None);
    future.spec.schedule = "2026-11-22T02:10:42.5Z".into();
    let h = harness_at(
        vec![
            answer("PATCH", STATUS, 200, at_response(&running_status())),
            answer("POST", EVENTS, 201, created_event()),
        ],
        clock,
    );
    let action = h.reconcile(future).await.unwrap();
    assert_eq!(action, Action::await_change());
    assert_eq!(h.wakes_in(), Some(Duration::from_millis(42_400)));
    h.finish(2).await;
}

impl Harness {
    fn answered(&self) -> usize {
        self.answered.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[tokio::test(start_paused = true)]
async fn status_writes_after_a_pod_create_wait_until_no_pod_create_is_in_flight() {
    let status = running_status();
    let h = harness(vec![
        answer("POST", PODS, 201, pod_fixture(Some(AT_UID), None)),
        answer("PATCH", STATUS, 200, at_response(&status)),
        answer("POST", EVENTS, 201, created_event()),
    ]);
    // Another At's pod create is in flight while this one's pod is created.
    let other = h.ctx.writer.priority().creating.enter();
    assert_eq!(
        h.reconcile(example_at(None)).await.unwrap(),
        Action::await_change()
    );
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(h.answered(), 1, "only the pod create went out");
    // Until written, the version decided on is not acted on again.
    assert_eq!(
        h.reconcile(example_at(None)).await.unwrap(),
        Action::await_change()
    );
    assert_eq!(h.ctx.writer.priority().creating.in_flight(), 1);

    drop(other);
    let sent = h.finish(3).await;
    assert_status_patch(&sent[1], Phase::Running);
    assert_event(&sent[2], "Normal", "PodCreated");
}

#[tokio::test(start_paused = true)]
async fn a_failed_follow_up_write_is_retried_by_a_new_reconcile_after_backoff() {
    let h = pod_created_then_status_write_fails();
    let mut reconcile_now = Box::pin(h.ctx.scheduler.reconcile_now().unwrap());
    let started = tokio::time::Instant::now();
    h.reconcile(example_at(None)).await.unwrap();
    let again = tokio::time::timeout(Duration::from_secs(5), reconcile_now.next())
        .await
        .expect("a reconcile now")
        .unwrap();
    assert_eq!(again, ObjectRef::new("example-at").within("default"));
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(500) && waited <= Duration::from_secs(1),
        "backoff of a first failure: {waited:?}"
    );
    assert_eq!(
        h.ctx.scheduler.failures.lock().unwrap()["default/example-at"],
        1
    );
    // The cached version is no longer skipped: the next reconcile acts on it.
    assert_eq!(h.ctx.is_stale(&example_at(None)), None);
    drop(reconcile_now);
    h.finish(2).await;
}

#[tokio::test(start_paused = true)]
async fn an_at_that_got_no_answer_is_retried_as_soon_as_the_api_server_answers_again() {
    let h = harness(vec![
        answer("POST", PODS, NO_ANSWER, Value::Null),
        answer("GET", "/version", NO_ANSWER, Value::Null),
        answer("GET", "/version", NO_ANSWER, Value::Null),
        answer("GET", "/version", NO_ANSWER, Value::Null),
        answer(
            "GET",
            "/version",
            200,
            serde_json::json!({"major": "1", "minor": "24", "gitVersion": "v1.24.17", "gitCommit": "", "gitTreeState": "clean", "buildDate": "2023-08-24T00:00:00Z", "goVersion": "go1.20.7", "compiler": "gc", "platform": "linux/amd64"}),
        ),
    ]);
    let mut reconcile_now = Box::pin(h.ctx.scheduler.reconcile_now().unwrap());
    let probe = tokio::spawn(h.ctx.clone().look_again());
    // The outage has lasted: eight failures already, so the backoff is past a minute.
    h.ctx
        .scheduler
        .failures
        .lock()
        .unwrap()
        .insert(AtKey::new("default", "example-at"), 8);
    let at = Arc::new(example_at(None));
    h.store_unless_set(&at);
    let error = reconcile(at.clone(), h.ctx.clone()).await.unwrap_err();
    assert!(
        error.api_error().is_some_and(reachability::unanswered),
        "{error:?}"
    );
    let started = tokio::time::Instant::now();
    error_policy(at, &error, h.ctx.clone());
    // The ninth failure: the runtime's own retry comes after at least 128 s.
    assert_eq!(
        h.ctx.scheduler.failures.lock().unwrap()["default/example-at"],
        9
    );
    assert!(scheduler::retry_delay(9) >= Duration::from_secs(128));

    // Three probes go unanswered; the fourth answer brings the At back at once.
    let again = tokio::time::timeout(Duration::from_secs(60), reconcile_now.next())
        .await
        .expect("a retry when the server answered")
        .unwrap();
    assert_eq!(again, ObjectRef::new("example-at").within("default"));
    assert_eq!(started.elapsed(), reachability::PROBE_EVERY * 4);
    assert_eq!(h.ctx.scheduler.unreachable().waiting(), 0);
    probe.abort();
    let _ = probe.await;
    drop(reconcile_now);
    h.finish(5).await;
}

#[tokio::test]
async fn an_answer_that_refuses_is_not_an_outage() {
    let h = harness(vec![answer(
        "POST",
        PODS,
        500,
        fixture("status-500-webhook-unreachable-create.json"),
    )]);
    let at = Arc::new(example_at(None));
    h.store_unless_set(&at);
    let error = reconcile(at.clone(), h.ctx.clone()).await.unwrap_err();
    error_policy(at, &error, h.ctx.clone());
    assert_eq!(
        h.ctx.scheduler.unreachable().waiting(),
        0,
        "backs off instead"
    );
    h.finish(1).await;
}

#[tokio::test(start_paused = true)]
async fn an_at_due_while_its_pending_write_waits_gets_its_pod_without_waiting() {
    use std::sync::atomic::{AtomicI64, Ordering};
    let offset = Arc::new(AtomicI64::new(0));
    let clock: Clock = Arc::new({
        let offset = offset.clone();
        move || {
            DateTime::parse_from_rfc3339(NOW).unwrap().to_utc()
                + chrono::Duration::seconds(offset.load(Ordering::SeqCst))
        }
    });
    let mut future = example_at(None);
    future.spec.schedule = "2026-11-22T02:10:10Z".into();
    let h = harness_at(
        vec![
            answer("POST", PODS, 201, pod_fixture(Some(AT_UID), None)),
            answer("PATCH", STATUS, 200, at_response(&running_status())),
            answer(
                "PATCH",
                STATUS,
                409,
                fixture("status-409-conflict-stale-resourceversion.json"),
            ),
            answer("POST", EVENTS, 201, created_event()),
        ],
        clock,
    );
    // Other pods are being created: the PENDING write waits in the queue.
    let others = h.ctx.writer.priority().creating.enter();
    assert_eq!(
        h.reconcile(future.clone()).await.unwrap(),
        Action::await_change()
    );
    assert_eq!(h.wakes_in(), Some(Duration::from_secs(10)));
    // The version decided on is not acted on again while it is not due...
    assert_eq!(
        h.reconcile(future.clone()).await.unwrap(),
        Action::await_change()
    );
    assert_eq!(h.answered(), 0);
    // ...but once due, its pod is created at once.
    offset.store(11, Ordering::SeqCst);
    h.reconcile(future).await.unwrap();
    assert_eq!(h.answered(), 1);
    drop(others);
    let sent = h.finish(4).await;
    assert_eq!(
        (sent[0].method.as_str(), sent[0].path.as_str()),
        ("POST", PODS)
    );
}

#[tokio::test(start_paused = true)]
async fn events_wait_until_no_status_write_is_queued_but_at_most_two_seconds() {
    let mut future = example_at(None);
    future.spec.schedule = "2026-11-22T02:10:42.5Z".into();
    let h = harness(vec![
        answer("PATCH", STATUS, 200, at_response(&running_status())),
        answer("POST", EVENTS, 201, created_event()),
    ]);
    // Another At's status write is queued (and stays: writes that never pause).
    let other = h.ctx.writer.priority().writing.enter();
    h.reconcile(future).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1900)).await;
    assert_eq!(
        h.answered(),
        1,
        "the status write went out, its event waits"
    );
    // Not for ever: late, never lost.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(h.answered(), 2, "the event went out after 2 s");
    drop(other);
    let sent = h.finish(2).await;
    assert_status_patch(&sent[0], Phase::Pending);
    assert_event(&sent[1], "Normal", "Scheduled");
}

/// Entries kept per At: backoffs, last writes, wake-ups.
fn kept(ctx: &Context) -> (usize, usize, usize) {
    let (failures, wakeups) = ctx.scheduler.kept();
    (failures, ctx.calls.ledger.kept(), wakeups)
}

#[tokio::test]
async fn a_deleted_at_leaves_nothing_behind_in_the_leader_s_maps() {
    let h = harness(vec![]);
    let at = example_at(None);
    let at_ref = AtKey::from(&at);
    // A failure's backoff, a write's record, a wakeup: all kept per At.
    let ledger = &h.ctx.calls.ledger;
    h.ctx.scheduler.failed(&at_ref);
    ledger.written(
        at_ref.clone(),
        at.resource_version().unwrap(),
        Phase::Pending,
    );
    h.ctx.scheduler.wakeups().set(
        at_ref.clone(),
        tokio::time::Instant::now() + Duration::from_secs(3600),
    );
    assert_eq!(kept(&h.ctx), (1, 1, 1));
    h.ctx.forget(&at_ref);
    assert_eq!(kept(&h.ctx), (0, 0, 0));

    // Deletions a relist did not report one by one: only Ats still known keep their entries.
    let mut other = example_at(None);
    other.metadata.name = Some("other".into());
    for at in [&at, &other] {
        h.ctx.scheduler.failed(&AtKey::from(at));
        h.ctx.scheduler.wakeups().set(
            AtKey::from(at),
            tokio::time::Instant::now() + Duration::from_secs(3600),
        );
        // Known to the ledger only by a PENDING write (its write record gone: unwritten).
        ledger.pending_written(&AtKey::from(at), "7");
    }
    h.ctx.forget_all_but(|known| known.name() == "other");
    assert_eq!(kept(&h.ctx), (1, 0, 1));
    assert!(!ledger.pending_confirmed(&at_ref, Some("7")), "forgotten");
    assert!(
        ledger.pending_confirmed(&AtKey::from(&other), Some("7")),
        "kept"
    );
    h.finish(0).await;
}

/// kube-apiserver v1.24 with CEL validation on answers some concurrent status writes 422 with an
/// internal error from evaluating the CRD's transition rule (seen on the real server): that is
/// no verdict on the At, so the write is retried, not given up as for an out-of-range spec.
#[tokio::test(start_paused = true)]
async fn a_422_from_the_cel_rule_s_internal_error_is_retried() {
    let h = harness(vec![
        answer("POST", PODS, 201, pod_fixture(Some(AT_UID), None)),
        answer(
            "PATCH",
            STATUS,
            422,
            serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 422, "reason": "Invalid",
                "message": "At.cnat.programming-kubernetes.info \"example-at\" is invalid: status: Invalid value: \"object\": internal error: runtime error: index out of range [4] with length 3 evaluating rule: status.phase cannot go back"}),
        ),
    ]);
    let mut reconcile_now = Box::pin(h.ctx.scheduler.reconcile_now().unwrap());
    h.reconcile(example_at(None)).await.unwrap();
    let again = tokio::time::timeout(Duration::from_secs(5), reconcile_now.next())
        .await
        .expect("retried")
        .unwrap();
    assert_eq!(again, ObjectRef::new("example-at").within("default"));
    assert_eq!(
        h.ctx.scheduler.failures.lock().unwrap()["default/example-at"],
        1
    );
    // Counted as failed (retried), not refused.
    let metrics = h.metrics.encode();
    for (result, count) in [("failed", 1), ("refused", 0), ("written", 0)] {
        let series = format!(r#"cnat_status_writes_total{{phase="RUNNING",result="{result}"}} "#);
        assert!(metrics.contains(&format!("{series}{count}\n")), "{metrics}");
    }
    drop(reconcile_now);
    h.finish(2).await;
}

/// `reconcile_now` hands kube-runtime at most `backlog::LIMIT` Ats whose reconcile has not
/// started; one more for each that starts, and for each request the runtime dropped (its At
/// gone), not for a deletion alone (its request is still in the runtime).
#[tokio::test(start_paused = true)]
async fn reconciles_now_wait_for_room_in_the_backlog_which_starts_and_dropped_requests_make() {
    let h = harness(vec![]);
    let mut reconcile_now = h.ctx.scheduler.reconcile_now().unwrap().boxed();
    let key = |i: usize| AtKey::new("default", &format!("at-{i}"));
    for i in 0..backlog::LIMIT + 3 {
        h.ctx.scheduler.wake_up(key(i));
    }
    let mut handed = Vec::new();
    while let Ok(Some(at)) =
        tokio::time::timeout(Duration::from_millis(1), reconcile_now.next()).await
    {
        handed.push(at);
    }
    assert_eq!(handed.len(), backlog::LIMIT);
    let wait = Duration::from_millis(1);
    let full = tokio::time::timeout(wait, reconcile_now.next()).await;
    assert!(full.is_err(), "the backlog is full");
    let running = h.ctx.scheduler.reconcile_starts(&key(0));
    let next = tokio::time::timeout(wait, reconcile_now.next()).await;
    assert_eq!(next.unwrap(), Some(key(backlog::LIMIT)));
    drop(running);
    h.ctx.forget(&key(1));
    let full = tokio::time::timeout(wait, reconcile_now.next()).await;
    assert!(full.is_err(), "a deletion alone makes no room");
    h.ctx.scheduler.request_dropped(&key(1));
    let next = tokio::time::timeout(wait, reconcile_now.next()).await;
    assert_eq!(next.unwrap(), Some(key(backlog::LIMIT + 1)));
    let full = tokio::time::timeout(wait, reconcile_now.next()).await;
    assert!(full.is_err(), "the backlog is full again");
    drop(reconcile_now);
    h.finish(0).await;
}

/// The example At named `name`, due at `due`, as a leader at `start` left it: PENDING with its
/// status written.
fn settled_at(name: &str, due: DateTime<Utc>, start: DateTime<Utc>) -> At {
    let mut at = example_at(None);
    at.metadata.name = Some(name.into());
    at.spec.schedule = due.to_rfc3339();
    let decided = decide(
        &at,
        &PodObservation::NotCached,
        start,
        &RunPolicy::default(),
    );
    at.status = decided.status;
    at
}

/// A wall clock at `start` that the test sets, and the cache of `ats` a look-ahead reads.
fn set_clock_and_cache(
    start: DateTime<Utc>,
    ats: &[&At],
) -> (
    Arc<std::sync::Mutex<DateTime<Utc>>>,
    Clock,
    Store<crate::operator::cache::CachedAt>,
) {
    let now = Arc::new(std::sync::Mutex::new(start));
    let clock: Clock = Arc::new({
        let now = now.clone();
        move || *now.lock().unwrap()
    });
    let (store, mut writer) = reflector::store();
    for at in ats {
        let cached = crate::operator::cache::CachedAt::from((*at).clone());
        writer.apply_watcher_event(&watcher::Event::Apply(cached));
    }
    (now, clock, store)
}

/// An At due beyond the wake-up index's horizon waits in no index (its cached form is all it
/// costs) until a look-ahead finds its time within the horizon, to the instant; a DONE At's TTL
/// likewise. Ats with nothing left to do stay out, and the look-ahead reconciles nothing itself.
#[tokio::test(start_paused = true)]
async fn the_look_ahead_indexes_an_at_once_its_time_comes_within_the_horizon() {
    use crate::operator::reconcile::wakeups::{HORIZON, LOOK_AHEAD_EVERY};
    use crate::operator::triggers::look_ahead_once;
    let start = DateTime::parse_from_rfc3339(NOW).unwrap().to_utc();
    let hours = |n: i64| chrono::Duration::minutes(n * 60);
    let far = settled_at("far", start + hours(3), start);
    let soon = settled_at("soon", start + chrono::Duration::minutes(30), start);
    // DONE an hour ago.
    let finished = |name: &str, ttl: Option<i32>| {
        let mut at = settled_at(name, start - hours(2), start);
        at.spec.ttl_seconds_after_finished = ttl;
        at.status = Some(AtStatus {
            phase: Phase::Done,
            completion_time: Some(start - hours(1)),
            ..AtStatus::default()
        });
        at
    };
    // Deleted 4 h after it finished, 3 h from now.
    let expiring = finished("expiring", Some(4 * 3600));
    let done = finished("done", None);
    let all = [&far, &soon, &expiring, &done];
    let (now, clock, store) = set_clock_and_cache(start, &all);
    let h = harness_at(vec![], clock);
    let mut reconcile_now = Box::pin(h.ctx.scheduler.reconcile_now().unwrap());
    // As the watch brings them: only the At due within the hour gets an entry.
    for at in all {
        assert!(!h.ctx.needs_reconcile(at), "{:?}", at.metadata.name);
    }
    let [far_key, soon_key, expiring_key, done_key] = all.map(AtKey::from);
    let t0 = tokio::time::Instant::now();
    assert_eq!(h.ctx.scheduler.wakeups().when(&far_key), None);
    assert_eq!(h.ctx.scheduler.wakeups().when(&expiring_key), None);
    assert_eq!(
        h.ctx.scheduler.wakeups().when(&soon_key),
        Some(t0 + Duration::from_secs(1800))
    );
    assert_eq!(h.ctx.scheduler.wakeups().len(), 1);
    let hour = chrono::Duration::from_std(HORIZON).unwrap();
    look_ahead_once(&h.ctx, &store, start + hour).await;
    assert_eq!(
        h.ctx.scheduler.wakeups().len(),
        1,
        "nothing new within the hour"
    );

    // Two and a half hours later: `far` and `expiring` are within the hour and get their
    // entries, to the instant. `soon` is overdue, its entry taken (its reconcile is on its way):
    // the look-ahead leaves it alone.
    h.ctx.scheduler.wakeups().clear(&soon_key);
    tokio::time::advance(LOOK_AHEAD_EVERY * 5).await;
    let later = start + chrono::Duration::from_std(LOOK_AHEAD_EVERY * 5).unwrap();
    *now.lock().unwrap() = later;
    look_ahead_once(&h.ctx, &store, later + hour).await;
    let t1 = tokio::time::Instant::now();
    let in_half_an_hour = t1 + Duration::from_secs(1800);
    assert_eq!(
        h.ctx.scheduler.wakeups().when(&far_key),
        Some(in_half_an_hour)
    );
    assert_eq!(
        h.ctx.scheduler.wakeups().when(&expiring_key),
        Some(in_half_an_hour)
    );
    assert_eq!(h.ctx.scheduler.wakeups().when(&soon_key), None);
    assert_eq!(h.ctx.scheduler.wakeups().when(&done_key), None);
    assert_eq!(h.ctx.scheduler.wakeups().len(), 2);
    let none = tokio::time::timeout(Duration::from_millis(10), reconcile_now.next()).await;
    assert!(none.is_err(), "the look-ahead reconciles nothing: {none:?}");
    h.finish(0).await;
}

/// The look-ahead runs every `LOOK_AHEAD_EVERY`, the first time that long after it starts; when
/// the wall clock jumped past the horizon it last covered, it looks at every At instead, so an
/// At that fell due outside the index is reconciled.
#[tokio::test(start_paused = true)]
async fn the_look_ahead_runs_every_half_hour_and_after_a_clock_jump_looks_at_every_at() {
    use crate::operator::reconcile::wakeups::LOOK_AHEAD_EVERY;
    let start = DateTime::parse_from_rfc3339(NOW).unwrap().to_utc();
    let minutes = chrono::Duration::minutes;
    let first = settled_at("first", start + minutes(80), start);
    let second = settled_at("second", start + minutes(110), start);
    let jumped = settled_at("jumped", start + minutes(200), start);
    let (now, clock, store) = set_clock_and_cache(start, &[&first, &second, &jumped]);
    let h = harness_at(vec![], clock);
    h.wakeups.abort();
    let mut reconcile_now = Box::pin(h.ctx.scheduler.reconcile_now().unwrap());
    let looking = tokio::spawn({
        let (ctx, store) = (h.ctx.clone(), store.clone());
        async move { crate::operator::triggers::look_ahead(&ctx, &store).await }
    });
    let [first, second, jumped] = [&first, &second, &jumped].map(AtKey::from);
    let t0 = tokio::time::Instant::now();
    let step = |n: u32| {
        let now = now.clone();
        async move {
            // The wall clock keeps pace with tokio's.
            tokio::time::sleep(LOOK_AHEAD_EVERY * n - Duration::from_secs(1)).await;
            *now.lock().unwrap() += chrono::Duration::from_std(LOOK_AHEAD_EVERY * n).unwrap();
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    };
    // At 30 minutes: `first` (due at 80) is within the hour, `second` (110) not yet.
    step(1).await;
    assert_eq!(
        h.ctx.scheduler.wakeups().when(&first),
        Some(t0 + Duration::from_secs(80 * 60))
    );
    assert_eq!(h.ctx.scheduler.wakeups().when(&second), None);
    // At 60: `second` too.
    step(1).await;
    assert_eq!(
        h.ctx.scheduler.wakeups().when(&second),
        Some(t0 + Duration::from_secs(110 * 60))
    );
    assert_eq!(h.ctx.scheduler.wakeups().when(&jumped), None);
    let none = tokio::time::timeout(Duration::from_millis(10), reconcile_now.next()).await;
    assert!(none.is_err(), "nothing reconciled: {none:?}");
    // The wall clock jumps ahead by three hours (say, the clock was set): at the next look,
    // at 90 minutes by tokio's clock, `jumped` (due at 200) is overdue and no index holds it.
    *now.lock().unwrap() += minutes(180);
    step(1).await;
    let mut woken = Vec::new();
    while let Ok(Some(at)) =
        tokio::time::timeout(Duration::from_millis(10), reconcile_now.next()).await
    {
        woken.push(at);
    }
    assert!(woken.contains(&jumped), "{woken:?}");
    looking.abort();
    h.finish(0).await;
}

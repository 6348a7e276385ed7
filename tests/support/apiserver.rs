//! A small, stateful stand-in for kube-apiserver, enough to run cnat's real controller: list and
//! watch (with resourceVersion replay and label selectors), create, get, delete, and JSON merge
//! patches of `ats/status` and events with resourceVersion preconditions. Error bodies are the
//! Status objects captured from a real v1.24 apiserver (tests/fixtures/api-k8s-1.24).
//!
//! It serves in-process (`client()`) or over plain HTTP/1.1 (`serve_http()`) for the real binary.

#![allow(dead_code)] // each test binary uses a different part of it

use bytes::Bytes;
use futures::{stream, Stream, StreamExt};
use http::{Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::broadcast;

type Body = BoxBody<Bytes, Infallible>;

/// Writes a real API server admits at once from one client's point of view.
pub const WRITES_IN_FLIGHT: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource {
    Ats,
    Pods,
    Events,
    Leases,
    /// The Secret with cnat's pod signing key.
    Secrets,
    /// authorization.k8s.io/v1 SubjectAccessReviews (POST only, answered, never stored).
    AccessReviews,
}

impl Resource {
    fn api_version(self) -> &'static str {
        match self {
            Resource::Ats => "cnat.programming-kubernetes.info/v1",
            Resource::Pods => "v1",
            Resource::Events => "events.k8s.io/v1",
            Resource::Leases => "coordination.k8s.io/v1",
            Resource::Secrets => "v1",
            Resource::AccessReviews => "authorization.k8s.io/v1",
        }
    }

    fn plural(self) -> &'static str {
        match self {
            Resource::Ats => "ats",
            Resource::Pods => "pods",
            Resource::Events => "events",
            Resource::Leases => "leases",
            Resource::Secrets => "secrets",
            Resource::AccessReviews => "subjectaccessreviews",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Resource::Ats => "At",
            Resource::Pods => "Pod",
            Resource::Events => "Event",
            Resource::Leases => "Lease",
            Resource::Secrets => "Secret",
            Resource::AccessReviews => "SubjectAccessReview",
        }
    }
}

#[derive(Clone, Debug)]
struct Change {
    rv: u64,
    resource: Resource,
    type_: &'static str,
    object: Value,
}

type Key = (Resource, String, String);

#[derive(Default)]
struct State {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    log: Vec<Change>,
    /// Requests served, as "METHOD resource[/subresource]", e.g. "PATCH ats/status".
    requests: Vec<String>,
    /// Each request's "METHOD resource[/sub]" and query string, in order.
    queries: Vec<(String, String)>,
    /// When each pod was created, for lateness measurements.
    pod_created: BTreeMap<(String, String), Instant>,
    /// When each At's status first said `Done`.
    at_done: BTreeMap<(String, String), Instant>,
    /// Requests by named clients: who, "METHOD resource[/subresource]", and when (tokio time,
    /// so paused-time tests read virtual time).
    calls: Vec<(String, String, tokio::time::Instant)>,
    /// Lease merge patches refused because they carried no `metadata.resourceVersion`.
    unguarded_lease_writes: usize,
    /// How long each request takes before the server acts on it.
    latency: Duration,
    /// How long the storage spends on each write (POST, PATCH, DELETE); zero: writes are free.
    write_cost: Duration,
    /// When the storage is free for the next write.
    storage_free: Option<tokio::time::Instant>,
    /// How much longer a list (not a watch, nor one by name) takes, as for a large collection.
    list_latency: Duration,
    /// Creations of these resources are refused with this captured Status (e.g. a 403 quota).
    refusals: BTreeMap<Resource, Value>,
    /// Lists (not watches) of these resources fail: 500 with this message.
    failing_lists: BTreeMap<Resource, String>,
    /// (user, namespace) pairs a SubjectAccessReview says may not create pods.
    no_pods: std::collections::BTreeSet<(String, String)>,
    /// Watches of a resource that resume from a resourceVersion below this get 410 Expired.
    compacted: BTreeMap<Resource, u64>,
    /// Watches are ended quietly and a watch from a compacted version is refused with the
    /// answer's status 410 (not an ERROR event in a 200 answer), as an API server may.
    expire_by_status: bool,
    /// Watches with `sendInitialEvents=true` are streaming lists, as on kube-apiserver 1.34+;
    /// otherwise refused, as by v1.24.
    streams_lists: bool,
    /// What each pod's container wrote (`pods/NAME/log`).
    pod_logs: BTreeMap<(String, String), String>,
}

/// The fake API server; clones share state.
#[derive(Clone)]
pub struct ApiServer {
    state: Arc<Mutex<State>>,
    changes: broadcast::Sender<Change>,
    /// Writes in flight at once (kube-apiserver's in-flight limit, as seen by one client).
    in_flight: Arc<tokio::sync::Semaphore>,
    /// While true, the HTTP server is down: connections are dropped without an answer.
    down: Arc<tokio::sync::watch::Sender<bool>>,
    /// While true, At status writes wait before the server acts on them (a slow write).
    status_held: Arc<tokio::sync::watch::Sender<bool>>,
    events_held: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Default for ApiServer {
    fn default() -> Self {
        Self::new()
    }
}

impl ApiServer {
    pub fn new() -> Self {
        let (changes, _) = broadcast::channel(1 << 16);
        ApiServer {
            state: Arc::default(),
            changes,
            in_flight: Arc::new(tokio::sync::Semaphore::new(WRITES_IN_FLIGHT)),
            down: Arc::new(tokio::sync::watch::Sender::new(false)),
            status_held: Arc::new(tokio::sync::watch::Sender::new(false)),
            events_held: Arc::new(tokio::sync::watch::Sender::new(false)),
        }
    }

    /// While `held`, At status writes wait (unanswered) before the server acts on them.
    pub fn hold_status_writes(&self, held: bool) {
        self.status_held.send_replace(held);
    }

    /// While `held`, every Event request waits (unanswered) before the server acts on it.
    pub fn hold_events(&self, held: bool) {
        self.events_held.send_replace(held);
    }

    /// A kube client talking to this server in-process.
    pub fn client(&self) -> kube::Client {
        let server = self.clone();
        let service = tower::service_fn(move |request: Request<kube::client::Body>| {
            let server = server.clone();
            async move { Ok::<_, Infallible>(server.handle(request).await) }
        });
        kube::Client::new(service, "default")
    }

    /// A client whose network to this server can be cut: requests then hang, as in a partition.
    pub fn partitionable_client(&self) -> (kube::Client, Partition) {
        self.named_client("")
    }

    /// A partitionable client whose requests are recorded under `name` (see `calls_by`).
    pub fn named_client(&self, name: &str) -> (kube::Client, Partition) {
        let partition = Partition::default();
        let (server, cut, name) = (self.clone(), partition.clone(), name.to_owned());
        let service = tower::service_fn(move |request: Request<kube::client::Body>| {
            let (server, cut, name) = (server.clone(), cut.clone(), name.clone());
            async move {
                if cut.is_cut() {
                    std::future::pending::<()>().await;
                }
                Ok::<_, Infallible>(server.handle_as(&name, request).await)
            }
        });
        (kube::Client::new(service, "default"), partition)
    }

    /// Every request takes `latency` before the server acts on it (tokio time: virtual under
    /// paused time).
    pub fn set_latency(&self, latency: Duration) {
        self.lock().latency = latency;
    }

    /// Creating `resource` is refused with the captured Status in `fixture` (None: allowed again).
    pub fn refuse_creates(&self, resource: Resource, fixture_file: Option<&str>) {
        let mut state = self.lock();
        match fixture_file {
            Some(file) => state.refusals.insert(resource, fixture(file)),
            None => state.refusals.remove(&resource),
        };
    }

    /// Lists of `resource` (not watches, not reads by name) fail with 500 and `message`, as a
    /// real server's list fails when it cannot convert (`None`: they work again).
    pub fn fail_lists(&self, resource: Resource, message: Option<&str>) {
        let mut state = self.lock();
        match message {
            Some(message) => state.failing_lists.insert(resource, message.to_owned()),
            None => state.failing_lists.remove(&resource),
        };
    }

    /// SubjectAccessReviews answer that `user` may not create pods in `namespace` (the captured
    /// denial); everyone else may.
    pub fn deny_pods(&self, user: &str, namespace: &str) {
        self.lock().no_pods.insert((user.into(), namespace.into()));
    }

    /// Removes an object without telling watchers, as when it goes while a watch is down.
    pub fn vanish(&self, resource: Resource, ns: &str, name: &str) {
        self.lock()
            .objects
            .remove(&(resource, ns.into(), name.into()));
    }

    /// Changes an object at a new resourceVersion without telling watchers, as when it changes
    /// while a watch is down.
    pub fn change_unseen(
        &self,
        resource: Resource,
        ns: &str,
        name: &str,
        change: impl FnOnce(&mut Value),
    ) {
        changed(&mut self.lock(), resource, ns, name, change);
    }

    /// Ends the open watches of `resource` with 410 Expired and forgets the history, as etcd
    /// compaction does: those watchers must re-list, and learn of nothing that vanished meanwhile.
    pub fn expire_watches(&self, resource: Resource) {
        let mut state = self.lock();
        // A watch from the current version (what a list now answers) is fine; older is gone.
        let now = state.rv;
        state.compacted.insert(resource, now);
        // With `expire_by_status`, they end without a word: their watchers resume, from a
        // version now compacted.
        let (type_, object) = if state.expire_by_status {
            ("END", Value::Null)
        } else {
            ("ERROR", expired())
        };
        let _ = self.changes.send(Change {
            rv: u64::MAX,
            resource,
            type_,
            object,
        });
    }

    /// From now on watches with `sendInitialEvents=true` are streaming lists (as on
    /// kube-apiserver 1.34 and later): every object as ADDED at the current version, then the
    /// bookmark that ends them, then the changes after.
    pub fn streams_lists(&self) {
        self.lock().streams_lists = true;
    }

    /// From now on `expire_watches` ends the watches quietly, and a watch resumed from a
    /// compacted version gets 410 as the answer's status.
    pub fn expire_by_status(&self) {
        self.lock().expire_by_status = true;
    }

    /// Makes writes cost what they cost on a real API server: each write (POST, PATCH, DELETE)
    /// holds the one storage lane for `cost`, with at most `WRITES_IN_FLIGHT` writes admitted
    /// at once. Calibrated with `cost` = 2 ms: 1000 pod creates over 8 connections take about
    /// 2 s, as on kube-apiserver v1.24 + etcd on this 2-core machine.
    pub fn set_write_cost(&self, cost: Duration) {
        self.lock().write_cost = cost;
    }

    /// Lists (not watches) take `extra` longer, as listing many thousands of objects does.
    pub fn set_list_latency(&self, extra: Duration) {
        self.lock().list_latency = extra;
    }

    /// Requests `name`'s client (`http` for every request over `serve_http`) made, as ("METHOD resource[/sub]", when), in order.
    pub fn calls_by(&self, name: &str) -> Vec<(String, tokio::time::Instant)> {
        self.lock()
            .calls
            .iter()
            .filter(|(who, _, _)| who == name)
            .map(|(_, what, at)| (what.clone(), *at))
            .collect()
    }

    /// Lease merge patches refused for carrying no `metadata.resourceVersion` precondition.
    pub fn unguarded_lease_writes(&self) -> usize {
        self.lock().unguarded_lease_writes
    }

    /// Replaces the Lease's spec as another writer would (a new resourceVersion, watchers told).
    pub fn set_lease_spec(&self, ns: &str, name: &str, spec: Value) {
        self.update(Resource::Leases, ns, name, |lease| lease["spec"] = spec);
    }

    /// Serves plain HTTP/1.1 on 127.0.0.1; returns the address. Stops with the runtime.
    pub async fn serve_http(&self) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = self.clone();
        tokio::spawn(async move {
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    continue;
                };
                if *server.down.borrow() {
                    continue; // dropped: the client sees its connection closed unanswered
                }
                // As Go servers (kube-apiserver) do: no Nagle delay on small watch frames.
                let _ = socket.set_nodelay(true);
                let server = server.clone();
                tokio::spawn(async move {
                    let mut down = server.down.subscribe();
                    let service = hyper::service::service_fn(move |request| {
                        let server = server.clone();
                        async move { Ok::<_, Infallible>(server.handle_as("http", request).await) }
                    });
                    let io = hyper_util::rt::TokioIo::new(socket);
                    let connection =
                        hyper::server::conn::http1::Builder::new().serve_connection(io, service);
                    // Going down drops every connection, watches and requests in flight too.
                    tokio::select! {
                        _ = connection => {}
                        _ = down.wait_for(|d| *d) => {}
                    }
                });
            }
        });
        addr
    }

    /// Takes the HTTP server down (every connection dropped, new ones closed unanswered, as
    /// when kube-apiserver is killed) or brings it back up. State is kept, as etcd keeps it.
    pub fn set_down(&self, down: bool) {
        self.down.send_replace(down);
    }

    /// A kubeconfig for a client of `serve_http()` at `addr`, whose context namespace is `namespace`.
    pub fn kubeconfig(addr: std::net::SocketAddr, namespace: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{addr}\nusers:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: {namespace}\ncurrent-context: fake\n"
        )
    }

    // ---- what tests do directly, as a user or the kubelet would ----

    /// Creates an object as a user would (generation 1; an At without a status shows the schema
    /// default, `Pending`). Unlike a create over HTTP (`kubectl create`), a status given here is
    /// kept, as if an earlier leader had written it.
    pub fn create(&self, resource: Resource, object: Value) -> Value {
        self.insert(resource, object).expect("new object")
    }

    pub fn get(&self, resource: Resource, ns: &str, name: &str) -> Option<Value> {
        self.lock()
            .objects
            .get(&(resource, ns.into(), name.into()))
            .cloned()
    }

    pub fn list(&self, resource: Resource) -> Vec<Value> {
        let state = self.lock();
        state
            .objects
            .iter()
            .filter(|(k, _)| k.0 == resource)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// The kubelet's part: the pod's container exits with `exit_code`.
    pub fn finish_pod(&self, ns: &str, name: &str, exit_code: i32) {
        let phase = if exit_code == 0 {
            "Succeeded"
        } else {
            "Failed"
        };
        let reason = if exit_code == 0 { "Completed" } else { "Error" };
        self.update(Resource::Pods, ns, name, |pod| {
            pod["status"] = json!({
                "phase": phase,
                "containerStatuses": [{
                    "name": "command", "image": "busybox", "imageID": "", "ready": false,
                    "restartCount": 0,
                    "state": {"terminated": {"exitCode": exit_code, "reason": reason,
                              "finishedAt": now_rfc3339()}},
                }],
            });
        });
    }

    /// Deletes `ns/name` as a real server does: an object with finalizers only gets a
    /// `deletionTimestamp` and stays until a write removes its last finalizer.
    pub fn delete(&self, resource: Resource, ns: &str, name: &str) {
        let mut state = self.lock();
        let key = (resource, ns.to_owned(), name.to_owned());
        let Some(object) = state.objects.get(&key).cloned() else {
            return;
        };
        let finalized = object["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        if !finalized {
            state.objects.remove(&key);
            self.record(&mut state, resource, "DELETED", object);
        } else if object["metadata"]["deletionTimestamp"].is_null() {
            let mut terminating = object;
            terminating["metadata"]["deletionTimestamp"] = now_rfc3339().into();
            self.record(&mut state, resource, "MODIFIED", terminating);
        }
    }

    /// The output pod `ns/name`'s container wrote, served at `pods/NAME/log`; until set, the
    /// container is still starting.
    pub fn set_pod_log(&self, ns: &str, name: &str, text: &str) {
        self.lock()
            .pod_logs
            .insert((ns.into(), name.into()), text.into());
    }

    /// `GET pods/NAME/log`: the text as kube-apiserver sends it (the whole log, then the end of
    /// the stream once the container has ended), 400 while the container is starting and 404
    /// when there is no such pod, with kubelet's and kube-apiserver's messages.
    fn pod_log(&self, ns: &str, name: &str) -> Response<Body> {
        if self.get(Resource::Pods, ns, name).is_none() {
            return not_found(Resource::Pods, name);
        }
        match self.lock().pod_logs.get(&(ns.to_owned(), name.to_owned())) {
            Some(text) => Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "text/plain")
                .body(Full::new(Bytes::from(text.clone())).boxed())
                .unwrap(),
            None => status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &format!(
                    "container \"at\" in pod \"{name}\" is waiting to start: ContainerCreating"
                ),
                None,
            ),
        }
    }

    /// How many requests matched `what`, e.g. "POST pods" or "PATCH ats/status".
    pub fn count(&self, what: &str) -> usize {
        self.lock()
            .requests
            .iter()
            .filter(|r| r.as_str() == what)
            .count()
    }

    /// Reasons of the events about `name`, in order.
    /// The reasons of the events about `name`, once there are at least `n` (events follow
    /// status writes in the background) or after 10 s.
    pub async fn told(&self, name: &str, n: usize) -> Vec<String> {
        self.wait_for(Duration::from_secs(10), |s| {
            s.event_reasons(name).len() >= n
        })
        .await;
        self.event_reasons(name)
    }

    pub fn event_reasons(&self, name: &str) -> Vec<String> {
        let mut events: Vec<Value> = self
            .list(Resource::Events)
            .into_iter()
            .filter(|e| e["regarding"]["name"] == name)
            .collect();
        events.sort_by_key(|e| {
            e["metadata"]["resourceVersion"]
                .as_str()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        });
        events
            .iter()
            .map(|e| e["reason"].as_str().unwrap().to_owned())
            .collect()
    }

    /// The query strings of the requests `what` ("METHOD resource[/sub]"), in order.
    pub fn queries(&self, what: &str) -> Vec<String> {
        let state = self.lock();
        let asked = state.queries.iter().filter(|(w, _)| w == what);
        asked.map(|(_, query)| query.clone()).collect()
    }

    pub fn requests(&self) -> Vec<String> {
        self.lock().requests.clone()
    }

    pub fn pod_created_at(&self, ns: &str, name: &str) -> Option<Instant> {
        self.lock()
            .pod_created
            .get(&(ns.into(), name.into()))
            .copied()
    }

    pub fn at_done_at(&self, ns: &str, name: &str) -> Option<Instant> {
        self.lock().at_done.get(&(ns.into(), name.into())).copied()
    }

    /// Polls `check` after every change until it holds or `timeout` passes.
    pub async fn wait_for(&self, timeout: Duration, mut check: impl FnMut(&Self) -> bool) -> bool {
        let mut changes = self.changes.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if check(self) {
                return true;
            }
            if tokio::time::timeout_at(deadline, changes.recv())
                .await
                .is_err()
            {
                return check(self);
            }
        }
    }

    // ---- HTTP ----

    async fn handle<B>(&self, request: Request<B>) -> Response<Body>
    where
        B: http_body::Body,
        B::Error: std::fmt::Debug,
    {
        self.handle_as("", request).await
    }

    async fn handle_as<B>(&self, client: &str, request: Request<B>) -> Response<Body>
    where
        B: http_body::Body,
        B::Error: std::fmt::Debug,
    {
        let (parts, body) = request.into_parts();
        let bytes = body.collect().await.unwrap().to_bytes();
        let query: BTreeMap<String, String> =
            form_urlencoded::parse(parts.uri.query().unwrap_or("").as_bytes())
                .into_owned()
                .collect();
        let Some(route) = Route::parse(parts.uri.path()) else {
            return status(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("no route {}", parts.uri.path()),
                None,
            );
        };
        let sub = route
            .subresource
            .as_deref()
            .map(|s| format!("/{s}"))
            .unwrap_or_default();
        let resource_name = route.resource.plural();
        let what = format!("{} {resource_name}{sub}", parts.method);
        {
            let mut state = self.lock();
            state.requests.push(what.clone());
            let asked = (what.clone(), parts.uri.query().unwrap_or("").to_owned());
            state.queries.push(asked);
            if !client.is_empty() {
                let call = (client.to_owned(), what, tokio::time::Instant::now());
                state.calls.push(call);
            }
        }
        if route.resource == Resource::Ats && route.subresource.as_deref() == Some("status") {
            let mut held = self.status_held.subscribe();
            let _ = held.wait_for(|held| !held).await;
        }
        if route.resource == Resource::Events {
            let mut held = self.events_held.subscribe();
            let _ = held.wait_for(|held| !held).await;
        }
        // A write waits for admission and for the storage, as on a real server.
        let write_cost = self.lock().write_cost;
        let _admitted = if !write_cost.is_zero() && parts.method != Method::GET {
            let admitted = self.in_flight.clone().acquire_owned().await.ok();
            // One write after another in the storage, each `write_cost` long: booked on a
            // timeline, so timer granularity does not stretch the cost.
            let done = {
                let mut state = self.lock();
                let now = tokio::time::Instant::now();
                let start = state.storage_free.map_or(now, |free| free.max(now));
                state.storage_free = Some(start + write_cost);
                start + write_cost
            };
            tokio::time::sleep_until(done).await;
            admitted
        } else {
            None
        };
        // Recorded when sent; acted on after the latency.
        let is_watch = query.get("watch").is_some_and(|w| w == "true" || w == "1");
        let is_list = parts.method == Method::GET
            && route.name.is_none()
            && !is_watch
            && !query.contains_key("fieldSelector");
        let latency = {
            let state = self.lock();
            state.latency
                + if is_list {
                    state.list_latency
                } else {
                    Duration::ZERO
                }
        };
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }

        match (&parts.method, &route.name) {
            (&Method::GET, None) if query.get("watch").is_some_and(|w| w == "true" || w == "1") => {
                self.watch(&route, &query)
            }
            (&Method::GET, None) if self.lock().failing_lists.contains_key(&route.resource) => {
                let message = self.lock().failing_lists[&route.resource].clone();
                status(StatusCode::INTERNAL_SERVER_ERROR, "", &message, None)
            }
            (&Method::GET, None) => self.list_response(&route, &query),
            (&Method::GET, Some(name))
                if route.resource == Resource::Pods
                    && route.subresource.as_deref() == Some("log") =>
            {
                self.pod_log(&route.ns(), name)
            }
            (&Method::GET, Some(name)) => match self.get(route.resource, &route.ns(), name) {
                Some(object) => ok(StatusCode::OK, &object),
                None => not_found(route.resource, name),
            },
            (&Method::POST, None) if route.resource == Resource::AccessReviews => {
                let asked: Value = serde_json::from_slice(&bytes).unwrap();
                let spec = &asked["spec"];
                let key = (
                    spec["user"].as_str().unwrap_or_default().to_owned(),
                    spec["resourceAttributes"]["namespace"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                );
                let denied = self.lock().no_pods.contains(&key);
                let mut answer = fixture(if denied {
                    "subjectaccessreview-denied.json"
                } else {
                    "subjectaccessreview-allowed.json"
                });
                answer["spec"] = spec.clone();
                ok(StatusCode::CREATED, &answer)
            }
            (&Method::POST, None) if self.lock().refusals.contains_key(&route.resource) => {
                let refusal = self.lock().refusals[&route.resource].clone();
                let code = refusal["code"].as_u64().unwrap() as u16;
                ok(StatusCode::from_u16(code).unwrap(), &refusal)
            }
            (&Method::POST, None) => {
                let mut object: Value = serde_json::from_slice(&bytes).unwrap();
                object["metadata"]["namespace"] = route.ns().into();
                // As a real server: the At CRD has a status subresource, so a create's status
                // is dropped (and the schema default given instead, by `insert`).
                if route.resource == Resource::Ats {
                    if let Some(object) = object.as_object_mut() {
                        object.remove("status");
                    }
                }
                let name = object["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                match self.insert(route.resource, object) {
                    Some(created) => ok(StatusCode::CREATED, &created),
                    None => already_exists(route.resource, &name),
                }
            }
            (&Method::PATCH, Some(name)) => {
                let patch: Value = serde_json::from_slice(&bytes).unwrap();
                self.merge_patch(&route, name, &patch)
            }
            (&Method::DELETE, Some(name))
                if self.get(route.resource, &route.ns(), name).is_none() =>
            {
                not_found(route.resource, name)
            }
            (&Method::DELETE, Some(name)) => {
                self.delete(route.resource, &route.ns(), name);
                ok(
                    StatusCode::OK,
                    &json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}),
                )
            }
            _ => status(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                "unsupported",
                None,
            ),
        }
    }

    /// A list, in pages of `limit` when asked (as kube's watcher does, 500 at a time): the
    /// `continue` token names the last key served and the first page's resourceVersion, which
    /// every page reports, as a real server serves all pages from one snapshot.
    fn list_response(&self, route: &Route, query: &BTreeMap<String, String>) -> Response<Body> {
        let state = self.lock();
        let limit: usize = query
            .get("limit")
            .and_then(|l| l.parse().ok())
            .filter(|l| *l > 0)
            .unwrap_or(usize::MAX);
        let token = query.get("continue").filter(|c| !c.is_empty());
        let (rv, after) = match token.and_then(|t| t.split_once('/')) {
            Some((rv, key)) => (rv.to_owned(), key.split_once('/')),
            None => (state.rv.to_string(), None),
        };
        let mut matching = state.objects.iter().filter(|((r, ns, name), v)| {
            *r == route.resource
                && route.matches_ns(ns)
                && selects(query, v)
                && after.is_none_or(|(a_ns, a_name)| (ns.as_str(), name.as_str()) > (a_ns, a_name))
        });
        let page: Vec<(&Key, &Value)> = matching.by_ref().take(limit).collect();
        let more = matching.next().is_some();
        let next = match page.last() {
            Some(((_, ns, name), _)) if more => format!("{rv}/{ns}/{name}"),
            _ => String::new(),
        };
        let items: Vec<&Value> = page.iter().map(|(_, v)| *v).collect();
        let list = json!({
            "apiVersion": route.resource.api_version(),
            "kind": format!("{}List", route.resource.kind()),
            "metadata": {"resourceVersion": rv, "continue": next},
            "items": items,
        });
        ok(StatusCode::OK, &list)
    }

    fn watch(&self, route: &Route, query: &BTreeMap<String, String>) -> Response<Body> {
        let initial_events = query.get("sendInitialEvents").is_some_and(|s| s == "true");
        // As kube-apiserver v1.24 (whose answers this server models): no streaming lists,
        // unless told.
        if query.contains_key("resourceVersionMatch")
            && !(initial_events && self.lock().streams_lists)
        {
            return status(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "ListOptions.meta.k8s.io \"\" is invalid: resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden for watch",
                Some(""),
            );
        }
        if initial_events {
            return self.streaming_list(route, query);
        }
        let since: u64 = query
            .get("resourceVersion")
            .and_then(|rv| rv.parse().ok())
            .unwrap_or(0);
        let compacted = self.lock().compacted.get(&route.resource).copied();
        let route_resource = route.resource;
        let wanted = wanted_by(route, query);
        if since != 0 && compacted.is_some_and(|c| since < c) && self.lock().expire_by_status {
            return ok(StatusCode::GONE, &expired());
        }
        if since != 0 && compacted.is_some_and(|c| since < c) {
            let line = serde_json::to_vec(&json!({"type": "ERROR", "object": expired()})).unwrap();
            let frame = Ok(Frame::data(Bytes::from([line, b"\n".to_vec()].concat())));
            return streaming(stream::iter([frame]));
        }
        self.stream_changes(route_resource, wanted, since, None)
    }

    /// A streaming list (any version asked is served from now): each object as ADDED, the
    /// bookmark that ends them, then the changes after, as a watch.
    fn streaming_list(&self, route: &Route, query: &BTreeMap<String, String>) -> Response<Body> {
        let (route, query) = (route.clone(), query.clone());
        let route_resource = route.resource;
        let state = self.lock();
        let now = state.rv;
        let mut initial: Vec<Change> = state
            .objects
            .iter()
            .filter(|((r, ns, _), v)| {
                *r == route.resource && route.matches_ns(ns) && selects(&query, v)
            })
            .map(|(_, object)| Change {
                rv: now,
                resource: route.resource,
                type_: "ADDED",
                object: object.clone(),
            })
            .collect();
        initial.push(Change {
            rv: now,
            resource: route.resource,
            type_: "BOOKMARK",
            object: json!({"kind": route.resource.kind(), "apiVersion": route.resource.api_version(),
                           "metadata": {"resourceVersion": now.to_string(),
                                        "annotations": {"k8s.io/initial-events-end": "true"}}}),
        });
        // Taken under the same lock as the objects: no change falls between the two.
        let receiver = self.changes.subscribe();
        drop(state);
        let wanted = wanted_by(&route, &query);
        self.stream_changes(route_resource, wanted, now, Some((initial, receiver)))
    }

    /// The changes of `resource` after version `since` that are `wanted`, as a watch's body;
    /// `initial`: what to send first instead of the log's changes, with the receiver of the
    /// changes after it.
    fn stream_changes(
        &self,
        route_resource: Resource,
        wanted: impl Fn(&Change) -> bool + Send + Sync + Clone + 'static,
        since: u64,
        initial: Option<(Vec<Change>, broadcast::Receiver<Change>)>,
    ) -> Response<Body> {
        let (replay, receiver) = match initial {
            Some(initial) => initial,
            None => {
                // Subscribe and replay under one lock, so no change falls between the two.
                let state = self.lock();
                let receiver = self.changes.subscribe();
                let replay: Vec<Change> = state
                    .log
                    .iter()
                    .filter(|c| c.rv > since && wanted(c))
                    .cloned()
                    .collect();
                (replay, receiver)
            }
        };
        let last = replay.last().map_or(since, |c| c.rv);
        let live = stream::unfold((receiver, last), move |(mut receiver, last)| async move {
            if last == u64::MAX {
                return None; // ended by an ERROR
            }
            loop {
                match receiver.recv().await {
                    Ok(change) if change.type_ == "END" && change.resource == route_resource => {
                        return None
                    }
                    Ok(change) if change.rv > last && change.type_ != "END" => {
                        return Some((change.clone(), (receiver, change.rv)))
                    }
                    Ok(_) => continue,
                    Err(broadcast::error::RecvError::Lagged(_)) => panic!("watch fell behind"),
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        });
        let events = stream::iter(replay)
            .chain(live)
            .filter(move |c| std::future::ready(wanted(c)))
            .map(|c| {
                let mut line =
                    serde_json::to_vec(&json!({"type": c.type_, "object": c.object})).unwrap();
                line.push(b'\n');
                Ok(Frame::data(Bytes::from(line)))
            });
        streaming(events)
    }

    fn merge_patch(&self, route: &Route, name: &str, patch: &Value) -> Response<Body> {
        let key = (route.resource, route.ns(), name.to_owned());
        let mut state = self.lock();
        let Some(current) = state.objects.get(&key).cloned() else {
            return not_found(route.resource, name);
        };
        match patch["metadata"]["resourceVersion"].as_str() {
            Some(rv) if current["metadata"]["resourceVersion"] != rv => {
                return conflict(route.resource, name);
            }
            // Stricter than a real server, on purpose: every Lease write must be a
            // compare-and-swap, so one without a precondition is refused and counted.
            None if route.resource == Resource::Leases => {
                state.unguarded_lease_writes += 1;
                return status(
                    StatusCode::PRECONDITION_REQUIRED,
                    "PreconditionRequired",
                    "test server: a Lease write must carry metadata.resourceVersion",
                    Some(name),
                );
            }
            _ => {}
        }
        // As a real server: a write validates the whole object against the CRD's schema, so an
        // At stored before the schema bounded its numbers can take no status at all.
        if route.resource == Resource::Ats {
            if let Ok(spec) = serde_json::from_value::<cnat::api::AtSpec>(current["spec"].clone()) {
                if let Some(problem) = cnat::limits::problems(&spec, |_| true).first() {
                    return status(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "Invalid",
                        &format!(
                            "At.cnat.programming-kubernetes.info {name:?} is invalid: {problem}"
                        ),
                        Some(name),
                    );
                }
            }
        }
        let mut updated = current.clone();
        if route.subresource.as_deref() == Some("status") {
            // The status subresource changes status only.
            let mut status = current.get("status").cloned().unwrap_or(Value::Null);
            json_patch::merge(&mut status, &patch["status"]);
            updated["status"] = status;
        } else {
            json_patch::merge(&mut updated, patch);
        }
        state.rv += 1;
        updated["metadata"]["resourceVersion"] = state.rv.to_string().into();
        if route.resource == Resource::Ats && updated["status"]["phase"] == "Done" {
            state
                .at_done
                .entry((key.1.clone(), key.2.clone()))
                .or_insert_with(Instant::now);
        }
        let gone = !updated["metadata"]["deletionTimestamp"].is_null()
            && updated["metadata"]["finalizers"]
                .as_array()
                .is_none_or(|f| f.is_empty());
        if gone {
            // Its last finalizer went: a terminating object is removed.
            state.objects.remove(&key);
            self.record_at(&mut state, route.resource, "DELETED", updated.clone());
        } else {
            state.objects.insert(key, updated.clone());
            self.record_at(&mut state, route.resource, "MODIFIED", updated.clone());
        }
        ok(StatusCode::OK, &updated)
    }

    // ---- state ----

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap()
    }

    fn insert(&self, resource: Resource, mut object: Value) -> Option<Value> {
        let mut state = self.lock();
        let ns = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default")
            .to_owned();
        let name = object["metadata"]["name"].as_str().unwrap().to_owned();
        let key = (resource, ns.clone(), name.clone());
        if state.objects.contains_key(&key) {
            return None;
        }
        object["apiVersion"] = resource.api_version().into();
        object["kind"] = resource.kind().into();
        let meta = &mut object["metadata"];
        meta["namespace"] = ns.clone().into();
        meta["creationTimestamp"] = now_rfc3339().into();
        if meta["uid"].is_null() {
            meta["uid"] = format!("uid-{}-{ns}-{name}", state.rv + 1).into();
        }
        if resource == Resource::Ats {
            meta["generation"] = 1.into();
            // The CRD's schema default, which a real server gives every At it serves that has no
            // status (so `status.phase` says `Pending` before any leader wrote a status).
            if object["status"].is_null() {
                object["status"] = json!({"phase": "Pending"});
            }
        }
        if resource == Resource::Pods {
            if object["status"].is_null() {
                object["status"] = json!({"phase": "Pending"});
            }
            state.pod_created.insert((ns, name), Instant::now());
        }
        self.record(&mut state, resource, "ADDED", object.clone());
        Some(state.objects.get(&key).cloned().unwrap())
    }

    fn update(&self, resource: Resource, ns: &str, name: &str, change: impl FnOnce(&mut Value)) {
        let mut state = self.lock();
        let object = changed(&mut state, resource, ns, name, change);
        self.record_at(&mut state, resource, "MODIFIED", object);
    }

    /// Stores `object` at a new resourceVersion and tells watchers.
    fn record(
        &self,
        state: &mut State,
        resource: Resource,
        type_: &'static str,
        mut object: Value,
    ) {
        state.rv += 1;
        object["metadata"]["resourceVersion"] = state.rv.to_string().into();
        if type_ != "DELETED" {
            let ns = object["metadata"]["namespace"].as_str().unwrap().to_owned();
            let name = object["metadata"]["name"].as_str().unwrap().to_owned();
            state.objects.insert((resource, ns, name), object.clone());
        }
        self.record_at(state, resource, type_, object);
    }

    fn record_at(&self, state: &mut State, resource: Resource, type_: &'static str, object: Value) {
        let change = Change {
            rv: state.rv,
            resource,
            type_,
            object,
        };
        state.log.push(change.clone());
        let _ = self.changes.send(change);
    }
}

/// A switch between one client and the server.
#[derive(Clone, Debug, Default)]
pub struct Partition(Arc<std::sync::atomic::AtomicBool>);

impl Partition {
    pub fn cut(&self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// New requests get through again (those sent while cut still hang).
    pub fn heal(&self) {
        self.0.store(false, std::sync::atomic::Ordering::SeqCst);
    }

    fn is_cut(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[derive(Clone, Debug)]
struct Route {
    resource: Resource,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

impl Route {
    /// `/api/v1[/namespaces/NS]/pods[/NAME[/SUB]]` and the same under `/apis/GROUP/VERSION`.
    fn parse(path: &str) -> Option<Route> {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        let rest = match parts.as_slice() {
            ["api", "v1", rest @ ..] => rest,
            ["apis", _group, _version, rest @ ..] => rest,
            _ => return None,
        };
        let (namespace, rest) = match rest {
            ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
            rest => (None, rest),
        };
        let resource = match *rest.first()? {
            "ats" => Resource::Ats,
            "pods" => Resource::Pods,
            "events" => Resource::Events,
            "leases" => Resource::Leases,
            "secrets" => Resource::Secrets,
            "subjectaccessreviews" => Resource::AccessReviews,
            _ => return None,
        };
        Some(Route {
            resource,
            namespace,
            name: rest.get(1).map(|s| s.to_string()),
            subresource: rest.get(2).map(|s| s.to_string()),
        })
    }

    fn ns(&self) -> String {
        self.namespace.clone().unwrap_or_else(|| "default".into())
    }

    fn matches_ns(&self, ns: &str) -> bool {
        self.namespace.as_deref().is_none_or(|want| want == ns)
    }
}

/// Label selectors as cnat uses them (`a=b,c=d`, `a`, `a in (x,y)`, `a notin (x,y)`), and the
/// field selector `metadata.name=<name>` (a Lease watch).
fn selects(query: &BTreeMap<String, String>, object: &Value) -> bool {
    if let Some(fields) = query.get("fieldSelector") {
        let by_name =
            fields
                .split(',')
                .filter(|f| !f.is_empty())
                .all(|f| match f.split_once('=') {
                    Some(("metadata.name", name)) => object["metadata"]["name"] == name,
                    _ => panic!("test server: unsupported field selector {f:?}"),
                });
        if !by_name {
            return false;
        }
    }
    let Some(selector) = query.get("labelSelector") else {
        return true;
    };
    label_terms(selector).into_iter().all(|term| {
        let labels = &object["metadata"]["labels"];
        if let Some((key, values)) = term.split_once(" notin ") {
            let values = values.trim_matches(|c| c == '(' || c == ')');
            return labels[key]
                .as_str()
                .is_none_or(|value| !values.split(',').any(|v| v == value));
        }
        if let Some((key, values)) = term.split_once(" in ") {
            let values = values.trim_matches(|c| c == '(' || c == ')');
            return labels[key]
                .as_str()
                .is_some_and(|value| values.split(',').any(|v| v == value));
        }
        match term.split_once('=') {
            Some((k, v)) => labels[k] == v,
            None => !labels[term].is_null(),
        }
    })
}

/// A label selector's terms: split at the commas outside parentheses (`a=b,c notin (1,2)`).
fn label_terms(selector: &str) -> Vec<&str> {
    let (mut terms, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&selector[start..]);
    terms.into_iter().filter(|t| !t.is_empty()).collect()
}

fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

fn ok(code: StatusCode, value: &Value) -> Response<Body> {
    let body = Full::new(Bytes::from(serde_json::to_vec(value).unwrap())).boxed();
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(body)
        .unwrap()
}

fn streaming(
    events: impl Stream<Item = Result<Frame<Bytes>, Infallible>> + Send + Sync + 'static,
) -> Response<Body> {
    let body = BodyExt::boxed(StreamBody::new(events));
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(body)
        .unwrap()
}

fn fixture(name: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/api-k8s-1.24/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A captured Status, re-aimed at this resource and name.
fn captured(file: &str, resource: Resource, name: &str, message: String) -> Response<Body> {
    let mut body = fixture(file);
    body["message"] = message.into();
    body["details"]["name"] = name.into();
    body["details"]["kind"] = resource.plural().into();
    let code = StatusCode::from_u16(body["code"].as_u64().unwrap() as u16).unwrap();
    ok(code, &body)
}

fn not_found(resource: Resource, name: &str) -> Response<Body> {
    let plural = resource.plural();
    captured(
        "status-404-not-found.json",
        resource,
        name,
        format!("{plural} \"{name}\" not found"),
    )
}

fn already_exists(resource: Resource, name: &str) -> Response<Body> {
    let plural = resource.plural();
    captured(
        "status-409-already-exists.json",
        resource,
        name,
        format!("{plural} \"{name}\" already exists"),
    )
}

fn conflict(resource: Resource, name: &str) -> Response<Body> {
    let plural = match resource {
        Resource::Leases => "leases.coordination.k8s.io",
        other => other.plural(),
    };
    let file = match resource {
        Resource::Leases => "status-409-conflict-lease-merge-patch-stale-resourceversion.json",
        _ => "status-409-conflict-stale-resourceversion.json",
    };
    captured(
        file,
        resource,
        name,
        format!("Operation cannot be fulfilled on {plural} \"{name}\": the object has been modified; please apply your changes to the latest version and try again"),
    )
}

/// The Status of a watch from a compacted resourceVersion, as kube-apiserver sends it.
/// Applies `change` to a stored object at a new resourceVersion; returns the new object.
fn changed(
    state: &mut State,
    resource: Resource,
    ns: &str,
    name: &str,
    change: impl FnOnce(&mut Value),
) -> Value {
    let key = (resource, ns.to_owned(), name.to_owned());
    let mut object = state.objects.get(&key).cloned().expect("object to change");
    change(&mut object);
    state.rv += 1;
    object["metadata"]["resourceVersion"] = state.rv.to_string().into();
    state.objects.insert(key, object.clone());
    object
}

/// Which changes a watch of `route` with `query` (its selectors) is sent: its resource's, in its
/// namespaces, selected, and every ERROR and BOOKMARK.
fn wanted_by(
    route: &Route,
    query: &BTreeMap<String, String>,
) -> impl Fn(&Change) -> bool + Send + Sync + Clone + 'static {
    let (route, query) = (route.clone(), query.clone());
    move |c: &Change| {
        c.resource == route.resource
            && (c.type_ == "ERROR"
                || c.type_ == "BOOKMARK"
                || route.matches_ns(c.object["metadata"]["namespace"].as_str().unwrap_or(""))
                    && selects(&query, &c.object))
    }
}

fn expired() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": "too old resource version: 1 (2)", "reason": "Expired", "code": 410})
}

fn status(code: StatusCode, reason: &str, message: &str, name: Option<&str>) -> Response<Body> {
    ok(
        code,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code.as_u16(),
                     "reason": reason, "message": message, "details": {"name": name}}),
    )
}

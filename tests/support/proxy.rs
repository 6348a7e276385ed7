//! A proxy between one replica and the real API server that makes the replica's At cache
//! stale on purpose: it can hold the events of the replica's At watches (the watch stays open
//! and says nothing, as behind a stuck proxy or a half-open connection), end them with 410
//! Expired (a forced relist), and hold the answers to its At lists (a relist that takes long;
//! a streaming list, a watch that first sends every At, is held as a list, then gated as a
//! watch).
//! Every other request (the Lease, pods, reads of one At) goes through at once. The replica
//! talks plain HTTP to it (`url`); it talks to the API server as the admin.

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;
use tokio_util::task::AbortOnDropHandle;

const ATS: &str = "/apis/cnat.programming-kubernetes.info/";

/// What the API server says when a watch's version is too old: the follower lists again.
const EXPIRED: &str = r#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too old resource version (the test's proxy)","reason":"Expired","code":410}}"#;

type ProxyBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// The proxy; stops when dropped.
pub struct Proxy {
    /// Where the replica finds it (`http://127.0.0.1:PORT`).
    pub url: String,
    state: Arc<State>,
    _task: AbortOnDropHandle<()>,
}

#[derive(Debug)]
struct State {
    /// While true, events of At watches are held.
    hold_watches: watch::Sender<bool>,
    /// While true, every At watch (open or new) ends with 410 Expired, until the replica lists.
    expiring: watch::Sender<bool>,
    /// While true, answers to At lists are held.
    hold_lists: watch::Sender<bool>,
    /// At lists held now.
    lists_held: std::sync::atomic::AtomicUsize,
    /// The At watch events passed to the replica so far (what its cache saw).
    forwarded: Mutex<String>,
    /// Every request of the replica so far, as `verb resource` (`Proxy::requests`).
    requests: Mutex<Vec<String>>,
}

impl Proxy {
    /// Starts a proxy to the API server `upstream` speaks to.
    pub async fn start(upstream: kube::Client) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port for the proxy");
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(State {
            hold_watches: watch::Sender::new(false),
            expiring: watch::Sender::new(false),
            hold_lists: watch::Sender::new(false),
            lists_held: Default::default(),
            forwarded: Mutex::default(),
            requests: Mutex::default(),
        });
        let shared = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (upstream, state) = (upstream.clone(), shared.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |request| {
                        forward(request, upstream.clone(), state.clone())
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Proxy {
            url,
            state,
            _task: AbortOnDropHandle::new(task),
        }
    }

    /// Holds (true) or lets through (false) the events of the replica's At watches.
    pub fn hold_watches(&self, hold: bool) {
        self.state.hold_watches.send_replace(hold);
    }

    /// Ends the replica's At watch with 410 Expired (an open one, or the next), so that it
    /// lists again.
    pub fn expire_watches(&self) {
        self.state.expiring.send_replace(true);
    }

    /// Holds (true) or lets through (false) the answers to the replica's At lists.
    pub fn hold_lists(&self, hold: bool) {
        self.state.hold_lists.send_replace(hold);
    }

    /// At lists of the replica held now.
    pub fn lists_held(&self) -> usize {
        self.state
            .lists_held
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The At watch events the replica was given so far.
    pub fn forwarded(&self) -> String {
        self.state.forwarded.lock().unwrap().clone()
    }

    /// Every request the replica sent so far, oldest first, each as its verb (Kubernetes'
    /// words: `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`) and resource with
    /// its subresource (`pods`, `ats/status`), e.g. `patch ats/status`.
    pub fn requests(&self) -> Vec<String> {
        self.state.requests.lock().unwrap().clone()
    }
}

/// `verb resource` for a request to the API server (see `Proxy::requests`).
fn verb_and_resource(method: &http::Method, path: &str, watching: bool) -> String {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    // After /api/v1 or /apis/GROUP/VERSION; a namespaced resource after namespaces/NAME.
    let mut rest = match segments.first() {
        Some(&"api") => segments.get(2..).unwrap_or_default(),
        _ => segments.get(3..).unwrap_or_default(),
    };
    if rest.first() == Some(&"namespaces") && rest.len() > 2 {
        rest = &rest[2..];
    }
    let resource = match rest {
        [resource] | [resource, _] => resource.to_string(),
        [resource, _, sub, ..] => format!("{resource}/{sub}"),
        [] => path.to_owned(),
    };
    let verb = match *method {
        http::Method::GET if watching => "watch",
        http::Method::GET if rest.len() == 1 => "list",
        http::Method::GET => "get",
        http::Method::POST => "create",
        http::Method::PUT => "update",
        http::Method::PATCH => "patch",
        http::Method::DELETE => "delete",
        _ => method.as_str(),
    };
    format!("{verb} {resource}")
}

async fn forward(
    request: Request<Incoming>,
    upstream: kube::Client,
    state: Arc<State>,
) -> Result<Response<ProxyBody>, std::convert::Infallible> {
    let (parts, body) = request.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let ats = parts.uri.path().starts_with(ATS) && parts.uri.path().ends_with("/ats");
    let query = parts.uri.query().unwrap_or_default();
    let has = |wanted: &[&str]| query.split('&').any(|pair| wanted.contains(&pair));
    let watching = has(&["watch=true", "watch=1"]);
    // A streaming list (a watch that first sends every At) is a list, then the watch.
    let streaming = watching && has(&["sendInitialEvents=true"]);
    let (watch, list) = (
        ats && watching,
        ats && (!watching || streaming) && parts.method == http::Method::GET,
    );
    let request = verb_and_resource(&parts.method, parts.uri.path(), watching);
    state.requests.lock().unwrap().push(request);
    if list {
        // The replica lists: what expired it is over.
        state.expiring.send_replace(false);
        let counted = &state.lists_held;
        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut held = state.hold_lists.subscribe();
        let _ = held.wait_for(|hold| !hold).await;
        counted.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
    let mut outgoing = http::Request::builder()
        .method(parts.method.clone())
        .uri(parts.uri.path_and_query().map_or("/", |p| p.as_str()));
    for (name, value) in &parts.headers {
        if name != http::header::AUTHORIZATION && name != http::header::HOST {
            outgoing = outgoing.header(name, value);
        }
    }
    let outgoing = outgoing
        .body(kube::client::Body::from(body.to_vec()))
        .unwrap();
    let answer = match upstream.send(outgoing).await {
        Ok(answer) => answer,
        Err(error) => {
            let body = Bytes::from(format!("the test's proxy: {error}"));
            let failed = http_body_util::Full::new(body).map_err(|never| match never {});
            let mut response = Response::new(failed.boxed_unsync());
            *response.status_mut() = http::StatusCode::BAD_GATEWAY;
            return Ok(response);
        }
    };
    let (mut parts, body) = answer.into_parts();
    let body = if watch {
        parts.headers.remove(http::header::CONTENT_LENGTH);
        gated(body, state)
    } else {
        body.map_err(std::io::Error::other).boxed_unsync()
    };
    Ok(Response::from_parts(parts, body))
}

/// A watch's body, passed on whole lines at a time while its events are not held, ended with
/// 410 Expired (after the last whole line) when asked.
fn gated(body: kube::client::Body, state: Arc<State>) -> ProxyBody {
    struct Gate {
        chunks: futures::stream::BoxStream<'static, Result<Bytes, kube::Error>>,
        /// Bytes of a line not yet ended.
        partial: Vec<u8>,
        state: Arc<State>,
    }
    let gate = Gate {
        chunks: body.into_data_stream().boxed(),
        partial: Vec::new(),
        state,
    };
    let frames = futures::stream::unfold(Some(gate), |gate| async move {
        let mut gate = gate?;
        loop {
            let mut expiring = gate.state.expiring.subscribe();
            let mut held = gate.state.hold_watches.subscribe();
            let next = tokio::select! {
                _ = expiring.wait_for(|expire| *expire) => None,
                chunk = gate.chunks.next() => Some(chunk),
            };
            let chunk = match next {
                None => {
                    let line = Bytes::from(format!("{EXPIRED}\n"));
                    return Some((Ok(Frame::data(line)), None));
                }
                Some(None) => return None,
                Some(Some(Err(error))) => {
                    return Some((Err(std::io::Error::other(error)), None));
                }
                Some(Some(Ok(chunk))) => chunk,
            };
            gate.partial.extend_from_slice(&chunk);
            let Some(end) = gate.partial.iter().rposition(|b| *b == b'\n') else {
                continue;
            };
            let lines: Vec<u8> = gate.partial.drain(..=end).collect();
            tokio::select! {
                _ = expiring.wait_for(|expire| *expire) => {
                    let line = Bytes::from(format!("{EXPIRED}\n"));
                    return Some((Ok(Frame::data(line)), None));
                }
                _ = held.wait_for(|hold| !hold) => {}
            }
            let text = String::from_utf8_lossy(&lines).into_owned();
            gate.state.forwarded.lock().unwrap().push_str(&text);
            return Some((Ok(Frame::data(Bytes::from(lines))), Some(gate)));
        }
    });
    BodyExt::boxed_unsync(StreamBody::new(frames))
}

//! How the At cache follows the Ats: a streaming list where offered, else the shard lists at
//! once, decoded as they stream in, then a watch; as kube-runtime's `watcher::Event`s.
//! See docs/src/design/decisions.md, "The first list and streaming lists" and "List shards".

use super::cached_at::CachedAt;
use super::freshness::{Following, Freshness, SILENCE};
use futures::{AsyncBufReadExt, Stream, StreamExt};
use kube::api::{ListParams, VersionMatch, WatchEvent, WatchParams};
use kube::core::Request;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher::{Error, Event};
use kube::{Client, Resource, ResourceExt};
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::timeout;
use tokio_util::task::AbortOnDropHandle;
use tracing::info;

/// The annotation of the bookmark that ends a streaming list's initial events.
const INITIAL_EVENTS_END: &str = "k8s.io/initial-events-end";
/// Seconds a watch asks to last (kube-runtime's watcher asks the same).
const WATCH_TIMEOUT: u32 = 290;
/// A watch with no event (bookmarks included) for this long is taken for dead and started
/// again (`freshness::SILENCE`).
const WATCH_IDLE: Duration = SILENCE;
/// An answer that does not start, or a list body that stops, for this long is dead
/// (kube-apiserver ends any request after 60 s by default).
const IDLE: Duration = Duration::from_secs(60);
/// Chunks of the list body in flight to the decoder, and batches of decoded Ats in flight
/// back, of at most `BATCH` each (one wake-up per batch, not per At).
const CHUNKS: usize = 64;
const BATCHES: usize = 8;
const BATCH: usize = 256;

type EventStream = Pin<Box<dyn Stream<Item = kube::Result<WatchEvent<CachedAt>>> + Send>>;

/// The next state and the events a step brought.
type Stepped = (State, Vec<Result<Event<CachedAt>, Error>>);

/// Where the follower is.
enum State {
    /// To list, at any version (`None`: the first list) or not older than this one.
    List(Option<String>),
    /// A streaming list in progress (asked at that version): a watch sending every At, until
    /// the bookmark that ends them.
    Streaming(Option<String>, EventStream),
    /// Lists in progress: their decoded Ats, then their resourceVersions.
    Listing(Listing),
    /// To watch from this version (and what the lists held, while the watch replays it).
    Watch(String, Option<Replay>),
    Watching(String, EventStream, Option<Replay>),
}

struct Follower {
    client: Client,
    url: String,
    /// The store the events go into, as far as they went: what a replaying watch compares with.
    held: Store<CachedAt>,
    /// Only the Ats this label selector selects (a Lease shard's, `shard::Shards::selector`);
    /// `None`: every At.
    selector: Option<String>,
    /// List the shards at once (`false` after an API server gave a resourceVersion that is not
    /// a number, which the replay needs to compare).
    sharded: bool,
    /// List by a streaming watch (`false` when not wanted, or after the API server refused
    /// it); shared with whoever asks how the cache lists.
    streaming: Arc<AtomicBool>,
    /// Where it is, for those who must not act on a cache that is behind.
    freshness: Freshness,
}

/// Follows the Ats (of `namespace`, or all; only those `selector` selects, if given) with
/// `client`; `held` is the store its events go into, `freshness` hears where it is after each
/// step. `streaming`: list by a streaming watch where offered (set to `false` when refused).
pub fn follow(
    client: Client,
    namespace: Option<String>,
    selector: Option<String>,
    held: Store<CachedAt>,
    freshness: Freshness,
    streaming: Arc<AtomicBool>,
) -> impl Stream<Item = Result<Event<CachedAt>, Error>> + Send {
    let url = CachedAt::url_path(&(), namespace.as_deref());
    let follower = Follower {
        client,
        url,
        selector,
        held,
        sharded: true,
        streaming,
        freshness,
    };
    futures::stream::unfold(
        (State::List(None), follower, VecDeque::new()),
        |(mut state, mut follower, mut ready)| async move {
            loop {
                if let Some(event) = ready.pop_front() {
                    return Some((event, (state, follower, ready)));
                }
                let (next, events) = step(state, &mut follower).await;
                state = next;
                ready.extend(events);
            }
        },
    )
}

impl Follower {
    /// `params` limited to the Ats this follower follows.
    fn selected(&self, params: WatchParams) -> WatchParams {
        match &self.selector {
            Some(selector) => params.labels(selector),
            None => params,
        }
    }
}

/// One step: the next state, and what it yields. The state it ends in says how fresh the
/// store is; it is `Watching` only when the watch just started or said something.
async fn step(state: State, follower: &mut Follower) -> Stepped {
    let (next, events) = match state {
        State::List(version) if follower.streaming.load(Ordering::Relaxed) => {
            stream(version, follower).await
        }
        State::List(version) => list(version, follower).await,
        State::Streaming(asked, events) => read_streamed(asked, events).await,
        State::Listing(listing) => read_listed(listing, follower).await,
        State::Watch(version, replay) => watch(version, replay, follower).await,
        State::Watching(version, events, replay) => {
            read_watched(version, events, replay, follower).await
        }
    };
    // A watch replaying what the lists held counts as watching: the events between the lists
    // come at once when it opens, while the replay's end may wait for the next change of an At.
    let following = match &next {
        State::List(_) | State::Listing(_) | State::Streaming(..) => Following::Listing,
        State::Watch(..) => Following::Connecting,
        State::Watching(..) => Following::Watching,
    };
    let heard = matches!(next, State::Watching(..));
    follower.freshness.set(following, heard);
    (next, events)
}

/// Lists every At by a watch that sends each first (`sendInitialEvents`), at any version
/// (`None`) or not older than `version`; a server that refuses it gets lists from then on.
async fn stream(version: Option<String>, follower: &mut Follower) -> Stepped {
    let params = follower.selected(
        WatchParams::default()
            .initial_events()
            .timeout(WATCH_TIMEOUT),
    );
    let from = version.as_deref().unwrap_or("0");
    // A refusal comes as the answer's status, which kube-client returns here.
    match open_watch(follower, &params, from).await {
        Ok(events) => (State::Streaming(version, events), vec![Ok(Event::Init)]),
        Err(kube::Error::Api(status)) if not_streaming(status.code) => {
            follower.streaming.store(false, Ordering::Relaxed);
            // Its own message names forbidden fields: not for the log, which says what it means.
            info!(
                code = status.code,
                reason = %status.reason,
                "the API server does not stream lists (WatchList); listing the Ats instead"
            );
            (State::List(version), vec![])
        }
        Err(error) => (
            State::List(version),
            vec![Err(Error::InitialListFailed(error))],
        ),
    }
}

/// Whether an answer with this code to a streaming list says the server does not offer one
/// (422 Invalid: `resourceVersionMatch` or `sendInitialEvents` forbidden for a watch; 400).
fn not_streaming(code: u16) -> bool {
    matches!(code, 400 | 422)
}

/// The next At of a streaming list, or its end: the bookmark that ends the initial events
/// turns it into the watch that follows them.
async fn read_streamed(asked: Option<String>, mut events: EventStream) -> Stepped {
    let failed = |asked, error| {
        (
            State::List(asked),
            vec![Err(Error::InitialListFailed(error))],
        )
    };
    match timeout(IDLE, events.next()).await {
        Ok(Some(Ok(event))) => match initial(event) {
            Initial::At(at) => (
                State::Streaming(asked, events),
                vec![Ok(Event::InitApply(*at))],
            ),
            Initial::Mark => (State::Streaming(asked, events), vec![]),
            Initial::End(version) => (
                State::Watching(version, events, None),
                vec![Ok(Event::InitDone)],
            ),
            Initial::Refused(status) => (State::List(asked), vec![Err(Error::WatchError(status))]),
            Initial::Unexpected(what) => failed(
                asked,
                kube::Error::Service(
                    format!("a streaming list sent {what} before the end of its initial events")
                        .into(),
                ),
            ),
        },
        Ok(Some(Err(error))) => failed(asked, error),
        Ok(None) => failed(
            asked,
            kube::Error::Service("a streaming list ended before all its initial events".into()),
        ),
        Err(_) => failed(asked, silent()),
    }
}

/// What a streaming list's event is, before the end of its initial events. Pure.
#[derive(Debug)]
enum Initial {
    At(Box<CachedAt>),
    /// A bookmark that does not end them.
    Mark,
    /// The bookmark that ends them: the version the watch goes on from.
    End(String),
    Refused(Box<kube::core::Status>),
    /// A change of an At, which the initial events do not bring.
    Unexpected(&'static str),
}

fn initial(event: WatchEvent<CachedAt>) -> Initial {
    match event {
        WatchEvent::Added(at) => Initial::At(Box::new(at)),
        WatchEvent::Bookmark(mark)
            if mark
                .metadata
                .annotations
                .get(INITIAL_EVENTS_END)
                .is_some_and(|end| end == "true") =>
        {
            Initial::End(mark.metadata.resource_version)
        }
        WatchEvent::Bookmark(_) => Initial::Mark,
        WatchEvent::Error(status) => Initial::Refused(status),
        WatchEvent::Modified(_) => Initial::Unexpected("a change"),
        WatchEvent::Deleted(_) => Initial::Unexpected("a deletion"),
    }
}

/// Lists every At (the shard lists at once) at any version (`None`) or not older than
/// `version`; the lists' bodies are decoded as they stream in (`Listing`).
async fn list(version: Option<String>, follower: &Follower) -> Stepped {
    let (client, url) = (&follower.client, follower.url.as_str());
    // A Lease shard's lists: each list shard's requirement and the Lease shard's (both must
    // hold).
    let base = follower.selector.as_deref();
    let selectors: Vec<Option<String>> = if follower.sharded {
        crate::shard::selectors()
            .into_iter()
            .map(|list| Some(base.map_or_else(|| list.clone(), |base| format!("{base},{list}"))))
            .collect()
    } else {
        vec![base.map(str::to_owned)]
    };
    let answers = futures::future::join_all(selectors.into_iter().map(|selector| {
        let mut params = match &version {
            None => ListParams::default().match_any(),
            Some(version) => ListParams {
                resource_version: Some(version.clone()),
                version_match: Some(VersionMatch::NotOlderThan),
                ..ListParams::default()
            },
        };
        params.label_selector = selector;
        async move {
            match Request::new(url).list(&params) {
                Ok(request) => timeout(IDLE, client.request_stream(request))
                    .await
                    .unwrap_or_else(|_| Err(silent())),
                Err(error) => Err(kube::Error::BuildRequest(error)),
            }
        }
    }))
    .await;
    match answers.into_iter().collect::<kube::Result<Vec<_>>>() {
        Ok(bodies) => (
            State::Listing(Listing::start(bodies, version)),
            vec![Ok(Event::Init)],
        ),
        Err(error) => (
            State::List(version),
            vec![Err(Error::InitialListFailed(error))],
        ),
    }
}

/// The next Ats the lists brought, or their end.
async fn read_listed(mut listing: Listing, follower: &mut Follower) -> Stepped {
    match listing.next().await {
        Listed::Ats(ats) => {
            let events = ats.into_iter().map(|at| Ok(Event::InitApply(at))).collect();
            (State::Listing(listing), events)
        }
        Listed::Ended => (State::Listing(listing), vec![]),
        Listed::Failed(error) => (State::List(listing.asked), vec![Err(error)]),
        Listed::Done(versions) => match Replay::of(&versions) {
            Ok((from, replay)) => (State::Watch(from, replay), vec![Ok(Event::InitDone)]),
            Err(odd) => {
                follower.sharded = false;
                let why = format!("the API server's resourceVersion {odd:?} is not a number, which listing the At shards at once needs; listing them in one request from now on");
                (
                    State::List(listing.asked),
                    vec![Err(Error::InitialListFailed(kube::Error::Service(
                        why.into(),
                    )))],
                )
            }
        },
    }
}

async fn watch(version: String, replay: Option<Replay>, follower: &Follower) -> Stepped {
    // Bookmarks are on by default.
    let params = follower.selected(WatchParams::default().timeout(WATCH_TIMEOUT));
    // A refusal comes as the answer's status (kube-client 5 returns it here), or, within a
    // 200 answer, as the stream's first event (`read_watched`); 410 both ways lists again.
    match open_watch(follower, &params, &version).await {
        Ok(events) => (State::Watching(version, events, replay), vec![]),
        Err(kube::Error::Api(status)) if status.code == 410 => (
            State::List(Some(relist_from(version, replay))),
            vec![Err(Error::WatchError(status))],
        ),
        Err(error) => (
            State::Watch(version, replay),
            vec![Err(Error::WatchStartFailed(error))],
        ),
    }
}

/// Opens a watch of the Ats with `params` from `version`: its events, once the answer started
/// within `IDLE`.
async fn open_watch(
    follower: &Follower,
    params: &WatchParams,
    version: &str,
) -> kube::Result<EventStream> {
    let request = Request::new(follower.url.as_str())
        .watch(params, version)
        .map_err(kube::Error::BuildRequest)?;
    let events = timeout(IDLE, follower.client.request_events::<CachedAt>(request))
        .await
        .unwrap_or_else(|_| Err(silent()))?;
    Ok(Box::pin(events))
}

/// The next event of the watch, or its end.
async fn read_watched(
    version: String,
    mut events: EventStream,
    replay: Option<Replay>,
    follower: &Follower,
) -> Stepped {
    match timeout(WATCH_IDLE, events.next()).await {
        Ok(Some(Ok(event))) => watched(version, events, replay, event, &follower.held),
        Ok(Some(Err(kube::Error::Api(status)))) if status.code == 410 => (
            State::List(Some(relist_from(version, replay))),
            vec![Err(Error::WatchError(status))],
        ),
        Ok(Some(Err(error))) => (
            State::Watch(version, replay),
            vec![Err(Error::WatchFailed(error))],
        ),
        // Ended after its timeout, as asked, or silent past it: go on from the last
        // version.
        Ok(None) | Err(_) => (State::Watch(version, replay), vec![]),
    }
}

/// What one watch event does.
fn watched(
    version: String,
    events: EventStream,
    replay: Option<Replay>,
    event: WatchEvent<CachedAt>,
    held: &Store<CachedAt>,
) -> Stepped {
    let (at, delete) = match event {
        WatchEvent::Added(at) | WatchEvent::Modified(at) => (at, false),
        WatchEvent::Deleted(at) => (at, true),
        WatchEvent::Bookmark(mark) => {
            let now = mark.metadata.resource_version;
            let replay = replay.filter(|replay| !replay.passed(&now));
            return (State::Watching(now, events, replay), vec![]);
        }
        WatchEvent::Error(status) if status.code == 410 => {
            return (
                State::List(Some(relist_from(version, replay))),
                vec![Err(Error::WatchError(status))],
            )
        }
        WatchEvent::Error(status) => {
            return (
                State::Watch(version, replay),
                vec![Err(Error::WatchError(status))],
            )
        }
    };
    let now = at.meta().resource_version.clone().unwrap_or(version);
    // Judged only while a replay goes on: no key is built for the watch's events after it.
    let (replay, skip) = match replay {
        None => (None, false),
        Some(replay) => {
            let seen = Seen {
                key: format!("{}/{}", at.namespace().unwrap_or_default(), at.name_any()),
                list: at.list(),
                version: &now,
                delete,
            };
            replayed(Some(replay), &seen, || {
                held.get(&ObjectRef::from_obj(&at))
                    .and_then(|stored| number(stored.meta().resource_version.as_deref()?))
            })
        }
    };
    let out = match (skip, delete) {
        (true, _) => vec![],
        (false, false) => vec![Ok(Event::Apply(at))],
        (false, true) => vec![Ok(Event::Delete(at))],
    };
    (State::Watching(now, events, replay), out)
}

/// A watch event as the replay judges it.
struct Seen<'a> {
    /// The At's `namespace/name`.
    key: String,
    /// The list its labels put it in (`CachedAt::list`); for a deletion, its labels last.
    list: usize,
    version: &'a str,
    delete: bool,
}

/// After watch event `seen`, the store holding its At at version `stored()` (or not at all):
/// the replay still going, if any (it ends once the watch is past every list), and whether the
/// store already holds what the event did, so it is skipped.
fn replayed(
    replay: Option<Replay>,
    seen: &Seen,
    stored: impl FnOnce() -> Option<u64>,
) -> (Option<Replay>, bool) {
    let mut replay = replay.filter(|replay| !replay.passed(seen.version));
    let held = replay.as_mut().is_some_and(|replay| {
        number(seen.version).is_some_and(|version| replay.holds(seen, version, stored()))
    });
    (replay, held)
}

/// The version a list after a watch at `version` expired asks for at least: the newest the
/// store holds, which is that of the newest list while the watch still replays the lists.
fn relist_from(version: String, replay: Option<Replay>) -> String {
    match replay {
        Some(replay) if number(&version).is_some_and(|v| v < replay.newest) => {
            replay.newest.to_string()
        }
        _ => version,
    }
}

/// A resourceVersion as the number it is on every API server backed by etcd.
fn number(version: &str) -> Option<u64> {
    version.parse().ok()
}

/// What the shard lists held, while a watch from the oldest of them replays events they
/// already hold. Pure.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Replay {
    /// Each list's resourceVersion, by list (`CachedAt::list`).
    lists: Vec<u64>,
    /// The newest of them: past it, every event is new.
    newest: u64,
    /// The Ats this replay deleted from the store.
    deleted: std::collections::HashSet<String>,
}

impl Replay {
    /// Where the watch starts after lists at these `versions` (one per list), and what it
    /// replays that they held (`None` for one list: nothing). `Err`: a version that is not a
    /// number, which the replay cannot compare.
    fn of(versions: &[String]) -> Result<(String, Option<Replay>), String> {
        if let [only] = versions {
            return Ok((only.clone(), None));
        }
        let lists = versions
            .iter()
            .map(|version| number(version).ok_or_else(|| version.clone()))
            .collect::<Result<Vec<u64>, String>>()?;
        let (Some(&oldest), Some(&newest)) = (lists.iter().min(), lists.iter().max()) else {
            return Err(String::new());
        };
        let replay = (oldest < newest).then(|| Replay {
            lists,
            newest,
            deleted: Default::default(),
        });
        Ok((oldest.to_string(), replay))
    }

    /// Whether the watch, at `version`, is past every list: no list held it.
    fn passed(&self, version: &str) -> bool {
        number(version).is_none_or(|version| version > self.newest)
    }

    /// Whether the store already holds what `seen` (at `version`) did, the store holding its At
    /// at version `stored` (`None`: not at all); notes the deletions it lets through. The rule
    /// and why it holds: docs/src/design/decisions.md, "List shards".
    fn holds(&mut self, seen: &Seen, version: u64, stored: Option<u64>) -> bool {
        let held = match stored {
            Some(stored) => version <= stored,
            None => {
                !self.deleted.contains(&seen.key)
                    && self
                        .lists
                        .get(seen.list)
                        .is_some_and(|&listed| version <= listed)
            }
        };
        if seen.delete && !held && stored.is_some() {
            self.deleted.insert(seen.key.clone());
        }
        held
    }
}

/// Lists being decoded: the Ats as they are decoded (from any of them), and each list's end
/// (its resourceVersion, or why it failed) as it comes.
struct Listing {
    /// The version the lists asked for, to ask again if one fails.
    asked: Option<String>,
    ats: mpsc::Receiver<Vec<CachedAt>>,
    /// Every decoder is done: `ats` is closed.
    drained: bool,
    ended: mpsc::Receiver<(usize, kube::Result<Option<String>>)>,
    /// Each list's resourceVersion, once it said it.
    versions: Vec<Option<String>>,
    /// Dropped with the lists (their stream was dropped, or one failed): reading stops, which
    /// ends the decoders.
    _lists: Vec<AbortOnDropHandle<()>>,
}

/// What lists in progress gave next.
enum Listed {
    /// Decoded Ats.
    Ats(Vec<CachedAt>),
    /// A list or a decoder ended; more is to come.
    Ended,
    /// A list failed: all are dropped (their requests and decoders stop).
    Failed(Error),
    /// Every At of every list is out: each list's resourceVersion.
    Done(Vec<String>),
}

impl Listing {
    /// The next Ats batch or list end, whichever comes first.
    async fn next(&mut self) -> Listed {
        let said = self.versions.iter().all(Option::is_some);
        if said && self.drained {
            return Listed::Done(self.versions.iter().flatten().cloned().collect());
        }
        // Each branch only while it has more to give: `ended` closes once every list said its
        // end, `ats` once every decoder is done, in either order.
        let ended = tokio::select! {
            ended = self.ended.recv(), if !said => ended,
            batch = self.ats.recv(), if !self.drained => {
                return match batch {
                    Some(ats) => Listed::Ats(ats),
                    None => {
                        self.drained = true;
                        Listed::Ended
                    }
                };
            }
        };
        match ended {
            Some((list, Ok(Some(version)))) => {
                self.versions[list] = Some(version);
                Listed::Ended
            }
            Some((_, Ok(None))) => Listed::Failed(Error::NoResourceVersion),
            Some((_, Err(error))) => Listed::Failed(Error::InitialListFailed(error)),
            // Every list's task sends its end before it ends.
            None => Listed::Failed(Error::InitialListFailed(kube::Error::Service(
                "a list ended without an answer".into(),
            ))),
        }
    }

    /// Reads each of `bodies` here and decodes it on a blocking thread, At by At.
    fn start(
        bodies: Vec<impl futures::AsyncBufRead + Send + Unpin + 'static>,
        asked: Option<String>,
    ) -> Listing {
        let (ats_out, ats) = mpsc::channel(BATCHES);
        let (ends, ended) = mpsc::channel(bodies.len().max(1));
        let versions = vec![None; bodies.len()];
        let lists = bodies
            .into_iter()
            .enumerate()
            .map(|(list, body)| {
                let (chunks_in, chunks) = mpsc::channel::<Vec<u8>>(CHUNKS);
                let (ats_out, ends) = (ats_out.clone(), ends.clone());
                let reading = AbortOnDropHandle::new(tokio::spawn(read_chunks(body, chunks_in)));
                let decoding = tokio::task::spawn_blocking(move || {
                    let reader = std::io::BufReader::with_capacity(1 << 16, Chunks::new(chunks));
                    let mut json = serde_json::Deserializer::from_reader(reader);
                    let decoded = ListSeed { ats: &ats_out }.deserialize(&mut json);
                    decoded.and_then(|version| json.end().map(|()| version))
                });
                AbortOnDropHandle::new(tokio::spawn(async move {
                    let decoded = decoding.await;
                    // The body's own error (a dropped connection) says more than the decoder's
                    // EOF.
                    let read = reading.await;
                    let end = match (decoded, read) {
                        (Ok(Ok(version)), _) => Ok(version),
                        (_, Ok(Err(error))) => Err(kube::Error::ReadEvents(error)),
                        (Ok(Err(error)), _) => Err(kube::Error::SerdeError(error)),
                        (Err(join), _) => Err(kube::Error::Service(Box::new(join))),
                    };
                    // Room for every list's end: this never waits.
                    drop(ends.send((list, end)).await);
                }))
            })
            .collect();
        Listing {
            asked,
            ats,
            drained: false,
            ended,
            versions,
            _lists: lists,
        }
    }
}

/// Reads the body in chunks for the decoder, until the end or until the decoder is gone.
async fn read_chunks(
    mut body: impl futures::AsyncBufRead + Unpin,
    chunks: mpsc::Sender<Vec<u8>>,
) -> std::io::Result<()> {
    loop {
        let chunk = timeout(IDLE, body.fill_buf())
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "the list stopped"))??
            .to_vec();
        if chunk.is_empty() {
            return Ok(());
        }
        body.consume_unpin(chunk.len());
        if chunks.send(chunk).await.is_err() {
            return Ok(());
        }
    }
}

/// The chunks as one `Read`, for serde_json on the blocking thread.
struct Chunks {
    chunks: mpsc::Receiver<Vec<u8>>,
    current: std::io::Cursor<Vec<u8>>,
}

impl Chunks {
    fn new(chunks: mpsc::Receiver<Vec<u8>>) -> Self {
        Chunks {
            chunks,
            current: std::io::Cursor::new(Vec::new()),
        }
    }
}

impl std::io::Read for Chunks {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let n = self.current.read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            match self.chunks.blocking_recv() {
                Some(chunk) => self.current = std::io::Cursor::new(chunk),
                // The end of the body (or the reader's error, which `done` reports).
                None => return Ok(0),
            }
        }
    }
}

/// A list object: its `items` go out one by one as they are decoded; its
/// `metadata.resourceVersion` is the answer.
struct ListSeed<'a> {
    ats: &'a mpsc::Sender<Vec<CachedAt>>,
}

impl<'de> DeserializeSeed<'de> for ListSeed<'_> {
    type Value = Option<String>;

    fn deserialize<D: de::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ListSeed<'_> {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of Ats")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        #[derive(serde::Deserialize)]
        struct ListMeta {
            #[serde(rename = "resourceVersion")]
            resource_version: Option<String>,
        }
        let mut version = None;
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match key.as_ref() {
                "items" => map.next_value_seed(ItemsSeed { ats: self.ats })?,
                "metadata" => version = map.next_value::<ListMeta>()?.resource_version,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(version.filter(|v| !v.is_empty()))
    }
}

/// A list's `items`, sent on as they are decoded.
struct ItemsSeed<'a> {
    ats: &'a mpsc::Sender<Vec<CachedAt>>,
}

impl<'de> DeserializeSeed<'de> for ItemsSeed<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        // `any`, not `seq`: a list with no items may say `"items": null`.
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ItemsSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("the Ats of a list")
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(()) // `"items": null`: an empty list
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<(), A::Error> {
        let gone = || de::Error::custom("the list is no longer wanted");
        let mut batch = Vec::with_capacity(BATCH);
        // Each item as its text first: the fast decoder skips what the cache does not keep.
        while let Some(text) = items.next_element::<Box<serde_json::value::RawValue>>()? {
            batch.push(CachedAt::decode_text(text.get()));
            if batch.len() == BATCH {
                let full = std::mem::replace(&mut batch, Vec::with_capacity(BATCH));
                self.ats.blocking_send(full).map_err(|_| gone())?;
            }
        }
        if !batch.is_empty() {
            self.ats.blocking_send(batch).map_err(|_| gone())?;
        }
        Ok(())
    }
}

/// The error for an API server that stayed silent past `IDLE`.
fn silent() -> kube::Error {
    kube::Error::ReadEvents(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("no answer within {IDLE:?}"),
    ))
}

#[cfg(test)]
mod tests;

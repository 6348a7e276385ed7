//! How the At cache follows the Ats: one list, decoded as it streams in, then a watch from the
//! list's resourceVersion; the same `watcher::Event`s kube-runtime's watcher gives, so the
//! runtime's reflector store and backoff take them unchanged.
//!
//! Why not kube-runtime's watcher: measured on kube-apiserver v1.24 with 100,000 Ats (see the
//! README, "Performance"), its list in pages of 500 is served from etcd and takes about 38 s; a
//! list at `resourceVersion=0` is served from the API server's watch cache in about 7 s, but
//! v1.24 then ignores `limit` and answers with one body of about 136 MB, which kube-client
//! collects and copies (twice) before decoding it. Here that body is decoded item by item while
//! it arrives, on a blocking thread, and each At is compacted into a `CachedAt` at once: the
//! list costs what its Ats cost cached, not three copies of their JSON.
//!
//! - The first list asks for `resourceVersion=0` (any version the API server has at hand: its
//!   watch cache). Each later list, after a watch expired (410), asks for a version not older
//!   than the last one seen, so the cache never goes back in time.
//! - A watch ends normally after its timeout; it is started again from the last version seen
//!   (bookmarks keep that fresh). A watch silent for longer than its timeout, a list body
//!   silent for `IDLE`, or an answer that does not start within `IDLE`, is taken for a dead
//!   connection (kube-client sets no read timeout): the watch is started again, the list failed.
//! - Errors are yielded as `watcher::Error`s for the caller's backoff; the next poll retries.
//!   A watch whose version expired (410) is yielded as an error too (then listed again), as
//!   kube-runtime does, so a relist is logged and backed off.

use super::CachedAt;
use futures::{AsyncBufReadExt, Stream, StreamExt};
use kube::api::{ListParams, VersionMatch, WatchEvent, WatchParams};
use kube::core::Request;
use kube::runtime::watcher::{Error, Event};
use kube::{Client, Resource};
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::timeout;
use tokio_util::task::AbortOnDropHandle;

/// Seconds a watch asks to last (kube-runtime's watcher asks the same).
const WATCH_TIMEOUT: u32 = 290;
/// A watch with no event (bookmarks included) for this long is dead (as kube-runtime judges).
const WATCH_IDLE: Duration = Duration::from_secs(WATCH_TIMEOUT as u64 + 5);
/// An answer that does not start, or a list body that stops, for this long is dead
/// (kube-apiserver ends any request after 60 s by default).
const IDLE: Duration = Duration::from_secs(60);
/// Chunks of the list body in flight to the decoder, and batches of decoded Ats in flight
/// back, of at most `BATCH` each (one wake-up per batch, not per At).
const CHUNKS: usize = 64;
const BATCHES: usize = 8;
const BATCH: usize = 256;

type EventStream = Pin<Box<dyn Stream<Item = kube::Result<WatchEvent<CachedAt>>> + Send>>;

/// Where the follower is.
enum State {
    /// To list, at any version (`None`: the first list) or not older than this one.
    List(Option<String>),
    /// A list in progress: its decoded Ats, then its resourceVersion.
    Listing(Listing),
    /// To watch from this version.
    Watch(String),
    Watching(String, EventStream),
}

/// Follows the Ats (of `namespace`, or all) with `client`, as kube-runtime's `watcher` does
/// (see the module docs for the difference).
pub fn follow(
    client: Client,
    namespace: Option<String>,
) -> impl Stream<Item = Result<Event<CachedAt>, Error>> + Send {
    let url = CachedAt::url_path(&(), namespace.as_deref());
    futures::stream::unfold(
        (State::List(None), client, url, VecDeque::new()),
        |(mut state, client, url, mut ready)| async move {
            loop {
                if let Some(event) = ready.pop_front() {
                    return Some((event, (state, client, url, ready)));
                }
                let (next, events) = step(state, &client, &url).await;
                state = next;
                ready.extend(events);
            }
        },
    )
}

/// One step: the next state, and what it yields.
async fn step(
    state: State,
    client: &Client,
    url: &str,
) -> (State, Vec<Result<Event<CachedAt>, Error>>) {
    match state {
        State::List(version) => {
            let params = match &version {
                None => ListParams::default().match_any(),
                Some(version) => ListParams {
                    resource_version: Some(version.clone()),
                    version_match: Some(VersionMatch::NotOlderThan),
                    ..ListParams::default()
                },
            };
            let request = Request::new(url).list(&params);
            let answer = match request {
                Ok(request) => timeout(IDLE, client.request_stream(request))
                    .await
                    .unwrap_or_else(|_| Err(silent())),
                Err(error) => Err(kube::Error::BuildRequest(error)),
            };
            match answer {
                Ok(body) => (
                    State::Listing(Listing::start(body, version)),
                    vec![Ok(Event::Init)],
                ),
                Err(error) => (
                    State::List(version),
                    vec![Err(Error::InitialListFailed(error))],
                ),
            }
        }
        State::Listing(mut listing) => match listing.ats.recv().await {
            Some(ats) => {
                let events = ats.into_iter().map(|at| Ok(Event::InitApply(at))).collect();
                (State::Listing(listing), events)
            }
            // Every At is in: the decoder's answer is the list's resourceVersion.
            None => match listing.done.await {
                Ok(Ok(Some(version))) => (State::Watch(version), vec![Ok(Event::InitDone)]),
                Ok(Ok(None)) => (
                    State::List(listing.asked),
                    vec![Err(Error::NoResourceVersion)],
                ),
                Ok(Err(error)) => (
                    State::List(listing.asked),
                    vec![Err(Error::InitialListFailed(error))],
                ),
                Err(join) => (
                    State::List(listing.asked),
                    vec![Err(Error::InitialListFailed(kube::Error::Service(
                        Box::new(join),
                    )))],
                ),
            },
        },
        State::Watch(version) => {
            // Bookmarks are on by default.
            let params = WatchParams::default().timeout(WATCH_TIMEOUT);
            let request = match Request::new(url).watch(&params, &version) {
                Ok(request) => request,
                Err(error) => {
                    return (
                        State::Watch(version),
                        vec![Err(Error::WatchStartFailed(kube::Error::BuildRequest(
                            error,
                        )))],
                    )
                }
            };
            // A refusal (410 too) comes as the stream's first event.
            let started = timeout(IDLE, client.request_events::<CachedAt>(request))
                .await
                .unwrap_or_else(|_| Err(silent()));
            match started {
                Ok(events) => (State::Watching(version, Box::pin(events)), vec![]),
                Err(error) => (
                    State::Watch(version),
                    vec![Err(Error::WatchStartFailed(error))],
                ),
            }
        }
        State::Watching(version, mut events) => match timeout(WATCH_IDLE, events.next()).await {
            Ok(Some(Ok(event))) => watched(version, events, event),
            Ok(Some(Err(kube::Error::Api(status)))) if status.code == 410 => (
                State::List(Some(version)),
                vec![Err(Error::WatchError(status))],
            ),
            Ok(Some(Err(error))) => (State::Watch(version), vec![Err(Error::WatchFailed(error))]),
            // Ended after its timeout, as asked, or silent past it: go on from the last version.
            Ok(None) | Err(_) => (State::Watch(version), vec![]),
        },
    }
}

/// What one watch event does.
fn watched(
    version: String,
    events: EventStream,
    event: WatchEvent<CachedAt>,
) -> (State, Vec<Result<Event<CachedAt>, Error>>) {
    let at_version = |at: &CachedAt| {
        at.meta()
            .resource_version
            .clone()
            .unwrap_or_else(|| version.clone())
    };
    match event {
        WatchEvent::Added(at) | WatchEvent::Modified(at) => (
            State::Watching(at_version(&at), events),
            vec![Ok(Event::Apply(at))],
        ),
        WatchEvent::Deleted(at) => (
            State::Watching(at_version(&at), events),
            vec![Ok(Event::Delete(at))],
        ),
        WatchEvent::Bookmark(mark) => (
            State::Watching(mark.metadata.resource_version, events),
            vec![],
        ),
        WatchEvent::Error(status) if status.code == 410 => (
            State::List(Some(version)),
            vec![Err(Error::WatchError(status))],
        ),
        WatchEvent::Error(status) => (State::Watch(version), vec![Err(Error::WatchError(status))]),
    }
}

/// A list being decoded: the Ats as they are decoded, then the list's resourceVersion.
struct Listing {
    /// The version the list asked for, to ask again if it fails.
    asked: Option<String>,
    ats: mpsc::Receiver<Vec<CachedAt>>,
    done: AbortOnDropHandle<kube::Result<Option<String>>>,
}

impl Listing {
    /// Reads `body` here and decodes it on a blocking thread, At by At.
    fn start(
        body: impl futures::AsyncBufRead + Send + Unpin + 'static,
        asked: Option<String>,
    ) -> Listing {
        let (chunks_in, chunks) = mpsc::channel::<Vec<u8>>(CHUNKS);
        let (ats_out, ats) = mpsc::channel(BATCHES);
        // Dropped with the list (its stream was dropped): reading stops, which ends the decoder.
        let reading = AbortOnDropHandle::new(tokio::spawn(read_chunks(body, chunks_in)));
        let decoding = tokio::task::spawn_blocking(move || {
            let reader = std::io::BufReader::with_capacity(1 << 16, Chunks::new(chunks));
            let mut json = serde_json::Deserializer::from_reader(reader);
            let decoded = ListSeed { ats: &ats_out }.deserialize(&mut json);
            decoded.and_then(|version| json.end().map(|()| version))
        });
        let done = AbortOnDropHandle::new(tokio::spawn(async move {
            let decoded = decoding.await;
            // The body's own error (a dropped connection) says more than the decoder's EOF.
            let read = reading.await;
            match (decoded, read) {
                (Ok(Ok(version)), _) => Ok(version),
                (_, Ok(Err(error))) => Err(kube::Error::ReadEvents(error)),
                (Ok(Err(error)), _) => Err(kube::Error::SerdeError(error)),
                (Err(join), _) => Err(kube::Error::Service(Box::new(join))),
            }
        }));
        Listing { asked, ats, done }
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

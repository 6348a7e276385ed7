//! The Ats as every replica caches them, leader or not, so a replica that becomes leader starts
//! from a full cache instead of listing every At first.
//!
//! `CachedAt` is an At in the form the cache keeps: at 100,000 Ats a typed `At` (each string
//! its own allocation) would be most of the operator's memory. It
//! keeps the name and namespace (all the runtime's store and queue key on), the resourceVersion
//! (which the watch resumes from), what the metrics read on every scrape (phase, due instant,
//! namespace), and the rest of the At as its JSON, compressed by LZ4 against a dictionary of what
//! every At repeats (`pack`), read back with `at()` when a reconcile or wake-up needs it.
//! `cargo bench --bench cache` measures what that saves.

use crate::api::{At, AtSpec, AtStatus, Phase};
use crate::operator::key::AtKey;
use crate::operator::pod::Stuck;
use crate::operator::quarantine::Quarantine;
use crate::schedule;
use crate::shard;
use chrono::{DateTime, Utc};
use freshness::Freshness;
use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::NamespaceResourceScope;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher::Event;
use kube::runtime::{reflector, WatchStreamExt};
use kube::{Client, Resource, ResourceExt};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::broadcast;
use tokio_util::task::AbortOnDropHandle;
use tracing::{error, info, warn};

/// An At as the cache keeps it (see the module docs). Decoded from the API server's JSON as an
/// `At`, trimmed (no managed fields or annotations, which nothing here reads) and compacted. An
/// At that does not decode (a value the schema lets through but the At type cannot hold, e.g. an
/// `exitCode` past int32, which kube-apiserver does not check) is kept as unreadable, with the
/// reason: one such At must not fail the list of every At.
#[derive(Clone, Debug)]
pub struct CachedAt {
    /// Name, namespace and resourceVersion (which the watch resumes from) only: the rest is in
    /// `packed`.
    metadata: ObjectMeta,
    phase: Phase,
    /// Its shard label's value (`shard::value_of`), `NO_VALUE` when it has none: which of the
    /// shard lists holds it (a watch that follows several lists uses that to tell what they
    /// already held), and the label itself, which is not kept twice.
    label: u8,
    /// The instant the schedule names; `None` when it does not parse.
    due: Option<DateTime<Utc>>,
    /// Its spec sets `ttlSecondsAfterFinished` (a DONE At is then deleted some time after).
    ttl: bool,
    /// What keeps its pod from starting the command, as its status shows it (`cnat_ats_stuck`).
    stuck: Option<Stuck>,
    /// The rest of the trimmed At (`Rest`), as JSON compressed with LZ4 against a dictionary of
    /// what every At repeats (`pack`).
    packed: Box<[u8]>,
    /// Why the At did not decode; `packed` is then empty.
    unreadable: Option<Box<str>>,
}

/// Through a JSON value, which any deserializer can give (a watch event's object comes through
/// serde's buffered content, which cannot give raw JSON text).
impl<'de> Deserialize<'de> for CachedAt {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        Ok(CachedAt::decode(&value))
    }
}

/// What the cache decodes of an At: its metadata without managedFields and annotations, which
/// nothing here reads and which are most of an At's bytes (the decoder skips them without
/// building them), its spec and its status.
#[derive(Deserialize)]
struct Incoming {
    metadata: meta::KeptMeta,
    spec: AtSpec,
    #[serde(default)]
    status: Option<AtStatus>,
}

impl From<Incoming> for At {
    fn from(incoming: Incoming) -> At {
        let Incoming {
            metadata: m,
            spec,
            status,
        } = incoming;
        let mut at = At::new(m.0.name.as_deref().unwrap_or_default(), spec);
        at.metadata = m.0;
        at.status = status;
        at
    }
}

impl CachedAt {
    /// Decodes an At from its JSON text (an item of a list); what does not decode is kept as
    /// unreadable.
    pub fn decode_text(json: &str) -> CachedAt {
        match serde_json::from_str::<Incoming>(json) {
            Ok(incoming) => At::from(incoming).into(),
            // The slow way, which says why and keeps what it can.
            Err(_) => match serde_json::from_str::<serde_json::Value>(json) {
                Ok(value) => CachedAt::decode(&value),
                Err(error) => CachedAt::undecodable(ObjectMeta::default(), error.to_string()),
            },
        }
    }

    /// Decodes an At from its JSON; what does not decode is kept as unreadable.
    pub fn decode(json: &serde_json::Value) -> CachedAt {
        match Incoming::deserialize(json) {
            Ok(incoming) => At::from(incoming).into(),
            Err(error) => {
                let meta = json
                    .get("metadata")
                    .and_then(|m| ObjectMeta::deserialize(m).ok())
                    .unwrap_or_default();
                CachedAt::undecodable(meta, error.to_string())
            }
        }
    }

    fn undecodable(meta: ObjectMeta, why: String) -> CachedAt {
        CachedAt {
            label: label_of(&meta),
            metadata: ObjectMeta {
                name: meta.name,
                namespace: meta.namespace,
                resource_version: meta.resource_version,
                uid: meta.uid,
                ..ObjectMeta::default()
            },
            phase: Phase::Pending,
            due: None,
            ttl: false,
            stuck: None,
            packed: Box::default(),
            unreadable: Some(why.into()),
        }
    }

    /// Why this At could not be read, if it could not.
    pub fn unreadable(&self) -> Option<&str> {
        self.unreadable.as_deref()
    }

    /// Which of the shard lists (`shard::selectors()`) holds this At.
    pub fn list(&self) -> usize {
        shard::list_of_value(self.value())
    }

    /// Its shard label's value, when it is one the webhook gives.
    fn value(&self) -> Option<u8> {
        (self.label != NO_VALUE).then_some(self.label)
    }
}

/// `CachedAt::label` of an At without a shard label value.
const NO_VALUE: u8 = u8::MAX;

/// `CachedAt::label` of an At with this metadata.
fn label_of(meta: &ObjectMeta) -> u8 {
    shard::value_of(meta.labels.as_ref()).unwrap_or(NO_VALUE)
}

impl From<At> for CachedAt {
    fn from(at: At) -> Self {
        let due = schedule::parse(&at.spec.schedule, at.spec.time_zone.as_deref()).ok();
        let ttl = at.spec.ttl_seconds_after_finished.is_some();
        let phase = at.phase();
        let stuck = at.status.as_ref().and_then(Stuck::shown);
        let At {
            mut metadata,
            spec,
            status,
            ..
        } = at;
        let key = ObjectMeta {
            name: metadata.name.take(),
            namespace: metadata.namespace.take(),
            resource_version: metadata.resource_version.take(),
            ..ObjectMeta::default()
        };
        let label = label_of(&metadata);
        // Of the rest of its metadata only what cnat reads, all of it of bounded size: not its
        // labels (the shard label's value is `label`), annotations, finalizers, owner references
        // or managed fields, which its writer may make as large as the API server allows.
        let metadata = ObjectMeta {
            uid: metadata.uid,
            generation: metadata.generation,
            creation_timestamp: metadata.creation_timestamp,
            deletion_timestamp: metadata.deletion_timestamp,
            deletion_grace_period_seconds: metadata.deletion_grace_period_seconds,
            ..ObjectMeta::default()
        };
        let rest = Rest {
            metadata,
            spec,
            status,
        };
        // It serializes: its maps have string keys. Were that ever to fail, reading it back
        // fails too, and says so; this says why.
        let json = serde_json::to_vec(&rest).unwrap_or_else(|error| {
            error!(%error, at = ?key.name, namespace = ?key.namespace, "caching an At");
            Vec::new()
        });
        CachedAt {
            label,
            metadata: key,
            phase,
            due,
            ttl,
            stuck,
            packed: pack::pack(&json),
            unreadable: None,
        }
    }
}

/// What the JSON holds: the At without what `CachedAt` keeps apart (name, namespace,
/// resourceVersion) or the type says (apiVersion, kind).
#[derive(Serialize, Deserialize)]
struct Rest {
    metadata: ObjectMeta,
    spec: AtSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    status: Option<AtStatus>,
}

impl CachedAt {
    /// The At, as it was cached. An error means the cache holds what the At type cannot read
    /// back, which is a bug: callers log it and leave the At alone.
    pub fn at(&self) -> Result<At, CacheError> {
        if let Some(why) = &self.unreadable {
            return Err(CacheError {
                at: AtKey::of(self),
                source: Fault::Unreadable(why.to_string()),
            });
        }
        let fault = |source| CacheError {
            at: AtKey::of(self),
            source,
        };
        let json = pack::unpack(&self.packed).map_err(|e| fault(Fault::Lz4(e)))?;
        let rest: Rest = serde_json::from_slice(&json).map_err(|e| fault(Fault::Json(e)))?;
        let mut at = At::new(&self.name_any(), rest.spec);
        at.metadata = ObjectMeta {
            name: self.metadata.name.clone(),
            namespace: self.metadata.namespace.clone(),
            resource_version: self.metadata.resource_version.clone(),
            ..rest.metadata
        };
        if let Some(value) = self.value() {
            let labels = at.metadata.labels.get_or_insert_with(Default::default);
            labels.insert(shard::LABEL.to_owned(), value.to_string());
        }
        at.status = rest.status;
        Ok(at)
    }

    /// The phase, `PENDING` while no status was written.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The instant the schedule names, `None` when it does not parse.
    pub fn due(&self) -> Option<DateTime<Utc>> {
        self.due
    }

    /// Whether its spec sets `ttlSecondsAfterFinished`.
    pub fn sets_ttl(&self) -> bool {
        self.ttl
    }

    /// What keeps its pod from starting the command, as its status shows it.
    pub fn stuck(&self) -> Option<Stuck> {
        self.stuck
    }

    /// The At this cached copy is of, by name and namespace.
    pub fn key(cached: &CachedAt) -> AtKey {
        AtKey::of(cached)
    }

    /// The same At's key in the runtime's queue of Ats to reconcile.
    pub fn key_of(at: &AtKey) -> ObjectRef<CachedAt> {
        at.to_ref()
    }
}

#[cfg(test)]
impl CachedAt {
    /// The bytes its JSON takes packed (`pack`), and what LZ4 alone makes of the same JSON.
    pub(crate) fn packed_sizes(&self) -> (usize, usize) {
        let json = pack::unpack(&self.packed).unwrap_or_default();
        let alone = lz4_flex::block::compress_prepend_size(&json);
        (self.packed.len(), alone.len())
    }

    /// An At running `true` at `schedule`, in `phase` (`None`: no status yet), as cached.
    pub(crate) fn example(
        name: &str,
        namespace: &str,
        schedule: &str,
        phase: Option<Phase>,
    ) -> Self {
        let mut at = At::new(
            name,
            AtSpec {
                schedule: schedule.into(),
                command: "true".into(),
                ..AtSpec::default()
            },
        );
        at.metadata.namespace = Some(namespace.into());
        at.status = phase.map(|phase| AtStatus {
            phase,
            ..AtStatus::default()
        });
        at.into()
    }
}

/// A cached At that does not read back as an At (a bug in cnat).
#[derive(Debug, thiserror::Error)]
#[error("At {at}: the cached copy does not read back ({source}); it is left alone until it changes. Please report this as a bug")]
pub struct CacheError {
    at: AtKey,
    source: Fault,
}

/// What went wrong reading a cached At back.
#[derive(Debug, thiserror::Error)]
pub enum Fault {
    #[error("it does not decode as an At: {0}")]
    Unreadable(String),
    #[error("decompressing: {0}")]
    Lz4(lz4_flex::block::DecompressError),
    #[error("decoding: {0}")]
    Json(serde_json::Error),
}

/// The At's API identity: what the runtime queries, and what pods' owner references name.
impl Resource for CachedAt {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(dt: &()) -> Cow<'_, str> {
        At::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        At::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        At::version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        At::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// Changes to cached Ats kept for a leader that falls behind; past that it looks at them all.
const CHANGES: usize = 4096;

/// What the cache tells the leader's reconcile loop.
#[derive(Clone, Debug)]
pub enum Change {
    /// An At was created or changed: this version, as the store now holds it.
    At(Arc<CachedAt>),
    /// An At was deleted (its name and namespace).
    Deleted(AtKey),
    /// The watch listed every At again (at start, or after its resourceVersion expired): the
    /// store now holds what that list found, so anything may have changed.
    Relisted,
}

/// The Ats this replica caches, with a feed of every change for the leader's reconcile loop.
#[derive(Clone)]
pub struct AtCache {
    store: Store<CachedAt>,
    changes: broadcast::Sender<Change>,
    /// At versions whose handling panicked, kept across leaderships (see `quarantine`).
    quarantine: Arc<Quarantine>,
    /// Cancelled when the watch task ended (it only does by a panic): the cache is frozen.
    stopped: tokio_util::sync::CancellationToken,
    /// How far the first list has come.
    listing: Arc<ListProgress>,
    /// Whether the store is caught up with the API server now.
    freshness: Freshness,
    /// Whether it lists by a streaming watch (`follow`).
    streams: Arc<std::sync::atomic::AtomicBool>,
    _watch: Arc<AbortOnDropHandle<()>>,
}

/// How far the cache's first list has come: a replica leads, and says it is ready, only once
/// it holds every At (see `AtCache::listed`).
#[derive(Debug, Default)]
struct ListProgress {
    /// Ats received by the list in progress.
    received: std::sync::atomic::AtomicUsize,
    /// A complete list is in the store; relists keep the store they replace until they end.
    complete: tokio_util::sync::CancellationToken,
    /// Why the last attempt failed, while none succeeded (for `/readyz`).
    failed: std::sync::Mutex<Option<String>>,
}

/// Whether a list failed because no conversion webhook answered the API server at all (its
/// message: "conversion webhook for GROUP/VERSION, Kind=At failed: Post ...: EOF", or a refused
/// or reset connection, or a Service without endpoints). Not for a webhook that answered
/// wrongly or could not be trusted (x509, a `Failure` result): readiness would not help there,
/// and an unready replica keeps a rolling update from stopping the old leader.
fn needs_conversion_webhook(error: &str) -> bool {
    error.contains("conversion webhook for")
        && [
            ": EOF",
            "connection refused",
            "connection reset by peer",
            "no endpoints available",
        ]
        .iter()
        .any(|unanswered| error.contains(unanswered))
}

impl AtCache {
    /// Starts watching Ats (in `namespace`, or all) on the current runtime, until dropped;
    /// every At listed by a streaming watch where the API server offers one.
    pub fn start(client: &Client, namespace: Option<&str>) -> Self {
        Self::start_listing(client, namespace, true)
    }

    /// As `start`; `streaming`: whether to list by a streaming watch where the API server
    /// offers one (`false`: by lists, as on a server that does not).
    pub fn start_listing(client: &Client, namespace: Option<&str>, streaming: bool) -> Self {
        Self::start_selected(client, namespace, None, streaming)
    }

    /// As `start_listing`, caching only the Ats `selector` selects (a Lease shard's,
    /// `shard::Shards::selector`; `None`: every At).
    pub fn start_selected(
        client: &Client,
        namespace: Option<&str>,
        selector: Option<String>,
        streaming: bool,
    ) -> Self {
        let (store, writer) = reflector::store();
        let (changes, _) = broadcast::channel(CHANGES);
        let (feed, cached) = (changes.clone(), store.clone());
        let listing = Arc::new(ListProgress::default());
        let progress = listing.clone();
        let started = std::time::Instant::now();
        let stopped = tokio_util::sync::CancellationToken::new();
        // Dropped when the task ends, by a panic too (unwinding drops it).
        let alive = stopped.clone().drop_guard();
        let freshness = Freshness::default();
        let streams = Arc::new(std::sync::atomic::AtomicBool::new(streaming));
        let streamed = streams.clone();
        let watch = follow::follow(
            client.clone(),
            namespace.map(str::to_owned),
            selector,
            store.clone(),
            freshness.clone(),
            streamed.clone(),
        )
        .backoff(watch_backoff())
        .reflect(writer)
        .for_each(move |event| {
            let change = match event {
                // The store was written before this runs, in the same task: its copy is
                // this version (shared, not copied again).
                Ok(Event::Apply(at)) => Some(Change::At(
                    cached
                        .get(&ObjectRef::from_obj(&at))
                        .unwrap_or_else(|| Arc::new(at)),
                )),
                // A list goes into the store only whole, at its end.
                Ok(Event::InitDone) => {
                    if !progress.complete.is_cancelled() {
                        info!(
                            ats = cached.len(),
                            took = ?started.elapsed(),
                            streamed = streamed.load(Ordering::Relaxed),
                            "the At cache holds every At"
                        );
                        progress.complete.cancel();
                    }
                    Some(Change::Relisted)
                }
                // The leader drops what it kept for it.
                Ok(Event::Delete(at)) => Some(Change::Deleted(AtKey::of(&at))),
                Ok(Event::Init) => {
                    progress.received.store(0, Ordering::Relaxed);
                    None
                }
                Ok(Event::InitApply(_)) => {
                    progress.received.fetch_add(1, Ordering::Relaxed);
                    None
                }
                Err(error) => {
                    warn!(%error, "watching Ats");
                    if !progress.complete.is_cancelled() {
                        let mut failed = progress.failed.lock().unwrap_or_else(|e| e.into_inner());
                        *failed = Some(error.to_string());
                    }
                    None
                }
            };
            // No leader listening is fine: nothing is kept for it.
            if let Some(change) = change {
                drop(feed.send(change));
            }
            std::future::ready(())
        });
        let watch = async move {
            let _alive = alive;
            watch.await;
        };
        AtCache {
            store,
            changes,
            quarantine: Arc::default(),
            stopped,
            listing,
            streams,
            freshness,
            _watch: Arc::new(AbortOnDropHandle::new(tokio::spawn(watch))),
        }
    }

    /// Completes if the cache stopped following the Ats (its task panicked): nothing this
    /// replica does is right after that, so `cnat run` exits and the pod restarts.
    pub fn stopped(&self) -> tokio_util::sync::WaitForCancellationFutureOwned {
        self.stopped.clone().cancelled_owned()
    }

    /// Completes once the cache holds a complete list of the Ats (at once if it did).
    pub fn listed(&self) -> tokio_util::sync::WaitForCancellationFutureOwned {
        self.listing.complete.clone().cancelled_owned()
    }

    /// Whether the cache lists by a streaming watch: it was asked to, and the API server has
    /// not refused one.
    pub fn streams_lists(&self) -> bool {
        self.streams.load(Ordering::Relaxed)
    }

    /// `Ok` once the cache holds a complete list; else how far the first list has come, for
    /// `/readyz`.
    pub fn readiness(&self) -> Result<(), StillListing> {
        if self.listing.complete.is_cancelled() {
            return Ok(());
        }
        let received = self.listing.received.load(Ordering::Relaxed);
        let failed = self
            .listing
            .failed
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if failed.as_deref().is_some_and(needs_conversion_webhook) {
            // The list waits for the conversion webhook, which the webhook Service sends only
            // to ready replicas: when all replicas start at once while Ats are still stored as
            // v1alpha1, none would ever be ready. So ready (webhooks serve), but no candidate
            // for the Lease until the list completes (`listed`).
            return Ok(());
        }
        Err(StillListing {
            received,
            failed: failed.clone(),
        })
    }

    /// Whether the store is caught up with the API server (`freshness`).
    pub fn freshness(&self) -> &Freshness {
        &self.freshness
    }

    /// At versions this replica skips after a panic handling them.
    pub fn quarantine(&self) -> &Arc<Quarantine> {
        &self.quarantine
    }

    /// This cache, with `quarantine` as the At versions it skips: one that outlives the cache
    /// (a shard's, shared by each of its leaderships, each with a cache of its own).
    pub fn with_quarantine(mut self, quarantine: Arc<Quarantine>) -> Self {
        self.quarantine = quarantine;
        self
    }

    /// The cached Ats.
    pub fn store(&self) -> &Store<CachedAt> {
        &self.store
    }

    /// Every change from now on; `Lagged` when the receiver fell more than 4096 behind.
    pub fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.changes.subscribe()
    }
}

/// The cache does not hold every At yet: how far its first list has come.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("listing Ats: {received} received so far{}; this replica leads and is ready once it holds them all", last_failure(.failed.as_deref()))]
pub struct StillListing {
    pub received: usize,
    /// Why the last attempt failed, if it did.
    pub failed: Option<String>,
}

fn last_failure(failed: Option<&str>) -> String {
    failed
        .map(|error| format!(" (the last attempt failed: {error})"))
        .unwrap_or_default()
}

/// Reads `cached` back as an At; `None` if it does not read: an At the API server holds but
/// the At type cannot (the leader tells it in an event), or else a bug, which is logged.
pub fn read(cached: &CachedAt) -> Option<At> {
    if cached.unreadable.is_some() {
        return None;
    }
    cached
        .at()
        .inspect_err(|bug| error!(error = %bug, "cached At"))
        .ok()
}

mod follow;
pub mod freshness;
mod meta;
mod pack;

/// Retrying a failed watch (the At cache's and the leader's pod watch): 100 ms doubling to
/// 500 ms, plus up to as much again of jitter, so never more than 1 s; reset by any event.
/// kube's default grows to 30 s, which after an API server outage leaves the caches (and new
/// Ats) waiting up to that long after the server is back; one request a second per watch is
/// cheap.
pub fn watch_backoff() -> kube::runtime::watcher::ExponentialBackoff {
    backon::ExponentialBuilder::new()
        .with_min_delay(std::time::Duration::from_millis(100))
        .with_max_delay(std::time::Duration::from_millis(500))
        .with_jitter()
        .without_max_times()
        .into()
}

#[cfg(test)]
mod tests;

//! The Ats as every replica caches them, leader or not, so a replica that becomes leader starts
//! from a full cache: `AtCache`, the store of `CachedAt`s that `follow` keeps up, and its feed.
//! See docs/src/design/decisions.md, "The At cache".

use crate::operator::key::AtKey;
use crate::operator::quarantine::Quarantine;
use crate::sync::lock;
pub use cached_at::{read, CacheError, CachedAt, Fault};
use freshness::Freshness;
use futures::StreamExt;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher::Event;
use kube::runtime::{reflector, WatchStreamExt};
use kube::Client;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::broadcast;
use tokio_util::task::AbortOnDropHandle;
use tracing::{info, warn};

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
    listing: Arc<ListProgress>,
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

/// Whether a list failed because no conversion webhook answered the API server at all (EOF, a
/// refused or reset connection, no endpoints); not for one that answered wrongly or could not be
/// trusted (x509, a `Failure` result), where being ready would not help.
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
                        let mut failed = lock(&progress.failed);
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
        let failed = lock(&self.listing.failed);
        if failed.as_deref().is_some_and(needs_conversion_webhook) {
            // The list waits for the conversion webhook, which the Service sends only to ready
            // replicas: ready, then, but no candidate for the Lease until the list completes.
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

    /// Every change from now on; `Lagged` when the receiver fell more than `CHANGES` behind.
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

mod cached_at;
mod follow;
pub mod freshness;
mod meta;
mod pack;

/// Retrying a failed watch (the At cache's and the leader's pod watch): 100 ms doubling to
/// 500 ms, plus up to as much again of jitter, so never more than 1 s; reset by any event.
/// Why so short: docs/src/design/decisions.md, "Recovery after an outage".
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

//! Wires the reconciler to the cluster: a trimmed watch of Ats, a watch of only the pods cnat
//! created (by label), and kube-runtime's `Controller` for queueing, requeues and concurrency.
//!
//! The Ats are cached by every replica (`AtCache`), leader or not, so a replica that becomes
//! leader starts from a full cache instead of listing every At first; the pods, usually far
//! fewer, are watched by the leader only.

use crate::api::At;
use crate::events::EventSink;
use crate::metrics::Metrics;
use crate::pod;
use crate::policy::RunPolicy;
use crate::reconcile::wakeups::Wakeups;
use crate::reconcile::{error_policy, reconcile, Context};
use backon::{BackoffBuilder, ExponentialBuilder};
use chrono::Utc;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::controller::{self, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::utils::Backoff;
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::{Api, Client};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{info, warn};

/// What `cnat run` tells the controller.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Watch this namespace only; `None` watches all.
    pub namespace: Option<String>,
    /// Most reconciles at once; 0 means no limit.
    pub concurrency: u16,
    /// Defaults for what Ats leave out, and the RUNNING re-check interval.
    pub policy: RunPolicy,
}

/// Changes to cached Ats kept for a leader that falls behind; past that it looks at them all.
const CHANGES: usize = 4096;

/// The Ats this replica caches, with a feed of every change for the leader's reconcile loop.
#[derive(Clone)]
pub struct AtCache {
    store: Store<At>,
    changes: broadcast::Sender<Arc<At>>,
    _watch: Arc<AbortOnDropHandle<()>>,
}

impl AtCache {
    /// Starts watching Ats (in `namespace`, or all) on the current runtime, until dropped.
    pub fn start(client: &Client, namespace: Option<&str>) -> Self {
        let (ats, _) = apis(client, namespace);
        let (store, writer) = reflector::store();
        let (changes, _) = broadcast::channel(CHANGES);
        let feed = changes.clone();
        let watch = watcher(ats, watcher::Config::default())
            .backoff(WatchBackoff::new())
            .modify(trim_at)
            .reflect(writer)
            .applied_objects()
            .for_each(move |at| {
                match at {
                    // No leader listening is fine: nothing is kept for it.
                    Ok(at) => drop(feed.send(Arc::new(at))),
                    Err(error) => warn!(%error, "watching Ats"),
                }
                std::future::ready(())
            });
        AtCache {
            store,
            changes,
            _watch: Arc::new(AbortOnDropHandle::new(tokio::spawn(watch))),
        }
    }

    /// The cached Ats.
    pub fn store(&self) -> &Store<At> {
        &self.store
    }
}

/// Runs the reconcile loop with a cache of its own (see `run_with_cache`).
pub async fn run(
    client: Client,
    settings: Settings,
    events: EventSink,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    let cache = AtCache::start(&client, settings.namespace.as_deref());
    run_with_cache(cache, client, settings, events, metrics, stop).await
}

/// Runs the reconcile loop on `cache` until `stop` is cancelled; reconciles in flight then
/// finish.
pub async fn run_with_cache(
    cache: AtCache,
    client: Client,
    settings: Settings,
    events: EventSink,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    let (_, pods) = apis(&client, settings.namespace.as_deref());
    let (pod_store, pod_writer) = reflector::store();
    let pod_events = watcher(pods, watcher::Config::default().labels(pod::SELECTOR))
        .backoff(WatchBackoff::new())
        .modify(pod::trim)
        .reflect(pod_writer)
        // Deletions too: a pod that vanishes must end its At.
        .touched_objects();
    let ctx = Arc::new(Context::new(
        client,
        pod_store,
        events,
        Box::new(Utc::now),
        metrics.clone(),
        settings.policy.clone(),
    ));
    // Only Ats with work now are reconciled as they are watched; settled ones wait in one
    // ordered index until they fall due (see `reconcile::wakeups`).
    let wakeups = Arc::new(Wakeups::default());
    // Subscribed before the first look at the cache, so no change falls between the two.
    let changes = cache.changes.subscribe();
    let at_store = cache.store.clone();
    let at_events = futures::stream::unfold(
        (changes, ctx.clone(), wakeups.clone(), at_store.clone()),
        |(mut changes, ctx, wakeups, store)| async move {
            loop {
                match changes.recv().await {
                    Ok(at) => return Some((at, (changes, ctx, wakeups, store))),
                    // Fell behind: whatever was missed is in the cache.
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        warn!(
                            missed,
                            "reconcile loop fell behind the At watch; looking at every At"
                        );
                        look_at_all(&ctx, &wakeups, &store);
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        },
    )
    .filter({
        let (ctx, wakeups) = (ctx.clone(), wakeups.clone());
        move |at: &Arc<At>| std::future::ready(ctx.needs_reconcile(at, &wakeups))
    });
    // Then every At already cached (once the cache has listed them all).
    let first_look = tokio::spawn({
        let (ctx, wakeups, store) = (ctx.clone(), wakeups.clone(), at_store.clone());
        async move {
            if store.wait_until_ready().await.is_ok() {
                look_at_all(&ctx, &wakeups, &store);
            }
        }
    });
    let _first_look = AbortOnDropHandle::new(first_look);

    metrics.count_ats(at_store.clone());
    let _forget = ForgetAts(metrics);
    info!(
        namespace = settings.namespace.as_deref().unwrap_or("<all>"),
        "reconciling Ats"
    );
    // Both exist once per context, which was just made.
    let (Some(followups), Some(retriggers)) = (ctx.followup_writer(), ctx.retriggers()) else {
        unreachable!("a new context hands out its follow-up writer and retriggers");
    };
    // Status writes queued behind pod creates live and die with the loop: a stopping leader
    // drops what it has not written, and its successor writes it from what it observes.
    let _followups = AbortOnDropHandle::new(tokio::spawn(followups));
    let _probe = AbortOnDropHandle::new(tokio::spawn(ctx.clone().probe_reachability()));
    let _wakeups = AbortOnDropHandle::new(tokio::spawn({
        let (ctx, store) = (ctx.clone(), at_store.clone());
        async move {
            wakeups
                .run(|at| {
                    // A deleted At has nothing left to do.
                    if store.get(&at).is_some() {
                        ctx.wake_up(at);
                    }
                })
                .await
        }
    }));
    Controller::for_shared_stream(at_events, at_store)
        .owns_stream(pod_events)
        .reconcile_on(retriggers)
        .with_config(controller::Config::default().concurrency(settings.concurrency))
        .graceful_shutdown_on(stop.cancelled_owned())
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            // Reconcile failures were logged by the error policy; these are the runtime's own.
            if let Err(
                error @ (controller::Error::ObjectNotFound(_) | controller::Error::QueueError(_)),
            ) = result
            {
                warn!(%error, "controller");
            }
        })
        .await;
    info!("reconcile loop stopped");
}

/// Reconciles every cached At that needs it now; the others go into `wakeups`.
fn look_at_all(ctx: &Context, wakeups: &Wakeups, store: &Store<At>) {
    for at in store.state() {
        if ctx.needs_reconcile(&at, wakeups) {
            ctx.wake_up(ObjectRef::from_obj(at.as_ref()));
        }
    }
}

/// Stops the At count when the loop ends, also when it is aborted on lost leadership.
struct ForgetAts(Arc<Metrics>);

impl Drop for ForgetAts {
    fn drop(&mut self) {
        self.0.forget_ats();
    }
}

/// Retrying a failed watch: 100 ms doubling to 500 ms, plus up to as much again of jitter, so
/// never more than 1 s; reset by any event. kube's
/// default grows to 30 s, which after an API server outage leaves the caches (and new Ats)
/// waiting up to that long after the server is back; one request a second per watch is cheap.
struct WatchBackoff(backon::ExponentialBackoff);

impl WatchBackoff {
    fn new() -> Self {
        WatchBackoff(
            ExponentialBuilder::new()
                .with_min_delay(Duration::from_millis(100))
                .with_max_delay(Duration::from_millis(500))
                .with_jitter()
                .without_max_times()
                .build(),
        )
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        self.0.next()
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        *self = WatchBackoff::new();
    }
}

fn apis(client: &Client, namespace: Option<&str>) -> (Api<At>, Api<Pod>) {
    match namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    }
}

/// Drops what the reconciler never reads, so the cache stays small.
fn trim_at(at: &mut At) {
    at.metadata.managed_fields = None;
    at.metadata.annotations = None;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_retries_stay_within_a_second_and_start_over_after_success() {
        let mut backoff = WatchBackoff::new();
        let delays: Vec<Duration> = backoff.by_ref().take(20).collect();
        assert_eq!(delays.len(), 20, "never gives up");
        assert!(delays[0] >= Duration::from_millis(100) && delays[0] <= Duration::from_millis(200));
        assert!(
            delays.iter().all(|d| *d <= Duration::from_secs(1)),
            "{delays:?}"
        );
        assert!(
            delays[10..]
                .iter()
                .all(|d| *d >= Duration::from_millis(500)),
            "{delays:?}"
        );
        backoff.reset();
        assert!(backoff.next().unwrap() <= Duration::from_millis(200));
    }
}

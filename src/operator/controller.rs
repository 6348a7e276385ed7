//! Wires the reconciler to the cluster: the At cache, the leader's watch of cnat's pods,
//! kube-runtime's `Controller`, and the tasks beside it, supervised.
//! See docs/src/design/architecture.md, "The reconcile loop" and "The pod watch".

use crate::observability::metrics::Metrics;
use crate::operator::cache::{self, AtCache, CachedAt};
use crate::operator::events::EventSink;
use crate::operator::key::AtKey;
use crate::operator::policy::RunPolicy;
use crate::operator::priority::InFlight;
use crate::operator::quarantine;
use crate::operator::reconcile::calls::Caches;
use crate::operator::reconcile::{self, error_policy, reconcile, Context};
use crate::operator::signing;
use crate::operator::triggers;
use crate::operator::{finalizer, pod};
use chrono::Utc;
use futures::{FutureExt, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::controller::{self, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::{Api, Client, ResourceExt};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

/// What `cnat run` tells the controller.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Watch this namespace only; `None` watches all.
    pub namespace: Option<String>,
    /// Only the Ats of this Lease shard, and their pods (`shard::Shards::selector`); `None`:
    /// every At.
    pub selector: Option<String>,
    /// Most reconciles at once; 0 means no limit.
    pub concurrency: u16,
    /// Defaults for what Ats leave out, and the RUNNING re-check interval.
    pub policy: RunPolicy,
    /// Where the key that signs cnat's pods comes from (`signing`).
    pub signing: signing::Source,
}

/// Runs the reconcile loop with a cache of its own (see `run_with_cache`).
pub async fn run(
    client: Client,
    settings: Settings,
    events: EventSink,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    let cache = AtCache::start_selected(
        &client,
        settings.namespace.as_deref(),
        settings.selector.clone(),
        true,
    );
    run_with_cache(cache, client, settings, events, metrics, stop).await
}

/// Runs the reconcile loop on `cache` until `stop` is cancelled; reconciles in flight then
/// finish. It also ends when a reconcile panicked or one of its tasks ended (see `quarantine`).
pub async fn run_with_cache(
    cache: AtCache,
    client: Client,
    settings: Settings,
    events: EventSink,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    // No pod is created or taken for an At's own without the signing key: this leadership ends.
    let signing = match settings.signing.signing(&client).await {
        Ok(signing) => signing,
        Err(error) => {
            error!(%error, "no pod signing key; giving up this leadership");
            return;
        }
    };
    let pods = crate::operator::pod_api(&client, settings.namespace.as_deref());
    let (pod_store, pod_writer) = reflector::store();
    let caches = Caches {
        pods: pod_store,
        ats: cache.freshness().clone(),
    };
    let ctx = Arc::new(
        Context::new(
            client,
            caches,
            events,
            Arc::new(Utc::now),
            metrics.clone(),
            settings.policy.clone(),
            cache.quarantine().clone(),
        )
        .with_signing(signing),
    );
    let backlog = reconcile::backlog::limit_for(settings.concurrency);
    ctx.scheduler().set_backlog_limit(backlog);
    let at_store = cache.store().clone();
    // Pods of deleted Ats that wait for cnat's finalizer to go.
    let (orphans, orphaned) = mpsc::unbounded_channel();
    // With Lease shards, pods started before them (no shard label) are in shard 0's pod watch
    // only: its leader labels each with its At's shard.
    let (unlabelled, to_label) = match &settings.selector {
        Some(_) => {
            let (sender, receiver) = mpsc::unbounded_channel();
            (Some(sender), Some(receiver))
        }
        None => (None, None),
    };
    let pod_selector = match &settings.selector {
        Some(shard) => format!("{},{shard}", pod::SELECTOR),
        None => pod::SELECTOR.to_owned(),
    };
    let pod_events = pod_events(
        pods,
        &pod_selector,
        pod_writer,
        (ctx.clone(), at_store.clone()),
        PodWork {
            orphans: orphans.clone(),
            unlabelled,
        },
    );
    // Subscribed before the first look at the cache, so no change falls between the two.
    let at_events = triggers::at_events(cache.subscribe(), ctx.clone(), at_store.clone(), orphans);
    let _forget = ForgetAts(metrics.clone(), metrics.count_ats(at_store.clone()));
    info!(
        namespace = settings.namespace.as_deref().unwrap_or("<all>"),
        "reconciling Ats"
    );
    // Exists once per context, which was just made.
    let Some(reconcile_now) = ctx.scheduler().reconcile_now() else {
        unreachable!("a new context hands out its reconcile_now stream");
    };
    let tasks = spawn_tasks(&ctx, &at_store, orphaned, to_label);
    let fatal = ctx.fatal().clone();
    let dropped_writing = ctx.writer().priority().writing.clone();
    let dropped = ctx.clone();
    let controller = Controller::for_shared_stream(at_events, at_store)
        .owns_stream(pod_events)
        .reconcile_on(reconcile_now.map(|at| CachedAt::key_of(&at)))
        .with_config(controller::Config::default().concurrency(settings.concurrency))
        .graceful_shutdown_on(stop.cancelled_owned())
        .run(reconcile_cached, error_policy_cached, ctx)
        .for_each(move |result| {
            // Reconcile failures were logged by the error policy; these are the runtime's own.
            match result {
                // A pod or wakeup of an At deleted meanwhile: normal, e.g. under mass deletion.
                // Its request is dropped, so it no longer waits in the runtime's queue.
                Err(controller::Error::ObjectNotFound(at)) => {
                    debug!(at = %at, "controller: the At is gone");
                    dropped.scheduler().request_dropped(&AtKey::new(
                        at.namespace.as_deref().unwrap_or_default(),
                        &at.name,
                    ));
                }
                Err(error @ controller::Error::QueueError(_)) => warn!(%error, "controller"),
                _ => {}
            }
            std::future::ready(())
        });
    let writing = dropped_writing;
    supervise(controller, fatal, tasks, &metrics, writing).await;
    info!("reconcile loop stopped");
}

/// Where the pod watch sends the pods someone must act on.
struct PodWork {
    /// Pods of gone Ats that wait for cnat's finalizer to go.
    orphans: mpsc::UnboundedSender<ObjectRef<Pod>>,
    /// With Lease shards: pods without a shard value, once each.
    unlabelled: Option<mpsc::UnboundedSender<ObjectRef<Pod>>>,
}

/// Pods without a shard value told once each, at most this many remembered (then forgotten).
const UNLABELLED_REMEMBERED: usize = 10_000;

/// Pods per page of the pod watch's lists: a page is decoded whole before its pods are trimmed,
/// and anyone may label a pod as cnat's (docs/src/operating/security.md, "What one At can cost").
const POD_LIST_PAGE: u32 = 10;

/// The leader's pod watch (the pods `selector` selects, deletions too), into its pod cache; a
/// pod of a gone At that waits for cnat's finalizer goes to `work.orphans`; once a list is in
/// the cache, `triggers::look_at_holders`.
fn pod_events(
    pods: Api<Pod>,
    selector: &str,
    writer: reflector::store::Writer<Pod>,
    (ctx, ats): (Arc<Context>, Store<CachedAt>),
    work: PodWork,
) -> impl futures::Stream<Item = Result<Pod, watcher::Error>> + Send {
    let PodWork {
        orphans,
        unlabelled,
    } = work;
    let holders_of = ats.clone();
    let mut told = std::collections::HashSet::new();
    let config = watcher::Config::default()
        .labels(selector)
        .page_size(POD_LIST_PAGE);
    watcher(pods, config)
        .backoff(cache::watch_backoff())
        .modify(pod::trim)
        .reflect(writer)
        .inspect_ok(move |event| {
            if matches!(event, watcher::Event::InitDone) {
                triggers::look_at_holders(&ctx, &holders_of);
            }
        })
        .touched_objects()
        .inspect_ok(move |found: &Pod| {
            if finalizer::awaits_release(found) && triggers::owner_gone(found, &ats) {
                let _ = orphans.send(ObjectRef::from_obj(found));
            }
            if let Some(unlabelled) = &unlabelled {
                let value = crate::shard::value_of(found.metadata.labels.as_ref());
                if value.is_none() && told.insert(found.uid().unwrap_or_default()) {
                    if told.len() > UNLABELLED_REMEMBERED {
                        told.clear();
                    }
                    let _ = unlabelled.send(ObjectRef::from_obj(found));
                }
            }
        })
}

/// The loop's tasks beside the runtime. They live and die with the loop: a stopping leader drops
/// the status writes it has not made, and its successor makes them from what it observes.
fn spawn_tasks(
    ctx: &Arc<Context>,
    store: &Store<CachedAt>,
    orphaned: mpsc::UnboundedReceiver<ObjectRef<Pod>>,
    unlabelled: Option<mpsc::UnboundedReceiver<ObjectRef<Pod>>>,
) -> JoinSet<&'static str> {
    let mut tasks: JoinSet<&'static str> = JoinSet::new();
    // Every At already cached. A cache still listing says `Relisted` when it has them all.
    tasks.spawn({
        let (ctx, store) = (ctx.clone(), store.clone());
        async move {
            if let Some(Ok(())) = store.wait_until_ready().now_or_never() {
                triggers::look_at_all(&ctx, &store).await;
            }
            FIRST_LOOK
        }
    });
    // Exists once per context, which was just made.
    let Some(writes) = ctx.writer().queued_writes() else {
        unreachable!("a new context hands out its queued writes");
    };
    tasks.spawn(async move {
        writes.await;
        "status writer"
    });
    tasks.spawn({
        let ctx = ctx.clone();
        async move {
            ctx.look_again().await;
            "reachability probe and deferred pod creates"
        }
    });
    tasks.spawn({
        let (ctx, store) = (ctx.clone(), store.clone());
        async move {
            let scheduler = ctx.scheduler();
            let wake_up = |at| {
                // A deleted At has nothing left to do.
                if store.get(&CachedAt::key_of(&at)).is_some() {
                    scheduler.wake_up(at);
                }
            };
            scheduler.wakeups().run(wake_up).await;
            "wakeups"
        }
    });
    tasks.spawn({
        let (ctx, store) = (ctx.clone(), store.clone());
        async move {
            triggers::look_ahead(&ctx, &store).await;
            "look-ahead"
        }
    });
    tasks.spawn(each_pod(
        orphaned,
        ctx.clone(),
        "orphan release",
        |ctx, found| async move { ctx.calls().release_orphan(&found).await },
    ));
    if let Some(unlabelled) = unlabelled {
        let label = |ctx: Arc<Context>, found: ObjectRef<Pod>| async move {
            ctx.calls().label_pod_with_shard(&found).await
        };
        tasks.spawn(each_pod(
            unlabelled,
            ctx.clone(),
            "shard labels of pods",
            label,
        ));
    }
    tasks
}

/// Runs `act` on each pod `received` brings, `ORPHAN_RELEASES` at once, until the sender goes;
/// then says it was `task`.
async fn each_pod<F, Fut>(
    mut received: mpsc::UnboundedReceiver<ObjectRef<Pod>>,
    ctx: Arc<Context>,
    task: &'static str,
    act: F,
) -> &'static str
where
    F: Fn(Arc<Context>, ObjectRef<Pod>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    futures::stream::poll_fn(move |cx| received.poll_recv(cx))
        .for_each_concurrent(ORPHAN_RELEASES, |found| act(ctx.clone(), found))
        .await;
    task
}

/// Runs `controller` until it ends, a reconcile panicked (`fatal`), or one of `tasks` ended or
/// panicked (the first look may end).
async fn supervise(
    controller: impl std::future::Future<Output = ()>,
    fatal: CancellationToken,
    mut tasks: JoinSet<&'static str>,
    metrics: &Metrics,
    writing: InFlight,
) {
    tokio::pin!(controller);
    loop {
        tokio::select! {
            _ = &mut controller => {
                // Stopped on purpose (a handover, a shutdown): the status writes decided so far
                // land first, so that no pod waits for a next leader to record it (on uninstall
                // there is none); within `DRAIN` and the step-down grace, which aborts the loop.
                if timeout(DRAIN, writing.idle()).await.is_err() {
                    warn!(left = writing.in_flight(), "status writes still queued when the reconcile loop stopped; the next leader makes them");
                }
                break;
            }
            // Logged and counted where it was caught, with its At.
            _ = fatal.cancelled() => break,
            Some(ended) = tasks.join_next() => match ended {
                Ok(FIRST_LOOK) => {}
                Ok(task) => {
                    error!(task, "a task of the reconcile loop ended; ending the loop");
                    break;
                }
                Err(error) => {
                    // A panic's message was logged by the panic hook as it happened.
                    metrics.panicked("task");
                    error!(%error, "a task of the reconcile loop panicked; ending the loop");
                    break;
                }
            },
        }
    }
}

/// How long a reconcile loop that stops on purpose waits for its queued status writes.
const DRAIN: Duration = Duration::from_secs(5);

/// The first look at every cached At ends by itself; every other task runs as long as the loop.
const FIRST_LOOK: &str = "first look";
/// Pods of deleted Ats released at once (three requests each).
const ORPHAN_RELEASES: usize = 8;

/// `reconcile` on the cached At, as decoded by the look that found work for it or read back.
async fn reconcile_cached(
    cached: Arc<CachedAt>,
    ctx: Arc<Context>,
) -> Result<controller::Action, reconcile::Error> {
    let at_key = CachedAt::key(&cached);
    let _running = ctx.scheduler().reconcile_starts(&at_key);
    // As the look that found work decoded it, or read back now (a wakeup, a retry).
    let version = cached.resource_version();
    let decoded = ctx.ledger().take_decoded(&at_key, version.as_deref());
    let Some(at) = decoded.or_else(|| cache::read(&cached).map(Arc::new)) else {
        // Logged; nothing can be done with it until it changes.
        return Ok(controller::Action::await_change());
    };
    if ctx.quarantined(&at) {
        return Ok(controller::Action::await_change());
    }
    match quarantine::Caught::new(reconcile(at.clone(), ctx.clone())).await {
        Ok(result) => result,
        Err(panic) => {
            ctx.panicked(&at, "reconcile", &panic);
            Ok(controller::Action::await_change())
        }
    }
}

/// `error_policy` on the cached At, read back.
fn error_policy_cached(
    cached: Arc<CachedAt>,
    error: &reconcile::Error,
    ctx: Arc<Context>,
) -> controller::Action {
    match cache::read(&cached) {
        Some(at) => error_policy(Arc::new(at), error, ctx),
        None => controller::Action::await_change(),
    }
}

/// Stops the At count when the loop ends, also when it is aborted on lost leadership.
struct ForgetAts(Arc<Metrics>, u64);

impl Drop for ForgetAts {
    fn drop(&mut self) {
        self.0.forget_ats(self.1);
    }
}

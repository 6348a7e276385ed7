//! What a replica does while it leads: joins `leader`'s election to `operator::controller`'s
//! loop, over the shared cache (one Lease) or each led shard's own `ShardCache` (`--shards`).
//! See docs/src/design/architecture.md, "The Lease and the election".

use crate::leader::{self, Leadership};
use crate::observability::metrics::Metrics;
use crate::operator::cache::AtCache;
use crate::operator::controller;
use crate::operator::events::EventSink;
use crate::operator::quarantine::Quarantine;
use crate::shard::Shards;
use crate::sync::lock;
use kube::runtime::events::Reporter;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, timeout, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

/// A led shard's cache lists its Ats within this many lease durations, or the shard is given
/// up (a shard held by a replica whose list keeps failing would run nothing, unseen).
const LIST_LEASES: u32 = 8;

/// What an election (of the one Lease, or of each shard's) is run with.
pub struct Election {
    pub client: kube::Client,
    /// This replica's identity, the holder it writes into a Lease.
    pub identity: String,
    pub timing: leader::Timing,
    pub leadership: Arc<Leadership>,
    pub metrics: Arc<Metrics>,
    /// `--lease-name` (with shards, the prefix of each shard's Lease) and its namespace.
    pub lease_name: String,
    pub lease_namespace: String,
    /// The reconcile loop's settings, for every At (each shard selects its own).
    pub controller: controller::Settings,
    /// A shard's cache lists by a streaming list where the server offers one (`--watch-list`).
    pub streaming: bool,
    /// `--shutdown-timeout`: the room a stopping replica has to hand its shards over in.
    pub shutdown_timeout: Duration,
}

impl Election {
    /// The election's settings for the Lease `lease_name` (`balance`: with shards), and the
    /// replica's event queue.
    fn settings(
        &self,
        balance: Option<Arc<leader::balance::Balance>>,
    ) -> (leader::Settings, EventSink) {
        let reporter = Reporter {
            controller: "cnat".into(),
            instance: Some(self.identity.clone()),
        };
        let events = EventSink::start(self.client.clone(), reporter);
        let settings = leader::Settings {
            lease_name: self.lease_name.clone(),
            namespace: self.lease_namespace.clone(),
            identity: self.identity.clone(),
            timing: self.timing,
            clock: leader::WallClock::system(),
            balance,
            handover: None,
        };
        (settings, events)
    }

    /// Competes for the one Lease; while this replica holds it, it reconciles every At, from
    /// `cache` (which every replica keeps, so the next leader starts with every At).
    pub fn run(self, cache: AtCache, shutdown: &CancellationToken) -> JoinHandle<()> {
        let (election_settings, events) = self.settings(None);
        let Election {
            client,
            leadership,
            metrics,
            controller: controller_settings,
            ..
        } = self;
        let (work_client, work_events) = (client.clone(), events.clone());
        let listed = cache.listed();
        tokio::spawn(leader::run(
            client,
            election_settings,
            leadership,
            events,
            listed,
            move |stop| {
                controller::run_with_cache(
                    cache.clone(),
                    work_client.clone(),
                    controller_settings.clone(),
                    work_events.clone(),
                    metrics.clone(),
                    stop,
                )
            },
            shutdown.clone(),
        ))
    }

    /// How long a stopping shard holder waits for a ready successor: `--shutdown-timeout` less
    /// the step-down grace and four retry periods (handing over or releasing, then closing the
    /// servers). Zero, with a warning: it releases its shards at once.
    fn handover_on_shutdown(&self) -> Duration {
        let after = self.timing.step_down_grace + self.timing.retry_period * 4;
        let room = self.shutdown_timeout.saturating_sub(after);
        if room.is_zero() {
            warn!(shutdown_timeout = ?self.shutdown_timeout, needed_above = ?after, "--shutdown-timeout leaves no room to hand shards over on shutdown: a stopping replica releases them, and their next leaders list them first");
        }
        room
    }

    /// Competes for each shard's Lease, keeping to this replica's share of them; while it holds
    /// one, it caches that shard's Ats and reconciles them.
    pub fn run_shards(self, shards: Shards, shutdown: &CancellationToken) -> JoinHandle<()> {
        let balance = Arc::new(leader::balance::Balance::new(
            shards.count(),
            self.leadership.clone(),
            self.timing.lease_duration,
        ));
        let (base, events) = self.settings(Some(balance.clone()));
        // Looks at the Leases until every shard is given up, also once stopping.
        let over = CancellationToken::new();
        let members = tokio::spawn(leader::members::run(
            self.client.clone(),
            base.clone(),
            shards.count(),
            balance.clone(),
            shutdown.clone(),
            over.clone(),
        ));
        // A holder waits at most a lease duration for a ready successor (no longer than a
        // replica that died leaves a shard); once stopping, what `--shutdown-timeout` leaves.
        let limit = self.timing.lease_duration;
        let on_shutdown = self.handover_on_shutdown();
        let elections: Vec<JoinHandle<()>> = (0..shards.count())
            .map(|shard| {
                let selector = shards.selector(shard);
                let cache = Arc::new(ShardCache {
                    client: self.client.clone(),
                    namespace: self.controller.namespace.clone(),
                    selector: selector.clone(),
                    streaming: self.streaming,
                    // Shared by each leadership of the shard: an At whose handling panicked
                    // stays skipped when the shard is led again (each time with a new cache).
                    quarantine: Arc::default(),
                    list_limit: limit * LIST_LEASES,
                    readied: Mutex::default(),
                });
                let settings = leader::Settings {
                    lease_name: leader::members::shard_lease_name(
                        &base.lease_name,
                        shard,
                        shards.count(),
                    ),
                    handover: Some(leader::handover::Handover {
                        prepare: cache.clone(),
                        limit,
                        on_shutdown,
                    }),
                    ..base.clone()
                };
                let controller_settings = controller::Settings {
                    selector,
                    ..self.controller.clone()
                };
                let (client, work_events, metrics) =
                    (self.client.clone(), events.clone(), self.metrics.clone());
                let work = move |stop: CancellationToken| {
                    let (client, settings, events, metrics) = (
                        client.clone(),
                        controller_settings.clone(),
                        work_events.clone(),
                        metrics.clone(),
                    );
                    let cache = cache.clone();
                    async move { lead_shard(&cache, client, settings, events, metrics, stop).await }
                };
                // Competes once the replicas were counted (or, after a lease duration, looked
                // at): a replica that starts first must not take every shard, nor a blind one any.
                let able = {
                    let (counted, looked) = (balance.counted(), balance.looked());
                    async move {
                        if timeout(limit, counted).await.is_err() {
                            looked.await;
                        }
                    }
                };
                tokio::spawn(leader::run(
                    self.client.clone(),
                    settings,
                    self.leadership.clone(),
                    events.clone(),
                    able,
                    work,
                    shutdown.clone(),
                ))
            })
            .collect();
        tokio::spawn(async move {
            for election in elections {
                let _ = election.await;
            }
            over.cancel();
            let _ = members.await;
        })
    }
}

/// A shard's cache as listed for a handover, and when its list began.
struct Readied {
    cache: AtCache,
    since: Instant,
}

/// One shard's At cache: a leadership of the shard lists it anew, unless the shard was handed
/// over to this replica, which listed it while the holder still led (`readied`).
struct ShardCache {
    client: kube::Client,
    namespace: Option<String>,
    selector: Option<String>,
    streaming: bool,
    quarantine: Arc<Quarantine>,
    /// How long a list may take, from its start (readying, then leading: one limit for both).
    list_limit: Duration,
    /// Listed (or listing) for a handover of the shard to this replica.
    readied: Mutex<Option<Readied>>,
}

impl ShardCache {
    fn readied(&self) -> MutexGuard<'_, Option<Readied>> {
        lock(&self.readied)
    }

    fn start(&self) -> Readied {
        let cache = AtCache::start_selected(
            &self.client,
            self.namespace.as_deref(),
            self.selector.clone(),
            self.streaming,
        )
        .with_quarantine(self.quarantine.clone());
        Readied {
            cache,
            since: Instant::now(),
        }
    }

    /// The cache a leadership of the shard uses (the one readied for it, or a new one), and
    /// the instant its list must be done by.
    fn lead(&self) -> (AtCache, Instant) {
        // Not started under the lock.
        let readied = self.readied().take();
        let readied = readied.unwrap_or_else(|| self.start());
        (readied.cache, readied.since + self.list_limit)
    }
}

impl leader::handover::Prepare for ShardCache {
    fn prepare(&self) -> Pin<Box<dyn Future<Output = bool> + Send>> {
        let (cache, by) = {
            let mut readied = self.readied();
            let readied = readied.get_or_insert_with(|| self.start());
            (readied.cache.clone(), readied.since + self.list_limit)
        };
        Box::pin(async move {
            // Listed wins over a limit passed meanwhile.
            tokio::select! {
                biased;
                _ = cache.stopped() => false,
                _ = cache.listed() => true,
                _ = sleep_until(by) => false,
            }
        })
    }

    fn discard(&self) {
        self.readied().take();
    }
}

/// Leads one shard: lists its Ats unless readied, then reconciles them until `stop`; ends early
/// (the Lease is released) if the list misses its limit or the cache stops following the Ats.
async fn lead_shard(
    shard: &ShardCache,
    client: kube::Client,
    settings: controller::Settings,
    events: EventSink,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    let (cache, by) = shard.lead();
    // A cache readied long ago is listed, whatever its limit says.
    tokio::select! {
        biased;
        _ = stop.cancelled() => return,
        _ = cache.stopped() => return,
        _ = cache.listed() => {}
        _ = sleep_until(by) => {
            let progress = cache.readiness().err().map(|e| e.to_string()).unwrap_or_default();
            warn!(selector = settings.selector.as_deref().unwrap_or_default(), limit = ?shard.list_limit, %progress, "the shard's Ats were not listed within the limit from the list's start; giving the shard up");
            return;
        }
    }
    let stopped = cache.stopped();
    tokio::select! {
        _ = controller::run_with_cache(cache, client, settings, events, metrics, stop) => {}
        _ = stopped => error!("the At cache of a shard stopped following its Ats (its task panicked); giving the shard up"),
    }
}

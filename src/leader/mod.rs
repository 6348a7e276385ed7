//! Leadership: replicas compete for a Lease, only the holder reconciles, and a holder stops
//! before it names its successor. Leases give no fencing: correctness rests on fixed pod names
//! and status preconditions. See docs/src/design/architecture.md, "The Lease and the election".

pub mod balance;
pub mod handover;
mod leadership;
pub mod members;
pub mod record;
mod renewal;
pub mod store;
pub mod timing;

pub use leadership::{Leadership, WallClock};
pub use timing::{Timing, TimingError};

use crate::operator::events::EventSink;
use futures::stream::FusedStream;
use futures::{Stream, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::events::{Event, EventType};
use kube::runtime::watcher;
use kube::{Api, Client, Resource};
use record::{Held, Known, Next, Offer, Reread, Seen};
use renewal::{held, Renewal, RenewalFuture};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use store::{holder_name, LeaseApi, LeaseError, Written};
use tokio::time::{sleep, sleep_until, timeout, Instant};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info, warn};

/// How soon a candidate asks again after the API server gave no answer.
const UNANSWERED_RETRY: Duration = Duration::from_millis(500);

/// Which Lease to compete for, as whom, and how.
#[derive(Debug, Clone)]
pub struct Settings {
    pub lease_name: String,
    pub namespace: String,
    pub identity: String,
    pub timing: Timing,
    pub clock: WallClock,
    /// With Lease shards: the share of shards this replica aims at, which this shard's election
    /// keeps to (`None`: the one Lease, always competed for).
    pub balance: Option<Arc<balance::Balance>>,
    /// With Lease shards: how this replica readies itself to be handed a shard, and how long it
    /// waits for a ready successor before releasing one (`None`: it releases at once).
    pub handover: Option<handover::Handover>,
}

/// Once `able` completes, competes for the Lease until `shutdown`, running `work` while holding
/// it. `work`'s token asks it to stop: on shutdown it has `step_down_grace`, then is aborted and
/// the Lease released; at the renew deadline it is aborted at once.
pub async fn run<W, F, A>(
    client: Client,
    settings: Settings,
    leadership: Arc<Leadership>,
    events: EventSink,
    able: A,
    work: W,
    shutdown: CancellationToken,
) where
    W: Fn(CancellationToken) -> F,
    F: Future<Output = ()> + Send + 'static,
    A: Future<Output = ()>,
{
    let elector = Elector::new(client, settings, leadership, events);
    let waiting = Instant::now();
    tokio::select! {
        _ = shutdown.cancelled() => return,
        _ = able => {}
    }
    debug!(waited = ?waiting.elapsed(), lease = %elector.name(), "competing for the Lease");
    // Until then, a shard this replica gave up it takes again only as a rescue.
    let mut rescue_only_until = None;
    loop {
        let Some(won) = elector.campaign(&shutdown, rescue_only_until).await else {
            return;
        };
        match elector.lead(won, &work, &shutdown).await {
            Ended::Released => return,
            Ended::Lost { gave_up: true } => {
                let timing = elector.settings.timing;
                rescue_only_until = Some(
                    Instant::now() + timing.lease_duration * balance::RESCUE_ONLY_AFTER_GIVING_UP,
                );
            }
            Ended::Lost { gave_up: false } => rescue_only_until = None,
        }
        // Leadership was lost: give the others a retry period before competing again.
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = sleep(elector.settings.timing.retry_period) => {}
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// Shutdown: the work stopped and the Lease was released.
    Released,
    /// Leadership lost or given up (`gave_up`: this replica let a shard go to another one):
    /// compete again.
    Lost { gave_up: bool },
}

/// Why leading ended.
#[derive(Debug)]
enum Why {
    /// Shutdown, or a shard given up.
    Leaving(Leaving),
    /// A ready successor was found for the Lease given up for `then`.
    HandOver {
        successor: handover::Successor,
        then: Leaving,
    },
    LoopEnded(String),
    Deadline,
    Taken(Option<String>),
}

/// Why this replica gives the Lease up by itself.
#[derive(Debug)]
enum Leaving {
    Shutdown,
    /// This replica leads more than its share of shards: this one goes to another (one at a
    /// time: the next once this is dropped).
    Yielded(balance::Yielding),
}

/// A won campaign: our tenure, and since when the Lease was free if we took it from someone.
struct Won {
    held: Held,
    free_since: Option<Instant>,
    /// With shards: this shard's place among those the replica leads, until it is counted.
    reserved: Option<balance::Reservation>,
}

/// What a campaign knows between its steps.
struct Campaign {
    known: Known,
    /// The Lease as last seen, and since when.
    last: Option<Seen>,
    /// When the watch or a read last brought the Lease.
    news_at: Instant,
    /// Failed attempts in a row.
    failures: u32,
    watch_failing: bool,
    /// A watcher stream does not end; if it ever did, it is not polled again (it would spin).
    watch_open: bool,
    /// When the campaign started (how long a missing Lease has been free, for the balance).
    started: Instant,
    /// With shards: the place reserved for the take under way.
    reserved: Option<balance::Reservation>,
    /// Until then (a shard this replica gave up), it takes this shard only as a rescue.
    rescue_only_until: Option<Instant>,
    /// Readying to be handed the Lease by its holder (`handover`).
    readying: Option<handover::Readying>,
}

struct Elector {
    leases: LeaseApi,
    settings: Settings,
    leadership: Arc<Leadership>,
    events: EventSink,
}

impl Elector {
    fn new(
        client: Client,
        settings: Settings,
        leadership: Arc<Leadership>,
        events: EventSink,
    ) -> Self {
        let api: Api<Lease> = Api::namespaced(client, &settings.namespace);
        Elector {
            leases: LeaseApi::new(api, &settings.lease_name, settings.timing.retry_period),
            settings,
            leadership,
            events,
        }
    }

    fn name(&self) -> String {
        format!("{}/{}", self.settings.namespace, self.settings.lease_name)
    }

    fn me(&self) -> &str {
        &self.settings.identity
    }

    /// Competes until this replica holds the Lease (`None` on shutdown); after a retry period
    /// without watch news it reads the Lease, so a broken watch only slows a handover to an expiry.
    async fn campaign(
        &self,
        shutdown: &CancellationToken,
        rescue_only_until: Option<Instant>,
    ) -> Option<Won> {
        let watch = self.leases.watch().fuse();
        tokio::pin!(watch);
        let mut c = Campaign {
            known: Known::Unknown,
            last: None,
            news_at: Instant::now(),
            failures: 0,
            watch_failing: false,
            watch_open: true,
            started: Instant::now(),
            reserved: None,
            rescue_only_until,
            readying: None,
        };
        loop {
            let now = Instant::now();
            // A place reserved for an earlier attempt is not this one's.
            c.reserved = None;
            let step = match self.readying_step(&mut c, now, shutdown.is_cancelled()) {
                Some(step) => step,
                None => self.balanced(record::next(&c.known, self.me(), now), &mut c, now),
            };
            let waiting = matches!(step, Next::Wait { .. });
            let attempt: Result<Option<Won>, LeaseError> = match step {
                Next::Read => self.leases.get().await.map(|lease| {
                    c.known = self.observe(lease.as_ref(), &mut c.last, Instant::now());
                    c.news_at = Instant::now();
                    None
                }),
                Next::Create => self.create(&mut c, now).await,
                Next::Take {
                    resource_version,
                    transitions,
                } => self.take(&mut c, &resource_version, transitions, now).await,
                Next::Offer { resource_version } => self.offer(&mut c, &resource_version).await,
                Next::Wait { until } => {
                    tokio::select! {
                        _ = shutdown.cancelled() => {
                            self.withdraw(&c).await;
                            return None;
                        }
                        () = self.wait_for_news(&mut c, &mut watch, until) => Ok(None),
                    }
                }
            };
            match attempt {
                Ok(Some(mut won)) => {
                    let readied = c.readying.take().and_then(handover::Readying::keep);
                    won.reserved = c.reserved.take().or(readied);
                    return Some(won);
                }
                // Only a settled state (someone else holds it) ends a streak of failures: a
                // read that works before a write that fails is no recovery.
                Ok(None) if waiting => c.failures = 0,
                Ok(None) => {}
                Err(error) => {
                    let pause = self.failed_attempt(&mut c, &error);
                    tokio::select! {
                        _ = shutdown.cancelled() => {
                            self.withdraw(&c).await;
                            return None;
                        }
                        _ = sleep(pause) => {}
                    }
                }
            }
        }
    }

    /// `step`, unless it takes a free Lease that this replica's share of shards leaves to
    /// others for now: then waits a retry period (or for news) and decides again.
    fn balanced(&self, step: Next, c: &mut Campaign, now: Instant) -> Next {
        let Some(balance) = &self.settings.balance else {
            return step;
        };
        let free_for = match (&step, &c.known) {
            // Ours already (handed over to us, or this identity held it): no one else's to take.
            (Next::Take { .. }, Known::Seen(seen)) if seen.holder.as_deref() == Some(self.me()) => {
                return step;
            }
            (Next::Take { .. }, Known::Seen(seen)) => {
                now.saturating_duration_since(seen.free_since())
            }
            (Next::Create, _) => now.saturating_duration_since(c.started),
            _ => return step,
        };
        // Readied for this Lease: its place was reserved then (and goes to the leadership).
        if c.readying.as_ref().is_some_and(|r| r.reserved.is_some()) {
            return step;
        }
        let rescue_only = c.rescue_only_until.is_some_and(|until| now < until);
        match balance.try_reserve(free_for, rescue_only) {
            Some(reserved) => {
                c.reserved = Some(reserved);
                step
            }
            None => Next::Wait {
                until: now + self.settings.timing.retry_period,
            },
        }
    }

    /// Creates the Lease, held by us (`now`: when the request went out).
    async fn create(&self, c: &mut Campaign, now: Instant) -> Result<Option<Won>, LeaseError> {
        let timing = self.settings.timing;
        let lease = record::new_lease(
            &self.settings.lease_name,
            &self.settings.namespace,
            self.me(),
            timing.lease_seconds(),
            self.settings.clock.now(),
        );
        match self.leases.create(&lease).await? {
            Written::Done(created) => Ok(Some(Won {
                held: held(&created, now),
                free_since: None,
                reserved: None,
            })),
            Written::Conflict => {
                c.known = Known::Unknown;
                Ok(None)
            }
            // The namespace is missing: a configuration error, retried with pauses.
            Written::Missing => Err(LeaseError::NoNamespace(self.name())),
        }
    }

    /// Takes the free or expired Lease at `resource_version` (`now`: when the request went out).
    async fn take(
        &self,
        c: &mut Campaign,
        resource_version: &str,
        transitions: i32,
        now: Instant,
    ) -> Result<Option<Won>, LeaseError> {
        let timing = self.settings.timing;
        // Handed over to us: it was never free.
        let free_since = c
            .last
            .as_ref()
            .filter(|seen| seen.holder.as_deref() != Some(self.me()))
            .map(Seen::free_since);
        let patch = record::take_patch(
            self.me(),
            resource_version,
            transitions,
            timing.lease_seconds(),
            self.settings.clock.now(),
        );
        // On an error the write may have landed: `failed_attempt` has the next step read.
        match self.leases.swap(&patch).await? {
            Written::Done(taken) => Ok(Some(Won {
                held: held(&taken, now),
                free_since,
                reserved: None,
            })),
            // Someone wrote first; read what they wrote.
            Written::Conflict => {
                debug!(lease = %self.name(), "the lease changed before we could take it");
                c.known = Known::Unknown;
                Ok(None)
            }
            Written::Missing => {
                c.known = Known::Missing;
                Ok(None)
            }
        }
    }

    /// Waits for news of the Lease from the watch, or until `until` (when it may be taken); a
    /// retry period without news makes the next step a read.
    async fn wait_for_news(
        &self,
        c: &mut Campaign,
        watch: &mut (impl FusedStream<Item = Result<Option<Lease>, watcher::Error>> + Unpin),
        until: Instant,
    ) {
        let reread_at = c.news_at + self.settings.timing.retry_period;
        let readying_runs = c.readying.as_ref().is_some_and(|r| r.task.is_some());
        let readying = c.readying.as_mut();
        tokio::select! {
            // Readied (or not): offer to lead, or wait as before.
            () = async move {
                match readying {
                    Some(readying) => readying.finished().await,
                    None => std::future::pending().await,
                }
            }, if readying_runs => {}
            news = watch.next(), if c.watch_open => match news {
                Some(Ok(lease)) => {
                    if c.watch_failing {
                        info!(lease = %self.name(), "watching the lease again");
                        c.watch_failing = false;
                    }
                    c.known = self.observe(lease.as_ref(), &mut c.last, Instant::now());
                    c.news_at = Instant::now();
                }
                Some(Err(error)) if !c.watch_failing => {
                    warn!(lease = %self.name(), %error, "cannot watch the lease; reading it every retry period instead");
                    c.watch_failing = true;
                }
                Some(Err(_)) => {}
                None => c.watch_open = false,
            },
            _ = sleep_until(until.min(reread_at)) => {
                if Instant::now() >= reread_at {
                    c.known = Known::Unknown;
                }
            }
        }
    }

    /// Counts and logs a failed attempt (a write may have landed: the next step reads); returns
    /// the pause before the next: short when the API server gave no answer, backing off when it
    /// refused (a missing namespace, RBAC).
    fn failed_attempt(&self, c: &mut Campaign, error: &LeaseError) -> Duration {
        c.failures += 1;
        let failures = c.failures;
        warn!(lease = %self.name(), %error, failures, "could not acquire the lease; retrying");
        c.known = Known::Unknown;
        let retry_period = self.settings.timing.retry_period;
        if error.unanswered() {
            retry_period.min(UNANSWERED_RETRY)
        } else {
            retry_period * failures.clamp(1, 5)
        }
    }

    /// Updates what we know from a read or watched Lease (`None`: there is none).
    fn observe(&self, lease: Option<&Lease>, last: &mut Option<Seen>, now: Instant) -> Known {
        match lease {
            None => Known::Missing,
            Some(lease) => {
                let seen = Seen::observe(
                    lease,
                    last.as_ref(),
                    self.settings.timing.lease_duration,
                    now,
                );
                debug!(lease = %self.name(), holder = holder_name(&seen), version = %seen.resource_version, "lease seen");
                *last = Some(seen.clone());
                Known::Seen(seen)
            }
        }
    }

    /// Leads until shutdown or a shard given up (the loop gets the step-down grace), the loop
    /// ends, or the Lease is lost (the renew deadline, or another holder: aborted at once).
    async fn lead<W, F>(&self, won: Won, work: &W, shutdown: &CancellationToken) -> Ended
    where
        W: Fn(CancellationToken) -> F,
        F: Future<Output = ()> + Send + 'static,
    {
        let stop = CancellationToken::new();
        // Dropping the election (e.g. its task is aborted) aborts the work too: no reconcile
        // loop may outlive the leadership that started it.
        let mut task = AbortOnDropHandle::new(tokio::spawn(work(stop.clone())));
        self.leadership.set_leading(&self.settings.lease_name, true);
        // Counted as led now: its reserved place is no longer needed.
        if let Some(reserved) = won.reserved {
            reserved.led();
        }
        if let Some(free) = won.free_since {
            let took = Instant::now().saturating_duration_since(free);
            self.leadership.handovers().observe(took.as_secs_f64());
        }
        // Best effort, and never awaited: renewals must not wait on event publishing.
        self.tell(
            EventType::Normal,
            "LeaderElected",
            "became leader: reconciling Ats",
        );
        let (why, held) = self.hold(won.held, &mut task, shutdown).await;
        self.stop_work(&why, &mut task, &stop, &held).await;
        self.leadership
            .set_leading(&self.settings.lease_name, false);
        self.step_down(why, &held).await
    }

    /// Renews the Lease every retry period while it is held; returns why holding ended and the
    /// last tenure. Leaving with a handover, it leads on until a successor is ready, its limit, or
    /// no other replica is left.
    async fn hold(
        &self,
        mut held: Held,
        task: &mut AbortOnDropHandle<()>,
        shutdown: &CancellationToken,
    ) -> (Why, Held) {
        let timing = self.settings.timing;
        let mut renewal: Option<RenewalFuture> = None;
        let mut renew_at = held.sent + timing.retry_period;
        let mut handing_over: Option<HandingOver> = None;
        let why = loop {
            let until = handing_over.as_ref().map(|h| h.until);
            tokio::select! {
                biased;
                _ = sleep_until(held.deadline(timing.renew_deadline)) => break Why::Deadline,
                _ = shutdown.cancelled(), if handing_over.as_ref().is_none_or(|h| !h.stopping) => match handing_over.as_mut() {
                    // Handing a shard over for the balance: within the shutdown's room now.
                    Some(handing) => handing.stop(self.settings.handover.as_ref().map_or(Duration::ZERO, |h| h.on_shutdown)),
                    None => match self.begin_handover(Leaving::Shutdown) {
                        Ok(handing) => (handing_over, renew_at) = (Some(handing), Instant::now()),
                        Err(leaving) => break Why::Leaving(leaving),
                    },
                },
                result = &mut *task => break Why::LoopEnded(format!("{result:?}")),
                news = async { handing_over.as_mut().expect("a handover").news().await }, if handing_over.is_some() => {
                    if let Some(why) = found(&mut handing_over, news) {
                        break why;
                    }
                }
                _ = sleep_until(until.unwrap_or(renew_at)), if until.is_some() => {
                    let handing = handing_over.take().expect("a handover");
                    info!(lease = %self.name(), "no replica was ready to take the lease over in time; releasing it");
                    break Why::Leaving(handing.leaving);
                }
                outcome = async { renewal.as_mut().expect("a renewal").await }, if renewal.is_some() => {
                    renewal = None;
                    match outcome {
                        Renewal::Renewed(renewed, asked, successor) => {
                            renew_at = renewed.sent + timing.retry_period;
                            held = renewed;
                            self.leadership.renewed(&self.settings.lease_name);
                            if let Some(why) = found(&mut handing_over, successor) {
                                break why;
                            }
                            if handing_over.is_some() && self.no_successor() {
                                let handing = handing_over.take().expect("a handover");
                                info!(lease = %self.name(), "no other replica is left to take the lease over; releasing it");
                                break Why::Leaving(handing.leaving);
                            } else if handing_over.is_some() {
                                // Not yet asked for a successor (a renewal sent before the
                                // handover began): ask with the next renewal, at once.
                                if !asked {
                                    renew_at = Instant::now();
                                }
                            } else if let Some(yielding) = self.settings.balance.as_ref().and_then(|b| b.try_yield()) {
                                match self.begin_handover(Leaving::Yielded(yielding)) {
                                    Ok(handing) => (handing_over, renew_at) = (Some(handing), Instant::now()),
                                    Err(leaving) => break Why::Leaving(leaving),
                                }
                            }
                        }
                        Renewal::StillOurs(version, successor) => {
                            held.resource_version = version;
                            renew_at = Instant::now();
                            if let Some(why) = found(&mut handing_over, successor) {
                                break why;
                            }
                        }
                        Renewal::Gone(holder) => break Why::Taken(holder),
                        Renewal::Failed(error) => renew_at = self.renewal_failed(&held, &error),
                    }
                }
                _ = sleep_until(renew_at), if renewal.is_none() => {
                    let left = held
                        .deadline(timing.renew_deadline)
                        .saturating_duration_since(Instant::now());
                    // A late answer still keeps the Lease, but a hung connection must leave
                    // room for another try.
                    let limit = timing.retry_period.max(left / 2);
                    let asks = handing_over.is_some();
                    renewal = Some(renewal::renew(
                        self.leases.clone(),
                        self.me().to_owned(),
                        self.settings.clock.now(),
                        held.resource_version.clone(),
                        limit,
                        asks,
                    ));
                }
            }
        };
        (why, held)
    }

    /// Logs a failed renewal (a warning once the renew deadline is less than a retry period away)
    /// and returns when to try again: within a retry period, and before the deadline.
    fn renewal_failed(&self, held: &Held, error: &LeaseError) -> Instant {
        let timing = self.settings.timing;
        let left = held
            .deadline(timing.renew_deadline)
            .saturating_duration_since(Instant::now());
        if left < timing.retry_period {
            warn!(lease = %self.name(), %error, ?left, "could not renew the lease; retrying before the renew deadline");
        } else {
            info!(lease = %self.name(), %error, ?left, "could not renew the lease; retrying");
        }
        Instant::now() + timing.retry_period.min(left / 2)
    }

    /// Stops the reconcile loop unless it ended: leaving, asked to stop and aborted past the
    /// step-down grace (within the tenure); otherwise aborted at once. No reconcile starts or continues after this returns.
    async fn stop_work(
        &self,
        why: &Why,
        task: &mut AbortOnDropHandle<()>,
        stop: &CancellationToken,
        held: &Held,
    ) {
        if matches!(why, Why::LoopEnded(_)) {
            return;
        }
        let timing = self.settings.timing;
        if matches!(why, Why::Leaving(_) | Why::HandOver { .. }) {
            stop.cancel();
            let until =
                (Instant::now() + timing.step_down_grace).min(held.deadline(timing.renew_deadline));
            let left = until.saturating_duration_since(Instant::now());
            if timeout(left, &mut *task).await.is_ok() {
                return;
            }
            info!(lease = %self.name(), grace = ?timing.step_down_grace, "reconciles still running after the step-down grace; aborting them");
        }
        task.abort();
        let _ = (&mut *task).await;
    }

    /// Releases the Lease on shutdown or when the loop ended, and tells why leading ended.
    async fn step_down(&self, why: Why, held: &Held) -> Ended {
        let limit = self.settings.timing.retry_period * 2;
        let reason = match why {
            Why::Leaving(leaving) => return self.leave(leaving, held).await,
            Why::HandOver { successor, then } => match timeout(limit, self.hand_over(&successor))
                .await
                .unwrap_or(Err(LeaseError::Timeout(limit)))
            {
                Ok(()) => return self.handed_over(&successor, then),
                // The write may have landed though its answer was lost.
                Err(_) if self.handed_to(&successor).await => {
                    return self.handed_over(&successor, then)
                }
                Err(error) => {
                    warn!(lease = %self.name(), successor = %successor.identity, %error, "could not hand the lease over; releasing it");
                    return self.leave(then, held).await;
                }
            },
            Why::Deadline => format!(
                "no renewal within the renew deadline {:?}",
                self.settings.timing.renew_deadline
            ),
            Why::Taken(Some(holder)) => format!("the lease is now held by {holder:?}"),
            Why::Taken(None) => "the lease was released or deleted by someone else".into(),
            Why::LoopEnded(result) => {
                // Let another replica (or this one, after a pause) start afresh.
                self.release(held).await;
                format!("the reconcile loop ended unexpectedly: {result}")
            }
        };
        self.lost(&reason);
        Ended::Lost { gave_up: false }
    }

    /// Releases the Lease on shutdown or a shard given up.
    async fn leave(&self, leaving: Leaving, held: &Held) -> Ended {
        self.release(held).await;
        match leaving {
            Leaving::Shutdown => {
                self.tell(
                    EventType::Normal,
                    "LeaderReleased",
                    "released the lease on shutdown",
                );
                Ended::Released
            }
            Leaving::Yielded(yielding) => {
                let why = if yielding.outranked() {
                    "released the lease: replicas of another layout lead (the one Lease, or more shards: a change of --shards)"
                } else {
                    "released the lease: this replica leads more than its share of shards"
                };
                self.tell(EventType::Normal, "LeaderYielded", why);
                drop(yielding);
                Ended::Lost { gave_up: true }
            }
        }
    }

    /// Logs and tells that the Lease went to `successor` on shutdown or a shard given up.
    fn handed_over(&self, successor: &handover::Successor, leaving: Leaving) -> Ended {
        let (ended, why) = match leaving {
            Leaving::Shutdown => (Ended::Released, "shutting down"),
            Leaving::Yielded(_) => (
                Ended::Lost { gave_up: true },
                "this replica leads more than its share of shards",
            ),
        };
        let message = format!(
            "handed the lease over to {}, ready to lead: {why}",
            successor.identity
        );
        self.tell(EventType::Normal, "LeaderHandedOver", &message);
        ended
    }

    /// Logs and tells that leading ended without a shutdown, and why.
    fn lost(&self, reason: &str) {
        warn!(lease = %self.name(), identity = %self.me(), reason = %reason, "lost leadership: reconciling stopped");
        self.tell(
            EventType::Warning,
            "LeaderLost",
            &format!("stopped leading: {reason}"),
        );
    }

    /// Gives the Lease up so a candidate takes over at once, but only while it is ours: the
    /// write carries our last version, and a conflict is resolved by reading who holds it.
    async fn release(&self, held: &Held) {
        let attempt = async {
            let mut version = held.resource_version.clone();
            // A renewal we gave up on may still have landed: then the Lease is ours at a newer
            // version, and one re-read finds it.
            for _ in 0..2 {
                let patch = record::release_patch(&version, self.settings.clock.now());
                match self.leases.swap(&patch).await? {
                    Written::Done(_) => return Ok("released the lease".to_owned()),
                    Written::Missing => return Ok("the lease is gone; nothing to release".into()),
                    Written::Conflict => {
                        match record::reread(self.leases.get().await?.as_ref(), self.me()) {
                            Reread::StillOurs { resource_version } => version = resource_version,
                            Reread::Gone { holder } => {
                                return Ok(format!(
                                    "not releasing: the lease is now held by {:?}",
                                    holder.unwrap_or_default()
                                ))
                            }
                        }
                    }
                }
            }
            Ok::<_, LeaseError>("the lease kept changing; it expires by itself".to_owned())
        };
        match timeout(self.settings.timing.retry_period, attempt).await {
            Ok(Ok(what)) => info!(lease = %self.name(), "{what}"),
            Ok(Err(error)) => {
                warn!(lease = %self.name(), %error, "could not release the lease; it expires by itself")
            }
            Err(_) => {
                warn!(lease = %self.name(), "releasing the lease timed out; it expires by itself")
            }
        }
    }

    /// Logs and queues an event on the Lease; dropped when the event queue is full.
    fn tell(&self, type_: EventType, reason: &str, note: &str) {
        info!(lease = %self.name(), identity = %self.me(), reason, "{note}");
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(format!("{}: {note}", self.me())),
            action: "LeaderElection".into(),
            secondary: None,
        };
        let regarding = Lease {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(self.settings.lease_name.clone()),
                namespace: Some(self.settings.namespace.clone()),
                ..Default::default()
            },
            spec: None,
        };
        if !self
            .events
            .try_send_replica(event, regarding.object_ref(&()))
        {
            debug!(lease = %self.name(), reason, "event not queued (its lane is full, or publishing stopped); dropped");
        }
    }
}

/// A holder handing its Lease over: it reconciles on, and watches its Lease for a ready
/// successor, until `until`.
struct HandingOver {
    leaving: Leaving,
    until: Instant,
    /// Shutting down: `until` fits the shutdown timeout.
    stopping: bool,
    watch: Pin<Box<dyn Stream<Item = Result<Option<Lease>, watcher::Error>> + Send>>,
    watch_open: bool,
    me: String,
}

impl HandingOver {
    /// The replica started shutting down while it hands a shard over for the balance: the
    /// handover ends within what the shutdown timeout leaves room for.
    fn stop(&mut self, on_shutdown: Duration) {
        self.until = self.until.min(Instant::now() + on_shutdown);
        self.stopping = true;
    }

    /// The next change of the Lease: the successor it names, if any (never completes once the
    /// watch has ended).
    async fn news(&mut self) -> Option<handover::Successor> {
        if !self.watch_open {
            return std::future::pending().await;
        }
        match self.watch.next().await {
            Some(Ok(Some(lease))) => handover::Successor::named_on(&lease, &self.me),
            Some(Ok(None) | Err(_)) => None,
            None => {
                self.watch_open = false;
                None
            }
        }
    }
}

/// While handing over, a successor the Lease names ends the handover: why leading ends.
fn found(
    handing_over: &mut Option<HandingOver>,
    successor: Option<handover::Successor>,
) -> Option<Why> {
    let successor = successor?;
    let handing = handing_over.take()?;
    Some(Why::HandOver {
        successor,
        then: handing.leaving,
    })
}

impl Elector {
    /// Starts handing the Lease over for `leaving`; `Err(leaving)` when no successor can be ready
    /// (no handovers, no other replica, or giving shards up to an outranking layout).
    fn begin_handover(&self, leaving: Leaving) -> Result<HandingOver, Leaving> {
        let Some(handover) = &self.settings.handover else {
            return Err(leaving);
        };
        let outranked = matches!(&leaving, Leaving::Yielded(yielding) if yielding.outranked());
        let stopping = matches!(leaving, Leaving::Shutdown);
        let limit = if stopping {
            handover.limit.min(handover.on_shutdown)
        } else {
            handover.limit
        };
        if self.no_successor() || outranked || limit.is_zero() {
            return Err(leaving);
        }
        info!(lease = %self.name(), ?limit, "handing the lease over: reconciling on until another replica is ready to lead");
        Ok(HandingOver {
            leaving,
            until: Instant::now() + limit,
            stopping,
            watch: Box::pin(self.leases.watch()),
            watch_open: true,
            me: self.me().to_owned(),
        })
    }

    /// No replica can take the Lease over: this one is alone among the replicas it counts, or
    /// another layout leads (its replicas compete for other Leases).
    fn no_successor(&self) -> bool {
        self.settings.balance.as_ref().is_none_or(|balance| {
            let view = balance.view();
            view.replicas <= 1 || view.another_layout_leads || view.outranked
        })
    }

    /// A candidate's step in a handover: ready itself if it may take the shard, then offer
    /// (`Next::Offer`); drop that once another is named or the holder stays. `None`: as usual.
    fn readying_step(&self, c: &mut Campaign, now: Instant, stopping: bool) -> Option<Next> {
        let handover = self.settings.handover.as_ref()?;
        let Known::Seen(seen) = &c.known else {
            return None;
        };
        match record::offer(seen, self.me()) {
            Offer::Open => match &c.readying {
                // A replica stopping readies itself for nothing.
                None if stopping => None,
                None => {
                    let balance = self.settings.balance.as_ref()?;
                    let rescue_only = c.rescue_only_until.is_some_and(|until| now < until);
                    if let Some(reserved) = balance.try_reserve(Duration::ZERO, rescue_only) {
                        info!(lease = %self.name(), holder = holder_name(seen), "the holder hands the lease over: readying to lead");
                        c.readying = Some(handover::Readying::start(handover, reserved));
                    }
                    None
                }
                // A replica stopping offers nothing (it would have to take it back).
                Some(readying) if readying.ready && !stopping => Some(Next::Offer {
                    resource_version: seen.resource_version.clone(),
                }),
                Some(_) => None,
            },
            Offer::Ours => None,
            Offer::Taken => {
                if c.readying.take().is_some() {
                    debug!(lease = %self.name(), successor = seen.preferred_holder.as_deref().unwrap_or_default(), "another replica is to take the lease over");
                }
                None
            }
            Offer::None => {
                // Held on by its holder or taken by another: what was readied is not needed.
                let another_holds = seen.holder.as_deref().is_some_and(|h| h != self.me());
                if another_holds && now < seen.expires_at() {
                    c.readying = None;
                }
                None
            }
        }
    }

    /// Says on the Lease that this replica is ready to lead (`record::PREFERRED_HOLDER`).
    async fn offer(
        &self,
        c: &mut Campaign,
        resource_version: &str,
    ) -> Result<Option<Won>, LeaseError> {
        let patch = record::prefer_patch(resource_version, self.me());
        match self.leases.swap(&patch).await? {
            Written::Done(lease) => {
                info!(lease = %self.name(), "ready to lead: asked the holder to hand the lease over");
                if let Some(readying) = c.readying.as_mut() {
                    readying.offered = true;
                }
                c.known = self.observe(Some(&lease), &mut c.last, Instant::now());
                c.news_at = Instant::now();
                Ok(None)
            }
            Written::Conflict | Written::Missing => {
                c.known = Known::Unknown;
                Ok(None)
            }
        }
    }

    /// Writes `successor` as the Lease's holder, on the version that named it (read again once
    /// if our own renewal changed it since).
    async fn hand_over(&self, successor: &handover::Successor) -> Result<(), LeaseError> {
        let timing = self.settings.timing;
        let mut named = successor.clone();
        for _ in 0..2 {
            let patch = record::hand_over_patch(
                &named.resource_version,
                &named.identity,
                named.transitions + 1,
                timing.lease_seconds(),
                self.settings.clock.now(),
            );
            match self.leases.swap(&patch).await? {
                Written::Done(_) => return Ok(()),
                Written::Missing => return Err(LeaseError::Gone),
                Written::Conflict => {
                    let lease = self.leases.get().await?.ok_or(LeaseError::Gone)?;
                    match handover::Successor::named_on(&lease, self.me()) {
                        Some(now_named) if now_named.identity == successor.identity => {
                            named = now_named
                        }
                        _ => return Err(LeaseError::Changed),
                    }
                }
            }
        }
        Err(LeaseError::Changed)
    }

    /// Whether `successor` holds the Lease now (a handover whose answer was lost may have
    /// landed).
    async fn handed_to(&self, successor: &handover::Successor) -> bool {
        self.leases.get().await.is_ok_and(|lease| {
            matches!(
                record::reread(lease.as_ref(), &successor.identity),
                record::Reread::StillOurs { .. }
            )
        })
    }

    /// On stopping, a candidate named on the Lease takes its name back (or releases the Lease it
    /// was already handed). Best effort: the Lease expires otherwise.
    async fn withdraw(&self, c: &Campaign) {
        // Only a candidate that readied can have named itself (an offer whose answer was lost
        // may have landed).
        if c.readying.is_none() {
            return;
        }
        let attempt = async {
            // A conflict (the holder renewed, or just handed the Lease over to us): read again.
            for _ in 0..3 {
                let Some(lease) = self.leases.get().await? else {
                    return Ok::<_, LeaseError>("the lease is gone");
                };
                let seen = Seen::observe(&lease, None, Duration::ZERO, Instant::now());
                let patch = if seen.holder.as_deref() == Some(self.me()) {
                    record::release_patch(&seen.resource_version, self.settings.clock.now())
                } else if seen.preferred_holder.as_deref() == Some(self.me()) {
                    record::unprefer_patch(&seen.resource_version)
                } else {
                    return Ok("not named");
                };
                match self.leases.swap(&patch).await? {
                    Written::Done(_) => return Ok("withdrawn"),
                    Written::Missing => return Ok("the lease is gone"),
                    Written::Conflict => {}
                }
            }
            Err(LeaseError::Changed)
        };
        match attempt.await {
            Ok(outcome) => {
                debug!(lease = %self.name(), outcome, "stopping: withdrew from the handover")
            }
            Err(error) => {
                warn!(lease = %self.name(), %error, "stopping: could not withdraw from the handover; the lease expires instead")
            }
        }
    }
}

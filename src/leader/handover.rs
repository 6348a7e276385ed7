//! Handing a Lease over to a successor that is ready to lead (with Lease shards: one that has
//! listed the shard's Ats). The holder stops before it names its successor: one leads at a time.
//! See docs/src/design/decisions.md, "Lease shards".

use super::balance::Reservation;
use super::record::{self, Known, Next, Offer, Seen};
use super::store::{holder_name, LeaseError, Written};
use super::{Campaign, Elector, Leaving, Why, Won};
use futures::{Stream, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::watcher;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info, warn};

/// Readies this replica to lead a Lease before it holds it.
pub trait Prepare: Send + Sync {
    /// Readies (with Lease shards: lists the shard's Ats into the cache its leadership will
    /// use); completes with `true` once ready, `false` if it could not be.
    fn prepare(&self) -> Pin<Box<dyn Future<Output = bool> + Send>>;

    /// What `prepare` readied will not be used (another replica was named, or the holder went
    /// on): let it go.
    fn discard(&self);
}

/// How this replica takes part in handovers of a Lease.
#[derive(Clone)]
pub struct Handover {
    pub prepare: Arc<dyn Prepare>,
    /// The longest a holder goes on reconciling while it waits for a ready successor; then it
    /// releases the Lease.
    pub limit: Duration,
    /// The same once the replica is shutting down (what its shutdown timeout leaves room for;
    /// zero: it releases at once).
    pub on_shutdown: Duration,
}

impl fmt::Debug for Handover {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handover")
            .field("limit", &self.limit)
            .field("on_shutdown", &self.on_shutdown)
            .finish_non_exhaustive()
    }
}

/// A candidate readying itself for a Lease whose holder asked for a successor. Dropped without
/// `keep`, what was readied is discarded.
pub(super) struct Readying {
    prepare: Arc<dyn Prepare>,
    /// Its place among the shards this replica leads (`None` once readying failed).
    reserved: Option<Reservation>,
    task: Option<AbortOnDropHandle<bool>>,
    ready: bool,
    /// It named itself on the Lease.
    offered: bool,
    kept: bool,
}

impl Readying {
    pub(super) fn start(handover: &Handover, reserved: Reservation) -> Self {
        let task = tokio::spawn(handover.prepare.prepare());
        Readying {
            prepare: handover.prepare.clone(),
            reserved: Some(reserved),
            task: Some(AbortOnDropHandle::new(task)),
            ready: false,
            offered: false,
            kept: false,
        }
    }

    /// Ready to lead: time to say so on the Lease.
    pub(super) fn is_ready(&self) -> bool {
        self.ready
    }

    pub(super) fn is_running(&self) -> bool {
        self.task.is_some()
    }

    /// Completes when readying ends (never, once it has).
    pub(super) async fn finished(&mut self) {
        let Some(task) = self.task.as_mut() else {
            return std::future::pending().await;
        };
        let ready = task.await.unwrap_or(false);
        self.task = None;
        self.ready = ready;
        if !ready {
            // Not ready: it takes no place among the shards, and nothing it readied is used
            // (the shard is taken as others would take it when it is free).
            self.reserved = None;
            self.prepare.discard();
        }
    }

    /// It holds a place among the shards this replica leads (a take need not reserve one).
    pub(super) fn holds_place(&self) -> bool {
        self.reserved.is_some()
    }

    /// The Lease is this replica's: what was readied is used (the leadership's work finds it),
    /// and the place reserved goes to the leadership.
    pub(super) fn keep(mut self) -> Option<Reservation> {
        self.kept = true;
        self.reserved.take()
    }
}

impl Drop for Readying {
    fn drop(&mut self) {
        if !self.kept {
            self.prepare.discard();
        }
    }
}

/// The candidate a holder hands its Lease over to, as the Lease named it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Successor {
    identity: String,
    /// The version that named it: the handover is a compare-and-swap on it.
    resource_version: String,
    transitions: i32,
}

impl Successor {
    /// The ready candidate `seen` names, if it is held by `me` and asks for a successor.
    pub(super) fn named(seen: &Seen, me: &str) -> Option<Self> {
        let ours = seen.holder.as_deref() == Some(me);
        match &seen.preferred_holder {
            Some(ready) if ours && seen.handing_over && ready != me => Some(Successor {
                identity: ready.clone(),
                resource_version: seen.resource_version.clone(),
                transitions: seen.transitions,
            }),
            _ => None,
        }
    }

    /// The ready candidate `lease` names, if it is held by `me` and asks for a successor.
    pub(super) fn named_on(lease: &Lease, me: &str) -> Option<Self> {
        // Only the annotations and holder are read: the durations do not matter here.
        let seen = Seen::observe(lease, None, Duration::ZERO, Instant::now());
        Self::named(&seen, me)
    }

    pub(super) fn identity(&self) -> &str {
        &self.identity
    }
}

/// A holder handing its Lease over: it reconciles on, and watches its Lease for a ready
/// successor, until `until`.
pub(super) struct HandingOver {
    pub(super) leaving: Leaving,
    pub(super) until: Instant,
    /// Shutting down: `until` fits the shutdown timeout.
    pub(super) stopping: bool,
    watch: Pin<Box<dyn Stream<Item = Result<Option<Lease>, watcher::Error>> + Send>>,
    watch_open: bool,
    me: String,
}

impl HandingOver {
    /// The replica started shutting down while it hands a shard over for the balance: the
    /// handover ends within what the shutdown timeout leaves room for.
    pub(super) fn stop(&mut self, on_shutdown: Duration) {
        self.until = self.until.min(Instant::now() + on_shutdown);
        self.stopping = true;
    }

    /// The next change of the Lease: the successor it names, if any (never completes once the
    /// watch has ended).
    pub(super) async fn news(&mut self) -> Option<Successor> {
        if !self.watch_open {
            return std::future::pending().await;
        }
        match self.watch.next().await {
            Some(Ok(Some(lease))) => Successor::named_on(&lease, &self.me),
            Some(Ok(None) | Err(_)) => None,
            None => {
                self.watch_open = false;
                None
            }
        }
    }
}

/// While handing over, a successor the Lease names ends the handover: why leading ends.
pub(super) fn found(
    handing_over: &mut Option<HandingOver>,
    successor: Option<Successor>,
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
    pub(super) fn begin_handover(&self, leaving: Leaving) -> Result<HandingOver, Leaving> {
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
    pub(super) fn no_successor(&self) -> bool {
        self.settings.balance.as_ref().is_none_or(|balance| {
            let view = balance.view();
            view.replicas <= 1 || view.another_layout_leads || view.outranked
        })
    }

    /// A candidate's step in a handover: ready itself if it may take the shard, then offer
    /// (`Next::Offer`); drop that once another is named or the holder stays. `None`: as usual.
    pub(super) fn readying_step(
        &self,
        c: &mut Campaign,
        now: Instant,
        stopping: bool,
    ) -> Option<Next> {
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
                        c.readying = Some(Readying::start(handover, reserved));
                    }
                    None
                }
                // A replica stopping offers nothing (it would have to take it back).
                Some(readying) if readying.is_ready() && !stopping => Some(Next::Offer {
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
    pub(super) async fn offer(
        &self,
        c: &mut Campaign,
        resource_version: &str,
    ) -> Result<Option<Won>, LeaseError> {
        let patch = record::prefer_patch(resource_version, self.me());
        match self.leases.swap(&patch).await {
            Ok(Written::Done(lease)) => {
                info!(lease = %self.name(), "ready to lead: asked the holder to hand the lease over");
                if let Some(readying) = c.readying.as_mut() {
                    readying.offered = true;
                }
                c.known = self.observe(Some(&lease), &mut c.last, Instant::now());
                c.news_at = Instant::now();
                Ok(None)
            }
            Ok(Written::Conflict | Written::Missing) => {
                c.known = Known::Unknown;
                Ok(None)
            }
            Err(error) => {
                c.known = Known::Unknown;
                Err(error)
            }
        }
    }

    /// Writes `successor` as the Lease's holder, on the version that named it (read again once
    /// if our own renewal changed it since).
    pub(super) async fn hand_over(&self, successor: &Successor) -> Result<(), LeaseError> {
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
                    match Successor::named_on(&lease, self.me()) {
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
    pub(super) async fn handed_to(&self, successor: &Successor) -> bool {
        self.leases.get().await.is_ok_and(|lease| {
            matches!(
                record::reread(lease.as_ref(), successor.identity()),
                record::Reread::StillOurs { .. }
            )
        })
    }

    /// On stopping, a candidate named on the Lease takes its name back (or releases the Lease it
    /// was already handed). Best effort: the Lease expires otherwise.
    pub(super) async fn withdraw(&self, c: &Campaign) {
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

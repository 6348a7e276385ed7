//! Reconciling Ats: carries `decide`'s decisions out one step at a time (`step`), through
//! `calls`, `writer` and `scheduler`; each reconcile is a `reconcile` span.
//! See docs/src/design/architecture.md, "The reconcile loop".

pub mod apiserver_bugs;
pub mod backlog;
pub mod calls;
pub mod decide;
pub mod error;
pub mod ledger;
pub mod queue;
pub mod scheduler;
pub mod wakeups;
pub mod writer;

use crate::api::{At, Phase};
use crate::observability::metrics::Metrics;
use crate::operator::events::EventSink;
use crate::operator::key::AtKey;
use crate::operator::policy::RunPolicy;
use crate::operator::quarantine::{Panicked, Quarantine};
use crate::operator::signing::{Key, Signing};
use crate::operator::{pod, reachability};
use calls::{key, Caches, Calls, Clock, Created};
use chrono::{DateTime, Utc};
use decide::{decide, Call, Decision};
use kube::runtime::controller::Action;
use kube::{Client, ResourceExt};
use ledger::Ledger;
use scheduler::Scheduler;
use std::sync::Arc;
use std::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::field::{display, Empty};
use tracing::{info_span, Instrument, Span};
use wakeups::Wake;
use writer::{Target, Writer};

pub use error::Error;

/// A reconcile never needs more than: look up or create the pod, look it up again, decide.
const MAX_STEPS: usize = 3;

/// What every reconcile shares: the executor's view of the cluster and the one writer.
pub struct Context {
    /// The API calls besides status writes, and what they share with the reconcile: the
    /// clock, the run policy, the metrics and the ledger.
    calls: Calls,
    /// When each At is looked at again, and the retry policy.
    scheduler: Arc<Scheduler>,
    /// Status writes and events.
    writer: Arc<Writer>,
    /// Cancelled when a reconcile panicked: the loop ends, and with it this leadership.
    fatal: CancellationToken,
}

impl Context {
    pub fn new(
        client: Client,
        caches: Caches,
        events: EventSink,
        clock: Clock,
        metrics: Arc<Metrics>,
        policy: RunPolicy,
        quarantine: Arc<Quarantine>,
    ) -> Self {
        let ledger = Arc::new(Ledger::new(quarantine));
        let scheduler = Arc::new(Scheduler::default());
        let (ledger_, scheduler_) = (ledger.clone(), scheduler.clone());
        let writer = Writer::new(client.clone(), events, metrics.clone(), ledger_, scheduler_);
        let calls = Calls {
            client,
            caches,
            // A key of its own until `with_signing` gives the replicas' shared one.
            signing: Signing::new(Key::generate().0),
            policy,
            metrics,
            ledger,
            clock,
        };
        Context {
            calls,
            scheduler,
            writer: Arc::new(writer),
            fatal: CancellationToken::new(),
        }
    }

    /// The one writer of statuses and events.
    pub fn writer(&self) -> &Arc<Writer> {
        &self.writer
    }

    /// The API calls besides status writes.
    pub fn calls(&self) -> &Calls {
        &self.calls
    }

    /// When each At is looked at again.
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// What is remembered of each At between reconciles.
    pub fn ledger(&self) -> &Ledger {
        &self.calls.ledger
    }

    /// Cancelled once a reconcile panicked: the loop must end.
    pub fn fatal(&self) -> &CancellationToken {
        &self.fatal
    }

    /// Drops everything kept for a deleted At: its backoff, its last write, its wakeup.
    pub fn forget(&self, at: &AtKey) {
        self.calls.ledger.forget(at);
        self.scheduler.forget(at);
    }

    /// Signs pods with `signing`'s key and takes only pods it signed (or older than signing) for
    /// Ats' own.
    pub fn with_signing(mut self, signing: Signing) -> Self {
        self.calls.signing = signing;
        self
    }

    /// Drops what is kept for Ats `known` does not hold any more (deletions a relist or a lagging
    /// feed did not report one by one).
    pub fn forget_all_but(&self, known: impl Fn(&AtKey) -> bool) {
        self.calls.ledger.retain(&known);
        // An At known only by its failures (its write unrecorded) may still have a pending
        // write or a quarantine kept in the ledger.
        for at in self.scheduler.retain(known) {
            self.calls.ledger.forget(&at);
        }
    }

    /// A panic while handling `at` at `place`: logged once with the At and the panic, counted,
    /// this version quarantined, and the loop ended (the leader releases the Lease).
    pub fn panicked(&self, at: &At, place: &'static str, panic: &Panicked) {
        self.calls.metrics.panicked(place);
        let at_key = key(at);
        tracing::error!(at = %at_key, place, %panic, "panic while handling this At; it is skipped until it changes, and leadership ends so the reconcile loop starts afresh. Please report this as a bug");
        let version = at.resource_version().unwrap_or_default();
        self.calls.ledger.quarantine().add(at_key, version);
        self.fatal.cancel();
    }

    /// Whether this version of `at` is quarantined after a panic.
    pub fn quarantined(&self, at: &At) -> bool {
        let version = at.resource_version();
        self.calls.ledger.quarantined(&key(at), version.as_deref())
    }

    /// Runs until dropped: the scheduler's probe of an unreachable API server (`probe`), and its
    /// wake-up of pod creates put off while the At cache was behind (`wake_deferred`).
    pub async fn look_again(self: Arc<Self>) {
        let probe = self
            .scheduler
            .probe(|| reachability::answers(&self.calls.client));
        let deferred = self.scheduler.wake_deferred(&self.calls.caches.ats);
        tokio::join!(probe, deferred);
    }

    /// The time now, by the injected clock.
    pub fn now(&self) -> DateTime<Utc> {
        (self.calls.clock)()
    }

    /// Whether a watched version of `at` needs a reconcile now; if not, `wakeups` holds when it
    /// does, if that is within its horizon (see `wakeups`).
    pub fn needs_reconcile(&self, at: &At) -> bool {
        if self.is_stale(at).is_some() || self.quarantined(at) {
            return false;
        }
        let wakeups = self.scheduler.wakeups();
        // By name only: the index holds one small key per waiting At.
        let at_key = key(at);
        // Its pod waits for cnat's finalizer to go: only a reconcile, which sees the pod, decides
        // that (a terminating or ended pod changes no more, so nothing else would bring it).
        if self.calls.pod_awaiting_release(&at_key).is_some()
            || self.calls.finalizer_on_finished_pod(at)
        {
            wakeups.clear(&at_key);
            return true;
        }
        match wakeups::wake(at, (self.calls.clock)(), &self.calls.policy) {
            Wake::Now => {
                wakeups.clear(&at_key);
                true
            }
            Wake::After(left) => {
                wakeups.set_in(at_key, left);
                false
            }
            Wake::OnChange => {
                wakeups.clear(&at_key);
                false
            }
        }
    }

    /// The look-ahead's part (`triggers::look_ahead`): puts `at` into the wake-up index if its
    /// next reconcile comes within the horizon; never reconciles it (work now is on its way).
    pub fn look_ahead(&self, at: &At) {
        if self.is_stale(at).is_some() || self.quarantined(at) {
            return;
        }
        if let Wake::After(left) = wakeups::wake(at, (self.calls.clock)(), &self.calls.policy) {
            self.scheduler.after(key(at), left);
        }
    }

    /// Whether Ats end with a TTL by default (`--default-ttl-seconds-after-finished`).
    pub fn ttl_by_default(&self) -> bool {
        self.calls.policy.ttl_seconds_after_finished.is_some()
    }

    /// The phase we wrote (or queued) over this version of `at`, if we did: the cache has not
    /// caught up with our write.
    fn is_stale(&self, at: &At) -> Option<Phase> {
        let version = at.resource_version();
        self.calls.ledger.stale(&key(at), version.as_deref())
    }
}

/// Brings one At one step closer to DONE.
pub async fn reconcile(at: Arc<At>, ctx: Arc<Context>) -> Result<Action, Error> {
    let span = info_span!(
        "reconcile",
        "at.namespace" = %calls::namespace(&at),
        "at.name" = %at.name_any(),
        "phase.before" = at.phase().as_str(),
        "phase.after" = Empty,
        action = Empty,
        "requeue.seconds" = Empty,
        error = Empty,
        "otel.status_code" = Empty,
    );
    let started = Instant::now();
    let result = step(&at, &ctx).instrument(span.clone()).await;
    ctx.calls
        .metrics
        .reconciled(result.is_ok(), started.elapsed());
    if let Err(error) = &result {
        span.record("error", display(error));
        span.record("otel.status_code", "ERROR");
    }
    result
}

async fn step(at: &Arc<At>, ctx: &Arc<Context>) -> Result<Action, Error> {
    // A version whose status write we queued or made is not acted on again, except to create
    // the pod of an At that fell due while its PENDING write waits (the create is idempotent).
    let stale = ctx.is_stale(at);
    let now = (ctx.calls.clock)();
    let calls = &ctx.calls;
    let mut observation = calls.cached_pod(at);
    let mut taken = Vec::new();
    for _ in 0..MAX_STEPS {
        let decision = decide(at, &observation, now, &ctx.calls.policy);
        let pending_write = stale == Some(Phase::Pending) && decision.call == Call::CreatePod;
        if stale.is_some() && !pending_write {
            taken.push("skip-stale");
            Span::current().record("action", taken.join(",").as_str());
            return Ok(Action::await_change());
        }
        taken.push(call_name(decision.call));
        Span::current().record("action", taken.join(",").as_str());
        observation = match decision.call {
            // Status writes and events follow at lower priority, behind the pod creates in
            // flight; a refused pod's status is written here, before the error backs off.
            Call::Nothing if decision.retry => return ctx.commit(at, decision, now).await,
            Call::Nothing => return Ok(ctx.defer(at, decision, now)),
            Call::LookUpPod => calls.fetch_pod(at).await?,
            Call::DeleteAt => return calls.delete_at(at).await,
            Call::DeletePod => match calls.delete_pod(at).await? {
                None => return Ok(ctx.defer(at, decision, now)),
                // Gone, ended or replaced meanwhile: decided again on what it is.
                Some(found) => found,
            },
            Call::ReleasePod => calls.release_pod(at).await?,
            Call::CreatePod => match calls.create_pod(at, ctx.writer.priority()).await? {
                Created::Yes => return Ok(ctx.defer(at, decision, now)),
                Created::Found(found) => found,
                // The watch brings the API server's version; the decision is made on that.
                Created::Unconfirmed => return Ok(Action::await_change()),
                // Decided again on what the cache holds once it caught up.
                Created::Behind => return Ok(ctx.scheduler.behind(key(at), &calls.caches.ats)),
            },
        };
    }
    Err(Error::PodChurn {
        at: key(at),
        pod: pod::name_for(&at.name_any()),
    })
}

/// Retries a failed reconcile (`Scheduler::failed_reconcile`).
pub fn error_policy(at: Arc<At>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.scheduler.failed_reconcile(&key(&at), error)
}

impl Context {
    /// Writes the decided status now (a refused pod: the status says why before the error
    /// backs off), then returns the refusal as the error.
    async fn commit(
        &self,
        at: &At,
        decision: Decision,
        decided_at: DateTime<Utc>,
    ) -> Result<Action, Error> {
        if let Some(status) = &decision.status {
            match self.writer.write_now(&Target::of(at), &decision).await {
                Ok(true) => {}
                Ok(false) => return Ok(Action::await_change()),
                Err(source) => {
                    return Err(Error::WriteStatus {
                        at: key(at),
                        phase: status.phase,
                        source,
                    });
                }
            }
        }
        if decision.retry {
            // The status says why (one event per distinct refusal); the error policy backs off.
            let reason = decision
                .status
                .as_ref()
                .or(at.status.as_ref())
                .and_then(|s| s.message.clone())
                .unwrap_or_default();
            return Err(Error::PodRefused {
                at: key(at),
                pod: pod::name_for(&at.name_any()),
                reason,
            });
        }
        self.scheduler.succeeded(&key(at));
        Ok(self.settled(at, &decision, decided_at))
    }

    /// Queues the decided status write and event behind the pod creates in flight (see
    /// `writer`); until it is written, reconciles of the version decided on are skipped.
    fn defer(&self, at: &At, decision: Decision, decided_at: DateTime<Utc>) -> Action {
        // With a write queued, the failures in a row are counted on until it is written, so
        // that a write failing again and again backs off and is reported.
        if decision.status.is_none() {
            self.scheduler.succeeded(&key(at));
            return self.settled(at, &decision, decided_at);
        }
        let action = self.settled(at, &decision, decided_at);
        self.writer.queue(Target::of(at), decision);
        action
    }

    /// Records the phase decided on and sets when to look again in the wake-up index (or
    /// earlier, if its wakeup already says so), shortened by the time spent since `decided_at`.
    fn settled(&self, at: &At, decision: &Decision, decided_at: DateTime<Utc>) -> Action {
        let span = Span::current();
        let after = decision.status.as_ref().map_or(at.phase(), |s| s.phase);
        span.record("phase.after", after.as_str());
        let spent = ((self.calls.clock)() - decided_at)
            .to_std()
            .unwrap_or_default();
        if let Some(left) = decision.requeue {
            // At most the index's horizon (an At may be due in 9999): beyond it, the look-ahead
            // puts the At in (`needs_reconcile` sets a PENDING At's whole remaining time).
            let left = left.saturating_sub(spent).min(wakeups::HORIZON);
            span.record("requeue.seconds", left.as_secs_f64());
            self.scheduler.after(key(at), left);
        }
        Action::await_change()
    }
}

fn call_name(call: Call) -> &'static str {
    match call {
        Call::Nothing => "none",
        Call::LookUpPod => "look-up-pod",
        Call::CreatePod => "create-pod",
        Call::DeleteAt => "delete-at",
        Call::ReleasePod => "release-pod",
        Call::DeletePod => "delete-pod",
    }
}

#[cfg(test)]
mod handover_model;
#[cfg(test)]
mod tests;

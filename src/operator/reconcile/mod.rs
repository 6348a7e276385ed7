//! Reconciling Ats: `decide` is the pure state machine; this module carries its decisions out
//! against the API server (pod creation, status writes, events) and retries failures with backoff.
//! Each reconcile is a `reconcile` span and is counted in the metrics.

pub mod decide;
pub mod followup;
pub mod glitch;
pub mod wakeups;

use crate::api::{At, AtStatus, Phase};
use crate::observability::metrics::Metrics;
use crate::operator::contain::{Panicked, Quarantine};
use crate::operator::events::EventSink;
use crate::operator::key::AtKey;
use crate::operator::ledger::Ledger;
use crate::operator::policy::RunPolicy;
use crate::operator::reachability::{self, Reachability};
use crate::{operator::pod, schedule};
use backon::{BackoffBuilder, ExponentialBuilder};
use chrono::{DateTime, Utc};
use decide::{decide, Action as Step, Decision, Note, PodObservation, Severity};
use followup::PodsFirst;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio_util::sync::CancellationToken;
use tracing::field::{display, Empty};
use tracing::{debug, info, info_span, warn, Instrument, Span};
use wakeups::{Wake, Wakeups};

/// Field manager recorded on everything cnat writes.
pub const FIELD_MANAGER: &str = "cnat";

/// A reconcile never needs more than: look up or create the pod, look it up again, decide.
const MAX_STEPS: usize = 3;

/// Attempts to release the pod of a deleted At before leaving it to the next relist or leader.
const ORPHAN_ATTEMPTS: u32 = 6;

/// The longest wait a reconcile sets in the wake-up index (an At may be due in 9999). The
/// watch event of the status it writes then sets the At's whole remaining time (`wake`; an At
/// due in 9999 stops no replica, tests/e2e `bad_input`); nothing looks at a far-off At before
/// it is due.
pub const MAX_REQUEUE: Duration = Duration::from_secs(3600);

/// A failed reconcile; it is retried with backoff. Each names the At and what was being done.
#[derive(Debug, Error)]
pub enum Error {
    #[error("At {at}: creating pod {pod}: {source}")]
    CreatePod {
        at: AtKey,
        pod: String,
        source: kube::Error,
    },
    #[error("At {at}: reading pod {pod}: {source}")]
    ReadPod {
        at: AtKey,
        pod: String,
        source: kube::Error,
    },
    #[error("At {at}: writing status {phase}: {source}")]
    WriteStatus {
        at: AtKey,
        phase: Phase,
        source: kube::Error,
    },
    #[error("At {at}: pod {pod} kept appearing and disappearing while being created")]
    PodChurn { at: AtKey, pod: String },
    #[error("At {at}: the API server refused pod {pod} (retried with backoff): {reason}")]
    PodRefused {
        at: AtKey,
        pod: String,
        reason: String,
    },
    #[error("At {at}: removing cnat's finalizer from pod {pod}, which is being deleted: {source}")]
    ReleasePod {
        at: AtKey,
        pod: String,
        source: kube::Error,
    },
    #[error("At {at}: deleting it after ttlSecondsAfterFinished: {source}")]
    Delete { at: AtKey, source: kube::Error },
}

impl Error {
    /// The API error behind this failure, if there is one.
    pub fn api_error(&self) -> Option<&kube::Error> {
        match self {
            Error::CreatePod { source, .. }
            | Error::ReadPod { source, .. }
            | Error::WriteStatus { source, .. }
            | Error::ReleasePod { source, .. }
            | Error::Delete { source, .. } => Some(source),
            Error::PodChurn { .. } | Error::PodRefused { .. } => None,
        }
    }
}

/// The wall clock, injected so tests control time.
pub type Clock = Box<dyn Fn() -> DateTime<Utc> + Send + Sync>;

/// What every reconcile shares.
pub struct Context {
    client: Client,
    pods: Store<Pod>,
    events: EventSink,
    clock: Clock,
    metrics: Arc<Metrics>,
    policy: RunPolicy,
    /// What is remembered of each At: last write, failures, wakeup, quarantine.
    ledger: Ledger,
    /// Pod creates and status writes in flight, which lower-priority writes wait for.
    pods_first: PodsFirst,
    /// Status writes queued behind pod creates.
    followups: followup::Queue<followup::Followup>,
    /// Events queued behind pod creates and status writes.
    queued_events: followup::Lanes<followup::QueuedEvent>,
    /// Ats to reconcile outside the runtime's own requeues (wakeups, failed follow-up writes,
    /// an API server that answers again).
    retriggers: followup::Queue<AtKey>,
    /// Ats whose last attempt got no answer from the API server: retried when it answers.
    unreachable: Reachability<AtKey>,
    /// Cancelled when a reconcile panicked: the loop ends, and with it this leadership.
    fatal: CancellationToken,
}

impl Context {
    pub fn new(
        client: Client,
        pods: Store<Pod>,
        events: EventSink,
        clock: Clock,
        metrics: Arc<Metrics>,
        policy: RunPolicy,
        quarantine: Arc<Quarantine>,
    ) -> Self {
        Context {
            client,
            pods,
            events,
            clock,
            metrics,
            policy,
            ledger: Ledger::new(quarantine),
            pods_first: PodsFirst::default(),
            followups: followup::Queue::default(),
            queued_events: followup::Lanes::default(),
            retriggers: followup::Queue::default(),
            unreachable: Reachability::default(),
            fatal: CancellationToken::new(),
        }
    }

    /// When settled Ats are looked at again (`Wakeups::run` hands them to `wake_up`).
    pub fn wakeups(&self) -> &Arc<Wakeups> {
        self.ledger.wakeups()
    }

    /// Cancelled once a reconcile panicked: the loop must end.
    pub fn fatal(&self) -> &CancellationToken {
        &self.fatal
    }

    /// Drops everything kept for a deleted At: its backoff, its last write, its wakeup.
    pub fn forget(&self, at: &AtKey) {
        self.ledger.forget(at);
    }

    /// Drops what is kept for Ats `known` does not hold any more (deletions a relist or a lagging
    /// feed did not report one by one).
    pub fn forget_all_but(&self, known: impl Fn(&AtKey) -> bool) {
        self.ledger.retain(known);
    }

    /// The pods in the pod cache that wait for cnat's finalizer while `owner_gone` says their
    /// At is gone.
    pub fn held_pods(&self, owner_gone: impl Fn(&Pod) -> bool) -> Vec<ObjectRef<Pod>> {
        self.pods
            .state()
            .iter()
            .filter(|found| pod::awaits_release(found) && owner_gone(found))
            .map(|found| ObjectRef::from_obj(found.as_ref()))
            .collect()
    }

    /// Tells, in a Warning event on the At, that cnat cannot read it (`why`), so it does nothing
    /// with it until it is fixed.
    pub fn report_unreadable(
        self: &Arc<Self>,
        at: &AtKey,
        regarding: k8s_openapi::api::core::v1::ObjectReference,
        why: &str,
    ) {
        warn!(at = %at, "an At that does not decode as an At is left alone until it changes");
        let event = Event {
            type_: EventType::Warning,
            reason: "Unreadable".into(),
            note: Some(format!(
                "cnat cannot read this At ({why}), so it does nothing with it; fix the field named (kubectl edit) and it runs"
            )),
            action: "Reconcile".into(),
            secondary: None,
        };
        self.tell_later(at, regarding, event);
    }

    /// Entries kept per At now: backoffs, last writes, wakeups (for tests of forgetting).
    pub fn kept(&self) -> (usize, usize, usize) {
        self.ledger.kept()
    }

    /// A panic while handling `at` at `place`: logged once with the At and the panic, counted,
    /// this version quarantined, and the loop ended (the leader releases the Lease).
    pub fn panicked(&self, at: &At, place: &'static str, panic: &Panicked) {
        self.metrics.panicked(place);
        let at_key = key(at);
        tracing::error!(at = %at_key, place, %panic, "panic while handling this At; it is skipped until it changes, and leadership ends so the reconcile loop starts afresh. Please report this as a bug");
        self.ledger
            .quarantine()
            .add(at_key, at.resource_version().unwrap_or_default());
        self.fatal.cancel();
    }

    /// Whether this version of `at` is quarantined after a panic.
    pub fn quarantined(&self, at: &At) -> bool {
        self.ledger
            .quarantined(&key(at), at.resource_version().as_deref())
    }

    /// Runs until dropped: while Ats wait for an unreachable API server, asks it every
    /// `reachability::PROBE_EVERY`; its first answer reconciles them all again at once.
    pub async fn probe_reachability(self: Arc<Self>) {
        let ask = || reachability::answers(&self.client);
        self.unreachable
            .probe(reachability::PROBE_EVERY, ask, |at| self.wake_up(at))
            .await;
    }

    /// After a failure of `at`: an unanswered request waits for the API server; any other
    /// failure is retried after backoff by the runtime (as here) or `retrigger_after`.
    fn wait_if_unanswered(&self, at: &At, error: &kube::Error) -> bool {
        let unanswered = reachability::unanswered(error);
        if unanswered {
            self.unreachable.wait(key(at));
        }
        unanswered
    }

    /// Ats to reconcile again, for `Controller::reconcile_on`; `None` if already taken.
    pub fn retriggers(&self) -> Option<impl futures::Stream<Item = AtKey> + use<>> {
        self.retriggers.take()
    }

    /// Counts one more failure of `at` and returns how many failures in a row that makes and
    /// the backoff before its next attempt.
    fn next_retry(&self, at: &At) -> (u32, Duration) {
        let attempt = self.ledger.failed(&key(at));
        (attempt, retry_delay(attempt))
    }

    /// The time now, by the injected clock.
    pub fn now(&self) -> DateTime<Utc> {
        (self.clock)()
    }

    /// Reconciles `at` now (for `wakeups::Wakeups::run`).
    pub fn wake_up(&self, at: AtKey) {
        // Fails only once the loop has ended, when nothing is left to wake.
        let _ = self.retriggers.sender.send(at);
    }

    /// Whether a watched version of `at` needs a reconcile now; if not, `wakeups` holds when it
    /// does (see `wakeups`).
    pub fn needs_reconcile(&self, at: &At) -> bool {
        if self.is_stale(at).is_some() || self.quarantined(at) {
            return false;
        }
        let wakeups = self.ledger.wakeups();
        // By name only: the index holds one small key per waiting At.
        let at_ref = key(at);
        // Its pod waits for cnat's finalizer to go: only a reconcile, which sees the pod,
        // decides that (a terminating pod changes no more, so nothing else would bring it).
        if self.held_pod_of(&at_ref).is_some() {
            self.ledger.wakeups().clear(&at_ref);
            return true;
        }
        match wakeups::wake(at, (self.clock)(), &self.policy) {
            Wake::Now => {
                wakeups.clear(&at_ref);
                true
            }
            Wake::After(left) => {
                wakeups.set(at_ref, tokio::time::Instant::now() + left);
                false
            }
            Wake::OnChange => {
                wakeups.clear(&at_ref);
                false
            }
        }
    }

    /// Reconciles `at` again after `delay`, or earlier if its wakeup already says so (no task
    /// of its own).
    fn retrigger_after(&self, at: AtKey, delay: Duration) {
        self.ledger
            .wakeups()
            .set_earlier(at, tokio::time::Instant::now() + delay);
    }
}

/// Brings one At one step closer to DONE.
pub async fn reconcile(at: Arc<At>, ctx: Arc<Context>) -> Result<Action, Error> {
    let span = info_span!(
        "reconcile",
        "at.namespace" = %namespace(&at),
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
    ctx.metrics.reconciled(result.is_ok(), started.elapsed());
    if let Err(error) = &result {
        span.record("error", display(error));
        span.record("otel.status_code", "ERROR");
    }
    result
}

async fn step(at: &Arc<At>, ctx: &Arc<Context>) -> Result<Action, Error> {
    // A version whose status write we queued or made: acting on it again would redo that step.
    // Only an At that fell due while its PENDING write waits behind other writes goes ahead
    // with its pod (whose fixed name makes the create idempotent).
    let stale = ctx.is_stale(at);
    let now = (ctx.clock)();
    let mut observation = ctx.cached_pod(at);
    let mut taken = Vec::new();
    for _ in 0..MAX_STEPS {
        let decision = decide(at, &observation, now, &ctx.policy);
        let pending_write = stale == Some(Phase::Pending) && decision.action == Step::CreatePod;
        if stale.is_some() && !pending_write {
            taken.push("skip-stale");
            Span::current().record("action", taken.join(",").as_str());
            return Ok(Action::await_change());
        }
        taken.push(action_name(decision.action));
        Span::current().record("action", taken.join(",").as_str());
        observation = match decision.action {
            // Status writes and events follow at lower priority, behind the pod creates in
            // flight; a refused pod's status is written here, before the error backs off.
            Step::Nothing if decision.retry => return ctx.commit(at, decision, now).await,
            Step::Nothing => return Ok(ctx.defer(at, decision, now)),
            Step::LookUpPod => ctx.fetch_pod(at).await?,
            Step::DeleteAt => return ctx.delete_at(at).await,
            Step::ReleasePod => ctx.release_pod(at).await?,
            Step::CreatePod => match ctx.create_pod(at).await? {
                None => return Ok(ctx.defer(at, decision, now)),
                Some(found) => found,
            },
        };
    }
    Err(Error::PodChurn {
        at: key(at),
        pod: pod::name_for(&at.name_any()),
    })
}

/// Retries a failed reconcile after an exponentially growing, jittered delay.
pub fn error_policy(at: Arc<At>, error: &Error, ctx: Arc<Context>) -> Action {
    let (attempt, delay) = ctx.next_retry(&at);
    // With no answer from the API server, its next answer also brings a retry.
    let unanswered = error
        .api_error()
        .is_some_and(|e| ctx.wait_if_unanswered(&at, e));
    if error.api_error().is_some_and(|e| glitch::quiet(e, attempt)) {
        debug!(at = %key(&at), %error, retry_in = ?delay, unanswered, attempt, "reconcile failed on the API server's own error; retrying");
    } else {
        warn!(at = %key(&at), %error, retry_in = ?delay, unanswered, "reconcile failed");
    }
    Action::requeue(delay)
}

/// Delay before retry number `attempt` (1-based): 0.5 s doubling to 5 minutes, with jitter.
pub fn retry_delay(attempt: u32) -> Duration {
    ExponentialBuilder::new()
        .with_min_delay(Duration::from_millis(500))
        .with_max_delay(Duration::from_secs(300))
        .with_jitter()
        .without_max_times()
        .build()
        .nth(attempt.saturating_sub(1) as usize)
        .unwrap_or(Duration::from_secs(300))
}

impl Context {
    fn at_api(&self, at: &At) -> Api<At> {
        Api::namespaced(self.client.clone(), &namespace(at))
    }

    fn pod_api(&self, at: &At) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &namespace(at))
    }

    /// The phase we wrote (or queued) over this version of `at`, if we did: the cache has not
    /// caught up with our write.
    fn is_stale(&self, at: &At) -> Option<Phase> {
        self.ledger
            .stale(&key(at), at.resource_version().as_deref())
    }

    fn cached_pod(&self, at: &At) -> PodObservation {
        let name = pod::name_for(&at.name_any());
        match self.pods.get(&ObjectRef::new(&name).within(&namespace(at))) {
            Some(found) => observe(&found, at),
            None => PodObservation::NotCached,
        }
    }

    async fn fetch_pod(&self, at: &At) -> Result<PodObservation, Error> {
        let name = pod::name_for(&at.name_any());
        match self.pod_api(at).get_opt(&name).await {
            Ok(Some(found)) => Ok(observe(&found, at)),
            Ok(None) => Ok(PodObservation::Missing),
            Err(source) => Err(Error::ReadPod {
                at: key(at),
                pod: name,
                source,
            }),
        }
    }

    /// The pod of `at` if the pod cache shows it waiting for cnat's finalizer to go.
    pub fn held_pod_of(&self, at: &AtKey) -> Option<ObjectRef<Pod>> {
        let name = pod::name_for(at.name());
        let key = ObjectRef::new(&name).within(at.namespace());
        self.pods
            .get(&key)
            .filter(|found| pod::awaits_release(found))
            .map(|_| key)
    }

    /// Removes cnat's finalizer from a pod whose At is gone: nothing is left to record. The
    /// caches may lag, so the API server is asked first: a pod whose At still exists is left to
    /// that At's reconcile.
    pub async fn release_orphan(&self, found: &ObjectRef<Pod>) {
        let namespace = found.namespace.as_deref().unwrap_or_default();
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let ats: Api<At> = Api::namespaced(self.client.clone(), namespace);
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        // Retried a few times with backoff (a terminating pod changes no more, so no event would
        // bring it back); past that, the next relist or the next leader finds it again.
        for attempt in 1..=ORPHAN_ATTEMPTS {
            match self.try_release_orphan(found, &pods, &ats, &params).await {
                Ok(true) => return debug!(pod = %found, "released the pod of a deleted At"),
                Ok(false) => return,
                Err(error) if attempt == ORPHAN_ATTEMPTS => {
                    return warn!(pod = %found, %error, attempts = attempt, "could not remove cnat's finalizer from the pod of a deleted At; the next relist or leader tries again")
                }
                Err(error) => {
                    debug!(pod = %found, %error, attempt, "removing cnat's finalizer failed; retrying");
                    tokio::time::sleep(retry_delay(attempt)).await;
                }
            }
        }
    }

    async fn try_release_orphan(
        &self,
        found: &ObjectRef<Pod>,
        pods: &Api<Pod>,
        ats: &Api<At>,
        params: &PatchParams,
    ) -> Result<bool, kube::Error> {
        let Some(current) = pods.get_opt(&found.name).await? else {
            return Ok(false);
        };
        if !pod::awaits_release(&current) {
            return Ok(false);
        }
        let owner = current
            .owner_references()
            .iter()
            .find(|o| o.controller == Some(true))
            .cloned();
        if let Some(owner) = owner {
            let at = ats.get_opt(&owner.name).await?;
            if at.is_some_and(|at| at.uid().as_deref() == Some(owner.uid.as_str())) {
                return Ok(false);
            }
        }
        let patch = Patch::Merge(pod::release_patch(&current));
        pods.patch(&found.name, params, &patch).await.map(|_| true)
    }

    /// Removes cnat's finalizer from the At's pod (read fresh, so the patch carries its current
    /// resourceVersion and other finalizers), then says what is left of the pod.
    async fn release_pod(&self, at: &At) -> Result<PodObservation, Error> {
        let name = pod::name_for(&at.name_any());
        let fail = |source| Error::ReleasePod {
            at: key(at),
            pod: name.clone(),
            source,
        };
        let api = self.pod_api(at);
        let Some(found) = api.get_opt(&name).await.map_err(fail)? else {
            return Ok(PodObservation::Missing);
        };
        // Only our own pod, and only while it waits for us.
        if !pod::awaits_release(&found) || !pod::is_controlled_by(&found, &uid(at)) {
            return Ok(observe(&found, at));
        }
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        match api
            .patch(&name, &params, &Patch::Merge(pod::release_patch(&found)))
            .await
        {
            Ok(released) => Ok(observe(&released, at)),
            // Gone meanwhile (its last finalizer went), or changed: look again.
            Err(kube::Error::Api(s)) if s.is_not_found() => Ok(PodObservation::Missing),
            Err(kube::Error::Api(s)) if s.is_conflict() => self.fetch_pod(at).await,
            Err(source) => Err(fail(source)),
        }
    }

    /// Creates the pod; `None` when created, else what was found instead.
    async fn create_pod(&self, at: &At) -> Result<Option<PodObservation>, Error> {
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PostParams::default()
        };
        let creating = self.pods_first.creating.enter();
        let created = self
            .pod_api(at)
            .create(&params, &pod::build(at, &self.policy))
            .await;
        drop(creating);
        match created {
            Ok(_) => {
                self.record_lateness(at);
                Ok(None)
            }
            Err(kube::Error::Api(status)) if status.is_already_exists() => {
                self.fetch_pod(at).await.map(Some)
            }
            Err(kube::Error::Api(status)) if status.is_invalid() || status.code == 400 => {
                self.metrics.pod_refused("invalid");
                Ok(Some(PodObservation::Rejected(status.message)))
            }
            // Quota, Pod Security or a policy webhook: may pass later, so retried with backoff.
            Err(kube::Error::Api(status)) if status.is_forbidden() => {
                self.metrics
                    .pod_refused(decide::Refusal::of(&status.message).label());
                Ok(Some(PodObservation::Refused(status.message)))
            }
            Err(source) => Err(Error::CreatePod {
                at: key(at),
                pod: pod::name_for(&at.name_any()),
                source,
            }),
        }
    }

    /// The run lateness: the pod exists now, its schedule said when it should have.
    fn record_lateness(&self, at: &At) {
        if let Ok(due) = schedule::parse(&at.spec.schedule, at.spec.time_zone.as_deref()) {
            let late = ((self.clock)() - due).to_std().unwrap_or_default();
            self.metrics.ran_late(late);
        }
    }

    /// Writes the decided status, then tells the story in an event and a log line. A requeue is
    /// shortened by the time spent since `decided_at`, so a due time is not missed by that much.
    async fn commit(
        self: &Arc<Self>,
        at: &At,
        decision: Decision,
        decided_at: DateTime<Utc>,
    ) -> Result<Action, Error> {
        if let Some(status) = &decision.status {
            match self.write_status(at, status).await {
                Ok(()) => self.remember_write(at, status.phase),
                // Someone wrote first: the watch brings the newer At, and we decide on that.
                Err(kube::Error::Api(s)) if s.is_conflict() => {
                    debug!(at = %key(at), "status changed meanwhile; waiting for the newer version");
                    return Ok(Action::await_change());
                }
                Err(kube::Error::Api(s)) if s.is_not_found() => {
                    self.forget(&key(at));
                    return Ok(Action::await_change());
                }
                Err(kube::Error::Api(s)) if followup::refuses_any_status(at, &s) => {
                    self.remember_write(at, status.phase);
                    self.refused_status(at, &decision, &s);
                    return Ok(Action::await_change());
                }
                Err(source) => {
                    return Err(Error::WriteStatus {
                        at: key(at),
                        phase: status.phase,
                        source,
                    });
                }
            }
            if let Some(note) = &decision.note {
                self.tell(at, status, note).await;
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
        Ok(self.succeeded(at, &decision, decided_at))
    }

    /// Queues the decided status write and event behind the pod creates in flight (see
    /// `followup`); until it is written, reconciles of the version decided on are skipped.
    fn defer(
        self: &Arc<Self>,
        at: &Arc<At>,
        decision: Decision,
        decided_at: DateTime<Utc>,
    ) -> Action {
        // With a write queued, the failures in a row are counted on until it is written
        // (`followup`), so that a write failing again and again backs off and is reported.
        let Some(status) = &decision.status else {
            return self.succeeded(at, &decision, decided_at);
        };
        let action = self.settled(at, &decision, decided_at);
        self.remember_write(at, status.phase);
        self.follow_up(at, decision);
        action
    }

    /// Resets the backoff and sets when to look again, shortened by the time spent since
    /// `decided_at`, in the wake-up index: not as a requeue of the runtime, whose queue would
    /// hold an entry per waiting At (about 400 bytes each, its tables never shrinking) beside
    /// the index's (README "Where the old leader's extra memory was").
    fn succeeded(&self, at: &At, decision: &Decision, decided_at: DateTime<Utc>) -> Action {
        self.ledger.succeeded(&key(at));
        self.settled(at, decision, decided_at)
    }

    /// `succeeded` without resetting the backoff: records the phase decided on and sets when
    /// to look again.
    fn settled(&self, at: &At, decision: &Decision, decided_at: DateTime<Utc>) -> Action {
        let span = Span::current();
        let after = decision.status.as_ref().map_or(at.phase(), |s| s.phase);
        span.record("phase.after", after.as_str());
        let spent = ((self.clock)() - decided_at).to_std().unwrap_or_default();
        if let Some(left) = decision.requeue {
            let left = left.saturating_sub(spent).min(MAX_REQUEUE);
            span.record("requeue.seconds", left.as_secs_f64());
            self.retrigger_after(key(at), left);
        }
        Action::await_change()
    }

    /// Status subresource only, guarded by the resourceVersion we decided on: never a blind write.
    async fn write_status(&self, at: &At, status: &AtStatus) -> Result<(), kube::Error> {
        let patch = json!({
            "metadata": { "resourceVersion": at.resource_version() },
            "status": status,
        });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        self.at_api(at)
            .patch_status(&at.name_any(), &params, &Patch::Merge(&patch))
            .await
            .map(drop)
    }

    /// Deletes a finished At whose `ttlSecondsAfterFinished` passed; its pod goes with it
    /// (owner reference). The uid precondition spares a new At that took the same name.
    async fn delete_at(&self, at: &At) -> Result<Action, Error> {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: at.uid(),
                resource_version: None,
            }),
            ..DeleteParams::background()
        };
        match self.at_api(at).delete(&at.name_any(), &params).await {
            Ok(_) => {
                info!(at = %key(at), "deleted: ttlSecondsAfterFinished passed");
                Ok(Action::await_change())
            }
            Err(kube::Error::Api(s)) if s.is_not_found() || s.is_conflict() => {
                Ok(Action::await_change())
            }
            Err(source) => Err(Error::Delete {
                at: key(at),
                source,
            }),
        }
    }

    fn forget_write(&self, at: &At) {
        self.ledger.unwritten(&key(at));
    }

    fn remember_write(&self, at: &At, phase: Phase) {
        if let Some(rv) = at.resource_version() {
            self.ledger.written(key(at), rv, phase);
        }
    }

    /// Logs the transition `note` tells and returns its event.
    fn log_transition(&self, at: &At, status: &AtStatus, note: &Note) -> Event {
        let from = at.status.as_ref().map(|s| s.phase.as_str());
        let (at_key, to, reason) = (key(at), status.phase.as_str(), note.reason);
        // The log gathers every tenant's Ats: it gets the summary, never the command's output,
        // which stays on the At (status and event) for whoever may read it.
        let logged = &note.summary;
        match note.severity {
            Severity::Normal => info!(at = %at_key, from, to, reason, "{logged}"),
            Severity::Warning => warn!(at = %at_key, from, to, reason, "{logged}"),
        }
        Event {
            type_: match note.severity {
                Severity::Normal => EventType::Normal,
                Severity::Warning => EventType::Warning,
            },
            reason: note.reason.into(),
            note: Some(note.message.clone()),
            action: "Reconcile".into(),
            secondary: None,
        }
    }

    async fn tell(&self, at: &At, status: &AtStatus, note: &Note) {
        let event = self.log_transition(at, status, note);
        if !self.events.try_send(event, at.object_ref(&())) {
            self.metrics.event_dropped();
        }
    }
}

fn observe(found: &Pod, at: &At) -> PodObservation {
    if pod::is_controlled_by(found, &uid(at)) {
        PodObservation::Owned(pod::view(found))
    } else {
        PodObservation::Foreign
    }
}

fn action_name(action: Step) -> &'static str {
    match action {
        Step::Nothing => "none",
        Step::LookUpPod => "look-up-pod",
        Step::CreatePod => "create-pod",
        Step::DeleteAt => "delete-at",
        Step::ReleasePod => "release-pod",
    }
}

fn namespace(at: &At) -> String {
    at.namespace().unwrap_or_default()
}

fn uid(at: &At) -> String {
    at.uid().unwrap_or_default()
}

/// `namespace/name`, how logs and errors name an At, and what per-At maps are keyed by.
fn key(at: &At) -> AtKey {
    AtKey::from(at)
}

#[cfg(test)]
mod tests;

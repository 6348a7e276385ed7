//! Reconciling Ats: `decide` is the pure state machine; this module carries its decisions out
//! against the API server (pod creation, status writes, events) and retries failures with backoff.
//! Each reconcile is a `reconcile` span and is counted in the metrics.

pub mod decide;
pub mod followup;
pub mod wakeups;

use crate::api::{At, AtStatus, Phase};
use crate::observability::metrics::Metrics;
use crate::operator::events::EventSink;
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
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thiserror::Error;
use tracing::field::{display, Empty};
use tracing::{debug, info, info_span, warn, Instrument, Span};
use wakeups::{Wake, Wakeups};

/// Field manager recorded on everything cnat writes.
pub const FIELD_MANAGER: &str = "cnat";

/// A reconcile never needs more than: look up or create the pod, look it up again, decide.
const MAX_STEPS: usize = 3;

/// A failed reconcile; it is retried with backoff. Each names the At and what was being done.
#[derive(Debug, Error)]
pub enum Error {
    #[error("At {at}: creating pod {pod}: {source}")]
    CreatePod {
        at: String,
        pod: String,
        source: kube::Error,
    },
    #[error("At {at}: reading pod {pod}: {source}")]
    ReadPod {
        at: String,
        pod: String,
        source: kube::Error,
    },
    #[error("At {at}: writing status {phase}: {source}")]
    WriteStatus {
        at: String,
        phase: Phase,
        source: kube::Error,
    },
    #[error("At {at}: pod {pod} kept appearing and disappearing while being created")]
    PodChurn { at: String, pod: String },
    #[error("At {at}: the API server refused pod {pod} (retried with backoff): {reason}")]
    PodRefused {
        at: String,
        pod: String,
        reason: String,
    },
    #[error("At {at}: deleting it after ttlSecondsAfterFinished: {source}")]
    Delete { at: String, source: kube::Error },
}

impl Error {
    /// The API error behind this failure, if there is one.
    pub fn api_error(&self) -> Option<&kube::Error> {
        match self {
            Error::CreatePod { source, .. }
            | Error::ReadPod { source, .. }
            | Error::WriteStatus { source, .. }
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
    /// Per At uid, the resourceVersion our last status write replaced: a cache still showing it
    /// is stale, and deciding on it would redo the step just taken.
    superseded: Mutex<HashMap<String, (String, Phase)>>,
    /// Per At uid, consecutive failed reconciles, for exponential backoff.
    failures: Mutex<HashMap<String, u32>>,
    /// Pod creates and status writes in flight, which lower-priority writes wait for.
    pods_first: PodsFirst,
    /// Status writes queued behind pod creates.
    followups: followup::Queue<followup::Followup>,
    /// Events queued behind pod creates and status writes.
    tellings: followup::Queue<followup::Telling>,
    /// Ats to reconcile outside the runtime's own requeues (wakeups, failed follow-up writes,
    /// an API server that answers again).
    retriggers: followup::Queue<ObjectRef<At>>,
    /// Ats whose last attempt got no answer from the API server: retried when it answers.
    unreachable: Reachability<ObjectRef<At>>,
}

impl Context {
    pub fn new(
        client: Client,
        pods: Store<Pod>,
        events: EventSink,
        clock: Clock,
        metrics: Arc<Metrics>,
        policy: RunPolicy,
    ) -> Self {
        Context {
            client,
            pods,
            events,
            clock,
            metrics,
            policy,
            superseded: Mutex::default(),
            failures: Mutex::default(),
            pods_first: PodsFirst::default(),
            followups: followup::Queue::default(),
            tellings: followup::Queue::default(),
            retriggers: followup::Queue::default(),
            unreachable: Reachability::default(),
        }
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
            self.unreachable.wait(ObjectRef::from_obj(at));
        }
        unanswered
    }

    /// Ats to reconcile again, for `Controller::reconcile_on`; `None` if already taken.
    pub fn retriggers(&self) -> Option<impl futures::Stream<Item = ObjectRef<At>> + use<>> {
        self.retriggers.take()
    }

    /// Counts one more failure of `at` and returns the backoff before its next attempt.
    fn next_retry(&self, at: &At) -> Duration {
        let attempt = {
            let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
            let count = failures.entry(uid(at)).or_insert(0);
            *count += 1;
            *count
        };
        retry_delay(attempt)
    }

    /// The time now, by the injected clock.
    pub fn now(&self) -> DateTime<Utc> {
        (self.clock)()
    }

    /// Reconciles `at` now (for `wakeups::Wakeups::run`).
    pub fn wake_up(&self, at: ObjectRef<At>) {
        // Fails only once the loop has ended, when nothing is left to wake.
        let _ = self.retriggers.sender.send(at);
    }

    /// Whether a watched version of `at` needs a reconcile now; if not, `wakeups` holds when it
    /// does (see `wakeups`).
    pub fn needs_reconcile(&self, at: &At, wakeups: &Wakeups) -> bool {
        if self.is_stale(at).is_some() {
            return false;
        }
        // By name only: the index holds one small key per waiting At.
        let at_ref = ObjectRef::new(&at.name_any()).within(&namespace(at));
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

    /// Reconciles `at` again after `delay` (nothing happens if the loop ended meanwhile).
    fn retrigger_after(&self, at: ObjectRef<At>, delay: Duration) {
        let retriggers = self.retriggers.sender.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = retriggers.send(at);
        });
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
    let delay = ctx.next_retry(&at);
    // With no answer from the API server, its next answer also brings a retry.
    let unanswered = error
        .api_error()
        .is_some_and(|e| ctx.wait_if_unanswered(&at, e));
    warn!(at = %key(&at), %error, retry_in = ?delay, unanswered, "reconcile failed");
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
        let mut superseded = self.superseded.lock().unwrap_or_else(|e| e.into_inner());
        let uid = uid(at);
        let written = superseded
            .get(&uid)
            .filter(|(rv, _)| Some(rv) == at.resource_version().as_ref())
            .map(|(_, phase)| *phase);
        if written.is_none() {
            superseded.remove(&uid);
        }
        written
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
        &self,
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
        let action = self.succeeded(at, &decision, decided_at);
        if let Some(status) = &decision.status {
            self.remember_write(at, status.phase);
            self.follow_up(at.clone(), decision);
        }
        action
    }

    /// Resets the backoff and returns when to look again, shortened by the time spent since
    /// `decided_at`.
    fn succeeded(&self, at: &At, decision: &Decision, decided_at: DateTime<Utc>) -> Action {
        self.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&uid(at));
        let span = Span::current();
        let after = decision.status.as_ref().map_or(at.phase(), |s| s.phase);
        span.record("phase.after", after.as_str());
        let spent = ((self.clock)() - decided_at).to_std().unwrap_or_default();
        decision.requeue.map_or_else(Action::await_change, |left| {
            let left = left.saturating_sub(spent);
            span.record("requeue.seconds", left.as_secs_f64());
            Action::requeue(left)
        })
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
        self.superseded
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&uid(at));
    }

    fn remember_write(&self, at: &At, phase: Phase) {
        if let Some(rv) = at.resource_version() {
            self.superseded
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(uid(at), (rv, phase));
        }
    }

    /// Logs the transition `note` tells and returns its event.
    fn log_transition(&self, at: &At, status: &AtStatus, note: &Note) -> Event {
        let from = at.status.as_ref().map(|s| s.phase.as_str());
        let (at_key, to, reason) = (key(at), status.phase.as_str(), note.reason);
        match note.severity {
            Severity::Normal => info!(at = %at_key, from, to, reason, "{}", note.message),
            Severity::Warning => warn!(at = %at_key, from, to, reason, "{}", note.message),
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
        self.events.send(event, at.object_ref(&())).await;
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
    }
}

fn namespace(at: &At) -> String {
    at.namespace().unwrap_or_default()
}

fn uid(at: &At) -> String {
    at.uid().unwrap_or_default()
}

/// `namespace/name`, how logs and errors name an At.
fn key(at: &At) -> String {
    format!("{}/{}", namespace(at), at.name_any())
}

#[cfg(test)]
mod tests;

//! The one writer of Ats' statuses, at once (`write_now`) or queued behind the pod creates in
//! flight (`queue`), and of the events that tell their transitions, after their writes.
//! See docs/src/design/decisions.md, "Pods first" and "Events after the writes".

use super::decide::{Decision, Note, Severity};
use super::error::Error;
use super::ledger::Ledger;
use super::queue::Queue;
use super::scheduler::Scheduler;
use crate::api::{At, AtStatus, Phase};
use crate::observability::metrics::{Metrics, WriteResult};
use crate::operator::events::EventSink;
use crate::operator::key::AtKey;
use crate::operator::priority::{InFlightGuard, Priority};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::Patch;
use kube::runtime::events::{Event, EventType};
use kube::{Api, Client, Resource};
use serde_json::json;
use std::sync::Arc;
use tracing::field::{display, Empty};
use tracing::{debug, info, info_span, warn, Instrument, Span};

/// Queued status writes made at once: as many as reconciles (pod creates) run at once by
/// default (`--concurrency`).
pub const WRITERS: usize = 32;

/// Owns status writes, the queue of writes behind pod creates, and transition events.
pub struct Writer {
    client: Client,
    events: EventSink,
    metrics: Arc<Metrics>,
    /// What is remembered of each At: last write, quarantine.
    ledger: Arc<Ledger>,
    /// When an At whose queued write failed is looked at again.
    scheduler: Arc<Scheduler>,
    /// Pod creates and status writes in flight, which lower-priority writes wait for.
    priority: Priority,
    /// Status writes queued behind pod creates.
    queued: Queue<QueuedWrite>,
}

/// What a status write keeps of its At (thousands of queued writes may wait: not whole Ats).
pub struct Target {
    key: AtKey,
    uid: Option<String>,
    /// The version decided on: the write is guarded by it, never blind.
    resource_version: Option<String>,
    /// The phase before (for the log line).
    from: Option<Phase>,
    /// Its spec is outside the CRD's bounds (see `Written::Refused`).
    out_of_range: bool,
}

impl Target {
    pub fn of(at: &At) -> Self {
        Target {
            key: AtKey::from(at),
            uid: at.metadata.uid.clone(),
            resource_version: at.metadata.resource_version.clone(),
            from: at.status.as_ref().map(|s| s.phase),
            out_of_range: !crate::limits::problems(&at.spec, |_| true).is_empty(),
        }
    }

    /// The At, as an event names what it is about.
    fn regarding(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some(At::api_version(&()).into_owned()),
            kind: Some(At::kind(&()).into_owned()),
            name: Some(self.key.name().into()),
            namespace: Some(self.key.namespace().into()),
            uid: self.uid.clone(),
            resource_version: self.resource_version.clone(),
            field_path: None,
        }
    }
}

/// How the API server answered a status write.
enum Written {
    Done,
    /// Someone wrote first: the watch brings the newer At, and the next decision is on that.
    Conflict,
    /// The At is gone: nothing to retry, nothing to keep for it.
    Gone,
    /// The API server refuses any status on this version (told in an event instead).
    Refused,
    Failed(kube::Error),
}

/// A status write (and its event) that waits for the pods of its wave; of the reconcile that
/// queued it, it keeps only the trace ids (an open span would cost more).
struct QueuedWrite {
    writer: Arc<Writer>,
    target: Target,
    decision: Decision,
    /// The reconcile's span, as trace ids: the `status-write` span is its child.
    parent: opentelemetry::trace::SpanContext,
    /// Counts this write as queued until it is done.
    _writing: InFlightGuard,
}

impl Writer {
    pub fn new(
        client: Client,
        events: EventSink,
        metrics: Arc<Metrics>,
        ledger: Arc<Ledger>,
        scheduler: Arc<Scheduler>,
    ) -> Self {
        Writer {
            client,
            events,
            metrics,
            ledger,
            scheduler,
            priority: Priority::default(),
            queued: Queue::default(),
        }
    }

    /// Pod creates and status writes in flight.
    pub fn priority(&self) -> &Priority {
        &self.priority
    }

    /// Writes the decided status now, then tells the transition: `Ok(true)` once written,
    /// `Ok(false)` when the write is moot (a newer version, a gone At, a refused status).
    pub async fn write_now(
        &self,
        target: &Target,
        decision: &Decision,
    ) -> Result<bool, kube::Error> {
        let Some(status) = &decision.status else {
            return Ok(true);
        };
        match self.write(target, status, decision).await {
            Written::Done => {
                self.remember(target, status.phase);
                self.tell_transition(target, status, decision.note.as_ref(), None);
                Ok(true)
            }
            Written::Refused => {
                self.remember(target, status.phase);
                Ok(false)
            }
            Written::Conflict | Written::Gone => Ok(false),
            Written::Failed(error) => Err(error),
        }
    }

    /// Queues the decided status write and event behind the pod creates in flight; until it is
    /// written, the version decided on counts as stale (`Ledger::stale`).
    pub fn queue(self: &Arc<Self>, target: Target, decision: Decision) {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let Some(status) = &decision.status else {
            return;
        };
        self.remember(&target, status.phase);
        let job = QueuedWrite {
            writer: self.clone(),
            target,
            decision,
            parent: Span::current().context().span().span_context().clone(),
            _writing: self.priority.writing.enter(),
        };
        if !self.queued.send(job) {
            // Only after the writer stopped, i.e. the loop is ending: the next leader writes it.
            debug!("status writer stopped; status write left to the next reconcile");
        }
    }

    /// The queue's writers, each write once no pod create is in flight. Runs until every
    /// `Writer` handle is gone (or dropped with the loop); `None` if already taken.
    pub fn queued_writes(&self) -> Option<impl std::future::Future<Output = ()> + use<>> {
        let jobs = self.queued.take()?;
        Some(jobs.for_each_concurrent(WRITERS, |job| async move {
            use opentelemetry::trace::TraceContextExt;
            use tracing_opentelemetry::OpenTelemetrySpanExt;
            let span = info_span!(
                "status-write",
                at = %job.target.key,
                phase = job.decision.status.as_ref().map(|s| s.phase.as_str()),
                error = Empty,
                "otel.status_code" = Empty,
            );
            // Without a collector or a sampled trace, there is no parent to name.
            if job.parent.is_valid() {
                let parent =
                    opentelemetry::Context::new().with_remote_span_context(job.parent.clone());
                let _ = span.set_parent(parent);
            }
            job.writer.write_queued(&job).instrument(span).await;
        }))
    }

    async fn write_queued(&self, job: &QueuedWrite) {
        let (target, decision) = (&job.target, &job.decision);
        let Some(status) = &decision.status else {
            return;
        };
        self.priority.creating.idle().await;
        match self.write(target, status, decision).await {
            Written::Done => {
                self.scheduler.succeeded(&target.key);
                let behind = Some(&self.priority);
                self.tell_transition(target, status, decision.note.as_ref(), behind);
            }
            Written::Conflict | Written::Gone | Written::Refused => {}
            Written::Failed(source) => {
                let error = Error::WriteStatus {
                    at: target.key.clone(),
                    phase: status.phase,
                    source,
                };
                let span = Span::current();
                span.record("error", display(&error));
                span.record("otel.status_code", "ERROR");
                // The cache still shows the version decided on: the next reconcile acts on it,
                // after the usual backoff or, if the API server did not answer, once it answers.
                self.ledger.unwritten(&target.key);
                self.scheduler.failed_write(&target.key, &error);
            }
        }
    }

    /// The status subresource only, guarded by the resourceVersion decided on.
    async fn write(&self, target: &Target, status: &AtStatus, decision: &Decision) -> Written {
        let patch = status_patch(target.resource_version.as_deref(), status);
        let params = crate::operator::patch_params();
        let api: Api<At> = Api::namespaced(self.client.clone(), target.key.namespace());
        let written = match api
            .patch_status(target.key.name(), &params, &Patch::Merge(&patch))
            .await
        {
            Ok(written) => {
                if let (Phase::Pending, Some(version)) =
                    (status.phase, written.metadata.resource_version.as_deref())
                {
                    self.ledger.pending_written(&target.key, version);
                }
                Written::Done
            }
            Err(kube::Error::Api(s)) if s.is_conflict() => {
                debug!(at = %target.key, "status changed meanwhile; waiting for the newer version");
                Written::Conflict
            }
            Err(kube::Error::Api(s)) if s.is_not_found() => {
                self.ledger.forget(&target.key);
                self.scheduler.forget(&target.key);
                Written::Gone
            }
            // Any other 422 is retried like other errors, the API server's own CEL failures
            // among them (`apiserver_bugs`).
            Err(kube::Error::Api(s)) if s.is_invalid() && target.out_of_range => {
                self.refused_status(target, decision, &s);
                Written::Refused
            }
            Err(error) => Written::Failed(error),
        };
        let result = match &written {
            Written::Done => WriteResult::Written,
            Written::Conflict => WriteResult::Conflict,
            Written::Gone => WriteResult::Gone,
            Written::Refused => WriteResult::Refused,
            Written::Failed(_) => WriteResult::Failed,
        };
        self.metrics.status_written(status.phase, result);
        written
    }

    /// Our status write of `phase` replaces the version of `target` decided on.
    fn remember(&self, target: &Target, phase: Phase) {
        if let Some(rv) = &target.resource_version {
            self.ledger.replaced(&target.key, rv);
            self.ledger.written(target.key.clone(), rv.clone(), phase);
        }
    }

    /// Logs the transition `note` tells and queues its event (`behind` the writes in flight,
    /// or at once).
    fn tell_transition(
        &self,
        target: &Target,
        status: &AtStatus,
        note: Option<&Note>,
        behind: Option<&Priority>,
    ) {
        let Some(note) = note else {
            return;
        };
        let from = target.from.map(|phase| phase.as_str());
        let (at, to, reason) = (&target.key, status.phase.as_str(), note.reason);
        // The log gathers every tenant's Ats: it gets the summary, never the command's output,
        // which stays on the At (status and event) for whoever may read it.
        let logged = &note.summary;
        match note.severity {
            Severity::Normal => info!(at = %at, from, to, reason, "{logged}"),
            Severity::Warning => warn!(at = %at, from, to, reason, "{logged}"),
        }
        let type_ = match note.severity {
            Severity::Normal => EventType::Normal,
            Severity::Warning => EventType::Warning,
        };
        let event = reconcile_event(type_, reason, note.message.clone());
        self.tell(at, target.regarding(), event, behind);
    }

    /// Queues `event` about `at` in its lane of the event queue; a full lane drops it (counted).
    fn tell(
        &self,
        at: &AtKey,
        regarding: ObjectReference,
        event: Event,
        behind: Option<&Priority>,
    ) {
        if !self.events.try_send(at, event, regarding, behind) {
            self.metrics.event_dropped();
        }
    }

    /// An At whose spec breaks the CRD's schema can get no status at all (422): the decided
    /// event tells it instead, with the server's words, and this version is left alone.
    fn refused_status(&self, target: &Target, decision: &Decision, refusal: &kube::core::Status) {
        let told = decision.note.as_ref().map_or_else(
            || {
                format!(
                    "the API server refuses any status for this At: {}",
                    refusal.message
                )
            },
            |note| {
                format!(
                    "{}; the API server refuses any status for this At until its spec is fixed: {}",
                    note.message, refusal.message
                )
            },
        );
        warn!(at = %target.key, reason = decision.note.as_ref().map(|n| n.reason), "the API server refuses any status for this At (its spec breaks the CRD's schema); told in an event only");
        let reason = decision.note.as_ref().map_or("InvalidSpec", |n| n.reason);
        let event = reconcile_event(EventType::Warning, reason, told);
        self.tell(&target.key, target.regarding(), event, Some(&self.priority));
    }

    /// Tells, in a Warning event on the At, that cnat cannot read it (`why`), so it does nothing
    /// with it until it is fixed.
    pub fn report_unreadable(&self, at: &AtKey, regarding: ObjectReference, why: &str) {
        warn!(at = %at, "an At that does not decode as an At is left alone until it changes");
        let note = format!(
            "cnat cannot read this At ({why}), so it does nothing with it; fix the field named (kubectl edit) and it runs"
        );
        let event = reconcile_event(EventType::Warning, "Unreadable", note);
        self.tell(at, regarding, event, Some(&self.priority));
    }
}

/// An event of the reconcile: `reason`, with `note`.
fn reconcile_event(type_: EventType, reason: &str, note: String) -> Event {
    Event {
        type_,
        reason: reason.into(),
        note: Some(note),
        action: "Reconcile".into(),
        secondary: None,
    }
}

/// The merge patch of one status write: `status` whole, and `resource_version` (the version
/// it was decided on) as a precondition, so that a write over a newer version is refused (409).
pub fn status_patch(resource_version: Option<&str>, status: &AtStatus) -> serde_json::Value {
    json!({
        "metadata": { "resourceVersion": resource_version },
        "status": status,
    })
}

//! Pods first: when many Ats fall due together, the API server's write capacity goes to their
//! pods before any status write or event of that wave, and to status writes before events. A
//! reconcile queues its status write here and returns at once; the queue's writers wait until no
//! pod create is in flight, then write (still guarded by the resourceVersion decided on); the
//! event waits until no status write is queued either. Exactly-once does not depend on this:
//! the pod's deterministic name does.

use super::{key, Context, Decision};
use crate::api::At;
use crate::operator::key::AtKey;
use futures::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::Event;
use kube::Resource;
use std::sync::Arc;
use tokio::sync::{mpsc, watch};
use tracing::field::{display, Empty};
use tracing::{debug, info_span, warn, Instrument, Span};

/// Status writes that follow pod creates, at once: as many as reconciles (pod creates) run at
/// once by default (`--concurrency`).
pub const WRITERS: usize = 32;
/// How long pod creates and status writes must have been idle before an event goes out.
const QUIET: std::time::Duration = std::time::Duration::from_millis(20);
/// The longest an event waits for pod creates and status writes to be quiet.
const MAX_DEFER: std::time::Duration = std::time::Duration::from_secs(2);
/// Events published at once (each one API request), in as many lanes.
const TELLERS: usize = 8;
/// Events waiting behind writes, in all lanes together (each holds its `TELLERS`th part); past
/// a lane's part they are dropped and counted (`cnat_events_dropped_total`): the At's status
/// holds the same facts.
pub const MAX_TELLINGS: usize = 4096;

/// Counts work in flight (or queued) of one priority; lower priorities wait until it is idle.
#[derive(Clone)]
pub struct InFlight(Arc<Counted>);

struct Counted {
    count: watch::Sender<usize>,
    /// When the count last went to zero.
    idle_since: std::sync::Mutex<tokio::time::Instant>,
}

impl Default for InFlight {
    fn default() -> Self {
        InFlight(Arc::new(Counted {
            count: watch::Sender::new(0),
            idle_since: std::sync::Mutex::new(tokio::time::Instant::now()),
        }))
    }
}

/// One unit of work counted by `InFlight`, until dropped.
pub struct InFlightGuard(InFlight);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        let counted = &self.0 .0;
        counted.count.send_modify(|n| {
            *n -= 1;
            if *n == 0 {
                *counted.idle_since.lock().unwrap_or_else(|e| e.into_inner()) =
                    tokio::time::Instant::now();
            }
        });
    }
}

impl InFlight {
    /// Counts one more unit until the returned guard is dropped.
    pub fn enter(&self) -> InFlightGuard {
        self.0.count.send_modify(|n| *n += 1);
        InFlightGuard(self.clone())
    }

    /// Returns once nothing is counted.
    pub async fn idle(&self) {
        let mut count = self.0.count.subscribe();
        // The sender lives as long as `self`, so waiting cannot fail.
        let _ = count.wait_for(|n| *n == 0).await;
    }

    /// Units counted now.
    pub fn in_flight(&self) -> usize {
        *self.0.count.borrow()
    }

    /// Since when nothing is counted, or `None` while something is.
    fn idle_since(&self) -> Option<tokio::time::Instant> {
        let count = self.0.count.borrow();
        (*count == 0).then(|| *self.0.idle_since.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// The three priorities of writes: pod creates, then status writes, then events.
#[derive(Default)]
pub struct PodsFirst {
    /// Pod creates in flight.
    pub creating: InFlight,
    /// Follow-up status writes queued or in flight.
    pub writing: InFlight,
}

impl PodsFirst {
    /// Returns once neither pod creates nor status writes have been in flight for `QUIET`. Once
    /// that holds, every waiter passes at once: a wave's events pay the quiet period once, not
    /// once each.
    pub async fn quiet(&self) {
        loop {
            self.creating.idle().await;
            self.writing.idle().await;
            let (Some(created), Some(written)) =
                (self.creating.idle_since(), self.writing.idle_since())
            else {
                continue;
            };
            let quiet_from = created.max(written) + QUIET;
            if tokio::time::Instant::now() >= quiet_from {
                return;
            }
            tokio::time::sleep_until(quiet_from).await;
        }
    }
}

/// A status write (and its event) that waits for the pods of its wave. It keeps of its At only
/// what the write, its event and its log line need, and of the reconcile that queued it only
/// the trace ids: when Ats are created faster than their statuses can be written, thousands
/// wait here, and whole Ats and open spans would cost several KiB each.
pub struct Followup {
    ctx: Arc<Context>,
    target: Target,
    decision: Decision,
    /// The reconcile's span, as trace ids: the `status-write` span is its child.
    parent: opentelemetry::trace::SpanContext,
    /// Counts this write as queued until it is done.
    _writing: InFlightGuard,
}

/// What a queued status write keeps of its At.
struct Target {
    name: String,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
    /// The phase before (for the log line).
    from: Option<crate::api::Phase>,
    /// Its spec is outside the CRD's bounds (see `refuses_any_status`).
    out_of_range: bool,
}

impl Target {
    fn of(at: &At) -> Self {
        Target {
            name: kube::ResourceExt::name_any(at),
            namespace: at.metadata.namespace.clone(),
            uid: at.metadata.uid.clone(),
            resource_version: at.metadata.resource_version.clone(),
            from: at.status.as_ref().map(|s| s.phase),
            out_of_range: !crate::limits::problems(&at.spec, |_| true).is_empty(),
        }
    }

    /// The At as far as the write needs it: identity, version and phase, no spec.
    fn at(&self) -> At {
        let mut at = At::new(&self.name, crate::api::AtSpec::default());
        at.metadata.namespace = self.namespace.clone();
        at.metadata.uid = self.uid.clone();
        at.metadata.resource_version = self.resource_version.clone();
        at.status = self.from.map(|phase| crate::api::AtStatus {
            phase,
            ..crate::api::AtStatus::default()
        });
        at
    }
}

/// An event that waits for the pod creates and status writes queued before it.
pub struct QueuedEvent {
    ctx: Arc<Context>,
    event: Event,
    regarding: ObjectReference,
    /// When it was queued: it waits for quiet at most `MAX_DEFER` from then.
    queued: tokio::time::Instant,
}

/// A queue's sending and receiving ends, as `Context` holds them.
pub(super) struct Queue<T> {
    pub sender: mpsc::UnboundedSender<T>,
    pub receiver: std::sync::Mutex<Option<mpsc::UnboundedReceiver<T>>>,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        let (sender, receiver) = mpsc::unbounded_channel();
        Queue {
            sender,
            receiver: std::sync::Mutex::new(Some(receiver)),
        }
    }
}

impl<T> Queue<T> {
    /// The receiving end as a stream; `None` once taken.
    pub(super) fn take(&self) -> Option<impl futures::Stream<Item = T> + use<T>> {
        let receiver = take(&self.receiver)?;
        Some(futures::stream::unfold(receiver, |mut rx| async {
            rx.recv().await.map(|item| (item, rx))
        }))
    }
}

/// `TELLERS` queues that hold at most `MAX_TELLINGS` together (senders drop what does not fit),
/// each emptied in order: what is sent with one key always goes to the same lane, so the events
/// of one At go out in the order they were queued, while other Ats' go at the same time.
pub(super) struct Lanes<T> {
    senders: Vec<mpsc::Sender<T>>,
    receivers: std::sync::Mutex<Option<Vec<mpsc::Receiver<T>>>>,
}

impl<T> Default for Lanes<T> {
    fn default() -> Self {
        let (senders, receivers) = (0..TELLERS)
            .map(|_| mpsc::channel(MAX_TELLINGS / TELLERS))
            .unzip();
        Lanes {
            senders,
            receivers: std::sync::Mutex::new(Some(receivers)),
        }
    }
}

impl<T> Lanes<T> {
    /// Queues `item` in the lane of `key` without waiting.
    pub(super) fn try_send(
        &self,
        key: &impl std::hash::Hash,
        item: T,
    ) -> Result<(), mpsc::error::TrySendError<T>> {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let hash = BuildHasherDefault::<DefaultHasher>::default().hash_one(key);
        // The modulo keeps it below TELLERS, so the cast cannot truncate.
        self.senders[(hash % TELLERS as u64) as usize].try_send(item)
    }

    /// Each lane's receiving end as a stream; `None` once taken.
    pub(super) fn take(&self) -> Option<Vec<impl futures::Stream<Item = T> + use<T>>> {
        let receivers = take(&self.receivers)?;
        Some(
            receivers
                .into_iter()
                .map(|receiver| {
                    futures::stream::unfold(receiver, |mut rx| async {
                        rx.recv().await.map(|item| (item, rx))
                    })
                })
                .collect(),
        )
    }
}

fn take<R>(slot: &std::sync::Mutex<Option<R>>) -> Option<R> {
    slot.lock().unwrap_or_else(|e| e.into_inner()).take()
}

impl Context {
    /// Queues the status write and event of `decision` for `at` behind the pods in flight.
    pub(super) fn follow_up(self: &Arc<Self>, at: &At, decision: Decision) {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let parent = Span::current().context().span().span_context().clone();
        let job = Followup {
            ctx: self.clone(),
            target: Target::of(at),
            decision,
            parent,
            _writing: self.pods_first.writing.enter(),
        };
        if self.followups.sender.send(job).is_err() {
            // Only after the writer stopped, i.e. the loop is ending: the next leader writes it.
            debug!("follow-up writer stopped; status write left to the next reconcile");
        }
    }

    /// The follow-up writer: status writes once no pod create is in flight, events once no
    /// status write is queued either. Runs until every `Context` handle is gone (or it is
    /// dropped with the reconcile loop). Returns `None` if it was already taken.
    pub fn followup_writer(&self) -> Option<impl std::future::Future<Output = ()> + use<>> {
        let jobs = self.followups.take()?;
        let lanes = self.queued_events.take()?;
        let writes = jobs.for_each_concurrent(WRITERS, |job| async move {
            use opentelemetry::trace::TraceContextExt;
            use tracing_opentelemetry::OpenTelemetrySpanExt;
            let span = info_span!(
                "status-write",
                at = %format_args!("{}/{}", job.target.namespace.as_deref().unwrap_or_default(), job.target.name),
                phase = job.decision.status.as_ref().map(|s| s.phase.as_str()),
                error = Empty,
                "otel.status_code" = Empty,
            );
            // Without a collector or a sampled trace, there is no parent to name.
            if job.parent.is_valid() {
                let parent = opentelemetry::Context::new().with_remote_span_context(job.parent.clone());
                let _ = span.set_parent(parent);
            }
            job.ctx.write_followup(&job).instrument(span).await;
        });
        // Each only once pod creates and status writes have been quiet for a moment (a wave's
        // events wait for the whole wave), several lanes at once, each At's in order.
        let events = futures::future::join_all(lanes.into_iter().map(|lane| {
            lane.for_each(|waiting| async move {
                // Under steady writes there may never be 20 ms of quiet: events wait for it at
                // most `MAX_DEFER`, so they are late, never lost.
                tokio::select! {
                    () = waiting.ctx.pods_first.quiet() => {}
                    () = tokio::time::sleep_until(waiting.queued + MAX_DEFER) => {}
                }
                waiting
                    .ctx
                    .events
                    .publish_now(waiting.event, waiting.regarding)
                    .await;
            })
        }));
        Some(async move {
            futures::future::join(writes, events).await;
        })
    }

    /// Queues `event` about `at` behind the pod creates and status writes.
    pub(super) fn tell_later(
        self: &Arc<Self>,
        at: &AtKey,
        regarding: ObjectReference,
        event: Event,
    ) {
        let waiting = QueuedEvent {
            ctx: self.clone(),
            event,
            regarding,
            queued: tokio::time::Instant::now(),
        };
        match self.queued_events.try_send(at, waiting) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => self.metrics.event_dropped(),
            Err(mpsc::error::TrySendError::Closed(_)) => {
                debug!("follow-up writer stopped; event dropped");
            }
        }
    }

    /// The API server validates the whole At on a status write, so an At whose spec breaks the
    /// CRD's schema (stored before the schema had today's bounds) can get no status at all
    /// (422; see `refuses_any_status`). Retrying cannot help: the decided event tells the story
    /// instead, with the server's words, and this version is left alone until it changes.
    pub(super) fn refused_status(
        self: &Arc<Self>,
        at: &At,
        decision: &Decision,
        refusal: &kube::core::Status,
    ) {
        let at_key = key(at);
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
        warn!(at = %at_key, reason = decision.note.as_ref().map(|n| n.reason), "the API server refuses any status for this At (its spec breaks the CRD's schema); told in an event only");
        let event = Event {
            type_: kube::runtime::events::EventType::Warning,
            reason: decision
                .note
                .as_ref()
                .map_or("InvalidSpec", |n| n.reason)
                .into(),
            note: Some(told),
            action: "Reconcile".into(),
            secondary: None,
        };
        self.tell_later(&key(at), at.object_ref(&()), event);
    }

    async fn write_followup(self: &Arc<Self>, job: &Followup) {
        let (at, decision) = (&job.target.at(), &job.decision);
        let Some(status) = &decision.status else {
            return;
        };
        self.pods_first.creating.idle().await;
        match self.write_status(at, status).await {
            Ok(()) => {
                self.ledger.succeeded(&key(at));
                if let Some(note) = &decision.note {
                    let event = self.log_transition(at, status, note);
                    self.tell_later(&key(at), at.object_ref(&()), event);
                }
            }
            Err(kube::Error::Api(s)) if s.is_conflict() => {
                debug!(at = %key(at), "status changed meanwhile; waiting for the newer version");
            }
            // Deleted meanwhile: nothing to retry, and nothing to keep for it.
            Err(kube::Error::Api(s)) if s.is_not_found() => {
                self.forget(&key(at));
            }
            // The server refuses any status on this version: see `refused_status`.
            Err(kube::Error::Api(s)) if s.is_invalid() && job.target.out_of_range => {
                self.refused_status(at, decision, &s)
            }
            Err(error) => {
                let span = Span::current();
                span.record("error", display(&error));
                span.record("otel.status_code", "ERROR");
                // The cache still shows the version we decided on: let the next reconcile act on
                // it, and bring that reconcile about after the usual backoff or, if the API
                // server did not answer, as soon as it answers again.
                self.forget_write(at);
                let (attempt, delay) = self.next_retry(at);
                let unanswered = self.wait_if_unanswered(at, &error);
                if super::glitch::quiet(&error, attempt) {
                    debug!(at = %key(at), phase = status.phase.as_str(), %error, retry_in = ?delay, unanswered, attempt, "writing status failed on the API server's own error; retrying");
                } else {
                    warn!(at = %key(at), phase = status.phase.as_str(), %error, retry_in = ?delay, unanswered, "writing status failed");
                }
                self.retrigger_after(key(at), delay);
            }
        }
    }
}

/// Whether the API server's `refusal` of a status write means it refuses any status for this
/// version of `at`: a 422 for an At whose spec is out of the CRD's bounds. Any other 422 is
/// retried like other errors, among them the API server's own CEL failures (`glitch`).
pub(super) fn refuses_any_status(at: &At, refusal: &kube::core::Status) -> bool {
    refusal.is_invalid() && !crate::limits::problems(&at.spec, |_| true).is_empty()
}

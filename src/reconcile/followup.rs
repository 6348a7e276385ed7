//! Pods first: when many Ats fall due together, the API server's write capacity goes to their
//! pods before any RUNNING status write or event of that wave. A reconcile that created a pod
//! queues its status write here and returns at once; the queue's writers wait until no pod
//! create is in flight, then write (still guarded by the resourceVersion decided on) and publish
//! the event. Exactly-once does not depend on this: the pod's deterministic name does.

use super::{key, Context, Decision};
use crate::api::At;
use futures::StreamExt;
use kube::runtime::reflector::ObjectRef;
use std::sync::Arc;
use tokio::sync::{mpsc, watch};
use tracing::field::{display, Empty};
use tracing::{debug, info_span, warn, Instrument, Span};

/// Status writes that follow pod creates, at once.
const WRITERS: usize = 8;

/// Counts pod creates in flight; follow-up writes wait for none.
pub struct PodsFirst {
    creating: watch::Sender<usize>,
}

impl Default for PodsFirst {
    fn default() -> Self {
        PodsFirst {
            creating: watch::Sender::new(0),
        }
    }
}

/// A pod create in flight, from `PodsFirst::creating` until dropped.
pub struct Creating<'a>(&'a PodsFirst);

impl Drop for Creating<'_> {
    fn drop(&mut self) {
        self.0.creating.send_modify(|n| *n -= 1);
    }
}

impl PodsFirst {
    /// Marks a pod create in flight until the returned guard is dropped.
    pub fn creating(&self) -> Creating<'_> {
        self.creating.send_modify(|n| *n += 1);
        Creating(self)
    }

    /// Returns once no pod create is in flight.
    pub async fn idle(&self) {
        let mut creating = self.creating.subscribe();
        // The sender lives as long as `self`, so waiting cannot fail.
        let _ = creating.wait_for(|n| *n == 0).await;
    }

    /// Pod creates in flight now.
    pub fn in_flight(&self) -> usize {
        *self.creating.borrow()
    }
}

/// A status write (and its event) that waits for the pods of its wave.
pub struct Followup {
    ctx: Arc<Context>,
    at: Arc<At>,
    decision: Decision,
    /// A `status-write` span, child of the reconcile that queued it: same trace.
    span: Span,
}

/// The queue's sending and receiving ends, as `Context` holds them.
pub(super) struct Queue {
    pub sender: mpsc::UnboundedSender<Followup>,
    pub receiver: std::sync::Mutex<Option<mpsc::UnboundedReceiver<Followup>>>,
}

impl Default for Queue {
    fn default() -> Self {
        let (sender, receiver) = mpsc::unbounded_channel();
        Queue {
            sender,
            receiver: std::sync::Mutex::new(Some(receiver)),
        }
    }
}

impl Context {
    /// Queues the status write and event of `decision` for `at` behind the pods in flight.
    pub(super) fn follow_up(self: &Arc<Self>, at: Arc<At>, decision: Decision) {
        let span = info_span!(
            "status-write",
            phase = decision.status.as_ref().map(|s| s.phase.as_str()),
            error = Empty,
            "otel.status_code" = Empty,
        );
        let job = Followup {
            ctx: self.clone(),
            at,
            decision,
            span,
        };
        if self.followups.sender.send(job).is_err() {
            // Only after the writer stopped, i.e. the loop is ending: the next leader writes it.
            debug!("follow-up writer stopped; status write left to the next reconcile");
        }
    }

    /// The follow-up writer: runs until every `Context` handle is gone (or it is dropped with the
    /// reconcile loop). Returns `None` if it was already taken.
    pub fn followup_writer(&self) -> Option<impl std::future::Future<Output = ()> + use<>> {
        let receiver = self
            .followups
            .receiver
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()?;
        let jobs = futures::stream::unfold(receiver, |mut rx| async {
            rx.recv().await.map(|job| (job, rx))
        });
        Some(jobs.for_each_concurrent(WRITERS, |job| async move {
            let span = job.span.clone();
            job.ctx
                .write_followup(&job.at, &job.decision)
                .instrument(span)
                .await;
        }))
    }

    async fn write_followup(&self, at: &Arc<At>, decision: &Decision) {
        let Some(status) = &decision.status else {
            return;
        };
        self.pods_first.idle().await;
        match self.write_status(at, status).await {
            Ok(()) => {
                if let Some(note) = &decision.note {
                    self.tell(at, status, note).await;
                }
            }
            Err(kube::Error::Api(s)) if s.is_conflict() => {
                debug!(at = %key(at), "status changed meanwhile; waiting for the newer version");
            }
            Err(error) => {
                let span = Span::current();
                span.record("error", display(&error));
                span.record("otel.status_code", "ERROR");
                // The cache still shows the version we decided on: let the next reconcile act on
                // it, and bring that reconcile about after the usual backoff or, if the API
                // server did not answer, as soon as it answers again.
                self.forget_write(at);
                let delay = self.next_retry(at);
                let unanswered = self.wait_if_unanswered(at, &error);
                warn!(at = %key(at), phase = status.phase.as_str(), %error, retry_in = ?delay, unanswered, "writing status failed");
                self.retrigger_after(ObjectRef::from_obj(at.as_ref()), delay);
            }
        }
    }
}

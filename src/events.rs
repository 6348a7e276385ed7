//! Publishes Kubernetes Events in the background, so a reconcile never waits for one: the status
//! write is what matters, and the event tells the same story for `kubectl describe`.

use futures::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, Recorder};
use tokio::sync::mpsc;
use tracing::warn;

/// Events waiting to be published; past this, reconciles wait for room (backpressure).
const QUEUE: usize = 4096;
/// Events published at once; each is one API request.
const CONCURRENCY: usize = 8;

/// A handle for queueing events; publishing stops once every handle is dropped.
#[derive(Clone)]
pub struct EventSink {
    queue: mpsc::Sender<(Event, ObjectReference)>,
}

impl EventSink {
    /// Starts the background publisher on the current tokio runtime.
    pub fn start(recorder: Recorder) -> Self {
        let (queue, receiver) = mpsc::channel(QUEUE);
        let pending = futures::stream::unfold(receiver, |mut rx| async {
            rx.recv().await.map(|e| (e, rx))
        });
        tokio::spawn(pending.for_each_concurrent(CONCURRENCY, move |(event, regarding)| {
            let recorder = recorder.clone();
            async move {
                // Best effort: the At's status already holds the same facts.
                if let Err(error) = recorder.publish(&event, &regarding).await {
                    warn!(%error, reason = event.reason, object = regarding.name.as_deref().unwrap_or(""), "could not publish event");
                }
            }
        }));
        EventSink { queue }
    }

    /// Queues `event` about `regarding`.
    pub async fn send(&self, event: Event, regarding: ObjectReference) {
        if self.queue.send((event, regarding)).await.is_err() {
            warn!("event publisher stopped; event dropped");
        }
    }
}

//! Publishes Kubernetes Events in the background, so a reconcile never waits for one: the status
//! write is what matters, and the event tells the same story for `kubectl describe`.
//!
//! Each event is published by a fresh kube `Recorder`. A long-lived one keeps every event it
//! published for six minutes (to count repeats as a series) and scans that whole cache on every
//! publish: with 100,000 Ats created at a few hundred a second that is tens of thousands of
//! cached events and a scan of them per event. cnat's events are one per transition (repeated
//! refusals are told once), so a series has nothing to count and memory stays flat.

use futures::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, Recorder, Reporter};
use tokio::sync::mpsc;
use tracing::{debug, warn};

/// Events waiting to be published; past this they are dropped (and counted by the caller):
/// nothing waits for room, least of all the leader's renewals.
const QUEUE: usize = 4096;
/// Events published at once; each is one API request.
const CONCURRENCY: usize = 8;
/// The API server refuses an event whose note is longer than this many bytes.
pub const MAX_NOTE_BYTES: usize = 1024;

/// A handle for queueing events; publishing stops once every handle is dropped.
#[derive(Clone)]
pub struct EventSink {
    queue: mpsc::Sender<(Event, ObjectReference)>,
    client: kube::Client,
    reporter: Reporter,
}

impl EventSink {
    /// Starts the background publisher on the current tokio runtime, reporting as `reporter`.
    pub fn start(client: kube::Client, reporter: Reporter) -> Self {
        let (queue, receiver) = mpsc::channel(QUEUE);
        let pending = futures::stream::unfold(receiver, |mut rx| async {
            rx.recv().await.map(|e| (e, rx))
        });
        let (publisher, reporting) = (client.clone(), reporter.clone());
        tokio::spawn(
            pending.for_each_concurrent(CONCURRENCY, move |(event, regarding)| {
                publish(publisher.clone(), reporting.clone(), event, regarding)
            }),
        );
        EventSink {
            queue,
            client,
            reporter,
        }
    }

    /// Publishes `event` about `regarding` now, returning when the API server answered (for
    /// callers that pace events themselves).
    pub async fn publish_now(&self, mut event: Event, regarding: ObjectReference) {
        event.note = event.note.map(|note| fit_note(&note));
        publish(self.client.clone(), self.reporter.clone(), event, regarding).await;
    }

    /// Queues `event` about `regarding`, its note cut to what the API server accepts, without
    /// waiting: `false` when the queue is full (or the publisher stopped) and it was dropped.
    pub fn try_send(&self, mut event: Event, regarding: ObjectReference) -> bool {
        event.note = event.note.map(|note| fit_note(&note));
        self.queue.try_send((event, regarding)).is_ok()
    }
}

async fn publish(
    client: kube::Client,
    reporter: Reporter,
    event: Event,
    regarding: ObjectReference,
) {
    // Best effort: the At's status already holds the same facts.
    if let Err(error) = Recorder::new(client, reporter)
        .publish(&event, &regarding)
        .await
    {
        let object = regarding.name.as_deref().unwrap_or("");
        if namespace_going(&error) {
            debug!(%error, reason = event.reason, object, "event not published: its namespace is being deleted");
        } else {
            warn!(%error, reason = event.reason, object, "could not publish event");
        }
    }
}

/// The namespace is being deleted (or is gone): no event can go there, and that is normal
/// when a namespace full of Ats is deleted, so not worth a warning per event.
fn namespace_going(error: &kube::Error) -> bool {
    match error {
        // The namespace itself is not found (not, say, an earlier event of a series).
        kube::Error::Api(status) if status.code == 404 => status
            .details
            .as_ref()
            .is_some_and(|d| d.kind == "namespaces"),
        kube::Error::Api(status) if status.code == 403 => status
            .details
            .as_ref()
            .is_some_and(|d| d.causes.iter().any(|c| c.reason == "NamespaceTerminating")),
        _ => false,
    }
}

/// `note` cut at a character boundary so that it, with a trailing `…`, fits `MAX_NOTE_BYTES`
/// bytes (not characters: command output may be any script).
pub fn fit_note(note: &str) -> String {
    if note.len() <= MAX_NOTE_BYTES {
        return note.to_owned();
    }
    let ellipsis = "…";
    let mut cut = MAX_NOTE_BYTES - ellipsis.len();
    while !note.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}{ellipsis}", &note[..cut])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(json: &str) -> kube::Error {
        kube::Error::Api(serde_json::from_str(json).unwrap())
    }

    #[test]
    fn a_namespace_being_deleted_is_no_reason_to_warn() {
        let terminating = api_error(include_str!(
            "../../tests/fixtures/api-k8s-1.24/status-403-forbidden-namespace-terminating.json"
        ));
        assert!(namespace_going(&terminating));
        // As kube-apiserver answers a write into a namespace that no longer exists.
        let gone = api_error(
            r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"namespaces \"gone\" not found","reason":"NotFound","details":{"name":"gone","kind":"namespaces"},"code":404}"#,
        );
        assert!(namespace_going(&gone));
        // Any other 404 is worth a warning.
        let other = api_error(include_str!(
            "../../tests/fixtures/api-k8s-1.24/status-404-not-found.json"
        ));
        assert!(!namespace_going(&other));
        // Other refusals are warned about.
        for other in [
            "status-403-forbidden-quota-exceeded.json",
            "status-409-already-exists.json",
            "status-500-webhook-unreachable-create.json",
        ] {
            let json = std::fs::read_to_string(format!(
                "{}/tests/fixtures/api-k8s-1.24/{other}",
                env!("CARGO_MANIFEST_DIR")
            ))
            .unwrap();
            assert!(!namespace_going(&api_error(&json)), "{other}");
        }
        assert!(!namespace_going(
            &kube::Error::LinesCodecMaxLineLengthExceeded
        ));
    }

    #[test]
    fn notes_fit_the_api_limit_in_bytes() {
        assert_eq!(fit_note("short"), "short");
        let exact = "a".repeat(MAX_NOTE_BYTES);
        assert_eq!(fit_note(&exact), exact);
        for unit in ["a", "é", "€", "𝄞", "日本"] {
            let long = unit.repeat(2000);
            let fitted = fit_note(&long);
            assert!(fitted.len() <= MAX_NOTE_BYTES, "{unit}: {}", fitted.len());
            assert!(fitted.len() > MAX_NOTE_BYTES - 8, "{unit}: cut too much");
            assert!(fitted.ends_with('…'));
            assert!(long.starts_with(fitted.trim_end_matches('…')));
        }
    }
}

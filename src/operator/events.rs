//! The one queue of Kubernetes Events, so that nothing waits for one: `LANES` lanes, one At's
//! events in order in one lane, each published by a fresh kube `Recorder`.
//! See docs/src/design/decisions.md, "Events after the writes".

use crate::operator::priority::Priority;
use crate::sync::lock;
use futures::StreamExt;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, Recorder, Reporter};
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher, Hash};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, warn};

/// Events published at once (each one API request), in as many lanes.
pub const LANES: usize = 8;
/// Ats' events waiting in all lanes together (each holds its `LANES`th part; the replica's own
/// lane as much again); past a lane's part they are dropped (and counted by the caller).
pub const QUEUE: usize = 4096;
/// The longest an event waits for pod creates and status writes to be quiet.
pub const MAX_DEFER: Duration = Duration::from_secs(2);
/// The API server refuses an event whose note is longer than this many bytes.
pub const MAX_NOTE_BYTES: usize = 1024;

/// A handle for queueing events; publishing stops once every handle is dropped.
#[derive(Clone)]
pub struct EventSink {
    lanes: Arc<Lanes<Queued>>,
    /// A lane of its own for the replica's events (its Lease's), which never wait behind Ats'.
    replica: mpsc::Sender<Queued>,
}

/// An event in its lane.
struct Queued {
    event: Event,
    regarding: ObjectReference,
    /// The writes it waits for, and since when.
    behind: Option<(Priority, Instant)>,
}

impl EventSink {
    /// Starts the lanes' publishers on the current tokio runtime, reporting as `reporter`.
    pub fn start(client: kube::Client, reporter: Reporter) -> Self {
        let lanes = Lanes::default();
        let (replica, mut replica_lane) = mpsc::channel(QUEUE / LANES);
        let replica_lane = futures::stream::poll_fn(move |cx| replica_lane.poll_recv(cx));
        for lane in lanes.take().into_iter().flatten() {
            spawn_publisher(lane, &client, &reporter);
        }
        spawn_publisher(replica_lane, &client, &reporter);
        EventSink {
            lanes: Arc::new(lanes),
            replica,
        }
    }

    /// Queues an event about this replica itself (its Lease) in its own lane, in order and
    /// never behind Ats' events; `false` when the lane is full and it was dropped.
    pub fn try_send_replica(&self, event: Event, regarding: ObjectReference) -> bool {
        sent(self.replica.try_send(Queued::new(event, regarding, None)))
    }

    /// Queues `event` about `regarding` in the lane of `key`, its note cut to what the API
    /// server accepts, without waiting: `false` when the lane is full (or the publishers
    /// stopped) and it was dropped. With `behind`, the event goes out once those writes are
    /// quiet (at most `MAX_DEFER` from now).
    pub fn try_send(
        &self,
        key: &impl Hash,
        event: Event,
        regarding: ObjectReference,
        behind: Option<&Priority>,
    ) -> bool {
        let queued = Queued::new(event, regarding, behind);
        sent(self.lanes.try_send(key, queued))
    }
}

impl Queued {
    /// `event`, its note cut to what the API server accepts, waiting for `behind` from now.
    fn new(mut event: Event, regarding: ObjectReference, behind: Option<&Priority>) -> Self {
        event.note = event.note.map(|note| fit_note(&note));
        Queued {
            event,
            regarding,
            behind: behind.map(|writes| (writes.clone(), Instant::now())),
        }
    }
}

/// Whether a queue took the event (a full queue or stopped publishers drop it).
fn sent<T>(result: Result<(), mpsc::error::TrySendError<T>>) -> bool {
    match result {
        Ok(()) => true,
        Err(mpsc::error::TrySendError::Full(_)) => false,
        Err(mpsc::error::TrySendError::Closed(_)) => {
            debug!("event publishers stopped; event dropped");
            false
        }
    }
}

/// Publishes what `lane` brings, one after the other, until every sender is gone.
fn spawn_publisher(
    lane: impl futures::Stream<Item = Queued> + Send + 'static,
    client: &kube::Client,
    reporter: &Reporter,
) {
    let (client, reporter) = (client.clone(), reporter.clone());
    tokio::spawn(
        lane.for_each(move |queued| publish_in_turn(client.clone(), reporter.clone(), queued)),
    );
}

/// Publishes `queued` once the writes it waits for are quiet: under steady writes there may
/// never be a quiet moment, so at most `MAX_DEFER` after it was queued.
async fn publish_in_turn(client: kube::Client, reporter: Reporter, queued: Queued) {
    if let Some((writes, since)) = &queued.behind {
        tokio::select! {
            () = writes.quiet() => {}
            () = tokio::time::sleep_until(*since + MAX_DEFER) => {}
        }
    }
    publish(client, reporter, queued.event, queued.regarding).await;
}

/// `LANES` queues that hold at most `QUEUE` together (senders drop what does not fit), each
/// emptied in order; what is sent with one key always goes to the same lane.
pub struct Lanes<T> {
    senders: Vec<mpsc::Sender<T>>,
    receivers: std::sync::Mutex<Option<Vec<mpsc::Receiver<T>>>>,
}

impl<T> Default for Lanes<T> {
    fn default() -> Self {
        let (senders, receivers) = (0..LANES).map(|_| mpsc::channel(QUEUE / LANES)).unzip();
        Lanes {
            senders,
            receivers: std::sync::Mutex::new(Some(receivers)),
        }
    }
}

impl<T> Lanes<T> {
    /// Queues `item` in the lane of `key` without waiting.
    pub fn try_send(&self, key: &impl Hash, item: T) -> Result<(), mpsc::error::TrySendError<T>> {
        let hash = BuildHasherDefault::<DefaultHasher>::default().hash_one(key);
        // The modulo keeps it below LANES, so the cast cannot truncate.
        self.senders[(hash % LANES as u64) as usize].try_send(item)
    }

    /// Each lane's receiving end as a stream; `None` once taken.
    pub fn take(&self) -> Option<Vec<impl futures::Stream<Item = T> + use<T>>> {
        let receivers = lock(&self.receivers).take()?;
        Some(
            receivers
                .into_iter()
                .map(|mut rx| futures::stream::poll_fn(move |cx| rx.poll_recv(cx)))
                .collect(),
        )
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

    #[tokio::test]
    async fn one_object_s_events_keep_their_order_while_others_go_alongside() {
        let lanes = Lanes::<u32>::default();
        for i in 0..50 {
            lanes.try_send(&(Some("default"), Some("a")), i).unwrap();
            lanes
                .try_send(&(Some("default"), Some("b")), 100 + i)
                .unwrap();
            lanes
                .try_send(&(Some("other"), Some("a")), 200 + i)
                .unwrap();
        }
        let streams = lanes.take().unwrap();
        assert!(lanes.take().is_none(), "taken once");
        drop(lanes);
        let emptied =
            futures::future::join_all(streams.into_iter().map(|s| s.collect::<Vec<_>>())).await;
        for base in [0, 100, 200] {
            let at: Vec<u32> = emptied
                .iter()
                .flatten()
                .copied()
                .filter(|i| (base..base + 50).contains(i))
                .collect();
            assert_eq!(
                at,
                (base..base + 50).collect::<Vec<_>>(),
                "in order, all in one lane"
            );
            assert_eq!(
                emptied.iter().filter(|lane| lane.contains(&base)).count(),
                1
            );
        }
    }
}

//! The conversion webhook's HTTP side: the body is read as it arrives and the answer written as
//! objects are converted (`conversion::streaming`), on a blocking thread, within a slot and a
//! deadline. See docs/src/operating/security.md, "Hostile callers".

use crate::conversion::streaming::{self, Answered};
use crate::observability::metrics::Metrics;
use crate::serving::guard::{self, Connection, Slots, Stage};
use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt};
use std::io;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, info_span};

/// Reviews converted at once on a replica, and from one client address: each holds at most one
/// object (`streaming::OBJECT_BUDGET`) and a few chunks of output.
pub const MAX_CONVERSIONS: usize = 8;
pub const MAX_CONVERSIONS_PER_CLIENT: usize = 4;
/// How long a review waits for a slot before it is answered 429.
pub const SLOT_WAIT: Duration = Duration::from_secs(2);
/// The longest a review may take, its body read and its answer written: kube-apiserver's own
/// bound on a conversion webhook call.
pub const DEADLINE: Duration = Duration::from_secs(30);
/// A review's body must keep up with this rate (bytes a second) after [`GRACE`]: kube-apiserver
/// sends it from memory; a client that trickles it is cut off and frees its slot.
pub const MIN_RATE: u64 = 1 << 20;
pub const GRACE: Duration = Duration::from_secs(3);
/// The largest body read: an unpaged list of many thousands of Ats fits.
pub const MAX_BODY: u64 = 512 << 20;
/// The answer goes out in chunks of about this size, at most `CHUNKS` of them waiting.
const CHUNK: usize = 64 << 10;
const CHUNKS: usize = 4;

/// The slots of one server.
pub fn slots() -> Arc<Slots> {
    Slots::new(MAX_CONVERSIONS, MAX_CONVERSIONS_PER_CLIENT)
}

/// Answers the ConversionReview in `body` from `client`.
pub async fn convert(
    slots: &Arc<Slots>,
    metrics: Arc<Metrics>,
    client: IpAddr,
    connection: Option<Arc<Connection>>,
    body: Body,
) -> Response {
    let started = Instant::now();
    let Some(slot) = slots.wait_n(client, 1, started + SLOT_WAIT).await else {
        return guard::busy(
            "cnat: too many conversions in flight on this replica (from this client, or in all); retry\n".into(),
        );
    };
    // Not closed to make room from now until the answer is written.
    if let Some(connection) = connection {
        connection.set(Stage::Answering);
    }
    let deadline = started + DEADLINE;
    let reader = tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(Box::pin(
        within(body, deadline),
    )));
    let (sender, answer) = mpsc::channel(CHUNKS);
    let runtime = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        let span = info_span!("conversion", "otel.kind" = "server");
        let _entered = span.enter();
        let out = Chunks {
            sender: sender.clone(),
            buffer: BytesMut::new(),
            runtime: runtime.clone(),
            deadline,
        };
        let ok = match streaming::answer(reader, out) {
            Ok(Answered::Converted(_)) => true,
            Ok(Answered::Refused(why)) => {
                debug!(reason = %why, "conversion refused");
                false
            }
            Err(broken) => {
                debug!(reason = %broken, "conversion answer cut off");
                let _ = runtime.block_on(tokio::time::timeout_at(
                    deadline,
                    sender.send(Err(io::Error::other(broken.to_string()))),
                ));
                false
            }
        };
        metrics.converted(ok);
    });
    let stream = futures::stream::unfold(answer, |mut answer| async move {
        answer.recv().await.map(|chunk| (chunk, answer))
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        Body::from_stream(stream),
    )
        .into_response()
}

/// The body's bytes, ending with an error at `deadline`, when it falls behind [`MIN_RATE`]
/// after [`GRACE`], or past [`MAX_BODY`].
fn within(body: Body, deadline: Instant) -> impl Stream<Item = io::Result<Bytes>> + Send {
    // The time spent waiting for the client's bytes (not for this replica to take them).
    let start = Some((body.into_data_stream(), 0u64, Duration::ZERO));
    futures::stream::unfold(start, move |state| async move {
        let (mut stream, read, waited) = state?;
        let allowed = GRACE + Duration::from_secs_f64(read as f64 / MIN_RATE as f64);
        let waiting = Instant::now();
        let keeping_up = waiting + allowed.saturating_sub(waited);
        let next = tokio::time::timeout_at(deadline.min(keeping_up), stream.next()).await;
        let waited = waited + waiting.elapsed();
        let error = match next {
            Err(_) => io::Error::new(
                io::ErrorKind::TimedOut,
                "the body was not received in time (it must arrive at 1 MiB/s after 3 s)",
            ),
            Ok(None) => return None,
            Ok(Some(Err(error))) => io::Error::other(error),
            Ok(Some(Ok(chunk))) => {
                let read = read + chunk.len() as u64;
                if read <= MAX_BODY {
                    return Some((Ok(chunk), Some((stream, read, waited))));
                }
                io::Error::other(format!("the body is over {} MiB", MAX_BODY >> 20))
            }
        };
        Some((Err(error), None))
    })
}

/// The answer's bytes, sent on in chunks; a send waits for the caller to read until the deadline.
struct Chunks {
    sender: mpsc::Sender<io::Result<Bytes>>,
    buffer: BytesMut,
    runtime: tokio::runtime::Handle,
    deadline: Instant,
}

impl Chunks {
    fn send(&mut self) -> io::Result<()> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let chunk = self.buffer.split().freeze();
        let sent = self.runtime.block_on(tokio::time::timeout_at(
            self.deadline,
            self.sender.send(Ok(chunk)),
        ));
        match sent {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the caller went away",
            )),
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the caller did not read the answer in time",
            )),
        }
    }
}

impl io::Write for Chunks {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.buffer.extend_from_slice(bytes);
        if self.buffer.len() >= CHUNK {
            self.send()?;
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send()
    }
}

//! What any client of the webhook port may hold. kube-apiserver presents no client certificate
//! by default, so the port cannot tell it from any other pod: these bounds (and the chart's
//! NetworkPolicy) keep a client that connects and trickles, or floods, from holding memory on
//! every replica until the `Fail` policy blocks every At write.
//!
//! - connections: at most `max_connections` at once; one more is closed on accept;
//! - requests: at most `max_in_flight` at once; one more is answered 429 at once;
//! - time: every request, its body included, is answered within `request_timeout` (408 when
//!   the client is too slow), on top of the TLS handshake and header timeouts.

use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum_server::accept::Accept;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The bounds of one listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_connections: usize,
    pub max_in_flight: usize,
    pub request_timeout: Duration,
}

impl Default for Limits {
    /// kube-apiserver keeps a few connections per replica to a webhook and waits at most 30 s
    /// (the webhooks here say 5 s); these leave it ample room.
    fn default() -> Self {
        Limits {
            max_connections: 256,
            max_in_flight: 64,
            request_timeout: Duration::from_secs(10),
        }
    }
}

/// An acceptor that closes connections beyond the cap; each accepted one holds a permit until
/// it closes.
#[derive(Clone)]
pub struct Capped<A> {
    inner: A,
    permits: Arc<Semaphore>,
}

impl<A> Capped<A> {
    pub fn new(inner: A, max_connections: usize) -> Self {
        Capped {
            inner,
            permits: Arc::new(Semaphore::new(max_connections)),
        }
    }
}

impl<A, I, S> Accept<I, S> for Capped<A>
where
    A: Accept<I, S> + Clone + Send + 'static,
    A::Future: Send,
    A::Stream: Send,
    A::Service: Send,
    I: Send + 'static,
    S: Send + 'static,
{
    type Stream = Counted<A::Stream>;
    type Service = A::Service;
    type Future = Pin<
        Box<dyn std::future::Future<Output = io::Result<(Self::Stream, Self::Service)>> + Send>,
    >;

    fn accept(&self, stream: I, service: S) -> Self::Future {
        let permit = self.permits.clone().try_acquire_owned();
        let inner = self.inner.clone();
        Box::pin(async move {
            let Ok(permit) = permit else {
                // Dropping the stream closes the connection.
                return Err(io::Error::other("too many connections to the webhook port"));
            };
            let (stream, service) = inner.accept(stream, service).await?;
            Ok((
                Counted {
                    inner: stream,
                    _permit: permit,
                },
                service,
            ))
        })
    }
}

/// A connection counted against the cap until dropped.
pub struct Counted<T> {
    inner: T,
    _permit: OwnedSemaphorePermit,
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    /// Passed through, so TLS records that are ready together leave in one system call.
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The middleware state: requests in flight and the deadline.
#[derive(Clone)]
pub struct RequestGuard {
    in_flight: Arc<Semaphore>,
    timeout: Duration,
}

impl RequestGuard {
    pub fn new(limits: Limits) -> Self {
        RequestGuard {
            in_flight: Arc::new(Semaphore::new(limits.max_in_flight)),
            timeout: limits.request_timeout,
        }
    }
}

/// Refuses a request beyond the in-flight cap (429) and cuts one that is not answered, body
/// read included, within the deadline (408).
pub async fn guard(
    axum::extract::State(guard): axum::extract::State<RequestGuard>,
    request: Request,
    next: Next,
) -> Response {
    let Ok(_permit) = guard.in_flight.clone().try_acquire_owned() else {
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, "1")],
            "cnat webhook: too many admission requests in flight on this replica; retry\n",
        )
            .into_response();
    };
    match tokio::time::timeout(guard.timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => (
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "cnat webhook: the request was not received and answered within {:?}\n",
                guard.timeout
            ),
        )
            .into_response(),
    }
}

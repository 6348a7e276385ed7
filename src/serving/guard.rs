//! What any client of a port may hold. kube-apiserver presents no client certificate by
//! default, so the webhook port cannot tell it from any other pod (and any pod can reach the
//! admin port): these bounds (and the chart's NetworkPolicy) keep a client that connects and
//! trickles, or floods, from holding memory or slots on a replica until the `Fail` policy blocks
//! every At write. Each bound is per listener, and also per client address, so that one client
//! (one pod, one node) cannot take what the API server needs:
//!
//! - connections: at most `max_connections` at once, `max_connections_per_client` from one
//!   address; one more is closed on accept;
//! - requests: at most `max_in_flight` at once, `max_in_flight_per_client` from one address;
//!   one more is answered 429 at once;
//! - time: every request, its body included, is answered within `request_timeout` (408 when
//!   the client is too slow), on top of the TLS handshake and header timeouts (which also close
//!   idle connections).

use axum::extract::{ConnectInfo, Request};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum_server::accept::Accept;
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// The bounds of one listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_connections: usize,
    pub max_connections_per_client: usize,
    pub max_in_flight: usize,
    pub max_in_flight_per_client: usize,
    pub request_timeout: Duration,
}

impl Default for Limits {
    /// The webhook port's. kube-apiserver keeps a few connections per replica to a webhook
    /// (a few dozen under a burst of writes) and waits at most 30 s (the webhooks here say
    /// 5 s); these leave it ample room, and leave room for it when one other client takes all
    /// it may.
    fn default() -> Self {
        Limits {
            max_connections: 512,
            max_connections_per_client: 128,
            max_in_flight: 128,
            max_in_flight_per_client: 32,
            request_timeout: Duration::from_secs(10),
        }
    }
}

impl Limits {
    /// The admin port's: the kubelet's probes and a Prometheus or two.
    pub fn admin() -> Self {
        Limits {
            max_connections: 128,
            max_connections_per_client: 16,
            max_in_flight: 32,
            max_in_flight_per_client: 8,
            request_timeout: Duration::from_secs(10),
        }
    }
}

/// Counts of what each client address holds, within a total and a per-client cap. An address
/// is forgotten once it holds nothing, so the map never holds more addresses than the total.
#[derive(Debug)]
pub struct Slots {
    total: usize,
    per_client: usize,
    held: Mutex<(usize, HashMap<IpAddr, usize>)>,
    /// Woken whenever slots are given back.
    freed: tokio::sync::Notify,
}

impl Slots {
    pub fn new(total: usize, per_client: usize) -> Arc<Self> {
        Arc::new(Slots {
            total,
            per_client,
            held: Mutex::default(),
            freed: tokio::sync::Notify::new(),
        })
    }

    /// `n` units for `client`, waiting until `deadline` for others to give them back; `None`
    /// then (or at once when `n` is more than a client may ever hold).
    pub async fn wait_n(
        self: &Arc<Self>,
        client: IpAddr,
        n: usize,
        deadline: tokio::time::Instant,
    ) -> Option<Slot> {
        if n > self.per_client.min(self.total) {
            return None;
        }
        loop {
            let freed = self.freed.notified();
            if let Some(slot) = self.take_n(client, n) {
                return Some(slot);
            }
            tokio::time::timeout_at(deadline, freed).await.ok()?;
        }
    }

    /// A slot for `client`, or `None` when the total or the client's share is taken.
    pub fn take(self: &Arc<Self>, client: IpAddr) -> Option<Slot> {
        self.take_n(client, 1)
    }

    /// `n` units for `client` at once (e.g. the KiB of a request body), or `None` when they
    /// would go past the total or the client's share.
    pub fn take_n(self: &Arc<Self>, client: IpAddr, n: usize) -> Option<Slot> {
        let client = canonical(client);
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let (all, clients) = &mut *held;
        let mine = clients.entry(client).or_insert(0);
        if *all + n > self.total || *mine + n > self.per_client {
            if *mine == 0 {
                clients.remove(&client);
            }
            return None;
        }
        *mine += n;
        *all += n;
        Some(Slot {
            slots: self.clone(),
            client,
            n,
        })
    }

    /// How many slots `client` holds (for tests).
    pub fn held_by(&self, client: IpAddr) -> usize {
        let held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        held.1.get(&canonical(client)).copied().unwrap_or(0)
    }
}

/// An IPv4 client seen through a dual-stack socket counts as the IPv4 address it is.
fn canonical(client: IpAddr) -> IpAddr {
    match client {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(client, IpAddr::V4),
        v4 => v4,
    }
}

/// One slot, given back when dropped.
#[derive(Debug)]
pub struct Slot {
    slots: Arc<Slots>,
    client: IpAddr,
    n: usize,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.slots.held.lock().unwrap_or_else(|e| e.into_inner());
        let (all, clients) = &mut *held;
        *all = all.saturating_sub(self.n);
        if let Some(mine) = clients.get_mut(&self.client) {
            *mine = mine.saturating_sub(self.n);
            if *mine == 0 {
                clients.remove(&self.client);
            }
        }
        drop(held);
        self.slots.freed.notify_waiters();
    }
}

/// An acceptor that closes connections beyond the caps; each accepted one holds a slot until
/// it closes.
#[derive(Clone)]
pub struct Capped<A> {
    inner: A,
    slots: Arc<Slots>,
}

impl<A> Capped<A> {
    pub fn new(inner: A, limits: &Limits) -> Self {
        Capped {
            inner,
            slots: Slots::new(limits.max_connections, limits.max_connections_per_client),
        }
    }

    /// The connections held, per client (for tests).
    pub fn slots(&self) -> Arc<Slots> {
        self.slots.clone()
    }
}

impl<A, S> Accept<TcpStream, S> for Capped<A>
where
    A: Accept<TcpStream, S> + Clone + Send + 'static,
    A::Future: Send,
    A::Stream: Send,
    A::Service: Send,
    S: Send + 'static,
{
    type Stream = Counted<A::Stream>;
    type Service = A::Service;
    type Future = Pin<
        Box<dyn std::future::Future<Output = io::Result<(Self::Stream, Self::Service)>> + Send>,
    >;

    fn accept(&self, stream: TcpStream, service: S) -> Self::Future {
        let permit = stream
            .peer_addr()
            .ok()
            .and_then(|peer| self.slots.take(peer.ip()));
        let inner = self.inner.clone();
        Box::pin(async move {
            let Some(permit) = permit else {
                // Dropping the stream closes the connection.
                return Err(io::Error::other(
                    "too many connections to this port, from this client or in all",
                ));
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
    _permit: Slot,
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

/// An HTTP/1.1 server on `listener` (non-blocking) through `acceptor`, shut down by `handle`,
/// dropping a client whose request headers (or next request, on a kept connection) have not
/// come within `header_timeout`.
pub fn http1_server<Acc>(
    listener: std::net::TcpListener,
    acceptor: Acc,
    handle: axum_server::Handle<SocketAddr>,
    header_timeout: Duration,
) -> io::Result<axum_server::Server<SocketAddr, Acc>> {
    let mut server = axum_server::from_tcp(listener)?
        .acceptor(acceptor)
        .handle(handle)
        .http1_only();
    server
        .http_builder()
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_timeout);
    Ok(server)
}

/// `app` within the request bounds of `limits` ("admission requests" and the like say `what`
/// in the 429), its requests' client address recorded (serve it with
/// `into_make_service_with_connect_info::<SocketAddr>()`).
pub fn guarded(app: axum::Router, limits: Limits, what: &'static str) -> axum::Router {
    app.layer(axum::middleware::from_fn_with_state(
        RequestGuard::new(limits, what),
        guard,
    ))
}

/// The middleware state: requests in flight and the deadline.
#[derive(Clone)]
pub struct RequestGuard {
    in_flight: Arc<Slots>,
    timeout: Duration,
    /// What the requests are, for the 429's message ("admission requests").
    what: &'static str,
}

impl RequestGuard {
    pub fn new(limits: Limits, what: &'static str) -> Self {
        RequestGuard {
            in_flight: Slots::new(limits.max_in_flight, limits.max_in_flight_per_client),
            timeout: limits.request_timeout,
            what,
        }
    }
}

/// Refuses a request beyond the in-flight caps (429) and cuts one that is not answered, body
/// read included, within the deadline (408). The client is the connection's peer (served with
/// `into_make_service_with_connect_info::<SocketAddr>`); a request without one counts as
/// `0.0.0.0`.
pub async fn guard(
    axum::extract::State(guard): axum::extract::State<RequestGuard>,
    request: Request,
    next: Next,
) -> Response {
    let client = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map_or(IpAddr::from([0, 0, 0, 0]), |info| info.0.ip());
    let Some(_permit) = guard.in_flight.take(client) else {
        let what = guard.what;
        return (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, "1")],
            format!("cnat: too many {what} in flight on this replica (from this client, or in all); retry\n"),
        )
            .into_response();
    };
    match tokio::time::timeout(guard.timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => (
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "cnat: the request was not received and answered within {:?}\n",
                guard.timeout
            ),
        )
            .into_response(),
    }
}

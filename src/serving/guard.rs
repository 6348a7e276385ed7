//! What any client of a port may hold: connections, requests in flight and time, per listener
//! and per client address, so that no client can take what the API server needs.
//! See docs/src/operating/security.md, "Hostile callers".

use crate::sync::lock;
use axum::extract::{ConnectInfo, Request};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum_server::accept::Accept;
use futures::task::AtomicWaker;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// The bounds of one listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections in all, shared max-min between client addresses ([`Pool`]).
    pub max_connections: usize,
    pub max_connections_per_client: usize,
    /// Requests answered at once, in all and from one address; one more is answered 429.
    pub max_in_flight: usize,
    pub max_in_flight_per_client: usize,
    /// Every request, its body included, is answered within this (408 when the client is slow).
    pub request_timeout: Duration,
    /// A new connection whose TLS handshake and first request head take longer is closed.
    pub first_request_within: Duration,
    /// A connection answering a request for longer than this (its client does not read the
    /// answer) may be closed to make room like any other.
    pub answer_within: Duration,
}

impl Default for Limits {
    /// The webhook port's: ample room for kube-apiserver's connections, even when another client
    /// takes all it may. Requests in flight are bounded by the connections (one each, HTTP/1.1).
    fn default() -> Self {
        Limits {
            max_connections: 512,
            max_connections_per_client: 128,
            max_in_flight: 1024,
            max_in_flight_per_client: 256,
            request_timeout: Duration::from_secs(10),
            first_request_within: Duration::from_secs(3),
            // Conversions take up to 30 s, their answer's writing included.
            answer_within: Duration::from_secs(30),
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
            first_request_within: Duration::from_secs(3),
            answer_within: Duration::from_secs(10),
        }
    }
}

/// Counts of what each client address holds, within a total and a per-client cap. An address
/// is forgotten once it holds nothing, so the map never holds more addresses than the total.
#[derive(Debug)]
pub struct Slots {
    total: usize,
    per_client: usize,
    /// A client that would hold more than `light` may not take the last `reserve` units.
    light: usize,
    reserve: usize,
    held: Mutex<(usize, HashMap<IpAddr, usize>)>,
    /// Woken whenever slots are given back.
    freed: tokio::sync::Notify,
}

impl Slots {
    pub fn new(total: usize, per_client: usize) -> Arc<Self> {
        Self::with_reserve(total, per_client, per_client, 0)
    }

    /// As [`Slots::new`], keeping the last `reserve` units for clients that hold at most
    /// `light` with them: a few clients taking all they may cannot take everything.
    pub fn with_reserve(
        total: usize,
        per_client: usize,
        light: usize,
        reserve: usize,
    ) -> Arc<Self> {
        Arc::new(Slots {
            total,
            per_client,
            light,
            reserve: reserve.min(total),
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

    /// `n` units for `client` at once (e.g. the KiB of a request body), or `None` when they
    /// would go past the total or the client's share.
    pub fn take_n(self: &Arc<Self>, client: IpAddr, n: usize) -> Option<Slot> {
        let client = canonical(client);
        let mut held = lock(&self.held);
        let (all, clients) = &mut *held;
        let mine = clients.entry(client).or_insert(0);
        let total = match *mine + n > self.light {
            true => self.total - self.reserve,
            false => self.total,
        };
        if *all + n > total || *mine + n > self.per_client {
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
}

/// The address a client's shares are counted by: an IPv4 client seen through a dual-stack
/// socket counts as the IPv4 address it is.
pub fn canonical(client: IpAddr) -> IpAddr {
    match client {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(client, IpAddr::V4),
        v4 => v4,
    }
}

impl Slot {
    /// How many units it holds.
    pub fn units(&self) -> usize {
        self.n
    }

    /// Holds `more` as well (taken for the same client from the same slots), as one.
    pub fn merge(&mut self, mut more: Slot) {
        debug_assert!(Arc::ptr_eq(&self.slots, &more.slots) && self.client == more.client);
        self.n += std::mem::take(&mut more.n);
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
        let mut held = lock(&self.slots.held);
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

/// Where a connection is in its life, for [`Connections`]: only a connection whose request is
/// being answered is never closed to make room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Stage {
    /// Accepted; its TLS handshake and first request head have not come yet (they must within
    /// [`Limits::first_request_within`]).
    Pending = 0,
    /// Between two requests (hyper closes it after its header timeout).
    Idle = 1,
    /// A request's head came and its body is arriving.
    Receiving = 2,
    /// A request is being answered (its body came; a conversion's from when it holds its slot),
    /// until hyper has taken its answer's last bytes.
    Answering = 3,
    /// Closed to make room: its reads and writes fail from now on.
    Closed = 4,
}

impl Stage {
    fn of(value: u8) -> Self {
        match value {
            0 => Stage::Pending,
            1 => Stage::Idle,
            2 => Stage::Receiving,
            3 => Stage::Answering,
            _ => Stage::Closed,
        }
    }
}

/// One accepted connection, as its listener's [`Connections`] knows it (and as each of its
/// requests carries it, in the request's extensions).
#[derive(Debug)]
pub struct Connection {
    /// The order of acceptance: a lower one is older.
    id: u64,
    client: IpAddr,
    stage: AtomicU8,
    /// Counted among the connections whose client presented a certificate.
    certified: AtomicBool,
    accepted: std::time::Instant,
    /// When its stage last changed, in milliseconds since the first connection of the process.
    since: AtomicU64,
    waker: AtomicWaker,
}

/// Milliseconds since the first call (a clock for [`Connection::since`]).
fn millis() -> u64 {
    millis_at(std::time::Instant::now())
}

/// [`millis`] at `at`.
fn millis_at(at: std::time::Instant) -> u64 {
    static START: std::sync::LazyLock<std::time::Instant> =
        std::sync::LazyLock::new(std::time::Instant::now);
    at.saturating_duration_since(*START).as_millis() as u64
}

impl Connection {
    pub fn stage(&self) -> Stage {
        Stage::of(self.stage.load(Ordering::Acquire))
    }

    /// Marks what the connection is doing now (not once it is closed).
    pub fn set(&self, stage: Stage) {
        let set = (self.stage).fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
            (now != Stage::Closed as u8).then_some(stage as u8)
        });
        if set.is_ok() {
            self.since.store(millis(), Ordering::Relaxed);
        }
    }

    fn closed(&self) -> bool {
        self.stage() == Stage::Closed
    }

    /// Whether it has been answering for longer than `within` at `now` (its client does not
    /// read the answer).
    fn overdue(&self, within: Duration, now: u64) -> bool {
        let since = self.since.load(Ordering::Relaxed);
        self.stage() == Stage::Answering && now.saturating_sub(since) > within.as_millis() as u64
    }

    /// Closes it to make room, unless it is being answered (for less than `within`) or already
    /// closed.
    fn close(&self, within: Duration) -> bool {
        let now = millis();
        let closed = (self.stage).fetch_update(Ordering::AcqRel, Ordering::Acquire, |stage| {
            let open = match Stage::of(stage) {
                Stage::Closed => false,
                Stage::Answering => self.overdue(within, now),
                _ => true,
            };
            open.then_some(Stage::Closed as u8)
        });
        self.waker.wake();
        closed.is_ok()
    }
}

/// The connections of one class (any client, or certified clients) within a total and a
/// per-address cap.
#[derive(Debug, Default)]
struct Pool {
    count: usize,
    by_client: HashMap<IpAddr, Vec<Arc<Connection>>>,
}

/// A pending connection younger than this, or a kept one idle for less than this since its last
/// answer, is taken to make room only after every other kind: it is most likely about to be used.
pub const YOUNG: Duration = Duration::from_secs(1);

/// An address that could give up a place: how many it holds, and its first victim with the
/// victim's order (rank, time in its stage, id).
type Candidate<'a> = (usize, (u8, u64, u64), &'a Arc<Connection>);

/// What to do with a new connection from an address that holds `mine` when the pool is full.
#[derive(Debug)]
enum Room {
    Free,
    /// Close this one (of the address holding the most) and take its place.
    Displace(Arc<Connection>),
    Refuse,
}

impl Pool {
    /// Max-min fairness: at the total, a newcomer from an address holding `n` takes the place of
    /// a connection not being answered of an address holding more than `n + 1`; addresses with
    /// nothing to give up do not count, and anyone else is refused. The order of victims is in
    /// docs/src/operating/security.md, "Many addresses".
    fn room(
        &self,
        client: IpAddr,
        limits: (usize, usize, Duration),
        now: std::time::Instant,
    ) -> Room {
        let (total, per_client, answer_within) = limits;
        let mine = self.by_client.get(&client).map_or(0, Vec::len);
        if mine >= per_client {
            return Room::Refuse;
        }
        if self.count < total {
            return Room::Free;
        }
        let clock = millis_at(now);
        let young = YOUNG.as_millis() as u64;
        let rank = |c: &Connection| match c.stage() {
            Stage::Answering if c.overdue(answer_within, clock) => Some(0u8),
            Stage::Pending if now.saturating_duration_since(c.accepted) >= YOUNG => Some(0),
            Stage::Idle if clock.saturating_sub(c.since.load(Ordering::Relaxed)) >= young => {
                Some(1)
            }
            Stage::Receiving => Some(2),
            Stage::Pending | Stage::Idle => Some(3),
            Stage::Answering | Stage::Closed => None,
        };
        // Per address: how many it holds, and the connection it would give up first.
        let candidates: Vec<Candidate<'_>> = (self.by_client.values())
            .filter(|held| held.len() > mine)
            .filter_map(|held| {
                let (key, c) = (held.iter())
                    .filter_map(|c| {
                        let since = c.since.load(Ordering::Relaxed);
                        Some(((rank(c)?, since, c.id), c))
                    })
                    .min_by_key(|(key, _)| *key)?;
                Some((held.len(), key, c))
            })
            .collect();
        let most = candidates
            .iter()
            .map(|(count, ..)| *count)
            .max()
            .unwrap_or(0);
        let takes_from = |held: usize| held > mine + 1 || (mine == 0 && most == 1 && held == 1);
        candidates
            .into_iter()
            .filter(|(count, ..)| takes_from(*count))
            .min_by_key(|(count, key, _)| (std::cmp::Reverse(*count), *key))
            .map_or(Room::Refuse, |(.., c)| Room::Displace(c.clone()))
    }

    fn insert(&mut self, connection: Arc<Connection>) {
        self.count += 1;
        let held = self.by_client.entry(connection.client).or_default();
        // Kept in order of acceptance (ids only grow; a certified connection moves in later).
        let at = held.partition_point(|c| c.id < connection.id);
        held.insert(at, connection);
    }

    /// Forgets `connection`; `false` when it was not here.
    fn remove(&mut self, connection: &Connection) -> bool {
        let Some(held) = self.by_client.get_mut(&connection.client) else {
            return false;
        };
        let Some(at) = held.iter().position(|c| c.id == connection.id) else {
            return false;
        };
        held.remove(at);
        if held.is_empty() {
            self.by_client.remove(&connection.client);
        }
        self.count -= 1;
        true
    }
}

/// The connections of one listener, in two pools of `max_connections` each: any client's, and
/// certified clients' (which no other client can take). See [`Pool::room`] for who gets in.
#[derive(Debug)]
pub struct Connections {
    total: usize,
    per_client: usize,
    first_request_within: Duration,
    answer_within: Duration,
    next_id: AtomicU64,
    /// Any client's, and certified clients'.
    pools: Mutex<[Pool; 2]>,
}

impl Connections {
    pub fn new(limits: &Limits) -> Arc<Self> {
        Arc::new(Connections {
            total: limits.max_connections,
            per_client: limits.max_connections_per_client,
            first_request_within: limits.first_request_within,
            answer_within: limits.answer_within,
            next_id: AtomicU64::new(0),
            pools: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, [Pool; 2]> {
        lock(&self.pools)
    }

    /// A place for a new connection from `client`, or `None` (then it is closed).
    pub fn accept(&self, client: IpAddr) -> Option<Arc<Connection>> {
        self.accept_at(client, std::time::Instant::now())
    }

    /// [`Connections::accept`] at `now`.
    fn accept_at(&self, client: IpAddr, now: std::time::Instant) -> Option<Arc<Connection>> {
        let client = canonical(client);
        let connection = Arc::new(Connection {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            client,
            stage: AtomicU8::new(Stage::Pending as u8),
            certified: AtomicBool::new(false),
            accepted: now,
            since: AtomicU64::new(millis_at(now)),
            waker: AtomicWaker::new(),
        });
        let mut pools = self.lock();
        self.enter(&mut pools[0], connection.clone(), now)
            .then_some(connection)
    }

    /// Moves `connection` into the certified pool (its client presented a certificate the
    /// client CA signed); `false` when there is no room for it there either (then it is closed).
    pub fn certify(&self, connection: &Arc<Connection>) -> bool {
        let mut pools = self.lock();
        let [open, certified] = &mut *pools;
        if connection.closed() || !open.remove(connection) {
            return false;
        }
        connection.certified.store(true, Ordering::Release);
        self.enter(certified, connection.clone(), std::time::Instant::now())
    }

    fn enter(&self, pool: &mut Pool, connection: Arc<Connection>, now: std::time::Instant) -> bool {
        // A victim whose request came meanwhile is not closed: the next one is tried.
        loop {
            let limits = (self.total, self.per_client, self.answer_within);
            match pool.room(connection.client, limits, now) {
                Room::Refuse => return false,
                Room::Displace(victim) => {
                    if !victim.close(self.answer_within) {
                        continue;
                    }
                    pool.remove(&victim);
                }
                Room::Free => {}
            }
            pool.insert(connection);
            return true;
        }
    }

    fn release(&self, connection: &Connection) {
        let mut pools = self.lock();
        let pool = usize::from(connection.certified.load(Ordering::Acquire));
        pools[pool].remove(connection);
    }

    /// How many connections `client` holds, in both pools (for tests).
    #[cfg(test)]
    pub fn held_by(&self, client: IpAddr) -> usize {
        let client = canonical(client);
        let pools = self.lock();
        pools
            .iter()
            .map(|pool| pool.by_client.get(&client).map_or(0, Vec::len))
            .sum()
    }
}

/// An acceptor that closes connections beyond the caps (see [`Connections`]); each accepted one
/// holds its place until it closes, and each of its requests carries its [`Connection`].
#[derive(Clone)]
pub struct Capped<A> {
    inner: A,
    connections: Arc<Connections>,
}

impl<A> Capped<A> {
    pub fn new(inner: A, limits: &Limits) -> Self {
        Capped {
            inner,
            connections: Connections::new(limits),
        }
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
    type Service = axum::middleware::AddExtension<A::Service, Arc<Connection>>;
    type Future = Pin<
        Box<dyn std::future::Future<Output = io::Result<(Self::Stream, Self::Service)>> + Send>,
    >;

    fn accept(&self, stream: TcpStream, service: S) -> Self::Future {
        // Given back if the inner acceptor fails (or the future is dropped).
        let place = stream
            .peer_addr()
            .ok()
            .and_then(|peer| self.connections.accept(peer.ip()))
            .map(|connection| Place {
                connection,
                connections: self.connections.clone(),
            });
        let inner = self.inner.clone();
        Box::pin(async move {
            let Some(place) = place else {
                // Dropping the stream closes the connection.
                return Err(io::Error::other(
                    "too many connections to this port, from this client or in all",
                ));
            };
            let deadline = place.connections.first_request_within;
            let (stream, service) = inner.accept(stream, service).await?;
            let service =
                tower_layer::Layer::layer(&axum::Extension(place.connection.clone()), service);
            let first_request = Some(Box::pin(tokio::time::sleep(deadline)));
            Ok((
                Counted {
                    inner: stream,
                    place,
                    first_request,
                },
                service,
            ))
        })
    }
}

/// A connection's place in its listener's [`Connections`], given back when dropped.
struct Place {
    connection: Arc<Connection>,
    connections: Arc<Connections>,
}

impl Drop for Place {
    fn drop(&mut self) {
        self.connections.release(&self.connection);
    }
}

/// A connection counted against the caps until dropped; closed when displaced, or when its
/// first request has not come within the deadline.
pub struct Counted<T> {
    inner: T,
    place: Place,
    first_request: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// A stream that knows the [`Connection`] it is (the TLS layer's certification moves it).
pub trait Tracked {
    fn certify(&self) -> bool;
}

impl<T> Tracked for Counted<T> {
    /// Moves this connection into the certified pool; `false` when there is no room there.
    fn certify(&self) -> bool {
        self.place.connections.certify(&self.place.connection)
    }
}

impl<T> Counted<T> {
    /// `Err` once the connection was displaced, or is still waiting for its first request past
    /// the deadline; registers the task to be woken for either.
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        let connection = &self.place.connection;
        connection.waker.register(cx.waker());
        if connection.closed() {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "closed to make room for another client's connection",
            ));
        }
        if let Some(first_request) = &mut self.first_request {
            if connection.stage() != Stage::Pending {
                self.first_request = None;
            } else if first_request.as_mut().poll(cx).is_ready() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no request within the deadline of a new connection",
                ));
            }
        }
        Ok(())
    }

    fn stream(&mut self) -> Pin<&mut T>
    where
        T: Unpin,
    {
        Pin::new(&mut self.inner)
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.check(cx)?;
        self.stream().poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.check(cx)?;
        self.stream().poll_write(cx, buf)
    }

    /// Passed through, so TLS records that are ready together leave in one system call.
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.check(cx)?;
        self.stream().poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.stream().poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.stream().poll_shutdown(cx)
    }
}

/// An HTTP/1.1 server on `listener` (non-blocking) through `acceptor`, shut down by `handle`,
/// dropping a client whose (next) request headers have not come within `header_timeout`.
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

/// The connection `request` came on (when served through [`Capped`]): a route that reads the
/// body marks it [`Stage::Answering`] once it has, so that it is not closed to make room.
pub fn connection_of(request: &Request) -> Option<Arc<Connection>> {
    request.extensions().get::<Arc<Connection>>().cloned()
}

/// The address of the caller, as `into_make_service_with_connect_info::<SocketAddr>()` records
/// it (`0.0.0.0` when it is not known).
pub fn client_of(request: &Request) -> IpAddr {
    request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map_or(IpAddr::from([0, 0, 0, 0]), |info| info.0.ip())
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
/// read included, within the deadline (408). A request without a peer address counts as `0.0.0.0`.
pub async fn guard(
    axum::extract::State(guard): axum::extract::State<RequestGuard>,
    request: Request,
    next: Next,
) -> Response {
    let client = client_of(&request);
    let connection = connection_of(&request);
    let Some(_permit) = guard.in_flight.take_n(client, 1) else {
        if let Some(connection) = &connection {
            connection.set(Stage::Idle);
        }
        let what = guard.what;
        return busy(format!(
            "cnat: too many {what} in flight on this replica (from this client, or in all); retry\n"
        ));
    };
    if let Some(connection) = &connection {
        // A request without a body (a GET) is answered at once; one with a body once the
        // route has read it (and marks it so).
        use axum::body::HttpBody;
        connection.set(match request.body().is_end_stream() {
            true => Stage::Answering,
            false => Stage::Receiving,
        });
    }
    let answered = tokio::time::timeout(guard.timeout, next.run(request)).await;
    // Idle once the answer is written (or given up).
    let idle = |response: Response| match connection {
        Some(connection) => response.map(|body| {
            axum::body::Body::new(UntilWritten {
                body,
                connection: Some(connection),
            })
        }),
        None => response,
    };
    idle(match answered {
        Ok(response) => response,
        Err(_) => (
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "cnat: the request was not received and answered within {:?}\n",
                guard.timeout
            ),
        )
            .into_response(),
    })
}

/// An answer's body that marks its connection idle once it is written to its end, or dropped.
struct UntilWritten {
    body: axum::body::Body,
    connection: Option<Arc<Connection>>,
}

impl UntilWritten {
    fn written(&mut self) {
        if let Some(connection) = self.connection.take() {
            connection.set(Stage::Idle);
        }
    }
}

impl Drop for UntilWritten {
    fn drop(&mut self) {
        self.written();
    }
}

impl http_body::Body for UntilWritten {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let frame = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(None) = frame {
            self.written();
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// 429 with `Retry-After: 1` (kube-apiserver resends such an answer to an admission review).
pub fn busy(message: String) -> Response {
    (
        StatusCode::TOO_MANY_REQUESTS,
        [(header::RETRY_AFTER, "1")],
        message,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(total: usize, per_client: usize) -> Limits {
        Limits {
            max_connections: total,
            max_connections_per_client: per_client,
            ..Limits::default()
        }
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn below_the_total_any_address_below_its_cap_gets_in() {
        let connections = Connections::new(&limits(4, 2));
        let held: Vec<_> = (0..2).map(|_| connections.accept(ip(1)).unwrap()).collect();
        assert!(connections.accept(ip(1)).is_none(), "its cap");
        assert!(connections.accept(ip(2)).is_some());
        assert_eq!(connections.held_by(ip(1)), 2);
        drop(held);
    }

    #[test]
    fn at_the_total_a_newcomer_takes_a_place_of_the_address_holding_the_most_never_one_answering() {
        let connections = Connections::new(&limits(7, 7));
        let start = std::time::Instant::now();
        let heavy: Vec<_> = (0..3).map(|_| connections.accept(ip(1)).unwrap()).collect();
        heavy[0].set(Stage::Answering);
        heavy[1].set(Stage::Receiving);
        heavy[2].set(Stage::Idle);
        // A second later (the idle one is no longer young): a new pending one, a kept one just
        // idle again after an answer, and another address's two.
        let later = start + 2 * YOUNG;
        let new = connections.accept_at(ip(1), later).unwrap();
        let kept = connections.accept_at(ip(1), later).unwrap();
        kept.set(Stage::Answering);
        kept.set(Stage::Idle);
        kept.since.store(millis_at(later), Ordering::Relaxed);
        let light: Vec<_> = (0..2)
            .map(|_| connections.accept_at(ip(2), later).unwrap())
            .collect();
        // Of the heaviest: one idle since long before one receiving a body before a new
        // pending one or one that just answered.
        let newcomer = connections
            .accept_at(ip(3), later)
            .expect("a place is made");
        assert_eq!(newcomer.stage(), Stage::Pending);
        assert!(heavy[2].closed());
        let _second = connections.accept_at(ip(4), later).unwrap();
        assert!(heavy[1].closed());
        // 3, 2, 1, 1: of two young ones, the older.
        let _third = connections.accept_at(ip(5), later).unwrap();
        assert!(new.closed() && !kept.closed());
        // 2, 2, 1, 1, 1: of the two holding the most, the oldest.
        let _fourth = connections.accept_at(ip(6), later).unwrap();
        assert!(kept.closed());
        assert!(!heavy[0].closed() && !light[0].closed() && !light[1].closed());
        // 1 (answering), 2, 1, 1, 1, 1: the second address's, then nobody holds more than one
        // and one holding none may take another's only place, but not the answering one.
        let _fifth = connections.accept(ip(7)).unwrap();
        assert!(light[0].closed());
        assert!(connections.accept(ip(8)).is_some());
        assert!(!heavy[0].closed(), "being answered");
        assert!(
            connections.accept(ip(1)).is_none(),
            "holds as many as anyone"
        );
    }

    #[test]
    fn an_address_holding_no_fewer_than_anyone_is_refused() {
        let connections = Connections::new(&limits(4, 4));
        let held: Vec<_> = (1..=2)
            .flat_map(|a| [connections.accept(ip(a)), connections.accept(ip(a))])
            .map(Option::unwrap)
            .collect();
        // 2 and 2: a third from either would not make it fairer.
        assert!(connections.accept(ip(1)).is_none());
        assert!(connections.accept(ip(2)).is_none());
        // A new address gets one (2 > 0 + 1), from the oldest of the first address.
        assert!(connections.accept(ip(3)).is_some());
        assert!(held[0].closed());
        // Every place answering: nothing can be taken.
        let all = Connections::new(&limits(2, 2));
        let busy: Vec<_> = (0..2).map(|_| all.accept(ip(1)).unwrap()).collect();
        busy.iter().for_each(|c| c.set(Stage::Answering));
        assert!(all.accept(ip(2)).is_none());
        // A connection that is being answered is not closed, nor marked anything else after.
        let within = Duration::from_secs(30);
        busy[0].set(Stage::Idle);
        assert!(busy[0].close(within));
        busy[0].set(Stage::Receiving);
        assert!(busy[0].closed());
        assert!(!busy[1].close(within));
        // Unless it has been answering past the limit (its client does not read).
        assert!(
            busy[1].close(Duration::ZERO) || {
                std::thread::sleep(Duration::from_millis(2));
                busy[1].close(Duration::ZERO)
            }
        );
    }

    #[test]
    fn a_pending_connection_past_its_youth_goes_first_a_young_one_last() {
        let connections = Connections::new(&limits(3, 3));
        let held: Vec<_> = [1, 1, 1]
            .into_iter()
            .map(|a| connections.accept(ip(a)).unwrap())
            .collect();
        held[0].set(Stage::Receiving);
        held[1].set(Stage::Idle);
        let now = std::time::Instant::now();
        let pool = &connections.lock()[0];
        let within = Duration::from_secs(30);
        let victim = |at| match pool.room(ip(2), (3, 3, within), at) {
            Room::Displace(victim) => victim.id,
            other => panic!("{other:?}"),
        };
        // Young: the one receiving a body before the pending one and the one just idle.
        assert_eq!(victim(now), held[0].id);
        // Past their youth: the idle one before the one receiving, and the pending one before
        // either.
        held[2].set(Stage::Answering);
        assert_eq!(victim(now + 2 * YOUNG), held[1].id);
        held[2].set(Stage::Pending);
        assert_eq!(victim(now + 2 * YOUNG), held[2].id);
    }

    #[test]
    fn certified_connections_have_a_pool_no_other_client_can_take() {
        let connections = Connections::new(&limits(2, 2));
        let apiserver = connections.accept(ip(1)).unwrap();
        assert!(connections.certify(&apiserver));
        // The open pool fills with others' connections; they displace each other, not it.
        let others: Vec<_> = (2..=9).filter_map(|a| connections.accept(ip(a))).collect();
        assert_eq!(others.len(), 8, "each swaps in for an older one");
        assert!(!apiserver.closed());
        assert_eq!(connections.held_by(ip(1)), 1);
        // A second certified one from the same client, and a third that finds no room.
        let again = connections.accept(ip(1)).unwrap();
        assert!(connections.certify(&again));
        let third = connections.accept(ip(1)).unwrap();
        assert!(!connections.certify(&third), "the certified pool is full");
        // Giving back a certified place frees it in its pool.
        connections.release(&apiserver);
        let fourth = connections.accept(ip(1)).unwrap();
        assert!(connections.certify(&fourth));
    }

    #[test]
    fn an_ipv4_client_through_a_dual_stack_socket_counts_as_its_ipv4_address() {
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(canonical(mapped), ip(1));
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(canonical(v6), v6);
    }

    #[test]
    fn the_reserve_of_slots_is_kept_for_clients_holding_little() {
        let slots = Slots::with_reserve(16, 8, 2, 4);
        let a = slots.take_n(ip(1), 8).unwrap();
        assert!(
            slots.take_n(ip(2), 6).is_none(),
            "would take from the reserve"
        );
        let b = slots.take_n(ip(2), 4).unwrap();
        // 12 of 16 taken: the last 4 only in pieces of at most 2 per client.
        assert!(slots.take_n(ip(3), 3).is_none());
        let c = slots.take_n(ip(3), 2).unwrap();
        let d = slots.take_n(ip(4), 2).unwrap();
        assert!(slots.take_n(ip(5), 1).is_none(), "all taken");
        drop((a, b, c, d));
    }
}

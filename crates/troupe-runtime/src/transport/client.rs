//! [`TransportClient`]: invokes actors on one remote node over one multiplexed connection.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use troupe_core::{ActorId, CallContext, Deadline, InvokeError};

use super::budget::{BudgetedFrame, ByteBudget};
use super::clock_sync::ClockSync;
use super::frame::{encode_frame, read_frame, write_frames, FrameError};
use super::round_trips::RoundTrips;
use super::wire::{ClientMessage, GoingAway, Hello, Probe, ServerMessage, WireCancel, WireRequest, WireResponse};
use super::{
    CLIENT_CONNECTION_IDLE_TIMEOUT_MS, CLIENT_REQUESTS_IN_FLIGHT_MAX, CLOCK_RESYNC_INTERVAL_MS, CONNECT_TIMEOUT_MS,
    FRAME_SIZE_MAX_BYTES, HANDSHAKE_FRAME_SIZE_MAX_BYTES, RETURN_ALLOWANCE_SHARE_OF_LEFT_MAX_PERCENT,
    WRITE_QUEUE_CAPACITY,
};
use crate::{Clock, IdempotencyKey};

/// Invokes actors hosted by the runtime behind one [`TransportServer`](super::TransportServer).
///
/// Connects lazily on the first call and multiplexes every concurrent call over that one
/// connection, matching replies to calls by request id. Each new connection starts with
/// a clock handshake, so deadlines cross it as absolute instants on the server's clock
/// (see the transport module's documentation in the source). When the connection breaks,
/// every call pending on it fails at once with [`InvokeError::Unreachable`] and the next
/// call connects (and handshakes) again. When its server stops, it says how many of the
/// connection's requests it read: the others fail as never sent
/// ([`Delivery::NeverSent`]). Never retries a request.
///
/// A connection is opened by a task of its own, bounded by
/// [`CONNECT_TIMEOUT_MS`] and not by any caller's deadline:
/// every caller that needs it waits for that one attempt until its own deadline, and a
/// caller that gives up early does not cancel it for the others. A connection with no
/// call pending for [`CLIENT_CONNECTION_IDLE_TIMEOUT_MS`]
/// is closed; the next call opens a new one (nothing had been sent on the old one, so
/// nothing fails).
///
/// Share it (`Arc<TransportClient>`); every method takes `&self`.
#[derive(Debug)]
pub struct TransportClient {
    shared: Arc<ClientShared>,
    next_request_id: AtomicU64,
    /// One permit per request in flight; a permit lives as long as its pending entry.
    slots: Arc<Semaphore>,
}

/// What a [`TransportClient`] did, for tests, the simulator and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransportClientStats {
    /// Calls now holding an in-flight slot: connecting, or sent and waiting for a reply (at most
    /// [`CLIENT_REQUESTS_IN_FLIGHT_MAX`]).
    pub requests_in_flight: usize,
    /// Connections opened (TCP connected) since the client was created.
    pub connections_opened: u64,
    /// Connections that broke (reset, end of stream, bad frame) while in use, or failed
    /// or timed out in their clock handshake.
    pub connections_broken: u64,
    /// Connections this client closed after
    /// [`CLIENT_CONNECTION_IDLE_TIMEOUT_MS`]
    /// without a call.
    pub connections_closed_idle: u64,
    /// Replies that arrived after their caller stopped waiting, and were dropped.
    pub late_replies_discarded: u64,
    /// Clock handshakes completed: one per connection opened, plus refreshes.
    pub clock_syncs: u64,
    /// The current connection's estimate of the server's clock minus this client's, in
    /// microseconds (`None` without an open connection, or while one is being opened).
    pub clock_offset_estimate_us: Option<i64>,
    /// The error bound of that estimate (half the handshake's round trip), in
    /// microseconds; deadlines are sent this much (plus rounding and drift allowance)
    /// earlier than the estimate says.
    pub clock_offset_error_us: Option<u64>,
    /// The current connection's return allowance, in microseconds: how much earlier
    /// than its caller's deadline a request's host is told to answer, so the answer has
    /// time to travel back, beyond the handshake's return leg the clock translation
    /// keeps: [`RETURN_ALLOWANCE_MS_MIN`](super::RETURN_ALLOWANCE_MS_MIN) plus the
    /// spread of the connection's recent round trips, at most
    /// [`RETURN_ALLOWANCE_MS_MAX`](super::RETURN_ALLOWANCE_MS_MAX); `None` without an
    /// open connection.
    pub return_allowance_us: Option<u64>,
    /// Calls sent with less than the return allowance, because the allowance was more
    /// than [`RETURN_ALLOWANCE_SHARE_OF_LEFT_MAX_PERCENT`](super::RETURN_ALLOWANCE_SHARE_OF_LEFT_MAX_PERCENT)
    /// of the time they had left: their host was given the rest, and an answer slower
    /// than the share kept ends `Timeout`.
    pub requests_allowance_capped: u64,
    /// Bytes of request frames queued and not yet written (at most
    /// [`CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES`](super::CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES)).
    pub bytes_in_flight: usize,
    /// Cancel frames queued: a caller stopped waiting for a request it had sent, before
    /// its reply (its future was dropped, or its deadline passed).
    pub cancels_sent: u64,
    /// Cancels that could not be queued because the connection's write queue or byte
    /// budget was full at that moment; those requests run on remotely until their own
    /// deadline (never later than their caller's).
    pub cancels_dropped: u64,
    /// Connections whose server said it was going away (it stopped: its node left)
    /// and closed them.
    pub connections_server_went_away: u64,
    /// Requests written on a connection whose server then went away without reading
    /// them: they failed `Unreachable` as never sent ([`Delivery::NeverSent`]).
    pub requests_not_read: u64,
}

#[derive(Debug, Default)]
struct Counters {
    connections_opened: AtomicU64,
    connections_broken: AtomicU64,
    connections_closed_idle: AtomicU64,
    late_replies_discarded: AtomicU64,
    clock_syncs: AtomicU64,
    bytes_in_flight: Arc<AtomicUsize>,
    cancels_sent: AtomicU64,
    cancels_dropped: AtomicU64,
    connections_server_went_away: AtomicU64,
    requests_not_read: AtomicU64,
    requests_allowance_capped: AtomicU64,
}

/// What the client shares with its connect and connection tasks.
#[derive(Debug)]
struct ClientShared {
    address: SocketAddr,
    clock: Clock,
    counters: Arc<Counters>,
    connection: Mutex<ConnectionSlot>,
}

/// How a connection attempt ended, as its waiting callers see it.
type ConnectOutcome = Result<Arc<Connection>, String>;

/// The client's connection, or the attempt to open one.
#[derive(Debug)]
enum ConnectionSlot {
    /// No connection, and none being opened.
    Empty,
    /// A connect task is opening one; it reports to each of these callers (one
    /// oneshot each rather than a `watch`: tokio's `watch` wakes its waiters in an order
    /// drawn from an unseeded random generator, which breaks seed replay under madsim).
    Connecting(Vec<oneshot::Sender<ConnectOutcome>>),
    /// The connection of the last successful attempt (possibly closed since).
    Open(Arc<Connection>),
}

/// What a request asks of the server: one of the four forms a [`TransportClient`]
/// sends, for [`TransportClient::attempt`].
#[derive(Debug, Clone, Copy)]
pub enum RequestKind<'a> {
    /// Run it and answer the reply.
    Invoke,
    /// Run it as one attempt of the keyed request `.0` names, and answer the reply.
    Keyed(&'a IdempotencyKey),
    /// Answer once the target's runtime accepted it (fire-and-forget).
    Tell,
    /// As `Tell`, for one delivery of the message `.0` names.
    KeyedTell(&'a IdempotencyKey),
}

/// How far a request that failed got: whether any of it may have reached the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// The server never read the request: no connection could be had (refused, timed
    /// out, the handshake failed), the connection had closed before the request was
    /// queued on it, the deadline passed first, or the server, stopping, said it had
    /// not read it (since protocol version 7). It did not run, and sending it again (to
    /// this server or another) cannot run it twice.
    NeverSent,
    /// The request was queued on an open connection, so it may have reached the
    /// server and run even though no reply came back (the connection broke, the
    /// deadline passed). Sending it again may run it twice, unless it is keyed.
    MaybeSent,
}

/// A failed [`TransportClient::attempt`]: the error the call ends with, and whether
/// the request may have reached the server.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestFailure {
    /// What the caller of [`TransportClient::invoke`] (or its siblings) gets.
    pub error: InvokeError,
    /// Whether the request may have reached the server.
    pub delivery: Delivery,
}

impl RequestFailure {
    fn never_sent(error: InvokeError) -> Self {
        Self {
            error,
            delivery: Delivery::NeverSent,
        }
    }

    fn maybe_sent(error: InvokeError) -> Self {
        Self {
            error,
            delivery: Delivery::MaybeSent,
        }
    }

    /// Whether the request never reached the server ([`Delivery::NeverSent`]).
    pub fn was_never_sent(&self) -> bool {
        self.delivery == Delivery::NeverSent
    }
}

/// How a pending call ended on the connection's side.
#[derive(Debug)]
enum Outcome {
    Reply(Result<Bytes, InvokeError>),
    /// The connection closed before the reply: the request may have been read.
    Broken(String),
    /// The server went away without reading the request: it did not run.
    NotRead(String),
}

/// One open connection: the queue to its writer, the calls waiting on it and its clock
/// bound. Dropping the last `Arc` closes the queue, which ends the connection's task and
/// closes the socket.
#[derive(Debug)]
struct Connection {
    frames: mpsc::Sender<BudgetedFrame>,
    budget: ByteBudget,
    pending: Arc<Pending>,
    sync: Arc<SyncState>,
}

/// The connection's clock bound and round trips, refreshed by hellos on the open
/// connection.
#[derive(Debug)]
struct SyncState {
    current: Mutex<SyncSamples>,
    /// A refresh hello is queued or in flight; at most one at a time.
    refreshing: AtomicBool,
}

/// What the connection's hellos measured.
#[derive(Debug, Clone, Copy)]
struct SyncSamples {
    /// The tightest clock bound (without a return allowance).
    bound: ClockSync,
    round_trips: RoundTrips,
}

impl SyncState {
    fn new(handshake: ClockSync) -> Self {
        Self {
            current: Mutex::new(SyncSamples {
                bound: handshake,
                round_trips: RoundTrips::new(handshake.round_trip_us()),
            }),
            refreshing: AtomicBool::new(false),
        }
    }

    /// The translation for requests sent now: the tightest bound, with the return
    /// allowance of the recent round trips.
    fn get(&self) -> ClockSync {
        // Reads the allowance kept with the samples; copies only the bound.
        let samples = self.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        samples
            .bound
            .with_return_allowance(samples.round_trips.return_allowance_us())
    }

    /// Keeps whichever of the current and `fresh` bounds gives more time at `now`
    /// (both are valid lower bounds), and `fresh`'s round trip among the recent ones.
    fn offer(&self, fresh: ClockSync, now: Deadline) {
        let mut current = self.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        current.bound = current.bound.tighter(fresh, now);
        current.round_trips.record(fresh.round_trip_us());
        self.refreshing.store(false, Ordering::Relaxed);
    }
}

/// The calls waiting on one connection, by request id.
#[derive(Debug)]
struct Pending {
    clock: Clock,
    state: Mutex<PendingState>,
}

#[derive(Debug)]
struct PendingState {
    waiting: BTreeMap<u64, Waiting>,
    /// Set once, when the connection closes; nothing registers or is queued after that.
    closed: Option<Closure>,
    /// When a call last registered or ended on this connection.
    last_active: Deadline,
    /// Request frames queued on the connection so far: the next one's place in the
    /// order the server reads them.
    requests_queued: u64,
}

/// A call waiting on a connection.
#[derive(Debug)]
struct Waiting {
    reply: oneshot::Sender<Outcome>,
    /// The request's place among the request frames queued on this connection (the
    /// writer writes them in that order, the server reads them in it), once queued.
    place: Option<u64>,
}

/// Why a connection takes no more calls.
#[derive(Debug, Clone)]
enum Closure {
    /// Closed by this client after being idle: nothing was lost, use a new one.
    Retired,
    /// Broke, with this cause.
    Broken(String),
}

impl Pending {
    fn new(clock: Clock) -> Self {
        Self {
            clock,
            state: Mutex::new(PendingState {
                waiting: BTreeMap::new(),
                closed: None,
                last_active: clock.now(),
                requests_queued: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PendingState> {
        // Nothing panics while holding the lock; recover the data if something did.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn is_closed(&self) -> bool {
        self.lock().closed.is_some()
    }

    /// Registers a call, unless the connection is already closed.
    fn register(&self, request_id: u64, waiter: oneshot::Sender<Outcome>) -> Result<(), Closure> {
        let now = self.clock.now();
        let mut state = self.lock();
        if let Some(closure) = &state.closed {
            return Err(closure.clone());
        }
        let previous = state.waiting.insert(
            request_id,
            Waiting {
                reply: waiter,
                place: None,
            },
        );
        assert!(previous.is_none(), "request id {request_id} registered twice");
        state.last_active = state.last_active.max(now);
        Ok(())
    }

    /// Queues request `request_id`'s `frame` in the place reserved on the connection's
    /// writer queue, and notes its place among the connection's requests, under the
    /// lock, so that places follow the queue's order, unless the connection is closed
    /// (then nothing is queued).
    fn queue(
        &self,
        request_id: u64,
        place_in_queue: mpsc::Permit<'_, BudgetedFrame>,
        frame: BudgetedFrame,
    ) -> Result<(), Closure> {
        let mut state = self.lock();
        if let Some(closure) = &state.closed {
            return Err(closure.clone());
        }
        let place = state.requests_queued;
        state.requests_queued += 1;
        if let Some(waiting) = state.waiting.get_mut(&request_id) {
            waiting.place = Some(place);
        }
        place_in_queue.send(frame);
        Ok(())
    }

    /// Removes a call that stopped waiting; `true` if it was still waiting for its reply
    /// (no reply arrived and the connection did not break).
    fn remove(&self, request_id: u64) -> bool {
        let now = self.clock.now();
        let mut state = self.lock();
        let was_waiting = state.waiting.remove(&request_id).is_some();
        state.last_active = state.last_active.max(now);
        was_waiting && state.closed.is_none()
    }

    /// Hands a reply to its caller; `false` if nobody waits for it any more.
    fn complete(&self, response: WireResponse) -> bool {
        let now = self.clock.now();
        let waiter = {
            let mut state = self.lock();
            state.last_active = state.last_active.max(now);
            state.waiting.remove(&response.request_id)
        };
        match waiter {
            Some(waiter) => waiter.reply.send(Outcome::Reply(response.result)).is_ok(),
            None => false,
        }
    }

    /// Marks the connection broken and fails every waiting call with `cause`.
    fn break_all(&self, cause: &str) {
        let waiting = {
            let mut state = self.lock();
            state.closed.get_or_insert_with(|| Closure::Broken(cause.to_string()));
            std::mem::take(&mut state.waiting)
        };
        for waiter in waiting.into_values() {
            // The caller may have stopped waiting already.
            let _ = waiter.reply.send(Outcome::Broken(cause.to_string()));
        }
    }

    /// The server went away having read the first `going_away.requests_read` requests
    /// queued on this connection: marks the connection broken and fails every waiting
    /// call, those queued later as never read ([`Outcome::NotRead`]), the others as
    /// broken (they may have run). A call not yet queued is not answered: it finds the
    /// connection closed when it tries to queue. Returns how many failed as never read.
    fn go_away(&self, going_away: GoingAway, address: SocketAddr) -> u64 {
        let GoingAway { requests_read } = going_away;
        let broken =
            format!("the server at {address} went away (it stopped) after reading this request, without answering it");
        let not_read = format!("the server at {address} went away (it stopped) without reading this request");
        let waiting = {
            let mut state = self.lock();
            state.closed.get_or_insert_with(|| Closure::Broken(broken.clone()));
            std::mem::take(&mut state.waiting)
        };
        let mut failed_not_read = 0;
        for waiter in waiting.into_values() {
            // The caller may have stopped waiting already.
            let _ = match waiter.place {
                Some(place) if place >= requests_read => {
                    failed_not_read += 1;
                    waiter.reply.send(Outcome::NotRead(not_read.clone()))
                }
                Some(_) => waiter.reply.send(Outcome::Broken(broken.clone())),
                None => Ok(()),
            };
        }
        failed_not_read
    }

    /// Returns once no call has been pending for [`CLIENT_CONNECTION_IDLE_TIMEOUT_MS`],
    /// having marked the connection retired (atomically with that check, so no call
    /// registers on a connection being closed).
    async fn until_retired(&self) {
        let idle_timeout = Duration::from_millis(CLIENT_CONNECTION_IDLE_TIMEOUT_MS);
        loop {
            let now = self.clock.now();
            let wait = {
                let mut state = self.lock();
                if state.closed.is_some() {
                    // Broken meanwhile: the connection task ends on its own.
                    idle_timeout
                } else if !state.waiting.is_empty() {
                    // Every call that ends touches `last_active`; look again within one timeout.
                    idle_timeout
                } else {
                    let idle_until = Deadline::after(state.last_active, idle_timeout);
                    if idle_until.has_passed(now) {
                        state.closed = Some(Closure::Retired);
                        return;
                    }
                    idle_until.remaining(now)
                }
            };
            tokio::time::sleep(wait).await;
        }
    }
}

/// A registered call: frees its pending entry and its in-flight slot when dropped, so a
/// caller that stops waiting (deadline, cancellation) leaves nothing behind. Once its
/// request is queued on the connection (`sent`), dropping it before its deadline while
/// the call still waits for its reply also queues a cancel for the request, so the
/// server drops the call. At the deadline no cancel is sent: the server's deadline for
/// the request, never later than the caller's, has passed too.
struct PendingEntry {
    pending: Arc<Pending>,
    request_id: u64,
    deadline: Deadline,
    _slot: OwnedSemaphorePermit,
    /// The connection the request was queued on, once it was.
    sent: Option<Arc<Connection>>,
    counters: Arc<Counters>,
}

impl Drop for PendingEntry {
    fn drop(&mut self) {
        let was_waiting = self.pending.remove(self.request_id);
        let Some(connection) = self.sent.take() else {
            return;
        };
        if !was_waiting || self.deadline.has_passed(self.pending.clock.now()) {
            // Answered, or the connection broke (the server then drops the call itself),
            // or the deadline passed (the server's has passed too).
            return;
        }
        // Never waits (this is a drop): a full queue or budget loses the cancel, and
        // the request then runs on remotely until its own deadline.
        let cancel = ClientMessage::Cancel(WireCancel {
            request_id: self.request_id,
        });
        let queued = encode_frame(&cancel).is_ok_and(|frame| {
            connection.budget.try_acquire(frame.len()).is_some_and(|permit| {
                connection
                    .frames
                    .try_send(BudgetedFrame { frame, _permit: permit })
                    .is_ok()
            })
        });
        let counter = if queued {
            &self.counters.cancels_sent
        } else {
            &self.counters.cancels_dropped
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

impl ClientShared {
    fn lock_connection(&self) -> std::sync::MutexGuard<'_, ConnectionSlot> {
        // Nothing panics while holding the lock; recover the data if something did.
        self.connection
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Opens a connection and does its clock handshake, within [`CONNECT_TIMEOUT_MS`].
    ///
    /// # Errors
    /// Why no connection could be opened: refused, timed out, or the handshake failed.
    async fn connect(&self) -> Result<Arc<Connection>, String> {
        let deadline = self.clock.deadline_in(Duration::from_millis(CONNECT_TIMEOUT_MS));
        let address = self.address;
        let mut stream = match self.clock.run_until(deadline, TcpStream::connect(address)).await {
            Err(_elapsed) => {
                return Err(format!(
                    "connecting to {address} timed out after {CONNECT_TIMEOUT_MS} ms"
                ))
            }
            Ok(connected) => connected.map_err(|error| format!("connecting to {address} failed: {error}"))?,
        };
        // Nagle would hold small requests back; failing to disable it only costs latency.
        let _ = stream.set_nodelay(true);
        self.counters.connections_opened.fetch_add(1, Ordering::Relaxed);
        let handshake = match self
            .clock
            .run_until(deadline, handshake(&mut stream, &self.clock))
            .await
        {
            Err(_elapsed) => Err(format!(
                "the clock handshake with {address} timed out (connecting has {CONNECT_TIMEOUT_MS} ms in all)"
            )),
            Ok(handshake) => handshake.map_err(|error| format!("the clock handshake with {address} failed: {error}")),
        };
        let sync = handshake.inspect_err(|_| {
            self.counters.connections_broken.fetch_add(1, Ordering::Relaxed);
        })?;
        self.counters.clock_syncs.fetch_add(1, Ordering::Relaxed);
        Ok(Connection::open(
            stream,
            address,
            Arc::clone(&self.counters),
            self.clock,
            sync,
        ))
    }
}

/// The connect task: opens a connection, stores it in the client's slot (or empties the
/// slot on failure) and reports the outcome to every caller waiting for it, in the
/// order they came. Runs to its end whatever happens to the callers: bounded by
/// [`CONNECT_TIMEOUT_MS`], not by them.
async fn connect_task(shared: Arc<ClientShared>) {
    let outcome = shared.connect().await;
    let next = match &outcome {
        Ok(connection) => ConnectionSlot::Open(Arc::clone(connection)),
        Err(cause) => {
            tracing::debug!(address = %shared.address, %cause, "transport connect failed");
            ConnectionSlot::Empty
        }
    };
    let previous = std::mem::replace(&mut *shared.lock_connection(), next);
    let ConnectionSlot::Connecting(waiters) = previous else {
        unreachable!("only the connect task ends an attempt, found {previous:?}");
    };
    for waiter in waiters {
        // A caller past its deadline has stopped waiting.
        let _ = waiter.send(outcome.clone());
    }
}

impl TransportClient {
    /// A client of the server at `address`. Does not connect until the first call.
    ///
    /// `clock` must be the clock of the runtime whose deadlines this client's callers
    /// pass in ([`RuntimeHandle::clock`](crate::RuntimeHandle::clock)): deadlines are
    /// absolute on it.
    pub fn new(address: SocketAddr, clock: Clock) -> Self {
        Self {
            shared: Arc::new(ClientShared {
                address,
                clock,
                counters: Arc::new(Counters::default()),
                connection: Mutex::new(ConnectionSlot::Empty),
            }),
            next_request_id: AtomicU64::new(1),
            slots: Arc::new(Semaphore::new(CLIENT_REQUESTS_IN_FLIGHT_MAX)),
        }
    }

    /// The server's address.
    pub fn address(&self) -> SocketAddr {
        self.shared.address
    }

    /// What this client did so far.
    pub fn stats(&self) -> TransportClientStats {
        let counters = &self.shared.counters;
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let sync = match &*self.shared.lock_connection() {
            ConnectionSlot::Open(connection) if !connection.pending.is_closed() => Some(connection.sync.get()),
            ConnectionSlot::Open(_) | ConnectionSlot::Connecting(_) | ConnectionSlot::Empty => None,
        };
        TransportClientStats {
            requests_in_flight: CLIENT_REQUESTS_IN_FLIGHT_MAX - self.slots.available_permits(),
            connections_opened: load(&counters.connections_opened),
            connections_broken: load(&counters.connections_broken),
            connections_closed_idle: load(&counters.connections_closed_idle),
            late_replies_discarded: load(&counters.late_replies_discarded),
            clock_syncs: load(&counters.clock_syncs),
            clock_offset_estimate_us: sync.map(|sync| {
                i64::try_from(sync.offset_estimate_us()).unwrap_or(if sync.offset_estimate_us() < 0 {
                    i64::MIN
                } else {
                    i64::MAX
                })
            }),
            clock_offset_error_us: sync.map(|sync| sync.error_bound_us()),
            return_allowance_us: sync.map(|sync| sync.return_allowance_us()),
            requests_allowance_capped: load(&counters.requests_allowance_capped),
            bytes_in_flight: counters.bytes_in_flight.load(Ordering::Relaxed),
            cancels_sent: load(&counters.cancels_sent),
            connections_server_went_away: load(&counters.connections_server_went_away),
            requests_not_read: load(&counters.requests_not_read),
            cancels_dropped: load(&counters.cancels_dropped),
        }
    }

    /// Sends `payload` to the remote actor `target` under `context` and waits for the
    /// reply until `context`'s deadline (on this client's clock).
    ///
    /// `caller` is the actor whose turn waits on this call, if any: the remote dispatcher
    /// records the wait-for edge `caller → target` (when `None`, the end of the context's
    /// chain is taken as the caller; a root context has none). The remote side rebuilds
    /// `context` with the same depth and chain and the same deadline, translated to its
    /// clock and made earlier by the handshake's error bound and by the connection's
    /// return allowance ([`TransportClientStats::return_allowance_us`]), so that the
    /// remote side answers early enough for its answer to travel back: the remote call
    /// never has more time than this caller, and a request that arrives after its
    /// deadline is answered [`InvokeError::Timeout`] without running.
    ///
    /// Waits for an open connection if there is none (joining the attempt under way, or
    /// starting one that runs on its own for up to
    /// [`CONNECT_TIMEOUT_MS`]). Waits for an in-flight slot if
    /// [`CLIENT_REQUESTS_IN_FLIGHT_MAX`] calls are
    /// already waiting, and for room in the connection's byte budget. All of this counts
    /// against the deadline.
    ///
    /// # Errors
    /// - [`InvokeError::Timeout`] when the deadline passes first (at once if it already
    ///   has); the request may still run remotely.
    /// - [`InvokeError::Unreachable`] when connecting fails or the connection breaks
    ///   before the reply; the request may or may not have run.
    /// - [`InvokeError::Rejected`] when the request does not fit in a frame; nothing was
    ///   sent.
    /// - Any error the remote runtime returned, unchanged.
    ///
    /// # Cancel safety
    /// Dropping the future frees the call's slot and pending entry; a reply arriving
    /// later is dropped. If the request was already sent and its deadline has not
    /// passed, a cancel frame follows it on
    /// the connection (never waiting: counted in [`TransportClientStats::cancels_sent`],
    /// or in `cancels_dropped` when the write queue or byte budget is full): the server
    /// drops the call, so the remote turn is cancelled and rolled back, or never starts.
    /// A request whose turn already committed, or whose cancel is lost (a partition),
    /// still counts. A connection attempt it started goes on for other callers.
    pub async fn invoke(
        &self,
        target: &ActorId,
        payload: Bytes,
        context: CallContext,
        caller: Option<&ActorId>,
    ) -> Result<Bytes, InvokeError> {
        self.attempt(target, payload, context, caller, RequestKind::Invoke)
            .await
            .map_err(|failure| failure.error)
    }

    /// As [`TransportClient::invoke`], for one attempt of the logical request `key`
    /// names: the remote runtime runs it as [`crate::RuntimeHandle::invoke_keyed`] does
    /// (if a turn of `target` with this key has committed, its recorded reply comes back
    /// and the handler does not run again; otherwise the handler runs and its reply is
    /// recorded under `key` in the same commit). So a request that ended `Timeout` or
    /// `Unreachable`, which may or may not have run, can be sent again with the same key,
    /// on this client or through another node, and its effect lands once.
    ///
    /// # Errors
    /// As [`TransportClient::invoke`], and those of [`crate::RuntimeHandle::invoke_keyed`].
    ///
    /// # Cancel safety
    /// As [`TransportClient::invoke`].
    pub async fn invoke_keyed(
        &self,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        context: CallContext,
        caller: Option<&ActorId>,
    ) -> Result<Bytes, InvokeError> {
        self.attempt(target, payload, context, caller, RequestKind::Keyed(key))
            .await
            .map_err(|failure| failure.error)
    }

    /// Sends a fire-and-forget message to the remote actor `target` under `context`
    /// (the context its turn runs under, as for [`TransportClient::invoke`]) and returns
    /// once the remote runtime has accepted it (in the target's mailbox, or held for its
    /// activation) or refused it, by the deadline. The turn it starts runs on its own,
    /// under the context's deadline; its reply goes nowhere. `caller` is the teller,
    /// if any (no wait-for edge is recorded: nobody waits).
    ///
    /// # Errors
    /// As [`TransportClient::invoke`], with the remote runtime's refusal at acceptance
    /// (`Busy`, `ActorNotFound`, `Timeout`, `Refused`, …). On `Timeout` or
    /// `Unreachable` the message may or may not have been accepted.
    ///
    /// # Cancel safety
    /// As [`TransportClient::invoke`]: dropping the future before the acceptance
    /// arrives sends a cancel, and the message is not accepted unless it already was.
    pub async fn tell(
        &self,
        target: &ActorId,
        payload: Bytes,
        context: CallContext,
        caller: Option<&ActorId>,
    ) -> Result<(), InvokeError> {
        self.attempt(target, payload, context, caller, RequestKind::Tell)
            .await
            .map(|_| ())
            .map_err(|failure| failure.error)
    }

    /// As [`TransportClient::tell`], for one delivery of the message `key` names: the
    /// remote runtime delivers it as [`crate::RuntimeHandle::tell_keyed`] does (a turn of
    /// `target` with this key that committed makes every later delivery a no-op). So a
    /// tell that ended `Timeout` or `Unreachable`, which may or may not have been
    /// accepted, can be sent again with the same key, on this client or through another
    /// node, and its effect lands once. A server older than 2026-12-01 refuses a keyed
    /// tell `Rejected`, with nothing delivered.
    ///
    /// # Errors
    /// As [`TransportClient::tell`].
    ///
    /// # Cancel safety
    /// As [`TransportClient::tell`].
    pub async fn tell_keyed(
        &self,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        context: CallContext,
        caller: Option<&ActorId>,
    ) -> Result<(), InvokeError> {
        self.attempt(target, payload, context, caller, RequestKind::KeyedTell(key))
            .await
            .map(|_| ())
            .map_err(|failure| failure.error)
    }

    /// One request of any [`RequestKind`] (what [`TransportClient::invoke`],
    /// [`TransportClient::invoke_keyed`], [`TransportClient::tell`] and
    /// [`TransportClient::tell_keyed`] send), whose failure also says whether the
    /// request may have reached the server ([`RequestFailure::delivery`]): a router
    /// can send a request that was never sent to the actor's current owner, while one
    /// that may have run must not be sent again unless it is keyed.
    ///
    /// # Errors
    /// As the method of that kind, with its [`Delivery`].
    ///
    /// # Cancel safety
    /// As [`TransportClient::invoke`].
    pub async fn attempt(
        &self,
        target: &ActorId,
        payload: Bytes,
        context: CallContext,
        caller: Option<&ActorId>,
        kind: RequestKind<'_>,
    ) -> Result<Bytes, RequestFailure> {
        let deadline = context.deadline();
        let clock = self.shared.clock;
        let now = clock.now();
        if deadline.has_passed(now) {
            return Err(RequestFailure::never_sent(InvokeError::Timeout {
                target: target.clone(),
                timeout_ms: 0,
            }));
        }
        let timeout_ms = deadline.remaining_ms(now);
        // Set once the request is queued on a connection: from then on it may reach
        // the server.
        let queued = AtomicBool::new(false);
        let waited = clock.run_until_from(
            now,
            deadline,
            self.invoke_until_reply(target, payload, &context, caller, kind, &queued),
        );
        match waited.await {
            Ok(result) => result,
            Err(_elapsed) => {
                let timeout = InvokeError::Timeout {
                    target: target.clone(),
                    timeout_ms,
                };
                Err(if queued.load(Ordering::Relaxed) {
                    RequestFailure::maybe_sent(timeout)
                } else {
                    RequestFailure::never_sent(timeout)
                })
            }
        }
    }

    /// Sends a deadlock probe to the server, one way, and returns once it is queued on
    /// the connection (opening one if needed) or `deadline` passed; nothing is answered.
    ///
    /// # Errors
    /// [`InvokeError::Unreachable`] if no connection could be had, [`InvokeError::Timeout`]
    /// at the deadline, [`InvokeError::Rejected`] if the probe does not encode. A probe
    /// that was queued may still be lost (a partition, a closed connection).
    pub async fn send_probe(&self, probe: Probe, deadline: Deadline) -> Result<(), InvokeError> {
        let target = probe.at.clone();
        let clock = self.shared.clock;
        let send = async {
            let connection = self
                .invoke_connection()
                .await
                .map_err(|cause| InvokeError::Unreachable {
                    target: target.clone(),
                    cause,
                })?;
            let frame = encode_frame(&ClientMessage::Probe(probe)).map_err(|error| InvokeError::Rejected {
                target: target.clone(),
                reason: format!("the probe cannot be sent: {error}"),
            })?;
            let permit = connection.budget.acquire(frame.len()).await;
            connection
                .frames
                .send(BudgetedFrame { frame, _permit: permit })
                .await
                .map_err(|_| InvokeError::Unreachable {
                    target: target.clone(),
                    cause: "the connection closed".to_string(),
                })
        };
        match clock.run_until(deadline, send).await {
            Ok(sent) => sent,
            Err(_elapsed) => Err(InvokeError::Timeout {
                target: target.clone(),
                timeout_ms: 0,
            }),
        }
    }

    async fn invoke_until_reply(
        &self,
        target: &ActorId,
        payload: Bytes,
        context: &CallContext,
        caller: Option<&ActorId>,
        kind: RequestKind<'_>,
        queued: &AtomicBool,
    ) -> Result<Bytes, RequestFailure> {
        let unreachable = |cause: String| InvokeError::Unreachable {
            target: target.clone(),
            cause,
        };
        let never_sent = |cause: String| RequestFailure::never_sent(unreachable(cause));
        let slot = Arc::clone(&self.slots)
            .acquire_owned()
            .await
            .expect("the client's in-flight semaphore is never closed");
        let (connection, request_id, reply) = loop {
            let connection = self.invoke_connection().await.map_err(never_sent)?;
            let request_id = self.next_request_id.fetch_add(1, Ordering::Relaxed);
            let (waiter, reply) = oneshot::channel();
            match connection.pending.register(request_id, waiter) {
                Ok(()) => break (connection, request_id, reply),
                // Closed for idleness before anything was sent on it: take a new one.
                Err(Closure::Retired) => {}
                // Broke before this request was queued on it: nothing of it was sent.
                Err(Closure::Broken(cause)) => return Err(never_sent(cause)),
            }
        };
        let mut entry = PendingEntry {
            pending: Arc::clone(&connection.pending),
            request_id,
            deadline: context.deadline(),
            _slot: slot,
            sent: None,
            counters: Arc::clone(&self.shared.counters),
        };
        let now = self.shared.clock.now();
        let mut sync = connection.clock_sync(now);
        // At most a share of the time left is kept for the answer's trip back: a short
        // call is still sent, its host given the rest. (Refusing it unsent, as this did
        // first, refused every call under 100 ms for the 8 refreshes after a partition
        // healed: a hello held up by the cut is one round trip of seconds, a spread
        // capped at `RETURN_ALLOWANCE_MS_MAX`; dst_partition, seed 3.)
        let left_us = context.deadline().as_micros().saturating_sub(now.as_micros());
        let share_us = left_us / 100 * RETURN_ALLOWANCE_SHARE_OF_LEFT_MAX_PERCENT;
        if sync.return_allowance_us() > share_us {
            sync = sync.with_return_allowance(share_us);
            self.shared
                .counters
                .requests_allowance_capped
                .fetch_add(1, Ordering::Relaxed);
        }
        let mut request = WireRequest::new(
            request_id,
            target.clone(),
            payload,
            context,
            caller.cloned(),
            &sync,
            now,
        );
        match kind {
            RequestKind::Invoke => {}
            RequestKind::Keyed(key) => request.key = Some(key.as_str().to_owned()),
            RequestKind::Tell => request.tell = true,
            RequestKind::KeyedTell(key) => {
                request.tell = true;
                request.key = Some(key.as_str().to_owned());
            }
        }
        let frame = encode_frame(&ClientMessage::Request(request)).map_err(|error| {
            RequestFailure::never_sent(InvokeError::Rejected {
                target: target.clone(),
                reason: format!("the request cannot be sent: {error}"),
            })
        })?;
        let permit = connection.budget.acquire(frame.len()).await;
        let budgeted = BudgetedFrame { frame, _permit: permit };
        // A reservation cancelled at the deadline before it completed queued nothing
        // (tokio's `Sender::reserve` is cancel safe); the frame is queued, and the flag
        // set, in the poll it completes.
        let Ok(place_in_queue) = connection.frames.reserve().await else {
            // The connection's task has ended: the frame was never taken for writing.
            return Err(never_sent("the connection closed".to_string()));
        };
        match connection.pending.queue(request_id, place_in_queue, budgeted) {
            Ok(()) => {}
            // Closed (broke, or its server went away) before the request was queued.
            Err(Closure::Broken(cause)) => return Err(never_sent(cause)),
            Err(Closure::Retired) => return Err(never_sent("the connection closed".to_string())),
        }
        queued.store(true, Ordering::Relaxed);
        // Queued: from now on, a caller that stops waiting tells the server (on drop).
        entry.sent = Some(Arc::clone(&connection));
        match reply.await {
            Ok(Outcome::Reply(result)) => result.map_err(RequestFailure::maybe_sent),
            Ok(Outcome::Broken(cause)) => Err(RequestFailure::maybe_sent(unreachable(cause))),
            Ok(Outcome::NotRead(cause)) => Err(never_sent(cause)),
            Err(_closed) => Err(RequestFailure::maybe_sent(unreachable(
                "the connection closed".to_string(),
            ))),
        }
    }

    /// The open connection; or the outcome of the attempt to open one that is under way,
    /// or of one started now if there is none. A new connection is usable only once its
    /// clock handshake is done.
    ///
    /// # Cancel safety
    /// Cancel safe: the attempt runs in its own task and stores its connection itself.
    async fn invoke_connection(&self) -> Result<Arc<Connection>, String> {
        let (waiter, outcome) = oneshot::channel();
        {
            let mut slot = self.shared.lock_connection();
            match &mut *slot {
                ConnectionSlot::Open(connection) if !connection.pending.is_closed() => {
                    return Ok(Arc::clone(connection));
                }
                ConnectionSlot::Connecting(waiters) => {
                    // Forget callers that stopped waiting, so the list stays within the
                    // callers holding an in-flight slot.
                    if waiters.len() >= CLIENT_REQUESTS_IN_FLIGHT_MAX {
                        waiters.retain(|waiter| !waiter.is_closed());
                    }
                    waiters.push(waiter);
                }
                ConnectionSlot::Open(_) | ConnectionSlot::Empty => {
                    *slot = ConnectionSlot::Connecting(vec![waiter]);
                    tokio::spawn(connect_task(Arc::clone(&self.shared)));
                }
            }
        }
        outcome.await.unwrap_or_else(|_| {
            Err(format!(
                "the attempt to connect to {} ended without an outcome (runtime shutting down?)",
                self.shared.address
            ))
        })
    }
}

/// The clock handshake on a new connection: sends a [`Hello`] stamped with `clock`, reads
/// the answer, and bounds the server's clock from the round trip.
///
/// # Errors
/// Any [`FrameError`]; [`FrameError::Handshake`] when the peer is not a Troupe server,
/// speaks another protocol version, or answers with something else than a hello.
///
/// # Cancel safety
/// Not cancel safe: cancelling leaves the stream mid-handshake; drop the stream.
async fn handshake(stream: &mut TcpStream, clock: &Clock) -> Result<ClockSync, FrameError> {
    let hello = encode_frame(&ClientMessage::Hello(Hello::new(clock.now())))?;
    stream.write_all(&hello).await?;
    stream.flush().await?;
    match read_frame::<ServerMessage, _>(stream, HANDSHAKE_FRAME_SIZE_MAX_BYTES).await? {
        ServerMessage::HelloAck(ack) => ack
            .clock_sync(clock.now())
            .map_err(|cause| FrameError::Handshake { cause }),
        ServerMessage::Response(_) => Err(FrameError::Handshake {
            cause: "the server answered the hello with a response".to_string(),
        }),
        ServerMessage::GoingAway(_) => Err(FrameError::Handshake {
            cause: "the server is going away (it is stopping)".to_string(),
        }),
    }
}

impl Connection {
    /// The clock bound for a request sent at `now`. When the bound is older than
    /// [`CLOCK_RESYNC_INTERVAL_MS`], also queues a refresh hello (at most one at a
    /// time, never waiting: if the write queue or the byte budget is full the next call
    /// tries again); meanwhile the old bound stays valid, with a growing drift allowance.
    fn clock_sync(&self, now: Deadline) -> ClockSync {
        let sync = self.sync.get();
        if sync.age_us(now) >= CLOCK_RESYNC_INTERVAL_MS * 1_000 && !self.sync.refreshing.swap(true, Ordering::Relaxed) {
            let queued = encode_frame(&ClientMessage::Hello(Hello::new(now))).is_ok_and(|frame| {
                self.budget
                    .try_acquire(frame.len())
                    .is_some_and(|permit| self.frames.try_send(BudgetedFrame { frame, _permit: permit }).is_ok())
            });
            if !queued {
                self.sync.refreshing.store(false, Ordering::Relaxed);
            }
        }
        sync
    }

    /// Starts the connection's task: it writes queued frames, reads replies and hands
    /// each to its caller (and refreshed clock bounds to the connection), closes the
    /// connection once idle, and on any failure fails every pending call at once.
    fn open(
        stream: TcpStream,
        address: SocketAddr,
        counters: Arc<Counters>,
        clock: Clock,
        sync: ClockSync,
    ) -> Arc<Self> {
        let (frames, mut frame_queue) = mpsc::channel::<BudgetedFrame>(WRITE_QUEUE_CAPACITY);
        let pending = Arc::new(Pending::new(clock));
        let sync = Arc::new(SyncState::new(sync));
        let connection = Arc::new(Self {
            frames,
            budget: ByteBudget::for_connection(Arc::clone(&counters.bytes_in_flight)),
            pending: Arc::clone(&pending),
            sync: Arc::clone(&sync),
        });
        tokio::spawn(async move {
            let (mut reader, mut writer) = tokio::io::split(stream);
            // Ends with the server's `GoingAway`, its last frame, or an error.
            let read_replies = async {
                loop {
                    match read_frame::<ServerMessage, _>(&mut reader, FRAME_SIZE_MAX_BYTES).await? {
                        ServerMessage::GoingAway(going_away) => return Ok::<_, FrameError>(going_away),
                        ServerMessage::Response(response) => {
                            if !pending.complete(response) {
                                counters.late_replies_discarded.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        ServerMessage::HelloAck(ack) => {
                            let now = clock.now();
                            let fresh = ack.clock_sync(now).map_err(|cause| FrameError::Handshake { cause })?;
                            sync.offer(fresh, now);
                            counters.clock_syncs.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            };
            // No write stall timeout here: a server stops reading on purpose when its
            // limits are reached, and every caller waiting behind it has a deadline.
            let write_requests = write_frames(&mut writer, &mut frame_queue, None, || {}, std::future::pending());
            let ended: Result<(), FrameError> = tokio::select! {
                biased;
                read = read_replies => match read {
                    Ok(going_away) => {
                        // Closes the connection as this task ends, so the server, which
                        // reads until then, closes it without a reset.
                        let not_read = pending.go_away(going_away, address);
                        counters.connections_server_went_away.fetch_add(1, Ordering::Relaxed);
                        counters.requests_not_read.fetch_add(not_read, Ordering::Relaxed);
                        tracing::debug!(
                            %address,
                            requests_read = going_away.requests_read,
                            not_read,
                            "transport connection closed: the server went away"
                        );
                        return;
                    }
                    Err(error) => Err(error),
                },
                // Ends with `Ok` when the last `Arc<Connection>` is dropped: nobody can
                // send on this connection any more.
                written = write_requests => written,
                () = pending.until_retired() => {
                    counters.connections_closed_idle.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%address, "transport connection closed: idle for {CLIENT_CONNECTION_IDLE_TIMEOUT_MS} ms");
                    return;
                }
            };
            let cause = match ended {
                Ok(()) => "the connection was closed by its client".to_string(),
                Err(error) => {
                    counters.connections_broken.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%address, %error, "transport connection broke");
                    format!("the connection to {address} broke: {error}")
                }
            };
            pending.break_all(&cause);
        });
        connection
    }
}

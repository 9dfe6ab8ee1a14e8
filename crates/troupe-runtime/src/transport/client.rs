//! [`TransportClient`]: invokes actors on one remote node over one multiplexed connection.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use troupe_core::{ActorId, CallContext, InvokeError};

use super::clock_sync::ClockSync;
use super::frame::{encode_frame, read_frame, write_frames, FrameError};
use super::wire::{ClientMessage, Hello, ServerMessage, WireRequest, WireResponse};
use super::{CLIENT_REQUESTS_IN_FLIGHT_MAX, CLOCK_RESYNC_INTERVAL_MS, WRITE_QUEUE_CAPACITY};
use crate::Clock;

/// Invokes actors hosted by the runtime behind one [`TransportServer`](super::TransportServer).
///
/// Connects lazily on the first call and multiplexes every concurrent call over that one
/// connection, matching replies to calls by request id. Each new connection starts with
/// a clock handshake, so deadlines cross it as absolute instants on the server's clock
/// (see the transport module's documentation in the source). When the connection breaks, every call
/// pending on it fails at once with [`InvokeError::Unreachable`] and the next call
/// connects (and handshakes) again. Never retries a request.
///
/// Share it (`Arc<TransportClient>`); every method takes `&self`.
#[derive(Debug)]
pub struct TransportClient {
    address: SocketAddr,
    clock: Clock,
    next_request_id: AtomicU64,
    /// One permit per request in flight; a permit lives as long as its pending entry.
    slots: Arc<Semaphore>,
    connection: tokio::sync::Mutex<Option<Arc<Connection>>>,
    counters: Arc<Counters>,
}

/// What a [`TransportClient`] did, for tests, the simulator and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransportClientStats {
    /// Calls now holding an in-flight slot: connecting, or sent and waiting for a reply (at most
    /// [`CLIENT_REQUESTS_IN_FLIGHT_MAX`](super::CLIENT_REQUESTS_IN_FLIGHT_MAX)).
    pub requests_in_flight: usize,
    /// Connections opened since the client was created.
    pub connections_opened: u64,
    /// Connections that broke (reset, end of stream, bad frame) while in use, or failed
    /// their clock handshake.
    pub connections_broken: u64,
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
}

#[derive(Debug, Default)]
struct Counters {
    connections_opened: AtomicU64,
    connections_broken: AtomicU64,
    late_replies_discarded: AtomicU64,
    clock_syncs: AtomicU64,
}

/// How a pending call ended on the connection's side.
#[derive(Debug)]
enum Outcome {
    Reply(Result<Bytes, InvokeError>),
    Broken(String),
}

/// One open connection: the queue to its writer, the calls waiting on it and its clock
/// bound. Dropping the last `Arc` closes the queue, which ends the connection's task and
/// closes the socket.
#[derive(Debug)]
struct Connection {
    frames: mpsc::Sender<Bytes>,
    pending: Arc<Pending>,
    sync: Arc<SyncState>,
}

/// The connection's clock bound, refreshed by hellos on the open connection.
#[derive(Debug)]
struct SyncState {
    current: Mutex<ClockSync>,
    /// A refresh hello is queued or in flight; at most one at a time.
    refreshing: AtomicBool,
}

impl SyncState {
    fn get(&self) -> ClockSync {
        *self.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps whichever of the current and `fresh` bounds gives more time at `now`
    /// (both are valid lower bounds).
    fn offer(&self, fresh: ClockSync, now: troupe_core::Deadline) {
        let mut current = self.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *current = current.tighter(fresh, now);
        self.refreshing.store(false, Ordering::Relaxed);
    }
}

/// The calls waiting on one connection, by request id.
#[derive(Debug, Default)]
struct Pending {
    state: Mutex<PendingState>,
}

#[derive(Debug, Default)]
struct PendingState {
    waiting: BTreeMap<u64, oneshot::Sender<Outcome>>,
    /// Set once, when the connection breaks; nothing registers after that.
    broken: Option<String>,
}

impl Pending {
    fn lock(&self) -> std::sync::MutexGuard<'_, PendingState> {
        // Nothing panics while holding the lock; recover the data if something did.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn is_broken(&self) -> bool {
        self.lock().broken.is_some()
    }

    /// Registers a call, unless the connection is already broken.
    fn register(&self, request_id: u64, waiter: oneshot::Sender<Outcome>) -> Result<(), String> {
        let mut state = self.lock();
        if let Some(cause) = &state.broken {
            return Err(cause.clone());
        }
        let previous = state.waiting.insert(request_id, waiter);
        assert!(previous.is_none(), "request id {request_id} registered twice");
        Ok(())
    }

    /// Hands a reply to its caller; `false` if nobody waits for it any more.
    fn complete(&self, response: WireResponse) -> bool {
        let waiter = self.lock().waiting.remove(&response.request_id);
        match waiter {
            Some(waiter) => waiter.send(Outcome::Reply(response.result)).is_ok(),
            None => false,
        }
    }

    /// Marks the connection broken and fails every waiting call with `cause`.
    fn break_all(&self, cause: &str) {
        let waiting = {
            let mut state = self.lock();
            state.broken.get_or_insert_with(|| cause.to_string());
            std::mem::take(&mut state.waiting)
        };
        for waiter in waiting.into_values() {
            // The caller may have stopped waiting already.
            let _ = waiter.send(Outcome::Broken(cause.to_string()));
        }
    }
}

/// A registered call: frees its pending entry and its in-flight slot when dropped, so a
/// caller that stops waiting (deadline, cancellation) leaves nothing behind.
struct PendingEntry {
    pending: Arc<Pending>,
    request_id: u64,
    _slot: OwnedSemaphorePermit,
}

impl Drop for PendingEntry {
    fn drop(&mut self) {
        self.pending.lock().waiting.remove(&self.request_id);
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
            address,
            clock,
            next_request_id: AtomicU64::new(1),
            slots: Arc::new(Semaphore::new(CLIENT_REQUESTS_IN_FLIGHT_MAX)),
            connection: tokio::sync::Mutex::new(None),
            counters: Arc::new(Counters::default()),
        }
    }

    /// The server's address.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// What this client did so far.
    pub fn stats(&self) -> TransportClientStats {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        // Not waiting for a connection being opened: stats never block.
        let sync = self
            .connection
            .try_lock()
            .ok()
            .and_then(|slot| slot.as_ref().filter(|c| !c.pending.is_broken()).map(|c| c.sync.get()));
        TransportClientStats {
            requests_in_flight: CLIENT_REQUESTS_IN_FLIGHT_MAX - self.slots.available_permits(),
            connections_opened: load(&self.counters.connections_opened),
            connections_broken: load(&self.counters.connections_broken),
            late_replies_discarded: load(&self.counters.late_replies_discarded),
            clock_syncs: load(&self.counters.clock_syncs),
            clock_offset_estimate_us: sync.map(|sync| {
                i64::try_from(sync.offset_estimate_us()).unwrap_or(if sync.offset_estimate_us() < 0 {
                    i64::MIN
                } else {
                    i64::MAX
                })
            }),
            clock_offset_error_us: sync.map(|sync| sync.error_bound_us()),
        }
    }

    /// Sends `payload` to the remote actor `target` under `context` and waits for the
    /// reply until `context`'s deadline (on this client's clock).
    ///
    /// `caller` is the actor whose turn waits on this call, if any: the remote dispatcher
    /// records the wait-for edge `caller → target` (when `None`, the end of the context's
    /// chain is taken as the caller; a root context has none). The remote side rebuilds
    /// `context` with the same depth and chain and the same deadline, translated to its
    /// clock and made earlier by the handshake's error bound: the remote call never has
    /// more time than this caller, and a request that arrives after its deadline is
    /// answered [`InvokeError::Timeout`] without running.
    ///
    /// Connects first if there is no open connection. Waits for an in-flight slot if
    /// [`CLIENT_REQUESTS_IN_FLIGHT_MAX`](super::CLIENT_REQUESTS_IN_FLIGHT_MAX) calls are
    /// already waiting. All of this counts against the deadline.
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
    /// later is dropped. The request may still run remotely.
    pub async fn invoke(
        &self,
        target: &ActorId,
        payload: Bytes,
        context: CallContext,
        caller: Option<&ActorId>,
    ) -> Result<Bytes, InvokeError> {
        let deadline = context.deadline();
        let now = self.clock.now();
        if deadline.has_passed(now) {
            return Err(InvokeError::Timeout {
                target: target.clone(),
                timeout_ms: 0,
            });
        }
        let timeout_ms = u64::try_from(deadline.remaining(now).as_millis()).unwrap_or(u64::MAX);
        let waited = self
            .clock
            .run_until(deadline, self.invoke_until_reply(target, payload, &context, caller));
        match waited.await {
            Ok(result) => result,
            Err(_elapsed) => Err(InvokeError::Timeout {
                target: target.clone(),
                timeout_ms,
            }),
        }
    }

    async fn invoke_until_reply(
        &self,
        target: &ActorId,
        payload: Bytes,
        context: &CallContext,
        caller: Option<&ActorId>,
    ) -> Result<Bytes, InvokeError> {
        let unreachable = |cause: String| InvokeError::Unreachable {
            target: target.clone(),
            cause,
        };
        let slot = Arc::clone(&self.slots)
            .acquire_owned()
            .await
            .expect("the client's in-flight semaphore is never closed");
        let connection = self.invoke_connection().await.map_err(unreachable)?;
        let request_id = self.next_request_id.fetch_add(1, Ordering::Relaxed);
        let now = self.clock.now();
        let sync = connection.clock_sync(now);
        let request = WireRequest::new(
            request_id,
            target.clone(),
            payload,
            context,
            caller.cloned(),
            &sync,
            now,
        );
        let frame = encode_frame(&ClientMessage::Request(request)).map_err(|error| InvokeError::Rejected {
            target: target.clone(),
            reason: format!("the request cannot be sent: {error}"),
        })?;
        let (waiter, reply) = oneshot::channel();
        connection.pending.register(request_id, waiter).map_err(unreachable)?;
        let _entry = PendingEntry {
            pending: Arc::clone(&connection.pending),
            request_id,
            _slot: slot,
        };
        if connection.frames.send(frame).await.is_err() {
            return Err(unreachable("the connection closed".to_string()));
        }
        match reply.await {
            Ok(Outcome::Reply(result)) => result,
            Ok(Outcome::Broken(cause)) => Err(unreachable(cause)),
            Err(_closed) => Err(unreachable("the connection closed".to_string())),
        }
    }

    /// The open connection, or a new one if there is none or it broke. A new connection
    /// is usable only once its clock handshake is done.
    ///
    /// # Cancel safety
    /// Cancel safe: a connection is stored only once it is open and synced.
    async fn invoke_connection(&self) -> Result<Arc<Connection>, String> {
        let mut slot = self.connection.lock().await;
        if let Some(connection) = slot.as_ref() {
            if !connection.pending.is_broken() {
                return Ok(Arc::clone(connection));
            }
        }
        *slot = None;
        let mut stream = TcpStream::connect(self.address)
            .await
            .map_err(|error| format!("connecting to {} failed: {error}", self.address))?;
        // Nagle would hold small requests back; failing to disable it only costs latency.
        let _ = stream.set_nodelay(true);
        self.counters.connections_opened.fetch_add(1, Ordering::Relaxed);
        let sync = handshake(&mut stream, &self.clock).await.map_err(|error| {
            self.counters.connections_broken.fetch_add(1, Ordering::Relaxed);
            format!("the clock handshake with {} failed: {error}", self.address)
        })?;
        self.counters.clock_syncs.fetch_add(1, Ordering::Relaxed);
        let connection = Connection::open(stream, self.address, Arc::clone(&self.counters), self.clock, sync);
        *slot = Some(Arc::clone(&connection));
        Ok(connection)
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
    match read_frame::<ServerMessage, _>(stream).await? {
        ServerMessage::HelloAck(ack) => ack
            .clock_sync(clock.now())
            .map_err(|cause| FrameError::Handshake { cause }),
        ServerMessage::Response(_) => Err(FrameError::Handshake {
            cause: "the server answered the hello with a response".to_string(),
        }),
    }
}

impl Connection {
    /// The clock bound for a request sent at `now`. When the bound is older than
    /// [`CLOCK_RESYNC_INTERVAL_MS`], also queues a refresh hello (at most one at a
    /// time, never waiting: if the write queue is full the next call tries again);
    /// meanwhile the old bound stays valid, with a growing drift allowance.
    fn clock_sync(&self, now: troupe_core::Deadline) -> ClockSync {
        let sync = self.sync.get();
        if sync.age_us(now) >= CLOCK_RESYNC_INTERVAL_MS * 1_000 && !self.sync.refreshing.swap(true, Ordering::Relaxed) {
            let queued = encode_frame(&ClientMessage::Hello(Hello::new(now)))
                .is_ok_and(|frame| self.frames.try_send(frame).is_ok());
            if !queued {
                self.sync.refreshing.store(false, Ordering::Relaxed);
            }
        }
        sync
    }

    /// Starts the connection's task: it writes queued frames, reads replies and hands
    /// each to its caller (and refreshed clock bounds to the connection), and on any
    /// failure fails every pending call at once.
    fn open(
        stream: TcpStream,
        address: SocketAddr,
        counters: Arc<Counters>,
        clock: Clock,
        sync: ClockSync,
    ) -> Arc<Self> {
        let (frames, mut frame_queue) = mpsc::channel::<Bytes>(WRITE_QUEUE_CAPACITY);
        let pending = Arc::new(Pending::default());
        let sync = Arc::new(SyncState {
            current: Mutex::new(sync),
            refreshing: AtomicBool::new(false),
        });
        let connection = Arc::new(Self {
            frames,
            pending: Arc::clone(&pending),
            sync: Arc::clone(&sync),
        });
        tokio::spawn(async move {
            let (mut reader, mut writer) = tokio::io::split(stream);
            let read_replies = async {
                loop {
                    match read_frame::<ServerMessage, _>(&mut reader).await? {
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
            let ended: Result<(), FrameError> = tokio::select! {
                biased;
                read = read_replies => read,
                // Ends with `Ok` when the last `Arc<Connection>` is dropped: nobody can
                // send on this connection any more.
                written = write_frames(&mut writer, &mut frame_queue) => written,
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

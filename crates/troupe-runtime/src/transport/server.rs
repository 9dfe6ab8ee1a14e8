//! [`TransportServer`]: accepts connections and runs their requests on a runtime.

use std::collections::BTreeMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use troupe_core::limits::AGENT_CALL_DEPTH_MAX;
use troupe_core::{CallRefused, Deadline, InvokeError};

use super::budget::{BudgetedFrame, ByteBudget};
use super::frame::{
    encode_frame, read_frame, read_frame_body, read_frame_length, write_frame_now, write_frames, FrameError,
};
use super::wire::WIRE_MAGIC;
use super::wire::{ClientMessage, GoingAway, Hello, Probe, ServerMessage, WireCancel, WireRequest, WireResponse};
use super::{
    ACCEPT_RETRY_DELAY_MS, CALL_CHAIN_LENGTH_MAX, CONNECTIONS_PER_NODE_MAX, CONNECTIONS_PER_PEER_MAX,
    FRAME_HEADER_SIZE_BYTES, FRAME_SIZE_MAX_BYTES, GOING_AWAY_LINGER_MS, GOING_AWAY_WRITE_MS_MAX,
    HANDSHAKE_FRAME_SIZE_MAX_BYTES, HANDSHAKE_TIMEOUT_MS, SERVER_CONNECTION_IDLE_TIMEOUT_MS,
    SERVER_REQUESTS_IN_FLIGHT_MAX, WRITE_QUEUE_CAPACITY, WRITE_STALL_TIMEOUT_MS,
};
use crate::{Clock, RuntimeHandle};

/// How long a server waits for its answer to a refused hello (another protocol version)
/// to be written before it closes the connection, in milliseconds.
const HANDSHAKE_REFUSAL_LINGER_MS: u64 = 100;

/// Serves the actors of one runtime to other nodes over TCP.
///
/// One task accepts connections; one task per connection answers the client's clock
/// handshake, then reads request frames and writes response frames; one task per request
/// invokes the actor, so a slow actor never blocks the other requests of its connection.
/// Responses go to the connection's writer through a bounded queue of
/// [`WRITE_QUEUE_CAPACITY`] frames.
///
/// A request whose deadline (sent on this runtime's clock) has passed when it is read is
/// answered [`InvokeError::Timeout`] and never runs. A connection runs at most
/// [`SERVER_REQUESTS_IN_FLIGHT_MAX`] requests at once; a request that arrives while all
/// of them run is answered [`InvokeError::ConnectionBusy`] at once and never runs (the
/// server keeps reading the connection, so its cancels and probes are still acted on).
///
/// Defends itself against slow and hostile peers (see the transport module's
/// documentation in the source): at most
/// [`CONNECTIONS_PER_NODE_MAX`] connections, at most
/// [`CONNECTIONS_PER_PEER_MAX`] from one IP address
/// (one over either is closed at once); a hello within
/// [`HANDSHAKE_TIMEOUT_MS`]; idle connections closed after
/// [`SERVER_CONNECTION_IDLE_TIMEOUT_MS`]; a
/// peer that reads nothing for [`WRITE_STALL_TIMEOUT_MS`]
/// closed; at most
/// [`CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES`](super::CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES)
/// buffered per connection. [`TransportServer::stats`] counts each of these.
///
/// When a connection closes, or its client sends a cancel for a request (its caller
/// stopped waiting), the call is abandoned on the runtime: a request that has not
/// started never runs, a running turn is cancelled and rolled back (nothing committed,
/// as for a local caller that gives up), and its wait-for edge is released at once.
///
/// Dropping the server stops accepting and closes every connection: each stops reading
/// at once (a request not wholly read by then never runs), writes the replies already
/// queued and a last `GoingAway` frame saying how many of the connection's requests it
/// read (within `GOING_AWAY_WRITE_MS_MAX`, 1 s), then closes (once the client has, or
/// after `GOING_AWAY_LINGER_MS`, 1 s). Requests running then are abandoned, as on any
/// close. Clients fail their pending calls with [`InvokeError::Unreachable`]: as never
/// sent (`Delivery::NeverSent`) those the server had not read, as possibly sent the
/// others.
#[derive(Debug)]
pub struct TransportServer {
    local_address: SocketAddr,
    shared: Arc<ServerShared>,
    stop: StopSignal,
}

/// Closed when the server is dropped; every task of the server waits on it. A closed
/// semaphore wakes its waiters in the order they came (tokio's `watch` would wake them
/// in an order drawn from an unseeded random generator, breaking seed replay).
#[derive(Debug, Clone)]
struct StopSignal(Arc<Semaphore>);

impl StopSignal {
    fn new() -> Self {
        Self(Arc::new(Semaphore::new(0)))
    }

    /// Returns once the server is dropped.
    async fn stopped(&self) {
        // No permit is ever added: the only way out is the close.
        let _closed = self.0.acquire().await;
    }
}

impl Drop for TransportServer {
    fn drop(&mut self) {
        self.stop.0.close();
    }
}

/// What a [`TransportServer`] did, for tests, the simulator and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransportServerStats {
    /// Connections open now (at most
    /// [`CONNECTIONS_PER_NODE_MAX`]).
    pub connections_open: usize,
    /// Connections accepted and served since the server started.
    pub connections_accepted: u64,
    /// Connections closed at once on arrival because the server, or their peer's
    /// address, had its most connections open.
    pub connections_refused: u64,
    /// Connections closed because no valid hello arrived within
    /// [`HANDSHAKE_TIMEOUT_MS`].
    pub connections_closed_handshake_timeout: u64,
    /// Connections closed after
    /// [`SERVER_CONNECTION_IDLE_TIMEOUT_MS`]
    /// with no request running and no frame read or written.
    pub connections_closed_idle: u64,
    /// Connections closed because the peer accepted no reply bytes for
    /// [`WRITE_STALL_TIMEOUT_MS`].
    pub connections_closed_write_stalled: u64,
    /// Requests read and not yet answered (their turn running, or their reply waiting
    /// for room in the write queue), over all connections.
    pub requests_running: usize,
    /// Bytes of frames the server holds buffered now, over all connections: requests
    /// not yet answered and replies not yet written (at most
    /// [`CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES`](super::CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES)
    /// per connection).
    pub bytes_in_flight: usize,
    /// Requests dropped because their client sent a cancel while they ran (or waited to
    /// start): their turns were cancelled and rolled back, or never started.
    pub requests_cancelled: u64,
    /// Cancels that named no request running on their connection (it had already been
    /// answered, or never arrived): ignored.
    pub cancels_unmatched: u64,
    /// Requests refused `Rejected` because their id was already in flight on their
    /// connection (a client bug or a hostile peer: a cancel could not tell them apart).
    pub requests_refused_duplicate_id: u64,
    /// Requests refused `ConnectionBusy` on arrival because their connection already ran
    /// [`SERVER_REQUESTS_IN_FLIGHT_MAX`] requests: they never ran.
    pub requests_refused_busy: u64,
}

/// State shared by the server's tasks.
#[derive(Debug, Default)]
struct ServerShared {
    open: Mutex<OpenConnections>,
    connections_accepted: AtomicU64,
    connections_refused: AtomicU64,
    connections_closed_handshake_timeout: AtomicU64,
    connections_closed_idle: AtomicU64,
    connections_closed_write_stalled: AtomicU64,
    requests_running: AtomicUsize,
    bytes_in_flight: Arc<AtomicUsize>,
    requests_cancelled: AtomicU64,
    cancels_unmatched: AtomicU64,
    requests_refused_duplicate_id: AtomicU64,
    requests_refused_busy: AtomicU64,
    probes: ProbeSinkSlot,
}

/// Where a server hands the deadlock probes it receives (the cluster layer).
pub trait ProbeSink: Send + Sync + 'static {
    /// A probe arrived; called on the connection's task: must not block.
    fn on_probe(&self, probe: Probe);
}

#[derive(Default)]
struct ProbeSinkSlot(Option<Arc<dyn ProbeSink>>);

impl std::fmt::Debug for ProbeSinkSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "ProbeSink" } else { "no ProbeSink" })
    }
}

/// The connections open now, in all and by peer address.
#[derive(Debug, Default)]
struct OpenConnections {
    total: usize,
    by_peer: BTreeMap<IpAddr, usize>,
}

/// A connection's place under the connection caps; frees it when dropped.
#[derive(Debug)]
struct ConnectionTicket {
    shared: Arc<ServerShared>,
    peer: IpAddr,
}

impl ServerShared {
    fn lock_open(&self) -> std::sync::MutexGuard<'_, OpenConnections> {
        // Nothing panics while holding the lock; recover the data if something did.
        self.open.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A place for a new connection from `peer`, unless the server or that peer has its
    /// most connections open.
    fn admit(self: &Arc<Self>, peer: IpAddr) -> Option<ConnectionTicket> {
        let mut open = self.lock_open();
        let from_peer = open.by_peer.get(&peer).copied().unwrap_or(0);
        if open.total >= CONNECTIONS_PER_NODE_MAX || from_peer >= CONNECTIONS_PER_PEER_MAX {
            return None;
        }
        open.total += 1;
        open.by_peer.insert(peer, from_peer + 1);
        assert!(
            open.total <= CONNECTIONS_PER_NODE_MAX,
            "open connections {} over the cap",
            open.total
        );
        Some(ConnectionTicket {
            shared: Arc::clone(self),
            peer,
        })
    }
}

impl Drop for ConnectionTicket {
    fn drop(&mut self) {
        let mut open = self.shared.lock_open();
        open.total = open
            .total
            .checked_sub(1)
            .expect("a ticket's connection was counted open");
        let from_peer = open.by_peer.get_mut(&self.peer).expect("a ticket's peer was counted");
        *from_peer -= 1;
        if *from_peer == 0 {
            open.by_peer.remove(&self.peer);
        }
    }
}

impl TransportServer {
    /// Binds `address` and serves `handle`'s actors on it.
    ///
    /// # Errors
    /// The bind error (address in use, not available).
    pub async fn bind(address: SocketAddr, handle: RuntimeHandle) -> io::Result<Self> {
        let listener = TcpListener::bind(address).await?;
        Self::serve(listener, handle)
    }

    /// Serves `handle`'s actors on connections accepted from `listener`.
    ///
    /// # Errors
    /// If the listener's local address cannot be read.
    ///
    /// # Panics
    /// Outside a tokio (or madsim) runtime.
    pub fn serve(listener: TcpListener, handle: RuntimeHandle) -> io::Result<Self> {
        Self::serve_with_probes(listener, handle, None)
    }

    /// As [`TransportServer::serve`], handing the deadlock probes that arrive to
    /// `probes` (dropped when `None`). With `probes`, requests from other nodes' turns do
    /// not add their wait-for edge to this runtime's graph: the caller's node keeps it,
    /// and cycles across nodes are found by the probes.
    ///
    /// # Errors
    /// If the listener's local address cannot be read.
    ///
    /// # Panics
    /// Outside a tokio (or madsim) runtime.
    pub fn serve_with_probes(
        listener: TcpListener,
        handle: RuntimeHandle,
        probes: Option<Arc<dyn ProbeSink>>,
    ) -> io::Result<Self> {
        let local_address = listener.local_addr()?;
        let stop = StopSignal::new();
        let shared = Arc::new(ServerShared {
            probes: ProbeSinkSlot(probes),
            ..ServerShared::default()
        });
        tokio::spawn(accept_connections(listener, handle, Arc::clone(&shared), stop.clone()));
        Ok(Self {
            local_address,
            shared,
            stop,
        })
    }

    /// The address the server listens on (with the real port if it bound port 0).
    pub fn local_address(&self) -> SocketAddr {
        self.local_address
    }

    /// What this server did so far.
    pub fn stats(&self) -> TransportServerStats {
        let shared = &self.shared;
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        TransportServerStats {
            connections_open: shared.lock_open().total,
            connections_accepted: load(&shared.connections_accepted),
            connections_refused: load(&shared.connections_refused),
            connections_closed_handshake_timeout: load(&shared.connections_closed_handshake_timeout),
            connections_closed_idle: load(&shared.connections_closed_idle),
            connections_closed_write_stalled: load(&shared.connections_closed_write_stalled),
            requests_running: shared.requests_running.load(Ordering::Relaxed),
            bytes_in_flight: shared.bytes_in_flight.load(Ordering::Relaxed),
            requests_cancelled: load(&shared.requests_cancelled),
            cancels_unmatched: load(&shared.cancels_unmatched),
            requests_refused_duplicate_id: load(&shared.requests_refused_duplicate_id),
            requests_refused_busy: load(&shared.requests_refused_busy),
        }
    }
}

async fn accept_connections(listener: TcpListener, handle: RuntimeHandle, shared: Arc<ServerShared>, stop: StopSignal) {
    loop {
        let accepted = tokio::select! {
            biased;
            () = stop.stopped() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => match shared.admit(peer.ip()) {
                Some(ticket) => {
                    shared.connections_accepted.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%peer, "transport connection accepted");
                    tokio::spawn(serve_connection(stream, peer, handle.clone(), ticket, stop.clone()));
                }
                None => {
                    // Dropping the stream closes it before anything is read.
                    shared.connections_refused.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%peer, "transport connection refused: too many connections open");
                    drop(stream);
                }
            },
            Err(error) => {
                // Usually out of file descriptors; pause rather than spin.
                tracing::warn!(%error, "transport accept failed");
                tokio::select! {
                    biased;
                    () = stop.stopped() => return,
                    () = tokio::time::sleep(Duration::from_millis(ACCEPT_RETRY_DELAY_MS)) => {}
                }
            }
        }
    }
}

/// Why a connection ended.
#[derive(Debug)]
enum ConnectionEnd {
    /// The server was dropped: the connection goes away (see [`go_away`]).
    Stopped,
    /// No valid hello within [`HANDSHAKE_TIMEOUT_MS`].
    HandshakeTimeout,
    /// Nothing to do for [`SERVER_CONNECTION_IDLE_TIMEOUT_MS`].
    Idle,
    /// The peer closed it, a frame was bad, or a write failed or stalled.
    Frame(FrameError),
}

impl From<FrameError> for ConnectionEnd {
    fn from(error: FrameError) -> Self {
        Self::Frame(error)
    }
}

/// When a connection last did something, and how many of its requests are running:
/// the idle timer's input.
#[derive(Debug)]
struct Activity {
    clock: Clock,
    state: Mutex<ActivityState>,
}

#[derive(Debug, Clone, Copy)]
struct ActivityState {
    last: Deadline,
    requests_running: usize,
}

impl Activity {
    fn lock(&self) -> std::sync::MutexGuard<'_, ActivityState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn touch(&self) {
        let now = self.clock.now();
        let mut state = self.lock();
        state.last = state.last.max(now);
    }

    fn request_started(&self) {
        self.lock().requests_running += 1;
    }

    /// A request ended: the connection is active until now.
    fn request_ended(&self) {
        let now = self.clock.now();
        let mut state = self.lock();
        state.requests_running = state
            .requests_running
            .checked_sub(1)
            .expect("a running request was counted");
        state.last = state.last.max(now);
    }

    /// Returns once the connection has been idle (no request running, no frame read or
    /// written) for [`SERVER_CONNECTION_IDLE_TIMEOUT_MS`].
    async fn until_idle(&self) {
        let idle_timeout = Duration::from_millis(SERVER_CONNECTION_IDLE_TIMEOUT_MS);
        loop {
            let now = self.clock.now();
            let state = *self.lock();
            let wait = if state.requests_running > 0 {
                // Ending a request touches the connection; look again within one timeout.
                idle_timeout
            } else {
                let idle_until = Deadline::after(state.last, idle_timeout);
                if idle_until.has_passed(now) {
                    return;
                }
                idle_until.remaining(now)
            };
            tokio::time::sleep(wait).await;
        }
    }
}

/// A request of a connection counted as running (in the server's stats and the
/// connection's idle timer) until dropped.
struct RunningRequest {
    shared: Arc<ServerShared>,
    activity: Arc<Activity>,
}

impl RunningRequest {
    fn start(shared: &Arc<ServerShared>, activity: &Arc<Activity>) -> Self {
        shared.requests_running.fetch_add(1, Ordering::Relaxed);
        activity.request_started();
        Self {
            shared: Arc::clone(shared),
            activity: Arc::clone(activity),
        }
    }
}

impl Drop for RunningRequest {
    fn drop(&mut self) {
        self.shared.requests_running.fetch_sub(1, Ordering::Relaxed);
        self.activity.request_ended();
    }
}

/// The requests of one connection that are running (or waiting to start), by request
/// id, each with the sender that cancels it and its in-flight slot. At most
/// [`SERVER_REQUESTS_IN_FLIGHT_MAX`] entries, as each holds a slot.
///
/// A slot lives in its request's entry, so it is freed exactly when the entry leaves:
/// when the request's task ends, or at once when the reader acts on a cancel for it (the
/// task, told to stop, ends at its next poll without running anything more). A slot
/// freed by a cancel is free for the very next frame the reader reads, which is often
/// the request the client sent in the cancelled one's place.
#[derive(Debug, Default)]
struct Cancels {
    state: Mutex<CancelsState>,
}

#[derive(Debug, Default)]
struct CancelsState {
    running: BTreeMap<u64, Registered>,
    /// Tells apart the entries of one request id taken again after a cancel removed its
    /// first entry (a client must not reuse an id before its reply, a hostile one may).
    next_registration: u64,
}

/// A running request's entry in [`Cancels`].
#[derive(Debug)]
struct Registered {
    registration: u64,
    cancel: oneshot::Sender<()>,
    _slot: OwnedSemaphorePermit,
}

impl Cancels {
    fn lock(&self) -> std::sync::MutexGuard<'_, CancelsState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Registers request `request_id` holding `slot`; the receiver resolves when a cancel
    /// for it arrives.
    ///
    /// # Errors
    /// The slot, handed back, if a request of that id is already running on this
    /// connection.
    fn register(
        self: &Arc<Self>,
        request_id: u64,
        slot: OwnedSemaphorePermit,
    ) -> Result<(CancelEntry, oneshot::Receiver<()>), OwnedSemaphorePermit> {
        let mut state = self.lock();
        if state.running.contains_key(&request_id) {
            return Err(slot);
        }
        let registration = state.next_registration;
        state.next_registration += 1;
        let (cancel, cancelled) = oneshot::channel();
        state.running.insert(
            request_id,
            Registered {
                registration,
                cancel,
                _slot: slot,
            },
        );
        assert!(
            state.running.len() <= SERVER_REQUESTS_IN_FLIGHT_MAX,
            "{} requests registered on one connection, over {SERVER_REQUESTS_IN_FLIGHT_MAX}",
            state.running.len()
        );
        let entry = CancelEntry {
            cancels: Arc::clone(self),
            request_id,
            registration,
        };
        Ok((entry, cancelled))
    }

    /// Cancels request `request_id` and frees its slot; `false` if it is not running.
    fn cancel(&self, request_id: u64) -> bool {
        let removed = self.lock().running.remove(&request_id);
        // The request's task may be ending at this moment: then nothing is cancelled.
        // Its slot is freed here either way, outside the lock.
        removed.is_some_and(|registered| registered.cancel.send(()).is_ok())
    }
}

/// A request's place in its connection's [`Cancels`]; removed when dropped (its task
/// ended), which frees its slot, unless a cancel removed it first.
struct CancelEntry {
    cancels: Arc<Cancels>,
    request_id: u64,
    registration: u64,
}

impl Drop for CancelEntry {
    fn drop(&mut self) {
        let removed = {
            let mut state = self.cancels.lock();
            match state.running.get(&self.request_id) {
                Some(registered) if registered.registration == self.registration => {
                    state.running.remove(&self.request_id)
                }
                // Cancelled (removed then), and perhaps its id taken again since.
                _ => None,
            }
        };
        // The slot is freed here, outside the lock.
        drop(removed);
    }
}

/// Runs one connection until the peer closes it, a frame is bad, a write fails or
/// stalls, the handshake or the idle timer runs out, or the server is dropped. Reading,
/// writing and the idle timer run in this one task, so when any ends the socket is
/// closed at once; when the server is dropped, reading stops at once and the
/// connection goes away ([`go_away`]) before it closes.
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    handle: RuntimeHandle,
    ticket: ConnectionTicket,
    stop: StopSignal,
) {
    let shared = Arc::clone(&ticket.shared);
    // Nagle would hold small replies back; failing to disable it only costs latency.
    let _ = stream.set_nodelay(true);
    let (mut reader, mut writer) = tokio::io::split(stream);
    let (responses, mut response_queue) = mpsc::channel::<BudgetedFrame>(WRITE_QUEUE_CAPACITY);
    let slots = Arc::new(Semaphore::new(SERVER_REQUESTS_IN_FLIGHT_MAX));
    let budget = ByteBudget::for_connection(Arc::clone(&shared.bytes_in_flight));
    let cancels = Arc::new(Cancels::default());
    let activity = Arc::new(Activity {
        clock: handle.clock(),
        state: Mutex::new(ActivityState {
            last: handle.now(),
            requests_running: 0,
        }),
    });
    // Request frames read whole on this connection, in the order the client wrote them;
    // counted in the same poll as the request is handed to its task (no await between),
    // so a request not counted never runs. Told to the client when the server stops.
    let requests_read = AtomicU64::new(0);
    let handshake_done = AtomicBool::new(false);
    let read_requests = async {
        // The first frame must be a hello: no request is served before the client
        // knows this runtime's clock.
        let handshake = serve_connection_handshake(&mut reader, &handle, &budget, &responses);
        match tokio::time::timeout(Duration::from_millis(HANDSHAKE_TIMEOUT_MS), handshake).await {
            Err(_elapsed) => return Err(ConnectionEnd::HandshakeTimeout),
            Ok(handshake) => handshake?,
        }
        handshake_done.store(true, Ordering::Relaxed);
        activity.touch();
        loop {
            // Read whatever the slots: a cancel must reach its request, and free its
            // slot, while every slot is taken. Bytes are budgeted before the body is
            // read: past the budget, the server stops reading this connection until a
            // request ends or a reply is written.
            let size_bytes = read_frame_length(&mut reader, FRAME_SIZE_MAX_BYTES).await?;
            let request_bytes = budget.acquire(FRAME_HEADER_SIZE_BYTES + size_bytes).await;
            let message = read_frame_body::<ClientMessage, _>(&mut reader, size_bytes).await?;
            activity.touch();
            let request = match message {
                ClientMessage::Request(request) => {
                    requests_read.fetch_add(1, Ordering::Relaxed);
                    request
                }
                ClientMessage::Hello(hello) => {
                    drop(request_bytes);
                    answer_hello(&hello, &handle, &budget, &responses).await?;
                    continue;
                }
                ClientMessage::Probe(probe) => {
                    drop(request_bytes);
                    if probe.path.len() <= CALL_CHAIN_LENGTH_MAX {
                        if let Some(sink) = &shared.probes.0 {
                            sink.on_probe(probe);
                        }
                    }
                    continue;
                }
                ClientMessage::Cancel(WireCancel { request_id }) => {
                    drop(request_bytes);
                    let counter = if cancels.cancel(request_id) {
                        &shared.requests_cancelled
                    } else {
                        &shared.cancels_unmatched
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                // Every slot runs a request: refused at once, never queued. Answering
                // waits only for room in the byte budget and the write queue, as any
                // reply does.
                shared.requests_refused_busy.fetch_add(1, Ordering::Relaxed);
                let response = refuse_busy(&request);
                drop(request_bytes);
                let response_bytes = budget.acquire(response.len()).await;
                let refusal = BudgetedFrame {
                    frame: response,
                    _permit: response_bytes,
                };
                if responses.send(refusal).await.is_err() {
                    return Err(ConnectionEnd::Frame(FrameError::Closed));
                }
                continue;
            };
            let running = RunningRequest::start(&shared, &activity);
            let records_edges = shared.probes.0.is_none();
            let handle = handle.clone();
            let responses = responses.clone();
            let budget = budget.clone();
            let registered = cancels.register(request.request_id, slot);
            if registered.is_err() {
                shared.requests_refused_duplicate_id.fetch_add(1, Ordering::Relaxed);
            }
            tokio::spawn(async move {
                let (entry, mut cancelled) = match registered {
                    Ok(registered) => registered,
                    Err(slot) => {
                        // Holds its slot until its refusal is queued.
                        let _slot = slot;
                        let response = refuse_duplicate_id(&request);
                        drop(request_bytes);
                        let response_bytes = budget.acquire(response.len()).await;
                        let _ = responses
                            .send(BudgetedFrame {
                                frame: response,
                                _permit: response_bytes,
                            })
                            .await;
                        return;
                    }
                };
                let response = tokio::select! {
                    biased;
                    // The connection closed: nobody can receive the reply. Dropping the
                    // call abandons it (unrun if it has not started, its turn cancelled
                    // and rolled back if it has) and releases its wait-for edge now
                    // rather than at its deadline.
                    () = responses.closed() => return,
                    // Its caller stopped waiting and said so: the same.
                    _ = &mut cancelled => return,
                    response = serve_connection_request(&handle, request, records_edges) => response,
                };
                // The request is gone; its bytes now go to the reply.
                drop(request_bytes);
                let response_bytes = tokio::select! {
                    biased;
                    () = responses.closed() => return,
                    _ = &mut cancelled => return,
                    permit = budget.acquire(response.len()) => permit,
                };
                let place = tokio::select! {
                    biased;
                    _ = &mut cancelled => return,
                    // The connection closed: the reply is dropped.
                    place = responses.reserve() => match place {
                        Ok(place) => place,
                        Err(_closed) => return,
                    },
                };
                // The slot is freed before the reply is queued: a client may send its
                // next request as soon as it reads this reply, and it must find the
                // slot free, not be refused busy.
                drop(entry);
                place.send(BudgetedFrame {
                    frame: response,
                    _permit: response_bytes,
                });
                drop(running);
            });
        }
    };
    // Boxed, so that each can be dropped (and its borrow of its half of the socket
    // ended) on its own when the server stops.
    let mut read_requests = Box::pin(read_requests);
    // Once the server stops, the queue is closed and what it holds is written; then
    // this ends `Ok`.
    let mut write_replies = Box::pin(write_frames(
        &mut writer,
        &mut response_queue,
        Some(Duration::from_millis(WRITE_STALL_TIMEOUT_MS)),
        || activity.touch(),
        stop.stopped(),
    ));
    let ended: ConnectionEnd = tokio::select! {
        biased;
        () = stop.stopped() => ConnectionEnd::Stopped,
        read = &mut read_requests => {
            let read: Result<std::convert::Infallible, ConnectionEnd> = read;
            match read {
                Err(end) => end,
            }
        }
        // The queue never closes while the reader holds a sender and the server runs:
        // `Ok` is unreachable.
        written = &mut write_replies => ConnectionEnd::Frame(written.err().unwrap_or(FrameError::Closed)),
        () = activity.until_idle() => ConnectionEnd::Idle,
    };
    // Reading stops here: no request is read, hence run, any more.
    drop(read_requests);
    if matches!(ended, ConnectionEnd::Stopped) && handshake_done.load(Ordering::Relaxed) {
        let going_away = GoingAway {
            requests_read: requests_read.load(Ordering::Relaxed),
        };
        let clock = handle.clock();
        let write_by = clock.deadline_in(Duration::from_millis(GOING_AWAY_WRITE_MS_MAX));
        let written = clock.run_until(write_by, write_replies).await;
        if matches!(written, Ok(Ok(()))) {
            go_away(
                &mut reader,
                &mut writer,
                going_away,
                write_by.remaining(clock.now()),
                peer,
            )
            .await;
        }
    } else {
        drop(write_replies);
    }
    match &ended {
        ConnectionEnd::Stopped | ConnectionEnd::Frame(FrameError::Closed) => {
            tracing::debug!(%peer, "transport connection closed");
        }
        ConnectionEnd::HandshakeTimeout => {
            shared
                .connections_closed_handshake_timeout
                .fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%peer, "transport connection closed: no hello within {HANDSHAKE_TIMEOUT_MS} ms");
        }
        ConnectionEnd::Idle => {
            shared.connections_closed_idle.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(%peer, "transport connection closed: idle for {SERVER_CONNECTION_IDLE_TIMEOUT_MS} ms");
        }
        ConnectionEnd::Frame(error @ FrameError::WriteStalled { .. }) => {
            shared.connections_closed_write_stalled.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, %error, "transport connection closed");
        }
        ConnectionEnd::Frame(error) => tracing::warn!(%peer, %error, "transport connection closed on error"),
    }
    drop(ticket);
}

/// The end of a connection whose server stopped, once reading stopped and every reply
/// queued was written: writes `going_away` within `write_time` (the client then knows
/// which of its requests were never read), shuts the writing side, and reads
/// (discarding, running nothing) until the client closes, at most
/// [`GOING_AWAY_LINGER_MS`]: closing a socket with unread bytes resets it, and a reset
/// may erase, at the client, the last frame before it is read.
async fn go_away<R, W>(reader: &mut R, writer: &mut W, going_away: GoingAway, write_time: Duration, peer: SocketAddr)
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let frame = encode_frame(&ServerMessage::GoingAway(going_away)).expect("a going-away frame encodes");
    match tokio::time::timeout(write_time, write_frame_now(writer, &frame, None)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => {
            tracing::debug!(%peer, %error, "transport connection: the going-away frame was not written");
            return;
        }
        Err(_elapsed) => {
            tracing::debug!(%peer, "transport connection: the going-away frame was not written in time");
            return;
        }
    }
    tracing::debug!(%peer, requests_read = going_away.requests_read, "transport connection going away");
    let _ = writer.shutdown().await;
    let linger = async {
        let mut discarded = [0_u8; 4_096];
        while matches!(reader.read(&mut discarded).await, Ok(read) if read > 0) {}
    };
    let _ = tokio::time::timeout(Duration::from_millis(GOING_AWAY_LINGER_MS), linger).await;
}

/// Reads the connection's first frame, which must be a valid hello of at most
/// [`HANDSHAKE_FRAME_SIZE_MAX_BYTES`], and answers it.
///
/// # Errors
/// As [`read_frame`] and [`answer_hello`]; [`FrameError::Handshake`] if the first frame
/// is a request.
async fn serve_connection_handshake<R>(
    reader: &mut R,
    handle: &RuntimeHandle,
    budget: &ByteBudget,
    responses: &mpsc::Sender<BudgetedFrame>,
) -> Result<(), FrameError>
where
    R: tokio::io::AsyncRead + Unpin,
{
    match read_frame::<ClientMessage, _>(reader, HANDSHAKE_FRAME_SIZE_MAX_BYTES).await? {
        ClientMessage::Hello(hello) => answer_hello(&hello, handle, budget, responses).await,
        ClientMessage::Request(_) | ClientMessage::Probe(_) | ClientMessage::Cancel(_) => Err(FrameError::Handshake {
            cause: "the first frame was a request, not a hello (an older or foreign client?)".to_string(),
        }),
    }
}

/// Answers a hello with this runtime's clock reading, read now (after the hello
/// arrived, before the answer leaves: inside the client's round trip). Queues the
/// answer behind replies already queued, which only widens the client's bound.
///
/// # Errors
/// [`FrameError::Handshake`] when the client is not a Troupe client or speaks another
/// protocol version; a client of another version is answered first, so it can report
/// both versions. [`FrameError::Closed`] if the connection's writer is gone.
async fn answer_hello(
    hello: &Hello,
    handle: &RuntimeHandle,
    budget: &ByteBudget,
    responses: &mpsc::Sender<BudgetedFrame>,
) -> Result<(), FrameError> {
    let refusal = hello.refusal();
    // A foreign peer gets no answer; a Troupe client of another version gets ours.
    if refusal.is_none() || hello.magic == WIRE_MAGIC {
        let frame = encode_frame(&ServerMessage::HelloAck(hello.ack(handle.now())))?;
        let ack = BudgetedFrame {
            _permit: budget.acquire(frame.len()).await,
            frame,
        };
        if responses.send(ack).await.is_err() {
            return Err(FrameError::Closed);
        }
    }
    match refusal {
        None => Ok(()),
        Some(cause) => {
            // Give the writer (polled beside this reader) a moment to send the answer
            // before the connection closes.
            let linger = Duration::from_millis(HANDSHAKE_REFUSAL_LINGER_MS);
            let _ = tokio::time::timeout(linger, responses.closed()).await;
            Err(FrameError::Handshake { cause })
        }
    }
}

/// The response frame refusing `request`, whose id is already in flight on its
/// connection (a cancel could not tell the two apart); it never runs.
fn refuse_duplicate_id(request: &WireRequest) -> Bytes {
    let result = Err(InvokeError::Rejected {
        target: request.target.clone(),
        reason: format!(
            "request id {} is already in flight on this connection; a client must not reuse an id until its reply",
            request.request_id
        ),
    });
    encode_frame(&ServerMessage::Response(WireResponse {
        request_id: request.request_id,
        result,
    }))
    .expect("a response holding only an error fits a frame")
}

/// The response frame refusing `request`, which arrived while its connection ran
/// [`SERVER_REQUESTS_IN_FLIGHT_MAX`] requests; it never runs. A client that keeps within
/// its own limit meets this only when one of its cancels was lost, or a reply is late.
fn refuse_busy(request: &WireRequest) -> Bytes {
    let result = Err(InvokeError::ConnectionBusy {
        target: request.target.clone(),
        capacity: SERVER_REQUESTS_IN_FLIGHT_MAX,
    });
    encode_frame(&ServerMessage::Response(WireResponse {
        request_id: request.request_id,
        result,
    }))
    .expect("a response holding only an error fits a frame")
}

/// Runs one request on the runtime and encodes its response frame. A request whose
/// deadline has passed on this runtime's clock is answered `Timeout` without running.
///
/// With `records_edges`, a request that names its waiting caller adds the wait-for edge
/// `caller → target` to this runtime's graph (a node pair that is not a cluster: a
/// two-node cycle is then refused by the host's graph). Without (a cluster node, which
/// chases cycles with probes), the edge is the waiter's node's alone, as the probe
/// protocol has it: a copy here could outlive the caller's wait (the caller's node's
/// cancel is best effort and may be lost) and name a cycle that no longer exists.
async fn serve_connection_request(handle: &RuntimeHandle, request: WireRequest, records_edges: bool) -> Bytes {
    let request_id = request.request_id;
    let target = request.target.clone();
    #[cfg(feature = "planted-bugs")]
    let checks = !handle.shared.planted_no_arrival_checks;
    #[cfg(not(feature = "planted-bugs"))]
    let checks = true;
    // A malformed key is refused before anything runs, as a malformed context is.
    let key = request.idempotency_key();
    let result = match request
        .context(handle.now())
        .and_then(|context| key.map(|key| (context, key)))
    {
        Err(refused) => Err(refused),
        Ok((context, _)) if checks && context.contains(&target) => {
            Err(InvokeError::Refused(CallRefused::CycleDetected {
                chain: context.chain().iter().chain([&target]).cloned().collect(),
            }))
        }
        Ok((context, _)) if checks && context.depth() > AGENT_CALL_DEPTH_MAX => {
            Err(InvokeError::Refused(CallRefused::DepthExceeded {
                depth: context.depth().saturating_sub(1),
                max: AGENT_CALL_DEPTH_MAX,
            }))
        }
        Ok((context, key)) if request.tell => {
            // Answered at acceptance; the turn runs on its own, under its own deadline.
            let payload = match key {
                None => crate::envelope::Payload::Bytes(request.payload),
                Some(key) => crate::envelope::Payload::keyed(&key, request.payload),
            };
            handle
                .send_only(&target, payload, context.into())
                .await
                .map(|()| Bytes::new())
        }
        Ok((context, key)) => {
            let caller = request.waiting_caller().cloned();
            let payload = match key {
                None => crate::envelope::Payload::Bytes(request.payload),
                Some(key) => crate::envelope::Payload::keyed(&key, request.payload),
            };
            // The context was rebuilt on this clock, its deadline capped: sent as is (a
            // root call's, with an empty chain, keeps its trace id).
            let waiting = match &caller {
                Some(caller) if records_edges => Some((caller, None)),
                _ => None,
            };
            handle
                .send_and_wait(&target, payload, context.into(), waiting)
                .await
                .and_then(|reply| reply.into_bytes(&target))
        }
    };
    match encode_frame(&ServerMessage::Response(WireResponse { request_id, result })) {
        Ok(frame) => frame,
        Err(error) => {
            // Only a reply can be too large here (an error fits a frame): the turn ran and
            // committed, so the caller must not take this for a turn that did nothing.
            let cause = format!(
                "its turn ran and its effects are committed, but the reply cannot be sent: {error}; \
                 a reply between nodes must fit a frame: return less, or store it and return a reference"
            );
            let result = Err(InvokeError::ActorFailed { target, cause });
            encode_frame(&ServerMessage::Response(WireResponse { request_id, result }))
                .expect("a response holding only an error fits a frame")
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use troupe_core::{ActorId, ActorKind, CallContext};

    use super::*;
    use crate::transport::clock_sync::ClockSync;
    use crate::{Actor, ActorBox, ActorError, KindConfig, Runtime, Turn, FRAME_SIZE_MAX_BYTES};

    /// Counts its turns.
    struct Counting(Arc<AtomicU64>);

    impl Actor for Counting {
        async fn handle(&mut self, _turn: &mut Turn, _payload: Bytes) -> Result<Bytes, ActorError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(Bytes::from_static(b"ran"))
        }
    }

    /// Counts its turns and answers one byte more than a frame holds.
    struct Oversized(Arc<AtomicU64>);

    impl Actor for Oversized {
        async fn handle(&mut self, _turn: &mut Turn, _payload: Bytes) -> Result<Bytes, ActorError> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(Bytes::from(vec![b'x'; FRAME_SIZE_MAX_BYTES + 1]))
        }
    }

    async fn serve(handle: &RuntimeHandle, key: Option<&str>) -> Result<Bytes, InvokeError> {
        serve_to(handle, ActorId::new("counting", "c").unwrap(), key).await
    }

    async fn serve_to(handle: &RuntimeHandle, target: ActorId, key: Option<&str>) -> Result<Bytes, InvokeError> {
        let now = handle.now();
        let context = CallContext::root(handle.deadline_in(Duration::from_secs(10)));
        let sync = ClockSync::from_handshake(now, now, now);
        let mut request = WireRequest::new(1, target, Bytes::new(), &context, None, &sync, now);
        request.key = key.map(str::to_string);
        let frame = serve_connection_request(handle, request, true).await;
        let message: ServerMessage = read_frame(&mut &frame[..], FRAME_SIZE_MAX_BYTES).await.unwrap();
        let ServerMessage::Response(response) = message else {
            panic!("a request is answered with a response: {message:?}")
        };
        response.result
    }

    /// Goal: a request whose idempotency key is malformed (empty, too long, a control
    /// character: a client that did not build it with `IdempotencyKey`) is refused
    /// `Rejected`, naming the key, and its target's handler does not run; a valid key
    /// runs it keyed (a second attempt gets the recorded reply unrun).
    #[tokio::test]
    async fn a_request_with_a_malformed_key_is_refused_and_nothing_runs() {
        let turns = Arc::new(AtomicU64::new(0));
        let runtime = Runtime::builder()
            .register(
                ActorKind::new("counting").unwrap(),
                {
                    let turns = Arc::clone(&turns);
                    move |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> {
                        Ok(ActorBox::new(Counting(Arc::clone(&turns))))
                    }
                },
                KindConfig::default(),
            )
            .unwrap()
            .start();
        let handle = runtime.handle();
        let too_long = "k".repeat(crate::IDEMPOTENCY_KEY_LENGTH_MAX_BYTES + 1);
        for malformed in ["", "a\u{7}b", too_long.as_str()] {
            let refused = serve(&handle, Some(malformed)).await.unwrap_err();
            assert!(
                matches!(&refused, InvokeError::Rejected { reason, .. } if reason.contains("idempotency key is malformed")),
                "{refused:?}"
            );
        }
        assert_eq!(turns.load(Ordering::SeqCst), 0, "nothing ran");
        assert_eq!(&serve(&handle, Some("k-1")).await.unwrap()[..], b"ran");
        assert_eq!(
            &serve(&handle, Some("k-1")).await.unwrap()[..],
            b"ran",
            "the recorded reply"
        );
        assert_eq!(turns.load(Ordering::SeqCst), 1, "the keyed request ran once");
        assert_eq!(&serve(&handle, None).await.unwrap()[..], b"ran");
        assert_eq!(turns.load(Ordering::SeqCst), 2, "an unkeyed one runs");
        runtime.shutdown().await;
    }

    /// Goal: a turn that ran and committed but whose reply does not fit a frame is
    /// answered `ActorFailed` saying so (the effects are committed; what to do), not only
    /// "the reply cannot be sent", which a caller could take for a turn that did nothing
    /// and retry unkeyed (helper-50's cluster probe, 2026-12-06). Method: an actor whose
    /// reply is one byte over `FRAME_SIZE_MAX_BYTES`, asked through the server's request
    /// path.
    #[tokio::test]
    async fn a_reply_too_large_for_a_frame_says_the_turn_ran_and_committed() {
        let turns = Arc::new(AtomicU64::new(0));
        let runtime = Runtime::builder()
            .register(
                ActorKind::new("oversized").unwrap(),
                {
                    let turns = Arc::clone(&turns);
                    move |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> {
                        Ok(ActorBox::new(Oversized(Arc::clone(&turns))))
                    }
                },
                KindConfig::default(),
            )
            .unwrap()
            .start();
        let target = ActorId::new("oversized", "o").unwrap();
        let refused = serve_to(&runtime.handle(), target, None).await.unwrap_err();
        let InvokeError::ActorFailed { cause, .. } = &refused else {
            panic!("{refused:?}")
        };
        assert!(
            cause.contains("its turn ran and its effects are committed") && cause.contains("exceeds the limit"),
            "{cause}"
        );
        assert_eq!(turns.load(Ordering::SeqCst), 1);
        runtime.shutdown().await;
    }
}

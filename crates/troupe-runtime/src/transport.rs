//! The network transport: lets one node invoke actors hosted by another node's runtime.
//!
//! ```text
//!  caller node                                          host node
//!  TransportClient::invoke(target, payload, context)    TransportServer (one task per connection)
//!    │ lazy connect by a connect task of its own          │ accept: over a connection cap? → close
//!    │ (one TCP connection, multiplexed; callers wait     │   at once, unread
//!    │ for it until their own deadlines)                  │
//!    │ ── Hello { magic, version, client_now } ───────►   │ within HANDSHAKE_TIMEOUT_MS: check
//!    │ ◄── HelloAck { echoed client_now, server_now } ──  │   magic and version (server_now read
//!    │ ClockSync: server clock bounded from the round trip│   on arrival)
//!    │ register request_id in the bounded pending map     │ read length → take that many bytes of
//!    │ deadline translated to the HOST's clock, made      │   the connection's budget → read body
//!    │ earlier by the bound's error and the return        │   → spawn one task per request:
//!    │ allowance (never later; at most half the time left)│
//!    │ frame → budget → writer ── Request frame ───────►  │   deadline already passed? → Timeout,
//!    │ wait for the reply until the LOCAL deadline        │     never runs; rebuild CallContext;
//!    │                                                    │   RuntimeHandle::invoke / invoke_from
//!    ◄───────────────────────── Response frame ────────── │ reply → budget → bounded writer queue
//!    reader task: request_id → waiting caller (late       │ idle timer, write-stall timer
//!    replies are dropped); idle timer                     │
//!    caller's future dropped before its reply ─ Cancel ─► │ request_id → its task: dropped, so
//!    and deadline (turn ended, gave up; never waits)      │   the turn is cancelled, rolled back
//! ```
//!
//! Owns: the frame codec (a `u32` big-endian length prefix, then a bincode body of at
//! most [`FRAME_SIZE_MAX_BYTES`]), the wire messages and the clock handshake,
//! [`TransportClient`] and [`TransportServer`]. It is plain `tokio::net` code; under
//! `--cfg madsim` the simulator swaps in its own TCP, so partitions, latency and node
//! kills hit this exact code.
//!
//! # Deadlines across nodes
//!
//! Each runtime's [`Clock`](crate::Clock) is anchored on its machine's wall clock when it
//! starts, so two clocks differ by the machines' skew (and by anything that stepped a
//! wall clock between the two anchors); a call's deadline must never depend on that, so
//! it is translated when it crosses the wire. Every new connection (and so every reconnect)
//! starts with a handshake: the client sends `Hello` stamped with its clock (`sent`),
//! the server answers `HelloAck` with the stamp echoed and its own clock read when the
//! hello arrived, and the client reads its clock when the answer arrives (`received`).
//! The server's reading happened inside `[sent, received]`, so the offset
//! `server − client` is within half the round trip of `server_now − (sent + rtt/2)`. A
//! request carries its deadline as an absolute instant on the server's clock, computed
//! with the LOWER end of that interval (`server_now − received`), minus
//! `CLOCK_ROUNDING_US` (both clocks are read in whole microseconds) and a drift
//! allowance of `CLOCK_DRIFT_PPM_MAX` (1,000 ppm) of the bound's age. The bound is
//! refreshed by another hello on the open connection once it is older than
//! `CLOCK_RESYNC_INTERVAL_MS` (1 s), sent with the next request rather than on a timer;
//! the tighter of the old (drift-discounted) and new bound is kept. The server refuses a
//! request whose deadline has passed when it is read, answering `Timeout`; the
//! dispatcher and the activation check again before the turn starts.
//!
//! The host's answer must also travel back before the caller stops waiting. The
//! translation keeps one return leg of the handshake, which covers a steady link; for
//! the rest every translated deadline is made earlier by the connection's return
//! allowance: [`RETURN_ALLOWANCE_MS_MIN`] (5 ms, scheduling) plus the spread (largest
//! minus smallest) of its last `ROUND_TRIP_SAMPLES` (8) measured round trips (the
//! handshake's and each refresh's: the network's jitter), at most
//! [`RETURN_ALLOWANCE_MS_MAX`] (100 ms), and at most
//! [`RETURN_ALLOWANCE_SHARE_OF_LEFT_MAX_PERCENT`] (half) of the request's time left: a
//! short call is sent, its host given the other half. Without it, a host
//! ending its work a few milliseconds before its deadline (its store retries stop
//! 5–10 ms before) answered a caller who had given up whenever the answer's trip was
//! slower than the handshake's (7 simulated seeds in 200 at 1–10 ms a message).
//!
//! Why this design rather than the alternatives: sending the time remaining (what this
//! transport did first) gives the transit time back to the host, and a request held up
//! by a partition or retransmissions ran with its whole budget after its caller had
//! given up. Sending deadlines as they are, on clocks anchored on the wall clock, trusts
//! the machines' clocks to be synchronized, which a skew or a stepped clock breaks. A
//! cancel message alone (there is one, for callers that stop before their deadline)
//! cannot stop a request held up in a partition: it is held up with it. The
//! handshake needs no clock synchronization beyond the connection, costs one round trip
//! per connection, and errs only on the safe side: a remote call gets at most one
//! handshake round trip (plus the allowances) less time than its caller, never more.
//!
//! # Guarantees
//!
//! - A call never outlives its deadline on the caller's clock: the wait is bounded by
//!   [`crate::Clock::run_until`]; waiting for the connection (whose attempt goes on for
//!   other callers, within [`CONNECT_TIMEOUT_MS`]), for an in-flight slot and for room in
//!   the connection's byte budget are inside that bound.
//! - The host's deadline for a request is never later than its caller's, whatever the
//!   latency, loss or partition in between (assuming the two clocks' rates differ by at
//!   most `CLOCK_DRIFT_PPM_MAX`; `tokio::time` is monotonic and, under madsim, exact).
//!   It is earlier by the time the handshake's answer took to come back (at most the
//!   handshake's round trip), plus 1 µs, the drift allowance and the return allowance.
//! - Expired work never runs: a request that arrives after its deadline (on the host's
//!   clock, hence after its caller's deadline) is answered [`InvokeError::Timeout`]
//!   without starting a turn; that reply reaches a caller who has stopped waiting and is
//!   discarded (counted in `late_replies_discarded`).
//! - A peer that is not a Troupe transport, or speaks another protocol version
//!   (`WIRE_PROTOCOL_VERSION`), fails the handshake with a [`FrameError::Handshake`]
//!   naming both versions; the caller sees [`InvokeError::Unreachable`]. A server
//!   answers a hello of another version before closing, so the client can say which
//!   version it met; it serves nothing before a valid hello.
//! - A keyed request ([`TransportClient::invoke_keyed`], since protocol version 5)
//!   carries its idempotency key; the host checks it on arrival (a malformed one is
//!   refused [`InvokeError::Rejected`], nothing run) and runs the request as a keyed
//!   turn, as [`RuntimeHandle::invoke_keyed`](crate::RuntimeHandle::invoke_keyed) does:
//!   an attempt sent again with the same key, after a `Timeout` or `Unreachable` that
//!   left its outcome unknown, on any connection, gets the first committed reply and the
//!   handler does not run again.
//! - Depth, chain and trace id arrive intact: the host replays the chain with
//!   [`CallContext::child`], so cycle and depth checks hold across nodes. When the request
//!   names a caller (or the chain does) the host records the wait-for edge with
//!   [`RuntimeHandle::invoke_from`](crate::RuntimeHandle::invoke_from), unless the server
//!   hands deadlock probes to a cluster node
//!   ([`TransportServer::serve_with_probes`]), whose waiter's node keeps the edge. The
//!   host refuses again a chain that holds the target (`CycleDetected`) and a depth over
//!   the limit (`DepthExceeded`).
//! - When a connection breaks (reset, EOF, an oversized or undecodable frame, a failed
//!   handshake) every call pending on it fails at once with
//!   [`InvokeError::Unreachable`]; none waits for its deadline. The next call opens a
//!   new connection, with a new handshake.
//! - A failed request says how far it got ([`TransportClient::attempt`]'s
//!   [`RequestFailure::delivery`]): [`Delivery::NeverSent`] when the server never read
//!   it (no connection could be had: refused, timed out, handshake failed; the
//!   connection had closed before the request was queued; the deadline passed first;
//!   or the server, stopping, said it had not read it: below), so it did not run and
//!   may be sent to another node; [`Delivery::MaybeSent`] once it was queued on an open
//!   connection and may have been read (it may have run). A request queued on a
//!   connection that broke without the server's word (reset, killed node, partition)
//!   counts as maybe sent.
//! - A server that stops (dropped: its node leaving) goes away cleanly (since protocol
//!   version 7): each connection stops reading at once (a request not wholly read then
//!   never runs), writes the replies already queued, then a last `GoingAway` frame
//!   with the number of request frames it read on that connection, shuts its side and
//!   reads (discarding) until the client closes, at most `GOING_AWAY_LINGER_MS` (1 s),
//!   so that unread bytes do not turn the close into a reset that could erase the last
//!   frame at the client. The client numbers its requests in the order it queues them
//!   on the connection (the order they are written, and read; not their ids, which are
//!   taken before queuing), and on `GoingAway` fails at once every request queued
//!   after the first `requests_read` as `Unreachable`, [`Delivery::NeverSent`], and
//!   the others (read, unanswered: they may have run, or been abandoned) as
//!   `Unreachable`, [`Delivery::MaybeSent`]. Requests running when the server stops are
//!   abandoned, as on any close. Writing the replies and `GoingAway` takes at most
//!   `GOING_AWAY_WRITE_MS_MAX` (1 s); past it the connection closes without it.
//! - Nothing grows without bound: the client's pending map holds at most
//!   [`CLIENT_REQUESTS_IN_FLIGHT_MAX`] entries (a caller over it waits for a slot until its
//!   deadline), an entry is freed when its caller stops waiting for any reason, the
//!   server runs at most [`SERVER_REQUESTS_IN_FLIGHT_MAX`] requests per connection (one
//!   more is answered [`InvokeError::ConnectionBusy`] at once, unrun, and the server
//!   keeps reading, so cancels reach their requests while every slot is taken; a
//!   cancel frees its request's slot as it is read), both write queues are bounded in frames
//!   ([`WRITE_QUEUE_CAPACITY`]) and in bytes (below), and at most one refresh hello per
//!   connection is outstanding.
//! - A bad frame from the network is a typed [`FrameError`] that closes that connection;
//!   it never panics the node (a property test feeds the decoder garbage). A length over
//!   the limit is refused before anything is allocated, and a body's buffer grows with
//!   the bytes that arrive, not with the length announced.
//! - Connecting is not tied to any caller: a connect task opens the connection (TCP
//!   connect and handshake) within [`CONNECT_TIMEOUT_MS`] and stores it for every caller;
//!   each caller waits for it until its own deadline. A caller with a short deadline no
//!   longer takes the attempt down with it, and a server that accepts but never answers
//!   fails its callers with `Unreachable` at the connect timeout.
//!
//! # Slow and hostile peers
//!
//! A server protects itself and its other peers, each limit a constant of this module:
//!
//! | Limit | Value | What happens past it |
//! |---|---|---|
//! | [`CONNECTIONS_PER_NODE_MAX`] | 256 connections | a new one is closed at once, unread; counted in [`TransportServerStats::connections_refused`] |
//! | [`CONNECTIONS_PER_PEER_MAX`] | 32 per peer IP address | the same; one peer cannot take a node's every connection |
//! | [`HANDSHAKE_TIMEOUT_MS`] | 5 s from accept to a valid hello | closed, however many bytes trickled in meanwhile |
//! | [`HANDSHAKE_FRAME_SIZE_MAX_BYTES`] | 64 bytes before the handshake | a longer first frame is refused unread |
//! | [`SERVER_CONNECTION_IDLE_TIMEOUT_MS`] | 60 s without a request running or a whole frame read or written | closed (so a peer trickling a frame is closed 60 s after its last whole frame) |
//! | [`WRITE_STALL_TIMEOUT_MS`] | 10 s without the peer taking any reply bytes | closed: the peer is not reading |
//! | [`CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES`] | 32 MiB per connection: requests read and not answered plus replies not written | the server stops reading that connection until bytes are freed |
//!
//! A connection over a limit affects only itself: each connection has its own task,
//! budget and timers, so a peer that trickles, hoards connections or never reads does not
//! delay another peer's calls (tests: `hostile_peers_that_hoard_or_trickle_connections_*`,
//! `a_peer_that_never_reads_*`). The client's side: a connection with no call for
//! [`CLIENT_CONNECTION_IDLE_TIMEOUT_MS`] (30 s, below the server's 60 s, so the client
//! closes first and never loses a request to the server's idle close) is closed by the
//! client, and the next call opens a new one; its queued requests are bounded by the
//! same byte budget, and it has no write-stall timeout (a server stops reading on
//! purpose under its limits; callers are bounded by their deadlines).
//!
//! Worst case, a node's transport buffers `CONNECTIONS_PER_NODE_MAX ×
//! CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES` = 8 GiB (plus the replies its actors have
//! produced and not yet queued): the budget must hold one whole frame of
//! [`FRAME_SIZE_MAX_BYTES`] (16 MiB). A node that cannot afford that should lower the
//! frame limit.
//! - When a connection closes, the host abandons the calls it carried: a request not yet
//!   started never runs, and the wait-for edges of those calls are released at once.
//! - A tell ([`TransportClient::tell`]) is a request with its `tell` flag set: the host
//!   runs the same arrival checks, hands the message to its runtime as a local tell, and
//!   answers as soon as the runtime accepted it (an empty reply) or refused it; the
//!   turn then runs on its own under the request's deadline, and its reply goes nowhere.
//! - A caller that stops waiting cancels its remote call: when the future of a call
//!   whose request was sent is dropped before its reply and before its deadline (the
//!   calling turn ended, the caller gave up), the client queues a one-way `Cancel` frame
//!   naming the request, behind the request on the same connection. The host drops the
//!   call as it does when the connection closes: the callee's turn is cancelled and
//!   rolled back (nothing committed; the local abandonment path), or never starts. The
//!   cancel is queued without waiting (it is sent from a drop): if the connection's write
//!   queue or byte budget is full it is lost (`cancels_dropped`), and the callee then
//!   stops at its own deadline, as before. A commit already under way when the cancel
//!   arrives may still land.
//!
//! TLA+ (`docs/tla/MultiAgentInvocation.tla`): the client side implements
//! `EveryCallResolves` for remote calls (each ends by its deadline, with a reply,
//! `Timeout` or `Unreachable`); the replayed chain keeps `DepthBounded` and
//! `NoCycleInCallChain` checkable on the host; `DeadlineMonotone` holds across the wire
//! as on one node (the DST check allows only 1 µs of rounding per comparison).
//!
//! What it deliberately does not do:
//! - No retries (a router may retry a request that was never sent, see above), and no
//!   at-most-once across reconnects: a request may have run even if
//!   its caller saw `Unreachable` or `Timeout` (it arrived in time, but its reply did
//!   not). Callers that need exactly-once effects deduplicate in the actor.
//! - No routing or placement: a client talks to one address. The directory decides which
//!   node hosts an actor and keeps one client per node.
//! - No guaranteed cancel: a cancel lost to a partition or a full write queue, or held
//!   up behind a server that is not reading (its connection's byte budget or write queue
//!   full), leaves the remote call to its (translated) deadline, which is no later
//!   than the caller's.
//! - No clock synchronization between nodes beyond each connection's bound, and no
//!   defence against a clock that jumps (the runtime clock is monotonic) or drifts
//!   faster than `CLOCK_DRIFT_PPM_MAX`.
//! - No authentication or encryption. The limits above bound what a peer can hold; they
//!   do not tell a hostile peer from a busy one (a peer may keep up to
//!   `CONNECTIONS_PER_PEER_MAX` connections busy with long calls, each within
//!   `INVOKE_TIMEOUT_MS_MAX`; many addresses together can fill `CONNECTIONS_PER_NODE_MAX`
//!   and refuse everyone else until their connections time out). No rate limiting. A
//!   frame's bytes are counted, not the memory its decoding takes (a maximal frame of
//!   tiny actor ids decodes into many allocations). A hostile client can claim any clock
//!   in its hello, which only shortens or lengthens its own requests' deadlines, still
//!   capped at `INVOKE_TIMEOUT_MS_MAX`.
//! - No retry of a connection attempt: when one fails, its waiting callers fail with
//!   `Unreachable` and the next call starts a new attempt.
//! - No wait-for edges across nodes on the caller's side: the host's dispatcher sees the
//!   edge `caller → target`; the caller's dispatcher does not see the remote call.
//!   Cross-node cycles end at their deadline.

#[cfg(doc)]
use troupe_core::{CallContext, InvokeError};

mod budget;
mod client;
mod clock_sync;
mod frame;
mod round_trips;
mod server;
mod wire;

pub use client::{Delivery, RequestFailure, RequestKind, TransportClient, TransportClientStats};
pub use frame::{FrameError, FRAME_HEADER_SIZE_BYTES, FRAME_SIZE_MAX_BYTES};
pub use server::{ProbeSink, TransportServer, TransportServerStats};
pub use wire::Probe;

/// Most requests one [`TransportClient`] has in flight at once; a caller over it waits
/// for a slot until its deadline.
pub const CLIENT_REQUESTS_IN_FLIGHT_MAX: usize = 1_024;
/// Most requests a [`TransportServer`] runs at once for one connection; one more is
/// answered [`InvokeError::ConnectionBusy`] at once (counted in
/// [`TransportServerStats::requests_refused_busy`]) and never runs. The server keeps
/// reading the connection meanwhile, so a cancel reaches its request, and frees its
/// slot, while every slot is taken.
pub const SERVER_REQUESTS_IN_FLIGHT_MAX: usize = 1_024;
/// Capacity of each connection's queue of encoded frames waiting to be written, in frames.
pub const WRITE_QUEUE_CAPACITY: usize = 256;
/// Most frames written before one flush.
pub const WRITE_BATCH_FRAMES_MAX: usize = 64;
/// Longest call chain a request may carry, in actors; a longer one is rejected unrun.
pub const CALL_CHAIN_LENGTH_MAX: usize = 64;
/// The transport protocol's version, sent in the opening hello of every connection; a
/// peer of another version fails the handshake with both versions in the cause.
///
/// History: 3 added the one-way `Probe` frame; 4 added the one-way `Cancel` frame and
/// the request's trace id (a peer of version 3 would not understand them, so it is
/// refused at the handshake); 5 added the request's optional idempotency key, at the
/// end of the request (a peer of version 4 would fail to decode a request with it, or
/// run a keyed request unkeyed, so it is refused at the handshake); 6 added
/// [`InvokeError::ConnectionBusy`], the answer to a request over a connection's limit
/// (version 5 answered `DispatcherBusy`, which named the wrong queue; a peer of version 5
/// could not decode the new variant); 7 added the server's last frame `GoingAway`, which
/// says how many of the connection's requests a stopping server read, so the client
/// knows the others never ran (a client of version 6 could not decode it); 8 encodes
/// `StoreError::Unavailable` (a store down for a moment) as itself, a new last variant,
/// where 7 encoded it as `StoreError::Backend`: a caller on another node now gets the
/// host's transient store failure, not a backend failure (a node of version 7 could not
/// decode the new variant). Every node of a cluster must run the same version: a node
/// of another one cannot call or be called.
pub(crate) const WIRE_PROTOCOL_VERSION: u16 = 8;
/// Rounding allowance of the clock handshake, in microseconds: both clocks are read in
/// whole microseconds, so the offset bound may be this much too generous; it is taken
/// off every translated deadline.
pub(crate) const CLOCK_ROUNDING_US: u64 = 1;
/// Largest difference in rate between two nodes' monotonic clocks the transport allows
/// for, in parts per million (NTP slews a clock by at most 500 ppm; two clocks slewed
/// in opposite directions differ by up to 1,000 ppm). A translated deadline is made
/// earlier by this fraction of the clock bound's age.
pub(crate) const CLOCK_DRIFT_PPM_MAX: u64 = 1_000;
/// Age after which a connection's clock bound is refreshed by another hello (sent with
/// the next request, never on a timer), in milliseconds. Bounds the drift allowance to
/// about `CLOCK_DRIFT_PPM_MAX` x this, plus the time until the next request.
pub(crate) const CLOCK_RESYNC_INTERVAL_MS: u64 = 1_000;
/// Least time a request's host is told to answer before its caller's deadline, beyond
/// the clock translation's own margin, in milliseconds: what no round trip shows (a
/// loopback one takes tens of microseconds), the scheduling of the host's writer, the
/// client's reader and the waiting caller on a loaded machine. The connection's
/// measured jitter (the spread of its recent round trips) is added to it. See the
/// `round_trips` module.
pub const RETURN_ALLOWANCE_MS_MIN: u64 = 5;
/// Most time a request's host is told to answer before its caller's deadline, in
/// milliseconds, however slow the connection's recent round trips were (a hello held up
/// by a stall is one sample; it does not take more than this from every call).
pub const RETURN_ALLOWANCE_MS_MAX: u64 = 100;
/// How many of a connection's latest round trips (its handshake's, then each clock
/// refresh's) its return allowance takes the spread of, in samples. Refreshes come at
/// most one a [`CLOCK_RESYNC_INTERVAL_MS`] while calls are made, so a slow sample is
/// remembered for at least that many seconds of traffic.
pub(crate) const ROUND_TRIP_SAMPLES: usize = 8;
/// Most of a request's time left that its return allowance takes, in percent: a call
/// shorter than twice the allowance is still sent, its host given the rest (and an
/// answer slower than the share kept ends `Timeout`). Not refused unsent: one round trip
/// that spanned a partition (seconds, capped at [`RETURN_ALLOWANCE_MS_MAX`]) stays among
/// the samples for the next `ROUND_TRIP_SAMPLES` refreshes, and refusing would fail every
/// call under that for as long (`dst_partition`'s one-way cut, seed 3: every call of
/// 80 ms after the heal refused).
pub const RETURN_ALLOWANCE_SHARE_OF_LEFT_MAX_PERCENT: u64 = 50;
/// Pause after a failed `accept` (for example, out of file descriptors), in milliseconds.
pub const ACCEPT_RETRY_DELAY_MS: u64 = 10;
/// Longest a [`TransportServer`] waits, from accepting a connection, for the client's
/// valid hello; a connection that sends nothing, trickles, or sends something else is
/// closed then (counted in [`TransportServerStats::connections_closed_handshake_timeout`]).
pub const HANDSHAKE_TIMEOUT_MS: u64 = 5_000;
/// Largest frame body accepted before the handshake is done, in bytes (each side's
/// first frame: a hello or its answer, under 40 bytes). An unauthenticated peer
/// cannot make a server buffer more.
pub const HANDSHAKE_FRAME_SIZE_MAX_BYTES: usize = 64;
/// Longest a [`TransportClient`] spends opening a connection (TCP connect and clock
/// handshake), in milliseconds. The attempt runs in its own task, whatever its callers'
/// deadlines: a caller stops waiting at its own deadline, the attempt goes on for the
/// next callers.
pub const CONNECT_TIMEOUT_MS: u64 = 5_000;
/// How long a [`TransportServer`] keeps a connection on which no request is running
/// and no frame has been read or written, in milliseconds. A peer that trickles a frame
/// without finishing it is closed this long after its last whole frame.
pub const SERVER_CONNECTION_IDLE_TIMEOUT_MS: u64 = 60_000;
/// How long a [`TransportClient`] keeps its connection with no call pending and no frame
/// sent or received, in milliseconds. Shorter than the server's, so it is the client
/// that closes an idle connection, never the server under a request that is on its way.
pub const CLIENT_CONNECTION_IDLE_TIMEOUT_MS: u64 = 30_000;
/// Longest a [`TransportServer`] waits for a peer to accept any bytes of a reply
/// (a write or flush that makes no progress), in milliseconds; then the peer is taken
/// not to read and the connection is closed.
pub const WRITE_STALL_TIMEOUT_MS: u64 = 10_000;
/// Longest a stopping [`TransportServer`] spends, per connection, writing the replies
/// it had queued and its last frame (`GoingAway`, which tells the client which of its
/// requests were never read), in milliseconds. Past it the connection is closed as it
/// is: its pending requests then end `Unreachable` as possibly sent.
pub(crate) const GOING_AWAY_WRITE_MS_MAX: u64 = 1_000;
/// Longest a stopping [`TransportServer`] keeps a connection open after its last frame,
/// reading (and discarding, unrun) what the client still sends, until the client closes
/// it, in milliseconds. Closing a socket with unread bytes resets it, and a reset may
/// erase, at the client, the last frame not yet read.
pub(crate) const GOING_AWAY_LINGER_MS: u64 = 1_000;
/// Most connections one [`TransportServer`] (one node) holds open at once, in
/// connections; one accepted over it is closed at once, unread (counted in
/// [`TransportServerStats::connections_refused`]).
pub const CONNECTIONS_PER_NODE_MAX: usize = 256;
/// Most connections one [`TransportServer`] holds open at once from one peer IP
/// address, in connections, so one peer cannot take every connection of a node. A
/// node keeps one connection per peer (plus one being replaced); the rest is slack for
/// several runtimes behind one address.
pub const CONNECTIONS_PER_PEER_MAX: usize = 32;
/// Most bytes one connection holds buffered at once, in bytes: on a server, request
/// frames read whose turn has not ended plus reply frames not yet written; on a
/// client, request frames not yet written. Past it the server stops reading the
/// connection and a client caller waits (within its deadline). Frames are counted
/// whole, length prefix included.
pub const CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES: usize = 32 * 1024 * 1024;

const _: () = assert!(CLIENT_REQUESTS_IN_FLIGHT_MAX >= 1);
const _: () = assert!(SERVER_REQUESTS_IN_FLIGHT_MAX >= 1);
// One client at its limit is not refused busy by the server's per-connection limit: a
// slot is freed before its reply is queued and when its cancel is read (a lost cancel,
// or a request ending at its deadline a moment after its caller's, may still be met).
const _: () = assert!(CLIENT_REQUESTS_IN_FLIGHT_MAX <= SERVER_REQUESTS_IN_FLIGHT_MAX);
const _: () = assert!(WRITE_QUEUE_CAPACITY >= 1);
const _: () = assert!(WRITE_BATCH_FRAMES_MAX >= 1);
const _: () = assert!(CALL_CHAIN_LENGTH_MAX >= troupe_core::limits::AGENT_CALL_DEPTH_MAX as usize);
const _: () = assert!(FRAME_SIZE_MAX_BYTES <= u32::MAX as usize);
const _: () = assert!(HANDSHAKE_FRAME_SIZE_MAX_BYTES <= FRAME_SIZE_MAX_BYTES);
// One whole frame always fits an empty budget, so no frame waits forever.
const _: () = assert!(FRAME_HEADER_SIZE_BYTES + FRAME_SIZE_MAX_BYTES <= CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES);
// A budget is taken in one semaphore call, which counts in u32.
const _: () = assert!(CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES <= u32::MAX as usize);
const _: () = assert!(CONNECTIONS_PER_PEER_MAX >= 2);
const _: () = assert!(CONNECTIONS_PER_PEER_MAX <= CONNECTIONS_PER_NODE_MAX);
// A client gives up on a handshake no later than the server does.
const _: () = assert!(CONNECT_TIMEOUT_MS <= HANDSHAKE_TIMEOUT_MS);
// The client closes an idle connection before the server would.
const _: () = assert!(CLIENT_CONNECTION_IDLE_TIMEOUT_MS < SERVER_CONNECTION_IDLE_TIMEOUT_MS);
const _: () = assert!(HANDSHAKE_TIMEOUT_MS < SERVER_CONNECTION_IDLE_TIMEOUT_MS);
const _: () = assert!(WRITE_STALL_TIMEOUT_MS >= 1);
// The drift allowance accumulated between refreshes stays below a millisecond or so.
const _: () = assert!(CLOCK_DRIFT_PPM_MAX * CLOCK_RESYNC_INTERVAL_MS <= 1_000_000);
const _: () = assert!(RETURN_ALLOWANCE_MS_MIN >= 1);
const _: () = assert!(RETURN_ALLOWANCE_MS_MIN <= RETURN_ALLOWANCE_MS_MAX);
// The allowance leaves most of the shortest deadline a caller would give a remote call.
const _: () = assert!(RETURN_ALLOWANCE_MS_MAX <= CONNECT_TIMEOUT_MS / 10);
const _: () = assert!(ROUND_TRIP_SAMPLES >= 1);
const _: () =
    assert!(RETURN_ALLOWANCE_SHARE_OF_LEFT_MAX_PERCENT >= 1 && RETURN_ALLOWANCE_SHARE_OF_LEFT_MAX_PERCENT < 100);

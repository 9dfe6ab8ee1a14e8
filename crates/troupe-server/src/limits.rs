//! The server's limits, as named constants with their unit last.

use troupe_agent::limits::{AGENT_ASK_TIMEOUT_MS_DEFAULT, AGENT_MESSAGE_SIZE_MAX_BYTES};
use troupe_core::limits::{ACTOR_KEY_LENGTH_MAX, AGENT_CALL_DEPTH_MAX, INVOKE_TIMEOUT_MS_MAX};
use troupe_runtime::STATE_KEY_LENGTH_MAX;

/// Largest request body accepted, in bytes; a larger one is refused with 413
/// `body_too_large`. Room for a full agent message in JSON, and an OpenAI-style
/// conversation.
pub const SERVER_REQUEST_BODY_SIZE_MAX_BYTES: usize = 256 * 1024;
/// How much of a refused (too large) body the server still reads and discards before it
/// answers 413, in bytes. A client that writes its whole body before it reads (most
/// HTTP clients do) then gets the answer; closing with the body unread would reset the
/// connection under its write, and the client would see a broken pipe instead. A body
/// declared larger than this is answered at once, unread, and its connection closes.
pub const SERVER_REQUEST_BODY_DRAIN_MAX_BYTES: usize = 16 * SERVER_REQUEST_BODY_SIZE_MAX_BYTES;
/// How long the server reads a refused body for, at most, in milliseconds; then it
/// answers 413 with the rest unread.
pub const SERVER_REQUEST_BODY_DRAIN_MS: u64 = 5_000;
/// How long an admitted request's body may take to arrive whole, in milliseconds, from
/// when the server starts reading it; a body still arriving then is answered 408
/// `body_timeout` and its connection closed. Without it a client that sends its headers
/// and then its body slowly (or never) held one of the concurrent-request slots until
/// the request timeout (130 s by default), and as many such clients as slots held the
/// server at 503 for everyone. The largest body
/// ([`SERVER_REQUEST_BODY_SIZE_MAX_BYTES`]) arrives in time at 26 KB/s.
pub const SERVER_REQUEST_BODY_READ_MS: u64 = 10_000;
/// Requests handled at once by default; one more is refused at once with 503
/// `overloaded` and `Retry-After`. A streamed response counts until its headers are sent.
pub const SERVER_CONCURRENT_REQUESTS_MAX_DEFAULT: usize = 256;
/// The most requests a server may be configured to handle at once, in requests: `serve`
/// (and `troupe serve --concurrent-requests-max`) refuses more. Each one holds a task
/// and its agent's turn; far more than one machine serves usefully.
pub const SERVER_CONCURRENT_REQUESTS_MAX: usize = 65_536;
/// Streamed answers open at once by default, in streams: a streamed message
/// (`POST /v1/agents/{id}/messages?stream=true`), a streamed chat completion
/// (`POST /v1/chat/completions` with `"stream": true`, counted from before its turn) and
/// the A2A streams (`SendStreamingMessage`, `SubscribeToTask`). One more is refused at once with 503 and
/// `Retry-After`, before it starts anything. Such a stream lives until its turn or task
/// ends (or its client goes away), long after its request left the concurrent-request
/// limit (which counts it only until its headers are sent).
pub const SERVER_STREAMS_OPEN_MAX_DEFAULT: usize = 256;
/// The most streams a server may be configured to keep open at once, in streams:
/// `serve` refuses more (see [`SERVER_STREAMS_OPEN_MAX_DEFAULT`]).
pub const SERVER_STREAMS_OPEN_MAX: usize = 65_536;
/// The most of the text of an error answered outside the handlers (axum's: a 405, a
/// path segment refused) that the server reads to name what was wrong in its JSON error,
/// in bytes; longer (none is), the error says only its status.
pub const SERVER_PLAIN_ERROR_TEXT_MAX_BYTES: usize = 4 * 1024;
/// Open SSE streams of `/v1/events` at once; one more is refused with 503 `overloaded`.
pub const SERVER_EVENT_STREAMS_MAX: usize = 64;
/// Calls the topology keeps for call trees (the most recent ones), in calls; an older
/// call is forgotten, and a tree shows only the calls still kept.
pub const TOPOLOGY_CALLS_KEPT: usize = 4_096;
/// Agents the topology counts traffic for, in agents; traffic of further agents is not
/// counted (their links neither).
pub const TOPOLOGY_AGENTS_TRACKED_MAX: usize = 4_096;
/// Observed links (ordered pairs of agents) the topology counts, in links; traffic on
/// further pairs is not counted.
pub const TOPOLOGY_LINKS_MAX: usize = 16_384;
/// Agents the topology remembers the last request of (for their call trees), in agents.
/// When it holds this many, the agents whose last request is no longer kept (among the
/// last [`TOPOLOGY_CALLS_KEPT`] calls) are forgotten: at most two per kept call remain
/// (its caller and its target), so the next forgetting is that many agents away.
pub const TOPOLOGY_LAST_ROOTS_MAX: usize = 4 * TOPOLOGY_CALLS_KEPT;
/// Agents one `GET /v1/topology` lists (by id), in agents; it reads each one's inbox
/// and outbox lengths from the store. Beyond it, `agents_truncated` is `true`.
pub const TOPOLOGY_AGENTS_LISTED_MAX: usize = 256;
/// How long a request may take until its response headers, by default, in
/// milliseconds; then it is answered 504 `request_timeout`. Longer than an agent's
/// default ask timeout, so the agent's own timeout (504 `timeout`) comes first.
pub const SERVER_REQUEST_TIMEOUT_MS_DEFAULT: u64 = AGENT_ASK_TIMEOUT_MS_DEFAULT + 10_000;
/// The shortest request timeout a server may be configured with, in milliseconds
/// (`Duration::ZERO` would answer every request 504).
pub const SERVER_REQUEST_TIMEOUT_MS_MIN: u64 = 1;
/// The longest request timeout a server may be configured with, in milliseconds (an
/// hour: a request waits for at most one agent's answer, whose own timeout is at most
/// [`SERVER_MESSAGE_TIMEOUT_MS_MAX`]).
pub const SERVER_REQUEST_TIMEOUT_MS_MAX: u64 = 3_600_000;
/// The `timeout_ms` a message request may ask for, at most, in milliseconds.
pub const SERVER_MESSAGE_TIMEOUT_MS_MAX: u64 = INVOKE_TIMEOUT_MS_MAX;
/// Largest message text accepted, in bytes (the agent's own limit); a longer one is
/// refused with 422 `message_too_long` rather than cut.
pub const SERVER_MESSAGE_SIZE_MAX_BYTES: usize = AGENT_MESSAGE_SIZE_MAX_BYTES;
/// The `Retry-After` sent with 429 (agent busy) and 503 (server overloaded), in seconds.
pub const SERVER_RETRY_AFTER_S: u64 = 1;
/// Longest `msg_id` a notification (`POST /v1/agents/{id}/notify`) may carry, in bytes;
/// a longer one is refused with 422 `invalid_message_id`. The agent keeps the id as
/// part of a store key (its dedupe mark), which the store limits to
/// `STATE_KEY_LENGTH_MAX` bytes: without this check a long id failed in the store, as a
/// 500. A UUID (36 bytes) fits many times over.
pub const SERVER_MESSAGE_ID_LENGTH_MAX_BYTES: usize = 256;
/// Longest task id the task routes (`GET /v1/agents/{id}/tasks/{task}`, `.../cancel`)
/// look up, in bytes: longer than any id an agent gives a task (an agent id of at most
/// `ACTOR_KEY_LENGTH_MAX` bytes, a separator and a number), so a longer one names no task
/// and is answered 404 `task_not_found` without a store read (whose key it would make
/// longer than the store allows: a 500).
pub const SERVER_TASK_ID_LENGTH_MAX_BYTES: usize = ACTOR_KEY_LENGTH_MAX + 64;
/// Most history entries one page returns; `limit` above it is refused with 400.
pub const SERVER_HISTORY_PAGE_MAX: usize = 1_000;
/// History entries one page returns when no `limit` is given.
pub const SERVER_HISTORY_PAGE_DEFAULT: usize = 100;
/// Most conversation messages one page returns (the agent's own page limit); `limit`
/// above it is refused with 400.
pub const SERVER_CONVERSATION_PAGE_MAX: usize = troupe_agent::CONVERSATION_PAGE_MAX;
/// Conversation messages one page returns when no `limit` is given.
pub const SERVER_CONVERSATION_PAGE_DEFAULT: usize = 100;
/// How long in-flight requests may run after a shutdown signal, in milliseconds; then
/// the server stops and the rest are cut.
pub const SERVER_SHUTDOWN_GRACE_MS: u64 = 10_000;
/// Shortest bearer token accepted, in bytes.
pub const SERVER_TOKEN_LENGTH_MIN_BYTES: usize = 16;

/// A2A tasks the server keeps in memory, at most; past it the oldest ended task is
/// forgotten, and if none has ended a new one is refused with 503 and `Retry-After`.
pub const A2A_TASKS_KEPT_MAX: usize = 10_000;
/// A2A tasks waiting for one agent (submitted, not yet started), at most; one more is
/// refused with 429 and `Retry-After`. The server runs one A2A task per agent at a time.
pub const A2A_TASKS_WAITING_PER_AGENT_MAX: usize = 64;
/// A2A task numbers a server reserves for one agent at a time, in task numbers: a block
/// reserved in the store (`seq_next` raised under the key space's fence) and given to
/// the agent's next tasks from memory, so a send writes nothing more than its task's
/// record (see `a2a_tasks`). The numbers left of a block when the server stops or the
/// agent is deleted are never given: at most this many minus one per agent and stop.
pub const A2A_TASK_NUMBERS_RESERVED: u64 = 64;
/// Attempts one reservation of A2A task numbers makes, at most: each is refused if
/// another server wrote the agent's A2A records between its read and its commit (then
/// it claims and reads again); past them the send is refused as retryable (503).
pub const A2A_TASK_NUMBERS_RESERVE_ATTEMPTS_MAX: u32 = 8;
/// Reservations of A2A task numbers one send makes, at most: other sends to the agent
/// may use a new block up before this one takes a number; past them the send is
/// refused as retryable (503).
pub const A2A_TASK_NUMBER_RESERVATIONS_PER_SEND_MAX: u32 = 4;
/// How often an A2A task's lane reads its Troupe task while waiting for its outcome,
/// in milliseconds.
pub const A2A_TASK_POLL_MS: u64 = 20;
/// How long past its deadline an A2A task's lane waits for its Troupe task's outcome
/// before recording it failed, in milliseconds.
pub const A2A_TASK_OUTCOME_GRACE_MS: u64 = 30_000;
/// Tasks one `ListTasks` page returns, at most (`pageSize` above it is invalid params).
pub const A2A_LIST_TASKS_PAGE_MAX: usize = 100;
/// Tasks one `ListTasks` page returns when no `pageSize` is given.
pub const A2A_LIST_TASKS_PAGE_DEFAULT: usize = 50;
/// How much sooner than the server's request timeout a blocking `SendMessage` stops
/// waiting and answers the task as it is (still working), in milliseconds.
pub const A2A_BLOCKING_HEADROOM_MS: u64 = 1_000;
/// How long a cluster node waits to connect to the node it forwards an A2A request
/// to, in milliseconds; past it the request is refused as retryable, naming that node.
pub const A2A_FORWARD_CONNECT_TIMEOUT_MS: u64 = 2_000;
/// How long a forwarded A2A request may take, its answer streamed to the end, in
/// milliseconds: a task's longest turn and the wait for its outcome past its deadline
/// (a stream of it ends by then).
pub const A2A_FORWARD_TIMEOUT_MS: u64 = SERVER_MESSAGE_TIMEOUT_MS_MAX + A2A_TASK_OUTCOME_GRACE_MS;
/// Bytes of an A2A message, as JSON, besides its parts' text, at most: its ids, role,
/// metadata, extensions and the parts' other fields (the text is limited by
/// [`SERVER_MESSAGE_SIZE_MAX_BYTES`]). A larger message is invalid params. Each task keeps
/// its message (in memory and in the store, up to [`A2A_TASKS_KEPT_MAX`] tasks) and every
/// `GetTask`, `ListTasks` and stream sends it back.
pub const A2A_MESSAGE_FIELDS_SIZE_MAX_BYTES: usize = 16 * 1024;
/// Entries `metadata.troupe.chain` may hold, at most (the deepest chain plus its
/// target); a longer one is invalid params.
pub const A2A_CHAIN_LENGTH_MAX: usize = AGENT_CALL_DEPTH_MAX as usize + 1;

const _: () = assert!(SERVER_MESSAGE_SIZE_MAX_BYTES < SERVER_REQUEST_BODY_SIZE_MAX_BYTES);
const _: () = assert!(SERVER_REQUEST_BODY_SIZE_MAX_BYTES < SERVER_REQUEST_BODY_DRAIN_MAX_BYTES);
const _: () = assert!(SERVER_REQUEST_TIMEOUT_MS_DEFAULT > AGENT_ASK_TIMEOUT_MS_DEFAULT);
const _: () = assert!(SERVER_REQUEST_TIMEOUT_MS_MIN <= SERVER_REQUEST_TIMEOUT_MS_DEFAULT);
const _: () = assert!(SERVER_REQUEST_TIMEOUT_MS_DEFAULT <= SERVER_REQUEST_TIMEOUT_MS_MAX);
const _: () = assert!(SERVER_MESSAGE_TIMEOUT_MS_MAX < SERVER_REQUEST_TIMEOUT_MS_MAX);
const _: () = assert!(SERVER_CONCURRENT_REQUESTS_MAX_DEFAULT <= SERVER_CONCURRENT_REQUESTS_MAX);
const _: () = assert!(SERVER_STREAMS_OPEN_MAX_DEFAULT >= 1);
const _: () = assert!(SERVER_STREAMS_OPEN_MAX_DEFAULT <= SERVER_STREAMS_OPEN_MAX);
const _: () = assert!(SERVER_HISTORY_PAGE_DEFAULT <= SERVER_HISTORY_PAGE_MAX);
// The agent's keys made of them (`seen/{msg_id}`, `task/{id}`, `canceled/{id}`,
// `tasks_in/{id}`) fit in the store's key limit.
const _: () = assert!(SERVER_MESSAGE_ID_LENGTH_MAX_BYTES + 16 <= STATE_KEY_LENGTH_MAX);
const _: () = assert!(SERVER_TASK_ID_LENGTH_MAX_BYTES + 16 <= STATE_KEY_LENGTH_MAX);
const _: () = assert!(SERVER_EVENT_STREAMS_MAX >= 1);
const _: () = assert!(SERVER_CONVERSATION_PAGE_DEFAULT <= SERVER_CONVERSATION_PAGE_MAX);
const _: () = assert!(A2A_LIST_TASKS_PAGE_DEFAULT <= A2A_LIST_TASKS_PAGE_MAX);
const _: () = assert!(TOPOLOGY_LAST_ROOTS_MAX > 2 * TOPOLOGY_CALLS_KEPT);
const _: () = assert!(A2A_TASKS_WAITING_PER_AGENT_MAX <= A2A_TASKS_KEPT_MAX);
const _: () = assert!(A2A_TASK_NUMBERS_RESERVED >= 1);
const _: () = assert!(A2A_TASK_NUMBERS_RESERVE_ATTEMPTS_MAX >= 1);
const _: () = assert!(A2A_TASK_NUMBER_RESERVATIONS_PER_SEND_MAX >= 1);

/// How long a streamed chat completion (`POST /v1/chat/completions` with `"stream":
/// true`) waits for its agent's turn before it sends its response headers, in
/// milliseconds (at most half the server's request timeout). An error known as the turn
/// is asked for (a full mailbox: 429 `busy`; the agent gone: 404; the server shutting
/// down: 503), and a turn that ends this soon, are answered as without streaming: the
/// error with its HTTP status. Past it the headers and the role chunk go out, the turn's
/// end follows in the stream (an error then as an error event), and the request leaves
/// the concurrent-request limit and its timeout. The client API tells no "admitted" apart
/// from the answer, hence a bound: a refusal takes a mailbox check (a round trip on a
/// cluster node), far less than this; the first chunk is this much later at most.
pub const OPENAI_STREAM_HEADERS_WAIT_MS: u64 = 200;
/// How long a streamed chat completion whose turn runs stays silent, at most, in
/// milliseconds: then it sends an SSE comment (a keep-alive, which OpenAI clients skip),
/// so that proxies and clients with a read timeout keep the connection.
pub const OPENAI_STREAM_KEEP_ALIVE_MS: u64 = 15_000;
/// The choices a chat completion answers, at most: one. A choice is an agent's turn,
/// which changes the agent's state (its conversation, what it sent), so `n` choices
/// would be `n` turns one after the other, each seeing the ones before: not the `n`
/// independent samples OpenAI's `n` means. A request with another `n` is refused 400
/// `invalid_request_error` (`param: "n"`) rather than answered with fewer choices.
pub const OPENAI_CHOICES_MAX: u64 = 1;

const _: () = assert!(OPENAI_STREAM_HEADERS_WAIT_MS < OPENAI_STREAM_KEEP_ALIVE_MS);

/// Most bytes of an error body that an OpenAI-compatible route puts in OpenAI's shape
/// (`openai_compat::in_openai_shape`), in bytes: every error body this server makes is
/// far shorter (its messages are a few hundred bytes).
pub const OPENAI_ERROR_BODY_MAX_BYTES: usize = 64 * 1024;
/// How long a connection may take to send a request's head (its request line and
/// headers), in milliseconds; also how long a kept-alive connection may stay idle
/// between two requests. Past it the connection is closed (hyper's header read timeout,
/// with a timer set), so connections that never send a whole request cannot pile up.
pub const SERVER_HEADER_READ_MS: u64 = 10_000;
/// How long `serve_http` waits before accepting again after an accept failed for a
/// reason other than that connection (out of file descriptors, ...), in milliseconds.
pub const SERVER_ACCEPT_RETRY_MS: u64 = 1_000;
/// Connections a server serves at once by default, in connections: past it, it accepts
/// no new connection until one closes, and the connections asking wait in the kernel's
/// listen backlog, unanswered (an idle one closes within [`SERVER_HEADER_READ_MS`], so a
/// wait is at most about that long). Each connection holds a file descriptor: without a
/// cap, a flood of idle connections used up the process's descriptors (1,024 is a common
/// soft limit), and its store, etcd and model clients could open none. Room for every
/// request ([`SERVER_CONCURRENT_REQUESTS_MAX_DEFAULT`]) and every stream
/// ([`SERVER_STREAMS_OPEN_MAX_DEFAULT`]) open at once, each on a connection of its own,
/// and under 1,024 with the process's other descriptors.
pub const SERVER_CONNECTIONS_MAX_DEFAULT: usize = 512;
/// How often a server at its connection cap says so in a `warn` line, at most, in
/// milliseconds.
pub const SERVER_CONNECTIONS_FULL_WARN_MS: u64 = 10_000;
/// The most connections a server may be configured to serve at once, in connections:
/// `serve` (and `troupe serve --max-connections`) refuses more.
pub const SERVER_CONNECTIONS_MAX: usize = 65_536;

const _: () =
    assert!(SERVER_CONNECTIONS_MAX_DEFAULT >= SERVER_CONCURRENT_REQUESTS_MAX_DEFAULT + SERVER_STREAMS_OPEN_MAX_DEFAULT);
const _: () = assert!(SERVER_CONNECTIONS_MAX_DEFAULT <= SERVER_CONNECTIONS_MAX);

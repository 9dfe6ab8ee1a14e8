//! Troupe's runtime: the single-threaded dispatcher, bounded mailboxes, the activation
//! lifecycle of virtual actors, and the state stores.
//!
//! ```text
//! caller ──invoke(target, payload, deadline)──► dispatcher task (owns the activation table)
//!                                                 │ active?   → try_send into the bounded mailbox
//!                                                 │             (full → InvokeError::Busy at once)
//!                                                 │ inactive? → spawn the actor task, queue the message
//!                                                 ▼
//!                        actor task: load state → on_activate → loop { next message;
//!                          drop it if its deadline passed; run one turn; commit state
//!                          and writes atomically; reply }   idle → ask to deactivate
//! ```
//!
//! The dispatcher never awaits a turn, storage or the network; turns run in each
//! actor's own task, one at a time per actor.

#![warn(missing_docs)]

mod activation;
mod actor;
mod caller;
mod clock;
#[cfg(feature = "conformance")]
pub mod conformance;
mod control;
mod dispatcher;
mod envelope;
mod fast_hash;
mod handle;
mod handler_slot;
mod idempotency;
mod kind_config;
mod mailbox;
mod memory_store;
mod observer;
mod remote;
mod reply_cell;
mod runtime;
mod signal;
#[cfg(feature = "sqlite")]
mod sqlite_store;
mod state_store;
mod store_key;
mod store_retry;
mod transport;
mod turn;
mod typed;
mod wait_for_graph;

pub use actor::{Actor, ActorBox, ActorError, ActorFactory, AnyValue, ANY_VALUE_INLINE_BYTES};
pub use caller::{Admitted, Caller};
pub use clock::{Clock, DeadlinePassed, Until};
pub use handle::{DispatcherStats, RuntimeCounters, RuntimeHandle, WeakRuntimeHandle};
pub use handler_slot::HANDLER_SLOT_KEPT_BYTES_MAX;
pub use idempotency::{
    IdempotencyKey, IdempotencyKeyError, IDEMPOTENCY_KEYS_KEPT_MAX, IDEMPOTENCY_KEY_LENGTH_MAX_BYTES,
    IDEMPOTENCY_STORE_PREFIX,
};
pub use kind_config::{ConfigError, KindConfig};
pub use memory_store::{MemoryStore, MemoryStoreFaults, MEMORY_STORE_OUTAGE_CAUSE};
pub use observer::{RuntimeEvent, RuntimeObserver};
pub use remote::{RemoteWait, RootCallRouter, TellRoute, TurnCall, TurnCallRouter, WaitEdge};
pub use runtime::{Runtime, RuntimeBuilder, SHUTDOWN_ABORT_WAIT_MS, SHUTDOWN_GRACE_MS_DEFAULT, SHUTDOWN_GRACE_MS_MAX};
pub use signal::Latch;
#[cfg(feature = "sqlite")]
pub use sqlite_store::{SqliteStore, SQLITE_IDENTITY_LENGTH_MAX_BYTES};
pub use state_store::{
    check_key, sqlite_file_identity, Claimed, Fence, FencedClaim, StateChange, StateStore, StoreError, StoreItem,
    StoreOperation, TurnCommit, STATE_KEY_LENGTH_MAX, STATE_SCAN_LIMIT_MAX, STATE_VALUE_SIZE_MAX, TURN_WRITES_MAX,
};
pub use store_retry::{STORE_RETRY_DEACTIVATION_MS_MAX, STORE_RETRY_PAUSE_MS_FIRST, STORE_RETRY_PAUSE_MS_MAX};
pub use transport::{
    Delivery, FrameError, Probe, ProbeSink, RequestFailure, RequestKind, TransportClient, TransportClientStats,
    TransportServer, TransportServerStats, ACCEPT_RETRY_DELAY_MS, CALL_CHAIN_LENGTH_MAX,
    CLIENT_CONNECTION_IDLE_TIMEOUT_MS, CLIENT_REQUESTS_IN_FLIGHT_MAX, CONNECTIONS_PER_NODE_MAX,
    CONNECTIONS_PER_PEER_MAX, CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES, CONNECT_TIMEOUT_MS, FRAME_HEADER_SIZE_BYTES,
    FRAME_SIZE_MAX_BYTES, HANDSHAKE_FRAME_SIZE_MAX_BYTES, HANDSHAKE_TIMEOUT_MS, RETURN_ALLOWANCE_MS_MAX,
    RETURN_ALLOWANCE_MS_MIN, RETURN_ALLOWANCE_SHARE_OF_LEFT_MAX_PERCENT, SERVER_CONNECTION_IDLE_TIMEOUT_MS,
    SERVER_REQUESTS_IN_FLIGHT_MAX, WRITE_BATCH_FRAMES_MAX, WRITE_QUEUE_CAPACITY, WRITE_STALL_TIMEOUT_MS,
};
pub use turn::Turn;
pub use typed::{ActorRef, ActorRefError, StateVersionError, StoredState, TypedActor, STATE_VERSION_TAG_BYTES};

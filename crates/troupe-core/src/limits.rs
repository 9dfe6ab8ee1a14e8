//! Every limit in Troupe, as a named constant with its unit last.
//!
//! Relations between limits are checked at compile time at the bottom of this file.

/// Default capacity of one actor's mailbox, in messages. A kind's capacity also bounds
/// the messages held for an actor while its previous activation is deactivating; past
/// it, a message is refused `Busy` as a full mailbox refuses it.
pub const MAILBOX_CAPACITY_DEFAULT: usize = 64;
/// Largest mailbox capacity a kind may configure, in messages.
pub const MAILBOX_CAPACITY_MAX: usize = 65_536;
/// Capacity of the dispatcher's own command queue, in commands.
pub const DISPATCHER_QUEUE_CAPACITY: usize = 4_096;
/// Most activations one dispatcher holds at once (active or deactivating), in actors.
pub const ACTIVATIONS_MAX: usize = 4_000_000;
/// Most wait-for edges (blocked calls between actors) the dispatcher tracks at once.
pub const WAIT_FOR_EDGES_MAX: usize = 1_000_000;
/// Default idle time after which an actor is deactivated, in milliseconds.
pub const ACTOR_IDLE_TIMEOUT_MS_DEFAULT: u64 = 60_000;
/// Shortest idle timeout a kind may configure, in milliseconds.
pub const ACTOR_IDLE_TIMEOUT_MS_MIN: u64 = 1;
/// Longest idle timeout a kind may configure, in milliseconds (30 days): an activation
/// that should outlive it is kept by its traffic, or reactivated by its next message.
/// Bounded so that every clock reading plus the timeout is an instant the runtime can
/// represent, on the simulator's clock too.
pub const ACTOR_IDLE_TIMEOUT_MS_MAX: u64 = 30 * 24 * 60 * 60 * 1_000;
/// Default deadline of an invocation made without one, in milliseconds.
pub const INVOKE_TIMEOUT_MS_DEFAULT: u64 = 30_000;
/// Longest deadline any invocation may have, in milliseconds.
pub const INVOKE_TIMEOUT_MS_MAX: u64 = 300_000;
/// Longest actor kind name, in bytes.
pub const ACTOR_KIND_LENGTH_MAX: usize = 64;
/// Longest actor key, in bytes.
pub const ACTOR_KEY_LENGTH_MAX: usize = 256;

/// Deepest agent-to-agent call chain: a call made at this depth is refused.
pub const AGENT_CALL_DEPTH_MAX: u32 = 5;
/// Default timeout of one `call_agent`, in milliseconds.
pub const AGENT_CALL_TIMEOUT_MS_DEFAULT: u64 = 30_000;
/// Longest timeout a `call_agent` may ask for, in milliseconds.
pub const AGENT_CALL_TIMEOUT_MS_MAX: u64 = 300_000;
/// Most `call_agent` calls one agent may have in flight at once.
pub const AGENT_CONCURRENT_CALLS_MAX: u32 = 10;

const _: () = assert!(MAILBOX_CAPACITY_DEFAULT >= 1);
const _: () = assert!(MAILBOX_CAPACITY_DEFAULT <= MAILBOX_CAPACITY_MAX);
const _: () = assert!(INVOKE_TIMEOUT_MS_DEFAULT <= INVOKE_TIMEOUT_MS_MAX);
const _: () = assert!(AGENT_CALL_TIMEOUT_MS_DEFAULT <= AGENT_CALL_TIMEOUT_MS_MAX);
const _: () = assert!(AGENT_CALL_TIMEOUT_MS_MAX <= INVOKE_TIMEOUT_MS_MAX);
const _: () = assert!(ACTOR_IDLE_TIMEOUT_MS_MIN <= ACTOR_IDLE_TIMEOUT_MS_DEFAULT);
const _: () = assert!(ACTOR_IDLE_TIMEOUT_MS_DEFAULT <= ACTOR_IDLE_TIMEOUT_MS_MAX);
const _: () = assert!(AGENT_CALL_DEPTH_MAX >= 1);

//! What the runtime reports about requests and turns: [`RuntimeEvent`] and the
//! [`RuntimeObserver`] that receives them.
//!
//! Events are reported synchronously, from the task where they happen, in the order
//! they happen in that task. They exist so tests, the simulator and metrics can check
//! what no reply shows: that a turn whose caller gave up never commits (the simulator's
//! NoCommitAfterAbandon invariant is built on `RequestAbandoned` and `TurnCommitting`).

use troupe_core::ActorId;

/// One thing the runtime did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuntimeEvent {
    /// A caller stopped waiting for `request` before it had a reply (timeout, its future
    /// was dropped, or its turn ended). Reported after the reply channel is closed, so
    /// the callee's turn decides to commit either before this event or never.
    RequestAbandoned {
        /// The actor called.
        target: ActorId,
        /// The request's id, unique within the runtime.
        request: u64,
    },
    /// `actor`'s turn for `request` finished, its caller still waits, and its commit
    /// starts now. A commit that started before its caller gave up still lands.
    TurnCommitting {
        /// The actor.
        actor: ActorId,
        /// The request the turn handled.
        request: u64,
    },
    /// `actor`'s turn for `request` was cancelled because its caller stopped waiting; it
    /// was rolled back and committed nothing.
    TurnAbandoned {
        /// The actor.
        actor: ActorId,
        /// The request the turn handled.
        request: u64,
    },
    /// `actor`'s activation has ended (deactivated, crashed, or failed to start) and is
    /// gone from the dispatcher's table; reported before the dispatcher starts the next
    /// activation of `actor` (if requests were held for one). A cluster node releases
    /// the actor's placement on it.
    ActivationEnded {
        /// The actor.
        actor: ActorId,
    },
}

/// Receives [`RuntimeEvent`]s. Called on the runtime's tasks: keep it fast, never block,
/// never panic.
pub trait RuntimeObserver: Send + Sync + 'static {
    /// Takes one event.
    fn on_event(&self, event: &RuntimeEvent);
}

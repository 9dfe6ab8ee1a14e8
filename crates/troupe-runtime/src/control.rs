//! What the dispatcher is told: [`Command`]s from callers (through its bounded queue) and
//! [`Control`] notices from actor tasks and call guards (drained first, before each
//! command). The messages themselves, and their replies, are in `envelope.rs`.

use tokio::sync::oneshot;
use troupe_core::ActorId;

use crate::envelope::Envelope;
use crate::wait_for_graph::CallId;

/// Requests from callers, through the dispatcher's bounded queue.
pub(crate) enum Command {
    /// Route `envelope` to `target`. A call from a turn (`envelope.edge`) comes with its
    /// wait-for edge already added by its caller.
    Invoke { target: ActorId, envelope: Box<Envelope> },
    /// Record the wait-for edge `caller → target` of a call to another node; answer
    /// whether it was recorded (`DeadlockDetected` if it closes a cycle). Not recorded
    /// if `reply` is closed (the caller gave up).
    AddRemoteEdge {
        call: CallId,
        caller: ActorId,
        target: ActorId,
        reply: oneshot::Sender<Result<(), troupe_core::InvokeError>>,
    },
    /// Report the wait-for edges whose waiter is `actor`.
    Waits {
        actor: ActorId,
        reply: oneshot::Sender<Vec<crate::WaitEdge>>,
    },
    /// Report the dispatcher's tables.
    Stats {
        reply: oneshot::Sender<crate::DispatcherStats>,
    },
    /// Deactivate one actor now; answer whether an activation was live once it is gone.
    Deactivate {
        target: ActorId,
        reply: oneshot::Sender<bool>,
    },
}

/// Notices from actor tasks and call guards. Their number is bounded by construction:
/// at most four per activation (activated or failed, one idle check per idle period,
/// deactivated or crashed), one per told message a stale activation gives back (at most
/// its mailbox's capacity: its mailbox is closed when it is found stale), one per timer
/// of the told messages kept for an actor, and one shutdown per runtime, so the channel
/// is unbounded.
/// (Calls send none: their wait-for edges are added and removed under the graph's own
/// lock, `wait_for_graph::SharedWaits`.)
///
/// Ordering: the dispatcher drains this channel before it handles each command, so a
/// notice sent before a command (by the same task, or causally before it) is always
/// applied first.
pub(crate) enum Control {
    /// Stop: refuse new work, close every mailbox; `reply` is answered when every
    /// activation has ended. Sent by `Runtime::shutdown` (with a reply) and by dropping
    /// the `Runtime` (without).
    Shutdown { reply: Option<oneshot::Sender<()>> },
    /// Stop every activation at once: the shutdown grace period is over, or the
    /// `Runtime` was dropped.
    Abort,
    /// The activation failed to start; its mailbox is closed and drained.
    ActivationFailed { id: ActorId, generation: u64 },
    /// The activation has been idle since it took its `received`-th message.
    IdleCheck {
        id: ActorId,
        generation: u64,
        received: u64,
    },
    /// The store refused the activation's commit for a newer claim: close its mailbox
    /// now (held messages start the next activation).
    Fenced { id: ActorId, generation: u64 },
    /// A told message the stale activation `generation` of `id` (its commit fenced, or
    /// its store's answer unknown) took from its mailbox unrun. It was accepted (its
    /// sender was answered `Ok`), so it is kept for this runtime's next activation of
    /// `id`, which it does not start by itself: see `Dispatcher::keep`.
    KeepTold {
        id: ActorId,
        generation: u64,
        envelope: Box<Envelope>,
    },
    /// The earliest of the times the told messages kept for `id` (under `epoch`) may
    /// wait has come: those whose time has passed are dropped as expired.
    KeptExpired { id: ActorId, epoch: u64 },
    /// The activation ran `on_deactivate`, saved, and its task is ending.
    Deactivated { id: ActorId, generation: u64 },
    /// The activation's task ended abnormally (a panic, or aborted). `unrun`: the
    /// messages still in its mailbox, which never started, oldest first, for the next
    /// activation.
    Crashed {
        id: ActorId,
        generation: u64,
        unrun: Vec<Envelope>,
    },
}

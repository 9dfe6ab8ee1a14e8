//! What travels from a caller to an actor's mailbox, and what comes back (the dispatcher's
//! commands and control notices are in `control.rs`).

use bytes::Bytes;
use tokio::sync::oneshot;
use troupe_core::{ActorId, CallContext, InvokeError};

use crate::wait_for_graph::CallId;
use crate::AnyValue;

/// The answer to one invocation.
pub(crate) type Reply = Result<Payload, InvokeError>;

/// A message or a reply: bytes (the untyped API, the agent layer, the wire) or, between
/// a typed [`crate::ActorRef`] and its actor in this process, the value itself, never
/// serialized (inline when small: see [`AnyValue`]).
pub(crate) enum Payload {
    Bytes(Bytes),
    Value(AnyValue),
}

impl Payload {
    /// The bytes of a reply to a bytes request.
    pub(crate) fn into_bytes(self, target: &ActorId) -> Result<Bytes, InvokeError> {
        match self {
            Self::Bytes(bytes) => Ok(bytes),
            Self::Value(_) => Err(InvokeError::ActorFailed {
                target: target.clone(),
                cause: "the actor replied with an in-process value to a request made as bytes".to_string(),
            }),
        }
    }
}

/// Where a request's reply goes.
pub(crate) enum ReplyTo {
    /// To a caller that waits for it.
    Caller(oneshot::Sender<Reply>),
    /// A fire-and-forget message on its way through the dispatcher: its sender waits
    /// only to learn whether it was accepted (put into the mailbox, or held for the next
    /// activation). The dispatcher answers and turns it into `Nobody` before delivery.
    Acceptance(oneshot::Sender<Result<(), InvokeError>>),
    /// Nobody: an accepted fire-and-forget message.
    Nobody,
}

impl ReplyTo {
    /// Whether a caller waits for the reply.
    pub(crate) fn has_caller(&self) -> bool {
        matches!(self, Self::Caller(_))
    }

    /// Sends the reply to whoever waits for it (a caller that is gone is ignored). To a
    /// fire-and-forget sender still waiting for acceptance, only a refusal means
    /// anything.
    pub(crate) fn send(self, reply: Reply) {
        match self {
            Self::Caller(sender) => {
                let _ = sender.send(reply);
            }
            Self::Acceptance(sender) => {
                let _ = sender.send(reply.map(|_| ()));
            }
            Self::Nobody => {}
        }
    }

    /// Takes the acceptance sender of a fire-and-forget message, leaving `Nobody`.
    pub(crate) fn take_acceptance(&mut self) -> Option<oneshot::Sender<Result<(), InvokeError>>> {
        match std::mem::replace(self, Self::Nobody) {
            Self::Acceptance(sender) => Some(sender),
            other => {
                *self = other;
                None
            }
        }
    }

    /// Whether whoever waits stopped waiting. Never, for an accepted message.
    pub(crate) fn is_closed(&self) -> bool {
        match self {
            Self::Caller(sender) => sender.is_closed(),
            Self::Acceptance(sender) => sender.is_closed(),
            Self::Nobody => false,
        }
    }

    /// Ready once the caller stops waiting; pending forever without one.
    pub(crate) fn poll_closed(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        match self {
            Self::Caller(sender) => sender.poll_closed(cx),
            Self::Acceptance(sender) => sender.poll_closed(cx),
            Self::Nobody => std::task::Poll::Pending,
        }
    }
}

/// One request in a mailbox. Boxed in the mailbox so an idle mailbox stays small.
pub(crate) struct Envelope {
    pub(crate) payload: Payload,
    pub(crate) context: CallContext,
    pub(crate) reply: ReplyTo,
    /// The request's id, unique within the runtime (also the id of its wait-for edge).
    pub(crate) call: CallId,
    /// Whether the call has a wait-for edge (made from inside a turn): the callee
    /// releases it before it replies, so the edge ends with the call, not with the
    /// caller's future.
    pub(crate) edge: bool,
    /// The caller's `invoke` (or `tell`) span: the parent of the callee's `turn` span
    /// (disabled, and free, when no `tracing` subscriber wants it).
    pub(crate) span: tracing::Span,
}

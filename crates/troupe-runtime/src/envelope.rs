//! What travels from a caller to an actor's mailbox, and what comes back (the dispatcher's
//! commands and control notices are in `control.rs`).

use bytes::Bytes;
use tokio::sync::oneshot;
use troupe_core::{ActorId, CallContext, Deadline, InvokeError};

use crate::idempotency::KeyedRequest;
use crate::reply_cell::ReplySender;
use crate::wait_for_graph::CallId;
use crate::AnyValue;

/// The answer to one invocation.
pub(crate) type Reply = Result<Payload, InvokeError>;

/// A message or a reply: bytes (the untyped API, the agent layer, the wire) or, between
/// a typed [`crate::ActorRef`] and its actor in this process, the value itself, never
/// serialized (inline when small: see [`AnyValue`]); or a request as bytes with its
/// idempotency key (`RuntimeHandle::invoke_keyed`), boxed so that the payload, and the
/// envelope, stay as small as without it. A reply is never keyed.
pub(crate) enum Payload {
    Bytes(Bytes),
    Value(AnyValue),
    Keyed(Box<KeyedRequest>),
}

impl Payload {
    /// A keyed request: `payload`, one attempt of the logical request `key` names.
    pub(crate) fn keyed(key: &crate::IdempotencyKey, payload: Bytes) -> Self {
        Self::Keyed(Box::new(KeyedRequest {
            key: key.clone(),
            payload,
        }))
    }

    /// The bytes of a reply to a bytes request.
    #[inline]
    pub(crate) fn into_bytes(self, target: &ActorId) -> Result<Bytes, InvokeError> {
        match self {
            Self::Bytes(bytes) => Ok(bytes),
            Self::Value(_) | Self::Keyed(_) => Err(value_for_bytes(target)),
        }
    }

    /// The value of a reply to a value request.
    #[inline]
    pub(crate) fn into_value(self, target: &ActorId) -> Result<AnyValue, InvokeError> {
        match self {
            Self::Value(value) => Ok(value),
            Self::Bytes(_) | Self::Keyed(_) => Err(bytes_for_value(target)),
        }
    }
}

/// The error for a reply made as bytes to a request made as a value (see
/// [`value_for_bytes`]).
#[cold]
#[inline(never)]
fn bytes_for_value(target: &ActorId) -> InvokeError {
    InvokeError::ActorFailed {
        target: target.clone(),
        cause: "the actor replied with bytes to a message sent as a value".to_string(),
    }
}

/// The error for a reply made as a value to a request made as bytes: out of line, so that
/// the common case inlines into each caller's wait.
#[cold]
#[inline(never)]
fn value_for_bytes(target: &ActorId) -> InvokeError {
    InvokeError::ActorFailed {
        target: target.clone(),
        cause: "the actor replied with an in-process value to a request made as bytes".to_string(),
    }
}

/// Where a request's reply goes.
pub(crate) enum ReplyTo {
    /// To a caller that waits for it.
    Caller(ReplySender),
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
            Self::Caller(sender) => sender.send(reply),
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
///
/// Kept to at most [`ENVELOPE_BYTES_MAX`]: a batch of fire-and-forget messages holds
/// many at once, more than glibc's per-thread cache of freed blocks (7 per size), and
/// beyond it a block of up to 120 bytes goes to malloc's fast bins while a larger one
/// takes its slow path (the unsorted bin, with merging) at every free and malloc. At 192
/// bytes that slow path was about 300 instructions of a typed tell's 2,050 (callgrind,
/// 2026-11-28, docs/architecture.md "Seventh pass"). So the two parts most requests do
/// not need are boxed only when present: a context with more than a deadline (a call
/// from a turn, or a traced one), and the caller's span (when a subscriber records it).
pub(crate) struct Envelope {
    pub(crate) payload: Payload,
    pub(crate) context: EnvelopeContext,
    pub(crate) reply: ReplyTo,
    /// The request's id, unique within the runtime (also the id of its wait-for edge).
    pub(crate) call: CallId,
    /// Whether the call has a wait-for edge (made from inside a turn): the callee
    /// releases it before it replies, so the edge ends with the call, not with the
    /// caller's future.
    pub(crate) edge: bool,
    /// The caller's `invoke` (or `tell`) span: the parent of the callee's `turn` span
    /// (absent, and free, when no `tracing` subscriber wants it).
    pub(crate) span: EnvelopeSpan,
}

/// The most bytes an [`Envelope`] takes: the largest request glibc's malloc serves from
/// its fast bins (a 128-byte block with its 8-byte header).
pub(crate) const ENVELOPE_BYTES_MAX: usize = 120;

// Checked where it is built: a field that grows the envelope past it fails the build.
const _: () = assert!(std::mem::size_of::<Envelope>() <= ENVELOPE_BYTES_MAX);

/// A request's call context as its envelope carries it: a root context with no trace id
/// (a call from outside any turn, the hot path) is its deadline alone; any other is
/// boxed.
pub(crate) enum EnvelopeContext {
    Root(Deadline),
    Full(Box<CallContext>),
}

impl EnvelopeContext {
    /// The request's deadline.
    pub(crate) fn deadline(&self) -> Deadline {
        match self {
            Self::Root(deadline) => *deadline,
            Self::Full(context) => context.deadline(),
        }
    }

    /// The request's depth in its call tree.
    pub(crate) fn depth(&self) -> u32 {
        match self {
            Self::Root(_) => 0,
            Self::Full(context) => context.depth(),
        }
    }

    /// The context itself: a full one as it travelled; a root one built into `root`
    /// (where the owner keeps it) the first time it is asked for.
    pub(crate) fn context<'a>(&'a self, root: &'a std::sync::OnceLock<Box<CallContext>>) -> &'a CallContext {
        match self {
            Self::Root(deadline) => root.get_or_init(|| Box::new(CallContext::root(*deadline))),
            Self::Full(context) => context,
        }
    }
}

impl EnvelopeContext {
    /// The context as an owned value: a root one built anew (no box, unlike
    /// [`EnvelopeContext::context`]), a full one cloned (its chain is shared).
    pub(crate) fn to_context(&self) -> CallContext {
        match self {
            Self::Root(deadline) => CallContext::root(*deadline),
            Self::Full(context) => CallContext::clone(context),
        }
    }
}

impl From<CallContext> for EnvelopeContext {
    fn from(context: CallContext) -> Self {
        if context.depth() == 0 && context.chain().is_empty() && context.trace_id().is_none() {
            Self::Root(context.deadline())
        } else {
            Self::Full(Box::new(context))
        }
    }
}

/// The caller's span, boxed only when a subscriber records it (a disabled span is
/// `Span::none()`, and takes 40 bytes where this takes 8).
pub(crate) struct EnvelopeSpan(Option<Box<tracing::Span>>);

impl EnvelopeSpan {
    pub(crate) fn new(span: tracing::Span) -> Self {
        if span.is_none() {
            Self(None)
        } else {
            Self(Some(Box::new(span)))
        }
    }

    /// Whether no span was recorded.
    pub(crate) fn is_none(&self) -> bool {
        self.0.is_none()
    }

    /// The span itself (`Span::none()` when it was not recorded).
    pub(crate) fn into_span(self) -> tracing::Span {
        match self.0 {
            Some(span) => *span,
            None => tracing::Span::none(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: a root context without a trace id travels as its deadline, anything else
    /// whole, and both come back as they went in.
    #[test]
    fn a_context_comes_back_as_it_went_in() {
        let deadline = Deadline::from_micros(5);
        let root = CallContext::root(deadline);
        let caller = ActorId::new("k", "a").unwrap();
        let child = root.child(caller, deadline);
        let traced = CallContext::root(deadline).with_trace_id(troupe_core::TraceId::new(7));
        for context in [root, child, traced] {
            let travelled = EnvelopeContext::from(context.clone());
            assert_eq!(
                matches!(travelled, EnvelopeContext::Root(_)),
                context.depth() == 0 && context.trace_id().is_none()
            );
            assert_eq!(travelled.deadline(), deadline);
            let root = std::sync::OnceLock::new();
            assert_eq!(travelled.to_context(), context);
            assert_eq!(travelled.context(&root), &context);
            assert_eq!(root.get().is_some(), matches!(travelled, EnvelopeContext::Root(_)));
        }
    }
}

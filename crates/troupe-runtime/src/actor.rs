//! What an actor is: the [`Actor`] trait, its [`ActorFactory`] and [`ActorError`].

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use smallbox::{smallbox, SmallBox};
use troupe_core::{ActorId, InvokeError};

use crate::handler_slot::{HandlerSlot, InSlot, HANDLER_SLOT_KEPT_BYTES_MAX};
use crate::idempotency::KeyedRequest;
use crate::{StateChange, StoreError, Turn};

/// Why an actor's turn or hook failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActorError {
    /// The turn failed; the caller sees [`InvokeError::ActorFailed`] and the turn's
    /// writes and state changes are rolled back.
    #[error("{cause}")]
    Failed {
        /// What went wrong.
        cause: String,
    },
    /// The actor refused the request; the caller sees [`InvokeError::Rejected`].
    #[error("rejected: {reason}")]
    Rejected {
        /// Why.
        reason: String,
    },
    /// A call the actor made failed and the actor passed the error on.
    #[error(transparent)]
    Invoke(#[from] InvokeError),
    /// A read of the actor's key-value space failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// An id a turn could not build (from what a message said, typically): the request is
/// refused, [`ActorError::Rejected`] with the reason, so a handler can use `?` on
/// `ActorId::new`.
impl From<troupe_core::IdError> for ActorError {
    fn from(error: troupe_core::IdError) -> Self {
        Self::rejected(error.to_string())
    }
}

impl ActorError {
    /// A [`ActorError::Failed`] with `cause`.
    pub fn failed(cause: impl Into<String>) -> Self {
        Self::Failed { cause: cause.into() }
    }

    /// A [`ActorError::Rejected`] with `reason`.
    pub fn rejected(reason: impl Into<String>) -> Self {
        Self::Rejected { reason: reason.into() }
    }
}

/// Bytes of inline space in an [`AnyValue`]: a value of at most this size (and of an
/// alignment of at most 8) is kept inline, without an allocation; a larger one is
/// boxed. 16 bytes hold a number or two, an `Arc` or a `Box`, or a small enum; a
/// `String` (24 bytes) is boxed. (Two words keep a payload as small as its bytes form;
/// with four, a typed `tell` measured more instructions than with two.)
pub const ANY_VALUE_INLINE_BYTES: usize = std::mem::size_of::<AnyValueSpace>();

/// The inline space of an [`AnyValue`]: two words.
type AnyValueSpace = smallbox::space::S2;

/// A message or a reply passed as a value within this process (by a typed
/// [`crate::ActorRef`], never serialized), of any type: kept inline when it fits in
/// [`ANY_VALUE_INLINE_BYTES`], so that a typed `ask` or `tell` of a small message
/// allocates nothing for it; boxed otherwise.
pub struct AnyValue(SmallBox<dyn Any + Send, AnyValueSpace>);

impl AnyValue {
    /// Wraps `value`.
    pub fn new<T: Any + Send>(value: T) -> Self {
        Self(smallbox!(value))
    }

    /// The value, if it is a `T`; else the same `AnyValue` back.
    ///
    /// # Errors
    /// `self`, unchanged, when the value is not a `T`.
    pub fn downcast<T: Any>(self) -> Result<T, Self> {
        self.0.downcast::<T>().map(SmallBox::into_inner).map_err(Self)
    }

    /// Whether the value is a `T`.
    pub fn is<T: Any>(&self) -> bool {
        (*self.0).is::<T>()
    }

    /// Whether the value was too large to be kept inline (and was boxed).
    pub fn is_boxed(&self) -> bool {
        self.0.is_heap()
    }
}

impl std::fmt::Debug for AnyValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnyValue")
            .field("boxed", &self.is_boxed())
            .finish_non_exhaustive()
    }
}

/// A virtual actor: state plus a turn handler. One turn runs at a time per actor.
///
/// The runtime builds the actor with its [`ActorFactory`] from the last committed
/// snapshot, runs [`Actor::on_activate`], then one [`Actor::handle`] per message. After a
/// successful turn it takes [`Actor::snapshot`] and commits it with the turn's writes
/// atomically before replying; if the turn fails, times out or the commit fails, the
/// actor is rebuilt from the last committed snapshot, so the in-memory state never
/// runs ahead of the stored one.
///
/// The hooks are `async fn`s in the trait (no `#[async_trait]` attribute): implement them
/// with plain `async fn`s. Their futures must be `Send`, since a turn may run on any
/// worker thread; a future that holds something not `Send` (an `Rc`, a
/// `std::sync::MutexGuard`) across an `.await` is refused at compile time, at the
/// `async fn`. A factory hands the actor to the runtime as an [`ActorBox`].
///
/// ```
/// use bytes::Bytes;
/// use troupe_runtime::{Actor, ActorError, Turn};
///
/// struct Echo;
///
/// impl Actor for Echo {
///     async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
///         Ok(payload)
///     }
/// }
/// ```
///
/// (Before issue 11 it was an `#[async_trait]` trait. Now [`Actor::handle`]'s future
/// runs in memory the activation reuses from turn to turn: a turn costs no heap
/// allocation for it.)
pub trait Actor: Send + 'static {
    /// Bytes of a turn's future (its `handle` or `handle_value` future) that an
    /// activation keeps allocated from one turn to the next. A future up to this size
    /// costs no allocation per turn after the activation's first, and an idle activation
    /// holds its block; a larger one is allocated at each turn and freed at its end.
    /// Default [`crate::HANDLER_SLOT_KEPT_BYTES_MAX`] (1,024 B). An actor whose turns are
    /// large and whose idle activations hold much more anyway (an agent, with its
    /// window of messages) may raise it to spare each turn a `malloc` and a `free` of its
    /// kilobytes.
    const TURN_FUTURE_KEPT_BYTES_MAX: usize = HANDLER_SLOT_KEPT_BYTES_MAX;

    /// Runs once after the state is loaded, before the first turn.
    ///
    /// # Errors
    /// An error ends the activation; every queued request fails with it.
    fn on_activate(&mut self, _id: &ActorId) -> impl Future<Output = Result<(), ActorError>> + Send {
        async { Ok(()) }
    }

    /// Handles one request and returns the reply. Write it as `async fn handle(&mut
    /// self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError>`.
    ///
    /// # Errors
    /// [`ActorError`]; the turn's writes and state changes are rolled back.
    ///
    /// # Cancel safety
    /// The future is dropped when the request's deadline passes; the runtime then
    /// rebuilds the actor from its last committed snapshot.
    fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> impl Future<Output = Result<Bytes, ActorError>> + Send;

    /// Handles one message passed as a value within this process, by a typed
    /// [`crate::ActorRef`]; returns the reply as a value. Typed actors get it from
    /// [`crate::TypedActor`]'s adapter; the default refuses.
    ///
    /// # Errors
    /// As [`Actor::handle`]; the default rejects the message.
    fn handle_value(
        &mut self,
        _turn: &mut Turn,
        _message: AnyValue,
    ) -> impl Future<Output = Result<AnyValue, ActorError>> + Send {
        async {
            Err(ActorError::rejected(
                "this actor takes bytes only; register it as a TypedActor to send it values",
            ))
        }
    }

    /// Not for implementors: the turn for a message passed as a value, as the runtime
    /// polls it, its future in the activation's `slot` (the block its turns' futures run
    /// in, see `handler_slot.rs`). The default places [`Actor::handle_value`]'s future
    /// there; the adapter of a [`crate::TypedActor`] overrides it to unwrap the message
    /// first.
    #[doc(hidden)]
    fn handle_value_turn<'a>(
        &'a mut self,
        slot: &'a mut TurnSlot,
        turn: &'a mut Turn,
        message: AnyValue,
    ) -> ValueTurn<'a> {
        // Made once its block is ready, so that it is written where it is polled: an
        // agent's turn future is kilobytes.
        ValueTurn::in_slot(slot.0.place_with(Self::TURN_FUTURE_KEPT_BYTES_MAX, move || {
            self.handle_value(turn, message)
        }))
    }

    /// Runs once before the actor is deactivated; its snapshot is committed afterwards.
    ///
    /// # Errors
    /// An error is logged; the state of the last successful turn is already committed.
    fn on_deactivate(&mut self, _id: &ActorId) -> impl Future<Output = Result<(), ActorError>> + Send {
        async { Ok(()) }
    }

    /// The actor's state as bytes, or `None` for a stateless actor. Called after every
    /// successful turn; the runtime commits it only when it differs from the last one.
    ///
    /// # Errors
    /// An error fails the turn and rolls it back.
    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(None)
    }

    /// How the actor's state differs from `committed`, its last committed snapshot:
    /// what the runtime calls after every successful turn (and at deactivation). The
    /// default takes [`Actor::snapshot`] and compares; an actor that can tell more
    /// cheaply that nothing changed may override it, as typed actors do (they compare
    /// their encoding with `committed` as it is written, and allocate only when it
    /// differs). It must agree with `StateChange::between(committed, self.snapshot()?)`.
    ///
    /// # Errors
    /// As [`Actor::snapshot`].
    fn state_change(&self, committed: Option<&Bytes>) -> Result<StateChange, ActorError> {
        Ok(StateChange::between(committed, self.snapshot()?))
    }
}

/// An actor as the runtime holds it: any [`Actor`], its type erased, with the memory its
/// turns' futures run in. An [`ActorFactory`] returns one: `Ok(ActorBox::new(actor))`.
///
/// [`Actor`]'s hooks return futures of the actor's own types, so `dyn Actor` is not a
/// type; `ActorBox` is the one object the runtime needs instead. It keeps one block for
/// its turns' futures ([`Actor::handle`]'s, or [`Actor::handle_value`]'s) for as long as
/// the activation lives, allocated at the first turn and reused by every later one (see
/// `handler_slot.rs`). The rare hooks
/// (`on_activate`, `on_deactivate`) are boxed.
pub struct ActorBox(Box<dyn ErasedActor>);

impl ActorBox {
    /// Erases `actor`'s type, for the runtime to hold.
    pub fn new<A: Actor>(actor: A) -> Self {
        Self(Box::new(Slotted {
            actor,
            slot: TurnSlot(HandlerSlot::new()),
        }))
    }

    /// A box holding no actor, for the moment between dropping a failed instance and
    /// building its successor (`Live::roll_back` in activation.rs). It allocates
    /// nothing (a box of a zero-sized type), and nothing is ever asked of it.
    pub(crate) fn vacant() -> Self {
        Self(Box::new(Vacant))
    }

    pub(crate) fn on_activate<'a>(&'a mut self, id: &'a ActorId) -> HookFuture<'a> {
        self.0.on_activate(id)
    }

    pub(crate) fn on_deactivate<'a>(&'a mut self, id: &'a ActorId) -> HookFuture<'a> {
        self.0.on_deactivate(id)
    }

    pub(crate) fn handle<'a>(&'a mut self, turn: &'a mut Turn, payload: Bytes) -> BytesTurn<'a> {
        self.0.handle(turn, payload)
    }

    /// The turn of a keyed request, in the same slot as a bytes turn (see
    /// `idempotency::keyed_turn`).
    pub(crate) fn handle_keyed<'a>(&'a mut self, turn: &'a mut Turn, request: KeyedRequest) -> BytesTurn<'a> {
        self.0.handle_keyed(turn, request)
    }

    pub(crate) fn handle_value_turn<'a>(&'a mut self, turn: &'a mut Turn, message: AnyValue) -> ValueTurn<'a> {
        self.0.handle_value_turn(turn, message)
    }

    pub(crate) fn state_change(&self, committed: Option<&Bytes>) -> Result<StateChange, ActorError> {
        self.0.state_change(committed)
    }
}

impl std::fmt::Debug for ActorBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActorBox").finish_non_exhaustive()
    }
}

/// The future of an activation's hook (`on_activate`, `on_deactivate`), its type
/// erased: inline when it fits in a word (the default hooks' `async { Ok(()) }` is one
/// byte, so an actor that keeps them allocates nothing for them), boxed otherwise. A
/// `Box` here was a malloc and a free per activation for a future of one byte (about
/// 250 instructions of a cold activation's 14,500, callgrind, 2026-12-05).
pub(crate) type HookFuture<'a> = SmallBox<dyn Future<Output = Result<(), ActorError>> + Send + 'a, smallbox::space::S1>;

/// The future of a turn for bytes, in the activation's reusable slot (whose block is
/// freed when the turn ends if it is larger than `HANDLER_SLOT_KEPT_BYTES_MAX`).
pub(crate) type BytesTurn<'a> = InSlot<'a, Result<Bytes, ActorError>>;

/// [`Actor`] with its futures' types erased: what [`ActorBox`] holds.
trait ErasedActor: Send {
    fn on_activate<'a>(&'a mut self, id: &'a ActorId) -> HookFuture<'a>;
    fn on_deactivate<'a>(&'a mut self, id: &'a ActorId) -> HookFuture<'a>;
    fn handle<'a>(&'a mut self, turn: &'a mut Turn, payload: Bytes) -> BytesTurn<'a>;
    fn handle_keyed<'a>(&'a mut self, turn: &'a mut Turn, request: KeyedRequest) -> BytesTurn<'a>;
    fn handle_value_turn<'a>(&'a mut self, turn: &'a mut Turn, message: AnyValue) -> ValueTurn<'a>;
    fn state_change(&self, committed: Option<&Bytes>) -> Result<StateChange, ActorError>;
}

/// What [`ActorBox::vacant`] holds: no actor. Its methods are never called: the box is
/// replaced by the rebuilt actor at once, or the activation's task ends with a panic.
struct Vacant;

/// Why a [`Vacant`] box is never used.
const VACANT: &str = "a vacant ActorBox is replaced before it is used";

impl ErasedActor for Vacant {
    fn on_activate<'a>(&'a mut self, _id: &'a ActorId) -> HookFuture<'a> {
        unreachable!("{VACANT}")
    }

    fn on_deactivate<'a>(&'a mut self, _id: &'a ActorId) -> HookFuture<'a> {
        unreachable!("{VACANT}")
    }

    fn handle<'a>(&'a mut self, _turn: &'a mut Turn, _payload: Bytes) -> BytesTurn<'a> {
        unreachable!("{VACANT}")
    }

    fn handle_keyed<'a>(&'a mut self, _turn: &'a mut Turn, _request: KeyedRequest) -> BytesTurn<'a> {
        unreachable!("{VACANT}")
    }

    fn handle_value_turn<'a>(&'a mut self, _turn: &'a mut Turn, _message: AnyValue) -> ValueTurn<'a> {
        unreachable!("{VACANT}")
    }

    fn state_change(&self, _committed: Option<&Bytes>) -> Result<StateChange, ActorError> {
        unreachable!("{VACANT}")
    }
}

/// An actor and the slot its turns' futures run in.
struct Slotted<A> {
    actor: A,
    slot: TurnSlot,
}

/// The block of memory an activation's turn futures run in, bytes and values alike
/// (one turn at a time): an [`ActorBox`] holds it. Not for implementors: it appears
/// only in the hidden [`Actor::handle_value_turn`].
#[doc(hidden)]
pub struct TurnSlot(pub(crate) HandlerSlot);

impl<A: Actor> ErasedActor for Slotted<A> {
    fn on_activate<'a>(&'a mut self, id: &'a ActorId) -> HookFuture<'a> {
        smallbox!(self.actor.on_activate(id))
    }

    fn on_deactivate<'a>(&'a mut self, id: &'a ActorId) -> HookFuture<'a> {
        smallbox!(self.actor.on_deactivate(id))
    }

    /// The future is made by a closure once its block is ready, so it is written where
    /// it will be polled rather than made on the stack and copied: an agent's future is
    /// kilobytes.
    #[inline]
    fn handle<'a>(&'a mut self, turn: &'a mut Turn, payload: Bytes) -> BytesTurn<'a> {
        let actor = &mut self.actor;
        self.slot
            .0
            .place_with(A::TURN_FUTURE_KEPT_BYTES_MAX, move || actor.handle(turn, payload))
    }

    /// A keyed turn runs in the slot too, rather than in a box of its own: a third,
    /// boxed kind of turn future gave every turn's handler out-of-line drop glue (about
    /// 40 instructions a told message, callgrind, 2026-12-01). Its block is larger than
    /// the bytes turn's, so it is freed after the turn unless within the kept maximum.
    #[inline]
    fn handle_keyed<'a>(&'a mut self, turn: &'a mut Turn, request: KeyedRequest) -> BytesTurn<'a> {
        let actor = &mut self.actor;
        self.slot.0.place_with(A::TURN_FUTURE_KEPT_BYTES_MAX, move || {
            crate::idempotency::keyed_turn(actor, turn, request)
        })
    }

    #[inline]
    fn handle_value_turn<'a>(&'a mut self, turn: &'a mut Turn, message: AnyValue) -> ValueTurn<'a> {
        let Self { actor, slot } = self;
        actor.handle_value_turn(slot, turn, message)
    }

    #[inline]
    fn state_change(&self, committed: Option<&Bytes>) -> Result<StateChange, ActorError> {
        self.actor.state_change(committed)
    }
}

/// The future of one turn for a message passed as a value (see
/// `Actor::handle_value_turn`): in the activation's reusable slot, or decided before it
/// started.
pub struct ValueTurn<'a>(ValueTurnInner<'a>);

/// What a turn for a value ends with.
type ValueOutcome = Result<AnyValue, ActorError>;

/// Two words, so that the actor's vtable call returns it in registers (an `InSlot` is
/// one pointer; the decided outcome, a rare refusal, is boxed).
enum ValueTurnInner<'a> {
    InSlot(InSlot<'a, ValueOutcome>),
    Ready(Option<Box<ValueOutcome>>),
}

impl<'a> ValueTurn<'a> {
    /// A turn whose future lives in a [`crate::handler_slot::HandlerSlot`].
    pub(crate) fn in_slot(future: InSlot<'a, ValueOutcome>) -> Self {
        Self(ValueTurnInner::InSlot(future))
    }

    /// A turn decided before it started (a message of the wrong type).
    pub(crate) fn ready(outcome: ValueOutcome) -> Self {
        Self(ValueTurnInner::Ready(Some(Box::new(outcome))))
    }
}

// Nothing in it is pinned in place: a slot's future is pinned where it lies, behind a
// pointer, and a decided outcome is only taken out.
impl Unpin for ValueTurn<'_> {}

impl Future for ValueTurn<'_> {
    type Output = ValueOutcome;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<ValueOutcome> {
        match &mut self.get_mut().0 {
            ValueTurnInner::InSlot(future) => Pin::new(future).poll(cx),
            ValueTurnInner::Ready(outcome) => Poll::Ready(*outcome.take().expect("a decided turn is polled once")),
        }
    }
}

/// Builds actors of one kind from their last committed snapshot.
pub trait ActorFactory: Send + Sync + 'static {
    /// Builds the actor `id` from `saved` (`None` if it never committed a snapshot).
    ///
    /// # Errors
    /// [`ActorError`] if the snapshot cannot be decoded; the activation fails and the
    /// caller sees the error: the actor never starts from a default state by accident.
    fn create(&self, id: &ActorId, saved: Option<Bytes>) -> Result<ActorBox, ActorError>;
}

impl<F> ActorFactory for F
where
    F: Fn(&ActorId, Option<Bytes>) -> Result<ActorBox, ActorError> + Send + Sync + 'static,
{
    fn create(&self, id: &ActorId, saved: Option<Bytes>) -> Result<ActorBox, ActorError> {
        self(id, saved)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// Goal: a value turn is two words, so that `handle_value_turn`, a call through the
    /// actor's vtable on every typed message, returns it in registers rather than
    /// through memory (docs/architecture.md, "Thirtieth pass").
    #[test]
    fn a_value_turn_is_two_words() {
        assert_eq!(std::mem::size_of::<ValueTurn<'_>>(), 2 * std::mem::size_of::<usize>());
        assert_eq!(std::mem::size_of::<BytesTurn<'_>>(), std::mem::size_of::<usize>());
    }

    /// More than 8-byte alignment: never inline, whatever its size.
    #[repr(align(32))]
    struct Aligned(u8);

    /// Goal: values that fit in `ANY_VALUE_INLINE_BYTES` (at 8-byte alignment) are kept
    /// inline and others boxed, and each comes back out as itself.
    #[test]
    fn small_values_are_inline_and_large_or_overaligned_ones_boxed() {
        assert_eq!(ANY_VALUE_INLINE_BYTES, 16);
        let inline = [
            AnyValue::new(7_u64),
            AnyValue::new(Some(7_u64)),
            AnyValue::new([7_u64; 2]),
            AnyValue::new(Box::new(7_u8)),
            AnyValue::new(()),
        ];
        assert!(inline.iter().all(|value| !value.is_boxed()), "{inline:?}");
        let boxed = [
            AnyValue::new(String::from("seven")),
            AnyValue::new([7_u64; 3]),
            AnyValue::new(Aligned(7)),
        ];
        assert!(boxed.iter().all(AnyValue::is_boxed), "{boxed:?}");

        let [number, optional, pair, small_box, unit] = inline;
        assert_eq!(number.downcast::<u64>().unwrap(), 7);
        assert_eq!(optional.downcast::<Option<u64>>().unwrap(), Some(7));
        assert_eq!(pair.downcast::<[u64; 2]>().unwrap(), [7; 2]);
        assert_eq!(*small_box.downcast::<Box<u8>>().unwrap(), 7);
        unit.downcast::<()>().unwrap();
        let [text, three, aligned] = boxed;
        assert_eq!(text.downcast::<String>().unwrap(), "seven");
        assert_eq!(three.downcast::<[u64; 3]>().unwrap(), [7; 3]);
        assert_eq!(aligned.downcast::<Aligned>().unwrap().0, 7);
    }

    /// Goal: a failed downcast gives the same value back, intact, and a value (inline or
    /// boxed) is dropped exactly once: when its `AnyValue` drops, or by whoever took it
    /// out, never both.
    #[test]
    fn a_wrong_downcast_gives_the_value_back_and_each_value_drops_once() {
        let owner = Arc::new(());
        let inline = AnyValue::new(Arc::clone(&owner));
        let boxed = AnyValue::new((Arc::clone(&owner), [0_u64; 8]));
        assert!(!inline.is_boxed() && boxed.is_boxed());
        assert_eq!(Arc::strong_count(&owner), 3);

        let inline = inline.downcast::<u64>().unwrap_err();
        let boxed = boxed.downcast::<Arc<()>>().unwrap_err();
        assert!(inline.is::<Arc<()>>() && boxed.is::<(Arc<()>, [u64; 8])>());
        assert_eq!(Arc::strong_count(&owner), 3, "a failed downcast drops nothing");

        let taken = inline.downcast::<Arc<()>>().unwrap();
        assert_eq!(Arc::strong_count(&owner), 3, "taken out, not dropped");
        drop(taken);
        assert_eq!(Arc::strong_count(&owner), 2);
        drop(boxed);
        assert_eq!(Arc::strong_count(&owner), 1, "a boxed value drops with its AnyValue");
    }
}

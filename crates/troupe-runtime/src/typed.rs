//! Typed actors: [`TypedActor`] declares its message and reply types, [`ActorRef`]
//! sends them with typed `ask` and `tell`.
//!
//! In this process, messages and replies travel as values (an [`AnyValue`] in the
//! envelope, inline when it fits in 16 bytes, downcast by the adapter): nothing is
//! serialized, and a small message or reply is not allocated either. Serialization (bincode)
//! happens only where bytes are needed: the actor's state at commit and load, and a
//! message that arrives as bytes (the untyped [`RuntimeHandle::invoke`], the transport
//! from another node), which the adapter decodes and answers in kind.
//!
//! ```text
//! ActorRef<A>::ask(msg)  ─► Envelope { Payload::Value(AnyValue(A::Message)) }       ─► mailbox
//! ActorRef<A>::tell(msg) ─► Envelope { Payload::Value(AnyValue(Told<A::Message>)) } ─► mailbox
//!                                                   │
//!   TypedAdapter<A>::handle_value: downcast ─► A::handle(turn, msg).await (inline, no box)
//!     ─► ask: AnyValue(A::Reply); tell: AnyValue(Unread) (zero-sized)
//! RuntimeHandle::invoke(bytes) ─► TypedAdapter<A>::handle: bincode ─► A::handle ─► bincode
//! state: [tag(A::STATE_VERSION)] bincode(A) committed after a turn that changed it;
//!        on activation: same version → bincode → A; another → A::migrate (default: refuse)
//! ```
//!
//! The actor is its own state: `A: Serialize + DeserializeOwned + Default`, built with
//! `Default` the first time and from its last committed encoding afterwards. Fields that
//! are not state (a connection, a cache) are `#[serde(skip)]`, and are reset at every
//! rollback (see [`TypedActor`]). A state at version 0 has no tag: the format of every
//! state stored before versions existed.

use std::any::TypeId;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::time::Duration;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;
use troupe_core::limits::INVOKE_TIMEOUT_MS_MAX;
use troupe_core::{ActorId, ActorKind, CallRefused, Deadline, InvokeError};

use crate::actor::{TurnSlot, ValueTurn};
use crate::envelope::{EnvelopeContext, Payload};
use crate::handle::{RouteCache, Told as Handed, IN_TURN};
use crate::handler_slot::HandlerSlot;
use crate::{Actor, ActorBox, ActorError, AnyValue, Caller, IdempotencyKey, RuntimeHandle, StateChange, Turn};

/// An actor with typed messages and replies, whose state is the actor itself.
///
/// Register it with [`crate::RuntimeBuilder::register_typed`]; reach it with
/// [`RuntimeHandle::actor_ref`].
///
/// `handle` is an `async fn` in the trait (no `#[async_trait]` attribute): implement it
/// with a plain `async fn`. Its future must be `Send`, since a turn may run on any worker
/// thread; a future that holds something not `Send` (an `Rc`, a `std::sync::MutexGuard`)
/// across an `.await` is refused at compile time, at the `async fn`.
///
/// ```
/// use serde::{Deserialize, Serialize};
/// use troupe_runtime::{ActorError, Turn, TypedActor};
///
/// #[derive(Default, Serialize, Deserialize)]
/// struct Counter {
///     total: u64,
/// }
///
/// impl TypedActor for Counter {
///     type Message = u64;
///     type Reply = u64;
///
///     async fn handle(&mut self, _turn: &mut Turn, add: u64) -> Result<u64, ActorError> {
///         self.total += add;
///         Ok(self.total)
///     }
/// }
/// ```
///
/// # State versions
///
/// The state is stored as its bincode encoding, which does not describe itself: a type
/// that reads another type's bytes whole, but with another meaning (a `u64` become an
/// `i64`, two fields of one type swapped), would read them silently. So a state type
/// declares its version, [`TypedActor::STATE_VERSION`] (0 unless said), which is stored
/// with the state; when a state stored at another version is loaded,
/// [`TypedActor::migrate`] converts it, and by default refuses it: the activation fails
/// with `ActorFailed` naming the actor, the type and both versions, and the stored
/// bytes stay as they were. Raise `STATE_VERSION` whenever the meaning of the encoding
/// changes, and implement `migrate` for the versions still stored:
///
/// ```
/// use serde::{Deserialize, Serialize};
/// use troupe_runtime::{ActorError, StateVersionError, StoredState, Turn, TypedActor};
///
/// /// Version 0 counted visits in a `u64`; version 1 keeps a signed balance.
/// #[derive(Default, Serialize, Deserialize)]
/// struct Account {
///     balance: i64,
/// }
///
/// impl TypedActor for Account {
///     type Message = i64;
///     type Reply = i64;
///     const STATE_VERSION: u32 = 1;
///
///     fn migrate(stored: StoredState<'_>) -> Result<Self, StateVersionError> {
///         match stored.version() {
///             0 => {
///                 let visits: u64 = stored.decode()?;
///                 let balance = i64::try_from(visits).map_err(|_| stored.fail("too many visits"))?;
///                 Ok(Account { balance })
///             }
///             _ => Err(stored.refuse()),
///         }
///     }
///
///     async fn handle(&mut self, _turn: &mut Turn, add: i64) -> Result<i64, ActorError> {
///         self.balance += add;
///         Ok(self.balance)
///     }
/// }
/// ```
///
/// A state at version 0 is stored as its bare encoding, as every state was before
/// versions existed: such a state loads as version 0. A state at a later version is
/// stored after a 12-byte tag ([`STATE_VERSION_TAG_BYTES`]: 8 fixed bytes, then the
/// version). A migrated state is committed, at its new version, after the first turn
/// that succeeds (its encoding differs from the stored one). Within the version, a
/// change that decoding notices (bytes that end too soon, or are left over once the
/// type is read, or values the type refuses) also fails the activation and leaves the
/// bytes as they were; one that it does not notice is what the version is for.
///
/// # Activation hooks, and fields that are not state
///
/// [`TypedActor::on_activate`] runs once per activation, after the state is loaded and
/// before the first message; [`TypedActor::on_deactivate`] once before the activation
/// ends, on the state of its last committed turn, and its changes are committed after
/// it. Fields that are not state (a connection, a cache) are `#[serde(skip)]`: they are
/// built with `Default`, and a turn that fails (an error, its deadline passed, its
/// commit refused) rolls the actor back by decoding the last committed state again, so
/// **every `#[serde(skip)]` field is reset to its default at every rollback**, not only
/// at activation. `on_activate` does not run again after a rollback: something it put
/// in a skipped field is gone after the first failed turn. Build such a field lazily
/// (an `Option` filled by the turn that first needs it), not in `on_activate` alone.
///
/// (Before issue 11 it was an `#[async_trait]` trait; awaiting the handler inline now
/// saves a heap allocation per message.)
pub trait TypedActor: Serialize + DeserializeOwned + Default + Send + 'static {
    /// What it accepts. `Serialize + DeserializeOwned` so it can also arrive as bytes
    /// (from another node, or through the untyped API).
    type Message: Serialize + DeserializeOwned + Send + 'static;
    /// What it answers.
    type Reply: Serialize + DeserializeOwned + Send + 'static;

    /// Bytes of a turn's future (its `handle` future) that an activation keeps
    /// allocated from one turn to the next: as [`Actor::TURN_FUTURE_KEPT_BYTES_MAX`],
    /// whose default ([`crate::HANDLER_SLOT_KEPT_BYTES_MAX`], 1,024 B) it shares. An
    /// actor whose `handle` holds more across an `.await` may raise it, so that each
    /// message costs no `malloc` and `free` of its future.
    const TURN_FUTURE_KEPT_BYTES_MAX: usize = crate::HANDLER_SLOT_KEPT_BYTES_MAX;

    /// The version of the state's encoding, stored with the state (see "State
    /// versions" above). Raise it when the meaning of the encoding changes; a state
    /// stored at another version goes through [`TypedActor::migrate`]. Default 0: a
    /// state stored before versions existed is version 0.
    const STATE_VERSION: u32 = 0;

    /// Converts a state stored at another version than [`TypedActor::STATE_VERSION`]
    /// (older, or newer: a build rolled back). Called when the actor is activated, and
    /// again when it is rebuilt after a failed turn, until a turn commits the converted
    /// state. [`StoredState::decode`] reads the stored encoding as the type that wrote
    /// it.
    ///
    /// # Errors
    /// [`StateVersionError`]: the activation fails with it, naming the actor, and the
    /// stored bytes are left as they are. The default refuses every other version
    /// ([`StoredState::refuse`]).
    fn migrate(stored: StoredState<'_>) -> Result<Self, StateVersionError> {
        Err(stored.refuse())
    }

    /// Runs once per activation, after the state is loaded and before the first
    /// message (not after a rollback). The default does nothing. Write it as `async fn
    /// on_activate(&mut self, id: &ActorId) -> Result<(), ActorError>`.
    ///
    /// # Errors
    /// An error ends the activation; every queued request fails with it.
    fn on_activate(&mut self, _id: &ActorId) -> impl Future<Output = Result<(), ActorError>> + Send {
        async { Ok(()) }
    }

    /// Runs once before the activation ends (idle, or the runtime shutting down), on
    /// the state of its last committed turn; what it changes in the state is committed
    /// after it. The default does nothing. Not run when the activation crashes or is
    /// aborted.
    ///
    /// # Errors
    /// An error is logged, and nothing it changed is committed: the last turn's state
    /// stays committed.
    fn on_deactivate(&mut self, _id: &ActorId) -> impl Future<Output = Result<(), ActorError>> + Send {
        async { Ok(()) }
    }

    /// Handles one message. After it returns `Ok`, the actor's new state is committed
    /// (if it changed) before the reply is sent. Write it as `async fn handle(&mut self,
    /// turn: &mut Turn, message: Self::Message) -> Result<Self::Reply, ActorError>`.
    ///
    /// # Errors
    /// [`ActorError`]; the turn is rolled back to the last committed state.
    fn handle(
        &mut self,
        turn: &mut Turn,
        message: Self::Message,
    ) -> impl Future<Output = Result<Self::Reply, ActorError>> + Send;
}

/// Runs a [`TypedActor`] as an [`Actor`]. Its handler's futures run in the
/// activation's [`TurnSlot`] (one block per activation, not one box per message).
struct TypedAdapter<A> {
    actor: A,
}

impl<A> TypedAdapter<A> {
    fn new(actor: A) -> Self {
        Self { actor }
    }
}

/// Decodes a `T` from bincode bytes (the encoding [`encode`] gives: fixed-size integers,
/// little-endian), strictly: bytes left over after the `T` are an error, not ignored as
/// `bincode::deserialize` ignores them. bincode is not self-describing, so a state
/// stored by another version of its type decodes as whatever the new type reads in its
/// bytes; reading all of them, and no more, is the one check it allows. Without it a
/// state type that lost a `String` field before a number read the string's length as
/// the number and committed that over the stored bytes
/// (`a_state_stored_by_another_version_is_refused_and_left_untouched`).
fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, bincode::Error> {
    use bincode::Options;
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .reject_trailing_bytes()
        .deserialize(bytes)
}

fn encode<T: Serialize>(value: &T, what: &str) -> Result<Bytes, ActorError> {
    bincode::serialize(value)
        .map(Bytes::from)
        .map_err(|error| ActorError::failed(format!("cannot encode the {what}: {error}")))
}

/// Bytes of the tag stored before a state whose [`TypedActor::STATE_VERSION`] is not 0:
/// [`STATE_VERSION_TAG_MAGIC`], then the version as a little-endian `u32`. A state at
/// version 0 has no tag (it is stored as every state was before versions existed).
pub const STATE_VERSION_TAG_BYTES: usize = STATE_VERSION_TAG_MAGIC.len() + 4;

/// The first 8 bytes of a version tag. Chosen so that no common first field of a
/// version-0 state begins with them: read as a length (of a `String`, a `Vec`) it is
/// above 2^63, as an enum's variant index above 4 billion, as an `Option` or a `bool`
/// an invalid tag byte, as an `f64` a NaN. A version-0 state whose encoding does begin
/// with them and a non-zero `u32` (a `u64` first field of exactly
/// 0xFFF7_5653_5052_54C7, say) is read as tagged, and refused by the default
/// [`TypedActor::migrate`]: refused, never misread or overwritten.
const STATE_VERSION_TAG_MAGIC: [u8; 8] = [0xC7, b'T', b'R', b'P', b'S', b'V', 0xF7, 0xFF];

/// The tag of a state at `version` (meaningful for a version other than 0).
const fn state_version_tag(version: u32) -> [u8; STATE_VERSION_TAG_BYTES] {
    let mut tag = [0; STATE_VERSION_TAG_BYTES];
    let mut at = 0;
    while at < STATE_VERSION_TAG_MAGIC.len() {
        tag[at] = STATE_VERSION_TAG_MAGIC[at];
        at += 1;
    }
    let version = version.to_le_bytes();
    while at < STATE_VERSION_TAG_BYTES {
        tag[at] = version[at - STATE_VERSION_TAG_MAGIC.len()];
        at += 1;
    }
    tag
}

/// The version a stored state was written at, and its encoding: the tagged version and
/// what follows the tag, or version 0 and the bytes whole for an untagged state (the
/// format before versions; a tag of version 0 is never written, so it is not one).
fn stored_version(bytes: &[u8]) -> (u32, &[u8]) {
    if let Some(rest) = bytes.strip_prefix(&STATE_VERSION_TAG_MAGIC) {
        if let Some((version, encoding)) = rest.split_first_chunk::<4>() {
            let version = u32::from_le_bytes(*version);
            if version != 0 {
                return (version, encoding);
            }
        }
    }
    (0, bytes)
}

/// The state as stored for `A`: its bincode encoding, after `A`'s version tag if
/// `A::STATE_VERSION` is not 0.
fn encode_state<A: TypedActor>(actor: &A) -> Result<Bytes, ActorError> {
    if A::STATE_VERSION == 0 {
        return encode(actor, "state");
    }
    let failed = |error: bincode::Error| ActorError::failed(format!("cannot encode the state: {error}"));
    let size = usize::try_from(bincode::serialized_size(actor).map_err(failed)?).unwrap_or(usize::MAX);
    let mut bytes = Vec::with_capacity(STATE_VERSION_TAG_BYTES.saturating_add(size));
    bytes.extend_from_slice(&state_version_tag(A::STATE_VERSION));
    bincode::serialize_into(&mut bytes, actor).map_err(failed)?;
    Ok(Bytes::from(bytes))
}

/// A state stored at another version than the actor's [`TypedActor::STATE_VERSION`], as
/// [`TypedActor::migrate`] gets it.
#[derive(Debug, Clone, Copy)]
pub struct StoredState<'a> {
    id: &'a ActorId,
    state: &'static str,
    version: u32,
    expected: u32,
    encoding: &'a [u8],
}

impl<'a> StoredState<'a> {
    /// The state of `id` stored at `version` as `encoding` (without a tag), as the
    /// runtime hands it to `A`'s [`TypedActor::migrate`]: to test a migration without a
    /// runtime and a store (`A::migrate(StoredState::of::<A>(&id, 1, &old_bytes))`).
    pub fn of<A: TypedActor>(id: &'a ActorId, version: u32, encoding: &'a [u8]) -> Self {
        Self {
            id,
            state: std::any::type_name::<A>(),
            version,
            expected: A::STATE_VERSION,
            encoding,
        }
    }

    /// The actor whose state it is.
    pub fn id(&self) -> &'a ActorId {
        self.id
    }

    /// The version it was stored at (0 for a state stored without a version).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Its encoding (after the version tag, if it has one): the bincode encoding of the
    /// type that stored it.
    pub fn bytes(&self) -> &'a [u8] {
        self.encoding
    }

    /// Its encoding read as a `T` (the type that stored it, typically), strictly: bytes
    /// left over after the `T` are an error too.
    ///
    /// # Errors
    /// [`StateVersionError::Unconvertible`] saying why it is not a `T`.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, StateVersionError> {
        decode(self.encoding).map_err(|error| {
            self.fail(format!(
                "it is not a bincode-encoded {}: {error}",
                std::any::type_name::<T>()
            ))
        })
    }

    /// The refusal of a version `migrate` does not convert: what the default
    /// [`TypedActor::migrate`] returns.
    pub fn refuse(&self) -> StateVersionError {
        StateVersionError::NotMigrated {
            actor: self.id.clone(),
            state: self.state,
            stored: self.version,
            expected: self.expected,
        }
    }

    /// The failure of a conversion, with `reason`.
    pub fn fail(&self, reason: impl Into<String>) -> StateVersionError {
        StateVersionError::Unconvertible {
            actor: self.id.clone(),
            state: self.state,
            stored: self.version,
            expected: self.expected,
            reason: reason.into(),
        }
    }
}

/// Why a typed actor's state stored at another version could not be loaded
/// ([`TypedActor::migrate`]). The activation fails with it (`ActorFailed`, its text the
/// cause) and the stored bytes are left as they are.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateVersionError {
    /// The actor's type has no conversion from the stored version.
    #[error(
        "the saved state of {actor} is version {stored} of {state}, which is now version {expected} and does not migrate version {stored}; it is left as stored, and {actor} cannot be activated until it is converted: implement TypedActor::migrate for version {stored} in {state}, or deploy the build of {state} that stored it, or delete the state to start {actor} anew"
    )]
    NotMigrated {
        /// The actor.
        actor: ActorId,
        /// The state type (its Rust name).
        state: &'static str,
        /// The version it was stored at.
        stored: u32,
        /// The type's version, [`TypedActor::STATE_VERSION`].
        expected: u32,
    },
    /// The conversion failed.
    #[error(
        "the saved state of {actor}, version {stored} of {state}, cannot be converted to version {expected}: {reason}; it is left as stored, and {actor} cannot be activated until {state}'s migrate converts it (or the state is deleted, to start {actor} anew)"
    )]
    Unconvertible {
        /// The actor.
        actor: ActorId,
        /// The state type (its Rust name).
        state: &'static str,
        /// The version it was stored at.
        stored: u32,
        /// The type's version, [`TypedActor::STATE_VERSION`].
        expected: u32,
        /// Why.
        reason: String,
    },
}

impl<A: TypedActor> Actor for TypedAdapter<A> {
    const TURN_FUTURE_KEPT_BYTES_MAX: usize = A::TURN_FUTURE_KEPT_BYTES_MAX;

    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let message: A::Message = decode(&payload).map_err(|error| {
            ActorError::rejected(format!(
                "the message is not a bincode-encoded {}: {error}",
                std::any::type_name::<A::Message>()
            ))
        })?;
        let reply = self.actor.handle(turn, message).await?;
        encode(&reply, "reply")
    }

    async fn handle_value(&mut self, turn: &mut Turn, message: AnyValue) -> Result<AnyValue, ActorError> {
        // Not the runtime's path (it calls `handle_value_turn` with the activation's
        // slot): a slot for this turn only.
        let mut slot = TurnSlot(HandlerSlot::new());
        self.handle_value_turn(&mut slot, turn, message).await
    }

    /// The handler's future runs in the activation's slot: after the activation's first
    /// message, a message costs no allocation for it.
    fn handle_value_turn<'a>(
        &'a mut self,
        slot: &'a mut TurnSlot,
        turn: &'a mut Turn,
        message: AnyValue,
    ) -> ValueTurn<'a> {
        // An `ask`'s message comes as itself, a `tell`'s wrapped in `Told`, whose reply
        // nobody reads: it gets the zero-sized `Unread`.
        let (message, told) = match message.downcast::<A::Message>() {
            Ok(message) => (message, false),
            Err(other) => match other.downcast::<Told<A::Message>>() {
                Ok(told) => (told.0, true),
                Err(_) => {
                    return ValueTurn::ready(Err(ActorError::rejected(format!(
                        "the message is not a {}",
                        std::any::type_name::<A::Message>()
                    ))))
                }
            },
        };
        let actor = &mut self.actor;
        ValueTurn::in_slot(slot.0.place_with(A::TURN_FUTURE_KEPT_BYTES_MAX, move || async move {
            let reply = actor.handle(turn, message).await?;
            Ok(if told {
                AnyValue::new(Unread)
            } else {
                AnyValue::new(reply)
            })
        }))
    }

    fn on_activate(&mut self, id: &ActorId) -> impl Future<Output = Result<(), ActorError>> + Send {
        self.actor.on_activate(id)
    }

    fn on_deactivate(&mut self, id: &ActorId) -> impl Future<Output = Result<(), ActorError>> + Send {
        self.actor.on_deactivate(id)
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        encode_state(&self.actor).map(Some)
    }

    /// Encodes the state into a writer that compares it with the committed encoding as
    /// it goes and stops at the first difference: an unchanged state (most turns of most
    /// actors) is neither allocated nor copied; a changed one is then encoded anew. (A
    /// versioned state compares its tag first: a committed state of another version, one
    /// just migrated, is a change.)
    fn state_change(&self, committed: Option<&Bytes>) -> Result<StateChange, ActorError> {
        if let Some(committed) = committed {
            let encoding = if A::STATE_VERSION == 0 {
                Some(committed.as_ref())
            } else {
                committed.strip_prefix(&state_version_tag(A::STATE_VERSION))
            };
            if let Some(encoding) = encoding {
                let mut same = SameAs { rest: encoding };
                if bincode::serialize_into(&mut same, &self.actor).is_ok() && same.rest.is_empty() {
                    return Ok(StateChange::Unchanged);
                }
            }
        }
        self.snapshot().map(|state| StateChange::between(committed, state))
    }
}

/// A writer that accepts only the bytes of `rest`, in order: bincode's encoding of a
/// state written into it succeeds, with nothing left, exactly when the encoding equals
/// the committed one. It fails at the first byte that differs, which ends the encoding.
struct SameAs<'a> {
    rest: &'a [u8],
}

impl std::io::Write for SameAs<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if bytes.is_empty() {
            // (No `memcmp` of nothing: see `same_bytes` in state_store.rs.)
            return Ok(0);
        }
        match self.rest.strip_prefix(bytes) {
            Some(rest) => {
                self.rest = rest;
                Ok(bytes.len())
            }
            None => Err(std::io::ErrorKind::InvalidData.into()),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A `tell`'s message: the adapter handles it as the message itself and does not box the
/// reply, which nobody reads (the envelope's reply goes to `ReplyTo::Nobody`).
struct Told<M>(M);

/// The reply value of a `tell`: zero-sized, so boxing it allocates nothing.
struct Unread;

/// A reference a turn could not make ([`Turn::actor_ref`]: the kind is not registered,
/// or not for that type): the turn fails, [`ActorError::Failed`] with the reason, so a
/// handler can use `?` on it.
impl From<ActorRefError> for ActorError {
    fn from(error: ActorRefError) -> Self {
        Self::failed(error.to_string())
    }
}

/// Builds the [`Actor`] for a typed kind: from `Default`, or from its saved encoding.
pub(crate) fn typed_factory<A: TypedActor>(
) -> impl Fn(&ActorId, Option<Bytes>) -> Result<ActorBox, ActorError> + Send + Sync + 'static {
    |id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
        let state = std::any::type_name::<A>();
        let actor = match saved {
            None => A::default(),
            Some(bytes) => match stored_version(&bytes) {
                (version, encoding) if version == A::STATE_VERSION => decode(encoding).map_err(|error| {
                    ActorError::failed(format!(
                        "the saved state of {id} is not a bincode-encoded {state} (version {version}: {error}); \
                         it is left as stored, and {id} cannot be activated until {state} reads it: if the type \
                         changed since the state was saved, raise its TypedActor::STATE_VERSION and implement \
                         TypedActor::migrate from version {version}, or delete the state to start {id} anew"
                    ))
                })?,
                (version, encoding) => A::migrate(StoredState::of::<A>(id, version, encoding))
                    .map_err(|error| ActorError::failed(error.to_string()))?,
            },
        };
        Ok(ActorBox::new(TypedAdapter::new(actor)))
    }
}

/// The type a typed kind was registered with, to check [`ActorRef`]s against.
pub(crate) fn type_of<A: TypedActor>() -> (TypeId, &'static str) {
    (TypeId::of::<A>(), std::any::type_name::<A>())
}

/// Why [`RuntimeHandle::actor_ref`] refused to make a reference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActorRefError {
    /// No kind of that name is registered.
    #[error("no actor kind `{kind}` is registered")]
    UnknownKind {
        /// The kind asked for.
        kind: String,
    },
    /// The kind is registered, but not as a typed actor of the requested type.
    #[error("actor kind `{kind}` is registered as {registered}, not as the typed actor {requested}")]
    WrongType {
        /// The kind asked for.
        kind: String,
        /// What it was registered as (`untyped` for an [`Actor`] factory).
        registered: &'static str,
        /// The type asked for.
        requested: &'static str,
    },
}

/// A typed reference to one actor: `ask` and `tell` with its own message and reply
/// types, passed as values in this process. Cheap to clone.
pub struct ActorRef<A> {
    id: ActorId,
    handle: RuntimeHandle,
    /// The route to the actor's current activation, once this ref has reached it: later
    /// messages skip the route map's lock and hash. It holds no sender, so it never
    /// keeps a mailbox open; a closed one sends the ref back to the map and the
    /// dispatcher (see "The caller's fast path" in docs/architecture.md).
    cache: RouteCache,
    _actor: PhantomData<fn() -> A>,
}

impl<A> Clone for ActorRef<A> {
    /// A clone starts with an empty cache of its own.
    fn clone(&self) -> Self {
        Self {
            id: self.id.clone(),
            handle: self.handle.clone(),
            cache: RouteCache::default(),
            _actor: PhantomData,
        }
    }
}

impl<A> fmt::Debug for ActorRef<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ActorRef")
            .field("id", &self.id)
            .field("type", &std::any::type_name::<A>())
            .finish()
    }
}

impl<A: TypedActor> ActorRef<A> {
    /// The actor it refers to.
    pub fn id(&self) -> &ActorId {
        &self.id
    }

    /// Sends `message` and waits for the reply at most `timeout` (capped at
    /// [`INVOKE_TIMEOUT_MS_MAX`]). Activates the actor if it is inactive.
    ///
    /// # Errors
    /// As [`RuntimeHandle::invoke`]. From inside a turn it is refused
    /// (`Refused(RootInvokeInsideTurn)`): calls from a turn go through its
    /// [`crate::Caller`], which records who waits for whom ([`ActorRef::ask_from`]).
    ///
    /// # Cancel safety
    /// As [`RuntimeHandle::invoke`].
    pub async fn ask(&self, message: A::Message, timeout: Duration) -> Result<A::Reply, InvokeError> {
        if IN_TURN.get() {
            return Err(CallRefused::RootInvokeInsideTurn.into());
        }
        let shared = &self.handle.shared;
        let now = shared.clock.now();
        let deadline = Deadline::after(now, timeout.min(Duration::from_millis(INVOKE_TIMEOUT_MS_MAX)));
        let reply = self
            .handle
            .start_call(
                now,
                &self.id,
                Payload::Value(AnyValue::new(message)),
                EnvelopeContext::Root(deadline),
                None,
                Some(&self.cache),
            )?
            .await?;
        match reply {
            Payload::Value(value) => value.downcast::<A::Reply>().map_err(|_| InvokeError::ActorFailed {
                target: self.id.clone(),
                cause: format!(
                    "the actor replied with something other than a {}",
                    std::any::type_name::<A::Reply>()
                ),
            }),
            Payload::Bytes(_) | Payload::Keyed(_) => Err(InvokeError::ActorFailed {
                target: self.id.clone(),
                cause: "the actor replied with bytes to a message sent as a value".to_string(),
            }),
        }
    }

    /// As [`ActorRef::ask`], for one attempt of the logical request `key` names (see
    /// [`RuntimeHandle::invoke_keyed`]): a message whose key already has a committed
    /// reply gets that reply, and the actor's handler does not run again.
    ///
    /// The message and the reply travel as bincode bytes (the reply has to be stored),
    /// not as values: a keyed ask costs their encoding and decoding on top of the store
    /// commit of its record, where a plain `ask` costs neither. Being bytes, it is
    /// routed as [`RuntimeHandle::invoke_routed_keyed`] routes: with a
    /// [`crate::RootCallRouter`] installed (a cluster node) it runs keyed on the node
    /// that owns the actor, where a plain `ask` runs on this runtime.
    ///
    /// # Errors
    /// As [`RuntimeHandle::invoke_keyed`]; `ActorFailed` if the message cannot be
    /// encoded or the reply (the stored one too) decoded.
    ///
    /// # Cancel safety
    /// As [`RuntimeHandle::invoke`].
    pub async fn ask_keyed(
        &self,
        key: &IdempotencyKey,
        message: A::Message,
        timeout: Duration,
    ) -> Result<A::Reply, InvokeError> {
        let payload = self.encode_message(&message)?;
        let deadline = self.handle.deadline_in(timeout);
        let reply = self
            .handle
            .invoke_routed_keyed(&self.id, key, payload, deadline)
            .await?;
        self.decode_reply(&reply)
    }

    /// As [`ActorRef::tell`], for one delivery of the message `key` names (see
    /// [`RuntimeHandle::tell_keyed`]): once a delivery's turn has committed, later ones
    /// do not run the handler. The message travels as bincode bytes, as for
    /// [`ActorRef::ask_keyed`].
    ///
    /// # Errors
    /// As [`RuntimeHandle::tell`]; `ActorFailed` (nothing sent) if the message cannot be
    /// encoded.
    pub async fn tell_keyed(
        &self,
        key: &IdempotencyKey,
        message: A::Message,
        timeout: Duration,
    ) -> Result<(), InvokeError> {
        let payload = self.encode_message(&message)?;
        let deadline = self.handle.deadline_in(timeout);
        self.handle.tell_keyed(&self.id, key, payload, deadline).await
    }

    /// Sends `message` without waiting for a reply (fire-and-forget); returns once it is
    /// accepted (see [`RuntimeHandle::tell`]). Its turn must finish within `timeout`.
    ///
    /// # Errors
    /// As [`RuntimeHandle::tell`].
    pub async fn tell(&self, message: A::Message, timeout: Duration) -> Result<(), InvokeError> {
        if IN_TURN.get() {
            return Err(CallRefused::RootInvokeInsideTurn.into());
        }
        let now = self.handle.shared.clock.now();
        let deadline = Deadline::after(now, timeout.min(Duration::from_millis(INVOKE_TIMEOUT_MS_MAX)));
        match self.hand_over(Some(now), message, deadline)? {
            Handed::Accepted => Ok(()),
            // The dispatcher answers at once; it is gone only when the runtime has stopped.
            Handed::ToDispatcher(accepted) => accepted.await.unwrap_or(Err(InvokeError::Shutdown)),
        }
    }

    /// As [`ActorRef::tell`], under a `deadline` the caller has already computed (with
    /// [`ActorRef::deadline_in`] or [`RuntimeHandle::deadline_in`]), so that a batch of
    /// messages, or one event told to many actors, shares one clock reading instead of
    /// one per message.
    ///
    /// What differs from `tell`, because the clock is not read here:
    /// - a `deadline` that has already passed is accepted when the actor is active (the
    ///   message goes straight into its mailbox): the actor drops it unrun when it
    ///   dequeues it, as one that expires while queued (the runtime's `expired_dropped`
    ///   counter counts it). When the actor is not active, the dispatcher reads the
    ///   clock and refuses it with `Timeout`, as `tell` does;
    /// - a `deadline` further than [`INVOKE_TIMEOUT_MS_MAX`] away is cut to that much
    ///   from the moment the actor dequeues the message.
    ///
    /// # Errors
    /// As [`RuntimeHandle::tell`] (`Timeout` only as said above).
    pub async fn tell_by(&self, message: A::Message, deadline: Deadline) -> Result<(), InvokeError> {
        if IN_TURN.get() {
            return Err(CallRefused::RootInvokeInsideTurn.into());
        }
        match self.hand_over(None, message, deadline)? {
            Handed::Accepted => Ok(()),
            Handed::ToDispatcher(accepted) => accepted.await.unwrap_or(Err(InvokeError::Shutdown)),
        }
    }

    /// Asks from inside a turn, as a call of that turn: `caller` is the turn's
    /// ([`Turn::caller`], or a clone of it in a task the turn spawned). The call is
    /// [`Caller::call`]'s: the target runs at depth + 1 with the caller in its chain, a
    /// target already in the chain is refused at once with the chain in the error, and
    /// the call waits at most `timeout`, clipped to the caller's own deadline. The wait
    /// is recorded in the wait-for graph, and the call is cancelled if the turn ends
    /// first. (`ActorRef::ask` from a turn is refused: it would skip all of this.)
    ///
    /// Within one process the message and the reply pass as values. On a runtime that
    /// routes its turns' calls (a cluster node, [`Caller::routes_calls`]) they travel as
    /// bincode bytes through the router, to wherever the actor lives.
    ///
    /// # Errors
    /// As [`Caller::call`]; `ActorFailed` if, on a routing runtime, the message cannot be
    /// encoded (nothing sent) or the reply cannot be decoded.
    ///
    /// # Cancel safety
    /// As [`Caller::invoke`]: dropping the future abandons the call.
    pub async fn ask_from(
        &self,
        caller: &Caller,
        message: A::Message,
        timeout: Duration,
    ) -> Result<A::Reply, InvokeError> {
        if caller.routes_calls() {
            let payload = self.encode_message(&message)?;
            let reply = caller.call(&self.id, payload, timeout).await?;
            return self.decode_reply(&reply);
        }
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX).max(1);
        let admitted = caller.admit(&self.id, true, Some(timeout_ms))?;
        let reply = caller.invoke_value(admitted, AnyValue::new(message)).await?;
        reply.downcast::<A::Reply>().map_err(|_| {
            self.failed(format!(
                "the actor replied with something other than a {}",
                std::any::type_name::<A::Reply>()
            ))
        })
    }

    /// Tells from inside a turn, as [`Caller::tell`] does: the target runs the message at
    /// depth + 1 with the caller in its chain, under a deadline `timeout` from now
    /// clipped to the caller's (a message to the caller itself runs after its turn, at
    /// its depth, unclipped). Returns once the message is accepted.
    ///
    /// Within one process the message passes as a value ([`Caller::tell_value`]); on a
    /// runtime that routes its turns' calls it travels as bincode bytes through the
    /// router, as for [`ActorRef::ask_from`].
    ///
    /// # Errors
    /// As [`Caller::tell`]; `ActorFailed` (nothing sent) if, on a routing runtime, the
    /// message cannot be encoded.
    pub async fn tell_from(&self, caller: &Caller, message: A::Message, timeout: Duration) -> Result<(), InvokeError> {
        if caller.routes_calls() && caller.id() != &self.id {
            let payload = self.encode_message(&message)?;
            return caller.tell(&self.id, payload, timeout).await;
        }
        caller.tell_value(&self.id, AnyValue::new(Told(message)), timeout).await
    }

    /// As [`ActorRef::ask_from`], for one attempt of the logical request `key` names
    /// ([`Caller::call_keyed`]): if a turn of the actor under this key has committed, its
    /// recorded reply comes back and the handler does not run again. So a turn that is
    /// run again (it failed after the call, or its own caller retried it) and asks again
    /// under the same key applies the effect once: derive the key from what names the
    /// work, not from anything that changes between attempts. The message and the reply
    /// travel as bincode bytes (the reply is stored with the actor's commit), in process
    /// too; through a router on a cluster node.
    ///
    /// # Errors
    /// As [`Caller::call_keyed`]; `ActorFailed` if the message cannot be encoded
    /// (nothing sent) or the reply, the recorded one too, cannot be decoded.
    pub async fn ask_keyed_from(
        &self,
        caller: &Caller,
        key: &IdempotencyKey,
        message: A::Message,
        timeout: Duration,
    ) -> Result<A::Reply, InvokeError> {
        let payload = self.encode_message(&message)?;
        let reply = caller.call_keyed(&self.id, key, payload, timeout).await?;
        self.decode_reply(&reply)
    }

    /// As [`ActorRef::tell_from`], for one delivery of the message `key` names
    /// ([`Caller::tell_keyed`]): once a delivery's turn has committed, later ones do not
    /// run the handler, so a turn run again that tells again under the same key lands
    /// the message once. The message travels as bincode bytes.
    ///
    /// # Errors
    /// As [`Caller::tell_keyed`]; `ActorFailed` (nothing sent) if the message cannot be
    /// encoded.
    pub async fn tell_keyed_from(
        &self,
        caller: &Caller,
        key: &IdempotencyKey,
        message: A::Message,
        timeout: Duration,
    ) -> Result<(), InvokeError> {
        let payload = self.encode_message(&message)?;
        caller.tell_keyed(&self.id, key, payload, timeout).await
    }

    /// The message as bincode bytes, or `ActorFailed` for this actor (nothing sent).
    fn encode_message(&self, message: &A::Message) -> Result<Bytes, InvokeError> {
        encode(message, "message").map_err(|error| self.failed(error.to_string()))
    }

    /// A reply that came as bincode bytes, decoded; `ActorFailed` for this actor if it
    /// is not an `A::Reply`.
    fn decode_reply(&self, reply: &[u8]) -> Result<A::Reply, InvokeError> {
        decode(reply).map_err(|error| {
            self.failed(format!(
                "the reply is not a bincode-encoded {}: {error}",
                std::any::type_name::<A::Reply>()
            ))
        })
    }

    /// `ActorFailed` for this actor with `cause`.
    fn failed(&self, cause: String) -> InvokeError {
        InvokeError::ActorFailed {
            target: self.id.clone(),
            cause,
        }
    }

    /// The deadline `timeout` from now, capped at [`INVOKE_TIMEOUT_MS_MAX`] (for
    /// [`ActorRef::tell_by`]).
    pub fn deadline_in(&self, timeout: Duration) -> Deadline {
        self.handle.deadline_in(timeout)
    }

    /// A told message into the actor's open mailbox (accepted), or to the dispatcher
    /// (whose acceptance the caller awaits). Plain, not `async`: one future state less.
    /// Always inlined: `tell` is the hot path, and a call here cost it about 30
    /// instructions a message (`scripts/instr-count tell`).
    #[inline(always)]
    fn hand_over(&self, now: Option<Deadline>, message: A::Message, deadline: Deadline) -> Result<Handed, InvokeError> {
        self.handle.start_tell(
            now,
            &self.id,
            Payload::Value(AnyValue::new(Told(message))),
            EnvelopeContext::Root(deadline),
            Some(&self.cache),
        )
    }
}

impl RuntimeHandle {
    /// A typed reference to the actor `key` of `kind`, registered with
    /// [`crate::RuntimeBuilder::register_typed`] for `A`.
    ///
    /// # Errors
    /// [`ActorRefError`] if `kind` is not registered, or not for `A`.
    pub fn actor_ref<A: TypedActor>(&self, id: ActorId) -> Result<ActorRef<A>, ActorRefError> {
        let kind: &ActorKind = id.kind();
        let Some(entry) = self.shared.kinds.get(kind) else {
            return Err(ActorRefError::UnknownKind { kind: kind.to_string() });
        };
        let (wanted, requested) = type_of::<A>();
        match entry.typed {
            Some((registered, _)) if registered == wanted => Ok(ActorRef {
                id,
                handle: self.clone(),
                cache: RouteCache::default(),
                _actor: PhantomData,
            }),
            other => Err(ActorRefError::WrongType {
                kind: kind.to_string(),
                registered: other.map_or("untyped", |(_, name)| name),
                requested,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Goal: a typed actor's adapter adds nothing to the actor it runs (its turns run in
    /// the activation's slot, which the `ActorBox` holds: one per activation, not two).
    #[test]
    fn a_typed_adapter_is_the_size_of_its_actor() {
        assert_eq!(
            std::mem::size_of::<TypedAdapter<Varied>>(),
            std::mem::size_of::<Varied>()
        );
    }

    /// A typed actor whose state has fields of several encodings (fixed-size, length-
    /// prefixed, optional), so that encodings of two states can differ anywhere, in
    /// length or not.
    #[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
    struct Varied {
        count: u64,
        name: String,
        items: Vec<u16>,
        flag: Option<bool>,
    }

    impl TypedActor for Varied {
        type Message = ();
        type Reply = ();

        async fn handle(&mut self, _turn: &mut Turn, (): ()) -> Result<(), ActorError> {
            Ok(())
        }
    }

    fn varied() -> impl Strategy<Value = Varied> {
        (
            0u64..3,
            "[ab]{0,3}",
            proptest::collection::vec(0u16..3, 0..3),
            proptest::option::of(any::<bool>()),
        )
            .prop_map(|(count, name, items, flag)| Varied {
                count,
                name,
                items,
                flag,
            })
    }

    proptest! {
        /// Goal: the typed adapter's state change, which compares the encoding with the
        /// committed one as it writes, is the change the default gives (a snapshot and
        /// `StateChange::between`), for committed encodings that are equal, differ in a
        /// byte, are the state's encoding cut short or with more after it, are foreign
        /// bytes, or are absent.
        #[test]
        fn the_typed_state_change_is_the_snapshots_change(
            state in varied(),
            before in varied(),
            foreign in proptest::collection::vec(any::<u8>(), 0..12),
            cut in any::<prop::sample::Index>(),
            committed_kind in 0..6u8,
        ) {
            let actor = TypedAdapter::new(state.clone());
            let encoded = bincode::serialize(&state).unwrap();
            let committed = match committed_kind {
                0 => None,
                1 => Some(bincode::serialize(&before).unwrap()),
                2 => Some(encoded),
                // The state's encoding cut short, or followed by more bytes.
                3 => Some(encoded[..cut.index(encoded.len())].to_vec()),
                4 => Some([encoded, foreign].concat()),
                _ => Some(foreign),
            }
            .map(Bytes::from);
            let expected = StateChange::between(committed.as_ref(), actor.snapshot().unwrap());
            prop_assert_eq!(actor.state_change(committed.as_ref()).unwrap(), expected);
        }
    }

    /// `Varied` at version 3.
    #[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
    struct Versioned(Varied);

    impl TypedActor for Versioned {
        type Message = ();
        type Reply = ();
        const STATE_VERSION: u32 = 3;

        async fn handle(&mut self, _turn: &mut Turn, (): ()) -> Result<(), ActorError> {
            Ok(())
        }
    }

    proptest! {
        /// Goal: a versioned state's change (its tag compared first, then its encoding as
        /// it is written) is the change its snapshot gives, for committed states of its
        /// own version (equal or not), of other versions (0: untagged), or cut short; and
        /// what it stores reads back as its version and its encoding.
        #[test]
        fn a_versioned_state_change_is_the_snapshots_change(
            state in varied(),
            before in varied(),
            before_version in 0u32..5,
            cut in any::<prop::sample::Index>(),
            same in any::<bool>(),
        ) {
            let actor = TypedAdapter::new(Versioned(state.clone()));
            let snapshot = actor.snapshot().unwrap().unwrap();
            let (version, encoding) = stored_version(&snapshot);
            prop_assert_eq!((version, encoding), (3, &bincode::serialize(&state).unwrap()[..]));
            let mut committed = if before_version == 0 {
                Vec::new()
            } else {
                state_version_tag(before_version).to_vec()
            };
            committed.extend_from_slice(&bincode::serialize(if same { &state } else { &before }).unwrap());
            for committed in [committed.clone(), committed[..cut.index(committed.len())].to_vec()] {
                let committed = Some(Bytes::from(committed));
                let expected = StateChange::between(committed.as_ref(), actor.snapshot().unwrap());
                prop_assert_eq!(actor.state_change(committed.as_ref()).unwrap(), expected);
            }
        }
    }

    /// Goal: an unchanged state is `Unchanged`, and a state one byte longer or shorter
    /// than the committed encoding is not (the prefix case, which a comparison that
    /// stopped early would get wrong).
    #[test]
    fn a_committed_prefix_or_extension_is_a_change() {
        let state = Varied {
            count: 1,
            name: "ab".into(),
            items: vec![2],
            flag: Some(true),
        };
        let actor = TypedAdapter::new(state.clone());
        let encoded = bincode::serialize(&state).unwrap();
        let same = Bytes::from(encoded.clone());
        assert_eq!(actor.state_change(Some(&same)).unwrap(), StateChange::Unchanged);
        let shorter = Bytes::from(encoded[..encoded.len() - 1].to_vec());
        let mut longer_bytes = encoded.clone();
        longer_bytes.push(0);
        let longer = Bytes::from(longer_bytes);
        for committed in [shorter, longer] {
            assert_eq!(
                actor.state_change(Some(&committed)).unwrap(),
                StateChange::Set(same.clone())
            );
        }
        assert_eq!(actor.state_change(None).unwrap(), StateChange::Set(same));
    }
}

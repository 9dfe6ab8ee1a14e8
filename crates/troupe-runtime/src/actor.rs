//! What an actor is: the [`Actor`] trait, its [`ActorFactory`] and [`ActorError`].

use std::any::Any;

use async_trait::async_trait;
use bytes::Bytes;
use troupe_core::{ActorId, InvokeError};

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

/// A virtual actor: state plus a turn handler. One turn runs at a time per actor.
///
/// The runtime builds the actor with its [`ActorFactory`] from the last committed
/// snapshot, runs [`Actor::on_activate`], then one [`Actor::handle`] per message. After a
/// successful turn it takes [`Actor::snapshot`] and commits it with the turn's writes
/// atomically before replying; if the turn fails, times out or the commit fails, the
/// actor is rebuilt from the last committed snapshot, so the in-memory state never
/// runs ahead of the stored one.
#[async_trait]
pub trait Actor: Send + 'static {
    /// Runs once after the state is loaded, before the first turn.
    ///
    /// # Errors
    /// An error ends the activation; every queued request fails with it.
    async fn on_activate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        Ok(())
    }

    /// Handles one request and returns the reply.
    ///
    /// # Errors
    /// [`ActorError`]; the turn's writes and state changes are rolled back.
    ///
    /// # Cancel safety
    /// The future is dropped when the request's deadline passes; the runtime then
    /// rebuilds the actor from its last committed snapshot.
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError>;

    /// Handles one message passed as a value within this process, by a typed
    /// [`crate::ActorRef`]; returns the reply as a value. Typed actors get it from
    /// [`crate::TypedActor`]'s adapter; the default refuses.
    ///
    /// # Errors
    /// As [`Actor::handle`]; the default rejects the message.
    async fn handle_value(
        &mut self,
        _turn: &mut Turn,
        _message: Box<dyn Any + Send>,
    ) -> Result<Box<dyn Any + Send>, ActorError> {
        Err(ActorError::rejected(
            "this actor takes bytes only; register it as a TypedActor to send it values",
        ))
    }

    /// Runs once before the actor is deactivated; its snapshot is committed afterwards.
    ///
    /// # Errors
    /// An error is logged; the state of the last successful turn is already committed.
    async fn on_deactivate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        Ok(())
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

/// Builds actors of one kind from their last committed snapshot.
pub trait ActorFactory: Send + Sync + 'static {
    /// Builds the actor `id` from `saved` (`None` if it never committed a snapshot).
    ///
    /// # Errors
    /// [`ActorError`] if the snapshot cannot be decoded; the activation fails and the
    /// caller sees the error: the actor never starts from a default state by accident.
    fn create(&self, id: &ActorId, saved: Option<Bytes>) -> Result<Box<dyn Actor>, ActorError>;
}

impl<F> ActorFactory for F
where
    F: Fn(&ActorId, Option<Bytes>) -> Result<Box<dyn Actor>, ActorError> + Send + Sync + 'static,
{
    fn create(&self, id: &ActorId, saved: Option<Bytes>) -> Result<Box<dyn Actor>, ActorError> {
        self(id, saved)
    }
}

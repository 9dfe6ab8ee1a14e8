//! Idempotency keys: a request sent again with the key of one that already committed
//! gets that request's reply, and its handler does not run again.
//!
//! A caller that times out does not know whether its request took effect: a turn that
//! had finished and was committing when the caller gave up keeps its commit (see
//! `activation.rs`, "A caller that gives up cancels its callee"). Retrying it plainly can
//! apply the effect twice (TLA+: `CP_gap_commit_window`). A keyed request closes that
//! window:
//!
//! ```text
//! invoke_keyed(target, K, payload) ─► Envelope { Payload::Keyed { K, payload } } ─► mailbox
//!   turn: reply stored under K?  ── yes ─► answer it; the handler does not run, nothing
//!                                           is committed
//!          │ no
//!          ▼
//!   handler(payload) ─► ok ─► buffer: reply under K, K in the next of the
//!                             IDEMPOTENCY_KEYS_KEPT_MAX slots (the key that was there,
//!                             the oldest, is deleted) ─► committed with the turn's own
//!                             writes and state, in the same atomic commit
//!                      error / timeout / abandoned / commit refused ─► nothing stored
//! ```
//!
//! Why the check cannot miss a commit in flight: an actor's turns run one at a time, and
//! the activation awaits each turn's commit before it takes the next message, so a retry
//! queued while the first attempt commits starts only once that commit has landed (or
//! failed). Across activations and processes the check reads the committed store: a new
//! activation claims a fence first, so a commit of an older one either landed before the
//! claim (and is read) or is refused.
//!
//! The records live in the actor's own key-value space under [`IDEMPOTENCY_STORE_PREFIX`],
//! which is reserved for the runtime: `Turn::put` and `Turn::delete` refuse keys that
//! start with it (`StoreError::ReservedKey`); a `scan` with an empty prefix sees them.

use std::fmt;

use bytes::Bytes;

use crate::{Actor, ActorError, Turn};

/// Longest idempotency key, in bytes.
pub const IDEMPOTENCY_KEY_LENGTH_MAX_BYTES: usize = 128;

/// Most idempotency keys an actor keeps (keys): the key committed
/// `IDEMPOTENCY_KEYS_KEPT_MAX` keyed turns ago is forgotten (its record deleted in the
/// same commit that adds the newest), so a retry must come within that many keyed
/// requests to the same actor.
pub const IDEMPOTENCY_KEYS_KEPT_MAX: u64 = 256;

/// The prefix of the store keys the runtime keeps idempotency records under, in each
/// actor's key-value space. Reserved: a turn's `put` or `delete` of a key that starts
/// with it is refused (`StoreError::ReservedKey`).
pub const IDEMPOTENCY_STORE_PREFIX: &str = "\u{0}troupe/idem/";

/// The key of one logical request: every attempt of it (the first and each retry) is sent
/// with the same key, to the same actor.
///
/// 1 to [`IDEMPOTENCY_KEY_LENGTH_MAX_BYTES`] bytes of UTF-8, no control characters.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(Box<str>);

/// Why a string is not an [`IdempotencyKey`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdempotencyKeyError {
    /// The key is empty.
    #[error("an idempotency key must not be empty")]
    Empty,
    /// The key is longer than [`IDEMPOTENCY_KEY_LENGTH_MAX_BYTES`].
    #[error("an idempotency key of {length} bytes is longer than {limit} bytes")]
    TooLong {
        /// The key's length, in bytes.
        length: usize,
        /// [`IDEMPOTENCY_KEY_LENGTH_MAX_BYTES`].
        limit: usize,
    },
    /// The key holds a control character.
    #[error("an idempotency key must not hold control characters (one at byte {at})")]
    ControlCharacter {
        /// Where, in bytes from the start.
        at: usize,
    },
}

impl IdempotencyKey {
    /// Checks `key` and makes it an idempotency key.
    ///
    /// # Errors
    /// [`IdempotencyKeyError`] if it is empty, longer than
    /// [`IDEMPOTENCY_KEY_LENGTH_MAX_BYTES`] or holds a control character.
    pub fn new(key: &str) -> Result<Self, IdempotencyKeyError> {
        if key.is_empty() {
            return Err(IdempotencyKeyError::Empty);
        }
        if key.len() > IDEMPOTENCY_KEY_LENGTH_MAX_BYTES {
            return Err(IdempotencyKeyError::TooLong {
                length: key.len(),
                limit: IDEMPOTENCY_KEY_LENGTH_MAX_BYTES,
            });
        }
        if let Some((at, _)) = key.char_indices().find(|(_, c)| c.is_control()) {
            return Err(IdempotencyKeyError::ControlCharacter { at });
        }
        Ok(Self(key.into()))
    }

    /// The key's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.as_str()).finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for IdempotencyKey {
    type Err = IdempotencyKeyError;

    fn from_str(key: &str) -> Result<Self, Self::Err> {
        Self::new(key)
    }
}

impl TryFrom<&str> for IdempotencyKey {
    type Error = IdempotencyKeyError;

    fn try_from(key: &str) -> Result<Self, Self::Error> {
        Self::new(key)
    }
}

/// A keyed request as its envelope carries it (boxed: the envelope stays as small as
/// for an unkeyed one).
pub(crate) struct KeyedRequest {
    pub(crate) key: IdempotencyKey,
    pub(crate) payload: Bytes,
}

/// The store key of the reply recorded for `key`.
fn reply_key(key: &str) -> String {
    format!("{IDEMPOTENCY_STORE_PREFIX}reply/{key}")
}

/// The store key of the next sequence number (8 bytes, big-endian): how many keys the
/// actor has recorded.
fn next_key() -> String {
    format!("{IDEMPOTENCY_STORE_PREFIX}next")
}

/// The store key of slot `slot` (of [`IDEMPOTENCY_KEYS_KEPT_MAX`]), which holds the key
/// recorded at a sequence number `slot` modulo the maximum: the oldest kept, until the
/// next key recorded replaces it.
fn slot_key(slot: u64) -> String {
    format!("{IDEMPOTENCY_STORE_PREFIX}slot/{slot:05}")
}

/// The turn of a keyed request: the recorded reply if `request`'s key has one, else the
/// handler's, recorded in the turn's writes (committed with the turn, or dropped with it).
pub(crate) async fn keyed_turn<A: Actor>(
    actor: &mut A,
    turn: &mut Turn,
    request: KeyedRequest,
) -> Result<Bytes, ActorError> {
    let KeyedRequest { key, payload } = request;
    if let Some(reply) = turn.get(&reply_key(key.as_str())).await? {
        return Ok(reply);
    }
    let reply = actor.handle(turn, payload).await?;
    record(turn, &key, &reply).await?;
    Ok(reply)
}

/// Buffers the record of `key`'s reply in the turn's writes: the reply, the key in the
/// next slot, the next sequence number, and the deletion of the key the slot held.
async fn record(turn: &mut Turn, key: &IdempotencyKey, reply: &Bytes) -> Result<(), ActorError> {
    let corrupt = |what: &str| ActorError::failed(format!("the idempotency records are corrupt: {what}"));
    let next = match turn.get(&next_key()).await? {
        None => 0,
        Some(bytes) => u64::from_be_bytes(
            bytes[..]
                .try_into()
                .map_err(|_| corrupt("the sequence number is not 8 bytes"))?,
        ),
    };
    let slot = slot_key(next % IDEMPOTENCY_KEYS_KEPT_MAX);
    if let Some(oldest) = turn.get(&slot).await? {
        let oldest = std::str::from_utf8(&oldest).map_err(|_| corrupt("a slot's key is not UTF-8"))?;
        // (The key itself cannot be in its own next slot: it had no reply recorded. The
        // deletion goes first anyway, so that the put below would win.)
        turn.delete_record(reply_key(oldest))?;
    }
    turn.put_record(reply_key(key.as_str()), reply.clone())?;
    turn.put_record(slot, Bytes::copy_from_slice(key.as_str().as_bytes()))?;
    let next = next
        .checked_add(1)
        .ok_or_else(|| corrupt("the sequence number overflowed"))?;
    turn.put_record(next_key(), Bytes::copy_from_slice(&next.to_be_bytes()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked() {
        assert_eq!(IdempotencyKey::new(""), Err(IdempotencyKeyError::Empty));
        let longest = "k".repeat(IDEMPOTENCY_KEY_LENGTH_MAX_BYTES);
        assert_eq!(IdempotencyKey::new(&longest).unwrap().as_str(), longest);
        assert_eq!(
            IdempotencyKey::new(&format!("{longest}k")),
            Err(IdempotencyKeyError::TooLong {
                length: IDEMPOTENCY_KEY_LENGTH_MAX_BYTES + 1,
                limit: IDEMPOTENCY_KEY_LENGTH_MAX_BYTES
            })
        );
        assert_eq!(
            IdempotencyKey::new("a\nb"),
            Err(IdempotencyKeyError::ControlCharacter { at: 1 })
        );
        assert_eq!("order-7/é".parse::<IdempotencyKey>().unwrap().as_str(), "order-7/é");
    }

    /// The longest key's record fits the store's key limit.
    #[test]
    fn the_longest_keys_record_fits_a_store_key() {
        let longest = "k".repeat(IDEMPOTENCY_KEY_LENGTH_MAX_BYTES);
        assert!(crate::check_key(&reply_key(&longest)).is_ok());
        assert!(crate::check_key(&slot_key(IDEMPOTENCY_KEYS_KEPT_MAX - 1)).is_ok());
    }
}

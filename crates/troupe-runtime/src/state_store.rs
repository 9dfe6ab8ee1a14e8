//! Durable actor state: the [`StateStore`] trait that every backend implements.
//!
//! An actor has one state blob and a small key-value space of its own. A turn's writes
//! are buffered by the runtime and handed to [`StateStore::commit`] together with the
//! actor's new state at the end of the turn; a backend applies the whole commit
//! atomically or not at all. A failed load or commit is an error the runtime returns to
//! the caller; it never falls back to a default state.
//!
//! Backends: [`crate::MemoryStore`] (tests and simulation, with fault injection) and
//! [`crate::SqliteStore`] (the embedded durable default, one file). Both pass the
//! conformance suite in `tests/state_store_conformance.rs`.

use std::fmt;

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe_core::ActorId;

/// Longest key in an actor's key-value space, in bytes.
pub const STATE_KEY_LENGTH_MAX: usize = 512;
/// Largest value, or state blob, a store accepts, in bytes.
pub const STATE_VALUE_SIZE_MAX: usize = 16 * 1024 * 1024;
/// Most writes one turn may buffer before committing.
pub const TURN_WRITES_MAX: usize = 4_096;
/// Most entries one [`StateStore::scan`] returns.
pub const STATE_SCAN_LIMIT_MAX: usize = 10_000;

/// What a store could not do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum StoreError {
    /// The backend failed (I/O, lock, database error).
    #[error("{operation} failed: {cause}")]
    Backend {
        /// `"load"`, `"commit"`, `"get"` or `"scan"`.
        operation: &'static str,
        /// The backend's error.
        cause: String,
    },
    /// A fault injected by a test or the simulator.
    #[error("{operation} failed: injected fault")]
    Injected {
        /// The operation that was made to fail.
        operation: &'static str,
    },
    /// A key or value is over its limit; nothing was written.
    #[error("{what} is {size} bytes, more than the limit of {limit}")]
    TooLarge {
        /// `"key"` or `"value"`.
        what: &'static str,
        /// Its size in bytes.
        size: usize,
        /// The limit in bytes.
        limit: usize,
    },
    /// A turn buffered more writes than [`TURN_WRITES_MAX`].
    #[error("a turn buffered {count} writes, more than the limit of {limit}")]
    TooManyWrites {
        /// Writes buffered.
        count: usize,
        /// [`TURN_WRITES_MAX`].
        limit: usize,
    },
}

/// Everything one turn changes, applied atomically.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct TurnCommit {
    /// The actor's new state blob, or `None` to leave it as it is.
    pub state: Option<Bytes>,
    /// Key-value writes in order; `None` deletes the key.
    pub writes: Vec<(String, Option<Bytes>)>,
}

impl TurnCommit {
    /// Whether the commit changes nothing.
    pub fn is_empty(&self) -> bool {
        self.state.is_none() && self.writes.is_empty()
    }

    /// Checks every limit; backends call this before writing anything.
    ///
    /// # Errors
    /// [`StoreError::TooLarge`] or [`StoreError::TooManyWrites`].
    pub fn validate(&self) -> Result<(), StoreError> {
        if self.writes.len() > TURN_WRITES_MAX {
            return Err(StoreError::TooManyWrites {
                count: self.writes.len(),
                limit: TURN_WRITES_MAX,
            });
        }
        if let Some(state) = &self.state {
            check_value(state)?;
        }
        for (key, value) in &self.writes {
            check_key(key)?;
            if let Some(value) = value {
                check_value(value)?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for TurnCommit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TurnCommit")
            .field("state_bytes", &self.state.as_ref().map(Bytes::len))
            .field("writes", &self.writes.len())
            .finish()
    }
}

/// Checks a key against [`STATE_KEY_LENGTH_MAX`].
///
/// # Errors
/// [`StoreError::TooLarge`] if the key is longer than the limit.
pub fn check_key(key: &str) -> Result<(), StoreError> {
    if key.len() > STATE_KEY_LENGTH_MAX {
        return Err(StoreError::TooLarge {
            what: "key",
            size: key.len(),
            limit: STATE_KEY_LENGTH_MAX,
        });
    }
    Ok(())
}

fn check_value(value: &Bytes) -> Result<(), StoreError> {
    if value.len() > STATE_VALUE_SIZE_MAX {
        return Err(StoreError::TooLarge {
            what: "value",
            size: value.len(),
            limit: STATE_VALUE_SIZE_MAX,
        });
    }
    Ok(())
}

/// Where actors keep their state between activations.
///
/// Implementations must be safe to share between actor tasks. Every method may fail;
/// callers surface the error, they never substitute a default.
#[async_trait]
pub trait StateStore: Send + Sync + 'static {
    /// The actor's last committed state blob, or `None` if it never committed one.
    ///
    /// # Errors
    /// [`StoreError`] if the backend fails; the caller must not treat that as `None`.
    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError>;

    /// Applies `commit` atomically: afterwards either all of it is visible or none.
    ///
    /// # Errors
    /// [`StoreError`] if the commit was refused or the backend failed; then nothing of
    /// it is visible.
    async fn commit(&self, actor: &ActorId, commit: TurnCommit) -> Result<(), StoreError>;

    /// One committed value from the actor's key-value space.
    ///
    /// # Errors
    /// [`StoreError`] if the backend fails.
    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError>;

    /// Up to `limit` (at most [`STATE_SCAN_LIMIT_MAX`]) committed entries whose keys start
    /// with `prefix`, in key order, starting after `after` if given.
    ///
    /// # Errors
    /// [`StoreError`] if the backend fails.
    async fn scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError>;
}

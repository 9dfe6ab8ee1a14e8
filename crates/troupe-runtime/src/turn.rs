//! What a turn can do: read its context, call other actors, read and buffer writes.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, CallContext, Deadline, InvokeError};

use crate::state_store::{check_key, STATE_SCAN_LIMIT_MAX, TURN_WRITES_MAX};
use crate::{Caller, Clock, RuntimeHandle, StoreError};

/// The context of one turn of one actor.
///
/// Writes are buffered here and committed atomically with the actor's snapshot when the
/// turn succeeds; if the turn fails or times out they are discarded. Reads see the
/// turn's own buffered writes first.
///
/// Calls to other actors go through the turn's [`Caller`] ([`Turn::caller`],
/// [`Turn::invoke`]): its identity, chain, depth and deadline come from the runtime.
pub struct Turn {
    id: ActorId,
    caller: Caller,
    handle: RuntimeHandle,
    writes: BTreeMap<String, Option<Bytes>>,
}

impl Turn {
    pub(crate) fn new(id: ActorId, caller: Caller, handle: RuntimeHandle) -> Self {
        Self {
            id,
            caller,
            handle,
            writes: BTreeMap::new(),
        }
    }

    pub(crate) fn into_writes(self) -> Vec<(String, Option<Bytes>)> {
        if self.writes.is_empty() {
            return Vec::new();
        }
        self.writes.into_iter().collect()
    }

    /// The actor running this turn.
    pub fn id(&self) -> &ActorId {
        &self.id
    }

    /// Depth, chain and deadline of the request this turn handles.
    pub fn context(&self) -> &CallContext {
        self.caller.context()
    }

    /// When this turn must have replied; it is cancelled then.
    pub fn deadline(&self) -> Deadline {
        self.caller.deadline()
    }

    /// The current time on the runtime's clock.
    pub fn now(&self) -> Deadline {
        self.handle.now()
    }

    /// The runtime's clock.
    pub fn clock(&self) -> Clock {
        self.handle.clock()
    }

    /// This turn's handle for calling other actors; clone it into tools and tasks.
    pub fn caller(&self) -> &Caller {
        &self.caller
    }

    /// Calls `target` and waits for its reply for at most `timeout`, clipped to this
    /// turn's own deadline: admission first (cycle in the chain, depth, registered
    /// kind, calls in flight), then the dispatcher's wait-for graph. The callee runs at
    /// depth + 1 with this actor appended to the chain. See [`Caller::call`].
    ///
    /// # Errors
    /// [`InvokeError`]: `Refused` (nothing sent), `DeadlockDetected` if `target`
    /// (directly or through others) is waiting on this actor, `Timeout`, and the rest.
    pub async fn invoke(&self, target: &ActorId, payload: Bytes, timeout: Duration) -> Result<Bytes, InvokeError> {
        self.caller.call(target, payload, timeout).await
    }

    /// Buffers a write of `value` under `key`, committed with the turn.
    ///
    /// # Errors
    /// [`StoreError::TooLarge`] for an over-long key, [`StoreError::TooManyWrites`] past
    /// [`TURN_WRITES_MAX`] distinct keys; nothing is buffered then.
    pub fn put(&mut self, key: impl Into<String>, value: Bytes) -> Result<(), StoreError> {
        self.buffer(key.into(), Some(value))
    }

    /// Buffers the deletion of `key`, committed with the turn.
    ///
    /// # Errors
    /// As [`Turn::put`].
    pub fn delete(&mut self, key: impl Into<String>) -> Result<(), StoreError> {
        self.buffer(key.into(), None)
    }

    fn buffer(&mut self, key: String, value: Option<Bytes>) -> Result<(), StoreError> {
        check_key(&key)?;
        if !self.writes.contains_key(&key) && self.writes.len() >= TURN_WRITES_MAX {
            return Err(StoreError::TooManyWrites {
                count: self.writes.len() + 1,
                limit: TURN_WRITES_MAX,
            });
        }
        self.writes.insert(key, value);
        Ok(())
    }

    /// The value of `key`: this turn's buffered write if any, else the committed one.
    ///
    /// # Errors
    /// [`StoreError`] if the store fails.
    pub async fn get(&self, key: &str) -> Result<Option<Bytes>, StoreError> {
        if let Some(buffered) = self.writes.get(key) {
            return Ok(buffered.clone());
        }
        self.handle.shared.store.get(&self.id, key).await
    }

    /// Up to `limit` entries whose keys start with `prefix`, after `after`, in key order,
    /// with this turn's buffered writes applied.
    ///
    /// # Errors
    /// [`StoreError`] if the store fails.
    pub async fn scan(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        let limit = limit.min(STATE_SCAN_LIMIT_MAX);
        let in_range = |key: &str| key.starts_with(prefix) && after.is_none_or(|after| key > after);
        let buffered: Vec<(&String, &Option<Bytes>)> = self.writes.iter().filter(|(key, _)| in_range(key)).collect();
        // Ask for enough that buffered deletions cannot leave the page short.
        let committed = self
            .handle
            .shared
            .store
            .scan(&self.id, prefix, after, limit.saturating_add(buffered.len()))
            .await?;
        let mut merged: BTreeMap<String, Bytes> = committed.into_iter().collect();
        for (key, value) in buffered {
            match value {
                Some(value) => merged.insert(key.clone(), value.clone()),
                None => merged.remove(key),
            };
        }
        Ok(merged.into_iter().take(limit).collect())
    }
}

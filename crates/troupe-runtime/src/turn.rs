//! What a turn can do: read its context, call other actors, read and buffer writes.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, CallContext, Deadline, InvokeError};

use crate::envelope::EnvelopeContext;
use crate::idempotency::IDEMPOTENCY_STORE_PREFIX;
use crate::state_store::{check_key, STATE_SCAN_LIMIT_MAX, TURN_WRITES_MAX};
use crate::store_retry::{retry, RetryBounds};
use crate::{Caller, Clock, Fence, RuntimeHandle, StoreError};

/// The context of one turn of one actor.
///
/// Writes are buffered here and committed atomically with the actor's snapshot when the
/// turn succeeds; if the turn fails or times out they are discarded. Reads see the
/// turn's own buffered writes first.
///
/// Calls to other actors go through the turn's [`Caller`] ([`Turn::caller`],
/// [`Turn::invoke`]): its identity, chain, depth and deadline come from the runtime.
pub struct Turn {
    /// Whose turn it is, shared with the activation: one reference count per turn where
    /// an id and a handle of its own took three (each an atomic increment, and a
    /// decrement at the turn's end: perf, 2026-11-25, about 10 % of a typed `tell`).
    home: Arc<TurnHome>,
    /// The request's context as its envelope carried it: for a root request without a
    /// trace id (the hot path), its deadline alone, 16 bytes where a `CallContext` takes
    /// 80. A turn is moved several times between the activation's steps, and at its
    /// old size each move was a `memcpy` call (callgrind, 2026-11-29).
    context: EnvelopeContext,
    /// A root request's `CallContext`, made when first asked for ([`Turn::context`]):
    /// a turn that never asks (a typed echo) neither builds nor drops one.
    root_context: OnceLock<Box<CallContext>>,
    /// Made on first use: a turn that calls nobody costs no allocation for it.
    caller: OnceLock<Caller>,
    /// The buffered writes, made on the first write: a turn that writes nothing neither
    /// allocates nor drops a map (an empty `BTreeMap`'s drop alone cost about 47
    /// instructions per turn, callgrind), and `Turn` stays a pointer smaller.
    writes: Option<Box<Writes>>,
}

/// The actor whose turns an activation runs, and its runtime: made once per
/// activation, shared by its turns.
pub(crate) struct TurnHome {
    pub(crate) id: ActorId,
    pub(crate) handle: RuntimeHandle,
    /// The fence the activation claimed, which its commits are made under.
    pub(crate) fence: Fence,
    /// The store's refusal of `fence`, once a turn's [`Turn::check_fence`] has met it:
    /// the activation reads it when a turn fails, and closes itself as after a refused
    /// commit.
    pub(crate) fence_refused: OnceLock<StoreError>,
}

/// The most distinct keys a turn's writes keep in a sorted vector before they move to
/// a map (keys). A turn writes a handful of keys, a log's in rising order: each is then
/// a push at the vector's end, and the commit takes the vector as it is. Past this
/// many, an insertion in the middle would shift too much, so a map takes over.
const WRITES_IN_ORDER_MAX: usize = 32;

/// The room a turn's first write makes for its writes (keys): an agent's turn writes
/// about five.
const WRITES_FIRST_ROOM: usize = 8;

/// A turn's buffered writes, by key, in key order: `None` is a deletion.
enum Writes {
    /// At most [`WRITES_IN_ORDER_MAX`] keys, sorted, each once.
    InOrder(Vec<(String, Option<Bytes>)>),
    Map(BTreeMap<String, Option<Bytes>>),
}

impl Default for Writes {
    fn default() -> Self {
        Self::InOrder(Vec::with_capacity(WRITES_FIRST_ROOM))
    }
}

impl Writes {
    fn len(&self) -> usize {
        match self {
            Self::InOrder(writes) => writes.len(),
            Self::Map(writes) => writes.len(),
        }
    }

    fn get(&self, key: &str) -> Option<&Option<Bytes>> {
        match self {
            Self::InOrder(writes) => writes
                .binary_search_by(|(written, _)| written.as_str().cmp(key))
                .ok()
                .map(|at| &writes[at].1),
            Self::Map(writes) => writes.get(key),
        }
    }

    /// The writes in key order.
    fn iter(&self) -> impl Iterator<Item = (&String, &Option<Bytes>)> {
        let (in_order, map) = match self {
            Self::InOrder(writes) => (Some(writes.iter().map(|(key, value)| (key, value))), None),
            Self::Map(writes) => (None, Some(writes.iter())),
        };
        in_order.into_iter().flatten().chain(map.into_iter().flatten())
    }

    /// Writes `value` under `key` (again, or for the first time if fewer than
    /// [`TURN_WRITES_MAX`] keys are written).
    fn insert(&mut self, key: String, value: Option<Bytes>) -> Result<(), StoreError> {
        let count = self.len();
        let too_many = || StoreError::TooManyWrites {
            count: count + 1,
            limit: TURN_WRITES_MAX,
        };
        match self {
            Self::InOrder(writes) => {
                // After the last key (a log's next entry): a push, no search.
                let at = match writes.last() {
                    Some((last, _)) if *last < key => Err(writes.len()),
                    None => Err(0),
                    Some(_) => writes.binary_search_by(|(written, _)| written.cmp(&key)),
                };
                match at {
                    Ok(at) => writes[at].1 = value,
                    Err(_) if count >= TURN_WRITES_MAX => return Err(too_many()),
                    Err(at) if count < WRITES_IN_ORDER_MAX => writes.insert(at, (key, value)),
                    Err(_) => {
                        let mut map: BTreeMap<_, _> = std::mem::take(writes).into_iter().collect();
                        map.insert(key, value);
                        *self = Self::Map(map);
                    }
                }
            }
            Self::Map(writes) => match writes.entry(key) {
                // One search of the map: the entry is there (a write again) or its place is.
                std::collections::btree_map::Entry::Occupied(mut written) => {
                    written.insert(value);
                }
                std::collections::btree_map::Entry::Vacant(_) if count >= TURN_WRITES_MAX => return Err(too_many()),
                std::collections::btree_map::Entry::Vacant(place) => {
                    place.insert(value);
                }
            },
        }
        Ok(())
    }
}

/// A finished turn's buffered writes (none made, if it wrote nothing).
pub(crate) struct TurnWrites(Option<Box<Writes>>);

impl TurnWrites {
    /// Whether the turn made no write at all.
    pub(crate) fn none_made(&self) -> bool {
        self.0.is_none()
    }

    /// The writes in key order, for the turn's commit.
    pub(crate) fn into_vec(self) -> Vec<(String, Option<Bytes>)> {
        match self.0.map(|writes| *writes) {
            Some(Writes::InOrder(writes)) => writes,
            Some(Writes::Map(writes)) => writes.into_iter().collect(),
            None => Vec::new(),
        }
    }
}

impl Turn {
    pub(crate) fn new(home: Arc<TurnHome>, context: EnvelopeContext) -> Self {
        Self {
            home,
            context,
            root_context: OnceLock::new(),
            caller: OnceLock::new(),
            writes: None,
        }
    }

    /// Ends the turn for its caller handle and every clone of it: calls still in flight
    /// are cancelled, new ones refused.
    pub(crate) fn end(&self) {
        if let Some(caller) = self.caller.get() {
            caller.end_turn();
        }
    }

    /// Ends the turn for good (as [`Turn::end`]) and gives back its home, which the
    /// activation lends to its next turn, and its buffered writes, for its commit.
    /// Inlined into the activation's loop: as a call, its turn was moved into it (a plain
    /// `#[inline]` was not taken).
    #[inline(always)]
    pub(crate) fn finish(self) -> (Arc<TurnHome>, TurnWrites) {
        self.end();
        (self.home, TurnWrites(self.writes))
    }

    /// Whether this turn has buffered a write (or deletion) of `key`.
    fn has_buffered(&self, key: &str) -> bool {
        self.writes.as_ref().is_some_and(|writes| writes.get(key).is_some())
    }

    /// The actor running this turn.
    pub fn id(&self) -> &ActorId {
        &self.home.id
    }

    /// Depth, chain and deadline of the request this turn handles.
    pub fn context(&self) -> &CallContext {
        self.context.context(&self.root_context)
    }

    /// When this turn must have replied; it is cancelled then.
    pub fn deadline(&self) -> Deadline {
        self.context.deadline()
    }

    /// The current time on the runtime's clock.
    pub fn now(&self) -> Deadline {
        self.home.handle.now()
    }

    /// The runtime's clock.
    pub fn clock(&self) -> Clock {
        self.home.handle.clock()
    }

    /// Whether this turn's runtime was aborted: dropped without a shutdown, or its
    /// shutdown grace ran out. Nothing this turn does from then on is committed, and its
    /// task is cancelled at its next `.await` once the dispatcher gets to it; calls it
    /// makes are refused (`ShuttingDown`). A turn that does work outside the runtime
    /// between its awaits (a model request, a tool with effects) should check this and
    /// stop rather than start more work for a process that is gone.
    pub fn runtime_aborted(&self) -> bool {
        self.home.handle.shared.aborted()
    }

    /// Whether this activation can still commit: asks the store whether the fence it
    /// claimed is still the actor's newest ([`crate::StateStore::check_fence`]). Where
    /// several runtimes share one store (two processes on one SQLite file), another may
    /// have claimed the actor since this activation started; this one is then stale,
    /// and its turn's commit will be refused. A turn about to do expensive work outside
    /// the runtime (a model call, a tool with effects) can call this first and stop.
    ///
    /// On `Err(Fenced)`, return an error from the turn (the `?` operator does): the
    /// turn is rolled back, its caller gets `StorageFailed` with the refusal, and the
    /// activation closes before the caller is answered, so the next request runs in a
    /// fresh activation from the newest state (as after a refused commit; the activation
    /// closes whatever error the turn returns, once it has met the refusal here).
    ///
    /// Advisory: `Ok(())` does not promise that the commit will be accepted (a claim may
    /// come after it; the commit checks again). Not free: a store round trip (on SQLite,
    /// `PRAGMA data_version` and, only when another connection has committed since the
    /// last check of this actor, a read of its fence); a store that cannot check answers
    /// `Ok(())` at once. Not called by the runtime itself.
    ///
    /// # Errors
    /// [`StoreError::Fenced`] if the actor was claimed since this activation's claim;
    /// [`StoreError::Backend`] if the store fails (the commit decides then);
    /// [`StoreError::Unavailable`] if the store stayed unavailable until this turn's
    /// deadline (tried again meanwhile, as [`Turn::get`] is).
    pub async fn check_fence(&self) -> Result<(), StoreError> {
        let home = &self.home;
        let checked = match home.handle.shared.store.check_fence(&home.id, home.fence).await {
            Err(source) if source.is_transient() => {
                let store = &home.handle.shared.store;
                Box::pin(self.read_failed("check_fence", source, || store.check_fence(&home.id, home.fence))).await
            }
            checked => checked,
        };
        if let Err(refused @ (StoreError::Fenced { .. } | StoreError::NotOwner { .. })) = &checked {
            let _ = home.fence_refused.set(refused.clone());
        }
        checked
    }

    /// A typed reference to the actor `id`, for calls from this turn with
    /// [`crate::ActorRef::ask_from`] and [`crate::ActorRef::tell_from`] (given
    /// [`Turn::caller`]).
    ///
    /// # Errors
    /// [`crate::ActorRefError`] if `id`'s kind is not registered, or not for `A`.
    pub fn actor_ref<A: crate::TypedActor>(&self, id: ActorId) -> Result<crate::ActorRef<A>, crate::ActorRefError> {
        self.home.handle.actor_ref(id)
    }

    /// This turn's handle for calling other actors; clone it into tools and tasks.
    pub fn caller(&self) -> &Caller {
        self.caller.get_or_init(|| {
            Caller::new(
                self.home.handle.clone(),
                self.home.id.clone(),
                self.context.to_context(),
            )
        })
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
        self.caller().call(target, payload, timeout).await
    }

    /// Buffers a write of `value` under `key`, committed with the turn.
    ///
    /// # Errors
    /// [`StoreError::TooLarge`] for an over-long key, [`StoreError::TooManyWrites`] past
    /// [`TURN_WRITES_MAX`] distinct keys, [`StoreError::ReservedKey`] for a key that
    /// starts with [`crate::IDEMPOTENCY_STORE_PREFIX`] (the runtime's records); nothing
    /// is buffered then.
    pub fn put(&mut self, key: impl Into<String>, value: Bytes) -> Result<(), StoreError> {
        let key = key.into();
        check_not_reserved(&key)?;
        self.buffer(key, Some(value))
    }

    /// Buffers the deletion of `key`, committed with the turn.
    ///
    /// # Errors
    /// As [`Turn::put`].
    pub fn delete(&mut self, key: impl Into<String>) -> Result<(), StoreError> {
        let key = key.into();
        check_not_reserved(&key)?;
        self.buffer(key, None)
    }

    /// As [`Turn::put`], for the runtime's own records (under
    /// [`crate::IDEMPOTENCY_STORE_PREFIX`]).
    pub(crate) fn put_record(&mut self, key: String, value: Bytes) -> Result<(), StoreError> {
        self.buffer(key, Some(value))
    }

    /// As [`Turn::delete`], for the runtime's own records.
    pub(crate) fn delete_record(&mut self, key: String) -> Result<(), StoreError> {
        self.buffer(key, None)
    }

    fn buffer(&mut self, key: String, value: Option<Bytes>) -> Result<(), StoreError> {
        check_key(&key)?;
        self.writes.get_or_insert_with(Box::default).insert(key, value)
    }

    /// The value of `key`: this turn's buffered write if any, else the committed one.
    ///
    /// A read the store fails for a moment ([`StoreError::Unavailable`]) is tried again
    /// within this turn's deadline (`store_retry.rs`): a read changes nothing, so asking
    /// again is safe whatever became of the failed try.
    ///
    /// # Errors
    /// [`StoreError`] if the store fails; [`StoreError::Unavailable`] if it stayed
    /// unavailable until near this turn's deadline.
    pub async fn get(&self, key: &str) -> Result<Option<Bytes>, StoreError> {
        if let Some(buffered) = self.writes.as_ref().and_then(|writes| writes.get(key)) {
            return Ok(buffered.clone());
        }
        let (store, id) = (&self.home.handle.shared.store, &self.home.id);
        match store.get(id, key).await {
            Err(source) if source.is_transient() => {
                Box::pin(self.read_failed("get", source, || store.get(id, key))).await
            }
            got => got,
        }
    }

    /// A read inside this turn after the store failed it for a moment (`source`): tried
    /// again while the store is unavailable, until this turn's deadline (for a told
    /// message's turn, its own), or until the runtime is aborted (`store_retry.rs`).
    /// Reads are idempotent: trying one again cannot change what the store holds, nor
    /// what this turn commits. Cold: only after a failure.
    #[cold]
    #[inline(never)]
    async fn read_failed<T, F, Attempt>(
        &self,
        operation: &'static str,
        source: StoreError,
        read: F,
    ) -> Result<T, StoreError>
    where
        F: FnMut() -> Attempt,
        Attempt: std::future::Future<Output = Result<T, StoreError>>,
    {
        let bounds = RetryBounds {
            shared: &self.home.handle.shared,
            deadline: self.deadline(),
            mailbox: None,
            actor: &self.home.id,
            operation,
        };
        retry(bounds, source, read).await
    }

    /// Up to `limit` (at most [`STATE_SCAN_LIMIT_MAX`]) entries whose keys start with
    /// `prefix`, after `after`, in key order, with this turn's buffered writes applied.
    /// The page is short only when no more entries exist: committed entries that the
    /// turn deleted are made up for by reading on, in as many store scans as needed.
    /// Each store scan the store fails for a moment is tried again within this turn's
    /// deadline, as [`Turn::get`] is (a read: safe to ask again).
    ///
    /// # Errors
    /// [`StoreError`] if the store fails; [`StoreError::Unavailable`] if it stayed
    /// unavailable until near this turn's deadline.
    pub async fn scan(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        let limit = limit.min(STATE_SCAN_LIMIT_MAX);
        let in_range = |key: &str| key.starts_with(prefix) && after.is_none_or(|after| key > after);
        let buffered: Vec<(&String, &Option<Bytes>)> = self
            .writes
            .iter()
            .flat_map(|writes| writes.iter())
            .filter(|(key, _)| in_range(key))
            .collect();
        let deletions = buffered.iter().filter(|(_, value)| value.is_none()).count();
        // Ask for enough that the buffered deletions rarely leave a page short; the store
        // caps a page at STATE_SCAN_LIMIT_MAX, so read on until `limit` committed entries
        // that the turn did not overwrite are in hand, or the store has no more.
        let page_limit = limit.saturating_add(deletions).min(STATE_SCAN_LIMIT_MAX);
        let mut committed: Vec<(String, Bytes)> = Vec::new();
        let mut cursor: Option<String> = after.map(str::to_string);
        loop {
            let (store, id) = (&self.home.handle.shared.store, &self.home.id);
            let page = match store.scan(id, prefix, cursor.as_deref(), page_limit).await {
                Err(source) if source.is_transient() => {
                    let scan = || store.scan(id, prefix, cursor.as_deref(), page_limit);
                    Box::pin(self.read_failed("scan", source, scan)).await?
                }
                page => page?,
            };
            let exhausted = page.len() < page_limit;
            if let Some((last, _)) = page.last() {
                cursor = Some(last.clone());
            }
            committed.extend(page.into_iter().filter(|(key, _)| !self.has_buffered(key)));
            // Every committed key up to `cursor` is in hand; with `limit` of them, the
            // first `limit` of the merged view are all at or before `cursor`.
            if exhausted || committed.len() >= limit {
                break;
            }
        }
        let mut merged: BTreeMap<String, Bytes> = committed.into_iter().collect();
        for (key, value) in buffered {
            if let Some(value) = value {
                merged.insert(key.clone(), value.clone());
            }
        }
        Ok(merged.into_iter().take(limit).collect())
    }
}

/// Refuses a key under [`IDEMPOTENCY_STORE_PREFIX`]: the runtime's records, which a
/// turn's own write would corrupt or forge (a recorded reply its handler never gave).
/// The prefix starts with a NUL, so an ordinary key is let through at its first byte.
#[inline]
fn check_not_reserved(key: &str) -> Result<(), StoreError> {
    if key.starts_with(IDEMPOTENCY_STORE_PREFIX) {
        return Err(StoreError::ReservedKey {
            key: key.to_string(),
            prefix: IDEMPOTENCY_STORE_PREFIX.to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Goal: the buffered writes answer as a map of the same writes does, for reads,
        /// the in-order walk and the commit's list, across the move from the sorted
        /// vector to the map. Method: writes and deletions of keys drawn from three
        /// times `WRITES_IN_ORDER_MAX` keys (so runs cross the move, or stay below it),
        /// in rising order, falling order or any, checked after each against a
        /// `BTreeMap`.
        #[test]
        fn writes_answer_as_a_map_of_them(
            ops in proptest::collection::vec((0..3 * WRITES_IN_ORDER_MAX, any::<bool>(), any::<u8>()), 0..120),
            order in 0..3_u8,
        ) {
            let mut ops = ops;
            match order {
                0 => ops.sort_by_key(|op| op.0),
                1 => ops.sort_by_key(|op| std::cmp::Reverse(op.0)),
                _ => {}
            }
            let key = |n: usize| format!("log/{n:03}");
            let mut writes = Writes::default();
            let mut model: BTreeMap<String, Option<Bytes>> = BTreeMap::new();
            for (n, put, byte) in ops {
                let value = put.then(|| Bytes::from(vec![byte]));
                writes.insert(key(n), value.clone()).unwrap();
                model.insert(key(n), value);
                prop_assert_eq!(writes.len(), model.len());
                prop_assert!(writes.iter().eq(model.iter()));
                for probe in 0..3 * WRITES_IN_ORDER_MAX {
                    prop_assert_eq!(writes.get(&key(probe)), model.get(&key(probe)));
                }
                prop_assert_eq!(
                    matches!(writes, Writes::InOrder(_)),
                    model.len() <= WRITES_IN_ORDER_MAX,
                    "the sorted vector holds at most its limit, and the map takes over past it"
                );
            }
            let committed = TurnWrites(Some(Box::new(writes))).into_vec();
            prop_assert_eq!(committed, model.into_iter().collect::<Vec<_>>());
        }
    }
}

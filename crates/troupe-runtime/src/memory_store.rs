//! An in-memory [`StateStore`] with fault injection, for tests and the simulator.
//!
//! Faults are switched on through [`MemoryStoreFaults`]:
//! - failing loads, commits or reads (the next `n`, or all until switched off) with
//!   [`StoreError::Injected`], which is not transient;
//! - an outage: every operation fails [`StoreError::Unavailable`] (a store down for a
//!   moment, which the runtime tries again within a request's deadline) until switched
//!   back ([`MemoryStoreFaults::set_unavailable`]);
//! - write-back mode, which models a disk cache: commits are visible at once but only
//!   durable after [`MemoryStore::flush`]; [`MemoryStore::crash`] loses what was not
//!   flushed. The simulator uses it for the "lost unflushed writes" fault.
//!
//! The store itself is shared by reference counting, so a simulated node that is killed
//! and restarted can be given the same store: that models its disk. Clones share the
//! fences too: a claim through one clone fences off commits through every other.
//!
//! Fences are written through even in write-back mode: a claim is durable when it
//! returns, so a crash never makes the store issue the same fence twice.
//!
//! Layout: a hash map from actor id to that actor's fence, state blob and ordered map of
//! entries, so a commit costs a lookup of its actor and an insert per write into that
//! actor's own map (logarithmic in the actor's entries, whatever the other actors hold),
//! and moves the commit's keys in without copying them. There is one copy of the data:
//! while a write-back commit is unflushed, the actor keeps the durable value of each
//! item that commit changed (an undo record), which a crash puts back and a flush drops.
//! This replaced one `BTreeMap` of every entry of every actor, keyed by a cloned
//! (actor, key) pair and kept twice (visible and durable); see docs/architecture.md,
//! "Where an agent call's time goes".

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use troupe_core::ActorId;

use crate::fast_hash::IdMap;
use crate::state_store::{
    check_key, Claimed, Fence, FencedClaim, StateChange, StateStore, StoreError, StoreOperation, TurnCommit,
    STATE_SCAN_LIMIT_MAX,
};
use crate::store_key::{Key, KeyStr};

/// Everything the store holds for one actor.
///
/// Each actor has its own entry map, so a commit's cost depends on the size of that
/// actor's key-value space only, never on the other actors' data, and the keys are the
/// commit's own strings (moved in, not cloned). There is one copy of the data, the
/// visible one; the durable one is that copy with [`Unflushed`] undone, which is empty
/// unless write-back mode left commits unflushed.
#[derive(Default)]
struct ActorSlot {
    /// The actor's newest fence; never lost by [`MemoryStore::crash`].
    fence: Option<Fence>,
    /// The committed state blob, as reads see it.
    state: Option<Bytes>,
    /// The committed key-value space, as reads see it (keys compared a word at a time:
    /// see `store_key`).
    entries: BTreeMap<Key, Bytes>,
    /// What the durable copy holds where it differs from the visible one; `None` when
    /// they are equal (always, unless write-back mode is or was on since the last flush).
    unflushed: Option<Box<Unflushed>>,
}

/// How to get from an actor's visible data back to its durable data: the value each
/// changed item had when it was last durable (recorded at its first change after a
/// flush).
#[derive(Default)]
struct Unflushed {
    /// The durable state blob, if the visible one has changed since.
    state: Option<Option<Bytes>>,
    /// The durable value (`None`: absent) of every key changed since.
    entries: BTreeMap<Key, Option<Bytes>>,
}

impl ActorSlot {
    /// Applies `commit` durably: to the visible data and, where they differ, to the
    /// durable data too (a durable write makes the item's durable value its new value,
    /// so what is undone on a crash no longer covers it).
    fn apply_durably(&mut self, commit: TurnCommit, states: &mut usize) {
        if let Some(unflushed) = self.unflushed.as_deref_mut() {
            if commit.state != StateChange::Unchanged {
                unflushed.state = None;
            }
            for (key, _) in &commit.writes {
                unflushed.entries.remove(KeyStr::new(key));
            }
        }
        self.apply(commit, states);
    }

    /// Applies `commit` to the visible data only, first recording the durable value of
    /// every item it changes for the first time since the last flush.
    fn apply_unflushed(&mut self, commit: TurnCommit, states: &mut usize) {
        let unflushed = self.unflushed.get_or_insert_with(Box::default);
        if commit.state != StateChange::Unchanged && unflushed.state.is_none() {
            unflushed.state = Some(self.state.clone());
        }
        for (key, _) in &commit.writes {
            let borrowed = KeyStr::new(key);
            if !unflushed.entries.contains_key(borrowed) {
                unflushed
                    .entries
                    .insert(Key::new(key.clone()), self.entries.get(borrowed).cloned());
            }
        }
        self.apply(commit, states);
    }

    /// Applies `commit` to the visible data; `states` counts the actors with a state.
    fn apply(&mut self, commit: TurnCommit, states: &mut usize) {
        match commit.state {
            StateChange::Unchanged => {}
            StateChange::Set(state) => self.set_state(Some(state), states),
            StateChange::Deleted => self.set_state(None, states),
        }
        for (key, value) in commit.writes {
            match value {
                Some(value) => self.entries.insert(Key::new(key), value),
                None => self.entries.remove(KeyStr::new(&key)),
            };
        }
    }

    /// Makes the durable data visible again: what a crash leaves.
    fn undo_unflushed(&mut self, states: &mut usize) {
        let Some(unflushed) = self.unflushed.take() else {
            return;
        };
        let Unflushed { state, entries } = *unflushed;
        if let Some(state) = state {
            self.set_state(state, states);
        }
        for (key, value) in entries {
            match value {
                Some(value) => self.entries.insert(key, value),
                None => self.entries.remove(&key),
            };
        }
    }

    fn set_state(&mut self, state: Option<Bytes>, states: &mut usize) {
        match (self.state.is_some(), state.is_some()) {
            (false, true) => *states += 1,
            (true, false) => *states -= 1,
            _ => {}
        }
        self.state = state;
    }
}

#[derive(Default)]
struct Disk {
    actors: IdMap<ActorSlot>,
    /// The actors whose [`ActorSlot::unflushed`] is `Some`, each once: what a flush or a
    /// crash visits.
    unflushed: Vec<ActorId>,
    /// How many actors have a visible state blob.
    states: usize,
}

impl Disk {
    /// The actor's slot, created empty (no fence, no data) if it has none yet.
    fn slot_mut(&mut self, actor: &ActorId) -> &mut ActorSlot {
        self.actors.get_or_insert_with(actor, ActorSlot::default)
    }

    fn visible_state(&self, actor: &ActorId) -> Option<Bytes> {
        self.actors.get(actor).and_then(|slot| slot.state.clone())
    }
}

/// Switches for the faults a [`MemoryStore`] can inject. Cheap to clone; all clones
/// control the same store.
#[derive(Clone, Default)]
pub struct MemoryStoreFaults {
    inner: Arc<FaultSwitches>,
}

#[derive(Default)]
struct FaultSwitches {
    fail_loads: AtomicU64,
    fail_commits: AtomicU64,
    fail_reads: AtomicU64,
    write_back: AtomicBool,
    injected: AtomicU64,
    /// Every operation fails `Unavailable` while set.
    unavailable: AtomicBool,
    /// Set by the first [`MemoryStoreFaults::set_unavailable`], never cleared: from then
    /// on the store answers [`StateStore::may_be_unavailable`] `true`.
    unavailable_switched: AtomicBool,
}

/// The cause of every [`StoreError::Unavailable`] a [`MemoryStore`] answers while
/// switched unavailable.
pub const MEMORY_STORE_OUTAGE_CAUSE: &str =
    "the memory store is switched unavailable (MemoryStoreFaults::set_unavailable)";

/// Fail every operation of a kind until switched off.
const FAIL_ALWAYS: u64 = u64::MAX;

impl MemoryStoreFaults {
    /// Fails the next `count` loads and claims (a claim is the load that starts an
    /// activation).
    pub fn fail_next_loads(&self, count: u64) {
        self.inner.fail_loads.store(count, Ordering::SeqCst);
    }

    /// Fails the next `count` commits.
    pub fn fail_next_commits(&self, count: u64) {
        self.inner.fail_commits.store(count, Ordering::SeqCst);
    }

    /// Fails the next `count` reads (`get` and `scan`).
    pub fn fail_next_reads(&self, count: u64) {
        self.inner.fail_reads.store(count, Ordering::SeqCst);
    }

    /// Fails every load, claim, commit and read until [`MemoryStoreFaults::heal`].
    pub fn fail_all(&self) {
        self.fail_next_loads(FAIL_ALWAYS);
        self.fail_next_commits(FAIL_ALWAYS);
        self.fail_next_reads(FAIL_ALWAYS);
    }

    /// Stops every failure (write-back mode stays as it is).
    pub fn heal(&self) {
        self.fail_next_loads(0);
        self.fail_next_commits(0);
        self.fail_next_reads(0);
    }

    /// Turns write-back mode on or off; see the module documentation.
    pub fn set_write_back(&self, on: bool) {
        self.inner.write_back.store(on, Ordering::SeqCst);
    }

    /// Starts (`true`) or ends (`false`) an outage: while it lasts, every claim, load,
    /// commit, fence check, `get` and `scan` fails [`StoreError::Unavailable`] with
    /// [`MEMORY_STORE_OUTAGE_CAUSE`] and changes nothing (counted in
    /// [`MemoryStoreFaults::injected_count`]), as a database server that is restarting
    /// would answer. The runtime tries such an operation again within the deadline of
    /// the request it serves. Once this has been called, the store answers
    /// [`StateStore::may_be_unavailable`] `true` for good, so the runtime keeps each
    /// turn's writes until their commit is made (a store never switched keeps answering
    /// `false` and spares that copy).
    pub fn set_unavailable(&self, down: bool) {
        self.inner.unavailable_switched.store(true, Ordering::SeqCst);
        self.inner.unavailable.store(down, Ordering::SeqCst);
    }

    /// How many operations have failed by injection so far (an outage's included).
    pub fn injected_count(&self) -> u64 {
        self.inner.injected.load(Ordering::SeqCst)
    }

    /// `Unavailable` for `operation` while an outage lasts.
    fn outage(&self, operation: StoreOperation) -> Result<(), StoreError> {
        if !self.inner.unavailable.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.inner.injected.fetch_add(1, Ordering::SeqCst);
        Err(StoreError::Unavailable {
            operation,
            cause: MEMORY_STORE_OUTAGE_CAUSE.to_string(),
        })
    }

    fn write_back(&self) -> bool {
        self.inner.write_back.load(Ordering::SeqCst)
    }

    fn take(&self, counter: &AtomicU64, operation: StoreOperation) -> Result<(), StoreError> {
        self.outage(operation)?;
        let mut current = counter.load(Ordering::SeqCst);
        loop {
            if current == 0 {
                return Ok(());
            }
            let next = if current == FAIL_ALWAYS { current } else { current - 1 };
            match counter.compare_exchange(current, next, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => {
                    self.inner.injected.fetch_add(1, Ordering::SeqCst);
                    return Err(StoreError::Injected { operation });
                }
                Err(actual) => current = actual,
            }
        }
    }
}

/// An in-memory [`StateStore`]; clones share the same data.
#[derive(Clone, Default)]
pub struct MemoryStore {
    disk: Arc<Mutex<Disk>>,
    faults: MemoryStoreFaults,
}

impl MemoryStore {
    /// An empty store with no faults.
    pub fn new() -> Self {
        Self::default()
    }

    /// The switches that inject faults into this store.
    pub fn faults(&self) -> &MemoryStoreFaults {
        &self.faults
    }

    /// Makes everything committed so far durable (a no-op unless write-back is on).
    pub fn flush(&self) {
        let mut disk = self.lock();
        let disk = &mut *disk;
        for actor in disk.unflushed.drain(..) {
            if let Some(slot) = disk.actors.get_mut(&actor) {
                slot.unflushed = None;
            }
        }
    }

    /// Models a power loss: everything committed but not flushed is lost. Without
    /// write-back mode every commit is durable at once and nothing is lost.
    pub fn crash(&self) {
        let mut disk = self.lock();
        let disk = &mut *disk;
        for actor in disk.unflushed.drain(..) {
            if let Some(slot) = disk.actors.get_mut(&actor) {
                slot.undo_unflushed(&mut disk.states);
            }
        }
    }

    /// How many actors have a committed state blob.
    pub fn actor_count(&self) -> usize {
        self.lock().states
    }

    /// A claim (`StateStore::claim` and `claim_now` both): a fence newer than any
    /// issued for `actor`, and its visible state, under the lock.
    fn claim_at_once(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        self.faults.take(&self.faults.inner.fail_loads, StoreOperation::Claim)?;
        let mut disk = self.lock();
        let slot = disk.slot_mut(actor);
        let fence = match slot.fence {
            None => Fence::FIRST,
            // `u64::MAX` can only have been given (`claim_with_fence`): no newer fence
            // exists, and `Fence::next` would panic under the lock.
            Some(newest) => newest
                .token()
                .checked_add(1)
                .and_then(Fence::from_token)
                .ok_or_else(|| StoreError::Backend {
                    operation: StoreOperation::Claim,
                    cause: format!("{newest} is the newest fence of {actor}: no claim can issue a newer one"),
                })?,
        };
        slot.fence = Some(fence);
        Ok(Claimed {
            fence,
            state: slot.state.clone(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Disk> {
        self.disk.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[async_trait]
impl FencedClaim for MemoryStore {
    async fn claim_with_fence(&self, actor: &ActorId, fence: Fence) -> Result<Claimed, StoreError> {
        self.faults.take(&self.faults.inner.fail_loads, StoreOperation::Claim)?;
        let mut disk = self.lock();
        let slot = disk.slot_mut(actor);
        let current = slot.fence;
        if current.is_some_and(|newest| newest >= fence) {
            return Err(StoreError::Fenced {
                actor: actor.clone(),
                held: fence,
                current,
            });
        }
        slot.fence = Some(fence);
        Ok(Claimed {
            fence,
            state: slot.state.clone(),
        })
    }
}

#[async_trait]
impl StateStore for MemoryStore {
    async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        self.claim_at_once(actor)
    }

    fn claim_now(&self, actor: &ActorId) -> Option<Result<Claimed, StoreError>> {
        Some(self.claim_at_once(actor))
    }

    /// Not until [`MemoryStoreFaults::set_unavailable`] is first called: its other
    /// faults are injected ([`StoreError::Injected`]), not transient, so the runtime
    /// keeps no copy of a turn's writes for it.
    fn may_be_unavailable(&self) -> bool {
        self.faults.inner.unavailable_switched.load(Ordering::Relaxed)
    }

    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        self.faults.take(&self.faults.inner.fail_loads, StoreOperation::Load)?;
        Ok(self.lock().visible_state(actor))
    }

    async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        commit.validate()?;
        self.faults
            .take(&self.faults.inner.fail_commits, StoreOperation::Commit)?;
        let write_back = self.faults.write_back();
        let mut disk = self.lock();
        let disk = &mut *disk;
        let slot = disk.actors.get_mut(actor).filter(|slot| slot.fence == Some(fence));
        let Some(slot) = slot else {
            return Err(StoreError::Fenced {
                actor: actor.clone(),
                held: fence,
                current: disk.actors.get(actor).and_then(|slot| slot.fence),
            });
        };
        if write_back {
            if slot.unflushed.is_none() {
                disk.unflushed.push(actor.clone());
            }
            slot.apply_unflushed(commit, &mut disk.states);
        } else {
            slot.apply_durably(commit, &mut disk.states);
        }
        Ok(())
    }

    /// The actor's newest fence, compared under the lock. Only an outage fails it, as
    /// `Commit` (the operation PostgreSQL's store names for a fence check; a check is
    /// advisory: the commit after it still meets the injected faults).
    async fn check_fence(&self, actor: &ActorId, fence: Fence) -> Result<(), StoreError> {
        self.faults.outage(StoreOperation::Commit)?;
        let current = self.lock().actors.get(actor).and_then(|slot| slot.fence);
        if current == Some(fence) {
            return Ok(());
        }
        Err(StoreError::Fenced {
            actor: actor.clone(),
            held: fence,
            current,
        })
    }

    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        check_key(key)?;
        self.faults.take(&self.faults.inner.fail_reads, StoreOperation::Get)?;
        Ok(self
            .lock()
            .actors
            .get(actor)
            .and_then(|slot| slot.entries.get(KeyStr::new(key)))
            .cloned())
    }

    async fn scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        check_key(prefix)?;
        self.faults.take(&self.faults.inner.fail_reads, StoreOperation::Scan)?;
        let limit = limit.min(STATE_SCAN_LIMIT_MAX);
        // Start at the later of the prefix and `after`: an `after` that sorts before the
        // prefix must not start the range on keys outside it.
        let start = after.map_or(prefix, |after| after.max(prefix));
        let disk = self.lock();
        let Some(slot) = disk.actors.get(actor) else {
            return Ok(Vec::new());
        };
        Ok(slot
            .entries
            .range::<KeyStr, _>((Bound::Included(KeyStr::new(start)), Bound::Unbounded))
            .take_while(|(key, _)| key.as_str().starts_with(prefix))
            .filter(|(key, _)| after.is_none_or(|after| key.as_str() > after))
            .take(limit)
            .map(|(key, value)| (key.as_str().to_string(), value.clone()))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    //! The store against a reference model: the plain design it replaced (two whole
    //! tables, visible and durable, of every entry of every actor; a commit applied to
    //! both, or to the visible one only in write-back mode; a flush copies visible to
    //! durable, a crash durable to visible), over random sequences of claims, commits,
    //! flushes, crashes, write-back switches and injected failures.

    use std::collections::BTreeMap;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    use proptest::prelude::*;

    use super::*;

    /// Runs a store future to completion; the memory store never waits for anything.
    fn ready<F: Future>(future: F) -> F::Output {
        let mut context = Context::from_waker(Waker::noop());
        match pin!(future).poll(&mut context) {
            Poll::Ready(output) => output,
            Poll::Pending => panic!("a memory store operation waited"),
        }
    }

    const ACTORS: [(&str, &str); 3] = [("agent", "a"), ("agent", "ab"), ("conversation", "a")];
    const KEYS: [&str; 7] = ["", "a", "a/1", "a/2", "ab", "log/1", "log/2"];
    const PREFIXES: [&str; 5] = ["", "a", "a/", "log/", "z"];

    fn actor(index: usize) -> ActorId {
        let (kind, key) = ACTORS[index];
        ActorId::new(kind, key).unwrap()
    }

    fn value(byte: u8) -> Bytes {
        Bytes::from(vec![byte; usize::from(byte % 3) + 1])
    }

    #[derive(Clone, Default, PartialEq, Debug)]
    struct Tables {
        states: BTreeMap<usize, Bytes>,
        entries: BTreeMap<(usize, String), Bytes>,
    }

    impl Tables {
        fn apply(&mut self, actor: usize, commit: &TurnCommit) {
            match &commit.state {
                StateChange::Unchanged => {}
                StateChange::Set(state) => {
                    self.states.insert(actor, state.clone());
                }
                StateChange::Deleted => {
                    self.states.remove(&actor);
                }
            }
            for (key, value) in &commit.writes {
                match value {
                    Some(value) => self.entries.insert((actor, key.clone()), value.clone()),
                    None => self.entries.remove(&(actor, key.clone())),
                };
            }
        }
    }

    #[derive(Default)]
    struct Model {
        visible: Tables,
        durable: Tables,
        fences: BTreeMap<usize, Fence>,
        write_back: bool,
        failing_commits: u64,
    }

    #[derive(Clone, Debug)]
    enum Op {
        Claim(usize),
        /// A claim through `StateStore::claim_now`, which the runtime calls first.
        ClaimNow(usize),
        ClaimWithFence(usize, u64),
        /// `fence_back`: how many fences older than the actor's newest to commit under.
        Commit {
            actor: usize,
            fence_back: u64,
            state: Option<Option<u8>>,
            writes: Vec<(usize, Option<u8>)>,
        },
        WriteBack(bool),
        Flush,
        Crash,
        FailNextCommits(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        let state = prop_oneof![Just(None), Just(Some(None)), any::<u8>().prop_map(|b| Some(Some(b)))];
        let write = (0..KEYS.len(), prop::option::weighted(0.7, any::<u8>()));
        prop_oneof![
            3 => (0..ACTORS.len()).prop_map(Op::Claim),
            2 => (0..ACTORS.len()).prop_map(Op::ClaimNow),
            1 => (0..ACTORS.len(), 1..12u64).prop_map(|(a, f)| Op::ClaimWithFence(a, f)),
            8 => (0..ACTORS.len(), prop_oneof![4 => Just(0u64), 1 => 1..3u64], state, prop::collection::vec(write, 0..5))
                .prop_map(|(actor, fence_back, state, writes)| Op::Commit { actor, fence_back, state, writes }),
            2 => any::<bool>().prop_map(Op::WriteBack),
            1 => Just(Op::Flush),
            2 => Just(Op::Crash),
            1 => (0..2u64).prop_map(Op::FailNextCommits),
        ]
    }

    fn run(store: &MemoryStore, model: &mut Model, op: Op) {
        match op {
            Op::Claim(a) | Op::ClaimNow(a) => {
                let claimed = match op {
                    Op::Claim(_) => ready(store.claim(&actor(a))),
                    _ => store.claim_now(&actor(a)).expect("a memory store claims at once"),
                }
                .unwrap();
                let fence = model.fences.get(&a).map_or(Fence::FIRST, |f| f.next());
                model.fences.insert(a, fence);
                assert_eq!(claimed.fence, fence);
                assert_eq!(claimed.state, model.visible.states.get(&a).cloned());
            }
            Op::ClaimWithFence(a, token) => {
                let fence = Fence::from_token(token).unwrap();
                let result = ready(store.claim_with_fence(&actor(a), fence));
                let current = model.fences.get(&a).copied();
                if current.is_some_and(|newest| newest >= fence) {
                    let error = StoreError::Fenced {
                        actor: actor(a),
                        held: fence,
                        current,
                    };
                    assert_eq!(result.unwrap_err(), error);
                } else {
                    model.fences.insert(a, fence);
                    let expected = Claimed {
                        fence,
                        state: model.visible.states.get(&a).cloned(),
                    };
                    assert_eq!(result.unwrap(), expected);
                }
            }
            Op::Commit {
                actor: a,
                fence_back,
                state,
                writes,
            } => {
                let current = model.fences.get(&a).copied();
                let token = current.map_or(1, Fence::token).saturating_sub(fence_back).max(1);
                let fence = Fence::from_token(token).unwrap();
                let commit = TurnCommit {
                    state: match state {
                        None => StateChange::Unchanged,
                        Some(None) => StateChange::Deleted,
                        Some(Some(byte)) => StateChange::Set(value(byte)),
                    },
                    writes: writes
                        .into_iter()
                        .map(|(key, byte)| (KEYS[key].to_string(), byte.map(value)))
                        .collect(),
                };
                let result = ready(store.commit(&actor(a), fence, commit.clone()));
                if model.failing_commits > 0 {
                    model.failing_commits -= 1;
                    let error = StoreError::Injected {
                        operation: StoreOperation::Commit,
                    };
                    assert_eq!(result.unwrap_err(), error);
                } else if current != Some(fence) {
                    let error = StoreError::Fenced {
                        actor: actor(a),
                        held: fence,
                        current,
                    };
                    assert_eq!(result.unwrap_err(), error);
                } else {
                    result.unwrap();
                    model.visible.apply(a, &commit);
                    if !model.write_back {
                        model.durable.apply(a, &commit);
                    }
                }
            }
            Op::WriteBack(on) => {
                store.faults().set_write_back(on);
                model.write_back = on;
            }
            Op::Flush => {
                store.flush();
                model.durable = model.visible.clone();
            }
            Op::Crash => {
                store.crash();
                model.visible = model.durable.clone();
            }
            Op::FailNextCommits(count) => {
                store.faults().fail_next_commits(count);
                model.failing_commits = count;
            }
        }
    }

    /// Every read the store offers agrees with the model's visible table.
    fn check_reads(store: &MemoryStore, model: &Model) {
        assert_eq!(store.actor_count(), model.visible.states.len());
        for a in 0..ACTORS.len() {
            let id = actor(a);
            assert_eq!(ready(store.load(&id)).unwrap(), model.visible.states.get(&a).cloned());
            for key in KEYS {
                let expected = model.visible.entries.get(&(a, key.to_string())).cloned();
                assert_eq!(ready(store.get(&id, key)).unwrap(), expected, "{id} {key:?}");
            }
            for prefix in PREFIXES {
                for after in [None, Some(""), Some("a"), Some("a/1"), Some("log/1")] {
                    for limit in [1, 2, STATE_SCAN_LIMIT_MAX] {
                        let expected: Vec<(String, Bytes)> = model
                            .visible
                            .entries
                            .iter()
                            .filter(|((owner, key), _)| *owner == a && key.starts_with(prefix))
                            .filter(|((_, key), _)| after.is_none_or(|after| key.as_str() > after))
                            .take(limit)
                            .map(|((_, key), value)| (key.clone(), value.clone()))
                            .collect();
                        let scanned = ready(store.scan(&id, prefix, after, limit)).unwrap();
                        assert_eq!(
                            scanned, expected,
                            "{id} prefix {prefix:?} after {after:?} limit {limit}"
                        );
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Goal: the per-actor store with its undo record of unflushed writes behaves as
        /// the two whole tables did. Method: random operations, every read compared with
        /// the model after each one; after the sequence, a crash must leave exactly the
        /// model's durable table.
        #[test]
        fn memory_store_matches_the_two_table_model(ops in prop::collection::vec(op(), 1..60)) {
            let store = MemoryStore::new();
            let mut model = Model::default();
            for op in ops {
                run(&store, &mut model, op);
                check_reads(&store, &model);
            }
            store.crash();
            model.visible = model.durable.clone();
            check_reads(&store, &model);
        }
    }

    /// Goal: an outage switched on fails every operation `Unavailable` (transient) and
    /// changes nothing; switched off, the store answers as before; `may_be_unavailable`
    /// turns `true` at the first switch and stays so. Method: one committed actor, the
    /// outage on, each operation tried, the outage off, the same reads compared.
    #[test]
    fn an_outage_fails_every_operation_unavailable_and_changes_nothing() {
        let store = MemoryStore::new();
        let id = actor(0);
        assert!(!store.may_be_unavailable());
        let fence = ready(store.claim(&id)).unwrap().fence;
        let commit = TurnCommit {
            state: StateChange::Set(value(1)),
            writes: vec![("a/1".to_string(), Some(value(2)))],
        };
        ready(store.commit(&id, fence, commit.clone())).unwrap();

        store.faults().set_unavailable(true);
        assert!(store.may_be_unavailable());
        let unavailable = |operation| StoreError::Unavailable {
            operation,
            cause: MEMORY_STORE_OUTAGE_CAUSE.to_string(),
        };
        assert_eq!(ready(store.claim(&id)).unwrap_err(), unavailable(StoreOperation::Claim));
        assert_eq!(ready(store.load(&id)).unwrap_err(), unavailable(StoreOperation::Load));
        let other = TurnCommit {
            state: StateChange::Set(value(9)),
            writes: vec![("a/1".to_string(), None)],
        };
        assert_eq!(
            ready(store.commit(&id, fence, other)).unwrap_err(),
            unavailable(StoreOperation::Commit)
        );
        assert_eq!(
            ready(store.check_fence(&id, fence)).unwrap_err(),
            unavailable(StoreOperation::Commit)
        );
        assert_eq!(
            ready(store.get(&id, "a/1")).unwrap_err(),
            unavailable(StoreOperation::Get)
        );
        assert_eq!(
            ready(store.scan(&id, "a/", None, 10)).unwrap_err(),
            unavailable(StoreOperation::Scan)
        );
        assert!(unavailable(StoreOperation::Get).is_transient());
        assert_eq!(store.faults().injected_count(), 6);

        store.faults().set_unavailable(false);
        assert!(
            store.may_be_unavailable(),
            "once switched, the runtime keeps copies for good"
        );
        // Nothing changed: the same fence still commits, the state and entry are the first commit's.
        ready(store.check_fence(&id, fence)).unwrap();
        assert_eq!(ready(store.load(&id)).unwrap(), Some(value(1)));
        assert_eq!(ready(store.get(&id, "a/1")).unwrap(), Some(value(2)));
        ready(store.commit(&id, fence, commit)).unwrap();
        assert_eq!(store.faults().injected_count(), 6);
    }

    /// Goal: commits in write-back mode cost the actor's changed keys, not a copy of the
    /// store; a flush forgets the undo record and a crash replays it once. Method: many
    /// actors with many entries, one write-back commit to one of them, then the undo
    /// record holds that commit's keys only.
    #[test]
    fn write_back_commit_records_only_the_keys_it_changes() {
        let store = MemoryStore::new();
        let ids: Vec<ActorId> = (0..50)
            .map(|i| ActorId::new("agent", format!("a{i}")).unwrap())
            .collect();
        for id in &ids {
            let fence = ready(store.claim(id)).unwrap().fence;
            let writes = (0..100).map(|k| (format!("log/{k:03}"), Some(value(4)))).collect();
            let commit = TurnCommit {
                state: StateChange::Set(value(1)),
                writes,
            };
            ready(store.commit(id, fence, commit)).unwrap();
        }
        store.faults().set_write_back(true);
        let fence = ready(store.claim(&ids[7])).unwrap().fence;
        let commit = TurnCommit {
            state: StateChange::Unchanged,
            writes: vec![("log/100".to_string(), Some(value(5))), ("log/000".to_string(), None)],
        };
        ready(store.commit(&ids[7], fence, commit)).unwrap();
        {
            let disk = store.lock();
            assert_eq!(disk.unflushed, vec![ids[7].clone()]);
            let unflushed = disk.actors.get(&ids[7]).unwrap().unflushed.as_deref().unwrap();
            assert_eq!(unflushed.state, None);
            let recorded: Vec<(&str, bool)> = unflushed
                .entries
                .iter()
                .map(|(key, value)| (key.as_str(), value.is_some()))
                .collect();
            assert_eq!(recorded, vec![("log/000", true), ("log/100", false)]);
        }
        store.crash();
        assert!(store.lock().unflushed.is_empty());
        assert_eq!(ready(store.get(&ids[7], "log/000")).unwrap(), Some(value(4)));
        assert_eq!(ready(store.get(&ids[7], "log/100")).unwrap(), None);
        assert_eq!(store.actor_count(), 50);
    }

    /// Goal: an actor whose newest fence is the last one (`u64::MAX`, given through
    /// `claim_with_fence`) gets a store error from its next claim, not a panic while the
    /// store's lock is held (`Fence::next` overflowed); the fence stays what it was and
    /// its commits are still accepted. Method: claim under `u64::MAX`, claim again,
    /// commit under `u64::MAX`.
    #[test]
    fn a_claim_after_the_last_fence_is_an_error_not_a_panic() {
        let store = MemoryStore::new();
        let id = actor(0);
        let last = Fence::from_token(u64::MAX).unwrap();
        assert_eq!(ready(store.claim_with_fence(&id, last)).unwrap().fence, last);
        assert_eq!(
            ready(store.claim(&id)),
            Err(StoreError::Backend {
                operation: StoreOperation::Claim,
                cause: format!("{last} is the newest fence of {id}: no claim can issue a newer one"),
            })
        );
        assert_eq!(store.claim_now(&id).map(|claimed| claimed.is_err()), Some(true));
        let commit = TurnCommit {
            state: StateChange::Set(value(1)),
            writes: Vec::new(),
        };
        assert_eq!(ready(store.commit(&id, last, commit)), Ok(()));
    }
}

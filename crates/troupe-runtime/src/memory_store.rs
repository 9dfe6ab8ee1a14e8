//! An in-memory [`StateStore`] with fault injection, for tests and the simulator.
//!
//! Faults are switched on through [`MemoryStoreFaults`]:
//! - failing loads, commits or reads (the next `n`, or all until switched off);
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

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use troupe_core::ActorId;

use crate::state_store::{
    check_key, Claimed, Fence, FencedClaim, StateChange, StateStore, StoreError, StoreOperation, TurnCommit,
    STATE_SCAN_LIMIT_MAX,
};

#[derive(Clone, Default)]
struct Tables {
    states: BTreeMap<ActorId, Bytes>,
    entries: BTreeMap<(ActorId, String), Bytes>,
}

impl Tables {
    fn apply(&mut self, actor: &ActorId, commit: &TurnCommit) {
        match &commit.state {
            StateChange::Unchanged => {}
            StateChange::Set(state) => {
                self.states.insert(actor.clone(), state.clone());
            }
            StateChange::Deleted => {
                self.states.remove(actor);
            }
        }
        for (key, value) in &commit.writes {
            let entry_key = (actor.clone(), key.clone());
            match value {
                Some(value) => self.entries.insert(entry_key, value.clone()),
                None => self.entries.remove(&entry_key),
            };
        }
    }
}

#[derive(Default)]
struct Disk {
    visible: Tables,
    durable: Tables,
    /// Each claimed actor's newest fence; never lost by [`MemoryStore::crash`].
    fences: BTreeMap<ActorId, Fence>,
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
}

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

    /// How many operations have failed by injection so far.
    pub fn injected_count(&self) -> u64 {
        self.inner.injected.load(Ordering::SeqCst)
    }

    fn write_back(&self) -> bool {
        self.inner.write_back.load(Ordering::SeqCst)
    }

    fn take(&self, counter: &AtomicU64, operation: StoreOperation) -> Result<(), StoreError> {
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
        disk.durable = disk.visible.clone();
    }

    /// Models a power loss: everything committed but not flushed is lost. Without
    /// write-back mode every commit is durable at once and nothing is lost.
    pub fn crash(&self) {
        let mut disk = self.lock();
        disk.visible = disk.durable.clone();
    }

    /// How many actors have a committed state blob.
    pub fn actor_count(&self) -> usize {
        self.lock().visible.states.len()
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
        let current = disk.fences.get(actor).copied();
        if current.is_some_and(|newest| newest >= fence) {
            return Err(StoreError::Fenced {
                actor: actor.clone(),
                held: fence,
                current,
            });
        }
        disk.fences.insert(actor.clone(), fence);
        let state = disk.visible.states.get(actor).cloned();
        Ok(Claimed { fence, state })
    }
}

#[async_trait]
impl StateStore for MemoryStore {
    async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        self.faults.take(&self.faults.inner.fail_loads, StoreOperation::Claim)?;
        let mut disk = self.lock();
        let fence = disk.fences.get(actor).map_or(Fence::FIRST, |newest| newest.next());
        disk.fences.insert(actor.clone(), fence);
        let state = disk.visible.states.get(actor).cloned();
        Ok(Claimed { fence, state })
    }

    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        self.faults.take(&self.faults.inner.fail_loads, StoreOperation::Load)?;
        Ok(self.lock().visible.states.get(actor).cloned())
    }

    async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        commit.validate()?;
        self.faults
            .take(&self.faults.inner.fail_commits, StoreOperation::Commit)?;
        let write_back = self.faults.write_back();
        let mut disk = self.lock();
        let current = disk.fences.get(actor).copied();
        if current != Some(fence) {
            return Err(StoreError::Fenced {
                actor: actor.clone(),
                held: fence,
                current,
            });
        }
        disk.visible.apply(actor, &commit);
        if !write_back {
            disk.durable.apply(actor, &commit);
        }
        Ok(())
    }

    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        check_key(key)?;
        self.faults.take(&self.faults.inner.fail_reads, StoreOperation::Get)?;
        Ok(self
            .lock()
            .visible
            .entries
            .get(&(actor.clone(), key.to_string()))
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
        let start = (
            actor.clone(),
            after.map_or(prefix, |after| after.max(prefix)).to_string(),
        );
        let disk = self.lock();
        Ok(disk
            .visible
            .entries
            .range(start..)
            .take_while(|((owner, key), _)| owner == actor && key.starts_with(prefix))
            .filter(|((_, key), _)| after.is_none_or(|after| key.as_str() > after))
            .take(limit)
            .map(|((_, key), value)| (key.clone(), value.clone()))
            .collect())
    }
}

//! A store over shared data that a test can close: `dead` refuses every operation (the
//! process died; nothing it does reaches the data any more), `refuse_scans` refuses only
//! scans (so a start-up `resume_pending` fails), counting the scans it refused, and
//! `refuse_loads` only `load` (what reads the organisation; an activation claims), and
//! `refuse_one_commit` the first commit a test's predicate picks; `count_commits` and
//! `count_gets` count the commits and gets a test's predicate picks, and `hold_gets`
//! holds the gets it picks until `release_gets`. A second store over the same data is the
//! process after a restart.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use troupe_core::ActorId;
use troupe_runtime::{Claimed, Fence, StateStore, StoreError, StoreOperation, TurnCommit};

pub(crate) struct GateStore {
    inner: Arc<dyn StateStore>,
    pub(crate) dead: AtomicBool,
    pub(crate) refuse_scans: AtomicBool,
    pub(crate) refused_scans: AtomicU64,
    pub(crate) refuse_loads: AtomicBool,
    pub(crate) refused_loads: AtomicU64,
    /// Refuses the first commit it is true for, then is removed.
    refuse_commit: Mutex<Option<CommitPredicate>>,
    /// Counts the commits it is true for (see `count_commits`).
    counted: Mutex<Option<(CommitPredicate, u64)>>,
    /// Counts the gets it is true for (see `count_gets`).
    counted_gets: Mutex<Option<(GetPredicate, u64)>>,
    /// Holds the gets it is true for until released (see `hold_gets`).
    held_gets: Mutex<Option<GetPredicate>>,
    /// How many gets have been held.
    held: AtomicU64,
    /// `true` once `release_gets` let the held gets go on.
    released: AtomicBool,
    /// Wakes the held gets at `release_gets`.
    release: tokio::sync::Notify,
}

/// Which gets `GateStore::count_gets` counts: the actor and the key.
type GetPredicate = Box<dyn Fn(&ActorId, &str) -> bool + Send + Sync>;

/// Which commit `GateStore::refuse_one_commit` refuses.
type CommitPredicate = Box<dyn Fn(&ActorId, &TurnCommit) -> bool + Send + Sync>;

impl GateStore {
    pub(crate) fn new(inner: Arc<dyn StateStore>, refuse_scans: bool) -> Arc<Self> {
        Arc::new(Self {
            inner,
            dead: AtomicBool::new(false),
            refuse_scans: AtomicBool::new(refuse_scans),
            refused_scans: AtomicU64::new(0),
            refuse_loads: AtomicBool::new(false),
            refused_loads: AtomicU64::new(0),
            refuse_commit: Mutex::new(None),
            counted: Mutex::new(None),
            counted_gets: Mutex::new(None),
            held_gets: Mutex::new(None),
            held: AtomicU64::new(0),
            released: AtomicBool::new(false),
            release: tokio::sync::Notify::new(),
        })
    }

    /// From now on, holds the gets `pick` is true for until `release_gets`.
    #[allow(dead_code)]
    pub(crate) fn hold_gets(&self, pick: impl Fn(&ActorId, &str) -> bool + Send + Sync + 'static) {
        *self.held_gets.lock().unwrap() = Some(Box::new(pick));
    }

    /// How many gets `hold_gets` has held so far.
    #[allow(dead_code)]
    pub(crate) fn held_gets(&self) -> u64 {
        self.held.load(Ordering::SeqCst)
    }

    /// Lets every held get go on, and holds no more.
    #[allow(dead_code)]
    pub(crate) fn release_gets(&self) {
        *self.held_gets.lock().unwrap() = None;
        self.released.store(true, Ordering::SeqCst);
        self.release.notify_waiters();
    }

    /// Refuses (`Injected`) the first commit `pick` is true for, once.
    #[allow(dead_code)] // not every test that includes this file uses it
    pub(crate) fn refuse_one_commit(&self, pick: impl Fn(&ActorId, &TurnCommit) -> bool + Send + Sync + 'static) {
        *self.refuse_commit.lock().unwrap() = Some(Box::new(pick));
    }

    /// Whether the commit picked by `refuse_one_commit` has been refused.
    #[allow(dead_code)]
    pub(crate) fn refused_the_commit(&self) -> bool {
        self.refuse_commit.lock().unwrap().is_none()
    }

    /// From now on, counts the commits `pick` is true for (read with `counted_commits`).
    #[allow(dead_code)]
    pub(crate) fn count_commits(&self, pick: impl Fn(&ActorId, &TurnCommit) -> bool + Send + Sync + 'static) {
        *self.counted.lock().unwrap() = Some((Box::new(pick), 0));
    }

    /// How many commits `count_commits`'s predicate picked (refused ones too).
    #[allow(dead_code)]
    pub(crate) fn counted_commits(&self) -> u64 {
        self.counted.lock().unwrap().as_ref().map_or(0, |(_, count)| *count)
    }

    /// From now on, counts the gets `pick` is true for (read with `counted_gets`).
    #[allow(dead_code)]
    pub(crate) fn count_gets(&self, pick: impl Fn(&ActorId, &str) -> bool + Send + Sync + 'static) {
        *self.counted_gets.lock().unwrap() = Some((Box::new(pick), 0));
    }

    /// How many gets `count_gets`'s predicate picked.
    #[allow(dead_code)]
    pub(crate) fn counted_gets(&self) -> u64 {
        self.counted_gets
            .lock()
            .unwrap()
            .as_ref()
            .map_or(0, |(_, count)| *count)
    }

    fn check(&self, operation: StoreOperation) -> Result<(), StoreError> {
        if self.dead.load(Ordering::SeqCst) {
            return Err(StoreError::Injected { operation });
        }
        Ok(())
    }
}

#[async_trait]
impl StateStore for GateStore {
    async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        self.check(StoreOperation::Claim)?;
        self.inner.claim(actor).await
    }
    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        self.check(StoreOperation::Load)?;
        if self.refuse_loads.load(Ordering::SeqCst) {
            self.refused_loads.fetch_add(1, Ordering::SeqCst);
            return Err(StoreError::Injected {
                operation: StoreOperation::Load,
            });
        }
        self.inner.load(actor).await
    }
    async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        self.check(StoreOperation::Commit)?;
        if let Some((pick, count)) = self.counted.lock().unwrap().as_mut() {
            if pick(actor, &commit) {
                *count += 1;
            }
        }
        {
            let mut pick = self.refuse_commit.lock().unwrap();
            if pick.as_ref().is_some_and(|pick| pick(actor, &commit)) {
                *pick = None;
                return Err(StoreError::Injected {
                    operation: StoreOperation::Commit,
                });
            }
        }
        self.inner.commit(actor, fence, commit).await
    }
    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        self.check(StoreOperation::Get)?;
        if let Some((pick, count)) = self.counted_gets.lock().unwrap().as_mut() {
            if pick(actor, key) {
                *count += 1;
            }
        }
        let hold = self
            .held_gets
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|pick| pick(actor, key));
        if hold {
            self.held.fetch_add(1, Ordering::SeqCst);
            loop {
                let released = self.release.notified();
                tokio::pin!(released);
                // Registered before the check, so a release after it wakes this one.
                released.as_mut().enable();
                if self.released.load(Ordering::SeqCst) {
                    break;
                }
                released.await;
            }
        }
        self.inner.get(actor, key).await
    }
    async fn scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        self.check(StoreOperation::Scan)?;
        if self.refuse_scans.load(Ordering::SeqCst) {
            self.refused_scans.fetch_add(1, Ordering::SeqCst);
            return Err(StoreError::Injected {
                operation: StoreOperation::Scan,
            });
        }
        self.inner.scan(actor, prefix, after, limit).await
    }
}

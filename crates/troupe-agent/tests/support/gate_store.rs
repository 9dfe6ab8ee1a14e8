//! A store over shared data that a test can close: `dead` refuses every operation (the
//! process died; nothing it does reaches the data any more), `refuse_scans` refuses only
//! scans (so a start-up `resume_pending` fails), counting the scans it refused, and
//! `refuse_loads` only `load` (what reads the organisation; an activation claims), and
//! `refuse_one_commit` the first commit a test's predicate picks; `count_commits` and
//! `count_gets` count the commits and gets a test's predicate picks, and `hold_gets`
//! holds the gets it picks until `release_gets`; `claims` and `commits` hold the claims
//! and commits of the actors a test picks until released, a held commit in a task of its
//! own that lands whether or not its caller still waits (as SQLite's thread or a
//! PostgreSQL server finishes a write whose caller left). A second store over the same
//! data is the process after a restart.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use troupe_core::ActorId;
use troupe_runtime::{Claimed, Fence, StateStore, StoreError, StoreOperation, TurnCommit};

#[path = "forwarding_store.rs"]
mod forwarding_store;
use forwarding_store::{forwarding_state_store, ForwardingStore};

pub(crate) struct GateStore {
    inner: Arc<dyn StateStore>,
    pub(crate) dead: AtomicBool,
    pub(crate) refuse_scans: AtomicBool,
    pub(crate) refused_scans: AtomicU64,
    pub(crate) refuse_loads: AtomicBool,
    pub(crate) refused_loads: AtomicU64,
    /// Fails every fence check (`StoreError::Injected`, the store's failure, not a
    /// refusal of the fence), counting them; otherwise a check is `Ok` (the trait's
    /// default, as before this knob).
    pub(crate) fail_fence_checks: AtomicBool,
    pub(crate) failed_fence_checks: AtomicU64,
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
    /// Holds the claims of the actors it picks (see [`Hold`]).
    pub(crate) claims: Arc<Hold>,
    /// Holds the commits of the actors it picks, each in a task of its own.
    pub(crate) commits: Arc<Hold>,
}

/// Holds the operations on the actors a test picks (`hold`) until `release`.
#[derive(Default)]
pub(crate) struct Hold {
    pick: Mutex<Option<ActorPredicate>>,
    /// How many operations it has held.
    held: AtomicU64,
    /// How many held operations have been done since (successfully or not).
    done: AtomicU64,
    /// Bumped by each `release`: an operation held before it goes on.
    releases: AtomicU64,
    release: tokio::sync::Notify,
}

/// Which actors' operations a [`Hold`] holds.
type ActorPredicate = Box<dyn Fn(&ActorId) -> bool + Send + Sync>;

#[allow(dead_code)] // not every test that includes this file uses it
impl Hold {
    /// From now on, holds the operations on the actors `pick` is true for.
    pub(crate) fn hold(&self, pick: impl Fn(&ActorId) -> bool + Send + Sync + 'static) {
        *self.pick.lock().unwrap() = Some(Box::new(pick));
    }

    /// How many operations it has held so far.
    pub(crate) fn held(&self) -> u64 {
        self.held.load(Ordering::SeqCst)
    }

    /// How many held operations have been done (successfully or not).
    pub(crate) fn done(&self) -> u64 {
        self.done.load(Ordering::SeqCst)
    }

    /// Lets every held operation go on, and holds no more.
    pub(crate) fn release(&self) {
        *self.pick.lock().unwrap() = None;
        self.releases.fetch_add(1, Ordering::SeqCst);
        self.release.notify_waiters();
    }

    /// Whether an operation on `actor` is to be held; if so, counts it and returns the
    /// release it waits for.
    fn picks(&self, actor: &ActorId) -> Option<u64> {
        let picked = self.pick.lock().unwrap().as_ref().is_some_and(|pick| pick(actor));
        picked.then(|| {
            self.held.fetch_add(1, Ordering::SeqCst);
            self.releases.load(Ordering::SeqCst) + 1
        })
    }

    /// Waits until `release` has been called `release` times in all.
    async fn wait(&self, release: u64) {
        loop {
            let released = self.release.notified();
            tokio::pin!(released);
            // Registered before the check, so a release after it wakes this one.
            released.as_mut().enable();
            if self.releases.load(Ordering::SeqCst) >= release {
                return;
            }
            released.await;
        }
    }
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
            fail_fence_checks: AtomicBool::new(false),
            failed_fence_checks: AtomicU64::new(0),
            refuse_commit: Mutex::new(None),
            counted: Mutex::new(None),
            counted_gets: Mutex::new(None),
            held_gets: Mutex::new(None),
            held: AtomicU64::new(0),
            released: AtomicBool::new(false),
            release: tokio::sync::Notify::new(),
            claims: Arc::default(),
            commits: Arc::default(),
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
}

#[async_trait]
impl ForwardingStore for GateStore {
    type Inner = dyn StateStore;

    fn inner(&self) -> &Self::Inner {
        &*self.inner
    }

    /// `dead` refuses every operation; then `refuse_loads` the loads and `refuse_scans`
    /// the scans, each counted.
    fn gate(&self, _actor: &ActorId, operation: StoreOperation) -> Result<(), StoreError> {
        if self.dead.load(Ordering::SeqCst) {
            return Err(StoreError::Injected { operation });
        }
        let refused = match operation {
            StoreOperation::Load if self.refuse_loads.load(Ordering::SeqCst) => &self.refused_loads,
            StoreOperation::Scan if self.refuse_scans.load(Ordering::SeqCst) => &self.refused_scans,
            _ => return Ok(()),
        };
        refused.fetch_add(1, Ordering::SeqCst);
        Err(StoreError::Injected { operation })
    }

    async fn forward_check_fence(&self, _actor: &ActorId, _fence: Fence) -> Result<(), StoreError> {
        if self.fail_fence_checks.load(Ordering::SeqCst) {
            self.failed_fence_checks.fetch_add(1, Ordering::SeqCst);
            return Err(StoreError::Injected {
                operation: StoreOperation::Get,
            });
        }
        Ok(())
    }
    async fn forward_claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        self.gate(actor, StoreOperation::Claim)?;
        if let Some(release) = self.claims.picks(actor) {
            self.claims.wait(release).await;
            let claimed = self.inner.claim(actor).await;
            self.claims.done.fetch_add(1, Ordering::SeqCst);
            return claimed;
        }
        self.inner.claim(actor).await
    }
    async fn forward_commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        self.gate(actor, StoreOperation::Commit)?;
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
        if let Some(release) = self.commits.picks(actor) {
            let (hold, inner, actor) = (Arc::clone(&self.commits), Arc::clone(&self.inner), actor.clone());
            // In a task of its own: it lands whether or not this caller still waits.
            let landing = tokio::spawn(async move {
                hold.wait(release).await;
                let committed = inner.commit(&actor, fence, commit).await;
                hold.done.fetch_add(1, Ordering::SeqCst);
                committed
            });
            return landing.await.expect("a held commit does not panic");
        }
        self.inner.commit(actor, fence, commit).await
    }
    async fn forward_get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        self.gate(actor, StoreOperation::Get)?;
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
}

forwarding_state_store!(GateStore);

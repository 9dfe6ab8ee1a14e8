//! The simulated disk behind each node's runtime, and the planted storage bugs.
//!
//! A [`MemoryStore`] is the disk: its `Arc` lives outside the simulated node, so it
//! survives a kill. [`SyncingStore`] is what the runtime commits to; its [`StoreMode`]
//! decides when a commit is acknowledged relative to when it is durable.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use troupe_core::ActorId;
use troupe_runtime::{Claimed, Fence, MemoryStore, StateChange, StateStore, StoreError, TurnCommit};

/// When a commit is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StoreMode {
    /// Write-through: every commit is durable when it returns.
    #[default]
    Durable,
    /// A disk with a write cache and an fsync of `latency_ms`: the commit is visible at
    /// once, durable after the fsync, acknowledged only after the fsync. A crash during
    /// the fsync loses the unflushed commit, which was never acknowledged.
    Fsync {
        /// How long an fsync takes, in virtual milliseconds.
        latency_ms: u64,
    },
    /// Planted bug: the commit is acknowledged before it is durable; a lazy writer
    /// flushes every `flush_every_ms`. A crash loses acknowledged turns.
    BugAckBeforeFlush {
        /// The lazy writer's period, in virtual milliseconds.
        flush_every_ms: u64,
    },
    /// Planted bug: a turn's writes are committed one by one, 1 ms apart, then its
    /// state; a crash or a storage failure in between leaves a partial turn.
    BugSplitCommit,
}

impl StoreMode {
    /// Whether the disk runs with its write cache on.
    pub fn write_back(self) -> bool {
        !matches!(self, Self::Durable | Self::BugSplitCommit)
    }
}

/// The store a simulated node's runtime commits to. See the module documentation.
pub struct SyncingStore {
    disk: MemoryStore,
    mode: StoreMode,
}

impl SyncingStore {
    /// A store over `disk` behaving as `mode`; sets the disk's write-back mode to match.
    pub fn new(disk: MemoryStore, mode: StoreMode) -> Arc<Self> {
        disk.faults().set_write_back(mode.write_back());
        Arc::new(Self { disk, mode })
    }

    /// The disk underneath.
    pub fn disk(&self) -> &MemoryStore {
        &self.disk
    }
}

#[async_trait]
impl StateStore for SyncingStore {
    async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        self.disk.claim(actor).await
    }

    /// The disk's answer: a node sharing the disk ([`crate::Disk::Shared`]) learns
    /// there that another claimed the actor since, as two processes on one file do.
    async fn check_fence(&self, actor: &ActorId, fence: Fence) -> Result<(), StoreError> {
        self.disk.check_fence(actor, fence).await
    }

    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        self.disk.load(actor).await
    }

    async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        match self.mode {
            StoreMode::Durable | StoreMode::BugAckBeforeFlush { .. } => self.disk.commit(actor, fence, commit).await,
            StoreMode::Fsync { latency_ms } => {
                self.disk.commit(actor, fence, commit).await?;
                tokio::time::sleep(Duration::from_millis(latency_ms)).await;
                self.disk.flush();
                Ok(())
            }
            StoreMode::BugSplitCommit => {
                commit.validate()?;
                for write in commit.writes {
                    let piece = TurnCommit {
                        state: StateChange::Unchanged,
                        writes: vec![write],
                    };
                    self.disk.commit(actor, fence, piece).await?;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                self.disk
                    .commit(
                        actor,
                        fence,
                        TurnCommit {
                            state: commit.state,
                            writes: Vec::new(),
                        },
                    )
                    .await
            }
        }
    }

    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        self.disk.get(actor, key).await
    }

    async fn scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        self.disk.scan(actor, prefix, after, limit).await
    }
}

/// Which actors' commits an [`InFlightStore`] delays.
pub type ActorPick = Box<dyn Fn(&ActorId) -> bool + Send + Sync>;

/// A store whose commits to the actors `pick` chooses take a random time, up to
/// `latency_ms_max` virtual milliseconds each, and run in a task of their own: such a
/// commit lands (or is refused as fenced) whether or not its caller still waits for it,
/// as a write handed to SQLite's thread or sent to a PostgreSQL server does. A caller
/// that gives up while its write is in flight does not take the write back.
pub struct InFlightStore {
    disk: MemoryStore,
    latency_ms_max: u64,
    pick: ActorPick,
    rng: std::sync::Mutex<crate::SimRng>,
}

impl InFlightStore {
    /// A store over `disk` whose commits to the actors `pick` chooses are in flight for
    /// up to `latency_ms_max` virtual milliseconds (drawn from the simulation's seed).
    pub fn new(
        disk: MemoryStore,
        latency_ms_max: u64,
        pick: impl Fn(&ActorId) -> bool + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(Self {
            disk,
            latency_ms_max,
            pick: Box::new(pick),
            rng: std::sync::Mutex::new(crate::SimRng::new()),
        })
    }

    /// The disk underneath.
    pub fn disk(&self) -> &MemoryStore {
        &self.disk
    }
}

#[async_trait]
impl StateStore for InFlightStore {
    async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        self.disk.claim(actor).await
    }

    /// The disk's answer (a write still in flight does not change the fence).
    async fn check_fence(&self, actor: &ActorId, fence: Fence) -> Result<(), StoreError> {
        self.disk.check_fence(actor, fence).await
    }

    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        self.disk.load(actor).await
    }

    async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        if !(self.pick)(actor) {
            return self.disk.commit(actor, fence, commit).await;
        }
        let latency = Duration::from_millis(
            self.rng
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .range(0, self.latency_ms_max + 1),
        );
        let (disk, actor) = (self.disk.clone(), actor.clone());
        let landing = tokio::spawn(async move {
            tokio::time::sleep(latency).await;
            disk.commit(&actor, fence, commit).await
        });
        landing.await.unwrap_or_else(|error| {
            Err(StoreError::Backend {
                operation: troupe_runtime::StoreOperation::Commit,
                cause: format!("the write's task ended: {error}"),
            })
        })
    }

    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        self.disk.get(actor, key).await
    }

    async fn scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        self.disk.scan(actor, prefix, after, limit).await
    }
}

//! A store on a slow disk for the cluster simulations (madsim only): every operation
//! first waits a random time, drawn from the seed, as the node's [`DiskProfile`] says.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use troupe_core::ActorId;
use troupe_runtime::{Claimed, Fence, FencedClaim, StateStore, StoreError, TurnCommit};

/// How a node's disk behaves: every claim, load, commit, get and scan first waits a
/// random time up to `typical_ms`; one in `stall_every` waits `stall_ms` instead (0:
/// never).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DiskProfile {
    pub(crate) typical_ms: u64,
    pub(crate) stall_every: u64,
    pub(crate) stall_ms: u64,
}

impl DiskProfile {
    pub(crate) const FAST: Self = Self {
        typical_ms: 0,
        stall_every: 0,
        stall_ms: 0,
    };
}

/// A store on a slow disk: waits as its [`DiskProfile`] says before each operation, and
/// counts the operations that waited in `slow_ops`.
#[derive(Clone)]
pub(crate) struct SlowDisk<S> {
    inner: S,
    profile: DiskProfile,
    slow_ops: Arc<AtomicU64>,
}

impl<S> SlowDisk<S> {
    /// `inner` behind a disk of `profile`; each operation that waits adds one to
    /// `slow_ops`.
    pub(crate) fn new(inner: S, profile: DiskProfile, slow_ops: Arc<AtomicU64>) -> Self {
        Self {
            inner,
            profile,
            slow_ops,
        }
    }

    async fn wait(&self) {
        use madsim::rand::Rng;
        let profile = self.profile;
        let ms = {
            let mut rng = madsim::rand::thread_rng();
            if profile.stall_every > 0 && rng.gen_range(0..profile.stall_every) == 0 {
                profile.stall_ms
            } else if profile.typical_ms > 0 {
                rng.gen_range(0..=profile.typical_ms)
            } else {
                0
            }
        };
        if ms > 0 {
            self.slow_ops.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }
}

#[async_trait::async_trait]
impl<S: FencedClaim + Clone> StateStore for SlowDisk<S> {
    async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        self.wait().await;
        self.inner.claim(actor).await
    }

    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        self.wait().await;
        self.inner.load(actor).await
    }

    async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        self.wait().await;
        self.inner.commit(actor, fence, commit).await
    }

    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        self.wait().await;
        self.inner.get(actor, key).await
    }

    async fn scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        self.wait().await;
        self.inner.scan(actor, prefix, after, limit).await
    }
}

#[async_trait::async_trait]
impl<S: FencedClaim + Clone> FencedClaim for SlowDisk<S> {
    async fn claim_with_fence(&self, actor: &ActorId, fence: Fence) -> Result<Claimed, StoreError> {
        self.wait().await;
        self.inner.claim_with_fence(actor, fence).await
    }
}

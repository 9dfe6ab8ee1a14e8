//! A memory store whose organisation's record (`troupe-org/org`) fails `Unavailable`
//! while a test says so, the agents' own activations and turns going on: for tests of
//! admission and organisation changes during an outage of that record.

#![allow(dead_code)] // each test file uses part of it

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use troupe_agent::ORG_STORE_KIND;
use troupe_core::ActorId;
use troupe_runtime::{Claimed, Fence, MemoryStore, StateStore, StoreError, StoreOperation, TurnCommit};

/// A memory store whose organisation's record fails `Unavailable` while `org_down`.
#[derive(Default)]
pub(crate) struct OrgOutage {
    pub(crate) inner: MemoryStore,
    pub(crate) org_down: AtomicBool,
    /// Set: the next commit of the organisation's record that lands sets `org_down`
    /// (the outage starts just after a write, within one request).
    pub(crate) down_after_commit: AtomicBool,
    /// Set: the next commit of the organisation's record that lands is followed by a
    /// claim of the record (another process's, in effect) and answers `Unavailable`: a
    /// commit that landed unseen, whose writer then finds its fence taken.
    pub(crate) unseen_then_claimed: AtomicBool,
    /// How many operations on the organisation's record failed.
    pub(crate) org_failures: AtomicU64,
}

impl OrgOutage {
    fn check(&self, actor: &ActorId, operation: StoreOperation) -> Result<(), StoreError> {
        if actor.kind().as_str() == ORG_STORE_KIND && self.org_down.load(Ordering::SeqCst) {
            self.org_failures.fetch_add(1, Ordering::SeqCst);
            return Err(StoreError::Unavailable {
                operation,
                cause: "connection refused (the test's outage)".to_string(),
            });
        }
        Ok(())
    }
}

#[async_trait]
impl StateStore for OrgOutage {
    async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        self.check(actor, StoreOperation::Claim)?;
        self.inner.claim(actor).await
    }

    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        self.check(actor, StoreOperation::Load)?;
        self.inner.load(actor).await
    }

    async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        self.check(actor, StoreOperation::Commit)?;
        self.inner.commit(actor, fence, commit).await?;
        if actor.kind().as_str() == ORG_STORE_KIND && self.down_after_commit.swap(false, Ordering::SeqCst) {
            self.org_down.store(true, Ordering::SeqCst);
        }
        if actor.kind().as_str() == ORG_STORE_KIND && self.unseen_then_claimed.swap(false, Ordering::SeqCst) {
            self.inner.claim(actor).await?;
            self.org_failures.fetch_add(1, Ordering::SeqCst);
            return Err(StoreError::Unavailable {
                operation: StoreOperation::Commit,
                cause: "the answer was lost after the commit landed (the test's fault)".to_string(),
            });
        }
        Ok(())
    }

    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        self.check(actor, StoreOperation::Get)?;
        self.inner.get(actor, key).await
    }

    async fn scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        self.check(actor, StoreOperation::Scan)?;
        self.inner.scan(actor, prefix, after, limit).await
    }
}

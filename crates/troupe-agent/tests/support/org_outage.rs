//! A memory store whose organisation's record (`troupe-org/org`) fails `Unavailable`
//! while a test says so, the agents' own activations and turns going on: for tests of
//! admission and organisation changes during an outage of that record.

#![allow(dead_code)] // each test file uses part of it

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use async_trait::async_trait;
use troupe_agent::ORG_STORE_KIND;
use troupe_core::ActorId;
use troupe_runtime::{MemoryStore, StateStore, StoreError, StoreOperation};

#[path = "forwarding_store.rs"]
mod forwarding_store;
use forwarding_store::{forwarding_state_store, ForwardingStore};

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

#[async_trait]
impl ForwardingStore for OrgOutage {
    type Inner = MemoryStore;

    fn inner(&self) -> &MemoryStore {
        &self.inner
    }

    fn gate(&self, actor: &ActorId, operation: StoreOperation) -> Result<(), StoreError> {
        if actor.kind().as_str() == ORG_STORE_KIND && self.org_down.load(Ordering::SeqCst) {
            self.org_failures.fetch_add(1, Ordering::SeqCst);
            return Err(StoreError::Unavailable {
                operation,
                cause: "connection refused (the test's outage)".to_string(),
            });
        }
        Ok(())
    }

    async fn committed(&self, actor: &ActorId) -> Result<(), StoreError> {
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
}

forwarding_state_store!(OrgOutage);

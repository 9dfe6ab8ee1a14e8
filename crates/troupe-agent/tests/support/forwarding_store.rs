//! One piece for the test stores that wrap another store and change one or two of its
//! operations. A [`ForwardingStore`] forwards each operation to its `inner()` store once
//! its `gate` lets it through, and answers a commit the inner store applied by its
//! `committed`; a store writes only what it changes (a hook, or a `forward_…` method),
//! and `forwarding_state_store!(Store)` makes it a `StateStore` by these methods
//! (`forwarding_state_store!(Store, fenced)` a `FencedClaim` too, gated as a claim).
//!
//! Not forwarded: `check_fence` answers `Ok(())` unless a store writes
//! `forward_check_fence`, and `claim_now` and `may_be_unavailable` keep the trait's
//! defaults (`None`, `true`), as each of these stores had them when it spelled every
//! operation out. The macro names `ForwardingStore`, so the file that calls it has the
//! trait in scope.
#![allow(dead_code)] // each test file uses part of it

use async_trait::async_trait;
use bytes::Bytes;
use troupe_core::ActorId;
use troupe_runtime::{Claimed, Fence, StateStore, StoreError, StoreOperation, TurnCommit};

/// A test store over `inner()`: each `forward_x` is `StateStore::x`, gated by `gate`.
#[async_trait]
pub(crate) trait ForwardingStore: Send + Sync + 'static {
    type Inner: StateStore + ?Sized;

    /// The store the operations go on to.
    fn inner(&self) -> &Self::Inner;

    /// Runs before each operation on `actor`; an error is the operation's answer, and
    /// the operation does not reach the inner store.
    fn gate(&self, _actor: &ActorId, _operation: StoreOperation) -> Result<(), StoreError> {
        Ok(())
    }

    /// Runs once the inner store applied a commit of `actor`; its answer is the
    /// commit's (an error: applied but reported failed).
    async fn committed(&self, _actor: &ActorId) -> Result<(), StoreError> {
        Ok(())
    }

    async fn forward_claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        self.gate(actor, StoreOperation::Claim)?;
        self.inner().claim(actor).await
    }

    async fn forward_load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        self.gate(actor, StoreOperation::Load)?;
        self.inner().load(actor).await
    }

    async fn forward_commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        self.gate(actor, StoreOperation::Commit)?;
        self.inner().commit(actor, fence, commit).await?;
        self.committed(actor).await
    }

    async fn forward_check_fence(&self, _actor: &ActorId, _fence: Fence) -> Result<(), StoreError> {
        Ok(())
    }

    async fn forward_get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        self.gate(actor, StoreOperation::Get)?;
        self.inner().get(actor, key).await
    }

    async fn forward_scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        self.gate(actor, StoreOperation::Scan)?;
        self.inner().scan(actor, prefix, after, limit).await
    }
}

/// `StateStore` for `$store` by its [`ForwardingStore`] methods; with `fenced`,
/// `FencedClaim` too.
macro_rules! forwarding_state_store {
    ($store:ty) => {
        const _: () = {
            use bytes::Bytes;
            use troupe_core::ActorId;
            use troupe_runtime::{Claimed, Fence, StateStore, StoreError, TurnCommit};

            #[async_trait::async_trait]
            impl StateStore for $store {
                async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
                    self.forward_claim(actor).await
                }
                async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
                    self.forward_load(actor).await
                }
                async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
                    self.forward_commit(actor, fence, commit).await
                }
                async fn check_fence(&self, actor: &ActorId, fence: Fence) -> Result<(), StoreError> {
                    self.forward_check_fence(actor, fence).await
                }
                async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
                    self.forward_get(actor, key).await
                }
                async fn scan(
                    &self,
                    actor: &ActorId,
                    prefix: &str,
                    after: Option<&str>,
                    limit: usize,
                ) -> Result<Vec<(String, Bytes)>, StoreError> {
                    self.forward_scan(actor, prefix, after, limit).await
                }
            }
        };
    };
    ($store:ty, fenced) => {
        forwarding_state_store!($store);

        const _: () = {
            use troupe_core::ActorId;
            use troupe_runtime::{Claimed, Fence, FencedClaim, StoreError, StoreOperation};

            #[async_trait::async_trait]
            impl FencedClaim for $store {
                async fn claim_with_fence(&self, actor: &ActorId, fence: Fence) -> Result<Claimed, StoreError> {
                    self.gate(actor, StoreOperation::Claim)?;
                    self.inner().claim_with_fence(actor, fence).await
                }
            }
        };
    };
}
pub(crate) use forwarding_state_store;

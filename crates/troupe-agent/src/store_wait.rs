//! The agent layer's own store operations made outside a turn, tried again while the
//! store is down for a moment (`StoreError::Unavailable`: PostgreSQL restarting, a
//! connection refused, SQLite's file locked) through [`RuntimeHandle::retry_store`]:
//! an agent's committed records read by the API (its task, its inbox and outbox
//! lengths, its log), the stored agent directory and the organisation read and
//! changed (`shared_record.rs`'s claim and commit).
//!
//! [`WaitingStore`] is the runtime's store with each operation made through
//! `retry_store` until one deadline, handed to code that takes a `&dyn StateStore`
//! (`shared_record::change`, `OrgStore`). What it makes again may be made twice: a read;
//! a claim (one applied unseen costs a fence); a commit, made again as the same commit
//! under the same fence with the same writes, which are absolute (a value set or a key
//! deleted, never an increment): one applied unseen is applied again to the same
//! effect, or refused `Fenced` if another process claimed since (then
//! `shared_record::change` claims again and decides on the newest record, which holds
//! the change applied unseen: a creation then answers that the item exists).

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use troupe_core::{ActorId, Deadline, StoreError};
use troupe_runtime::{Claimed, Fence, RuntimeHandle, StateStore, TurnCommit};

use crate::AgentClient;

/// How long a store operation of an [`AgentClient`] method that takes no timeout is
/// tried again while the store is unavailable, in milliseconds from the call (one
/// deadline for all of a call's operations): an agent's task, inbox and outbox lengths
/// and log read by the API ([`AgentClient::task`], [`AgentClient::pending`],
/// [`AgentClient::conversation_log_page`], ...), the stored agent directory and the
/// organisation read again or changed ([`AgentClient::reload_directory`],
/// [`AgentClient::define_agent`], [`AgentClient::reload_org`], [`AgentClient::add_link`],
/// ...). The same 10 s as [`crate::CONVERSATION_READ_STORE_WAIT_MS`], for the same
/// reasons: it rides out a restart of PostgreSQL (1–5 s), and a client told 503 with
/// `Retry-After` after that may ask again, well within the server's request timeout
/// (130 s by default).
pub const AGENT_API_STORE_WAIT_MS: u64 = 10_000;

const _: () = assert!(AGENT_API_STORE_WAIT_MS >= troupe_runtime::STORE_RETRY_PAUSE_MS_MAX);
const _: () = assert!(AGENT_API_STORE_WAIT_MS <= crate::limits::AGENT_DELIVERY_ACK_TIMEOUT_MS);

/// The runtime's store, each operation tried again while unavailable until `deadline`
/// (see the module doc for what that makes twice).
pub(crate) struct WaitingStore {
    runtime: RuntimeHandle,
    deadline: Deadline,
}

impl WaitingStore {
    /// The store of `runtime`, its operations tried again until `deadline`.
    pub(crate) fn until(runtime: &RuntimeHandle, deadline: Deadline) -> Self {
        Self {
            runtime: runtime.clone(),
            deadline,
        }
    }

    /// The store of `runtime`, its operations tried again for
    /// [`AGENT_API_STORE_WAIT_MS`] from now.
    pub(crate) fn for_api(runtime: &RuntimeHandle) -> Self {
        Self::until(
            runtime,
            runtime.deadline_in(Duration::from_millis(AGENT_API_STORE_WAIT_MS)),
        )
    }
}

impl AgentClient {
    /// The runtime's store for one call of an API method that takes no timeout: its
    /// operations tried again while unavailable for [`AGENT_API_STORE_WAIT_MS`] from now.
    pub(crate) fn api_store(&self) -> WaitingStore {
        WaitingStore::for_api(&self.runtime)
    }
}

#[async_trait]
impl StateStore for WaitingStore {
    async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        let store = self.runtime.store();
        self.runtime
            .retry_store(self.deadline, "claim", actor, || store.claim(actor))
            .await
    }

    fn may_be_unavailable(&self) -> bool {
        self.runtime.store().may_be_unavailable()
    }

    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        let store = self.runtime.store();
        self.runtime
            .retry_store(self.deadline, "load", actor, || store.load(actor))
            .await
    }

    async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        let store = self.runtime.store();
        // Every try the same commit under the same fence (see the module doc).
        self.runtime
            .retry_store(self.deadline, "commit", actor, || {
                store.commit(actor, fence, commit.clone())
            })
            .await
    }

    async fn check_fence(&self, actor: &ActorId, fence: Fence) -> Result<(), StoreError> {
        let store = self.runtime.store();
        self.runtime
            .retry_store(self.deadline, "check_fence", actor, || store.check_fence(actor, fence))
            .await
    }

    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        let store = self.runtime.store();
        self.runtime
            .retry_store(self.deadline, "get", actor, || store.get(actor, key))
            .await
    }

    async fn scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        let store = self.runtime.store();
        self.runtime
            .retry_store(self.deadline, "scan", actor, || store.scan(actor, prefix, after, limit))
            .await
    }
}

//! A root router (as a cluster node installs) that runs every request on its own
//! runtime and records the keys of the keyed ones: for the tests that check a keyed
//! request reaches the router with its key.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use troupe_core::{ActorId, Deadline, InvokeError};
use troupe_runtime::{IdempotencyKey, RootCallRouter, RuntimeHandle};

pub(crate) struct KeyedRootRouter {
    handle: RuntimeHandle,
    /// The key of each keyed request, in order.
    pub(crate) keyed: Mutex<Vec<String>>,
}

impl KeyedRootRouter {
    /// Installs a new one as `handle`'s root router.
    pub(crate) fn install(handle: &RuntimeHandle) -> Arc<Self> {
        let router = Arc::new(Self {
            handle: handle.clone(),
            keyed: Mutex::default(),
        });
        assert!(handle.set_root_call_router(router.clone()).is_ok(), "no router yet");
        router
    }
}

#[async_trait]
impl RootCallRouter for KeyedRootRouter {
    async fn invoke_root(&self, target: &ActorId, payload: Bytes, deadline: Deadline) -> Result<Bytes, InvokeError> {
        self.handle.invoke_root_for_router(target, payload, deadline).await
    }

    async fn invoke_root_keyed(
        &self,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        deadline: Deadline,
    ) -> Result<Bytes, InvokeError> {
        self.keyed.lock().unwrap().push(key.to_string());
        self.handle
            .invoke_root_keyed_for_router(target, key, payload, deadline)
            .await
    }
}

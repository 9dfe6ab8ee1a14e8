//! The echo actor the runtime benchmarks measure, and a runtime with it registered.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use troupe::core::{ActorId, ActorKind};
use troupe::runtime::{Actor, ActorBox, ActorError, KindConfig, MemoryStore, Runtime, Turn};

/// How long an echo actor stays active without a message: longer than any benchmark, so
/// none is deactivated while it is measured.
pub(crate) const ECHO_IDLE_TIMEOUT: Duration = Duration::from_secs(3_600);

/// Answers every message with the message itself; stateless.
pub(crate) struct Echo;

impl Actor for Echo {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        Ok(payload)
    }
}

/// A runtime on an in-memory store with the kind `echo` registered.
pub(crate) fn echo_runtime() -> Runtime {
    let config = KindConfig::default().with_idle_timeout(ECHO_IDLE_TIMEOUT);
    Runtime::builder()
        .store(Arc::new(MemoryStore::new()))
        .register(
            ActorKind::new("echo").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Echo)) },
            config,
        )
        .unwrap()
        .start()
}

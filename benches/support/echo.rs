//! The echo actor the runtime benchmarks measure, and a runtime with it registered.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use troupe::core::{ActorId, ActorKind};
use troupe::runtime::{Actor, ActorBox, ActorError, KindConfig, MemoryStore, Runtime, RuntimeBuilder, Turn};

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

/// Calls `echo/0` from its turn (`Turn::invoke`, a call with a wait-for edge) with the
/// message it got, and answers with the echo's reply: a relay's round trip is an
/// invoke plus one call from a turn. (Not every bench that includes this file uses it.)
#[allow(dead_code)]
pub(crate) struct Relay;

/// The relay's call's timeout: longer than any run.
#[allow(dead_code)]
const RELAY_CALL_TIMEOUT: Duration = Duration::from_secs(60);

impl Actor for Relay {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let echo = ActorId::new("echo", "0").expect("a valid id");
        Ok(turn.invoke(&echo, payload, RELAY_CALL_TIMEOUT).await?)
    }
}

/// A runtime on an in-memory store with the kinds `echo` and `relay` registered.
#[allow(dead_code)]
pub(crate) fn relay_runtime() -> Runtime {
    echo_builder()
        .register(
            ActorKind::new("relay").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Relay)) },
            KindConfig::default().with_idle_timeout(ECHO_IDLE_TIMEOUT),
        )
        .unwrap()
        .start()
}

/// A runtime on an in-memory store with the kind `echo` registered.
#[allow(dead_code)]
pub(crate) fn echo_runtime() -> Runtime {
    echo_builder().start()
}

/// A builder on an in-memory store with the kind `echo` registered.
fn echo_builder() -> RuntimeBuilder {
    Runtime::builder()
        .store(Arc::new(MemoryStore::new()))
        .register(
            ActorKind::new("echo").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Echo)) },
            KindConfig::default().with_idle_timeout(ECHO_IDLE_TIMEOUT),
        )
        .unwrap()
}

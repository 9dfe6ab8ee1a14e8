//! The HTTP answer to a store down for a moment on another node: the error a caller
//! gets over the cluster transport from a host whose store is down is answered as the
//! host's own server answers it, 503 `storage_unavailable` with `Retry-After`, not 500
//! `storage_failed`.
//!
//! Goal: the answer below the routes ([`ApiError`] from the `InvokeError`, what every
//! `troupe serve` route and `troupe node`'s agent routes use) of a call that crossed
//! nodes. Before transport protocol version 8 the wire carried `StoreError::Unavailable`
//! as `Backend`, and this answer was 500 `storage_failed` ("do not retry").
//!
//! Method: a host runtime on a store that fails every operation `Unavailable` behind a
//! `TransportServer` on loopback; a `TransportClient` calls an actor there; its error is
//! turned into the HTTP response. Not a whole two-node cluster (etcd and PostgreSQL):
//! the error is the real one from the wire, the route's mapping the real one.
//! Normal build only (real TCP).
#![cfg(not(madsim))]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use troupe_core::{ActorId, ActorKind, CallContext, InvokeError};
use troupe_runtime::{
    Actor, ActorBox, ActorError, Clock, KindConfig, MemoryStore, Runtime, StoreError, StoreOperation, TransportClient,
    TransportServer, Turn, MEMORY_STORE_OUTAGE_CAUSE,
};
use troupe_server::ApiError;

/// The call's deadline, in milliseconds: the host tries its store again until then.
const CALL_MS: u64 = 500;
/// Replies with its payload.
struct Echo;

impl Actor for Echo {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        Ok(payload)
    }
}

/// The error of a call from another node to an actor on a host whose store is down.
async fn remote_error() -> InvokeError {
    // A store that is down throughout: every operation fails `Unavailable`.
    let store = MemoryStore::new();
    store.faults().set_unavailable(true);
    let host = Runtime::builder()
        .store(Arc::new(store))
        .register(
            ActorKind::new("echo").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Echo)) },
            KindConfig::default(),
        )
        .unwrap()
        .start();
    let address: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let server = TransportServer::bind(address, host.handle()).await.unwrap();
    let clock = Clock::new();
    let client = TransportClient::new(server.local_address(), clock);
    let target = ActorId::new("echo", "e").unwrap();
    // Made once: the host stops trying its store 5 to 10 ms before its deadline, which
    // is the caller's made earlier by the connection's return allowance (at least
    // `RETURN_ALLOWANCE_MS_MIN`), so its answer arrives before the caller gives up.
    let context = CallContext::root(clock.deadline_in(Duration::from_millis(CALL_MS)));
    let error = client
        .invoke(&target, Bytes::from_static(b"hi"), context, None)
        .await
        .expect_err("the host's store is down");
    drop(server);
    host.shutdown().await;
    error
}

/// Goal and method: see the file's documentation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_down_for_a_moment_on_another_node_is_answered_503_storage_unavailable_with_retry_after() {
    let error = remote_error().await;
    let api = ApiError::from(&error);
    assert_eq!(
        (api.status, api.code),
        (StatusCode::SERVICE_UNAVAILABLE, "storage_unavailable"),
        "{error}"
    );
    let response = api.into_response();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let retry_after = response
        .headers()
        .get(header::RETRY_AFTER)
        .map(|value| value.to_str().unwrap().to_string());
    assert_eq!(retry_after.as_deref(), Some("1"), "{error}");
    let body = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(body["error"]["code"], "storage_unavailable", "{body}");
    assert_eq!(
        body["error"]["message"],
        format!("storage failed for echo/e: claim failed: {MEMORY_STORE_OUTAGE_CAUSE}"),
        "{body}"
    );
    assert!(
        matches!(
            &error,
            InvokeError::StorageFailed {
                source: StoreError::Unavailable { operation: StoreOperation::Claim, cause },
                ..
            } if cause == MEMORY_STORE_OUTAGE_CAUSE
        ),
        "not the host's store failing for a moment: {error:?}"
    );
}

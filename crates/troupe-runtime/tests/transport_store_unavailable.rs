//! A store down for a moment on the node that hosts an actor reaches a caller on
//! another node as what it is: `StorageFailed { source: StoreError::Unavailable }`,
//! transient, the same error the host's own callers get (transport protocol version 8).
//!
//! Goal: a call across the transport to an actor whose host's store is down ends with
//! the host's `Unavailable` (the claim's or the commit's), which the caller's node
//! answers as a store that failed for a moment (503 `storage_unavailable` with
//! `Retry-After`, as the host itself does), not as a backend failure (500
//! `storage_failed`, "do not retry"). Before version 8 the wire encoded `Unavailable` as
//! `StoreError::Backend`, and the caller got `Backend` with the same text.
//!
//! Method: the host runs counters (`support/turn_counter.rs`) on a store that fails
//! every operation `Unavailable` while it is down (a `MemoryStore` switched by
//! `MemoryStoreFaults::set_unavailable`); a [`TransportClient`]
//! calls them from another node. The host tries the store again until the request's
//! deadline, then answers the store's last error: a commit's for a counter already
//! active, a claim's for one that is not. Once the store is back, the next call counts
//! from the committed state (the failed turn committed nothing). The first section runs
//! on loopback TCP (both runtime flavours), the second on two simulated nodes.
//!
//! Run with `cargo nextest run -p troupe-runtime --test transport_store_unavailable`, and
//! under simulation with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo
//! nextest run -p troupe-runtime --test transport_store_unavailable`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, CallContext, InvokeError};
use troupe_runtime::{
    Clock, MemoryStore, Runtime, StoreError, StoreOperation, TransportClient, MEMORY_STORE_OUTAGE_CAUSE,
};

#[path = "support/turn_counter.rs"]
mod turn_counter;
use turn_counter::{turn_counter_runtime, TURN_COUNTER_KIND};

/// The deadline of a call made while the host's store is down, in milliseconds: the
/// host tries the store again until then.
const OUTAGE_CALL_MS: u64 = 1_000;
/// The deadline of a call made while the store is up, in milliseconds.
const CALL_MS: u64 = 10_000;
/// The host: counters on `store`; every turn run adds one to `turns`.
fn host(store: &MemoryStore, turns: &Arc<AtomicU64>) -> Runtime {
    turn_counter_runtime(Arc::new(store.clone()), turns)
}

fn counter(key: &str) -> ActorId {
    ActorId::new(TURN_COUNTER_KIND, key).unwrap()
}

/// One `inc` of `target` through `client`, within `within_ms`.
async fn inc(client: &TransportClient, clock: Clock, target: &ActorId, within_ms: u64) -> Result<Bytes, InvokeError> {
    let context = CallContext::root(clock.deadline_in(Duration::from_millis(within_ms)));
    client.invoke(target, Bytes::from_static(b"inc"), context, None).await
}

/// Checks that `result` is the host's `Unavailable` for `operation` on `target`, typed
/// and transient.
fn assert_unavailable(result: Result<Bytes, InvokeError>, target: &ActorId, operation: StoreOperation) {
    let error = result.expect_err("the host's store is down");
    match &error {
        InvokeError::StorageFailed {
            target: failed,
            source:
                StoreError::Unavailable {
                    operation: failed_operation,
                    cause,
                },
        } if failed == target && *failed_operation == operation && cause == MEMORY_STORE_OUTAGE_CAUSE => {}
        other => panic!(
            "{target}: not the host's store failing for a moment at {operation} (StorageFailed {{ source: \
             Unavailable }}): {other:?}"
        ),
    }
    assert!(error.is_transient(), "{error}");
}

/// One call to `target` while the host's store is down, which must end with the
/// host's `Unavailable` at `operation`: at a commit for a counter active when the store
/// went down (activated first, store up), at its claim for one not active.
///
/// The host stops trying the store under `STORE_RETRY_LEFT_MS_MIN` (10 ms) before its
/// deadline, and that deadline is its caller's made earlier by the connection's return
/// allowance (the recent maximum of its measured round trips, at least
/// `RETURN_ALLOWANCE_MS_MIN`): the answer must arrive before the caller's deadline,
/// whatever the network's latency within that allowance. A `Timeout` fails the test.
async fn outage_call(
    client: &TransportClient,
    clock: Clock,
    store: &MemoryStore,
    turns: &AtomicU64,
    target: &ActorId,
    operation: StoreOperation,
) {
    store.faults().set_unavailable(false);
    if operation == StoreOperation::Commit {
        inc(client, clock, target, CALL_MS).await.expect("the store is up");
    }
    store.faults().set_unavailable(true);
    let (failed_before, turns_before) = (store.faults().injected_count(), turns.load(Ordering::SeqCst));
    let result = inc(client, clock, target, OUTAGE_CALL_MS).await;
    assert_unavailable(result, target, operation);
    let turns_run = turns.load(Ordering::SeqCst) - turns_before;
    let expected_turns = u64::from(operation == StoreOperation::Commit);
    assert_eq!(
        turns_run, expected_turns,
        "{target}: only the store operation was tried again"
    );
    let failed = store.faults().injected_count() - failed_before;
    assert!(
        failed >= 2,
        "{target}: the host tried the store again: {failed} failures"
    );
    store.faults().set_unavailable(false);
}

/// The scenario, with `client` calling the host that runs on `store`: a call to an
/// active counter while the store is down (its commit fails), one to a counter not
/// active (its claim fails), then, the store back, both counters count on from their
/// committed state (the failed turns committed nothing).
async fn calls_during_the_hosts_outage(client: &TransportClient, clock: Clock, store: &MemoryStore, turns: &AtomicU64) {
    let (active, idle) = (counter("active"), counter("idle"));
    outage_call(client, clock, store, turns, &active, StoreOperation::Commit).await;
    outage_call(client, clock, store, turns, &idle, StoreOperation::Claim).await;
    // One count committed before the call made while the store was down.
    assert_eq!(
        inc(client, clock, &active, CALL_MS).await.expect("the store is back"),
        "2",
        "counter/active counts on from its committed state, 1"
    );
    assert_eq!(
        inc(client, clock, &idle, CALL_MS).await.expect("the store is back"),
        "1"
    );
}

#[cfg(not(madsim))]
mod loopback {
    use std::net::SocketAddr;

    use troupe_runtime::TransportServer;

    use super::*;

    async fn run() {
        let store = MemoryStore::new();
        let turns = Arc::new(AtomicU64::new(0));
        let runtime = host(&store, &turns);
        let address: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let server = TransportServer::bind(address, runtime.handle()).await.unwrap();
        let clock = Clock::new();
        let client = TransportClient::new(server.local_address(), clock);
        calls_during_the_hosts_outage(&client, clock, &store, &turns).await;
        drop(server);
        runtime.shutdown().await;
    }

    /// Goal and method: see the file's documentation; the client's callers and the
    /// host's tasks on two threads.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_to_a_host_whose_store_is_down_fails_unavailable_at_the_caller_on_two_threads() {
        run().await;
    }

    /// As above, on one thread.
    #[tokio::test]
    async fn a_call_to_a_host_whose_store_is_down_fails_unavailable_at_the_caller() {
        run().await;
    }
}

#[cfg(madsim)]
mod simulated {
    use std::net::{IpAddr, SocketAddr};

    use madsim::runtime::Handle;
    use troupe_runtime::TransportServer;

    use super::*;

    const HOST_IP: &str = "10.0.0.1";
    const CALLER_IP: &str = "10.0.0.2";
    const HOST_PORT: u16 = 7_000;
    /// When the caller starts, in milliseconds after the start: the host is listening.
    const CALL_AT_MS: u64 = 100;

    fn host_address() -> SocketAddr {
        SocketAddr::new(HOST_IP.parse().unwrap(), HOST_PORT)
    }

    /// Goal and method: see the file's documentation, on two simulated nodes at the
    /// simulator's default latency (1 to 10 ms a message, drawn from the seed). Before
    /// the return allowance, 4 seeds in 40 (1 to 40) ended a call `Timeout`.
    #[madsim::test]
    async fn a_call_to_a_host_whose_store_is_down_fails_unavailable_at_the_caller() {
        let handle = Handle::current();
        let store = MemoryStore::new();
        let turns = Arc::new(AtomicU64::new(0));
        handle
            .create_node()
            .name("host")
            .ip(HOST_IP.parse::<IpAddr>().unwrap())
            .init({
                let (store, turns) = (store.clone(), Arc::clone(&turns));
                move || {
                    let (store, turns) = (store.clone(), Arc::clone(&turns));
                    async move {
                        let runtime = host(&store, &turns);
                        let _server = TransportServer::bind(host_address(), runtime.handle()).await.unwrap();
                        std::future::pending::<()>().await;
                    }
                }
            })
            .build();
        let caller = handle
            .create_node()
            .name("caller")
            .ip(CALLER_IP.parse::<IpAddr>().unwrap())
            .build();
        caller
            .spawn(async move {
                tokio::time::sleep(Duration::from_millis(CALL_AT_MS)).await;
                let clock = Clock::new();
                let client = TransportClient::new(host_address(), clock);
                calls_during_the_hosts_outage(&client, clock, &store, &turns).await;
            })
            .await
            .unwrap();
    }
}

//! Keyed requests across the transport (protocol version 5): a request sent with an
//! idempotency key to an actor behind a [`TransportServer`] runs there as a keyed turn,
//! so an attempt sent again with the same key (on the same connection, another one, or
//! through a router) gets the first attempt's reply and the actor's effect lands once.
//!
//! Two runtimes on loopback: the host runs a `counter` whose effect is counted in its
//! committed state (the key `count`, read from the host's store, as
//! `tests/idempotency.rs` does); the caller runtime runs an `order` actor and installs a
//! router that sends its turns' calls and its root requests over a [`TransportClient`]
//! to the host (what a cluster node does, without etcd). Every keyed case has an unkeyed
//! control that applies the effect twice, so each fails if the key is not carried.
//!
//! Real TCP on the multi-thread runtime, so the normal build only (the cluster's simulator tests cross nodes under
//! madsim).
#![cfg(not(madsim))]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use troupe_core::{ActorId, ActorKind, CallContext, Deadline, InvokeError};
use troupe_runtime::{
    Actor, ActorBox, ActorError, IdempotencyKey, KindConfig, MemoryStore, RootCallRouter, Runtime, StateStore,
    TellRoute, TransportClient, TransportServer, Turn, TurnCall, TurnCallRouter, WaitEdge,
};

const LONG: Duration = Duration::from_secs(10);

#[path = "support/counter.rs"]
mod counter_actor;
use counter_actor::{count_of_reply, read_count, Counter};

fn counter(key: &str) -> ActorId {
    ActorId::new("counter", key).unwrap()
}

async fn count(store: &dyn StateStore, key: &str) -> u64 {
    read_count(store.get(&counter(key), "count").await.unwrap())
}

fn key(text: &str) -> IdempotencyKey {
    IdempotencyKey::new(text).unwrap()
}

fn add() -> Bytes {
    Bytes::from_static(b"add")
}

/// The host: a runtime with the counter, on a store the test reads, behind a server on
/// loopback.
async fn start_host() -> (Runtime, Arc<MemoryStore>, TransportServer) {
    let store = Arc::new(MemoryStore::new());
    let config = KindConfig::default().with_idle_timeout(Duration::from_secs(3_600));
    let runtime = Runtime::builder()
        .store(store.clone())
        .register(
            ActorKind::new("counter").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Counter)) },
            config,
        )
        .unwrap()
        .start();
    let address: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let server = TransportServer::bind(address, runtime.handle()).await.unwrap();
    (runtime, store, server)
}

/// Goal: a keyed request sent across the transport and sent again with the same key
/// (on the same connection, then on another client's, as a retry through another node
/// would be) runs the counter once, and every attempt gets the first reply; unkeyed,
/// the same two sends apply it twice. Method: count the host's committed effects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_request_sent_again_across_the_transport_runs_once() {
    let (host, store, server) = start_host().await;
    let clock = troupe_runtime::Clock::new();
    let first = TransportClient::new(server.local_address(), clock);
    let second = TransportClient::new(server.local_address(), clock);
    let context = || CallContext::root(clock.deadline_in(LONG));

    let (target, order_7) = (counter("k"), key("order-7"));
    let attempt = first.invoke_keyed(&target, &order_7, add(), context(), None).await;
    assert_eq!(attempt.unwrap(), "count=1");
    let again = first.invoke_keyed(&target, &order_7, add(), context(), None).await;
    assert_eq!(again.unwrap(), "count=1", "the recorded reply");
    let elsewhere = second.invoke_keyed(&target, &order_7, add(), context(), None).await;
    assert_eq!(
        elsewhere.unwrap(),
        "count=1",
        "the recorded reply, on another connection"
    );
    assert_eq!(count(&*store, "k").await, 1, "the effect landed once");
    let other = second
        .invoke_keyed(&target, &key("order-8"), add(), context(), None)
        .await;
    assert_eq!(other.unwrap(), "count=2", "another key is another request");

    for _ in 0..2 {
        first.invoke(&counter("u"), add(), context(), None).await.unwrap();
    }
    assert_eq!(count(&*store, "u").await, 2, "unkeyed, both sends applied it");
    drop(server);
    host.shutdown().await;
}

/// Sends a caller runtime's routed calls over the transport, keyed when they are: a
/// cluster node's router in miniature (one host, no placement).
struct TransportRouter {
    client: TransportClient,
}

#[async_trait]
impl TurnCallRouter for TransportRouter {
    async fn call(&self, call: TurnCall) -> Result<Bytes, InvokeError> {
        let TurnCall {
            caller,
            target,
            payload,
            context,
            key,
        } = call;
        match key {
            Some(key) => {
                self.client
                    .invoke_keyed(&target, &key, payload, context, Some(&caller))
                    .await
            }
            None => self.client.invoke(&target, payload, context, Some(&caller)).await,
        }
    }

    async fn tell(&self, call: TurnCall) -> TellRoute {
        let TurnCall {
            caller,
            target,
            payload,
            context,
            key,
        } = call;
        TellRoute::Sent(match key {
            Some(key) => {
                self.client
                    .tell_keyed(&target, &key, payload, context, Some(&caller))
                    .await
            }
            None => self.client.tell(&target, payload, context, Some(&caller)).await,
        })
    }

    fn carries_idempotency_keys(&self) -> bool {
        true
    }

    fn path_leaves_node(&self, _remote_edges: Vec<WaitEdge>) {}
}

#[async_trait]
impl RootCallRouter for TransportRouter {
    async fn invoke_root(&self, target: &ActorId, payload: Bytes, deadline: Deadline) -> Result<Bytes, InvokeError> {
        self.client
            .invoke(target, payload, CallContext::root(deadline), None)
            .await
    }

    async fn invoke_root_keyed(
        &self,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        deadline: Deadline,
    ) -> Result<Bytes, InvokeError> {
        self.client
            .invoke_keyed(target, key, payload, CallContext::root(deadline), None)
            .await
    }
}

/// Its payload is `<step>`, `<step>:unkeyed`, `<step>:tell` or `<step>:tell-unkeyed`:
/// calls (or tells) the host's counter `c` under the key `step-<step>` (or without a
/// key), then fails while `fail_after_call` is set, else replies with the counter's reply
/// (`told` for a tell).
struct Order {
    fail_after_call: Arc<AtomicBool>,
}

impl Actor for Order {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let text = std::str::from_utf8(&payload).unwrap().to_string();
        let (step, mode) = text.split_once(':').unwrap_or((&text, "keyed"));
        let (caller, key) = (turn.caller(), key(&format!("step-{step}")));
        let told = |()| Bytes::from_static(b"told");
        let reply = match mode {
            "keyed" => caller.call_keyed(&counter("c"), &key, add(), LONG).await,
            "unkeyed" => caller.call(&counter("c"), add(), LONG).await,
            "tell" => caller.tell_keyed(&counter("c"), &key, add(), LONG).await.map(told),
            "tell-unkeyed" => caller.tell(&counter("c"), add(), LONG).await.map(told),
            other => panic!("unknown mode {other}"),
        };
        let reply = reply.map_err(|error| ActorError::failed(format!("the counter: {error}")))?;
        if self.fail_after_call.load(Ordering::SeqCst) {
            return Err(ActorError::failed("told to fail after the call"));
        }
        Ok(reply)
    }
}

fn order() -> ActorId {
    ActorId::new("order", "o").unwrap()
}

/// The caller runtime: the `order` actor (the counter kind is registered too, so a
/// turn's admission knows it, but every call to it is routed to the host), with the
/// transport router installed for turns' calls and root requests.
fn start_caller(host: SocketAddr, fail_after_call: Arc<AtomicBool>) -> Runtime {
    let config = KindConfig::default().with_idle_timeout(Duration::from_secs(3_600));
    let runtime = Runtime::builder()
        .store(Arc::new(MemoryStore::new()))
        .register(
            ActorKind::new("counter").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Err(ActorError::failed("the counter lives on the host"))
            },
            config,
        )
        .unwrap()
        .register(
            ActorKind::new("order").unwrap(),
            move |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Ok(ActorBox::new(Order {
                    fail_after_call: fail_after_call.clone(),
                }))
            },
            config,
        )
        .unwrap()
        .start();
    let router = Arc::new(TransportRouter {
        client: TransportClient::new(host, runtime.handle().clock()),
    });
    assert!(runtime.handle().set_turn_call_router(router.clone()).is_ok());
    assert!(runtime.handle().set_root_call_router(router).is_ok());
    runtime
}

/// Goal: `RuntimeHandle::invoke_routed_keyed` goes through the root router, and the
/// router carries the key across: sent twice with one key, the host's counter runs once;
/// `invoke_routed` twice (the control) runs it twice. Method: count the host's
/// committed effects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routed_keyed_root_request_sent_again_runs_once_on_the_host() {
    let (host, store, server) = start_host().await;
    let caller = start_caller(server.local_address(), Arc::default());
    let handle = caller.handle();

    let (target, root_1) = (counter("r"), key("root-1"));
    for _ in 0..2 {
        let deadline = handle.deadline_in(LONG);
        let reply = handle.invoke_routed_keyed(&target, &root_1, add(), deadline).await;
        assert_eq!(reply.unwrap(), "count=1");
    }
    assert_eq!(count(&*store, "r").await, 1, "the effect landed once");
    for _ in 0..2 {
        let deadline = handle.deadline_in(LONG);
        handle.invoke_routed(&counter("u"), add(), deadline).await.unwrap();
    }
    assert_eq!(count(&*store, "u").await, 2, "unkeyed, both applied it");
    caller.shutdown().await;
    drop(server);
    host.shutdown().await;
}

/// Goal: a turn's keyed call on a runtime that routes its calls (here over the
/// transport) now goes through, keyed: an `order` turn that called the host's counter
/// under a key and then failed is run again, and the counter's effect lands once (the
/// retry gets the recorded reply). Unkeyed, the same two attempts apply it twice.
/// Method: count the host's committed effects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turns_keyed_call_across_the_transport_applies_once_when_the_turn_is_run_again() {
    let (host, store, server) = start_host().await;
    let fail_after_call = Arc::new(AtomicBool::new(true));
    let caller = start_caller(server.local_address(), fail_after_call.clone());
    let target = order();
    let run = |payload: &'static str| caller.invoke_within(&target, Bytes::from_static(payload.as_bytes()), LONG);

    let failed = run("1").await.unwrap_err();
    assert!(failed.to_string().contains("told to fail after the call"), "{failed}");
    assert_eq!(count(&*store, "c").await, 1, "the counter's turn committed");
    fail_after_call.store(false, Ordering::SeqCst);
    assert_eq!(run("1").await.unwrap(), "count=1", "the recorded reply");
    assert_eq!(count(&*store, "c").await, 1, "the effect landed once");

    fail_after_call.store(true, Ordering::SeqCst);
    run("2:unkeyed").await.unwrap_err();
    fail_after_call.store(false, Ordering::SeqCst);
    assert_eq!(run("2:unkeyed").await.unwrap(), "count=3");
    assert_eq!(count(&*store, "c").await, 3, "unkeyed, both attempts applied it");
    caller.shutdown().await;
    drop(server);
    host.shutdown().await;
}

/// Goal: without a root router, `invoke_routed_keyed` is `invoke_keyed` (local, keyed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_router_a_routed_keyed_request_runs_here_keyed() {
    let (host, store, server) = start_host().await;
    let handle = host.handle();
    let (target, local_1) = (counter("l"), key("local-1"));
    for _ in 0..2 {
        let reply = handle
            .invoke_routed_keyed(&target, &local_1, add(), handle.deadline_in(LONG))
            .await;
        assert_eq!(reply.unwrap(), "count=1");
    }
    assert_eq!(count(&*store, "l").await, 1);
    drop(server);
    host.shutdown().await;
}

/// The host counter `name`'s count as an unkeyed `add` sent behind everything told to it
/// so far sees it (a tell is in the counter's mailbox when its acceptance comes back,
/// and the mailbox runs in order), less the `add` itself.
async fn count_after_tells(client: &TransportClient, clock: troupe_runtime::Clock, name: &str) -> u64 {
    let context = CallContext::root(clock.deadline_in(LONG));
    let reply = client.invoke(&counter(name), add(), context, None).await.unwrap();
    count_of_reply(&reply) - 1
}

/// Goal: a keyed tell across the transport (`TransportClient::tell_keyed`), sent again
/// with the same key on the same connection and on another client's, lands once;
/// unkeyed, two tells land twice. Method: the host counter's count behind the tells.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_tell_sent_again_across_the_transport_lands_once() {
    let (host, store, server) = start_host().await;
    let clock = troupe_runtime::Clock::new();
    let first = TransportClient::new(server.local_address(), clock);
    let second = TransportClient::new(server.local_address(), clock);
    let context = || CallContext::root(clock.deadline_in(LONG));
    let (target, deposit_7) = (counter("t"), key("deposit-7"));
    for client in [&first, &first, &second] {
        client
            .tell_keyed(&target, &deposit_7, add(), context(), None)
            .await
            .unwrap();
    }
    assert_eq!(
        count_after_tells(&first, clock, "t").await,
        1,
        "three copies, one effect"
    );
    for _ in 0..2 {
        first.tell(&counter("tu"), add(), context(), None).await.unwrap();
    }
    assert_eq!(count_after_tells(&first, clock, "tu").await, 2, "unkeyed, both landed");
    assert_eq!(count(&*store, "t").await, 2, "the keyed effect and the count's own add");
    drop(server);
    host.shutdown().await;
}

/// Goal: a turn's keyed tell on a runtime that routes its turns' messages over the
/// transport goes through keyed: the turn, run again after it failed, tells again under
/// the same key and the host counter's effect lands once. Unkeyed, twice. Method: the
/// host counter's count behind the tells.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turns_keyed_tell_across_the_transport_lands_once_when_the_turn_is_run_again() {
    let (host, _store, server) = start_host().await;
    let fail_after_call = Arc::new(AtomicBool::new(true));
    let caller = start_caller(server.local_address(), fail_after_call.clone());
    let target = order();
    let run = |payload: &'static str| caller.invoke_within(&target, Bytes::from_static(payload.as_bytes()), LONG);
    let clock = caller.handle().clock();
    let client = TransportClient::new(server.local_address(), clock);

    let failed = run("1:tell").await.unwrap_err();
    assert!(failed.to_string().contains("told to fail after the call"), "{failed}");
    fail_after_call.store(false, Ordering::SeqCst);
    assert_eq!(run("1:tell").await.unwrap(), "told");
    assert_eq!(
        count_after_tells(&client, clock, "c").await,
        1,
        "the keyed tell landed once"
    );

    fail_after_call.store(true, Ordering::SeqCst);
    run("2:tell-unkeyed").await.unwrap_err();
    fail_after_call.store(false, Ordering::SeqCst);
    run("2:tell-unkeyed").await.unwrap();
    // 1, the count's own add, then the control's 2.
    assert_eq!(
        count_after_tells(&client, clock, "c").await,
        4,
        "unkeyed, both applied it"
    );
    caller.shutdown().await;
    drop(server);
    host.shutdown().await;
}

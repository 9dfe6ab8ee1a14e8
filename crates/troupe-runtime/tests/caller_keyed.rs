//! Keyed calls from a turn (`Caller::call_keyed`, `Caller::invoke_keyed`, the root
//! request `Caller::invoke_as_root_keyed`, and the fire-and-forget `Caller::tell_keyed`):
//! a turn that
//! is run again and makes the same call under the same idempotency key gets the first
//! reply back, and the target's effect is applied once. This is the step of a saga: an
//! `order` actor's turn asks a `counter` to apply an effect, then fails (or its caller
//! gives up), and the retried turn must not apply the effect again.
//!
//! Effects are counted in the counter's committed state (the key `count`), read from
//! the store. Runs in both builds (the multi-thread variants outside the simulator).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{
    Actor, ActorBox, ActorError, IdempotencyKey, KindConfig, MemoryStore, RootCallRouter, Runtime, RuntimeHandle,
    StateStore, TellRoute, Turn, TurnCall, TurnCallRouter, WaitEdge,
};

#[path = "support/counter.rs"]
mod counter_actor;
use counter_actor::{count_of_reply, read_count, Counter};
#[path = "support/keyed_root_router.rs"]
mod keyed_root_router;
use keyed_root_router::KeyedRootRouter;

/// Its payload is `<step>`, `<step>:unkeyed`, `<step>:root`, `<step>:tell` or
/// `<step>:tell-unkeyed`: calls the counter under the key `step-<step>` (or without a
/// key; or as a keyed root request of the turn; or tells it, keyed or not), then fails
/// while `fail_after_call` is set, else replies with the counter's reply (`told` for a
/// tell).
struct Order {
    fail_after_call: Arc<AtomicBool>,
}

impl Actor for Order {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let text = std::str::from_utf8(&payload).unwrap().to_string();
        let (step, mode) = text.split_once(':').unwrap_or((&text, "keyed"));
        let key = IdempotencyKey::new(&format!("step-{step}")).unwrap();
        let caller = turn.caller();
        let add = Bytes::from_static(b"add");
        let reply = match mode {
            "keyed" => caller.call_keyed(&counter(), &key, add, LONG).await,
            "unkeyed" => caller.call(&counter(), add, LONG).await,
            "root" => caller.invoke_as_root_keyed(&counter(), &key, add, LONG).await,
            "tell" => caller
                .tell_keyed(&counter(), &key, add, LONG)
                .await
                .map(|()| Bytes::from_static(b"told")),
            "tell-unkeyed" => caller
                .tell(&counter(), add, LONG)
                .await
                .map(|()| Bytes::from_static(b"told")),
            other => panic!("unknown mode {other}"),
        };
        let reply = reply.map_err(|error| ActorError::failed(format!("the counter: {error}")))?;
        if self.fail_after_call.load(Ordering::SeqCst) {
            return Err(ActorError::failed("told to fail after the call"));
        }
        Ok(reply)
    }
}

const LONG: Duration = Duration::from_secs(10);

fn counter() -> ActorId {
    ActorId::new("counter", "c").unwrap()
}

fn order() -> ActorId {
    ActorId::new("order", "o").unwrap()
}

/// The counter's mailbox, in messages: room for two rounds of 64 tells queued at once
/// (a round's tells can still be queued when its retries arrive) and an `add` behind
/// them. With the default 64, the concurrent tell test's retries met `Busy`, as a
/// bounded mailbox must answer (1 run in 3 on 2026-12-01).
const COUNTER_MAILBOX_CAPACITY: usize = 2 * 64 + 1;

fn start(store: Arc<dyn StateStore>, fail_after_call: Arc<AtomicBool>) -> Runtime {
    let config = KindConfig::default().with_idle_timeout(Duration::from_secs(3_600));
    Runtime::builder()
        .store(store)
        .register(
            ActorKind::new("counter").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Counter)) },
            config.with_mailbox_capacity(COUNTER_MAILBOX_CAPACITY),
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
        .start()
}

async fn run_order(runtime: &Runtime, payload: &str) -> Result<Bytes, InvokeError> {
    runtime
        .invoke_within(&order(), Bytes::from(payload.to_string()), LONG)
        .await
}

async fn count(store: &dyn StateStore) -> u64 {
    read_count(store.get(&counter(), "count").await.unwrap())
}

/// Goal: an `order` turn that called the counter under a key and then failed is run
/// again; its second attempt gets the first call's reply and the counter's effect is
/// applied once. Unkeyed, the same two attempts apply it twice (the control). Another
/// key is another request. Method: count the counter's committed effects.
async fn a_turn_run_again_applies_its_keyed_call_once() {
    let store = Arc::new(MemoryStore::new());
    let fail_after_call = Arc::new(AtomicBool::new(true));
    let runtime = start(store.clone(), fail_after_call.clone());

    let failed = run_order(&runtime, "1").await.unwrap_err();
    assert!(failed.to_string().contains("told to fail after the call"), "{failed}");
    assert_eq!(count(&*store).await, 1, "the counter's turn committed");
    fail_after_call.store(false, Ordering::SeqCst);
    assert_eq!(run_order(&runtime, "1").await.unwrap(), "count=1", "the recorded reply");
    assert_eq!(count(&*store).await, 1, "the effect applied once");

    assert_eq!(run_order(&runtime, "2").await.unwrap(), "count=2", "another key");
    fail_after_call.store(true, Ordering::SeqCst);
    run_order(&runtime, "3:unkeyed").await.unwrap_err();
    fail_after_call.store(false, Ordering::SeqCst);
    assert_eq!(run_order(&runtime, "3:unkeyed").await.unwrap(), "count=4");
    assert_eq!(count(&*store).await, 4, "unkeyed, both attempts applied it");
    runtime.shutdown().await;
}

/// Goal: the same for a keyed root request of the turn (`Caller::invoke_as_root_keyed`,
/// not a call of the turn: no wait-for edge, no chain): run again, the turn gets the
/// first reply and the effect is applied once. Method: count the counter's committed
/// effects.
async fn a_turn_run_again_applies_its_keyed_root_request_once() {
    let store = Arc::new(MemoryStore::new());
    let fail_after_call = Arc::new(AtomicBool::new(true));
    let runtime = start(store.clone(), fail_after_call.clone());
    run_order(&runtime, "1:root").await.unwrap_err();
    assert_eq!(count(&*store).await, 1, "the counter's turn committed");
    fail_after_call.store(false, Ordering::SeqCst);
    assert_eq!(
        run_order(&runtime, "1:root").await.unwrap(),
        "count=1",
        "the recorded reply"
    );
    assert_eq!(count(&*store).await, 1, "the effect applied once");
    runtime.shutdown().await;
}

/// The counter's count as an unkeyed `add` behind everything told to it so far sees it
/// (a tell is accepted into the counter's mailbox before the telling turn goes on, and
/// the mailbox runs in order), less the `add` itself.
async fn count_after_tells(runtime: &Runtime) -> u64 {
    let reply = runtime
        .invoke_within(&counter(), Bytes::from_static(b"add"), LONG)
        .await
        .unwrap();
    count_of_reply(&reply) - 1
}

/// Goal: a turn that told the counter under a key and then failed is run again and
/// tells it again under the same key; the counter's effect lands once. Unkeyed, the same
/// two attempts apply it twice (the control). Method: the counter's count behind the
/// tells.
async fn a_turn_run_again_applies_its_keyed_tell_once() {
    let store = Arc::new(MemoryStore::new());
    let fail_after_call = Arc::new(AtomicBool::new(true));
    let runtime = start(store.clone(), fail_after_call.clone());
    let failed = run_order(&runtime, "1:tell").await.unwrap_err();
    assert!(failed.to_string().contains("told to fail after the call"), "{failed}");
    fail_after_call.store(false, Ordering::SeqCst);
    assert_eq!(run_order(&runtime, "1:tell").await.unwrap(), "told");
    assert_eq!(count_after_tells(&runtime).await, 1, "the keyed tell landed once");

    fail_after_call.store(true, Ordering::SeqCst);
    run_order(&runtime, "2:tell-unkeyed").await.unwrap_err();
    fail_after_call.store(false, Ordering::SeqCst);
    run_order(&runtime, "2:tell-unkeyed").await.unwrap();
    // 1, the control's 2, and the first count's own add.
    assert_eq!(
        count_after_tells(&runtime).await,
        4,
        "unkeyed, both attempts applied it"
    );
    runtime.shutdown().await;
}

/// Runs the `order` actor with `<step><suffix>` for every step below `steps`, all at
/// once from spawned tasks: the outcomes, in step order.
#[cfg(not(madsim))]
async fn order_every_step_at_once(
    handle: &RuntimeHandle,
    steps: u64,
    suffix: &'static str,
) -> Vec<Result<Bytes, InvokeError>> {
    let tasks: Vec<_> = (0..steps)
        .map(|step| {
            let handle = handle.clone();
            tokio::spawn(async move {
                handle
                    .invoke_within(&order(), Bytes::from(format!("{step}{suffix}")), LONG)
                    .await
            })
        })
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.unwrap());
    }
    results
}

/// Goal: on worker threads, 64 keyed tells from turns that each fail once and are run
/// again, all attempts in flight together, land each step exactly once. Method: the
/// counter's count behind all the tells.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_retried_turns_land_each_keyed_tell_once_multi_thread() {
    /// Distinct steps, each told first by a turn that fails, then by its retry.
    const STEPS: u64 = 64;
    let store = Arc::new(MemoryStore::new());
    let fail_after_call = Arc::new(AtomicBool::new(true));
    let runtime = start(store.clone(), fail_after_call.clone());
    let first = order_every_step_at_once(&runtime.handle(), STEPS, ":tell").await;
    assert!(
        first.iter().all(Result::is_err),
        "every first attempt fails after its tell"
    );
    fail_after_call.store(false, Ordering::SeqCst);
    let second = order_every_step_at_once(&runtime.handle(), STEPS, ":tell").await;
    assert!(second.iter().all(Result::is_ok), "{second:?}");
    assert_eq!(count_after_tells(&runtime).await, STEPS, "no step landed twice");
    runtime.shutdown().await;
}

#[tokio::test]
async fn a_turn_run_again_applies_its_keyed_tell_once_current_thread() {
    a_turn_run_again_applies_its_keyed_tell_once().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_run_again_applies_its_keyed_tell_once_multi_thread() {
    a_turn_run_again_applies_its_keyed_tell_once().await;
}

#[tokio::test]
async fn a_turn_run_again_applies_its_keyed_root_request_once_current_thread() {
    a_turn_run_again_applies_its_keyed_root_request_once().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_run_again_applies_its_keyed_root_request_once_multi_thread() {
    a_turn_run_again_applies_its_keyed_root_request_once().await;
}

#[tokio::test]
async fn a_turn_run_again_applies_its_keyed_call_once_current_thread() {
    a_turn_run_again_applies_its_keyed_call_once().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_run_again_applies_its_keyed_call_once_multi_thread() {
    a_turn_run_again_applies_its_keyed_call_once().await;
}

/// Goal: on worker threads, many `order` actors that each fail once after their keyed
/// call and are retried apply each step exactly once, while they run concurrently.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_retried_turns_apply_each_keyed_call_once_multi_thread() {
    /// Distinct steps, each first attempted by a turn that fails, then retried.
    const STEPS: u64 = 64;
    let store = Arc::new(MemoryStore::new());
    let fail_after_call = Arc::new(AtomicBool::new(true));
    let runtime = start(store.clone(), fail_after_call.clone());
    let handle = runtime.handle();
    let first = order_every_step_at_once(&handle, STEPS, "").await;
    assert!(
        first.iter().all(Result::is_err),
        "every first attempt fails after its call"
    );
    assert_eq!(count(&*store).await, STEPS);
    fail_after_call.store(false, Ordering::SeqCst);
    let second = order_every_step_at_once(&handle, STEPS, "").await;
    let mut replies: Vec<u64> = second
        .into_iter()
        .map(|reply| count_of_reply(&reply.unwrap()))
        .collect();
    replies.sort_unstable();
    assert_eq!(
        replies,
        (1..=STEPS).collect::<Vec<_>>(),
        "each retry gets its first reply"
    );
    assert_eq!(count(&*store).await, STEPS, "no step applied twice");
    runtime.shutdown().await;
}

/// A router that runs every call and tell here, counting them (and the keyed ones), and
/// says whether it carries idempotency keys.
struct CountingRouter {
    handle: RuntimeHandle,
    carries_keys: bool,
    calls: Mutex<u32>,
    keyed_calls: Mutex<u32>,
}

impl CountingRouter {
    fn new(handle: RuntimeHandle, carries_keys: bool) -> Arc<Self> {
        Arc::new(Self {
            handle,
            carries_keys,
            calls: Mutex::new(0),
            keyed_calls: Mutex::new(0),
        })
    }
}

#[async_trait]
impl TurnCallRouter for CountingRouter {
    async fn call(&self, call: TurnCall) -> Result<Bytes, InvokeError> {
        *self.calls.lock().unwrap() += 1;
        match &call.key {
            Some(key) => {
                *self.keyed_calls.lock().unwrap() += 1;
                self.handle
                    .invoke_for_turn_keyed(&call.caller, &call.target, key, call.payload, call.context)
                    .await
            }
            None => {
                self.handle
                    .invoke_for_turn(&call.caller, &call.target, call.payload, call.context)
                    .await
            }
        }
    }

    async fn tell(&self, call: TurnCall) -> TellRoute {
        *self.calls.lock().unwrap() += 1;
        TellRoute::Sent(match &call.key {
            Some(key) => {
                *self.keyed_calls.lock().unwrap() += 1;
                self.handle
                    .tell_for_turn_keyed(&call.target, key, call.payload, call.context)
                    .await
            }
            None => {
                self.handle
                    .tell_for_turn(&call.target, call.payload, call.context)
                    .await
            }
        })
    }

    fn carries_idempotency_keys(&self) -> bool {
        self.carries_keys
    }

    fn path_leaves_node(&self, _remote_edges: Vec<WaitEdge>) {}
}

/// Goal: where a router takes a turn's calls (a cluster node) and carries keys, a keyed
/// call goes to the router with its key, and a turn run again after it failed applies
/// the counter's effect once. Method: count the router's calls (and keyed ones) and the
/// counter's committed effects. (Before keys crossed the transport, such a call was
/// refused `Rejected` with nothing sent.)
#[tokio::test]
async fn a_runtime_that_routes_calls_sends_a_keyed_call_to_its_router_with_the_key() {
    let store = Arc::new(MemoryStore::new());
    let fail_after_call = Arc::new(AtomicBool::new(true));
    let runtime = start(store.clone(), fail_after_call.clone());
    let router = CountingRouter::new(runtime.handle(), true);
    assert!(runtime.handle().set_turn_call_router(router.clone()).is_ok());

    run_order(&runtime, "1").await.unwrap_err();
    fail_after_call.store(false, Ordering::SeqCst);
    assert_eq!(run_order(&runtime, "1").await.unwrap(), "count=1", "the recorded reply");
    assert_eq!(*router.calls.lock().unwrap(), 2, "both attempts went to the router");
    assert_eq!(*router.keyed_calls.lock().unwrap(), 2, "with their key");
    assert_eq!(count(&*store).await, 1, "the effect applied once");
    runtime.shutdown().await;
}

/// Goal: a router that does not say it carries keys (the trait's default) never sees a
/// keyed call: it is refused `Rejected` with nothing sent, so the router cannot run it
/// unkeyed. Method: the router counts no call and the counter never runs.
#[tokio::test]
async fn a_router_that_does_not_carry_keys_is_sent_no_keyed_call() {
    let store = Arc::new(MemoryStore::new());
    let runtime = start(store.clone(), Arc::default());
    let router = CountingRouter::new(runtime.handle(), false);
    assert!(runtime.handle().set_turn_call_router(router.clone()).is_ok());
    let refused = run_order(&runtime, "1").await.unwrap_err().to_string();
    assert!(refused.contains("rejected"), "{refused}");
    assert!(refused.contains("does not carry idempotency keys"), "{refused}");
    assert_eq!(*router.calls.lock().unwrap(), 0);
    assert_eq!(count(&*store).await, 0);
    runtime.shutdown().await;
}

/// Goal: the same for a turn's keyed tell: through a router that carries keys, it goes
/// with its key, and the turn run again lands it once; through one that does not, it is
/// refused `Rejected` with nothing sent. Method: the router's counts and the counter's
/// count behind the tells.
#[tokio::test]
async fn a_turns_keyed_tell_goes_to_its_router_with_the_key_or_is_refused() {
    let store = Arc::new(MemoryStore::new());
    let fail_after_call = Arc::new(AtomicBool::new(true));
    let runtime = start(store.clone(), fail_after_call.clone());
    let router = CountingRouter::new(runtime.handle(), true);
    assert!(runtime.handle().set_turn_call_router(router.clone()).is_ok());
    run_order(&runtime, "1:tell").await.unwrap_err();
    fail_after_call.store(false, Ordering::SeqCst);
    assert_eq!(run_order(&runtime, "1:tell").await.unwrap(), "told");
    assert_eq!(*router.calls.lock().unwrap(), 2, "both attempts went to the router");
    assert_eq!(*router.keyed_calls.lock().unwrap(), 2, "with their key");
    assert_eq!(count_after_tells(&runtime).await, 1, "the effect applied once");
    runtime.shutdown().await;

    let store = Arc::new(MemoryStore::new());
    let runtime = start(store.clone(), Arc::default());
    let router = CountingRouter::new(runtime.handle(), false);
    assert!(runtime.handle().set_turn_call_router(router.clone()).is_ok());
    let refused = run_order(&runtime, "1:tell").await.unwrap_err().to_string();
    assert!(refused.contains("does not carry idempotency keys"), "{refused}");
    assert_eq!(*router.calls.lock().unwrap(), 0, "the router saw nothing");
    assert_eq!(count_after_tells(&runtime).await, 0, "nothing was told");
    runtime.shutdown().await;
}

/// A root router that keeps the trait's default for keyed requests.
struct UnkeyedRootRouter {
    handle: RuntimeHandle,
}

#[async_trait]
impl RootCallRouter for UnkeyedRootRouter {
    async fn invoke_root(
        &self,
        target: &ActorId,
        payload: Bytes,
        deadline: troupe_core::Deadline,
    ) -> Result<Bytes, InvokeError> {
        self.handle.invoke_root_for_router(target, payload, deadline).await
    }
}

/// Goal: with a root router installed (a cluster node), a turn's keyed root request goes
/// to the router with its key, and the turn run again applies the effect once. Method:
/// the keys the router saw, and the counter's committed effects.
#[tokio::test]
async fn a_turns_keyed_root_request_goes_to_the_root_router_with_its_key() {
    let store = Arc::new(MemoryStore::new());
    let fail_after_call = Arc::new(AtomicBool::new(true));
    let runtime = start(store.clone(), fail_after_call.clone());
    let router = KeyedRootRouter::install(&runtime.handle());
    run_order(&runtime, "1:root").await.unwrap_err();
    fail_after_call.store(false, Ordering::SeqCst);
    assert_eq!(
        run_order(&runtime, "1:root").await.unwrap(),
        "count=1",
        "the recorded reply"
    );
    assert_eq!(
        *router.keyed.lock().unwrap(),
        ["step-1", "step-1"],
        "both attempts, keyed"
    );
    assert_eq!(count(&*store).await, 1, "the effect applied once");
    runtime.shutdown().await;
}

/// Goal: `RuntimeHandle::invoke_routed_keyed` through a root router that does not carry
/// keys (the trait's default) is refused `Rejected` with nothing run, not run unkeyed.
#[tokio::test]
async fn a_root_router_that_does_not_carry_keys_refuses_a_keyed_request() {
    let store = Arc::new(MemoryStore::new());
    let runtime = start(store.clone(), Arc::default());
    let handle = runtime.handle();
    let router = Arc::new(UnkeyedRootRouter { handle: handle.clone() });
    assert!(handle.set_root_call_router(router).is_ok());
    let key = IdempotencyKey::new("root-1").unwrap();
    let refused = handle
        .invoke_routed_keyed(&counter(), &key, Bytes::from_static(b"add"), handle.deadline_in(LONG))
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("does not carry idempotency keys"), "{refused}");
    assert_eq!(count(&*store).await, 0);
    let refused = run_order(&runtime, "1:root").await.unwrap_err().to_string();
    assert!(
        refused.contains("does not carry idempotency keys"),
        "a turn's keyed root request too: {refused}"
    );
    assert_eq!(count(&*store).await, 0);
    runtime.shutdown().await;
}

//! The virtual-actor runtime, end to end through the real dispatcher: activation,
//! idle deactivation and reactivation with persisted state, backpressure, deadlines,
//! deadlock refusal, single activation and state durability.
//!
//! Runs in both builds: `cargo nextest run` (tokio with paused time) and
//! `RUSTFLAGS="--cfg madsim" cargo nextest run` (the madsim simulator).

#[path = "support/actors.rs"]
mod actors;

use std::sync::Arc;
use std::time::Duration;

use actors::{call, count, counter, op, with_counters, EventLog, Op};
use bytes::Bytes;
use troupe::core::{ActorId, CallRefused, InvokeError};
use troupe::runtime::{KindConfig, MemoryStore, Runtime, RuntimeHandle, StateStore};

const IDLE: Duration = Duration::from_millis(500);
const LONG: Duration = Duration::from_secs(60);

fn start(store: Arc<dyn StateStore>, config: KindConfig, log: &EventLog) -> Runtime {
    with_counters(Runtime::builder().store(store), config, log).start()
}

async fn invoke(rt: &RuntimeHandle, key: &str, message: Op) -> Result<u64, InvokeError> {
    rt.invoke(&counter(key), op(message), rt.deadline_in(LONG))
        .await
        .map(count)
}

/// Goal: the lifecycle of a virtual actor against a given store. Method: invoke, wait
/// past the idle timeout, check the actor deactivated (hook ran, table empty), invoke
/// again and find the state it had before.
async fn lifecycle_round_trip(store: Arc<dyn StateStore>) {
    let log = EventLog::default();
    let rt = start(store, KindConfig::default().with_idle_timeout(IDLE), &log);
    assert_eq!(invoke(&rt, "c", Op::Add(3)).await, Ok(3));
    assert_eq!(invoke(&rt, "c", Op::Add(4)).await, Ok(7));
    assert_eq!(log.activations_of("c"), 1);
    assert_eq!(rt.stats().await.unwrap().activations, 1);

    tokio::time::sleep(IDLE * 3).await;
    assert_eq!(
        rt.stats().await.unwrap().activations,
        0,
        "an idle actor must be deactivated"
    );
    assert_eq!(
        log.events(),
        vec![
            actors::Event::Activated("c".into(), 0),
            actors::Event::TurnStarted("c".into()),
            actors::Event::TurnStarted("c".into()),
            actors::Event::Deactivated("c".into(), 7),
        ]
    );
    assert_eq!(rt.counters().deactivations_finished, 1);

    assert_eq!(
        invoke(&rt, "c", Op::Get).await,
        Ok(7),
        "reactivated with its persisted state"
    );
    assert_eq!(log.activations_of("c"), 2);
    assert_eq!(
        log.events()[4..],
        [
            actors::Event::Activated("c".into(), 7),
            actors::Event::TurnStarted("c".into()),
        ]
    );
    rt.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn actor_activates_deactivates_when_idle_and_reactivates_with_state_in_memory_store() {
    lifecycle_round_trip(Arc::new(MemoryStore::new())).await;
}

#[tokio::test(start_paused = true)]
async fn actor_activates_deactivates_when_idle_and_reactivates_with_state_in_sqlite_store() {
    let store = troupe::runtime::SqliteStore::open_in_memory().unwrap();
    lifecycle_round_trip(Arc::new(store)).await;
}

/// Goal: the dispatcher never waits on a turn. Method: start a 10 s turn in A, then
/// invoke B; B must answer in zero virtual time while A is still running.
#[tokio::test(start_paused = true)]
async fn a_slow_turn_in_one_actor_does_not_delay_a_reply_from_another() {
    let log = EventLog::default();
    let rt = start(Arc::new(MemoryStore::new()), KindConfig::default(), &log);
    let handle = rt.handle();
    let slow = tokio::spawn(async move { invoke(&handle, "a", Op::SlowAdd(10_000)).await });
    tokio::time::sleep(Duration::from_millis(1)).await;
    let started = tokio::time::Instant::now();
    assert_eq!(invoke(&rt, "b", Op::Add(1)).await, Ok(1));
    assert!(
        started.elapsed() < Duration::from_millis(1),
        "b waited {:?}",
        started.elapsed()
    );
    assert!(!slow.is_finished(), "a's slow turn should still be running");
    assert_eq!(slow.await.unwrap(), Ok(1));
}

/// Goal: backpressure is the mailbox. Method: occupy the actor with a slow turn, fill
/// its mailbox of 2, then one more invoke must fail with `Busy` at once; the queued
/// messages must still complete.
#[tokio::test(start_paused = true)]
async fn a_full_mailbox_answers_busy_at_once_and_queued_messages_still_complete() {
    let log = EventLog::default();
    let rt = start(
        Arc::new(MemoryStore::new()),
        KindConfig::default().with_mailbox_capacity(2),
        &log,
    );
    let mut pending = Vec::new();
    let handle = rt.handle();
    pending.push(tokio::spawn(
        async move { invoke(&handle, "m", Op::SlowAdd(1_000)).await },
    ));
    tokio::time::sleep(Duration::from_millis(1)).await;
    for _ in 0..2 {
        let handle = rt.handle();
        pending.push(tokio::spawn(async move { invoke(&handle, "m", Op::Add(1)).await }));
    }
    tokio::time::sleep(Duration::from_millis(1)).await;
    let started = tokio::time::Instant::now();
    let refused = invoke(&rt, "m", Op::Add(100)).await;
    assert_eq!(
        refused,
        Err(InvokeError::Busy {
            target: counter("m"),
            capacity: 2
        })
    );
    assert!(
        started.elapsed() < Duration::from_micros(100),
        "busy took {:?}",
        started.elapsed()
    );
    let mut replies = Vec::new();
    for task in pending {
        replies.push(task.await.unwrap().unwrap());
    }
    replies.sort_unstable();
    assert_eq!(replies, vec![1, 2, 3]);
    assert_eq!(rt.counters().busy_refused, 1);
}

/// Goal: a request whose deadline passes while it waits in the mailbox is dropped
/// without running. Method: queue an `Add` with a 100 ms deadline behind a 1 s turn.
#[tokio::test(start_paused = true)]
async fn an_expired_request_is_never_run() {
    let log = EventLog::default();
    let rt = start(Arc::new(MemoryStore::new()), KindConfig::default(), &log);
    let handle = rt.handle();
    let slow = tokio::spawn(async move { invoke(&handle, "e", Op::SlowAdd(1_000)).await });
    tokio::time::sleep(Duration::from_millis(1)).await;
    let short = rt.deadline_in(Duration::from_millis(100));
    let expired = rt.invoke(&counter("e"), op(Op::Add(50)), short).await;
    assert_eq!(
        expired,
        Err(InvokeError::Timeout {
            target: counter("e"),
            timeout_ms: 100
        })
    );
    assert_eq!(slow.await.unwrap(), Ok(1));
    assert_eq!(
        invoke(&rt, "e", Op::Get).await,
        Ok(1),
        "the expired Add must not have run"
    );
    let turns = log
        .events()
        .iter()
        .filter(|e| matches!(e, actors::Event::TurnStarted(_)))
        .count();
    assert_eq!(turns, 2, "only the slow add and the get ran");
    assert_eq!(rt.counters().expired_dropped, 1);
}

/// Goal: a call back into a waiting actor inside one chain is refused by admission (the
/// call chain), at once, before anything is sent. Method: A calls B, B calls A.
#[tokio::test(start_paused = true)]
async fn a_call_back_into_the_chain_is_refused_with_the_chain_at_once() {
    let log = EventLog::default();
    let rt = start(Arc::new(MemoryStore::new()), KindConfig::default(), &log);
    let started = tokio::time::Instant::now();
    let result = invoke(&rt, "a", call("b", call("a", Op::Add(1), 30_000, 0), 30_000, 0)).await;
    assert_eq!(
        result,
        Err(InvokeError::Refused(CallRefused::CycleDetected {
            chain: vec![counter("a"), counter("b"), counter("a")]
        }))
    );
    assert!(
        started.elapsed() < Duration::from_micros(100),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(
        rt.counters().deadlocks_refused,
        0,
        "refused by admission, never sent to the dispatcher"
    );
    assert_eq!(rt.stats().await.unwrap().wait_for_edges, 0, "edges are released");
}

/// Goal: the wait-for graph catches what a call chain cannot: two independent requests,
/// A waiting on B while B waits on A. Method: both turns start, sleep 1 ms, then call
/// each other; one call must be refused at once, and the other then completes.
#[tokio::test(start_paused = true)]
async fn crossing_calls_from_independent_callers_are_refused_with_deadlock_detected_at_once() {
    let log = EventLog::default();
    let rt = start(Arc::new(MemoryStore::new()), KindConfig::default(), &log);
    let (first, second) = (rt.handle(), rt.handle());
    let started = tokio::time::Instant::now();
    let a = tokio::spawn(async move { invoke(&first, "a", call("b", Op::Add(1), 30_000, 1)).await });
    let b = tokio::spawn(async move { invoke(&second, "b", call("a", Op::Add(1), 30_000, 1)).await });
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_micros(1_100),
        "took {elapsed:?}, a={a:?}, b={b:?}"
    );
    // The refused call names the cycle, its caller first and last; the other call then
    // runs its Add on the refused caller's actor, whose turn has ended: count 1.
    let a_refused = Err(InvokeError::DeadlockDetected {
        cycle: vec![counter("a"), counter("b"), counter("a")],
    });
    let b_refused = Err(InvokeError::DeadlockDetected {
        cycle: vec![counter("b"), counter("a"), counter("b")],
    });
    assert!(
        (a == a_refused && b == Ok(1)) || (a == Ok(1) && b == b_refused),
        "exactly one crossing call is refused with the cycle, the other answered: a={a:?} b={b:?}"
    );
    assert_eq!(rt.counters().deadlocks_refused, 1);
    assert_eq!(rt.stats().await.unwrap().wait_for_edges, 0, "edges are released");
}

/// Goal: a failed commit is an error the caller sees, and the actor's in-memory state
/// does not run ahead of the store. Method: fail the next commit, add 5 (must fail),
/// read (still 0), add 1 (1), deactivate and reactivate (still 1).
#[tokio::test(start_paused = true)]
async fn a_failed_state_save_surfaces_as_an_error_and_the_in_memory_state_is_not_corrupted() {
    let log = EventLog::default();
    let store = MemoryStore::new();
    let rt = start(
        Arc::new(store.clone()),
        KindConfig::default().with_idle_timeout(IDLE),
        &log,
    );
    store.faults().fail_next_commits(1);
    let failed = invoke(&rt, "s", Op::Add(5)).await;
    assert!(
        matches!(&failed, Err(InvokeError::StorageFailed { target, .. }) if *target == counter("s")),
        "{failed:?}"
    );
    assert_eq!(invoke(&rt, "s", Op::Get).await, Ok(0));
    assert_eq!(invoke(&rt, "s", Op::Add(1)).await, Ok(1));
    tokio::time::sleep(IDLE * 3).await;
    assert_eq!(rt.stats().await.unwrap().activations, 0);
    assert_eq!(invoke(&rt, "s", Op::Get).await, Ok(1));
}

/// Goal: a failed load is never a silent reset. Method: commit 9, deactivate, fail the
/// next load: the caller sees `StorageFailed`; the next invoke finds 9.
#[tokio::test(start_paused = true)]
async fn a_failed_state_load_is_an_error_not_a_default_state() {
    let log = EventLog::default();
    let store = MemoryStore::new();
    let rt = start(
        Arc::new(store.clone()),
        KindConfig::default().with_idle_timeout(IDLE),
        &log,
    );
    assert_eq!(invoke(&rt, "l", Op::Add(9)).await, Ok(9));
    tokio::time::sleep(IDLE * 3).await;
    store.faults().fail_next_loads(1);
    let failed = invoke(&rt, "l", Op::Get).await;
    assert!(
        matches!(&failed, Err(InvokeError::StorageFailed { target, .. }) if *target == counter("l")),
        "{failed:?}"
    );
    assert_eq!(invoke(&rt, "l", Op::Get).await, Ok(9));
}

/// Goal: a turn's writes are all-or-nothing. Method: a turn that adds and writes then
/// fails leaves neither the count nor the key; a turn that succeeds leaves both.
#[tokio::test(start_paused = true)]
async fn a_failed_turn_rolls_back_its_writes_and_state() {
    let log = EventLog::default();
    let store = MemoryStore::new();
    let rt = start(Arc::new(store.clone()), KindConfig::default(), &log);
    let failed = invoke(&rt, "w", Op::AddThenFail(7)).await;
    assert_eq!(
        failed,
        Err(InvokeError::ActorFailed {
            target: counter("w"),
            cause: "planned failure".to_string()
        })
    );
    assert_eq!(invoke(&rt, "w", Op::Get).await, Ok(0));
    assert_eq!(store.get(&counter("w"), "doomed").await, Ok(None));
    let put = Op::Put {
        key: "k".into(),
        value: "v".into(),
    };
    assert_eq!(invoke(&rt, "w", put).await, Ok(1));
    assert_eq!(store.get(&counter("w"), "k").await, Ok(Some(Bytes::from_static(b"v"))));
}

#[tokio::test(start_paused = true)]
async fn an_unregistered_kind_is_actor_not_found() {
    let rt = start(
        Arc::new(MemoryStore::new()),
        KindConfig::default(),
        &EventLog::default(),
    );
    let target = ActorId::new("ghost", "x").unwrap();
    let result = rt.invoke(&target, Bytes::new(), rt.deadline_in(LONG)).await;
    assert_eq!(
        result,
        Err(InvokeError::ActorNotFound {
            target,
            kind: "ghost".into()
        })
    );
}

/// Goal: shutdown deactivates every actor through its hook and then refuses work.
#[tokio::test(start_paused = true)]
async fn shutdown_deactivates_every_actor_and_then_refuses_invocations() {
    let log = EventLog::default();
    let rt = start(Arc::new(MemoryStore::new()), KindConfig::default(), &log);
    for key in ["x", "y", "z"] {
        invoke(&rt, key, Op::Add(1)).await.unwrap();
    }
    let handle = rt.handle();
    rt.shutdown().await;
    let deactivated = log
        .events()
        .iter()
        .filter(|e| matches!(e, actors::Event::Deactivated(..)))
        .count();
    assert_eq!(deactivated, 3);
    assert_eq!(invoke(&handle, "x", Op::Get).await, Err(InvokeError::Shutdown));
}

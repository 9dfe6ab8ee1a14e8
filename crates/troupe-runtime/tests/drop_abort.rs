//! Dropping a runtime aborts it at once: a turn that reaches its commit after the drop
//! commits nothing, and its caller gets `Shutdown` (as a process that dies commits
//! nothing after its death). The abort used to take effect only when the dispatcher next
//! ran, so such a turn could still commit: `dst_agent_inbox` found it at seed 906969186,
//! where the dropped system's turn committed an outbox entry after the restarted system
//! had looked for pending entries, and the entry was never delivered.
//!
//! Runs in both builds (the madsim build runs the current_thread case on the simulator).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, MemoryStore, Runtime, StateStore, Turn};

/// The key the turn writes.
const KEY: &str = "written";
/// How long the test lets the dropped runtime's tasks run on (ms).
const SETTLE_MS: u64 = 100;

/// Tells `started` when its turn runs, waits for `go`, then writes `KEY`.
struct Gated {
    started: Arc<Notify>,
    go: Arc<Notify>,
}

impl Actor for Gated {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        self.started.notify_one();
        self.go.notified().await;
        turn.put(KEY, payload.clone())?;
        Ok(payload)
    }
}

/// Starts a runtime on a fresh store, calls the gated actor, and once its turn runs,
/// lets the turn go on and drops the runtime at once, on the same thread; returns the
/// call's answer, the store and the actor's id.
async fn release_the_turn_and_drop_the_runtime() -> (Result<Bytes, InvokeError>, Arc<MemoryStore>, ActorId) {
    let store = Arc::new(MemoryStore::new());
    let (started, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (for_actor, go_for_actor) = (Arc::clone(&started), Arc::clone(&go));
    let runtime = Runtime::builder()
        .store(store.clone())
        .register(
            ActorKind::new("gated").unwrap(),
            move |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Ok(ActorBox::new(Gated {
                    started: Arc::clone(&for_actor),
                    go: Arc::clone(&go_for_actor),
                }))
            },
            KindConfig::default().with_idle_timeout(Duration::from_secs(3_600)),
        )
        .unwrap()
        .start();
    let target = ActorId::new("gated", "0").unwrap();
    let handle = runtime.handle();
    let call_target = target.clone();
    let call = tokio::spawn(async move {
        handle
            .invoke_within(&call_target, Bytes::from_static(b"v"), Duration::from_secs(5))
            .await
    });
    started.notified().await;
    go.notify_one(); // the turn may go on, when its task runs next
    drop(runtime);
    (call.await.unwrap(), store, target)
}

/// Current thread: the turn is released, then the runtime is dropped before the turn's
/// task runs again, so the turn reaches its commit after the drop, every time.
#[tokio::test]
async fn a_turn_that_reaches_its_commit_after_the_runtime_is_dropped_commits_nothing() {
    let (answer, store, target) = release_the_turn_and_drop_the_runtime().await;
    tokio::time::sleep(Duration::from_millis(SETTLE_MS)).await;
    let stored = store.get(&target, KEY).await.unwrap();
    assert_eq!(stored, None, "nothing is committed after the drop");
    assert!(
        matches!(answer, Err(InvokeError::Shutdown)),
        "the caller is told the runtime stopped: {answer:?}"
    );
}

/// Worker threads: the turn may commit before the drop or not at all, and its caller's
/// answer says which: `Ok` with the write stored, or `Shutdown` with nothing stored.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_racing_a_drop_is_answered_as_it_committed_on_worker_threads() {
    /// Rounds of the race (each a fresh runtime).
    const ROUNDS: usize = 50;
    for _ in 0..ROUNDS {
        let (answer, store, target) = release_the_turn_and_drop_the_runtime().await;
        tokio::time::sleep(Duration::from_millis(10)).await;
        let stored = store.get(&target, KEY).await.unwrap();
        match answer {
            Ok(_) => {
                assert_eq!(stored, Some(Bytes::from_static(b"v")), "an Ok answer was committed");
            }
            Err(InvokeError::Shutdown) => {
                assert_eq!(stored, None, "a Shutdown answer committed nothing");
            }
            other => panic!("unexpected answer {other:?}"),
        }
    }
}

/// A `WeakRuntimeHandle` (what a factory keeps to reach its runtime without a reference
/// cycle) reaches the runtime while it lives, and no longer once the runtime is dropped
/// and its tasks (the dispatcher, the activations) have ended: the weak handle alone
/// keeps nothing alive.
#[tokio::test]
async fn a_weak_handle_reaches_the_runtime_only_while_it_lives() {
    let runtime = Runtime::builder().start();
    let weak = runtime.downgrade();
    let upgraded = weak.upgrade().expect("the runtime lives");
    drop(upgraded);
    drop(runtime);
    tokio::time::sleep(Duration::from_millis(SETTLE_MS)).await;
    assert!(
        weak.upgrade().is_none(),
        "nothing but the weak handle refers to the dropped runtime"
    );
}

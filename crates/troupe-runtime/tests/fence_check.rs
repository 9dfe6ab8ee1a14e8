//! A stale activation's turn learns that it is fenced before its expensive work
//! (`Turn::check_fence`), not only when its commit is refused after it.
//!
//! Two runtimes on one store (one SQLite file, or clones of one `MemoryStore`, as two
//! processes would share it): the first activates an actor, the second claims it since,
//! and the first's stale activation gets a request. Its turn checks its fence first,
//! as an agent's turn would before a model call: it stops there, its caller gets the
//! refusal, the stale activation closes, and the next request runs in a fresh one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{
    Actor, ActorBox, ActorError, KindConfig, MemoryStore, Runtime, SqliteStore, StateStore, StoreError, Turn,
};

/// What every wait here is bounded by.
const HANG: Duration = Duration::from_secs(10);

/// A counter whose every turn first checks its fence, then does "expensive work" (counts
/// a model call), then adds one to its state.
struct Careful {
    count: u64,
    model_calls: Arc<AtomicU64>,
}

impl Actor for Careful {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        if payload.as_ref() == b"wrap" {
            // As a layer above might: its own error, the refusal only in its text.
            turn.check_fence()
                .await
                .map_err(|refused| ActorError::failed(format!("not calling the model: {refused}")))?;
        } else {
            turn.check_fence().await?;
        }
        self.model_calls.fetch_add(1, Ordering::Relaxed);
        self.count += 1;
        Ok(Bytes::from(self.count.to_string()))
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(self.count.to_string())))
    }
}

fn start(store: Arc<dyn StateStore>, model_calls: &Arc<AtomicU64>) -> Runtime {
    let model_calls = Arc::clone(model_calls);
    Runtime::builder()
        .store(store)
        .register(
            ActorKind::new("careful").unwrap(),
            move |_id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Ok(ActorBox::new(Careful {
                    count: saved.map_or(0, |b| std::str::from_utf8(&b).unwrap().parse().unwrap()),
                    model_calls: Arc::clone(&model_calls),
                }))
            },
            KindConfig::default(),
        )
        .unwrap()
        .start()
}

async fn ask(runtime: &Runtime, id: &ActorId) -> Result<u64, InvokeError> {
    send(runtime, id, b"go").await
}

async fn send(runtime: &Runtime, id: &ActorId, payload: &'static [u8]) -> Result<u64, InvokeError> {
    let reply = tokio::time::timeout(HANG, runtime.invoke_within(id, Bytes::from_static(payload), HANG))
        .await
        .expect("no answer");
    reply.map(|bytes| std::str::from_utf8(&bytes).unwrap().parse().unwrap())
}

/// The scenario on two runtimes whose stores share their data.
async fn a_stale_turn_stops_before_its_expensive_work(first: Arc<dyn StateStore>, second: Arc<dyn StateStore>) {
    let model_calls = Arc::new(AtomicU64::new(0));
    let a = start(first, &model_calls);
    let b = start(second, &model_calls);
    let id = ActorId::new("careful", "c").unwrap();
    assert_eq!(ask(&a, &id).await, Ok(1), "a activates it");
    assert_eq!(ask(&b, &id).await, Ok(2), "b claims it since, from a's state");
    assert_eq!(model_calls.load(Ordering::Relaxed), 2);
    // a's activation is stale: its turn learns it before the model call.
    match ask(&a, &id).await {
        Err(InvokeError::StorageFailed {
            target,
            source: StoreError::Fenced { held, current, .. },
        }) => {
            assert_eq!(target, id);
            assert!(current > Some(held), "held {held}, current {current:?}");
        }
        other => panic!("the stale turn was not told it is fenced: {other:?}"),
    }
    assert_eq!(
        model_calls.load(Ordering::Relaxed),
        2,
        "the stale turn stopped before its model call"
    );
    // The stale activation closed: a's next request runs in a fresh one, from b's state.
    assert_eq!(ask(&a, &id).await, Ok(3));
    assert_eq!(model_calls.load(Ordering::Relaxed), 3);
    a.shutdown().await;
    b.shutdown().await;
}

/// Goal: on two runtimes sharing one SQLite file (two connections, as two processes
/// have), a stale activation's turn that checks its fence stops before its expensive
/// work, its caller gets `Fenced`, and the next request is served by a fresh activation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_turn_on_a_shared_sqlite_file_learns_it_is_fenced_before_its_work() {
    let directory = tempfile::tempdir().unwrap();
    let file = directory.path().join("state.sqlite");
    let first = SqliteStore::open(&file).unwrap();
    let second = SqliteStore::open(&file).unwrap();
    a_stale_turn_stops_before_its_expensive_work(Arc::new(first), Arc::new(second)).await;
}

/// Goal: the same on two runtimes sharing one SQLite connection (clones of one store),
/// whose claims do not change `PRAGMA data_version` for each other.
#[tokio::test]
async fn a_stale_turn_on_one_sqlite_connection_learns_it_is_fenced_before_its_work() {
    let store = SqliteStore::open_in_memory().unwrap();
    a_stale_turn_stops_before_its_expensive_work(Arc::new(store.clone()), Arc::new(store)).await;
}

/// Goal: the same on two runtimes sharing one `MemoryStore` (clones share its data).
#[tokio::test]
async fn a_stale_turn_on_a_shared_memory_store_learns_it_is_fenced_before_its_work() {
    let store = MemoryStore::new();
    a_stale_turn_stops_before_its_expensive_work(Arc::new(store.clone()), Arc::new(store)).await;
}

/// Goal: a turn that meets the refusal and returns an error of its own (the refusal
/// only in its text, as a layer above might) closes the stale activation all the same:
/// the next request runs in a fresh one, not in the stale one again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_turn_that_returns_its_own_error_closes_the_stale_activation_too() {
    let store = MemoryStore::new();
    let model_calls = Arc::new(AtomicU64::new(0));
    let a = start(Arc::new(store.clone()), &model_calls);
    let b = start(Arc::new(store), &model_calls);
    let id = ActorId::new("careful", "w").unwrap();
    assert_eq!(ask(&a, &id).await, Ok(1));
    assert_eq!(ask(&b, &id).await, Ok(2));
    match send(&a, &id, b"wrap").await {
        Err(InvokeError::ActorFailed { cause, .. }) => assert!(cause.contains("fenced off"), "{cause}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(model_calls.load(Ordering::Relaxed), 2);
    assert_eq!(send(&a, &id, b"wrap").await, Ok(3));
    a.shutdown().await;
    b.shutdown().await;
}

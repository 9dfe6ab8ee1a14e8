//! Idempotency keys (`RuntimeHandle::invoke_keyed`, `ActorRef::ask_keyed`): a request
//! retried with the key of an attempt that committed gets that attempt's reply, and the
//! handler runs once. Effects are counted in the actor's committed state (the key
//! `count`), read from the store.
//!
//! The gap it closes (docs/status.md; TLA+ `CP_gap_commit_window`): a caller that times
//! out while its first attempt's commit is in flight, and retries. [`CommitGate`] holds a
//! commit in the store until the test lets it go.
//!
//! Runs in both builds (the multi-thread variants outside the simulator).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, Notify};
use troupe_core::{ActorId, ActorKind, InvokeError};
#[path = "support/keyed_root_router.rs"]
mod keyed_root_router;
use keyed_root_router::KeyedRootRouter;
use troupe_runtime::{
    Actor, ActorBox, ActorError, Claimed, Fence, IdempotencyKey, IdempotencyKeyError, KindConfig, MemoryStore, Runtime,
    StateStore, StoreError, StoreOperation, Turn, TurnCommit, TypedActor, IDEMPOTENCY_KEYS_KEPT_MAX,
    IDEMPOTENCY_KEY_LENGTH_MAX_BYTES, IDEMPOTENCY_STORE_PREFIX,
};

/// Counts its effects in its key-value space: `add` adds one to `count` and replies with
/// the new count; it fails instead (after writing) while `fail` is set.
struct Counter {
    fail: Arc<AtomicBool>,
}

impl Actor for Counter {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        assert_eq!(&payload[..], b"add");
        let count = read_count(turn.get("count").await?);
        turn.put("count", Bytes::from((count + 1).to_string()))?;
        if self.fail.load(Ordering::SeqCst) {
            return Err(ActorError::failed("told to fail"));
        }
        Ok(Bytes::from(format!("count={}", count + 1)))
    }
}

fn read_count(value: Option<Bytes>) -> u64 {
    value.map_or(0, |bytes| std::str::from_utf8(&bytes).unwrap().parse().unwrap())
}

/// A store that can hold one commit until released, or refuse one.
struct CommitGate {
    inner: Arc<dyn StateStore>,
    /// Set: the next commit announces itself here and waits for `release`.
    hold: Mutex<Option<oneshot::Sender<()>>>,
    release: Notify,
    refuse_next: AtomicBool,
}

impl CommitGate {
    fn new(inner: Arc<dyn StateStore>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            hold: Mutex::new(None),
            release: Notify::new(),
            refuse_next: AtomicBool::new(false),
        })
    }

    /// Holds the next commit; the receiver fires once it is in the store's hands.
    fn hold_next_commit(&self) -> oneshot::Receiver<()> {
        let (entered, held) = oneshot::channel();
        *self.hold.lock().unwrap() = Some(entered);
        held
    }
}

#[async_trait]
impl StateStore for CommitGate {
    async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        self.inner.claim(actor).await
    }
    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        self.inner.load(actor).await
    }
    async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        if self.refuse_next.swap(false, Ordering::SeqCst) {
            return Err(StoreError::Injected {
                operation: StoreOperation::Commit,
            });
        }
        let entered = self.hold.lock().unwrap().take();
        if let Some(entered) = entered {
            let released = self.release.notified();
            let _ = entered.send(());
            released.await;
        }
        self.inner.commit(actor, fence, commit).await
    }
    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        self.inner.get(actor, key).await
    }
    async fn scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        self.inner.scan(actor, prefix, after, limit).await
    }
}

fn counter_kind() -> ActorKind {
    ActorKind::new("counter").unwrap()
}

fn start(store: Arc<dyn StateStore>, fail: Arc<AtomicBool>) -> Runtime {
    Runtime::builder()
        .store(store)
        .register(
            counter_kind(),
            move |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Ok(ActorBox::new(Counter { fail: fail.clone() }))
            },
            KindConfig::default().with_idle_timeout(Duration::from_secs(3_600)),
        )
        .unwrap()
        .start()
}

fn target() -> ActorId {
    ActorId::new("counter", "c").unwrap()
}

fn key(text: &str) -> IdempotencyKey {
    IdempotencyKey::new(text).unwrap()
}

const LONG: Duration = Duration::from_secs(10);

async fn add_keyed(runtime: &Runtime, key: &IdempotencyKey) -> Result<Bytes, InvokeError> {
    runtime
        .invoke_keyed(&target(), key, Bytes::from_static(b"add"), runtime.deadline_in(LONG))
        .await
}

async fn count(store: &dyn StateStore) -> u64 {
    read_count(store.get(&target(), "count").await.unwrap())
}

/// Goal: a keyed request sent again after its first attempt committed gets the first
/// reply and does not run the handler again; another key runs it, and unkeyed requests
/// run it every time. Method: count the committed effects after each.
async fn a_retry_of_a_committed_attempt_runs_the_handler_once() {
    let store = Arc::new(MemoryStore::new());
    let runtime = start(store.clone(), Arc::default());
    let first = key("order-1");
    assert_eq!(add_keyed(&runtime, &first).await.unwrap(), "count=1");
    assert_eq!(
        add_keyed(&runtime, &first).await.unwrap(),
        "count=1",
        "the stored reply"
    );
    assert_eq!(count(&*store).await, 1, "the handler ran once");
    assert_eq!(add_keyed(&runtime, &key("order-2")).await.unwrap(), "count=2");
    for expected in 3..=4 {
        let reply = runtime
            .invoke_within(&target(), Bytes::from_static(b"add"), LONG)
            .await
            .unwrap();
        assert_eq!(reply, format!("count={expected}"), "unkeyed requests run every time");
    }
    assert_eq!(add_keyed(&runtime, &first).await.unwrap(), "count=1");
    assert_eq!(count(&*store).await, 4);
    runtime.shutdown().await;
}

#[tokio::test]
async fn a_retry_of_a_committed_attempt_runs_the_handler_once_current_thread() {
    a_retry_of_a_committed_attempt_runs_the_handler_once().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_of_a_committed_attempt_runs_the_handler_once_multi_thread() {
    a_retry_of_a_committed_attempt_runs_the_handler_once().await;
}

/// The commit window: the first attempt's turn finishes while its caller waits, so it
/// commits; the store holds the commit until the caller has timed out and its retry is
/// queued behind the commit. Returns the first caller's error, the retry's reply and the
/// effects committed. `keyed` sends both attempts with one key; else both unkeyed.
async fn retry_during_the_commit_window(keyed: bool) -> (InvokeError, Result<Bytes, InvokeError>, u64) {
    let gate = CommitGate::new(Arc::new(MemoryStore::new()));
    let runtime = start(gate.clone(), Arc::default());
    let request = key("order-1");
    let send = |timeout: Duration| {
        let runtime = runtime.handle();
        let request = request.clone();
        async move {
            let deadline = runtime.deadline_in(timeout);
            let payload = Bytes::from_static(b"add");
            if keyed {
                runtime.invoke_keyed(&target(), &request, payload, deadline).await
            } else {
                runtime.invoke(&target(), payload, deadline).await
            }
        }
    };
    let held = gate.hold_next_commit();
    let first = tokio::spawn(send(Duration::from_millis(200)));
    held.await.expect("the first attempt's commit reaches the store");
    let first = first
        .await
        .unwrap()
        .expect_err("the first caller times out during the commit");
    assert!(matches!(first, InvokeError::Timeout { .. }), "{first:?}");
    // The retry waits in the mailbox behind the commit in flight.
    let retry = tokio::spawn(send(LONG));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!retry.is_finished(), "the retry's turn waits for the commit");
    gate.release.notify_one();
    let retried = retry.await.unwrap();
    let effects = count(&*gate).await;
    runtime.shutdown().await;
    (first, retried, effects)
}

/// Goal: the gap of docs/status.md is closed for keyed requests: a caller that times out
/// while its first attempt commits, and retries with the same key, gets the first
/// attempt's reply, and the effect lands once.
async fn a_keyed_retry_in_the_commit_window_gets_the_first_reply() {
    let (_, retried, effects) = retry_during_the_commit_window(true).await;
    assert_eq!(retried.unwrap(), "count=1", "the first attempt's reply");
    assert_eq!(effects, 1, "the effect landed once");
}

#[tokio::test]
async fn a_keyed_retry_in_the_commit_window_gets_the_first_reply_current_thread() {
    a_keyed_retry_in_the_commit_window_gets_the_first_reply().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_retry_in_the_commit_window_gets_the_first_reply_multi_thread() {
    a_keyed_retry_in_the_commit_window_gets_the_first_reply().await;
}

/// Goal: the witness that the scenario above is the gap: the same two attempts unkeyed
/// apply the effect twice.
#[tokio::test]
async fn an_unkeyed_retry_in_the_commit_window_applies_the_effect_twice() {
    let (_, retried, effects) = retry_during_the_commit_window(false).await;
    assert_eq!(retried.unwrap(), "count=2");
    assert_eq!(effects, 2, "both attempts committed");
}

/// Goal: a turn that fails, or whose commit the store refuses, records nothing: the retry
/// with the same key runs the handler, and its reply is then the one kept.
async fn a_failed_attempt_stores_nothing_and_the_retry_runs() {
    let gate = CommitGate::new(Arc::new(MemoryStore::new()));
    let fail = Arc::new(AtomicBool::new(true));
    let runtime = start(gate.clone(), fail.clone());
    let request = key("order-1");
    let failed = add_keyed(&runtime, &request).await.unwrap_err();
    assert!(matches!(failed, InvokeError::ActorFailed { .. }), "{failed:?}");
    fail.store(false, Ordering::SeqCst);
    gate.refuse_next.store(true, Ordering::SeqCst);
    let refused = add_keyed(&runtime, &request).await.unwrap_err();
    assert!(matches!(refused, InvokeError::StorageFailed { .. }), "{refused:?}");
    assert_eq!(count(&*gate).await, 0, "neither attempt committed");
    assert_eq!(add_keyed(&runtime, &request).await.unwrap(), "count=1", "the retry ran");
    assert_eq!(add_keyed(&runtime, &request).await.unwrap(), "count=1");
    assert_eq!(count(&*gate).await, 1);
    runtime.shutdown().await;
}

#[tokio::test]
async fn a_failed_attempt_stores_nothing_and_the_retry_runs_current_thread() {
    a_failed_attempt_stores_nothing_and_the_retry_runs().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_attempt_stores_nothing_and_the_retry_runs_multi_thread() {
    a_failed_attempt_stores_nothing_and_the_retry_runs().await;
}

/// Goal: an actor keeps the last `IDEMPOTENCY_KEYS_KEPT_MAX` keys, the oldest forgotten
/// first, in the commit that adds the newest; its records stay bounded.
#[tokio::test]
async fn the_oldest_key_is_forgotten_past_the_keys_kept() {
    let store = Arc::new(MemoryStore::new());
    let runtime = start(store.clone(), Arc::default());
    let kept = IDEMPOTENCY_KEYS_KEPT_MAX;
    let numbered = |n: u64| key(&format!("k{n}"));
    for n in 0..kept {
        add_keyed(&runtime, &numbered(n)).await.unwrap();
    }
    assert_eq!(add_keyed(&runtime, &numbered(0)).await.unwrap(), "count=1", "all kept");
    assert_eq!(count(&*store).await, kept);
    // One more key: k0 is the oldest, and goes.
    add_keyed(&runtime, &numbered(kept)).await.unwrap();
    assert_eq!(
        add_keyed(&runtime, &numbered(1)).await.unwrap(),
        "count=2",
        "k1 is kept"
    );
    assert_eq!(count(&*store).await, kept + 1);
    let again = add_keyed(&runtime, &numbered(0)).await.unwrap();
    assert_eq!(again, format!("count={}", kept + 2), "k0 was forgotten: it runs again");
    let replies = store
        .scan(&target(), &format!("{IDEMPOTENCY_STORE_PREFIX}reply/"), None, 10_000)
        .await
        .unwrap();
    assert_eq!(replies.len() as u64, kept, "the records stay bounded");
    // k0 took k1's place, the oldest then.
    assert_eq!(
        add_keyed(&runtime, &numbered(1)).await.unwrap(),
        format!("count={}", kept + 3)
    );
    runtime.shutdown().await;
}

/// Goal: the key is in the store, not in the activation: it holds after the actor is
/// deactivated and activated again.
#[tokio::test]
async fn a_key_survives_deactivation() {
    let store = Arc::new(MemoryStore::new());
    let runtime = start(store.clone(), Arc::default());
    let request = key("order-1");
    assert_eq!(add_keyed(&runtime, &request).await.unwrap(), "count=1");
    assert!(runtime.deactivate(&target()).await.unwrap());
    assert_eq!(add_keyed(&runtime, &request).await.unwrap(), "count=1");
    assert_eq!(runtime.counters().activations_started, 2);
    assert_eq!(count(&*store).await, 1);
    runtime.shutdown().await;
}

/// Goal: the key holds across a process restart on the same SQLite file.
#[tokio::test]
async fn a_key_survives_a_restart_on_the_same_sqlite_file() {
    let directory = tempfile::Builder::new()
        .prefix(&format!("troupe-idempotency-{}-", std::process::id()))
        .tempdir()
        .unwrap();
    let file = directory.path().join("state.sqlite");
    let request = key("order-1");
    let open = || -> Arc<dyn StateStore> { Arc::new(troupe_runtime::SqliteStore::open(&file).unwrap()) };
    let runtime = start(open(), Arc::default());
    assert_eq!(add_keyed(&runtime, &request).await.unwrap(), "count=1");
    runtime.shutdown().await;

    let store = open();
    let runtime = start(store.clone(), Arc::default());
    assert_eq!(
        add_keyed(&runtime, &request).await.unwrap(),
        "count=1",
        "after the restart"
    );
    assert_eq!(add_keyed(&runtime, &key("order-2")).await.unwrap(), "count=2");
    assert_eq!(count(&*store).await, 2);
    runtime.shutdown().await;
}

#[derive(Default, Serialize, Deserialize)]
struct Total {
    total: u64,
}

impl TypedActor for Total {
    type Message = u64;
    type Reply = u64;

    async fn handle(&mut self, _turn: &mut Turn, add: u64) -> Result<u64, ActorError> {
        self.total += add;
        Ok(self.total)
    }
}

/// Goal: a typed keyed ask (message and reply as bincode bytes) runs once per key; its
/// effect is the actor's own state.
#[tokio::test]
async fn a_typed_keyed_ask_runs_once() {
    let store = Arc::new(MemoryStore::new());
    let kind = ActorKind::new("total").unwrap();
    let runtime = Runtime::builder()
        .store(store.clone())
        .register_typed::<Total>(kind.clone(), KindConfig::default())
        .unwrap()
        .start();
    let total = runtime.actor_ref::<Total>(ActorId::new("total", "t").unwrap()).unwrap();
    let request = key("deposit-1");
    assert_eq!(total.ask_keyed(&request, 5, LONG).await.unwrap(), 5);
    assert_eq!(total.ask_keyed(&request, 5, LONG).await.unwrap(), 5);
    assert_eq!(total.ask(0, LONG).await.unwrap(), 5, "the state holds one deposit");
    assert_eq!(total.ask_keyed(&key("deposit-2"), 5, LONG).await.unwrap(), 10);
    runtime.shutdown().await;
}

/// Goal: a typed keyed tell delivered twice deposits once. Method: the actor's state,
/// read by an ask sent behind the tells.
#[tokio::test]
async fn a_typed_keyed_tell_delivered_twice_deposits_once() {
    let runtime = Runtime::builder()
        .register_typed::<Total>(ActorKind::new("total").unwrap(), KindConfig::default())
        .unwrap()
        .start();
    let total = runtime.actor_ref::<Total>(ActorId::new("total", "t").unwrap()).unwrap();
    for _ in 0..2 {
        total.tell_keyed(&key("deposit-7"), 5, LONG).await.unwrap();
    }
    assert_eq!(total.ask(0, LONG).await.unwrap(), 5, "one deposit");
    total.tell_keyed(&key("deposit-8"), 5, LONG).await.unwrap();
    assert_eq!(total.ask(0, LONG).await.unwrap(), 10, "another key, another deposit");
    runtime.shutdown().await;
}

/// Goal: with a root router installed (a cluster node), a typed keyed ask goes to the
/// router with its key (it runs keyed on the actor's owner), and still runs once per
/// key. Method: the keys the router saw, and the actor's state.
#[tokio::test]
async fn a_typed_keyed_ask_goes_to_the_root_router_with_its_key() {
    let runtime = Runtime::builder()
        .register_typed::<Total>(ActorKind::new("total").unwrap(), KindConfig::default())
        .unwrap()
        .start();
    let router = KeyedRootRouter::install(&runtime.handle());
    let total = runtime.actor_ref::<Total>(ActorId::new("total", "t").unwrap()).unwrap();
    assert_eq!(total.ask_keyed(&key("deposit-1"), 5, LONG).await.unwrap(), 5);
    assert_eq!(total.ask_keyed(&key("deposit-1"), 5, LONG).await.unwrap(), 5);
    assert_eq!(*router.keyed.lock().unwrap(), ["deposit-1", "deposit-1"]);
    assert_eq!(total.ask(0, LONG).await.unwrap(), 5, "the state holds one deposit");
    runtime.shutdown().await;
}

/// Goal: a keyed tell delivered again, as a source that delivers at least once does,
/// applies its effect once: copies queued together, and a copy sent after the first
/// committed; a delivery whose turn failed records nothing, and the next delivery runs.
/// Method: count the committed effects, each time after a keyed ask sent behind the
/// tells (one mailbox, in order: it runs after them).
async fn a_redelivered_keyed_tell_applies_its_effect_once() {
    let store = Arc::new(MemoryStore::new());
    let fail = Arc::new(AtomicBool::new(false));
    let runtime = start(store.clone(), fail.clone());
    let target = target();
    let tell = |id: &'static str| {
        let runtime = &runtime;
        let target = &target;
        async move {
            let deadline = runtime.deadline_in(LONG);
            runtime
                .tell_keyed(target, &key(id), Bytes::from_static(b"add"), deadline)
                .await
        }
    };
    for _ in 0..3 {
        tell("message-1").await.unwrap();
    }
    assert_eq!(add_keyed(&runtime, &key("probe-1")).await.unwrap(), "count=2");
    assert_eq!(count(&*store).await, 2, "message-1 once, then the probe");
    tell("message-1").await.unwrap();
    assert_eq!(add_keyed(&runtime, &key("probe-2")).await.unwrap(), "count=3");

    fail.store(true, Ordering::SeqCst);
    tell("message-2").await.unwrap();
    add_keyed(&runtime, &key("probe-3")).await.unwrap_err();
    assert_eq!(count(&*store).await, 3, "the failed delivery and probe changed nothing");
    fail.store(false, Ordering::SeqCst);
    tell("message-2").await.unwrap();
    tell("message-2").await.unwrap();
    assert_eq!(add_keyed(&runtime, &key("probe-4")).await.unwrap(), "count=5");
    assert_eq!(count(&*store).await, 5, "message-2 once after its failed delivery");
    runtime.shutdown().await;
}

#[tokio::test]
async fn a_redelivered_keyed_tell_applies_its_effect_once_current_thread() {
    a_redelivered_keyed_tell_applies_its_effect_once().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_keyed_tell_applies_its_effect_once_multi_thread() {
    a_redelivered_keyed_tell_applies_its_effect_once().await;
}

/// Writes what its payload says, as a key-value actor writes its users' keys: `put`,
/// a key and a value, or `delete` and a key, one per line; replies `ok`.
struct Notes;

impl Actor for Notes {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let text = std::str::from_utf8(&payload).map_err(|_| ActorError::rejected("not text"))?;
        match text.split('\n').collect::<Vec<_>>()[..] {
            ["put", key, value] => turn.put(key, Bytes::copy_from_slice(value.as_bytes()))?,
            ["delete", key] => turn.delete(key)?,
            _ => return Err(ActorError::rejected("neither put nor delete")),
        }
        Ok(Bytes::from_static(b"ok"))
    }
}

/// Goal: a turn cannot write or delete keys under [`IDEMPOTENCY_STORE_PREFIX`], which
/// the runtime keeps for its records: `Turn::put` and `Turn::delete` refuse them with
/// `StoreError::ReservedKey` (the caller sees `StorageFailed`), and nothing is written,
/// so a keyed request still runs its handler. Before, an actor that wrote keys its
/// users chose let one forge the recorded reply of a key the actor had not yet seen:
/// the keyed request then got the forged reply and its handler never ran.
#[tokio::test]
async fn a_turn_cannot_write_the_runtimes_reserved_keys() {
    let store: Arc<dyn StateStore> = Arc::new(MemoryStore::new());
    let runtime = Runtime::builder()
        .store(Arc::clone(&store))
        .register(
            ActorKind::new("notes").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Notes)) },
            KindConfig::default(),
        )
        .unwrap()
        .start();
    let notes = ActorId::new("notes", "n").unwrap();
    let forged_key = format!("{IDEMPOTENCY_STORE_PREFIX}reply/k");
    let refused = |key: &str| InvokeError::StorageFailed {
        target: notes.clone(),
        source: StoreError::ReservedKey {
            key: key.to_string(),
            prefix: IDEMPOTENCY_STORE_PREFIX.to_string(),
        },
    };
    let forge = Bytes::from(format!("put\n{forged_key}\nforged"));
    let result = runtime.invoke_within(&notes, forge, Duration::from_secs(5)).await;
    assert_eq!(result, Err(refused(&forged_key)));
    let next_key = format!("{IDEMPOTENCY_STORE_PREFIX}next");
    let delete = Bytes::from(format!("delete\n{next_key}"));
    let result = runtime.invoke_within(&notes, delete, Duration::from_secs(5)).await;
    assert_eq!(result, Err(refused(&next_key)));
    assert_eq!(store.get(&notes, &forged_key).await, Ok(None), "nothing was written");
    // The keyed request runs its handler (which writes `note`), and its reply is recorded.
    let deadline = runtime.deadline_in(Duration::from_secs(5));
    let reply = runtime
        .invoke_keyed(&notes, &key("k"), Bytes::from_static(b"put\nnote\nkept"), deadline)
        .await;
    assert_eq!(reply, Ok(Bytes::from_static(b"ok")));
    assert_eq!(store.get(&notes, "note").await, Ok(Some(Bytes::from_static(b"kept"))));
    assert_eq!(
        store.get(&notes, &forged_key).await,
        Ok(Some(Bytes::from_static(b"ok")))
    );
    // A key that merely contains the prefix, later on, is the actor's own.
    let own = Bytes::from(format!("put\nmine/{IDEMPOTENCY_STORE_PREFIX}\nx"));
    let result = runtime.invoke_within(&notes, own, Duration::from_secs(5)).await;
    assert_eq!(result, Ok(Bytes::from_static(b"ok")));
    runtime.shutdown().await;
}

/// Goal: keys are bounded and checked, with a typed error.
#[test]
fn invalid_keys_are_refused_with_a_typed_error() {
    assert_eq!(IdempotencyKey::new(""), Err(IdempotencyKeyError::Empty));
    let long = "k".repeat(IDEMPOTENCY_KEY_LENGTH_MAX_BYTES + 1);
    assert!(matches!(
        IdempotencyKey::new(&long),
        Err(IdempotencyKeyError::TooLong { .. })
    ));
    assert!(matches!(
        IdempotencyKey::new("a\u{0}b"),
        Err(IdempotencyKeyError::ControlCharacter { at: 1 })
    ));
}

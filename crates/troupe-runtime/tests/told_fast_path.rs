//! The told fast path (activation.rs: `Begun::Told`, `told_first_poll`, `settle_told`): a
//! fire-and-forget message with nobody to answer, no wait-for edge and no span takes its
//! own path through the turn, without the ends a request carries. Each test here fails if
//! that path cuts a corner in a batch of told messages handled in one wake-up of the
//! actor's task: a told turn that changed state (or wrote a key) must commit, one that
//! fails must roll back only itself, one whose deadline passed in the queue must be
//! dropped unrun and counted, one that waits must go on with the same handler and
//! commit, and one whose own deadline passes while it waits must fail and roll back.
//!
//! Runs in both builds: `cargo nextest run -p troupe-runtime --test told_fast_path` and
//! `RUSTFLAGS="--cfg madsim" cargo nextest run -p troupe-runtime --test told_fast_path`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{
    Actor, ActorBox, ActorError, KindConfig, MemoryStore, Runtime, RuntimeCounters, StateStore, Turn,
};

/// Longer than any test: no actor is deactivated while one runs.
const IDLE: Duration = Duration::from_secs(3_600);
/// The timeout of a call or message expected to be handled.
const LONG: Duration = Duration::from_secs(30);
/// The timeout of a message meant to expire.
const SHORT: Duration = Duration::from_millis(50);
/// Long enough for a `SHORT` deadline to have passed.
const PAST_SHORT: Duration = Duration::from_millis(250);

/// What the tests observe: how many times a handler started, and a gate that a
/// `wait-add` command waits on.
#[derive(Default)]
struct Probe {
    handler_starts: AtomicU64,
    gate: Notify,
}

/// A counter whose state is its count. Commands: `add`, `noop`, `fail` (adds 100, then
/// fails: rolled back), `put` (writes the key `told`, state unchanged), `wait-add`
/// (waits for the gate, then adds), `get`.
struct Counter {
    count: u64,
    probe: Arc<Probe>,
}

impl Actor for Counter {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        self.probe.handler_starts.fetch_add(1, Ordering::SeqCst);
        match payload.as_ref() {
            b"add" => self.count += 1,
            b"noop" | b"get" => {}
            b"fail" => {
                self.count += 100;
                return Err(ActorError::failed("told to fail"));
            }
            b"put" => turn.put("told", Bytes::from_static(b"yes"))?,
            b"wait-add" => {
                self.probe.gate.notified().await;
                self.count += 1;
            }
            other => return Err(ActorError::rejected(format!("unknown command {other:?}"))),
        }
        Ok(Bytes::from(self.count.to_string()))
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(self.count.to_string())))
    }
}

fn decode(saved: Option<&Bytes>) -> u64 {
    saved.map_or(0, |bytes| std::str::from_utf8(bytes).unwrap().parse().unwrap())
}

fn counter() -> ActorId {
    ActorId::new("counter", "0").unwrap()
}

fn start(store: Arc<MemoryStore>, probe: &Arc<Probe>) -> Runtime {
    let probe = Arc::clone(probe);
    Runtime::builder()
        .store(store)
        .register(
            ActorKind::new("counter").unwrap(),
            move |_: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Ok(ActorBox::new(Counter {
                    count: decode(saved.as_ref()),
                    probe: Arc::clone(&probe),
                }))
            },
            KindConfig::default().with_idle_timeout(IDLE),
        )
        .unwrap()
        .start()
}

async fn send(runtime: &Runtime, command: &'static str) -> Result<String, InvokeError> {
    let reply = runtime
        .handle()
        .invoke_within(&counter(), Bytes::from_static(command.as_bytes()), LONG)
        .await?;
    Ok(String::from_utf8(reply.to_vec()).unwrap())
}

async fn tell(runtime: &Runtime, command: &'static str, timeout: Duration) {
    runtime
        .handle()
        .tell(
            &counter(),
            Bytes::from_static(command.as_bytes()),
            runtime.deadline_in(timeout),
        )
        .await
        .unwrap();
}

/// What the store holds for the counter.
async fn stored(store: &MemoryStore) -> u64 {
    decode(store.load(&counter()).await.unwrap().as_ref())
}

/// Waits until the counter's handler has started `count` times.
async fn handler_started(probe: &Probe, count: u64) {
    while probe.handler_starts.load(Ordering::SeqCst) < count {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The counters since `before`: (turns run, turns failed, expired dropped).
fn since(runtime: &Runtime, before: RuntimeCounters) -> (u64, u64, u64) {
    let now = runtime.handle().counters();
    (
        now.turns_run - before.turns_run,
        now.turns_failed - before.turns_failed,
        now.expired_dropped - before.expired_dropped,
    )
}

async fn a_batch_of_told_messages_commits_fails_and_drops_each_on_its_own() {
    let store = Arc::new(MemoryStore::new());
    let probe = Arc::new(Probe::default());
    let runtime = Arc::new(start(Arc::clone(&store), &probe));
    // A request holds the actor until the gate opens, so the told messages below queue
    // up and are handled one after another in one wake-up of its task.
    let holder = {
        let runtime = Arc::clone(&runtime);
        tokio::spawn(async move { send(&runtime, "wait-add").await })
    };
    handler_started(&probe, 1).await;
    let before = runtime.handle().counters();
    for command in ["add", "noop", "fail", "add", "put"] {
        tell(&runtime, command, LONG).await;
    }
    // In the middle of the batch, one whose deadline passes while it waits in the queue.
    tell(&runtime, "add", SHORT).await;
    for command in ["noop", "add"] {
        tell(&runtime, command, LONG).await;
    }
    tokio::time::sleep(PAST_SHORT).await;
    probe.gate.notify_one();
    assert_eq!(holder.await.unwrap().unwrap(), "1");
    // 1 (the holder) + 3 adds: the failed turn's +100 rolled back, and only it (the add
    // before it had committed); the expired add never ran.
    assert_eq!(send(&runtime, "get").await.unwrap(), "4");
    assert_eq!(stored(&store).await, 4, "every told turn that changed state committed");
    assert_eq!(
        store.get(&counter(), "told").await.unwrap(),
        Some(Bytes::from_static(b"yes")),
        "a told turn that only wrote a key committed it"
    );
    // The holder, 7 told turns and the get ran; one failed; one was dropped unrun.
    assert_eq!(since(&runtime, before), (9, 1, 1));
    // Handler starts: the holder, the 7 told turns that ran, the get.
    assert_eq!(probe.handler_starts.load(Ordering::SeqCst), 9);
    Arc::into_inner(runtime).unwrap().shutdown().await;
}

#[tokio::test]
async fn a_batch_of_told_messages_commits_fails_and_drops_each_on_its_own_current_thread() {
    a_batch_of_told_messages_commits_fails_and_drops_each_on_its_own().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_told_messages_commits_fails_and_drops_each_on_its_own_multi_thread() {
    a_batch_of_told_messages_commits_fails_and_drops_each_on_its_own().await;
}

async fn a_told_turn_that_waits_goes_on_and_commits_before_the_next() {
    let store = Arc::new(MemoryStore::new());
    let probe = Arc::new(Probe::default());
    let runtime = start(Arc::clone(&store), &probe);
    tell(&runtime, "wait-add", LONG).await;
    tell(&runtime, "add", LONG).await;
    tell(&runtime, "add", LONG).await;
    handler_started(&probe, 1).await;
    probe.gate.notify_one();
    assert_eq!(send(&runtime, "get").await.unwrap(), "3");
    assert_eq!(stored(&store).await, 3);
    // Started once each: the waiting told turn went on with its first poll's handler.
    assert_eq!(probe.handler_starts.load(Ordering::SeqCst), 4);
    runtime.shutdown().await;
}

#[tokio::test]
async fn a_told_turn_that_waits_goes_on_and_commits_before_the_next_current_thread() {
    a_told_turn_that_waits_goes_on_and_commits_before_the_next().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_told_turn_that_waits_goes_on_and_commits_before_the_next_multi_thread() {
    a_told_turn_that_waits_goes_on_and_commits_before_the_next().await;
}

async fn a_told_turn_past_its_deadline_while_it_waits_fails_and_rolls_back() {
    let store = Arc::new(MemoryStore::new());
    let probe = Arc::new(Probe::default());
    let runtime = start(Arc::clone(&store), &probe);
    assert_eq!(send(&runtime, "add").await.unwrap(), "1");
    let before = runtime.handle().counters();
    // It waits for a gate that opens only after its deadline: its own timer ends it.
    tell(&runtime, "wait-add", SHORT).await;
    handler_started(&probe, 2).await;
    tokio::time::sleep(PAST_SHORT).await;
    probe.gate.notify_one();
    assert_eq!(send(&runtime, "get").await.unwrap(), "1");
    assert_eq!(stored(&store).await, 1);
    // The timed-out told turn and the get ran; the told one failed.
    assert_eq!(since(&runtime, before), (2, 1, 0));
    runtime.shutdown().await;
}

#[tokio::test]
async fn a_told_turn_past_its_deadline_while_it_waits_fails_and_rolls_back_current_thread() {
    a_told_turn_past_its_deadline_while_it_waits_fails_and_rolls_back().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_told_turn_past_its_deadline_while_it_waits_fails_and_rolls_back_multi_thread() {
    a_told_turn_past_its_deadline_while_it_waits_fails_and_rolls_back().await;
}

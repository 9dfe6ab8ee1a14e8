//! The turn's fast path (activation.rs): a turn whose handler finishes in its first poll
//! is decided inline, with no boxed turn future; one that has to wait goes on in a box
//! with the same handler future. Each test here fails if the fast path cuts a corner:
//! a first-poll turn that changed state must still commit (request and fire-and-forget),
//! a request whose caller gave up before it was dequeued must not run, a turn that
//! waits must run its handler once and commit what it did after the wait, and a turn
//! whose caller gives up while it waits must commit nothing.
//!
//! Runs in both builds: `cargo nextest run -p troupe-runtime --test turn_fast_path` and
//! `RUSTFLAGS="--cfg madsim" cargo nextest run -p troupe-runtime --test turn_fast_path`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, MemoryStore, Runtime, StateStore, Turn};

/// Longer than any test: no actor is deactivated while one runs.
const IDLE: Duration = Duration::from_secs(3_600);
/// The timeout of a call expected to be answered.
const LONG: Duration = Duration::from_secs(30);
/// The timeout of a call whose caller is meant to give up.
const SHORT: Duration = Duration::from_millis(50);

/// What the tests observe: how many times a handler started, and a gate that a
/// `wait-*` command waits on.
#[derive(Default)]
struct Probe {
    handler_starts: AtomicU64,
    gate: Notify,
}

/// A counter whose state is its count. Commands: `add` (in the first poll), `wait-add`
/// (waits for the gate, then adds), `get`.
struct Counter {
    count: u64,
    probe: Arc<Probe>,
}

impl Actor for Counter {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        self.probe.handler_starts.fetch_add(1, Ordering::SeqCst);
        match payload.as_ref() {
            b"add" => self.count += 1,
            b"wait-add" => {
                self.probe.gate.notified().await;
                self.count += 1;
            }
            b"get" => {}
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

async fn send(runtime: &Runtime, command: &'static str, timeout: Duration) -> Result<String, InvokeError> {
    let reply = runtime
        .handle()
        .invoke_within(&counter(), Bytes::from_static(command.as_bytes()), timeout)
        .await?;
    Ok(String::from_utf8(reply.to_vec()).unwrap())
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

async fn first_poll_turns_that_change_state_commit() {
    let store = Arc::new(MemoryStore::new());
    let probe = Arc::new(Probe::default());
    let runtime = start(Arc::clone(&store), &probe);
    for expected in 1..=3 {
        assert_eq!(send(&runtime, "add", LONG).await.unwrap(), expected.to_string());
        // Acknowledged means committed: the store has it before the reply arrives.
        assert_eq!(stored(&store).await, expected);
    }
    // A fire-and-forget message that finishes in its first poll commits too.
    runtime
        .handle()
        .tell(&counter(), Bytes::from_static(b"add"), runtime.deadline_in(LONG))
        .await
        .unwrap();
    assert_eq!(send(&runtime, "get", LONG).await.unwrap(), "4");
    assert_eq!(stored(&store).await, 4);
    runtime.shutdown().await;
}

#[tokio::test]
async fn first_poll_turns_that_change_state_commit_current_thread() {
    first_poll_turns_that_change_state_commit().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_poll_turns_that_change_state_commit_multi_thread() {
    first_poll_turns_that_change_state_commit().await;
}

async fn a_request_abandoned_before_dequeue_never_runs() {
    let store = Arc::new(MemoryStore::new());
    let probe = Arc::new(Probe::default());
    let runtime = Arc::new(start(Arc::clone(&store), &probe));
    // The first turn holds the actor until the gate opens.
    let holder = {
        let runtime = Arc::clone(&runtime);
        tokio::spawn(async move { send(&runtime, "wait-add", LONG).await })
    };
    handler_started(&probe, 1).await;
    // Queued behind it; its caller gives up before it is dequeued. It would finish in its
    // first poll, so only the dequeue check stands between it and a commit.
    let abandoned = send(&runtime, "add", SHORT).await;
    assert!(matches!(abandoned, Err(InvokeError::Timeout { .. })), "{abandoned:?}");
    probe.gate.notify_one();
    assert_eq!(holder.await.unwrap().unwrap(), "1");
    assert_eq!(send(&runtime, "get", LONG).await.unwrap(), "1");
    // The abandoned request's handler never started: the holder and the get only.
    assert_eq!(probe.handler_starts.load(Ordering::SeqCst), 2);
    assert_eq!(stored(&store).await, 1);
    Arc::into_inner(runtime).unwrap().shutdown().await;
}

#[tokio::test]
async fn a_request_abandoned_before_dequeue_never_runs_current_thread() {
    a_request_abandoned_before_dequeue_never_runs().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_abandoned_before_dequeue_never_runs_multi_thread() {
    a_request_abandoned_before_dequeue_never_runs().await;
}

async fn a_turn_that_waits_goes_on_with_the_same_handler_and_commits() {
    let store = Arc::new(MemoryStore::new());
    let probe = Arc::new(Probe::default());
    let runtime = Arc::new(start(Arc::clone(&store), &probe));
    let waiting = {
        let runtime = Arc::clone(&runtime);
        tokio::spawn(async move { send(&runtime, "wait-add", LONG).await })
    };
    handler_started(&probe, 1).await;
    probe.gate.notify_one();
    assert_eq!(waiting.await.unwrap().unwrap(), "1");
    // Started once: the slow path went on with the first poll's future, it did not run
    // the handler again.
    assert_eq!(probe.handler_starts.load(Ordering::SeqCst), 1);
    assert_eq!(stored(&store).await, 1);
    Arc::into_inner(runtime).unwrap().shutdown().await;
}

#[tokio::test]
async fn a_turn_that_waits_goes_on_with_the_same_handler_and_commits_current_thread() {
    a_turn_that_waits_goes_on_with_the_same_handler_and_commits().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_that_waits_goes_on_with_the_same_handler_and_commits_multi_thread() {
    a_turn_that_waits_goes_on_with_the_same_handler_and_commits().await;
}

async fn a_waiting_turn_whose_caller_gives_up_commits_nothing() {
    let store = Arc::new(MemoryStore::new());
    let probe = Arc::new(Probe::default());
    let runtime = start(Arc::clone(&store), &probe);
    assert_eq!(send(&runtime, "add", LONG).await.unwrap(), "1");
    let abandoned = send(&runtime, "wait-add", SHORT).await;
    assert!(matches!(abandoned, Err(InvokeError::Timeout { .. })), "{abandoned:?}");
    // The gate opens only after the caller has gone: had the turn not been cancelled, it
    // would now add and commit 2.
    probe.gate.notify_one();
    assert_eq!(send(&runtime, "get", LONG).await.unwrap(), "1");
    assert_eq!(stored(&store).await, 1);
    runtime.shutdown().await;
}

#[tokio::test]
async fn a_waiting_turn_whose_caller_gives_up_commits_nothing_current_thread() {
    a_waiting_turn_whose_caller_gives_up_commits_nothing().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_turn_whose_caller_gives_up_commits_nothing_multi_thread() {
    a_waiting_turn_whose_caller_gives_up_commits_nothing().await;
}

//! A store that fails for a moment costs a call latency, not an error: the runtime tries
//! a claim, a commit, a turn's read (`get`, `scan`, `check_fence`) or the save at
//! deactivation that failed with `StoreError::Unavailable` again, within the deadline of
//! the request it serves (the save: within `STORE_RETRY_DEACTIVATION_MS_MAX`), and never
//! runs the turn again.
//!
//! Method: a store that wraps a `MemoryStore` and fails its first claims, commits or
//! reads as told (transiently, or not), or applies a commit and then reports it failed
//! (as a PostgreSQL `COMMIT` whose answer is lost); a counter actor that counts its turns,
//! and one ([`Saver`]) that saves something at deactivation and reads inside its turns.
//! Before the runtime tried again, each call below that now succeeds failed at once with
//! `StorageFailed`, and each save at deactivation was given up at its first failure. Run
//! with `cargo nextest run -p troupe-runtime --test store_retries` (and under `--cfg
//! madsim`). Not a real SQLite lock: SQLite waits one out itself for its busy timeout
//! (5 s) before it reports `Unavailable`, longer than the save's bound.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::time::Instant;
use troupe_core::{ActorId, InvokeError};
use troupe_runtime::{
    Claimed, Fence, MemoryStore, Runtime, StateStore, StoreError, StoreOperation, TurnCommit,
    STORE_RETRY_DEACTIVATION_MS_MAX, STORE_RETRY_PAUSE_MS_MAX,
};

#[path = "support/turn_counter.rs"]
mod turn_counter;
use turn_counter::{turn_counter_runtime, TURN_COUNTER_KIND};

/// What every wait here is bounded by.
const HANG: Duration = Duration::from_secs(60);

/// How the wrapped store fails its next operations of one kind.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Failure {
    /// `Unavailable`, nothing applied.
    Unavailable,
    /// `Unavailable` after the commit was applied (its answer lost).
    AppliedButUnavailable,
    /// `Backend`, which is not transient.
    Backend,
}

/// The failures still to come, per operation, and what was asked.
#[derive(Default)]
struct Plan {
    claims: Vec<Failure>,
    commits: Vec<Failure>,
    /// For the reads inside a turn: `get`, `scan` and `check_fence`.
    reads: Vec<Failure>,
    /// Every claim, commit and read from now on fails `Unavailable`, until healed.
    down: bool,
}

/// A `MemoryStore` that fails as its plan says.
#[derive(Clone)]
struct Flaky {
    inner: MemoryStore,
    plan: Arc<Mutex<Plan>>,
    claims_asked: Arc<AtomicU64>,
    commits_asked: Arc<AtomicU64>,
    reads_asked: Arc<AtomicU64>,
}

impl Flaky {
    fn new() -> Self {
        Self {
            inner: MemoryStore::new(),
            plan: Arc::default(),
            claims_asked: Arc::default(),
            commits_asked: Arc::default(),
            reads_asked: Arc::default(),
        }
    }

    fn fail_claims(&self, failures: &[Failure]) {
        self.plan.lock().unwrap().claims.extend_from_slice(failures);
    }

    fn fail_commits(&self, failures: &[Failure]) {
        self.plan.lock().unwrap().commits.extend_from_slice(failures);
    }

    fn fail_reads(&self, failures: &[Failure]) {
        self.plan.lock().unwrap().reads.extend_from_slice(failures);
    }

    fn set_down(&self, down: bool) {
        self.plan.lock().unwrap().down = down;
    }

    fn next_failure(&self, operation: StoreOperation) -> Option<Failure> {
        let mut plan = self.plan.lock().unwrap();
        if plan.down {
            return Some(Failure::Unavailable);
        }
        let failures = match operation {
            StoreOperation::Claim => &mut plan.claims,
            StoreOperation::Commit => &mut plan.commits,
            _ => &mut plan.reads,
        };
        (!failures.is_empty()).then(|| failures.remove(0))
    }
}

fn failed(operation: StoreOperation, failure: Failure) -> StoreError {
    let cause = "connection refused".to_string();
    match failure {
        Failure::Unavailable | Failure::AppliedButUnavailable => StoreError::Unavailable { operation, cause },
        Failure::Backend => StoreError::Backend { operation, cause },
    }
}

#[async_trait]
impl StateStore for Flaky {
    async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        self.claims_asked.fetch_add(1, Ordering::SeqCst);
        if let Some(failure) = self.next_failure(StoreOperation::Claim) {
            return Err(failed(StoreOperation::Claim, failure));
        }
        self.inner.claim(actor).await
    }

    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        self.inner.load(actor).await
    }

    async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        self.commits_asked.fetch_add(1, Ordering::SeqCst);
        match self.next_failure(StoreOperation::Commit) {
            None => self.inner.commit(actor, fence, commit).await,
            Some(Failure::AppliedButUnavailable) => {
                self.inner.commit(actor, fence, commit).await?;
                Err(failed(StoreOperation::Commit, Failure::AppliedButUnavailable))
            }
            Some(failure) => Err(failed(StoreOperation::Commit, failure)),
        }
    }

    async fn check_fence(&self, actor: &ActorId, fence: Fence) -> Result<(), StoreError> {
        self.reads_asked.fetch_add(1, Ordering::SeqCst);
        // A fence check is a read: reported as one of the state (`Load`).
        if let Some(failure) = self.next_failure(StoreOperation::Load) {
            return Err(failed(StoreOperation::Load, failure));
        }
        self.inner.check_fence(actor, fence).await
    }

    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        self.reads_asked.fetch_add(1, Ordering::SeqCst);
        if let Some(failure) = self.next_failure(StoreOperation::Get) {
            return Err(failed(StoreOperation::Get, failure));
        }
        self.inner.get(actor, key).await
    }

    async fn scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        self.reads_asked.fetch_add(1, Ordering::SeqCst);
        if let Some(failure) = self.next_failure(StoreOperation::Scan) {
            return Err(failed(StoreOperation::Scan, failure));
        }
        self.inner.scan(actor, prefix, after, limit).await
    }
}

fn counter(key: &str) -> ActorId {
    ActorId::new(TURN_COUNTER_KIND, key).unwrap()
}

async fn inc(runtime: &Runtime, id: &ActorId, within: Duration) -> Result<u64, InvokeError> {
    let reply = tokio::time::timeout(HANG, runtime.invoke_within(id, Bytes::from_static(b"inc"), within))
        .await
        .expect("no answer");
    reply.map(|bytes| std::str::from_utf8(&bytes).unwrap().parse().unwrap())
}

/// What the store holds for the counter: its state and its `last` entry.
async fn stored(store: &Flaky, id: &ActorId) -> (Option<Bytes>, Option<Bytes>) {
    (
        store.inner.load(id).await.unwrap(),
        store.inner.get(id, "last").await.unwrap(),
    )
}

fn bytes(text: &str) -> Option<Bytes> {
    Some(Bytes::copy_from_slice(text.as_bytes()))
}

/// The scenario of a commit that fails for a moment: `failures` before it is made.
async fn a_commit_failing_for_a_moment_is_made_once_and_the_call_succeeds(failures: &[Failure]) {
    let store = Flaky::new();
    let turns = Arc::new(AtomicU64::new(0));
    let runtime = turn_counter_runtime(Arc::new(store.clone()), &turns);
    let id = counter("commit");
    assert_eq!(inc(&runtime, &id, Duration::from_secs(10)).await, Ok(1));
    store.fail_commits(failures);
    let asked_before = store.commits_asked.load(Ordering::SeqCst);
    assert_eq!(
        inc(&runtime, &id, Duration::from_secs(10)).await,
        Ok(2),
        "the call succeeds after {failures:?}"
    );
    assert_eq!(
        turns.load(Ordering::SeqCst),
        2,
        "the turn ran once: only its commit was tried again"
    );
    assert_eq!(
        store.commits_asked.load(Ordering::SeqCst) - asked_before,
        failures.len() as u64 + 1,
        "one try per failure, and the one that was made"
    );
    assert_eq!(runtime.handle().counters().store_retries, failures.len() as u64);
    assert_eq!(
        stored(&store, &id).await,
        (bytes("2"), bytes("2")),
        "state and write, once"
    );
    // The activation goes on: the next turn counts from the committed state.
    assert_eq!(inc(&runtime, &id, Duration::from_secs(10)).await, Ok(3));
    assert_eq!(runtime.handle().counters().activations_started, 1);
    runtime.shutdown().await;
}

/// Goal: a commit that fails `Unavailable` three times is tried again and made once, and
/// the caller gets the turn's answer; the turn ran once. Before: the call failed
/// `StorageFailed` at the first failure.
#[tokio::test]
async fn a_commit_failing_for_a_moment_is_tried_again_and_the_call_succeeds() {
    a_commit_failing_for_a_moment_is_made_once_and_the_call_succeeds(&[Failure::Unavailable; 3]).await;
}

/// Goal: the same on worker threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_failing_for_a_moment_is_tried_again_on_worker_threads() {
    a_commit_failing_for_a_moment_is_made_once_and_the_call_succeeds(&[Failure::Unavailable; 3]).await;
}

/// Goal: a commit the store applied but whose answer was lost (`Unavailable` after the
/// writes, as a PostgreSQL `COMMIT` whose connection died) is made again under the same
/// fence, and the store holds it once: the count is 2, not 3, and the turn ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_applied_unseen_and_made_again_is_held_once() {
    a_commit_failing_for_a_moment_is_made_once_and_the_call_succeeds(&[
        Failure::AppliedButUnavailable,
        Failure::Unavailable,
    ])
    .await;
}

/// Goal: a claim that fails `Unavailable` twice is tried again; the activation starts
/// and the call succeeds from the stored state. Before: the call failed `StorageFailed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_failing_for_a_moment_is_tried_again_and_the_call_succeeds() {
    let store = Flaky::new();
    let turns = Arc::new(AtomicU64::new(0));
    let runtime = turn_counter_runtime(Arc::new(store.clone()), &turns);
    let id = counter("claim");
    assert_eq!(inc(&runtime, &id, Duration::from_secs(10)).await, Ok(1));
    assert!(runtime.handle().deactivate(&id).await.unwrap(), "deactivated");
    store.fail_claims(&[Failure::Unavailable; 2]);
    assert_eq!(inc(&runtime, &id, Duration::from_secs(10)).await, Ok(2));
    assert_eq!(
        store.claims_asked.load(Ordering::SeqCst),
        4,
        "1, then 1 + 2 tries again"
    );
    assert_eq!(runtime.handle().counters().store_retries, 2);
    assert_eq!(stored(&store, &id).await, (bytes("2"), bytes("2")));
    runtime.shutdown().await;
}

/// Goal: a failure that is not transient (`Backend`) fails the call at once, as before:
/// no try again, for a claim or a commit.
#[tokio::test]
async fn a_failure_that_is_not_transient_fails_the_call_at_once() {
    let store = Flaky::new();
    let turns = Arc::new(AtomicU64::new(0));
    let runtime = turn_counter_runtime(Arc::new(store.clone()), &turns);
    let id = counter("backend");
    store.fail_claims(&[Failure::Backend]);
    match inc(&runtime, &id, Duration::from_secs(10)).await {
        Err(InvokeError::StorageFailed {
            source:
                StoreError::Backend {
                    operation: StoreOperation::Claim,
                    ..
                },
            ..
        }) => {}
        other => panic!("the claim's failure: {other:?}"),
    }
    assert_eq!(store.claims_asked.load(Ordering::SeqCst), 1);
    assert_eq!(inc(&runtime, &id, Duration::from_secs(10)).await, Ok(1));
    store.fail_commits(&[Failure::Backend]);
    let started = Instant::now();
    match inc(&runtime, &id, Duration::from_secs(10)).await {
        Err(InvokeError::StorageFailed {
            source:
                StoreError::Backend {
                    operation: StoreOperation::Commit,
                    ..
                },
            ..
        }) => {}
        other => panic!("the commit's failure: {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "at once: {:?}",
        started.elapsed()
    );
    assert_eq!(runtime.handle().counters().store_retries, 0);
    // Rolled back as before; the activation goes on.
    assert_eq!(inc(&runtime, &id, Duration::from_secs(10)).await, Ok(2));
    assert_eq!(
        runtime.handle().counters().activations_started,
        2,
        "the failed claim's, then one"
    );
    runtime.shutdown().await;
}

/// Goal: a `MemoryStore`'s injected fault is not transient: the call fails at once and
/// nothing is tried again (the simulator's storage faults behave as before).
#[tokio::test]
async fn an_injected_fault_fails_the_call_at_once() {
    let store = MemoryStore::new();
    let turns = Arc::new(AtomicU64::new(0));
    let runtime = turn_counter_runtime(Arc::new(store.clone()), &turns);
    let id = counter("injected");
    assert_eq!(inc(&runtime, &id, Duration::from_secs(10)).await, Ok(1));
    store.faults().fail_next_commits(1);
    match inc(&runtime, &id, Duration::from_secs(10)).await {
        Err(InvokeError::StorageFailed {
            source: StoreError::Injected { .. },
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(runtime.handle().counters().store_retries, 0);
    assert_eq!(inc(&runtime, &id, Duration::from_secs(10)).await, Ok(2));
    runtime.shutdown().await;
}

/// Goal: a store unavailable for longer than the request's deadline ends the call with
/// `StorageFailed(Unavailable)` by the deadline (not a `Timeout`, not later), after
/// trying again all along; the activation is closed (the commit may have been applied
/// unseen), and once the store is back the next call runs in a new activation from what
/// the store holds. Simulated time: the tries' pauses are exact.
#[tokio::test(start_paused = true)]
async fn a_commit_unavailable_past_the_deadline_fails_storage_failed_by_the_deadline() {
    let store = Flaky::new();
    let turns = Arc::new(AtomicU64::new(0));
    let runtime = turn_counter_runtime(Arc::new(store.clone()), &turns);
    let id = counter("down");
    assert_eq!(inc(&runtime, &id, Duration::from_secs(10)).await, Ok(1));
    store.set_down(true);
    let within = Duration::from_millis(2_000);
    let started = Instant::now();
    let result = inc(&runtime, &id, within).await;
    let took = started.elapsed();
    match &result {
        Err(InvokeError::StorageFailed {
            source:
                StoreError::Unavailable {
                    operation: StoreOperation::Commit,
                    ..
                },
            ..
        }) => {}
        other => panic!("not the store's last error: {other:?}"),
    }
    assert!(took <= within, "ended by the deadline: {took:?}");
    assert!(
        took + Duration::from_millis(STORE_RETRY_PAUSE_MS_MAX) >= within,
        "tried again until near the deadline: {took:?}"
    );
    let retries = runtime.handle().counters().store_retries;
    // 10, 20, 40, 80, 160, 250 ms ... then halves of what is left: at least 10 tries.
    assert!(retries >= 10, "{retries} tries again");
    assert_eq!(turns.load(Ordering::SeqCst), 2, "the turn ran once");
    store.set_down(false);
    assert_eq!(
        inc(&runtime, &id, Duration::from_secs(10)).await,
        Ok(2),
        "from the store's state"
    );
    assert_eq!(
        runtime.handle().counters().activations_started,
        2,
        "the activation that gave up was closed"
    );
    runtime.shutdown().await;
}

/// Goal: the same for a claim: the store unavailable past the deadline fails the call
/// with `StorageFailed(Unavailable)` by the deadline, and the next call after the store
/// is back succeeds.
#[tokio::test(start_paused = true)]
async fn a_claim_unavailable_past_the_deadline_fails_storage_failed_by_the_deadline() {
    let store = Flaky::new();
    let turns = Arc::new(AtomicU64::new(0));
    let runtime = turn_counter_runtime(Arc::new(store.clone()), &turns);
    let id = counter("never-claimed");
    store.set_down(true);
    let within = Duration::from_millis(1_500);
    let started = Instant::now();
    match inc(&runtime, &id, within).await {
        Err(InvokeError::StorageFailed {
            source:
                StoreError::Unavailable {
                    operation: StoreOperation::Claim,
                    ..
                },
            ..
        }) => {}
        other => panic!("not the store's last error: {other:?}"),
    }
    let took = started.elapsed();
    assert!(took <= within, "{took:?}");
    assert!(
        took + Duration::from_millis(STORE_RETRY_PAUSE_MS_MAX) >= within,
        "{took:?}"
    );
    assert_eq!(turns.load(Ordering::SeqCst), 0);
    store.set_down(false);
    assert_eq!(inc(&runtime, &id, Duration::from_secs(10)).await, Ok(1));
    runtime.shutdown().await;
}

/// Goal: the tries stop at once when the runtime shuts down (its mailboxes close) or is
/// dropped (aborted): a call whose deadline is 30 s away, on a store that stays down,
/// ends within one pause of the shutdown, not at its deadline.
#[tokio::test(start_paused = true)]
async fn the_tries_stop_when_the_runtime_shuts_down_or_is_dropped() {
    for drop_it in [false, true] {
        let store = Flaky::new();
        let turns = Arc::new(AtomicU64::new(0));
        let runtime = turn_counter_runtime(Arc::new(store.clone()), &turns);
        let id = counter("stopping");
        assert_eq!(inc(&runtime, &id, Duration::from_secs(10)).await, Ok(1));
        store.set_down(true);
        let handle = runtime.handle();
        let call = tokio::spawn({
            let id = id.clone();
            async move {
                handle
                    .invoke_within(&id, Bytes::from_static(b"inc"), Duration::from_secs(30))
                    .await
            }
        });
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        assert!(!call.is_finished(), "still trying while the runtime runs");
        let stopping = Instant::now();
        if drop_it {
            drop(runtime);
        } else {
            runtime.shutdown().await;
        }
        let result = tokio::time::timeout(HANG, call).await.expect("the call ended").unwrap();
        let took = stopping.elapsed();
        assert!(result.is_err(), "{result:?}");
        assert!(
            took <= Duration::from_millis(STORE_RETRY_PAUSE_MS_MAX + 50),
            "drop {drop_it}: the call ended {took:?} after the runtime stopped: {result:?}"
        );
    }
}

/// The kind of [`Saver`].
const SAVER_KIND: &str = "saver";

/// A counter that also has something to save at deactivation and reads inside its
/// turns: `inc` adds one (its snapshot, and the key `last`); `on_deactivate` adds
/// [`SAVED_AT_DEACTIVATION`], which only the save at deactivation stores; `get` reads
/// `last`, `scan` counts the keys, `fence` checks the activation's fence.
struct Saver {
    count: u64,
}

/// What `on_deactivate` adds to the count: a next activation that counts from above it
/// read the save made at deactivation.
const SAVED_AT_DEACTIVATION: u64 = 100;

impl troupe_runtime::Actor for Saver {
    async fn handle(
        &mut self,
        turn: &mut troupe_runtime::Turn,
        payload: Bytes,
    ) -> Result<Bytes, troupe_runtime::ActorError> {
        match &payload[..] {
            b"inc" => {
                self.count += 1;
                let count = Bytes::from(self.count.to_string());
                turn.put("last", count.clone())?;
                Ok(count)
            }
            b"get" => Ok(turn.get("last").await?.unwrap_or_default()),
            b"scan" => Ok(Bytes::from(turn.scan("", None, 10).await?.len().to_string())),
            b"fence" => {
                turn.check_fence().await?;
                Ok(Bytes::from_static(b"current"))
            }
            _ => Err(troupe_runtime::ActorError::Rejected {
                reason: "inc, get, scan or fence".to_string(),
            }),
        }
    }

    async fn on_deactivate(&mut self, _id: &ActorId) -> Result<(), troupe_runtime::ActorError> {
        self.count += SAVED_AT_DEACTIVATION;
        Ok(())
    }

    fn snapshot(&self) -> Result<Option<Bytes>, troupe_runtime::ActorError> {
        Ok(Some(Bytes::from(self.count.to_string())))
    }
}

/// A runtime on `store` with [`Saver`]s registered, and `grace` to shut down in.
fn saver_runtime(store: &Flaky, grace: Duration) -> Runtime {
    Runtime::builder()
        .store(Arc::new(store.clone()))
        .shutdown_grace(grace)
        .expect("a grace within bounds")
        .register(
            troupe_core::ActorKind::new(SAVER_KIND).unwrap(),
            |_id: &ActorId, saved: Option<Bytes>| -> Result<troupe_runtime::ActorBox, troupe_runtime::ActorError> {
                let count = saved.map_or(0, |saved| std::str::from_utf8(&saved).unwrap().parse().unwrap());
                Ok(troupe_runtime::ActorBox::new(Saver { count }))
            },
            troupe_runtime::KindConfig::default(),
        )
        .unwrap()
        .start()
}

fn saver(key: &str) -> ActorId {
    ActorId::new(SAVER_KIND, key).unwrap()
}

async fn ask(runtime: &Runtime, id: &ActorId, what: &'static str, within: Duration) -> Result<String, InvokeError> {
    let reply = tokio::time::timeout(
        HANG,
        runtime.invoke_within(id, Bytes::from_static(what.as_bytes()), within),
    )
    .await
    .expect("no answer");
    reply.map(|bytes| std::str::from_utf8(&bytes).unwrap().to_string())
}

/// Goal: a save at deactivation that fails `Unavailable` twice is tried again and made:
/// the next activation counts from what `on_deactivate` added. Before: the save was
/// given up at the first failure (`deactivation_saves_failed` 1), and the next
/// activation counted from the last turn's 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deactivation_save_failing_twice_is_made_and_the_next_activation_reads_it() {
    let store = Flaky::new();
    let runtime = saver_runtime(&store, Duration::from_secs(5));
    let id = saver("save");
    assert_eq!(ask(&runtime, &id, "inc", Duration::from_secs(10)).await, Ok("1".into()));
    store.fail_commits(&[Failure::Unavailable; 2]);
    let asked_before = store.commits_asked.load(Ordering::SeqCst);
    assert!(runtime.handle().deactivate(&id).await.unwrap(), "deactivated");
    assert_eq!(
        store.commits_asked.load(Ordering::SeqCst) - asked_before,
        3,
        "two failures, then the save"
    );
    let counters = runtime.handle().counters();
    assert_eq!(counters.deactivation_saves_failed, 0);
    assert_eq!(counters.store_retries, 2);
    assert_eq!(
        ask(&runtime, &id, "inc", Duration::from_secs(10)).await,
        Ok((SAVED_AT_DEACTIVATION + 2).to_string()),
        "counted from the save at deactivation"
    );
    runtime.shutdown().await;
}

/// Goal: a save at deactivation on a store that stays unavailable is tried again for
/// `STORE_RETRY_DEACTIVATION_MS_MAX`, no longer, then given up (counted in
/// `deactivation_saves_failed`); the next activation, once the store is back, counts
/// from the last committed turn. Simulated time. Before: given up at once.
#[tokio::test(start_paused = true)]
async fn a_deactivation_save_unavailable_past_its_bound_is_given_up_and_the_last_turn_stays() {
    let store = Flaky::new();
    let runtime = saver_runtime(&store, Duration::from_secs(5));
    let id = saver("given-up");
    assert_eq!(ask(&runtime, &id, "inc", Duration::from_secs(10)).await, Ok("1".into()));
    store.set_down(true);
    let started = Instant::now();
    assert!(runtime.handle().deactivate(&id).await.unwrap(), "deactivated");
    let took = started.elapsed();
    let bound = Duration::from_millis(STORE_RETRY_DEACTIVATION_MS_MAX);
    assert!(took <= bound, "within its bound: {took:?}");
    assert!(
        took + Duration::from_millis(STORE_RETRY_PAUSE_MS_MAX) >= bound,
        "tried again until near its bound: {took:?}"
    );
    let counters = runtime.handle().counters();
    assert_eq!(counters.deactivation_saves_failed, 1);
    assert!(counters.store_retries >= 8, "{} tries again", counters.store_retries);
    store.set_down(false);
    assert_eq!(
        ask(&runtime, &id, "inc", Duration::from_secs(10)).await,
        Ok("2".into()),
        "counted from the last committed turn"
    );
    runtime.shutdown().await;
}

/// Goal: a new request for an actor whose save at deactivation is being tried again is
/// held until that activation has ended, then served by a new one that reads the save
/// (never two activations at once). Before: the save was given up at once, and the
/// request counted from the last turn's 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_during_a_retried_deactivation_save_waits_for_it_and_reads_it() {
    let store = Flaky::new();
    let runtime = saver_runtime(&store, Duration::from_secs(5));
    let id = saver("held");
    assert_eq!(ask(&runtime, &id, "inc", Duration::from_secs(10)).await, Ok("1".into()));
    store.set_down(true);
    let deactivation = tokio::spawn({
        let handle = runtime.handle();
        let id = id.clone();
        async move { handle.deactivate(&id).await }
    });
    // Until the first pause has started (the save has failed at least once).
    while runtime.handle().counters().store_retries == 0 && !deactivation.is_finished() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let request = tokio::spawn({
        let handle = runtime.handle();
        let id = id.clone();
        async move {
            handle
                .invoke_within(&id, Bytes::from_static(b"inc"), Duration::from_secs(10))
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!request.is_finished(), "held while the save is tried again");
    assert_eq!(runtime.handle().counters().activations_started, 1);
    store.set_down(false);
    assert!(tokio::time::timeout(HANG, deactivation)
        .await
        .unwrap()
        .unwrap()
        .unwrap());
    let reply = tokio::time::timeout(HANG, request).await.unwrap().unwrap().unwrap();
    assert_eq!(&reply[..], (SAVED_AT_DEACTIVATION + 2).to_string().as_bytes());
    assert_eq!(runtime.handle().counters().deactivation_saves_failed, 0);
    assert_eq!(runtime.handle().counters().activations_started, 2);
    runtime.shutdown().await;
}

/// Goal: a turn's `get`, `scan` and `check_fence` that fail `Unavailable` twice each are
/// tried again and answer; the turn ran once each. Before: each turn failed
/// `StorageFailed(Unavailable)` at the first failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_inside_a_turn_failing_twice_answer() {
    let store = Flaky::new();
    let runtime = saver_runtime(&store, Duration::from_secs(5));
    let id = saver("reads");
    assert_eq!(ask(&runtime, &id, "inc", Duration::from_secs(10)).await, Ok("1".into()));
    for (what, answer) in [("get", "1"), ("scan", "1"), ("fence", "current")] {
        store.fail_reads(&[Failure::Unavailable; 2]);
        let asked_before = store.reads_asked.load(Ordering::SeqCst);
        assert_eq!(
            ask(&runtime, &id, what, Duration::from_secs(10)).await,
            Ok(answer.to_string()),
            "{what}"
        );
        assert_eq!(store.reads_asked.load(Ordering::SeqCst) - asked_before, 3, "{what}");
    }
    assert_eq!(runtime.handle().counters().store_retries, 6);
    assert_eq!(runtime.handle().counters().activations_started, 1);
    runtime.shutdown().await;
}

/// Goal: a `get` on a store unavailable past the request's deadline fails the turn with
/// `StorageFailed(Unavailable, get)` by the deadline (not a `Timeout`), after trying
/// again all along; the activation goes on once the store is back. Simulated time.
/// Before: the turn failed at once.
#[tokio::test(start_paused = true)]
async fn a_get_unavailable_past_the_deadline_fails_the_turn_storage_failed() {
    let store = Flaky::new();
    let runtime = saver_runtime(&store, Duration::from_secs(5));
    let id = saver("get-down");
    assert_eq!(ask(&runtime, &id, "inc", Duration::from_secs(10)).await, Ok("1".into()));
    store.set_down(true);
    let within = Duration::from_millis(1_500);
    let started = Instant::now();
    match ask(&runtime, &id, "get", within).await {
        Err(InvokeError::StorageFailed {
            source:
                StoreError::Unavailable {
                    operation: StoreOperation::Get,
                    ..
                },
            ..
        }) => {}
        other => panic!("not the store's last error: {other:?}"),
    }
    let took = started.elapsed();
    assert!(took <= within, "by the deadline: {took:?}");
    assert!(
        took + Duration::from_millis(STORE_RETRY_PAUSE_MS_MAX) >= within,
        "tried again until near the deadline: {took:?}"
    );
    assert!(runtime.handle().counters().store_retries >= 8);
    store.set_down(false);
    assert_eq!(ask(&runtime, &id, "get", Duration::from_secs(10)).await, Ok("1".into()));
    assert_eq!(runtime.handle().counters().activations_started, 1);
    runtime.shutdown().await;
}

/// What a shutdown cut at its grace's end takes beyond it: the abort of what still runs
/// and its report to the dispatcher (a few hundred nanoseconds of simulated time under
/// madsim, none under tokio's paused clock).
const ABORT_SLACK: Duration = Duration::from_millis(1);

/// Goal: a shutdown whose saves at deactivation are being tried again ends within its
/// grace: cut at the grace's end when the grace is shorter than
/// `STORE_RETRY_DEACTIVATION_MS_MAX` (nothing half-saved: a new runtime counts from the
/// last turn), and given up at that bound when the grace is longer. Simulated time.
/// Before: the save was given up at once, and never tried again.
#[tokio::test(start_paused = true)]
async fn a_shutdown_with_a_save_being_tried_again_ends_within_its_grace() {
    for grace_ms in [500, 5_000] {
        let store = Flaky::new();
        let runtime = saver_runtime(&store, Duration::from_millis(grace_ms));
        let id = saver("shutdown");
        assert_eq!(ask(&runtime, &id, "inc", Duration::from_secs(10)).await, Ok("1".into()));
        store.set_down(true);
        let handle = runtime.handle();
        let started = Instant::now();
        tokio::time::timeout(HANG, runtime.shutdown()).await.expect("shut down");
        let took = started.elapsed();
        let grace = Duration::from_millis(grace_ms);
        assert!(
            took <= grace + ABORT_SLACK,
            "grace {grace_ms} ms: shut down in {took:?}"
        );
        let bound = Duration::from_millis(STORE_RETRY_DEACTIVATION_MS_MAX.min(grace_ms));
        assert!(
            took + Duration::from_millis(STORE_RETRY_PAUSE_MS_MAX) >= bound,
            "grace {grace_ms} ms: the save was tried again until {bound:?}: {took:?}"
        );
        assert!(handle.counters().store_retries >= 5, "grace {grace_ms} ms");
        store.set_down(false);
        let again = saver_runtime(&store, Duration::from_secs(5));
        assert_eq!(
            ask(&again, &id, "inc", Duration::from_secs(10)).await,
            Ok("2".into()),
            "grace {grace_ms} ms: from the last committed turn"
        );
        again.shutdown().await;
    }
}

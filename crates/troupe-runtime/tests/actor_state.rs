//! Actor state through the real runtime: what a turn or a deactivation commits, how two
//! runtimes on one store fence each other, what a storage failure looks like to the
//! caller, and what a turn's scan returns at the scan limit.
//!
//! The store-level contract is in `state_store_conformance.rs`; these tests check that
//! the runtime uses it right (activation claims, commits carry the fence, snapshot
//! transitions become the right [`StateChange`]).
//!
//! Runs in both builds: `cargo nextest run -p troupe-runtime --test actor_state` and
//! `RUSTFLAGS="--cfg madsim" cargo nextest run -p troupe-runtime --test actor_state`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{
    Actor, ActorBox, ActorError, Fence, KindConfig, MemoryStore, Runtime, RuntimeHandle, SqliteStore, StateChange,
    StateStore, StoreError, StoreOperation, Turn, TurnCommit, STATE_SCAN_LIMIT_MAX, TURN_WRITES_MAX,
};

const IDLE: Duration = Duration::from_millis(500);
const LONG: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------
// A counter whose state can be cleared, and a scanner
// ---------------------------------------------------------------------------------------

/// The count each activation of a counter started with, in order (`None`: no state).
#[derive(Clone, Default)]
struct Activations(Arc<Mutex<Vec<Option<u64>>>>);

impl Activations {
    fn saved(&self) -> Vec<Option<u64>> {
        self.0.lock().unwrap().clone()
    }
}

/// A count that is `None` until the first `add` and after a `clear`. Commands:
/// `add`, `get`, `clear`, and `clear-on-deactivate` (clear in `on_deactivate`, so only
/// the deactivation save can persist it). Replies with the count, or `none`.
struct Counter {
    count: Option<u64>,
    clear_on_deactivate: bool,
    activations: Activations,
}

impl Counter {
    fn reply(&self) -> Bytes {
        Bytes::from(self.count.map_or_else(|| "none".to_string(), |count| count.to_string()))
    }
}

impl Actor for Counter {
    async fn on_activate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        // Here, not in the factory: the factory also rebuilds the actor after a failed turn.
        self.activations.0.lock().unwrap().push(self.count);
        Ok(())
    }

    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        match payload.as_ref() {
            b"add" => self.count = Some(self.count.unwrap_or(0) + 1),
            b"get" => {}
            b"clear" => self.count = None,
            b"clear-on-deactivate" => self.clear_on_deactivate = true,
            other => return Err(ActorError::rejected(format!("unknown command {other:?}"))),
        }
        Ok(self.reply())
    }

    async fn on_deactivate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        if self.clear_on_deactivate {
            self.count = None;
        }
        Ok(())
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(self.count.map(|count| Bytes::from(count.to_string())))
    }
}

fn decode_count(saved: Option<&Bytes>) -> Option<u64> {
    saved.map(|bytes| {
        std::str::from_utf8(bytes)
            .expect("a count is text")
            .parse()
            .expect("a count is a number")
    })
}

/// A stateless actor whose turn applies the payload's writes (`+key` puts `new`,
/// `-key` deletes, one per line), then scans prefix `k` with the largest limit and
/// replies with the keys found, one per line.
struct Scanner;

impl Actor for Scanner {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let payload = std::str::from_utf8(&payload).expect("a scan request is text");
        for line in payload.lines() {
            match line.split_at(1) {
                ("+", key) => turn.put(key, Bytes::from_static(b"new"))?,
                ("-", key) => turn.delete(key)?,
                _ => return Err(ActorError::rejected(format!("bad line {line:?}"))),
            }
        }
        let entries = turn.scan("k", None, STATE_SCAN_LIMIT_MAX).await?;
        let keys: Vec<String> = entries.into_iter().map(|(key, _)| key).collect();
        Ok(Bytes::from(keys.join("\n")))
    }
}

fn counter(key: &str) -> ActorId {
    ActorId::new("counter", key).unwrap()
}

fn scanner(key: &str) -> ActorId {
    ActorId::new("scanner", key).unwrap()
}

fn start(store: Arc<dyn StateStore>, config: KindConfig, activations: &Activations) -> Runtime {
    let log = activations.clone();
    Runtime::builder()
        .store(store)
        .register(
            ActorKind::new("counter").unwrap(),
            move |_: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Ok(ActorBox::new(Counter {
                    count: decode_count(saved.as_ref()),
                    clear_on_deactivate: false,
                    activations: log.clone(),
                }))
            },
            config,
        )
        .unwrap()
        .register(
            ActorKind::new("scanner").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Scanner)) },
            KindConfig::default(),
        )
        .unwrap()
        .start()
}

async fn send(runtime: &RuntimeHandle, target: &ActorId, command: &str) -> Result<String, InvokeError> {
    runtime
        .invoke(
            target,
            Bytes::copy_from_slice(command.as_bytes()),
            runtime.deadline_in(LONG),
        )
        .await
        .map(|reply| String::from_utf8(reply.to_vec()).expect("a text reply"))
}

/// A directory of its own for one test (`tempfile`), removed when dropped; named after
/// the test and the process, so that a leftover one tells whose it was.
struct TestDirectory(tempfile::TempDir);

impl TestDirectory {
    fn new(test_name: &str) -> Self {
        let directory = tempfile::Builder::new()
            .prefix(&format!("troupe-actor-state-{test_name}-{}-", std::process::id()))
            .tempdir()
            .expect("create the test directory");
        Self(directory)
    }

    fn file(&self) -> PathBuf {
        self.0.path().join("state.sqlite")
    }
}

// ---------------------------------------------------------------------------------------
// Unchanged, set and deleted
// ---------------------------------------------------------------------------------------

/// Goal: an actor that clears its state (snapshot `Some` → `None`) in a turn is built
/// from `None` when it next activates; before `StateChange`, "no state" meant "leave
/// as is" and the old count came back. Method: add, clear, read the store, wait past
/// the idle timeout, ask again.
async fn cleared_state_stays_cleared_after_reactivation(store: Arc<dyn StateStore>) {
    let activations = Activations::default();
    let runtime = start(
        Arc::clone(&store),
        KindConfig::default().with_idle_timeout(IDLE),
        &activations,
    );
    let id = counter("c");
    assert_eq!(send(&runtime, &id, "add").await, Ok("1".to_string()));
    assert_eq!(send(&runtime, &id, "add").await, Ok("2".to_string()));
    assert_eq!(store.load(&id).await, Ok(Some(Bytes::from_static(b"2"))));
    assert_eq!(send(&runtime, &id, "clear").await, Ok("none".to_string()));
    assert_eq!(store.load(&id).await, Ok(None), "the clearing turn deleted the state");

    tokio::time::sleep(IDLE * 3).await;
    assert_eq!(
        runtime.stats().await.unwrap().activations,
        0,
        "the idle counter deactivated"
    );
    assert_eq!(send(&runtime, &id, "get").await, Ok("none".to_string()));
    assert_eq!(activations.saved(), vec![None, None]);
    runtime.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn actor_that_clears_its_state_in_a_turn_reactivates_with_none_in_memory_store() {
    cleared_state_stays_cleared_after_reactivation(Arc::new(MemoryStore::new())).await;
}

#[tokio::test(start_paused = true)]
async fn actor_that_clears_its_state_in_a_turn_reactivates_with_none_in_sqlite_store() {
    cleared_state_stays_cleared_after_reactivation(Arc::new(SqliteStore::open_in_memory().unwrap())).await;
}

/// Goal: the deactivation save maps `Some` → `None` to a delete too. Method: the
/// counter clears its count in `on_deactivate`, which only the deactivation save can
/// persist; after reactivation it must be `None`, not the count of its last turn.
#[tokio::test(start_paused = true)]
async fn actor_that_clears_its_state_on_deactivation_reactivates_with_none() {
    let store = Arc::new(MemoryStore::new());
    let activations = Activations::default();
    let runtime = start(
        store.clone(),
        KindConfig::default().with_idle_timeout(IDLE),
        &activations,
    );
    let id = counter("c");
    assert_eq!(send(&runtime, &id, "add").await, Ok("1".to_string()));
    assert_eq!(send(&runtime, &id, "clear-on-deactivate").await, Ok("1".to_string()));
    assert_eq!(store.load(&id).await, Ok(Some(Bytes::from_static(b"1"))));

    tokio::time::sleep(IDLE * 3).await;
    assert_eq!(runtime.counters().deactivations_finished, 1);
    assert_eq!(runtime.counters().deactivation_saves_failed, 0);
    assert_eq!(
        store.load(&id).await,
        Ok(None),
        "the deactivation save deleted the state"
    );
    assert_eq!(send(&runtime, &id, "get").await, Ok("none".to_string()));
    assert_eq!(activations.saved(), vec![None, None]);
    runtime.shutdown().await;
}

// ---------------------------------------------------------------------------------------
// Fencing: two runtimes on one SQLite file
// ---------------------------------------------------------------------------------------

/// Increments sent to each runtime in the alternating phase.
const ALTERNATING_ROUNDS: u64 = 10;

/// The count committed in `file` for `id`, read through a store of its own.
async fn committed_count(file: &std::path::Path, id: &ActorId) -> Option<u64> {
    let reader = SqliteStore::open(file).expect("open the file to read it");
    decode_count(reader.load(id).await.expect("load").as_ref())
}

/// The expected outcome of one `add` sent to runtime `index`, from a model of claims and
/// fences: a runtime without a live activation claims the newest fence; one whose fence
/// is stale is refused with `Fenced` and its activation is closed at once, so its next
/// request activates afresh.
struct FenceModel {
    held: [Option<Fence>; 2],
    newest: Option<Fence>,
    count: u64,
}

impl FenceModel {
    fn add(&mut self, index: usize, id: &ActorId) -> Result<String, InvokeError> {
        let held = match self.held[index] {
            Some(held) => held,
            None => {
                let fence = self.newest.map_or(Fence::FIRST, Fence::next);
                self.newest = Some(fence);
                self.held[index] = Some(fence);
                fence
            }
        };
        if Some(held) != self.newest {
            self.held[index] = None;
            return Err(InvokeError::StorageFailed {
                target: id.clone(),
                source: StoreError::Fenced {
                    actor: id.clone(),
                    held,
                    current: self.newest,
                },
            });
        }
        self.count += 1;
        Ok(self.count.to_string())
    }
}

/// Goal: two runtimes on one SQLite file never both commit for one actor, so no
/// acknowledged increment is lost (without fences, 20 increments were acknowledged and
/// the count was 11), and a stale activation recovers at once instead of failing until
/// it goes idle. Method: runtimes A and B alternately increment counter `c`. Each
/// activation claims a newer fence, which makes the other runtime's activation stale:
/// its next turn fails with `StorageFailed`, source `Fenced`, commits nothing, and its
/// activation is closed, so the request after that claims afresh and succeeds. Every
/// outcome is checked against a model of claims and fences, and the committed count
/// equals the number of acknowledged increments, exactly.
async fn alternating_increments_on_two_runtimes_lose_nothing(directory: TestDirectory) {
    let id = counter("c");
    let file = directory.file();
    let config = KindConfig::default();
    let activations = Activations::default();
    let open = || -> Arc<dyn StateStore> { Arc::new(SqliteStore::open(&file).expect("open the file")) };
    let runtimes = [start(open(), config, &activations), start(open(), config, &activations)];
    let mut model = FenceModel {
        held: [None, None],
        newest: None,
        count: 0,
    };
    let (mut acknowledged, mut refused) = (0_u64, 0_u64);
    for round in 0..ALTERNATING_ROUNDS {
        for (index, runtime) in runtimes.iter().enumerate() {
            let outcome = send(runtime, &id, "add").await;
            assert_eq!(outcome, model.add(index, &id), "round {round}, runtime {index}");
            match outcome {
                Ok(_) => acknowledged += 1,
                Err(_) => refused += 1,
            }
            // The closed stale activation must be gone before the model's next claim.
            settle(runtime).await;
        }
    }
    assert!(
        refused >= ALTERNATING_ROUNDS / 2,
        "stale activations were refused: {refused}"
    );
    assert_eq!(committed_count(&file, &id).await, Some(acknowledged));
    assert_eq!(
        InvokeError::StorageFailed {
            target: id.clone(),
            source: StoreError::Fenced {
                actor: id.clone(),
                held: Fence::FIRST,
                current: Some(Fence::FIRST.next())
            },
        }
        .to_string(),
        "storage failed for counter/c: commit for counter/c was fenced off: it holds fence 1, \
         but the newest claim holds fence 2"
    );
    let [runtime_a, runtime_b] = runtimes;
    runtime_a.shutdown().await;
    runtime_b.shutdown().await;
    assert_eq!(committed_count(&file, &id).await, Some(acknowledged));
    // Every activation was built from the count committed last.
    let saved = activations.saved();
    assert_eq!(saved.len() as u64, refused + 2, "one activation per claim: {saved:?}");
}

/// Waits until `runtime` has no activation still deactivating.
async fn settle(runtime: &RuntimeHandle) {
    for _ in 0..1_000 {
        if runtime.stats().await.expect("running").deactivating == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("an activation never finished deactivating");
}

#[tokio::test]
async fn two_runtimes_on_one_sqlite_file_lose_no_acknowledged_increment() {
    let directory = TestDirectory::new("two_runtimes_on_one_sqlite_file_lose_no_acknowledged_increment");
    alternating_increments_on_two_runtimes_lose_nothing(directory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_runtimes_on_one_sqlite_file_lose_no_acknowledged_increment_on_worker_threads() {
    let directory =
        TestDirectory::new("two_runtimes_on_one_sqlite_file_lose_no_acknowledged_increment_on_worker_threads");
    alternating_increments_on_two_runtimes_lose_nothing(directory).await;
}

/// Where the two racing runtimes wait for each other: a count and a `Notify`, not a
/// `tokio::sync::Barrier`, whose wake order follows tokio's own random generator under
/// the simulator (see `clippy.toml`).
#[derive(Default)]
struct BothStarted {
    arrived: std::sync::atomic::AtomicUsize,
    all_in: tokio::sync::Notify,
}

impl BothStarted {
    async fn arrive_and_wait(&self) {
        // Registered before this arrival counts, so the other side's wake-up cannot fall
        // between the count and the wait.
        let all_in = self.all_in.notified();
        tokio::pin!(all_in);
        all_in.as_mut().enable();
        if self.arrived.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 == 2 {
            self.all_in.notify_waiters();
        } else {
            all_in.await;
        }
    }
}

/// Goal: the fence holds when the two runtimes race, not only when they alternate.
/// Method: on worker threads, both runtimes activate the counter, wait for each other,
/// then send their increments concurrently, each restarting itself after a refusal (so
/// activations keep fencing each other off); every refusal must be a `Fenced` storage
/// failure, and the committed count must equal the acknowledged increments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_runtimes_on_one_sqlite_file_lose_no_acknowledged_increment() {
    const INCREMENTS_PER_RUNTIME: u64 = 40;
    let directory = TestDirectory::new("racing_runtimes_on_one_sqlite_file_lose_no_acknowledged_increment");
    let file = directory.file();
    let id = counter("c");
    let both_started = Arc::new(BothStarted::default());
    let race = |file: PathBuf, id: ActorId, both_started: Arc<BothStarted>| async move {
        let activations = Activations::default();
        let open = || -> Arc<dyn StateStore> { Arc::new(SqliteStore::open(&file).expect("open the file")) };
        let mut runtime = start(open(), KindConfig::default(), &activations);
        send(&runtime, &id, "get").await.expect("activate the counter");
        both_started.arrive_and_wait().await;
        let (mut acknowledged, mut refused) = (0_u64, 0_u64);
        for _ in 0..INCREMENTS_PER_RUNTIME {
            tokio::task::yield_now().await;
            match send(&runtime, &id, "add").await {
                Ok(_) => acknowledged += 1,
                Err(InvokeError::StorageFailed {
                    source: StoreError::Fenced { .. },
                    ..
                }) => {
                    refused += 1;
                    runtime.shutdown().await;
                    runtime = start(open(), KindConfig::default(), &activations);
                }
                Err(other) => panic!("an increment failed with {other:?}"),
            }
        }
        runtime.shutdown().await;
        (acknowledged, refused)
    };
    let first = tokio::spawn(race(file.clone(), id.clone(), Arc::clone(&both_started)));
    let second = tokio::spawn(race(file.clone(), id.clone(), both_started));
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    let acknowledged = first.0 + second.0;
    println!("racing: acknowledged {first:?} {second:?} (acknowledged, refused) per runtime");
    assert_eq!(first.0 + first.1, INCREMENTS_PER_RUNTIME);
    assert_eq!(second.0 + second.1, INCREMENTS_PER_RUNTIME);
    assert_eq!(committed_count(&file, &id).await, Some(acknowledged));
}

// ---------------------------------------------------------------------------------------
// Error sources
// ---------------------------------------------------------------------------------------

/// Goal: a storage failure keeps the store's typed error as its `source()`, so a caller
/// can tell an injected fault, a backend error and a fence apart without parsing text.
/// Method: fail the next commit of a memory store; the add fails; downcast its source.
#[tokio::test(start_paused = true)]
async fn storage_failure_reaches_the_caller_with_the_store_error_as_its_source() {
    let store = Arc::new(MemoryStore::new());
    let runtime = start(store.clone(), KindConfig::default(), &Activations::default());
    let id = counter("c");
    assert_eq!(send(&runtime, &id, "add").await, Ok("1".to_string()));
    store.faults().fail_next_commits(1);
    let error = send(&runtime, &id, "add").await.expect_err("the commit fails");
    let source = std::error::Error::source(&error).expect("a storage failure has a source");
    assert_eq!(
        source.downcast_ref::<StoreError>(),
        Some(&StoreError::Injected {
            operation: StoreOperation::Commit
        })
    );
    assert_eq!(
        send(&runtime, &id, "get").await,
        Ok("1".to_string()),
        "the failed add was rolled back"
    );
    runtime.shutdown().await;
}

// ---------------------------------------------------------------------------------------
// Turn::scan at the scan limit
// ---------------------------------------------------------------------------------------

/// Committed rows in the scan test: more than one page of the largest limit.
const SCAN_ROWS_COMMITTED: usize = STATE_SCAN_LIMIT_MAX + 10;

fn scan_key(index: usize) -> String {
    format!("k{index:06}")
}

/// Goal: a turn's scan with the largest limit returns a full page although the turn
/// deleted committed rows and the store caps each page at the same limit (before, it
/// asked the store for limit + deletions, the store gave limit, and the deletions left
/// the page short while rows remained). Method: commit `SCAN_ROWS_COMMITTED` rows; a
/// turn deletes five within the first page and puts one new key; its scan must be
/// exactly the first `STATE_SCAN_LIMIT_MAX` keys of the merged view.
async fn turn_scan_at_the_limit_is_full_despite_buffered_deletions(store: Arc<dyn StateStore>) {
    let id = scanner("s");
    let fence = store.claim(&id).await.expect("claim").fence;
    let keys: Vec<String> = (0..SCAN_ROWS_COMMITTED).map(scan_key).collect();
    for chunk in keys.chunks(TURN_WRITES_MAX) {
        let writes = chunk
            .iter()
            .map(|key| (key.clone(), Some(Bytes::from_static(b"v"))))
            .collect();
        let commit = TurnCommit {
            state: StateChange::Unchanged,
            writes,
        };
        store.commit(&id, fence, commit).await.expect("commit the rows");
    }
    let deleted = [0, 1, 2, 5_000, STATE_SCAN_LIMIT_MAX - 1].map(scan_key);
    let added = format!("{}x", scan_key(7));
    let mut request: Vec<String> = deleted.iter().map(|key| format!("-{key}")).collect();
    request.push(format!("+{added}"));

    let runtime = start(store, KindConfig::default(), &Activations::default());
    let reply = send(&runtime, &id, &request.join("\n")).await.expect("the scan turn");
    let mut expected: Vec<String> = keys.into_iter().filter(|key| !deleted.contains(key)).collect();
    expected.push(added);
    expected.sort_unstable();
    expected.truncate(STATE_SCAN_LIMIT_MAX);
    let found: Vec<&str> = reply.split('\n').collect();
    assert_eq!(found.len(), STATE_SCAN_LIMIT_MAX);
    assert_eq!(found, expected);
    runtime.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn turn_scan_at_the_scan_limit_returns_a_full_page_despite_buffered_deletions_in_memory_store() {
    turn_scan_at_the_limit_is_full_despite_buffered_deletions(Arc::new(MemoryStore::new())).await;
}

#[tokio::test(start_paused = true)]
async fn turn_scan_at_the_scan_limit_returns_a_full_page_despite_buffered_deletions_in_sqlite_store() {
    turn_scan_at_the_limit_is_full_despite_buffered_deletions(Arc::new(SqliteStore::open_in_memory().unwrap())).await;
}

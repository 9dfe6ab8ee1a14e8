//! A store operation made outside any turn (an API's read of a conversation, a server's
//! own records) gets the runtime's retries through `RuntimeHandle::retry_store`: made
//! again while it fails `StoreError::Unavailable`, with the runtime's pauses, counted in
//! `RuntimeCounters::store_retries`, never started past the caller's deadline, and
//! stopped by a runtime abort; any other error is returned at once.
//!
//! Method: a `MemoryStore` read through an attempt that fails as long as the test says
//! the store is down (`Outage`), recording when each try starts. Before `retry_store`
//! existed such code called the store once and failed at its first `Unavailable` (the
//! first test fails so: one try, `Err(Unavailable)`). The real stores (PostgreSQL
//! stopped and started, a SQLite file locked) are in troupe-postgres's
//! `tests/outside_turn_retries.rs`. Run with `cargo nextest run -p troupe-runtime --test
//! store_retries_outside_turns` (and under `--cfg madsim`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use troupe_core::{ActorId, StoreOperation};
use troupe_runtime::{
    MemoryStore, Runtime, RuntimeHandle, StateChange, StateStore, StoreError, TurnCommit, STORE_RETRY_PAUSE_MS_FIRST,
    STORE_RETRY_PAUSE_MS_MAX,
};

/// What every wait here is bounded by.
const HANG: Duration = Duration::from_secs(60);

/// A store down until healed, or for its next few reads, and the start of every try.
#[derive(Default)]
struct Outage {
    /// Reads still to fail `Unavailable`.
    failing: AtomicU64,
    /// Every read fails `Unavailable` while set.
    down: AtomicBool,
    /// Fail with `Backend` (not transient) instead.
    backend: AtomicBool,
    /// When each try started.
    tries: Mutex<Vec<Instant>>,
}

impl Outage {
    fn tries(&self) -> usize {
        self.tries.lock().unwrap().len()
    }

    /// One try of reading `key` of `actor` from `store`.
    async fn get(&self, store: &MemoryStore, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        self.tries.lock().unwrap().push(Instant::now());
        let failing = self
            .failing
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| left.checked_sub(1))
            .is_ok();
        if self.backend.load(Ordering::SeqCst) {
            return Err(StoreError::Backend {
                operation: StoreOperation::Get,
                cause: "relation does not exist".to_string(),
            });
        }
        if failing || self.down.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable {
                operation: StoreOperation::Get,
                cause: "connection refused".to_string(),
            });
        }
        store.get(actor, key).await
    }
}

fn record() -> ActorId {
    ActorId::new("records", "r1").unwrap()
}

/// A runtime on a `MemoryStore` holding `stored` under `record()`'s key `k`.
async fn runtime_with_a_record() -> (Runtime, MemoryStore) {
    let store = MemoryStore::new();
    let claimed = store.claim(&record()).await.unwrap();
    let commit = TurnCommit {
        state: StateChange::Unchanged,
        writes: vec![("k".to_string(), Some(Bytes::from_static(b"stored")))],
    };
    store.commit(&record(), claimed.fence, commit).await.unwrap();
    let runtime = Runtime::builder().store(Arc::new(store.clone())).start();
    (runtime, store)
}

/// `retry_store` of one read of `k`, within `within` of now.
async fn read(
    handle: &RuntimeHandle,
    store: &MemoryStore,
    outage: &Outage,
    within: Duration,
) -> Result<Option<Bytes>, StoreError> {
    let deadline = handle.deadline_in(within);
    let id = record();
    handle
        .retry_store(deadline, "get", &id, || outage.get(store, &id, "k"))
        .await
}

/// Goal: a read that fails for a moment twice is made a third time and answers, after
/// the runtime's first two pauses (10 ms, then 20 ms), and the two tries after the first
/// are counted. Before: one try, `Err(Unavailable)`.
#[tokio::test(start_paused = true)]
async fn a_read_failing_twice_is_made_again_after_the_runtimes_pauses_and_counted() {
    let (runtime, store) = runtime_with_a_record().await;
    let handle = runtime.handle();
    let outage = Outage::default();
    outage.failing.store(2, Ordering::SeqCst);
    let started = Instant::now();
    let result = read(&handle, &store, &outage, Duration::from_secs(5)).await;
    let took = started.elapsed();
    assert_eq!(result, Ok(Some(Bytes::from_static(b"stored"))));
    assert_eq!(outage.tries(), 3, "two failures, then the answer");
    assert_eq!(
        handle.counters().store_retries,
        2,
        "each try after the first is counted"
    );
    let pauses = Duration::from_millis(STORE_RETRY_PAUSE_MS_FIRST * 3);
    assert!(
        took >= pauses && took < pauses + Duration::from_millis(5),
        "answered after {took:?}, the pauses being {pauses:?}"
    );
    // A read that succeeds at once is made once and counts nothing.
    let result = read(&handle, &store, &outage, Duration::from_secs(5)).await;
    assert_eq!(result, Ok(Some(Bytes::from_static(b"stored"))));
    assert_eq!((outage.tries(), handle.counters().store_retries), (4, 2));
}

/// Goal: a store that stays down past the deadline is answered with its last
/// `Unavailable` by the deadline, no try starting after it, and the tries made before
/// it counted; the pauses grow to at most `STORE_RETRY_PAUSE_MS_MAX`.
#[tokio::test(start_paused = true)]
async fn a_store_down_past_the_deadline_fails_unavailable_by_the_deadline_with_no_try_after_it() {
    let (runtime, store) = runtime_with_a_record().await;
    let handle = runtime.handle();
    let outage = Outage::default();
    outage.down.store(true, Ordering::SeqCst);
    let within = Duration::from_millis(1_500);
    let started = Instant::now();
    let result = read(&handle, &store, &outage, within).await;
    let took = started.elapsed();
    assert!(matches!(result, Err(StoreError::Unavailable { .. })), "{result:?}");
    assert!(
        took <= within,
        "answered {took:?} after the start, the deadline being {within:?}"
    );
    let tries = outage.tries.lock().unwrap().clone();
    assert!(
        tries.iter().all(|tried| tried.duration_since(started) <= within),
        "a try started past the deadline: {:?}",
        tries
            .iter()
            .map(|tried| tried.duration_since(started))
            .collect::<Vec<_>>()
    );
    let gaps: Vec<Duration> = tries.windows(2).map(|pair| pair[1] - pair[0]).collect();
    // (The simulator's timers fire some nanoseconds late: under a millisecond.)
    assert!(
        gaps.iter()
            .all(|gap| *gap < Duration::from_millis(STORE_RETRY_PAUSE_MS_MAX + 1)),
        "{gaps:?}"
    );
    // Pauses of 10, 20, 40, 80, 160, 250, 250, 250 and 250 ms end 1.31 s in: ten tries
    // by then, and more in what is left (each pause then half of it).
    assert!(tries.len() >= 10, "{} tries in {within:?}: {gaps:?}", tries.len());
    assert_eq!(handle.counters().store_retries, tries.len() as u64 - 1);
}

/// Goal: an error that is not transient (`Backend`) is returned at once: one try,
/// nothing counted, no pause.
#[tokio::test(start_paused = true)]
async fn an_error_that_is_not_transient_is_returned_at_once() {
    let (runtime, store) = runtime_with_a_record().await;
    let handle = runtime.handle();
    let outage = Outage::default();
    outage.backend.store(true, Ordering::SeqCst);
    let started = Instant::now();
    let result = read(&handle, &store, &outage, Duration::from_secs(5)).await;
    assert!(matches!(result, Err(StoreError::Backend { .. })), "{result:?}");
    assert_eq!(started.elapsed(), Duration::ZERO);
    assert_eq!((outage.tries(), handle.counters().store_retries), (1, 0));
}

/// Goal: the tries stop once the runtime is aborted (dropped): a read whose deadline is
/// 30 s away, on a store that stays down, ends within one pause of the drop.
#[tokio::test(start_paused = true)]
async fn the_tries_stop_within_one_pause_once_the_runtime_is_dropped() {
    let (runtime, store) = runtime_with_a_record().await;
    let handle = runtime.handle();
    let outage = Arc::new(Outage::default());
    outage.down.store(true, Ordering::SeqCst);
    let reading = tokio::spawn({
        let (outage, handle) = (Arc::clone(&outage), handle.clone());
        async move { read(&handle, &store, &outage, Duration::from_secs(30)).await }
    });
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert!(!reading.is_finished(), "still trying while the runtime runs");
    let dropped = Instant::now();
    drop(runtime);
    let result = tokio::time::timeout(HANG, reading)
        .await
        .expect("the read ended")
        .unwrap();
    let took = dropped.elapsed();
    assert!(matches!(result, Err(StoreError::Unavailable { .. })), "{result:?}");
    assert!(
        took <= Duration::from_millis(STORE_RETRY_PAUSE_MS_MAX),
        "the read ended {took:?} after the runtime was dropped"
    );
    let tries_at_end = outage.tries();
    tokio::time::sleep(Duration::from_millis(STORE_RETRY_PAUSE_MS_MAX * 4)).await;
    assert_eq!(outage.tries(), tries_at_end, "no try after the end");
}

/// Goal: on worker threads, reads racing through an outage all answer once the store is
/// back, and the counter holds exactly the tries after the first of each. Method: eight
/// tasks read while the store is down; it is healed 300 ms later (real time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_racing_through_an_outage_on_worker_threads_all_answer_and_are_counted() {
    /// Reads made at once.
    const READS: usize = 8;
    let (runtime, store) = runtime_with_a_record().await;
    let handle = runtime.handle();
    let outage = Arc::new(Outage::default());
    outage.down.store(true, Ordering::SeqCst);
    let reads: Vec<_> = (0..READS)
        .map(|_| {
            let (outage, handle, store) = (Arc::clone(&outage), handle.clone(), store.clone());
            tokio::spawn(async move { read(&handle, &store, &outage, Duration::from_secs(10)).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    outage.down.store(false, Ordering::SeqCst);
    for reading in reads {
        let result = tokio::time::timeout(HANG, reading)
            .await
            .expect("the read ended")
            .unwrap();
        assert_eq!(result, Ok(Some(Bytes::from_static(b"stored"))));
    }
    let tries = outage.tries();
    assert!(tries > READS, "each read failed at least once: {tries} tries");
    assert_eq!(handle.counters().store_retries, (tries - READS) as u64);
}

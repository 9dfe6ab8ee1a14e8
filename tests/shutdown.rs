//! Shutdown, drop and forced deactivation: bounded in time, nothing left waiting, typed
//! errors for everyone who was. Both builds (paused tokio time, or the simulator);
//! the multi-thread variants run in the normal build.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe::core::{ActorId, ActorKind, InvokeError};
use troupe::runtime::{
    Actor, ActorBox, ActorError, KindConfig, Runtime, RuntimeHandle, Turn, SHUTDOWN_GRACE_MS_DEFAULT,
};

const KIND: &str = "worker";

fn worker(key: &str) -> ActorId {
    ActorId::new(KIND, key).unwrap()
}

#[derive(Debug, Clone, Serialize, Deserialize)]
enum Job {
    /// Add one, reply with the count.
    Add,
    /// Sleep this long (a turn stuck on a slow model or tool), then add one.
    Sleep { ms: u64 },
    /// Sleep, then call `target` with `Add`.
    SleepThenCall { ms: u64, target: String },
    /// Add one, and make the next `on_deactivate` change the count and then fail.
    AddAndBreakDeactivation,
}

/// Live actor instances (built minus dropped), and hooks that ran.
#[derive(Default)]
struct Tally {
    live: AtomicI64,
    /// The most instances ever live at once (one actor per test: its activations).
    live_max: AtomicI64,
    deactivated: Mutex<Vec<String>>,
    call_results: Mutex<Vec<(Result<Bytes, InvokeError>, Duration)>>,
}

struct Worker {
    key: String,
    count: u64,
    tally: Arc<Tally>,
    break_deactivation: bool,
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.tally.live.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Actor for Worker {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        match bincode::deserialize::<Job>(&payload).map_err(|e| ActorError::failed(e.to_string()))? {
            Job::Add => {}
            Job::AddAndBreakDeactivation => self.break_deactivation = true,
            Job::Sleep { ms } => tokio::time::sleep(Duration::from_millis(ms)).await,
            Job::SleepThenCall { ms, target } => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                let started = tokio::time::Instant::now();
                let result = turn
                    .invoke(&worker(&target), job(&Job::Add), Duration::from_secs(60))
                    .await;
                self.tally
                    .call_results
                    .lock()
                    .unwrap()
                    .push((result.clone(), started.elapsed()));
                result?;
            }
        }
        self.count += 1;
        Ok(Bytes::from(self.count.to_le_bytes().to_vec()))
    }

    async fn on_deactivate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        self.tally.deactivated.lock().unwrap().push(self.key.clone());
        if self.break_deactivation {
            self.count += 1_000;
            return Err(ActorError::failed("on_deactivate failed half-way"));
        }
        Ok(())
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(self.count.to_le_bytes().to_vec())))
    }
}

fn job(job: &Job) -> Bytes {
    Bytes::from(bincode::serialize(job).unwrap())
}

fn count(reply: &Bytes) -> u64 {
    u64::from_le_bytes(reply[..8].try_into().unwrap())
}

fn start(tally: &Arc<Tally>, grace: Duration) -> Runtime {
    let tally = Arc::clone(tally);
    let factory = move |id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
        let live = tally.live.fetch_add(1, Ordering::SeqCst) + 1;
        tally.live_max.fetch_max(live, Ordering::SeqCst);
        let count = saved.map(|b| count(&b)).unwrap_or(0);
        Ok(ActorBox::new(Worker {
            key: id.key().to_string(),
            count,
            tally: Arc::clone(&tally),
            break_deactivation: false,
        }))
    };
    Runtime::builder()
        .shutdown_grace(grace)
        .unwrap()
        .register(ActorKind::new(KIND).unwrap(), factory, KindConfig::default())
        .unwrap()
        .start()
}

async fn send(rt: &RuntimeHandle, key: &str, what: Job) -> Result<Bytes, InvokeError> {
    rt.invoke(&worker(key), job(&what), rt.deadline_in(Duration::from_secs(300)))
        .await
}

/// Goal: shutdown is bounded by its grace period even when a turn is stuck for minutes;
/// the stuck turn is cancelled and rolled back and its caller gets `Shutdown`. Method: a
/// turn sleeps 300 s; shutdown with a 1 s grace period.
#[tokio::test(start_paused = true)]
async fn shutdown_with_a_stuck_turn_returns_after_the_grace_period_and_its_caller_gets_shutdown() {
    let tally = Arc::new(Tally::default());
    let rt = start(&tally, Duration::from_secs(1));
    let handle = rt.handle();
    assert_eq!(count(&send(&handle, "w", Job::Add).await.unwrap()), 1);
    let stuck = tokio::spawn({
        let handle = rt.handle();
        async move { send(&handle, "w", Job::Sleep { ms: 300_000 }).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let started = tokio::time::Instant::now();
    rt.shutdown().await;
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(1), "the grace period is honoured: {took:?}");
    assert!(
        took < Duration::from_millis(1_100),
        "shutdown is bounded by the grace period: {took:?}"
    );
    assert_eq!(stuck.await.unwrap(), Err(InvokeError::Shutdown));
    let counters = handle.counters();
    assert_eq!(counters.activations_aborted, 1, "{counters:?}");
    assert!(
        tally.deactivated.lock().unwrap().is_empty(),
        "on_deactivate does not run after the grace period"
    );
    assert_eq!(tally.live.load(Ordering::SeqCst), 0, "the activation ended");
    assert_eq!(send(&handle, "w", Job::Add).await, Err(InvokeError::Shutdown));
    // The stuck turn was rolled back: the stored count is the one committed before.
    assert_eq!(
        handle.store().load(&worker("w")).await.unwrap().map(|b| count(&b)),
        Some(1)
    );
}

/// Goal: the default grace period is seconds, not the 300 s a turn may be allowed.
#[test]
fn the_default_shutdown_grace_is_seconds() {
    const { assert!(SHUTDOWN_GRACE_MS_DEFAULT <= 10_000) };
}

/// Goal: a shutdown with nothing stuck finishes at once, after every actor ran
/// `on_deactivate` and saved.
#[tokio::test(start_paused = true)]
async fn shutdown_with_idle_actors_deactivates_them_at_once() {
    let tally = Arc::new(Tally::default());
    let rt = start(&tally, Duration::from_secs(5));
    let handle = rt.handle();
    for key in ["a", "b", "c"] {
        send(&handle, key, Job::Add).await.unwrap();
    }
    let started = tokio::time::Instant::now();
    rt.shutdown().await;
    assert!(started.elapsed() < Duration::from_millis(10), "{:?}", started.elapsed());
    let mut deactivated = tally.deactivated.lock().unwrap().clone();
    deactivated.sort();
    assert_eq!(deactivated, vec!["a", "b", "c"]);
    assert_eq!(tally.live.load(Ordering::SeqCst), 0);
}

/// Goal: a call made by a running turn after shutdown began fails at once with
/// `Shutdown` (it used to wait out its whole timeout), and shutdown then completes
/// without waiting for the grace period. Method: A's turn sleeps 100 ms, then calls B;
/// shutdown starts at 50 ms with a 60 s grace period.
#[tokio::test(start_paused = true)]
async fn a_call_made_by_a_turn_after_shutdown_began_fails_at_once() {
    let tally = Arc::new(Tally::default());
    let rt = start(&tally, Duration::from_secs(60));
    let handle = rt.handle();
    send(&handle, "b", Job::Add).await.unwrap();
    let caller = tokio::spawn({
        let handle = rt.handle();
        async move {
            send(
                &handle,
                "a",
                Job::SleepThenCall {
                    ms: 100,
                    target: "b".into(),
                },
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = tokio::time::Instant::now();
    rt.shutdown().await;
    assert!(
        started.elapsed() < Duration::from_millis(60),
        "no grace wait: {:?}",
        started.elapsed()
    );
    let results = tally.call_results.lock().unwrap().clone();
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].0, Err(InvokeError::Shutdown));
    assert!(
        results[0].1 < Duration::from_millis(1),
        "refused at once: {:?}",
        results[0].1
    );
    assert_eq!(caller.await.unwrap(), Err(InvokeError::Shutdown));
}

/// Goal: dropping a `Runtime` without `shutdown()` ends the dispatcher and every actor
/// task: live actors are dropped, a stuck turn's caller gets `Shutdown`, and later
/// invocations through a surviving handle get `Shutdown`.
#[tokio::test(start_paused = true)]
async fn dropping_a_runtime_ends_its_tasks_and_answers_its_callers() {
    let tally = Arc::new(Tally::default());
    let rt = start(&tally, Duration::from_secs(5));
    let handle = rt.handle();
    for key in ["a", "b"] {
        send(&handle, key, Job::Add).await.unwrap();
    }
    let stuck = tokio::spawn({
        let handle = rt.handle();
        async move { send(&handle, "c", Job::Sleep { ms: 300_000 }).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(tally.live.load(Ordering::SeqCst), 3);
    drop(rt);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(tally.live.load(Ordering::SeqCst), 0, "every activation ended");
    assert_eq!(stuck.await.unwrap(), Err(InvokeError::Shutdown));
    assert_eq!(send(&handle, "a", Job::Add).await, Err(InvokeError::Shutdown));
    assert!(handle.stats().await.is_err(), "the dispatcher has ended");
}

/// Goal: `deactivate(id)` deactivates one live actor at once with the idle handshake:
/// `on_deactivate` runs, the state is saved, the table entry is freed, and the next
/// message reactivates it with its state; an inactive actor reports `false`.
#[tokio::test(start_paused = true)]
async fn forced_deactivation_saves_and_frees_one_actor_and_the_next_message_reactivates_it() {
    let tally = Arc::new(Tally::default());
    let rt = start(&tally, Duration::from_secs(5));
    send(&rt, "a", Job::Add).await.unwrap();
    send(&rt, "b", Job::Add).await.unwrap();
    assert_eq!(rt.deactivate(&worker("a")).await, Ok(true));
    assert_eq!(*tally.deactivated.lock().unwrap(), vec!["a".to_string()]);
    let stats = rt.stats().await.unwrap();
    assert_eq!(stats.activations, 1, "only b is left: {stats:?}");
    assert_eq!(rt.deactivate(&worker("a")).await, Ok(false));
    assert_eq!(
        count(&send(&rt, "a", Job::Add).await.unwrap()),
        2,
        "reactivated with its state"
    );
    assert_eq!(rt.counters().activations_started, 3);
    rt.shutdown().await;
}

/// Goal: forcing a deactivation while a turn runs and requests are queued loses none of
/// them: the running turn and the queued requests finish first, and a request sent
/// while it deactivates starts the next activation.
#[tokio::test(start_paused = true)]
async fn forced_deactivation_finishes_running_and_queued_work_first() {
    let tally = Arc::new(Tally::default());
    let rt = start(&tally, Duration::from_secs(5));
    let mut queued = Vec::new();
    for _ in 0..3 {
        let handle = rt.handle();
        queued.push(tokio::spawn(
            async move { send(&handle, "a", Job::Sleep { ms: 100 }).await },
        ));
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
    let deactivating = tokio::spawn({
        let handle = rt.handle();
        async move { handle.deactivate(&worker("a")).await }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let late = send(&rt, "a", Job::Add).await.unwrap();
    let mut counts: Vec<u64> = Vec::new();
    for request in queued {
        counts.push(count(&request.await.unwrap().unwrap()));
    }
    counts.sort_unstable();
    assert_eq!(counts, vec![1, 2, 3]);
    assert_eq!(deactivating.await.unwrap(), Ok(true));
    assert_eq!(
        count(&late),
        4,
        "the late request ran on the next activation, after the save"
    );
    assert_eq!(rt.counters().activations_started, 2);
    rt.shutdown().await;
}

/// Goal: `DispatcherBusy` is produced when the dispatcher's own queue is full, at once,
/// and nothing is queued for the refused request. Method: on one thread, 5,000 tasks
/// each send a first message to a different inactive actor before the dispatcher runs;
/// the queue holds `DISPATCHER_QUEUE_CAPACITY` (4,096) of them.
#[cfg(not(madsim))]
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_full_dispatcher_queue_refuses_with_dispatcher_busy_at_once() {
    use troupe::core::limits::DISPATCHER_QUEUE_CAPACITY;
    let tally = Arc::new(Tally::default());
    let rt = start(&tally, Duration::from_secs(5));
    let senders: Vec<_> = (0..5_000)
        .map(|i| {
            let handle = rt.handle();
            tokio::spawn(async move { send(&handle, &format!("k{i}"), Job::Add).await })
        })
        .collect();
    let mut busy = 0;
    for sender in senders {
        match sender.await.unwrap() {
            Ok(_) => {}
            Err(InvokeError::DispatcherBusy { capacity }) => {
                assert_eq!(capacity, DISPATCHER_QUEUE_CAPACITY);
                busy += 1;
            }
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(busy, 5_000 - DISPATCHER_QUEUE_CAPACITY);
    assert_eq!(rt.counters().dispatcher_busy_refused, busy as u64);
    assert_eq!(rt.counters().activations_started, DISPATCHER_QUEUE_CAPACITY as u64);
    rt.shutdown().await;
}

/// Goal: on the multi-thread runtime, shutdown with stuck turns on several actors and
/// many waiting callers is bounded and every caller gets a typed answer.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_on_the_multi_thread_runtime_is_bounded_and_answers_every_caller() {
    let tally = Arc::new(Tally::default());
    let rt = start(&tally, Duration::from_millis(200));
    let mut callers = Vec::new();
    for i in 0..50 {
        let handle = rt.handle();
        let key = format!("s{}", i % 5);
        callers.push(tokio::spawn(async move {
            send(&handle, &key, Job::Sleep { ms: 300_000 }).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = tokio::time::Instant::now();
    rt.shutdown().await;
    let took = started.elapsed();
    assert!(took < Duration::from_millis(700), "bounded: {took:?}");
    for caller in callers {
        assert_eq!(caller.await.unwrap(), Err(InvokeError::Shutdown));
    }
    assert_eq!(tally.live.load(Ordering::SeqCst), 0);
}

/// Goal: a failed `on_deactivate` saves nothing: the half-finished state it left is
/// dropped and the last committed turn's state stays. Method: the hook adds 1,000 to
/// the count and then fails.
#[tokio::test(start_paused = true)]
async fn a_failed_on_deactivate_saves_nothing_and_the_last_committed_state_stays() {
    let tally = Arc::new(Tally::default());
    let rt = start(&tally, Duration::from_secs(5));
    assert_eq!(count(&send(&rt, "a", Job::AddAndBreakDeactivation).await.unwrap()), 1);
    assert_eq!(rt.deactivate(&worker("a")).await, Ok(true));
    assert_eq!(rt.counters().deactivation_saves_failed, 1);
    assert_eq!(rt.store().load(&worker("a")).await.unwrap().map(|b| count(&b)), Some(1));
    assert_eq!(
        count(&send(&rt, "a", Job::Add).await.unwrap()),
        2,
        "reactivated from the committed state"
    );
    rt.shutdown().await;
}

/// Goal: forced deactivation keeps single activation and loses nothing on the
/// multi-thread runtime. Method: 4 tasks send 50 adds each to one actor while another
/// task forces its deactivation 20 times; every add is acknowledged, the final count is
/// exactly 200, and never more than one instance of the actor is live.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forced_deactivation_under_concurrent_callers_keeps_one_activation_and_loses_nothing() {
    let tally = Arc::new(Tally::default());
    let rt = start(&tally, Duration::from_secs(5));
    let mut senders = Vec::new();
    for _ in 0..4 {
        let handle = rt.handle();
        senders.push(tokio::spawn(async move {
            for _ in 0..50 {
                send(&handle, "a", Job::Add).await.expect("every add is acknowledged");
            }
        }));
    }
    let deactivator = tokio::spawn({
        let handle = rt.handle();
        async move {
            let mut live = 0;
            for _ in 0..20 {
                if handle.deactivate(&worker("a")).await.unwrap() {
                    live += 1;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            live
        }
    });
    for sender in senders {
        sender.await.unwrap();
    }
    let deactivated = deactivator.await.unwrap();
    assert_eq!(count(&send(&rt, "a", Job::Add).await.unwrap()), 201, "no add was lost");
    assert_eq!(tally.live_max.load(Ordering::SeqCst), 1, "never two instances at once");
    assert!(deactivated >= 1, "the deactivations really happened: {deactivated}");
    assert_eq!(
        rt.counters().activations_started,
        1 + rt.counters().deactivations_finished
    );
    rt.shutdown().await;
}

/// An actor whose instance takes a while to drop (it releases something), and counts
/// its instances.
#[cfg(not(madsim))]
struct SlowToDrop {
    tally: Arc<Tally>,
}

/// How long dropping a [`SlowToDrop`] takes, in milliseconds.
#[cfg(not(madsim))]
const DROP_MS: u64 = 50;

#[cfg(not(madsim))]
impl Drop for SlowToDrop {
    fn drop(&mut self) {
        // Blocking on purpose: the instance is released synchronously, as a file lock
        // or a connection closed in `Drop` would be.
        #[allow(clippy::disallowed_methods)]
        std::thread::sleep(Duration::from_millis(DROP_MS));
        self.tally.live.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(not(madsim))]
impl Actor for SlowToDrop {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        Ok(payload)
    }
}

/// Goal: an actor's instance is dropped before its deactivation is reported, so the next
/// activation's instance is never built while the old one still exists, on the
/// multi-thread runtime. Method: the instance takes 50 ms to drop; after each forced
/// deactivation (which returns once the dispatcher knows of it) the next message builds
/// a new instance at once; the count of instances alive never exceeds one. (Before, the
/// report went first and the old instance was dropped afterwards, on its own thread.)
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_is_dropped_before_the_next_activation_builds_its_successor() {
    let tally = Arc::new(Tally::default());
    let counted = Arc::clone(&tally);
    let factory = move |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> {
        let live = counted.live.fetch_add(1, Ordering::SeqCst) + 1;
        counted.live_max.fetch_max(live, Ordering::SeqCst);
        Ok(ActorBox::new(SlowToDrop {
            tally: Arc::clone(&counted),
        }))
    };
    let rt = Runtime::builder()
        .register(ActorKind::new(KIND).unwrap(), factory, KindConfig::default())
        .unwrap()
        .start();
    let handle = rt.handle();
    // Keeps the dispatcher busy on a worker of its own, as other traffic would, so that
    // it hears of a deactivation while the old instance is still being dropped.
    let busy = tokio::spawn({
        let handle = rt.handle();
        async move {
            while handle.stats().await.is_ok() {
                tokio::task::yield_now().await;
            }
        }
    });
    for round in 0..5 {
        let reply = handle
            .invoke(
                &worker("d"),
                Bytes::from_static(b"x"),
                handle.deadline_in(Duration::from_secs(5)),
            )
            .await
            .unwrap();
        assert_eq!(&reply[..], b"x");
        assert!(
            handle.deactivate(&worker("d")).await.unwrap(),
            "round {round}: it was live"
        );
    }
    assert_eq!(tally.live_max.load(Ordering::SeqCst), 1, "never two instances at once");
    assert_eq!(tally.live.load(Ordering::SeqCst), 0, "every instance was dropped");
    assert_eq!(rt.counters().activations_started, 5);
    busy.abort();
    rt.shutdown().await;
}

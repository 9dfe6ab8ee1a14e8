//! Probes of the runtime as an embedder runs it: on tokio's multi-thread runtime, with
//! many callers at once, callers that give up, shutdown and drop in the middle of the
//! traffic, two runtimes on one SQLite file, bounded mailboxes under bursts, and
//! deadlines at their edges. Every await that could hang is bounded, so a hang fails
//! the test instead of stalling CI.
//!
//! Four of them failed before the fixes they came with (2026-12-06):
//! - `queued_requests_of_a_dropped_runtime_never_run_*`,
//!   `requests_queued_behind_a_turn_blocked_past_the_grace_never_run`: an activation
//!   whose task was running when the runtime was aborted (dropped, or its shutdown grace
//!   over) went on taking queued requests and running their turns (answered `Ok`, or
//!   their side effects made) until it next yielded; now they are answered `Shutdown`,
//!   unrun (`begin` in activation.rs).
//! - `a_dropped_runtime_runs_no_on_deactivate_multi_thread`: such a task that saw its
//!   mailbox closed ran `on_deactivate` (56 of 300 drops); now it does not.
//! - `a_rollback_drops_the_failed_instance_before_it_builds_the_next`: a rollback built
//!   the new instance while the failed one was still alive (an actor holding something
//!   exclusive crashed its activation); now the failed one goes first.
//! - `the_request_after_a_fenced_refusal_is_served_by_a_fresh_activation`: the request
//!   right after a `Fenced` refusal reached the stale mailbox through the fast path and
//!   was refused with the fence again (13 of 40 on worker threads); now the refusal
//!   closes the mailbox before it is answered.

#![cfg(not(madsim))]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, ActorKind, Deadline, InvokeError};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, MemoryStore, Runtime, StateStore, Turn};

/// How long any single await may take before the probe calls it a hang.
const HANG: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(HANG, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {HANG:?}"))
}

/// Polls `future` once: a request is sent in its first poll (everything before its wait
/// is synchronous: the fast path into an open mailbox, or the dispatcher's queue). Gives
/// back its output if it finished in that poll, else the future, to be awaited later.
async fn poll_once<F: std::future::Future + Unpin>(future: F) -> Result<F::Output, F> {
    let mut future = Some(future);
    let done = std::future::poll_fn(|cx| {
        let polled = std::pin::Pin::new(future.as_mut().expect("polled once")).poll(cx);
        std::task::Poll::Ready(match polled {
            std::task::Poll::Ready(output) => Some(output),
            std::task::Poll::Pending => None,
        })
    })
    .await;
    done.ok_or_else(|| future.take().expect("not finished"))
}

/// Counts the activations that ended (`RuntimeEvent::ActivationEnded`) and wakes who
/// waits for one.
#[derive(Default)]
struct Ended {
    count: AtomicU64,
    notify: tokio::sync::Notify,
}

impl troupe_runtime::RuntimeObserver for Ended {
    fn on_event(&self, event: &troupe_runtime::RuntimeEvent) {
        if matches!(event, troupe_runtime::RuntimeEvent::ActivationEnded { .. }) {
            self.count.fetch_add(1, Ordering::SeqCst);
            self.notify.notify_waiters();
        }
    }
}

impl Ended {
    /// Waits until `count` activations have ended.
    async fn until(&self, count: u64) {
        loop {
            let notified = self.notify.notified();
            if self.count.load(Ordering::SeqCst) >= count {
                return;
            }
            within("an activation's end", notified).await;
        }
    }
}

fn worker(key: &str) -> ActorId {
    ActorId::new("worker", key).unwrap()
}

/// Instances alive per actor key, and the most ever alive at once.
#[derive(Default)]
struct Instances {
    live: Mutex<HashMap<String, (i64, i64)>>,
    built: AtomicU64,
    /// The clock and the turn's deadline, in microseconds, at each `deadline` turn.
    deadlines: Mutex<Vec<(u64, u64)>>,
    /// The activations that ended (the runtime's observer).
    ended: Ended,
}

impl troupe_runtime::RuntimeObserver for Instances {
    fn on_event(&self, event: &troupe_runtime::RuntimeEvent) {
        self.ended.on_event(event);
    }
}

impl Instances {
    fn built(&self, key: &str) {
        self.built.fetch_add(1, Ordering::SeqCst);
        let mut live = self.live.lock().unwrap();
        let entry = live.entry(key.to_string()).or_default();
        entry.0 += 1;
        entry.1 = entry.1.max(entry.0);
    }

    fn dropped(&self, key: &str) {
        let mut live = self.live.lock().unwrap();
        live.get_mut(key).expect("built before dropped").0 -= 1;
    }

    fn most_at_once(&self) -> i64 {
        self.live
            .lock()
            .unwrap()
            .values()
            .map(|(_, most)| *most)
            .max()
            .unwrap_or(0)
    }

    fn alive(&self) -> i64 {
        self.live.lock().unwrap().values().map(|(now, _)| *now).sum()
    }
}

/// A counter whose count is its snapshot. Commands (ASCII):
/// `add`; `sleep:<ms>` (sleep, then add); `kv` or `kv:<n>` (add one to the key `count`
/// of its key-value space, read and written through the turn, yielding `n` times in
/// between); `deadline` (reply the turn's
/// deadline in microseconds); `call:<key>:<ms>` (call `worker/<key>` with `deadline`
/// for at most `<ms>` ms, reply `<mine>,<child's>`); `get`; `panic` (ends the activation's
/// task: a crash).
struct Worker {
    key: String,
    count: u64,
    instances: Arc<Instances>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.instances.dropped(&self.key);
    }
}

impl Actor for Worker {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let text = std::str::from_utf8(&payload).map_err(|e| ActorError::failed(e.to_string()))?;
        let mut parts = text.split(':');
        match parts.next().unwrap_or_default() {
            "add" => {}
            "get" => return Ok(Bytes::from(self.count.to_string())),
            "panic" => panic!("worker/{} was asked to panic", self.key),
            "sleep" => {
                let ms: u64 = parts.next().unwrap().parse().unwrap();
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            "kv" => {
                let stored = turn.get("count").await?;
                // `kv:<n>`: the turn yields n times between its read and its write.
                for _ in 0..parts.next().map_or(0, |n| n.parse::<u32>().unwrap()) {
                    tokio::task::yield_now().await;
                }
                let count: u64 = stored.map_or(0, |b| std::str::from_utf8(&b).unwrap().parse().unwrap());
                turn.put("count", Bytes::from((count + 1).to_string()))?;
                return Ok(Bytes::from((count + 1).to_string()));
            }
            "deadline" => {
                let deadline = turn.deadline().as_micros();
                self.instances
                    .deadlines
                    .lock()
                    .unwrap()
                    .push((turn.now().as_micros(), deadline));
                return Ok(Bytes::from(deadline.to_string()));
            }
            "call" => {
                let key = parts.next().unwrap();
                let ms: u64 = parts.next().unwrap().parse().unwrap();
                let child = turn
                    .invoke(&worker(key), Bytes::from_static(b"deadline"), Duration::from_millis(ms))
                    .await?;
                let child = std::str::from_utf8(&child).unwrap().to_string();
                return Ok(Bytes::from(format!("{},{child}", turn.deadline().as_micros())));
            }
            other => return Err(ActorError::rejected(format!("unknown command {other}"))),
        }
        self.count += 1;
        Ok(Bytes::from(self.count.to_string()))
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(self.count.to_string())))
    }
}

fn count_of(bytes: &[u8]) -> u64 {
    std::str::from_utf8(bytes).unwrap().parse().unwrap()
}

fn start_with(store: Arc<dyn StateStore>, instances: &Arc<Instances>, config: KindConfig, grace: Duration) -> Runtime {
    let observer = Arc::clone(instances);
    let instances = Arc::clone(instances);
    Runtime::builder()
        .store(store)
        .observer(observer)
        .shutdown_grace(grace)
        .unwrap()
        .register(
            ActorKind::new("worker").unwrap(),
            move |id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                instances.built(id.key());
                Ok(ActorBox::new(Worker {
                    key: id.key().to_string(),
                    count: saved.map_or(0, |b| count_of(&b)),
                    instances: Arc::clone(&instances),
                }))
            },
            config,
        )
        .unwrap()
        .start()
}

async fn stored_count(store: &dyn StateStore, key: &str) -> u64 {
    store.load(&worker(key)).await.unwrap().map_or(0, |b| count_of(&b))
}

/// What callers saw, by outcome.
#[derive(Default, Debug)]
struct Outcomes {
    ok: u64,
    shutdown: u64,
    busy: u64,
    other: Vec<String>,
}

// ---------------------------------------------------------------------------------------
// Shutdown in the middle of the traffic
// ---------------------------------------------------------------------------------------

/// How the storm of [`storm`] ends.
#[derive(Clone, Copy, Debug)]
enum Ending {
    /// `Runtime::shutdown`, with its grace period.
    Shutdown,
    /// The `Runtime` dropped, without a shutdown.
    Drop,
}

/// Many tasks send adds (asks), slow adds and tells to many actors, while a few tasks
/// hold turns stuck far past the grace period; then the runtime is shut down or
/// dropped. Returns what the callers saw, after checking that everyone was answered and
/// the store holds exactly the acknowledged adds.
async fn storm(ending: Ending) -> Outcomes {
    const GRACE: Duration = Duration::from_millis(150);
    const ACTORS: usize = 16;
    const TASKS: usize = 48;
    const STUCK_TASKS: usize = 8;
    let store = Arc::new(MemoryStore::new());
    let instances = Arc::new(Instances::default());
    let runtime = start_with(
        store.clone(),
        &instances,
        KindConfig::default().with_mailbox_capacity(8),
        GRACE,
    );
    // Acknowledged adds per actor.
    let acked: Arc<Vec<AtomicU64>> = Arc::new((0..ACTORS).map(|_| AtomicU64::new(0)).collect());
    let mut tasks = Vec::new();
    for task in 0..TASKS + STUCK_TASKS {
        let handle = runtime.handle();
        let acked = Arc::clone(&acked);
        tasks.push(tokio::spawn(async move {
            let mut outcomes = Outcomes::default();
            for round in 0u64.. {
                if task >= TASKS {
                    // Turns stuck far past the grace period, on actors of their own.
                    let key = format!("s{}", task % 3);
                    let result = handle
                        .invoke(
                            &worker(&key),
                            Bytes::from_static(b"sleep:60000"),
                            handle.deadline_in(Duration::from_secs(120)),
                        )
                        .await;
                    match result {
                        Err(InvokeError::Shutdown) => outcomes.shutdown += 1,
                        Err(InvokeError::Busy { .. }) => {
                            outcomes.busy += 1;
                            tokio::time::sleep(Duration::from_millis(1)).await;
                            continue;
                        }
                        other => outcomes.other.push(format!("stuck turn: {other:?}")),
                    }
                    break;
                }
                let actor = (task * 7 + round as usize) % ACTORS;
                let command = if round % 9 == 3 { "sleep:20" } else { "add" };
                let result = if round % 5 == 4 {
                    // A tell: its effect is not acknowledged, so it goes to an actor of
                    // its own whose count is not checked.
                    handle
                        .tell(
                            &worker(&format!("t{actor}")),
                            Bytes::from(command),
                            handle.deadline_in(HANG),
                        )
                        .await
                        .map(|()| Bytes::new())
                } else {
                    handle
                        .invoke(
                            &worker(&format!("a{actor}")),
                            Bytes::from(command),
                            handle.deadline_in(Duration::from_secs(120)),
                        )
                        .await
                };
                match result {
                    Ok(reply) => {
                        if !reply.is_empty() {
                            acked[actor].fetch_add(1, Ordering::SeqCst);
                        }
                        outcomes.ok += 1;
                    }
                    Err(InvokeError::Shutdown) => {
                        outcomes.shutdown += 1;
                        break;
                    }
                    Err(InvokeError::Busy { .. }) => {
                        outcomes.busy += 1;
                        tokio::task::yield_now().await;
                    }
                    Err(other) => {
                        outcomes.other.push(format!("{other:?}"));
                        break;
                    }
                }
            }
            outcomes
        }));
    }
    // Let the traffic build up (not a synchronisation: the storm runs meanwhile).
    tokio::time::sleep(Duration::from_millis(80)).await;
    let handle = runtime.handle();
    let started = tokio::time::Instant::now();
    match ending {
        Ending::Shutdown => within("shutdown", runtime.shutdown()).await,
        Ending::Drop => drop(runtime),
    }
    let took = started.elapsed();
    let bound = GRACE + Duration::from_millis(troupe_runtime::SHUTDOWN_ABORT_WAIT_MS) + Duration::from_millis(300);
    assert!(took < bound, "{ending:?} took {took:?}, more than {bound:?}");
    let mut total = Outcomes::default();
    for task in tasks {
        let outcomes = within("a caller's answer", task).await.unwrap();
        total.ok += outcomes.ok;
        total.shutdown += outcomes.shutdown;
        total.busy += outcomes.busy;
        total.other.extend(outcomes.other);
    }
    let answered = started.elapsed();
    let bound = match ending {
        Ending::Shutdown => bound,
        // Dropped: no grace period, so the callers are answered about at once.
        Ending::Drop => Duration::from_millis(300),
    };
    assert!(
        answered < bound,
        "{ending:?}: the callers were answered after {answered:?}, more than {bound:?}"
    );
    println!("{ending:?}: {total:?}");
    assert!(
        total.other.is_empty(),
        "errors other than Shutdown or Busy: {:?}",
        total.other
    );
    assert_eq!(
        total.shutdown,
        (TASKS + STUCK_TASKS) as u64,
        "every task ended on Shutdown"
    );
    for actor in 0..ACTORS {
        let key = format!("a{actor}");
        assert_eq!(
            stored_count(store.as_ref(), &key).await,
            acked[actor].load(Ordering::SeqCst),
            "{key}: the store holds exactly the acknowledged adds"
        );
    }
    // Dropped: the activations end when their tasks are next polled.
    instances.ended.until(handle.counters().activations_started).await;
    assert_eq!(instances.alive(), 0, "every instance was dropped");
    assert_eq!(instances.most_at_once(), 1, "never two instances of one actor");
    total
}

/// Goal: `shutdown()` while many callers on many tasks have asks and tells in flight
/// (fast turns, slow ones, and ones stuck past the grace period): it returns within the
/// grace period plus the abort wait, every waiter gets `Ok` or a typed `Shutdown`/`Busy`
/// (never another error, never a hang), and the store holds exactly the acknowledged
/// adds: nothing of a cancelled turn was committed and no acknowledged add was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_in_the_middle_of_traffic_answers_everyone_and_commits_only_acknowledged_work() {
    storm(Ending::Shutdown).await;
}

/// Goal: as above, with the `Runtime` dropped instead of shut down: every caller is
/// answered at once (no grace period), with `Ok` or `Shutdown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_dropped_in_the_middle_of_traffic_answers_everyone_and_commits_only_acknowledged_work() {
    storm(Ending::Drop).await;
}

/// Goal: after `shutdown()` has returned, every entry point of a handle kept by the
/// embedder answers `Shutdown` at once: invoke, invoke_within, invoke_keyed, tell,
/// tell_keyed, stats, deactivate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_entry_point_answers_shutdown_after_shutdown() {
    let instances = Arc::new(Instances::default());
    let runtime = start_with(
        Arc::new(MemoryStore::new()),
        &instances,
        KindConfig::default(),
        Duration::from_millis(100),
    );
    let handle = runtime.handle();
    assert_eq!(
        within(
            "add",
            handle.invoke_within(&worker("x"), Bytes::from_static(b"add"), HANG)
        )
        .await,
        Ok(Bytes::from_static(b"1"))
    );
    within("shutdown", runtime.shutdown()).await;
    let key = troupe_runtime::IdempotencyKey::new("k").unwrap();
    let id = worker("x");
    let deadline = handle.deadline_in(HANG);
    assert_eq!(
        within("invoke", handle.invoke(&id, Bytes::from_static(b"add"), deadline)).await,
        Err(InvokeError::Shutdown)
    );
    assert_eq!(
        within(
            "invoke_within",
            handle.invoke_within(&id, Bytes::from_static(b"add"), HANG)
        )
        .await,
        Err(InvokeError::Shutdown)
    );
    assert_eq!(
        within(
            "invoke_keyed",
            handle.invoke_keyed(&id, &key, Bytes::from_static(b"add"), deadline)
        )
        .await,
        Err(InvokeError::Shutdown)
    );
    assert_eq!(
        within("tell", handle.tell(&id, Bytes::from_static(b"add"), deadline)).await,
        Err(InvokeError::Shutdown)
    );
    assert_eq!(
        within(
            "tell_keyed",
            handle.tell_keyed(&id, &key, Bytes::from_static(b"add"), deadline)
        )
        .await,
        Err(InvokeError::Shutdown)
    );
    assert_eq!(within("stats", handle.stats()).await, Err(InvokeError::Shutdown));
    assert_eq!(
        within("deactivate", handle.deactivate(&id)).await,
        Err(InvokeError::Shutdown)
    );
    assert_eq!(instances.alive(), 0);
}

// ---------------------------------------------------------------------------------------
// No new turn starts once the runtime is aborted
// ---------------------------------------------------------------------------------------

/// `gate` waits for the gate; `effect` counts a side effect (an email sent, a model
/// called), and one made for a runtime already aborted apart, and changes no state, so
/// it is answered without a store commit.
struct Effects {
    started: Arc<tokio::sync::Notify>,
    gate: Arc<tokio::sync::Notify>,
    effects: Arc<[AtomicU64; 2]>,
}

impl Actor for Effects {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        match &payload[..] {
            b"gate" => {
                self.started.notify_one();
                self.gate.notified().await;
            }
            _ => {
                self.effects[usize::from(turn.runtime_aborted())].fetch_add(1, Ordering::SeqCst);
            }
        }
        Ok(payload)
    }
}

/// Queues `QUEUED` `effect` requests behind a turn waiting at its gate, opens the gate
/// and drops the runtime at once. Returns the answers of the queued requests and how
/// many side effects ran before the drop and after it.
async fn queued_requests_of_a_dropped_runtime() -> (Vec<Result<Bytes, InvokeError>>, [u64; 2]) {
    const QUEUED: usize = 20;
    let started = Arc::new(tokio::sync::Notify::new());
    let gate = Arc::new(tokio::sync::Notify::new());
    let effects = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let runtime = {
        let (started, gate, effects) = (started.clone(), gate.clone(), effects.clone());
        Runtime::builder()
            .register(
                ActorKind::new("effects").unwrap(),
                move |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> {
                    Ok(ActorBox::new(Effects {
                        started: started.clone(),
                        gate: gate.clone(),
                        effects: effects.clone(),
                    }))
                },
                KindConfig::default(),
            )
            .unwrap()
            .start()
    };
    let id = ActorId::new("effects", "e").unwrap();
    let gated = tokio::spawn({
        let (handle, id) = (runtime.handle(), id.clone());
        async move { handle.invoke_within(&id, Bytes::from_static(b"gate"), HANG).await }
    });
    within("the gated turn starts", started.notified()).await;
    let handle = runtime.handle();
    let mut queued = Vec::new();
    for _ in 0..QUEUED {
        // Sent into the mailbox in its first poll.
        let request = Box::pin(handle.invoke_within(&id, Bytes::from_static(b"effect"), HANG));
        queued.push(poll_once(request).await.expect_err("waits behind the gated turn"));
    }
    assert_eq!(
        effects[0].load(Ordering::SeqCst),
        0,
        "nothing ran behind the gated turn"
    );
    gate.notify_one();
    drop(runtime);
    let _ = within("the gated turn's answer", gated).await.unwrap();
    let mut answers = Vec::new();
    for request in queued {
        answers.push(within("a queued request's answer", request).await);
    }
    (
        answers,
        [effects[0].load(Ordering::SeqCst), effects[1].load(Ordering::SeqCst)],
    )
}

/// Goal: dropping a runtime answers its queued requests `Shutdown` and runs none of
/// them (the `Runtime` docs: "queued and held requests are answered with Shutdown"):
/// a turn that starts after the drop would act for a runtime that is gone. Method: 20
/// requests wait behind a turn at its gate; the gate opens and the runtime is dropped
/// at once, so the activation's task runs again before the dispatcher aborts it.
#[tokio::test]
async fn queued_requests_of_a_dropped_runtime_never_run_current_thread() {
    let (answers, effects) = queued_requests_of_a_dropped_runtime().await;
    assert_eq!(
        effects,
        [0, 0],
        "side effects of turns started after the drop; answers {answers:?}"
    );
    for answer in answers {
        assert_eq!(answer, Err(InvokeError::Shutdown));
    }
}

/// As above on worker threads, where the activation may run on another thread at the
/// moment of the drop: a queued turn runs before the drop and is answered `Ok`, or is
/// answered `Shutdown` unrun; none starts after the drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_requests_of_a_dropped_runtime_never_run_multi_thread() {
    for _ in 0..20 {
        // The queued turns may run before the drop (on the other worker, as soon as the
        // gate opens), never after it; each is answered as it went.
        let (answers, [before, after]) = queued_requests_of_a_dropped_runtime().await;
        assert_eq!(
            after, 0,
            "side effects of turns started after the drop; answers {answers:?}"
        );
        let ok = answers.iter().filter(|answer| answer.is_ok()).count() as u64;
        assert_eq!(ok, before, "an Ok for each turn that ran: {answers:?}");
        for answer in answers {
            assert!(matches!(answer, Ok(_) | Err(InvokeError::Shutdown)), "{answer:?}");
        }
    }
}

/// Counts its `on_deactivate` runs; `gate` waits for the gate.
struct Hooked {
    started: Arc<tokio::sync::Notify>,
    gate: Arc<tokio::sync::Notify>,
    deactivations: Arc<AtomicU64>,
}

impl Actor for Hooked {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        self.started.notify_one();
        self.gate.notified().await;
        Ok(payload)
    }

    async fn on_deactivate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        self.deactivations.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// Goal: a dropped runtime runs no `on_deactivate` (the `Runtime` docs), also when the
/// activation's task is running on another worker at the moment of the drop and sees
/// its mailbox closed before the dispatcher aborts it. Method: a turn at its gate; the
/// gate opens and the runtime is dropped at once, many times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_runtime_runs_no_on_deactivate_multi_thread() {
    let deactivations = Arc::new(AtomicU64::new(0));
    for _ in 0..300 {
        let ended = Arc::new(Ended::default());
        let started = Arc::new(tokio::sync::Notify::new());
        let gate = Arc::new(tokio::sync::Notify::new());
        let runtime = {
            let (started, gate, deactivations) = (started.clone(), gate.clone(), deactivations.clone());
            Runtime::builder()
                .observer(ended.clone())
                .register(
                    ActorKind::new("hooked").unwrap(),
                    move |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> {
                        Ok(ActorBox::new(Hooked {
                            started: started.clone(),
                            gate: gate.clone(),
                            deactivations: deactivations.clone(),
                        }))
                    },
                    KindConfig::default(),
                )
                .unwrap()
                .start()
        };
        let id = ActorId::new("hooked", "h").unwrap();
        let gated = tokio::spawn({
            let handle = runtime.handle();
            async move { handle.invoke_within(&id, Bytes::from_static(b"gate"), HANG).await }
        });
        within("the gated turn starts", started.notified()).await;
        gate.notify_one();
        drop(runtime);
        let _ = within("the gated turn's answer", gated).await.unwrap();
        // Its activation has ended (the dispatcher reports it before it stops).
        ended.until(1).await;
    }
    assert_eq!(
        deactivations.load(Ordering::SeqCst),
        0,
        "on_deactivate ran for a dropped runtime"
    );
}

/// `block:<ms>` blocks its worker thread (synchronous code, a turn the abort cannot
/// cancel); `effect` counts a side effect, apart for one made for an aborted runtime.
struct Blocking {
    started: Arc<tokio::sync::Notify>,
    effects: Arc<[AtomicU64; 2]>,
}

impl Actor for Blocking {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        if let Some(ms) = payload.strip_prefix(b"block:") {
            self.started.notify_one();
            let ms: u64 = std::str::from_utf8(ms).unwrap().parse().unwrap();
            // On purpose: a turn in synchronous code, which no abort can cancel.
            #[allow(clippy::disallowed_methods)]
            std::thread::sleep(Duration::from_millis(ms));
        } else {
            self.effects[usize::from(turn.runtime_aborted())].fetch_add(1, Ordering::SeqCst);
        }
        Ok(payload)
    }
}

/// Goal: once the shutdown grace is over, the requests still queued are answered
/// `Shutdown` unrun, also behind a turn that blocked its thread through the whole grace
/// (it cannot be cancelled, and its task goes on once it returns); shutdown returns
/// within the grace plus the abort wait. Method: a turn blocks 400 ms with 10 requests
/// queued behind it; shutdown with a 100 ms grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_queued_behind_a_turn_blocked_past_the_grace_never_run() {
    const GRACE: Duration = Duration::from_millis(100);
    let started = Arc::new(tokio::sync::Notify::new());
    let effects = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let runtime = {
        let (started, effects) = (started.clone(), effects.clone());
        Runtime::builder()
            .shutdown_grace(GRACE)
            .unwrap()
            .register(
                ActorKind::new("blocking").unwrap(),
                move |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> {
                    Ok(ActorBox::new(Blocking {
                        started: started.clone(),
                        effects: effects.clone(),
                    }))
                },
                KindConfig::default(),
            )
            .unwrap()
            .start()
    };
    let id = ActorId::new("blocking", "b").unwrap();
    let blocked = tokio::spawn({
        let (handle, id) = (runtime.handle(), id.clone());
        async move { handle.invoke_within(&id, Bytes::from_static(b"block:400"), HANG).await }
    });
    within("the blocking turn starts", started.notified()).await;
    let handle = runtime.handle();
    let mut queued = Vec::new();
    for _ in 0..10 {
        // Sent into the mailbox in its first poll.
        let request = Box::pin(handle.invoke_within(&id, Bytes::from_static(b"effect"), HANG));
        queued.push(poll_once(request).await.expect_err("waits behind the blocked turn"));
    }
    let began = tokio::time::Instant::now();
    within("shutdown", runtime.shutdown()).await;
    let took = began.elapsed();
    let bound = GRACE + Duration::from_millis(troupe_runtime::SHUTDOWN_ABORT_WAIT_MS);
    assert!(took < bound, "shutdown took {took:?}");
    // The blocked turn itself never reached an `.await` after the abort: it is answered
    // as it ended.
    let _ = within("the blocked turn's answer", blocked).await.unwrap();
    for request in queued {
        assert_eq!(
            within("a queued request's answer", request).await,
            Err(InvokeError::Shutdown)
        );
    }
    assert_eq!(
        [effects[0].load(Ordering::SeqCst), effects[1].load(Ordering::SeqCst)],
        [0, 0],
        "no queued turn ran"
    );
}

// ---------------------------------------------------------------------------------------
// Rollback by rebuild never overlaps two instances of one actor
// ---------------------------------------------------------------------------------------

/// An actor that holds something exclusive for as long as its instance lives (a lock
/// file, a device, a registration under its id): its factory refuses to build a second
/// instance of one id while the first is alive. `add` adds one; `fail` fails the turn.
struct Exclusive {
    key: String,
    held: Arc<Mutex<std::collections::HashSet<String>>>,
    count: u64,
}

impl Drop for Exclusive {
    fn drop(&mut self) {
        self.held.lock().unwrap().remove(&self.key);
    }
}

impl Actor for Exclusive {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        if &payload[..] == b"fail" {
            self.count += 100; // rolled back with the failed turn
            return Err(ActorError::failed("asked to fail"));
        }
        self.count += 1;
        Ok(Bytes::from(self.count.to_string()))
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(self.count.to_string())))
    }
}

/// Goal: the rollback of a failed turn rebuilds the actor from its committed state
/// without a second instance alive next to the failed one (as a new activation never
/// overlaps the last: "Deactivation is a handshake" in docs/architecture.md), so an
/// actor that holds something exclusive per instance is rebuilt, and its caller gets
/// the turn's own error. Method: a factory that refuses a second live instance of an
/// id; a turn fails; the next add finds the count rolled back, in the same activation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_drops_the_failed_instance_before_it_builds_the_next() {
    let held: Arc<Mutex<std::collections::HashSet<String>>> = Arc::default();
    let runtime = {
        let held = held.clone();
        Runtime::builder()
            .register(
                ActorKind::new("exclusive").unwrap(),
                move |id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                    if !held.lock().unwrap().insert(id.key().to_string()) {
                        return Err(ActorError::failed(format!("{id} is held by a live instance")));
                    }
                    Ok(ActorBox::new(Exclusive {
                        key: id.key().to_string(),
                        held: held.clone(),
                        count: saved.map_or(0, |b| count_of(&b)),
                    }))
                },
                KindConfig::default(),
            )
            .unwrap()
            .start()
    };
    let id = ActorId::new("exclusive", "x").unwrap();
    let send = |what: &'static str| runtime.invoke_within(&id, Bytes::from_static(what.as_bytes()), HANG);
    assert_eq!(within("add", send("add")).await, Ok(Bytes::from_static(b"1")));
    assert_eq!(
        within("fail", send("fail")).await,
        Err(InvokeError::ActorFailed {
            target: id.clone(),
            cause: "asked to fail".to_string()
        }),
        "the caller gets the turn's own error"
    );
    assert_eq!(
        within("add", send("add")).await,
        Ok(Bytes::from_static(b"2")),
        "rolled back"
    );
    assert_eq!(runtime.counters().activations_started, 1, "the activation lived on");
    within("shutdown", runtime.shutdown()).await;
    assert!(held.lock().unwrap().is_empty());
}

// ---------------------------------------------------------------------------------------
// Callers that give up, racing the turn's end, idle deactivation and the fast path
// ---------------------------------------------------------------------------------------

/// A small deterministic generator (xorshift), for the probes' choices.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Goal: a keyed request retried by a caller that keeps giving up (its future dropped
/// after a random few hundred microseconds, or its own short timeout), while the actor
/// is deactivated when idle (1 ms) and on demand, lands exactly once: each logical
/// increment's reply is one count of its own, the counts are exactly 1..=N, and the
/// store holds N. Method: 8 tasks × 40 logical increments (the `kv` command, read and
/// written through the turn, which yields up to 40 times in between), each retried
/// under its key until it is answered `Ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_increments_retried_by_callers_that_give_up_land_exactly_once() {
    const TASKS: u64 = 8;
    const INCREMENTS: u64 = 40;
    let store = Arc::new(MemoryStore::new());
    let instances = Arc::new(Instances::default());
    let runtime = start_with(
        store.clone(),
        &instances,
        KindConfig::default().with_idle_timeout(Duration::from_millis(1)),
        Duration::from_secs(1),
    );
    let id = worker("keyed");
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let (handle, id) = (runtime.handle(), id.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (task + 1));
            let mut replies = Vec::new();
            let mut attempts = 0u64;
            for increment in 0..INCREMENTS {
                let key = troupe_runtime::IdempotencyKey::new(&format!("t{task}-i{increment}")).unwrap();
                loop {
                    attempts += 1;
                    let payload = Bytes::from(format!("kv:{}", rng.below(40)));
                    let request = handle.invoke_keyed(&id, &key, payload.clone(), handle.deadline_in(HANG));
                    let outcome = match rng.below(3) {
                        // The caller's future dropped after a moment.
                        0 => tokio::time::timeout(Duration::from_micros(rng.below(800)), request).await,
                        // The request's own short deadline.
                        1 => Ok(handle
                            .invoke_keyed(
                                &id,
                                &key,
                                payload,
                                handle.deadline_in(Duration::from_micros(200 + rng.below(800))),
                            )
                            .await),
                        _ => Ok(within("a keyed increment", request).await),
                    };
                    match outcome {
                        Ok(Ok(reply)) => {
                            replies.push(count_of(&reply));
                            break;
                        }
                        Ok(Err(InvokeError::Timeout { .. } | InvokeError::Busy { .. })) | Err(_) => {}
                        Ok(Err(other)) => panic!("a keyed increment failed with {other:?}"),
                    }
                }
            }
            (replies, attempts)
        }));
    }
    let deactivator = tokio::spawn({
        let (handle, id) = (runtime.handle(), id.clone());
        async move {
            for _ in 0..200 {
                within("deactivate", handle.deactivate(&id)).await.unwrap();
                tokio::time::sleep(Duration::from_micros(300)).await;
            }
        }
    });
    let mut replies = Vec::new();
    let mut attempts = 0;
    for task in tasks {
        let (mut own, tried) = within("a task's increments", task).await.unwrap();
        replies.append(&mut own);
        attempts += tried;
    }
    within("the deactivator", deactivator).await.unwrap();
    let counters = runtime.counters();
    println!("attempts {attempts}, {counters:?}");
    replies.sort_unstable();
    let expected: Vec<u64> = (1..=TASKS * INCREMENTS).collect();
    assert_eq!(replies, expected, "each increment landed once, with a count of its own");
    let stored = store.get(&id, "count").await.unwrap().map(|b| count_of(&b));
    assert_eq!(stored, Some(TASKS * INCREMENTS));
    assert_eq!(instances.most_at_once(), 1, "never two instances of one actor");
    within("shutdown", runtime.shutdown()).await;
}

/// A typed counter; its instances alive (built new or from its saved state) are
/// counted in [`TYPED_LIVE`].
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(from = "SavedCounter")]
struct TypedCounter {
    count: u64,
}

/// What a [`TypedCounter`] is read back from.
#[derive(serde::Deserialize)]
struct SavedCounter {
    count: u64,
}

static TYPED_LIVE: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);
static TYPED_LIVE_MAX: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

impl TypedCounter {
    fn built(count: u64) -> Self {
        let live = TYPED_LIVE.fetch_add(1, Ordering::SeqCst) + 1;
        TYPED_LIVE_MAX.fetch_max(live, Ordering::SeqCst);
        Self { count }
    }
}

impl From<SavedCounter> for TypedCounter {
    fn from(saved: SavedCounter) -> Self {
        Self::built(saved.count)
    }
}

impl Default for TypedCounter {
    fn default() -> Self {
        Self::built(0)
    }
}

impl Drop for TypedCounter {
    fn drop(&mut self) {
        TYPED_LIVE.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `Some(ms)`: sleep `ms` milliseconds, then add one; `None`: the count.
impl troupe_runtime::TypedActor for TypedCounter {
    type Message = Option<u64>;
    type Reply = u64;

    async fn handle(&mut self, _turn: &mut Turn, message: Option<u64>) -> Result<u64, ActorError> {
        if let Some(ms) = message {
            if ms > 0 {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            self.count += 1;
        }
        Ok(self.count)
    }
}

/// Goal: typed asks through cached refs (the fast path) whose callers give up at random
/// moments, racing the turn's end and idle deactivation (1 ms), never double-apply or
/// lose an acknowledged increment and never run two activations of one actor: every
/// acknowledged count is distinct, and the final count lies between the acknowledged
/// increments and those plus the abandoned ones (an abandoned turn may have been
/// committing). Method: 6 tasks, each with its own cached ref, 300 asks each, a third
/// of them abandoned after a random few hundred microseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_asks_abandoned_through_cached_refs_never_double_apply() {
    const TASKS: u64 = 6;
    const ASKS: u64 = 300;
    let store = Arc::new(MemoryStore::new());
    let runtime = Runtime::builder()
        .store(store.clone())
        .register_typed::<TypedCounter>(
            ActorKind::new("typed").unwrap(),
            KindConfig::default().with_idle_timeout(Duration::from_millis(1)),
        )
        .unwrap()
        .start();
    let id = ActorId::new("typed", "t").unwrap();
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let actor = runtime.actor_ref::<TypedCounter>(id.clone()).unwrap();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(0xD1B5_4A32_D192_ED03 ^ (task + 1));
            let (mut acked, mut abandoned) = (Vec::new(), 0u64);
            for _ in 0..ASKS {
                let ms = u64::from(rng.below(10) == 0);
                let ask = actor.ask(Some(ms), HANG);
                if rng.below(3) == 0 {
                    match tokio::time::timeout(Duration::from_micros(rng.below(600)), ask).await {
                        Ok(Ok(count)) => acked.push(count),
                        Ok(Err(error)) => panic!("an ask failed with {error:?}"),
                        Err(_) => abandoned += 1,
                    }
                } else {
                    acked.push(within("an ask", ask).await.expect("an ask is answered"));
                }
                if rng.below(20) == 0 {
                    // Idle long enough to be deactivated.
                    tokio::time::sleep(Duration::from_millis(3)).await;
                }
            }
            (acked, abandoned)
        }));
    }
    let (mut acked, mut abandoned) = (Vec::new(), 0);
    for task in tasks {
        let (mut own, gave_up) = within("a task's asks", task).await.unwrap();
        acked.append(&mut own);
        abandoned += gave_up;
    }
    let actor = runtime.actor_ref::<TypedCounter>(id.clone()).unwrap();
    let last = within("the count", actor.ask(None, HANG)).await.unwrap();
    let counters = runtime.counters();
    println!(
        "acked {}, abandoned {abandoned}, last {last}, {counters:?}",
        acked.len()
    );
    acked.sort_unstable();
    let distinct = acked.len();
    acked.dedup();
    assert_eq!(acked.len(), distinct, "an acknowledged count was given twice");
    let acked = acked.len() as u64;
    assert!(
        (acked..=acked + abandoned).contains(&last),
        "final count {last} outside [{acked}, {}]",
        acked + abandoned
    );
    assert_eq!(
        TYPED_LIVE_MAX.load(Ordering::SeqCst),
        1,
        "never two instances of one actor"
    );
    within("shutdown", runtime.shutdown()).await;
    let stored: Option<TypedCounter> = store
        .load(&id)
        .await
        .unwrap()
        .map(|bytes| bincode::deserialize(&bytes).unwrap());
    assert_eq!(
        stored.as_ref().map(|counter| counter.count),
        Some(last),
        "the store holds the last count"
    );
}

// ---------------------------------------------------------------------------------------
// Two runtimes (two processes) on one SQLite file
// ---------------------------------------------------------------------------------------

/// The name of an error's variant (with its store error's, for a storage failure).
fn error_kind(error: &InvokeError) -> String {
    let name = |debug: String| debug.split([' ', '{', '(']).next().unwrap().to_string();
    match error {
        InvokeError::StorageFailed { source, .. } => format!("StorageFailed({})", name(format!("{source:?}"))),
        other => name(format!("{other:?}")),
    }
}

/// A temporary SQLite file, removed with its directory when dropped.
struct TempFile(tempfile::TempDir);

impl TempFile {
    fn new(name: &str) -> Self {
        Self(
            tempfile::Builder::new()
                .prefix(&format!("troupe-embedder-{name}-{}-", std::process::id()))
                .tempdir()
                .unwrap(),
        )
    }

    fn path(&self) -> std::path::PathBuf {
        self.0.path().join("state.sqlite")
    }

    fn open(&self) -> Arc<dyn StateStore> {
        Arc::new(troupe_runtime::SqliteStore::open(self.path()).unwrap())
    }
}

/// Goal: two runtimes on one SQLite file, called concurrently for the same actors from
/// many tasks each, keep exactly one committer per actor: keyed increments retried
/// until answered `Ok` (after a fenced commit, a busy mailbox, a timeout) land exactly
/// once, so each actor's replies are exactly 1..=N and its stored count is N (never a
/// lost update, never one applied twice). Method: 2 runtimes × 4 tasks × 3 actors ×
/// 12 increments; short idle timeouts and forced deactivations make the activations
/// move between the runtimes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_increments_from_two_runtimes_on_one_sqlite_file_land_exactly_once() {
    const TASKS: u64 = 4;
    const ACTORS: u64 = 3;
    const INCREMENTS: u64 = 12;
    let file = TempFile::new("keyed-two-runtimes");
    let instances = Arc::new(Instances::default());
    let config = KindConfig::default().with_idle_timeout(Duration::from_millis(5));
    let runtimes = [
        start_with(file.open(), &instances, config, Duration::from_secs(1)),
        start_with(file.open(), &instances, config, Duration::from_secs(1)),
    ];
    let errors: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let mut tasks = Vec::new();
    for (side, runtime) in runtimes.iter().enumerate() {
        for task in 0..TASKS {
            let (handle, errors) = (runtime.handle(), errors.clone());
            tasks.push(tokio::spawn(async move {
                let mut rng = Rng(0xA076_1D64_78BD_642F ^ ((side as u64) << 8 | task));
                let mut replies: Vec<(u64, u64)> = Vec::new();
                for increment in 0..INCREMENTS {
                    for actor in 0..ACTORS {
                        let id = worker(&format!("shared{actor}"));
                        let key =
                            troupe_runtime::IdempotencyKey::new(&format!("r{side}-t{task}-i{increment}")).unwrap();
                        loop {
                            let payload = Bytes::from(format!("kv:{}", rng.below(4)));
                            let deadline = handle.deadline_in(Duration::from_millis(200 + rng.below(400)));
                            match within("a keyed increment", handle.invoke_keyed(&id, &key, payload, deadline)).await {
                                Ok(reply) => {
                                    replies.push((actor, count_of(&reply)));
                                    break;
                                }
                                Err(error) => {
                                    let kind = error_kind(&error);
                                    *errors.lock().unwrap().entry(kind).or_default() += 1;
                                    assert!(
                                        matches!(
                                            error,
                                            InvokeError::StorageFailed { .. }
                                                | InvokeError::Timeout { .. }
                                                | InvokeError::Busy { .. }
                                        ),
                                        "unexpected {error:?}"
                                    );
                                    tokio::task::yield_now().await;
                                }
                            }
                        }
                    }
                }
                replies
            }));
        }
    }
    let deactivator = tokio::spawn({
        let handles = [runtimes[0].handle(), runtimes[1].handle()];
        async move {
            for round in 0..60u64 {
                let id = worker(&format!("shared{}", round % ACTORS));
                within("deactivate", handles[(round % 2) as usize].deactivate(&id))
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    });
    let mut replies: HashMap<u64, Vec<u64>> = HashMap::new();
    for task in tasks {
        for (actor, count) in tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("a task hung")
            .unwrap()
        {
            replies.entry(actor).or_default().push(count);
        }
    }
    within("the deactivator", deactivator).await.unwrap();
    let counters = [runtimes[0].counters(), runtimes[1].counters()];
    println!("errors {:?}\n{counters:?}", errors.lock().unwrap());
    let [first, second] = runtimes;
    within("shutdown", first.shutdown()).await;
    within("shutdown", second.shutdown()).await;
    let reader = file.open();
    for actor in 0..ACTORS {
        let mut counts = replies.remove(&actor).unwrap_or_default();
        counts.sort_unstable();
        let expected: Vec<u64> = (1..=2 * TASKS * INCREMENTS).collect();
        assert_eq!(counts, expected, "shared{actor}: each increment landed once");
        let stored = reader.get(&worker(&format!("shared{actor}")), "count").await.unwrap();
        assert_eq!(
            stored.map(|b| count_of(&b)),
            Some(2 * TASKS * INCREMENTS),
            "shared{actor}: stored"
        );
    }
}

/// Goal: unkeyed increments of an actor's in-memory state (its snapshot), sent to two
/// runtimes on one SQLite file from many tasks at once, lose no acknowledged increment
/// and apply none twice: a caller retries only what was refused unrun or uncommitted
/// (a fenced commit, a busy mailbox), so the final count is at least the acknowledged
/// increments and at most those plus the ones whose outcome the caller could not know
/// (timeouts); the acknowledged counts are distinct.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unkeyed_increments_from_two_runtimes_on_one_sqlite_file_lose_nothing_and_double_nothing() {
    const TASKS: u64 = 4;
    const INCREMENTS: u64 = 40;
    let file = TempFile::new("unkeyed-two-runtimes");
    let instances = Arc::new(Instances::default());
    let config = KindConfig::default().with_idle_timeout(Duration::from_millis(3));
    let runtimes = [
        start_with(file.open(), &instances, config, Duration::from_secs(1)),
        start_with(file.open(), &instances, config, Duration::from_secs(1)),
    ];
    let id = worker("contended");
    let errors: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let mut tasks = Vec::new();
    for runtime in &runtimes {
        for _ in 0..TASKS {
            let (handle, errors, id) = (runtime.handle(), errors.clone(), id.clone());
            tasks.push(tokio::spawn(async move {
                let (mut acked, mut unknown) = (Vec::new(), 0u64);
                for _ in 0..INCREMENTS {
                    loop {
                        let deadline = handle.deadline_in(Duration::from_millis(500));
                        let outcome =
                            within("an increment", handle.invoke(&id, Bytes::from_static(b"add"), deadline)).await;
                        if let Err(error) = &outcome {
                            *errors.lock().unwrap().entry(error_kind(error)).or_default() += 1;
                        }
                        match outcome {
                            Ok(reply) => {
                                acked.push(count_of(&reply));
                                break;
                            }
                            // Refused unrun, or its commit refused: nothing landed.
                            Err(InvokeError::Busy { .. })
                            | Err(InvokeError::StorageFailed {
                                source: troupe_runtime::StoreError::Fenced { .. },
                                ..
                            }) => tokio::task::yield_now().await,
                            Err(InvokeError::Timeout { .. }) => {
                                unknown += 1;
                                break;
                            }
                            Err(other) => panic!("unexpected {other:?}"),
                        }
                    }
                }
                (acked, unknown)
            }));
        }
    }
    let (mut acked, mut unknown) = (Vec::new(), 0);
    for task in tasks {
        let (mut own, unsure) = tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("a task hung")
            .unwrap();
        acked.append(&mut own);
        unknown += unsure;
    }
    let counters = [runtimes[0].counters(), runtimes[1].counters()];
    let [first, second] = runtimes;
    within("shutdown", first.shutdown()).await;
    within("shutdown", second.shutdown()).await;
    let stored = stored_count(file.open().as_ref(), "contended").await;
    println!(
        "acked {}, unknown {unknown}, stored {stored}, errors {:?}\n{counters:?}",
        acked.len(),
        errors.lock().unwrap()
    );
    acked.sort_unstable();
    let all = acked.len();
    acked.dedup();
    assert_eq!(
        acked.len(),
        all,
        "an acknowledged count was given twice: an increment applied on a stale state"
    );
    let acked = acked.len() as u64;
    assert!(
        (acked..=acked + unknown).contains(&stored),
        "stored {stored} outside [{acked}, {}]",
        acked + unknown
    );
    assert_eq!(instances.alive(), 0);
}

// ---------------------------------------------------------------------------------------
// Backpressure under many concurrent senders
// ---------------------------------------------------------------------------------------

/// Each turn says it started, then takes one permit of the gate before it adds one to
/// its count.
struct Turnstile {
    started: Arc<tokio::sync::Notify>,
    gate: Arc<tokio::sync::Semaphore>,
    count: u64,
}

impl Actor for Turnstile {
    async fn handle(&mut self, _turn: &mut Turn, _payload: Bytes) -> Result<Bytes, ActorError> {
        self.started.notify_one();
        self.gate.acquire().await.unwrap().forget();
        self.count += 1;
        Ok(Bytes::from(self.count.to_string()))
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(self.count.to_string())))
    }
}

/// A request of [`burst`]: an ask's reply, or `None` for an accepted tell.
type Sent = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Option<Bytes>, InvokeError>> + Send>>;

/// Sends `senders` requests at once from as many tasks (every third a tell, the rest
/// asks), each sent in one poll; then, once the dispatcher has routed what went through
/// it (a `stats` request, queued behind them, has been answered), polls each once more.
/// Returns the accepted asks (still waiting), how many tells were accepted, and how many
/// of either were refused `Busy`: by then, every request is decided, nobody waits in
/// line.
async fn burst(handle: &troupe_runtime::RuntimeHandle, id: &ActorId, senders: usize) -> (Vec<Sent>, usize, usize) {
    let start = Arc::new(tokio::sync::Barrier::new(senders));
    let mut tasks = Vec::new();
    for sender in 0..senders {
        let (handle, id, start) = (handle.clone(), id.clone(), start.clone());
        tasks.push(tokio::spawn(async move {
            // The normal build only (this file), where a replay is not promised (see
            // clippy.toml on `Barrier::wait`).
            #[allow(clippy::disallowed_methods)]
            start.wait().await;
            let request: Sent = if sender % 3 == 0 {
                Box::pin(async move {
                    let deadline = handle.deadline_in(HANG);
                    handle.tell(&id, Bytes::new(), deadline).await.map(|()| None)
                })
            } else {
                Box::pin(async move { handle.invoke_within(&id, Bytes::new(), HANG).await.map(Some) })
            };
            poll_once(request).await
        }));
    }
    let mut sent = Vec::new();
    for task in tasks {
        sent.push(within("a sender", task).await.unwrap());
    }
    // Every request above was sent in its sender's first poll, so the dispatcher has
    // answered each (held, refused or passed on) before it answers this `stats`. A
    // refusal is then in its reply channel; an accepted ask stays undecided. Undecided
    // requests are polled again after two more round trips, so a refusal that is slow
    // to show counts as one here, and is caught by the exact checks instead (the
    // dispatcher's held count and the `busy_refused` counter, asserted by the caller).
    let mut undecided: Vec<Result<_, Sent>> = sent;
    let (mut told, mut busy) = (0, 0);
    for _round in 0..BURST_DECIDE_ROUNDS {
        within("stats", handle.stats()).await.unwrap();
        let mut still = Vec::new();
        for request in undecided {
            let decided = match request {
                Ok(done) => Ok(done),
                Err(pending) => poll_once(pending).await,
            };
            match decided {
                Err(ask) => still.push(Err(ask)),
                Ok(Ok(None)) => told += 1,
                Ok(Err(InvokeError::Busy { capacity, .. })) => {
                    assert_eq!(capacity, CAPACITY);
                    busy += 1;
                }
                Ok(other) => panic!("unexpected {other:?}"),
            }
        }
        undecided = still;
    }
    let waiting = undecided.into_iter().map(|ask| ask.expect_err("undecided")).collect();
    (waiting, told, busy)
}

/// Round trips to the dispatcher after which a burst's undecided asks count as waiting.
const BURST_DECIDE_ROUNDS: usize = 3;

/// The mailbox capacity of the backpressure probe.
const CAPACITY: usize = 4;

/// Goal: a bounded mailbox under 120 concurrent senders (asks and tells, on worker
/// threads, through the fast path and the dispatcher) accepts exactly its capacity
/// behind a running turn and refuses every other message `Busy` at once; while the
/// activation deactivates (forced, behind the same stuck turn), exactly the capacity
/// more is held and the rest is refused. Nothing is queued beyond that, and everything
/// accepted runs once the gate opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_senders_meet_a_bounded_mailbox_and_a_bounded_hold() {
    const SENDERS: usize = 120;
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let started = Arc::new(tokio::sync::Notify::new());
    let runtime = {
        let (gate, started) = (gate.clone(), started.clone());
        Runtime::builder()
            .register(
                ActorKind::new("turnstile").unwrap(),
                move |_: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                    Ok(ActorBox::new(Turnstile {
                        started: started.clone(),
                        gate: gate.clone(),
                        count: saved.map_or(0, |b| count_of(&b)),
                    }))
                },
                KindConfig::default().with_mailbox_capacity(CAPACITY),
            )
            .unwrap()
            .start()
    };
    let id = ActorId::new("turnstile", "t").unwrap();
    // The turn that holds the actor: it waits at the gate.
    let first = tokio::spawn({
        let (handle, id) = (runtime.handle(), id.clone());
        async move { handle.invoke_within(&id, Bytes::new(), HANG).await }
    });
    within("the first turn starts", started.notified()).await;
    let (mut waiting, told, busy) = burst(&runtime.handle(), &id, SENDERS).await;
    assert_eq!(
        waiting.len() + told,
        CAPACITY,
        "accepted into the mailbox: its capacity, no more"
    );
    assert_eq!(busy, SENDERS - CAPACITY);
    // Deactivation on demand waits for the stuck turn; meanwhile messages are held. Its
    // request is sent in its first poll, and handled before the `stats` sent after it.
    let handle = runtime.handle();
    let deactivation = poll_once(Box::pin(handle.deactivate(&id)))
        .await
        .expect_err("waits for the stuck turn");
    assert_eq!(within("stats", runtime.stats()).await.unwrap().deactivating, 1);
    let (mut held_waiting, held_told, held_busy) = burst(&runtime.handle(), &id, SENDERS).await;
    let stats = within("stats", runtime.stats()).await.unwrap();
    assert_eq!(
        (held_waiting.len() + held_told, held_busy, stats.held_messages),
        (CAPACITY, SENDERS - CAPACITY, CAPACITY),
        "held for the next activation: its capacity, no more (accepted, refused Busy, held by the dispatcher)"
    );
    assert_eq!(runtime.counters().busy_refused, 2 * (SENDERS - CAPACITY) as u64);
    // Open the gate: the stuck turn, the queued messages, then the held ones in the next
    // activation.
    gate.add_permits(1 + 2 * CAPACITY);
    assert!(within("the stuck turn", first).await.unwrap().is_ok());
    waiting.append(&mut held_waiting);
    for ask in waiting {
        assert!(matches!(within("an accepted ask", ask).await, Ok(Some(_))));
    }
    assert_eq!(within("the deactivation", deactivation).await, Ok(true));
    // One more ask, behind every held message in the next activation's mailbox.
    gate.add_permits(1);
    let count = within("the count", runtime.invoke_within(&id, Bytes::new(), HANG))
        .await
        .unwrap();
    let total = 2 + 2 * CAPACITY as u64;
    assert_eq!(count_of(&count), total, "everything accepted ran once");
    assert_eq!(runtime.counters().turns_run, total, "and nothing else ran");
    assert_eq!(runtime.counters().activations_started, 2);
    within("shutdown", runtime.shutdown()).await;
}

// ---------------------------------------------------------------------------------------
// Deadlines at their edges
// ---------------------------------------------------------------------------------------

/// The longest a turn may run, in microseconds.
const TURN_US_MAX: u64 = troupe_core::limits::INVOKE_TIMEOUT_MS_MAX * 1_000;

/// Goal: zero, past, huge and overflowing timeouts and deadlines, through every entry
/// point, never panic, never run what has no time left, and never give a turn more
/// than the longest invoke timeout; a child's deadline is never beyond its parent's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_at_their_edges_are_refused_or_capped_never_overflowed() {
    let instances = Arc::new(Instances::default());
    let runtime = start_with(
        Arc::new(MemoryStore::new()),
        &instances,
        KindConfig::default(),
        Duration::from_secs(1),
    );
    let handle = runtime.handle();
    let end_of_time = Deadline::from_micros(u64::MAX);
    let deadline_cmd = || Bytes::from_static(b"deadline");
    let timed_out = |result: Result<Bytes, InvokeError>| matches!(result, Err(InvokeError::Timeout { .. }));

    // No time at all: refused, nothing activated.
    let cold = worker("never");
    assert!(timed_out(
        within("zero", handle.invoke_within(&cold, deadline_cmd(), Duration::ZERO)).await
    ));
    assert!(timed_out(
        within("past", handle.invoke(&cold, deadline_cmd(), Deadline::from_micros(0))).await
    ));
    assert!(timed_out(
        within("now", handle.invoke(&cold, deadline_cmd(), handle.now())).await
    ));
    assert!(matches!(
        within(
            "past tell",
            handle.tell(&cold, deadline_cmd(), Deadline::from_micros(1))
        )
        .await,
        Err(InvokeError::Timeout { .. })
    ));
    let key = troupe_runtime::IdempotencyKey::new("k").unwrap();
    assert!(timed_out(
        within(
            "past keyed",
            handle.invoke_keyed(&cold, &key, deadline_cmd(), Deadline::from_micros(0))
        )
        .await
    ));
    assert_eq!(runtime.counters().activations_started, 0, "nothing ran without time");

    // The end of time, and the longest durations: capped.
    let hot = worker("capped");
    let mut answers = Vec::new();
    answers.push(within("end of time", handle.invoke(&hot, deadline_cmd(), end_of_time)).await);
    answers.push(
        within(
            "Duration::MAX",
            handle.invoke_within(&hot, deadline_cmd(), Duration::MAX),
        )
        .await,
    );
    answers.push(
        within(
            "deadline_in(MAX)",
            handle.invoke(&hot, deadline_cmd(), handle.deadline_in(Duration::MAX)),
        )
        .await,
    );
    answers.push(
        within(
            "clock's end of time",
            handle.invoke(&hot, deadline_cmd(), handle.clock().deadline_in(Duration::MAX)),
        )
        .await,
    );
    answers.push(
        within(
            "keyed end of time",
            handle.invoke_keyed(&hot, &key, deadline_cmd(), end_of_time),
        )
        .await,
    );
    answers.push(
        within(
            "invoke_in at the end of time",
            handle.invoke_in(&hot, deadline_cmd(), troupe_core::CallContext::root(end_of_time)),
        )
        .await,
    );
    for answer in answers {
        assert!(answer.is_ok(), "{answer:?}");
    }
    // Told at the end of time: runs, under the cap.
    within(
        "tell at the end of time",
        handle.tell(&hot, deadline_cmd(), end_of_time),
    )
    .await
    .unwrap();
    within(
        "tell_keyed at the end of time",
        handle.tell_keyed(
            &hot,
            &troupe_runtime::IdempotencyKey::new("t").unwrap(),
            deadline_cmd(),
            end_of_time,
        ),
    )
    .await
    .unwrap();
    // One more, behind the told ones in the mailbox: they have run when it answers.
    within("behind the tells", handle.invoke_within(&hot, deadline_cmd(), HANG))
        .await
        .unwrap();
    let deadlines = instances.deadlines.lock().unwrap().clone();
    assert_eq!(deadlines.len(), 9, "every capped request ran once: {deadlines:?}");
    for (now, deadline) in &deadlines {
        assert!(deadline > now, "{deadline} not after {now}");
        assert!(
            deadline - now <= TURN_US_MAX,
            "a turn got {} s",
            (deadline - now) / 1_000_000
        );
    }

    // A call from a turn, asking for the longest time: the child's deadline is its
    // parent's at most, also when the parent has little left.
    for (parent_ms, child_ms) in [(300_000, u64::MAX), (200, 60_000), (50, 1)] {
        let reply = within(
            "a call",
            handle.invoke_within(
                &worker("parent"),
                Bytes::from(format!("call:child:{child_ms}")),
                Duration::from_millis(parent_ms),
            ),
        )
        .await
        .unwrap();
        let text = String::from_utf8(reply.to_vec()).unwrap();
        let (mine, child) = text.split_once(',').unwrap();
        let (mine, child): (u64, u64) = (mine.parse().unwrap(), child.parse().unwrap());
        assert!(
            child <= mine,
            "child {child} beyond parent {mine} ({parent_ms} ms, asked {child_ms} ms)"
        );
    }

    // The clock's conversions at the end of time do not overflow.
    let clock = handle.clock();
    let _ = clock.instant_of(end_of_time);
    let _ = clock.instant_of(Deadline::from_micros(0));
    assert_eq!(
        within("until the end of time", clock.until(end_of_time, async { 7 })).await,
        Ok(7)
    );
    assert!(
        within("run_until the end of time", clock.run_until(end_of_time, async { 7 }))
            .await
            .is_ok()
    );

    // Configuration past the limits is refused, not overflowed.
    assert!(Runtime::builder().shutdown_grace(Duration::MAX).is_err());
    assert!(KindConfig::default()
        .with_idle_timeout(Duration::MAX)
        .validate()
        .is_err());
    assert!(KindConfig::default()
        .with_idle_timeout(Duration::ZERO)
        .validate()
        .is_err());
    assert!(KindConfig::default().with_mailbox_capacity(0).validate().is_err());
    assert!(KindConfig::default()
        .with_mailbox_capacity(usize::MAX)
        .validate()
        .is_err());
    within("shutdown", runtime.shutdown()).await;
}

/// A typed actor that records how long each of its turns was given, in microseconds.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct TypedDeadlines;

static TYPED_TURN_TIME: Mutex<Vec<u64>> = Mutex::new(Vec::new());

impl troupe_runtime::TypedActor for TypedDeadlines {
    type Message = ();
    type Reply = u64;

    async fn handle(&mut self, turn: &mut Turn, (): ()) -> Result<u64, ActorError> {
        let given = turn.deadline().as_micros().saturating_sub(turn.now().as_micros());
        TYPED_TURN_TIME.lock().unwrap().push(given);
        Ok(given)
    }
}

/// Goal: the typed entry points (`ask`, `tell`, `tell_by`, `ask_keyed`, `tell_keyed`)
/// at zero, past and the longest times: nothing with no time left runs, nothing is
/// given more than the longest invoke timeout, nothing panics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_deadlines_at_their_edges_are_refused_or_capped() {
    let runtime = Runtime::builder()
        .register_typed::<TypedDeadlines>(ActorKind::new("deadlines").unwrap(), KindConfig::default())
        .unwrap()
        .start();
    let actor = runtime
        .actor_ref::<TypedDeadlines>(ActorId::new("deadlines", "d").unwrap())
        .unwrap();
    let key = |k: &str| troupe_runtime::IdempotencyKey::new(k).unwrap();
    // No time: refused, never run (the actor is not active yet, so tell_by's past
    // deadline is seen by the dispatcher).
    assert!(matches!(
        within("ask 0", actor.ask((), Duration::ZERO)).await,
        Err(InvokeError::Timeout { .. })
    ));
    assert!(matches!(
        within("tell 0", actor.tell((), Duration::ZERO)).await,
        Err(InvokeError::Timeout { .. })
    ));
    assert!(matches!(
        within("tell_by past", actor.tell_by((), Deadline::from_micros(1))).await,
        Err(InvokeError::Timeout { .. })
    ));
    assert!(matches!(
        within("ask_keyed 0", actor.ask_keyed(&key("a"), (), Duration::ZERO)).await,
        Err(InvokeError::Timeout { .. })
    ));
    assert_eq!(runtime.counters().activations_started, 0);
    // The longest: capped.
    let mut given = vec![
        within("ask MAX", actor.ask((), Duration::MAX)).await.unwrap(),
        within("ask_keyed MAX", actor.ask_keyed(&key("b"), (), Duration::MAX))
            .await
            .unwrap(),
    ];
    within("tell MAX", actor.tell((), Duration::MAX)).await.unwrap();
    within("tell_by end", actor.tell_by((), Deadline::from_micros(u64::MAX)))
        .await
        .unwrap();
    within("tell_keyed MAX", actor.tell_keyed(&key("c"), (), Duration::MAX))
        .await
        .unwrap();
    // Active now: a past deadline through tell_by is accepted and dropped unrun.
    let dropped = runtime.counters().expired_dropped;
    within("tell_by past, active", actor.tell_by((), Deadline::from_micros(1)))
        .await
        .unwrap();
    given.push(within("ask", actor.ask((), Duration::from_secs(1))).await.unwrap());
    assert_eq!(
        runtime.counters().expired_dropped,
        dropped + 1,
        "the expired tell was dropped unrun"
    );
    let all = TYPED_TURN_TIME.lock().unwrap().clone();
    assert_eq!(all.len(), 6, "{all:?} (answered {given:?})");
    assert!(all.iter().all(|&us| us > 0 && us <= TURN_US_MAX), "{all:?}");
    within("shutdown", runtime.shutdown()).await;
}

/// Goal: after a stale activation's commit is refused (`Fenced`: the other runtime on
/// the file claimed the actor since), the caller's next request is served by a fresh
/// activation, from the newest state, at once: the refusal closed the stale activation
/// before it was answered (docs/architecture.md, "The turn's fast path": a caller that
/// next asks finds it closed). A request that reached the stale mailbox instead would
/// be refused with the fence again, although nothing is wrong with it. Method: for 40
/// actors, runtime A activates the actor, runtime B adds one, A's add is refused with
/// the fence, and A's next request, sent as soon as that refusal is in, must answer
/// B's count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_after_a_fenced_refusal_is_served_by_a_fresh_activation() {
    const ACTORS: usize = 40;
    let file = TempFile::new("after-fenced");
    let instances = Arc::new(Instances::default());
    let config = KindConfig::default();
    let a = start_with(file.open(), &instances, config, Duration::from_secs(1));
    let b = start_with(file.open(), &instances, config, Duration::from_secs(1));
    async fn send(runtime: &Runtime, key: &str, command: &'static str) -> Result<Bytes, InvokeError> {
        runtime
            .invoke_within(&worker(key), Bytes::from_static(command.as_bytes()), HANG)
            .await
    }
    let mut refused_again = Vec::new();
    for actor in 0..ACTORS {
        let key = format!("f{actor}");
        assert_eq!(
            within("a: get", send(&a, &key, "get")).await,
            Ok(Bytes::from_static(b"0"))
        );
        assert_eq!(
            within("b: add", send(&b, &key, "add")).await,
            Ok(Bytes::from_static(b"1"))
        );
        let refused = within("a: add", send(&a, &key, "add")).await;
        assert!(
            matches!(
                refused,
                Err(InvokeError::StorageFailed {
                    source: troupe_runtime::StoreError::Fenced { .. },
                    ..
                })
            ),
            "{refused:?}"
        );
        match within("a: get after the refusal", send(&a, &key, "get")).await {
            Ok(count) => assert_eq!(count, Bytes::from_static(b"1"), "the newest state"),
            Err(error) => refused_again.push(error_kind(&error)),
        }
    }
    assert!(
        refused_again.is_empty(),
        "{} of {ACTORS} requests after a fenced refusal were refused again: {refused_again:?}",
        refused_again.len()
    );
    within("shutdown", a.shutdown()).await;
    within("shutdown", b.shutdown()).await;
}

// ---------------------------------------------------------------------------------------
// Shutdown given up, deactivation during shutdown, a runtime outliving its tokio runtime
// ---------------------------------------------------------------------------------------

/// Goal: an embedder that stops waiting for `shutdown()` (its future dropped during the
/// grace period, say under its own timeout) does not leave the runtime running until
/// the grace ends: dropping the future drops the `Runtime`, which aborts at once, so a
/// caller of a stuck turn gets `Shutdown` at once; a `deactivate` waiting on that turn
/// is answered too. Method: a turn stuck for a minute, a deactivation waiting for it,
/// shutdown with a 60 s grace given up after 50 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_given_up_aborts_at_once_and_answers_everyone() {
    let instances = Arc::new(Instances::default());
    let runtime = start_with(
        Arc::new(MemoryStore::new()),
        &instances,
        KindConfig::default(),
        Duration::from_secs(60),
    );
    let handle = runtime.handle();
    let id = worker("stuck");
    let stuck = Box::pin(handle.invoke_within(&id, Bytes::from_static(b"sleep:60000"), HANG));
    let stuck = poll_once(stuck).await.expect_err("sent");
    // The turn runs once the dispatcher has activated the actor: wait for it through a
    // deactivation request, which waits on the running turn.
    let deactivation = poll_once(Box::pin(handle.deactivate(&id)))
        .await
        .expect_err("waits on the stuck turn");
    assert_eq!(within("stats", handle.stats()).await.unwrap().deactivating, 1);
    let began = tokio::time::Instant::now();
    assert!(
        tokio::time::timeout(Duration::from_millis(50), runtime.shutdown())
            .await
            .is_err(),
        "the grace period is a minute"
    );
    assert_eq!(within("the stuck call", stuck).await, Err(InvokeError::Shutdown));
    let answered = began.elapsed();
    assert!(answered < Duration::from_secs(2), "answered after {answered:?}");
    // The activation ended (aborted): `true`; or the dispatcher had stopped: `Shutdown`.
    let deactivated = within("the deactivation", deactivation).await;
    assert!(
        matches!(deactivated, Ok(true) | Err(InvokeError::Shutdown)),
        "{deactivated:?}"
    );
    assert_eq!(
        within(
            "a request after",
            handle.invoke_within(&id, Bytes::from_static(b"add"), HANG)
        )
        .await,
        Err(InvokeError::Shutdown)
    );
    instances.ended.until(1).await;
    assert_eq!(instances.alive(), 0);
}

/// Goal: a `Runtime` whose tokio runtime has already been shut down (an embedder that
/// tears down in the wrong order) can still be dropped, and its handles still answer,
/// without a panic: `Shutdown`, or nothing waits. Method: start a runtime inside a
/// tokio runtime made by hand, shut that tokio runtime down, then use a handle from
/// another tokio runtime and drop the `Runtime` outside any.
#[test]
fn a_runtime_outliving_its_tokio_runtime_drops_and_answers_without_a_panic() {
    let instances = Arc::new(Instances::default());
    let first = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let runtime = first.block_on(async {
        let runtime = start_with(
            Arc::new(MemoryStore::new()),
            &instances,
            KindConfig::default(),
            Duration::from_secs(1),
        );
        let reply = runtime
            .invoke_within(&worker("w"), Bytes::from_static(b"add"), HANG)
            .await;
        assert_eq!(reply, Ok(Bytes::from_static(b"1")));
        runtime
    });
    first.shutdown_timeout(Duration::from_secs(5));
    let handle = runtime.handle();
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async {
        let answer = within(
            "a request to a runtime whose tasks are gone",
            handle.invoke_within(&worker("w"), Bytes::from_static(b"add"), HANG),
        )
        .await;
        assert!(matches!(answer, Err(InvokeError::Shutdown)), "{answer:?}");
        assert_eq!(within("stats", handle.stats()).await, Err(InvokeError::Shutdown));
    });
    drop(runtime);
    drop(handle);
    assert_eq!(instances.alive(), 0, "the instance went with the tokio runtime's tasks");
}

/// Goal: `RuntimeHandle::deactivate` waiting on a busy activation when a graceful
/// shutdown begins is answered as its docs say: the shutdown deactivates the activation
/// the usual way (the turn finishes, `on_deactivate` runs, the state is saved), so the
/// call returns `Ok(true)`; once the runtime has stopped, `deactivate` is `Shutdown`.
/// Method: a turn that sleeps 200 ms, a deactivation waiting on it, then `shutdown()`
/// with a 10 s grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deactivation_waiting_when_a_graceful_shutdown_begins_returns_true_once_saved() {
    let instances = Arc::new(Instances::default());
    let store = Arc::new(MemoryStore::new());
    let runtime = start_with(
        store.clone(),
        &instances,
        KindConfig::default(),
        Duration::from_secs(10),
    );
    let handle = runtime.handle();
    let id = worker("graceful");
    let busy = tokio::spawn({
        let handle = handle.clone();
        let id = id.clone();
        async move { handle.invoke_within(&id, Bytes::from_static(b"sleep:200"), HANG).await }
    });
    let deactivation = tokio::spawn({
        let handle = handle.clone();
        let id = id.clone();
        async move {
            // Sent once the actor is active, so the deactivation waits on the turn.
            while handle.stats().await.unwrap().activations == 0 {
                tokio::task::yield_now().await;
            }
            handle.deactivate(&id).await
        }
    });
    while within("stats", handle.stats()).await.unwrap().deactivating == 0 {
        tokio::task::yield_now().await;
    }
    within("shutdown", runtime.shutdown()).await;
    assert_eq!(
        within("the sleeping turn", busy).await.unwrap(),
        Ok(Bytes::from_static(b"1")),
        "the running turn finished within the grace"
    );
    assert_eq!(
        within("the deactivation", deactivation).await.unwrap(),
        Ok(true),
        "the activation was live and ended"
    );
    assert_eq!(stored_count(store.as_ref(), "graceful").await, 1, "saved at its end");
    assert_eq!(
        within("a deactivation after", handle.deactivate(&id)).await,
        Err(InvokeError::Shutdown)
    );
}

/// Goal: what two runtimes on one file promise, and what they do not. The fence makes
/// one committer per actor; it does not make reads fresh. An activation that another
/// runtime's newer claim has made stale still answers turns that commit nothing from
/// the state it loaded, until a turn of it commits and is refused `Fenced`; then the next
/// request is served by a fresh activation, from the newest state. This pins down the
/// limit docs/architecture.md states ("Two runtimes on one file: one committer, not
/// fresh reads"). Method: runtime a activates the counter and reads 0; runtime b adds
/// one (committed: 1); a reads again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_activation_answers_reads_from_its_own_state_until_a_commit_is_fenced() {
    let file = TempFile::new("stale-reads");
    let instances = Arc::new(Instances::default());
    let a = start_with(file.open(), &instances, KindConfig::default(), Duration::from_secs(1));
    let b = start_with(file.open(), &instances, KindConfig::default(), Duration::from_secs(1));
    let send = |runtime: &Runtime, command: &'static str| {
        let handle = runtime.handle();
        async move {
            handle
                .invoke_within(&worker("s"), Bytes::from_static(command.as_bytes()), HANG)
                .await
        }
    };
    assert_eq!(within("a: get", send(&a, "get")).await, Ok(Bytes::from_static(b"0")));
    assert_eq!(within("b: add", send(&b, "add")).await, Ok(Bytes::from_static(b"1")));
    assert_eq!(
        within("a: get, stale", send(&a, "get")).await,
        Ok(Bytes::from_static(b"0")),
        "a read-only turn of the stale activation commits nothing, so nothing refuses it"
    );
    let refused = within("a: add", send(&a, "add")).await;
    assert!(
        matches!(
            refused,
            Err(InvokeError::StorageFailed {
                source: troupe_runtime::StoreError::Fenced { .. },
                ..
            })
        ),
        "{refused:?}"
    );
    assert_eq!(
        within("a: get after the fence", send(&a, "get")).await,
        Ok(Bytes::from_static(b"1")),
        "a fresh activation reads the newest state"
    );
    within("shutdown", a.shutdown()).await;
    within("shutdown", b.shutdown()).await;
}

/// Goal: requests that reach a stale activation while its fenced commit closes its
/// mailbox are answered with the fence or served by a fresh activation, never with
/// `ActorFailed` ("the activation ended before the message was delivered"): a request
/// the dispatcher routes between the fence's close and its notice is held for the
/// next activation, as during a deactivation. Method: two runtimes on one SQLite file;
/// for each of 60 actors runtime `a` activates it, runtime `b` commits (a newer claim),
/// then 8 tasks send `add` through `a` at once, each retrying on the fence; every answer
/// must be `Ok`. This probe held before the dispatcher's fix too (it reaches the window
/// too rarely): the fix's test is `dispatcher::tests::a_request_that_meets_a_mailbox_its_task_closed_is_held_for_the_next_activation`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_racing_a_fenced_close_are_fenced_or_served_never_failed() {
    const ACTORS: usize = 60;
    const SENDERS: usize = 8;
    const RETRIES: usize = 20;
    let file = TempFile::new("fenced-race");
    let instances = Arc::new(Instances::default());
    let a = start_with(file.open(), &instances, KindConfig::default(), Duration::from_secs(1));
    let b = start_with(file.open(), &instances, KindConfig::default(), Duration::from_secs(1));
    let mut kinds: HashMap<String, usize> = HashMap::new();
    for actor in 0..ACTORS {
        let id = worker(&format!("r{actor}"));
        let get = a.invoke_within(&id, Bytes::from_static(b"get"), HANG);
        assert_eq!(within("a: get", get).await, Ok(Bytes::from_static(b"0")));
        let add = b.invoke_within(&id, Bytes::from_static(b"add"), HANG);
        assert_eq!(within("b: add", add).await, Ok(Bytes::from_static(b"1")));
        let senders: Vec<_> = (0..SENDERS)
            .map(|_| {
                let handle = a.handle();
                let id = id.clone();
                tokio::spawn(async move {
                    // Retried on the fence, as a caller would: the retries race the close.
                    for _ in 0..RETRIES {
                        match handle.invoke_within(&id, Bytes::from_static(b"add"), HANG).await {
                            Err(InvokeError::StorageFailed {
                                source: troupe_runtime::StoreError::Fenced { .. },
                                ..
                            }) => continue,
                            other => return other,
                        }
                    }
                    panic!("fenced {RETRIES} times in a row")
                })
            })
            .collect();
        for sender in senders {
            let kind = match within("a: add", sender).await.unwrap() {
                Ok(_) => "Ok".to_string(),
                Err(error) => error_kind(&error),
            };
            *kinds.entry(kind).or_default() += 1;
        }
    }
    let unexpected: Vec<_> = kinds.iter().filter(|(kind, _)| kind.as_str() != "Ok").collect();
    assert!(
        unexpected.is_empty(),
        "outcomes of {} sends: {kinds:?}",
        ACTORS * SENDERS
    );
    within("shutdown", a.shutdown()).await;
    within("shutdown", b.shutdown()).await;
}

/// Goal: a request that reaches an activation whose task has just crashed (its mailbox
/// gone with it), before the dispatcher has had the crash notice, is held and served by
/// the next activation, as one that comes during a deactivation is: it never ran, so it
/// is not failed. Requests queued in the crashed mailbox had not started either: since
/// 9c35b1a the crash notice carries them to the next activation too (before, they
/// failed `ActorFailed`, "ended before it replied"); only the panicking turn's caller
/// fails. Method: 4 tasks send `add` in a loop through
/// one runtime while a fifth asks the actor to panic, 40 times; every failure must be
/// one of the queued kind. This probe held before the dispatcher's fix too (the notice is
/// sent before the mailbox goes, and the dispatcher applies notices before each command,
/// so the window is one command's routing wide): the fix's test is the dispatcher's unit
/// test named above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_racing_a_crash_notice_is_served_by_the_next_activation() {
    const ROUNDS: usize = 40;
    const SENDERS: usize = 4;
    const SENDS: usize = 50;
    let instances = Arc::new(Instances::default());
    let runtime = start_with(
        Arc::new(MemoryStore::new()),
        &instances,
        KindConfig::default(),
        Duration::from_secs(1),
    );
    let mut undelivered = Vec::new();
    let mut outcomes: HashMap<String, usize> = HashMap::new();
    for round in 0..ROUNDS {
        let id = worker(&format!("c{round}"));
        let senders: Vec<_> = (0..SENDERS)
            .map(|_| {
                let handle = runtime.handle();
                let id = id.clone();
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    for _ in 0..SENDS {
                        seen.push(handle.invoke_within(&id, Bytes::from_static(b"add"), HANG).await);
                    }
                    seen
                })
            })
            .collect();
        tokio::task::yield_now().await;
        let crash = runtime.invoke_within(&id, Bytes::from_static(b"panic"), HANG);
        assert!(
            matches!(within("the panic", crash).await, Err(InvokeError::ActorFailed { .. })),
            "the panicking turn fails"
        );
        for sender in senders {
            for outcome in within("the senders", sender).await.unwrap() {
                let kind = match &outcome {
                    Ok(_) => "Ok".to_string(),
                    Err(InvokeError::ActorFailed { cause, .. }) => format!("ActorFailed: {cause}"),
                    Err(other) => error_kind(other),
                };
                if kind.contains("before the message was delivered") {
                    undelivered.push(round);
                }
                *outcomes.entry(kind).or_default() += 1;
            }
        }
    }
    assert!(
        undelivered.is_empty(),
        "{} requests never delivered were failed (rounds {undelivered:?}); outcomes: {outcomes:?}",
        undelivered.len()
    );
    within("shutdown", runtime.shutdown()).await;
}

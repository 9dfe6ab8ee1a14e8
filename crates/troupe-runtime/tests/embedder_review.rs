//! A demanding embedder's review of the runtime, from outside (helper-80, 2026-12-07):
//! only the public API, on tokio's worker threads, every wait bounded. Each probe is a
//! property that fails if its guarantee breaks; what `embedder_probes.rs` already covers
//! (shutdown storms, abandoned asks, two runtimes on one SQLite file, deadlines at their
//! edges) is not repeated here.

#![cfg(not(madsim))]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, MemoryStore, Runtime, StateStore, Turn};

/// How long any single await may take before the probe calls it a hang.
const HANG: Duration = Duration::from_secs(5);

/// How often a probe looks again at the dispatcher's tables while it waits for a state.
const POLL_PAUSE_MS: u64 = 1;

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(HANG, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {HANG:?}"))
}

/// What the recorder's instances share with the test: the told records in the order
/// they ran, and the gate a `gate` turn waits at.
#[derive(Default)]
struct Shared {
    records: Mutex<Vec<String>>,
    gate: tokio::sync::Notify,
    /// Notified when a `gate` turn has begun (its message is out of the mailbox).
    at_gate: tokio::sync::Notify,
}

/// An actor that runs told commands (ASCII): `gate` (waits until the test opens the
/// gate), `panic` (its task ends: a crash), `rec:<x>` (appends `x` to the records).
struct Recorder {
    shared: Arc<Shared>,
}

impl Actor for Recorder {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let text = std::str::from_utf8(&payload).map_err(|e| ActorError::failed(e.to_string()))?;
        match text.split_once(':') {
            None if text == "gate" => {
                self.shared.at_gate.notify_one();
                self.shared.gate.notified().await;
            }
            None if text == "panic" => panic!("the recorder panics on purpose"),
            Some(("rec", record)) => self.shared.records.lock().unwrap().push(record.to_string()),
            _ => return Err(ActorError::rejected(format!("unknown command {text}"))),
        }
        Ok(Bytes::new())
    }
}

fn start_recorder(shared: &Arc<Shared>, config: KindConfig) -> Runtime {
    start_recorder_with_grace(
        shared,
        config,
        Duration::from_millis(troupe_runtime::SHUTDOWN_GRACE_MS_DEFAULT),
    )
}

/// As `start_recorder`, with a shutdown grace of `grace`.
fn start_recorder_with_grace(shared: &Arc<Shared>, config: KindConfig, grace: Duration) -> Runtime {
    let shared = Arc::clone(shared);
    Runtime::builder()
        .store(Arc::new(MemoryStore::new()))
        .shutdown_grace(grace)
        .unwrap()
        .register(
            ActorKind::new("recorder").unwrap(),
            move |_id: &ActorId, _saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Ok(ActorBox::new(Recorder {
                    shared: Arc::clone(&shared),
                }))
            },
            config,
        )
        .unwrap()
        .start()
}

/// Goal: a told message, once accepted (`tell` answered `Ok`), runs: here, when the
/// activation crashes while it deactivates, with a full mailbox behind the crash and
/// more messages held for the next activation. The crashed mailbox's unrun messages and
/// the held ones together are up to twice the mailbox's capacity; every one of them was
/// accepted, so the next activation must run them all, in the order they were accepted.
/// Method: capacity 4; a `gate` turn holds the actor while `panic` and three records
/// fill the mailbox; `deactivate` closes it; four more records are held (each tell `Ok`);
/// the gate opens, the `panic` turn crashes the activation, and the next activation
/// must record all seven.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn told_messages_accepted_behind_a_crash_while_deactivating_all_run() {
    const CAPACITY: usize = 4;
    quiet_planned_panics();
    let shared = Arc::new(Shared::default());
    let runtime = start_recorder(&shared, KindConfig::default().with_mailbox_capacity(CAPACITY));
    let id = ActorId::new("recorder", "r").unwrap();
    let tell = |text: String| {
        let handle = runtime.handle();
        let id = id.clone();
        async move { handle.tell(&id, Bytes::from(text), handle.deadline_in(HANG)).await }
    };
    within("the gate's tell", tell("gate".into())).await.unwrap();
    // The gate turn has taken its message once the mailbox has room for CAPACITY more.
    let mut in_mailbox = vec!["panic".to_string()];
    in_mailbox.extend((0..CAPACITY - 1).map(|i| format!("rec:m{i}")));
    for text in &in_mailbox {
        loop {
            match within("a tell into the mailbox", tell(text.clone())).await {
                Ok(()) => break,
                // The gate's message not taken yet: the mailbox holds one too many.
                Err(InvokeError::Busy { .. }) => {
                    tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await;
                }
                Err(other) => panic!("{text}: {other:?}"),
            }
        }
    }
    let full = within("a tell into the full mailbox", tell("rec:refused".into())).await;
    assert!(
        matches!(full, Err(InvokeError::Busy { .. })),
        "the mailbox is full: {full:?}"
    );
    // Close the mailbox while the gate turn runs: the activation deactivates once its
    // queued messages are done; new messages are held for the next one.
    let deactivation = tokio::spawn({
        let handle = runtime.handle();
        let id = id.clone();
        async move { handle.deactivate(&id).await }
    });
    within("the mailbox closed", async {
        while runtime.stats().await.unwrap().deactivating == 0 {
            tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await;
        }
    })
    .await;
    let held: Vec<String> = (0..CAPACITY).map(|i| format!("h{i}")).collect();
    for record in &held {
        within("a held tell", tell(format!("rec:{record}")))
            .await
            .unwrap_or_else(|error| panic!("{record}: held for the next activation, not {error:?}"));
    }
    assert_eq!(runtime.stats().await.unwrap().held_messages, CAPACITY, "all held");
    shared.gate.notify_one();
    let deactivated = within("the deactivation", deactivation).await.unwrap();
    println!("deactivate answered {deactivated:?}");
    // Every accepted record, in the order accepted.
    let expected: Vec<String> = in_mailbox
        .iter()
        .filter_map(|text| text.strip_prefix("rec:").map(str::to_string))
        .chain(held.iter().cloned())
        .collect();
    // An ask sent after them is answered after every message queued before it ran.
    within("the ask behind them", async {
        loop {
            let handle = runtime.handle();
            match handle
                .invoke(&id, Bytes::from_static(b"rec:last"), handle.deadline_in(HANG))
                .await
            {
                Ok(_) => return,
                Err(InvokeError::Busy { .. }) => tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await,
                Err(other) => panic!("the ask behind them: {other:?}"),
            }
        }
    })
    .await;
    let mut ran = shared.records.lock().unwrap().clone();
    assert_eq!(ran.pop().as_deref(), Some("last"), "the ask ran last");
    assert_eq!(ran, expected, "every accepted told message runs once, in order");
    within("shutdown", runtime.shutdown()).await;
}

/// Goal: a told message accepted before `shutdown()` runs within the grace period also
/// when it was held for the next activation (its actor was deactivating when it came),
/// as one put into an open mailbox does (`Runtime::shutdown`, step 2; `tell` is accepted
/// once "in the mailbox or held for the next activation"). Method: a `gate` turn holds
/// the actor; `deactivate` closes its mailbox; one record is told and held (`Ok`);
/// `shutdown()` begins (grace `GRACE`); the gate opens well within the grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_told_message_held_when_shutdown_begins_runs_within_the_grace() {
    const GRACE: Duration = Duration::from_secs(2);
    let shared = Arc::new(Shared::default());
    let runtime = start_recorder_with_grace(&shared, KindConfig::default(), GRACE);
    let handle = runtime.handle();
    let id = ActorId::new("recorder", "r").unwrap();
    let tell = |text: &'static str| {
        let handle = handle.clone();
        let id = id.clone();
        async move { handle.tell(&id, Bytes::from(text), handle.deadline_in(HANG)).await }
    };
    within("the gate's tell", tell("gate")).await.unwrap();
    let deactivation = tokio::spawn({
        let (handle, id) = (handle.clone(), id.clone());
        async move { handle.deactivate(&id).await }
    });
    within("the mailbox closed", async {
        while handle.stats().await.unwrap().deactivating == 0 {
            tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await;
        }
    })
    .await;
    within("the held tell", tell("rec:held"))
        .await
        .expect("held, so accepted");
    assert_eq!(handle.stats().await.unwrap().held_messages, 1, "held");
    let started = tokio::time::Instant::now();
    let shutdown = tokio::spawn(runtime.shutdown());
    shutdown_begun(&handle).await;
    shared.gate.notify_one();
    within("shutdown", shutdown).await.unwrap();
    let took = started.elapsed();
    let _ = within("the deactivation", deactivation).await.unwrap();
    assert!(took < GRACE, "shutdown took {took:?}, the whole grace {GRACE:?}");
    let ran = shared.records.lock().unwrap().clone();
    assert_eq!(
        ran,
        vec!["held".to_string()],
        "the told message accepted before the shutdown ran within the grace (shutdown took {took:?})"
    );
}

/// Silences the panic messages of the turns the probes make panic on purpose (their
/// message says "on purpose", on a runtime worker); other panics are reported as usual
/// (a task's assertion again through its `JoinError` on the test's thread).
fn quiet_planned_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let report = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let message = payload
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| payload.downcast_ref::<&str>().copied());
            // Only on the runtime's workers: the test's own thread reports every
            // failure, also one whose text quotes a planned panic's.
            let on_a_worker = std::thread::current().name() == Some("tokio-rt-worker");
            let planned = on_a_worker && message.is_some_and(|message| message.contains("on purpose"));
            if !planned {
                report(info);
            }
        }));
    });
}

/// Instances of one actor alive now and the most ever alive at once.
#[derive(Default)]
struct Live {
    now_and_most: Mutex<(i64, i64)>,
}

impl Live {
    fn built(&self) {
        let mut live = self.now_and_most.lock().unwrap();
        live.0 += 1;
        live.1 = live.1.max(live.0);
    }

    fn most(&self) -> i64 {
        self.now_and_most.lock().unwrap().1
    }
}

/// A counter whose count is its snapshot: `add` adds one and replies the count;
/// `panic:<key>` adds a thousand, then panics (the turn never commits).
struct Crashy {
    count: u64,
    live: Arc<Live>,
}

impl Drop for Crashy {
    fn drop(&mut self) {
        self.live.now_and_most.lock().unwrap().0 -= 1;
    }
}

impl Actor for Crashy {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        if payload.starts_with(b"panic") {
            self.count += 1_000;
            tokio::task::yield_now().await;
            panic!("crashy panics on purpose: {}", String::from_utf8_lossy(&payload));
        }
        tokio::task::yield_now().await;
        self.count += 1;
        Ok(Bytes::from(self.count.to_string()))
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(self.count.to_string())))
    }
}

/// A small deterministic generator (xorshift), one per task.
struct Rng(u64);

impl Rng {
    fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % bound
    }
}

/// Goal: turns that panic among many concurrent asks cost only themselves: each
/// panicking ask fails `ActorFailed` (or `Busy`, not run); every other ask is answered
/// `Ok` or `Busy` (queued behind a crash, it is served by the next activation), never
/// failed by someone else's panic; the acknowledged counts are exactly 1..=N (no
/// panicking turn's change survives, none is applied twice or lost), the store holds N,
/// and never two instances live at once. Method: 6 tasks × 150 asks at one actor with
/// a mailbox of 4 (fewer than the tasks), one in eight a panic, each add retried on `Busy` until answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn panicking_turns_among_concurrent_asks_cost_only_themselves() {
    const TASKS: u64 = 6;
    const ASKS: u64 = 150;
    const CAPACITY: usize = 4;
    quiet_planned_panics();
    let store = Arc::new(MemoryStore::new());
    let live = Arc::new(Live::default());
    let factory_live = Arc::clone(&live);
    let runtime = Runtime::builder()
        .store(store.clone())
        .register(
            ActorKind::new("crashy").unwrap(),
            move |_id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                factory_live.built();
                Ok(ActorBox::new(Crashy {
                    count: saved.map_or(0, |b| std::str::from_utf8(&b).unwrap().parse().unwrap()),
                    live: Arc::clone(&factory_live),
                }))
            },
            KindConfig::default().with_mailbox_capacity(CAPACITY),
        )
        .unwrap()
        .start();
    let id = ActorId::new("crashy", "c").unwrap();
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let (handle, id) = (runtime.handle(), id.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(0xA076_1D64_78BD_642F ^ (task + 1));
            let (mut counts, mut crashes) = (Vec::new(), 0u64);
            for ask in 0..ASKS {
                if rng.below(8) == 0 {
                    let payload = Bytes::from(format!("panic:{task}-{ask}"));
                    match within("a panic", handle.invoke(&id, payload, handle.deadline_in(HANG))).await {
                        Err(InvokeError::ActorFailed { .. }) => crashes += 1,
                        Err(InvokeError::Busy { .. }) => {}
                        other => panic!("a panicking turn answered {other:?}"),
                    }
                    continue;
                }
                loop {
                    let add = handle.invoke(&id, Bytes::from_static(b"add"), handle.deadline_in(HANG));
                    match within("an add", add).await {
                        Ok(reply) => {
                            counts.push(std::str::from_utf8(&reply).unwrap().parse::<u64>().unwrap());
                            break;
                        }
                        Err(InvokeError::Busy { .. }) => tokio::task::yield_now().await,
                        Err(other) => panic!("an add failed because of another turn: {other:?}"),
                    }
                }
            }
            (counts, crashes)
        }));
    }
    let (mut counts, mut crashes) = (Vec::new(), 0);
    for task in tasks {
        let (mut own, crashed) = within("a task", task).await.unwrap();
        counts.append(&mut own);
        crashes += crashed;
    }
    let counters = runtime.counters();
    println!("adds {}, crashes {crashes}, {counters:?}", counts.len());
    assert!(crashes > 0, "no turn crashed: the probe tested nothing");
    counts.sort_unstable();
    let expected: Vec<u64> = (1..=counts.len() as u64).collect();
    assert_eq!(
        counts, expected,
        "each add counted once, no panicking turn's change kept"
    );
    assert_eq!(live.most(), 1, "never two instances of one actor");
    within("shutdown", runtime.shutdown()).await;
    let stored = store
        .load(&id)
        .await
        .unwrap()
        .map(|b| String::from_utf8(b.to_vec()).unwrap());
    assert_eq!(
        stored,
        Some(counts.len().to_string()),
        "the store holds the acknowledged adds"
    );
}

/// Polls `future` once (a request is sent in its first poll: into the open mailbox on
/// the fast path, or onto the dispatcher's queue) and gives it back, to be awaited later.
/// It must not have finished in that poll.
async fn sent<F: std::future::Future + Unpin>(mut future: F) -> F {
    std::future::poll_fn(|cx| {
        assert!(
            std::pin::Pin::new(&mut future).poll(cx).is_pending(),
            "answered at once"
        );
        std::task::Poll::Ready(())
    })
    .await;
    future
}

/// Goal: when a crash leaves more than a mailbox's worth for the next activation (its
/// unrun messages and those held while it deactivated), the requests past the first
/// mailbox's worth are refused `Busy` (their callers still wait, and are told), while
/// every told message, accepted already, runs; all in the order they came. Method:
/// capacity 4; behind a `gate` turn the mailbox holds `panic`, ask a1, tell t1, ask a2;
/// `deactivate`; held: tell t2, ask a3, tell t3, ask a4; the gate opens and `panic`
/// crashes the activation.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_a_mailbox_carried_over_a_crash_requests_are_busy_and_tells_run() {
    const CAPACITY: usize = 4;
    quiet_planned_panics();
    let shared = Arc::new(Shared::default());
    let runtime = start_recorder(&shared, KindConfig::default().with_mailbox_capacity(CAPACITY));
    let handle = runtime.handle();
    let id = ActorId::new("recorder", "r").unwrap();
    let deadline = handle.deadline_in(HANG);
    let tell = |text: &'static str| handle.tell(&id, Bytes::from(text), deadline);
    let ask = |text: &'static str| Box::pin(handle.invoke(&id, Bytes::from(text), deadline));
    within("the gate's tell", tell("gate")).await.unwrap();
    within("the gate's turn", shared.at_gate.notified()).await;
    within("panic's tell", tell("panic")).await.unwrap();
    let a1 = sent(ask("rec:a1")).await;
    within("t1", tell("rec:t1")).await.unwrap();
    let a2 = sent(ask("rec:a2")).await;
    let deactivation = tokio::spawn({
        let (handle, id) = (handle.clone(), id.clone());
        async move { handle.deactivate(&id).await }
    });
    within("the mailbox closed", async {
        while handle.stats().await.unwrap().deactivating == 0 {
            tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await;
        }
    })
    .await;
    within("t2", tell("rec:t2")).await.unwrap();
    let a3 = sent(ask("rec:a3")).await;
    within("t3", tell("rec:t3")).await.unwrap();
    let a4 = sent(ask("rec:a4")).await;
    within("a4 held", async {
        while handle.stats().await.unwrap().held_messages < CAPACITY {
            tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await;
        }
    })
    .await;
    shared.gate.notify_one();
    within("the deactivation", deactivation).await.unwrap().unwrap();
    let answers = [
        within("a1", a1).await,
        within("a2", a2).await,
        within("a3", a3).await,
        within("a4", a4).await,
    ];
    let kinds: Vec<&str> = answers
        .iter()
        .map(|answer| match answer {
            Ok(_) => "ok",
            Err(InvokeError::Busy { .. }) => "busy",
            Err(_) => "other",
        })
        .collect();
    assert_eq!(kinds, ["ok", "ok", "busy", "busy"], "{answers:?}");
    let last = within(
        "the ask behind them",
        handle.invoke(&id, Bytes::from_static(b"rec:last"), deadline),
    )
    .await;
    assert!(last.is_ok(), "{last:?}");
    let ran = shared.records.lock().unwrap().clone();
    assert_eq!(
        ran,
        ["a1", "t1", "a2", "t2", "t3", "last"],
        "told messages all ran, in order"
    );
    within("shutdown", runtime.shutdown()).await;
}

/// Goal: requests already in a mailbox when `shutdown()` begins finish within the grace
/// (`Runtime::shutdown`, step 2) also when a turn before them panics: they never
/// started, so they run in one more activation, as they would outside a shutdown, and
/// are answered `Ok`, not `Shutdown`. Method: a `gate` turn holds the actor while
/// `panic`, two asks and a tell queue behind it; `shutdown()` begins (grace `GRACE`);
/// the gate opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_queued_behind_a_panic_during_the_grace_are_served() {
    const GRACE: Duration = Duration::from_secs(2);
    quiet_planned_panics();
    let shared = Arc::new(Shared::default());
    let runtime = start_recorder_with_grace(&shared, KindConfig::default(), GRACE);
    let handle = runtime.handle();
    let id = ActorId::new("recorder", "r").unwrap();
    let deadline = handle.deadline_in(HANG);
    let tell = |text: &'static str| handle.tell(&id, Bytes::from(text), deadline);
    let ask = |text: &'static str| Box::pin(handle.invoke(&id, Bytes::from(text), deadline));
    within("the gate's tell", tell("gate")).await.unwrap();
    within("the gate's turn", shared.at_gate.notified()).await;
    within("panic's tell", tell("panic")).await.unwrap();
    let first = sent(ask("rec:q1")).await;
    within("q2's tell", tell("rec:q2")).await.unwrap();
    let third = sent(ask("rec:q3")).await;
    let shutdown = tokio::spawn(runtime.shutdown());
    shutdown_begun(&handle).await;
    shared.gate.notify_one();
    let answers = (within("q1", first).await, within("q3", third).await);
    within("shutdown", shutdown).await.unwrap();
    assert!(
        matches!(answers, (Ok(_), Ok(_))),
        "queued behind the panic, within the grace: {answers:?}"
    );
    let ran = shared.records.lock().unwrap().clone();
    assert_eq!(ran, ["q1", "q2", "q3"], "all three ran, in order");
}

/// How many times [`Flaky::migrate`] ran; every odd-numbered run fails.
static FLAKY_MIGRATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Version 1 of a counter whose version 0 was a bare `u32`. Its migration fails every
/// other time it runs (a conversion that reaches something flaky); a message `true`
/// fails its turn (rolled back: the instance is rebuilt from the stored state, which
/// migrates again).
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Flaky {
    count: u64,
}

impl troupe_runtime::TypedActor for Flaky {
    type Message = bool;
    type Reply = u64;
    const STATE_VERSION: u32 = 1;

    fn migrate(stored: troupe_runtime::StoredState<'_>) -> Result<Self, troupe_runtime::StateVersionError> {
        let run = FLAKY_MIGRATIONS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if run % 2 == 1 {
            return Err(stored.fail(format!("migration run {run} failed on purpose")));
        }
        match stored.version() {
            0 => Ok(Self {
                count: u64::from(stored.decode::<u32>()?),
            }),
            _ => Err(stored.refuse()),
        }
    }

    async fn handle(&mut self, _turn: &mut Turn, fail: bool) -> Result<u64, ActorError> {
        self.count += 1;
        if fail {
            return Err(ActorError::failed("this turn fails on purpose"));
        }
        Ok(self.count)
    }
}

/// Goal: a migration that fails now and then, under concurrent callers and failed
/// turns (each rollback migrates again), never lets a turn run on anything but the
/// converted state: the stored `u32` 100 is never lost to a default (0) state, no
/// failed turn's change survives, the acknowledged counts are exactly 101..=100+N, and
/// the store ends at 100+N in the new version. A failed migration's callers get
/// `ActorFailed` whose text names the actor and reads cleanly (no runs of spaces). Method:
/// 8 tasks × 25 asks, the first and one in five of the rest a failing turn, each add
/// retried until `Ok`; the migration's runs 1 (the first activation) and 3 (the
/// rollback of the first turn) fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flaky_migration_under_concurrent_callers_never_loses_the_stored_state() {
    const TASKS: u64 = 8;
    const ASKS: u64 = 25;
    FLAKY_MIGRATIONS.store(0, std::sync::atomic::Ordering::SeqCst);
    quiet_planned_panics();
    let store = Arc::new(MemoryStore::new());
    let id = ActorId::new("flaky", "f").unwrap();
    let claimed = store.claim(&id).await.unwrap();
    let old = troupe_runtime::TurnCommit {
        state: troupe_runtime::StateChange::Set(Bytes::copy_from_slice(&100u32.to_le_bytes())),
        writes: Vec::new(),
    };
    store.commit(&id, claimed.fence, old).await.unwrap();
    let runtime = Runtime::builder()
        .store(store.clone())
        .register_typed::<Flaky>(ActorKind::new("flaky").unwrap(), KindConfig::default())
        .unwrap()
        .start();
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let actor = runtime.actor_ref::<Flaky>(id.clone()).unwrap();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(0xE703_7ED1_A0B4_28DB ^ (task + 1));
            let (mut counts, mut migration_failures) = (Vec::new(), Vec::new());
            for ask in 0..ASKS {
                // Every task's first ask fails its turn: the first turn that ever runs
                // fails, and its rollback migrates again (run 3, which fails).
                let fail = ask == 0 || rng.below(5) == 0;
                loop {
                    match within("an ask", actor.ask(fail, HANG)).await {
                        Ok(count) => {
                            assert!(!fail, "a failing turn answered Ok({count})");
                            counts.push(count);
                            break;
                        }
                        Err(InvokeError::ActorFailed { cause, .. }) if cause.contains("migration run") => {
                            migration_failures.push(cause);
                        }
                        Err(InvokeError::ActorFailed { cause, .. }) if fail && cause.contains("this turn fails") => {
                            break;
                        }
                        Err(other) => panic!("an ask (fail: {fail}) answered {other:?}"),
                    }
                }
            }
            (counts, migration_failures)
        }));
    }
    let (mut counts, mut failures) = (Vec::new(), Vec::new());
    for task in tasks {
        let (mut own, mut failed) = within("a task", task).await.unwrap();
        counts.append(&mut own);
        failures.append(&mut failed);
    }
    let migrations = FLAKY_MIGRATIONS.load(std::sync::atomic::Ordering::SeqCst);
    println!(
        "adds {}, migrations {migrations}, callers failed by a migration {}",
        counts.len(),
        failures.len()
    );
    counts.sort_unstable();
    let expected: Vec<u64> = (101..=100 + counts.len() as u64).collect();
    assert_eq!(counts, expected, "every add counted once on the converted state");
    assert!(!failures.is_empty(), "no migration failed: the probe tested nothing");
    for cause in &failures {
        assert!(cause.contains("flaky/f"), "the failure names the actor: {cause}");
        assert!(!cause.contains("  "), "the failure reads cleanly: {cause:?}");
    }
    within("shutdown", runtime.shutdown()).await;
    let actor_state = store.load(&id).await.unwrap().expect("stored");
    let tag = &actor_state[..troupe_runtime::STATE_VERSION_TAG_BYTES];
    assert_eq!(&tag[tag.len() - 4..], &1u32.to_le_bytes(), "stored in the new version");
    let stored: Flaky = bincode::deserialize(&actor_state[troupe_runtime::STATE_VERSION_TAG_BYTES..]).unwrap();
    assert_eq!(
        stored.count,
        100 + counts.len() as u64,
        "the store holds the acknowledged adds"
    );
}

/// Goal: commits that fail (an injected fault, refused at once) and store outages that
/// come and go (tried again until the request's deadline) among concurrent asks never
/// double an add and never keep a refused one: every acknowledged count is distinct,
/// the store ends at or above the highest, and above the acknowledged adds by no more
/// than the adds whose outcome the caller could not know (`Timeout`: the turn may have
/// committed as the wait ran out); an add refused `StorageFailed` (an injected fault, or
/// an outage past its deadline: a memory store's outage changes nothing) is never kept. Never two instances at once; the store's answers are the only errors.
/// Method: 6 tasks add (deadline 40 ms, a pause of up to 2 ms between adds) for as long
/// as a side task injects a commit fault or an outage of up to 30 ms, 40 times.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failing_commits_and_outages_among_concurrent_asks_never_double_or_keep_a_refused_add() {
    const TASKS: u64 = 6;
    const ADDS_MAX: u64 = 2_000;
    const ADD_DEADLINE: Duration = Duration::from_millis(40);
    const FAULTS: u64 = 40;
    let store = Arc::new(MemoryStore::new());
    let live = Arc::new(Live::default());
    let factory_live = Arc::clone(&live);
    let runtime = Runtime::builder()
        .store(store.clone())
        .register(
            ActorKind::new("crashy").unwrap(),
            move |_id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                factory_live.built();
                Ok(ActorBox::new(Crashy {
                    count: saved.map_or(0, |b| std::str::from_utf8(&b).unwrap().parse().unwrap()),
                    live: Arc::clone(&factory_live),
                }))
            },
            KindConfig::default(),
        )
        .unwrap()
        .start();
    let id = ActorId::new("crashy", "s").unwrap();
    let faults_done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let faults = tokio::spawn({
        let store = store.clone();
        let faults_done = Arc::clone(&faults_done);
        async move {
            let mut rng = Rng(0x8EBC_6AF0_9C88_C6E3);
            for _ in 0..FAULTS {
                tokio::time::sleep(Duration::from_millis(rng.below(10))).await;
                if rng.below(2) == 0 {
                    store.faults().fail_next_commits(1);
                } else {
                    store.faults().set_unavailable(true);
                    tokio::time::sleep(Duration::from_millis(rng.below(30))).await;
                    store.faults().set_unavailable(false);
                }
            }
            faults_done.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    });
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let (handle, id, faults_done) = (runtime.handle(), id.clone(), Arc::clone(&faults_done));
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(0x5851_F42D_4C95_7F2D ^ (task + 1));
            let (mut counts, mut unknown, mut refused) = (Vec::new(), 0u64, 0u64);
            for _ in 0..ADDS_MAX {
                if faults_done.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                tokio::time::sleep(Duration::from_micros(rng.below(2_000))).await;
                let add = handle.invoke(&id, Bytes::from_static(b"add"), handle.deadline_in(ADD_DEADLINE));
                match within("an add", add).await {
                    Ok(reply) => counts.push(std::str::from_utf8(&reply).unwrap().parse::<u64>().unwrap()),
                    Err(InvokeError::StorageFailed {
                        source: troupe_core::StoreError::Injected { .. },
                        ..
                    }) => refused += 1,
                    // A memory store's outage changes nothing: not kept either.
                    Err(InvokeError::StorageFailed {
                        source: troupe_core::StoreError::Unavailable { .. },
                        ..
                    }) => refused += 1,
                    // The turn may have committed as the caller's wait ran out.
                    Err(InvokeError::Timeout { .. }) => unknown += 1,
                    Err(other) => panic!("an add answered {other:?}"),
                }
            }
            (counts, unknown, refused)
        }));
    }
    let (mut counts, mut unknown, mut refused) = (Vec::new(), 0, 0);
    for task in tasks {
        let (mut own, not_known, not_kept) = within("a task", task).await.unwrap();
        counts.append(&mut own);
        unknown += not_known;
        refused += not_kept;
    }
    within("the faults", faults).await.unwrap();
    store.faults().set_unavailable(false);
    store.faults().heal();
    let last = within(
        "the last add",
        runtime.invoke(&id, Bytes::from_static(b"add"), runtime.deadline_in(HANG)),
    )
    .await
    .expect("the store is back");
    let last: u64 = std::str::from_utf8(&last).unwrap().parse().unwrap();
    println!(
        "acked {}, unknown {unknown}, refused {refused}, last {last}, injected {}, {:?}",
        counts.len(),
        store.faults().injected_count(),
        runtime.counters()
    );
    counts.push(last);
    counts.sort_unstable();
    let acked = counts.len() as u64;
    let distinct = {
        let mut distinct = counts.clone();
        distinct.dedup();
        distinct.len() as u64
    };
    assert_eq!(distinct, acked, "an acknowledged count was given twice");
    assert_eq!(counts.last(), Some(&last), "the last add counts on from every other");
    assert!(
        (acked..=acked + unknown).contains(&last),
        "the count {last} is outside [{acked}, {}]: an add refused Injected was kept, or one was lost",
        acked + unknown
    );
    assert!(refused > 0, "no commit was refused: the probe tested nothing");
    assert_eq!(live.most(), 1, "never two instances of one actor");
    within("shutdown", runtime.shutdown()).await;
    let stored = store
        .load(&id)
        .await
        .unwrap()
        .map(|b| String::from_utf8(b.to_vec()).unwrap());
    assert_eq!(stored, Some(last.to_string()), "the store holds the last count");
}

/// An actor whose state is the list of its records (its snapshot, comma-separated), so
/// every `rec:<x>` turn commits; `gate` waits for the test (and records `gate`); `get`
/// replies the list; `panic` ends its task (a crash).
struct Ledger {
    records: Vec<String>,
    shared: Arc<Shared>,
}

impl Actor for Ledger {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let text = std::str::from_utf8(&payload).map_err(|e| ActorError::failed(e.to_string()))?;
        match text.split_once(':') {
            None if text == "get" => {}
            None if text == "panic" => panic!("the ledger panics on purpose"),
            None if text == "gate" => {
                self.shared.at_gate.notify_one();
                self.shared.gate.notified().await;
                self.records.push("gate".to_string());
            }
            Some(("rec", record)) => self.records.push(record.to_string()),
            _ => return Err(ActorError::rejected(format!("unknown command {text}"))),
        }
        Ok(Bytes::from(self.records.join(",")))
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(self.records.join(","))))
    }
}

/// A runtime on `store` with the ledger kind registered with `config`.
fn start_ledger_with(store: &Arc<MemoryStore>, shared: &Arc<Shared>, config: KindConfig) -> Runtime {
    let shared = Arc::clone(shared);
    Runtime::builder()
        .store(store.clone())
        .register(
            ActorKind::new("ledger").unwrap(),
            move |_id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                let saved = saved
                    .map(|b| String::from_utf8(b.to_vec()).unwrap())
                    .unwrap_or_default();
                Ok(ActorBox::new(Ledger {
                    records: saved.split(',').filter(|r| !r.is_empty()).map(str::to_string).collect(),
                    shared: Arc::clone(&shared),
                }))
            },
            config,
        )
        .unwrap()
        .start()
}

/// Goal: told messages accepted by an activation that turns out stale (another runtime
/// on the same store claimed the actor since) are not lost when its commit is fenced:
/// they never started, so they run first, in order, in this runtime's next activation
/// of the actor, which a new message starts. Method: runtimes `a` and `b` on one memory
/// store; `a` holds the actor in a `gate` turn with two records told behind it; `b`
/// records `b1` (a newer claim); the gate opens, `a`'s commit is fenced; then `a` is
/// asked for the list (again while the stale activation refuses the request with the
/// fence), which a fresh activation answers. Before: 'left: b"b1" right: b"b1,a1,a2"'
/// (the two records refused with the fence, dropped).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn told_messages_queued_behind_a_fenced_commit_are_not_lost() {
    let fenced = tells_behind_a_fenced_commit(HANG).await;
    let list = within("a: get", async {
        loop {
            match fenced
                .a
                .invoke(&fenced.id, Bytes::from_static(b"get"), fenced.deadline)
                .await
            {
                Err(InvokeError::StorageFailed { .. }) => {
                    tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await;
                }
                other => return other,
            }
        }
    })
    .await
    .expect("a fresh activation answers");
    assert_eq!(
        list,
        Bytes::from_static(b"b1,a1,a2"),
        "the records told to the stale activation ran first in the fresh one"
    );
    assert_eq!(fenced.lost(), (0, 0), "(told_lost of a, of b)");
    fenced.shutdown().await;
}

/// Goal: the told messages kept after a fence start no activation by themselves, so the
/// runtime that took the actor over is not fenced back (the ping-pong of 6f09540, where
/// they started one at once); a new message to the stale runtime then runs them first.
/// Method: the scenario above; once `a`'s stale activation has ended and its two records
/// are kept (its stats), 200 ms pass: `a` has no activation and still keeps them, and
/// `b` records `b2`, its commit not fenced; then `a` records `a3`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn told_messages_kept_after_a_fence_start_no_activation_and_fence_nobody_back() {
    let fenced = tells_behind_a_fenced_commit(HANG).await;
    kept_on(&fenced.a, 2).await;
    tokio::time::sleep(Duration::from_millis(QUIET_MS)).await;
    let stats = within("a: stats", fenced.a.stats()).await.unwrap();
    assert_eq!(
        (stats.activations, stats.held_messages),
        (0, 2),
        "a started no activation for its kept records"
    );
    let b2 = fenced.ask(&fenced.b, "b: b2", b"rec:b2").await;
    assert_eq!(b2, Ok(Bytes::from_static(b"b1,b2")), "b still holds the actor");
    let a3 = fenced.ask(&fenced.a, "a: a3", b"rec:a3").await;
    assert_eq!(
        a3,
        Ok(Bytes::from_static(b"b1,b2,a1,a2,a3")),
        "a's next activation ran the kept records first, in order"
    );
    assert_eq!(within("a: stats", fenced.a.stats()).await.unwrap().held_messages, 0);
    assert_eq!(fenced.lost(), (0, 0), "(told_lost of a, of b)");
    fenced.shutdown().await;
}

/// Goal: a told message kept after a fence that no new message comes to run is dropped
/// at its own deadline, counted as expired (not as lost), without waiting for a next
/// activation; one that comes after runs without it. Method: the records are told with
/// a deadline `TOLD_FOR_MS` away; once kept, the test waits (bounded) for `a`'s
/// `expired_dropped` to grow by two and its held messages to fall to zero, with no
/// activation, then asks `a` for the list.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn told_messages_kept_after_a_fence_are_dropped_as_expired_at_their_deadline() {
    const TOLD_FOR_MS: u64 = 1_500;
    let fenced = tells_behind_a_fenced_commit(Duration::from_millis(TOLD_FOR_MS)).await;
    kept_on(&fenced.a, 2).await;
    let expired_before = fenced.a.counters().expired_dropped;
    within("a: the kept records expire", async {
        loop {
            let stats = fenced.a.stats().await.unwrap();
            if stats.held_messages == 0 {
                assert_eq!(stats.activations, 0, "no activation started for them");
                break;
            }
            tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await;
        }
    })
    .await;
    assert_eq!(
        fenced.a.counters().expired_dropped - expired_before,
        2,
        "both kept records dropped as expired"
    );
    let list = fenced.ask(&fenced.a, "a: get", b"get").await;
    assert_eq!(list, Ok(Bytes::from_static(b"b1")), "the expired records did not run");
    assert_eq!(fenced.lost(), (0, 0), "expired, not lost");
    fenced.shutdown().await;
}

/// Goal: what is still lost, and said: told messages kept after a fence when the runtime
/// shuts down before a new message started its next activation of the actor (kept
/// messages start none) are counted in `told_lost` (their senders were answered `Ok` at
/// acceptance, so nothing else says it). The runtime that took the actor over loses
/// nothing. Method: the scenario above; once the records are kept, `a` shuts down.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn told_messages_kept_after_a_fence_at_shutdown_are_counted_as_lost() {
    let fenced = tells_behind_a_fenced_commit(HANG).await;
    kept_on(&fenced.a, 2).await;
    assert_eq!(fenced.lost(), (0, 0), "kept, not lost yet");
    let list = fenced.ask(&fenced.b, "b: get", b"get").await;
    assert_eq!(list, Ok(Bytes::from_static(b"b1")), "the kept records did not run on b");
    let FencedTells { a, b, .. } = fenced;
    let handle_a = (*a).clone();
    within("shutdown a", a.shutdown()).await;
    assert_eq!(
        (handle_a.counters().told_lost, b.counters().told_lost),
        (2, 0),
        "(told_lost of a, of b): a1 and a2, accepted and not run"
    );
    within("shutdown b", b.shutdown()).await;
}

/// How long a probe watches for something that must not happen (an activation started
/// by kept messages), in milliseconds.
const QUIET_MS: u64 = 200;

/// Two runtimes on one store, and the actor `ledger/l` that `b` took over from `a`'s
/// activation, whose commit is then fenced with `a1` and `a2` told behind it.
struct FencedTells {
    a: Runtime,
    b: Runtime,
    id: ActorId,
    /// For the test's own requests.
    deadline: troupe_core::Deadline,
    _shared: (Arc<Shared>, Arc<Shared>),
}

impl FencedTells {
    /// Asks `runtime` (`a` or `b`) `text` of the actor, bounded (`what` names it if it hangs).
    async fn ask(&self, runtime: &Runtime, what: &str, text: &'static [u8]) -> Result<Bytes, InvokeError> {
        within(what, runtime.invoke(&self.id, Bytes::from_static(text), self.deadline)).await
    }

    /// The `told_lost` counters of `a` and `b`.
    fn lost(&self) -> (u64, u64) {
        (self.a.counters().told_lost, self.b.counters().told_lost)
    }

    async fn shutdown(self) {
        within("shutdown a", self.a.shutdown()).await;
        within("shutdown b", self.b.shutdown()).await;
    }
}

/// The scenario of the tests above, up to the gate's opening (the fenced commit follows):
/// runtimes `a` and `b` on one memory store; `a` holds the actor in a `gate` turn with
/// `rec:a1` and `rec:a2` told behind it (with a deadline `told_for` away); `b` records
/// `b1`, a newer claim.
async fn tells_behind_a_fenced_commit(told_for: Duration) -> FencedTells {
    tells_behind_a_fenced_commit_with(told_for, KindConfig::default()).await
}

/// As `tells_behind_a_fenced_commit`, the ledger kind registered with `config` on both.
async fn tells_behind_a_fenced_commit_with(told_for: Duration, config: KindConfig) -> FencedTells {
    let store = Arc::new(MemoryStore::new());
    let (shared_a, shared_b) = (Arc::new(Shared::default()), Arc::new(Shared::default()));
    let a = start_ledger_with(&store, &shared_a, config);
    let b = start_ledger_with(&store, &shared_b, config);
    let id = ActorId::new("ledger", "l").unwrap();
    let deadline = a.deadline_in(HANG);
    within("a: gate", a.tell(&id, Bytes::from_static(b"gate"), deadline))
        .await
        .unwrap();
    within("a: the gate's turn", shared_a.at_gate.notified()).await;
    let told_deadline = a.deadline_in(told_for);
    for record in ["rec:a1", "rec:a2"] {
        within("a: a record", a.tell(&id, Bytes::from(record), told_deadline))
            .await
            .unwrap();
    }
    assert_eq!(a.counters().told_lost, 0, "nothing lost before the fence");
    let newer = within("b: b1", b.invoke(&id, Bytes::from_static(b"rec:b1"), deadline)).await;
    assert_eq!(newer, Ok(Bytes::from_static(b"b1")), "b claims the actor anew");
    shared_a.gate.notify_one();
    FencedTells {
        a,
        b,
        id,
        deadline,
        _shared: (shared_a, shared_b),
    }
}

/// Waits (bounded) until `runtime`'s stale activation has ended and `count` told
/// messages are kept: no activation, `count` held.
async fn kept_on(runtime: &Runtime, count: usize) {
    let until = tokio::time::Instant::now() + HANG;
    let mut seen = (0, 0);
    while tokio::time::Instant::now() < until {
        let stats = within("stats", runtime.stats()).await.unwrap();
        seen = (stats.activations, stats.held_messages);
        if seen == (0, count) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await;
    }
    panic!("the stale activation did not end with its {count} told messages kept within {HANG:?}: (activations, held messages) = {seen:?}");
}

/// Goal (7efdca2's cap): a stale activation keeps at most a mailbox's worth of told
/// messages behind its fenced commit; those run first, in order, in this runtime's next
/// activation, started by a new message (here a request held while the stale activation
/// ends); the rest are refused and counted in `told_lost`, exactly. More than a
/// mailbox's worth sit behind the fence only in a mailbox that opened with more, carried
/// over a crash. Method: capacity `OVER_CAPACITY` (3) on `a`; a `gate` turn holds the actor
/// while `panic`, a second `gate` and `rec:a0` fill its mailbox; `deactivate` closes it
/// and `rec:a1..a3` are held; the first gate opens (its turn commits `gate`), `panic`
/// crashes the activation, and the next one opens with `gate, a0..a3` (four tells
/// behind its gate, one past capacity); `b` records `b1` (a newer claim); `a` is told to
/// deactivate and asked `rec:a4` (held); the second gate opens, its commit is fenced.
/// Then `a4` is answered `gate,b1,a0,a1,a2,a4` and `a`'s `told_lost` is 1 (`a3`).
/// Before 7efdca2: `a4` refused `Busy` (the four kept tells took the mailbox's room).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_a_mailbox_of_told_messages_behind_a_fenced_commit_only_a_mailbox_is_kept() {
    let fenced = over_a_mailbox_behind_a_gate().await;
    let (a, b, id) = (&fenced.a, &fenced.b, &fenced.id);
    open_the_gate_behind_a_held_request(
        (a, b, id),
        &fenced._shared.0.gate,
        "rec:a4",
        (
            b"gate,b1,a0,a1,a2,a4",
            "the kept three ran first, in order, then the request",
        ),
        ((1, 0), "(told_lost of a, of b): a3, past the mailbox's worth"),
    )
    .await;
    assert_eq!(within("a: stats", a.stats()).await.unwrap().held_messages, 0);
    fenced.shutdown().await;
}

/// Goal (7efdca2's room): a request held while a stale activation ends with a full
/// mailbox's worth of told messages kept behind its fenced commit starts the next
/// activation and is answered after them, not refused `Busy`: the kept ones come on top
/// of the mailbox, not in a held request's room. Method: capacity 1; `a` holds the actor
/// in a `gate` turn with `rec:a1` told behind it (the mailbox full); `b` records `b1`;
/// `a` is told to deactivate and asked `rec:a2` (held); the gate opens, `a`'s commit is
/// fenced. Before 7efdca2: `Err(Busy { .. })`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_held_behind_a_mailbox_of_kept_told_messages_is_answered_after_them() {
    let store = Arc::new(MemoryStore::new());
    let (shared_a, shared_b) = (Arc::new(Shared::default()), Arc::new(Shared::default()));
    let config = KindConfig::default().with_mailbox_capacity(1);
    let a = start_ledger_with(&store, &shared_a, config);
    let b = start_ledger_with(&store, &shared_b, config);
    let id = ActorId::new("ledger", "l").unwrap();
    let deadline = a.deadline_in(HANG);
    within("a: gate", a.tell(&id, Bytes::from_static(b"gate"), deadline))
        .await
        .unwrap();
    within("a: the gate's turn", shared_a.at_gate.notified()).await;
    within("a: a1", a.tell(&id, Bytes::from_static(b"rec:a1"), deadline))
        .await
        .unwrap();
    let newer = within("b: b1", b.invoke(&id, Bytes::from_static(b"rec:b1"), deadline)).await;
    assert_eq!(newer, Ok(Bytes::from_static(b"b1")), "b claims the actor anew");
    open_the_gate_behind_a_held_request(
        (&a, &b, &id),
        &shared_a.gate,
        "rec:a2",
        (
            b"b1,a1,a2",
            "the request started the next activation and ran after the kept tell",
        ),
        ((0, 0), "(told_lost of a, of b)"),
    )
    .await;
    within("shutdown a", a.shutdown()).await;
    within("shutdown b", b.shutdown()).await;
}

/// The end both fenced-commit probes share: asks `request` of `a`, held behind its
/// deactivation of `id`; opens `gate` so that the stale turn commits (fenced); then checks
/// the answer (`expected`, for the reason `why`) and the `told_lost` counts of `a` and `b`
/// (`lost`, for the reason `lost_why`). One piece, so the two probes cannot drift apart.
async fn open_the_gate_behind_a_held_request(
    (a, b, id): (&Runtime, &Runtime, &ActorId),
    gate: &tokio::sync::Notify,
    request: &'static str,
    (expected, why): (&'static [u8], &str),
    (lost, lost_why): ((u64, u64), &str),
) {
    let (deactivation, ask) = ask_held_behind_a_deactivation(a, id, request).await;
    gate.notify_one();
    let answer = within(&format!("a: {request}"), ask).await.unwrap();
    assert_eq!(answer, Ok(Bytes::from_static(expected)), "{why}");
    println!(
        "a's stale deactivation: {:?}",
        within("a: the deactivation", deactivation).await
    );
    assert_eq!((a.counters().told_lost, b.counters().told_lost), lost, "{lost_why}");
}

/// Waits (bounded) until the shutdown of `handle`'s runtime has begun: until a new
/// request is refused with it (a request to a kind no one registered: refused
/// `ActorNotFound` before, and it runs nothing).
async fn shutdown_begun(handle: &troupe_runtime::RuntimeHandle) {
    let nobody = ActorId::new("nobody", "n").unwrap();
    within("shutdown begun", async {
        loop {
            match handle.tell(&nobody, Bytes::new(), handle.deadline_in(HANG)).await {
                Err(InvokeError::Shutdown) => return,
                Err(InvokeError::ActorNotFound { .. }) => {
                    tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await;
                }
                other => panic!("a tell to an unregistered kind: {other:?}"),
            }
        }
    })
    .await;
}

/// Tells `runtime` to deactivate `id` (in a task) and waits (bounded) until its mailbox
/// is closed: new messages are held for the next activation.
async fn deactivate_in_background(
    runtime: &Runtime,
    id: &ActorId,
) -> tokio::task::JoinHandle<Result<bool, InvokeError>> {
    let deactivation = tokio::spawn({
        let handle = runtime.handle();
        let id = id.clone();
        async move { handle.deactivate(&id).await }
    });
    within("the mailbox closed", async {
        while runtime.stats().await.unwrap().deactivating == 0 {
            tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await;
        }
    })
    .await;
    deactivation
}

/// Closes `id`'s mailbox on `runtime` (`deactivate_in_background`), then asks `text` in
/// a task and waits (bounded) until the request is held: the deactivation and the ask.
async fn ask_held_behind_a_deactivation(
    runtime: &Runtime,
    id: &ActorId,
    text: &'static str,
) -> (
    tokio::task::JoinHandle<Result<bool, InvokeError>>,
    tokio::task::JoinHandle<Result<Bytes, InvokeError>>,
) {
    let deactivation = deactivate_in_background(runtime, id).await;
    let ask = tokio::spawn({
        let handle = runtime.handle();
        let id = id.clone();
        async move {
            handle
                .invoke(&id, Bytes::from_static(text.as_bytes()), handle.deadline_in(HANG))
                .await
        }
    });
    within("the request held", async {
        while runtime.stats().await.unwrap().held_messages == 0 {
            tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await;
        }
    })
    .await;
    (deactivation, ask)
}

/// The capacity of `over_a_mailbox_behind_a_gate`'s ledger kind.
const OVER_CAPACITY: usize = 3;

/// The setup of `past_a_mailbox_of_told_messages_behind_a_fenced_commit_only_a_mailbox_is_kept`
/// up to its second gate's opening: `a`'s activation (opened with `gate, a0..a3` after a
/// crash) waits in its gate turn with four tells behind it, and `b` has recorded `b1`.
async fn over_a_mailbox_behind_a_gate() -> FencedTells {
    quiet_planned_panics();
    let store = Arc::new(MemoryStore::new());
    let (shared_a, shared_b) = (Arc::new(Shared::default()), Arc::new(Shared::default()));
    let config = KindConfig::default().with_mailbox_capacity(OVER_CAPACITY);
    let a = start_ledger_with(&store, &shared_a, config);
    let b = start_ledger_with(&store, &shared_b, config);
    let id = ActorId::new("ledger", "l").unwrap();
    let deadline = a.deadline_in(HANG);
    let tell = |text: &'static str| a.tell(&id, Bytes::from_static(text.as_bytes()), deadline);
    within("a: gate", tell("gate")).await.unwrap();
    within("a: the first gate's turn", shared_a.at_gate.notified()).await;
    for text in ["panic", "gate", "rec:a0"] {
        within("a: into the mailbox", tell(text))
            .await
            .unwrap_or_else(|error| panic!("{text}: {error:?}"));
    }
    let deactivation = deactivate_in_background(&a, &id).await;
    for text in ["rec:a1", "rec:a2", "rec:a3"] {
        within("a: a held tell", tell(text))
            .await
            .unwrap_or_else(|error| panic!("{text}: held for the next activation, not {error:?}"));
    }
    shared_a.gate.notify_one();
    within("a: the second gate's turn", shared_a.at_gate.notified()).await;
    println!(
        "a's first deactivation: {:?}",
        within("a: the deactivation", deactivation).await
    );
    assert_eq!(a.counters().told_lost, 0, "nothing lost before the fence");
    let newer = within("b: b1", b.invoke(&id, Bytes::from_static(b"rec:b1"), deadline)).await;
    assert_eq!(newer, Ok(Bytes::from_static(b"gate,b1")), "b claims the actor anew");
    FencedTells {
        a,
        b,
        id,
        deadline,
        _shared: (shared_a, shared_b),
    }
}

/// Goal: the cap holds too when the stale activation ends before a new message comes:
/// it keeps a mailbox's worth (no activation), refuses the rest (`told_lost`, exactly),
/// and a later message runs the kept ones first, in order. This path (`Dispatcher::keep`)
/// capped them before 7efdca2 too, so this test passes on either. Method: the setup of
/// the test above; the second gate opens with no message held; once three are kept,
/// `a` records `a4`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_a_mailbox_of_told_messages_kept_with_no_message_waiting_only_a_mailbox_is_kept() {
    let fenced = over_a_mailbox_behind_a_gate().await;
    fenced._shared.0.gate.notify_one();
    kept_on(&fenced.a, OVER_CAPACITY).await;
    assert_eq!(
        fenced.lost(),
        (1, 0),
        "(told_lost of a, of b): a3, past the mailbox's worth"
    );
    let a4 = fenced.ask(&fenced.a, "a: a4", b"rec:a4").await;
    assert_eq!(
        a4,
        Ok(Bytes::from_static(b"gate,b1,a0,a1,a2,a4")),
        "the kept three ran first, in order, then the new message"
    );
    assert_eq!(fenced.lost(), (1, 0), "(told_lost of a, of b)");
    fenced.shutdown().await;
}

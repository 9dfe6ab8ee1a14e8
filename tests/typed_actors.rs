//! Typed actors (`TypedActor`, `ActorRef::ask`/`tell`) and fire-and-forget `tell`:
//! values in process, bincode at the store and for bytes callers, typed refusals.
//! Both builds (paused tokio time, or the simulator); the multi-thread variants run in
//! the normal build.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe::core::{ActorId, ActorKind, CallRefused, Deadline, InvokeError};
use troupe::runtime::{
    Actor, ActorBox, ActorError, ActorRef, ActorRefError, KindConfig, MemoryStore, Runtime, StateStore, Turn,
    TypedActor,
};

const COUNTER: &str = "counter";
const SECONDS_5: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Serialize, Deserialize)]
enum Op {
    Add(u64),
    Get,
    /// Add, then wait this long (a slow turn).
    AddSlowly {
        add: u64,
        ms: u64,
    },
    Fail,
    /// Ask another counter from inside the turn through a captured `ActorRef`.
    AskInside,
}

#[derive(Default, Serialize, Deserialize)]
struct Counter {
    total: u64,
}

/// A reference a turn captured (as a closure or a struct field would): for `AskInside`.
static CAPTURED: Mutex<Option<ActorRef<Counter>>> = Mutex::new(None);

impl TypedActor for Counter {
    type Message = Op;
    type Reply = u64;

    async fn handle(&mut self, _turn: &mut Turn, op: Op) -> Result<u64, ActorError> {
        match op {
            Op::Add(n) => self.total += n,
            Op::Get => {}
            Op::AddSlowly { add, ms } => {
                self.total += add;
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            Op::Fail => {
                self.total += 1_000;
                return Err(ActorError::failed("asked to fail"));
            }
            Op::AskInside => {
                let other = CAPTURED.lock().unwrap().clone().expect("set by the test");
                return other.ask(Op::Get, SECONDS_5).await.map_err(ActorError::from);
            }
        }
        Ok(self.total)
    }
}

/// A plain bytes actor, to check that typed refs refuse it.
struct Echo;

impl Actor for Echo {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        Ok(payload)
    }
}

fn start(store: Arc<MemoryStore>, mailbox: usize) -> Runtime {
    Runtime::builder()
        .store(store)
        .register_typed::<Counter>(
            ActorKind::new(COUNTER).unwrap(),
            KindConfig::default().with_mailbox_capacity(mailbox),
        )
        .unwrap()
        .register(
            ActorKind::new("echo").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Echo)) },
            KindConfig::default(),
        )
        .unwrap()
        .start()
}

fn counter(key: &str) -> ActorId {
    ActorId::new(COUNTER, key).unwrap()
}

/// Goal: a typed ask passes values, the state is committed with bincode and survives a
/// deactivation, and a bytes caller gets bincode in and out of the same actor.
#[tokio::test(start_paused = true)]
async fn typed_ask_commits_state_that_survives_deactivation_and_bytes_callers_get_bincode() {
    let store = Arc::new(MemoryStore::new());
    let rt = start(Arc::clone(&store), 16);
    let a = rt.actor_ref::<Counter>(counter("a")).unwrap();
    assert_eq!(a.ask(Op::Add(2), SECONDS_5).await.unwrap(), 2);
    assert_eq!(a.ask(Op::Add(3), SECONDS_5).await.unwrap(), 5);
    // The committed state is the bincode of the actor.
    let claimed = store.claim(a.id()).await.unwrap();
    let saved: Counter = bincode::deserialize(&claimed.state.unwrap()).unwrap();
    assert_eq!(saved.total, 5);
    drop(rt);

    let rt = start(Arc::clone(&store), 16);
    let a = rt.actor_ref::<Counter>(counter("a")).unwrap();
    assert_eq!(a.ask(Op::Get, SECONDS_5).await.unwrap(), 5, "reloaded from the store");
    assert!(rt.deactivate(a.id()).await.unwrap());
    assert_eq!(
        a.ask(Op::Add(1), SECONDS_5).await.unwrap(),
        6,
        "reloaded after deactivation"
    );

    let reply = rt
        .invoke_within(a.id(), Bytes::from(bincode::serialize(&Op::Add(4)).unwrap()), SECONDS_5)
        .await
        .unwrap();
    assert_eq!(bincode::deserialize::<u64>(&reply).unwrap(), 10);
    let garbage = rt
        .invoke_within(a.id(), Bytes::from_static(&[0xff, 0xff, 0xff, 0xff, 0xff]), SECONDS_5)
        .await
        .unwrap_err();
    assert!(
        matches!(&garbage, InvokeError::Rejected { reason, .. } if reason.contains("not a bincode-encoded")),
        "{garbage:?}"
    );
    assert_eq!(
        a.ask(Op::Get, SECONDS_5).await.unwrap(),
        10,
        "the garbage changed nothing"
    );
    rt.shutdown().await;
}

/// Goal: a failed typed turn rolls back to the last committed state.
#[tokio::test(start_paused = true)]
async fn a_failed_typed_turn_is_rolled_back() {
    let rt = start(Arc::new(MemoryStore::new()), 16);
    let a = rt.actor_ref::<Counter>(counter("a")).unwrap();
    a.ask(Op::Add(7), SECONDS_5).await.unwrap();
    let error = a.ask(Op::Fail, SECONDS_5).await.unwrap_err();
    assert!(
        matches!(&error, InvokeError::ActorFailed { cause, .. } if cause == "asked to fail"),
        "{error:?}"
    );
    assert_eq!(a.ask(Op::Get, SECONDS_5).await.unwrap(), 7);
    rt.shutdown().await;
}

/// Goal: references are checked against what the kind was registered as.
#[tokio::test(start_paused = true)]
async fn actor_ref_refuses_unknown_kinds_and_untyped_kinds() {
    let rt = start(Arc::new(MemoryStore::new()), 16);
    assert_eq!(
        rt.actor_ref::<Counter>(ActorId::new("nobody", "x").unwrap())
            .unwrap_err(),
        ActorRefError::UnknownKind {
            kind: "nobody".to_string()
        }
    );
    let wrong = rt.actor_ref::<Counter>(ActorId::new("echo", "x").unwrap()).unwrap_err();
    assert!(
        matches!(
            wrong,
            ActorRefError::WrongType {
                registered: "untyped",
                ..
            }
        ),
        "{wrong:?}"
    );
    rt.shutdown().await;
}

/// Goal: a typed ask from inside a turn through a captured reference is refused (calls
/// from a turn go through its Caller), and the refusal reaches the caller unchanged.
#[tokio::test(start_paused = true)]
async fn a_typed_ask_from_inside_a_turn_is_refused() {
    let rt = start(Arc::new(MemoryStore::new()), 16);
    let a = rt.actor_ref::<Counter>(counter("a")).unwrap();
    let b = rt.actor_ref::<Counter>(counter("b")).unwrap();
    *CAPTURED.lock().unwrap() = Some(b.clone());
    let error = a.ask(Op::AskInside, SECONDS_5).await.unwrap_err();
    assert_eq!(error, InvokeError::Refused(CallRefused::RootInvokeInsideTurn));
    assert_eq!(b.ask(Op::Get, SECONDS_5).await.unwrap(), 0);
    rt.shutdown().await;
}

/// Goal: tells are accepted at once, run in order before a later ask, and wake an
/// inactive actor.
#[tokio::test(start_paused = true)]
async fn tells_run_in_order_and_activate_an_inactive_actor() {
    let rt = start(Arc::new(MemoryStore::new()), 64);
    let a = rt.actor_ref::<Counter>(counter("a")).unwrap();
    for n in 1..=10 {
        a.tell(Op::Add(n), SECONDS_5).await.unwrap();
    }
    assert_eq!(rt.counters().activations_started, 1, "the first tell activated it");
    assert_eq!(a.ask(Op::Get, SECONDS_5).await.unwrap(), 55);
    // The untyped tell with bincode bytes reaches the same actor.
    rt.tell(
        a.id(),
        Bytes::from(bincode::serialize(&Op::Add(45)).unwrap()),
        rt.deadline_in(SECONDS_5),
    )
    .await
    .unwrap();
    assert_eq!(a.ask(Op::Get, SECONDS_5).await.unwrap(), 100);
    rt.shutdown().await;
}

/// Goal: a tell is refused at once, with the typed error, when the mailbox is full,
/// when its deadline has passed, for an unknown kind and from inside a turn; a tell
/// whose turn runs out of time is rolled back.
#[tokio::test(start_paused = true)]
async fn tell_refusals_are_typed_and_a_late_tell_is_rolled_back() {
    let rt = start(Arc::new(MemoryStore::new()), 2);
    let a = rt.actor_ref::<Counter>(counter("a")).unwrap();
    // A slow turn holds the actor; two more fill its mailbox of 2.
    a.tell(Op::AddSlowly { add: 1, ms: 1_000 }, SECONDS_5).await.unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    a.tell(Op::Add(1), SECONDS_5).await.unwrap();
    a.tell(Op::Add(1), SECONDS_5).await.unwrap();
    let busy = a.tell(Op::Add(1), SECONDS_5).await.unwrap_err();
    assert!(matches!(busy, InvokeError::Busy { capacity: 2, .. }), "{busy:?}");
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(
        a.ask(Op::Get, SECONDS_5).await.unwrap(),
        3,
        "the refused tell never ran"
    );

    let past = rt.deadline_in(Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(1)).await;
    let late = rt.tell(a.id(), Bytes::new(), past).await.unwrap_err();
    assert!(matches!(late, InvokeError::Timeout { .. }), "{late:?}");
    let unknown = rt
        .tell(
            &ActorId::new("nobody", "x").unwrap(),
            Bytes::new(),
            rt.deadline_in(SECONDS_5),
        )
        .await
        .unwrap_err();
    assert!(matches!(unknown, InvokeError::ActorNotFound { .. }), "{unknown:?}");

    // Its turn takes 1 s with 100 ms allowed: timed out by its own timer, rolled back.
    let failed_before = rt.counters().turns_failed;
    a.tell(Op::AddSlowly { add: 100, ms: 1_000 }, Duration::from_millis(100))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(rt.counters().turns_failed, failed_before + 1);
    assert_eq!(
        a.ask(Op::Get, SECONDS_5).await.unwrap(),
        3,
        "the late tell was rolled back"
    );
    rt.shutdown().await;
}

/// Goal: `tell_by` runs a batch under one deadline the caller computed; a deadline that
/// has already passed is accepted and dropped unrun when dequeued (counted as expired)
/// by an active actor, and refused with `Timeout` by the dispatcher for an inactive one;
/// a deadline beyond the cap, through `tell_by` or the untyped `tell`, gives the turn
/// only the cap (300 s) from its start, so a turn that would take 400 s is cut and
/// rolled back.
#[tokio::test(start_paused = true)]
async fn tell_by_shares_a_deadline_drops_an_expired_one_unrun_and_caps_a_far_one() {
    let rt = start(Arc::new(MemoryStore::new()), 64);
    let a = rt.actor_ref::<Counter>(counter("a")).unwrap();
    let deadline = a.deadline_in(SECONDS_5);
    for n in 1..=10 {
        a.tell_by(Op::Add(n), deadline).await.unwrap();
    }
    assert_eq!(a.ask(Op::Get, SECONDS_5).await.unwrap(), 55);

    let past = a.deadline_in(Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(1)).await;
    let dropped_before = rt.counters().expired_dropped;
    a.tell_by(Op::Add(1_000), past)
        .await
        .expect("not refused: the clock is not read at send");
    assert_eq!(
        a.ask(Op::Get, SECONDS_5).await.unwrap(),
        55,
        "the expired tell never ran"
    );
    assert_eq!(rt.counters().expired_dropped, dropped_before + 1);
    // Not active: the dispatcher reads the clock and refuses it at once.
    assert!(rt.deactivate(a.id()).await.unwrap());
    let refused = a.tell_by(Op::Add(1_000), past).await.unwrap_err();
    assert!(matches!(refused, InvokeError::Timeout { .. }), "{refused:?}");
    assert_eq!(a.ask(Op::Get, SECONDS_5).await.unwrap(), 55, "reloaded, nothing added");

    // Both at once, on two actors, so the test stays within the DST sweep's 600 virtual
    // seconds per seed: `a` through `tell_by`, `b` through the untyped `tell`.
    let far = Deadline::from_micros(u64::MAX);
    let slow = Op::AddSlowly { add: 7, ms: 400_000 };
    let b = rt.actor_ref::<Counter>(counter("b")).unwrap();
    let failed_before = rt.counters().turns_failed;
    a.tell_by(slow.clone(), far).await.unwrap();
    rt.tell(b.id(), Bytes::from(bincode::serialize(&slow).unwrap()), far)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(299)).await;
    assert_eq!(rt.counters().turns_failed, failed_before, "still within the cap");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(rt.counters().turns_failed, failed_before + 2, "both cut at the cap");
    assert_eq!(a.ask(Op::Get, SECONDS_5).await.unwrap(), 55, "and rolled back");
    assert_eq!(b.ask(Op::Get, SECONDS_5).await.unwrap(), 0, "and rolled back");
    rt.shutdown().await;
}

/// Makes an actor active (its first state stored), gives it a turn that waits `slow_ms`
/// and changes nothing (so it has nothing to commit), and queues behind it a tell that
/// expires `expiry_ms` from now, long before that turn ends, and a tell in time; checks
/// that the first is dropped unrun and the second runs.
async fn check_a_tell_expiring_behind_a_slow_turn(slow_ms: u64, expiry_ms: u64) {
    let rt = start(Arc::new(MemoryStore::new()), 64);
    let a = rt.actor_ref::<Counter>(counter("a")).unwrap();
    assert_eq!(a.ask(Op::Get, SECONDS_5).await.unwrap(), 0);
    a.tell(Op::AddSlowly { add: 0, ms: slow_ms }, SECONDS_5).await.unwrap();
    tokio::time::sleep(Duration::from_millis(slow_ms / 10)).await;
    let dropped_before = rt.counters().expired_dropped;
    a.tell(Op::Add(10), Duration::from_millis(expiry_ms)).await.unwrap();
    a.tell(Op::Add(100), SECONDS_5).await.unwrap();
    assert_eq!(
        a.ask(Op::Get, SECONDS_5).await.unwrap(),
        100,
        "the expired tell never ran; the next one did"
    );
    assert_eq!(
        rt.counters().expired_dropped,
        dropped_before + 1,
        "it was dropped as expired"
    );
    rt.shutdown().await;
}

/// Goal: a tell whose deadline passes while it waits in the mailbox is dropped unrun
/// when its turn would start, also behind a turn that waited (the activation reads the
/// clock again after any wait), while the tell queued after it, still in time, runs.
#[tokio::test(start_paused = true)]
async fn a_tell_that_expires_in_the_mailbox_is_dropped_unrun_behind_a_slow_turn() {
    check_a_tell_expiring_behind_a_slow_turn(500, 100).await;
}

/// Goal: the same on the multi-thread runtime, in real time.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tell_that_expires_in_the_mailbox_is_dropped_unrun_on_the_multi_thread_runtime() {
    check_a_tell_expiring_behind_a_slow_turn(300, 50).await;
}

/// Adds 1 to `a` by a tell, a tell by a deadline or an ask, in turn by `n`.
async fn add_one_by_turns(a: &ActorRef<Counter>, n: u64) {
    match n % 3 {
        0 => a.tell(Op::Add(1), SECONDS_5).await.unwrap(),
        1 => a.tell_by(Op::Add(1), a.deadline_in(SECONDS_5)).await.unwrap(),
        _ => drop(a.ask(Op::Add(1), SECONDS_5).await.unwrap()),
    }
}

/// Goal: on the multi-thread runtime, concurrent typed asks, tells and `tell_by`s from
/// many tasks all land exactly once (one activation, no lost or doubled update).
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_typed_asks_and_tells_land_exactly_once_on_the_multi_thread_runtime() {
    const TASKS: u64 = 8;
    const EACH: u64 = 500;
    let rt = start(Arc::new(MemoryStore::new()), 4_096);
    let a = rt.actor_ref::<Counter>(counter("a")).unwrap();
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let a = a.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..EACH {
                add_one_by_turns(&a, task + i).await;
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    // Every tell was accepted before its task moved on; an ask behind them sees all.
    assert_eq!(a.ask(Op::Get, SECONDS_5).await.unwrap(), TASKS * EACH);
    assert_eq!(rt.counters().activations_started, 1);
    rt.shutdown().await;
}

/// Deactivations forced while `check_one_ref_across_activations` sends.
const FORCED_DEACTIVATIONS: u64 = 12;

/// One `ActorRef` (not clones: one route cache) shared by several tasks that tell, tell
/// by a deadline and ask, while another task deactivates the actor again and again. The
/// ref keeps its first activation's mailbox without a lock and its later ones under one
/// (`RouteCache` in handle.rs): whichever it tries, every message lands exactly once, in
/// the activation that is open, and the total is exact.
async fn check_one_ref_across_activations() {
    const TASKS: u64 = 4;
    const EACH: u64 = 300;
    let rt = start(Arc::new(MemoryStore::new()), 4_096);
    let a = Arc::new(rt.actor_ref::<Counter>(counter("a")).unwrap());
    assert_eq!(a.ask(Op::Add(0), SECONDS_5).await.unwrap(), 0);
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let a = Arc::clone(&a);
        tasks.push(tokio::spawn(async move {
            for i in 0..EACH {
                add_one_by_turns(&a, task + i).await;
                if i % 16 == 0 {
                    tokio::task::yield_now().await;
                }
            }
        }));
    }
    let mut forced = 0;
    while forced < FORCED_DEACTIVATIONS {
        // Activate it again through the shared ref, then close that activation.
        a.ask(Op::Add(0), SECONDS_5).await.unwrap();
        if rt.deactivate(a.id()).await.unwrap() {
            forced += 1;
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(a.ask(Op::Get, SECONDS_5).await.unwrap(), TASKS * EACH);
    let started = rt.counters().activations_started;
    assert!(
        started > FORCED_DEACTIVATIONS,
        "{started} activations for {FORCED_DEACTIVATIONS} deactivations"
    );
    rt.shutdown().await;
}

/// Goal: see `check_one_ref_across_activations`.
#[tokio::test]
async fn one_ref_shared_by_tasks_delivers_exactly_once_across_activations() {
    check_one_ref_across_activations().await;
}

/// Goal: as above, with the tasks on four worker threads.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_ref_shared_by_tasks_delivers_exactly_once_across_activations_on_the_multi_thread_runtime() {
    check_one_ref_across_activations().await;
}

/// Rounds of `check_waiting_turns_and_callers_that_give_up`.
const WAITING_ROUNDS: u64 = 20;

/// Alternates turns that wait and finish (their handler's future is polled again after
/// each wait, on whichever thread the activation's task then runs) with turns whose
/// caller gives up while they wait (the future is dropped where it lies, unfinished,
/// and its addition rolled back); then the total counts exactly the finished turns.
/// A typed handler's future lives in the activation's reusable slot (handler_slot.rs).
async fn check_waiting_turns_and_callers_that_give_up() {
    let rt = start(Arc::new(MemoryStore::new()), 64);
    let a = rt.actor_ref::<Counter>(counter("waits")).unwrap();
    for round in 1..=WAITING_ROUNDS {
        let finished = a.ask(Op::AddSlowly { add: 1, ms: 2 }, SECONDS_5).await.unwrap();
        assert_eq!(finished, round);
        let given_up = a
            .ask(Op::AddSlowly { add: 1_000, ms: 300 }, Duration::from_millis(20))
            .await;
        assert!(
            matches!(given_up, Err(InvokeError::Timeout { .. })),
            "round {round}: {given_up:?}"
        );
    }
    assert_eq!(a.ask(Op::Get, SECONDS_5).await.unwrap(), WAITING_ROUNDS);
    assert_eq!(rt.counters().turns_abandoned, WAITING_ROUNDS);
    rt.shutdown().await;
}

/// Goal: typed turns that wait resume and commit, and turns cancelled while they wait
/// leave nothing behind, turn after turn in one activation.
#[tokio::test(start_paused = true)]
async fn typed_turns_that_wait_or_are_cancelled_while_waiting_keep_the_state_exact() {
    check_waiting_turns_and_callers_that_give_up().await;
}

/// Goal: the same on the multi-thread runtime, in real time.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_turns_that_wait_or_are_cancelled_keep_the_state_exact_on_the_multi_thread_runtime() {
    check_waiting_turns_and_callers_that_give_up().await;
}

/// Hands each message back with how many it has had: its message and reply types are
/// `M` (small enough to travel inline in an `AnyValue`, or boxed).
#[derive(Serialize, Deserialize)]
struct HandBack<M> {
    seen: u64,
    #[serde(skip)]
    _message: std::marker::PhantomData<M>,
}

impl<M> Default for HandBack<M> {
    fn default() -> Self {
        Self {
            seen: 0,
            _message: std::marker::PhantomData,
        }
    }
}

impl<M> TypedActor for HandBack<M>
where
    M: Serialize + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    type Message = M;
    type Reply = (M, u64);

    async fn handle(&mut self, _turn: &mut Turn, message: M) -> Result<(M, u64), ActorError> {
        self.seen += 1;
        Ok((message, self.seen))
    }
}

/// A small message (inline) and a large one (72 bytes: boxed); the `Arc` shows whether
/// the very value crossed (serializing would make a new one) and whether every copy was
/// dropped.
type Small = Arc<u64>;
type Large = (Arc<u64>, [u64; 8]);

/// Asks and tells `ROUNDS` messages of type `M`, made by `make`; checks that each ask's
/// reply holds the same `Arc`, that every message was handled, and that none is left
/// behind or dropped twice.
async fn check_values_cross_in_process<M>(make: impl Fn(&Arc<u64>, u64) -> M, token_of: impl Fn(&M) -> &Arc<u64>)
where
    M: Serialize + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    const ROUNDS: u64 = 50;
    let rt = Runtime::builder()
        .register_typed::<HandBack<M>>(ActorKind::new("hand").unwrap(), KindConfig::default())
        .unwrap()
        .start();
    let hand = rt.actor_ref::<HandBack<M>>(ActorId::new("hand", "h").unwrap()).unwrap();
    let token = Arc::new(7_u64);
    for round in 0..ROUNDS {
        let (back, seen) = hand.ask(make(&token, round), SECONDS_5).await.unwrap();
        assert!(Arc::ptr_eq(token_of(&back), &token), "round {round}: the very value");
        assert_eq!(seen, 2 * round + 1);
        drop(back);
        hand.tell(make(&token, round), SECONDS_5).await.unwrap();
    }
    let (last, seen) = hand.ask(make(&token, ROUNDS), SECONDS_5).await.unwrap();
    assert_eq!(seen, 2 * ROUNDS + 1, "every message was handled");
    drop(last);
    assert_eq!(Arc::strong_count(&token), 1, "every message and reply was dropped");
    rt.shutdown().await;
}

/// Goal: typed messages and replies, small enough to travel inline or large enough to be
/// boxed, cross in process as the values themselves and are each dropped once.
#[tokio::test(start_paused = true)]
async fn small_and_large_values_cross_in_process_and_each_is_dropped_once() {
    check_values_cross_in_process::<Small>(|token, _| Arc::clone(token), |small| small).await;
    check_values_cross_in_process::<Large>(|token, round| (Arc::clone(token), [round; 8]), |large| &large.0).await;
}

/// Goal: the same on the multi-thread runtime, where the values cross threads.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_and_large_values_cross_in_process_on_the_multi_thread_runtime() {
    check_values_cross_in_process::<Small>(|token, _| Arc::clone(token), |small| small).await;
    check_values_cross_in_process::<Large>(|token, round| (Arc::clone(token), [round; 8]), |large| &large.0).await;
}

/// Issue 11 asks for an example of a typed actor in under 30 lines: the whole program
/// (`examples/typed_actor.rs`, which `scripts/test` runs in CI) stays under 30, and it declares a
/// `TypedActor` and both asks and tells it.
#[test]
fn the_typed_actor_example_is_a_whole_program_in_under_30_lines() {
    let example = include_str!("../examples/typed_actor.rs");
    let lines = example.lines().count();
    assert!(lines < 30, "examples/typed_actor.rs has {lines} lines");
    for used in ["impl TypedActor for", ".tell(", ".ask(", "fn main"] {
        assert!(example.contains(used), "examples/typed_actor.rs no longer uses {used}");
    }
}

//! The caller's wait for a reply (`ReplyWait` in `handle.rs`): its first poll yields
//! without looking at the reply channel or arming a timer; a reply that is not there by
//! the next poll arms the deadline's timer and is still received when it comes; a wait
//! dropped after its first poll abandons the request (it never runs, and
//! `RequestAbandoned` is reported).
//!
//! Runs in both builds (the multi-thread test only in the normal one).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use troupe_core::limits::INVOKE_TIMEOUT_MS_MAX;
use troupe_core::{ActorId, ActorKind, Deadline, InvokeError};
use troupe_runtime::{
    Actor, ActorBox, ActorError, IdempotencyKey, KindConfig, Runtime, RuntimeEvent, RuntimeObserver, Turn, TypedActor,
};

/// Replies with the payload after sleeping the number of milliseconds it spells (none
/// for an empty or non-numeric payload).
struct Sleepy;

impl Actor for Sleepy {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        if let Ok(ms) = std::str::from_utf8(&payload).unwrap_or("").parse::<u64>() {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        Ok(payload)
    }
}

/// A typed actor that sleeps `message` milliseconds and answers it doubled.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct SlowDouble;

impl TypedActor for SlowDouble {
    type Message = u64;
    type Reply = u64;

    async fn handle(&mut self, _turn: &mut Turn, message: u64) -> Result<u64, ActorError> {
        tokio::time::sleep(Duration::from_millis(message)).await;
        Ok(message * 2)
    }
}

#[derive(Default)]
struct Events(Mutex<Vec<RuntimeEvent>>);

impl RuntimeObserver for Events {
    fn on_event(&self, event: &RuntimeEvent) {
        self.0.lock().unwrap().push(event.clone());
    }
}

fn start(events: Arc<Events>) -> Runtime {
    let config = KindConfig::default().with_idle_timeout(Duration::from_secs(3_600));
    Runtime::builder()
        .observer(events)
        .register(
            ActorKind::new("sleepy").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Sleepy)) },
            config,
        )
        .unwrap()
        .register_typed::<SlowDouble>(ActorKind::new("double").unwrap(), config)
        .unwrap()
        .start()
}

fn sleepy(key: &str) -> ActorId {
    ActorId::new("sleepy", key).unwrap()
}

/// A reply that comes long after the first yield (the turn sleeps) wakes the waiting
/// caller at once: the wait ends when the reply arrives, not at the deadline.
#[tokio::test(start_paused = true)]
async fn a_late_reply_wakes_the_caller_before_its_deadline() {
    let runtime = start(Arc::default());
    let target = sleepy("late");
    let started = tokio::time::Instant::now();
    let reply = runtime
        .invoke_within(&target, Bytes::from_static(b"300"), Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(reply, Bytes::from_static(b"300"));
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(1),
        "the reply after 300 ms ends the wait, not the 20 s deadline: waited {waited:?}"
    );
    // Hot (active actor, immediate reply) and then late again on the same activation.
    let hot = runtime
        .invoke_within(&target, Bytes::from_static(b"x"), Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(hot, Bytes::from_static(b"x"));
    let typed = runtime
        .actor_ref::<SlowDouble>(ActorId::new("double", "a").unwrap())
        .unwrap();
    assert_eq!(typed.ask(250, Duration::from_secs(20)).await.unwrap(), 500);
    assert_eq!(typed.ask(0, Duration::from_secs(1)).await.unwrap(), 0);
}

/// A reply that never comes in time ends the wait exactly at the deadline, with the
/// time the caller allowed.
#[tokio::test(start_paused = true)]
async fn a_reply_that_comes_too_late_times_out_at_the_deadline() {
    let runtime = start(Arc::default());
    let target = sleepy("slow");
    // Activate it first, so the next call takes the fast path.
    runtime
        .invoke_within(&target, Bytes::new(), Duration::from_secs(1))
        .await
        .unwrap();
    let started = tokio::time::Instant::now();
    let result = runtime
        .invoke_within(&target, Bytes::from_static(b"10000"), Duration::from_millis(200))
        .await;
    assert!(
        matches!(&result, Err(InvokeError::Timeout { timeout_ms: 200, .. })),
        "{result:?}"
    );
    // The deadline is kept in whole microseconds; the simulator's clock also moves a
    // little with every poll.
    let waited = started.elapsed();
    assert!(
        waited > Duration::from_millis(199) && waited < Duration::from_millis(201),
        "the wait ends at the deadline: waited {waited:?}"
    );
    let typed = runtime
        .actor_ref::<SlowDouble>(ActorId::new("double", "b").unwrap())
        .unwrap();
    let result = typed.ask(10_000, Duration::from_millis(150)).await;
    assert!(
        matches!(&result, Err(InvokeError::Timeout { timeout_ms: 150, .. })),
        "{result:?}"
    );
}

/// A root request made with a deadline further away than [`INVOKE_TIMEOUT_MS_MAX`] (the
/// end of time here) is cut to that much from when it is sent, as `invoke_within` and
/// `tell` cut theirs: its turn, which would run for 400 s, is cancelled at 300 s and its
/// caller gets `Timeout` with the time it was allowed, through each entry point that
/// takes a deadline (`invoke`, `invoke_keyed`, `invoke_routed` without a router,
/// `invoke_root_for_router`). Before, the deadline was kept as given: the turn ran
/// unbounded (here to its end at 400 s, answering `Ok`; a turn that never ends held its
/// actor forever). 400 virtual seconds at most: within the simulator's 600.
#[tokio::test(start_paused = true)]
async fn a_root_deadline_past_the_longest_invoke_timeout_is_cut_to_it() {
    let runtime = start(Arc::default());
    let never = Deadline::from_micros(u64::MAX);
    let long = || Bytes::from_static(b"400000");
    let (a, b, c, d) = (sleepy("far-a"), sleepy("far-b"), sleepy("far-c"), sleepy("far-d"));
    let key = IdempotencyKey::new("far").unwrap();
    let started = tokio::time::Instant::now();
    let timed = |result: Result<Bytes, InvokeError>| {
        let waited = started.elapsed();
        (result, waited)
    };
    let (invoked, keyed, routed, for_router) = tokio::join!(
        async { timed(runtime.invoke(&a, long(), never).await) },
        async { timed(runtime.invoke_keyed(&b, &key, long(), never).await) },
        async { timed(runtime.invoke_routed(&c, long(), never).await) },
        async { timed(runtime.invoke_root_for_router(&d, long(), never).await) },
    );
    let cap = Duration::from_millis(INVOKE_TIMEOUT_MS_MAX);
    for ((result, waited), target) in [(invoked, a), (keyed, b), (routed, c), (for_router, d)] {
        assert_eq!(
            result,
            Err(InvokeError::Timeout {
                target: target.clone(),
                timeout_ms: INVOKE_TIMEOUT_MS_MAX
            }),
            "{target}"
        );
        assert!(
            waited >= cap && waited < cap + Duration::from_millis(1),
            "{target}: the wait ends at the cap, waited {waited:?}"
        );
    }
    // Let the activations see their callers gone.
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        runtime.counters().turns_abandoned,
        4,
        "each turn was cancelled at the cap"
    );
}

/// Polls `future` once, then drops it.
async fn poll_once_and_drop<F: std::future::Future>(future: F) {
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(|cx| {
        assert!(future.as_mut().poll(cx).is_pending(), "the first poll only yields");
        std::task::Poll::Ready(())
    })
    .await;
}

/// A wait dropped after its first poll (which only yields) abandons the request: it is
/// reported, and the request, already in the mailbox, is dropped unrun.
#[tokio::test(start_paused = true)]
async fn a_wait_dropped_after_its_first_poll_abandons_the_request() {
    let events = Arc::new(Events::default());
    let runtime = start(Arc::clone(&events));
    let target = sleepy("dropped");
    runtime
        .invoke_within(&target, Bytes::new(), Duration::from_secs(1))
        .await
        .unwrap();
    let before = runtime.counters();
    poll_once_and_drop(runtime.invoke_within(&target, Bytes::from_static(b"x"), Duration::from_secs(1))).await;
    // Let the actor dequeue it.
    tokio::time::sleep(Duration::from_millis(10)).await;
    let after = runtime.counters();
    assert_eq!(after.expired_dropped, before.expired_dropped + 1, "dropped unrun");
    assert_eq!(after.turns_run, before.turns_run, "no turn ran for it");
    let abandoned = events
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|event| matches!(event, RuntimeEvent::RequestAbandoned { target: t, .. } if *t == target))
        .count();
    assert_eq!(abandoned, 1);
    // The actor still answers.
    let reply = runtime
        .invoke_within(&target, Bytes::from_static(b"y"), Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(reply, Bytes::from_static(b"y"));
}

/// Many callers on two worker threads, each on its own actor and all on one shared
/// actor, mixing immediate and late replies: every reply reaches its own caller.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callers_each_get_their_own_reply() {
    const CALLERS: u64 = 8;
    const CALLS: u64 = 200;
    let runtime = start(Arc::default());
    let handle = runtime.handle();
    let mut tasks = Vec::new();
    for caller in 0..CALLERS {
        let handle = handle.clone();
        tasks.push(tokio::spawn(async move {
            let own = sleepy(&format!("own-{caller}"));
            let shared = sleepy("shared");
            let typed = handle
                .actor_ref::<SlowDouble>(ActorId::new("double", "shared").unwrap())
                .unwrap();
            for call in 0..CALLS {
                // Every 50th call waits a millisecond in the actor: the caller's timer path.
                let payload = if call % 50 == 0 {
                    "1".to_string()
                } else {
                    format!("c{caller}-{call}")
                };
                let target = if call % 2 == 0 { &own } else { &shared };
                let reply = handle
                    .invoke_within(target, Bytes::from(payload.clone()), Duration::from_secs(30))
                    .await
                    .unwrap();
                assert_eq!(reply, Bytes::from(payload));
                let doubled = typed.ask(call % 2, Duration::from_secs(30)).await.unwrap();
                assert_eq!(doubled, (call % 2) * 2);
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

/// Callers on two worker threads keep invoking one actor while it is deactivated over
/// and over: every request is answered (by the activation it was delivered to, or held
/// and answered by the next), none is lost or refused.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_racing_deactivations_lose_nothing() {
    const CALLERS: u64 = 6;
    const CALLS: u64 = 300;
    const DEACTIVATIONS: u64 = 40;
    let runtime = start(Arc::default());
    let handle = runtime.handle();
    let target = sleepy("raced");
    let mut tasks = Vec::new();
    for caller in 0..CALLERS {
        let handle = handle.clone();
        let target = target.clone();
        tasks.push(tokio::spawn(async move {
            for call in 0..CALLS {
                let payload = Bytes::from(format!("c{caller}-{call}"));
                let reply = handle
                    .invoke_within(&target, payload.clone(), Duration::from_secs(30))
                    .await
                    .unwrap();
                assert_eq!(reply, payload);
            }
        }));
    }
    let deactivator = {
        let handle = handle.clone();
        let target = target.clone();
        tokio::spawn(async move {
            let mut ended = 0;
            for _ in 0..DEACTIVATIONS {
                if handle.deactivate(&target).await.unwrap() {
                    ended += 1;
                }
                tokio::task::yield_now().await;
            }
            ended
        })
    };
    for task in tasks {
        task.await.unwrap();
    }
    let ended = deactivator.await.unwrap();
    let counters = runtime.counters();
    assert_eq!(counters.busy_refused, 0);
    assert_eq!(counters.deactivations_finished, ended);
    assert!(ended >= 1, "some deactivation met a live activation");
    assert!(counters.activations_started >= ended, "{counters:?}");
}

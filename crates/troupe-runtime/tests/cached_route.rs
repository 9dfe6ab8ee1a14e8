//! A typed `ActorRef` caches the route to its actor's activation (`RouteCache` in
//! `handle.rs`). The cache must not change what the idle handshake sees: an actor reached
//! through a cached ref is deactivated exactly when it is idle (the cache keeps no
//! mailbox open, and every message through it is counted), is not deactivated while
//! messages keep arriving through it, and a message sent through a cache whose
//! activation has ended reaches the next activation.
//!
//! Runs in both builds (the multi-thread test only in the normal one).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use troupe_core::{ActorId, ActorKind};
use troupe_runtime::{ActorError, KindConfig, Runtime, Turn, TypedActor};

/// Adds what it is told; answers its total. Its total is its saved state, so it
/// survives deactivation.
#[derive(Default, Serialize, Deserialize)]
struct Tally {
    total: u64,
}

#[derive(Serialize, Deserialize)]
enum Op {
    Add(u64),
    Get,
}

impl TypedActor for Tally {
    type Message = Op;
    type Reply = u64;

    async fn handle(&mut self, _turn: &mut Turn, message: Op) -> Result<u64, ActorError> {
        if let Op::Add(n) = message {
            self.total += n;
        }
        Ok(self.total)
    }
}

const IDLE: Duration = Duration::from_millis(100);
const LONG: Duration = Duration::from_secs(30);

fn start(idle: Duration) -> Runtime {
    Runtime::builder()
        .register_typed::<Tally>(
            ActorKind::new("tally").unwrap(),
            KindConfig::default().with_idle_timeout(idle),
        )
        .unwrap()
        .start()
}

fn tally(key: &str) -> ActorId {
    ActorId::new("tally", key).unwrap()
}

/// After messages through a cached ref, the actor is deactivated once idle (between one
/// and two idle timeouts), while the ref still exists; a message through that ref then
/// activates it again, with its state.
#[tokio::test(start_paused = true)]
async fn an_actor_reached_through_a_cached_ref_is_deactivated_when_idle_and_reactivated_by_it() {
    let runtime = start(IDLE);
    let actor = runtime.actor_ref::<Tally>(tally("a")).unwrap();
    for _ in 0..5 {
        actor.tell(Op::Add(1), LONG).await.unwrap();
    }
    assert_eq!(actor.ask(Op::Get, LONG).await.unwrap(), 5);
    assert_eq!(runtime.counters().activations_started, 1);
    tokio::time::sleep(IDLE * 3).await;
    let counters = runtime.counters();
    assert_eq!(
        counters.deactivations_finished, 1,
        "idle with a cached ref: deactivated"
    );
    assert_eq!(runtime.stats().await.unwrap().activations, 0);
    // Through the stale cache: routed to a new activation, not lost.
    actor.tell(Op::Add(10), LONG).await.unwrap();
    assert_eq!(actor.ask(Op::Get, LONG).await.unwrap(), 15);
    assert_eq!(runtime.counters().activations_started, 2);
}

/// Messages through a cached ref more often than the idle timeout keep the actor
/// active: each is counted as delivered, so no idle check is granted.
#[tokio::test(start_paused = true)]
async fn messages_through_a_cached_ref_keep_the_actor_active() {
    let runtime = start(IDLE);
    let actor = runtime.actor_ref::<Tally>(tally("b")).unwrap();
    for _ in 0..20 {
        actor.tell(Op::Add(1), LONG).await.unwrap();
        tokio::time::sleep(IDLE / 2).await;
    }
    assert_eq!(actor.ask(Op::Get, LONG).await.unwrap(), 20);
    let counters = runtime.counters();
    assert_eq!(counters.activations_started, 1);
    assert_eq!(counters.deactivations_finished, 0);
}

/// A message through a cache whose activation was deactivated on demand (while the
/// ref holds the route) reaches the next activation.
#[tokio::test(start_paused = true)]
async fn a_message_through_a_stale_cache_reaches_the_next_activation() {
    let runtime = start(Duration::from_secs(3_600));
    let actor = runtime.actor_ref::<Tally>(tally("c")).unwrap();
    let clone = actor.clone();
    for round in 1..=5u64 {
        actor.tell(Op::Add(1), LONG).await.unwrap();
        assert_eq!(clone.ask(Op::Get, LONG).await.unwrap(), round);
        assert!(runtime.deactivate(&tally("c")).await.unwrap());
    }
    assert_eq!(actor.ask(Op::Get, LONG).await.unwrap(), 5);
    let counters = runtime.counters();
    assert_eq!(counters.activations_started, 6);
    assert_eq!(counters.deactivations_finished, 5);
}

/// Many callers on two worker threads share refs (one ref used by all, and a clone
/// each) to one actor while it is deactivated over and over and deactivates itself
/// when idle: every accepted message is counted exactly once in the end.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_through_cached_refs_racing_deactivations_lose_nothing() {
    const CALLERS: u64 = 6;
    const CALLS: u64 = 300;
    const DEACTIVATIONS: u64 = 60;
    // The shortest idle timeout, so idle checks race the callers too.
    let runtime = start(Duration::from_millis(1));
    let handle = runtime.handle();
    let shared = std::sync::Arc::new(handle.actor_ref::<Tally>(tally("raced")).unwrap());
    let mut tasks = Vec::new();
    for caller in 0..CALLERS {
        let shared = std::sync::Arc::clone(&shared);
        let own = (*shared).clone();
        tasks.push(tokio::spawn(async move {
            let mut added = 0;
            for call in 0..CALLS {
                let actor = if (call + caller) % 2 == 0 { &*shared } else { &own };
                actor.tell(Op::Add(1), LONG).await.unwrap();
                added += 1;
                // The ask also bounds what is in flight (the mailbox is FIFO), so no
                // tell meets a full mailbox.
                let total = actor.ask(Op::Get, LONG).await.unwrap();
                assert!(total >= 1);
                if call % 25 == 0 {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            added
        }));
    }
    let deactivator = {
        let handle = handle.clone();
        tokio::spawn(async move {
            for _ in 0..DEACTIVATIONS {
                handle.deactivate(&tally("raced")).await.unwrap();
                tokio::task::yield_now().await;
            }
        })
    };
    let mut added = 0;
    for task in tasks {
        added += task.await.unwrap();
    }
    deactivator.await.unwrap();
    assert_eq!(
        shared.ask(Op::Get, LONG).await.unwrap(),
        added,
        "every accepted message counted once"
    );
    let counters = runtime.counters();
    assert_eq!(counters.busy_refused, 0);
    assert!(counters.deactivations_finished >= 1, "{counters:?}");
}

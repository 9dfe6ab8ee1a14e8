//! Heap allocations per untyped invoke of an active actor in steady state (issue 11):
//! `INVOKE_ALLOCATIONS_MAX`, none; and per first invoke of a new actor,
//! `COLD_INVOKE_ALLOCATIONS_MAX`, none of them for the caller's wait. The reply cell comes from the thread's pool
//! (`reply_cell.rs`), `Actor::handle`'s future runs in the activation's reusable slot
//! (`handler_slot.rs`), a turn that writes nothing makes no write buffer (`Turn`), and
//! the caller's wait and the activation's wait for its next message allocate nothing;
//! an allocation added to any of them fails this.
//!
//! Counted per thread by a counting global allocator, on a current_thread runtime whose
//! caller, dispatcher and actor all run on the test's thread. Normal build only: the
//! simulator's runtime allocates differently.
#![cfg(not(madsim))]

mod counting_alloc;

use std::time::Duration;

use bytes::Bytes;
use counting_alloc::allocations;
use troupe_core::{ActorId, ActorKind};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, Runtime, Turn};

/// Allocations per invoke of an active actor in steady state (allocations).
const INVOKE_ALLOCATIONS_MAX: u64 = 0;
/// Measured invokes, after as many for warm-up.
const INVOKES: u64 = 200;

struct Echo;

impl Actor for Echo {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        Ok(payload)
    }
}

/// A runtime with the kind `echo`, whose actors stay active for the whole test.
fn echo_runtime() -> Runtime {
    Runtime::builder()
        .register(
            ActorKind::new("echo").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Echo)) },
            KindConfig::default().with_idle_timeout(Duration::from_secs(3_600)),
        )
        .unwrap()
        .start()
}

#[tokio::test]
async fn an_invoke_of_an_active_actor_allocates_at_most_its_budget_in_steady_state() {
    let runtime = echo_runtime();
    let target = ActorId::new("echo", "0").unwrap();
    let timeout = Duration::from_secs(5);
    let payload = Bytes::from_static(b"x");
    for _ in 0..INVOKES {
        runtime.invoke_within(&target, payload.clone(), timeout).await.unwrap();
    }
    let before = allocations();
    for _ in 0..INVOKES {
        assert_eq!(
            runtime.invoke_within(&target, payload.clone(), timeout).await.unwrap(),
            payload
        );
    }
    let invokes = allocations() - before;
    let budget = INVOKES * INVOKE_ALLOCATIONS_MAX;
    assert!(
        invokes <= budget,
        "{invokes} allocations for {INVOKES} invokes: more than {INVOKE_ALLOCATIONS_MAX} each"
    );
    eprintln!("{invokes} allocations for {INVOKES} invokes");
    runtime.shutdown().await;
}

/// Allocations per first invoke of an actor that was not active, made from outside any
/// turn (allocations): what starting an activation takes (its task, mailbox and its
/// queue, actor, handler block, `on_activate`'s future, the turn's home, the store's
/// claim, the envelope's trip through the dispatcher), and nothing for the caller's wait.
/// The caller yields twice before it arms a timer (`REPLY_WAIT_YIELDS_BEFORE_TIMER`), and
/// on a current_thread runtime the first reply of a new activation is there by then; with
/// one yield the wait boxes its timer, and this counted 13 per invoke (2,603 for 200 on
/// 2026-11-29, against 2,403 with two). Since 2026-12-03 nine: no queue of boxes to open
/// the mailbox with, no box for the task's arguments or for its start (1,803 for 200).
/// Since the same day's second session eight: the mailbox's queue is the block the first
/// message came to the dispatcher in (1,603 for 200). Since 2026-12-04 (night) nine: the
/// start is boxed again, so that the task's state stays at 528 bytes rather than 624, a
/// step of tokio's 128-byte task cell per idle actor (docs/architecture.md, "Twenty-ninth
/// pass"; 1,947 for 200). Since 2026-12-04 (late) the store's claim is done at once by a
/// store that can (`StateStore::claim_now`), without its boxed future: 1,747 for 200,
/// of which the tables' growth is the part over eight each.
const COLD_INVOKE_ALLOCATIONS_MAX: u64 = 9;
/// Allocations the measured first invokes may add in all as the runtime's and the
/// store's tables grow (allocations): each shard of the three tables of one entry per
/// actor (activation table, route map, memory store; 64 shards each since 2026-12-03,
/// `IdMap`) doubles about once over them, as each whole table did before (the budget was
/// then 16). Measured: 147 (1,747 in all for 200).
const COLD_TABLE_GROWTH_ALLOCATIONS_MAX: u64 = 3 * 64;
/// Measured first invokes, of as many new actors.
const COLD_INVOKES: u64 = 200;

#[tokio::test]
async fn a_first_invoke_of_a_new_actor_allocates_nothing_for_the_callers_wait() {
    let runtime = echo_runtime();
    let timeout = Duration::from_secs(5);
    let payload = Bytes::from_static(b"x");
    let ids = |from: u64| -> Vec<ActorId> {
        (from..from + COLD_INVOKES)
            .map(|key| ActorId::new("echo", key.to_string()).unwrap())
            .collect()
    };
    let handle = runtime.handle();
    // In a spawned task, as a server's request handler calls: the test's own future
    // (`block_on`'s) is polled again only after every other task that is ready has run,
    // which would hide the round the wait has to give the new activation.
    let invokes = tokio::spawn(async move {
        // Warm-up: the thread's pools and the tables' first growth.
        for id in ids(0) {
            handle.invoke_within(&id, payload.clone(), timeout).await.unwrap();
        }
        let measured = ids(COLD_INVOKES);
        let before = allocations();
        for id in &measured {
            assert_eq!(
                handle.invoke_within(id, payload.clone(), timeout).await.unwrap(),
                payload
            );
        }
        allocations() - before
    })
    .await
    .unwrap();
    eprintln!("{invokes} allocations for {COLD_INVOKES} first invokes");
    let budget = COLD_INVOKES * COLD_INVOKE_ALLOCATIONS_MAX + COLD_TABLE_GROWTH_ALLOCATIONS_MAX;
    assert!(
        invokes <= budget,
        "{invokes} allocations for {COLD_INVOKES} first invokes: more than {COLD_INVOKE_ALLOCATIONS_MAX} each \
         and {COLD_TABLE_GROWTH_ALLOCATIONS_MAX} for the tables' growth"
    );
    runtime.shutdown().await;
}

/// Allocations per round trip of a relay whose turn calls an active echo actor, beyond
/// the relay's own invoke (allocations), as counted on 2026-12-04 (valgrind's dhat): the
/// turn's caller handle (`Turn::caller`, made at the turn's first call); the child
/// context's chain (admission) and its box in the envelope; and the race of a turn that
/// had to wait, boxed when its first poll is pending. None for the call's wait-for edge
/// (added and removed under the graph's lock, in tables that keep their room), for the
/// turn's own context (a caller handle takes it by value, not from the box
/// `Turn::context` makes of a root context when it is read), for the turn's future (the
/// relay's is under the 1,024 bytes its slot keeps, `Actor::TURN_FUTURE_KEPT_BYTES_MAX`)
/// or for the caller's wait: the message goes straight into the echo's open mailbox and
/// the reply is there when the relay's wait looks again, so the wait arms no timer.
/// Until 2026-12-04 such a call went through the dispatcher for its edge (a boxed
/// command), its reply came a scheduling round too late for the wait's yields (a boxed
/// wait with its timer), the caller handle was made from the boxed context, and
/// `Turn::invoke`'s future was 1,072 bytes (880 now), which put the relay's over the
/// slot's 1,024 (a block per turn): 9 allocations a round trip (1,800 for 200), against
/// 4 now.
const NESTED_CALL_ALLOCATIONS_MAX: u64 = 4;

/// Calls `echo/0` from its turn with the message it got; answers with the reply.
struct Relay {
    echo: ActorId,
}

impl Actor for Relay {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        Ok(turn.invoke(&self.echo, payload, Duration::from_secs(5)).await?)
    }
}

#[tokio::test]
async fn a_call_from_a_turn_to_an_active_actor_allocates_nothing_for_its_edge_or_its_wait() {
    let runtime = Runtime::builder()
        .register(
            ActorKind::new("echo").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Echo)) },
            KindConfig::default().with_idle_timeout(Duration::from_secs(3_600)),
        )
        .unwrap()
        .register(
            ActorKind::new("relay").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Ok(ActorBox::new(Relay {
                    echo: ActorId::new("echo", "0").unwrap(),
                }))
            },
            KindConfig::default().with_idle_timeout(Duration::from_secs(3_600)),
        )
        .unwrap()
        .start();
    let relay = ActorId::new("relay", "0").unwrap();
    let timeout = Duration::from_secs(5);
    let payload = Bytes::from_static(b"x");
    let handle = runtime.handle();
    // In a spawned task, as in the cold test above: the test's own future would be
    // polled only after every other ready task, which hides the rounds a wait yields.
    let round_trips = tokio::spawn(async move {
        for _ in 0..INVOKES {
            handle.invoke_within(&relay, payload.clone(), timeout).await.unwrap();
        }
        let before = allocations();
        for _ in 0..INVOKES {
            assert_eq!(
                handle.invoke_within(&relay, payload.clone(), timeout).await.unwrap(),
                payload
            );
        }
        allocations() - before
    })
    .await
    .unwrap();
    eprintln!("{round_trips} allocations for {INVOKES} relayed invokes");
    let budget = INVOKES * (INVOKE_ALLOCATIONS_MAX + NESTED_CALL_ALLOCATIONS_MAX);
    assert!(
        round_trips <= budget,
        "{round_trips} allocations for {INVOKES} relayed invokes: more than {} each",
        INVOKE_ALLOCATIONS_MAX + NESTED_CALL_ALLOCATIONS_MAX
    );
    assert_eq!(
        runtime.stats().await.unwrap().wait_for_edges,
        0,
        "every edge was removed"
    );
    runtime.shutdown().await;
}

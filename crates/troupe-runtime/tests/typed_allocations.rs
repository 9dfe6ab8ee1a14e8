//! Heap allocations per typed message in steady state (issue 11): a typed `tell` makes
//! `TELL_ALLOCATIONS_MAX` (none), a typed `ask` `ASK_ALLOCATIONS_MAX` (none: its reply
//! channel's cell comes from the thread's pool, `reply_cell.rs`). The envelope travels in the mailbox's queue itself (`mailbox.rs`), the
//! handler's future runs in the activation's reusable slot (`handler_slot.rs`), and a
//! small message and its reply travel inline in their `AnyValue`: boxing the envelope
//! again (as until 2026-11-29), boxing the handler's future again (as `async_trait` did
//! until 2026-11-28), boxing either value, boxing a tell's unread reply, or a reply
//! channel allocated per request (tokio's `oneshot`, as until 2026-11-29) fails it. An actor with state
//! that a turn leaves unchanged allocates no more: its encoding is compared with the
//! committed one, not made anew (`Actor::state_change`); nor does one whose turn's future
//! is over the default kept size and which raises `TypedActor::TURN_FUTURE_KEPT_BYTES_MAX`.
//!
//! Counted per thread by a counting global allocator, on a current_thread runtime whose
//! caller, dispatcher and actor all run on the test's thread. Normal build only: the
//! simulator's runtime allocates differently.
#![cfg(not(madsim))]

mod counting_alloc;

use std::time::Duration;

use counting_alloc::allocations;
use serde::{Deserialize, Serialize};
use troupe_core::{ActorId, ActorKind};
use troupe_runtime::{ActorError, KindConfig, Runtime, Turn, TypedActor};

/// Allocations per typed `tell` in steady state (allocations).
const TELL_ALLOCATIONS_MAX: u64 = 0;
/// Allocations per typed `ask` in steady state (allocations).
const ASK_ALLOCATIONS_MAX: u64 = 0;
/// Tells per batch: below the default mailbox capacity, as in `benches/runtime.rs`.
const BATCH: u64 = 32;
/// Measured batches (each `BATCH` tells and one ask), after as many for warm-up.
const BATCHES: u64 = 50;

#[derive(Default, Serialize, Deserialize)]
struct Echo;

impl TypedActor for Echo {
    type Message = u64;
    type Reply = u64;

    async fn handle(&mut self, _turn: &mut Turn, message: u64) -> Result<u64, ActorError> {
        Ok(message)
    }
}

/// An actor with state (16 bytes encoded) that its turns read and leave unchanged.
#[derive(Default, Serialize, Deserialize)]
struct StatefulEcho {
    offset: u64,
    name: String,
}

impl TypedActor for StatefulEcho {
    type Message = u64;
    type Reply = u64;

    async fn handle(&mut self, _turn: &mut Turn, message: u64) -> Result<u64, ActorError> {
        Ok(message + self.offset + self.name.len() as u64)
    }
}

/// Bytes a [`LargeTurn`] turn holds across its `.await`: more than the default kept
/// size of a turn's future (`HANDLER_SLOT_KEPT_BYTES_MAX`, 1,024 B).
const LARGE_TURN_BYTES: usize = 2 * troupe_runtime::HANDLER_SLOT_KEPT_BYTES_MAX;

/// An actor whose turn's future is over 2 KiB (a buffer held across an `.await`), which
/// raises the size of the future its activation keeps.
#[derive(Default, Serialize, Deserialize)]
struct LargeTurn;

impl TypedActor for LargeTurn {
    type Message = u64;
    type Reply = u64;
    const TURN_FUTURE_KEPT_BYTES_MAX: usize = 2 * LARGE_TURN_BYTES;

    async fn handle(&mut self, _turn: &mut Turn, message: u64) -> Result<u64, ActorError> {
        let buffer = [1_u8; LARGE_TURN_BYTES];
        std::future::ready(()).await; // held across an `.await`: part of the future
        Ok(message + u64::from(buffer[message as usize % LARGE_TURN_BYTES]) - 1)
    }
}

#[tokio::test]
async fn typed_tells_and_asks_allocate_at_most_their_budget_in_steady_state() {
    check_allocations::<Echo>().await;
}

/// Goal: a typed actor that raises `TypedActor::TURN_FUTURE_KEPT_BYTES_MAX` above its
/// turn's future (over 2 KiB) allocates no more per message either: its activation keeps
/// the future's block (with the default, 1,024 B, each message allocated it anew).
#[tokio::test]
async fn a_typed_actor_that_keeps_its_large_turn_future_allocates_no_more_per_message() {
    check_allocations::<LargeTurn>().await;
}

/// Goal: a turn that leaves a non-empty state unchanged allocates nothing for it (before
/// `Actor::state_change`, its snapshot was encoded into a new buffer at every turn).
#[tokio::test]
async fn a_typed_actor_whose_state_is_unchanged_allocates_no_more_per_message() {
    check_allocations::<StatefulEcho>().await;
}

// The budgets are zero today, which makes `<=` an equality to clippy; they are compared
// as budgets so that one can be raised with a reason.
#[allow(clippy::absurd_extreme_comparisons)]
async fn check_allocations<A: TypedActor<Message = u64, Reply = u64>>() {
    let runtime = Runtime::builder()
        .register_typed::<A>(
            ActorKind::new("echo").unwrap(),
            KindConfig::default().with_idle_timeout(Duration::from_secs(3_600)),
        )
        .unwrap()
        .start();
    let echo = runtime.actor_ref::<A>(ActorId::new("echo", "0").unwrap()).unwrap();
    let timeout = Duration::from_secs(5);
    let batch = || async {
        for i in 0..BATCH {
            echo.tell(i, timeout).await.unwrap();
        }
        assert_eq!(echo.ask(7, timeout).await.unwrap(), 7);
    };
    for _ in 0..BATCHES {
        batch().await;
    }

    let before = allocations();
    for _ in 0..BATCHES {
        batch().await;
    }
    let batches = allocations() - before;

    let before = allocations();
    for i in 0..BATCHES {
        assert_eq!(echo.ask(i, timeout).await.unwrap(), i);
    }
    let asks = allocations() - before;

    assert!(
        asks <= BATCHES * ASK_ALLOCATIONS_MAX,
        "{asks} allocations for {BATCHES} typed asks: more than {ASK_ALLOCATIONS_MAX} each"
    );
    eprintln!(
        "{asks} allocations for {BATCHES} typed asks; {batches} for {BATCHES} batches of {BATCH} tells and one ask"
    );
    let budget = BATCHES * (BATCH * TELL_ALLOCATIONS_MAX + ASK_ALLOCATIONS_MAX);
    assert!(
        batches <= budget,
        "{batches} allocations for {BATCHES} batches of {BATCH} typed tells and one ask: \
         more than {TELL_ALLOCATIONS_MAX} per tell and {ASK_ALLOCATIONS_MAX} per ask"
    );
    runtime.shutdown().await;
}

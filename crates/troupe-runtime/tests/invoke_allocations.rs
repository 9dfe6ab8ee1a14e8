//! Heap allocations per untyped invoke of an active actor in steady state (issue 11):
//! `INVOKE_ALLOCATIONS_MAX`, none. The reply cell comes from the thread's pool
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

#[tokio::test]
async fn an_invoke_of_an_active_actor_allocates_at_most_its_budget_in_steady_state() {
    let runtime = Runtime::builder()
        .register(
            ActorKind::new("echo").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Echo)) },
            KindConfig::default().with_idle_timeout(Duration::from_secs(3_600)),
        )
        .unwrap()
        .start();
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

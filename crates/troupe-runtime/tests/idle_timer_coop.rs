//! The idle timer must still fire after the activation's first poll of it was refused
//! by tokio's cooperative budget: a burst of messages larger than the budget, waiting
//! in the mailbox when the activation first reaches its loop, empties the budget on the
//! mailbox receive, and then the timer's poll returns `Pending` without registering
//! the task's waker. An activation that then stopped polling the timer until it had
//! elapsed would never be deactivated (the timer, never registered, never elapses).
//!
//! Normal build only: the simulator has no cooperative budget.
#![cfg(not(madsim))]

use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, ActorKind};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, Runtime};

/// How long `on_activate` takes (ms): long enough for the whole burst to be queued.
const ACTIVATE_DELAY_MS: u64 = 20;
/// Idle timeout of the actor (ms).
const IDLE_TIMEOUT_MS: u64 = 50;
/// Messages in the burst: more than tokio's cooperative budget of 128 per task poll.
const BURST: usize = 400;
/// Mailbox capacity (messages): room for the whole burst.
const MAILBOX: usize = 1_024;
/// How long the test waits for the deactivation at most (ms).
const DEACTIVATION_WAIT_MS: u64 = 5_000;

struct SlowStart;

impl Actor for SlowStart {
    async fn on_activate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        tokio::time::sleep(Duration::from_millis(ACTIVATE_DELAY_MS)).await;
        Ok(())
    }

    async fn handle(&mut self, _turn: &mut troupe_runtime::Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        Ok(payload)
    }
}

async fn burst_then_idle() {
    let runtime = Runtime::builder()
        .register(
            ActorKind::new("slow").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(SlowStart)) },
            KindConfig::default()
                .with_idle_timeout(Duration::from_millis(IDLE_TIMEOUT_MS))
                .with_mailbox_capacity(MAILBOX),
        )
        .unwrap()
        .start();
    let handle = runtime.handle();
    let target = ActorId::new("slow", "0").unwrap();
    for _ in 0..BURST {
        handle
            .tell(
                &target,
                Bytes::from_static(b"x"),
                handle.deadline_in(Duration::from_secs(5)),
            )
            .await
            .unwrap();
    }
    // Every message has run once this answers (one mailbox, in order).
    handle
        .invoke_within(&target, Bytes::from_static(b"x"), Duration::from_secs(5))
        .await
        .unwrap();
    let last = tokio::time::Instant::now();
    while runtime.counters().deactivations_finished == 0 {
        assert!(
            last.elapsed() < Duration::from_millis(DEACTIVATION_WAIT_MS),
            "an actor idle for {:?} (idle timeout {IDLE_TIMEOUT_MS} ms) is still active: {:?}",
            last.elapsed(),
            runtime.counters()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(runtime.counters().activations_started, 1);
    runtime.shutdown().await;
}

#[tokio::test]
async fn an_actor_whose_first_timer_poll_ran_out_of_budget_is_still_deactivated() {
    burst_then_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_whose_first_timer_poll_ran_out_of_budget_is_still_deactivated_multi_thread() {
    burst_then_idle().await;
}

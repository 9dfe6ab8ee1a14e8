//! A caller whose callee's activation ends without replying (a panic in the turn) gets
//! `ActorFailed`, whether the reply channel closed before the caller looked at it again
//! (`ReplyWait` takes what is there with `try_recv`, without polling) or while the caller
//! was registered on it (the poll path). The actor is activated afresh afterwards.
//!
//! Normal build only: a panicking task is the tokio runtime's business, not the
//! simulator's.
#![cfg(not(madsim))]

use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, Runtime, Turn};

/// How many times an echo is sent before the test gives up on the actor coming back
/// (attempts).
const ECHO_ATTEMPTS_MAX: u32 = 100;

/// Panics in its first poll on `now`, after a sleep on `later`; echoes anything else.
struct Crashy;

impl Actor for Crashy {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        match &payload[..] {
            b"now" => panic!("crashy panics in its first poll"),
            b"later" => {
                tokio::time::sleep(Duration::from_millis(5)).await;
                panic!("crashy panics after waiting");
            }
            _ => Ok(payload),
        }
    }
}

fn start() -> Runtime {
    Runtime::builder()
        .register(
            ActorKind::new("crashy").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Crashy)) },
            KindConfig::default().with_idle_timeout(Duration::from_secs(3_600)),
        )
        .unwrap()
        .start()
}

async fn closed_channels_fail_the_call_and_the_actor_comes_back() {
    let runtime = start();
    let target = ActorId::new("crashy", "0").unwrap();
    let timeout = Duration::from_secs(5);
    for round in 0..3 {
        for payload in ["now", "later"] {
            // Activate it first, so the call below takes the fast path into an open mailbox.
            // On worker threads a message may still reach the crashed activation's mailbox
            // before the dispatcher has handled the crash; it fails as a queued request
            // does, so it is sent again (at most ECHO_ATTEMPTS_MAX times).
            let mut attempts = 0;
            loop {
                attempts += 1;
                match runtime.invoke_within(&target, Bytes::from_static(b"hi"), timeout).await {
                    Ok(echoed) => break assert_eq!(echoed, Bytes::from_static(b"hi")),
                    Err(InvokeError::ActorFailed { .. }) if attempts < ECHO_ATTEMPTS_MAX => {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    Err(other) => panic!("round {round}: the echo failed with {other:?}"),
                }
            }
            let failed = runtime
                .invoke_within(&target, Bytes::from(payload), timeout)
                .await
                .unwrap_err();
            match failed {
                InvokeError::ActorFailed { target: failed, cause } => {
                    assert_eq!(failed, target);
                    assert!(cause.contains("ended before it replied"), "{payload}: {cause}");
                }
                other => panic!("{payload}: expected ActorFailed, got {other:?}"),
            }
        }
    }
    assert_eq!(runtime.counters().turns_abandoned, 0);
    runtime.shutdown().await;
}

#[tokio::test]
async fn a_callee_that_panics_fails_its_caller_current_thread() {
    closed_channels_fail_the_call_and_the_actor_comes_back().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callee_that_panics_fails_its_caller_multi_thread() {
    closed_channels_fail_the_call_and_the_actor_comes_back().await;
}

//! Every wait-for edge a turn's call adds is released, however the call ends: a reply,
//! an error the callee answers, a timeout of the caller, a cycle refused by the chain,
//! a deadlock refused at the call. A caller that got its reply removes nothing itself
//! (whoever answered removed the edge first, `ReplyWait::finish` in handle.rs), so a leak
//! would show here as an edge left in the runtime's graph (`RuntimeStats::wait_for_edges`).
//!
//! Runs in both builds, and on tokio's multi-thread runtime outside the simulator.

use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, Runtime, Turn};

/// Rounds of every kind of call, so that a leak of one edge a call adds up.
const ROUNDS: usize = 20;
/// A request's timeout.
const LONG: Duration = Duration::from_secs(10);
/// The timeout of a call that must time out.
const SHORT: Duration = Duration::from_millis(50);

fn node(key: &str) -> ActorId {
    ActorId::new("node", key).expect("an actor id")
}

/// `call:<key>:<rest>` calls `<key>` with `<rest>` (timeout [`LONG`]), `short:<key>:<rest>`
/// the same with [`SHORT`]; `later:<ms>:<rest>` sleeps, then does `<rest>`; `fail`
/// fails; `sleep:<ms>` sleeps and answers; anything else answers `leaf`.
struct Node;

impl Actor for Node {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let mut text = String::from_utf8(payload.to_vec()).expect("text");
        loop {
            let (mode, rest) = text.split_once(':').unwrap_or((text.as_str(), ""));
            return match mode {
                "call" | "short" => {
                    let (key, rest) = rest.split_once(':').unwrap_or((rest, ""));
                    let timeout = if mode == "call" { LONG } else { SHORT };
                    turn.caller()
                        .call(&node(key), Bytes::from(rest.to_string()), timeout)
                        .await
                        .map_err(ActorError::Invoke)
                }
                "later" => {
                    let (ms, rest) = rest.split_once(':').expect("later:<ms>:<rest>");
                    tokio::time::sleep(Duration::from_millis(ms.parse().expect("ms"))).await;
                    text = rest.to_string();
                    continue;
                }
                "fail" => Err(ActorError::failed("told to fail")),
                "sleep" => {
                    tokio::time::sleep(Duration::from_millis(rest.parse().expect("ms"))).await;
                    Ok(Bytes::from_static(b"slept"))
                }
                _ => Ok(Bytes::from_static(b"leaf")),
            };
        }
    }
}

fn runtime() -> Runtime {
    Runtime::builder()
        .register(
            ActorKind::new("node").expect("a kind"),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Node)) },
            KindConfig::default(),
        )
        .expect("register")
        .start()
}

async fn edges(runtime: &Runtime) -> usize {
    runtime.stats().await.expect("stats").wait_for_edges
}

/// Goal: after calls from turns that end each way, no wait-for edge is left. Method: the
/// runtime's edge count after each call (whoever answers removes the edge before the
/// reply), over [`ROUNDS`] rounds.
async fn every_calls_edge_is_released() {
    let runtime = runtime();
    let target = node("a");
    let invoke = |payload: &'static str| runtime.invoke_within(&target, Bytes::from_static(payload.as_bytes()), LONG);
    for round in 0..ROUNDS {
        assert_eq!(invoke("call:b:").await.expect("a reply"), "leaf");
        assert_eq!(edges(&runtime).await, 0, "round {round}: after a reply");

        let failed = invoke("call:b:fail").await.expect_err("the callee failed");
        assert!(matches!(failed, InvokeError::ActorFailed { .. }), "{failed:?}");
        assert_eq!(edges(&runtime).await, 0, "round {round}: after an error reply");

        let late = invoke("short:b:sleep:200").await.expect_err("the call timed out");
        assert!(matches!(late, InvokeError::Timeout { .. }), "{late:?}");
        assert_eq!(edges(&runtime).await, 0, "round {round}: after a timeout");

        let cycle = invoke("call:b:call:a:").await.expect_err("a cycle in the chain");
        assert!(matches!(cycle, InvokeError::Refused(_)), "{cycle:?}");
        assert_eq!(
            edges(&runtime).await,
            0,
            "round {round}: after a cycle refused by the chain"
        );

        // A deadlock of two independent requests, which no chain shows: a → b, and b,
        // after a pause, → c, while c → a (queued behind a's waiting turn). b's call
        // would close the cycle: the dispatcher refuses it, b's turn fails, and a's
        // then answers c's call.
        let first = invoke("call:b:later:100:call:c:");
        let second = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            runtime
                .invoke_within(&node("c"), Bytes::from_static(b"call:a:"), LONG)
                .await
        };
        let (first, second) = tokio::join!(first, second);
        let deadlock = first.expect_err("b's call closed a cycle");
        assert!(deadlock.to_string().contains("deadlock"), "round {round}: {deadlock}");
        assert_eq!(second.expect("c's call ran once a was free"), "leaf");
        assert_eq!(edges(&runtime).await, 0, "round {round}: after a refused deadlock");
    }
    runtime.shutdown().await;
}

#[tokio::test]
async fn every_calls_edge_is_released_current_thread() {
    every_calls_edge_is_released().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_calls_edge_is_released_multi_thread() {
    every_calls_edge_is_released().await;
}

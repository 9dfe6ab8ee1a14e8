//! A turn's `Caller::call` with a timeout under 1 ms (zero too): it counts as 1 ms, so
//! the call is sent and may be answered within that millisecond, or times out at its
//! end; it is not refused (`Caller::admit` given `Some(0)` refuses, as `call_agent` does:
//! there a zero is a model's mistake, here a computed remainder).
//!
//! Runs in both builds.

use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, Runtime, Turn};

/// How long the slow callee takes to answer, in milliseconds.
const SLOW_MS: u64 = 10;

/// `fast` answers at once, `slow` after `SLOW_MS`; `caller` calls the actor its payload
/// names (`fast:0`, `slow:500`: the target and the timeout in microseconds) and answers
/// with the outcome.
struct Node {
    key: String,
}

impl Actor for Node {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        match self.key.as_str() {
            "fast" => Ok(payload),
            "slow" => {
                tokio::time::sleep(Duration::from_millis(SLOW_MS)).await;
                Ok(payload)
            }
            _ => {
                let text = String::from_utf8(payload.to_vec()).unwrap();
                let (target, micros) = text.split_once(':').unwrap();
                let timeout = Duration::from_micros(micros.parse().unwrap());
                let target = ActorId::new("node", target).unwrap();
                let outcome = match turn.caller().call(&target, Bytes::from_static(b"hi"), timeout).await {
                    Ok(reply) => format!("ok {}", String::from_utf8_lossy(&reply)),
                    Err(InvokeError::Timeout { timeout_ms, .. }) => format!("timeout {timeout_ms}"),
                    Err(other) => format!("other {other:?}"),
                };
                Ok(Bytes::from(outcome))
            }
        }
    }
}

async fn outcome(runtime: &Runtime, request: &str) -> String {
    let reply = runtime
        .invoke(
            &ActorId::new("node", "caller").unwrap(),
            Bytes::from(request.to_string()),
            runtime.deadline_in(Duration::from_secs(10)),
        )
        .await
        .unwrap();
    String::from_utf8(reply.to_vec()).unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_call_given_under_a_millisecond_gets_one_and_is_not_refused() {
    let factory = |id: &ActorId, _saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
        Ok(ActorBox::new(Node {
            key: id.key().to_string(),
        }))
    };
    let runtime = Runtime::builder()
        .register(ActorKind::new("node").unwrap(), factory, KindConfig::default())
        .unwrap()
        .start();
    for micros in [0, 500, 999] {
        assert_eq!(
            outcome(&runtime, &format!("fast:{micros}")).await,
            "ok hi",
            "{micros} µs"
        );
        assert_eq!(
            outcome(&runtime, &format!("slow:{micros}")).await,
            "timeout 1",
            "{micros} µs"
        );
    }
    // Whole milliseconds, rounded down.
    assert_eq!(outcome(&runtime, "slow:1999").await, "timeout 1");
    assert_eq!(outcome(&runtime, &format!("slow:{}", SLOW_MS * 2_000)).await, "ok hi");
    runtime.shutdown().await;
}

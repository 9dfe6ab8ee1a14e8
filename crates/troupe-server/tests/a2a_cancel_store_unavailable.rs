//! A2A `CancelTask` whose cancel cannot be stored because the store is down for a
//! moment: answered as every other A2A method answers it, 503 with JSON-RPC code
//! -32000 (`storage_unavailable`) and `Retry-After: 1`, a condition the client may
//! retry; until 2026-12-07 it was 200 with JSON-RPC -32603 (internal error), which
//! tells the client nothing may help. And the cancel did not happen: the task still
//! waits, and the same cancel sent again once the store is back cancels it (until
//! 2026-12-07 the task read canceled after the 503 while the store did not have it).
//!
//! Method: a real server on loopback over an agent system whose store is a
//! `MemoryStore` switched unavailable (`MemoryStoreFaults::set_unavailable`: every
//! operation fails `Unavailable`) on command; a task waiting behind a running one is canceled while the switch is on.
//! Normal build only (a real server on real TCP), as the other server tests.
#![cfg(not(madsim))]

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use troupe_agent::{ScriptRule, ScriptedLlm};
use troupe_runtime::{KindConfig, MemoryStore};
use troupe_server::ServerConfig;

mod support;
use support::{Harness, POLL_MS, TEST_WAIT_MS_MAX};

/// The server's request timeout, in milliseconds: the cancel's save is tried again
/// until it less `A2A_BLOCKING_HEADROOM_MS` (1 s), so a store down throughout is
/// answered after about 1 s.
const REQUEST_TIMEOUT_MS: u64 = 2_000;
/// How long the `slow` agent's model takes, in milliseconds: its first task holds the
/// lane while the second is canceled.
const SLOW_TURN_MS: u64 = 3_000;

/// One JSON-RPC call to `/a2a/slow`: the status, the `Retry-After` header and the body.
async fn call(server: &Harness, method: &str, params: Value) -> (u16, Option<String>, Value) {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    let response = server
        .request(reqwest::Method::POST, "/a2a/slow")
        .header("content-type", "application/json")
        .header("A2A-Version", "1.0")
        .body(body.to_string())
        .send()
        .await
        .expect("the server answers");
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|value| value.to_str().unwrap().to_string());
    let text = response.text().await.unwrap();
    let value = serde_json::from_str(&text).unwrap_or_else(|error| panic!("not JSON ({error}): {text}"));
    (status, retry_after, value)
}

/// A task sent to `slow` without waiting for it: its id.
async fn submit(server: &Harness, text: &str) -> String {
    let params = json!({
        "message": {"messageId": text, "role": "ROLE_USER", "parts": [{"text": text}]},
        "configuration": {"returnImmediately": true},
    });
    let (status, _, body) = call(server, "SendMessage", params).await;
    assert_eq!(status, 200, "{body}");
    body["result"]["task"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no task id in {body}"))
        .to_string()
}

/// Goal: see the module doc; and a cancel that could not be stored did not happen:
/// the task reads `submitted` (not canceled) after the 503, the same `CancelTask` sent
/// again once the store is back cancels it and is answered as a first cancel is (200,
/// the task canceled), and this server and a new one on the same store then read it
/// canceled. Until 2026-12-07 the cancel was decided in memory before it was stored:
/// after the 503 the task read canceled, and the cancel sent again was refused -32002
/// "already ended". Method: two tasks to `slow` (the first runs for `SLOW_TURN_MS`, the
/// second waits), the store switched down, `CancelTask` of the second, the store back,
/// `CancelTask` again; the server stopped and a new one started on the same store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_that_cannot_be_stored_is_answered_503_and_leaves_the_task_to_be_canceled_again() {
    let store = Arc::new(MemoryStore::new());
    let start_on_store = || {
        let llm = ScriptedLlm::new().rule(
            ScriptRule::agent("slow")
                .reply("slow done")
                .latency(Duration::from_millis(SLOW_TURN_MS)),
        );
        let builder = support::agents(llm, &["slow"], KindConfig::default()).store(Arc::clone(&store) as _);
        let config = ServerConfig::default().request_timeout(Duration::from_millis(REQUEST_TIMEOUT_MS));
        Harness::start(builder, config)
    };
    let server = start_on_store().await;
    let first = submit(&server, "first").await;
    let second = submit(&server, "second").await;
    tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        while call(&server, "GetTask", json!({"id": first})).await.2["result"]["status"]["state"]
            != "TASK_STATE_WORKING"
        {
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    })
    .await
    .expect("the first task starts");

    store.faults().set_unavailable(true);
    let asked = tokio::time::Instant::now();
    let (status, retry_after, body) = call(&server, "CancelTask", json!({"id": second})).await;
    eprintln!(
        "CancelTask with the store down: {status} (Retry-After {retry_after:?}) after {} ms: {body}",
        asked.elapsed().as_millis()
    );
    store.faults().set_unavailable(false);
    assert_eq!(
        (status, retry_after.as_deref(), &body["error"]["code"]),
        (503, Some("1"), &json!(-32000)),
        "{body}"
    );
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("the cancel could not be stored"), "{message}");

    // Not canceled: it still waits behind the first task (which runs for 3 s).
    let (status, _, body) = call(&server, "GetTask", json!({"id": second})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["result"]["status"]["state"], "TASK_STATE_SUBMITTED",
        "a cancel that could not be stored must not show: {body}"
    );

    // Sent again, as `Retry-After` invites: a first cancel's answer.
    let (status, _, body) = call(&server, "CancelTask", json!({"id": second})).await;
    assert_eq!(status, 200, "the cancel sent again once the store is back: {body}");
    assert_eq!(body["result"]["id"], json!(second), "{body}");
    assert_eq!(body["result"]["status"]["state"], "TASK_STATE_CANCELED", "{body}");
    let (status, _, body) = call(&server, "GetTask", json!({"id": second})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["result"]["status"]["state"], "TASK_STATE_CANCELED", "{body}");
    let canceled_at = body["result"]["status"]["timestamp"].clone();
    server.stop().await;

    // A new server on the same store reads the cancel back as this one answered it.
    let restarted = start_on_store().await;
    let (status, _, body) = call(&restarted, "GetTask", json!({"id": second})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["result"]["status"]["state"], "TASK_STATE_CANCELED",
        "the cancel is stored: {body}"
    );
    assert_eq!(body["result"]["status"]["timestamp"], canceled_at, "{body}");
    restarted.stop().await;
}

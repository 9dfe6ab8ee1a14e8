//! `OpenAiClient` against a local OpenAI-compatible server that misbehaves: slow,
//! rate-limited, failing, truncating its stream, sending garbage; and streaming answers
//! with text and tool calls.
//!
//! Goal: show the documented guarantees of `openai.rs` hold on a real socket: the
//! budget (`min(request timeout, deadline - now)`) bounds every attempt and wait; 429,
//! 5xx and connection failures are retried (exact attempt counts), `Retry-After` is
//! honoured, giving up happens before the deadline with the last error; malformed
//! answers are not retried; a stream is assembled (text, tool-call deltas merged by
//! index, usage) and shown to the observer delta by delta; a truncated stream is
//! `Malformed`; dropping the call's future closes the connection.
//!
//! Method: each test starts a tokio HTTP/1.1 server on `127.0.0.1:0` whose answer to
//! the n-th request is scripted (`Behaviour`, `support/fake_provider.rs`, shared with
//! the other provider tests); it counts requests and reports when a held connection is
//! closed by the client.
//!
//! Run: `cargo nextest run -p troupe-agent --test openai_resilience`.

#![cfg(not(madsim))]
// Real sockets and wall-clock timing are the point of this test, which never runs under
// the simulator.
#![allow(clippy::disallowed_methods)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use troupe_agent::{
    ChatMessage, LlmClient, LlmError, LlmRequest, OpenAiClient, OpenAiConfig, Role, StreamDelta, TokenUsage, ToolCall,
};
use troupe_core::ActorId;
use troupe_runtime::Clock;

const API_KEY: &str = "sk-resilience-secret";
/// How long a test waits for anything that should happen promptly.
const TEST_WAIT_MS_MAX: u64 = 10_000;
/// How much later than its deadline a call may return.
const DEADLINE_SLACK_MS_MAX: u64 = 1_500;

#[allow(dead_code)] // the answers the other provider tests use and these do not
#[path = "support/fake_provider.rs"]
mod fake_provider;
use fake_provider::{respond, Behaviour, FakeServer};

fn completion(text: &str) -> String {
    json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    })
    .to_string()
}

/// A config for `base_url` with short, fast backoff (10..=40 ms) and `retries_max`.
fn config(base_url: &str, retries_max: u32) -> OpenAiConfig {
    let mut config = OpenAiConfig::new(API_KEY);
    config.base_url = base_url.to_owned();
    config.model = "test-model".to_owned();
    config.request_timeout = Duration::from_secs(30);
    config.retries_max = retries_max;
    config.retry_backoff_initial = Duration::from_millis(10);
    config.retry_backoff_max = Duration::from_millis(40);
    config
}

fn request(clock: &Clock, deadline_in: Duration) -> LlmRequest {
    LlmRequest {
        max_tokens: None,
        agent: ActorId::new("agent", "alice").expect("valid id"),
        model: String::new(),
        messages: vec![ChatMessage::new(Role::User, "hello")].into(),
        tools: Vec::new().into(),
        deadline: clock.deadline_in(deadline_in),
    }
}

fn wait() -> Duration {
    Duration::from_millis(TEST_WAIT_MS_MAX)
}

/// A server slower than the deadline: `Timeout` with the deadline as the budget, on
/// time; the request was sent once (a timeout is not retried).
#[tokio::test]
async fn slow_server_hits_the_deadline_and_times_out() {
    let server = FakeServer::start(|_, _| Behaviour::Hang).await;
    let clock = Clock::new();
    let client = OpenAiClient::new(config(&server.base_url, 3), clock).unwrap();
    let deadline_in = Duration::from_millis(300);

    let started = Instant::now();
    let error = client.complete(request(&clock, deadline_in)).await.unwrap_err();
    let elapsed = started.elapsed();

    let LlmError::Timeout { timeout_ms } = error else {
        panic!("expected Timeout, got {error:?}");
    };
    // The budget is what was left of the 300 ms when the call started.
    assert!((200..=300).contains(&timeout_ms), "budget {timeout_ms} ms");
    assert!(elapsed >= Duration::from_millis(timeout_ms), "{elapsed:?}");
    assert!(
        elapsed <= deadline_in + Duration::from_millis(DEADLINE_SLACK_MS_MAX),
        "{elapsed:?}"
    );
    assert_eq!(server.requests(), 1);
}

/// 429 with `Retry-After: 1` (seconds), then success: exactly two requests, the second
/// no sooner than the second asked for.
#[tokio::test]
async fn rate_limited_then_success_is_retried_once_after_retry_after() {
    let server = FakeServer::start(|index, _| match index {
        0 => Behaviour::Respond {
            status: 429,
            headers: vec![("Retry-After", "1".to_owned())],
            body: r#"{"error":{"message":"slow down"}}"#.to_owned(),
        },
        _ => respond(200, &completion("finally")),
    })
    .await;
    let clock = Clock::new();
    let client = OpenAiClient::new(config(&server.base_url, 3), clock).unwrap();

    let started = Instant::now();
    let reply = client.complete(request(&clock, Duration::from_secs(10))).await.unwrap();
    let elapsed = started.elapsed();

    assert_eq!(reply.message, ChatMessage::new(Role::Assistant, "finally"));
    assert_eq!(
        reply.usage,
        Some(TokenUsage {
            prompt_tokens: 11,
            completion_tokens: 3,
            total_tokens: 14
        })
    );
    assert_eq!(server.requests(), 2);
    assert!(
        elapsed >= Duration::from_secs(1),
        "Retry-After not honoured: {elapsed:?}"
    );
}

/// 503 twice, then success, with backoff (no Retry-After): exactly three requests.
#[tokio::test]
async fn server_errors_are_retried_with_backoff_until_success() {
    let server = FakeServer::start(|index, _| {
        if index < 2 {
            respond(503, "overloaded")
        } else {
            respond(200, &completion("ok"))
        }
    })
    .await;
    let clock = Clock::new();
    let client = OpenAiClient::new(config(&server.base_url, 3), clock).unwrap();

    let reply = client.complete(request(&clock, Duration::from_secs(10))).await.unwrap();

    assert_eq!(reply.message.content, "ok");
    assert_eq!(server.requests(), 3);
}

/// 500 forever with retries to spare: 1 + `retries_max` requests, then the last
/// `Provider` error.
#[tokio::test]
async fn server_error_forever_gives_up_after_retries_max() {
    let server = FakeServer::start(|_, _| respond(500, "boom")).await;
    let clock = Clock::new();
    let client = OpenAiClient::new(config(&server.base_url, 2), clock).unwrap();

    let error = client
        .complete(request(&clock, Duration::from_secs(10)))
        .await
        .unwrap_err();

    assert_eq!(
        error,
        LlmError::Provider {
            status: 500,
            body: "boom".to_owned(),
            retry_after_ms: None
        }
    );
    assert_eq!(server.requests(), 3);
}

/// 500 forever with more retries than time: the call gives up with the `Provider`
/// error before the deadline (a retry whose wait would leave less than
/// `RETRY_ATTEMPT_MS_MIN` is not started), after at least one retry.
#[tokio::test]
async fn server_error_forever_gives_up_with_provider_error_within_the_deadline() {
    let server = FakeServer::start(|_, _| respond(500, "boom")).await;
    let clock = Clock::new();
    let mut config = config(&server.base_url, 10);
    config.retry_backoff_initial = Duration::from_millis(100);
    config.retry_backoff_max = Duration::from_millis(400);
    let client = OpenAiClient::new(config, clock).unwrap();
    let deadline_in = Duration::from_millis(800);

    let started = Instant::now();
    let error = client.complete(request(&clock, deadline_in)).await.unwrap_err();
    let elapsed = started.elapsed();

    assert_eq!(
        error,
        LlmError::Provider {
            status: 500,
            body: "boom".to_owned(),
            retry_after_ms: None
        }
    );
    assert!(elapsed < deadline_in, "gave up only after the deadline: {elapsed:?}");
    assert!((2..=11).contains(&server.requests()), "{} requests", server.requests());
}

/// A 400 is the caller's fault: not retried.
#[tokio::test]
async fn client_error_is_not_retried() {
    let server = FakeServer::start(|_, _| respond(400, "bad request")).await;
    let clock = Clock::new();
    let client = OpenAiClient::new(config(&server.base_url, 3), clock).unwrap();

    let error = client
        .complete(request(&clock, Duration::from_secs(10)))
        .await
        .unwrap_err();

    assert_eq!(
        error,
        LlmError::Provider {
            status: 400,
            body: "bad request".to_owned(),
            retry_after_ms: None
        }
    );
    assert_eq!(server.requests(), 1);
}

/// A 200 whose body is not JSON is `Malformed`, and not retried.
#[tokio::test]
async fn malformed_json_is_malformed_and_not_retried() {
    let server = FakeServer::start(|_, _| respond(200, "{\"choices\": [")).await;
    let clock = Clock::new();
    let client = OpenAiClient::new(config(&server.base_url, 3), clock).unwrap();

    let error = client
        .complete(request(&clock, Duration::from_secs(10)))
        .await
        .unwrap_err();

    let LlmError::Malformed { cause } = &error else {
        panic!("expected Malformed, got {error:?}");
    };
    assert!(cause.starts_with("the response is not a chat completion"), "{cause}");
    assert_eq!(server.requests(), 1);
}

/// Nobody listening: every attempt fails to connect, is retried, and the result is
/// `Unreachable` after exactly 1 + `retries_max` attempts (no secret in the text).
#[tokio::test]
async fn connection_refused_is_retried_then_unreachable() {
    let address = {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        listener.local_addr().unwrap()
    };
    let clock = Clock::new();
    let client = OpenAiClient::new(config(&format!("http://{address}/v1"), 2), clock).unwrap();

    let error = client
        .complete(request(&clock, Duration::from_secs(10)))
        .await
        .unwrap_err();

    let LlmError::Unreachable { cause } = &error else {
        panic!("expected Unreachable, got {error:?}");
    };
    assert!(!cause.contains(API_KEY), "{cause}");
    assert!(!format!("{client:?}").contains(API_KEY));
}

fn sse(data: &Value) -> String {
    format!("data: {data}\n\n")
}

/// The pieces of a streamed answer: text in two deltas, two tool calls whose arguments
/// arrive in fragments, a finish chunk, a usage chunk, `[DONE]`.
fn streamed_answer() -> Vec<String> {
    let delta = |delta: Value| json!({"choices": [{"index": 0, "delta": delta, "finish_reason": null}]});
    vec![
        ": keep-alive comment\n\n".to_owned(),
        sse(&delta(json!({"role": "assistant", "content": ""}))),
        sse(&delta(json!({"content": "Let me "}))),
        sse(&delta(json!({"content": "add."}))),
        sse(&delta(
            json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                          "function": {"name": "add", "arguments": ""}}]}),
        )),
        sse(&delta(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\": 2,"}}]}),
        )),
        // A line split across two TCP writes.
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,".to_owned(),
        "\"function\":{\"arguments\":\" \\\"b\\\": 3}\"}}]}}]}\r\n\r\n".to_owned(),
        sse(&delta(
            json!({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                                          "function": {"name": "now", "arguments": ""}}]}),
        )),
        sse(&json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})),
        sse(&json!({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29}})),
        "data: [DONE]\n\n".to_owned(),
    ]
}

/// An observer that writes down every delta.
fn recording_observer() -> (Arc<Mutex<Vec<String>>>, Arc<dyn troupe_agent::StreamObserver>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    let observer = move |agent: &ActorId, delta: &StreamDelta<'_>| {
        sink.lock().unwrap().push(format!("{agent} {delta:?}"));
    };
    (seen, Arc::new(observer))
}

/// A streamed answer with text and tool calls is assembled into one reply with usage;
/// the observer sees every delta in order; the request asked for a stream with usage.
#[tokio::test]
async fn streamed_text_and_tool_calls_are_assembled_and_observed() {
    let server = FakeServer::start(|_, _| Behaviour::Sse(streamed_answer())).await;
    let clock = Clock::new();
    let mut config = config(&server.base_url, 0);
    config.stream = true;
    let (seen, observer) = recording_observer();
    let client = OpenAiClient::new(config, clock).unwrap().with_stream_observer(observer);

    let reply = client.complete(request(&clock, Duration::from_secs(10))).await.unwrap();

    let mut expected = ChatMessage::new(Role::Assistant, "Let me add.");
    expected.tool_calls = vec![
        ToolCall {
            id: "call_1".to_owned(),
            name: "add".to_owned(),
            arguments: json!({"a": 2, "b": 3}),
        },
        ToolCall {
            id: "call_2".to_owned(),
            name: "now".to_owned(),
            arguments: json!({}),
        },
    ];
    assert_eq!(reply.message, expected);
    assert_eq!(
        reply.usage,
        Some(TokenUsage {
            prompt_tokens: 20,
            completion_tokens: 9,
            total_tokens: 29
        })
    );
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            r#"agent/alice Text("Let me ")"#,
            r#"agent/alice Text("add.")"#,
            r#"agent/alice ToolCall { index: 0, id: Some("call_1"), name: Some("add"), arguments: "" }"#,
            r#"agent/alice ToolCall { index: 0, id: None, name: None, arguments: "{\"a\": 2," }"#,
            r#"agent/alice ToolCall { index: 0, id: None, name: None, arguments: " \"b\": 3}" }"#,
            r#"agent/alice ToolCall { index: 1, id: Some("call_2"), name: Some("now"), arguments: "" }"#,
            r#"agent/alice End { outcome: Ok(()) }"#,
        ]
    );
    let body = server.bodies.lock().unwrap()[0].clone();
    assert_eq!(body["stream"], json!(true));
    assert_eq!(body["stream_options"], json!({"include_usage": true}));
}

/// A stream cut in the middle of a chunk is `Malformed`; what arrived before was
/// observed, then the end with the error; the request is not retried.
#[tokio::test]
async fn truncated_stream_is_malformed() {
    let server = FakeServer::start(|_, _| {
        Behaviour::Sse(vec![
            sse(&json!({"choices": [{"index": 0, "delta": {"content": "Hel"}}]})),
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo".to_owned(),
        ])
    })
    .await;
    let clock = Clock::new();
    let mut config = config(&server.base_url, 3);
    config.stream = true;
    let (seen, observer) = recording_observer();
    let client = OpenAiClient::new(config, clock).unwrap().with_stream_observer(observer);

    let error = client
        .complete(request(&clock, Duration::from_secs(10)))
        .await
        .unwrap_err();

    let LlmError::Malformed { cause } = &error else {
        panic!("expected Malformed, got {error:?}");
    };
    assert!(cause.starts_with("a stream chunk is not JSON"), "{cause}");
    // Then the end, with the error: what was shown is no answer.
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            r#"agent/alice Text("Hel")"#.to_owned(),
            format!("agent/alice End {{ outcome: Err({error:?}) }}"),
        ]
    );
    assert_eq!(server.requests(), 1);
}

/// A stream that ends cleanly but without `data: [DONE]` is `Malformed` too.
#[tokio::test]
async fn stream_without_done_is_malformed() {
    let server = FakeServer::start(|_, _| {
        Behaviour::Sse(vec![sse(
            &json!({"choices": [{"index": 0, "delta": {"content": "Hello"}, "finish_reason": "stop"}]}),
        )])
    })
    .await;
    let clock = Clock::new();
    let mut config = config(&server.base_url, 0);
    config.stream = true;
    let client = OpenAiClient::new(config, clock).unwrap();

    let error = client
        .complete(request(&clock, Duration::from_secs(10)))
        .await
        .unwrap_err();

    assert_eq!(
        error,
        LlmError::Malformed {
            cause: "the stream ended before data: [DONE]".to_owned()
        }
    );
}

/// Dropping the call's future (a cancelled turn) closes the connection: the server sees
/// the client hang up, and no second request is made.
#[tokio::test]
async fn dropping_the_call_closes_the_connection() {
    let mut server = FakeServer::start(|_, _| Behaviour::Hang).await;
    let clock = Clock::new();
    let client = OpenAiClient::new(config(&server.base_url, 3), clock).unwrap();
    let call = tokio::spawn({
        let request = request(&clock, Duration::from_secs(30));
        async move { client.complete(request).await }
    });

    tokio::time::timeout(wait(), server.received.recv())
        .await
        .expect("the server got the request")
        .unwrap();
    call.abort();
    let aborted = call.await.unwrap_err();
    assert!(aborted.is_cancelled());

    tokio::time::timeout(wait(), server.closed.recv())
        .await
        .expect("the connection is closed when the call is dropped")
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(server.requests(), 1);
}

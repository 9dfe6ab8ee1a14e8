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
//! the n-th request is scripted (`Behaviour`); it counts requests and reports when a
//! held connection is closed by the client.
//!
//! Run: `cargo nextest run -p troupe-agent --test openai_resilience`.

#![cfg(not(madsim))]
// Real sockets and wall-clock timing are the point of this test, which never runs under
// the simulator.
#![allow(clippy::disallowed_methods)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
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

/// What the server does with one request.
#[derive(Clone)]
enum Behaviour {
    /// A complete response: status, extra headers, body.
    Respond {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: String,
    },
    /// An SSE response: these raw pieces, written one by one, then the connection closes.
    Sse(Vec<String>),
    /// Reads the request and answers nothing; reports when the client closes.
    Hang,
}

/// A scripted OpenAI-compatible server on loopback.
struct FakeServer {
    base_url: String,
    requests: Arc<AtomicUsize>,
    bodies: Arc<Mutex<Vec<Value>>>,
    received: mpsc::UnboundedReceiver<()>,
    closed: mpsc::UnboundedReceiver<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeServer {
    /// A server answering request `n` (0-based) with `script(n)`.
    async fn start(script: impl Fn(usize) -> Behaviour + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
        let address = listener.local_addr().expect("local address");
        let requests = Arc::new(AtomicUsize::new(0));
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let (received_sender, received) = mpsc::unbounded_channel();
        let (closed_sender, closed) = mpsc::unbounded_channel();
        let script = Arc::new(script);
        let task = {
            let requests = requests.clone();
            let bodies = bodies.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        return;
                    };
                    let script = script.clone();
                    let requests = requests.clone();
                    let bodies = bodies.clone();
                    let received_sender = received_sender.clone();
                    let closed_sender = closed_sender.clone();
                    tokio::spawn(async move {
                        let (body, mut stream) = read_request(stream).await;
                        let index = requests.fetch_add(1, Ordering::SeqCst);
                        bodies.lock().unwrap().push(body);
                        let _ = received_sender.send(());
                        answer(&mut stream, script(index), &closed_sender).await;
                    });
                }
            })
        };
        Self {
            base_url: format!("http://{address}/v1"),
            requests,
            bodies,
            received,
            closed,
            task,
        }
    }

    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

/// Reads one HTTP/1.1 request with a `Content-Length` body; returns the body as JSON.
async fn read_request(mut stream: TcpStream) -> (Value, TcpStream) {
    let mut bytes = Vec::new();
    let mut buffer = [0_u8; 4096];
    let header_end = loop {
        let read = stream.read(&mut buffer).await.expect("read request");
        assert!(read > 0, "the client closed before sending a whole request");
        bytes.extend_from_slice(&buffer[..read]);
        if let Some(position) = bytes.windows(4).position(|window| window == b"\r\n\r\n") {
            break position + 4;
        }
    };
    let head = String::from_utf8_lossy(&bytes[..header_end]).to_lowercase();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .map(|value| value.trim().parse().expect("numeric content-length"))
        .expect("the client sends Content-Length");
    while bytes.len() < header_end + length {
        let read = stream.read(&mut buffer).await.expect("read body");
        assert!(read > 0, "the client closed mid-body");
        bytes.extend_from_slice(&buffer[..read]);
    }
    let body = serde_json::from_slice(&bytes[header_end..header_end + length]).expect("the request body is JSON");
    (body, stream)
}

async fn answer(stream: &mut TcpStream, behaviour: Behaviour, closed: &mpsc::UnboundedSender<()>) {
    match behaviour {
        Behaviour::Respond { status, headers, body } => {
            let mut head = format!(
                "HTTP/1.1 {status} Scripted\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
                 Connection: close\r\n",
                body.len()
            );
            for (name, value) in headers {
                head.push_str(&format!("{name}: {value}\r\n"));
            }
            head.push_str("\r\n");
            let _ = stream.write_all(head.as_bytes()).await;
            let _ = stream.write_all(body.as_bytes()).await;
            let _ = stream.shutdown().await;
        }
        Behaviour::Sse(pieces) => {
            let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n";
            let _ = stream.write_all(head.as_bytes()).await;
            for piece in pieces {
                let _ = stream.write_all(piece.as_bytes()).await;
                let _ = stream.flush().await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let _ = stream.shutdown().await;
        }
        Behaviour::Hang => {
            let mut buffer = [0_u8; 256];
            loop {
                match tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), stream.read(&mut buffer)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => {
                        let _ = closed.send(());
                        return;
                    }
                    Ok(Ok(_)) => {}
                    Err(_) => return,
                }
            }
        }
    }
}

fn respond(status: u16, body: &str) -> Behaviour {
    Behaviour::Respond {
        status,
        headers: Vec::new(),
        body: body.to_owned(),
    }
}

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
    let server = FakeServer::start(|_| Behaviour::Hang).await;
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
    let server = FakeServer::start(|index| match index {
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
    let server = FakeServer::start(|index| {
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
    let server = FakeServer::start(|_| respond(500, "boom")).await;
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
            body: "boom".to_owned()
        }
    );
    assert_eq!(server.requests(), 3);
}

/// 500 forever with more retries than time: the call gives up with the `Provider`
/// error before the deadline (a retry whose wait would leave less than
/// `RETRY_ATTEMPT_MS_MIN` is not started), after at least one retry.
#[tokio::test]
async fn server_error_forever_gives_up_with_provider_error_within_the_deadline() {
    let server = FakeServer::start(|_| respond(500, "boom")).await;
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
            body: "boom".to_owned()
        }
    );
    assert!(elapsed < deadline_in, "gave up only after the deadline: {elapsed:?}");
    assert!((2..=11).contains(&server.requests()), "{} requests", server.requests());
}

/// A 400 is the caller's fault: not retried.
#[tokio::test]
async fn client_error_is_not_retried() {
    let server = FakeServer::start(|_| respond(400, "bad request")).await;
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
            body: "bad request".to_owned()
        }
    );
    assert_eq!(server.requests(), 1);
}

/// A 200 whose body is not JSON is `Malformed`, and not retried.
#[tokio::test]
async fn malformed_json_is_malformed_and_not_retried() {
    let server = FakeServer::start(|_| respond(200, "{\"choices\": [")).await;
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
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
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
    let server = FakeServer::start(|_| Behaviour::Sse(streamed_answer())).await;
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
        ]
    );
    let body = server.bodies.lock().unwrap()[0].clone();
    assert_eq!(body["stream"], json!(true));
    assert_eq!(body["stream_options"], json!({"include_usage": true}));
}

/// A stream cut in the middle of a chunk is `Malformed`; what arrived before was
/// observed; the request is not retried.
#[tokio::test]
async fn truncated_stream_is_malformed() {
    let server = FakeServer::start(|_| {
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
    assert_eq!(*seen.lock().unwrap(), vec![r#"agent/alice Text("Hel")"#]);
    assert_eq!(server.requests(), 1);
}

/// A stream that ends cleanly but without `data: [DONE]` is `Malformed` too.
#[tokio::test]
async fn stream_without_done_is_malformed() {
    let server = FakeServer::start(|_| {
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
    let mut server = FakeServer::start(|_| Behaviour::Hang).await;
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

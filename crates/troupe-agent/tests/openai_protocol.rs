//! `OpenAiClient` against a local HTTP server that speaks the chat-completions protocol.
//!
//! Goal: show that the client sends what an OpenAI-compatible provider expects (path,
//! bearer key, model, messages with tool calls and tool results, tools as functions) and
//! turns every kind of answer into the right `LlmReply` or `LlmError`: text, tool calls
//! with JSON-string arguments, error statuses, malformed arguments, silence past the
//! budget, and nobody listening.
//!
//! Retries are off here (`retries_max = 0`): each test is one exchange. Retries,
//! streaming, cancellation and misbehaving servers are in `openai_resilience.rs`.
//!
//! Method: each test starts a one-connection HTTP/1.1 server on `127.0.0.1:0` in a
//! thread (`std::net`), which records the request it receives and answers with a canned
//! response; the test then checks both the client's result and the recorded request.
//!
//! Run: `cargo nextest run -p troupe-agent --test openai_protocol`.

#![cfg(not(madsim))]
// Real sockets, a server thread and wall-clock timing are the point of this test, which
// never runs under the simulator.
#![allow(clippy::disallowed_methods)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use troupe_agent::{
    ChatMessage, LlmClient, LlmError, LlmRequest, OpenAiClient, OpenAiConfig, Role, TokenUsage, ToolCall, ToolSpec,
    PROVIDER_ERROR_BODY_BYTES_MAX,
};
use troupe_core::ActorId;
use troupe_runtime::Clock;

const API_KEY: &str = "sk-test-0123456789";
const MODEL: &str = "test-model";
/// How long a test waits for anything that should happen promptly.
const TEST_WAIT_MS_MAX: u64 = 10_000;
/// How much later than its budget a timed-out call may return.
const TIMEOUT_SLACK_MS_MAX: u64 = 1_500;

/// One HTTP request as the server received it.
#[derive(Debug)]
struct RecordedRequest {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Value,
}

impl RecordedRequest {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

/// What the server does after reading the request.
enum Answer {
    /// Sends this status and JSON body, then closes.
    Respond { status: u16, body: String },
    /// Sends nothing and holds the connection until the test ends.
    Silence,
}

/// A one-connection chat-completions server on loopback.
struct FakeProvider {
    base_url: String,
    recorded: JoinHandle<RecordedRequest>,
    /// Dropping it releases a silent connection.
    _release: mpsc::Sender<()>,
}

impl FakeProvider {
    fn start(answer: Answer) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let address = listener.local_addr().expect("local address");
        let (release_sender, release_receiver) = mpsc::channel::<()>();
        let recorded = std::thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            stream
                .set_read_timeout(Some(Duration::from_millis(TEST_WAIT_MS_MAX)))
                .unwrap();
            let (request, mut stream) = read_request(stream);
            match answer {
                Answer::Respond { status, body } => {
                    let response = format!(
                        "HTTP/1.1 {status} Canned\r\nContent-Type: application/json\r\n\
                         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    stream.write_all(response.as_bytes()).expect("write response");
                    stream.flush().unwrap();
                }
                Answer::Silence => {
                    // Hold the connection open until the test drops the provider.
                    let _ = release_receiver.recv_timeout(Duration::from_millis(TEST_WAIT_MS_MAX));
                }
            }
            request
        });
        Self {
            base_url: format!("http://{address}/v1"),
            recorded,
            _release: release_sender,
        }
    }

    fn recorded_request(self) -> RecordedRequest {
        self.recorded.join().expect("the fake provider thread panicked")
    }
}

fn read_request(stream: TcpStream) -> (RecordedRequest, TcpStream) {
    let mut reader = BufReader::new(stream);
    let mut request_line = String::new();
    reader.read_line(&mut request_line).expect("request line");
    let mut parts = request_line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_owned();
    let path = parts.next().unwrap_or_default().to_owned();
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("header line");
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (name, value) = line.split_once(':').expect("header has a colon");
        headers.push((name.trim().to_owned(), value.trim().to_owned()));
    }
    let length: usize = headers
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case("content-length"))
        .map(|(_, value)| value.parse().expect("numeric content-length"))
        .expect("the client sends Content-Length");
    let mut body = vec![0; length];
    reader.read_exact(&mut body).expect("body");
    let body = serde_json::from_slice(&body).expect("the request body is JSON");
    (
        RecordedRequest {
            method,
            path,
            headers,
            body,
        },
        reader.into_inner(),
    )
}

fn completion(message: Value) -> String {
    json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    })
    .to_string()
}

fn client(base_url: &str, request_timeout: Duration, clock: Clock) -> OpenAiClient {
    let mut config = OpenAiConfig::new(API_KEY);
    config.base_url = base_url.to_owned();
    config.model = "config-default-model".to_owned();
    config.request_timeout = request_timeout;
    config.retries_max = 0;
    OpenAiClient::new(config, clock).expect("valid config")
}

fn add_tool() -> ToolSpec {
    ToolSpec {
        name: "add".to_owned(),
        description: "Adds two integers.".to_owned(),
        parameters: json!({
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]
        }),
    }
}

/// A chat that has been through one tool round: system, user, the assistant's call, and
/// the tool's result.
fn request_after_tool_round(clock: &Clock, deadline_in: Duration) -> LlmRequest {
    let mut assistant = ChatMessage::new(Role::Assistant, "");
    assistant.tool_calls.push(ToolCall {
        id: "call_1".to_owned(),
        name: "add".to_owned(),
        arguments: json!({"a": 2, "b": 3}),
    });
    LlmRequest {
        max_tokens: None,
        agent: ActorId::new("agent", "alice").expect("valid id"),
        model: MODEL.to_owned(),
        messages: vec![
            ChatMessage::new(Role::System, "You add numbers."),
            ChatMessage::new(Role::User, "What is 2 + 3?"),
            assistant,
            ChatMessage::tool_result("call_1", "5"),
        ]
        .into(),
        tools: vec![add_tool()].into(),
        deadline: clock.deadline_in(deadline_in),
    }
}

/// Checks that the recorded request is the chat-completions request for
/// [`request_after_tool_round`].
fn assert_is_chat_completions_request(recorded: &RecordedRequest) {
    assert_eq!(recorded.method, "POST");
    assert_eq!(recorded.path, "/v1/chat/completions");
    assert_eq!(
        recorded.header("authorization"),
        Some(format!("Bearer {API_KEY}").as_str())
    );
    assert_eq!(recorded.header("content-type"), Some("application/json"));
    let body = &recorded.body;
    assert_eq!(body["model"], MODEL, "the request's model wins over the config default");
    assert_eq!(
        body["messages"],
        json!([
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "add", "arguments": "{\"a\":2,\"b\":3}"}}
            ]},
            {"role": "tool", "content": "5", "tool_call_id": "call_1"}
        ])
    );
    assert_eq!(
        body["tools"],
        json!([{"type": "function", "function": {
            "name": "add",
            "description": "Adds two integers.",
            "parameters": add_tool().parameters
        }}])
    );
}

/// (a) A text answer becomes an assistant message with that text and no tool calls; the
/// request carries the whole protocol (path, key, model, tool result, tools).
#[tokio::test]
async fn text_reply_becomes_assistant_message_and_request_speaks_chat_completions() {
    let provider = FakeProvider::start(Answer::Respond {
        status: 200,
        body: completion(json!({"role": "assistant", "content": "2 + 3 = 5."})),
    });
    let clock = Clock::new();
    let client = client(&provider.base_url, Duration::from_secs(10), clock);

    let reply = client
        .complete(request_after_tool_round(&clock, Duration::from_secs(10)))
        .await;

    let reply = reply.expect("a text answer");
    assert_eq!(reply.message, ChatMessage::new(Role::Assistant, "2 + 3 = 5."));
    assert_eq!(
        reply.usage,
        Some(TokenUsage {
            prompt_tokens: 1,
            completion_tokens: 1,
            total_tokens: 2
        })
    );
    assert_is_chat_completions_request(&provider.recorded_request());
}

/// (b) Tool calls whose arguments arrive as a JSON string come back as `ToolCall`s with
/// the arguments parsed into JSON values; `content: null` becomes empty text.
#[tokio::test]
async fn tool_calls_reply_returns_tool_calls_with_parsed_arguments() {
    let provider = FakeProvider::start(Answer::Respond {
        status: 200,
        body: completion(json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [
                {"id": "call_7", "type": "function",
                 "function": {"name": "add", "arguments": "{\"a\": 40, \"b\": 2}"}},
                {"id": "call_8", "type": "function",
                 "function": {"name": "add", "arguments": "{\"a\": -1, \"b\": 1}"}}
            ]
        })),
    });
    let clock = Clock::new();
    let client = client(&provider.base_url, Duration::from_secs(10), clock);

    let reply = client
        .complete(request_after_tool_round(&clock, Duration::from_secs(10)))
        .await;

    let message = reply.expect("a tool-call answer").message;
    assert_eq!(message.role, Role::Assistant);
    assert_eq!(message.content, "");
    assert_eq!(
        message.tool_calls,
        vec![
            ToolCall {
                id: "call_7".to_owned(),
                name: "add".to_owned(),
                arguments: json!({"a": 40, "b": 2})
            },
            ToolCall {
                id: "call_8".to_owned(),
                name: "add".to_owned(),
                arguments: json!({"a": -1, "b": 1})
            },
        ]
    );
    assert_is_chat_completions_request(&provider.recorded_request());
}

/// (c) An error status is `Provider` with that status and the start of the body, cut to
/// `PROVIDER_ERROR_BODY_BYTES_MAX` bytes.
#[tokio::test]
async fn status_429_is_provider_error_with_status_and_truncated_body() {
    let long_tail = "é".repeat(PROVIDER_ERROR_BODY_BYTES_MAX);
    let error_body =
        json!({"error": {"message": format!("Rate limit reached {long_tail}"), "type": "rate_limit"}}).to_string();
    let provider = FakeProvider::start(Answer::Respond {
        status: 429,
        body: error_body.clone(),
    });
    let clock = Clock::new();
    let client = client(&provider.base_url, Duration::from_secs(10), clock);

    let error = client
        .complete(request_after_tool_round(&clock, Duration::from_secs(10)))
        .await
        .expect_err("a 429 is an error");

    let LlmError::Provider { status, body, .. } = error else {
        panic!("expected LlmError::Provider, got {error:?}");
    };
    assert_eq!(status, 429);
    assert!(
        body.starts_with("{\"error\":{\"message\":\"Rate limit reached"),
        "{body}"
    );
    assert!(body.len() <= PROVIDER_ERROR_BODY_BYTES_MAX, "{} bytes", body.len());
    assert!(
        body.len() > PROVIDER_ERROR_BODY_BYTES_MAX - 4,
        "cut no shorter than needed"
    );
    assert!(
        error_body.starts_with(&body),
        "the kept body is a prefix of the real one"
    );
    provider.recorded_request();
}

/// (d) Tool-call arguments that are not JSON make the answer `Malformed`.
#[tokio::test]
async fn malformed_tool_call_arguments_are_malformed_error() {
    let provider = FakeProvider::start(Answer::Respond {
        status: 200,
        body: completion(json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [{"id": "call_9", "type": "function",
                            "function": {"name": "add", "arguments": "{\"a\": 1, \"b\":"}}]
        })),
    });
    let clock = Clock::new();
    let client = client(&provider.base_url, Duration::from_secs(10), clock);

    let error = client
        .complete(request_after_tool_round(&clock, Duration::from_secs(10)))
        .await
        .expect_err("broken arguments are an error");

    let LlmError::Malformed { cause } = &error else {
        panic!("expected LlmError::Malformed, got {error:?}");
    };
    assert!(cause.contains("call_9"), "{cause}");
    provider.recorded_request();
}

/// (e) A provider that accepts the request and never answers gives `Timeout` once the
/// config's request timeout (the shorter limit here) has passed, and not much later.
#[tokio::test]
async fn silent_provider_times_out_within_request_timeout() {
    let provider = FakeProvider::start(Answer::Silence);
    let clock = Clock::new();
    let request_timeout = Duration::from_millis(300);
    let client = client(&provider.base_url, request_timeout, clock);

    let started = Instant::now();
    let error = client
        .complete(request_after_tool_round(&clock, Duration::from_secs(30)))
        .await
        .expect_err("silence is an error");
    let elapsed = started.elapsed();

    assert_eq!(error, LlmError::Timeout { timeout_ms: 300 });
    assert!(
        elapsed >= request_timeout,
        "returned after {elapsed:?}, before the budget"
    );
    assert!(
        elapsed <= request_timeout + Duration::from_millis(TIMEOUT_SLACK_MS_MAX),
        "returned after {elapsed:?}"
    );
    drop(provider);
}

/// (e') When the request's deadline is nearer than the request timeout, the deadline is
/// the budget.
#[tokio::test]
async fn silent_provider_times_out_at_the_request_deadline_when_it_is_sooner() {
    let provider = FakeProvider::start(Answer::Silence);
    let clock = Clock::new();
    let client = client(&provider.base_url, Duration::from_secs(30), clock);
    let deadline_in = Duration::from_millis(250);

    let started = Instant::now();
    let error = client
        .complete(request_after_tool_round(&clock, deadline_in))
        .await
        .expect_err("silence is an error");
    let elapsed = started.elapsed();

    let LlmError::Timeout { timeout_ms } = error else {
        panic!("expected LlmError::Timeout, got {error:?}");
    };
    assert!(timeout_ms <= 250, "budget {timeout_ms} ms exceeds the deadline");
    assert!(
        elapsed <= deadline_in + Duration::from_millis(TIMEOUT_SLACK_MS_MAX),
        "returned after {elapsed:?}"
    );
    drop(provider);
}

/// A deadline that has already passed fails at once, without connecting.
#[tokio::test]
async fn passed_deadline_times_out_without_sending() {
    let clock = Clock::new();
    // Port 9 (discard) on loopback: nothing is expected to listen, and nothing must be sent.
    let client = client("http://127.0.0.1:9/v1", Duration::from_secs(10), clock);
    let mut request = request_after_tool_round(&clock, Duration::ZERO);
    request.deadline = clock.now();

    let error = client.complete(request).await.expect_err("no time left");

    assert_eq!(error, LlmError::Timeout { timeout_ms: 0 });
}

/// (f) Nothing listening on the port gives `Unreachable`.
#[tokio::test]
async fn nothing_listening_is_unreachable() {
    let address = {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        listener.local_addr().expect("local address")
    }; // The listener is dropped here, so the port refuses connections.
    let clock = Clock::new();
    let client = client(&format!("http://{address}/v1"), Duration::from_secs(10), clock);

    let error = client
        .complete(request_after_tool_round(&clock, Duration::from_secs(10)))
        .await
        .expect_err("nobody answers");

    assert!(
        matches!(error, LlmError::Unreachable { .. }),
        "expected Unreachable, got {error:?}"
    );
}

//! Probes of an agent system whose model is an OpenAI-compatible provider that
//! misbehaves, as an embedder meets it: silent past the ask's deadline, refusing the
//! key, failing then recovering, resetting the connection mid-body, answering with no
//! choices, a body over the limit, a stream cut before `[DONE]`, a tool the agent does
//! not have.
//!
//! Goal: what the caller of `ask` gets in each case is typed and names the cause (a
//! timeout is `InvokeError::Timeout`, on time); a failed turn commits nothing to the
//! agent's log; a retried model call does not duplicate anything in it.
//!
//! Method: a tokio HTTP/1.1 server on `127.0.0.1:0` scripted per request (as in
//! `openai_resilience.rs`), an `OpenAiClient` on the runtime's clock, an agent system
//! with one agent. Every wait is bounded.
//!
//! Run: `cargo nextest run -p troupe-agent --test provider_probes`.

#![cfg(not(madsim))]
// Real sockets and wall-clock timing are the point of this test, which never runs under
// the simulator.
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use troupe_agent::{AgentCallError, AgentSpec, AgentSystem, OpenAiClient, OpenAiConfig, Role};
use troupe_core::InvokeError;

#[path = "support/fake_provider.rs"]
mod fake_provider;
use fake_provider::{read_request, respond, Behaviour, FakeServer};

/// How long a test waits for anything that should happen promptly.
const TEST_WAIT_MS_MAX: u64 = 10_000;
/// How much later than its deadline an ask may end.
const DEADLINE_SLACK_MS_MAX: u64 = 1_500;

fn completion(message: Value) -> String {
    json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    })
    .to_string()
}

fn text(text: &str) -> Behaviour {
    respond(200, &completion(json!({"role": "assistant", "content": text})))
}

/// A system with one agent, `bob`, whose model is the provider at `base_url` (request
/// timeout 30 s, `retries_max` retries with 10..=40 ms backoff).
fn system(base_url: &str, retries_max: u32, stream: bool) -> AgentSystem {
    let mut config = OpenAiConfig::new("sk-probe-secret");
    config.base_url = base_url.to_owned();
    config.model = "probe-model".to_owned();
    config.request_timeout = Duration::from_secs(30);
    config.retries_max = retries_max;
    config.retry_backoff_initial = Duration::from_millis(10);
    config.retry_backoff_max = Duration::from_millis(40);
    config.stream = stream;
    let client = OpenAiClient::new(config, troupe_runtime::Clock::new()).expect("valid config");
    AgentSystem::builder()
        .llm(Arc::new(client))
        .agent(AgentSpec::new("bob"))
        .start()
        .expect("the system starts")
}

/// The cause of a failed turn, or a panic naming what came instead.
fn failure_cause(result: Result<troupe_agent::AgentReply, AgentCallError>) -> String {
    match result {
        Err(AgentCallError::ModelFailed(failed)) => format!("the model failed: {}", failed.error),
        Err(AgentCallError::Invoke(InvokeError::ActorFailed { cause, .. })) => cause,
        other => panic!("expected the turn to fail, got {other:?}"),
    }
}

async fn assert_log_empty(system: &AgentSystem) {
    let log = system.client().conversation_log("bob").await.unwrap();
    assert!(log.is_empty(), "a failed turn committed: {log:?}");
}

/// A provider that never answers, and an ask shorter than the client's request
/// timeout: the caller gets `InvokeError::Timeout` (not the model's own timeout as a
/// failed turn), on time, every time; nothing is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_provider_ends_the_ask_with_a_typed_timeout_on_time() {
    let server = FakeServer::start(|_, _| Behaviour::Hang).await;
    let system = system(&server.base_url, 3, false);
    let timeout = Duration::from_millis(300);
    for attempt in 0..8 {
        let started = Instant::now();
        let result = system.ask_with_timeout("bob", "hello", timeout).await;
        let elapsed = started.elapsed();
        assert!(
            matches!(result, Err(AgentCallError::Invoke(InvokeError::Timeout { .. }))),
            "attempt {attempt}: expected a timeout, got {result:?}"
        );
        assert!(
            elapsed <= timeout + Duration::from_millis(DEADLINE_SLACK_MS_MAX),
            "attempt {attempt}: {elapsed:?}"
        );
    }
    assert_eq!(server.requests(), 8, "a timed-out model call is not retried");
    assert_log_empty(&system).await;
    system.shutdown().await;
}

/// A 401 fails the turn at once with the status and the provider's text, is not
/// retried, and commits nothing.
#[tokio::test]
async fn a_refused_key_fails_the_turn_with_the_status_and_commits_nothing() {
    let server = FakeServer::start(|_, _| respond(401, r#"{"error":{"message":"Incorrect API key provided"}}"#)).await;
    let system = system(&server.base_url, 3, false);

    let cause = failure_cause(system.ask("bob", "hello").await);

    assert!(cause.contains("401"), "{cause}");
    assert!(cause.contains("Incorrect API key provided"), "{cause}");
    assert!(!cause.contains("sk-probe-secret"), "{cause}");
    assert_eq!(server.requests(), 1);
    assert_log_empty(&system).await;
    system.shutdown().await;
}

/// 503, a body cut mid-way (connection closed), a 429 whose `Retry-After` is an HTTP
/// date, then an answer: the one turn succeeds after four requests, and the log holds
/// the user message and the answer once.
#[tokio::test]
async fn retried_model_calls_commit_the_turn_once() {
    let server = FakeServer::start(|index, _| match index {
        0 => respond(503, "overloaded"),
        1 => Behaviour::CutBody {
            length: 1_000,
            sent: r#"{"choices":[{"mess"#.to_owned(),
        },
        2 => Behaviour::Respond {
            status: 429,
            headers: vec![("Retry-After", "Wed, 21 Oct 2015 07:28:00 GMT".to_owned())],
            body: "slow down".to_owned(),
        },
        _ => text("hi there"),
    })
    .await;
    let system = system(&server.base_url, 3, false);

    let reply = system.ask("bob", "hello").await.unwrap();

    assert_eq!(reply.text, "hi there");
    assert_eq!(server.requests(), 4);
    let log = system.client().conversation_log("bob").await.unwrap();
    let said: Vec<(Role, &str)> = log
        .iter()
        .map(|message| (message.role, message.content.as_str()))
        .collect();
    assert_eq!(said, vec![(Role::User, "hello"), (Role::Assistant, "hi there")]);
    system.shutdown().await;
}

/// Answers that are not the protocol fail the turn, each naming what was wrong, and
/// commit nothing: no choices, a body over `RESPONSE_BODY_BYTES_MAX`, a tool call
/// without a name, a stream cut before `[DONE]`. (A tool call without an id is not
/// malformed: it gets an id of its own, `provider_leftovers.rs`.)
#[tokio::test]
async fn malformed_answers_fail_the_turn_naming_the_fault() {
    let cases: Vec<(Behaviour, bool, &str)> = vec![
        (respond(200, r#"{"choices":[]}"#), false, "no choices"),
        (
            respond(
                200,
                &format!(r#"{{"pad":"{}"}}"#, "x".repeat(troupe_agent::RESPONSE_BODY_BYTES_MAX)),
            ),
            false,
            "exceeds",
        ),
        (
            respond(
                200,
                &completion(json!({"role": "assistant", "content": null,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"arguments": "{}"}}]})),
            ),
            false,
            "not a chat completion",
        ),
        (
            Behaviour::Sse(vec![
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hal\"}}]}\n\n".to_owned(),
            ]),
            true,
            "before data: [DONE]",
        ),
    ];
    for (behaviour, stream, expected) in cases {
        let server = FakeServer::start(move |_, _| behaviour.clone()).await;
        let system = system(&server.base_url, 3, stream);
        let cause = failure_cause(system.ask("bob", "hello").await);
        assert!(cause.contains(expected), "expected {expected:?} in {cause}");
        assert_eq!(server.requests(), 1, "{cause}: a malformed answer is not retried");
        assert_log_empty(&system).await;
        system.shutdown().await;
    }
}

/// The model calls a tool the agent does not have: the model reads an `unknown tool`
/// result naming the tools there are, and the turn goes on to its answer.
#[tokio::test]
async fn a_call_of_an_unknown_tool_is_answered_to_the_model() {
    let server = FakeServer::start(|index, _| match index {
        0 => respond(
            200,
            &completion(json!({"role": "assistant", "content": null,
                "tool_calls": [{"id": "c1", "type": "function",
                                "function": {"name": "launch_rockets", "arguments": "{\"n\":1}"}}]})),
        ),
        _ => text("could not"),
    })
    .await;
    let system = system(&server.base_url, 0, false);

    let reply = system.ask("bob", "hello").await.unwrap();

    assert_eq!(reply.text, "could not");
    let bodies = server.bodies.lock().unwrap().clone();
    assert_eq!(bodies.len(), 2);
    let messages = bodies[1]["messages"].as_array().unwrap();
    let result = messages.last().unwrap();
    assert_eq!(result["role"], "tool");
    assert_eq!(result["tool_call_id"], "c1");
    let content = result["content"].as_str().unwrap();
    assert!(
        content.starts_with("error: unknown tool \"launch_rockets\"; available tools: "),
        "{content}"
    );
    system.shutdown().await;
}

/// A 200 whose body is the provider's error object (some gateways answer so) fails the
/// turn with the provider's own message, not only with "missing field `choices`".
#[tokio::test]
async fn an_error_object_under_status_200_names_the_providers_message() {
    let server = FakeServer::start(|_, _| {
        respond(
            200,
            r#"{"error":{"message":"The model `probe-model` does not exist","type":"invalid_request_error"}}"#,
        )
    })
    .await;
    let system = system(&server.base_url, 3, false);

    let cause = failure_cause(system.ask("bob", "hello").await);

    assert!(cause.contains("The model `probe-model` does not exist"), "{cause}");
    assert_eq!(server.requests(), 1);
    assert_log_empty(&system).await;
    system.shutdown().await;
}

/// An API key that cannot be sent in an HTTP header (a newline or a non-ASCII
/// character pasted into it), or a base URL that does not parse, is refused when the
/// client is built, with the reason and without the key: before, every model call
/// failed as `Unreachable` ("builder error"), after every retry.
#[tokio::test]
async fn a_key_or_url_that_cannot_be_sent_is_refused_when_the_client_is_built() {
    let server = FakeServer::start(|_, _| text("unreachable")).await;
    for key in ["sk-probe\nsecret", "sk-probe\u{2011}secret", "sk-probe\u{0}secret"] {
        let mut config = OpenAiConfig::new(key);
        config.base_url = server.base_url.clone();
        let error = OpenAiClient::new(config, troupe_runtime::Clock::new())
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(error, troupe_agent::OpenAiConfigError::InvalidApiKey { .. }),
            "{key:?}: {error:?}"
        );
        let shown = error.to_string();
        assert!(!shown.contains("secret"), "{shown}");
        assert!(shown.contains("header"), "{shown}");
    }
    for base_url in ["http://exa mple.com/v1", "http://[::1/v1", "http://host:99999/v1"] {
        let mut config = OpenAiConfig::new("sk-probe");
        config.base_url = base_url.to_owned();
        let error = OpenAiClient::new(config, troupe_runtime::Clock::new())
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(error, troupe_agent::OpenAiConfigError::InvalidBaseUrl { .. }),
            "{base_url:?}: {error:?}"
        );
    }
    assert_eq!(server.requests(), 0);
}

/// A completion with `finish_reason` `reason` (and the given message).
fn finished(message: Value, reason: &str) -> Behaviour {
    let body = json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": reason}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    });
    respond(200, &body.to_string())
}

/// An answer the provider stopped at its token limit (`finish_reason: "length"`, the
/// cap a budget sets, or the provider's own) reaches the caller marked `truncated`,
/// streamed or not; a tool call it cut (arguments that are not JSON) fails the turn
/// naming the token limit. Before, a cut answer was taken as complete
/// (`truncated: false`) and a cut call failed as arguments "not JSON" only.
#[tokio::test]
async fn an_answer_cut_at_the_token_limit_is_marked_truncated() {
    let server =
        FakeServer::start(|_, _| finished(json!({"role": "assistant", "content": "The answer is"}), "length")).await;
    let agents = system(&server.base_url, 0, false);
    let reply = agents.ask("bob", "hello").await.unwrap();
    assert_eq!(reply.text, "The answer is");
    assert!(reply.truncated, "a cut answer is marked: {reply:?}");
    agents.shutdown().await;

    let server =
        FakeServer::start(|_, _| finished(json!({"role": "assistant", "content": "All of it."}), "stop")).await;
    let agents = system(&server.base_url, 0, false);
    let reply = agents.ask("bob", "hello").await.unwrap();
    assert!(!reply.truncated, "{reply:?}");
    agents.shutdown().await;

    let server = FakeServer::start(|_, _| {
        Behaviour::Sse(vec![
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"The answer\"}}]}\n\n".to_owned(),
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\n".to_owned(),
            "data: [DONE]\n\n".to_owned(),
        ])
    })
    .await;
    let agents = system(&server.base_url, 0, true);
    let reply = agents.ask("bob", "hello").await.unwrap();
    assert_eq!(reply.text, "The answer");
    assert!(reply.truncated, "a cut streamed answer is marked: {reply:?}");
    agents.shutdown().await;

    let server = FakeServer::start(|_, _| {
        finished(
            json!({"role": "assistant", "content": null,
                   "tool_calls": [{"id": "c1", "type": "function",
                                   "function": {"name": "call_agent", "arguments": "{\"agent\": \"al"}}]}),
            "length",
        )
    })
    .await;
    let agents = system(&server.base_url, 0, false);
    let cause = failure_cause(agents.ask("bob", "hello").await);
    assert!(cause.contains("token limit"), "{cause}");
    assert_log_empty(&agents).await;
    agents.shutdown().await;
}

/// What the caller reads for the usual refusals says what to do, besides the status
/// and the provider's text: a refused key, a wrong base URL or model, a rate limit or
/// an outage that outlasted the retries, nobody listening.
#[tokio::test]
async fn provider_failures_say_what_to_check() {
    let cases: [(u16, &str, &[&str]); 4] = [
        (
            401,
            r#"{"error":{"message":"Unauthorized"}}"#,
            &["401", "Unauthorized", "API key"],
        ),
        (
            404,
            "<html>Not Found</html>",
            &["404", "Not Found", "base URL", "model"],
        ),
        (
            429,
            r#"{"error":{"message":"Rate limit reached"}}"#,
            &["429", "Rate limit reached", "retry later"],
        ),
        (
            503,
            "upstream connect error",
            &["503", "upstream connect error", "retry later"],
        ),
    ];
    for (status, body, expected) in cases {
        let server = FakeServer::start(move |_, _| respond(status, body)).await;
        let agents = system(&server.base_url, 0, false);
        let cause = failure_cause(agents.ask("bob", "hello").await);
        for part in expected {
            assert!(cause.contains(part), "{status}: expected {part:?} in {cause}");
        }
        agents.shutdown().await;
    }

    let address = {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        listener.local_addr().unwrap()
    };
    let agents = system(&format!("http://{address}/v1"), 0, false);
    let cause = failure_cause(agents.ask("bob", "hello").await);
    for part in ["unreachable", &address.to_string(), "base URL"] {
        assert!(cause.contains(part), "nobody listening: expected {part:?} in {cause}");
    }
    agents.shutdown().await;
}

/// A provider that sends a tool call's arguments as a JSON object rather than a JSON
/// string (some OpenAI-compatible servers do): the call is taken as the object says.
/// Before, the whole answer failed the turn ("invalid type: map, expected a string").
/// Arguments that are neither (a number) still fail it, naming the call.
#[tokio::test]
async fn tool_call_arguments_sent_as_an_object_are_taken() {
    let server = FakeServer::start(|index, _| match index {
        0 => respond(
            200,
            &completion(json!({"role": "assistant", "content": null,
                "tool_calls": [{"id": "c1", "type": "function",
                                "function": {"name": "lookup", "arguments": {"city": "Oslo"}}}]})),
        ),
        _ => text("done"),
    })
    .await;
    let agents = system(&server.base_url, 0, false);

    let reply = agents.ask("bob", "hello").await.unwrap();

    assert_eq!(reply.text, "done");
    let bodies = server.bodies.lock().unwrap().clone();
    let messages = bodies[1]["messages"].as_array().unwrap();
    let call = &messages[messages.len() - 2]["tool_calls"][0];
    assert_eq!(call["function"]["arguments"], r#"{"city":"Oslo"}"#);
    agents.shutdown().await;

    let server = FakeServer::start(|_, _| {
        respond(
            200,
            &completion(json!({"role": "assistant", "content": null,
                "tool_calls": [{"id": "c9", "type": "function",
                                "function": {"name": "lookup", "arguments": 42}}]})),
        )
    })
    .await;
    let agents = system(&server.base_url, 0, false);
    let cause = failure_cause(agents.ask("bob", "hello").await);
    assert!(cause.contains("\"c9\""), "{cause}");
    agents.shutdown().await;
}

/// A streamed answer whose parallel tool calls all come at index 0 (or without an
/// index), each whole and with its own id, as some OpenAI-compatible servers send
/// them: each id is a call of its own. Before, they were merged into one call whose
/// arguments were the two objects run together, and the turn failed ("trailing
/// characters").
#[tokio::test]
async fn streamed_parallel_calls_at_one_index_stay_separate_calls() {
    use troupe_agent::LlmClient;

    let chunk = |call: Value| {
        format!(
            "data: {}\n\n",
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
        )
    };
    let server = FakeServer::start(move |_, _| {
        Behaviour::Sse(vec![
            chunk(json!({"index": 0, "id": "c1", "type": "function",
                         "function": {"name": "lookup", "arguments": "{\"city\":"}})),
            chunk(json!({"index": 0, "function": {"arguments": "\"Oslo\"}"}})),
            chunk(json!({"id": "c2", "type": "function",
                         "function": {"name": "lookup", "arguments": "{\"city\":\"Bergen\"}"}})),
            "data: [DONE]\n\n".to_owned(),
        ])
    })
    .await;
    let mut config = OpenAiConfig::new("sk-probe");
    config.base_url = server.base_url.clone();
    config.stream = true;
    config.retries_max = 0;
    let clock = troupe_runtime::Clock::new();
    let client = OpenAiClient::new(config, clock).unwrap();
    let request = troupe_agent::LlmRequest {
        max_tokens: None,
        agent: troupe_core::ActorId::new("agent", "bob").unwrap(),
        model: String::new(),
        messages: vec![troupe_agent::ChatMessage::new(Role::User, "weather?")].into(),
        tools: Vec::new().into(),
        deadline: clock.deadline_in(Duration::from_secs(10)),
    };

    let reply = client.complete(request).await.unwrap();

    let calls: Vec<(&str, &str, Value)> = reply
        .message
        .tool_calls
        .iter()
        .map(|call| (call.id.as_str(), call.name.as_str(), call.arguments.clone()))
        .collect();
    assert_eq!(
        calls,
        vec![
            ("c1", "lookup", json!({"city": "Oslo"})),
            ("c2", "lookup", json!({"city": "Bergen"}))
        ]
    );
}

/// A stream that only ever sends keep-alive comments: the ask ends with a typed
/// timeout at its deadline, not when the provider would stop.
#[tokio::test]
async fn a_stream_of_keep_alives_only_ends_on_time() {
    // A comment every 20 ms, 400 of them: 8 s, far past the 300 ms ask.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Some((_, mut stream)) = read_request(stream).await else {
                    return;
                };
                let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n";
                let _ = stream.write_all(head.as_bytes()).await;
                for _ in 0..400 {
                    if stream.write_all(b": keep-alive\n\n").await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            });
        }
    });
    let agents = system(&format!("http://{address}/v1"), 3, true);
    let timeout = Duration::from_millis(300);
    let started = Instant::now();
    let result = agents.ask_with_timeout("bob", "hello", timeout).await;
    let elapsed = started.elapsed();
    assert!(
        matches!(result, Err(AgentCallError::Invoke(InvokeError::Timeout { .. }))),
        "{result:?}"
    );
    assert!(
        elapsed <= timeout + Duration::from_millis(DEADLINE_SLACK_MS_MAX),
        "{elapsed:?}"
    );
    assert_log_empty(&agents).await;
    agents.shutdown().await;
    task.abort();
}

/// Eight agents share one client (one connection pool, one jitter generator) on a
/// multi-threaded runtime while the provider fails the first eight requests with 503:
/// every agent answers, and each log holds its own question and the answer once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_sharing_one_client_through_failures_each_commit_once() {
    let server = FakeServer::start(|index, _| if index < 8 { respond(503, "busy") } else { text("ok") }).await;
    let mut config = OpenAiConfig::new("sk-probe");
    config.base_url = server.base_url.clone();
    config.retries_max = troupe_agent::OPENAI_RETRIES_MAX;
    config.retry_backoff_initial = Duration::from_millis(10);
    config.retry_backoff_max = Duration::from_millis(40);
    let client = Arc::new(OpenAiClient::new(config, troupe_runtime::Clock::new()).unwrap());
    let names: Vec<String> = (0..8).map(|index| format!("agent{index}")).collect();
    let mut builder = AgentSystem::builder().llm(client);
    for name in &names {
        builder = builder.agent(AgentSpec::new(name));
    }
    let agents = builder.start().unwrap();

    let asks: Vec<_> = names
        .iter()
        .map(|name| {
            let client = agents.client();
            let name = name.clone();
            tokio::spawn(async move { client.ask(&name, &format!("hello {name}")).await })
        })
        .collect();
    let replies = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), futures::future::join_all(asks))
        .await
        .expect("every ask ends");
    for reply in replies {
        assert_eq!(reply.unwrap().unwrap().text, "ok");
    }
    assert_eq!(server.requests(), 16, "8 failures, 8 answers");
    for name in &names {
        let log = agents.client().conversation_log(name).await.unwrap();
        let said: Vec<(Role, String)> = log
            .iter()
            .map(|message| (message.role, message.content.clone()))
            .collect();
        assert_eq!(
            said,
            vec![
                (Role::User, format!("hello {name}")),
                (Role::Assistant, "ok".to_owned())
            ]
        );
    }
    agents.shutdown().await;
}

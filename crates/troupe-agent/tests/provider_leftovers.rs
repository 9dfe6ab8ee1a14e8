//! The provider client's leftovers, as a demanding embedder meets them: tool-call ids a
//! provider sends empty or twice in one step, answers its content filter stopped, and
//! newer models that refuse `max_tokens` for `max_completion_tokens`.
//!
//! Goal: the next request always pairs every tool result with exactly one call (ids
//! present and distinct within the step); an answer the provider withheld or broke off
//! is a typed error, not an empty answer taken for a normal one; a token cap reaches a
//! model that wants `max_completion_tokens`, by setting or by one resend.
//!
//! Method: a tokio HTTP/1.1 server on `127.0.0.1:0` scripted per request (as in
//! `provider_probes.rs`), an `OpenAiClient` on the runtime's clock. Every wait is
//! bounded.
//!
//! Run: `cargo nextest run -p troupe-agent --test provider_leftovers`.

#![cfg(not(madsim))]
// Real sockets are the point of this test, which never runs under the simulator.
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use troupe_agent::{
    AgentCallError, AgentSpec, AgentSystem, ChatMessage, LlmClient, LlmError, LlmRequest, OpenAiClient, OpenAiConfig,
    Role, StreamDelta, Tool,
};
use troupe_core::InvokeError;

#[allow(dead_code)] // the answers the other provider tests use and these do not
#[path = "support/fake_provider.rs"]
mod fake_provider;
use fake_provider::{respond, Behaviour, FakeServer};

/// A completion of `message` with `finish_reason` `reason`.
fn finished(message: Value, reason: &str) -> Behaviour {
    let body = json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": reason}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    });
    respond(200, &body.to_string())
}

fn text(text: &str) -> Behaviour {
    finished(json!({"role": "assistant", "content": text}), "stop")
}

fn config(base_url: &str, stream: bool) -> OpenAiConfig {
    let mut config = OpenAiConfig::new("sk-probe-secret");
    config.base_url = base_url.to_owned();
    config.model = "probe-model".to_owned();
    config.request_timeout = Duration::from_secs(30);
    config.retries_max = 0;
    config.stream = stream;
    config
}

/// A system with one agent, `bob`, whose model is the provider at `base_url`, and a
/// tool `lookup` that answers `weather in {city}`.
fn system(base_url: &str, stream: bool) -> AgentSystem {
    let client = OpenAiClient::new(config(base_url, stream), troupe_runtime::Clock::new()).expect("valid config");
    let lookup = Tool::from_fn(
        "lookup",
        "Looks up the weather of a city.",
        json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
        |_context, arguments: Value| async move { Ok(format!("weather in {}", arguments["city"].as_str().unwrap_or("?"))) },
    );
    AgentSystem::builder()
        .llm(Arc::new(client))
        .tool(lookup)
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

fn call(id: &str, city: &str) -> Value {
    json!({"id": id, "type": "function",
           "function": {"name": "lookup", "arguments": json!({"city": city}).to_string()}})
}

/// The ids of the calls in the second request's assistant message, and for each tool
/// result after it, its `tool_call_id` and its text; asserts every result answers the
/// call at its position and the ids are present and distinct.
fn pairs_of_second_request(bodies: &[Value], cities: &[&str]) -> Vec<String> {
    assert_eq!(bodies.len(), 2, "a tool step, then the answer");
    let messages = bodies[1]["messages"].as_array().unwrap();
    let position = messages
        .iter()
        .position(|message| message["role"] == "assistant")
        .expect("the tool-calling message is sent back");
    let ids: Vec<String> = messages[position]["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|call| call["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids.len(), cities.len(), "{ids:?}");
    let results = &messages[position + 1..];
    assert_eq!(results.len(), cities.len(), "a result per call: {results:?}");
    for (index, (id, result)) in ids.iter().zip(results).enumerate() {
        assert!(!id.is_empty(), "call {index} has an empty id: {ids:?}");
        assert!(
            ids.iter().filter(|other| *other == id).count() == 1,
            "id {id:?} is repeated in the step: {ids:?}"
        );
        assert_eq!(result["role"], "tool");
        assert_eq!(result["tool_call_id"].as_str(), Some(id.as_str()), "result {index}");
        assert_eq!(
            result["content"].as_str(),
            Some(format!("weather in {}", cities[index]).as_str()),
            "result {index} answers its own call"
        );
    }
    ids
}

/// One step's tool calls with empty ids and a repeated id: the next request sends each
/// call with an id of its own (the provider's when it is present and first, otherwise
/// one made from the step and the call's position, the same on every run) and each
/// result under its call's id. Before, the results were sent under `""` and `"dup"`
/// twice, which a provider refuses (empty id) or cannot pair with their calls.
#[tokio::test]
async fn empty_and_repeated_tool_call_ids_get_ids_of_their_own() {
    let cities = ["Oslo", "Bergen", "Rome", "Paris"];
    let mut runs = Vec::new();
    for _ in 0..2 {
        let server = FakeServer::start(move |index, _| match index {
            0 => finished(
                json!({"role": "assistant", "content": null,
                       "tool_calls": [call("", "Oslo"), call("", "Bergen"), call("dup", "Rome"), call("dup", "Paris")]}),
                "tool_calls",
            ),
            _ => text("done"),
        })
        .await;
        let system = system(&server.base_url, false);
        let reply = system.ask("bob", "weather?").await.unwrap();
        assert_eq!(reply.text, "done");
        let bodies = server.bodies.lock().unwrap().clone();
        let ids = pairs_of_second_request(&bodies, &cities);
        assert_eq!(ids[2], "dup", "a present, first id is the provider's own");
        // The log keeps the same pairs (later turns send them again).
        let log = system.client().conversation_log("bob").await.unwrap();
        let logged: Vec<String> = log
            .iter()
            .flat_map(|message| message.tool_calls.iter().map(|call| call.id.clone()))
            .collect();
        assert_eq!(logged, ids);
        let answered: Vec<String> = log.iter().filter_map(|message| message.tool_call_id.clone()).collect();
        assert_eq!(answered, ids);
        system.shutdown().await;
        runs.push(ids);
    }
    assert_eq!(runs[0], runs[1], "the ids made are the same on every run");
}

/// A non-streamed answer whose tool calls carry no `id` field, or `"id": null` (some
/// OpenAI-compatible servers): the calls run, and each gets the id a call with an empty
/// id gets, `call_{step}_{index}`, its result sent under it. Before, the whole answer
/// was `LlmError::Malformed` ("missing field `id`") and the turn failed.
#[tokio::test]
async fn tool_calls_without_an_id_field_get_ids_of_their_own() {
    let cities = ["Oslo", "Bergen"];
    let server = FakeServer::start(move |index, _| match index {
        0 => {
            let mut first = call("", "Oslo");
            first.as_object_mut().unwrap().remove("id");
            let mut second = call("", "Bergen");
            second["id"] = Value::Null;
            finished(
                json!({"role": "assistant", "content": null, "tool_calls": [first, second]}),
                "tool_calls",
            )
        }
        _ => text("done"),
    })
    .await;
    let system = system(&server.base_url, false);
    let reply = system.ask("bob", "weather?").await.unwrap();
    assert_eq!(reply.text, "done");
    let bodies = server.bodies.lock().unwrap().clone();
    let ids = pairs_of_second_request(&bodies, &cities);
    assert_eq!(ids, ["call_1_0", "call_1_1"]);
    system.shutdown().await;
}

/// Streamed calls at two indices that carry no id at all (some local servers): each
/// gets an id of its own and its result is sent under it. Before, both went out as
/// `""`.
#[tokio::test]
async fn streamed_tool_calls_without_ids_get_ids_of_their_own() {
    let chunk = |call: Value| {
        format!(
            "data: {}\n\n",
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
        )
    };
    let server = FakeServer::start(move |index, _| match index {
        0 => Behaviour::Sse(vec![
            chunk(json!({"index": 0, "type": "function",
                         "function": {"name": "lookup", "arguments": "{\"city\":\"Oslo\"}"}})),
            chunk(json!({"index": 1, "type": "function",
                         "function": {"name": "lookup", "arguments": "{\"city\":\"Bergen\"}"}})),
            "data: [DONE]\n\n".to_owned(),
        ]),
        _ => Behaviour::Sse(vec![
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"done\"}}]}\n\n".to_owned(),
            "data: [DONE]\n\n".to_owned(),
        ]),
    })
    .await;
    let system = system(&server.base_url, true);
    let reply = system.ask("bob", "weather?").await.unwrap();
    assert_eq!(reply.text, "done");
    let bodies = server.bodies.lock().unwrap().clone();
    pairs_of_second_request(&bodies, &["Oslo", "Bergen"]);
    system.shutdown().await;
}

/// An answer the provider's content filter stopped (`finish_reason:
/// "content_filter"`), streamed or not, or one it broke off (`"error"`), fails the turn
/// naming the reason, and commits nothing. Before, the empty (or partial) text was the
/// agent's answer, as if complete.
#[tokio::test]
async fn an_answer_the_provider_stopped_early_fails_the_turn_naming_why() {
    let cases: Vec<(Behaviour, bool, &str)> = vec![
        (
            finished(json!({"role": "assistant", "content": ""}), "content_filter"),
            false,
            "content_filter",
        ),
        (
            finished(
                json!({"role": "assistant", "content": "The recipe starts with"}),
                "content_filter",
            ),
            false,
            "content_filter",
        ),
        (
            Behaviour::Sse(vec![
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"The recipe\"}}]}\n\n".to_owned(),
                "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"content_filter\"}]}\n\n".to_owned(),
                "data: [DONE]\n\n".to_owned(),
            ]),
            true,
            "content_filter",
        ),
        (
            finished(json!({"role": "assistant", "content": "Half an"}), "error"),
            false,
            "\"error\"",
        ),
    ];
    for (behaviour, stream, expected) in cases {
        let server = FakeServer::start(move |_, _| behaviour.clone()).await;
        let system = system(&server.base_url, stream);
        let cause = failure_cause(system.ask("bob", "hello").await);
        assert!(cause.contains(expected), "expected {expected:?} in {cause}");
        assert_eq!(server.requests(), 1, "{cause}: not retried");
        assert_log_empty(&system).await;
        system.shutdown().await;
    }
}

fn request(clock: &troupe_runtime::Clock, max_tokens: Option<u64>) -> LlmRequest {
    LlmRequest {
        max_tokens,
        agent: troupe_core::ActorId::new("agent", "bob").unwrap(),
        model: String::new(),
        messages: vec![ChatMessage::new(Role::User, "hello")].into(),
        tools: Vec::new().into(),
        deadline: clock.deadline_in(Duration::from_secs(10)),
    }
}

/// What OpenAI answers a newer model (o1, o3, gpt-5) sent `max_tokens`.
const MAX_TOKENS_REFUSED: &str = r#"{"error":{"message":"Unsupported parameter: 'max_tokens' is not supported with this model. Use 'max_completion_tokens' instead.","type":"invalid_request_error","param":"max_tokens","code":"unsupported_parameter"}}"#;

/// A provider like OpenAI's newer models: `max_tokens` is a 400, `max_completion_tokens`
/// is taken.
async fn refusing_max_tokens() -> FakeServer {
    FakeServer::start(|_, body| {
        if body.get("max_tokens").is_some() {
            respond(400, MAX_TOKENS_REFUSED)
        } else {
            text("capped")
        }
    })
    .await
}

/// A model that refuses `max_tokens` with OpenAI's 400: the call is sent once more at
/// once with `max_completion_tokens` (the same cap), and the client's later calls (its
/// clones' too) send that field from the start. Before, every call with a token cap
/// (every turn of an agent with a token budget) failed with the 400.
#[tokio::test]
async fn a_model_that_refuses_max_tokens_gets_max_completion_tokens() {
    let server = refusing_max_tokens().await;
    let clock = troupe_runtime::Clock::new();
    let client = OpenAiClient::new(config(&server.base_url, false), clock).unwrap();

    let reply = client.complete(request(&clock, Some(500))).await;

    let reply = reply.unwrap_or_else(|error| panic!("the capped call failed: {error}"));
    assert_eq!(reply.message.content, "capped");
    let bodies = server.bodies.lock().unwrap().clone();
    assert_eq!(bodies.len(), 2, "one resend: {bodies:?}");
    assert_eq!(bodies[0]["max_tokens"], 500);
    assert_eq!(bodies[1]["max_completion_tokens"], 500);
    assert!(bodies[1].get("max_tokens").is_none(), "{}", bodies[1]);

    // Learned: the next call, from a clone, goes with the right field at once.
    let clone = client.clone();
    clone.complete(request(&clock, Some(40))).await.unwrap();
    let bodies = server.bodies.lock().unwrap().clone();
    assert_eq!(bodies.len(), 3, "{bodies:?}");
    assert_eq!(bodies[2]["max_completion_tokens"], 40);
}

/// Another 400 is not resent (one request), and a call without a cap sends neither
/// field.
#[tokio::test]
async fn only_the_refusal_of_the_token_field_is_resent() {
    let server = FakeServer::start(|_, _| respond(400, r#"{"error":{"message":"messages must not be empty"}}"#)).await;
    let clock = troupe_runtime::Clock::new();
    let client = OpenAiClient::new(config(&server.base_url, false), clock).unwrap();
    let error = client.complete(request(&clock, Some(500))).await.unwrap_err();
    assert!(matches!(error, LlmError::Provider { status: 400, .. }), "{error:?}");
    assert_eq!(server.requests(), 1);

    let server = refusing_max_tokens().await;
    let client = OpenAiClient::new(config(&server.base_url, false), clock).unwrap();
    client.complete(request(&clock, None)).await.unwrap();
    let bodies = server.bodies.lock().unwrap().clone();
    assert_eq!(bodies.len(), 1);
    assert!(bodies[0].get("max_tokens").is_none() && bodies[0].get("max_completion_tokens").is_none());
}

/// The client's caller sees the reason typed: `LlmError::StoppedEarly` with
/// `EarlyStop::ContentFilter` (or `Error`), the provider's `finish_reason` and how much
/// text had arrived; `"stop"`, `"tool_calls"` and a value the client does not know are
/// complete answers.
#[tokio::test]
async fn the_reason_an_answer_stopped_early_is_typed() {
    use troupe_agent::EarlyStop;

    let clock = troupe_runtime::Clock::new();
    let cases = [
        ("content_filter", Some(EarlyStop::ContentFilter)),
        ("error", Some(EarlyStop::Error)),
        ("stop", None),
        ("tool_calls", None),
        ("a_reason_from_the_future", None),
    ];
    for (reason, early) in cases {
        let server =
            FakeServer::start(move |_, _| finished(json!({"role": "assistant", "content": "Part"}), reason)).await;
        let client = OpenAiClient::new(config(&server.base_url, false), clock).unwrap();
        let outcome = client.complete(request(&clock, None)).await;
        match early {
            Some(expected) => assert_eq!(
                outcome,
                Err(LlmError::StoppedEarly {
                    reason: expected,
                    finish_reason: reason.to_owned(),
                    partial_bytes: 4,
                }),
                "{reason}"
            ),
            None => assert_eq!(outcome.unwrap().message.content, "Part", "{reason}"),
        }
    }
}

/// The field is a setting too: `OpenAiConfig::token_cap_field` (or
/// `with_token_cap_field`, or `OPENAI_TOKEN_CAP_FIELD`) sends `max_completion_tokens`
/// from the first request; a value that is neither field is refused.
#[tokio::test]
async fn the_token_cap_field_is_a_setting() {
    use troupe_agent::TokenCapField;

    let server = refusing_max_tokens().await;
    let clock = troupe_runtime::Clock::new();
    let config = config(&server.base_url, false).with_token_cap_field(TokenCapField::MaxCompletionTokens);
    let client = OpenAiClient::new(config, clock).unwrap();
    client.complete(request(&clock, Some(64))).await.unwrap();
    let bodies = server.bodies.lock().unwrap().clone();
    assert_eq!(bodies.len(), 1, "{bodies:?}");
    assert_eq!(bodies[0]["max_completion_tokens"], 64);

    let lookup = |field: &'static str| {
        move |name: &str| match name {
            "OPENAI_API_KEY" => Some("k".to_owned()),
            "OPENAI_TOKEN_CAP_FIELD" => Some(field.to_owned()),
            _ => None,
        }
    };
    let config = OpenAiConfig::from_lookup(lookup("max_completion_tokens")).unwrap();
    assert_eq!(config.token_cap_field, TokenCapField::MaxCompletionTokens);
    let config = OpenAiConfig::from_lookup(lookup("max_tokens")).unwrap();
    assert_eq!(config.token_cap_field, TokenCapField::MaxTokens);
    let error = OpenAiConfig::from_lookup(lookup("max_output_tokens")).unwrap_err();
    assert!(
        matches!(
            error,
            troupe_agent::OpenAiConfigError::InvalidEnv {
                name: "OPENAI_TOKEN_CAP_FIELD",
                ..
            }
        ),
        "{error:?}"
    );
}

/// Eight calls at once on one client (multi-threaded runtime), to a model that refuses
/// `max_tokens`: every call is answered, none needs more than its one resend, and the
/// client sends `max_completion_tokens` from then on. Before, all eight failed with
/// the 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_switch_the_token_cap_field_each_at_most_once() {
    let server = refusing_max_tokens().await;
    let clock = troupe_runtime::Clock::new();
    let client = OpenAiClient::new(config(&server.base_url, false), clock).unwrap();
    let calls: Vec<_> = (0..8_u64)
        .map(|index| {
            let client = client.clone();
            tokio::spawn(async move { client.complete(request(&clock, Some(100 + index))).await })
        })
        .collect();
    for call in calls {
        let reply = call.await.unwrap().unwrap_or_else(|error| panic!("{error}"));
        assert_eq!(reply.message.content, "capped");
    }
    let requests = server.requests();
    assert!((9..=16).contains(&requests), "{requests} requests for 8 calls");
    client.complete(request(&clock, Some(7))).await.unwrap();
    let bodies = server.bodies.lock().unwrap().clone();
    assert_eq!(bodies.len(), requests + 1);
    assert_eq!(bodies.last().unwrap()["max_completion_tokens"], 7);
}

/// A provider that answers 429 with `Retry-After` (after the client's retries): the
/// embedder's ask is `AgentCallError::ModelFailed` with the status, the body and the
/// wait the provider asked for, and the call is not answered with `ActorFailed` text.
/// Before, it was `Invoke(ActorFailed { cause: "the model failed: the model provider
/// answered 429 ..." })`, and the wait was not kept.
#[tokio::test]
async fn a_rate_limited_model_reaches_the_embedder_typed_with_its_wait() {
    let server = FakeServer::start(|_, _| Behaviour::Respond {
        status: 429,
        headers: vec![("retry-after", "2".to_owned())],
        body: "{\"error\": {\"message\": \"Rate limit reached\"}}".to_owned(),
    })
    .await;
    let system = system(&server.base_url, false);
    match system.ask("bob", "hello").await {
        Err(AgentCallError::ModelFailed(troupe_agent::ModelFailed { agent, error })) => {
            assert_eq!(agent.key(), "bob");
            assert_eq!(
                error,
                LlmError::Provider {
                    status: 429,
                    body: "{\"error\": {\"message\": \"Rate limit reached\"}}".to_owned(),
                    retry_after_ms: Some(2_000),
                }
            );
            assert_eq!(error.kind(), "rate_limited");
        }
        other => panic!("expected ModelFailed, got {other:?}"),
    }
    assert_log_empty(&system).await;
    system.shutdown().await;
}

/// A stream observer learns how each streamed answer ended, after its deltas
/// (`StreamDelta::End`): a `content_filter` finish reason after text it showed is
/// `Err(StoppedEarly)` (the text is no answer, to be withdrawn); a complete answer is
/// `Ok`. Before, the observer saw "The recipe" and then nothing: it could not tell a
/// withheld answer from a complete one.
#[tokio::test]
async fn a_stream_observer_learns_that_the_stream_was_stopped() {
    let stopped = vec![
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"The recipe\"}}]}\n\n".to_owned(),
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"content_filter\"}]}\n\n".to_owned(),
        "data: [DONE]\n\n".to_owned(),
    ];
    let complete = vec![
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"done\"}}]}\n\n".to_owned(),
        "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n".to_owned(),
        "data: [DONE]\n\n".to_owned(),
    ];
    let server = FakeServer::start(move |index, _| match index {
        0 => Behaviour::Sse(stopped.clone()),
        _ => Behaviour::Sse(complete.clone()),
    })
    .await;
    let seen: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let observer = {
        let seen = seen.clone();
        move |_agent: &troupe_core::ActorId, delta: &StreamDelta<'_>| {
            let said = match delta {
                StreamDelta::Text(text) => format!("text {text}"),
                StreamDelta::ToolCall { .. } => "tool call".to_owned(),
                StreamDelta::End { outcome: Ok(()) } => "end ok".to_owned(),
                StreamDelta::End { outcome: Err(error) } => format!("end {error:?}"),
            };
            seen.lock().unwrap().push(said);
        }
    };
    let clock = troupe_runtime::Clock::new();
    let client = OpenAiClient::new(config(&server.base_url, true), clock)
        .expect("valid config")
        .with_stream_observer(Arc::new(observer));

    let error = client.complete(request(&clock, None)).await.unwrap_err();
    assert!(matches!(error, LlmError::StoppedEarly { .. }), "{error:?}");
    let reply = client.complete(request(&clock, None)).await.unwrap();
    assert_eq!(reply.message.content, "done");
    let ended_early = format!("end {error:?}");
    assert_eq!(
        *seen.lock().unwrap(),
        ["text The recipe", ended_early.as_str(), "text done", "end ok"]
    );
}

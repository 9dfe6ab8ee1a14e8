//! One trace id per request: a request entering `troupe serve` (REST message, OpenAI
//! chat completion, A2A `SendMessage`) gets one (its `traceparent` header's, A2A
//! `metadata.troupe.trace_id`, or a new one), the response names it
//! (`x-troupe-trace-id`, the A2A task's `metadata.troupe.trace_id`), and every agent
//! turn of the request runs under it: observed on the runtime's `turn` tracing spans,
//! captured by a `tracing-subscriber` layer installed for the test process.
//!
//! Normal build only: HTTP is not simulated.
#![cfg(not(madsim))]

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use serde_json::{json, Value};
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::Layer;
use troupe_agent::{ScriptRule, ScriptedLlm};
use troupe_core::TraceId;
use troupe_runtime::KindConfig;
use troupe_server::{ServerConfig, TRACE_ID_HEADER};

mod support;
use support::{Harness, POLL_MS, TEST_WAIT_MS_MAX};

/// A `turn` span: its actor and trace id (empty when it had none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct TurnSpan {
    actor: String,
    trace_id: String,
}

#[derive(Default)]
struct TurnFields(TurnSpan);

impl Visit for TurnFields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "actor" => self.0.actor = format!("{value:?}"),
            "trace_id" => self.0.trace_id = format!("{value:?}"),
            _ => {}
        }
    }
}

/// Records every `turn` span opened in this process.
struct Turns(Arc<Mutex<Vec<TurnSpan>>>);

impl<S: tracing::Subscriber> Layer<S> for Turns {
    fn on_new_span(&self, attrs: &tracing::span::Attributes<'_>, _: &tracing::span::Id, _: Context<'_, S>) {
        if attrs.metadata().name() == "turn" {
            let mut fields = TurnFields::default();
            attrs.record(&mut fields);
            self.0.lock().unwrap().push(fields.0);
        }
    }
}

/// The turn spans seen so far (the subscriber is installed once per process).
fn turns() -> Arc<Mutex<Vec<TurnSpan>>> {
    static TURNS: OnceLock<Arc<Mutex<Vec<TurnSpan>>>> = OnceLock::new();
    Arc::clone(TURNS.get_or_init(|| {
        let turns = Arc::new(Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::registry().with(Turns(Arc::clone(&turns)));
        tracing::subscriber::set_global_default(subscriber).expect("no other subscriber in this test binary");
        turns
    }))
}

/// The agents (by key) whose turns ran under `trace`.
fn agents_traced(trace: &str) -> Vec<String> {
    let mut agents: Vec<String> = turns()
        .lock()
        .unwrap()
        .iter()
        .filter(|turn| turn.trace_id == trace)
        .map(|turn| turn.actor.rsplit('/').next().unwrap_or_default().to_string())
        .collect();
    agents.sort();
    agents.dedup();
    agents
}

fn script() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(ScriptRule::agent("echo").reply("echo: {input}"))
        .rule(ScriptRule::agent("caller").on_user_containing("").call(
            "call_agent",
            json!({"agent_id": "echo", "message": "from caller: {input}"}),
        ))
        .rule(
            ScriptRule::agent("caller")
                .on_tool_result()
                .reply("caller heard: {tool_result}"),
        )
}

async fn start() -> Harness {
    let _ = turns();
    Harness::start(
        support::agents(script(), &["echo", "caller"], KindConfig::default()),
        ServerConfig::default(),
    )
    .await
}

/// POSTs `body` to `path` (with `traceparent` when given): status, trace id header, body.
async fn post(server: &Harness, path: &str, body: Value, traceparent: Option<&str>) -> (u16, String, Value) {
    let mut request = server
        .request(reqwest::Method::POST, path)
        .header("content-type", "application/json")
        .header("A2A-Version", "1.0")
        .body(body.to_string());
    if let Some(traceparent) = traceparent {
        request = request.header("traceparent", traceparent);
    }
    let response = request.send().await.expect("the server answers");
    let status = response.status().as_u16();
    let trace = response
        .headers()
        .get(TRACE_ID_HEADER)
        .map(|value| value.to_str().unwrap().to_string())
        .unwrap_or_default();
    let body = serde_json::from_str(&response.text().await.unwrap()).unwrap();
    (status, trace, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rest_message_gets_a_trace_id_that_every_turn_of_its_request_runs_under() {
    let server = start().await;
    let (status, first, body) = post(&server, "/v1/agents/caller/messages", json!({"text": "hi"}), None).await;
    assert_eq!(status, 200, "{body}");
    assert!(TraceId::parse_hex(&first).is_some(), "a new trace id in hex: {first:?}");
    assert_eq!(agents_traced(&first), ["caller", "echo"], "both turns of the request");

    let (status, second, _) = post(&server, "/v1/agents/caller/messages", json!({"text": "again"}), None).await;
    assert_eq!(status, 200);
    assert!(TraceId::parse_hex(&second).is_some());
    assert_ne!(first, second, "each request its own trace id");
    assert_eq!(agents_traced(&second), ["caller", "echo"]);

    // A W3C traceparent names the trace.
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let (status, given, _) = post(
        &server,
        "/v1/agents/caller/messages",
        json!({"text": "traced"}),
        Some(traceparent),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(given, "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(agents_traced(&given), ["caller", "echo"]);

    // An invalid one is ignored: a new id.
    let (status, fresh, _) = post(
        &server,
        "/v1/agents/echo/messages",
        json!({"text": "x"}),
        Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
    )
    .await;
    assert_eq!(status, 200);
    assert!(TraceId::parse_hex(&fresh).is_some(), "{fresh:?}");
    assert_eq!(agents_traced(&fresh), ["echo"]);

    // A request refused before it runs (an empty text) has none.
    let (status, failed, _) = post(&server, "/v1/agents/echo/messages", json!({"text": ""}), None).await;
    assert_eq!(status, 422);
    assert_eq!(failed, "", "a request refused before it runs has no trace id");
    server.stop().await;
}

/// How many turns of each agent (by key) ran under `trace`, by agent.
fn turns_traced(trace: &str) -> std::collections::BTreeMap<String, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for turn in turns().lock().unwrap().iter().filter(|turn| turn.trace_id == trace) {
        let agent = turn.actor.rsplit('/').next().unwrap_or_default().to_string();
        *counts.entry(agent).or_insert(0) += 1;
    }
    counts
}

/// Waits until `done` holds for the turns traced under `trace` (at most
/// `TEST_WAIT_MS_MAX`), then returns them.
async fn wait_for_turns(
    trace: &str,
    done: impl Fn(&std::collections::BTreeMap<String, usize>) -> bool,
) -> std::collections::BTreeMap<String, usize> {
    let waited = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let counts = turns_traced(trace);
            if done(&counts) {
                return counts;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    })
    .await;
    waited.unwrap_or_else(|_| panic!("turns under {trace}: {:?}", turns_traced(trace)))
}

/// Goal: a notification and a delegation sent over REST run under the request's trace
/// id, which the 202 names: the turn that processes the notification; the delegating
/// turn, the task's turn at the delegatee, and the delegator's turn on the result
/// (which comes back under the task's trace).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rest_notification_and_delegation_run_under_the_requests_trace_id() {
    let server = start().await;
    let notified = "1bf92f3577b34da6a3ce929d0e0e4736";
    let (status, trace, body) = post(
        &server,
        "/v1/agents/echo/notify",
        json!({"text": "fyi", "msg_id": "n-1"}),
        Some(&format!("00-{notified}-00f067aa0ba902b7-01")),
    )
    .await;
    assert_eq!((status, trace.as_str()), (202, notified), "{body}");
    let counts = wait_for_turns(notified, |counts| counts.contains_key("echo")).await;
    assert_eq!(counts.keys().collect::<Vec<_>>(), ["echo"], "{counts:?}");

    // Without a traceparent: a new id, named by the response, and the turn runs under it.
    let (status, fresh, body) = post(&server, "/v1/agents/echo/notify", json!({"text": "again"}), None).await;
    assert_eq!(status, 202, "{body}");
    assert!(TraceId::parse_hex(&fresh).is_some(), "{fresh:?}");
    wait_for_turns(&fresh, |counts| counts.contains_key("echo")).await;

    let delegated = "2bf92f3577b34da6a3ce929d0e0e4736";
    let (status, trace, body) = post(
        &server,
        "/v1/agents/caller/tasks",
        json!({"to": "echo", "text": "do it"}),
        Some(&format!("00-{delegated}-00f067aa0ba902b7-01")),
    )
    .await;
    assert_eq!((status, trace.as_str()), (202, delegated), "{body}");
    let task = body["task_id"].as_str().unwrap().to_string();
    // The delegating turn and the result's turn at the caller, the task's at echo.
    let counts = wait_for_turns(delegated, |counts| {
        counts.get("caller").copied().unwrap_or(0) >= 2 && counts.contains_key("echo")
    })
    .await;
    assert!(
        counts.keys().all(|agent| agent == "caller" || agent == "echo"),
        "{counts:?}"
    );
    // The result's turn has started (its span opened); it commits the task's outcome
    // when it ends.
    let waited = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let (status, record) = server.get(&format!("/v1/agents/caller/tasks/{task}")).await;
            assert_eq!(status, 200, "{record}");
            if record["state"] != "submitted" && record["state"] != "working" {
                return record;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    })
    .await;
    let record = waited.expect("the task ended in time");
    assert_eq!(record["state"], "completed", "{record}");

    // A request refused before it runs (an unknown target) still names its trace.
    let (status, refused, _) = post(
        &server,
        "/v1/agents/caller/tasks",
        json!({"to": "nobody", "text": "x"}),
        None,
    )
    .await;
    assert_eq!(status, 404);
    assert!(TraceId::parse_hex(&refused).is_some(), "{refused:?}");
    server.stop().await;
}

/// Goal: a post to a conversation over REST runs under the request's trace id, which
/// the response names, and so does the turn of the agent it mentions (delivered later
/// by the conversation's delivery task, from the relay record the post stored); a
/// refused post names its trace too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rest_post_to_a_conversation_and_the_turn_it_mentions_run_under_the_requests_trace_id() {
    let server = start().await;
    let (status, _, body) = post(
        &server,
        "/v1/conversations",
        json!({"id": "room", "kind": "group", "participants": [
            {"kind": "human", "name": "hugo"}, {"kind": "agent", "name": "echo"}]}),
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let posted = "3bf92f3577b34da6a3ce929d0e0e4736";
    let (status, trace, body) = post(
        &server,
        "/v1/conversations/room/messages",
        json!({"sender": {"kind": "human", "name": "hugo"}, "msg_id": "m1", "text": "@echo hello"}),
        Some(&format!("00-{posted}-00f067aa0ba902b7-01")),
    )
    .await;
    assert_eq!((status, trace.as_str()), (200, posted), "{body}");
    // The conversation's turns (the post, the relay, the delivery's report, echo's
    // reply) and echo's turn on the mention.
    let counts = wait_for_turns(posted, |counts| counts.contains_key("echo")).await;
    assert!(counts.contains_key("room"), "{counts:?}");
    assert!(counts.keys().all(|key| key == "room" || key == "echo"), "{counts:?}");

    // Refused (the sender takes no part): the response still names its trace.
    let (status, refused, body) = post(
        &server,
        "/v1/conversations/room/messages",
        json!({"sender": {"kind": "human", "name": "mallory"}, "msg_id": "m2", "text": "hi"}),
        None,
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert!(TraceId::parse_hex(&refused).is_some(), "{refused:?}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_openai_chat_completion_names_its_trace_id() {
    let server = start().await;
    let body = json!({"model": "caller", "messages": [{"role": "user", "content": "hi"}]});
    let (status, trace, answer) = post(&server, "/v1/chat/completions", body, None).await;
    assert_eq!(status, 200, "{answer}");
    assert!(TraceId::parse_hex(&trace).is_some(), "{trace:?}");
    assert_eq!(agents_traced(&trace), ["caller", "echo"]);
    server.stop().await;
}

fn a2a_send(message_id: &str, troupe: Option<Value>) -> Value {
    let mut message = json!({"messageId": message_id, "role": "ROLE_USER", "parts": [{"text": "hi"}]});
    if let Some(troupe) = troupe {
        message["metadata"] = json!({ "troupe": troupe });
    }
    json!({"jsonrpc": "2.0", "id": "r1", "method": "SendMessage", "params": {"message": message}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_a2a_message_continues_the_callers_trace_id_and_its_task_names_it() {
    let server = start().await;
    let trace = "0af7651916cd43dd8448eb211c80319c";
    let (status, _, answer) = post(
        &server,
        "/a2a/caller",
        a2a_send("m1", Some(json!({"chain": ["far"], "depth": 1, "trace_id": trace}))),
        None,
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let task = &answer["result"]["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{answer}");
    assert_eq!(task["metadata"]["troupe"]["trace_id"], trace, "{answer}");
    assert_eq!(agents_traced(trace), ["caller", "echo"]);

    // An older caller's free-form per-call id is accepted but not continued: a new one.
    let (status, _, answer) = post(
        &server,
        "/a2a/echo",
        a2a_send(
            "m2",
            Some(json!({"chain": ["far"], "depth": 1, "trace_id": "far-call-7"})),
        ),
        None,
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let fresh = answer["result"]["task"]["metadata"]["troupe"]["trace_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(TraceId::parse_hex(&fresh).is_some(), "{answer}");
    assert_eq!(agents_traced(&fresh), ["echo"]);

    // Without metadata: the traceparent header's (another id than the other tests' header:
    // the turns of every test in this process are captured together).
    let traceparent = "00-5cf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let (status, _, answer) = post(&server, "/a2a/echo", a2a_send("m3", None), Some(traceparent)).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["result"]["task"]["metadata"]["troupe"]["trace_id"],
        "5cf92f3577b34da6a3ce929d0e0e4736"
    );
    assert_eq!(agents_traced("5cf92f3577b34da6a3ce929d0e0e4736"), ["echo"]);
    server.stop().await;
}

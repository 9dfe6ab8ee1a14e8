//! OpenTelemetry export (feature `otel`) end to end: a real `troupe_server::serve` with
//! the `otel` layer installed, one request whose agent calls another, and an in-process
//! OTLP/HTTP collector (an axum route on 127.0.0.1 decoding the protobuf with
//! `opentelemetry-proto`) that receives the spans.
//!
//! `cargo nextest run -p troupe-server --features otel -E 'test(otel)'` (scripts/test
//! runs it). Normal build only.
#![cfg(all(feature = "otel", not(madsim)))]

use std::collections::{BTreeSet, HashMap};

use opentelemetry_proto::tonic::trace::v1::Span;
use serde_json::json;
use troupe_agent::{ScriptRule, ScriptedLlm};
use troupe_runtime::KindConfig;
use troupe_server::ServerConfig;

mod otlp;
mod support;
use otlp::{attribute, collector, hex, text, trace_id_of};
use support::Harness;

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

/// The actor an `invoke` span calls: its `target` field (the exporter also writes the
/// span's tracing target under the same key).
fn invoke_target(span: &Span) -> Option<String> {
    span.attributes
        .iter()
        .filter(|attribute| attribute.key == "target")
        .map(|attribute| text(attribute.value.as_ref().and_then(|v| v.value.as_ref())))
        .find(|value| !value.starts_with("troupe_"))
}

/// A W3C `traceparent` a traced caller sends: its trace and its span.
const CALLERS_TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const CALLERS_TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLERS_SPAN_ID: &str = "00f067aa0ba902b7";
/// The trace id an A2A message names in its `metadata.troupe` (another than the caller's).
const MESSAGE_TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";

/// Goal: the spans of one request reach an OTLP/HTTP collector as protobuf: the
/// request's `http_request` is the root of one trace holding the `invoke`, `turn`,
/// `model_call` and `tool_call` spans of both agents (each span's parent in the same
/// trace), and the callee's `turn` carries the call chain (the caller), the caller's an empty one.
/// A request with a W3C `traceparent` joins the caller's trace instead: its
/// `http_request` span has the caller's trace id and span as parent, the trace id the
/// response names in `x-troupe-trace-id`. An A2A message that names its own trace id is
/// exported in that trace (the one its task names), even with a `traceparent` of
/// another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otel_exports_one_trace_per_request_with_the_call_chain() {
    let (endpoint, received) = collector().await;
    let guard = otlp::install(&endpoint, "troupe-otel-test");

    let builder = support::agents(script(), &["caller", "echo"], KindConfig::default());
    let server = Harness::start(builder, ServerConfig::default()).await;
    let answered = server
        .request(reqwest::Method::POST, "/v1/agents/caller/messages")
        .json(&json!({"text": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(answered.status(), 200);
    let untraced_trace_id = trace_id_of(&answered).expect("the response names its trace id");
    let reply: serde_json::Value = answered.json().await.unwrap();
    assert_eq!(
        reply["text"],
        "caller heard: echo: [message from agent caller] from caller: hi"
    );
    // A second request from a caller that is itself traced: a W3C `traceparent`.
    let answered = server
        .request(reqwest::Method::POST, "/v1/agents/echo/messages")
        .header("traceparent", CALLERS_TRACEPARENT)
        .json(&json!({"text": "traced"}))
        .send()
        .await
        .unwrap();
    assert_eq!(answered.status(), 200);
    assert_eq!(trace_id_of(&answered).as_deref(), Some(CALLERS_TRACE_ID));
    // An A2A message that names its own trace id (a Troupe caller's call from another
    // server), with a `traceparent` of another trace: its task names the message's id,
    // and so does the export.
    let answered = server
        .request(reqwest::Method::POST, "/a2a/echo")
        .header("traceparent", CALLERS_TRACEPARENT)
        .json(
            &json!({"jsonrpc": "2.0", "id": "r1", "method": "SendMessage", "params": {"message": {
                "messageId": "m1", "role": "ROLE_USER", "parts": [{"text": "from far"}],
                "metadata": {"troupe": {"chain": ["far"], "depth": 1, "trace_id": MESSAGE_TRACE_ID}},
            }}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(answered.status(), 200);
    let answer: serde_json::Value = answered.json().await.unwrap();
    assert_eq!(
        answer["result"]["task"]["metadata"]["troupe"]["trace_id"], MESSAGE_TRACE_ID,
        "{answer}"
    );
    server.stop().await;
    guard.shutdown().await.expect("the spans are flushed to the collector");

    let received = received.lock().unwrap();
    assert_eq!(
        received.content_types,
        BTreeSet::from(["application/x-protobuf".to_string()])
    );
    assert_eq!(received.service_names, BTreeSet::from(["troupe-otel-test".to_string()]));
    let requests: Vec<&Span> = received
        .spans
        .iter()
        .filter(|span| {
            span.name == "http_request" && attribute(span, "route").as_deref() == Some("/v1/agents/{id}/messages")
        })
        .collect();
    assert_eq!(requests.len(), 2, "two request spans: {:#?}", received.spans);
    // The A2A request's spans are in the trace its message named, with the request's span
    // its root (the `traceparent` of another trace is not its parent); echo's turn in it.
    let a2a: Vec<&Span> = received
        .spans
        .iter()
        .filter(|span| span.name == "http_request" && attribute(span, "route").as_deref() == Some("/a2a/{agent}"))
        .collect();
    assert_eq!(a2a.len(), 1, "one A2A request span: {:#?}", received.spans);
    assert_eq!(hex(&a2a[0].trace_id), MESSAGE_TRACE_ID, "{:#?}", a2a[0]);
    assert!(a2a[0].parent_span_id.is_empty(), "the A2A request span is a root");
    assert!(
        received.spans.iter().any(|span| span.name == "turn"
            && hex(&span.trace_id) == MESSAGE_TRACE_ID
            && attribute(span, "actor").as_deref() == Some("agent/echo")),
        "echo's turn on the A2A message is in the message's trace"
    );
    let task: Vec<&Span> = received.spans.iter().filter(|span| span.name == "a2a_task").collect();
    assert_eq!(task.len(), 1, "one A2A task span: {task:#?}");
    assert_eq!(hex(&task[0].trace_id), MESSAGE_TRACE_ID);
    assert!(
        task[0].parent_span_id.is_empty(),
        "the A2A task's span is a root of its own"
    );
    // The traced request joined its caller's trace: the caller's trace id (the one the
    // response named too) and the caller's span as its parent; its turn is in it.
    let (joined, root): (Vec<&Span>, Vec<&Span>) = requests
        .iter()
        .partition(|span| hex(&span.trace_id) == CALLERS_TRACE_ID);
    assert_eq!(joined.len(), 1, "one request joined the caller's trace: {requests:#?}");
    assert_eq!(hex(&joined[0].parent_span_id), CALLERS_SPAN_ID);
    assert!(
        received.spans.iter().any(|span| span.name == "turn"
            && hex(&span.trace_id) == CALLERS_TRACE_ID
            && attribute(span, "actor").as_deref() == Some("agent/echo")),
        "echo's turn is in the caller's trace"
    );
    let root = root[0];
    // A request without a `traceparent` is named by the trace the export started for it.
    assert_eq!(hex(&root.trace_id), untraced_trace_id);
    assert!(root.parent_span_id.is_empty(), "the request span is a root");
    assert_eq!(attribute(root, "status").as_deref(), Some("200"));
    let trace: Vec<&Span> = received
        .spans
        .iter()
        .filter(|span| span.trace_id == root.trace_id)
        .collect();
    // Every span of the trace hangs from another span of it, up to the root.
    let ids: HashMap<&[u8], &Span> = trace.iter().map(|span| (span.span_id.as_slice(), *span)).collect();
    for span in &trace {
        if span.span_id != root.span_id {
            assert!(
                ids.contains_key(span.parent_span_id.as_slice()),
                "{} has a parent outside the trace",
                span.name
            );
        }
    }
    let names: BTreeSet<&str> = trace.iter().map(|span| span.name.as_str()).collect();
    for name in ["http_request", "invoke", "turn", "model_call", "tool_call"] {
        assert!(names.contains(name), "no {name} span in the trace: {names:?}");
    }
    let turns: Vec<(String, String)> = trace
        .iter()
        // Agents' turns only: an answered call is also recorded in the pair's direct
        // conversation, whose actors' turns belong to the same trace.
        .filter(|span| span.name == "turn" && attribute(span, "actor").is_some_and(|actor| actor.starts_with("agent/")))
        .map(|span| {
            (
                attribute(span, "actor").unwrap_or_default(),
                attribute(span, "chain").unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(turns.len(), 2, "the caller's turn and echo's: {turns:?}");
    assert_eq!(
        trace
            .iter()
            .filter(
                |span| span.name == "invoke" && invoke_target(span).is_some_and(|target| target.starts_with("agent/"))
            )
            .count(),
        2,
        "outside -> caller -> echo: {:?}",
        trace
            .iter()
            .filter(|span| span.name == "invoke")
            .map(|span| invoke_target(span))
            .collect::<Vec<_>>()
    );
    let echo = turns
        .iter()
        .find(|(actor, _)| actor.contains("echo"))
        .unwrap_or_else(|| panic!("no turn of echo in the request's trace: {turns:?}"));
    assert!(
        echo.1.contains("agent/caller"),
        "echo's turn carries the call chain that led to it (the caller): {echo:?}"
    );
    let caller = turns
        .iter()
        .find(|(actor, _)| actor.contains("caller"))
        .unwrap_or_else(|| panic!("no turn of the caller in the request's trace: {turns:?}"));
    assert_eq!(caller.1, "[]", "the caller's turn starts the chain: {caller:?}");
}

//! OpenTelemetry export (feature `otel`) of the work an agent's durable inbox runs: a
//! REST notification and a REST delegation are answered 202 at once, and the turns that
//! process them run later, from the inbox. Those turns are exported in the trace the
//! request's response named, not as traces of their own.
//!
//! A test file of its own: the export layer is this process's global subscriber.
//! `cargo nextest run -p troupe-server --features otel -E 'test(otel)'` (scripts/test
//! runs it). Normal build only.
#![cfg(all(feature = "otel", not(madsim)))]

use std::collections::BTreeSet;

use opentelemetry_proto::tonic::trace::v1::Span;
use serde_json::json;
use troupe_agent::{ScriptRule, ScriptedLlm};
use troupe_runtime::KindConfig;
use troupe_server::ServerConfig;

mod otlp;
mod support;
use otlp::{attribute, collector, hex, trace_id_of};
use support::Harness;

/// The agent a span names (its `agent` field, or an `actor` of kind `agent`), by key.
fn agent_of(span: &Span) -> Option<String> {
    let id = attribute(span, "agent").or_else(|| attribute(span, "actor"))?;
    id.strip_prefix("agent/").map(str::to_string)
}

/// Goal: the turn that processes a REST notification (at `echo`), the delegated task's
/// turn (at `echo`) and the delegator's turn on the task's result (at `caller`) are
/// exported in the trace the request's `x-troupe-trace-id` named, with their
/// `model_call` spans. Each such trace is a tree of the request's `http_request` span and
/// a tree for each delivery task (its root span `deliver` linked to the turn that
/// relayed it). Without the delivery's span started in its entry's trace, the task's
/// turn and the result's turn are exported in traces of their own (the test fails). A
/// REST post to a conversation that mentions `echo` is the same: the mention's delivery
/// (a `deliver` span linked to the conversation's relaying turn), echo's turn on it and
/// its model call are in the trace the post's response named; without the relay record
/// carrying the post's trace they are a trace of their own (the test fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otel_inbox_turns_are_exported_in_their_requests_trace() {
    let (endpoint, received) = collector().await;
    let guard = otlp::install(&endpoint, "troupe-otel-inbox-test");

    let script = ScriptedLlm::new()
        .rule(ScriptRule::agent("echo").reply("echo: {input}"))
        .rule(ScriptRule::agent("caller").reply("noted: {input}"));
    let server = Harness::start(
        support::agents(script, &["caller", "echo"], KindConfig::default()),
        ServerConfig::default(),
    )
    .await;

    let notified = server
        .request(reqwest::Method::POST, "/v1/agents/echo/notify")
        .json(&json!({"text": "fyi", "msg_id": "n-1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(notified.status(), 202);
    let notify_trace = trace_id_of(&notified).expect("the 202 names its trace id");
    let delegated = server
        .request(reqwest::Method::POST, "/v1/agents/caller/tasks")
        .json(&json!({"to": "echo", "text": "do it"}))
        .send()
        .await
        .unwrap();
    assert_eq!(delegated.status(), 202);
    let delegate_trace = trace_id_of(&delegated).expect("the 202 names its trace id");
    let task: serde_json::Value = delegated.json().await.unwrap();
    let task = task["task_id"].as_str().expect("a task id").to_string();
    assert_ne!(notify_trace, delegate_trace);

    // The task ends with the result's turn at the caller (it commits the outcome); the
    // notification's turn ends when echo's inbox is empty again.
    let record = server
        .get_when(&format!("/v1/agents/caller/tasks/{task}"), "the task ended", |record| {
            record["state"] != "submitted" && record["state"] != "working"
        })
        .await;
    assert_eq!(record["state"], "completed", "{record}");
    server
        .get_when("/v1/agents/echo", "echo's inbox drained", |agent| agent["inbox"] == 0)
        .await;
    server
        .get_when("/v1/agents/caller", "the caller's inbox drained", |agent| {
            agent["inbox"] == 0
        })
        .await;
    // A mention in a conversation: delivered to echo's inbox by the conversation's
    // delivery task; echo's reply is appended once its turn ran.
    let (status, body) = server
        .post(
            "/v1/conversations",
            json!({"id": "room", "kind": "group", "participants": [
                {"kind": "human", "name": "hugo"}, {"kind": "agent", "name": "echo"}]}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let posted = server
        .request(reqwest::Method::POST, "/v1/conversations/room/messages")
        .json(&json!({"sender": {"kind": "human", "name": "hugo"}, "msg_id": "m1", "text": "@echo hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(posted.status(), 200);
    let post_trace = trace_id_of(&posted).expect("the post names its trace id");
    assert_ne!(post_trace, notify_trace);
    assert_ne!(post_trace, delegate_trace);
    server
        .get_when("/v1/conversations/room/messages", "echo answered the mention", |page| {
            page["messages"].as_array().is_some_and(|messages| messages.len() >= 2)
        })
        .await;
    server.stop().await;
    guard.shutdown().await.expect("the spans are flushed to the collector");

    let received = received.lock().unwrap();
    // The notification went into echo's inbox from the request itself; the task was
    // delivered from the caller's outbox to echo's inbox, and its result from echo's
    // outbox back to the caller's, each by a delivery task; the mention was delivered
    // to echo's inbox by the conversation's delivery task.
    for (trace, agents, deliveries) in [
        (&notify_trace, vec!["echo"], 0),
        (&delegate_trace, vec!["caller", "echo"], 2),
        (&post_trace, vec!["echo"], 1),
    ] {
        let spans: Vec<&Span> = received
            .spans
            .iter()
            .filter(|span| &hex(&span.trace_id) == trace)
            .collect();
        // Every model call of the trace's agents is in it: one by echo for the
        // notification; for the delegation, echo's on the task and the caller's on the
        // result.
        let model_calls: BTreeSet<String> = spans
            .iter()
            .filter(|span| span.name == "model_call")
            .filter_map(|span| agent_of(span))
            .collect();
        assert_eq!(
            model_calls,
            agents.iter().map(|agent| agent.to_string()).collect(),
            "trace {trace}: {:#?}",
            spans
                .iter()
                .map(|span| (&span.name, agent_of(span)))
                .collect::<Vec<_>>()
        );
        // No turn that names the trace (its `trace_id` field) is exported elsewhere.
        let elsewhere: Vec<&Span> = received
            .spans
            .iter()
            .filter(|span| {
                attribute(span, "trace_id").as_deref() == Some(trace.as_str()) && &hex(&span.trace_id) != trace
            })
            .collect();
        assert!(
            elsewhere.is_empty(),
            "spans of trace {trace} exported in another: {elsewhere:#?}"
        );
        // Every span's parent is in the trace, but for the roots: the request's span and
        // the delivery tasks' spans, each of which follows from (an OpenTelemetry link)
        // the turn in the trace that relayed its entry.
        let ids: BTreeSet<&[u8]> = spans.iter().map(|span| span.span_id.as_slice()).collect();
        let roots: Vec<&&Span> = spans
            .iter()
            .filter(|span| !ids.contains(span.parent_span_id.as_slice()))
            .collect();
        let mut names: Vec<&str> = roots.iter().map(|span| span.name.as_str()).collect();
        names.sort_unstable();
        let mut expected = vec!["deliver"; deliveries];
        expected.push("http_request");
        assert_eq!(names, expected, "trace {trace}: its roots");
        for delivery in roots.iter().filter(|span| span.name == "deliver") {
            let relayed_by: Vec<&str> = delivery
                .links
                .iter()
                .filter_map(|link| spans.iter().find(|span| span.span_id == link.span_id))
                .map(|span| span.name.as_str())
                .collect();
            assert_eq!(relayed_by, ["turn"], "trace {trace}: {delivery:#?}");
        }
    }
    // The mention's delivery task (its `deliver` span, from the conversation to echo)
    // is in the post's trace, linked to the conversation's relaying turn.
    let deliveries: Vec<&Span> = received
        .spans
        .iter()
        .filter(|span| span.name == "deliver" && attribute(span, "to").as_deref() == Some("echo"))
        .filter(|span| attribute(span, "from").as_deref() == Some("conversation/room"))
        .collect();
    assert_eq!(deliveries.len(), 1, "one delivery of the mention: {deliveries:#?}");
    let delivery = deliveries[0];
    assert_eq!(hex(&delivery.trace_id), post_trace, "{delivery:#?}");
    assert!(delivery.parent_span_id.is_empty(), "{delivery:#?}");
    let relayed_by: Vec<(&str, Option<String>)> = delivery
        .links
        .iter()
        .filter_map(|link| received.spans.iter().find(|span| span.span_id == link.span_id))
        .map(|span| (span.name.as_str(), attribute(span, "actor")))
        .collect();
    assert_eq!(relayed_by, [("turn", Some("conversation/room".to_string()))]);
}

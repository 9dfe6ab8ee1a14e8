//! OpenTelemetry export (feature `otel`) across two servers: an agent on server A calls
//! an agent of server B as a remote agent (A2A over HTTP on 127.0.0.1), both servers in
//! this process and exporting to one in-process OTLP/HTTP collector. The call carries
//! the calling span's W3C `traceparent`, so B's spans are in A's trace, under the span
//! that made the call.
//!
//! A test file of its own: the export layer is this process's global subscriber.
//! `cargo nextest run -p troupe-server --features otel -E 'test(otel)'` (scripts/test
//! runs it). Normal build only.
#![cfg(all(feature = "otel", not(madsim)))]

use std::collections::HashMap;

use opentelemetry_proto::tonic::trace::v1::Span;
use serde_json::json;
use troupe_agent::{RemoteAgent, ScriptRule, ScriptedLlm};
use troupe_runtime::KindConfig;
use troupe_server::ServerConfig;

mod otlp;
mod support;
use otlp::{attribute, collector, hex, trace_id_of};
use support::Harness;

/// Goal: a call to a remote Troupe agent is exported as one trace across the two
/// servers: B's `http_request` span for the A2A message has A's trace id and, as its
/// parent, a span of A's (the one the call was made from, in the caller's turn), and
/// B's turn of the called agent is in the same trace. The trace id is also the one A's
/// response names. Without the `traceparent` on the call, B's request span is a root
/// (the test fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otel_a_remote_agent_call_is_one_trace_across_two_servers() {
    let (endpoint, received) = collector().await;
    let guard = otlp::install(&endpoint, "troupe-otel-remote-test");

    let b_script = ScriptedLlm::new().rule(ScriptRule::agent("echo").reply("echo: {input}"));
    let b = Harness::start(
        support::agents(b_script, &["echo"], KindConfig::default()),
        ServerConfig::default(),
    )
    .await;
    let a_script = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("caller")
                .on_user_containing("")
                .call("call_agent", json!({"agent_id": "far", "message": "{input}"})),
        )
        .rule(
            ScriptRule::agent("caller")
                .on_tool_result()
                .reply("caller heard: {tool_result}"),
        );
    let a_builder = support::agents(a_script, &["caller"], KindConfig::default())
        .remote_agent(RemoteAgent::new("far", format!("{}/a2a/echo", b.base)));
    let a = Harness::start(a_builder, ServerConfig::default()).await;

    let answered = a
        .request(reqwest::Method::POST, "/v1/agents/caller/messages")
        .json(&json!({"text": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(answered.status(), 200);
    let trace = trace_id_of(&answered).expect("the response names its trace id");
    let reply: serde_json::Value = answered.json().await.unwrap();
    assert_eq!(reply["text"], "caller heard: echo: hi", "{reply}");
    a.stop().await;
    b.stop().await;
    guard.shutdown().await.expect("the spans are flushed to the collector");

    let received = received.lock().unwrap();
    let spans = &received.spans;
    let in_trace: Vec<&Span> = spans.iter().filter(|span| hex(&span.trace_id) == trace).collect();
    let by_id: HashMap<&[u8], &Span> = in_trace.iter().map(|span| (span.span_id.as_slice(), *span)).collect();
    let requests: Vec<&Span> = in_trace
        .iter()
        .copied()
        .filter(|span| span.name == "http_request")
        .collect();
    let route = |span: &Span| attribute(span, "route").unwrap_or_default();
    let a_request = requests
        .iter()
        .find(|span| route(span) == "/v1/agents/{id}/messages")
        .unwrap_or_else(|| panic!("A's request is not in its trace: {requests:#?}"));
    assert!(a_request.parent_span_id.is_empty(), "A's request span is the root");
    let b_request = requests
        .iter()
        .find(|span| route(span) == "/a2a/{agent}")
        .unwrap_or_else(|| panic!("B's A2A request is not in A's trace: {:#?}", spans));
    let parent = by_id.get(b_request.parent_span_id.as_slice()).unwrap_or_else(|| {
        panic!(
            "B's request span's parent {} is not a span of the trace",
            hex(&b_request.parent_span_id)
        )
    });
    // The parent is a span of A's, below A's request: walk up to A's root.
    let mut up = *parent;
    while !up.parent_span_id.is_empty() {
        up = by_id
            .get(up.parent_span_id.as_slice())
            .unwrap_or_else(|| panic!("{} has a parent outside the trace", up.name));
    }
    assert_eq!(up.span_id, a_request.span_id, "B's request hangs below A's request");
    assert!(
        in_trace
            .iter()
            .any(|span| span.name == "turn" && attribute(span, "actor").as_deref() == Some("agent/echo")),
        "B's turn of echo is in A's trace: {:?}",
        in_trace.iter().map(|span| &span.name).collect::<Vec<_>>()
    );
}

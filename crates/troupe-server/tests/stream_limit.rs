//! The limit on streamed answers open at once (`ServerConfig::streams_open_max`): a
//! streamed message and the A2A streams (`SendStreamingMessage`, `SubscribeToTask`)
//! each hold a slot until they end or their client goes away; one more is refused 503
//! with `Retry-After` before it starts anything. A real `troupe_server::serve` on
//! 127.0.0.1:0 over a real `AgentSystem` whose model waits at a gate the test opens.
//!
//! Normal build only: HTTP is not simulated (the crate is empty under madsim).
#![cfg(not(madsim))]

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use troupe_agent::{ScriptRule, ScriptedLlm};
use troupe_runtime::KindConfig;
use troupe_server::{ServeError, ServerConfig};

mod support;
use support::{parse_sse, Gated, Harness, POLL_MS, TEST_WAIT_MS_MAX};

const TOKEN: &str = "stream-limit-token-0123456789";

/// A served system of agents `a`, `b`, `c` behind the gate, at most `streams` streams
/// open.
async fn start(streams: usize) -> (Harness, Arc<tokio::sync::Semaphore>) {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let llm = Gated {
        script: ScriptedLlm::new().rule(ScriptRule::any_agent().reply("heard: {input}")),
        gate: Arc::clone(&gate),
    };
    let mut builder = troupe_agent::AgentSystem::builder()
        .llm(Arc::new(llm))
        .kind_config(KindConfig::default());
    for id in ["a", "b", "c"] {
        builder = builder.agent(troupe_agent::AgentSpec::new(id));
    }
    let config = ServerConfig::default().token(TOKEN).streams_open_max(streams);
    (Harness::start(builder, config).await, gate)
}

/// Starts a streamed message to `agent`: the response, its headers received.
async fn rest_stream(server: &Harness, agent: &str) -> reqwest::Response {
    server
        .request(
            reqwest::Method::POST,
            &format!("/v1/agents/{agent}/messages?stream=true"),
        )
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body(json!({"text": format!("to {agent}")}).to_string())
        .send()
        .await
        .expect("the server answers")
}

/// Sends the A2A request `method` with `params` to `agent`: the response, its headers
/// received.
async fn a2a(server: &Harness, agent: &str, method: &str, params: Value) -> reqwest::Response {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    server
        .request(reqwest::Method::POST, &format!("/a2a/{agent}"))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .header("A2A-Version", "1.0")
        .body(body.to_string())
        .send()
        .await
        .expect("the server answers")
}

fn send_params(agent: &str, n: u32) -> Value {
    json!({"message": {"messageId": format!("{agent}-{n}"), "role": "ROLE_USER", "parts": [{"text": "hi"}]}})
}

/// Reads an open SSE response until its first event: the event's data.
async fn first_event(response: &mut reqwest::Response) -> String {
    let mut text = String::new();
    tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let chunk = response.chunk().await.unwrap().expect("the stream stays open");
            text.push_str(std::str::from_utf8(&chunk).unwrap());
            if let Some((_, data)) = parse_sse(&text).into_iter().next() {
                return data;
            }
        }
    })
    .await
    .expect("the stream's first event arrives")
}

/// Checks that `response` is the refusal of a stream over the limit: 503, `Retry-After`,
/// and `json` (the REST error shape or, for A2A, a JSON-RPC error) naming the limit.
async fn assert_refused(response: reqwest::Response, what: &str) {
    assert_eq!(response.status().as_u16(), 503, "{what}");
    assert_eq!(
        response
            .headers()
            .get("retry-after")
            .map(|value| value.to_str().unwrap()),
        Some("1"),
        "{what}"
    );
    let body: Value = serde_json::from_str(&response.text().await.unwrap()).unwrap();
    // Both shapes keep it under `error`: REST's `{code, message}`, JSON-RPC's too.
    let (code, message) = (body["error"]["code"].to_string(), body["error"]["message"].to_string());
    assert!(code == "\"overloaded\"" || code == "-32000", "{what}: {body}");
    assert!(
        message.contains("streams_open_max") && message.contains('3'),
        "{what}: {body}"
    );
}

/// Goal: no more than `streams_open_max` streamed answers are open at once, whichever
/// route opened them; one more is refused at once (503, `Retry-After`) and starts
/// nothing; a stream that ends or whose client goes away frees its slot. Method: limit
/// 3; a streamed REST message to `a`, an A2A `SendStreamingMessage` to `b` and a
/// `SubscribeToTask` of `b`'s task stay open (their model waits at a gate); then a REST
/// stream and an A2A stream to `c` are 503 and `c` gets no task; a plain request is
/// still served. The client drops the subscription: a new one is served. The gate
/// opens: the open streams end with their replies, and a new streamed message is
/// served to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_over_the_limit_are_refused_503_until_one_ends_or_its_client_leaves() {
    let (server, gate) = start(3).await;

    let rest = rest_stream(&server, "a").await;
    assert_eq!(rest.status().as_u16(), 200);
    let mut sent = a2a(&server, "b", "SendStreamingMessage", send_params("b", 1)).await;
    assert_eq!(sent.status().as_u16(), 200);
    let task: Value = serde_json::from_str(&first_event(&mut sent).await).unwrap();
    let task_id = task["result"]["task"]["id"]
        .as_str()
        .expect("the task first")
        .to_string();
    let subscribed = a2a(&server, "b", "SubscribeToTask", json!({"id": task_id})).await;
    assert_eq!(subscribed.status().as_u16(), 200);

    assert_refused(rest_stream(&server, "c").await, "a fourth stream (REST)").await;
    assert_refused(
        a2a(&server, "c", "SendStreamingMessage", send_params("c", 1)).await,
        "a fourth stream (A2A)",
    )
    .await;
    assert_refused(
        a2a(&server, "b", "SubscribeToTask", json!({"id": task_id})).await,
        "a fourth stream (subscription)",
    )
    .await;
    let listed = a2a(&server, "c", "ListTasks", json!({})).await;
    let listed: Value = serde_json::from_str(&listed.text().await.unwrap()).unwrap();
    assert_eq!(
        listed["result"]["totalSize"], 0,
        "a refused stream starts no task: {listed}"
    );
    let (status, _) = server.get("/health").await;
    assert_eq!(status, 200, "plain requests are not streams");

    // The client of the subscription goes away: its slot frees.
    drop(subscribed);
    let again = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let response = a2a(&server, "b", "SubscribeToTask", json!({"id": task_id})).await;
            if response.status().as_u16() == 200 {
                return response;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    })
    .await
    .expect("a dropped stream's slot frees");
    assert_refused(rest_stream(&server, "c").await, "full again").await;

    // The turns end: so do their streams, and their slots free.
    gate.add_permits(16);
    let rest_text = rest.text().await.unwrap();
    assert!(
        parse_sse(&rest_text)
            .iter()
            .any(|(event, data)| event == "reply" && data.contains("heard")),
        "{rest_text}"
    );
    assert!(sent.text().await.unwrap().contains("TASK_STATE_COMPLETED"));
    assert!(again.text().await.unwrap().contains("TASK_STATE_COMPLETED"));
    let served = rest_stream(&server, "c").await;
    assert_eq!(served.status().as_u16(), 200);
    let text = served.text().await.unwrap();
    assert!(parse_sse(&text).iter().any(|(event, _)| event == "reply"), "{text}");
    server.stop().await;
}

/// Goal: `streams_open_max` outside 1 ..= `SERVER_STREAMS_OPEN_MAX` is refused by
/// `check_bind` (so by `serve`) naming the range; its ends are taken.
#[tokio::test]
async fn a_stream_limit_out_of_range_is_refused_naming_the_range() {
    let loopback: std::net::SocketAddr = "127.0.0.1:1".parse().unwrap();
    let most = troupe_server::limits::SERVER_STREAMS_OPEN_MAX;
    for given in [0, most + 1, usize::MAX] {
        let error = ServerConfig::default()
            .streams_open_max(given)
            .check_bind(loopback)
            .unwrap_err();
        assert!(
            matches!(error, ServeError::StreamsOpen { given: g, max } if g == given && max == most),
            "{error}"
        );
        assert_eq!(
            error.to_string(),
            format!("streams_open_max is {given}: give from 1 to 65536 streamed answers to keep open at once")
        );
    }
    for given in [1, most] {
        assert!(ServerConfig::default()
            .streams_open_max(given)
            .check_bind(loopback)
            .is_ok());
    }
}

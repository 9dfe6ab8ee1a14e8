//! The limit on streamed answers open at once (`ServerConfig::streams_open_max`): a
//! streamed message, a streamed chat completion (from before its turn) and the A2A
//! streams (`SendStreamingMessage`, `SubscribeToTask`) each hold a slot until they end
//! or their client goes away; one more is refused 503 with `Retry-After` before it
//! starts anything. A real `troupe_server::serve` on
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
/// The gauge of `/metrics` that counts the open streamed answers.
const STREAMS_OPEN: &str = "troupe_streams_open";
/// How long a refusal over the limit may take, in milliseconds: it is answered at once,
/// before any turn.
const REFUSAL_WAIT_MS: u64 = 5_000;

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

/// Sends a streamed chat completion (`POST /v1/chat/completions`, `"stream": true`)
/// asking `agent`: the response, its headers received (an accepted one sends them
/// while its turn runs, within `OPENAI_STREAM_HEADERS_WAIT_MS`).
async fn chat_stream(server: &Harness, agent: &str) -> reqwest::Response {
    let body =
        json!({"model": agent, "messages": [{"role": "user", "content": format!("to {agent}")}], "stream": true});
    server
        .request(reqwest::Method::POST, "/v1/chat/completions")
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("the server answers")
}

/// A streamed chat completion asking `agent` that must be answered within
/// [`REFUSAL_WAIT_MS`] (a refusal is; an accepted one is too, with 200: the caller
/// checks which).
async fn chat_stream_at_once(server: &Harness, agent: &str) -> reqwest::Response {
    tokio::time::timeout(Duration::from_millis(REFUSAL_WAIT_MS), chat_stream(server, agent))
        .await
        .unwrap_or_else(|_| panic!("a streamed chat completion to {agent} got no answer within {REFUSAL_WAIT_MS} ms"))
}

/// Checks that a streamed chat completion's SSE `text` is OpenAI's chunks of a reply
/// containing `reply`, ended by `[DONE]`.
fn assert_chat_served(text: &str, reply: &str) {
    let events = parse_sse(text);
    assert_eq!(events.last().map(|(_, data)| data.as_str()), Some("[DONE]"), "{text}");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|(_, data)| serde_json::from_str(data).unwrap())
        .collect();
    assert!(
        chunks.iter().all(|chunk| chunk["object"] == "chat.completion.chunk"),
        "{text}"
    );
    assert!(
        chunks.iter().any(|chunk| chunk["choices"][0]["delta"]["content"]
            .as_str()
            .is_some_and(|content| content.contains(reply))),
        "{text}"
    );
}

/// Checks that `response` is the refusal of a stream over the limit of `limit` streams:
/// 503, `Retry-After`, and `json` (the REST and OpenAI error shape or, for A2A, a
/// JSON-RPC error) naming the limit.
async fn assert_refused(response: reqwest::Response, limit: usize, what: &str) {
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
        message.contains("streams_open_max") && message.contains(&limit.to_string()),
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

    assert_refused(rest_stream(&server, "c").await, 3, "a fourth stream (REST)").await;
    assert_refused(
        a2a(&server, "c", "SendStreamingMessage", send_params("c", 1)).await,
        3,
        "a fourth stream (A2A)",
    )
    .await;
    assert_refused(
        a2a(&server, "b", "SubscribeToTask", json!({"id": task_id})).await,
        3,
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
    assert_refused(rest_stream(&server, "c").await, 3, "full again").await;

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

/// Goal: a streamed chat completion counts against `streams_open_max` as the other
/// streams do: beside a held stream it is refused at once, before its agent is asked,
/// in the route's error shape (503 `overloaded`, `Retry-After`, naming the limit), and
/// once that stream ends a new one is served (before 2026-12-06 it was not counted: it
/// was accepted and waited for its turn). Method: limit 1; a streamed REST message to
/// `a` stays open (its model waits at a gate); a streamed chat completion to `b` must be
/// answered within `REFUSAL_WAIT_MS`, refused. The gate opens: the REST stream ends, a
/// streamed chat completion to `b` is served to `[DONE]`, the slots are all free again,
/// and `b`'s conversation holds that one exchange only (the refused one asked nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_chat_completion_beside_a_held_stream_is_refused_503_until_it_ends() {
    let (server, gate) = start(1).await;
    let rest = rest_stream(&server, "a").await;
    assert_eq!(rest.status().as_u16(), 200);

    let refused = chat_stream_at_once(&server, "b").await;
    assert_refused(refused, 1, "a streamed chat completion beside a held stream").await;

    gate.add_permits(16);
    let rest_text = rest.text().await.unwrap();
    assert!(
        parse_sse(&rest_text)
            .iter()
            .any(|(event, data)| event == "reply" && data.contains("heard")),
        "{rest_text}"
    );
    let served = chat_stream(&server, "b").await;
    assert_eq!(served.status().as_u16(), 200);
    assert_chat_served(&served.text().await.unwrap(), "heard: to b");
    server.gauge_when(STREAMS_OPEN, 0, "every stream ended").await;
    let (status, history) = server.get("/v1/agents/b/history").await;
    assert_eq!(status, 200);
    assert_eq!(history["total"], 2, "one exchange, the served one: {history}");
    server.stop().await;
}

/// Goal: a streamed chat completion holds its slot from when it is accepted (before its
/// turn) until its body ends, or until its client goes away during the turn, which
/// cancels the turn (it commits nothing); meanwhile another stream of any route is
/// refused. Method: limit 1; a streamed chat completion to `a` gets its headers and its
/// role chunk while its turn waits (the gate is shut): `/metrics` shows one stream open,
/// and a streamed message and a streamed chat completion are refused 503. Its client
/// goes away: the slot frees, the runtime counts the turn abandoned, and `a`'s
/// conversation stays empty once the gate opens. A second one, to `b`, holds the slot
/// while it waits; the gate opens: it is served to `[DONE]` and then the slot is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_chat_completion_holds_a_slot_from_before_its_turn_until_its_body_ends_or_its_client_leaves() {
    let (server, gate) = start(1).await;
    let mut first = chat_stream(&server, "a").await;
    assert_eq!(first.status().as_u16(), 200);
    let role: Value = serde_json::from_str(&first_event(&mut first).await).unwrap();
    assert_eq!(role["choices"][0]["delta"]["role"], "assistant", "{role}");
    server
        .gauge_when(
            STREAMS_OPEN,
            1,
            "a streamed chat completion holds a slot while its turn runs",
        )
        .await;
    assert_refused(
        rest_stream(&server, "b").await,
        1,
        "a streamed message beside a streamed chat completion",
    )
    .await;
    assert_refused(
        chat_stream_at_once(&server, "c").await,
        1,
        "a second streamed chat completion",
    )
    .await;
    assert_eq!(server.system().runtime().counters().turns_abandoned, 0);

    // Its client goes away before the turn ends: the slot frees, the turn is cancelled.
    drop(first);
    server
        .gauge_when(
            STREAMS_OPEN,
            0,
            "a streamed chat completion whose client left frees its slot",
        )
        .await;
    tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        while server.system().runtime().counters().turns_abandoned == 0 {
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    })
    .await
    .expect("the turn of a streamed chat completion whose client left is cancelled");

    let second = chat_stream(&server, "b").await;
    assert_eq!(second.status().as_u16(), 200);
    server.gauge_when(STREAMS_OPEN, 1, "the second one's slot").await;
    gate.add_permits(16);
    let text = second.text().await.unwrap();
    assert_chat_served(&text, "heard: to b");
    server
        .gauge_when(
            STREAMS_OPEN,
            0,
            "a streamed chat completion whose body ended frees its slot",
        )
        .await;
    let (status, history) = server.get("/v1/agents/a/history").await;
    assert_eq!(status, 200);
    assert_eq!(history["total"], 0, "the cancelled turn committed nothing: {history}");
    server.stop().await;
}

/// Goal: under concurrent streamed chat completions no more than `streams_open_max` are
/// accepted at once: the rest are refused at once (503 `overloaded`, `Retry-After`).
/// Method: limit 2, the gate shut; 8 streamed chat completions to `a`, `b`, `c` sent at
/// once from tasks on two worker threads. 6 are refused within `TEST_WAIT_MS_MAX` and no
/// seventh answer comes while the gate is shut; `/metrics` shows 2 streams open. The
/// gate opens: the 2 accepted ones are served to `[DONE]`, and the slots free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streamed_chat_completions_past_the_limit_are_refused_and_at_most_the_limit_accepted() {
    const LIMIT: usize = 2;
    const REQUESTS: usize = 8;
    let (server, gate) = start(LIMIT).await;
    let server = Arc::new(server);
    let (answers, mut answered) = tokio::sync::mpsc::unbounded_channel();
    for n in 0..REQUESTS {
        let server = Arc::clone(&server);
        let answers = answers.clone();
        tokio::spawn(async move {
            let agent = ["a", "b", "c"][n % 3];
            let response = chat_stream(&server, agent).await;
            let status = response.status().as_u16();
            let retry_after = response.headers().get("retry-after").cloned();
            let text = response.text().await.unwrap();
            drop(server);
            let _ = answers.send((status, retry_after, text));
        });
    }
    drop(answers);

    let refused = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        let mut refused = Vec::new();
        while refused.len() < REQUESTS - LIMIT {
            refused.push(answered.recv().await.expect("every request is answered"));
        }
        refused
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "{} of {REQUESTS} streamed chat completions refused at once",
            REQUESTS - LIMIT
        )
    });
    for (status, retry_after, text) in &refused {
        assert_eq!(*status, 503, "{text}");
        assert_eq!(
            retry_after.as_ref().map(|value| value.to_str().unwrap()),
            Some("1"),
            "{text}"
        );
        let body: Value = serde_json::from_str(text).unwrap();
        assert_eq!(body["error"]["code"], "overloaded", "{text}");
        assert!(
            body["error"]["message"].as_str().unwrap().contains("streams_open_max"),
            "{text}"
        );
    }
    assert!(
        answered.try_recv().is_err(),
        "no more than {LIMIT} accepted: the rest wait at the gate"
    );
    server
        .gauge_when(STREAMS_OPEN, LIMIT as u64, "the accepted ones' slots")
        .await;

    gate.add_permits(64);
    for _ in 0..LIMIT {
        let (status, _, text) = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), answered.recv())
            .await
            .expect("an accepted streamed chat completion is answered once the gate opens")
            .expect("every request is answered");
        assert_eq!(status, 200, "{text}");
        assert_chat_served(&text, "heard: to ");
    }
    server.gauge_when(STREAMS_OPEN, 0, "every stream ended").await;
    Arc::into_inner(server).unwrap().stop().await;
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

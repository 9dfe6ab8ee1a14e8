//! Streamed OpenAI chat completions (`POST /v1/chat/completions` with `"stream": true`)
//! stream while the agent's turn runs: the headers and the role chunk go out once the
//! turn has been asked for (within `OPENAI_STREAM_HEADERS_WAIT_MS`), the content when it
//! ends; the request timeout (which bounds the time to the headers) does not cut a long
//! turn; an error after the headers arrives as an OpenAI error event in the stream; an
//! error known at once keeps its HTTP status. A real `troupe_server::serve` on
//! 127.0.0.1:0 over a real `AgentSystem` whose model waits at a gate the test opens.
//!
//! Normal build only: HTTP is not simulated (the crate is empty under madsim).
#![cfg(not(madsim))]

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use troupe_agent::{ScriptRule, ScriptedLlm};
use troupe_runtime::KindConfig;
use troupe_server::ServerConfig;

mod support;
use support::{parse_sse, turn_started, Gated, Harness, TEST_WAIT_MS_MAX};

/// The server's request timeout in these tests, in milliseconds: a turn held at the
/// gate lasts longer.
const REQUEST_TIMEOUT_MS: u64 = 400;
/// What the failing agent's model fails with.
const MODEL_DOWN: &str = "the model is down";

/// A served system behind the gate: agent `a` answers "heard: {input}", agent `broken`'s
/// model fails. `kind` configures the agents' actors.
async fn start(config: ServerConfig, kind: KindConfig) -> (Harness, Arc<tokio::sync::Semaphore>) {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let llm = Gated {
        script: ScriptedLlm::new()
            .rule(ScriptRule::agent("broken").fail(MODEL_DOWN))
            .rule(ScriptRule::any_agent().reply("heard: {input}")),
        gate: Arc::clone(&gate),
    };
    let mut builder = troupe_agent::AgentSystem::builder()
        .llm(Arc::new(llm))
        .kind_config(kind);
    for id in ["a", "broken"] {
        builder = builder.agent(troupe_agent::AgentSpec::new(id));
    }
    (Harness::start(builder, config).await, gate)
}

fn short_timeout() -> ServerConfig {
    ServerConfig::default().request_timeout(Duration::from_millis(REQUEST_TIMEOUT_MS))
}

/// Sends a chat completion asking `agent` `text`, streamed or not: the response, its
/// headers received.
async fn chat(server: &Harness, agent: &str, text: &str, stream: bool) -> reqwest::Response {
    let body = json!({"model": agent, "messages": [{"role": "user", "content": text}], "stream": stream});
    server
        .request(reqwest::Method::POST, "/v1/chat/completions")
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("the server answers")
}

/// Reads an SSE body event by event as it arrives.
struct Events {
    response: reqwest::Response,
    /// Everything read so far.
    text: String,
    /// Events already returned.
    taken: usize,
}

impl Events {
    async fn of(response: reqwest::Response) -> Self {
        assert_eq!(response.status().as_u16(), 200, "a stream");
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        Self {
            response,
            text: String::new(),
            taken: 0,
        }
    }

    /// The next event's data; `None` once the body has ended with no further event.
    async fn next(&mut self) -> Option<String> {
        tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
            loop {
                // Only whole events: the last block counts once its blank line arrived.
                let whole = self.text.rfind("\n\n").map_or("", |end| &self.text[..end + 2]);
                if let Some((_, data)) = parse_sse(whole).into_iter().nth(self.taken) {
                    self.taken += 1;
                    return Some(data);
                }
                match self.response.chunk().await.expect("the body reads") {
                    Some(chunk) => self.text.push_str(std::str::from_utf8(&chunk).unwrap()),
                    None => return None,
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no event within {TEST_WAIT_MS_MAX} ms; read so far: {}", self.text))
    }

    /// The next event's data as a chunk (JSON).
    async fn chunk(&mut self) -> Value {
        let data = self.next().await.expect("a chunk, not the body's end");
        serde_json::from_str(&data).unwrap_or_else(|error| panic!("not JSON ({error}): {data}"))
    }
}

/// Goal: a streamed completion whose turn outlasts the server's request timeout gets
/// its headers and its role chunk while the turn runs, then its content, finish and
/// `[DONE]`, and no 504; and it leaves the concurrent-request limit once its headers
/// are out. Until 2026-12-06 the handler waited for the whole turn before it answered,
/// so this request got 504 `request_timeout` after `REQUEST_TIMEOUT_MS`. Method:
/// request timeout 400 ms, one concurrent request; the model waits at a gate; the role
/// chunk arrives with the gate shut; `/health` is served meanwhile; the gate opens only
/// after twice the request timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_completion_longer_than_the_request_timeout_streams_its_role_then_its_content() {
    let (server, gate) = start(short_timeout().concurrent_requests_max(1), KindConfig::default()).await;
    let response = chat(&server, "a", "a long question", true).await;
    let status = response.status().as_u16();
    if status != 200 {
        let body = response.text().await.unwrap();
        panic!("a streamed completion whose turn is still running is answered {status}: {body}");
    }
    let mut events = Events::of(response).await;
    let role = events.chunk().await;
    assert_eq!(role["object"], "chat.completion.chunk", "{role}");
    assert_eq!(
        role["choices"],
        json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}])
    );
    assert_eq!(gate.available_permits(), 0, "the turn is still at the gate");
    let (status, _) = server.get("/health").await;
    assert_eq!(status, 200, "the stream holds no request slot once its headers are out");

    tokio::time::sleep(Duration::from_millis(2 * REQUEST_TIMEOUT_MS)).await;
    gate.add_permits(1);
    let content = events.chunk().await;
    assert_eq!(
        content["choices"][0]["delta"],
        json!({"content": "heard: a long question"})
    );
    let finish = events.chunk().await;
    assert_eq!(finish["choices"][0]["finish_reason"], "stop", "{finish}");
    assert_eq!(events.next().await.as_deref(), Some("[DONE]"));
    assert_eq!(events.next().await, None, "nothing after [DONE]");
    for chunk in [&content, &finish] {
        assert_eq!(chunk["id"], role["id"]);
        assert_eq!(chunk["created"], role["created"]);
        assert_eq!(chunk["model"], "a");
    }
    server.stop().await;
}

/// Goal: an error after the headers went out arrives in the stream as OpenAI sends one:
/// a `data:` event whose JSON is the route's HTTP error body (`{"error": {"code",
/// "message"}}`, the same code as the HTTP answer of the same failure), and then the
/// stream ends without `[DONE]`. Method: agent `broken`'s model fails; a streamed
/// completion gets its role chunk with the gate shut, then the gate opens; the same
/// request not streamed is answered 500 with the body compared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_after_the_headers_arrives_as_an_error_event_in_the_routes_error_shape() {
    let (server, gate) = start(ServerConfig::default(), KindConfig::default()).await;
    let mut events = Events::of(chat(&server, "broken", "hi", true).await).await;
    let role = events.chunk().await;
    assert_eq!(role["choices"][0]["delta"]["role"], "assistant", "{role}");
    gate.add_permits(1);
    let streamed = events.chunk().await;
    assert_eq!(
        events.next().await,
        None,
        "the stream ends after the error, without [DONE]"
    );

    gate.add_permits(1);
    let plain = chat(&server, "broken", "hi", false).await;
    assert_eq!(plain.status().as_u16(), 500);
    let plain: Value = serde_json::from_str(&plain.text().await.unwrap()).unwrap();
    let keys = |body: &Value| {
        let mut keys: Vec<String> = body["error"]
            .as_object()
            .unwrap_or_else(|| panic!("not the error shape: {body}"))
            .keys()
            .cloned()
            .collect();
        keys.sort();
        (body.as_object().unwrap().len(), keys)
    };
    assert_eq!(keys(&streamed), keys(&plain), "{streamed} vs {plain}");
    assert_eq!(streamed["error"]["code"], "agent_failed", "{streamed}");
    assert_eq!(streamed["error"]["code"], plain["error"]["code"]);
    let message = streamed["error"]["message"].as_str().unwrap();
    assert!(message.contains(MODEL_DOWN), "{streamed}");
    server.stop().await;
}

/// Goal: an error known as the turn is asked for keeps its HTTP status on a streamed
/// completion: a full mailbox is 429 `busy` with `Retry-After`, in the route's error
/// shape, not a 200 stream with an error event. Method: mailbox capacity 1, the gate
/// shut; a streamed completion's turn runs (seen on the event stream), a second one
/// waits in the mailbox (its headers are out: 200), a third is refused. The gate opens:
/// the two accepted ones are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_mailbox_is_429_busy_for_a_streamed_completion_too() {
    let (server, gate) = start(ServerConfig::default(), KindConfig::default().with_mailbox_capacity(1)).await;
    let mut agent_events = server.system().subscribe();
    let mut first = Events::of(chat(&server, "a", "one", true).await).await;
    turn_started(&mut agent_events, "a").await;
    let mut second = Events::of(chat(&server, "a", "two", true).await).await;
    let refused = chat(&server, "a", "three", true).await;
    assert_eq!(refused.status().as_u16(), 429);
    assert_eq!(refused.headers()["retry-after"], "1");
    let body: Value = serde_json::from_str(&refused.text().await.unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "busy", "{body}");

    gate.add_permits(2);
    for (events, text) in [(&mut first, "one"), (&mut second, "two")] {
        assert_eq!(events.chunk().await["choices"][0]["delta"]["role"], "assistant");
        let content = events.chunk().await;
        assert_eq!(
            content["choices"][0]["delta"]["content"],
            format!("heard: {text}"),
            "{content}"
        );
        assert!(events.chunk().await["choices"][0]["finish_reason"] == "stop");
        assert_eq!(events.next().await.as_deref(), Some("[DONE]"));
    }
    server.stop().await;
}

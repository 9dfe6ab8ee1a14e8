//! The HTTP API end to end: a real `troupe_server::serve` on 127.0.0.1:0, the real
//! `AgentSystem` on the scripted model, and real HTTP requests (reqwest). Every route's
//! happy path, the error mapping (401, 404, 400/422, 413, 429, 503, 504), the SSE
//! streams parsed, and graceful shutdown.
//!
//! Normal build only: HTTP is not simulated (the crate is empty under madsim).
#![cfg(not(madsim))]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use troupe_agent::{AgentSpec, AgentSystem, ScriptRule, ScriptedLlm};
use troupe_runtime::KindConfig;
use troupe_server::{ServeError, ServerConfig};

mod support;
use support::{parse_sse, turn_started, Harness, TEST_WAIT_MS_MAX};

/// How long the `slow` agent's model takes, in milliseconds.
const SLOW_TURN_MS: u64 = 3_000;
const TOKEN: &str = "test-token-0123456789";

fn script() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(ScriptRule::agent("echo").reply("echo: {input}"))
        .rule(
            ScriptRule::agent("slow")
                .reply("slow done")
                .latency(Duration::from_millis(SLOW_TURN_MS)),
        )
        .rule(ScriptRule::agent("caller").on_user_containing("").call(
            "call_agent",
            json!({"agent_id": "echo", "message": "from caller: {input}"}),
        ))
        .rule(
            ScriptRule::agent("caller")
                .on_tool_result()
                .reply("caller heard: {tool_result}"),
        )
        .rule(ScriptRule::agent("boss").reply("noted"))
}

async fn start(config: ServerConfig, kind: KindConfig) -> Harness {
    Harness::start(
        support::agents(script(), &["echo", "slow", "caller", "boss"], kind),
        config,
    )
    .await
}

async fn start_default() -> Harness {
    start(ServerConfig::default(), KindConfig::default()).await
}

/// A server whose one agent, `echo`, answers "echo: {input}", and its scripted model
/// (whose recorded requests show what the agent was asked).
async fn echo_server() -> (ScriptedLlm, Harness) {
    let llm = ScriptedLlm::new().rule(ScriptRule::agent("echo").reply("echo: {input}"));
    let server = Harness::start(
        support::agents(llm.clone(), &["echo"], KindConfig::default()),
        ServerConfig::default(),
    )
    .await;
    (llm, server)
}

/// `POST /v1/chat/completions` with `body` as it is (raw JSON text: the nulls and field
/// combinations a typed body would not send).
fn chat_raw(server: &Harness, body: String) -> impl std::future::Future<Output = reqwest::Result<reqwest::Response>> {
    server
        .request(reqwest::Method::POST, "/v1/chat/completions")
        .header("content-type", "application/json")
        .body(body)
        .send()
}

/// The chunks of a streamed chat completion's SSE `text`, parsed, after checking that
/// the stream ends with `[DONE]` (not included).
fn chat_chunks(text: &str) -> Vec<Value> {
    let events = parse_sse(text);
    assert_eq!(events.last().map(|(_, data)| data.as_str()), Some("[DONE]"), "{text}");
    events[..events.len() - 1]
        .iter()
        .map(|(_, data)| serde_json::from_str(data).unwrap())
        .collect()
}

/// The wall clock in whole Unix seconds: what an OpenAI `created` is compared with.
#[allow(clippy::disallowed_methods)]
fn unix_seconds() -> u64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    since.expect("after 1970").as_secs()
}

fn error_code(body: &Value) -> &str {
    body["error"]["code"]
        .as_str()
        .unwrap_or_else(|| panic!("not the error shape: {body}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_open_and_every_other_route_needs_the_bearer_token() {
    let server = start(ServerConfig::default().token(TOKEN), KindConfig::default()).await;
    let health = server.request(reqwest::Method::GET, "/health").send().await.unwrap();
    assert_eq!(health.status().as_u16(), 200);
    let health: Value = serde_json::from_str(&health.text().await.unwrap()).unwrap();
    assert_eq!(health, json!({"status": "ok", "agents": 4}));
    for path in ["/v1/agents", "/metrics", "/v1/models", "/v1/agents/echo/history"] {
        let missing = server.request(reqwest::Method::GET, path).send().await.unwrap();
        assert_eq!(missing.status().as_u16(), 401, "{path}");
        assert_eq!(missing.headers()["www-authenticate"], "Bearer");
        let body: Value = serde_json::from_str(&missing.text().await.unwrap()).unwrap();
        assert_eq!(error_code(&body), "unauthorized");
        let wrong = server
            .request(reqwest::Method::GET, path)
            .bearer_auth("test-token-0123456780")
            .send()
            .await
            .unwrap();
        assert_eq!(wrong.status().as_u16(), 401, "{path}");
    }
    let (status, body) = server.get("/v1/agents").await;
    assert_eq!(status, 200);
    assert_eq!(body["agents"].as_array().unwrap().len(), 4);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_are_listed_created_updated_and_deleted() {
    let server = start_default().await;
    let (status, body) = server.get("/v1/agents").await;
    assert_eq!(status, 200);
    let ids: Vec<&str> = body["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|agent| agent["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["boss", "caller", "echo", "slow"]);

    let helper = json!({"id": "helper", "role": "helps", "system_prompt": "Be brief.", "max_steps": 3, "history": 6,
                        "call_approval": "delegate"});
    let (status, body) = server.post("/v1/agents", helper.clone()).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["role"], "helps");
    assert_eq!(body["max_steps"], 3);
    assert_eq!(body["history"], 6);
    assert_eq!(body["call_approval"], "delegate");
    assert_eq!(
        server.system().directory().get("helper").unwrap().call_approval,
        troupe_agent::CallApproval::Delegate
    );
    assert_eq!(server.system().directory().get("helper").unwrap().history, 6);
    let (status, body) = server.post("/v1/agents", helper).await;
    assert_eq!(status, 409);
    assert_eq!(error_code(&body), "agent_exists");

    let (status, body) = server.get("/v1/agents/helper").await;
    assert_eq!(status, 200);
    assert_eq!(body["system_prompt"], "Be brief.");
    assert_eq!(body["inbox"], 0);

    let (status, body) = server
        .send(
            reqwest::Method::PUT,
            "/v1/agents/helper",
            Some(json!({"role": "helps more"})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(server.get("/v1/agents/helper").await.1["role"], "helps more");
    // A replacement is whole: a field it leaves out takes its default.
    assert_eq!(
        server.get("/v1/agents/helper").await.1["history"],
        troupe_agent::limits::AGENT_HISTORY_WINDOW_DEFAULT
    );
    assert_eq!(server.get("/v1/agents/helper").await.1["call_approval"], "wait_in_turn");
    let (status, body) = server
        .send(reqwest::Method::PUT, "/v1/agents/helper", Some(json!({"history": 1})))
        .await;
    assert_eq!((status, error_code(&body)), (422, "invalid_agent"), "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("history window of helper is 1 messages") && message.contains("2..=1000"),
        "{body}"
    );
    assert_eq!(
        server.get("/v1/agents/helper").await.1["role"],
        "helps more",
        "the refused PUT changed nothing"
    );
    let (status, body) = server
        .send(reqwest::Method::PUT, "/v1/agents/helper", Some(json!({"id": "other"})))
        .await;
    assert_eq!((status, error_code(&body)), (422, "invalid_agent"));
    let (status, body) = server
        .send(reqwest::Method::PUT, "/v1/agents/nobody", Some(json!({"role": "x"})))
        .await;
    assert_eq!((status, error_code(&body)), (404, "agent_not_found"));

    let (status, _) = server.send(reqwest::Method::DELETE, "/v1/agents/helper", None).await;
    assert_eq!(status, 204);
    let (status, body) = server.get("/v1/agents/helper").await;
    assert_eq!((status, error_code(&body)), (404, "agent_not_found"));
    let (status, body) = server.send(reqwest::Method::DELETE, "/v1/agents/helper", None).await;
    assert_eq!((status, error_code(&body)), (404, "agent_not_found"));

    // Bad input: an invalid id, an unknown field, a wrong type, broken JSON, no JSON.
    let (status, body) = server.post("/v1/agents", json!({"id": ""})).await;
    assert_eq!((status, error_code(&body)), (422, "invalid_agent"), "{body}");
    let (status, body) = server.post("/v1/agents", json!({"role": "no id"})).await;
    assert_eq!((status, error_code(&body)), (422, "invalid_agent"));
    let (status, body) = server.post("/v1/agents", json!({"id": "x", "colour": "red"})).await;
    assert_eq!((status, error_code(&body)), (422, "invalid_body"));
    assert!(body["error"]["message"].as_str().unwrap().contains("colour"), "{body}");
    let (status, body) = server.post("/v1/agents", json!({"id": "x", "max_steps": "many"})).await;
    assert_eq!((status, error_code(&body)), (422, "invalid_body"));
    let (status, body) = server
        .post("/v1/agents", json!({"id": "x", "call_approval": "later"}))
        .await;
    assert_eq!((status, error_code(&body)), (422, "invalid_body"));
    assert!(
        body["error"]["message"].as_str().unwrap().contains("wait_in_turn"),
        "{body}"
    );
    let broken = server
        .request(reqwest::Method::POST, "/v1/agents")
        .header("content-type", "application/json")
        .body("{\"id\": ")
        .send()
        .await
        .unwrap();
    assert_eq!(broken.status().as_u16(), 400);
    let body: Value = serde_json::from_str(&broken.text().await.unwrap()).unwrap();
    assert_eq!(error_code(&body), "invalid_json");
    let untyped = server
        .request(reqwest::Method::POST, "/v1/agents")
        .body("{\"id\": \"x\"}")
        .send()
        .await
        .unwrap();
    assert_eq!(untyped.status().as_u16(), 415);
    server.stop().await;
}

/// Goal: two clients creating the same agent at once never both succeed (no silent
/// overwrite). Method: 16 concurrent POSTs of one id on a multi-thread runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_creates_of_one_agent_succeed_exactly_once() {
    let server = Arc::new(start_default().await);
    let mut tasks = Vec::new();
    for n in 0..16 {
        let server = Arc::clone(&server);
        tasks.push(tokio::spawn(async move {
            server
                .post("/v1/agents", json!({"id": "twin", "role": format!("writer {n}")}))
                .await
        }));
    }
    let mut created = Vec::new();
    let mut conflicts = 0;
    for task in tasks {
        match task.await.unwrap() {
            (201, body) => created.push(body["role"].as_str().unwrap().to_string()),
            (409, body) => {
                assert_eq!(error_code(&body), "agent_exists");
                conflicts += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(created.len(), 1);
    assert_eq!(conflicts, 15);
    assert_eq!(server.get("/v1/agents/twin").await.1["role"], created[0]);
    Arc::into_inner(server).unwrap().stop().await;
}

/// Goal: a definition out of the agent layer's limits is 422 `invalid_agent` with the
/// one message `AgentSpec::validate` gives, naming the range or the limit: `max_steps` 0
/// and `AGENT_TURN_STEPS_MAX` + 1 (by POST and by PUT), a model name one byte over
/// `AGENT_MODEL_NAME_SIZE_MAX_BYTES`; the bounds themselves are taken. Method: POST and
/// PUT /v1/agents, then GET: nothing refused was defined or changed.
#[tokio::test]
async fn a_definition_out_of_the_agent_limits_is_422_naming_the_range() {
    use troupe_agent::limits::{AGENT_MODEL_NAME_SIZE_MAX_BYTES, AGENT_TURN_STEPS_MAX, AGENT_TURN_STEPS_MIN};
    let server = start_default().await;
    let range = format!("{AGENT_TURN_STEPS_MIN}..={AGENT_TURN_STEPS_MAX}");
    for steps in [0, AGENT_TURN_STEPS_MAX + 1] {
        let (status, body) = server
            .post("/v1/agents", json!({"id": "steps", "max_steps": steps}))
            .await;
        assert_eq!((status, error_code(&body)), (422, "invalid_agent"), "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("max_steps of steps is {steps}")) && message.contains(&range),
            "max_steps {steps}: {message}"
        );
    }
    let (status, body) = server.get("/v1/agents/steps").await;
    assert_eq!((status, error_code(&body)), (404, "agent_not_found"), "{body}");

    let longest = "m".repeat(AGENT_MODEL_NAME_SIZE_MAX_BYTES);
    let (status, body) = server
        .post("/v1/agents", json!({"id": "model", "model": format!("{longest}m")}))
        .await;
    assert_eq!((status, error_code(&body)), (422, "invalid_agent"), "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    let sizes = format!(
        "{} bytes, more than the limit of {AGENT_MODEL_NAME_SIZE_MAX_BYTES}",
        AGENT_MODEL_NAME_SIZE_MAX_BYTES + 1
    );
    assert!(
        message.contains("model of model") && message.contains(&sizes),
        "{message}"
    );

    let at_bounds = json!({"id": "model", "model": longest, "max_steps": AGENT_TURN_STEPS_MAX});
    let (status, body) = server.post("/v1/agents", at_bounds).await;
    assert_eq!(status, 201, "the bounds are taken: {body}");
    let (status, body) = server
        .send(reqwest::Method::PUT, "/v1/agents/model", Some(json!({"max_steps": 0})))
        .await;
    assert_eq!((status, error_code(&body)), (422, "invalid_agent"), "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains(&range), "PUT max_steps 0: {message}");
    let (status, body) = server
        .send(
            reqwest::Method::PUT,
            "/v1/agents/model",
            Some(json!({"max_steps": AGENT_TURN_STEPS_MIN})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["max_steps"], AGENT_TURN_STEPS_MIN, "{body}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_gets_the_agents_reply_and_errors_map_to_their_statuses() {
    let server = start_default().await;
    let (status, body) = server.post("/v1/agents/echo/messages", json!({"text": "hi"})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["text"], "echo: hi");
    assert_eq!(body["agent"], "echo");
    assert_eq!(body["steps"], 1);
    let (status, body) = server.post("/v1/agents/caller/messages", json!({"text": "ping"})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["text"],
        "caller heard: echo: [message from agent caller] from caller: ping"
    );

    let (status, body) = server.post("/v1/agents/nobody/messages", json!({"text": "hi"})).await;
    assert_eq!((status, error_code(&body)), (404, "agent_not_found"));
    let (status, body) = server.post("/v1/agents/echo/messages", json!({"text": ""})).await;
    assert_eq!((status, error_code(&body)), (422, "empty_message"));
    let long = "x".repeat(troupe_server::limits::SERVER_MESSAGE_SIZE_MAX_BYTES + 1);
    let (status, body) = server.post("/v1/agents/echo/messages", json!({"text": long})).await;
    assert_eq!((status, error_code(&body)), (422, "message_too_long"));
    let huge = "x".repeat(troupe_server::limits::SERVER_REQUEST_BODY_SIZE_MAX_BYTES + 1);
    let (status, body) = server.post("/v1/agents/echo/messages", json!({"text": huge})).await;
    assert_eq!((status, error_code(&body)), (413, "body_too_large"));
    let (status, body) = server
        .post("/v1/agents/echo/messages", json!({"text": "hi", "timeout_ms": 0}))
        .await;
    assert_eq!((status, error_code(&body)), (422, "invalid_timeout"));
    let (status, body) = server
        .post("/v1/agents/echo/messages?stream=maybe", json!({"text": "hi"}))
        .await;
    assert_eq!((status, error_code(&body)), (400, "invalid_query"));

    // The agent's own deadline: 504 `timeout`.
    let (status, body) = server
        .post("/v1/agents/slow/messages", json!({"text": "hi", "timeout_ms": 100}))
        .await;
    assert_eq!((status, error_code(&body)), (504, "timeout"), "{body}");

    let (status, body) = server.get("/v1/nothing").await;
    assert_eq!((status, error_code(&body)), (404, "route_not_found"));
    let (status, body) = server.send(reqwest::Method::DELETE, "/v1/models", None).await;
    assert_eq!((status, error_code(&body)), (405, "method_not_allowed"));
    server.stop().await;
}

/// Writes `head` and then `body` on a new connection to the server, without reading,
/// then reads the whole answer until the server closes (bounded by [`TEST_WAIT_MS_MAX`]):
/// what a raw HTTP/1.1 client that writes its request before it reads gets back.
async fn raw_exchange(server: &Harness, head: &str, body: &[u8]) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let addr = server.base.trim_start_matches("http://");
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(head.as_bytes())
            .await
            .expect("the server reads the head");
        stream
            .write_all(body)
            .await
            .expect("the server reads the body it was sent");
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.expect("the answer arrives whole");
        String::from_utf8(answer).unwrap()
    };
    tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), exchange)
        .await
        .expect("the server answers in time")
}

/// Goal: a client that sends its headers and then stops short of its body's end gets
/// 408 `body_timeout` once `SERVER_REQUEST_BODY_READ_MS` has passed, not at the request
/// timeout, and the connection closes (before, it held its concurrency slot for the
/// whole request timeout, 130 s by default); a body that arrives whole is answered as
/// before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_short_is_answered_408_within_the_read_limit() {
    use troupe_server::limits::SERVER_REQUEST_BODY_READ_MS;
    let server = start_default().await;
    let body = br#"{"text": "#;
    let head = format!(
        "POST /v1/agents/echo/messages HTTP/1.1\r\nhost: troupe\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len() + 10
    );
    let started = tokio::time::Instant::now();
    let answer = raw_exchange(&server, &head, body).await;
    let took = started.elapsed();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
    assert!(
        took >= Duration::from_millis(SERVER_REQUEST_BODY_READ_MS)
            && took < Duration::from_millis(SERVER_REQUEST_BODY_READ_MS + 3_000),
        "answered after {took:?}"
    );
    let (status, reply) = server.post("/v1/agents/echo/messages", json!({"text": "whole"})).await;
    assert_eq!(status, 200, "{reply}");
    server.stop().await;
}

/// A body over the limit gets its 413, whether declared or chunked, and a client that
/// writes all of it before it reads still gets the answer (the server reads the rest and
/// discards it) rather than a reset connection; a body declared beyond what the server
/// would read is answered from the head alone. Before, the server answered from the
/// `Content-Length` at once and closed with the body unread, and a client still writing
/// it sometimes got a broken pipe instead of the 413.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_body_is_answered_413_and_its_writer_reads_the_answer() {
    use troupe_server::limits::{SERVER_REQUEST_BODY_DRAIN_MAX_BYTES, SERVER_REQUEST_BODY_SIZE_MAX_BYTES};
    let server = start_default().await;
    // Through reqwest, which writes the whole body first, again and again.
    let huge = json!({"text": "x".repeat(SERVER_REQUEST_BODY_SIZE_MAX_BYTES)});
    for _ in 0..20 {
        let (status, body) = server.post("/v1/agents/echo/messages", huge.clone()).await;
        assert_eq!((status, error_code(&body)), (413, "body_too_large"));
    }
    // Many times over the limit, but within what the server reads on: more than the
    // sockets' buffers hold, so the server must read it for the client to finish writing.
    let head = format!(
        "POST /v1/agents/echo/messages HTTP/1.1\r\nhost: troupe\r\ncontent-type: application/json\r\ncontent-length: {SERVER_REQUEST_BODY_DRAIN_MAX_BYTES}\r\nconnection: close\r\n\r\n"
    );
    let answer = raw_exchange(&server, &head, &vec![b' '; SERVER_REQUEST_BODY_DRAIN_MAX_BYTES]).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("\"body_too_large\""), "{answer}");
    // A body just within the limit is read and handled (422: the text is too long for a
    // message, which only a handler that read it can say).
    let within = json!({"text": "x".repeat(SERVER_REQUEST_BODY_SIZE_MAX_BYTES - 100)});
    let (status, body) = server.post("/v1/agents/echo/messages", within).await;
    assert_eq!((status, error_code(&body)), (422, "message_too_long"));

    // Chunked, with no length declared: refused once the limit is passed.
    let head = "POST /v1/agents/echo/messages HTTP/1.1\r\nhost: troupe\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";
    let chunk = vec![b' '; 64 * 1024];
    let mut body = Vec::new();
    for _ in 0..=SERVER_REQUEST_BODY_SIZE_MAX_BYTES / chunk.len() {
        body.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        body.extend_from_slice(&chunk);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(b"0\r\n\r\n");
    let answer = raw_exchange(&server, head, &body).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("\"body_too_large\""), "{answer}");

    // Declared beyond what the server would read: answered with none of it sent.
    let head = format!(
        "POST /v1/agents/echo/messages HTTP/1.1\r\nhost: troupe\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        SERVER_REQUEST_BODY_DRAIN_MAX_BYTES + 1
    );
    let answer = raw_exchange(&server, &head, b"").await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("\"body_too_large\""), "{answer}");

    // A body that breaks off (here: chunking that is not hex) is refused as such.
    let head = "POST /v1/agents/echo/messages HTTP/1.1\r\nhost: troupe\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";
    let answer = raw_exchange(&server, head, b"5\r\n{\"tex\r\nzz\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("\"body_unreadable\""), "{answer}");

    // The server still answers normally afterwards.
    let (status, body) = server.post("/v1/agents/echo/messages", json!({"text": "hi"})).await;
    assert_eq!((status, body["text"].as_str()), (200, Some("echo: hi")));
    server.stop().await;
}

/// Goal: a request refused before its body is read (401 without the token, 503 over the
/// concurrency limit) still gets its answer when its client writes a large body whole
/// before reading, as most clients do: the server reads the body and discards it first.
/// Before, it answered and closed with the body unread, and the client writing it got a
/// reset connection. Method: a raw client writes a body of
/// `SERVER_REQUEST_BODY_DRAIN_MAX_BYTES`, more than the sockets' buffers hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_before_its_body_is_read_gets_its_answer_not_a_reset() {
    use troupe_server::limits::SERVER_REQUEST_BODY_DRAIN_MAX_BYTES;
    let config = ServerConfig::default().token(TOKEN).concurrent_requests_max(1);
    let server = Arc::new(start(config, KindConfig::default()).await);
    let body = vec![b' '; SERVER_REQUEST_BODY_DRAIN_MAX_BYTES];
    let head = |authorization: &str| {
        format!(
            "POST /v1/agents/echo/messages HTTP/1.1\r\nhost: troupe\r\n{authorization}content-type: application/json\r\ncontent-length: {SERVER_REQUEST_BODY_DRAIN_MAX_BYTES}\r\nconnection: close\r\n\r\n"
        )
    };
    let answer = raw_exchange(&server, &head(""), &body).await;
    assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    assert!(answer.contains("\"unauthorized\""), "{answer}");

    // Over the limit: one slow turn in flight holds the only slot.
    let mut events = server.system().subscribe();
    let first = {
        let server = Arc::clone(&server);
        tokio::spawn(async move { server.post("/v1/agents/slow/messages", json!({"text": "a"})).await })
    };
    turn_started(&mut events, "slow").await;
    let answer = raw_exchange(&server, &head(&format!("authorization: Bearer {TOKEN}\r\n")), &body).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("\"overloaded\""), "{answer}");
    assert_eq!(first.await.unwrap().0, 200);
    Arc::into_inner(server).unwrap().stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_request_timeout_answers_504() {
    let config = ServerConfig::default().request_timeout(Duration::from_millis(200));
    let server = start(config, KindConfig::default()).await;
    let (status, body) = server.post("/v1/agents/slow/messages", json!({"text": "hi"})).await;
    assert_eq!((status, error_code(&body)), (504, "request_timeout"), "{body}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_message_sends_the_turns_events_then_the_reply() {
    let server = start_default().await;
    let by_query = server
        .request(reqwest::Method::POST, "/v1/agents/caller/messages?stream=true")
        .header("content-type", "application/json")
        .body(json!({"text": "ping"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(by_query.status().as_u16(), 200);
    assert_eq!(by_query.headers()["content-type"], "text/event-stream");
    let events = parse_sse(&by_query.text().await.unwrap());
    let names: Vec<&str> = events.iter().map(|(name, _)| name.as_str()).collect();
    let data: Vec<Value> = events
        .iter()
        .map(|(_, data)| serde_json::from_str(data).unwrap())
        .collect();
    assert_eq!(names.last(), Some(&"reply"), "{names:?}");
    assert_eq!(
        data.last().unwrap()["text"],
        "caller heard: echo: [message from agent caller] from caller: ping"
    );
    // The root call to caller, its turn, its nested call to echo and echo's turn.
    let root = data
        .iter()
        .find(|event| event["type"] == "call_started" && event["target"] == "agent/caller")
        .expect("the root call");
    assert_eq!(root["parent"], Value::Null);
    let nested = data
        .iter()
        .find(|event| event["type"] == "call_started" && event["target"] == "agent/echo")
        .expect("the nested call");
    assert_eq!(nested["parent"], root["call"]);
    assert_eq!(nested["depth"], 1);
    for agent in ["agent/caller", "agent/echo"] {
        assert!(
            data.iter()
                .any(|event| event["type"] == "turn_started" && event["agent"] == agent),
            "{agent}: {names:?}"
        );
        assert!(
            data.iter()
                .any(|event| event["type"] == "turn_ended" && event["agent"] == agent && event["ok"] == true),
            "{agent}: {names:?}"
        );
    }
    assert!(names.contains(&"tool_finished"), "{names:?}");
    assert_eq!(
        names.iter().filter(|name| **name == "call_finished").count(),
        2,
        "{names:?}"
    );

    // Accept: text/event-stream, and an error as the final event.
    let by_accept = server
        .request(reqwest::Method::POST, "/v1/agents/slow/messages")
        .header("content-type", "application/json")
        .header("accept", "text/event-stream")
        .body(json!({"text": "hi", "timeout_ms": 100}).to_string())
        .send()
        .await
        .unwrap();
    let events = parse_sse(&by_accept.text().await.unwrap());
    let (name, data) = events.last().unwrap();
    assert_eq!(name, "error");
    let data: Value = serde_json::from_str(data).unwrap();
    assert_eq!(data["status"], 504);
    assert_eq!(data["error"]["code"], "timeout");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_pages_back_over_the_conversation_log() {
    let server = start_default().await;
    for n in 0..3 {
        let (status, _) = server
            .post("/v1/agents/echo/messages", json!({"text": format!("m{n}")}))
            .await;
        assert_eq!(status, 200);
    }
    let (status, page) = server.get("/v1/agents/echo/history?limit=2").await;
    assert_eq!(status, 200);
    assert_eq!(page["total"], 6);
    let contents: Vec<&str> = page["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|message| message["content"].as_str().unwrap())
        .collect();
    assert_eq!(contents, ["m2", "echo: m2"]);
    assert_eq!(page["messages"][0]["index"], 4);
    assert_eq!(page["messages"][0]["role"], "user");
    assert_eq!(page["next_before"], 4);
    let (_, page) = server.get("/v1/agents/echo/history?limit=3&before=4").await;
    let indices: Vec<u64> = page["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|message| message["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, [1, 2, 3]);
    assert_eq!(page["next_before"], 1);
    let (_, page) = server.get("/v1/agents/echo/history?before=1").await;
    assert_eq!(page["messages"][0]["content"], "m0");
    assert_eq!(page["next_before"], Value::Null);
    let (_, page) = server.get("/v1/agents/slow/history").await;
    assert_eq!(page["total"], 0);

    let (status, body) = server.get("/v1/agents/echo/history?limit=0").await;
    assert_eq!((status, error_code(&body)), (400, "invalid_query"));
    let (status, body) = server.get("/v1/agents/echo/history?limit=1001").await;
    assert_eq!((status, error_code(&body)), (400, "invalid_query"));
    let (status, body) = server.get("/v1/agents/echo/history?limit=ten").await;
    assert_eq!((status, error_code(&body)), (400, "invalid_query"));
    let (status, body) = server.get("/v1/agents/nobody/history").await;
    assert_eq!((status, error_code(&body)), (404, "agent_not_found"));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_and_delegated_tasks_are_accepted_tracked_and_cancelled() {
    let server = start_default().await;
    let (status, body) = server.post("/v1/agents/echo/notify", json!({"text": "fyi"})).await;
    assert_eq!(status, 202, "{body}");
    assert!(body["msg_id"].as_str().unwrap().starts_with("echo.in"), "{body}");
    for _ in 0..2 {
        let (status, body) = server
            .post("/v1/agents/echo/notify", json!({"text": "once", "msg_id": "n-1"}))
            .await;
        assert_eq!((status, body["msg_id"].as_str()), (202, Some("n-1")));
    }
    let (status, body) = server
        .post("/v1/agents/echo/notify", json!({"text": "x", "msg_id": ""}))
        .await;
    assert_eq!((status, error_code(&body)), (422, "invalid_message_id"));
    let (status, body) = server.post("/v1/agents/nobody/notify", json!({"text": "x"})).await;
    assert_eq!((status, error_code(&body)), (404, "agent_not_found"));

    let (status, body) = server
        .post("/v1/agents/boss/tasks", json!({"to": "echo", "text": "do it"}))
        .await;
    assert_eq!(status, 202, "{body}");
    let task_id = body["task_id"].as_str().unwrap().to_string();
    let path = format!("/v1/agents/boss/tasks/{task_id}");
    let finished = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let (status, body) = server.get(&path).await;
            assert_eq!(status, 200, "{body}");
            if body["state"] == "completed" {
                return body;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the task completes");
    assert_eq!(finished["to"], "echo");
    assert_eq!(
        finished["result"],
        format!("echo: [task {task_id} delegated by agent boss] do it")
    );
    let (status, body) = server.post(&format!("{path}/cancel"), json!({})).await;
    assert_eq!((status, body["state"].as_str()), (200, Some("completed")));

    let (status, body) = server
        .post("/v1/agents/boss/tasks", json!({"to": "nobody", "text": "x"}))
        .await;
    assert_eq!((status, error_code(&body)), (404, "agent_not_found"), "{body}");
    let (status, body) = server.get("/v1/agents/boss/tasks/none").await;
    assert_eq!((status, error_code(&body)), (404, "task_not_found"));
    let (status, body) = server.post("/v1/agents/boss/tasks/none/cancel", json!({})).await;
    assert_eq!((status, error_code(&body)), (404, "task_not_found"));
    server.stop().await;
}

/// Goal: a full agent mailbox is 429 `busy` with `Retry-After`, never a queue without
/// bound. Method: mailbox capacity 1; one slow turn runs (seen on the event stream),
/// then two more messages race for the one queue slot: exactly one is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_mailbox_is_429_busy_with_retry_after() {
    let server = Arc::new(start(ServerConfig::default(), KindConfig::default().with_mailbox_capacity(1)).await);
    let mut events = server.system().subscribe();
    let first = {
        let server = Arc::clone(&server);
        tokio::spawn(async move { server.post("/v1/agents/slow/messages", json!({"text": "a"})).await })
    };
    turn_started(&mut events, "slow").await;
    let mut racers = Vec::new();
    for text in ["b", "c"] {
        let server = Arc::clone(&server);
        racers.push(tokio::spawn(async move {
            let response = server
                .request(reqwest::Method::POST, "/v1/agents/slow/messages")
                .header("content-type", "application/json")
                .body(json!({"text": text}).to_string())
                .send()
                .await
                .unwrap();
            let retry_after = response
                .headers()
                .get("retry-after")
                .map(|value| value.to_str().unwrap().to_string());
            let status = response.status().as_u16();
            let body: Value = serde_json::from_str(&response.text().await.unwrap()).unwrap();
            (status, retry_after, body)
        }));
    }
    let mut statuses = Vec::new();
    for racer in racers {
        let (status, retry_after, body) = racer.await.unwrap();
        if status == 429 {
            assert_eq!(error_code(&body), "busy");
            assert_eq!(retry_after.as_deref(), Some("1"));
        } else {
            assert_eq!(body["text"], "slow done");
        }
        statuses.push(status);
    }
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 429]);
    assert_eq!(first.await.unwrap().0, 200);
    assert_eq!(server.system().runtime().counters().busy_refused, 1);
    Arc::into_inner(server).unwrap().stop().await;
}

/// Goal: over its concurrency limit the server refuses at once (503 `overloaded`,
/// `Retry-After`) and serves again when a slot frees. Method: limit 1, one slow turn in
/// flight (seen on the event stream), then a second request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_concurrency_limit_the_server_answers_503_at_once() {
    let config = ServerConfig::default().concurrent_requests_max(1);
    let server = Arc::new(start(config, KindConfig::default()).await);
    let mut events = server.system().subscribe();
    let first = {
        let server = Arc::clone(&server);
        tokio::spawn(async move { server.post("/v1/agents/slow/messages", json!({"text": "a"})).await })
    };
    turn_started(&mut events, "slow").await;
    let refused = server.request(reqwest::Method::GET, "/v1/agents").send().await.unwrap();
    assert_eq!(refused.status().as_u16(), 503);
    assert_eq!(refused.headers()["retry-after"], "1");
    let body: Value = serde_json::from_str(&refused.text().await.unwrap()).unwrap();
    assert_eq!(error_code(&body), "overloaded");
    assert!(
        !first.is_finished(),
        "the slow turn ({SLOW_TURN_MS} ms) was still running when the second request was refused"
    );
    assert_eq!(first.await.unwrap().0, 200);
    assert_eq!(server.get("/v1/agents").await.0, 200);
    Arc::into_inner(server).unwrap().stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_carries_agent_events_as_they_happen() {
    let server = start_default().await;
    let mut stream = server.request(reqwest::Method::GET, "/v1/events").send().await.unwrap();
    assert_eq!(stream.status().as_u16(), 200);
    assert_eq!(stream.headers()["content-type"], "text/event-stream");
    // The stream is open once its headers arrived: events from now on are in it.
    let (status, _) = server.post("/v1/agents/echo/messages", json!({"text": "hi"})).await;
    assert_eq!(status, 200);
    let mut text = String::new();
    let seen = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let chunk = stream.chunk().await.unwrap().expect("the stream stays open");
            text.push_str(std::str::from_utf8(&chunk).unwrap());
            let events = parse_sse(&text);
            if events
                .iter()
                .any(|(name, data)| name == "turn_ended" && data.contains("agent/echo"))
            {
                return events;
            }
        }
    })
    .await
    .expect("the turn's end arrives on the stream");
    let names: Vec<&str> = seen.iter().map(|(name, _)| name.as_str()).collect();
    for expected in [
        "call_started",
        "activated",
        "turn_started",
        "model_responded",
        "turn_ended",
    ] {
        assert!(names.contains(&expected), "{expected} missing from {names:?}");
    }
    for (name, data) in &seen {
        let value: Value = serde_json::from_str(data).unwrap();
        assert_eq!(value["type"], name.as_str());
    }
    drop(stream);
    server.stop().await;
}

/// The `created` of model `id` in a `GET /v1/models` answer.
fn model_created(models: &Value, id: &str) -> u64 {
    let model = models["data"]
        .as_array()
        .and_then(|data| data.iter().find(|model| model["id"] == id))
        .unwrap_or_else(|| panic!("{id} is not in {models}"));
    model["created"].as_u64().unwrap_or_else(|| panic!("{model}"))
}

/// Goal: `GET /v1/models` answers when each agent was defined, in Unix seconds, as
/// OpenAI's `created` (0 for every agent until 2026-12-06): an agent the system was
/// built with, the time the system started; one defined or replaced through the API,
/// the time of that definition. Method: read the wall clock before the server starts
/// and around each request; define `helper` with `POST`, replace it with `PUT`, and
/// check every `created` lies between the reads around what defined it (and that the
/// replacement's time, in microseconds, is later than the definition's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_answer_when_each_agent_was_defined() {
    let before_start = unix_seconds();
    let server = start_default().await;
    let (status, models) = server.get("/v1/models").await;
    let after = unix_seconds();
    assert_eq!(status, 200, "{models}");
    let built = models["data"].as_array().expect("a list of models");
    assert_eq!(built.len(), 4, "{models}");
    for model in built {
        let created = model["created"].as_u64().unwrap_or_else(|| panic!("{model}"));
        assert!(
            (before_start..=after).contains(&created),
            "{model}: created {created}, the wall clock {before_start}..={after}"
        );
    }

    let before_post = unix_seconds();
    let (status, body) = server
        .post("/v1/agents", json!({"id": "helper", "role": "helps"}))
        .await;
    assert_eq!(status, 201, "{body}");
    let (_, models) = server.get("/v1/models").await;
    let after = unix_seconds();
    let defined = model_created(&models, "helper");
    assert!(
        (before_post..=after).contains(&defined),
        "created {defined}, the wall clock {before_post}..={after}"
    );
    let defined_us = server.system().directory().get("helper").unwrap().defined_at_us();

    let before_put = unix_seconds();
    let (status, body) = server
        .send(
            reqwest::Method::PUT,
            "/v1/agents/helper",
            Some(json!({"role": "helps more"})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let (_, models) = server.get("/v1/models").await;
    let after = unix_seconds();
    let replaced = model_created(&models, "helper");
    assert!(
        (before_put..=after).contains(&replaced),
        "created {replaced}, the wall clock {before_put}..={after}"
    );
    let replaced_us = server.system().directory().get("helper").unwrap().defined_at_us();
    assert!(
        replaced_us > defined_us && defined_us.is_some(),
        "replaced at {replaced_us:?}, defined at {defined_us:?}"
    );
    // The built agents keep the time the system started.
    for model in built {
        let id = model["id"].as_str().unwrap();
        assert_eq!(model_created(&models, id), model["created"].as_u64().unwrap(), "{id}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_style_chat_completions_and_models_answer_in_openais_shapes() {
    let server = start_default().await;
    let (status, models) = server.get("/v1/models").await;
    assert_eq!(status, 200);
    assert_eq!(models["object"], "list");
    // `created` is when the agent was defined (`models_answer_when_each_agent_was_defined`).
    let created = models["data"][0]["created"].clone();
    assert!(created.as_u64().is_some_and(|created| created > 0), "{models}");
    assert_eq!(
        models["data"][0],
        json!({"id": "boss", "object": "model", "created": created, "owned_by": "troupe"})
    );

    let request = json!({
        "model": "echo",
        "messages": [
            {"role": "system", "content": "ignored"},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "echo: first"},
            {"role": "user", "content": [{"type": "text", "text": "sec"}, {"type": "text", "text": "ond"}]},
        ],
        "temperature": 0.2,
    });
    let before = unix_seconds();
    let (status, body) = server.post("/v1/chat/completions", request.clone()).await;
    let after = unix_seconds();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "echo");
    // `created`: when the completion was made, in Unix seconds (0 until 2026-12-06).
    let created = body["created"].as_u64().unwrap_or_else(|| panic!("{body}"));
    assert!(
        (before..=after).contains(&created),
        "created {created}, the wall clock {before}..={after}"
    );
    assert_eq!(
        body["choices"][0]["message"],
        json!({"role": "assistant", "content": "echo: second"})
    );
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert!(body["usage"]["total_tokens"].is_u64());

    let mut streamed = request;
    streamed["stream"] = json!(true);
    let response = chat_raw(&server, streamed.to_string()).await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let events = parse_sse(&response.text().await.unwrap());
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|(_, data)| serde_json::from_str(data).unwrap())
        .collect();
    assert!(chunks.iter().all(|chunk| chunk["object"] == "chat.completion.chunk"));
    let created = chunks[0]["created"].as_u64().unwrap_or_else(|| panic!("{}", chunks[0]));
    assert!((after..=unix_seconds()).contains(&created), "created {created}");
    assert!(
        chunks.iter().all(|chunk| chunk["created"] == created),
        "one `created` for every chunk"
    );
    let text: String = chunks
        .iter()
        .filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "echo: second");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");

    let (status, body) = server
        .post(
            "/v1/chat/completions",
            json!({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!((status, error_code(&body)), (404, "model_not_found"));
    let (status, body) = server
        .post(
            "/v1/chat/completions",
            json!({"model": "echo", "messages": [{"role": "system", "content": "x"}]}),
        )
        .await;
    assert_eq!((status, error_code(&body)), (400, "no_user_message"));
    let (status, body) = server
        .post(
            "/v1/chat/completions",
            json!({"model": "echo", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        )
        .await;
    assert_eq!((status, error_code(&body)), (400, "unsupported_content"));
    server.stop().await;
}

/// Goal: the OpenAI-compatible route takes a request whose optional fields are JSON
/// `null`, as OpenAI's API does (it types them nullable, `stream` default false) and as
/// clients other than the official Python one send them: null is absent. Method: raw
/// JSON bodies (not built from a `json!` that could drop a field) with every optional
/// request field OpenAI documents as nullable set to null, also on the messages; the
/// answer must be the plain `chat.completion` (null `stream` is not streaming), and with
/// `"stream": true` beside the nulls the SSE chunks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_openai_request_with_null_optional_fields_is_served_as_if_they_were_absent() {
    let server = start_default().await;
    let nulls = r#""stream_options": null, "max_tokens": null, "max_completion_tokens": null,
        "temperature": null, "top_p": null, "n": null, "stop": null, "presence_penalty": null,
        "frequency_penalty": null, "logit_bias": null, "logprobs": null, "top_logprobs": null,
        "user": null, "seed": null, "tools": null, "tool_choice": null, "parallel_tool_calls": null,
        "response_format": null, "service_tier": null, "metadata": null, "store": null,
        "reasoning_effort": null, "modalities": null, "audio": null, "prediction": null,
        "functions": null, "function_call": null, "web_search_options": null"#;
    let messages = r#""messages": [
        {"role": "system", "content": "ignored", "name": null},
        {"role": "user", "content": "first", "name": null},
        {"role": "assistant", "content": null, "name": null, "tool_calls": null, "refusal": null,
         "function_call": null, "audio": null},
        {"role": "user", "content": "second", "name": null}
    ]"#;
    let post = |body: String| chat_raw(&server, body);

    let plain = format!(r#"{{"model": "echo", {messages}, "stream": null, {nulls}}}"#);
    let response = post(plain).await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    assert_eq!(status, 200, "a request with null optional fields: {text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        body["object"], "chat.completion",
        "null stream is not streaming: {body}"
    );
    assert_eq!(body["choices"][0]["message"]["content"], "echo: second");

    let streamed = format!(r#"{{"model": "echo", {messages}, "stream": true, {nulls}}}"#);
    let response = post(streamed).await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let text: String = chat_chunks(&response.text().await.unwrap())
        .iter()
        .filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str().map(str::to_string))
        .collect();
    assert_eq!(text, "echo: second");

    // Null where OpenAI requires a value is still refused, naming the field.
    let response = post(r#"{"model": "echo", "messages": null}"#.to_string())
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let body: Value = serde_json::from_str(&response.text().await.unwrap()).unwrap();
    assert_eq!(error_code(&body), "invalid_body");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("messages"),
        "{body}"
    );
    server.stop().await;
}

/// The usage of `llm`'s last turn for agent `agent`, a one-step turn, recomputed here as
/// the scripted model counts it (one token per whitespace-separated word of the prompt's
/// messages and of the answer): OpenAI's `usage` object.
fn scripted_turn_usage(llm: &ScriptedLlm, agent: &str) -> Value {
    let request = llm.requests_of(agent).pop().expect("the agent asked its model");
    let words = |text: &str| u64::try_from(text.split_whitespace().count()).unwrap();
    let prompt: u64 = request
        .messages
        .iter()
        .map(|message| {
            assert!(
                message.tool_calls.is_empty(),
                "a prompt without tool calls: {message:?}"
            );
            words(&message.content)
        })
        .sum();
    let answer = llm.answers().pop().expect("the model answered");
    assert_eq!(answer.agent.key(), agent);
    let completion = words(&answer.message.content);
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// Goal: a streamed chat completion asked with `"stream_options": {"include_usage":
/// true}` ends as OpenAI's does: after the finish chunk, one chunk with empty `choices`
/// and the turn's real token usage, the last before `[DONE]`, every other chunk with
/// `"usage": null`; asked without it (absent, null, or false), no chunk has a `usage`
/// field. The plain answer's `usage` is its turn's too. Method: raw JSON bodies to a
/// real server over an agent on the scripted model; the expected usage is recomputed
/// from the requests and answers the model recorded, turn by turn (the agent keeps its
/// conversation, so each turn's prompt is longer and the numbers differ).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_completion_asked_for_usage_ends_with_the_turns_usage_chunk() {
    let (llm, server) = echo_server().await;
    let post = |options: &str, stream: bool| {
        let body = format!(
            r#"{{"model": "echo", "messages": [{{"role": "user", "content": "count these four words"}}],
                "stream": {stream}{options}}}"#
        );
        chat_raw(&server, body)
    };

    let response = post(r#", "stream_options": {"include_usage": true}"#, true)
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let chunks = chat_chunks(&response.text().await.unwrap());
    let expected = scripted_turn_usage(&llm, "echo");
    let (usage_chunk, others) = chunks.split_last().unwrap();
    assert_eq!(
        usage_chunk["choices"],
        json!([]),
        "the usage chunk is last before [DONE]: {chunks:?}"
    );
    assert_eq!(usage_chunk["usage"], expected, "{usage_chunk}");
    assert_eq!(usage_chunk["object"], "chat.completion.chunk");
    assert_eq!(usage_chunk["id"], others[0]["id"], "{chunks:?}");
    assert_eq!(
        others.last().unwrap()["choices"][0]["finish_reason"],
        "stop",
        "{chunks:?}"
    );
    for chunk in others {
        assert_eq!(chunk.get("usage"), Some(&Value::Null), "{chunk}");
    }

    for options in [
        "",
        r#", "stream_options": null"#,
        r#", "stream_options": {"include_usage": false}"#,
    ] {
        let response = post(options, true).await.unwrap();
        assert_eq!(response.status().as_u16(), 200, "{options}");
        let chunks = chat_chunks(&response.text().await.unwrap());
        for chunk in &chunks {
            assert!(chunk.get("usage").is_none(), "{options}: {chunk}");
            assert_eq!(chunk["choices"].as_array().map(Vec::len), Some(1), "{options}: {chunk}");
        }
    }

    let response = post("", false).await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let body: Value = serde_json::from_str(&response.text().await.unwrap()).unwrap();
    assert_eq!(body["usage"], scripted_turn_usage(&llm, "echo"), "{body}");
    assert_ne!(body["usage"], expected, "a later turn's prompt is longer");
    server.stop().await;
}

/// Goal: `stream_options` on a chat completion that is not streamed is refused as
/// OpenAI's API refuses it: 400 `invalid_request_error`, the message naming
/// `stream_options` and `stream`, before the agent is asked (before: it was ignored, 200
/// with a plain answer, and the agent ran a turn). `stream` false, null and absent are
/// all "not streamed"; `stream_options` `{}` counts as given, null as absent. Method: raw
/// JSON bodies to a real server over an agent on the scripted model; the model's
/// recorded requests show whether the agent ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_options_on_a_completion_that_is_not_streamed_is_refused_400() {
    let (llm, server) = echo_server().await;
    let post = |fields: &str| {
        let body = format!(r#"{{"model": "echo", "messages": [{{"role": "user", "content": "hi"}}]{fields}}}"#);
        chat_raw(&server, body)
    };
    for fields in [
        r#", "stream": false, "stream_options": {"include_usage": true}"#,
        r#", "stream_options": {"include_usage": true}"#,
        r#", "stream": null, "stream_options": {"include_usage": false}"#,
        r#", "stream_options": {}"#,
    ] {
        let response = post(fields).await.unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        assert_eq!(status, 400, "{fields}: {text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error_code(&body), "invalid_request_error", "{fields}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("'stream_options'") && message.contains("'stream'"),
            "{fields}: {message}"
        );
    }
    assert!(llm.requests_of("echo").is_empty(), "a refused request asked the agent");

    // Null is absent; with `"stream": true` the options are read (as before).
    let response = post(r#", "stream": false, "stream_options": null"#).await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let response = post(r#", "stream": true, "stream_options": {"include_usage": true}"#)
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    chat_chunks(&response.text().await.unwrap());
    assert_eq!(llm.requests_of("echo").len(), 2, "the two accepted requests ran");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_by_route_and_status_and_show_the_runtimes_counters() {
    let server = start_default().await;
    assert_eq!(
        server.post("/v1/agents/echo/messages", json!({"text": "hi"})).await.0,
        200
    );
    assert_eq!(server.get("/v1/agents/nobody").await.0, 404);
    assert_eq!(server.get("/v1/agents/nobody").await.0, 404);
    let response = server.request(reqwest::Method::GET, "/metrics").send().await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert!(response.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain"));
    let text = response.text().await.unwrap();
    let lines: Vec<&str> = text.lines().collect();
    for expected in [
        "troupe_http_requests_total{method=\"POST\",route=\"/v1/agents/{id}/messages\",status=\"200\"} 1",
        "troupe_http_requests_total{method=\"GET\",route=\"/v1/agents/{id}\",status=\"404\"} 2",
        "troupe_runtime_turns_run_total 1",
        "troupe_runtime_busy_refused_total 0",
        "troupe_agents 4",
        "troupe_event_streams_open 0",
    ] {
        assert!(lines.contains(&expected), "{expected} missing from\n{text}");
    }
    server.stop().await;
}

#[tokio::test]
async fn a_non_loopback_address_without_a_token_is_refused_with_what_to_do() {
    let anywhere: SocketAddr = "0.0.0.0:8080".parse().unwrap();
    let error = ServerConfig::default().check_bind(anywhere).unwrap_err();
    assert!(matches!(error, ServeError::TokenRequired { addr } if addr == anywhere));
    let message = error.to_string();
    assert!(
        message.contains("--token") && message.contains("127.0.0.1"),
        "{message}"
    );
    assert!(ServerConfig::default().token(TOKEN).check_bind(anywhere).is_ok());
    assert!(ServerConfig::default()
        .check_bind("127.0.0.1:8080".parse().unwrap())
        .is_ok());
    assert!(ServerConfig::default()
        .check_bind("[::1]:8080".parse().unwrap())
        .is_ok());
    let short = ServerConfig::default().token("short").check_bind(anywhere).unwrap_err();
    assert!(matches!(short, ServeError::TokenTooShort { length: 5, .. }), "{short}");
    let loopback: std::net::SocketAddr = "127.0.0.1:1".parse().unwrap();
    let most = troupe_server::limits::SERVER_CONCURRENT_REQUESTS_MAX;
    for given in [0, most + 1, usize::MAX] {
        let error = ServerConfig::default()
            .concurrent_requests_max(given)
            .check_bind(loopback)
            .unwrap_err();
        assert!(
            matches!(error, ServeError::ConcurrentRequests { given: g, max } if g == given && max == most),
            "{error}"
        );
        assert_eq!(
            error.to_string(),
            format!("concurrent_requests_max is {given}: give from 1 to 65536 requests to handle at once")
        );
    }
    for given in [1, most] {
        let config = ServerConfig::default().concurrent_requests_max(given);
        assert!(config.check_bind(loopback).is_ok(), "{given}");
    }
    let longest = Duration::from_millis(troupe_server::limits::SERVER_REQUEST_TIMEOUT_MS_MAX);
    for given in [Duration::ZERO, longest + Duration::from_millis(1), Duration::MAX] {
        let error = ServerConfig::default()
            .request_timeout(given)
            .check_bind(loopback)
            .unwrap_err();
        assert!(
            matches!(error, ServeError::RequestTimeout { given_ms, min_ms: 1, max_ms: 3_600_000 } if given_ms == given.as_millis()),
            "{error}"
        );
        assert_eq!(
            error.to_string(),
            format!("request_timeout is {} ms: give from 1 to 3600000 ms", given.as_millis())
        );
    }
    for given in [Duration::from_millis(1), longest] {
        let config = ServerConfig::default().request_timeout(given);
        assert!(config.check_bind(loopback).is_ok(), "{given:?}");
    }
    for kept in [0, troupe_server::limits::A2A_TASKS_KEPT_MAX + 1] {
        let error = ServerConfig::default()
            .a2a_tasks_kept(kept)
            .check_bind(loopback)
            .unwrap_err();
        assert!(
            matches!(error, ServeError::A2aTasksKept { kept: given, .. } if given == kept),
            "{error}"
        );
    }
    assert!(ServerConfig::default().a2a_tasks_kept(1).check_bind(loopback).is_ok());

    // `serve` itself refuses such a listener before serving anything.
    let system = AgentSystem::builder()
        .llm(Arc::new(script()))
        .agent(AgentSpec::new("echo"))
        .start()
        .unwrap();
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let served = troupe_server::serve(
        listener,
        system.client(),
        ServerConfig::default(),
        std::future::pending(),
    )
    .await;
    assert!(matches!(served, Err(ServeError::TokenRequired { .. })), "{served:?}");
    system.shutdown().await;
}

/// Goal: a shutdown lets a request in flight finish with its reply, ends event streams,
/// and then accepts no connection. Method: a slow turn in flight and an open event
/// stream when the shutdown signal comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_requests_in_flight_finish_and_ends_event_streams() {
    let mut server = start_default().await;
    let mut events = server.system().subscribe();
    let stream = server.request(reqwest::Method::GET, "/v1/events").send().await.unwrap();
    let url = format!("{}/v1/agents/slow/messages", server.base);
    let http = server.http.clone();
    let in_flight = tokio::spawn(async move {
        let response = http
            .post(url)
            .header("content-type", "application/json")
            .body(json!({"text": "finish me"}).to_string())
            .send()
            .await
            .unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    });
    turn_started(&mut events, "slow").await;
    let _ = server.stop.take().unwrap().send(());
    // The event stream ends (its body completes) instead of holding the shutdown.
    let rest = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), stream.text())
        .await
        .expect("the event stream ends at shutdown");
    assert!(rest.is_ok(), "{rest:?}");
    let (status, body) = in_flight.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("slow done"), "{body}");
    tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), server.served.take().unwrap())
        .await
        .expect("serve returns after the last request")
        .unwrap()
        .unwrap();
    let refused = reqwest::Client::new()
        .get(format!("{}/health", server.base))
        .send()
        .await;
    assert!(
        refused.is_err(),
        "a new connection was accepted after shutdown: {refused:?}"
    );
    server.system.take().unwrap().shutdown().await;
}

/// Goal: a router built without `serve`'s checks (`troupe_server::router`, for an
/// embedder's own axum server) takes any `concurrent_requests_max` without panicking and
/// serves: tokio's `Semaphore::new` panicked above 2^61 permits, so `usize::MAX` crashed
/// the embedder at start.
/// Method: the router with `usize::MAX` under `axum::serve` on loopback, and a
/// `GET /health` through it.
#[tokio::test]
async fn a_router_built_with_any_concurrency_limit_serves() {
    let system = support::agents(script(), &["echo"], KindConfig::default())
        .start()
        .unwrap();
    let app = troupe_server::router(
        system.client(),
        ServerConfig::default().concurrent_requests_max(usize::MAX),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = tokio::spawn(async move { axum::serve(listener, app).await });
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_millis(TEST_WAIT_MS_MAX))
        .build()
        .unwrap();
    let response = http.get(format!("http://{addr}/health")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    served.abort();
    system.shutdown().await;
}

/// Goal: a notification's `msg_id` longer than the server takes is refused as the
/// client's error (422 `invalid_message_id`, naming the limit), not answered 500
/// `storage_failed` once the agent's store refuses the key it makes of it; an id of
/// exactly the limit is accepted.
/// Method: `POST /v1/agents/echo/notify` with ids of `SERVER_MESSAGE_ID_LENGTH_MAX_BYTES`, 100,000
/// bytes and one byte over the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_id_over_the_limit_is_422_not_a_storage_failure() {
    use troupe_server::limits::SERVER_MESSAGE_ID_LENGTH_MAX_BYTES;
    let server = start_default().await;
    let longest = "n".repeat(SERVER_MESSAGE_ID_LENGTH_MAX_BYTES);
    let (status, body) = server
        .post("/v1/agents/echo/notify", json!({"text": "fyi", "msg_id": longest}))
        .await;
    assert_eq!(
        (status, body["msg_id"].as_str()),
        (202, Some(longest.as_str())),
        "{body}"
    );
    for length in [100_000, SERVER_MESSAGE_ID_LENGTH_MAX_BYTES + 1] {
        let (status, body) = server
            .post(
                "/v1/agents/echo/notify",
                json!({"text": "fyi", "msg_id": "n".repeat(length)}),
            )
            .await;
        assert_eq!(
            (status, error_code(&body)),
            (422, "invalid_message_id"),
            "{length}: {body}"
        );
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&length.to_string()) && message.contains(&SERVER_MESSAGE_ID_LENGTH_MAX_BYTES.to_string()),
            "{message}"
        );
    }
    server.stop().await;
}

/// Goal: a task id longer than any id an agent gives a task names no task: `GET` and
/// `cancel` answer 404 `task_not_found`, not 500 `storage_failed` (the store refuses a
/// key that long), and nothing is cancelled.
/// Method: ids of `SERVER_TASK_ID_LENGTH_MAX_BYTES` + 1 and 50,000 bytes against agent
/// `boss`, which has delegated nothing; an id of exactly the limit is looked up too
/// (404 as well: no such task).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_id_over_the_limit_is_404_not_a_storage_failure() {
    use troupe_server::limits::SERVER_TASK_ID_LENGTH_MAX_BYTES;
    let server = start_default().await;
    for length in [
        SERVER_TASK_ID_LENGTH_MAX_BYTES,
        SERVER_TASK_ID_LENGTH_MAX_BYTES + 1,
        50_000,
    ] {
        let path = format!("/v1/agents/boss/tasks/{}", "t".repeat(length));
        let (status, body) = server.get(&path).await;
        assert_eq!(
            (status, error_code(&body)),
            (404, "task_not_found"),
            "GET {length}: {body}"
        );
        let (status, body) = server.post(&format!("{path}/cancel"), json!({})).await;
        assert_eq!(
            (status, error_code(&body)),
            (404, "task_not_found"),
            "cancel {length}: {body}"
        );
    }
    server.stop().await;
}

/// Methods sent by [`metrics_series_stay_bounded_whatever_methods_clients_send`].
const INVENTED_METHODS: usize = 50;

/// Goal: `/metrics` has one series per standard method, route template and status, not
/// one per method name a client invents: HTTP allows any token as a method, and every
/// request is counted, a refused one too (401 without the token), so before, anyone who
/// could reach the server grew the metrics (and their memory) without bound.
/// Method: a server with a token; [`INVENTED_METHODS`] requests without it, each with a
/// method of its own (`PROBE0`, `PROBE1`, ...): none is named in `/metrics`, they are
/// counted together under `method="other"`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_series_stay_bounded_whatever_methods_clients_send() {
    let server = start(ServerConfig::default().token(TOKEN), KindConfig::default()).await;
    for index in 0..INVENTED_METHODS {
        let method = reqwest::Method::from_bytes(format!("PROBE{index}").as_bytes()).unwrap();
        let response = server.request(method, "/v1/agents").send().await.unwrap();
        assert_eq!(response.status().as_u16(), 401);
    }
    let response = server
        .request(reqwest::Method::GET, "/metrics")
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let text = response.text().await.unwrap();
    let invented = text.lines().filter(|line| line.contains("method=\"PROBE")).count();
    assert_eq!(invented, 0, "series named by clients' methods:\n{text}");
    let expected = format!(
        "troupe_http_requests_total{{method=\"other\",route=\"/v1/agents\",status=\"401\"}} {INVENTED_METHODS}"
    );
    assert!(
        text.lines().any(|line| line == expected),
        "{expected} missing from\n{text}"
    );
    server.stop().await;
}

/// Goal: the token is taken whatever case the client writes the scheme in: HTTP's
/// authentication scheme is case-insensitive (RFC 9110, 11.1), so `bearer TOKEN` is the
/// same credential as `Bearer TOKEN`; before, it was refused 401 as if absent. A wrong
/// token stays refused in any case.
/// Method: `GET /v1/agents` with `Authorization: bearer`, `BEARER` and `Bearer` and the
/// token (200), and with `bearer` and a wrong token (401).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bearer_scheme_is_matched_whatever_its_case() {
    let server = start(ServerConfig::default().token(TOKEN), KindConfig::default()).await;
    for scheme in ["bearer", "BEARER", "Bearer", "bEaReR"] {
        let response = server
            .request(reqwest::Method::GET, "/v1/agents")
            .header("authorization", format!("{scheme} {TOKEN}"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 200, "{scheme}");
    }
    let wrong = server
        .request(reqwest::Method::GET, "/v1/agents")
        .header("authorization", "bearer test-token-0123456780")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status().as_u16(), 401);
    server.stop().await;
}

/// Goal: with two servers on one SQLite file (a supported set-up: each sees the other's
/// agents within `DIRECTORY_REFRESH_MS`), a message whose turn ran on this server's
/// activation after the other server had taken the agent over (the turn's commit was
/// fenced off: nothing was committed, and the stale activation is closed at once) is
/// answered 503 `fenced` with `Retry-After`, an answer a client retries, not 500
/// `storage_failed`; the same message sent again is answered from the newest state.
/// Method: `echo` asked on the first server, then on the second, then on the first
/// (fenced), then on the first again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_whose_turn_another_server_fenced_off_is_503_fenced_with_retry_after() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("troupe.db");
    let start = || {
        let store = Arc::new(troupe_runtime::SqliteStore::open(&path).expect("the SQLite file opens"));
        let builder = AgentSystem::builder()
            .llm(Arc::new(script()))
            .store(store as _)
            .agent(AgentSpec::new("echo"));
        Harness::start(builder, ServerConfig::default())
    };
    let here = start().await;
    let elsewhere = start().await;
    let (status, body) = here.post("/v1/agents/echo/messages", json!({"text": "one"})).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = elsewhere.post("/v1/agents/echo/messages", json!({"text": "two"})).await;
    assert_eq!(status, 200, "{body}");

    let response = here
        .request(reqwest::Method::POST, "/v1/agents/echo/messages")
        .header("content-type", "application/json")
        .body(json!({"text": "three"}).to_string())
        .send()
        .await
        .expect("the server answers");
    assert_eq!(response.status().as_u16(), 503);
    assert!(
        response.headers().get("retry-after").is_some(),
        "{:?}",
        response.headers()
    );
    let body: Value = response.json().await.unwrap();
    assert_eq!(error_code(&body), "fenced", "{body}");

    let (status, body) = here.post("/v1/agents/echo/messages", json!({"text": "three"})).await;
    assert_eq!(status, 200, "sent again: {body}");
    assert_eq!(body["text"], "echo: three", "{body}");
    here.stop().await;
    elsewhere.stop().await;
}

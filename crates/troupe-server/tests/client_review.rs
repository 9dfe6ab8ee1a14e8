//! A demanding client's review of `troupe serve` from outside, over HTTP: hundreds of
//! requests at once to one agent with a small mailbox, clients that leave mid-request
//! and mid-stream, bodies and ids a careless client sends, A2A cancels racing a task's
//! end, a graceful shutdown with requests and streams in flight, and the 504 of a turn
//! that ran out of time. Each property is an assertion that fails if the guarantee
//! breaks; each test is bounded in requests and time, on loopback only.
//!
//! Normal build only: HTTP is not simulated (the crate is empty under madsim).
#![cfg(not(madsim))]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use troupe_agent::{ScriptRule, ScriptedLlm};
use troupe_runtime::KindConfig;
use troupe_server::ServerConfig;

mod support;
use support::{agents, parse_sse, Gated, Harness, POLL_MS, TEST_WAIT_MS_MAX};

/// How long the scripted model takes to answer, in milliseconds: long enough that
/// requests sent at once queue behind each other.
const MODEL_LATENCY_MS: u64 = 20;
/// Requests sent at once in the concurrency test.
const CONCURRENT_REQUESTS: usize = 240;
/// The mailbox of the agent they all ask, in messages.
const MAILBOX_CAPACITY: usize = 2;
/// Requests the server handles at once in the concurrency test.
const SERVER_REQUESTS_MAX: usize = 4;
/// The longest any one request of the concurrency test may take to be answered, in
/// milliseconds: a hang fails the test rather than the suite's timeout.
const ANSWER_WAIT_MS_MAX: u64 = 5_000;

/// A served system of `ids` on the scripted model ("heard: {input}" after `latency`),
/// with mailboxes of `mailbox` messages and `config`.
async fn serve_echo(ids: &[&str], latency: Duration, mailbox: usize, config: ServerConfig) -> Harness {
    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("heard: {input}").latency(latency));
    let kind = KindConfig::default().with_mailbox_capacity(mailbox);
    Harness::start(agents(llm, ids, kind), config).await
}

/// The mailbox of the agents of tests that do not probe backpressure, in messages: more
/// than any of them fills.
const ROOMY_MAILBOX: usize = 64;

/// [`serve_echo`] with [`ROOMY_MAILBOX`] and the default server configuration: the
/// set-up most tests here share.
async fn serve_echo_roomy(ids: &[&str], latency: Duration) -> Harness {
    serve_echo(ids, latency, ROOMY_MAILBOX, ServerConfig::default()).await
}

/// A served system of `ids` whose model waits at a gate the test opens.
async fn serve_gated(ids: &[&str], config: ServerConfig) -> (Harness, Arc<tokio::sync::Semaphore>) {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let llm = Gated {
        script: ScriptedLlm::new().rule(ScriptRule::any_agent().reply("heard: {input}")),
        gate: Arc::clone(&gate),
    };
    let mut builder = troupe_agent::AgentSystem::builder()
        .llm(Arc::new(llm))
        .kind_config(KindConfig::default());
    for id in ids {
        builder = builder.agent(troupe_agent::AgentSpec::new(*id));
    }
    (Harness::start(builder, config).await, gate)
}

/// A small seeded generator (xorshift64*), so a run's disconnect points replay.
struct Seeded(u64);

impl Seeded {
    fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % bound
    }
}

/// One answer as a client sees it: status, `Retry-After`, body text.
struct Answer {
    status: u16,
    retry_after: Option<String>,
    text: String,
}

async fn read(response: reqwest::Response) -> Answer {
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|value| value.to_str().unwrap().to_string());
    let text = response.text().await.expect("the body is read to its end");
    Answer {
        status,
        retry_after,
        text,
    }
}

/// POSTs `body` as JSON to `path` with `client`, answered within [`ANSWER_WAIT_MS_MAX`].
async fn post_with(client: &reqwest::Client, base: &str, path: &str, body: &Value) -> Answer {
    let sent = client
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send();
    let response = tokio::time::timeout(Duration::from_millis(ANSWER_WAIT_MS_MAX), sent)
        .await
        .unwrap_or_else(|_| panic!("POST {path} {body} hung past {ANSWER_WAIT_MS_MAX} ms"))
        .unwrap_or_else(|error| panic!("POST {path} {body}: no answer: {error}"));
    read(response).await
}

/// The agent's conversation log as `(role, content)` pairs.
async fn history(server: &Harness, agent: &str) -> Vec<(String, String)> {
    let (status, page) = server.get(&format!("/v1/agents/{agent}/history?limit=1000")).await;
    assert_eq!(status, 200, "{page}");
    page["messages"]
        .as_array()
        .unwrap_or_else(|| panic!("{page}"))
        .iter()
        .map(|entry| {
            (
                entry["role"].as_str().unwrap_or_default().to_string(),
                entry["content"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// How many times each `(role, content)` is in `log`.
fn counted(log: &[(String, String)]) -> BTreeMap<(String, String), usize> {
    let mut counts = BTreeMap::new();
    for entry in log {
        *counts.entry(entry.clone()).or_insert(0) += 1;
    }
    counts
}

/// Checks that a refusal is REST's error shape: exactly `{"error": {"code", "message"}}`,
/// the code one of `codes`, a message saying something; returns the code.
fn rest_error(what: &str, text: &str, codes: &[&str]) -> String {
    let body = error_body(what, text, &["code", "message"]);
    assert_eq!(body.as_object().unwrap().len(), 1, "{what}: {text}");
    let error = &body["error"];
    let code = code_among(what, text, error, codes);
    assert!(!error["message"].as_str().unwrap().is_empty(), "{what}: {text}");
    code
}

/// The body of the refusal `text` (named `what` in failures), checked to be JSON with an
/// `error` object of exactly the keys `keys` (sorted): the start both error shapes share.
fn error_body(what: &str, text: &str, keys: &[&str]) -> Value {
    let body: Value = serde_json::from_str(text).unwrap_or_else(|error| panic!("{what}: not JSON ({error}): {text}"));
    let error = body["error"]
        .as_object()
        .unwrap_or_else(|| panic!("{what}: no error object: {text}"));
    let mut found: Vec<&str> = error.keys().map(String::as_str).collect();
    found.sort_unstable();
    assert_eq!(found, keys, "{what}: {text}");
    body
}

/// The `code` of the error object `error` of the refusal `text`, checked to be one of
/// `codes`.
fn code_among(what: &str, text: &str, error: &Value, codes: &[&str]) -> String {
    let code = error["code"].as_str().unwrap().to_string();
    assert!(
        codes.contains(&code.as_str()),
        "{what}: code {code}, not one of {codes:?}: {text}"
    );
    code
}

/// Checks that a refusal is OpenAI's error shape (`message`, `type`, `param`, `code`),
/// the code one of `codes`; returns the code.
fn openai_error(what: &str, text: &str, kind: &str, codes: &[&str]) -> String {
    let body = error_body(what, text, &["code", "message", "param", "type"]);
    let error = &body["error"];
    assert_eq!(error["type"], kind, "{what}: {text}");
    code_among(what, text, error, codes)
}

/// Goal: hundreds of requests at once to one agent with a mailbox of 2 are each
/// answered (with the reply to its own text) or refused in a typed way: 429 `busy`
/// (the mailbox) or 503 `overloaded` (the server's request limit), each with
/// `Retry-After: 1` and the route's error shape (REST's on `/messages`, OpenAI's on
/// `/v1/chat/completions`); never a hang, never a 500; and the conversation holds each
/// answered text once and no refused one. Method: 240 requests sent at once (half REST,
/// half chat completions), server limit 4 requests, model 20 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_requests_at_once_are_each_answered_or_refused_typed_with_retry_after() {
    let server = serve_echo(
        &["echo"],
        Duration::from_millis(MODEL_LATENCY_MS),
        MAILBOX_CAPACITY,
        ServerConfig::default().concurrent_requests_max(SERVER_REQUESTS_MAX),
    )
    .await;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(CONCURRENT_REQUESTS)
        .build()
        .unwrap();
    let mut sent = tokio::task::JoinSet::new();
    for n in 0..CONCURRENT_REQUESTS {
        let (client, base) = (client.clone(), server.base.clone());
        sent.spawn(async move {
            let text = format!("request {n}");
            let chat = n % 2 == 1;
            let answer = if chat {
                let body = json!({"model": "echo", "messages": [{"role": "user", "content": text}]});
                post_with(&client, &base, "/v1/chat/completions", &body).await
            } else {
                post_with(&client, &base, "/v1/agents/echo/messages", &json!({"text": text})).await
            };
            (text, chat, answer)
        });
    }
    let mut answered = Vec::new();
    let mut refused: BTreeMap<String, usize> = BTreeMap::new();
    while let Some(joined) = sent.join_next().await {
        let (text, chat, answer) = joined.unwrap();
        let what = format!("{text} (chat: {chat}): {} {}", answer.status, answer.text);
        match answer.status {
            200 => {
                let body: Value = serde_json::from_str(&answer.text).unwrap();
                let reply = if chat {
                    body["choices"][0]["message"]["content"].clone()
                } else {
                    body["text"].clone()
                };
                assert_eq!(reply, format!("heard: {text}"), "{what}");
                answered.push(text);
            }
            429 | 503 => {
                assert_eq!(answer.retry_after.as_deref(), Some("1"), "{what}");
                let expected = if answer.status == 429 { "busy" } else { "overloaded" };
                let code = if chat {
                    // docs/serve.md: `invalid_request_error` for a 4xx, `server_error` otherwise.
                    let kind = if answer.status == 429 {
                        "invalid_request_error"
                    } else {
                        "server_error"
                    };
                    openai_error(&what, &answer.text, kind, &[expected])
                } else {
                    rest_error(&what, &answer.text, &[expected])
                };
                *refused.entry(format!("{} {code}", answer.status)).or_insert(0) += 1;
            }
            _ => panic!("neither an answer nor a typed refusal: {what}"),
        }
    }
    // The test proves nothing unless both happened.
    assert!(!answered.is_empty(), "no request was answered; refused {refused:?}");
    assert!(
        refused.get("429 busy").is_some_and(|n| *n > 0),
        "the mailbox of {MAILBOX_CAPACITY} never refused one of {CONCURRENT_REQUESTS}: {refused:?}"
    );
    eprintln!("answered {}, refused {refused:?}", answered.len());

    let log = counted(&history(&server, "echo").await);
    for n in 0..CONCURRENT_REQUESTS {
        let text = format!("request {n}");
        let expected = usize::from(answered.contains(&text));
        let asked = log.get(&("user".to_string(), text.clone())).copied().unwrap_or(0);
        let replied = log
            .get(&("assistant".to_string(), format!("heard: {text}")))
            .copied()
            .unwrap_or(0);
        assert_eq!((asked, replied), (expected, expected), "{text} in the conversation");
    }
    // And the agent still answers.
    let (status, body) = server.post("/v1/agents/echo/messages", json!({"text": "after"})).await;
    assert_eq!((status, &body["text"]), (200, &json!("heard: after")), "{body}");
    server.stop().await;
}

/// Rounds of clients that leave in the disconnect test.
const LEAVING_CLIENTS: u64 = 60;
/// Of them, how many run at once.
const LEAVING_AT_ONCE: u64 = 10;
/// The longest a leaving client waits for its answer before it hangs up, in
/// milliseconds (it picks a time below this).
const LEAVE_AFTER_MS_MAX: u64 = 80;

/// How long the streams and connections of clients that hung up may stay open on the
/// server, in milliseconds: far less than its idle timeout (`SERVER_HEADER_READ_MS`, 10 s).
const LEFT_CLOSE_WAIT_MS: u64 = 2_000;
/// The gauge of the connections the server holds open.
const CONNECTIONS_OPEN: &str = "troupe_http_connections_open";

/// The gauge `name` of `/metrics`, read on a connection of its own, closed after (it
/// counts 1 among the connections open). Not the harness's client: it keeps its
/// connection in its pool and may open a second one, which the server closes only at
/// its idle timeout, 10 s later: the client's connection, not one the server failed to
/// close (seen: the gauge at 2 for 10 s after the clients left, then 1).
async fn scraped(base: &str, name: &str) -> u64 {
    let scraper = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let text = scraper
        .get(format!("{base}/metrics"))
        .timeout(Duration::from_millis(ANSWER_WAIT_MS_MAX))
        .send()
        .await
        .expect("/metrics answers")
        .text()
        .await
        .unwrap();
    support::gauge(&text, name)
}

/// What a leaving client does: sends `text` to `echo` one way or another and hangs up
/// at a point picked by `pick`.
async fn leave(client: reqwest::Client, base: String, text: String, way: u64, pick: u64) {
    let (path, body) = match way {
        0 => ("/v1/agents/echo/messages".to_string(), json!({"text": text})),
        1 => (
            "/v1/agents/echo/messages?stream=true".to_string(),
            json!({"text": text}),
        ),
        _ => (
            "/v1/chat/completions".to_string(),
            json!({"model": "echo", "stream": true, "messages": [{"role": "user", "content": text}]}),
        ),
    };
    let request = client
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(body.to_string());
    if way == 0 {
        // Hangs up mid-request, before or after the answer (the timeout drops it).
        let _ = request
            .timeout(Duration::from_millis(1 + pick % LEAVE_AFTER_MS_MAX))
            .send()
            .await;
        return;
    }
    // A stream: read `pick % 4` chunks (0: only the headers), then hang up.
    let Ok(Ok(mut response)) = tokio::time::timeout(Duration::from_millis(ANSWER_WAIT_MS_MAX), request.send()).await
    else {
        panic!("the stream {text} got no headers within {ANSWER_WAIT_MS_MAX} ms");
    };
    for _ in 0..pick % 4 {
        let read = tokio::time::timeout(Duration::from_millis(ANSWER_WAIT_MS_MAX), response.chunk()).await;
        match read {
            Ok(Ok(Some(_))) => {}
            Ok(Ok(None)) => return,
            Ok(Err(error)) => panic!("the stream {text} broke: {error}"),
            Err(_) => panic!("the stream {text} stalled past {ANSWER_WAIT_MS_MAX} ms"),
        }
    }
    drop(response);
}

/// Goal: clients that hang up mid-request and mid-stream, at points picked by a seeded
/// generator, leave nothing behind: the open-stream gauge and the connection gauge come
/// back to what they were, a later request is answered, and each text is in the
/// conversation at most once, with its answer exactly as often as itself (a turn is
/// recorded whole or not at all, never twice). Method: 60 clients, 10 at once, each a
/// plain message (hung up after 1-80 ms), a streamed message or a streamed chat
/// completion (hung up after 0-3 chunks); model 20 ms; connections not reused, so each
/// hang-up closes its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_hang_up_mid_request_or_mid_stream_leave_nothing_behind() {
    let server = serve_echo_roomy(&["echo"], Duration::from_millis(MODEL_LATENCY_MS)).await;
    // Scraped on connections of their own (closed after): only the scrape's is open.
    assert_eq!(scraped(&server.base, CONNECTIONS_OPEN).await, 1);
    let leaving = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let mut seeded = Seeded(0x5eed_0084);
    for batch in 0..LEAVING_CLIENTS / LEAVING_AT_ONCE {
        let mut clients = tokio::task::JoinSet::new();
        for n in 0..LEAVING_AT_ONCE {
            let text = format!("leaving {}", batch * LEAVING_AT_ONCE + n);
            let (way, pick) = (seeded.below(3), seeded.below(1_000));
            clients.spawn(leave(leaving.clone(), server.base.clone(), text, way, pick));
        }
        while let Some(left) = clients.join_next().await {
            left.unwrap();
        }
    }
    drop(leaving);
    // Every stream's slot freed and every hung-up connection closed, well before the
    // server's idle timeout (`SERVER_HEADER_READ_MS`, 10 s) would close one left open.
    let waited = tokio::time::Instant::now();
    let mut open = (u64::MAX, u64::MAX);
    while waited.elapsed() < Duration::from_millis(LEFT_CLOSE_WAIT_MS) {
        open = (
            scraped(&server.base, "troupe_streams_open").await,
            scraped(&server.base, CONNECTIONS_OPEN).await,
        );
        if open == (0, 1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    assert_eq!(
        open,
        (0, 1),
        "(streams, connections) open {LEFT_CLOSE_WAIT_MS} ms after their clients hung up"
    );
    // Queued behind whatever the others left in the mailbox: answered, so they ended.
    let (status, body) = server.post("/v1/agents/echo/messages", json!({"text": "after"})).await;
    assert_eq!((status, &body["text"]), (200, &json!("heard: after")), "{body}");

    let log = counted(&history(&server, "echo").await);
    let mut recorded = 0;
    for n in 0..LEAVING_CLIENTS {
        let text = format!("leaving {n}");
        let asked = log.get(&("user".to_string(), text.clone())).copied().unwrap_or(0);
        let replied = log
            .get(&("assistant".to_string(), format!("heard: {text}")))
            .copied()
            .unwrap_or(0);
        assert!(asked <= 1, "{text} recorded {asked} times: {log:?}");
        assert_eq!(
            replied, asked,
            "{text}: asked {asked} times, answered {replied}: {log:?}"
        );
        recorded += asked;
    }
    eprintln!("{recorded} of {LEAVING_CLIENTS} turns recorded");
    server.stop().await;
}

/// One JSON-RPC request `method` with `params` to agent `agent`'s A2A endpoint: the
/// answer's `result`, or its `error`'s code and message.
async fn rpc(
    client: &reqwest::Client,
    base: &str,
    agent: &str,
    method: &str,
    params: Value,
) -> Result<Value, (i64, String)> {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    let answer = post_with(client, base, &format!("/a2a/{agent}"), &body).await;
    assert_eq!(answer.status, 200, "{method}: {}", answer.text);
    let value: Value = serde_json::from_str(&answer.text).unwrap();
    match value.get("error") {
        Some(error) => Err((
            error["code"].as_i64().unwrap(),
            error["message"].as_str().unwrap().to_string(),
        )),
        None => Ok(value["result"].clone()),
    }
}

/// Polls `GetTask` of `id` (of agent `echo`) until its state is none of `passing`, for
/// at most [`TEST_WAIT_MS_MAX`]: the task then.
async fn ended_task(client: &reqwest::Client, base: &str, id: &str, passing: &[&str]) -> Value {
    let mut last = Value::Null;
    let waited = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let task = rpc(client, base, "echo", "GetTask", json!({"id": id})).await.unwrap();
            let state = task["status"]["state"].as_str().unwrap_or_default().to_string();
            last = task;
            if !passing.contains(&state.as_str()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "task {id} stayed in {passing:?}: {last}");
    last
}

/// Rounds of the A2A cancel race.
const CANCEL_ROUNDS: u64 = 20;

/// Goal: A2A `CancelTask` racing its task's start and end has one outcome, told the
/// same to everyone: of two cancels sent at once, exactly one is answered `canceled` if
/// the task ends canceled (the other -32002, already ended), and then its message never
/// reached the agent; otherwise both are -32002 and the task completes with its answer.
/// A cancel and a get of an unknown task are -32001. Method: 20 rounds, each two tasks
/// sent with `returnImmediately` (the second waits behind the first, model 20 ms); once
/// the first runs, after 0-39 ms (seeded), two `CancelTask` of the second and a
/// `GetTask` at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a2a_cancels_racing_a_tasks_end_agree_on_one_outcome() {
    let server = serve_echo_roomy(&["echo"], Duration::from_millis(MODEL_LATENCY_MS)).await;
    let (client, base) = (server.http.clone(), server.base.clone());
    let send = |text: String| {
        json!({
            "message": {"messageId": text.clone(), "role": "ROLE_USER", "parts": [{"text": text}]},
            "configuration": {"returnImmediately": true},
        })
    };
    let mut seeded = Seeded(0xca_9ce1);
    let mut outcomes: BTreeMap<&str, u64> = BTreeMap::new();
    for round in 0..CANCEL_ROUNDS {
        let first = rpc(&client, &base, "echo", "SendMessage", send(format!("first {round}")))
            .await
            .unwrap();
        let second = rpc(&client, &base, "echo", "SendMessage", send(format!("second {round}")))
            .await
            .unwrap();
        let first_id = first["task"]["id"]
            .as_str()
            .unwrap_or_else(|| panic!("{first}"))
            .to_string();
        let id = second["task"]["id"].as_str().unwrap().to_string();
        // The first runs (20 ms of model); the cancels come 0-39 ms later, around the
        // second's start and end.
        ended_task(&client, &base, &first_id, &["TASK_STATE_SUBMITTED"]).await;
        tokio::time::sleep(Duration::from_millis(seeded.below(40))).await;
        let (one, two, got) = tokio::join!(
            rpc(&client, &base, "echo", "CancelTask", json!({"id": id})),
            rpc(&client, &base, "echo", "CancelTask", json!({"id": id})),
            rpc(&client, &base, "echo", "GetTask", json!({"id": id})),
        );
        let got = got.unwrap_or_else(|error| panic!("GetTask {id}: {error:?}"));
        assert!(got["status"]["state"].is_string(), "{got}");
        let won: Vec<&Value> = [&one, &two]
            .into_iter()
            .filter_map(|answer| answer.as_ref().ok())
            .collect();
        for answer in [&one, &two] {
            match answer {
                Ok(task) => assert_eq!(task["status"]["state"], "TASK_STATE_CANCELED", "{task}"),
                Err((code, message)) => assert_eq!(*code, -32002, "{id}: {message}"),
            }
        }
        let ended = ended_task(&client, &base, &id, &["TASK_STATE_SUBMITTED", "TASK_STATE_WORKING"]).await;
        let first_ended = ended_task(
            &client,
            &base,
            &first_id,
            &["TASK_STATE_SUBMITTED", "TASK_STATE_WORKING"],
        )
        .await;
        assert_eq!(first_ended["status"]["state"], "TASK_STATE_COMPLETED", "{first_ended}");
        match ended["status"]["state"].as_str().unwrap() {
            "TASK_STATE_CANCELED" => {
                assert_eq!(
                    won.len(),
                    1,
                    "canceled, but {} cancels say so: {one:?} {two:?}",
                    won.len()
                );
                assert_eq!(ended["artifacts"], json!([]), "{ended}");
                *outcomes.entry("canceled").or_insert(0) += 1;
            }
            "TASK_STATE_COMPLETED" => {
                assert!(won.is_empty(), "completed, yet a cancel said canceled: {one:?} {two:?}");
                assert_eq!(
                    ended["artifacts"][0]["parts"][0]["text"],
                    format!("heard: second {round}"),
                    "{ended}"
                );
                *outcomes.entry("completed").or_insert(0) += 1;
            }
            other => panic!("task {id} ended {other}: {ended}"),
        }
        // Once ended, a cancel is -32002 however often it is sent.
        let again = rpc(&client, &base, "echo", "CancelTask", json!({"id": id})).await;
        assert!(
            matches!(&again, Err((-32002, message)) if message.contains("already ended")),
            "{again:?}"
        );
    }
    eprintln!("outcomes {outcomes:?}");
    // A canceled task's message never reached the agent; a completed one's did, once.
    let log = counted(&history(&server, "echo").await);
    for round in 0..CANCEL_ROUNDS {
        let asked = log
            .get(&("user".to_string(), format!("second {round}")))
            .copied()
            .unwrap_or(0);
        assert!(asked <= 1, "second {round} asked {asked} times");
    }
    let user_turns: usize = log.iter().filter(|((role, _), _)| role == "user").map(|(_, n)| n).sum();
    assert_eq!(
        user_turns as u64,
        CANCEL_ROUNDS + outcomes.get("completed").copied().unwrap_or(0),
        "every first task and every completed second one ran once: {log:?}"
    );
    for method in ["CancelTask", "GetTask"] {
        let unknown = rpc(&client, &base, "echo", method, json!({"id": "echo-task-999999"})).await;
        assert!(
            matches!(&unknown, Err((-32001, _))),
            "{method} of an unknown task: {unknown:?}"
        );
    }
    server.stop().await;
}

/// Goal: a graceful shutdown with plain requests and streams in flight answers each of
/// them whole (a plain reply; a streamed message to its `reply` event; a streamed chat
/// completion to `[DONE]`), returns once they are answered, well within the shutdown
/// grace, and runs no request sent after the shutdown began: it is never answered 200
/// and its text never reaches an agent. Method: five agents whose model waits at a
/// gate; two plain messages, a streamed message and a streamed chat completion in flight
/// (their turns started); the stop; a new request on a new connection; the gate opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_answers_every_request_and_stream_in_flight_and_runs_none_sent_after() {
    /// How long answering them and `serve`'s return may take, in milliseconds: far
    /// less than `SERVER_SHUTDOWN_GRACE_MS` (10 s).
    const STOP_WAIT_MS: u64 = 4_000;
    let (mut server, gate) = serve_gated(&["p0", "p1", "s0", "c0", "late"], ServerConfig::default()).await;
    let mut events = server.system().client().subscribe();
    let mut in_flight = tokio::task::JoinSet::new();
    for (agent, path, body) in [
        ("p0", "/v1/agents/p0/messages", json!({"text": "to p0"})),
        ("p1", "/v1/agents/p1/messages", json!({"text": "to p1"})),
        ("s0", "/v1/agents/s0/messages?stream=true", json!({"text": "to s0"})),
        (
            "c0",
            "/v1/chat/completions",
            json!({"model": "c0", "stream": true, "messages": [{"role": "user", "content": "to c0"}]}),
        ),
    ] {
        let (client, base) = (server.http.clone(), server.base.clone());
        in_flight.spawn(async move {
            let response = client
                .post(format!("{base}{path}"))
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await
                .unwrap_or_else(|error| panic!("{agent}: no answer: {error}"));
            let status = response.status().as_u16();
            let text = response
                .text()
                .await
                .unwrap_or_else(|error| panic!("{agent}: the body was cut: {error}"));
            (agent, status, text)
        });
    }
    for _ in 0..4 {
        // Four turns start (in any order): each request is in its agent's hands.
        turn_started_any(&mut events).await;
    }
    let _ = server.stop.take().unwrap().send(());
    let served = server.served.take().unwrap();
    // Give the shutdown a moment to close the listener's accepting.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let late = reqwest::Client::new()
        .post(format!("{}/v1/agents/late/messages", server.base))
        .header("content-type", "application/json")
        .body(json!({"text": "sent after the stop"}).to_string())
        .timeout(Duration::from_millis(STOP_WAIT_MS))
        .send();
    let late = tokio::spawn(late);
    gate.add_permits(16);
    let answered = tokio::time::timeout(Duration::from_millis(STOP_WAIT_MS), async {
        let mut answered = BTreeMap::new();
        while let Some(joined) = in_flight.join_next().await {
            let (agent, status, text) = joined.unwrap();
            answered.insert(agent, (status, text));
        }
        answered
    })
    .await
    .expect("every request in flight is answered after the stop");
    for (agent, (status, text)) in &answered {
        assert_eq!(*status, 200, "{agent}: {text}");
        match *agent {
            "p0" | "p1" => {
                let body: Value = serde_json::from_str(text).unwrap();
                assert_eq!(body["text"], format!("heard: to {agent}"), "{text}");
            }
            "s0" => {
                let events = parse_sse(text);
                let (last, data) = events.last().unwrap_or_else(|| panic!("no event: {text}"));
                assert_eq!(last, "reply", "{text}");
                assert!(data.contains("heard: to s0"), "{text}");
            }
            _ => {
                let events = parse_sse(text);
                assert_eq!(events.last().map(|(_, data)| data.as_str()), Some("[DONE]"), "{text}");
                assert!(text.contains("heard: to c0"), "{text}");
            }
        }
    }
    let begun = tokio::time::Instant::now();
    tokio::time::timeout(Duration::from_millis(STOP_WAIT_MS), served)
        .await
        .expect("serve returns once the requests in flight are answered")
        .unwrap()
        .expect("serve ends cleanly");
    eprintln!(
        "serve returned {} ms after the last answer",
        begun.elapsed().as_millis()
    );
    let late = late.await.unwrap();
    assert!(
        late.as_ref().map_or(true, |response| response.status() != 200),
        "a request sent after the stop was served: {late:?}"
    );
    // Nothing runs it later either: its agent never gets the text.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let log = server.system().conversation_log("late").await.unwrap();
    assert!(log.is_empty(), "the late request reached its agent: {log:?}");
    server.system.take().unwrap().shutdown().await;
}

/// Waits until any agent starts a turn (at most [`TEST_WAIT_MS_MAX`]).
async fn turn_started_any(events: &mut tokio::sync::broadcast::Receiver<troupe_agent::AgentEvent>) {
    tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            if let Ok(troupe_agent::AgentEvent::TurnStarted { .. }) = events.recv().await {
                return;
            }
        }
    })
    .await
    .expect("a turn starts");
}

/// The agent's model latency in the 504 test, in milliseconds: longer than the
/// message's `timeout_ms`.
const SLOW_MODEL_MS: u64 = 400;
/// The message's `timeout_ms` in the 504 test.
const SHORT_TIMEOUT_MS: u64 = 100;

/// Goal: a message whose agent does not answer within its `timeout_ms` is 504
/// `timeout` whose message says what to do (a larger `timeout_ms`, naming the
/// maximum, or a stream), and carries no `Retry-After`: RFC 9110 (10.2.3) gives
/// `Retry-After` its meaning with 503 (how long the service will be unavailable) and
/// 3xx; here the server is not unavailable, the request's own budget ran out, and no
/// wait makes the same request with the same budget succeed (docs/serve.md, "Errors").
/// What makes sending it again safe is shown instead: the turn was abandoned, nothing
/// of it is in the conversation, and the same text sent again with a longer budget is
/// answered and recorded once. A streamed message's `error` event says the same (less
/// the advice to stream). Before the fix the message was only "invocation of
/// agent/slow timed out after 100 ms", streamed or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_runs_out_of_time_is_504_saying_what_to_do_and_is_safe_to_send_again() {
    let server = serve_echo_roomy(&["slow"], Duration::from_millis(SLOW_MODEL_MS)).await;
    let path = "/v1/agents/slow/messages";
    let answer = send_one(&server, path, SHORT_TIMEOUT_MS).await;
    let what = format!("{} {:?} {}", answer.status, answer.retry_after, answer.text);
    assert_eq!(answer.status, 504, "{what}");
    assert_eq!(rest_error(&what, &answer.text, &["timeout"]), "timeout");
    assert_eq!(answer.retry_after, None, "{what}");
    let body: Value = serde_json::from_str(&answer.text).unwrap();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("100 ms")
            && message.contains("timeout_ms")
            && message.contains(&troupe_server::limits::SERVER_MESSAGE_TIMEOUT_MS_MAX.to_string()),
        "the 504 does not say what to do: {message}"
    );
    // Past the model's latency: the abandoned turn left nothing.
    slow_turn_left_nothing(&server).await;
    let metrics = server.metrics().await;
    assert_eq!(
        support::gauge(&metrics, "troupe_runtime_turns_abandoned_total"),
        1,
        "{metrics}"
    );

    // Streamed, the error event says the same, less the advice to stream.
    let streamed = send_one(&server, "/v1/agents/slow/messages?stream=true", SHORT_TIMEOUT_MS).await;
    assert_eq!(streamed.status, 200, "{}", streamed.text);
    let events = parse_sse(&streamed.text);
    let (name, data) = events.last().unwrap_or_else(|| panic!("no event: {}", streamed.text));
    assert_eq!(name, "error", "{}", streamed.text);
    let data: Value = serde_json::from_str(data).unwrap();
    assert_eq!(
        (&data["status"], &data["error"]["code"]),
        (&json!(504), &json!("timeout")),
        "{data}"
    );
    let message = data["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("timeout_ms")
            && message.contains(&troupe_server::limits::SERVER_MESSAGE_TIMEOUT_MS_MAX.to_string())
            && !message.contains("stream=true"),
        "the streamed 504 does not say what to do: {message}"
    );
    slow_turn_left_nothing(&server).await;

    let again = send_one(&server, path, 4 * SLOW_MODEL_MS).await;
    assert_eq!(again.status, 200, "{}", again.text);
    let log = history(&server, "slow").await;
    let expected =
        [("user", "one"), ("assistant", "heard: one")].map(|(role, text)| (role.to_string(), text.to_string()));
    assert_eq!(log, expected, "the message sent again is recorded once");
    server.stop().await;
}

/// POSTs the text "one" with `timeout_ms` to `path` of `server` (the 504 test's message).
async fn send_one(server: &Harness, path: &str, timeout_ms: u64) -> Answer {
    let body = json!({"text": "one", "timeout_ms": timeout_ms});
    post_with(&server.http, &server.base, path, &body).await
}

/// Waits past the slow model's latency and checks that the abandoned turn of `slow`
/// left nothing in its conversation.
async fn slow_turn_left_nothing(server: &Harness) {
    tokio::time::sleep(Duration::from_millis(2 * SLOW_MODEL_MS)).await;
    assert_eq!(history(server, "slow").await, Vec::<(String, String)>::new());
}

/// A request a careless client sends: method, path, `Content-Type` (if any), body;
/// then the status and code expected, and whether the refusal is in OpenAI's shape.
struct Careless {
    what: &'static str,
    method: reqwest::Method,
    path: String,
    content_type: Option<&'static str>,
    body: Vec<u8>,
    status: u16,
    code: &'static str,
    openai: bool,
}

fn careless(
    what: &'static str,
    path: &str,
    content_type: Option<&'static str>,
    body: impl Into<Vec<u8>>,
    status: u16,
    code: &'static str,
) -> Careless {
    Careless {
        what,
        method: reqwest::Method::POST,
        path: path.to_string(),
        content_type,
        body: body.into(),
        status,
        code,
        openai: path.starts_with("/v1/chat/") || path.starts_with("/v1/models"),
    }
}

/// Goal: what a careless client sends (wrong content types, broken or oversized JSON,
/// wrong field types, unknown fields, ids that look like paths, very long ids, ids in
/// other scripts, unknown model names) is each refused with the route's typed 4xx in
/// the route's shape (REST: exactly `code` and `message`; OpenAI's: `message`, `type:
/// invalid_request_error`, `param`, `code`), no `Retry-After`, and nothing is stored or
/// run: the agents listed are those built, the agent's conversation stays empty, no turn
/// ran. Method: one server; the requests below, one after the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn careless_requests_are_refused_typed_in_the_routes_shape_and_store_nothing() {
    let server = serve_echo_roomy(&["echo"], Duration::ZERO).await;
    let json = Some("application/json");
    let messages = "/v1/agents/echo/messages";
    let chat = "/v1/chat/completions";
    let long_id = "a".repeat(4_096);
    let ask = |model: &str| json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let mut oversized = br#"{"text": ""#.to_vec();
    oversized.extend(std::iter::repeat_n(b'x', 300 * 1024));
    oversized.extend(br#""}"#);
    let cases = vec![
        careless(
            "text/plain",
            messages,
            Some("text/plain"),
            r#"{"text": "hi"}"#,
            415,
            "unsupported_media_type",
        ),
        careless(
            "no content type",
            messages,
            None,
            r#"{"text": "hi"}"#,
            415,
            "unsupported_media_type",
        ),
        careless(
            "form content type",
            messages,
            Some("application/x-www-form-urlencoded"),
            "text=hi",
            415,
            "unsupported_media_type",
        ),
        careless("cut JSON", messages, json, r#"{"text": "h"#, 400, "invalid_json"),
        careless(
            "no UTF-8",
            messages,
            json,
            b"{\"text\": \"\xff\xfe\"}".to_vec(),
            400,
            "invalid_json",
        ),
        careless("empty body", messages, json, "", 400, "invalid_json"),
        careless("text a number", messages, json, r#"{"text": 5}"#, 422, "invalid_body"),
        careless("an array", messages, json, "[]", 422, "invalid_body"),
        careless(
            "unknown field",
            messages,
            json,
            r#"{"text": "hi", "temperature": 1}"#,
            422,
            "invalid_body",
        ),
        careless(
            "timeout 0",
            messages,
            json,
            r#"{"text": "hi", "timeout_ms": 0}"#,
            422,
            "invalid_timeout",
        ),
        careless(
            "negative timeout",
            messages,
            json,
            r#"{"text": "hi", "timeout_ms": -1}"#,
            422,
            "invalid_body",
        ),
        careless("empty text", messages, json, r#"{"text": ""}"#, 422, "empty_message"),
        careless(
            "text over 32 KiB",
            messages,
            json,
            json!({"text": "y".repeat(33 * 1024)}).to_string(),
            422,
            "message_too_long",
        ),
        careless(
            "body over 256 KiB",
            messages,
            json,
            oversized.clone(),
            413,
            "body_too_large",
        ),
        careless(
            "path-like id",
            "/v1/agents/..%2F..%2Fetc%2Fpasswd/messages",
            json,
            r#"{"text": "hi"}"#,
            404,
            "agent_not_found",
        ),
        careless(
            "dot-dot id (the client resolves it)",
            "/v1/agents/../messages",
            json,
            r#"{"text": "hi"}"#,
            404,
            "route_not_found",
        ),
        careless(
            "4 KiB id",
            &format!("/v1/agents/{long_id}/messages"),
            json,
            r#"{"text": "hi"}"#,
            404,
            "agent_not_found",
        ),
        careless(
            "unicode id",
            "/v1/agents/%C3%A9cho%F0%9F%99%82/messages",
            json,
            r#"{"text": "hi"}"#,
            404,
            "agent_not_found",
        ),
        careless(
            "NUL in id",
            "/v1/agents/ec%00ho/messages",
            json,
            r#"{"text": "hi"}"#,
            404,
            "agent_not_found",
        ),
        careless("unknown model", chat, json, ask("gpt-4o"), 404, "model_not_found"),
        careless("4 KiB model", chat, json, ask(&long_id), 404, "model_not_found"),
        careless("unicode model", chat, json, ask("échо🙂"), 404, "model_not_found"),
        careless("path-like model", chat, json, ask("../echo"), 404, "model_not_found"),
        careless(
            "chat text/plain",
            chat,
            Some("text/plain"),
            ask("echo"),
            415,
            "unsupported_media_type",
        ),
        careless(
            "chat cut JSON",
            chat,
            json,
            r#"{"model": "echo", "messages": ["#,
            400,
            "invalid_json",
        ),
        careless("chat body over 256 KiB", chat, json, oversized, 413, "body_too_large"),
        careless(
            "messages a string",
            chat,
            json,
            r#"{"model": "echo", "messages": "hi"}"#,
            400,
            "invalid_body",
        ),
        careless(
            "create with a 4 KiB id",
            "/v1/agents",
            json,
            json!({"id": long_id}).to_string(),
            422,
            "invalid_agent",
        ),
        careless(
            "create with an id with spaces around",
            "/v1/agents",
            json,
            r#"{"id": " echo2 "}"#,
            422,
            "invalid_agent",
        ),
        careless(
            "create with the wildcard id",
            "/v1/agents",
            json,
            r#"{"id": "*"}"#,
            422,
            "invalid_agent",
        ),
        careless(
            "create with a number id",
            "/v1/agents",
            json,
            r#"{"id": 7}"#,
            422,
            "invalid_body",
        ),
    ];
    let mut failures = Vec::new();
    for case in &cases {
        let mut request = server.request(case.method.clone(), &case.path).body(case.body.clone());
        if let Some(content_type) = case.content_type {
            request = request.header("content-type", content_type);
        }
        let answer = read(
            request
                .send()
                .await
                .unwrap_or_else(|error| panic!("{}: no answer: {error}", case.what)),
        )
        .await;
        let what = format!(
            "{} ({} {}): {} {}",
            case.what,
            case.method,
            &case.path[..case.path.len().min(60)],
            answer.status,
            answer.text
        );
        if answer.status != case.status {
            failures.push(format!("{what}: expected {}", case.status));
            continue;
        }
        assert_eq!(answer.retry_after, None, "{what}");
        let code = if case.openai {
            openai_error(&what, &answer.text, "invalid_request_error", &[case.code])
        } else {
            rest_error(&what, &answer.text, &[case.code])
        };
        assert_eq!(code, case.code, "{what}");
    }
    assert!(
        failures.is_empty(),
        "{} of {} answered otherwise:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );

    let (status, listed) = server.get("/v1/agents").await;
    assert_eq!(status, 200, "{listed}");
    let ids: Vec<&str> = listed["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|agent| agent["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["echo"], "a refused request created an agent: {listed}");
    assert_eq!(history(&server, "echo").await, Vec::<(String, String)>::new());
    let metrics = server.metrics().await;
    assert_eq!(
        support::gauge(&metrics, "troupe_runtime_turns_run_total"),
        0,
        "a refused request ran a turn"
    );
    server.stop().await;
}

/// A served system with `echo` (model `MODEL_LATENCY_MS`, replying "noted", a reply that
/// mentions nobody: "heard: {input}" would mention `echo` again) and a direct
/// conversation `id` of the person `ann` and `echo`, created.
async fn serve_a_desk_with_echo(id: &str) -> Harness {
    let llm = ScriptedLlm::new().rule(
        ScriptRule::any_agent()
            .reply("noted")
            .latency(Duration::from_millis(MODEL_LATENCY_MS)),
    );
    let server = Harness::start(agents(llm, &["echo"], KindConfig::default()), ServerConfig::default()).await;
    let (status, created) = server
        .post(
            "/v1/conversations",
            json!({"id": id, "kind": "direct",
                   "participants": [{"kind": "human", "name": "ann"}, {"kind": "agent", "name": "echo"}]}),
        )
        .await;
    assert_eq!(status, 200, "{created}");
    server
}

/// Questions posted to the conversation in the hang-up-and-retry test.
const QUESTIONS: u64 = 20;
/// The earliest a posting client hangs up, in microseconds.
const HANG_UP_AFTER_US_MIN: u64 = 200;
/// The spread of the hang-up times above that, in microseconds: a post is answered in
/// about a millisecond, so some land before the hang-up and some do not.
const HANG_UP_AFTER_US_SPREAD: u64 = 3_000;

/// Goal: a client that hangs up while posting a message that mentions an agent, and
/// then posts it again with the same `msg_id` (as the docs advise), gets the first
/// post's `seq` back, and the conversation holds the message once and the agent's
/// reply to it once, whether or not the first post had landed. Method: a direct
/// conversation of a person and `echo` (model 20 ms, replying "noted"); 20 posts `@echo question n`,
/// each first sent with a client that hangs up after 0.2-3.2 ms (seeded), then again
/// with the same `msg_id`; then the conversation read until every question has a
/// reply, and once more 200 ms later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mention_posted_again_after_a_hang_up_is_kept_and_answered_once() {
    let server = serve_a_desk_with_echo("desk").await;
    let leaving = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let mut seeded = Seeded(0xde5c);
    let mut seqs = BTreeMap::new();
    let mut landed_first = 0;
    for n in 0..QUESTIONS {
        let post = json!({"sender": {"kind": "human", "name": "ann"}, "msg_id": format!("q-{n}"),
                          "text": format!("@echo question {n}")});
        let first = leaving
            .post(format!("{}/v1/conversations/desk/messages", server.base))
            .header("content-type", "application/json")
            .body(post.to_string())
            .timeout(Duration::from_micros(
                HANG_UP_AFTER_US_MIN + seeded.below(HANG_UP_AFTER_US_SPREAD),
            ))
            .send()
            .await;
        let (status, again) = server.post("/v1/conversations/desk/messages", post).await;
        assert_eq!(status, 200, "question {n} posted again: {again}");
        if again["duplicate"] == true {
            landed_first += 1;
        }
        if let Ok(first) = first {
            // Answered before the hang-up: then the retry is its duplicate.
            assert_eq!(first.status().as_u16(), 200);
            assert_eq!(again["duplicate"], true, "question {n}: {again}");
        }
        seqs.insert(again["seq"].as_u64().unwrap_or_else(|| panic!("{again}")), n);
    }
    eprintln!("{landed_first} of {QUESTIONS} first posts had landed before the hang-up");
    assert_eq!(seqs.len() as u64, QUESTIONS, "two questions share a seq: {seqs:?}");

    let read = || async {
        let (status, page) = server.get("/v1/conversations/desk/messages?limit=500").await;
        assert_eq!(status, 200, "{page}");
        page["messages"].as_array().unwrap().clone()
    };
    let replies_to = |messages: &[Value]| {
        let mut replies: BTreeMap<u64, usize> = BTreeMap::new();
        for message in messages {
            if let Some(to) = message["reply_to"].as_u64() {
                *replies.entry(to).or_insert(0) += 1;
            }
        }
        replies
    };
    let waited = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let messages = read().await;
            if replies_to(&messages).len() as u64 >= QUESTIONS {
                return;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "not every question answered: {:?}", read().await);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let messages = read().await;
    for (seq, n) in &seqs {
        let questions: Vec<&Value> = messages
            .iter()
            .filter(|message| message["text"] == format!("@echo question {n}"))
            .collect();
        assert_eq!(
            questions.len(),
            1,
            "question {n} kept {} times: {messages:?}",
            questions.len()
        );
        assert_eq!(questions[0]["seq"], *seq, "question {n}: {messages:?}");
    }
    let replies = replies_to(&messages);
    assert!(
        seqs.keys().all(|seq| replies.get(seq) == Some(&1)),
        "replies per question seq {replies:?}, questions {seqs:?}"
    );
    assert_eq!(messages.len() as u64, 2 * QUESTIONS, "{messages:?}");
    server.stop().await;
}

/// Goal: every 503 this server sends carries `Retry-After`, also `shutting_down` (the
/// agent system is stopping while the server still serves, as when an embedder stops
/// it first, or a process manager restarts the server on the same address): a client
/// that waits and sends the request again reaches a server that is up, so the server
/// says when to try, as for its other 503s (RFC 9110 15.6.4, 10.2.3). Method: the agent
/// system shut down under a running server; a plain message, a chat completion and an
/// A2A blocking send to its agent. Before the fix each was 503 (the A2A send 200, its
/// task `failed`) without `Retry-After`: "message: 503 None {"error":{"code":
/// "shutting_down","message":"the runtime has shut down"}}".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_to_a_stopping_agent_system_is_503_shutting_down_with_retry_after() {
    let mut server = serve_echo_roomy(&["echo"], Duration::ZERO).await;
    let (status, body) = server.post("/v1/agents/echo/messages", json!({"text": "before"})).await;
    assert_eq!(status, 200, "{body}");
    server.system.take().unwrap().shutdown().await;

    let message = post_with(
        &server.http,
        &server.base,
        "/v1/agents/echo/messages",
        &json!({"text": "after"}),
    )
    .await;
    let what = format!("message: {} {:?} {}", message.status, message.retry_after, message.text);
    assert_eq!(message.status, 503, "{what}");
    rest_error(&what, &message.text, &["shutting_down"]);
    assert_eq!(message.retry_after.as_deref(), Some("1"), "{what}");

    let chat = json!({"model": "echo", "messages": [{"role": "user", "content": "after"}]});
    let chat = post_with(&server.http, &server.base, "/v1/chat/completions", &chat).await;
    let what = format!("chat: {} {:?} {}", chat.status, chat.retry_after, chat.text);
    assert_eq!(chat.status, 503, "{what}");
    openai_error(&what, &chat.text, "server_error", &["shutting_down"]);
    assert_eq!(chat.retry_after.as_deref(), Some("1"), "{what}");

    let send = json!({"message": {"messageId": "m-after", "role": "ROLE_USER", "parts": [{"text": "after"}]}});
    let a2a = json!({"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": send});
    let a2a = post_with(&server.http, &server.base, "/a2a/echo", &a2a).await;
    // A blocking send: the task was not handed over, and the refusal is the server's
    // (until 2026-12-07 the send was answered 200 with a task `failed`, which tells a
    // client nothing about sending it again).
    let what = format!("a2a: {} {:?} {}", a2a.status, a2a.retry_after, a2a.text);
    assert_eq!((a2a.status, a2a.retry_after.as_deref()), (503, Some("1")), "{what}");
    let body: Value = serde_json::from_str(&a2a.text).unwrap();
    assert_eq!(body["error"]["code"], -32000, "{what}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("shutting_down: "),
        "{what}"
    );

    let _ = server.stop.take().unwrap().send(());
    tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), server.served.take().unwrap())
        .await
        .expect("serve returns")
        .unwrap()
        .expect("serve ends cleanly");
}

/// Posts of one `msg_id` sent at once in the racing-retries test.
const SAME_POST_AT_ONCE: usize = 4;

/// Goal: retries that race their first post (a client that sends again before the
/// first answer came, `SAME_POST_AT_ONCE` at once) are one post: every answer is 200
/// with the same `seq`, exactly one says `duplicate: false`, the conversation holds the
/// message once and the mentioned agent answers it once. Method: a direct conversation
/// of a person and `echo` (model 20 ms, replying "noted"); 10 `msg_id`s, each posted
/// 4 times at once, the 10 at once too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn posts_of_one_msg_id_sent_at_once_are_one_post_answered_once() {
    const POSTS: usize = 10;
    let server = serve_a_desk_with_echo("race").await;
    let mut sent = tokio::task::JoinSet::new();
    for n in 0..POSTS {
        for _ in 0..SAME_POST_AT_ONCE {
            let (client, base) = (server.http.clone(), server.base.clone());
            sent.spawn(async move {
                let post = json!({"sender": {"kind": "human", "name": "ann"}, "msg_id": format!("r-{n}"),
                                  "text": format!("@echo race {n}")});
                (
                    n,
                    post_with(&client, &base, "/v1/conversations/race/messages", &post).await,
                )
            });
        }
    }
    let mut answers: BTreeMap<usize, Vec<Value>> = BTreeMap::new();
    while let Some(joined) = sent.join_next().await {
        let (n, answer) = joined.unwrap();
        assert_eq!(answer.status, 200, "post {n}: {}", answer.text);
        answers
            .entry(n)
            .or_default()
            .push(serde_json::from_str(&answer.text).unwrap());
    }
    let mut seqs = BTreeMap::new();
    for (n, bodies) in &answers {
        let seq = &bodies[0]["seq"];
        assert!(bodies.iter().all(|body| &body["seq"] == seq), "post {n}: {bodies:?}");
        let firsts = bodies.iter().filter(|body| body["duplicate"] == false).count();
        assert_eq!(firsts, 1, "post {n}: {bodies:?}");
        seqs.insert(seq.as_u64().unwrap(), *n);
    }
    assert_eq!(seqs.len(), POSTS, "two posts share a seq: {answers:?}");
    let messages = server
        .get_when(
            "/v1/conversations/race/messages?limit=500",
            "every post answered",
            |page| {
                page["messages"]
                    .as_array()
                    .is_some_and(|messages| messages.iter().filter(|m| m["reply_to"].is_u64()).count() >= POSTS)
            },
        )
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, page) = server.get("/v1/conversations/race/messages?limit=500").await;
    assert_eq!(status, 200, "{page}");
    let messages_now = page["messages"].as_array().unwrap();
    assert_eq!(messages_now.len(), 2 * POSTS, "{page} (first seen {messages})");
    for (seq, n) in &seqs {
        let kept = messages_now
            .iter()
            .filter(|message| message["text"] == format!("@echo race {n}"))
            .count();
        let replies = messages_now
            .iter()
            .filter(|message| message["reply_to"] == *seq)
            .count();
        assert_eq!((kept, replies), (1, 1), "post {n} at seq {seq}: {page}");
    }
    server.stop().await;
}

/// Goal: what needs no token as `GET` needs none as `HEAD` either (HEAD is GET without
/// the body, RFC 9110 9.3.2; load balancers check health with it): `HEAD /health`, an
/// A2A Agent Card and the topology page are 200 with no body and no token, while `HEAD`
/// of a route that needs the token is still 401. Before the fix `HEAD /health` on a
/// server with a token was 401 ("assertion failed: HEAD /health, left: 401, right: 200").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_needs_no_token_as_get_needs_none_as_head() {
    const TOKEN: &str = "client-review-token-0123456789";
    let server = serve_echo(
        &["echo"],
        Duration::ZERO,
        ROOMY_MAILBOX,
        ServerConfig::default().token(TOKEN),
    )
    .await;
    for path in [
        "/health",
        "/a2a/echo/.well-known/agent-card.json",
        "/",
        "/ui/topology.js",
    ] {
        let get = server.request(reqwest::Method::GET, path).send().await.unwrap();
        assert_eq!(get.status().as_u16(), 200, "GET {path}");
        let head = server.request(reqwest::Method::HEAD, path).send().await.unwrap();
        assert_eq!(head.status().as_u16(), 200, "HEAD {path}");
        assert_eq!(head.text().await.unwrap(), "", "HEAD {path} has no body");
    }
    for path in ["/v1/agents", "/metrics", "/v1/agents/echo/history"] {
        let head = server.request(reqwest::Method::HEAD, path).send().await.unwrap();
        assert_eq!(head.status().as_u16(), 401, "HEAD {path} without the token");
        let head = server
            .request(reqwest::Method::HEAD, path)
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(head.status().as_u16(), 200, "HEAD {path} with the token");
    }
    server.stop().await;
}

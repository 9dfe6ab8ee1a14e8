//! Three gaps of the HTTP API closed on 2026-12-06, each probed as a client sees it:
//! OpenAI's "retrieve model" (`GET /v1/models/{model}`), `n` other than 1 in a chat
//! completion (refused, not answered with one choice), and a REST notification's
//! `msg_id` that could be taken for an A2A task's message (refused: the prefix `a2a:`
//! is reserved).
//!
//! Normal build only: HTTP is not simulated (the crate is empty under madsim).
#![cfg(not(madsim))]

use serde_json::{json, Value};
use troupe_agent::{ScriptRule, ScriptedLlm};
use troupe_runtime::KindConfig;
use troupe_server::ServerConfig;

mod support;
use support::{agents, Harness};

/// An agent id that needs percent-encoding in a path: a space, `?`, `#`, `%`, a
/// non-ASCII letter.
const ODD_ID: &str = "lead ?#%é";

/// Every byte of `id` but RFC 3986's unreserved ones, percent-encoded: one path segment.
fn segment(id: &str) -> String {
    id.bytes()
        .map(|byte| {
            if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
                (byte as char).to_string()
            } else {
                format!("%{byte:02X}")
            }
        })
        .collect()
}

async fn server() -> Harness {
    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("heard: {input}"));
    Harness::start(
        agents(llm, &["echo", ODD_ID], KindConfig::default()),
        ServerConfig::default(),
    )
    .await
}

/// An error body in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`,
/// with this `type`, `param` and `code`; its message.
fn openai_error<'a>(answer: &'a Value, kind: &str, param: &str, code: &str) -> &'a str {
    let error = &answer["error"];
    assert_eq!(
        (&error["type"], &error["param"], &error["code"]),
        (&json!(kind), &json!(param), &json!(code)),
        "{answer}"
    );
    error["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no message: {answer}"))
}

/// Goal: `GET /v1/models/{model}` answers the agent as the entry `GET /v1/models` lists
/// for it (`id`, `object: "model"`, `created`, `owned_by`), also for an id that needs
/// percent-encoding; an unknown model is 404 `model_not_found` in OpenAI's error shape
/// (`type: "invalid_request_error"`, `param: "model"`), as the chat completion's unknown
/// model now is. Before: 404 `route_not_found` for every model.
#[tokio::test]
async fn retrieve_model_answers_the_listed_entry_and_an_unknown_one_is_404_in_openais_shape() {
    let server = server().await;
    let (status, list) = server.get("/v1/models").await;
    assert_eq!(status, 200, "{list}");
    for id in ["echo", ODD_ID] {
        let listed = list["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|model| model["id"] == id)
            .unwrap_or_else(|| panic!("{id} not listed: {list}"));
        let (status, model) = server.get(&format!("/v1/models/{}", segment(id))).await;
        assert_eq!(status, 200, "{id}: {model}");
        assert_eq!(&model, listed, "{id}");
        assert_eq!(model["object"], "model", "{model}");
        assert!(model["created"].as_u64().is_some_and(|at| at > 0), "{model}");
    }
    for unknown in ["nobody", "lead ?#"] {
        let (status, answer) = server.get(&format!("/v1/models/{}", segment(unknown))).await;
        assert_eq!(status, 404, "{unknown}: {answer}");
        let message = openai_error(&answer, "invalid_request_error", "model", "model_not_found");
        assert!(message.contains(unknown), "{message}");
    }
    let (status, answer) = server
        .post(
            "/v1/chat/completions",
            json!({"model": "nobody", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(status, 404, "{answer}");
    openai_error(&answer, "invalid_request_error", "model", "model_not_found");
    server.stop().await;
}

/// Goal: a chat completion asking for `n` choices other than 1 is refused, 400
/// `invalid_request_error` with `param: "n"` and a message naming the value and the
/// limit, before the agent is asked (streamed or not); `n: 1`, `n: null` and no `n` are
/// served. Before: `n` was ignored, and `n: 3` was answered 200 with one choice.
#[tokio::test]
async fn n_other_than_one_is_refused_naming_n_and_one_or_absent_is_served() {
    let server = server().await;
    let ask = |n: Option<Value>, stream: bool| {
        let mut body = json!({"model": "echo", "messages": [{"role": "user", "content": "hello"}]});
        if let Some(n) = n {
            body["n"] = n;
        }
        if stream {
            body["stream"] = json!(true);
        }
        body
    };
    for n in [json!(3), json!(2), json!(0), json!(-1)] {
        for stream in [false, true] {
            let body = ask(Some(n.clone()), stream);
            let (status, answer) = server.post("/v1/chat/completions", body.clone()).await;
            assert_eq!(status, 400, "{body}: {answer}");
            let message = openai_error(&answer, "invalid_request_error", "n", "invalid_request_error");
            assert!(
                message.contains(&format!("n is {n}")) && message.contains("1 choice"),
                "{message}"
            );
        }
    }
    let (status, history) = server.get("/v1/agents/echo/history").await;
    assert_eq!(status, 200, "{history}");
    assert_eq!(history["total"], 0, "no refused request reached the agent: {history}");
    for n in [Some(json!(1)), Some(Value::Null), None] {
        let body = ask(n, false);
        let (status, answer) = server.post("/v1/chat/completions", body.clone()).await;
        assert_eq!(status, 200, "{body}: {answer}");
        assert_eq!(answer["choices"].as_array().map(Vec::len), Some(1), "{answer}");
        assert_eq!(answer["choices"][0]["message"]["content"], "heard: hello", "{answer}");
    }
    server.stop().await;
}

/// Goal: a REST notification cannot take the message id an A2A task is handed to its
/// agent with (`a2a:{task id}`, deduped in the same namespace): `msg_id` starting with
/// `a2a:` is 422 `invalid_message_id` saying the prefix is reserved, whether the task
/// exists yet or not, and the A2A task sent after it is worked. Other ids (`a2a`,
/// `A2A:x`, `x:a2a:`) are taken. Before: the notification `a2a:echo-task-0` was answered
/// 202 and its id marked seen, so the A2A task given that id next was taken for it.
#[tokio::test]
async fn a_notification_cannot_take_an_a2a_tasks_message_id() {
    let server = server().await;
    let notify = |msg_id: &str| json!({"text": "a note", "msg_id": msg_id});
    let (status, answer) = server.post("/v1/agents/echo/notify", notify("a2a:echo-task-0")).await;
    assert_eq!(status, 422, "{answer}");
    assert_eq!(answer["error"]["code"], "invalid_message_id", "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("\"a2a:\"") && message.contains("reserved"),
        "{message}"
    );

    let send = json!({
        "jsonrpc": "2.0", "id": 1, "method": "SendMessage",
        "params": {"message": {"messageId": "m0", "role": "ROLE_USER", "parts": [{"text": "a task"}]}},
    });
    let (status, answer) = server.post("/a2a/echo", send).await;
    assert_eq!(status, 200, "{answer}");
    let task = &answer["result"]["task"];
    assert_eq!(task["id"], "echo-task-0", "{answer}");
    assert_eq!(
        task["status"]["state"], "TASK_STATE_COMPLETED",
        "the task is worked: {answer}"
    );
    assert!(answer.to_string().contains("heard: a task"), "{answer}");

    // The task exists now: a notification with its message id is refused too.
    let (status, answer) = server.post("/v1/agents/echo/notify", notify("a2a:echo-task-0")).await;
    assert_eq!(status, 422, "{answer}");
    for id in ["a2a", "A2A:x", "x:a2a:"] {
        let (status, answer) = server.post("/v1/agents/echo/notify", notify(id)).await;
        assert_eq!(status, 202, "{id}: {answer}");
        assert_eq!(answer["msg_id"], id, "{answer}");
    }
    server.stop().await;
}

/// Goal: every refusal of `POST /v1/chat/completions` is in OpenAI's error shape, those
/// of its body too, with `type: "invalid_request_error"` and `param` naming the field
/// that is wrong (serde's path: `messages[0].role`; null for the body as a whole), so
/// that an OpenAI client's typed error carries `.type` and `.param` whatever was wrong.
/// The codes are as before: 400 `invalid_json` (not JSON), `invalid_body` (a field
/// missing or of the wrong type; 400, as OpenAI's API answers any invalid request, since
/// 2026-12-07; 422 before, as the REST routes), 413 `body_too_large`, 415
/// `unsupported_media_type`; the route's own refusals of the messages name `messages`.
/// Until 2026-12-06 the body's refusals (read before the route's code runs) were in
/// the REST routes' shape, `{"error": {"code", "message"}}`, without `type` and
/// `param`, and the route's `no_user_message` and `empty_message` had no `param`.
/// Method: raw bodies, each sent streamed and not.
#[tokio::test]
async fn every_chat_completion_refusal_is_in_openais_shape_naming_the_field() {
    let server = server().await;
    let too_large = format!(
        r#"{{"model": "echo", "messages": [{{"role": "user", "content": "{}"}}]}}"#,
        "x".repeat(troupe_server::limits::SERVER_REQUEST_BODY_SIZE_MAX_BYTES)
    );
    let refusals: [(&str, &str, u16, &str, Value); 10] = [
        (
            r#"{"model": "echo", "messages": [{"role": "user", "content": "hi"}"#,
            "application/json",
            400,
            "invalid_json",
            json!("messages"),
        ),
        ("not json", "application/json", 400, "invalid_json", Value::Null),
        (
            r#"{"model": "echo", "messages": "hi"}"#,
            "application/json",
            400,
            "invalid_body",
            json!("messages"),
        ),
        (
            r#"{"messages": [{"role": "user", "content": "hi"}]}"#,
            "application/json",
            400,
            "invalid_body",
            json!("model"),
        ),
        (
            r#"{"model": "echo", "messages": [{"content": "hi"}]}"#,
            "application/json",
            400,
            "invalid_body",
            json!("messages[0].role"),
        ),
        (
            r#"{"model": "echo", "messages": [{"role": "user", "content": "hi"}], "n": "two"}"#,
            "application/json",
            400,
            "invalid_body",
            json!("n"),
        ),
        (
            r#"{"model": "echo", "messages": [{"role": "user", "content": "hi"}]}"#,
            "text/plain",
            415,
            "unsupported_media_type",
            Value::Null,
        ),
        (&too_large, "application/json", 413, "body_too_large", Value::Null),
        (
            r#"{"model": "echo", "messages": [{"role": "assistant", "content": "hi"}]}"#,
            "application/json",
            400,
            "no_user_message",
            json!("messages"),
        ),
        (
            r#"{"model": "echo", "messages": [{"role": "user", "content": ""}]}"#,
            "application/json",
            400,
            "empty_message",
            json!("messages"),
        ),
    ];
    for (body, content_type, status, code, param) in refusals {
        for stream in [false, true] {
            // `stream` as the body's first field: the body stays what it is after it.
            let body = if stream && body.starts_with('{') {
                format!(r#"{{"stream": true, {}"#, &body[1..])
            } else {
                body.to_string()
            };
            let response = server
                .request(reqwest::Method::POST, "/v1/chat/completions")
                .header("content-type", content_type)
                .body(body.clone())
                .send()
                .await
                .unwrap();
            let answered = response.status().as_u16();
            let answer: Value = response.json().await.unwrap();
            let shown = &body[..body.len().min(120)];
            assert_eq!(answered, status, "{shown}: {answer}");
            let error = &answer["error"];
            assert_eq!(
                (&error["type"], &error["param"], &error["code"]),
                (&json!("invalid_request_error"), &param, &json!(code)),
                "{shown}: {answer}"
            );
            assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{answer}");
        }
    }
    server.stop().await;

    // Refused before the route's code runs (no bearer token): OpenAI's shape too, its
    // `WWW-Authenticate` kept.
    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("heard: {input}"));
    let guarded = Harness::start(
        agents(llm, &["echo"], KindConfig::default()),
        ServerConfig::default().token("a-token-of-sixteen-bytes"),
    )
    .await;
    let response = guarded
        .request(reqwest::Method::POST, "/v1/chat/completions")
        .json(&json!({"model": "echo", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 401);
    assert_eq!(response.headers()["www-authenticate"], "Bearer");
    let answer: Value = response.json().await.unwrap();
    let error = &answer["error"];
    assert_eq!(
        (&error["type"], &error["param"], &error["code"]),
        (&json!("invalid_request_error"), &Value::Null, &json!("unauthorized")),
        "{answer}"
    );
    guarded.stop().await;
}

/// Goal: a connection that sends an incomplete request head (slowloris), or nothing at
/// all, is closed once `SERVER_HEADER_READ_MS` has passed, so connections held open
/// without a request cannot pile up until the process runs out of file descriptors;
/// the server answers others all along. Until 2026-12-06 axum's `serve` ran hyper
/// without a timer, so hyper's header read timeout never applied: a half-sent head held
/// its connection for good (still open 45 s later in the probe). Method: two raw
/// connections, one with half a request head, one silent; each must be closed (read
/// gives 0 bytes or a reset) within `SERVER_HEADER_READ_MS` and a margin, while a
/// request on a third connection is answered.
#[tokio::test]
async fn a_connection_without_a_whole_request_head_is_closed_after_the_header_read_timeout() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    /// Margin over the timeout for the close to be seen, in milliseconds.
    const CLOSE_MARGIN_MS: u64 = 3_000;
    let server = server().await;
    let addr = server.base.trim_start_matches("http://").to_string();
    let mut half = tokio::net::TcpStream::connect(&addr).await.unwrap();
    half.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    let mut silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (status, _) = server.get("/health").await;
    assert_eq!(status, 200);
    let started = tokio::time::Instant::now();
    let bound = std::time::Duration::from_millis(troupe_server::limits::SERVER_HEADER_READ_MS + CLOSE_MARGIN_MS);
    for (name, connection) in [("half a head", &mut half), ("nothing", &mut silent)] {
        let mut buffer = [0_u8; 256];
        let left = bound.saturating_sub(started.elapsed());
        let read = tokio::time::timeout(left, connection.read(&mut buffer)).await;
        assert!(
            matches!(read, Ok(Ok(_)) | Ok(Err(_))),
            "a connection that sent {name} is still open {:?} after it connected",
            started.elapsed()
        );
        if let Ok(Ok(n)) = read {
            // hyper may answer 408 before closing: then the connection ends.
            let text = String::from_utf8_lossy(&buffer[..n]).to_string();
            assert!(n == 0 || text.starts_with("HTTP/1.1 408"), "{name}: {text}");
        }
    }
    // On a new connection: the client's pooled one, idle since the first request, is
    // closed by the same timeout at about this moment, and a request sent on it as the
    // server closes it fails `IncompleteMessage` (CI, 2026-12-07).
    let fresh = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let status = fresh
        .get(format!("{}/health", server.base))
        .send()
        .await
        .expect("a new connection is answered")
        .status();
    assert_eq!(status, 200);
    server.stop().await;
}

//! Gaps an operator of `troupe serve` met next, closed on 2026-12-07, each probed as a
//! client sees it: the log lines dropped by the process's log queue in `/metrics`; an
//! A2A JSON-RPC notification (a request without `id`), which was answered; and no cap on
//! the connections served.
//!
//! Normal build only: HTTP is not simulated (the crate is empty under madsim).
#![cfg(not(madsim))]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use troupe_agent::{ScriptRule, ScriptedLlm};
use troupe_runtime::KindConfig;
use troupe_server::ServerConfig;

mod support;
use support::{agents, gauge, Gated, Harness, POLL_MS, TEST_WAIT_MS_MAX};

async fn serve_echo(config: ServerConfig) -> Harness {
    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("heard: {input}"));
    Harness::start(agents(llm, &["echo"], KindConfig::default()), config).await
}

/// Goal: a server given a count of dropped log lines (`troupe serve`'s log queue) shows
/// it in `/metrics` as the counter `troupe_log_lines_dropped_total`, read at every
/// scrape; a server given none leaves it out. Before: no such counter (the count was
/// only written to stderr, which is what nobody reads when lines are dropped).
#[tokio::test]
async fn metrics_show_the_log_lines_dropped_read_at_every_scrape() {
    let dropped = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&dropped);
    let server =
        serve_echo(ServerConfig::default().log_lines_dropped(Arc::new(move || counted.load(Ordering::Relaxed)))).await;
    let metrics = server.metrics().await;
    assert_eq!(gauge(&metrics, "troupe_log_lines_dropped_total"), 0, "{metrics}");
    assert!(
        metrics.contains("# TYPE troupe_log_lines_dropped_total counter\n"),
        "{metrics}"
    );
    dropped.store(1_234, Ordering::Relaxed);
    let metrics = server.metrics().await;
    assert_eq!(gauge(&metrics, "troupe_log_lines_dropped_total"), 1_234, "{metrics}");
    server.stop().await;

    let server = serve_echo(ServerConfig::default()).await;
    let metrics = server.metrics().await;
    assert!(!metrics.contains("troupe_log_lines_dropped_total"), "{metrics}");
    server.stop().await;
}

/// `POST /a2a/{agent}` with `body` as it is: the status, the headers and the body's text.
async fn a2a_raw(server: &Harness, agent: &str, body: &Value) -> (u16, reqwest::header::HeaderMap, String) {
    let response = server
        .request(reqwest::Method::POST, &format!("/a2a/{agent}"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("the server answers");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    (status, headers, response.text().await.unwrap())
}

/// The `result` of the JSON-RPC request `method` with `params` (id 1) to `agent`.
async fn a2a_ok(server: &Harness, agent: &str, method: &str, params: Value) -> Value {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    let (status, _, text) = a2a_raw(server, agent, &body).await;
    assert_eq!(status, 200, "{method}: {text}");
    let answer: Value = serde_json::from_str(&text).unwrap_or_else(|error| panic!("{method}: {error}: {text}"));
    assert_eq!(answer["id"], 1, "{method}: {answer}");
    answer
        .get("result")
        .cloned()
        .unwrap_or_else(|| panic!("{method} failed: {answer}"))
}

/// A notification of `method` with `params`: no `id` member.
fn notification(method: &str, params: Value) -> Value {
    json!({"jsonrpc": "2.0", "method": method, "params": params})
}

/// `SendMessage` params of a message `text` with its own message id.
fn send_params(text: &str) -> Value {
    json!({"message": {"messageId": format!("message-{text}"), "role": "ROLE_USER", "parts": [{"text": text}]}})
}

/// The ids and states of `agent`'s A2A tasks, oldest first.
async fn tasks(server: &Harness, agent: &str) -> Vec<(String, String)> {
    let listed = a2a_ok(server, agent, "ListTasks", json!({})).await;
    let mut tasks: Vec<(String, String)> = listed["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|task| {
            (
                task["id"].as_str().unwrap().to_string(),
                task["status"]["state"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    tasks.sort();
    tasks
}

/// Polls `agent`'s tasks until `done` holds for them (at most `TEST_WAIT_MS_MAX`).
async fn tasks_when(
    server: &Harness,
    agent: &str,
    what: &str,
    done: impl Fn(&[(String, String)]) -> bool,
) -> Vec<(String, String)> {
    let waited = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let now = tasks(server, agent).await;
            if done(&now) {
                return now;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    })
    .await;
    let last = tasks(server, agent).await;
    waited.unwrap_or_else(|_| panic!("{what}: not within {TEST_WAIT_MS_MAX} ms; tasks {last:?}"))
}

/// Asserts that `answer` (status, headers, text) is a notification's: 202 Accepted, no
/// body.
fn assert_unanswered(what: &str, answer: &(u16, reqwest::header::HeaderMap, String)) {
    let (status, _, text) = answer;
    assert_eq!(
        (*status, text.as_str()),
        (202, ""),
        "{what}: a notification was answered"
    );
}

/// Goal: a JSON-RPC notification (a request without an `id` member) to the A2A endpoint
/// is never answered in JSON-RPC (JSON-RPC 2.0, 4.1: the server MUST NOT reply), yet runs
/// as the request would: 202 Accepted with no body. A `SendMessage` or
/// `SendStreamingMessage` starts its task (not waited for, no stream), a `CancelTask`
/// cancels; a method that only answers (`GetTask`, `ListTasks`), an unknown method or
/// bad params run nothing and are not answered either. A refusal the client may retry
/// (the server full of running tasks) is still an HTTP 503 with `Retry-After`, in the
/// server's error shape, with no JSON-RPC member. A request with `"id": null` is no
/// notification (answered under `null`), and a batch is still refused whole (batches
/// are not served: one Invalid Request, nothing run). Before: every notification was
/// answered 200 with a JSON-RPC response whose `id` was `null` (a `SendMessage`
/// blocking until its task ended). Method: an agent whose model waits behind a gate, a
/// server keeping 2 A2A tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_rpc_notification_runs_but_is_never_answered() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let gated = Gated {
        script: ScriptedLlm::new().rule(ScriptRule::agent("gated").reply("gated: {input}")),
        gate: Arc::clone(&gate),
    };
    let builder = troupe_agent::AgentSystem::builder()
        .llm(Arc::new(gated))
        .kind_config(KindConfig::default())
        .agent(troupe_agent::AgentSpec::new("gated"));
    let server = Harness::start(builder, ServerConfig::default().a2a_tasks_kept(2)).await;

    // A SendMessage notification starts its task; its turn waits behind the gate.
    let answer = a2a_raw(&server, "gated", &notification("SendMessage", send_params("t0"))).await;
    assert_unanswered("SendMessage", &answer);
    let running = tasks_when(&server, "gated", "t0 runs", |tasks| {
        tasks.len() == 1 && tasks[0].1 == "TASK_STATE_WORKING"
    })
    .await;
    let t0 = running[0].0.clone();
    // A SendStreamingMessage notification starts its task too, with no stream.
    let answer = a2a_raw(
        &server,
        "gated",
        &notification("SendStreamingMessage", send_params("t1")),
    )
    .await;
    assert_unanswered("SendStreamingMessage", &answer);
    let listed = tasks(&server, "gated").await;
    assert_eq!(listed.len(), 2, "{listed:?}");
    let t1 = listed.iter().find(|(id, _)| *id != t0).unwrap().0.clone();
    assert_eq!(
        a2a_ok(&server, "gated", "GetTask", json!({"id": t1})).await["status"]["state"],
        "TASK_STATE_SUBMITTED"
    );

    // The server keeps 2 tasks, none ended: a third is refused as retryable, over HTTP.
    let (status, headers, text) = a2a_raw(&server, "gated", &notification("SendMessage", send_params("t2"))).await;
    assert_eq!(status, 503, "{text}");
    assert_eq!(headers["retry-after"], "1", "{headers:?}");
    let refusal: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(refusal["error"]["code"], "overloaded", "{refusal}");
    assert!(
        refusal.get("jsonrpc").is_none() && refusal.get("id").is_none(),
        "{refusal}"
    );

    // A CancelTask notification cancels t1, still waiting.
    let answer = a2a_raw(&server, "gated", &notification("CancelTask", json!({"id": t1}))).await;
    assert_unanswered("CancelTask", &answer);
    assert_eq!(
        a2a_ok(&server, "gated", "GetTask", json!({"id": t1})).await["status"]["state"],
        "TASK_STATE_CANCELED"
    );

    // Notifications that only answer, or fail, run nothing and are not answered.
    for (what, body) in [
        ("GetTask", notification("GetTask", json!({"id": t0}))),
        ("ListTasks", notification("ListTasks", json!({}))),
        ("an unknown method", notification("Nope", json!({}))),
        ("bad params", notification("SendMessage", json!({"message": 5}))),
        (
            "a task not found",
            notification("CancelTask", json!({"id": "gated-task-none"})),
        ),
        (
            "params not an object",
            json!({"jsonrpc": "2.0", "method": "SendMessage", "params": [1]}),
        ),
    ] {
        let answer = a2a_raw(&server, "gated", &body).await;
        assert_unanswered(what, &answer);
    }
    // `"id": null` is a request: answered, under `null`.
    let (status, _, text) = a2a_raw(
        &server,
        "gated",
        &json!({"jsonrpc": "2.0", "id": null, "method": "GetTask", "params": {"id": t0}}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (&answer["id"], &answer["result"]["id"]),
        (&Value::Null, &json!(t0)),
        "{answer}"
    );
    // A batch (of a notification) is refused whole, as before: nothing run.
    let (status, _, text) = a2a_raw(
        &server,
        "gated",
        &json!([notification("SendMessage", send_params("in a batch"))]),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(answer["error"]["code"], -32600, "{answer}");
    let listed = tasks(&server, "gated").await;
    assert_eq!(listed.len(), 2, "only t0 and t1: {listed:?}");

    // The gate opens: t0 ends as any task does.
    gate.add_permits(16);
    tasks_when(&server, "gated", "t0 completes", |tasks| {
        tasks
            .iter()
            .any(|(id, state)| *id == t0 && state == "TASK_STATE_COMPLETED")
    })
    .await;
    server.stop().await;
}

/// The file descriptors this process holds (Linux: the entries of `/proc/self/fd`).
fn descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd is readable")
        .count()
}

/// The text of `GET /metrics` on a connection of its own, closed after it.
async fn scrape_closing(address: &str) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(
        Duration::from_millis(TEST_WAIT_MS_MAX),
        stream.read_to_string(&mut answer),
    )
    .await
    .expect("answered in time")
    .unwrap();
    let (_, body) = answer.split_once("\r\n\r\n").expect("a head and a body");
    body.to_string()
}

/// A client that opens a connection of its own for every request (none kept for the
/// next), each request bounded by `timeout_ms`.
fn fresh_client(timeout_ms: u64) -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_millis(timeout_ms))
        .build()
        .unwrap()
}

/// Goal: a server serves at most `connections_max` connections at once: a flood of idle
/// connections past it is not accepted (they wait in the kernel's backlog), so the
/// process's descriptors grow by the client's ends and the cap only, and a request on a
/// new connection waits instead of being served; once the idle connections go, it is
/// answered at once. `/metrics` shows the connections open
/// (`troupe_http_connections_open`), and a cap of 0 or over `SERVER_CONNECTIONS_MAX` is
/// refused. Before: every connection was accepted (two descriptors per idle connection
/// in this process, client and server end), until the descriptors ran out. Method: a
/// cap of `CAP`, `IDLE` idle connections from this process, a `GET /health` on one more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_wait_unaccepted_and_the_descriptors_stay_bounded() {
    /// The server's cap, in connections.
    const CAP: usize = 4;
    /// Idle connections opened, far more than the cap.
    const IDLE: usize = 64;
    /// Descriptors this process may open besides the idle connections' client ends and
    /// the cap's server ends (a runtime's, a client's).
    const SLACK: usize = 8;
    /// How long the request on one more connection is given while the idle ones are
    /// held, in milliseconds: it must not be answered.
    const HELD_MS: u64 = 1_000;
    /// How soon it must be answered once they are gone, in milliseconds.
    const ANSWERED_MS: u64 = 3_000;
    let loopback: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
    for refused in [0, troupe_server::limits::SERVER_CONNECTIONS_MAX + 1] {
        let error = ServerConfig::default()
            .connections_max(refused)
            .check_bind(loopback)
            .expect_err("out of range");
        assert!(
            matches!(error, troupe_server::ServeError::Connections { given, .. } if given == refused),
            "{error}"
        );
    }

    let server = serve_echo(ServerConfig::default().connections_max(CAP)).await;
    let address = server.base.trim_start_matches("http://").to_string();
    let before = descriptors();
    let mut idle = Vec::new();
    for _ in 0..IDLE {
        idle.push(tokio::net::TcpStream::connect(&address).await.unwrap());
    }
    // The server accepts what it will.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let grown = descriptors() - before;
    eprintln!("{IDLE} idle connections, cap {CAP}: this process's descriptors grew by {grown}");
    assert!(
        grown <= IDLE + CAP + SLACK,
        "{grown} descriptors more for {IDLE} idle connections with a cap of {CAP}: the server accepted past its cap"
    );

    // One more connection waits behind them, unanswered.
    let health = format!("{}/health", server.base);
    let waiting = tokio::spawn(async move {
        let started = tokio::time::Instant::now();
        let answer = fresh_client(HELD_MS + ANSWERED_MS).get(&health).send().await;
        (answer.map(|answer| answer.status().as_u16()), started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(HELD_MS)).await;
    assert!(!waiting.is_finished(), "a request was served past the cap");
    let released = tokio::time::Instant::now();
    drop(idle);
    let (status, _) = waiting.await.unwrap();
    let took = released.elapsed();
    assert_eq!(status.expect("answered once the idle connections are gone"), 200);
    assert!(
        took < Duration::from_millis(ANSWERED_MS),
        "answered {took:?} after the idle connections went"
    );

    // The gauge: the scrape's own connection, once the others are closed.
    let mut last = None;
    let waited = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let open = gauge(&scrape_closing(&address).await, "troupe_http_connections_open");
            last = Some(open);
            if open == 1 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    })
    .await;
    assert!(
        waited.is_ok(),
        "troupe_http_connections_open never came back to 1: {last:?}"
    );
    server.stop().await;
}

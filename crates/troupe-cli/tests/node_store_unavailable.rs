//! `troupe node` probed from outside as an operator runs it, on a throwaway etcd and
//! PostgreSQL (the servers of crates/troupe-etcd's and crates/troupe-postgres's tests):
//! what a client gets while the PostgreSQL server is down for a moment, what `/metrics`
//! says about it, and the connection cap (`--max-connections`) on a node. Normal build
//! only (the node command is not built under madsim).
//!
//! Without `/usr/bin/etcd` (Debian `etcd-server`) or the PostgreSQL server binaries
//! (Debian `postgresql`) the tests fail and name the package; nothing is skipped.
//!
//! Run with `cargo nextest run -p troupe-cli --test node_store_unavailable`.
#![cfg(not(madsim))]
// Real processes and real time only: the child is polled with the wall clock.
#![allow(clippy::disallowed_methods)]

#[allow(dead_code)] // the helpers the etcd tests use and these do not
#[path = "../../troupe-etcd/tests/support/etcd_server.rs"]
mod etcd_server;
#[path = "../../troupe-postgres/tests/support/postgres_server.rs"]
mod postgres_server;
#[allow(dead_code)] // `http`: these use `http_with_head`
mod support;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use etcd_server::TestEtcd;
use postgres_server::TestServer;
use serde_json::{json, Value};

/// The longest any one HTTP request of these tests may wait for its answer, in
/// milliseconds.
const REQUEST_WAIT_MS_MAX: u64 = 20_000;
/// The longest a call of the node's own conversation routes may wait for its answer,
/// in milliseconds: they take no `timeout_ms`, and a store down runs out their
/// `NODE_CALL_TIMEOUT_MS` (30 s) before they answer.
const NODE_CALL_WAIT_MS_MAX: u64 = 45_000;

/// A `troupe node` child, killed when dropped (a failed assertion leaves no process).
struct Node {
    child: Child,
    stderr: Option<std::thread::JoinHandle<String>>,
    /// The rest of its stdout, kept open so that its writes never fail.
    _stdout: std::io::BufReader<std::process::ChildStdout>,
    addr: String,
}

impl Node {
    /// `troupe node` on `etcd` and `database` as node `id`, serving examples/org.toml's
    /// agents, with a 3 s lease, loopback ports of its own, no token, no model key (the
    /// scripted model), `extra` flags; up to the HTTP address it prints.
    fn start(etcd: &str, database: &str, id: &str, extra: &[&str]) -> Self {
        let config = format!("{}/../../examples/org.toml", env!("CARGO_MANIFEST_DIR"));
        Self::spawn(etcd, database, id, Some(&config), extra)
    }

    /// As [`Node::start`], with the organisation `config` (`--config`), or none: then
    /// the node serves only its own conversation routes and `/health`.
    fn spawn(etcd: &str, database: &str, id: &str, config: Option<&str>, extra: &[&str]) -> Self {
        let (child, stderr, stdout, addr) = support::spawn_serving(
            Command::new(env!("CARGO_BIN_EXE_troupe"))
                .args(["node", "--etcd", etcd, "--postgres", database, "--node-id", id])
                .args([
                    "--lease-ttl-ms",
                    "3000",
                    "--listen",
                    "127.0.0.1:0",
                    "--http",
                    "127.0.0.1:0",
                ])
                // With an organisation the node serves `troupe serve`'s API (/v1/agents,
                // /metrics); without, only conversations and /health.
                .args(config.map(|config| ["--config", config]).into_iter().flatten())
                .args(extra)
                .env_remove("TROUPE_TOKEN")
                .env_remove("OPENAI_API_KEY")
                .env("RUST_LOG", "warn"),
            "troupe node",
        );
        Self {
            child,
            stderr: Some(stderr),
            _stdout: stdout,
            addr,
        }
    }

    /// One request to the node; the status, the response head and the body.
    fn request(&self, method: &str, path: &str, body: &str) -> (u16, String, String) {
        support::http_with_head(&self.addr, method, path, body, REQUEST_WAIT_MS_MAX)
    }

    /// As [`Node::request`], waiting up to `wait_ms` for the answer.
    fn request_within(&self, method: &str, path: &str, body: &str, wait_ms: u64) -> (u16, String, String) {
        support::http_with_head(&self.addr, method, path, body, wait_ms)
    }

    /// The value of the sample `name` (no labels) in the node's `/metrics`.
    fn metric(&self, name: &str) -> Option<u64> {
        let (status, _, text) = self.request("GET", "/metrics", "");
        assert_eq!(status, 200, "{text}");
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }

    /// Kills the node and returns what it wrote to stderr.
    fn stop(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stderr
            .take()
            .map(|stderr| stderr.join().unwrap())
            .unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|error| panic!("not JSON ({error}): {body}"))
}

/// Goal: while the node's PostgreSQL server is down (longer than the message's
/// deadline), a message is answered 503 `storage_unavailable` with `Retry-After: 1`, a
/// condition the client may retry, not 500 `storage_failed` (until 2026-12-07 it was
/// 500); `/metrics` shows the store tried again (`troupe_runtime_store_retries_total` >
/// 0; not shown before 2026-12-07); and the same message sent again once the server is
/// back is answered 200 and is in the agent's history once: the failed turn committed
/// nothing. Streamed (`?stream=true`), the failure is the stream's error event with
/// status 503 and the same code. Method: `pg_ctl stop -m fast` under a serving node, a message with a 1.5 s
/// `timeout_ms` (plain, then streamed), `pg_ctl start`, the message again.
#[tokio::test]
async fn a_node_whose_postgres_is_down_answers_503_storage_unavailable_and_the_same_message_later_runs_once() {
    /// The message's deadline while the store is down, in milliseconds.
    const DOWN_TIMEOUT_MS: u64 = 1_500;
    let (etcd, postgres, database) = etcd_and_database("node-store-unavailable", "unavailable").await;
    let node = Node::start(&etcd.endpoint(), &database, "down", &[]);
    let (status, _, body) = node.request("POST", "/v1/agents", r#"{"id": "echo"}"#);
    assert_eq!(status, 201, "{body}");
    let (status, _, body) = node.request("POST", "/v1/agents/echo/messages", r#"{"text": "first"}"#);
    assert_eq!(status, 200, "{body}");

    postgres.stop();
    let message = format!(r#"{{"text": "a second note", "timeout_ms": {DOWN_TIMEOUT_MS}}}"#);
    let asked = Instant::now();
    let (status, head, body) = node.request("POST", "/v1/agents/echo/messages", &message);
    eprintln!(
        "with PostgreSQL stopped: {status} after {} ms: {body}",
        asked.elapsed().as_millis()
    );
    assert_eq!(status, 503, "{head}\n{body}");
    let error = json(&body);
    assert_eq!(error["error"]["code"], "storage_unavailable", "{body}");
    assert!(
        head.to_ascii_lowercase().contains("\r\nretry-after: 1"),
        "no Retry-After: 1 in {head}"
    );
    let retries = node
        .metric("troupe_runtime_store_retries_total")
        .expect("/metrics shows troupe_runtime_store_retries_total");
    eprintln!("troupe_runtime_store_retries_total {retries}");
    assert!(retries > 0, "the store was tried again while down: {retries}");

    // Streamed, the same failure is the stream's error event, with the same code.
    let (status, _, stream) = node.request("POST", "/v1/agents/echo/messages?stream=true", &message);
    assert_eq!(status, 200, "the stream's headers: {stream}");
    let error_event = stream
        .lines()
        .skip_while(|line| *line != "event: error")
        .find_map(|line| line.strip_prefix("data: "))
        .unwrap_or_else(|| panic!("no error event in the stream: {stream}"));
    let error = json(error_event);
    assert_eq!(
        (&error["status"], &error["error"]["code"]),
        (&json!(503), &json!("storage_unavailable")),
        "{error_event}"
    );

    postgres.start_again();
    let (status, _, body) = node.request(
        "POST",
        "/v1/agents/echo/messages",
        r#"{"text": "a second note", "timeout_ms": 10000}"#,
    );
    assert_eq!(status, 200, "the same message once the server is back: {body}");
    eprintln!("once the server is back: {body}");
    let (status, _, body) = node.request("GET", "/v1/agents/echo/history", "");
    assert_eq!(status, 200, "{body}");
    let history = json(&body);
    let asked_second = history["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|message| message["role"] == "user" && message["content"] == "a second note")
        .count();
    assert_eq!(asked_second, 1, "the message is in the history once: {history}");
    let stderr = node.stop();
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Goal: `troupe node --max-connections N` serves at most N connections at once, as
/// `troupe serve` does (tested there in operator_probes.rs; on a node by no test
/// before): idle connections past the cap are not accepted, a request on one more
/// connection waits unanswered, and is answered at once when the idle ones go; the
/// node's `/metrics` shows `troupe_http_connections_open` (until 2026-12-07 it did not:
/// only `troupe serve`'s did). Method: `--max-connections 2`, one idle connection and a
/// scrape; then `IDLE` idle connections, then `GET /health`.
#[tokio::test]
async fn a_node_serves_at_most_max_connections_and_one_more_waits_until_one_closes() {
    /// The cap given, in connections.
    const CAP: usize = 2;
    /// Idle connections opened: far more than the cap, fewer than the listen backlog
    /// holds (about 128 here).
    const IDLE: usize = 64;
    /// Descriptors the node may open meanwhile besides the cap's (its store's and
    /// etcd's connections, a log line).
    const SLACK: usize = 16;
    /// How long the request on one more connection is given while the idle ones are
    /// held, in milliseconds: it must not be answered.
    const HELD_MS: u64 = 1_000;
    /// How soon it must be answered once they are gone, in milliseconds.
    const ANSWERED_MS: u64 = 3_000;
    // The server lives to the end of the test (dropping it stops it).
    let (etcd, _postgres, database) = etcd_and_database("node-connection-cap", "cap").await;
    let node = Node::start(
        &etcd.endpoint(),
        &database,
        "capped",
        &["--max-connections", &CAP.to_string()],
    );
    // One idle connection and the scrape's own: both counted.
    let one_idle = std::net::TcpStream::connect(&node.addr).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        node.metric("troupe_http_connections_open"),
        Some(2),
        "/metrics counts the idle connection and its own"
    );
    drop(one_idle);
    let pid = node.child.id();
    let descriptors = || std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count();
    let before = descriptors();
    let idle: Vec<std::net::TcpStream> = (0..IDLE)
        .map(|_| std::net::TcpStream::connect(&node.addr).unwrap())
        .collect();
    // The node accepts what it will.
    std::thread::sleep(Duration::from_millis(300));
    let grown = descriptors().saturating_sub(before);
    eprintln!("{IDLE} idle connections, --max-connections {CAP}: the node's descriptors grew by {grown}");
    assert!(
        grown <= CAP + SLACK,
        "{grown} descriptors more for {IDLE} idle connections with --max-connections {CAP}"
    );

    let took = support::held_past_the_cap_then_answered(
        &node.addr,
        Duration::from_millis(HELD_MS),
        Duration::from_millis(ANSWERED_MS),
        || drop(idle),
    );
    eprintln!("answered {} ms after the idle connections went", took.as_millis());
    assert!(
        node.metric("troupe_log_lines_dropped_total").is_some(),
        "the node's /metrics shows troupe_log_lines_dropped_total"
    );
    let stderr = node.stop();
    assert!(stderr.contains("--max-connections"), "the cap's warn line: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Whether the response head `head` carries `Retry-After: 1`.
fn retry_after_1(head: &str) -> bool {
    head.to_ascii_lowercase().contains("\r\nretry-after: 1\r\n")
        || head.to_ascii_lowercase().ends_with("\r\nretry-after: 1")
}

/// An A2A JSON-RPC `SendMessage` of `text` as message `message_id`; a notification
/// (no `id`) if `id` is null.
fn send_message(id: &Value, message_id: &str, text: &str) -> String {
    let mut request = json!({
        "jsonrpc": "2.0",
        "method": "SendMessage",
        "params": {"message": {"messageId": message_id, "role": "ROLE_USER", "parts": [{"text": text}]}},
    });
    if !id.is_null() {
        request["id"] = id.clone();
    }
    request.to_string()
}

/// [`send_message`] from a caller that waits `timeout_ms` (Troupe's call context,
/// `metadata.troupe.timeout_ms`): the request's deadline, until which the server tries
/// a store down for a moment again.
fn send_message_within(id: &Value, message_id: &str, text: &str, timeout_ms: u64) -> String {
    let mut request: Value = serde_json::from_str(&send_message(id, message_id, text)).unwrap();
    request["params"]["message"]["metadata"] = json!({"troupe": {"timeout_ms": timeout_ms}});
    request.to_string()
}

/// Goal: while a node's PostgreSQL server is down past the request's deadline, its A2A
/// route refuses a new task as every other route says a store down for a moment: a
/// `SendMessage` is 503 with JSON-RPC code -32000 and `Retry-After: 1`, and the same
/// message sent as a notification is 503 `storage_unavailable` with `Retry-After: 1`
/// (until 2026-12-07 it was 503 `overloaded`, which told the client the server was
/// full), each once the store was tried again until the deadline the caller gave
/// (since 2026-12-07; before, at its first failure); once the server is back, the same
/// message is answered with a completed task. Method: one task while the store is up
/// (the node takes the agent's A2A records), `pg_ctl stop -m fast`, both sends of a
/// new message with a `DOWN_TIMEOUT_MS` deadline, `pg_ctl start`, the message again.
#[tokio::test]
async fn a_nodes_a2a_route_refuses_a_task_503_storage_unavailable_while_its_postgres_is_down() {
    /// The caller's time while the store is down, in milliseconds.
    const DOWN_TIMEOUT_MS: u64 = 1_500;
    let (etcd, postgres, database) = etcd_and_database("node-a2a-store-unavailable", "a2a").await;
    let node = Node::start(&etcd.endpoint(), &database, "a2a-down", &[]);
    let (status, _, body) = node.request("POST", "/a2a/ana", &send_message(&json!(1), "up", "first"));
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        json(&body)["result"]["task"]["status"]["state"],
        "TASK_STATE_COMPLETED",
        "{body}"
    );

    postgres.stop();
    let retries_before = node.metric("troupe_runtime_store_retries_total").unwrap_or(0);
    let asked = Instant::now();
    let (status, head, body) = node.request(
        "POST",
        "/a2a/ana",
        &send_message_within(&json!(2), "down", "second", DOWN_TIMEOUT_MS),
    );
    let took = asked.elapsed();
    let retries = node.metric("troupe_runtime_store_retries_total").unwrap_or(0) - retries_before;
    eprintln!(
        "SendMessage with PostgreSQL stopped, {DOWN_TIMEOUT_MS} ms deadline: {status} after {} ms, {retries} store \
         retries: {body}",
        took.as_millis()
    );
    assert_eq!(status, 503, "{head}\n{body}");
    assert!(
        took >= Duration::from_millis(DOWN_TIMEOUT_MS / 2) && took < Duration::from_millis(DOWN_TIMEOUT_MS + 2_000),
        "answered after {took:?}: the store is tried again until the {DOWN_TIMEOUT_MS} ms deadline"
    );
    assert!(retries > 0, "the task's save was tried again: {retries}");
    assert!(retry_after_1(&head), "no Retry-After: 1 in {head}");
    let answer = json(&body);
    assert_eq!(
        (&answer["id"], &answer["error"]["code"]),
        (&json!(2), &json!(-32000)),
        "{body}"
    );
    let (status, head, body) = node.request(
        "POST",
        "/a2a/ana",
        &send_message_within(&Value::Null, "down", "second", DOWN_TIMEOUT_MS),
    );
    eprintln!("the same as a notification: {status}: {body}");
    assert_eq!(status, 503, "{head}\n{body}");
    assert!(retry_after_1(&head), "no Retry-After: 1 in {head}");
    assert_eq!(json(&body)["error"]["code"], "storage_unavailable", "{body}");

    postgres.start_again();
    let (status, _, body) = node.request("POST", "/a2a/ana", &send_message(&json!(3), "down", "second"));
    assert_eq!(status, 200, "the same message once the server is back: {body}");
    assert_eq!(
        json(&body)["result"]["task"]["status"]["state"],
        "TASK_STATE_COMPLETED",
        "{body}"
    );
    let stderr = node.stop();
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Goal: while a node's PostgreSQL server is down, `troupe serve`'s conversation routes
/// (on a node with `--config`) answer 503 `storage_unavailable` with `Retry-After: 1`,
/// as its agent routes do (until 2026-12-07 they answered 503 `overloaded`, which told
/// the client the server was full), once the read was tried again for
/// `CONVERSATION_READ_STORE_WAIT_MS` (since 2026-12-07; before, at its first failure),
/// and read the messages again once it is back. Method: a group conversation with a
/// message, `pg_ctl stop -m fast`, its definition and its messages read, `pg_ctl
/// start`, read again.
#[tokio::test]
async fn a_nodes_conversation_routes_answer_503_storage_unavailable_while_its_postgres_is_down() {
    let (etcd, postgres, database) = etcd_and_database("node-conversations-store-unavailable", "conversations").await;
    let node = Node::start(&etcd.endpoint(), &database, "conversations-down", &[]);
    let room = r#"{"id": "room", "kind": "group", "participants": [
        {"kind": "human", "name": "hugo"}, {"kind": "agent", "name": "ana"}]}"#;
    let (status, _, body) = node.request("POST", "/v1/conversations", room);
    assert_eq!(status, 200, "{body}");
    let note = r#"{"sender": {"kind": "human", "name": "hugo"}, "msg_id": "n1", "text": "a note"}"#;
    let (status, _, body) = node.request("POST", "/v1/conversations/room/messages", note);
    assert_eq!(status, 200, "{body}");

    postgres.stop();
    let wait = Duration::from_millis(troupe_agent::CONVERSATION_READ_STORE_WAIT_MS);
    for path in ["/v1/conversations/room", "/v1/conversations/room/messages"] {
        let retries_before = node.metric("troupe_runtime_store_retries_total").unwrap_or(0);
        let asked = Instant::now();
        let (status, head, body) = node.request("GET", path, "");
        let took = asked.elapsed();
        let retries = node.metric("troupe_runtime_store_retries_total").unwrap_or(0) - retries_before;
        eprintln!(
            "GET {path} with PostgreSQL stopped: {status} after {} ms, {retries} store retries: {body}",
            took.as_millis()
        );
        assert_eq!(status, 503, "{path}: {head}\n{body}");
        assert!(
            took >= wait - Duration::from_millis(500) && took < wait + Duration::from_millis(3_000),
            "{path}: answered after {took:?}, the reads being tried again for {wait:?}"
        );
        assert!(retries > 0, "{path}: the read was tried again: {retries}");
        assert_eq!(json(&body)["error"]["code"], "storage_unavailable", "{path}: {body}");
        assert!(retry_after_1(&head), "{path}: no Retry-After: 1 in {head}");
    }

    postgres.start_again();
    let (status, _, body) = node.request("GET", "/v1/conversations/room/messages", "");
    assert_eq!(status, 200, "once the server is back: {body}");
    assert_eq!(json(&body)["messages"][0]["text"], "a note", "{body}");
    let stderr = node.stop();
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A throwaway etcd and PostgreSQL server, both named `name`, and the address of a new
/// database `database` on the server.
async fn etcd_and_database(name: &str, database: &str) -> (TestEtcd, TestServer, String) {
    let etcd = TestEtcd::start(name).await;
    let postgres = TestServer::start(name);
    let database = postgres.create_database(database).await;
    (etcd, postgres, database)
}

/// One request to `node` sent as its PostgreSQL server is stopped, the server started
/// again `outage` after the stop ([`while_briefly_down`]): its answer, how long it took,
/// how long the server was down and the store retries counted meanwhile
/// (`troupe_runtime_store_retries_total`), said on stderr.
fn request_while_briefly_down(
    node: &Node,
    postgres: &TestServer,
    outage: Duration,
    label: &str,
    (method, path, body): (&str, &str, &str),
) -> ThroughRestart {
    let retries_before = node.metric("troupe_runtime_store_retries_total").unwrap_or(0);
    let (((status, _, answer), took), down) = while_briefly_down(postgres, outage, || {
        let asked = Instant::now();
        let answer = node.request(method, path, body);
        (answer, asked.elapsed())
    });
    let retries = node.metric("troupe_runtime_store_retries_total").unwrap_or(0) - retries_before;
    eprintln!(
        "{label} during a {} ms PostgreSQL outage: {status} after {} ms, {retries} store retries",
        down.as_millis(),
        took.as_millis()
    );
    ThroughRestart {
        status,
        body: answer,
        took,
        retries,
    }
}

/// What [`request_while_briefly_down`] saw: the answer's status and body, its time, the
/// store retries counted meanwhile.
struct ThroughRestart {
    status: u16,
    body: String,
    took: Duration,
    retries: u64,
}

/// Stops `postgres`, runs `during` while it is down, and starts it again `outage` after
/// the stop (in another thread, while `during` waits for its answer); returns what
/// `during` returned and how long the server was down (the restart included).
fn while_briefly_down<T>(postgres: &TestServer, outage: Duration, during: impl FnOnce() -> T) -> (T, Duration) {
    postgres.stop();
    let stopped = Instant::now();
    std::thread::scope(|scope| {
        let restart = scope.spawn(|| {
            std::thread::sleep(outage);
            postgres.start_again();
            stopped.elapsed()
        });
        let done = during();
        (done, restart.join().expect("the restart"))
    })
}

/// Goal: a PostgreSQL restart shorter than the request's deadline costs a node's reads
/// and A2A tasks some latency, not an error: a conversation's definition and its
/// messages (read outside any turn, tried again for `CONVERSATION_READ_STORE_WAIT_MS`),
/// and an A2A `SendMessage` to an agent the node serves no A2A task of yet (its records'
/// claim and read, its task numbers' read and reservation, the task's record: each tried
/// again within the request's deadline) are answered 200 once the server is back, and
/// `/metrics` counts the tries made again. Until 2026-12-07 each failed at once with
/// 503 `storage_unavailable` (the store went to directly, outside a turn). Method:
/// `pg_ctl stop -m fast`, each request sent at once, `pg_ctl start` `OUTAGE_MS` after
/// the stop from another thread.
#[tokio::test]
async fn a_nodes_conversation_reads_and_a2a_tasks_during_a_short_postgres_restart_succeed() {
    /// How long the server stays stopped before it is started again, in milliseconds.
    const OUTAGE_MS: u64 = 1_500;
    /// The A2A caller's time, in milliseconds: well past the outage.
    const A2A_TIMEOUT_MS: u64 = 15_000;
    let (etcd, postgres, database) = etcd_and_database("node-store-restart-reads", "restart").await;
    let node = Node::start(&etcd.endpoint(), &database, "restart", &[]);
    let room = r#"{"id": "room", "kind": "group", "participants": [
        {"kind": "human", "name": "hugo"}, {"kind": "agent", "name": "ana"}]}"#;
    let (status, _, body) = node.request("POST", "/v1/conversations", room);
    assert_eq!(status, 200, "{body}");
    let note = r#"{"sender": {"kind": "human", "name": "hugo"}, "msg_id": "n1", "text": "a note"}"#;
    let (status, _, body) = node.request("POST", "/v1/conversations/room/messages", note);
    assert_eq!(status, 200, "{body}");
    let outage = Duration::from_millis(OUTAGE_MS);

    for path in ["/v1/conversations/room", "/v1/conversations/room/messages"] {
        let ThroughRestart {
            status,
            body,
            took,
            retries,
            ..
        } = request_while_briefly_down(&node, &postgres, outage, &format!("GET {path}"), ("GET", path, ""));
        assert_eq!(status, 200, "{path}: {body}");
        assert!(
            took >= outage,
            "{path}: answered after {took:?}, inside the {outage:?} outage"
        );
        assert!(retries > 0, "{path}: the read was tried again: {retries}");
        if path.ends_with("/messages") {
            assert_eq!(json(&body)["messages"][0]["text"], "a note", "{body}");
        } else {
            assert_eq!(json(&body)["id"], "room", "{body}");
        }
    }

    // `ben`: no A2A task of it yet, so the node claims and reads its records first.
    let send = send_message_within(&json!(1), "restart-1", "hello during a restart", A2A_TIMEOUT_MS);
    let ThroughRestart {
        status,
        body,
        took,
        retries,
        ..
    } = request_while_briefly_down(&node, &postgres, outage, "A2A SendMessage", ("POST", "/a2a/ben", &send));
    assert_eq!(status, 200, "{body}");
    let task = &json(&body)["result"]["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{body}");
    assert!(took >= outage, "answered after {took:?}, inside the {outage:?} outage");
    assert!(retries > 0, "the store was tried again: {retries}");
    let stderr = node.stop();
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Goal: a node without `--config` answers a message to its own conversation route
/// while its PostgreSQL server is down as `troupe serve` does: 503 in the server's
/// error shape, `{"error": {"code": "storage_unavailable", "message"}}`, with
/// `Retry-After: 1` (until 2026-12-07 it was 503 `{"error": "..."}` without
/// `Retry-After`); the same message (same `id`) sent again once the server is back is
/// stored once. Method: a message, `pg_ctl stop -m fast`, a second message with an id
/// (the route takes no `timeout_ms`: the answer comes after `NODE_CALL_TIMEOUT_MS`,
/// 30 s), `pg_ctl start`, the second message again, the log read.
#[tokio::test]
async fn a_node_without_config_answers_its_own_conversation_route_503_storage_unavailable_with_retry_after() {
    let (etcd, postgres, database) = etcd_and_database("node-log-store-unavailable", "logs").await;
    let node = Node::spawn(&etcd.endpoint(), &database, "log-down", None, &[]);
    let (status, _, body) = node.request("POST", "/v1/conversations/c1/messages", r#"{"text": "first"}"#);
    assert_eq!(status, 200, "{body}");

    postgres.stop();
    let second = r#"{"text": "second", "id": "k2"}"#;
    let asked = Instant::now();
    let (status, head, body) =
        node.request_within("POST", "/v1/conversations/c1/messages", second, NODE_CALL_WAIT_MS_MAX);
    eprintln!(
        "with PostgreSQL stopped: {status} after {} ms: {body}",
        asked.elapsed().as_millis()
    );
    assert_eq!(status, 503, "{head}\n{body}");
    assert_eq!(json(&body)["error"]["code"], "storage_unavailable", "{body}");
    assert!(retry_after_1(&head), "no Retry-After: 1 in {head}");

    postgres.start_again();
    let (status, _, body) = node.request_within("POST", "/v1/conversations/c1/messages", second, NODE_CALL_WAIT_MS_MAX);
    assert_eq!(status, 200, "the same message once the server is back: {body}");
    let (status, _, body) = node.request("GET", "/v1/conversations/c1/messages", "");
    assert_eq!(status, 200, "{body}");
    let log = json(&body);
    let texts: Vec<&str> = log["messages"]
        .as_array()
        .unwrap_or_else(|| panic!("no messages in {body}"))
        .iter()
        .filter_map(|message| message["text"].as_str())
        .collect();
    assert_eq!(texts, ["first", "second"], "{body}");
    let stderr = node.stop();
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// The requests of the agent layer's own store operations outside a turn (since
/// 2026-12-07 tried again while the store is unavailable, for
/// `AGENT_API_STORE_WAIT_MS`), each with the status it is answered once the store
/// answers: an agent read (its inbox and outbox lengths: a load), its history (a
/// load), a task's record (a key read: none, so 404), a link added (the organisation
/// claimed and committed), an agent defined (the stored directory claimed and
/// committed).
const AGENT_LAYER_REQUESTS: [(&str, &str, &str, u16); 5] = [
    ("GET", "/v1/agents/ana", "", 200),
    ("GET", "/v1/agents/ana/history", "", 200),
    ("GET", "/v1/agents/ana/tasks/ana-task-none", "", 404),
    (
        "POST",
        "/v1/links",
        r#"{"from": "lead", "to": "ben", "relationship": "peer"}"#,
        201,
    ),
    ("POST", "/v1/agents", r#"{"id": "newcomer"}"#, 201),
];

/// Goal: a PostgreSQL restart shorter than `AGENT_API_STORE_WAIT_MS` costs the agent
/// layer's own reads and writes outside a turn some latency, not an error: an agent's
/// record (`GET /v1/agents/{id}`), its history, a task's record, a link added to the
/// organisation and an agent defined are answered as they are with the store up (200,
/// 404 for a task there is none of, 201) once the server is back, and `/metrics` counts
/// the tries made again. Until 2026-12-07 each was 503 `storage_unavailable` at the
/// first failure (the store gone to directly: `AgentClient::pending`, `task`,
/// `conversation_log_page`, the organisation's and the directory's `shared_record`
/// claim). Method: `pg_ctl stop -m fast`, one request sent at once, `pg_ctl start`
/// `OUTAGE_MS` after the stop from another thread; once per request.
#[tokio::test]
async fn a_nodes_agent_records_org_and_directory_changes_during_a_short_postgres_restart_succeed() {
    /// How long the server stays stopped before it is started again, in milliseconds.
    const OUTAGE_MS: u64 = 1_500;
    let (etcd, postgres, database) = etcd_and_database("node-store-restart-agents", "agents").await;
    let node = Node::start(&etcd.endpoint(), &database, "restart-agents", &[]);
    // Each route answers with the store up (and the organisation is in the cache).
    let (status, _, body) = node.request("GET", "/v1/agents/ana", "");
    assert_eq!(status, 200, "{body}");
    let outage = Duration::from_millis(OUTAGE_MS);

    // Every request is made (and said) before any is checked: each one's answer shows.
    let mut answered = Vec::new();
    for (method, path, body, expected) in AGENT_LAYER_REQUESTS {
        let ThroughRestart {
            status,
            body: answer,
            took,
            retries,
            ..
        } = request_while_briefly_down(
            &node,
            &postgres,
            outage,
            &format!("{method} {path}"),
            (method, path, body),
        );
        answered.push((method, path, expected, status, answer, took, retries));
    }
    for (method, path, expected, status, answer, took, retries) in answered {
        assert_eq!(status, expected, "{method} {path}: {answer}");
        assert!(
            took >= outage,
            "{method} {path}: answered after {took:?}, inside the {outage:?} outage"
        );
        assert!(retries > 0, "{method} {path}: the store was tried again: {retries}");
    }
    // What was written during the restarts is there, once.
    let (status, _, body) = node.request("GET", "/v1/links", "");
    assert_eq!(status, 200, "{body}");
    let links = json(&body);
    let added = links["links"]
        .as_array()
        .unwrap_or_else(|| panic!("no links in {body}"))
        .iter()
        .filter(|link| link["from"] == "lead" && link["to"] == "ben")
        .count();
    assert_eq!(added, 1, "{body}");
    let (status, _, body) = node.request("GET", "/v1/agents/newcomer", "");
    assert_eq!(status, 200, "{body}");
    let stderr = node.stop();
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Goal: while a node's PostgreSQL server stays down past `AGENT_API_STORE_WAIT_MS`,
/// the agent layer's reads and writes outside a turn still answer 503
/// `storage_unavailable` with `Retry-After: 1`, once the store was tried again for
/// that long (not at once, as until 2026-12-07; not an unbounded wait); once the server
/// is back they answer as usual. Method: `pg_ctl stop -m fast`, the requests sent at
/// once from threads of their own, `pg_ctl start`, the requests again.
#[tokio::test]
async fn a_nodes_agent_records_and_org_changes_answer_503_storage_unavailable_past_their_wait() {
    let (etcd, postgres, database) = etcd_and_database("node-store-down-agents", "agents").await;
    let node = Node::start(&etcd.endpoint(), &database, "down-agents", &[]);
    let (status, _, body) = node.request("GET", "/v1/agents/ana", "");
    assert_eq!(status, 200, "{body}");
    let wait = Duration::from_millis(troupe_agent::AGENT_API_STORE_WAIT_MS);
    let retries_before = node.metric("troupe_runtime_store_retries_total").unwrap_or(0);

    postgres.stop();
    let answers: Vec<_> = std::thread::scope(|scope| {
        let asked: Vec<_> = AGENT_LAYER_REQUESTS
            .iter()
            .map(|&(method, path, body, _)| {
                let node = &node;
                scope.spawn(move || {
                    let asked = Instant::now();
                    let answer = node.request(method, path, body);
                    (method, path, answer, asked.elapsed())
                })
            })
            .collect();
        asked
            .into_iter()
            .map(|asked| asked.join().expect("a request"))
            .collect()
    });
    for (method, path, (status, head, body), took) in answers {
        eprintln!(
            "{method} {path} with PostgreSQL stopped: {status} after {} ms: {body}",
            took.as_millis()
        );
        assert_eq!(status, 503, "{method} {path}: {head}\n{body}");
        assert_eq!(
            json(&body)["error"]["code"],
            "storage_unavailable",
            "{method} {path}: {body}"
        );
        assert!(retry_after_1(&head), "{method} {path}: no Retry-After: 1 in {head}");
        assert!(
            took >= wait - Duration::from_millis(500) && took < wait + Duration::from_millis(3_000),
            "{method} {path}: answered after {took:?}, the store being tried again for {wait:?}"
        );
    }
    let retries = node.metric("troupe_runtime_store_retries_total").unwrap_or(0) - retries_before;
    eprintln!("{retries} store retries in all");
    assert!(retries > 0, "the store was tried again: {retries}");

    postgres.start_again();
    for (method, path, body, expected) in AGENT_LAYER_REQUESTS {
        let (status, _, answer) = node.request(method, path, body);
        assert_eq!(status, expected, "{method} {path} once the server is back: {answer}");
    }
    let stderr = node.stop();
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Goal: a message to a conversation that lives on another node, sent while the
/// PostgreSQL server both nodes share is down, is answered by the node the client asked
/// 503 `storage_unavailable` with `Retry-After: 1` (the owner's turn fails its store
/// reads, tried again on the owner until the call's deadline, and says so across the
/// wire), not 503 `overloaded` (the server full); the same message once the server is
/// back is stored once. Method: two nodes on one etcd and one database; the group
/// conversation created and first written through `owner` (which places it there:
/// checked at the end, a message through `asked` runs a turn on `owner` and none on
/// `asked`); `pg_ctl stop -m fast`; a message through `asked` (answered after the
/// call's 30 s, `AGENT_DELIVERY_ACK_TIMEOUT_MS`); `pg_ctl start`; the message again.
#[tokio::test]
async fn a_conversation_on_another_node_answers_503_storage_unavailable_while_their_postgres_is_down() {
    let (etcd, postgres, database) = etcd_and_database("node-remote-conversation-down", "remote_conversations").await;
    let owner = Node::start(&etcd.endpoint(), &database, "conversation-owner", &[]);
    let asked = Node::start(&etcd.endpoint(), &database, "conversation-asked", &[]);
    let room = r#"{"id": "room", "kind": "group", "participants": [
        {"kind": "human", "name": "hugo"}, {"kind": "agent", "name": "ana"}]}"#;
    let (status, _, body) = owner.request("POST", "/v1/conversations", room);
    assert_eq!(status, 200, "{body}");
    let note = r#"{"sender": {"kind": "human", "name": "hugo"}, "msg_id": "n1", "text": "a note"}"#;
    let (status, _, body) = owner.request("POST", "/v1/conversations/room/messages", note);
    assert_eq!(status, 200, "{body}");

    postgres.stop();
    let second = r#"{"sender": {"kind": "human", "name": "hugo"}, "msg_id": "n2", "text": "a second note"}"#;
    let retries_before = owner.metric("troupe_runtime_store_retries_total").unwrap_or(0);
    let sent = Instant::now();
    let (status, head, body) =
        asked.request_within("POST", "/v1/conversations/room/messages", second, NODE_CALL_WAIT_MS_MAX);
    let owner_retries = owner.metric("troupe_runtime_store_retries_total").unwrap_or(0) - retries_before;
    eprintln!(
        "a message through the other node with PostgreSQL stopped: {status} after {} ms, {owner_retries} store \
         retries on the owner: {body}",
        sent.elapsed().as_millis()
    );
    assert_eq!(status, 503, "{head}\n{body}");
    assert_eq!(json(&body)["error"]["code"], "storage_unavailable", "{body}");
    assert!(retry_after_1(&head), "no Retry-After: 1 in {head}");
    assert!(owner_retries > 0, "the owner tried its store again: {owner_retries}");

    postgres.start_again();
    let turns = |node: &Node| node.metric("troupe_runtime_turns_run_total").unwrap_or(0);
    let (owner_turns, asked_turns) = (turns(&owner), turns(&asked));
    let (status, _, body) =
        asked.request_within("POST", "/v1/conversations/room/messages", second, NODE_CALL_WAIT_MS_MAX);
    assert_eq!(status, 200, "the same message once the server is back: {body}");
    assert!(
        turns(&owner) > owner_turns && turns(&asked) == asked_turns,
        "the conversation's turn ran on the owner (turns: owner {owner_turns} -> {}, asked {asked_turns} -> {})",
        turns(&owner),
        turns(&asked)
    );
    let (status, _, body) = asked.request("GET", "/v1/conversations/room/messages", "");
    assert_eq!(status, 200, "{body}");
    let log = json(&body);
    let texts: Vec<&str> = log["messages"]
        .as_array()
        .unwrap_or_else(|| panic!("no messages in {body}"))
        .iter()
        .filter_map(|message| message["text"].as_str())
        .collect();
    assert_eq!(texts, ["a note", "a second note"], "{body}");
    for node in [asked, owner] {
        let stderr = node.stop();
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

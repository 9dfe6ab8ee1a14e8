//! `troupe serve` run as a user runs it: it prints where it listens, answers HTTP on
//! loopback, and stops cleanly on SIGTERM; it refuses a non-loopback address without a
//! token. Normal build only (the server is not built under madsim).
#![cfg(not(madsim))]

mod support;

use std::io::{BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The longest the binary may take to start or to stop, in milliseconds.
const SERVE_WAIT_MS_MAX: u64 = 20_000;

fn troupe_serve(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_troupe"));
    command
        .arg("serve")
        .args(args)
        .env_remove("TROUPE_TOKEN")
        .env_remove("OPENAI_API_KEY");
    command
}

/// One HTTP/1.1 request over a fresh connection; the status and the body.
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    support::http(addr, method, path, body, SERVE_WAIT_MS_MAX)
}

/// Reads the child's stdout up to the `listening on http://ADDR` line; the rest of
/// stdout (for later reads) and the address.
fn read_address(child: &mut Child) -> (BufReader<std::process::ChildStdout>, String) {
    support::read_address(child).expect("troupe serve printed no address")
}

/// How often a stopping child is checked, in milliseconds.
const SERVE_POLL_MS: u64 = 20;

/// Sends SIGTERM to `child` (as a service manager stops it); `wait` then sees it stop.
fn send_sigterm(child: &Child) {
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success(), "kill -TERM {} failed", child.id());
}

/// Its exit status once it stops, within `SERVE_WAIT_MS_MAX`; else kills it and panics.
async fn wait(child: &mut Child) -> std::process::ExitStatus {
    for _ in 0..SERVE_WAIT_MS_MAX / SERVE_POLL_MS {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(SERVE_POLL_MS)).await;
    }
    let _ = child.kill();
    panic!("troupe serve did not stop within {SERVE_WAIT_MS_MAX} ms of SIGTERM");
}

/// Goal: the binary serves the default organisation on a free loopback port and stops
/// on SIGTERM with exit code 0. Method: start it on 127.0.0.1:0, read the address it
/// prints, ask /health and the critic agent, send SIGTERM.
#[tokio::test]
async fn serve_answers_on_loopback_and_stops_cleanly_on_sigterm() {
    let mut child = troupe_serve(&["--bind", "127.0.0.1:0", "--scripted"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (mut stdout, addr) = read_address(&mut child);
    let (status, body) = http(&addr, "GET", "/health", "");
    assert_eq!((status, body.as_str()), (200, "{\"agents\":5,\"status\":\"ok\"}"));
    let (status, body) = http(&addr, "POST", "/v1/agents/critic/messages", "{\"text\": \"a brief\"}");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"text\":\"Looks fine.\""), "{body}");

    send_sigterm(&child);
    let status = wait(&mut child).await;
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    assert!(status.success(), "{status:?}; stdout: {rest}");
    assert!(rest.contains("troupe serve: stopped"), "{rest}");
}

/// Goal: serving every interface without a token is refused with what to do. Method:
/// run `troupe serve --bind 0.0.0.0:0` with no token.
#[test]
fn serve_refuses_a_public_address_without_a_token() {
    let output = troupe_serve(&["--bind", "0.0.0.0:0", "--scripted"]).output().unwrap();
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("refusing to serve on 0.0.0.0:0 without a bearer token") && stderr.contains("--token"),
        "{stderr}"
    );
}

/// Goal: `troupe serve --config FILE` serves the file's agents instead of the built-in
/// five. Method: serve examples/org.toml, read /health and /v1/agents, send one of its
/// agents a message.
#[tokio::test]
async fn serve_with_a_config_serves_the_declared_organisation() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/org.toml");
    let mut child = troupe_serve(&["--bind", "127.0.0.1:0", "--scripted", "--config", config])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (_stdout, addr) = read_address(&mut child);
    let (status, body) = http(&addr, "GET", "/health", "");
    assert_eq!((status, body.as_str()), (200, "{\"agents\":4,\"status\":\"ok\"}"));
    let (status, body) = http(&addr, "GET", "/v1/agents", "");
    assert_eq!(status, 200, "{body}");
    for id in ["lead", "ana", "ben", "pia"] {
        assert!(body.contains(&format!("\"id\":\"{id}\"")), "{id} missing from {body}");
    }
    let (status, body) = http(&addr, "POST", "/v1/agents/ana/messages", "{\"text\": \"hello\"}");
    assert_eq!(status, 200, "{body}");

    send_sigterm(&child);
    assert!(wait(&mut child).await.success());
}

/// One A2A JSON-RPC call to `agent` on `addr`: the HTTP status and the response.
fn a2a(addr: &str, agent: &str, method: &str, params: serde_json::Value) -> (u16, serde_json::Value) {
    let body = serde_json::json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    let (status, text) = http(addr, "POST", &format!("/a2a/{agent}"), &body.to_string());
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}")),
    )
}

/// Goal: `--a2a-tasks-kept` and `--concurrent-requests-max` reach the server, and a
/// value out of range stops it before it listens, naming the flag. Method: serve with
/// one A2A task kept; send the critic two A2A messages: the first task is let go
/// (-32001), the second is kept. Then start with `--a2a-tasks-kept 0`.
#[tokio::test]
async fn serve_keeps_as_many_a2a_tasks_as_asked_and_refuses_a_limit_out_of_range() {
    let mut child = troupe_serve(&[
        "--bind",
        "127.0.0.1:0",
        "--scripted",
        "--a2a-tasks-kept",
        "1",
        "--concurrent-requests-max",
        "4",
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let (_stdout, addr) = read_address(&mut child);
    let mut ids = Vec::new();
    for (n, text) in ["a brief", "another brief"].iter().enumerate() {
        let message = serde_json::json!({
            "messageId": format!("m{n}"), "role": "ROLE_USER", "parts": [{"text": text}]
        });
        let (status, answer) = a2a(&addr, "critic", "SendMessage", serde_json::json!({"message": message}));
        assert_eq!(status, 200, "{answer}");
        let task = &answer["result"]["task"];
        assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{answer}");
        ids.push(task["id"].as_str().expect("a task id").to_string());
    }
    let (_, first) = a2a(&addr, "critic", "GetTask", serde_json::json!({"id": ids[0]}));
    assert_eq!(first["error"]["code"], -32001, "the first task was let go: {first}");
    let (_, second) = a2a(&addr, "critic", "GetTask", serde_json::json!({"id": ids[1]}));
    assert_eq!(second["result"]["id"], ids[1].as_str(), "the second is kept: {second}");
    send_sigterm(&child);
    assert!(wait(&mut child).await.success());

    let output = troupe_serve(&["--bind", "127.0.0.1:0", "--scripted", "--a2a-tasks-kept", "0"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--a2a-tasks-kept") && stderr.contains("1..=10000"),
        "{stderr}"
    );
}

/// Goal: `--streams-open-max` reaches the server, and a value out of range stops it
/// before it listens, naming the flag and the range. Method: serve with one stream;
/// hold a streamed message to the archivist open (its scripted turn takes 4 s) and ask
/// for a second stream: 503 naming the limit, while a plain request is served. Then
/// start with `--streams-open-max 0`.
#[tokio::test]
async fn serve_keeps_as_many_streams_open_as_asked_and_refuses_a_limit_out_of_range() {
    use std::io::{BufRead, Write};
    let mut child = troupe_serve(&["--bind", "127.0.0.1:0", "--scripted", "--streams-open-max", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (_stdout, addr) = read_address(&mut child);
    let body = r#"{"text": "Any reports on batteries?"}"#;
    let mut held = std::net::TcpStream::connect(&addr).unwrap();
    held.set_read_timeout(Some(Duration::from_millis(SERVE_WAIT_MS_MAX)))
        .unwrap();
    write!(
        held,
        "POST /v1/agents/archivist/messages?stream=true HTTP/1.1\r\nHost: {addr}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut status_line = String::new();
    BufReader::new(&held).read_line(&mut status_line).unwrap();
    assert!(
        status_line.starts_with("HTTP/1.1 200"),
        "the first stream opens: {status_line}"
    );

    let (status, answer) = http(&addr, "POST", "/v1/agents/critic/messages?stream=true", body);
    assert_eq!(status, 503, "a second stream over the limit of 1: {answer}");
    assert!(answer.contains("streams_open_max"), "{answer}");
    let (status, answer) = http(&addr, "GET", "/v1/agents", "");
    assert_eq!(status, 200, "a plain request is served: {answer}");
    drop(held);
    send_sigterm(&child);
    assert!(wait(&mut child).await.success());

    let output = troupe_serve(&["--bind", "127.0.0.1:0", "--scripted", "--streams-open-max", "0"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--streams-open-max") && stderr.contains("1..=65536"),
        "{stderr}"
    );
}

/// Goal: a broken config stops `troupe serve` before it listens, naming the file's line
/// and field. Method: serve a file with a misspelt field.
#[test]
fn serve_refuses_a_broken_config_naming_the_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("org.toml");
    std::fs::write(&file, "[[agents]]\nid = \"a\"\nsystem_promt = \"x\"\n").unwrap();
    let output = troupe_serve(&[
        "--bind",
        "127.0.0.1:0",
        "--scripted",
        "--config",
        file.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("org.toml:3"), "{stderr}");
    assert!(stderr.contains("system_promt"), "{stderr}");
    assert!(
        !String::from_utf8_lossy(&output.stdout).contains("listening on"),
        "{output:?}"
    );
}

/// Goal: with `--log-format json`, every log line on stderr is one JSON object; one
/// request logs an `http_request` line with its method, route, status 200 and latency,
/// and the agent's `turn` (with the `invoke` that started it) appears among the spans of
/// that same request (its `http_request` span, by `id`). Method: run the binary with
/// RUST_LOG=info, message the critic once, stop it, read stderr.
#[tokio::test]
async fn serve_logs_json_lines_with_the_turn_inside_the_request_span() {
    let mut child = troupe_serve(&["--bind", "127.0.0.1:0", "--scripted", "--log-format", "json"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (_stdout, addr) = read_address(&mut child);
    let (status, body) = http(&addr, "POST", "/v1/agents/critic/messages", "{\"text\": \"a brief\"}");
    assert_eq!(status, 200, "{body}");
    send_sigterm(&child);
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(wait(&mut child).await.success(), "{stderr}");

    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|error| panic!("not a JSON line ({error}): {line}")))
        .collect();
    // The request's own line: its span, closed, with the status and the latency.
    let request = lines
        .iter()
        .find(|line| {
            line["span"]["name"] == "http_request"
                && line["span"]["route"] == "/v1/agents/{id}/messages"
                && line["fields"]["message"] == "close"
        })
        .unwrap_or_else(|| panic!("no http_request line for the message: {stderr}"));
    let span = &request["span"];
    assert_eq!(
        (&span["method"], &span["status"]),
        (&"POST".into(), &200.into()),
        "{request}"
    );
    assert!(span["latency_us"].as_u64().is_some_and(|us| us > 0), "{request}");
    let id = span["id"].as_u64().expect("the request span has an id");
    // A line logged inside the agent's turn lists that request, then invoke, then turn.
    let inside = lines
        .iter()
        .find(|line| {
            let names: Vec<&str> = line["spans"]
                .as_array()
                .map(|spans| spans.iter().filter_map(|span| span["name"].as_str()).collect())
                .unwrap_or_default();
            names.starts_with(&["http_request", "invoke", "turn"])
                && line["spans"][0]["id"].as_u64() == Some(id)
                && line["spans"][2]["actor"] == "agent/critic"
        })
        .unwrap_or_else(|| panic!("no line inside the critic's turn under request {id}: {stderr}"));
    assert_eq!(inside["spans"][1]["target"], "agent/critic", "{inside}");
}

/// Goal: with `--log-format text` (the default), a request's span-close line names the
/// span with its fields (`http_request{id=.. method=POST route=.. status=200
/// latency_us=..}`), and a line from inside the agent's turn carries the span path of
/// that same request: `http_request{id=N ..}:invoke{..}:turn{actor=agent/critic ..}`.
/// Method: run the binary with RUST_LOG=info, message the critic once, stop it, read
/// stderr (not a terminal: no colour codes).
#[tokio::test]
async fn serve_logs_text_lines_with_the_span_fields() {
    let mut child = troupe_serve(&["--bind", "127.0.0.1:0", "--scripted", "--log-format", "text"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (_stdout, addr) = read_address(&mut child);
    let (status, body) = http(&addr, "POST", "/v1/agents/critic/messages", "{\"text\": \"a brief\"}");
    assert_eq!(status, 200, "{body}");
    send_sigterm(&child);
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(wait(&mut child).await.success(), "{stderr}");

    assert!(
        !stderr.contains('\u{1b}'),
        "no colour codes when stderr is not a terminal: {stderr}"
    );
    assert!(
        stderr
            .lines()
            .all(|line| serde_json::from_str::<serde_json::Value>(line).is_err()),
        "text, not JSON: {stderr}"
    );
    // The request span's own close line: the span path is that one span.
    let request = stderr
        .lines()
        .find(|line| {
            line.contains(" INFO http_request{")
                && line.contains("route=/v1/agents/{id}/messages")
                && line.contains("}: troupe_server::server: close ")
        })
        .unwrap_or_else(|| panic!("no close line of the message's http_request span: {stderr}"));
    let fields = request
        .split_once(" INFO http_request{")
        .and_then(|(_, rest)| rest.split_once("}: troupe_server::server: close "))
        .map(|(fields, _)| fields)
        .unwrap();
    assert!(fields.contains("method=POST"), "{request}");
    assert!(fields.contains("status=200"), "{request}");
    let latency: u64 = fields
        .split_whitespace()
        .find_map(|field| field.strip_prefix("latency_us="))
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no latency_us in {request}"));
    assert!(latency > 0, "{request}");
    let id = fields
        .split_whitespace()
        .find_map(|field| field.strip_prefix("id="))
        .unwrap_or_else(|| panic!("no id in {request}"));
    let inside = stderr
        .lines()
        .find(|line| {
            line.contains(&format!("http_request{{id={id} "))
                && line.contains("}:invoke{")
                && line.contains("}:turn{actor=agent/critic")
        })
        .unwrap_or_else(|| panic!("no line inside the critic's turn under request {id}: {stderr}"));
    assert!(
        inside.contains("chain="),
        "the turn's span carries the call chain: {inside}"
    );
}

/// Goal: `--otlp-endpoint` in a build without the `otel` feature is refused before
/// anything starts, with a message saying how to build it.
#[cfg(not(feature = "otel"))]
#[test]
fn serve_refuses_an_otlp_endpoint_without_the_otel_feature() {
    let output = troupe_serve(&[
        "--bind",
        "127.0.0.1:0",
        "--scripted",
        "--otlp-endpoint",
        "http://127.0.0.1:4318",
    ])
    .output()
    .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--features otel"), "{stderr}");
    assert!(
        !String::from_utf8_lossy(&output.stdout).contains("listening on"),
        "refused before listening"
    );
}

/// Reads one HTTP/1.1 request from `stream` (headers, then `Content-Length` bytes of
/// body) and answers 200 with an empty body: the request line, the headers (lower
/// case) and the body.
#[cfg(feature = "otel")]
async fn read_one_request(stream: &mut tokio::net::TcpStream) -> (String, String, Vec<u8>) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buffer = Vec::new();
    let mut chunk = [0_u8; 8192];
    let head_end = loop {
        if let Some(at) = buffer.windows(4).position(|window| window == b"\r\n\r\n") {
            break at;
        }
        let read = stream.read(&mut chunk).await.unwrap();
        assert!(read > 0, "the exporter closed the connection mid-request");
        buffer.extend_from_slice(&chunk[..read]);
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).to_lowercase();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .map(|value| value.trim().parse().unwrap())
        .unwrap_or_else(|| panic!("no content-length: {head}"));
    let mut body = buffer[head_end + 4..].to_vec();
    while body.len() < length {
        let read = stream.read(&mut chunk).await.unwrap();
        assert!(read > 0, "the exporter closed the connection mid-body");
        body.extend_from_slice(&chunk[..read]);
    }
    stream
        .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n")
        .await
        .unwrap();
    let (line, headers) = head.split_once("\r\n").unwrap_or((&head, ""));
    (line.to_string(), headers.to_string(), body)
}

/// Goal: a binary built with `--features otel` and given `--otlp-endpoint` sends the
/// spans of a request to that collector when it stops: a `POST /v1/traces` with a
/// protobuf body naming the request's spans and the agent. Method: a loopback listener
/// standing in for the collector (it reads the raw request; the protobuf itself is
/// decoded in troupe-server's otel test), one message to the critic, SIGTERM.
#[cfg(feature = "otel")]
#[tokio::test]
async fn serve_exports_the_spans_to_the_otlp_endpoint() {
    let collector = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", collector.local_addr().unwrap());
    let mut child = troupe_serve(&["--bind", "127.0.0.1:0", "--scripted", "--otlp-endpoint", &endpoint])
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (_stdout, addr) = read_address(&mut child);
    let (status, body) = http(&addr, "POST", "/v1/agents/critic/messages", "{\"text\": \"a brief\"}");
    assert_eq!(status, 200, "{body}");
    send_sigterm(&child);
    let received = tokio::time::timeout(Duration::from_millis(SERVE_WAIT_MS_MAX), async {
        let mut bodies = Vec::new();
        loop {
            let (mut stream, _) = collector.accept().await.unwrap();
            let (line, headers, body) = read_one_request(&mut stream).await;
            assert_eq!(line, "post /v1/traces http/1.1");
            assert!(headers.contains("content-type: application/x-protobuf"), "{headers}");
            bodies.extend(body);
            let has = |needle: &[u8]| bodies.windows(needle.len()).any(|window| window == needle);
            if has(b"http_request") && has(b"model_call") {
                return bodies;
            }
        }
    })
    .await
    .expect("the spans reach the collector");
    let has = |needle: &[u8]| received.windows(needle.len()).any(|window| window == needle);
    for needle in [
        &b"turn"[..],
        b"invoke",
        b"agent/critic",
        b"/v1/agents/{id}/messages",
        b"troupe",
    ] {
        assert!(has(needle), "{:?} not in the export", String::from_utf8_lossy(needle));
    }
    assert!(wait(&mut child).await.success());
}

/// Goal: with the `otel` feature, an endpoint that is not `http://` is refused before
/// anything starts, with an example of a valid one.
#[cfg(feature = "otel")]
#[test]
fn serve_refuses_an_otlp_endpoint_that_is_not_http() {
    let output = troupe_serve(&[
        "--bind",
        "127.0.0.1:0",
        "--scripted",
        "--otlp-endpoint",
        "collector:4318",
    ])
    .output()
    .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("http://127.0.0.1:4318"), "{stderr}");
}

/// A `troupe serve` on the scripted model keeping its state in `db`, listening on a
/// free loopback port: the child, its stdout and its address.
fn serve_on_db(db: &str) -> (Child, BufReader<std::process::ChildStdout>, String) {
    let mut child = troupe_serve(&["--bind", "127.0.0.1:0", "--scripted", "--db", db])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (stdout, addr) = read_address(&mut child);
    (child, stdout, addr)
}

/// Goal: two `troupe serve` processes on one state directory (one SQLite file) share the
/// organisation: a policy set through one is what the other reports (and admits by)
/// within `ORG_CACHE_MAX_AGE_MS` of the change, without a restart. Method: start both
/// with the same `--db`, read the policy from the second (its copy is then fresh), set
/// `enforced` through the first, and poll the second until it reports it; then set it
/// back through the second and poll the first. Bounded by the cache age plus
/// `CROSS_PROCESS_SLACK_MS` (two HTTP round trips and a SQLite read, on a busy machine).
#[tokio::test]
async fn two_processes_on_one_file_see_each_others_policy_within_the_cache_age() {
    /// What the wait may take beyond the cache age, in milliseconds.
    const CROSS_PROCESS_SLACK_MS: u64 = 2_000;
    let directory = tempfile::tempdir().unwrap();
    let db = directory.path().to_str().unwrap();
    let start = || serve_on_db(db);
    let (mut first, _first_out, first_addr) = start();
    let (mut second, _second_out, second_addr) = start();
    let policy_of = |addr: &str| {
        let (status, body) = http(addr, "GET", "/v1/org/policy", "");
        assert_eq!(status, 200, "{body}");
        let value: serde_json::Value = serde_json::from_str(&body).unwrap();
        value["policy"].as_str().unwrap().to_string()
    };
    let bound = Duration::from_millis(troupe_agent::ORG_CACHE_MAX_AGE_MS + CROSS_PROCESS_SLACK_MS);
    for (writer, reader, policy) in [
        (&first_addr, &second_addr, "enforced"),
        (&second_addr, &first_addr, "open"),
    ] {
        assert_ne!(policy_of(reader), policy, "{reader} reads the policy before the change");
        let (status, body) = http(
            writer,
            "PUT",
            "/v1/org/policy",
            &format!("{{\"policy\": \"{policy}\"}}"),
        );
        assert_eq!(status, 200, "{body}");
        let changed = tokio::time::Instant::now();
        loop {
            if policy_of(reader) == policy {
                eprintln!(
                    "{policy} set through {writer} was seen by {reader} after {:?}",
                    changed.elapsed()
                );
                break;
            }
            assert!(
                changed.elapsed() < bound,
                "the other process still reports the old policy {:?} after the change",
                changed.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(SERVE_POLL_MS)).await;
        }
    }
    for child in [&mut first, &mut second] {
        send_sigterm(child);
        assert!(wait(child).await.success());
    }
}

/// Goal: an agent created over the API is kept: another `troupe serve` on the same
/// `--db` lists and runs it within the refresh period, and so does a server started
/// after the first is killed with SIGKILL; one deleted over the API stays deleted, even
/// an agent the server starts with. Method: two processes on one `--db`, the scripted
/// model; `POST /v1/agents` and `DELETE /v1/agents/{id}` through the first, then
/// `GET`s and a message through the second; both killed, a third started.
#[tokio::test]
async fn an_agent_created_over_the_api_outlives_the_server_and_reaches_the_other_on_the_file() {
    /// What the wait may take beyond the refresh period, in milliseconds.
    const CROSS_PROCESS_SLACK_MS: u64 = 2_000;
    let directory = tempfile::tempdir().unwrap();
    let db = directory.path().to_str().unwrap();
    let start = || serve_on_db(db);
    let (mut first, _first_out, first_addr) = start();
    let (mut second, _second_out, second_addr) = start();
    // The default organisation's first agent, deleted below.
    let (status, body) = http(&first_addr, "GET", "/v1/agents", "");
    assert_eq!(status, 200, "{body}");
    let listed: serde_json::Value = serde_json::from_str(&body).unwrap();
    let built = listed["agents"][0]["id"].as_str().expect("an agent").to_string();
    // The second process reads the stored directory now: it sees the changes below
    // only when its copy is a refresh period old.
    let (status, body) = http(&second_addr, "GET", "/v1/agents", "");
    assert_eq!(status, 200, "{body}");

    let created = r#"{"id": "kept", "role": "kept across restarts", "system_prompt": "You are kept."}"#;
    let (status, body) = http(&first_addr, "POST", "/v1/agents", created);
    assert_eq!(status, 201, "{body}");
    let (status, body) = http(&first_addr, "DELETE", &format!("/v1/agents/{built}"), "");
    assert_eq!(status, 204, "{body}");
    let written = tokio::time::Instant::now();
    let bound = Duration::from_millis(troupe_agent::DIRECTORY_REFRESH_MS + CROSS_PROCESS_SLACK_MS);
    loop {
        let (kept, _) = http(&second_addr, "GET", "/v1/agents/kept", "");
        let (gone, _) = http(&second_addr, "GET", &format!("/v1/agents/{built}"), "");
        if (kept, gone) == (200, 404) {
            eprintln!("the other process saw both changes after {:?}", written.elapsed());
            break;
        }
        assert!(
            written.elapsed() < bound,
            "the other process answers {kept} for the created agent and {gone} for the deleted one after {:?}",
            written.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(SERVE_POLL_MS)).await;
    }
    let (status, body) = http(&second_addr, "POST", "/v1/agents/kept/messages", r#"{"text": "hello"}"#);
    assert_eq!(status, 200, "the created agent runs in the other process: {body}");
    assert!(body.contains("kept heard: hello"), "{body}");

    for child in [&mut first, &mut second] {
        child.kill().unwrap();
        child.wait().unwrap();
    }
    let (mut third, _third_out, third_addr) = start();
    let (status, body) = http(&third_addr, "GET", "/v1/agents/kept", "");
    assert_eq!(status, 200, "the created agent outlives both servers: {body}");
    assert!(body.contains("kept across restarts"), "{body}");
    let (status, body) = http(&third_addr, "GET", &format!("/v1/agents/{built}"), "");
    assert_eq!(status, 404, "the deleted agent stays deleted: {body}");
    let (status, body) = http(&third_addr, "POST", "/v1/agents/kept/messages", r#"{"text": "again"}"#);
    assert_eq!(status, 200, "{body}");
    let (status, body) = http(&third_addr, "GET", "/v1/agents/kept/history", "");
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("hello") && body.contains("again"),
        "its history is kept: {body}"
    );
    send_sigterm(&third);
    assert!(wait(&mut third).await.success());
}

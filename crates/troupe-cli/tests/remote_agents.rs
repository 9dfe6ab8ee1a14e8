//! Remote agents across two `troupe serve` processes on loopback: an agent of server 1
//! calls an agent of server 2 through `call_agent` (the scripted model really emits the
//! tool call), and the call rules hold across the servers: a cycle 1 → 2 → 1 is
//! refused naming the chain, a chain too deep is refused, a slow remote agent gets no
//! more time than its caller has left, and a server that is down is a clear error to
//! the model. Normal build only (the server is not built under madsim).
#![cfg(not(madsim))]

mod support;

use std::io::BufReader;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

/// The longest a server may take to start, or one HTTP exchange to end, in ms.
const SERVE_WAIT_MS_MAX: u64 = 30_000;
/// The deadline the user gives the slow call, in milliseconds.
const SLOW_CALL_DEADLINE_MS: u64 = 2_000;
/// How long the slow test waits for the remote task to end, at most, in milliseconds.
const REMOTE_TASK_END_WAIT_MS_MAX: u64 = 10_000;
/// How often the slow test reads the remote task, in milliseconds.
const REMOTE_TASK_POLL_MS: u64 = 100;

/// A `troupe serve` child, killed when dropped.
struct Server {
    child: Child,
    addr: String,
    /// Held open: the child prints a line when it stops.
    _stdout: BufReader<std::process::ChildStdout>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A loopback port nobody listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Serves `config` (TOML) on `port` with the scripted model.
fn serve(dir: &Path, name: &str, port: u16, config: &str) -> Server {
    let file = dir.join(format!("{name}.toml"));
    std::fs::write(&file, config).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args([
            "serve",
            "--scripted",
            "--bind",
            &format!("127.0.0.1:{port}"),
            "--config",
        ])
        .arg(&file)
        .env_remove("TROUPE_TOKEN")
        .env_remove("OPENAI_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    if let Some((stdout, addr)) = support::read_address(&mut child) {
        return Server {
            child,
            addr,
            _stdout: stdout,
        };
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("troupe serve ({name}) printed no address");
}

/// One HTTP/1.1 request; the status and the body as JSON.
fn http(addr: &str, method: &str, path: &str, body: &Value) -> (u16, Value) {
    let (status, body) = support::http(addr, method, path, &body.to_string(), SERVE_WAIT_MS_MAX);
    let body = serde_json::from_str(&body).unwrap_or(Value::String(body));
    (status, body)
}

/// Asks agent `agent` of `server`; the status and the reply.
fn ask(server: &Server, agent: &str, text: &str, timeout_ms: Option<u64>) -> (u16, Value) {
    let mut body = json!({"text": text});
    if let Some(timeout_ms) = timeout_ms {
        body["timeout_ms"] = json!(timeout_ms);
    }
    http(&server.addr, "POST", &format!("/v1/agents/{agent}/messages"), &body)
}

/// The A2A tasks of agent `agent` on `server`, newest first.
fn tasks(server: &Server, agent: &str) -> Vec<Value> {
    let request = json!({"jsonrpc": "2.0", "id": 1, "method": "ListTasks", "params": {"historyLength": 0}});
    let (status, answer) = http(&server.addr, "POST", &format!("/a2a/{agent}"), &request);
    assert_eq!(status, 200, "{answer}");
    answer["result"]["tasks"].as_array().cloned().unwrap_or_default()
}

fn agents(ids: &[&str]) -> String {
    ids.iter().map(|id| format!("[[agents]]\nid = \"{id}\"\n\n")).collect()
}

fn remote(id: &str, port: u16, agent: &str) -> String {
    format!("[[remote_agents]]\nid = \"{id}\"\nurl = \"http://127.0.0.1:{port}/a2a/{agent}\"\nrole = \"remote\"\n\n")
}

/// Goal: an agent of server 1 calls an agent of server 2 with call_agent and gets its
/// answer; the message carried the call context. Method: a1 (server 1) is told
/// `route: b2`; its scripted model calls the remote agent b2; server 2's A2A task shows
/// the chain [a1] and depth 1 it arrived with, and the trace id server 1 gave the
/// request (its `x-troupe-trace-id` header): b2's turn ran under it (the task's
/// `metadata.troupe.trace_id` is the id its turn runs under: troupe-server's
/// `tests/trace_ids.rs` checks that on the turn spans).
#[test]
fn an_agent_calls_an_agent_of_another_server_and_gets_its_answer() {
    let dir = tempfile::tempdir().unwrap();
    let (port1, port2) = (free_port(), free_port());
    let two = serve(dir.path(), "two", port2, &agents(&["b2"]));
    let one = serve(
        dir.path(),
        "one",
        port1,
        &format!("{}{}", agents(&["a1"]), remote("b2", port2, "b2")),
    );
    let (status, head, reply) = support::http_with_head(
        &one.addr,
        "POST",
        "/v1/agents/a1/messages",
        &json!({"text": "route: b2"}).to_string(),
        SERVE_WAIT_MS_MAX,
    );
    let reply: Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["text"], "hello from b2", "{reply}");
    let trace = head
        .lines()
        .find_map(|line| line.strip_prefix("x-troupe-trace-id: "))
        .unwrap_or_else(|| panic!("no trace id header: {head}"));
    assert_eq!(trace.len(), 32, "{trace}");
    let arrived = tasks(&two, "b2");
    assert_eq!(arrived.len(), 1, "{arrived:?}");
    let troupe = &arrived[0]["metadata"]["troupe"];
    assert_eq!(troupe["chain"], json!(["a1"]), "{troupe}");
    assert_eq!(troupe["depth"], 1, "{troupe}");
    assert_eq!(troupe["trace_id"], trace, "server 2 ran the request's trace: {troupe}");
    assert_eq!(arrived[0]["status"]["state"], "TASK_STATE_COMPLETED");
}

/// Goal: a cycle across servers is refused, naming the chain. Method: server 2 knows
/// server 1's a1 under another local id (`boss`), so only the check on arrival can see
/// the cycle a1 → b2 → a1; a1 is told `route: b2 boss`.
#[test]
fn a_cycle_across_servers_is_refused_with_the_chain() {
    let dir = tempfile::tempdir().unwrap();
    let (port1, port2) = (free_port(), free_port());
    let _two = serve(
        dir.path(),
        "two",
        port2,
        &format!("{}{}", agents(&["b2"]), remote("boss", port1, "a1")),
    );
    let one = serve(
        dir.path(),
        "one",
        port1,
        &format!("{}{}", agents(&["a1"]), remote("b2", port2, "b2")),
    );
    let (status, reply) = ask(&one, "a1", "route: b2 boss", None);
    assert_eq!(status, 200, "{reply}");
    let text = reply["text"].as_str().unwrap();
    assert!(text.contains("refused the call"), "{text}");
    assert!(text.contains("cycle") && text.contains(r#"["a1", "b2"]"#), "{text}");
    // Server 1 rejected the second arrival of a1 without running it.
    let a1_tasks = tasks(&one, "a1");
    assert_eq!(a1_tasks.len(), 1, "{a1_tasks:?}");
    assert_eq!(a1_tasks[0]["status"]["state"], "TASK_STATE_REJECTED");
}

/// Goal: the depth of a chain carries across servers and its limit holds there.
/// Method: a1 → a2 → a3 → a4 on server 1, then b5 → b6 on server 2; b6 (at depth 5, the
/// limit) may not call b7, which it could from a fresh request on server 2.
#[test]
fn a_chain_too_deep_across_servers_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (port1, port2) = (free_port(), free_port());
    let two = serve(dir.path(), "two", port2, &agents(&["b5", "b6", "b7"]));
    let one = serve(
        dir.path(),
        "one",
        port1,
        &format!("{}{}", agents(&["a1", "a2", "a3", "a4"]), remote("b5", port2, "b5")),
    );
    let (status, reply) = ask(&one, "a1", "route: a2 a3 a4 b5 b6 b7", None);
    assert_eq!(status, 200, "{reply}");
    let text = reply["text"].as_str().unwrap();
    assert!(text.contains("call depth 5 has reached the limit of 5"), "{text}");
    // The same hops started on server 2 are within the limit.
    let (status, reply) = ask(&two, "b5", "route: b6 b7", None);
    assert_eq!(
        (status, reply["text"].as_str()),
        (200, Some("hello from b7")),
        "{reply}"
    );
}

/// Goal: a remote agent never gets more time than its caller has left. Method: the user
/// gives a1 2 s; a1 calls b2 on server 2, whose scripted model takes 20 s. The user
/// gets a timeout in about 2 s; server 2's task ran under at most 2 s and ended
/// failed (timeout) long before the 20 s.
#[tokio::test]
async fn a_slow_remote_agent_hits_the_callers_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let (port1, port2) = (free_port(), free_port());
    let two = serve(dir.path(), "two", port2, &agents(&["b2"]));
    let one = serve(
        dir.path(),
        "one",
        port1,
        &format!("{}{}", agents(&["a1"]), remote("b2", port2, "b2")),
    );
    let started = tokio::time::Instant::now();
    let (status, reply) = ask(&one, "a1", "route: b2 wait", Some(SLOW_CALL_DEADLINE_MS));
    let waited = started.elapsed();
    assert_eq!(status, 504, "{reply}");
    assert!(
        waited < Duration::from_millis(SLOW_CALL_DEADLINE_MS + 2_000),
        "{waited:?}"
    );
    let mut task = Value::Null;
    for _ in 0..REMOTE_TASK_END_WAIT_MS_MAX / REMOTE_TASK_POLL_MS {
        task = tasks(&two, "b2").first().cloned().unwrap_or_default();
        if matches!(
            task["status"]["state"].as_str(),
            Some("TASK_STATE_FAILED" | "TASK_STATE_COMPLETED")
        ) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(REMOTE_TASK_POLL_MS)).await;
    }
    let allowed = task["metadata"]["troupe"]["timeout_ms"].as_u64().unwrap();
    assert!(allowed > 0 && allowed <= SLOW_CALL_DEADLINE_MS, "{task}");
    assert_eq!(task["status"]["state"], "TASK_STATE_FAILED", "{task}");
    let reason = task["status"]["message"]["parts"][0]["text"].as_str().unwrap();
    assert!(reason.starts_with("timeout"), "{reason}");
    assert!(
        started.elapsed() < Duration::from_millis(troupe_cli::ORG_DEMO_WAIT_MS),
        "{:?}",
        started.elapsed()
    );
}

/// Goal: a remote server that is down is a clear error to the model, naming the URL.
/// Method: a1's remote agent points at a loopback port nobody listens on.
#[test]
fn a_remote_server_that_is_down_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (port1, down) = (free_port(), free_port());
    let one = serve(
        dir.path(),
        "one",
        port1,
        &format!("{}{}", agents(&["a1"]), remote("gone", down, "gone")),
    );
    let (status, reply) = ask(&one, "a1", "route: gone", None);
    assert_eq!(status, 200, "{reply}");
    let text = reply["text"].as_str().unwrap();
    let url = format!("http://127.0.0.1:{down}/a2a/gone");
    assert!(
        text.contains("call_agent failed") && text.contains(&format!("remote agent gone at {url} is unreachable")),
        "{text}"
    );
}

//! Goal: a stdio MCP server's child process lives exactly as long as what uses it. It is
//! killed once the `McpServer` and every tool made from it are gone, also when the agent
//! system holding the tools is dropped with a call to it still in flight; while a tool
//! is still held, the process stays. A process left behind by each system an embedder
//! started and dropped would pile up.
//!
//! Method: this crate's `troupe-mcp-echo` binary is the server. The test finds its
//! child processes in `/proc` (parent = this test process, command `troupe-mcp-echo`,
//! not a zombie); it is alone in its binary, so no other test's children are counted.
//! Every wait is bounded by `EXIT_WAIT_MS`. Linux only (`/proc`).

#![cfg(all(not(madsim), target_os = "linux"))]

#[path = "support/mcp_setup.rs"]
mod mcp_setup;

use std::sync::Arc;
use std::time::Duration;

use mcp_setup::{CONNECT_TIMEOUT, ECHO_SERVER, EXIT_WAIT_MS, POLL_MS};
use serde_json::json;
use troupe_agent::{AgentSpec, AgentSystem, McpServer, ScriptRule, ScriptedLlm};

/// The echo server's process name, as `/proc/PID/stat` shows it (at most 15 bytes).
const ECHO_COMM: &str = "troupe-mcp-echo";

/// The pids of this process's living (not zombie) `troupe-mcp-echo` children.
fn echo_children() -> Vec<u32> {
    let me = std::process::id();
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc is readable").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        // A process may end between the listing and this read.
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": the command may hold spaces, so split at the last ')'.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = &stat[open + 1..close];
        let mut rest = stat[close + 1..].split_whitespace();
        let (Some(state), Some(ppid)) = (rest.next(), rest.next()) else {
            continue;
        };
        if comm == ECHO_COMM && state != "Z" && ppid.parse::<u32>() == Ok(me) {
            pids.push(pid);
        }
    }
    pids
}

/// Waits (at most `EXIT_WAIT_MS`) until this process has no living echo child; fails
/// naming the ones left and `when`.
async fn assert_no_child_within_wait(when: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(EXIT_WAIT_MS);
    loop {
        let left = echo_children();
        if left.is_empty() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{EXIT_WAIT_MS} ms after {when}, the MCP server's process is still alive: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
}

async fn connect() -> McpServer {
    let server = McpServer::connect_stdio("echo", ECHO_SERVER, std::iter::empty::<&str>(), CONNECT_TIMEOUT)
        .await
        .expect("the echo server starts");
    assert_eq!(echo_children().len(), 1, "one child per connection");
    server
}

/// Both cases in one test, one after the other: the counts are of this process's
/// children, which a second test running at the same time would change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stdio_mcp_servers_process_ends_with_its_last_user() {
    assert!(echo_children().is_empty(), "no child before the test");

    // 1. The server handle goes, a tool made from it stays: the process stays; then
    //    the tool goes too.
    let server = connect().await;
    let tools = server.tools().unwrap();
    drop(server);
    tokio::time::sleep(Duration::from_millis(POLL_MS * 5)).await;
    assert_eq!(echo_children().len(), 1, "a tool still holds the connection");
    drop(tools);
    assert_no_child_within_wait("the server and its tools were dropped").await;

    // 2. An agent system holds the tools and is dropped while its agent waits for a
    //    call to the server (`sleep` for 10 s).
    let server = connect().await;
    let llm = Arc::new(
        ScriptedLlm::new()
            .rule(
                ScriptRule::agent("calc")
                    .on_user_containing("go")
                    .call("sleep", json!({"ms": 10_000})),
            )
            .rule(ScriptRule::agent("calc").on_tool_result().reply("{tool_result}")),
    );
    let mut builder = AgentSystem::builder()
        .llm(Arc::clone(&llm) as _)
        .agent(AgentSpec::new("calc"));
    for tool in server.tools().unwrap() {
        builder = builder.tool(tool);
    }
    drop(server);
    let system = builder.start().unwrap();
    let client = system.client();
    let ask = tokio::spawn(async move { client.ask("calc", "go").await });
    // The model asked for the tool: the call is on its way to the server.
    let deadline = tokio::time::Instant::now() + Duration::from_millis(EXIT_WAIT_MS);
    while llm.requests_of("calc").is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the agent's turn did not start");
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    tokio::time::sleep(Duration::from_millis(POLL_MS * 5)).await;
    assert_eq!(echo_children().len(), 1, "the system's tools hold the connection");
    drop(system);
    let answer = tokio::time::timeout(Duration::from_millis(EXIT_WAIT_MS), ask)
        .await
        .expect("the ask ends when its system is dropped")
        .unwrap();
    assert!(answer.is_err(), "the dropped system does not answer: {answer:?}");
    assert_no_child_within_wait("the system holding its tools was dropped mid-call").await;
}

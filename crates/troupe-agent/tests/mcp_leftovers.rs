//! MCP leftovers, as a demanding embedder meets them: a server that dies between calls
//! (a stdio process that exited, or was killed), one that cannot be started again, and
//! a server whose tool list holds one tool with a schema that does not compile.
//!
//! Goal: a dead server is started again at the next call (once, however many calls
//! find it dead at the same time), within `MCP_RECONNECT_ATTEMPTS_MAX` attempts, and
//! one that cannot be is a typed error naming it; one bad tool costs only itself.
//!
//! Method: the server is this crate's `troupe-mcp-echo` binary (`--mode
//! exit-after-call` exits after answering a call), or a shell script around it; the
//! model is scripted; `/proc` shows this process's children. Every wait is bounded.
//!
//! Run: `cargo nextest run -p troupe-agent --test mcp_leftovers`.

#![cfg(all(not(madsim), target_os = "linux"))]
// Real child processes are the point here; never simulated.
#![allow(clippy::disallowed_methods)]

#[path = "support/mcp_setup.rs"]
mod mcp_setup;

use std::sync::Arc;
use std::time::{Duration, Instant};

use mcp_setup::{wait_until_disconnected, CONNECT_TIMEOUT, ECHO_SERVER, EXIT_WAIT_MS, POLL_MS};
use serde_json::json;
use troupe_agent::{AgentSpec, AgentSystem, McpServer, ScriptRule, ScriptedLlm};

/// The pids of this process's live children (not zombies) whose command line holds
/// `marker`.
fn live_children_with(marker: &str) -> Vec<u32> {
    let me = std::process::id();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc is readable").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(close) = stat.rfind(')') else { continue };
        let mut rest = stat[close + 1..].split_whitespace();
        let (Some(state), Some(ppid)) = (rest.next(), rest.next()) else {
            continue;
        };
        if ppid.parse::<u32>() != Ok(me) || state == "Z" {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).replace('\0', " ").contains(marker) {
            found.push(pid);
        }
    }
    found
}

/// Waits (at most `EXIT_WAIT_MS`) until no live child with `marker` is left.
async fn wait_until_no_live_child(marker: &str, when: &str) {
    let deadline = Instant::now() + Duration::from_millis(EXIT_WAIT_MS);
    loop {
        let left = live_children_with(marker);
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{EXIT_WAIT_MS} ms after {when}, live children are left: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
}

/// Agents that call `add {a: 1, b: 2}` on "go", then reply with the result.
fn adding_agents() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("go")
                .call("add", json!({"a": 1, "b": 2})),
        )
        .rule(ScriptRule::any_agent().on_tool_result().reply("result: {tool_result}"))
}

fn system_with(server: &McpServer, agents: &[&str]) -> AgentSystem {
    let mut builder = AgentSystem::builder().llm(Arc::new(adding_agents()));
    for agent in agents {
        builder = builder.agent(AgentSpec::new(*agent));
    }
    for tool in server.tools().expect("the tools are offered") {
        builder = builder.tool(tool);
    }
    builder.start().expect("the system starts")
}

/// A stdio server that exits after each call it answers: every next call starts it
/// again and is answered (the process that answered it is gone each time). Before, every call after the
/// first failed ("the MCP server \"flaky\" is gone ...").
#[tokio::test]
async fn a_server_that_died_between_calls_is_started_again_at_the_next_call() {
    let marker = "exit-after-call";
    let server = McpServer::connect_stdio("flaky", ECHO_SERVER, ["--mode", marker], CONNECT_TIMEOUT)
        .await
        .expect("the echo server starts");
    let system = system_with(&server, &["calc"]);
    for attempt in 0..3 {
        let reply = system.ask("calc", "go").await.unwrap();
        assert_eq!(reply.text, "result: 3", "attempt {attempt}");
        wait_until_no_live_child(marker, "the server answered and exited").await;
        wait_until_disconnected(&server).await;
    }
    system.shutdown().await;
    drop(server);
}

/// The server is killed (SIGKILL) between calls; then four agents call it at once
/// (multi-threaded runtime): all four are answered, by one new process (the calls that
/// find it dead start it once). Before, all four failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_that_find_a_killed_server_at_once_start_it_again_once() {
    let server = McpServer::connect_stdio("echo", ECHO_SERVER, std::iter::empty::<&str>(), CONNECT_TIMEOUT)
        .await
        .expect("the echo server starts");
    let agents = ["a1", "a2", "a3", "a4"];
    let system = Arc::new(system_with(&server, &agents));
    assert_eq!(system.ask("a1", "go").await.unwrap().text, "result: 3");
    let first = live_children_with("troupe-mcp-echo");
    assert_eq!(first.len(), 1, "{first:?}");
    let killed = std::process::Command::new("kill")
        .args(["-9", &first[0].to_string()])
        .status()
        .expect("kill runs");
    assert!(killed.success());
    wait_until_no_live_child("troupe-mcp-echo", "the server was killed").await;
    wait_until_disconnected(&server).await;

    let asks = agents.map(|agent| {
        let system = system.clone();
        tokio::spawn(async move { system.ask(agent, "go").await })
    });
    for (agent, ask) in agents.iter().zip(asks) {
        let reply = ask.await.unwrap().unwrap();
        assert_eq!(reply.text, "result: 3", "{agent}");
    }
    let now = live_children_with("troupe-mcp-echo");
    assert_eq!(now.len(), 1, "one new process for all four calls: {now:?}");
    assert_ne!(now, first);
}

/// A server that starts once and then cannot be started again: the call after its
/// death is a tool failure naming the server and the attempts, within the bound of
/// `MCP_RECONNECT_ATTEMPTS_MAX` attempts and pauses, and `McpServer::reconnect` is the
/// typed `McpError::Reconnect`.
#[tokio::test]
async fn a_server_that_cannot_be_started_again_is_a_typed_error_naming_it() {
    let directory = tempfile::tempdir().unwrap();
    let mark = directory.path().join("started");
    let script = format!(
        "if [ -e '{mark}' ]; then exit 3; fi; : > '{mark}'; exec '{ECHO_SERVER}' --mode exit-after-call",
        mark = mark.display()
    );
    let server = McpServer::connect_stdio("once", "sh", ["-c", &script], CONNECT_TIMEOUT)
        .await
        .expect("the first start works");
    let system = system_with(&server, &["calc"]);
    assert_eq!(system.ask("calc", "go").await.unwrap().text, "result: 3");
    wait_until_no_live_child("exit-after-call", "the server answered and exited").await;
    wait_until_disconnected(&server).await;

    let started = Instant::now();
    let reply = system.ask("calc", "go").await.unwrap();
    let elapsed = started.elapsed();
    assert!(reply.text.starts_with("result: error: add failed: "), "{}", reply.text);
    for part in [
        "\"once\"".to_owned(),
        format!("{} attempts", troupe_agent::MCP_RECONNECT_ATTEMPTS_MAX),
    ] {
        assert!(reply.text.contains(&part), "{part:?} in {}", reply.text);
    }
    let bound = Duration::from_millis(
        troupe_agent::MCP_RECONNECT_PAUSE_MS * u64::from(troupe_agent::MCP_RECONNECT_ATTEMPTS_MAX) + 2_000,
    );
    assert!(elapsed < bound, "{elapsed:?}");

    let error = server.reconnect().await.unwrap_err();
    assert!(
        matches!(&error, troupe_agent::McpError::Reconnect { server, attempts, .. }
            if server == "once" && *attempts == troupe_agent::MCP_RECONNECT_ATTEMPTS_MAX),
        "{error:?}"
    );
    system.shutdown().await;
}

/// A server whose list holds one tool with a schema that does not compile: the other
/// tools are offered and work, the bad one is skipped and reported (its name and why).
/// Before, `tools()` failed for all of them (`InvalidToolSchema` "broken").
#[tokio::test]
async fn one_bad_schema_costs_only_its_own_tool() {
    let server = McpServer::connect_stdio("bad", ECHO_SERVER, ["--mode", "bad-schema"], CONNECT_TIMEOUT)
        .await
        .expect("the echo server starts");
    let tools = server.tools().expect("the good tools are offered");
    let names: Vec<String> = tools.iter().map(|tool| tool.spec().name.clone()).collect();
    assert!(names.contains(&"add".to_owned()), "{names:?}");
    assert!(!names.contains(&"broken".to_owned()), "{names:?}");
    assert_eq!(names.len(), server.tool_names().len() - 1, "{names:?}");
    let skipped = server.skipped_tools();
    assert!(
        matches!(skipped.as_slice(), [troupe_agent::McpError::InvalidToolSchema { tool, .. }] if tool == "broken"),
        "{skipped:?}"
    );
    let prefixed = server.tools_with_prefix("bad_").expect("the good tools are offered");
    assert_eq!(prefixed.len(), tools.len());

    let system = system_with(&server, &["calc"]);
    assert_eq!(system.ask("calc", "go").await.unwrap().text, "result: 3");
    system.shutdown().await;
}

/// A tool result whose message is over `MCP_MESSAGE_BYTES_MAX` (9 MiB and 16 MiB of
/// text): the call fails at once, naming the server and the limit, without the message
/// being held whole; the next call is answered (the server started again). Before, a
/// 9 MiB message was read and held whole (rmcp's own limit is 16 MiB), and one over
/// 16 MiB was dropped by rmcp while the call waited until its turn's deadline (a probe:
/// a 4 s ask ended as a timeout after 4 s).
#[tokio::test]
async fn a_message_over_the_limit_fails_the_call_at_once() {
    let server = McpServer::connect_stdio("huge", ECHO_SERVER, ["--mode", "huge"], CONNECT_TIMEOUT)
        .await
        .expect("the echo server starts");
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("calc")
                .on_user_containing("bigger")
                .call("huge", json!({"bytes": 16 * 1024 * 1024})),
        )
        .rule(
            ScriptRule::agent("calc")
                .on_user_containing("big")
                .call("huge", json!({"bytes": 9 * 1024 * 1024})),
        )
        .rule(
            ScriptRule::agent("calc")
                .on_user_containing("small")
                .call("huge", json!({"bytes": 3})),
        )
        .rule(
            ScriptRule::agent("calc")
                .on_tool_result()
                .reply("result: {tool_result}"),
        );
    let mut builder = AgentSystem::builder().llm(Arc::new(llm)).agent(AgentSpec::new("calc"));
    for tool in server.tools().unwrap() {
        builder = builder.tool(tool);
    }
    let system = builder.start().unwrap();
    let timeout = Duration::from_secs(10);

    for ask in ["big", "bigger"] {
        let started = Instant::now();
        let reply = system.ask_with_timeout("calc", ask, timeout).await;
        let elapsed = started.elapsed();
        let reply = reply.unwrap_or_else(|error| panic!("{ask}: {error:?} after {elapsed:?}"));
        assert!(
            reply.text.starts_with("result: error: huge failed: "),
            "{ask}: {}",
            troupe_core::truncate_utf8(&reply.text, 200)
        );
        for part in [
            "\"huge\"".to_owned(),
            format!("over {} bytes", troupe_agent::MCP_MESSAGE_BYTES_MAX),
        ] {
            assert!(reply.text.contains(&part), "{ask}: {part:?} in {}", reply.text);
        }
        assert!(elapsed < Duration::from_secs(3), "{ask}: {elapsed:?}");

        let reply = system.ask_with_timeout("calc", "small", timeout).await.unwrap();
        assert_eq!(reply.text, "result: xxx", "after {ask}");
    }
    system.shutdown().await;
    drop(server);
    wait_until_no_live_child("--mode huge", "the server was dropped").await;
}

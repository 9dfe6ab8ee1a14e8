//! An MCP server's tool list is read again when it changes: after the server was
//! started again (a restarted server may be a newer version, offering other tools), and
//! after it says so (`notifications/tools/list_changed`).
//!
//! Goal: a tool the server no longer lists fails its calls with a typed error naming it
//! (`McpError::ToolGone`'s text), without being sent; a tool new in the list is offered
//! by `McpServer::tools` and callable.
//!
//! Method: this crate's `troupe-mcp-echo` binary behind a shell script that starts
//! `--mode exit-after-call` the first time and `--mode upgraded` (no `add`, a new
//! `multiply`) after; and `--mode grows`, which lists `multiply` after its first `echo`
//! call and says so. Scripted models. Every wait is bounded.
//!
//! Run: `cargo nextest run -p troupe-agent --test mcp_tool_lists`.

#![cfg(all(not(madsim), target_os = "linux"))]
// Real child processes are the point here; never simulated.
#![allow(clippy::disallowed_methods)]

#[path = "support/mcp_setup.rs"]
mod mcp_setup;

use std::sync::Arc;
use std::time::Duration;

use mcp_setup::{
    calling_agents, upgrading_server, wait_until_disconnected, CONNECT_TIMEOUT, ECHO_SERVER, EXIT_WAIT_MS, POLL_MS,
};
use troupe_agent::{AgentSpec, AgentSystem, McpError, McpServer};

fn system_with(server: &McpServer) -> AgentSystem {
    let mut builder = AgentSystem::builder()
        .llm(Arc::new(calling_agents()))
        .agent(AgentSpec::new("calc"));
    for tool in server.tools().expect("the tools are offered") {
        builder = builder.tool(tool);
    }
    builder.start().expect("the system starts")
}

/// A server started again as a newer version: its list is read again; `add`, gone from
/// it, fails naming itself and the tools offered now (and is not sent); `multiply`,
/// new, is offered and callable. Before, the list read at first was kept:
/// `tool_names` still held `add` and not `multiply`, and `add` was sent to a server
/// that no longer knew it.
#[tokio::test]
async fn a_server_started_again_with_other_tools_offers_its_new_list() {
    let directory = tempfile::tempdir().unwrap();
    let server = upgrading_server("tools", directory.path()).await;
    assert_eq!(server.tool_names(), ["echo", "add", "sleep", "fail"]);
    let system = system_with(&server);
    assert_eq!(system.ask("calc", "add").await.unwrap().text, "result: 5");
    wait_until_disconnected(&server).await;

    // The next call starts it again: the upgraded server, without `add`.
    let reply = system.ask("calc", "add").await.unwrap();
    assert!(
        reply
            .text
            .starts_with("result: error: add failed: MCP server \"tools\" no longer offers tool \"add\""),
        "{}",
        reply.text
    );
    assert!(reply.text.contains("echo, sleep, fail, multiply"), "{}", reply.text);
    assert_eq!(server.tool_names(), ["echo", "sleep", "fail", "multiply"]);
    assert!(server.is_connected(), "the server was started again");

    // Its new tool, offered now, is callable.
    let offered: Vec<String> = server
        .tools()
        .unwrap()
        .iter()
        .map(|tool| tool.spec().name.clone())
        .collect();
    assert_eq!(offered, ["echo", "sleep", "fail", "multiply"]);
    let upgraded = system_with(&server);
    assert_eq!(upgraded.ask("calc", "multiply").await.unwrap().text, "result: 6");
    // An explicit reconnection reads the list again too.
    server.reconnect().await.unwrap();
    assert_eq!(server.tool_names(), ["echo", "sleep", "fail", "multiply"]);
    let gone = McpError::ToolGone {
        server: "tools".into(),
        tool: "add".into(),
        offered: server.tool_names(),
    };
    assert!(reply.text.ends_with(&gone.to_string()), "{}", reply.text);
    upgraded.shutdown().await;
    system.shutdown().await;
}

/// A server that says its tool list changed (`notifications/tools/list_changed`): the
/// next call reads the list again, and the new tool is offered and callable. Before,
/// the notification was dropped and `multiply` was never offered.
#[tokio::test]
async fn a_server_that_says_its_tools_changed_is_listed_again() {
    let server = McpServer::connect_stdio("growing", ECHO_SERVER, ["--mode", "grows"], CONNECT_TIMEOUT)
        .await
        .expect("the server starts");
    assert!(!server.tool_names().contains(&"multiply".to_owned()));
    let system = system_with(&server);
    assert_eq!(system.ask("calc", "echo").await.unwrap().text, "result: hi");
    // The list is read again at the next call (the notification may come just after
    // the answer): bounded.
    let mut waited = 0;
    while !server.tool_names().contains(&"multiply".to_owned()) {
        assert!(waited < EXIT_WAIT_MS, "multiply not listed: {:?}", server.tool_names());
        let _ = system.ask("calc", "echo").await.unwrap();
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        waited += POLL_MS;
    }
    let grown = system_with(&server);
    assert_eq!(grown.ask("calc", "multiply").await.unwrap().text, "result: 6");
    grown.shutdown().await;
    system.shutdown().await;
}

//! The edges of an attached MCP server's changing list (`AgentSystemBuilder::mcp_server`):
//! a list over `MCP_TOOLS_MAX`, and a new tool named as a built-in.
//!
//! Goal: a server whose new list holds more than `MCP_TOOLS_MAX` tools keeps its last
//! list offered and callable (refused, not read again at every call), and its next
//! change is read; a new tool named `call_agent` is refused (`ToolRegistryError::Clash`)
//! and `call_agent` stays the built-in.
//!
//! Method: a real rmcp server in-process, served over streamable HTTP on `127.0.0.1:0`
//! (rmcp's `StreamableHttpService` under axum; `ChangingServer` of
//! `support/mcp_setup.rs`): it lists `echo` and `set_extra`, and
//! `set_extra {names}` replaces its other tools with tools of those names, then says
//! its list changed (`notifications/tools/list_changed`) before it answers. Scripted
//! models. Every wait is bounded.
//!
//! Run: `cargo nextest run -p troupe-agent --test mcp_live_tool_limits`.

#![cfg(not(madsim))]
// A real HTTP server on loopback is the point here; never simulated.
#![allow(clippy::disallowed_methods)]

#[path = "support/mcp_setup.rs"]
mod mcp_setup;

use std::sync::Arc;

use mcp_setup::{attached_system, changing_server, wait_for};
use serde_json::json;
use troupe_agent::{ScriptRule, ScriptedLlm, ToolRegistryError, MCP_TOOLS_MAX};

/// A model whose agents call `set_extra` with the names after "set " in the user's
/// message (comma-separated), `echo` on "echo", and `call_agent` to "helper" on "ask";
/// then reply with the result. "helper" replies "helper here".
fn model() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(ScriptRule::agent("helper").reply("helper here"))
        .rule(ScriptRule::any_agent().on_tool_result().reply("result: {tool_result}"))
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("echo")
                .call("echo", json!({"text": "hi"})),
        )
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("ask")
                .call("call_agent", json!({"agent_id": "helper", "message": "hello"})),
        )
}

/// A model that calls `set_extra {names}` once, then replies with the result.
fn setting(names: &[String]) -> ScriptedLlm {
    model().rule(
        ScriptRule::any_agent()
            .on_user_containing("set")
            .call("set_extra", json!({ "names": names })),
    )
}

/// The server lists `MCP_TOOLS_MAX + 1` extra tools: the new list is refused (a
/// warning), the last one stays offered, and `echo` still answers; the next change (one
/// extra tool, `fresh`) is read and offered. Before, every call read the list again
/// and failed with `McpError::TooManyTools`: "echo failed: MCP server \"live\" offers
/// 259 tools, more than 256".
#[tokio::test]
async fn a_list_over_the_limit_is_refused_and_the_last_one_stays_callable() {
    let (server, _shutdown) = changing_server().await;
    let flood: Vec<String> = (0..=MCP_TOOLS_MAX).map(|index| format!("extra_{index}")).collect();
    let system = attached_system(Arc::new(setting(&flood)), &["calc"], &server);
    let before = system.tool_names();
    assert_eq!(system.ask("calc", "set").await.unwrap().text, "result: set");
    assert_eq!(system.ask("calc", "echo").await.unwrap().text, "result: hi");
    assert_eq!(system.ask("calc", "echo").await.unwrap().text, "result: hi");
    assert_eq!(system.tool_names(), before);
    assert_eq!(server.tool_names(), ["echo", "set_extra"]);
    system.shutdown().await;

    // The next change is read.
    let system = attached_system(Arc::new(setting(&["fresh".to_owned()])), &["calc"], &server);
    assert_eq!(system.ask("calc", "set").await.unwrap().text, "result: set");
    wait_for("fresh offered", || system.tool_names().contains(&"fresh".to_owned())).await;
    system.shutdown().await;
}

/// The server lists a new tool named `call_agent`: it is refused, naming the built-in;
/// the other new tool (`fresh`) is offered; `call_agent` still reaches the agent
/// "helper". Before, the list was fixed at start: `fresh` was never offered and
/// nothing was refused.
#[tokio::test]
async fn a_new_tool_named_as_a_built_in_is_refused_and_call_agent_stays_the_built_in() {
    let (server, _shutdown) = changing_server().await;
    let llm = Arc::new(setting(&["call_agent".to_owned(), "fresh".to_owned()]));
    let system = attached_system(llm, &["boss", "helper"], &server);
    assert_eq!(system.ask("boss", "set").await.unwrap().text, "result: set");
    wait_for("fresh offered", || system.tool_names().contains(&"fresh".to_owned())).await;
    assert_eq!(
        system.refused_tools(),
        [ToolRegistryError::Clash {
            name: "call_agent".into(),
            offered_by: "MCP server \"live\"".into(),
            taken_by: "a tool registered when the system was built (built-ins included)".into(),
        }]
    );
    let refused = system.refused_tools()[0].to_string();
    assert!(refused.contains("mcp_server_with_prefix"), "{refused}");
    assert_eq!(system.ask("boss", "ask").await.unwrap().text, "result: helper here");
    system.shutdown().await;
}

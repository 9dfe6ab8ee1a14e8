//! An MCP server attached to a running `AgentSystem` (`AgentSystemBuilder::mcp_server`):
//! the tools it lists later reach the agents without a restart.
//!
//! Goal: a tool new in the server's list (after `notifications/tools/list_changed`, or
//! a restart of the server) is offered at the next model step to the agents that may
//! use it (every agent whose spec lists no tools; not an agent limited to others) and
//! is callable; a tool it no longer lists leaves the list offered and fails with
//! `McpError::ToolGone`'s text; a new tool whose name is taken is refused
//! (`ToolRegistryError::Clash`), the tool that had the name keeps it; a step's list
//! is fixed for the step, while the next one offers the new list (multi-threaded).
//!
//! Method: this crate's `troupe-mcp-echo` binary (a real rmcp server in a child
//! process): `--mode grows` lists `multiply` after its first `echo` call and says so
//! before it answers; a shell script starts `--mode exit-after-call` first and
//! `--mode upgraded` (no `add`, a new `multiply`) after. Scripted models (one written
//! here that waits, inside a step, for the change). Every wait is bounded.
//!
//! Run: `cargo nextest run -p troupe-agent --test mcp_live_tools`.

#![cfg(all(not(madsim), target_os = "linux"))]
// Real child processes are the point here; never simulated.
#![allow(clippy::disallowed_methods)]

#[path = "support/mcp_setup.rs"]
mod mcp_setup;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use mcp_setup::{attached_system, calling_agents, upgrading_server, wait_for, CONNECT_TIMEOUT, ECHO_SERVER};
use serde_json::json;
use troupe_agent::{
    AgentSpec, AgentSystem, AgentSystemError, ChatMessage, LlmClient, LlmError, LlmReply, LlmRequest, McpError,
    McpServer, Role, ScriptedLlm, Tool, ToolCall, ToolRegistryError,
};

async fn growing_server() -> McpServer {
    McpServer::connect_stdio("growing", ECHO_SERVER, ["--mode", "grows"], CONNECT_TIMEOUT)
        .await
        .expect("the server starts")
}

/// The tool names of request `request`.
fn offered(request: &LlmRequest) -> Vec<String> {
    request.tools.iter().map(|tool| tool.name.clone()).collect()
}

/// The server grows `multiply` while the system runs: the agent with every tool is
/// offered it at its next step and calls it; the agent limited to `echo` is not offered
/// it and its call is refused. Before, the registry was fixed at start: `multiply` was
/// never offered, and a call of it was "unknown tool".
#[tokio::test]
async fn a_tool_new_in_an_attached_servers_list_is_offered_and_callable() {
    let server = growing_server().await;
    assert!(!server.tool_names().contains(&"multiply".to_owned()));
    let llm = Arc::new(calling_agents());
    let system = AgentSystem::builder()
        .llm(llm.clone())
        .agent(AgentSpec::new("calc"))
        .agent(AgentSpec::new("narrow").tools(["echo"]))
        .mcp_server(server.clone())
        .start()
        .expect("the system starts");
    assert_eq!(
        system.tool_names(),
        [
            "add",
            "call_agent",
            "delegate_to_agent",
            "echo",
            "fail",
            "notify_agent",
            "sleep"
        ]
    );
    assert_eq!(system.ask("calc", "echo").await.unwrap().text, "result: hi");
    // The server said so before it answered; the list is read on a task of its own.
    wait_for("multiply offered", || {
        system.tool_names().contains(&"multiply".to_owned())
    })
    .await;

    assert_eq!(system.ask("calc", "multiply").await.unwrap().text, "result: 6");
    let calc = llm.requests_of("calc");
    assert!(
        !offered(&calc[0]).contains(&"multiply".to_owned()),
        "{:?}",
        offered(&calc[0])
    );
    let last = offered(calc.last().unwrap());
    assert!(last.contains(&"multiply".to_owned()), "{last:?}");
    assert!(last.contains(&"call_agent".to_owned()), "{last:?}");

    // Not widened: "narrow" has `echo` only.
    let refused = system.ask("narrow", "multiply").await.unwrap().text;
    assert!(
        refused.starts_with("result: error: tool `multiply` is not available to agent narrow"),
        "{refused}"
    );
    for request in llm.requests_of("narrow") {
        assert_eq!(offered(&request), ["echo"]);
    }
    assert!(system.refused_tools().is_empty(), "{:?}", system.refused_tools());
    system.shutdown().await;
}

/// The server is started again as a newer version without `add`: `add` leaves the list
/// offered at the next step, `multiply` joins it, and a model that still calls `add`
/// reads `McpError::ToolGone`'s text. Before, `add` stayed offered and `multiply` was
/// never offered.
#[tokio::test]
async fn a_tool_gone_from_a_restarted_servers_list_leaves_the_offered_list() {
    let directory = tempfile::tempdir().unwrap();
    let server = upgrading_server("tools", directory.path()).await;
    let llm = Arc::new(calling_agents());
    let system = attached_system(llm.clone(), &["calc"], &server);
    assert_eq!(system.ask("calc", "add").await.unwrap().text, "result: 5");
    wait_for("disconnected", || !server.is_connected()).await;

    // The call starts it again (the upgraded server); the turn's next step offers its list.
    assert_eq!(system.ask("calc", "echo").await.unwrap().text, "result: hi");
    let after = offered(llm.requests_of("calc").last().unwrap());
    assert!(!after.contains(&"add".to_owned()), "{after:?}");
    assert!(after.contains(&"multiply".to_owned()), "{after:?}");
    assert!(!system.tool_names().contains(&"add".to_owned()));

    let reply = system.ask("calc", "add").await.unwrap().text;
    let gone = McpError::ToolGone {
        server: "tools".into(),
        tool: "add".into(),
        offered: server.tool_names(),
    };
    assert_eq!(reply, format!("result: error: add failed: {gone}"));
    assert_eq!(system.ask("calc", "multiply").await.unwrap().text, "result: 6");
    system.shutdown().await;
}

/// Names that clash: at start, a server's tool named as a tool given to the builder
/// stops the start (`Duplicate`); later, a new tool whose name is taken is not offered
/// (`refused_tools` names it, its server and what has the name) and the tool that had
/// the name still answers. Before, there was no live list to clash in: `refused_tools`
/// stayed empty.
#[tokio::test]
async fn a_new_tool_whose_name_is_taken_is_refused_and_the_owner_keeps_it() {
    let clashing = growing_server().await;
    let echo = Tool::from_fn(
        "echo",
        "A fixed echo.",
        json!({"type": "object"}),
        |_context, _arguments| async { Ok("fixed".to_owned()) },
    );
    let error = AgentSystem::builder()
        .llm(Arc::new(ScriptedLlm::new()))
        .tool(echo)
        .mcp_server(clashing)
        .start()
        .expect_err("a clash at start is refused");
    assert_eq!(
        error,
        AgentSystemError::Tool(ToolRegistryError::Duplicate { name: "echo".into() })
    );

    let server = growing_server().await;
    let multiply = Tool::from_fn(
        "multiply",
        "A fixed multiply.",
        json!({"type": "object"}),
        |_context, _arguments| async { Ok("fixed".to_owned()) },
    );
    let system = AgentSystem::builder()
        .llm(Arc::new(calling_agents()))
        .agent(AgentSpec::new("calc"))
        .tool(multiply)
        .mcp_server(server.clone())
        .start()
        .expect("the system starts");
    assert_eq!(system.ask("calc", "echo").await.unwrap().text, "result: hi");
    wait_for("multiply refused", || !system.refused_tools().is_empty()).await;
    assert_eq!(
        system.refused_tools(),
        [ToolRegistryError::Clash {
            name: "multiply".into(),
            offered_by: "MCP server \"growing\"".into(),
            taken_by: "a tool registered when the system was built (built-ins included)".into(),
        }]
    );
    assert!(server.tool_names().contains(&"multiply".to_owned()));
    assert_eq!(system.ask("calc", "multiply").await.unwrap().text, "result: fixed");
    system.shutdown().await;
}

/// A model that, in one turn: step 1 calls `echo` (the server grows `multiply` and
/// says so); step 2 waits inside its model call until this process has read the new
/// list, then calls `echo` again; step 3 calls `multiply`; step 4 answers with its
/// result. It records each step's tool names.
struct StepModel {
    server: McpServer,
    steps: AtomicUsize,
    offered: Mutex<Vec<Vec<String>>>,
}

#[async_trait]
impl LlmClient for StepModel {
    async fn complete(&self, request: LlmRequest) -> Result<LlmReply, LlmError> {
        self.offered.lock().unwrap().push(offered(&request));
        let step = self.steps.fetch_add(1, Ordering::SeqCst) + 1;
        let call = |name: &str, arguments: serde_json::Value| {
            let mut message = ChatMessage::new(Role::Assistant, "");
            message.tool_calls.push(ToolCall {
                id: format!("call-{step}"),
                name: name.to_owned(),
                arguments,
            });
            Ok(LlmReply::new(message))
        };
        match step {
            1 => call("echo", json!({"text": "one"})),
            2 => {
                // The list changes while this step runs.
                wait_for("multiply listed", || {
                    self.server.tool_names().contains(&"multiply".to_owned())
                })
                .await;
                call("echo", json!({"text": "two"}))
            }
            3 => call("multiply", json!({"a": 6, "b": 7})),
            _ => {
                let last = request.messages.last().map(|message| message.content.clone());
                Ok(LlmReply::new(ChatMessage::new(
                    Role::Assistant,
                    last.unwrap_or_default(),
                )))
            }
        }
    }
}

/// A step's list is the one read when the step started, while the list changes during
/// the turn: step 1 is offered no `multiply`; once the process has read the new list
/// (during step 2's model call), step 3 is offered it and calls it. On the
/// multi-threaded runtime. Before, every step of every turn offered the list fixed at
/// start: step 3 had no `multiply`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_running_while_the_list_changes_keeps_its_list_and_the_next_offers_the_new() {
    let server = growing_server().await;
    let model = Arc::new(StepModel {
        server: server.clone(),
        steps: AtomicUsize::new(0),
        offered: Mutex::new(Vec::new()),
    });
    let system = attached_system(model.clone(), &["calc"], &server);
    let reply = system.ask("calc", "go").await.unwrap();
    assert_eq!(reply.text, "42");
    assert_eq!(reply.steps, 4);
    let offered = model.offered.lock().unwrap().clone();
    let multiply = "multiply".to_owned();
    assert!(!offered[0].contains(&multiply), "{:?}", offered[0]);
    assert!(offered[2].contains(&multiply), "{:?}", offered[2]);
    assert!(offered[3].contains(&multiply), "{:?}", offered[3]);
    system.shutdown().await;
}

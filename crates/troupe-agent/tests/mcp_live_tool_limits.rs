//! The edges of an attached MCP server's changing list (`AgentSystemBuilder::mcp_server`):
//! a list over `MCP_TOOLS_MAX`, and a new tool named as a built-in.
//!
//! Goal: a server whose new list holds more than `MCP_TOOLS_MAX` tools keeps its last
//! list offered and callable (refused, not read again at every call), and its next
//! change is read; a new tool named `call_agent` is refused (`ToolRegistryError::Clash`)
//! and `call_agent` stays the built-in.
//!
//! Method: a real rmcp server in-process, served over streamable HTTP on `127.0.0.1:0`
//! (rmcp's `StreamableHttpService` under axum): it lists `echo` and `set_extra`, and
//! `set_extra {names}` replaces its other tools with tools of those names, then says
//! its list changed (`notifications/tools/list_changed`) before it answers. Scripted
//! models. Every wait is bounded.
//!
//! Run: `cargo nextest run -p troupe-agent --test mcp_live_tool_limits`.

#![cfg(not(madsim))]
// A real HTTP server on loopback is the point here; never simulated.
#![allow(clippy::disallowed_methods)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::ServerHandler;
use serde_json::{json, Value};
use troupe_agent::{AgentSpec, AgentSystem, McpServer, ScriptRule, ScriptedLlm, ToolRegistryError, MCP_TOOLS_MAX};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a change may take to be seen, in milliseconds.
const CHANGE_WAIT_MS: u64 = 5_000;
/// How often the test looks meanwhile, in milliseconds.
const POLL_MS: u64 = 20;

fn object(value: Value) -> serde_json::Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => unreachable!("every schema here is an object"),
    }
}

/// Lists `echo`, `set_extra` and the extra tools `set_extra` last named (each answers
/// `called NAME`).
#[derive(Clone, Default)]
struct ChangingServer {
    extra: Arc<Mutex<Vec<String>>>,
}

impl ServerHandler for ChangingServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let mut tools = vec![
            rmcp::model::Tool::new(
                "echo",
                "Returns the text it is given.",
                object(json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})),
            ),
            rmcp::model::Tool::new(
                "set_extra",
                "Replaces the extra tools.",
                object(json!({"type": "object",
                              "properties": {"names": {"type": "array", "items": {"type": "string"}}},
                              "required": ["names"]})),
            ),
        ];
        for name in self.extra.lock().unwrap().iter() {
            tools.push(rmcp::model::Tool::new(
                name.clone(),
                "An extra tool.",
                object(json!({"type": "object"})),
            ));
        }
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let arguments = Value::Object(request.arguments.unwrap_or_default());
        let text = |value: String| Ok(CallToolResult::success(vec![ContentBlock::text(value)]).into());
        match request.name.as_ref() {
            "echo" => text(arguments["text"].as_str().unwrap_or_default().to_owned()),
            "set_extra" => {
                let names: Vec<String> = serde_json::from_value(arguments["names"].clone()).unwrap_or_default();
                *self.extra.lock().unwrap() = names;
                // Said before the answer, as `troupe-mcp-echo --mode grows` does.
                let _ = context.peer.notify_tool_list_changed().await;
                text("set".to_owned())
            }
            other => text(format!("called {other}")),
        }
    }
}

/// Stops the HTTP server when dropped.
struct Shutdown(tokio::task::JoinHandle<()>);

impl Drop for Shutdown {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves a [`ChangingServer`] over streamable HTTP on loopback; connects to it.
async fn changing_server() -> (McpServer, Shutdown) {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};

    let served = ChangingServer::default();
    let service: StreamableHttpService<ChangingServer, LocalSessionManager> = StreamableHttpService::new(
        move || Ok(served.clone()),
        Default::default(),
        StreamableHttpServerConfig::default(),
    );
    let router = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let server = McpServer::connect_http("live", &format!("http://{address}/mcp"), CONNECT_TIMEOUT)
        .await
        .expect("the server connects");
    (server, Shutdown(task))
}

/// Waits (bounded) until `done` holds.
async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let mut waited = 0;
    while !done() {
        assert!(waited < CHANGE_WAIT_MS, "{CHANGE_WAIT_MS} ms on, still not {what}");
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        waited += POLL_MS;
    }
}

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
    let system = AgentSystem::builder()
        .llm(Arc::new(setting(&flood)))
        .agent(AgentSpec::new("calc"))
        .mcp_server(server.clone())
        .start()
        .expect("the system starts");
    let before = system.tool_names();
    assert_eq!(system.ask("calc", "set").await.unwrap().text, "result: set");
    assert_eq!(system.ask("calc", "echo").await.unwrap().text, "result: hi");
    assert_eq!(system.ask("calc", "echo").await.unwrap().text, "result: hi");
    assert_eq!(system.tool_names(), before);
    assert_eq!(server.tool_names(), ["echo", "set_extra"]);
    system.shutdown().await;

    // The next change is read.
    let system = AgentSystem::builder()
        .llm(Arc::new(setting(&["fresh".to_owned()])))
        .agent(AgentSpec::new("calc"))
        .mcp_server(server.clone())
        .start()
        .expect("the system starts");
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
    let system = AgentSystem::builder()
        .llm(Arc::new(setting(&["call_agent".to_owned(), "fresh".to_owned()])))
        .agent(AgentSpec::new("boss"))
        .agent(AgentSpec::new("helper"))
        .mcp_server(server.clone())
        .start()
        .expect("the system starts");
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

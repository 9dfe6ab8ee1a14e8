//! What the MCP tests share: the `troupe-mcp-echo` binary and the bounds of their
//! waits, the scripted agents that call the echo server's tools, a bounded wait for a
//! condition, a server's disconnection, and a real rmcp server in-process over streamable HTTP on loopback
//! ([`serve_http`]; [`ChangingServer`], whose list changes on command).
//!
//! Included by the test files with `#[path = "support/mcp_setup.rs"] mod mcp_setup;`.

#![allow(dead_code)] // each test file uses part of it

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::ServerHandler;
use serde_json::{json, Value};
use troupe_agent::{AgentSpec, AgentSystem, LlmClient, McpServer, ScriptRule, ScriptedLlm};

/// This crate's test MCP server (a real rmcp server on stdio).
pub(crate) const ECHO_SERVER: &str = env!("CARGO_BIN_EXE_troupe-mcp-echo");
/// The connect timeout the tests give.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a change may take to be seen, in milliseconds.
pub(crate) const CHANGE_WAIT_MS: u64 = 5_000;
/// How long a server gets to be seen gone, in milliseconds.
pub(crate) const EXIT_WAIT_MS: u64 = 5_000;
/// How often a test looks meanwhile, in milliseconds.
pub(crate) const POLL_MS: u64 = 20;

/// Agents that call `add {a: 2, b: 3}` on "add", `multiply` on "multiply", `echo` on
/// "echo", then reply with the result.
pub(crate) fn calling_agents() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(ScriptRule::any_agent().on_tool_result().reply("result: {tool_result}"))
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("add")
                .call("add", json!({"a": 2, "b": 3})),
        )
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("multiply")
                .call("multiply", json!({"a": 2, "b": 3})),
        )
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("echo")
                .call("echo", json!({"text": "hi"})),
        )
}

/// Agents that make `ChangingServer` list `fresh` on "grow" and nothing extra on
/// "shrink", call `fresh` on "use fresh", and reply "hello" to anything else; after a
/// tool, they reply with its result.
pub(crate) fn growing_agents() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(ScriptRule::any_agent().on_tool_result().reply("result: {tool_result}"))
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("grow")
                .call("set_extra", json!({"names": ["fresh"]})),
        )
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("shrink")
                .call("set_extra", json!({"names": []})),
        )
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("use fresh")
                .call("fresh", json!({})),
        )
        .rule(ScriptRule::any_agent().reply("hello"))
}

/// An agent `calc` that calls `tool` with `arguments` on "go", then replies with the
/// result.
pub(crate) fn calling_agent(tool: &str, arguments: Value) -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(ScriptRule::agent("calc").on_user_containing("go").call(tool, arguments))
        .rule(
            ScriptRule::agent("calc")
                .on_tool_result()
                .reply("result: {tool_result}"),
        )
}

/// A system of `agents` (each with every tool) on `llm`, `server` attached
/// (`AgentSystemBuilder::mcp_server`).
pub(crate) fn attached_system(llm: Arc<dyn LlmClient>, agents: &[&str], server: &McpServer) -> AgentSystem {
    let mut builder = AgentSystem::builder().llm(llm).mcp_server(server.clone());
    for agent in agents {
        builder = builder.agent(AgentSpec::new(*agent));
    }
    builder.start().expect("the system starts")
}

/// A shell script that counts its starts in `{directory}/starts` (one byte a start)
/// and runs `first` the first time, `later` after (each a shell command).
pub(crate) fn counting_script(directory: &std::path::Path, first: &str, later: &str) -> String {
    let starts = directory.join("starts");
    format!(
        "printf x >> '{starts}'; if [ \"$(wc -c < '{starts}')\" -gt 1 ]; then {later}; fi; {first}",
        starts = starts.display()
    )
}

/// How many times the script of [`counting_script`] started.
pub(crate) fn starts(directory: &std::path::Path) -> usize {
    std::fs::read(directory.join("starts")).map_or(0, |bytes| bytes.len())
}

/// `troupe-mcp-echo` as `name`, behind a [`counting_script`] in `directory`: `--mode
/// exit-after-call` the first time (it exits after its first call), `--mode upgraded`
/// (no `add`, a new `multiply`) each time after.
pub(crate) async fn upgrading_server(name: &str, directory: &std::path::Path) -> McpServer {
    let script = counting_script(
        directory,
        &format!("exec '{ECHO_SERVER}' --mode exit-after-call"),
        &format!("exec '{ECHO_SERVER}' --mode upgraded"),
    );
    McpServer::connect_stdio(name, "sh", ["-c", &script], CONNECT_TIMEOUT)
        .await
        .expect("the first start works")
}

/// Waits (bounded by [`CHANGE_WAIT_MS`]) until `done` holds.
pub(crate) async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let mut waited = 0;
    while !done() {
        assert!(waited < CHANGE_WAIT_MS, "{CHANGE_WAIT_MS} ms on, still not {what}");
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        waited += POLL_MS;
    }
}

/// Waits (bounded by [`EXIT_WAIT_MS`]) until `server` looks disconnected.
pub(crate) async fn wait_until_disconnected(server: &McpServer) {
    let mut waited = 0;
    while server.is_connected() {
        assert!(
            waited < EXIT_WAIT_MS,
            "{EXIT_WAIT_MS} ms on, the server still looks connected"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        waited += POLL_MS;
    }
}

/// A JSON object (every schema here is one).
pub(crate) fn object(value: Value) -> serde_json::Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => unreachable!("every schema here is an object"),
    }
}

/// Stops the HTTP server when dropped.
pub(crate) struct Shutdown(pub(crate) tokio::task::JoinHandle<()>);

impl Shutdown {
    /// Stops the HTTP server now and waits until its task has ended.
    pub(crate) async fn stop(mut self) {
        self.0.abort();
        let _ = (&mut self.0).await;
    }
}

impl Drop for Shutdown {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves `handler` (a clone per session) over streamable HTTP on `127.0.0.1:0`, under
/// rmcp's `StreamableHttpService` and axum; returns the endpoint's URL.
pub(crate) async fn serve_http<H>(handler: H) -> (String, Shutdown)
where
    H: ServerHandler + Clone + Send + Sync + 'static,
{
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};

    let service: StreamableHttpService<H, LocalSessionManager> = StreamableHttpService::new(
        move || Ok(handler.clone()),
        Default::default(),
        StreamableHttpServerConfig::default(),
    );
    let router = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    (format!("http://{address}/mcp"), Shutdown(task))
}

/// Lists `echo`, `set_extra` and the extra tools `set_extra` last named (each answers
/// `called NAME`).
#[derive(Clone, Default)]
pub(crate) struct ChangingServer {
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

/// Serves a [`ChangingServer`] over streamable HTTP on loopback and connects to it as
/// `live`.
pub(crate) async fn changing_server() -> (McpServer, Shutdown) {
    let (url, shutdown) = serve_http(ChangingServer::default()).await;
    let server = McpServer::connect_http("live", &url, CONNECT_TIMEOUT)
        .await
        .expect("the server connects");
    (server, shutdown)
}

//! `McpServer`: the tools of a real MCP server (rmcp) as Troupe tools.
//!
//! Goal: show that a server started as a child process (stdio) and one reached over
//! streamable HTTP list their tools with names, descriptions and schemas; that an agent
//! calls them end to end through `AgentSystem` (arguments validated against the
//! server's schema first); that an error result reaches the model as a tool error; that
//! a slow tool is bounded by the turn's deadline and the connection stays usable; and
//! that connecting fails with typed errors (no such program, nobody listening).
//!
//! Method: the stdio server is this crate's `troupe-mcp-echo` binary
//! (`src/bin/troupe-mcp-echo`); the HTTP server serves the same tools in-process with
//! rmcp's `StreamableHttpService` under axum on `127.0.0.1:0`. The model is scripted.
//!
//! Run: `cargo nextest run -p troupe-agent --test mcp_tools`.

#![cfg(not(madsim))]
// Wall-clock timing of a real child process is the point here; never simulated.
#![allow(clippy::disallowed_methods)]

#[path = "../src/bin/troupe-mcp-echo/echo.rs"]
mod echo;
#[path = "support/mcp_setup.rs"]
mod mcp_setup;

use std::sync::Arc;
use std::time::{Duration, Instant};

use mcp_setup::{calling_agent, serve_http, CONNECT_TIMEOUT, ECHO_SERVER};
use serde_json::json;
use troupe_agent::{AgentCallError, AgentSpec, AgentSystem, McpError, McpServer, ScriptRule, ScriptedLlm};
/// How much later than its deadline a turn may end.
const DEADLINE_SLACK_MS_MAX: u64 = 1_500;

async fn stdio_server() -> McpServer {
    McpServer::connect_stdio("echo", ECHO_SERVER, std::iter::empty::<&str>(), CONNECT_TIMEOUT)
        .await
        .expect("the echo server starts")
}

#[tokio::test]
async fn stdio_server_lists_its_tools_with_descriptions_and_schemas() {
    let server = stdio_server().await;

    assert_eq!(server.tool_names(), vec!["echo", "add", "sleep", "fail"]);
    let tools = server.tools().unwrap();
    let add = tools.iter().find(|tool| tool.spec().name == "add").unwrap();
    assert_eq!(add.spec().description, "Adds two integers.");
    assert_eq!(
        add.spec().parameters,
        json!({"type": "object",
               "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
               "required": ["a", "b"]})
    );
    let prefixed = server.tools_with_prefix("echo_").unwrap();
    let names: Vec<&str> = prefixed.iter().map(|tool| tool.spec().name.as_str()).collect();
    assert_eq!(names, vec!["echo_echo", "echo_add", "echo_sleep", "echo_fail"]);
}

#[tokio::test]
async fn an_agent_calls_a_stdio_mcp_tool_end_to_end() {
    let server = stdio_server().await;
    let llm = Arc::new(calling_agent("add", json!({"a": 40, "b": 2})));
    let mut builder = AgentSystem::builder().llm(llm.clone()).agent(AgentSpec::new("calc"));
    for tool in server.tools().unwrap() {
        builder = builder.tool(tool);
    }
    let system = builder.start().unwrap();

    let reply = system.ask("calc", "go").await.unwrap();

    assert_eq!(reply.text, "result: 42");
    assert_eq!(llm.tool_results_seen_by("calc"), vec!["42".to_owned()]);
    system.shutdown().await;
}

#[tokio::test]
async fn schema_violations_and_error_results_reach_the_model_as_tool_errors() {
    let server = stdio_server().await;
    let llm = Arc::new(
        ScriptedLlm::new()
            .rule(
                ScriptRule::agent("calc")
                    .on_user_containing("bad")
                    .call("add", json!({"a": "forty"})),
            )
            .rule(
                ScriptRule::agent("calc")
                    .on_user_containing("fail")
                    .call("fail", json!({})),
            )
            .rule(
                ScriptRule::agent("calc")
                    .on_tool_result()
                    .reply("result: {tool_result}"),
            ),
    );
    let mut builder = AgentSystem::builder().llm(llm.clone()).agent(AgentSpec::new("calc"));
    for tool in server.tools().unwrap() {
        builder = builder.tool(tool);
    }
    let system = builder.start().unwrap();

    let bad = system.ask("calc", "bad").await.unwrap();
    assert_eq!(
        bad.text,
        r#"result: error: invalid arguments for add: $: "b" is a required property; $.a: "forty" is not of type "integer""#
    );
    let failed = system.ask("calc", "fail").await.unwrap();
    assert_eq!(failed.text, "result: error: fail failed: this tool always fails");
    system.shutdown().await;
}

/// A tool slower than the turn: the turn ends at its deadline (not when the tool would
/// have finished), and the server still answers the next call.
#[tokio::test]
async fn a_slow_mcp_tool_is_bounded_by_the_turns_deadline() {
    let server = stdio_server().await;
    let llm = Arc::new(calling_agent("sleep", json!({"ms": 10_000})));
    let mut builder = AgentSystem::builder().llm(llm).agent(AgentSpec::new("calc"));
    for tool in server.tools().unwrap() {
        builder = builder.tool(tool);
    }
    let system = builder.start().unwrap();
    let timeout = Duration::from_millis(500);

    let started = Instant::now();
    let result = system.ask_with_timeout("calc", "go", timeout).await;
    let elapsed = started.elapsed();

    assert!(
        elapsed <= timeout + Duration::from_millis(DEADLINE_SLACK_MS_MAX),
        "the turn outlived its deadline: {elapsed:?}"
    );
    match result {
        // The turn timed out while the tool ran.
        Err(AgentCallError::Invoke(_)) => {}
        // Or the tool's DeadlineExceeded reached the model in the turn's last instant.
        Ok(reply) => assert_eq!(
            reply.text,
            "result: error: sleep did not finish before the turn's deadline"
        ),
        Err(other) => panic!("unexpected error {other:?}"),
    }
    system.shutdown().await;

    // The connection survived the cancelled call.
    let echo = server.tools().unwrap();
    let llm = Arc::new(calling_agent("echo", json!({"text": "still here"})));
    let mut builder = AgentSystem::builder().llm(llm).agent(AgentSpec::new("calc"));
    for tool in echo {
        builder = builder.tool(tool);
    }
    let system = builder.start().unwrap();
    assert_eq!(system.ask("calc", "go").await.unwrap().text, "result: still here");
    system.shutdown().await;
}

#[tokio::test]
async fn a_missing_program_is_a_spawn_error() {
    let error = McpServer::connect_stdio(
        "ghost",
        "/nonexistent/troupe-no-such-mcp-server",
        std::iter::empty::<&str>(),
        CONNECT_TIMEOUT,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&error, McpError::Spawn { server, .. } if server == "ghost"),
        "{error:?}"
    );
}

/// A program that never speaks MCP (it reads stdin forever) times out.
#[tokio::test]
async fn a_silent_program_times_out() {
    let started = Instant::now();
    let error = McpServer::connect_stdio("cat", "cat", std::iter::empty::<&str>(), Duration::from_millis(300))
        .await
        .unwrap_err();
    assert_eq!(
        error,
        McpError::Timeout {
            server: "cat".to_owned(),
            timeout_ms: 300
        }
    );
    assert!(started.elapsed() < Duration::from_millis(300 + DEADLINE_SLACK_MS_MAX));
}

#[tokio::test]
async fn an_agent_calls_a_streamable_http_mcp_tool_end_to_end() {
    let (url, _shutdown) = serve_http(echo::EchoServer).await;
    let server = McpServer::connect_http("echo-http", &url, CONNECT_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(server.tool_names(), vec!["echo", "add", "sleep", "fail"]);

    let llm = Arc::new(calling_agent("echo", json!({"text": "over http"})));
    let mut builder = AgentSystem::builder().llm(llm).agent(AgentSpec::new("calc"));
    for tool in server.tools().unwrap() {
        builder = builder.tool(tool);
    }
    let system = builder.start().unwrap();

    assert_eq!(system.ask("calc", "go").await.unwrap().text, "result: over http");
    system.shutdown().await;
}

#[tokio::test]
async fn nobody_listening_over_http_is_a_connect_error() {
    let address = {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        listener.local_addr().unwrap()
    };
    let error = McpServer::connect_http("gone", &format!("http://{address}/mcp"), CONNECT_TIMEOUT)
        .await
        .unwrap_err();
    assert!(
        matches!(&error, McpError::Connect { server, .. } if server == "gone"),
        "{error:?}"
    );
}

/// Goal: MCP tools are selected per agent by name like any other tool. Method: `calc`
/// may use only the server's `add`; it is offered only `add`, and its call of the
/// server's `echo` is refused before reaching the server.
#[tokio::test]
async fn an_agent_limited_to_one_mcp_tool_is_offered_only_it() {
    let server = stdio_server().await;
    let llm = Arc::new(calling_agent("echo", json!({"text": "hi"})));
    let mut builder = AgentSystem::builder()
        .llm(llm.clone())
        .agent(AgentSpec::new("calc").tools(["add"]));
    for tool in server.tools().unwrap() {
        builder = builder.tool(tool);
    }
    let system = builder.start().unwrap();

    let reply = system.ask("calc", "go").await.unwrap();

    assert_eq!(
        reply.text,
        "result: error: tool `echo` is not available to agent calc; its tools are: add"
    );
    let offered: Vec<String> = llm.requests()[0].tools.iter().map(|tool| tool.name.clone()).collect();
    assert_eq!(offered, vec!["add"]);
    system.shutdown().await;
}

/// An MCP server whose `tools/list` never ends: every page holds one tool and names a
/// next page. Counts the pages it served.
#[derive(Clone, Default)]
struct EndlessPages(Arc<std::sync::atomic::AtomicUsize>);

impl rmcp::ServerHandler for EndlessPages {
    fn get_info(&self) -> rmcp::model::ServerConfig {
        rmcp::model::ServerConfig::new(rmcp::model::ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<rmcp::model::PaginatedRequestParams>,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::ListToolsResult, rmcp::model::ErrorData> {
        let page = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tool = rmcp::model::Tool::new(
            format!("tool_{page}"),
            "One more tool.",
            serde_json::Map::from_iter([("type".to_owned(), json!("object"))]),
        );
        let mut result = rmcp::model::ListToolsResult::with_all_items(vec![tool]);
        result.next_cursor = Some((page + 1).to_string());
        Ok(result)
    }
}

/// Goal: a server that keeps naming a next page of tools is refused with
/// `TooManyTools` once it has listed more than `MCP_TOOLS_MAX`, not paged (and kept in
/// memory) until the connect timeout. Method: the server above over streamable HTTP,
/// a connect timeout of 20 s; the refusal must come with at most `MCP_TOOLS_MAX + 1`
/// pages read and well before the timeout.
#[tokio::test]
async fn a_server_listing_tools_without_end_is_refused_at_the_tool_limit() {
    let handler = EndlessPages::default();
    let pages = Arc::clone(&handler.0);
    let (url, _shutdown) = serve_http(handler).await;

    let started = Instant::now();
    let error = McpServer::connect_http("endless", &url, CONNECT_TIMEOUT)
        .await
        .unwrap_err();
    let read = pages.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        matches!(&error, McpError::TooManyTools { server, count } if server == "endless" && *count > troupe_agent::MCP_TOOLS_MAX),
        "{error:?} after {read} pages in {:?}",
        started.elapsed()
    );
    assert!(read <= troupe_agent::MCP_TOOLS_MAX + 1, "{read} pages read");
    assert!(started.elapsed() < CONNECT_TIMEOUT / 2, "{:?}", started.elapsed());
}

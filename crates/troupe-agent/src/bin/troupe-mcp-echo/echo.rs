//! The echo server's tools (also served over streamable HTTP by the `mcp_tools` test).

use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::ServerHandler;
use serde_json::{json, Value};

/// The longest `sleep` the server accepts, in milliseconds.
const SLEEP_MS_MAX: u64 = 60_000;

/// A stateless MCP server with four tools.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct EchoServer;

fn schema(value: Value) -> serde_json::Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => unreachable!("every schema here is an object"),
    }
}

fn tools() -> Vec<Tool> {
    vec![
        Tool::new(
            "echo",
            "Returns the text it is given.",
            schema(json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})),
        ),
        Tool::new(
            "add",
            "Adds two integers.",
            schema(json!({"type": "object",
                          "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                          "required": ["a", "b"]})),
        ),
        Tool::new(
            "sleep",
            "Waits `ms` milliseconds, then answers.",
            schema(json!({"type": "object",
                          "properties": {"ms": {"type": "integer", "minimum": 0, "maximum": SLEEP_MS_MAX}},
                          "required": ["ms"]})),
        ),
        Tool::new(
            "fail",
            "Always fails.",
            schema(json!({"type": "object", "properties": {}})),
        ),
    ]
}

impl ServerHandler for EchoServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(tools()))
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
            "add" => {
                let a = arguments["a"].as_i64().unwrap_or_default();
                let b = arguments["b"].as_i64().unwrap_or_default();
                text(a.saturating_add(b).to_string())
            }
            "sleep" => {
                let ms = arguments["ms"].as_u64().unwrap_or_default().min(SLEEP_MS_MAX);
                // A cancelled call (`notifications/cancelled`) stops sleeping at once.
                match context
                    .ct
                    .run_until_cancelled(tokio::time::sleep(Duration::from_millis(ms)))
                    .await
                {
                    Some(()) => text(format!("slept {ms} ms")),
                    None => Err(ErrorData::internal_error("cancelled", None)),
                }
            }
            "fail" => Ok(CallToolResult::error(vec![ContentBlock::text("this tool always fails")]).into()),
            other => Err(ErrorData::invalid_params(format!("no tool named {other}"), None)),
        }
    }
}

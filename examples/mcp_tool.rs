//! An agent using a tool from an MCP (Model Context Protocol) server. `McpServer`
//! starts the server as a child process, speaks MCP with it over stdin/stdout (the
//! official `rmcp` SDK), lists its tools and turns each into a Troupe `Tool`: the model
//! sees the server's name, description and JSON schema, arguments are validated
//! against that schema, and a call is bounded by the turn's deadline like any tool.
//! Attached with `AgentSystemBuilder::mcp_server`, the server's list is followed while
//! the system runs (docs/mcp.md).
//! `McpServer::connect_http` does the same for a streamable-HTTP endpoint.
//!
//! So the example needs nothing installed, the server is this same program run with
//! `--serve-mcp`: a one-tool MCP server (`word_count`) written with `rmcp`. The model
//! is scripted (deterministic, no API key): it calls `word_count`, then answers with
//! the result.
//!
//! Run it with `cargo run --example mcp_tool`. It prints the server's tools, and the
//! agent's answer.

#[cfg(not(madsim))]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    use std::sync::Arc;
    use std::time::Duration;

    use troupe::agent::{AgentSpec, AgentSystem, McpServer, ScriptRule, ScriptedLlm};
    use troupe::json;

    if std::env::args().any(|argument| argument == "--serve-mcp") {
        return server::serve().await;
    }

    let program = std::env::current_exe()?;
    let server = McpServer::connect_stdio("text-tools", program, ["--serve-mcp"], Duration::from_secs(10)).await?;
    println!("MCP server {:?} offers {:?}", server.name(), server.tool_names());

    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("editor")
                .on_user_containing("How many words")
                .call("word_count", json!({"text": "the quick brown fox jumps"})),
        )
        .rule(
            ScriptRule::agent("editor")
                .on_tool_result()
                .reply("That sentence has {tool_result} words."),
        );
    // Attached, not copied: the agents follow the server's tool list while the system
    // runs (a tool it adds later is offered at the next model step, one it drops leaves
    // the list). `server.tools()` gives a copy of today's list instead.
    let system = AgentSystem::builder()
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("editor").role("answers questions about texts"))
        .mcp_server(server)
        .start()?;
    let reply = system
        .ask("editor", "How many words are in 'the quick brown fox jumps'?")
        .await?;
    println!("editor: {}", reply.text);
    assert_eq!(reply.text, "That sentence has 5 words.");
    system.shutdown().await;
    Ok(())
}

/// A one-tool MCP server on stdio, written with `rmcp`.
#[cfg(not(madsim))]
mod server {
    use rmcp::model::{
        CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData, ListToolsResult,
        PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
    };
    use rmcp::service::{RequestContext, RoleServer};
    use rmcp::{ServerHandler, ServiceExt};
    use serde_json::json;

    struct TextTools;

    impl ServerHandler for TextTools {
        fn get_info(&self) -> ServerConfig {
            ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
        }

        async fn list_tools(
            &self,
            _request: Option<PaginatedRequestParams>,
            _context: RequestContext<RoleServer>,
        ) -> Result<ListToolsResult, ErrorData> {
            let schema = json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]});
            let serde_json::Value::Object(schema) = schema else {
                unreachable!("an object literal")
            };
            Ok(ListToolsResult::with_all_items(vec![Tool::new(
                "word_count",
                "Counts the words of a text.",
                schema,
            )]))
        }

        async fn call_tool(
            &self,
            request: CallToolRequestParams,
            _context: RequestContext<RoleServer>,
        ) -> Result<CallToolResponse, ErrorData> {
            if request.name != "word_count" {
                return Err(ErrorData::invalid_params(
                    format!("no tool named {}", request.name),
                    None,
                ));
            }
            let arguments = request.arguments.unwrap_or_default();
            let text = arguments.get("text").and_then(|text| text.as_str()).unwrap_or_default();
            let count = text.split_whitespace().count();
            Ok(CallToolResult::success(vec![ContentBlock::text(count.to_string())]).into())
        }
    }

    /// Serves until stdin closes (the parent closes it when it is done).
    pub(crate) async fn serve() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let service = TextTools.serve(rmcp::transport::stdio()).await?;
        service.waiting().await?;
        Ok(())
    }
}

/// The simulator build has no child processes; the example does nothing there.
#[cfg(madsim)]
fn main() {}

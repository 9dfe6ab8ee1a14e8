//! `troupe-mcp-echo`: a tiny MCP server on stdio (rmcp), for testing
//! `troupe_agent::McpServer` against a real child process.
//!
//! Tools: `echo {text}` returns the text; `add {a, b}` returns the sum; `sleep {ms}`
//! waits that long, then answers (for deadline tests); `fail {}` returns an error
//! result. It serves until its stdin closes.

#[cfg(not(madsim))]
mod echo;

#[cfg(not(madsim))]
#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    use rmcp::ServiceExt;
    let service = echo::EchoServer.serve(rmcp::transport::stdio()).await?;
    service.waiting().await?;
    Ok(())
}

/// The simulator build has no MCP; the binary does nothing there.
#[cfg(madsim)]
fn main() {}

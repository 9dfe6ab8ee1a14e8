//! `troupe-mcp-echo`: a tiny MCP server on stdio (rmcp), for testing
//! `troupe_agent::McpServer` against a real child process.
//!
//! Tools: `echo {text}` returns the text; `add {a, b}` returns the sum; `sleep {ms}`
//! waits that long, then answers (for deadline tests); `fail {}` returns an error
//! result. It serves until its stdin closes.
//!
//! `--mode MODE` makes it misbehave for the probes (`crash`, `huge`, `bad-schema`,
//! `slow-list`, `odd-names`, `exit-after-call`, `upgraded`, `grows`: see `misbehave.rs`).

#[cfg(not(madsim))]
mod echo;
#[cfg(not(madsim))]
mod misbehave;

#[cfg(not(madsim))]
#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    use rmcp::ServiceExt;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = match args.as_slice() {
        [] => None,
        [flag, name] if flag == "--mode" => {
            Some(misbehave::Mode::parse(name).ok_or_else(|| format!("unknown mode {name:?}"))?)
        }
        _ => return Err(format!("usage: troupe-mcp-echo [--mode MODE], got {args:?}").into()),
    };
    match mode {
        None => {
            echo::EchoServer
                .serve(rmcp::transport::stdio())
                .await?
                .waiting()
                .await?
        }
        Some(mode) => {
            misbehave::Misbehaving { mode }
                .serve(rmcp::transport::stdio())
                .await?
                .waiting()
                .await?
        }
    };
    Ok(())
}

/// The simulator build has no MCP; the binary does nothing there.
#[cfg(madsim)]
fn main() {}

//! The echo server's misbehaving modes (`troupe-mcp-echo --mode MODE`), for the probes
//! in `tests/mcp_probes.rs`: each mode serves the echo tools and breaks one rule.
//!
//! - `crash`: an extra tool `crash {}` makes the process exit (status 3) without
//!   answering, mid-call.
//! - `huge`: an extra tool `huge {bytes}` answers with that many bytes of text (at most
//!   [`HUGE_BYTES_MAX`]).
//! - `bad-schema`: lists an extra tool `broken` whose input schema does not compile.
//! - `slow-list`: answers `tools/list` after [`SLOW_LIST_MS`].
//! - `odd-names`: lists extra tools named as MCP allows but model providers refuse
//!   (`files.read`, `read file`, a name of 100 characters); each answers `called NAME`.
//! - `exit-after-call`: answers its first tool call as the echo server does, then
//!   exits (status 0) [`EXIT_AFTER_CALL_MS`] later: a server that dies between calls.
//! - `upgraded`: a newer version of the server: lists the echo tools without `add`
//!   (a call of it is refused as an unknown tool) and with `multiply {a, b}`.
//! - `grows`: after its first `echo` call, lists `multiply {a, b}` too, and says so
//!   with `notifications/tools/list_changed` before it answers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData, ListToolsResult,
    PaginatedRequestParams, ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::ServerHandler;
use serde_json::{json, Value};

use crate::echo::EchoServer;

/// The largest result `huge` gives, in bytes.
const HUGE_BYTES_MAX: u64 = 16 * 1024 * 1024;

/// How long `slow-list` takes to list its tools, in milliseconds.
const SLOW_LIST_MS: u64 = 30_000;

/// How long `exit-after-call` lives after answering its first call, in milliseconds
/// (time for the answer to be written out).
const EXIT_AFTER_CALL_MS: u64 = 50;

/// Whether `grows` has grown (one server per process).
static GROWN: AtomicBool = AtomicBool::new(false);

/// `multiply {a, b}`, of `upgraded` and `grows`.
fn multiply() -> Tool {
    Tool::new(
        "multiply",
        "Multiplies two integers.",
        object(json!({"type": "object",
                      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]})),
    )
}

/// The tool names of `odd-names`.
fn odd_names() -> Vec<String> {
    vec!["files.read".to_owned(), "read file".to_owned(), "n".repeat(100)]
}

/// How the server misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Crash,
    Huge,
    BadSchema,
    SlowList,
    OddNames,
    ExitAfterCall,
    Upgraded,
    Grows,
}

impl Mode {
    pub(crate) fn parse(name: &str) -> Option<Self> {
        match name {
            "crash" => Some(Self::Crash),
            "huge" => Some(Self::Huge),
            "bad-schema" => Some(Self::BadSchema),
            "slow-list" => Some(Self::SlowList),
            "odd-names" => Some(Self::OddNames),
            "exit-after-call" => Some(Self::ExitAfterCall),
            "upgraded" => Some(Self::Upgraded),
            "grows" => Some(Self::Grows),
            _ => None,
        }
    }
}

/// The echo server, misbehaving as `mode` says.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Misbehaving {
    pub(crate) mode: Mode,
}

fn object(value: Value) -> serde_json::Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => unreachable!("every schema here is an object"),
    }
}

impl ServerHandler for Misbehaving {
    fn get_info(&self) -> ServerConfig {
        EchoServer.get_info()
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let mut listed = EchoServer.list_tools(request, context).await?;
        match self.mode {
            Mode::Crash => listed.tools.push(Tool::new(
                "crash",
                "Exits the server without answering.",
                object(json!({"type": "object", "properties": {}})),
            )),
            Mode::Huge => listed.tools.push(Tool::new(
                "huge",
                "Answers with `bytes` bytes of text.",
                object(json!({"type": "object",
                              "properties": {"bytes": {"type": "integer", "minimum": 0}},
                              "required": ["bytes"]})),
            )),
            Mode::BadSchema => listed.tools.push(Tool::new(
                "broken",
                "Its schema does not compile.",
                object(json!({"type": 12})),
            )),
            Mode::ExitAfterCall => {}
            Mode::Upgraded => {
                listed.tools.retain(|tool| tool.name != "add");
                listed.tools.push(multiply());
            }
            Mode::Grows => {
                if GROWN.load(Ordering::SeqCst) {
                    listed.tools.push(multiply());
                }
            }
            Mode::SlowList => tokio::time::sleep(Duration::from_millis(SLOW_LIST_MS)).await,
            Mode::OddNames => {
                for name in odd_names() {
                    listed.tools.push(Tool::new(
                        name,
                        "Answers with its own name.",
                        object(json!({"type": "object", "properties": {}})),
                    ));
                }
            }
        }
        Ok(listed)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        match (self.mode, request.name.as_ref()) {
            (Mode::Crash, "crash") => std::process::exit(3),
            (Mode::Huge, "huge") => {
                let bytes = request
                    .arguments
                    .as_ref()
                    .and_then(|arguments| arguments.get("bytes"))
                    .and_then(Value::as_u64)
                    .unwrap_or_default()
                    .min(HUGE_BYTES_MAX);
                let text = "x".repeat(usize::try_from(bytes).unwrap_or_default());
                Ok(CallToolResult::success(vec![ContentBlock::text(text)]).into())
            }
            (Mode::OddNames, name) if odd_names().iter().any(|odd| odd == name) => {
                Ok(CallToolResult::success(vec![ContentBlock::text(format!("called {name}"))]).into())
            }
            (Mode::ExitAfterCall, _) => {
                tokio::spawn(async {
                    tokio::time::sleep(Duration::from_millis(EXIT_AFTER_CALL_MS)).await;
                    std::process::exit(0);
                });
                EchoServer.call_tool(request, context).await
            }
            (Mode::Upgraded, "add") => Err(ErrorData::invalid_params("no tool named add", None)),
            (Mode::Upgraded | Mode::Grows, "multiply") => {
                let arguments = request.arguments.unwrap_or_default();
                let number = |name: &str| arguments.get(name).and_then(Value::as_i64).unwrap_or_default();
                let product = number("a").saturating_mul(number("b"));
                Ok(CallToolResult::success(vec![ContentBlock::text(product.to_string())]).into())
            }
            (Mode::Grows, "echo") if !GROWN.swap(true, Ordering::SeqCst) => {
                // Said before the answer, so the client has it when the call returns.
                let _ = context.peer.notify_tool_list_changed().await;
                EchoServer.call_tool(request, context).await
            }
            _ => EchoServer.call_tool(request, context).await,
        }
    }
}

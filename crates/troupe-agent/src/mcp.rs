//! [`McpServer`]: the tools of a Model Context Protocol server as Troupe [`Tool`]s,
//! through the official `rmcp` SDK.
//!
//! ```text
//!  McpServer::connect_stdio(program, args)   (child process, JSON-RPC on its stdio)
//!  McpServer::connect_http(url)              (streamable HTTP)
//!     │  initialize + tools/list, bounded by MCP_CONNECT_TIMEOUT_MS_DEFAULT
//!     ▼
//!  AgentSystemBuilder::mcp_server(server) ─► its tools, following its list while the
//!     │                                       system runs (or McpServer::tools(): the
//!     │                                       list now, as Vec<Tool>)
//!     │  the model calls one ─► schema check (as every Tool) ─► tools/call
//!     ▼
//!  text content joined ─► tool result; isError ─► ToolError::Failed (the model reads it)
//! ```
//!
//! # Guarantees and edge behaviour
//! - **Deadline.** A call runs inside [`Tool::execute`] like every built-in tool: it is
//!   bounded by the turn's remaining deadline and ends as
//!   [`ToolError::DeadlineExceeded`] (a tool result the model reads) when the server is
//!   slower. The call's future is then dropped, and rmcp tells the server with
//!   `notifications/cancelled`.
//! - **Connecting** (start, `initialize`, `tools/list`) happens outside any turn and is
//!   bounded by the `timeout` given to the `connect_*` functions: [`McpError::Timeout`].
//! - **Schemas.** Each tool's `inputSchema` is compiled like a hand-written one; a tool
//!   whose schema does not compile is skipped (not offered; a warning names it and
//!   why, and [`McpServer::skipped_tools`] lists it as [`McpError::InvalidToolSchema`]),
//!   and the server's other tools are offered. A
//!   server with more than [`MCP_TOOLS_MAX`] tools is [`McpError::TooManyTools`], as
//!   soon as its pages of `tools/list` hold more (the pages are read one at a time).
//! - **Results.** Text blocks are joined with newlines; other blocks (images, audio,
//!   resources) are named, not inlined; structured content is appended as JSON when
//!   there is no text. The result is cut to [`MCP_TOOL_RESULT_BYTES_MAX`] bytes on a
//!   UTF-8 boundary. A result with `isError: true`, or a protocol error, is
//!   [`ToolError::Failed`] with that text; a failure of the connection names the
//!   server. A message a stdio server sends is read only up to
//!   [`MCP_MESSAGE_BYTES_MAX`] bytes (what one answer may hold in memory): a longer one
//!   closes the connection at once and the call waiting for it fails, naming the limit
//!   (rmcp alone read up to 16 MiB, then dropped the line and left the call waiting
//!   until its deadline). Over HTTP, rmcp's own limit of 16 MiB per event applies.
//! - **Reconnecting.** A server found dead at a call (its stdio process exited, its
//!   connection closed, or an earlier call lost it) is started (connected) again,
//!   `initialize` included, before the call is sent: up to
//!   [`MCP_RECONNECT_ATTEMPTS_MAX`] attempts, [`MCP_RECONNECT_PAUSE_MS`] apart, each
//!   bounded by the connect timeout given at first (and the whole by the turn's
//!   deadline). Calls that find it dead at the same time start it once. When it cannot
//!   be, the call fails with [`McpError::Reconnect`]'s text (the server and the
//!   attempts), and the next call tries again. A model step of an agent system the
//!   server is attached to (and `define_agent` of an agent naming a tool not found)
//!   that finds it dead starts it again too, so its new list is offered without
//!   waiting for a call of one of its tools: one attempt, within the connect timeout, at most once per
//!   [`MCP_DEAD_SERVER_RESTART_INTERVAL_MS`] since it was last started or tried (a
//!   server that keeps dying is not started in a loop); steps that find it dead at once
//!   start it once. A call the server was lost during is not
//!   sent again (it may have run): it fails, and the next call reconnects; a call a
//!   stdio server never read (writing it failed: the process was gone) is sent again
//!   once after reconnecting. The server's tool list is read again at each
//!   reconnection, and when it sends `notifications/tools/list_changed`: at once, on a
//!   task of its own, and at the latest at the next call (or model step of an agent
//!   system it is attached to; who finds the list being read waits for that read, at
//!   most the connect timeout). A tool it no longer lists fails its calls with
//!   [`McpError::ToolGone`]'s text, naming it and the tools offered now, without being
//!   sent; [`McpServer::tools`] and [`McpServer::tool_names`] give the new list. A
//!   new list over [`MCP_TOOLS_MAX`] is refused (a warning) and the last one kept, until
//!   the server says its list changed again or is started again; a list that could not
//!   be read (the connection, the timeout) is read again at the next call or step.
//! - **Attached to an agent system** (`AgentSystemBuilder::mcp_server`, or
//!   `mcp_server_with_prefix`): the system's tools follow the server's list while it
//!   runs. Each model step offers the list as read when the step starts (a step's list
//!   does not change under it); a tool new in it is offered to every agent whose spec
//!   lists no tools and to those that name it; a tool gone leaves every list. A name
//!   taken (by a built-in such as `call_agent`, a tool given to the builder, or another
//!   server's tool that had it first) is refused: `AgentClient::refused_tools` gives
//!   each as `ToolRegistryError::Clash`. Tools made with [`McpServer::tools`] and given
//!   to `AgentSystemBuilder::tool` instead stay as made (the list at start); a tool
//!   kept there keeps the name and schema it was made with.
//! - **Lifetime.** The connection stays open while the [`McpServer`] or any tool made
//!   from it is alive; a stdio child process is killed when the connection closes. On
//!   Unix it leads a process group of its own, and the whole group is killed
//!   [`MCP_CLOSE_GRACE_MS`] later (SIGKILL; also when connecting fails), once the
//!   server had its grace to stop on its own: the processes it started go with it. (So it
//!   does not get a terminal's Ctrl-C either; it reads end of input when this process
//!   ends.)
//! - **Names.** Tools keep the server's names, or get `{prefix}{name}` with
//!   [`McpServer::tools_with_prefix`] when two servers (or a built-in tool) clash.
//!   MCP allows names that model providers refuse (OpenAI-compatible ones accept
//!   `^[a-zA-Z0-9_-]{1,64}$`; a request offering `files.read` is a 400, for every turn
//!   of every agent that has the tool): such a name is offered with each other
//!   character replaced by `_`, and one over [`MCP_TOOL_NAME_BYTES_MAX`] is cut and
//!   ends in `_{n}`, `n` its position in the server's list (so two cut names stay
//!   distinct). The server is still called under its own name. Two names that become
//!   the same are refused when the agent system starts (a duplicate tool).
//!
//! Not under madsim (`#[cfg(not(madsim))]`): child processes and sockets are not
//! simulated.

use std::ffi::{OsStr, OsString};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use rmcp::model::{CallToolRequestParams, ContentBlock};
use rmcp::service::RunningService;
use rmcp::transport::async_rw::AsyncRwTransport;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{RoleClient, ServiceExt};
use serde_json::Value;

use crate::{ArgumentSchema, Tool, ToolError, ToolExecutionContext, ToolHandler};

/// How long connecting (start, `initialize`, `tools/list`) may take by default, in
/// milliseconds.
pub const MCP_CONNECT_TIMEOUT_MS_DEFAULT: u64 = 10_000;

/// How long a stdio server's process group may outlive its connection before it is
/// killed, in milliseconds: the grace rmcp gives the server to stop on its own once its
/// input is closed (its `MAX_WAIT_ON_DROP_SECS`).
pub const MCP_CLOSE_GRACE_MS: u64 = 3_000;

/// The most tools one server may offer.
pub const MCP_TOOLS_MAX: usize = 256;

/// The longest tool result handed to the model, in bytes.
pub const MCP_TOOL_RESULT_BYTES_MAX: usize = 64 * 1024;

/// The longest message (one line of JSON-RPC) read from a stdio server, in bytes: a
/// longer one closes the connection at once, and the call waiting for it fails (the
/// server is started again at the next call). What one server's answer may hold in
/// memory while it is read; its text is cut to [`MCP_TOOL_RESULT_BYTES_MAX`] after.
pub const MCP_MESSAGE_BYTES_MAX: usize = 8 * 1024 * 1024;

const _: () = assert!(MCP_TOOL_RESULT_BYTES_MAX < MCP_MESSAGE_BYTES_MAX);

/// The longest tool name offered to the model, in bytes: the limit of OpenAI-compatible
/// providers (a longer name of the server's is cut, see the module's **Names**).
pub const MCP_TOOL_NAME_BYTES_MAX: usize = crate::TOOL_NAME_BYTES_MAX;

/// How many times a server found dead is started (connected) again for one call before
/// the call gives up.
pub const MCP_RECONNECT_ATTEMPTS_MAX: u32 = 3;

/// The pause between two attempts to start a dead server again, in milliseconds.
pub const MCP_RECONNECT_PAUSE_MS: u64 = 200;

const _: () = assert!(MCP_RECONNECT_ATTEMPTS_MAX >= 1);

/// How long after the last attempt to start (connect to) a server a model step may
/// start it again when it finds it dead, in milliseconds: a step that finds an attached
/// server dead (its stdio process exited) starts it again, once, so its list is read
/// again without waiting for a call of one of its tools; a server that keeps dying, or
/// cannot be started, is tried at most once per this time by steps (calls of its tools
/// start it again at once, as they always did).
pub const MCP_DEAD_SERVER_RESTART_INTERVAL_MS: u64 = 1_000;

/// Why an MCP server could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum McpError {
    /// The child process could not be started.
    #[error("MCP server {server:?} could not be started: {cause}")]
    Spawn {
        /// The server's name.
        server: String,
        /// What failed.
        cause: String,
    },
    /// The connection or the `initialize` handshake failed.
    #[error("MCP server {server:?} did not connect: {cause}")]
    Connect {
        /// The server's name.
        server: String,
        /// What failed.
        cause: String,
    },
    /// Connecting or listing took longer than allowed.
    #[error("MCP server {server:?} did not connect within {timeout_ms} ms")]
    Timeout {
        /// The server's name.
        server: String,
        /// The time allowed, in milliseconds.
        timeout_ms: u64,
    },
    /// `tools/list` failed.
    #[error("MCP server {server:?} did not list its tools: {cause}")]
    ListTools {
        /// The server's name.
        server: String,
        /// What failed.
        cause: String,
    },
    /// The server offers more than [`MCP_TOOLS_MAX`] tools.
    #[error("MCP server {server:?} offers {count} tools, more than {MCP_TOOLS_MAX}")]
    TooManyTools {
        /// The server's name.
        server: String,
        /// How many it listed before it was refused: more than [`MCP_TOOLS_MAX`] (the
        /// listing stops at the first page past the limit).
        count: usize,
    },
    /// A tool's input schema is not a schema this crate can compile (the tool is
    /// skipped, see [`McpServer::skipped_tools`]).
    #[error("MCP tool {tool:?} has an invalid input schema: {cause}")]
    InvalidToolSchema {
        /// The tool's name.
        tool: String,
        /// What is wrong.
        cause: String,
    },
    /// The server no longer offers the tool: it was started (connected) again, or
    /// said its list changed (`notifications/tools/list_changed`), and its new list
    /// does not hold it. The tool's calls fail with this until the server lists it
    /// again; [`McpServer::tools`] gives the tools it offers now.
    #[error(
        "MCP server {server:?} no longer offers tool {tool:?} (its list was read again after it was \
         started again or said its tools changed); it offers: {}",
        offered.join(", ")
    )]
    ToolGone {
        /// The server's name.
        server: String,
        /// The tool's name on the server.
        tool: String,
        /// The names the server lists now.
        offered: Vec<String>,
    },
    /// A dead server could not be started (connected) again.
    #[error(
        "MCP server {server:?} is gone and could not be started again in {attempts} attempts \
         ({MCP_RECONNECT_PAUSE_MS} ms apart): {cause}; its tools fail until it can be"
    )]
    Reconnect {
        /// The server's name.
        server: String,
        /// The attempts made ([`MCP_RECONNECT_ATTEMPTS_MAX`]).
        attempts: u32,
        /// Why the last attempt failed.
        cause: String,
    },
}

type Connection = RunningService<RoleClient, ListWatcher>;

/// The slot of a server's [`Link`], set once it is made: its connections' watchers read
/// the list again through it.
type LinkSlot = Arc<OnceLock<Weak<Link>>>;

/// The client side of a connection: marks the server's `notifications/tools/list_changed`
/// (so the next call, or model step of an agent system it is attached to, reads the list
/// again before it goes on), and starts reading it at once, on a task of its own.
struct ListWatcher {
    changed: Arc<AtomicBool>,
    link: LinkSlot,
}

impl rmcp::ClientHandler for ListWatcher {
    async fn on_tool_list_changed(&self, _context: rmcp::service::NotificationContext<RoleClient>) {
        self.changed.store(true, Ordering::Release);
        if let Some(link) = self.link.get().and_then(Weak::upgrade) {
            // Not here: rmcp runs this handler on a task of its own, but a read that
            // waits for the server holds the link (and its connection) only as long as
            // the list read's own bound.
            tokio::spawn(async move { link.refresh().await });
        }
    }
}

/// A connection, and the process group of its stdio server (killed when the last
/// holder drops it).
struct Connected {
    service: Connection,
    _group: ProcessGroup,
    /// A call lost the connection (the server is not to be trusted with another).
    broken: AtomicBool,
    /// What was seen of a stdio server's output; nothing is set over HTTP.
    output: Arc<OutputState>,
    /// The server said its tool list changed since it was last read.
    list_changed: Arc<AtomicBool>,
}

impl Connected {
    /// Whether the connection is gone (or was lost by a call, or the stdio server's
    /// output ended: it cannot answer).
    fn is_dead(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
            || self.output.ended.load(Ordering::Relaxed)
            || self.service.is_closed()
            || self.service.peer().is_transport_closed()
    }
}

/// What [`CappedLines`] saw of a stdio server's output.
#[derive(Default)]
struct OutputState {
    /// A message over [`MCP_MESSAGE_BYTES_MAX`] came (which closed the connection).
    oversized: AtomicBool,
    /// The output ended (the server exited or closed it), as soon as it is read: before
    /// rmcp's service notices, so the next call starts the server again instead of being
    /// sent to it.
    ended: AtomicBool,
}

/// How to connect to a server (again).
enum Recipe {
    Stdio { program: OsString, args: Vec<OsString> },
    Http { url: String },
}

/// A server's current connection, and how to make a new one when it dies.
struct Link {
    name: String,
    recipe: Recipe,
    /// The connect timeout given at first, for every reconnection too.
    timeout: Duration,
    current: std::sync::Mutex<Arc<Connected>>,
    /// The tools the server listed last: at connecting, again at each reconnection and
    /// after it said its list changed.
    tools: std::sync::Mutex<Arc<[rmcp::model::Tool]>>,
    /// Held while reconnecting: calls that find the server dead at once start it once.
    reconnecting: tokio::sync::Mutex<()>,
    /// Held while the list is read again after the server said it changed: who finds
    /// it being read waits for that read (a model step then offers the new list).
    listing: tokio::sync::Mutex<()>,
    /// Grows each time `tools` is replaced (after the new list is stored).
    generation: AtomicU64,
    /// This link, for its connections' [`ListWatcher`]s.
    slot: LinkSlot,
    /// When the server was last started (connected), or an attempt to was made: a step
    /// starts a dead server again only [`MCP_DEAD_SERVER_RESTART_INTERVAL_MS`] after.
    started_at: std::sync::Mutex<tokio::time::Instant>,
}

impl Link {
    fn current(&self) -> Arc<Connected> {
        self.current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The tools the server listed last.
    fn tools(&self) -> Arc<[rmcp::model::Tool]> {
        self.tools
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn set_tools(&self, tools: Vec<rmcp::model::Tool>) {
        *self.tools.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = tools.into();
        // After the list: who reads the generation, then the list, sees a list at least
        // as new as the generation.
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Reads the list again on `connection` if the server said it changed since it was
    /// last read, or waits for the read under way; within the connect timeout given at
    /// first. On failure the last list is kept and the next call or step tries again.
    async fn read_again_if_changed(&self, connection: &Connected) -> Result<(), McpError> {
        let reading = self.listing.try_lock().is_err();
        if !reading && !connection.list_changed.load(Ordering::Acquire) {
            return Ok(());
        }
        let _one_at_a_time = self.listing.lock().await;
        if !connection.list_changed.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        let failed = match tokio::time::timeout(self.timeout, list_tools(&self.name, &connection.service)).await {
            Ok(Ok(tools)) => {
                tracing::info!(server = %self.name, tools = tools.len(), "MCP server's tool list read again");
                self.set_tools(tools);
                return Ok(());
            }
            Ok(Err(error @ McpError::TooManyTools { .. })) => {
                // Not read again at each call (a list of hundreds of tools each time):
                // the last list stays offered and callable until the server says its
                // list changed again, or is started again.
                tracing::warn!(server = %self.name, %error, "MCP server's new tool list refused; the last one is kept");
                return Ok(());
            }
            Ok(Err(error)) => error,
            Err(_elapsed) => McpError::Timeout {
                server: self.name.clone(),
                timeout_ms: u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
            },
        };
        // Read again at the next call or step.
        connection.list_changed.store(true, Ordering::Release);
        Err(failed)
    }

    /// Reads the list again if the live connection's server said it changed (see
    /// [`Link::read_again_if_changed`]); a failure is logged, the last list kept. A
    /// dead server is started again (its list read at connecting) when it is due: see
    /// [`Link::restart_if_due`].
    async fn refresh(&self) {
        let connection = self.current();
        if connection.is_dead() {
            self.restart_if_due(&connection).await;
            return;
        }
        if let Err(error) = self.read_again_if_changed(&connection).await {
            tracing::warn!(server = %self.name, %error, "MCP server's changed tool list could not be read; the last one is kept");
        }
    }

    /// `Ok` if the server's last list holds tool `remote`; else [`McpError::ToolGone`].
    /// A list the server said changed is read again first (on `connection`).
    async fn offers(&self, connection: &Connected, remote: &str) -> Result<(), McpError> {
        self.read_again_if_changed(connection).await?;
        let tools = self.tools();
        if tools.iter().any(|tool| tool.name == remote) {
            return Ok(());
        }
        Err(McpError::ToolGone {
            server: self.name.clone(),
            tool: remote.to_owned(),
            offered: tools.iter().map(|tool| tool.name.to_string()).collect(),
        })
    }

    /// The connection to call on: the current one, or a new one when it is dead.
    async fn live(&self) -> Result<Arc<Connected>, McpError> {
        let current = self.current();
        if !current.is_dead() {
            return Ok(current);
        }
        self.reconnect(&current).await
    }

    /// Whether [`MCP_DEAD_SERVER_RESTART_INTERVAL_MS`] passed since the server was last
    /// started, or an attempt to was made.
    fn restart_due(&self) -> bool {
        let started_at = *self
            .started_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        tokio::time::Instant::now().duration_since(started_at)
            >= Duration::from_millis(MCP_DEAD_SERVER_RESTART_INTERVAL_MS)
    }

    /// Starts the dead server `dead` again for a model step (its list is read at
    /// connecting), so that its tools come back without a call of one: one attempt,
    /// within the connect timeout, and only when due ([`Link::restart_due`]: a server
    /// that keeps dying is not started in a loop). Steps that find it dead at once
    /// start it once: the others wait for that start. A failure is logged; the last
    /// list stays, and the next call (or due step) tries again.
    async fn restart_if_due(&self, dead: &Arc<Connected>) {
        if !self.restart_due() {
            return;
        }
        let _one_at_a_time = self.reconnecting.lock().await;
        let current = self.current();
        if !Arc::ptr_eq(&current, dead) || !self.restart_due() {
            // Started again (or tried) meanwhile, by a call or another step.
            return;
        }
        if let Err(error) = self.start_again(1).await {
            tracing::warn!(server = %self.name, %error, "MCP server found dead before a model step could not be started again; its last tool list is kept");
        }
    }

    /// One attempt to start (connect to) the server again, replacing the connection
    /// and its list; the caller holds `reconnecting`.
    async fn start_again(&self, attempt: u32) -> Result<Arc<Connected>, McpError> {
        *self
            .started_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = tokio::time::Instant::now();
        let (connected, tools) = open(&self.name, &self.recipe, self.timeout, &self.slot).await?;
        tracing::info!(server = %self.name, attempt, tools = tools.len(), "MCP server connected again");
        let connected = Arc::new(connected);
        // Its tools as it lists them now: a server started again may offer others
        // (before, the list read at first was kept).
        self.set_tools(tools);
        *self.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = connected.clone();
        Ok(connected)
    }

    /// Replaces `dead` with a new connection (unless another caller already did), within
    /// [`MCP_RECONNECT_ATTEMPTS_MAX`] attempts.
    async fn reconnect(&self, dead: &Arc<Connected>) -> Result<Arc<Connected>, McpError> {
        let _one_at_a_time = self.reconnecting.lock().await;
        let current = self.current();
        if !Arc::ptr_eq(&current, dead) && !current.is_dead() {
            return Ok(current);
        }
        let mut cause = String::new();
        for attempt in 1..=MCP_RECONNECT_ATTEMPTS_MAX {
            if attempt > 1 {
                tokio::time::sleep(Duration::from_millis(MCP_RECONNECT_PAUSE_MS)).await;
            }
            match self.start_again(attempt).await {
                Ok(connected) => return Ok(connected),
                Err(error) => {
                    tracing::warn!(server = %self.name, attempt, %error, "MCP server could not be connected again");
                    cause = error.to_string();
                }
            }
        }
        Err(McpError::Reconnect {
            server: self.name.clone(),
            attempts: MCP_RECONNECT_ATTEMPTS_MAX,
            cause,
        })
    }
}

/// Connects to the server `recipe` says, within `timeout`.
async fn open(
    name: &str,
    recipe: &Recipe,
    timeout: Duration,
    link: &LinkSlot,
) -> Result<(Connected, Vec<rmcp::model::Tool>), McpError> {
    match recipe {
        Recipe::Stdio { program, args } => {
            let mut command = tokio::process::Command::new(program);
            command.args(args);
            // Its own process group, killed whole when the connection closes: a helper
            // the server started (a browser, a language server) is not left running as
            // an orphan, as it was when only the server was stopped.
            #[cfg(unix)]
            command.process_group(0);
            let output = Arc::new(OutputState::default());
            let transport = StdioServer::spawn(command, output.clone()).map_err(|error| McpError::Spawn {
                server: name.to_owned(),
                cause: error.to_string(),
            })?;
            let group = ProcessGroup::of(transport.id());
            let changed = Arc::new(AtomicBool::new(false));
            let watcher = ListWatcher {
                changed: changed.clone(),
                link: Arc::clone(link),
            };
            connect_with(name, timeout, group, output, changed, async move {
                watcher.serve(transport).await
            })
            .await
        }
        Recipe::Http { url } => {
            crate::openai::ensure_tls_provider();
            let transport = StreamableHttpClientTransport::from_uri(url.clone());
            let output = Arc::new(OutputState::default());
            let changed = Arc::new(AtomicBool::new(false));
            let watcher = ListWatcher {
                changed: changed.clone(),
                link: Arc::clone(link),
            };
            connect_with(name, timeout, ProcessGroup::none(), output, changed, async move {
                watcher.serve(transport).await
            })
            .await
        }
    }
}

/// The process group a stdio server leads (`process_group(0)`: its id is the server's
/// pid), sent SIGKILL when dropped: the server and every process it started that did
/// not leave the group. rmcp stops only the server (at once, or after closing its input
/// and a grace), so a helper that does not read its input (a browser, a language
/// server) outlived it as an orphan. The group's id cannot be taken by another process
/// while any member lives; once the group is empty the signal finds no one.
struct ProcessGroup {
    #[cfg(unix)]
    id: Option<libc::pid_t>,
}

impl ProcessGroup {
    fn none() -> Self {
        Self {
            #[cfg(unix)]
            id: None,
        }
    }

    /// The group led by the process `pid` (none without a pid).
    fn of(pid: Option<u32>) -> Self {
        #[cfg(unix)]
        {
            Self {
                id: pid
                    .and_then(|pid| libc::pid_t::try_from(pid).ok())
                    .filter(|pid| *pid > 1),
            }
        }
        #[cfg(not(unix))]
        {
            let _ = pid;
            Self {}
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        #[cfg(unix)]
        if let Some(id) = self.id.take() {
            let kill = KillGroup(id);
            // After the grace rmcp gives the server to stop on its own (its input
            // closed), as MCP's stdio shutdown asks. The kill is the task's to drop:
            // a runtime that shuts down first, or has, drops the task and kills at once.
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn(async move {
                        tokio::time::sleep(Duration::from_millis(MCP_CLOSE_GRACE_MS)).await;
                        drop(kill);
                    });
                }
                Err(_) => drop(kill),
            }
        }
    }
}

/// Sends SIGKILL to process group `.0` when dropped.
#[cfg(unix)]
struct KillGroup(libc::pid_t);

#[cfg(unix)]
impl Drop for KillGroup {
    fn drop(&mut self) {
        // SAFETY: `killpg` only sends a signal; it reads and writes no memory of this
        // process. An error (the group is empty: ESRCH) needs no handling.
        unsafe {
            libc::killpg(self.0, libc::SIGKILL);
        }
    }
}

/// A connected MCP server and the tools it listed.
///
/// # Examples
/// ```no_run
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use troupe_agent::McpServer;
/// let server = McpServer::connect_stdio("files", "my-mcp-server", ["--root", "."], Duration::from_secs(10)).await?;
/// // Its tools, as it lists them now and later (or `server.tools()?`, the list now, for
/// // `AgentSystemBuilder::tool`).
/// let builder = troupe_agent::AgentSystem::builder().mcp_server(server);
/// # let _ = builder; Ok(()) }
/// ```
#[derive(Clone)]
pub struct McpServer {
    name: String,
    link: Arc<Link>,
}

impl std::fmt::Debug for McpServer {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("McpServer")
            .field("name", &self.name)
            .field("tools", &self.tool_names())
            .finish_non_exhaustive()
    }
}

impl McpServer {
    /// Starts `program args…` as a child process speaking MCP on its stdin/stdout,
    /// initializes it and lists its tools, all within `timeout`. Its stderr is
    /// inherited.
    ///
    /// # Errors
    /// [`McpError::Spawn`], [`McpError::Connect`], [`McpError::Timeout`],
    /// [`McpError::ListTools`] or [`McpError::TooManyTools`].
    pub async fn connect_stdio<I, A>(
        name: impl Into<String>,
        program: impl AsRef<OsStr>,
        args: I,
        timeout: Duration,
    ) -> Result<Self, McpError>
    where
        I: IntoIterator<Item = A>,
        A: AsRef<OsStr>,
    {
        let recipe = Recipe::Stdio {
            program: program.as_ref().to_owned(),
            args: args.into_iter().map(|arg| arg.as_ref().to_owned()).collect(),
        };
        Self::connect(name.into(), recipe, timeout).await
    }

    /// Connects to a streamable-HTTP MCP endpoint at `url` (for example
    /// `http://127.0.0.1:8000/mcp`), initializes the session and lists its tools, all
    /// within `timeout`.
    ///
    /// # Errors
    /// [`McpError::Connect`], [`McpError::Timeout`], [`McpError::ListTools`] or
    /// [`McpError::TooManyTools`].
    pub async fn connect_http(name: impl Into<String>, url: &str, timeout: Duration) -> Result<Self, McpError> {
        Self::connect(name.into(), Recipe::Http { url: url.to_owned() }, timeout).await
    }

    async fn connect(name: String, recipe: Recipe, timeout: Duration) -> Result<Self, McpError> {
        let slot = LinkSlot::default();
        let started_at = tokio::time::Instant::now();
        let (connected, tools) = open(&name, &recipe, timeout, &slot).await?;
        let link = Arc::new(Link {
            name: name.clone(),
            recipe,
            timeout,
            current: std::sync::Mutex::new(Arc::new(connected)),
            tools: std::sync::Mutex::new(tools.into()),
            reconnecting: tokio::sync::Mutex::new(()),
            listing: tokio::sync::Mutex::new(()),
            generation: AtomicU64::new(0),
            slot: Arc::clone(&slot),
            started_at: std::sync::Mutex::new(started_at),
        });
        let _ = slot.set(Arc::downgrade(&link));
        Ok(Self { name, link })
    }

    /// Whether the connection is up, as far as this side knows (a stdio server that
    /// exited may be noticed only at the next call).
    pub fn is_connected(&self) -> bool {
        !self.link.current().is_dead()
    }

    /// Starts (connects to) the server again now, replacing the connection, as a call
    /// does when it finds the server dead (see the module's **Reconnecting**). Calls in
    /// flight on the old connection finish or fail on it.
    ///
    /// # Errors
    /// [`McpError::Reconnect`] after [`MCP_RECONNECT_ATTEMPTS_MAX`] failed attempts.
    pub async fn reconnect(&self) -> Result<(), McpError> {
        let current = self.link.current();
        self.link.reconnect(&current).await.map(drop)
    }

    /// The name given when connecting.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The server's tool names, as it listed them last (at connecting, or again after
    /// it was started again or said its list changed).
    pub fn tool_names(&self) -> Vec<String> {
        self.link.tools().iter().map(|tool| tool.name.to_string()).collect()
    }

    /// Every tool of the server as a Troupe [`Tool`], under the server's names, but those
    /// whose schema does not compile: they are skipped with a warning naming them and why
    /// ([`McpServer::skipped_tools`]). The tools the server listed last: after it was
    /// started again, or said its list changed, asked again, this gives the tools it
    /// offers now (a tool made earlier that it no longer lists fails its calls with
    /// [`McpError::ToolGone`]'s text).
    ///
    /// # Errors
    /// None today (a bad schema costs only its own tool); kept for errors to come.
    pub fn tools(&self) -> Result<Vec<Tool>, McpError> {
        self.tools_with_prefix("")
    }

    /// As [`McpServer::tools`], each named `{prefix}{name}` (the server is still called
    /// with its own name), made a name model providers accept (see the module's
    /// **Names**).
    ///
    /// # Errors
    /// As [`McpServer::tools`].
    pub fn tools_with_prefix(&self, prefix: &str) -> Result<Vec<Tool>, McpError> {
        let tools = self.link.tools();
        let mut offered = Vec::with_capacity(tools.len());
        for (index, tool) in tools.iter().enumerate() {
            let parameters = Value::Object((*tool.input_schema).clone());
            if let Err(invalid) = ArgumentSchema::compile(&parameters) {
                // One bad schema costs only its own tool (before, every tool of the
                // server was refused with it).
                tracing::warn!(
                    server = %self.name,
                    tool = %tool.name,
                    cause = %invalid,
                    "MCP tool skipped: its input schema does not compile"
                );
                continue;
            }
            let exposed = offered_name(prefix, &tool.name, index);
            let handler = McpToolHandler {
                server: self.name.clone(),
                exposed: exposed.clone(),
                remote: tool.name.to_string(),
                link: self.link.clone(),
            };
            let description = tool.description.as_deref().unwrap_or_default().to_owned();
            offered.push(Tool::new(exposed, description, parameters, handler));
        }
        Ok(offered)
    }

    /// The server's tools that [`McpServer::tools`] skips, each an
    /// [`McpError::InvalidToolSchema`] naming it and saying why, in the server's order.
    pub fn skipped_tools(&self) -> Vec<McpError> {
        self.link
            .tools()
            .iter()
            .filter_map(|tool| {
                let parameters = Value::Object((*tool.input_schema).clone());
                ArgumentSchema::compile(&parameters)
                    .err()
                    .map(|invalid| McpError::InvalidToolSchema {
                        tool: tool.name.to_string(),
                        cause: invalid.to_string(),
                    })
            })
            .collect()
    }
}

/// Connects with `connect` within `timeout`; `group` is the stdio server's process
/// group, killed if this fails, or else when the connection is dropped.
async fn connect_with<F, E>(
    name: &str,
    timeout: Duration,
    group: ProcessGroup,
    output: Arc<OutputState>,
    list_changed: Arc<AtomicBool>,
    connect: F,
) -> Result<(Connected, Vec<rmcp::model::Tool>), McpError>
where
    F: std::future::Future<Output = Result<Connection, E>>,
    E: std::fmt::Display,
{
    let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
    let setup = async {
        let connection = connect.await.map_err(|error| McpError::Connect {
            server: name.to_owned(),
            cause: error.to_string(),
        })?;
        let tools = list_tools(name, &connection).await?;
        Ok::<_, McpError>((connection, tools))
    };
    let (connection, tools) = tokio::time::timeout(timeout, setup)
        .await
        .map_err(|_elapsed| McpError::Timeout {
            server: name.to_owned(),
            timeout_ms,
        })??;
    Ok((
        Connected {
            service: connection,
            _group: group,
            broken: AtomicBool::new(false),
            output,
            list_changed,
        },
        tools,
    ))
}

/// The server's tools, page by page, stopping past the limit: a server that keeps
/// naming a next page is refused there, not read (and kept) until the timeout.
async fn list_tools(name: &str, connection: &Connection) -> Result<Vec<rmcp::model::Tool>, McpError> {
    let mut tools = Vec::new();
    let mut cursor = None;
    loop {
        let params = rmcp::model::PaginatedRequestParams::default().with_cursor(cursor);
        let page = connection
            .list_tools(Some(params))
            .await
            .map_err(|error| McpError::ListTools {
                server: name.to_owned(),
                cause: error.to_string(),
            })?;
        tools.extend(page.tools);
        if tools.len() > MCP_TOOLS_MAX {
            return Err(McpError::TooManyTools {
                server: name.to_owned(),
                count: tools.len(),
            });
        }
        cursor = page.next_cursor;
        if cursor.is_none() {
            return Ok(tools);
        }
    }
}

/// A stdio server's output, failing the read of a line over [`MCP_MESSAGE_BYTES_MAX`]
/// (and every read after it). rmcp drops such a line itself, but only after reading
/// 16 MiB of it, and then never answers the call that waited for it: the call hung
/// until its turn's deadline. A failed read ends the connection: the call fails at
/// once.
struct CappedLines<R> {
    inner: R,
    /// The bytes of the line being read so far.
    line_bytes: usize,
    output: Arc<OutputState>,
}

impl<R: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for CappedLines<R> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        context: &mut std::task::Context<'_>,
        buffer: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let over = || {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("the MCP server sent a message over {MCP_MESSAGE_BYTES_MAX} bytes"),
            )
        };
        if self.output.oversized.load(Ordering::Relaxed) {
            return std::task::Poll::Ready(Err(over()));
        }
        let before = buffer.filled().len();
        let read = std::task::ready!(std::pin::Pin::new(&mut self.inner).poll_read(context, buffer));
        if read.is_err() || (buffer.filled().len() == before && buffer.remaining() > 0) {
            self.output.ended.store(true, Ordering::Relaxed);
        }
        read?;
        let mut line_bytes = self.line_bytes;
        let mut lines = buffer.filled()[before..].split(|byte| *byte == b'\n');
        let mut longest = 0;
        if let Some(rest_of_line) = lines.next() {
            line_bytes += rest_of_line.len();
            longest = line_bytes;
        }
        for line in lines {
            line_bytes = line.len();
            longest = longest.max(line_bytes);
        }
        if longest > MCP_MESSAGE_BYTES_MAX {
            self.output.oversized.store(true, Ordering::Relaxed);
            return std::task::Poll::Ready(Err(over()));
        }
        self.line_bytes = line_bytes;
        std::task::Poll::Ready(Ok(()))
    }
}

/// A stdio MCP server: its child process and the JSON-RPC lines on its stdin and
/// stdout (stderr inherited), its output read through [`CappedLines`]. The child is
/// killed when this is dropped, as rmcp's own `TokioChildProcess` does; `close` first
/// closes its input and gives it [`MCP_CLOSE_GRACE_MS`] to exit.
struct StdioServer {
    transport: AsyncRwTransport<RoleClient, CappedLines<tokio::process::ChildStdout>, tokio::process::ChildStdin>,
    child: Option<tokio::process::Child>,
    /// Shared with its [`CappedLines`].
    output: Arc<OutputState>,
}

impl StdioServer {
    fn spawn(mut command: tokio::process::Command, output: Arc<OutputState>) -> std::io::Result<Self> {
        command
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .kill_on_drop(true);
        let mut child = command.spawn()?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(std::io::Error::other("the child's stdin or stdout was not piped"));
        };
        let stdout = CappedLines {
            inner: stdout,
            line_bytes: 0,
            output: output.clone(),
        };
        Ok(Self {
            transport: AsyncRwTransport::new(stdout, stdin),
            child: Some(child),
            output,
        })
    }

    fn id(&self) -> Option<u32> {
        self.child.as_ref()?.id()
    }

    fn transport_oversized(&self) -> bool {
        self.output.oversized.load(Ordering::Relaxed)
    }
}

impl Drop for StdioServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Killed and reaped (no zombie) on the runtime when there is one; else
            // `kill_on_drop` kills it and tokio reaps it later.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    let _ = child.kill().await;
                });
            }
        }
    }
}

impl rmcp::transport::Transport<RoleClient> for StdioServer {
    type Error = std::io::Error;

    fn send(
        &mut self,
        item: rmcp::service::TxJsonRpcMessage<RoleClient>,
    ) -> impl std::future::Future<Output = Result<(), Self::Error>> + Send + 'static {
        self.transport.send(item)
    }

    fn receive(
        &mut self,
    ) -> impl std::future::Future<Output = Option<rmcp::service::RxJsonRpcMessage<RoleClient>>> + Send {
        self.transport.receive()
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        self.transport.close().await?;
        if let Some(mut child) = self.child.take() {
            // A server that sent a message over the limit is killed at once: it may be
            // stuck writing the rest of it, and the calls waiting on it fail only once
            // the connection is closed.
            let grace = if self.transport_oversized() {
                Duration::ZERO
            } else {
                Duration::from_millis(MCP_CLOSE_GRACE_MS)
            };
            if tokio::time::timeout(grace, child.wait()).await.is_err() {
                child.kill().await?;
            }
        }
        Ok(())
    }
}

/// An [`McpServer`] attached to an agent system
/// (`AgentSystemBuilder::mcp_server_with_prefix`): its tools, as it lists them now, are
/// those of the system's [`crate::ToolRegistry`].
pub(crate) struct McpToolSource {
    server: McpServer,
    prefix: String,
}

impl McpToolSource {
    pub(crate) fn new(server: McpServer, prefix: impl Into<String>) -> Self {
        Self {
            server,
            prefix: prefix.into(),
        }
    }
}

#[async_trait]
impl crate::tool::ToolSource for McpToolSource {
    fn describe(&self) -> String {
        format!("MCP server {:?}", self.server.name)
    }

    fn generation(&self) -> u64 {
        self.server.link.generation.load(Ordering::Acquire)
    }

    fn tools(&self) -> Vec<Tool> {
        // `tools_with_prefix` has no error today (see `McpServer::tools`).
        self.server.tools_with_prefix(&self.prefix).unwrap_or_default()
    }

    async fn refresh(&self) {
        self.server.link.refresh().await;
    }
}

/// The name tool `name` (the `index`th of its server's list) is offered under:
/// `{prefix}{name}` with every character outside `[a-zA-Z0-9_-]` replaced by `_`, cut
/// to [`MCP_TOOL_NAME_BYTES_MAX`] ending in `_{index}` when longer (`tool_{index}` when
/// empty).
fn offered_name(prefix: &str, name: &str, index: usize) -> String {
    let mut offered: String = prefix
        .chars()
        .chain(name.chars())
        .map(|character| {
            if character.is_ascii_alphanumeric() || character == '_' || character == '-' {
                character
            } else {
                '_'
            }
        })
        .collect();
    if offered.is_empty() {
        return format!("tool_{index}");
    }
    if offered.len() > MCP_TOOL_NAME_BYTES_MAX {
        let suffix = format!("_{index}");
        // Every character is ASCII here: any byte is a character boundary.
        offered.truncate(MCP_TOOL_NAME_BYTES_MAX - suffix.len());
        offered.push_str(&suffix);
    }
    offered
}

/// Calls one remote tool.
struct McpToolHandler {
    /// The server's name, as given when connecting.
    server: String,
    exposed: String,
    remote: String,
    link: Arc<Link>,
}

impl McpToolHandler {
    /// What a failed call says: which server, and, when its connection is gone, that
    /// it is connected again at the next call (before: "the MCP call failed: Transport
    /// closed").
    fn describe_failure(&self, connection: &Connected, error: &rmcp::ServiceError) -> String {
        let server = &self.server;
        match error {
            rmcp::ServiceError::TransportClosed if connection.output.oversized.load(Ordering::Relaxed) => format!(
                "the MCP server {server:?} answered with a message over {MCP_MESSAGE_BYTES_MAX} bytes: the \
                 connection was closed without reading it; the server is started again at the next call"
            ),
            rmcp::ServiceError::TransportClosed => format!(
                "the MCP server {server:?} is gone (its process exited or its connection closed) during the call, \
                 which may or may not have run: it is started (connected) again at the next call"
            ),
            rmcp::ServiceError::TransportSend(_) => {
                format!("the MCP server {server:?} could not be reached: {error}")
            }
            _ => format!("the call to MCP server {server:?} failed: {error}"),
        }
    }
}

#[async_trait]
impl ToolHandler for McpToolHandler {
    async fn call(&self, _context: &ToolExecutionContext, arguments: Value) -> Result<String, ToolError> {
        let mut params = CallToolRequestParams::new(self.remote.clone());
        if let Value::Object(arguments) = arguments {
            params = params.with_arguments(arguments);
        }
        // Bounded by the turn's deadline in `Tool::execute`; dropping this future
        // cancels the request on the server.
        let failed = |error: McpError| ToolError::failed(&self.exposed, error.to_string());
        let connection = self.link.live().await.map_err(failed)?;
        // Not sent when the server (started again, or after saying its list changed)
        // no longer lists the tool: a typed failure naming it, not whatever the server
        // answers to a name it does not know.
        self.link.offers(&connection, &self.remote).await.map_err(failed)?;
        let result = match connection.service.call_tool(params.clone()).await {
            Ok(result) => result,
            Err(error) => {
                let lost = matches!(
                    error,
                    rmcp::ServiceError::TransportClosed | rmcp::ServiceError::TransportSend(_)
                );
                if lost {
                    connection.broken.store(true, Ordering::Relaxed);
                }
                // A request that could not be written to a stdio server's input never
                // reached it (the process was gone): sent once more to a new process.
                let unread = matches!(error, rmcp::ServiceError::TransportSend(_))
                    && matches!(self.link.recipe, Recipe::Stdio { .. });
                if !unread {
                    return Err(ToolError::failed(
                        &self.exposed,
                        self.describe_failure(&connection, &error),
                    ));
                }
                let connection = self.link.reconnect(&connection).await.map_err(failed)?;
                self.link.offers(&connection, &self.remote).await.map_err(failed)?;
                match connection.service.call_tool(params).await {
                    Ok(result) => result,
                    Err(error) => {
                        if matches!(
                            error,
                            rmcp::ServiceError::TransportClosed | rmcp::ServiceError::TransportSend(_)
                        ) {
                            connection.broken.store(true, Ordering::Relaxed);
                        }
                        return Err(ToolError::failed(
                            &self.exposed,
                            self.describe_failure(&connection, &error),
                        ));
                    }
                }
            }
        };
        let mut parts: Vec<String> = result
            .content
            .iter()
            .map(|block| match block {
                ContentBlock::Text(text) => text.text.clone(),
                ContentBlock::Image(_) => "[image]".to_owned(),
                ContentBlock::Audio(_) => "[audio]".to_owned(),
                ContentBlock::Resource(_) => "[embedded resource]".to_owned(),
                ContentBlock::ResourceLink(link) => format!("[resource {}]", link.uri),
                _ => "[content of an unknown kind]".to_owned(),
            })
            .collect();
        if parts.is_empty() {
            if let Some(structured) = &result.structured_content {
                parts.push(structured.to_string());
            }
        }
        let text = parts.join("\n");
        let text = troupe_core::truncate_utf8(&text, MCP_TOOL_RESULT_BYTES_MAX).to_owned();
        if result.is_error == Some(true) {
            Err(ToolError::failed(&self.exposed, text))
        } else {
            Ok(text)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offered_names_keep_within_the_providers_rule_at_the_edges() {
        assert_eq!(offered_name("", "", 3), "tool_3");
        assert_eq!(offered_name("fs.", "été", 0), "fs__t_");
        let exact = "a".repeat(MCP_TOOL_NAME_BYTES_MAX);
        assert_eq!(offered_name("", &exact, 7), exact);
        let over = offered_name("", &"a".repeat(MCP_TOOL_NAME_BYTES_MAX + 1), 12);
        assert_eq!(over.len(), MCP_TOOL_NAME_BYTES_MAX);
        assert!(over.ends_with("a_12"), "{over}");
    }
}

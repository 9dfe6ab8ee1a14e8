//! Troupe's agent layer: agents as virtual actors that think with an LLM, use tools and
//! call each other through `call_agent`.
//!
//! - [`AgentSystem`]: a runtime with the `"agent"` actor kind, a model client
//!   ([`LlmClient`]; [`ScriptedLlm`] for tests, the simulator and the demo), the agents'
//!   definitions ([`AgentSpec`], kept in an [`AgentDirectory`]) and extra [`Tool`]s.
//! - Each agent is a virtual actor (`agent/{id}`): one turn handles one message, runs up
//!   to [`limits::AGENT_TURN_STEPS_MAX`] model steps with tool calls, and commits its
//!   conversation (bounded window in the snapshot, full log in the store) atomically.
//! - [`call_agent`] (also a tool every agent has) admits a call with
//!   `troupe_core::admit_call`: no cycles, depth at most 5, known targets, at most 10
//!   calls in flight per agent, and a deadline that only shrinks along a chain.
//! - [`Budget`]: a request may carry a token (and tool-call) budget; every model call is
//!   charged, a child call gets at most what its parent has left (reserved while it
//!   runs, the unused part refunded), and an exhausted budget is [`BudgetExhausted`]
//!   ([`AgentClient::ask_with`], see `budget.rs`).
//! - [`AgentObserver`] sees every call and turn; [`CallRecorder`] renders the call tree.
//! - Normal build only (HTTP and processes stay out of simulated code): `OpenAiClient`,
//!   an async OpenAI-compatible [`LlmClient`] (streaming, retries, token usage), and
//!   `McpServer`, which turns the tools of an MCP server (stdio child process or
//!   streamable HTTP) into [`Tool`]s.
//!
//! # Examples
//! Two agents on the scripted model: `coordinator` asks `analyst`, which answers.
//! ```
//! use std::sync::Arc;
//! use serde_json::json;
//! use troupe_agent::{AgentSpec, AgentSystem, ScriptRule, ScriptedLlm};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let llm = ScriptedLlm::new()
//!     .rule(ScriptRule::agent("coordinator").on_user_containing("forecast")
//!         .call("call_agent", json!({"agent_id": "analyst", "message": "{input}"})))
//!     .rule(ScriptRule::agent("coordinator").on_tool_result().reply("analyst says: {tool_result}"))
//!     .rule(ScriptRule::agent("analyst").reply("sunny"));
//! let system = AgentSystem::builder()
//!     .llm(Arc::new(llm))
//!     .agent(AgentSpec::new("coordinator").role("plans the work"))
//!     .agent(AgentSpec::new("analyst").role("answers questions about data"))
//!     .start()?;
//! let reply = system.ask("coordinator", "what is the forecast?").await?;
//! assert_eq!(reply.text, "analyst says: sunny");
//! system.shutdown().await;
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

mod agent;
mod budget;
mod call_agent;
mod call_record;
mod config;
mod conversation;
mod conversation_api;
mod directory_store;
mod export_hooks;
mod external;
mod inbox;
mod inbox_turns;
mod json_text;
pub mod limits;
mod llm;
#[cfg(not(madsim))]
mod mcp;
mod observer;
#[cfg(not(madsim))]
mod openai;
mod org;
mod org_api;
mod org_prompt;
mod org_store;
mod overdue_wake;
mod permissions;
mod remote;
mod resume_sweep;
mod schema;
mod scripted_llm;
mod shared_record;
mod store_wait;
mod system;
mod tool;

pub use agent::{
    agent_id, AgentCatalog, AgentDirectory, AgentReply, AgentRequest, AgentSpec, AgentSpecError, CallApproval,
    ContextWindow, ModelSettings, AGENT_KIND,
};
pub use budget::{
    AskOptions, Budget, BudgetExhausted, BudgetResource, DelegateOptions, NotifyOptions, Spend,
    AGENT_CALL_PARENT_RESERVE_PERCENT,
};
pub use call_agent::{
    call_agent, call_agent_schema, AgentCallError, CallAgentArguments, ModelFailed, CALL_AGENT_TOOL_NAME,
};
pub use config::{
    AgentConfig, ConfigError, LinkConfig, OrgConfig, PermissionConfig, RemoteAgentConfig, CONFIG_AGENTS_MAX,
    CONFIG_FILE_SIZE_MAX_BYTES,
};
pub use conversation::{
    conversation_window, conversation_window_within, direct_conversation_id, direct_conversation_id_of, parse_mentions,
    ConversationError, ConversationInfo, ConversationKind, ConversationMessage, Note, NoteKind, Participant, Posted,
    Sender, CONVERSATIONS_LISTED_MAX, CONVERSATION_BYTES_PER_TOKEN, CONVERSATION_KIND, CONVERSATION_MENTIONS_MAX,
    CONVERSATION_MESSAGES_MAX, CONVERSATION_NAME_LENGTH_MAX_BYTES, CONVERSATION_PAGE_MAX,
    CONVERSATION_PARTICIPANTS_MAX, CONVERSATION_WINDOW_MESSAGES_MAX, CONVERSATION_WINDOW_TOKENS_MAX,
};
pub use conversation_api::CONVERSATION_READ_STORE_WAIT_MS;
pub use directory_store::{DirectoryError, DIRECTORY_REFRESH_MS, DIRECTORY_STORE_KEY, DIRECTORY_STORE_KIND};
pub use export_hooks::{set_trace_starter, set_traceparent_source};
pub use external::{ExternalCancel, ExternalForget, ExternalReply, ExternalTask, ExternalTaskRequest};
pub use inbox::{InboxError, MessageKind, TaskState, TaskStatus, DELEGATE_TOOL_NAME, NOTIFY_TOOL_NAME};
pub use inbox_turns::{send_schema, SendArguments};
pub use llm::{
    ChatMessage, EarlyStop, LlmClient, LlmError, LlmReply, LlmRequest, LlmRouter, Prompt, PromptIter, PromptParts,
    Role, TokenUsage, ToolCall, ToolSpec,
};
#[cfg(not(madsim))]
pub use mcp::{
    McpError, McpServer, MCP_CLOSE_GRACE_MS, MCP_CONNECT_TIMEOUT_MS_DEFAULT, MCP_DEAD_SERVER_RESTART_INTERVAL_MS,
    MCP_MESSAGE_BYTES_MAX, MCP_RECONNECT_ATTEMPTS_MAX, MCP_RECONNECT_PAUSE_MS, MCP_TOOLS_MAX, MCP_TOOL_NAME_BYTES_MAX,
    MCP_TOOL_RESULT_BYTES_MAX,
};
pub use observer::{AgentEvent, AgentObserver, CallNode, CallOutcome, CallRecorder};
#[cfg(not(madsim))]
pub use openai::{
    ensure_tls_provider, OpenAiClient, OpenAiConfig, OpenAiConfigError, StreamDelta, StreamObserver, TokenCapField,
    OPENAI_BASE_URL_DEFAULT, OPENAI_MODEL_DEFAULT, OPENAI_REQUEST_TIMEOUT_MS_DEFAULT, OPENAI_REQUEST_TIMEOUT_MS_MAX,
    OPENAI_RETRIES_DEFAULT, OPENAI_RETRIES_MAX, OPENAI_RETRY_BACKOFF_INITIAL_MS_DEFAULT,
    OPENAI_RETRY_BACKOFF_MS_MAX_DEFAULT, OPENAI_RETRY_JITTER_SEED_DEFAULT, PROVIDER_ERROR_BODY_BYTES_MAX,
    RESPONSE_BODY_BYTES_MAX, RETRY_AFTER_MS_MAX, RETRY_ATTEMPT_MS_MIN, STREAM_TOOL_CALLS_MAX,
};
pub use org::{
    Approval, ApprovalState, ContactKind, Link, LinkDirection, LinkPatch, LinkRelationship, Membership, NotPermitted,
    NotPermittedReason, OrgError, OrgPolicy, Organisation, Permitted, ORG_APPROVALS_PENDING_MAX,
    ORG_APPROVALS_RESOLVED_KEPT_MAX, ORG_APPROVAL_MESSAGE_SIZE_MAX_BYTES, ORG_LINKS_MAX, ORG_PROMPT_AGENTS_LISTED_MAX,
    ORG_RULES_PER_AGENT_MAX,
};
pub use org_store::{
    ORG_CACHE_MAX_AGE_MS, ORG_CACHE_STALE_MAX_MS, ORG_READ_LOCK_WAIT_MS, ORG_STORE_KEY, ORG_STORE_KIND,
    ORG_WRITE_ATTEMPTS_MAX, ORG_WRITE_RETRY_PAUSE_MS,
};
pub use permissions::{
    match_rules, resolve_permission, BehaviourMode, PermissionEffect, PermissionRule, PermissionVerdict, RuleMatch,
    PERMISSION_TARGET_ANY,
};
pub use remote::{
    RemoteAgent, RemoteAgentError, RemoteCallError, RemoteToken, TroupeCallMetadata, REMOTE_AGENTS_MAX,
    REMOTE_AGENT_URL_LENGTH_MAX_BYTES, REMOTE_ERROR_BODY_QUOTED_MAX_BYTES, REMOTE_RESPONSE_SIZE_MAX_BYTES,
    REMOTE_TASK_POLL_INTERVAL_MS, REMOTE_TRACE_ID_LENGTH_MAX_BYTES, TROUPE_METADATA_KEY,
};
pub use resume_sweep::{ResumeSweep, ResumeSweepError};
pub use schema::{
    validate, ArgumentSchema, InvalidSchema, SchemaError, SchemaViolation, SCHEMA_ERRORS_REPORTED_MAX,
    SCHEMA_ERROR_PROBLEM_BYTES_MAX,
};
/// The `schemars` crate, for deriving the argument types of [`Tool::typed`] without a
/// direct dependency: `#[derive(JsonSchema)] #[schemars(crate = "troupe_agent::schemars")]`.
pub use schemars;
pub use scripted_llm::{ScriptAction, ScriptCondition, ScriptRule, ScriptedAnswer, ScriptedLlm};
pub use store_wait::AGENT_API_STORE_WAIT_MS;
pub use system::{AgentClient, AgentSystem, AgentSystemBuilder, AgentSystemError, LogPage, PendingAgentSystem};
pub use tool::{
    tool_parameters_schema, Tool, ToolError, ToolExecutionContext, ToolHandler, ToolRegistry, ToolRegistryError,
    TOOLS_GONE_KEPT_MAX, TOOL_NAME_BYTES_MAX,
};

//! Remote agents: agents served by another A2A server, called with the same
//! `call_agent` tool and under the same rules as local ones.
//!
//! ```text
//! model of A ──call_agent{agent_id: hq-analyst}──► the same admission as a local call
//!   (cycle, depth, in-flight, deadline; then the organisation's links and permissions,
//!    by the remote agent's local id; then the budget grant)
//!   ──► POST {url}  A2A v1.0 JSON-RPC SendMessage (blocking), HTTP timeout = the
//!        time the call has left; message.metadata.troupe = {chain (with A), depth,
//!        timeout_ms (what is left), trace_id}
//!   ──► the reply text, or a typed error: timeout, busy, refused by the remote side
//!        (its cycle or depth check), failed, unreachable, bad status (URL and status)
//! ```
//!
//! On arrival at a Troupe server, the chain and depth are checked again and continue
//! into the remote agent's own calls ([`AgentClient::ask_continued`]), so a cycle that
//! crosses servers (A on server 1 → B on server 2 → A on server 1) is refused, and so
//! is a chain deeper than the limit. Chain entries are agent ids: two different agents
//! with the same id on two servers look like one agent to the cycle check, which then
//! refuses a call it could have let through (never the other way round).
//!
//! The HTTP client is not built under the simulator (HTTP stays out of simulated code,
//! as for the OpenAI client): there a call to a remote agent fails as unreachable.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use troupe_core::limits::{AGENT_CALL_DEPTH_MAX, INVOKE_TIMEOUT_MS_MAX};
use troupe_core::{truncate_utf8, ActorId, CallContext, CallRefused, Deadline, InvokeError};

use crate::agent::{agent_id, AgentReply, AgentRequest};
use crate::limits::AGENT_MESSAGE_SIZE_MAX_BYTES;
use crate::{AgentCallError, AgentClient, AgentEvent, Budget};

/// The key of Troupe's call context in an A2A message's `metadata`.
pub const TROUPE_METADATA_KEY: &str = "troupe";
/// Remote agents one system knows, at most.
pub const REMOTE_AGENTS_MAX: usize = 1_000;
/// Longest remote agent URL accepted, in bytes.
pub const REMOTE_AGENT_URL_LENGTH_MAX_BYTES: usize = 2_048;
/// Largest A2A response body read from a remote server, in bytes; a longer one is a
/// malformed answer.
pub const REMOTE_RESPONSE_SIZE_MAX_BYTES: usize = 1024 * 1024;
/// How much of a remote server's error body an error quotes, at most, in bytes.
pub const REMOTE_ERROR_BODY_QUOTED_MAX_BYTES: usize = 512;
/// How often a remote task that outlived the server's blocking wait is read again
/// (`GetTask`), in milliseconds.
pub const REMOTE_TASK_POLL_INTERVAL_MS: u64 = 250;
/// Longest `trace_id` accepted in Troupe's metadata, in bytes.
pub const REMOTE_TRACE_ID_LENGTH_MAX_BYTES: usize = 256;

/// Where a remote agent's bearer token comes from.
#[derive(Clone, PartialEq, Eq)]
pub enum RemoteToken {
    /// No token: the remote server serves without one (loopback).
    None,
    /// Read from this environment variable at each call.
    Env(String),
    /// This token.
    Literal(String),
}

impl std::fmt::Debug for RemoteToken {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::None => formatter.write_str("None"),
            Self::Env(variable) => formatter.debug_tuple("Env").field(variable).finish(),
            Self::Literal(_) => formatter.write_str("Literal(<set>)"),
        }
    }
}

/// An agent served by another A2A server, known here under a local id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteAgent {
    /// The id local agents call it by (`call_agent`'s `agent_id`); links and
    /// permission rules name it by this id.
    pub id: String,
    /// Its A2A JSON-RPC endpoint, as its agent card lists it; on a Troupe server
    /// `http://HOST:PORT/a2a/{its id there}`.
    pub url: String,
    /// What it does, listed to the agents that may call it.
    pub role: String,
    /// Its server's bearer token.
    pub token: RemoteToken,
}

impl RemoteAgent {
    /// Remote agent `id` at A2A endpoint `url`, with no role and no token.
    pub fn new(id: impl Into<String>, url: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            url: url.into(),
            role: String::new(),
            token: RemoteToken::None,
        }
    }

    /// Its role, as listed to the agents that may call it.
    #[must_use]
    pub fn role(mut self, role: impl Into<String>) -> Self {
        self.role = role.into();
        self
    }

    /// Sends the bearer token read from environment variable `variable` at each call.
    #[must_use]
    pub fn token_env(mut self, variable: impl Into<String>) -> Self {
        self.token = RemoteToken::Env(variable.into());
        self
    }

    /// Sends bearer token `token`.
    #[must_use]
    pub fn bearer_token(mut self, token: impl Into<String>) -> Self {
        self.token = RemoteToken::Literal(token.into());
        self
    }

    /// Checks the id, the URL, the role's size and the token's variable name.
    ///
    /// # Errors
    /// [`RemoteAgentError::InvalidId`], [`RemoteAgentError::InvalidUrl`],
    /// [`RemoteAgentError::RoleTooLong`], [`RemoteAgentError::InvalidTokenEnv`].
    pub fn validate(&self) -> Result<(), RemoteAgentError> {
        agent_id(&self.id).map_err(|cause| RemoteAgentError::InvalidId {
            id: self.id.clone(),
            cause: cause.to_string(),
        })?;
        if self.role.len() > crate::limits::AGENT_ROLE_SIZE_MAX_BYTES {
            return Err(RemoteAgentError::RoleTooLong {
                id: self.id.clone(),
                size: self.role.len(),
                limit: crate::limits::AGENT_ROLE_SIZE_MAX_BYTES,
            });
        }
        check_url(&self.url).map_err(|cause| RemoteAgentError::InvalidUrl {
            id: self.id.clone(),
            url: self.url.clone(),
            cause,
        })?;
        if let RemoteToken::Env(variable) = &self.token {
            check_env_name(variable).map_err(|cause| RemoteAgentError::InvalidTokenEnv {
                id: self.id.clone(),
                variable: variable.clone(),
                cause,
            })?;
        }
        Ok(())
    }
}

/// Why a URL cannot be a remote agent's endpoint.
pub(crate) fn check_url(url: &str) -> Result<(), String> {
    if url.len() > REMOTE_AGENT_URL_LENGTH_MAX_BYTES {
        return Err(format!(
            "it is {} bytes, more than the limit of {REMOTE_AGENT_URL_LENGTH_MAX_BYTES}",
            url.len()
        ));
    }
    let Some(rest) = url.strip_prefix("http://").or_else(|| url.strip_prefix("https://")) else {
        return Err("it must start with http:// or https://".into());
    };
    let host = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if host.is_empty() {
        return Err("it names no host".into());
    }
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("it contains whitespace or control characters".into());
    }
    Ok(())
}

/// Why `name` cannot be an environment variable's name.
pub(crate) fn check_env_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("it is empty".into());
    }
    if !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') || name.starts_with(|c: char| c.is_ascii_digit()) {
        return Err("use letters, digits and `_`, not starting with a digit".into());
    }
    Ok(())
}

/// Why a remote agent was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RemoteAgentError {
    /// The id cannot name an agent.
    #[error("remote agent id {id:?} is not valid: {cause}")]
    InvalidId {
        /// The id.
        id: String,
        /// Why.
        cause: String,
    },
    /// The URL cannot be an A2A endpoint.
    #[error("remote agent {id:?}: url {url:?} is not valid: {cause} (give its A2A endpoint, such as http://127.0.0.1:8080/a2a/analyst)")]
    InvalidUrl {
        /// The id.
        id: String,
        /// The URL.
        url: String,
        /// Why.
        cause: String,
    },
    /// The token's environment variable name is not valid.
    #[error("remote agent {id:?}: token_env {variable:?} is not an environment variable name: {cause}")]
    InvalidTokenEnv {
        /// The id.
        id: String,
        /// The name.
        variable: String,
        /// Why.
        cause: String,
    },
    /// A local agent has the id.
    #[error("remote agent {id:?} has the id of a local agent; give it another local id")]
    ClashesWithLocal {
        /// The id.
        id: String,
    },
    /// Its role is longer than [`crate::limits::AGENT_ROLE_SIZE_MAX_BYTES`] (it is
    /// listed in the system message of every agent that may call it).
    #[error("remote agent {id:?}: its role is {size} bytes, more than the limit of {limit}; shorten it")]
    RoleTooLong {
        /// The id.
        id: String,
        /// The role's size in bytes.
        size: usize,
        /// [`crate::limits::AGENT_ROLE_SIZE_MAX_BYTES`].
        limit: usize,
    },
    /// Too many remote agents.
    #[error("at most {limit} remote agents may be known")]
    TooMany {
        /// [`REMOTE_AGENTS_MAX`].
        limit: usize,
    },
}

/// The remote agents a system knows, by local id.
#[derive(Debug, Default)]
pub(crate) struct RemoteDirectory {
    agents: RwLock<BTreeMap<String, Arc<RemoteAgent>>>,
    /// Counts the changes, so an agent's list of peers is rebuilt only when it changed.
    generation: std::sync::atomic::AtomicU64,
    #[cfg(not(madsim))]
    http: std::sync::OnceLock<reqwest::Client>,
}

impl RemoteDirectory {
    pub(crate) fn get(&self, id: &str) -> Option<Arc<RemoteAgent>> {
        self.agents
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(id)
            .cloned()
    }

    pub(crate) fn list(&self) -> Vec<RemoteAgent> {
        self.agents
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .map(|remote| (**remote).clone())
            .collect()
    }

    /// Adds or replaces `remote` (validated).
    pub(crate) fn upsert(&self, remote: RemoteAgent) -> Result<(), RemoteAgentError> {
        remote.validate()?;
        let mut agents = self.agents.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !agents.contains_key(&remote.id) && agents.len() >= REMOTE_AGENTS_MAX {
            return Err(RemoteAgentError::TooMany {
                limit: REMOTE_AGENTS_MAX,
            });
        }
        agents.insert(remote.id.clone(), Arc::new(remote));
        // Under the lock: a reader that sees the new generation reads the new entry.
        self.generation.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// How many changes the directory has had: equal generations, equal contents.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::SeqCst)
    }

    #[cfg(not(madsim))]
    fn http(&self) -> Result<&reqwest::Client, String> {
        if let Some(client) = self.http.get() {
            return Ok(client);
        }
        crate::openai::ensure_tls_provider();
        let client = reqwest::Client::builder()
            .user_agent(concat!("troupe-agent/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|error| format!("the HTTP client could not be built: {error}"))?;
        Ok(self.http.get_or_init(|| client))
    }
}

/// Troupe's call context in an A2A message (`metadata.troupe`): where the call stands
/// in its call tree. Numbers may come as `2.0`: A2A metadata is a protobuf `Struct`,
/// whose numbers are doubles.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TroupeCallMetadata {
    /// The agent ids whose turns wait on this call, outermost first (the caller last).
    #[serde(default)]
    pub chain: Vec<String>,
    /// The depth the call arrives at (0 for a call from outside).
    #[serde(default, deserialize_with = "whole_u32")]
    pub depth: u32,
    /// How long the caller waits, in milliseconds: what its deadline has left.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "optional_whole_u64"
    )]
    pub timeout_ms: Option<u64>,
    /// The trace id of the caller's request: 32 lowercase hex digits
    /// ([`troupe_core::TraceId`]), continued by the callee's turn. Older Troupe sent a
    /// free-form per-call string (`{agent}-call-{n}`): still accepted up to
    /// [`REMOTE_TRACE_ID_LENGTH_MAX_BYTES`], but treated as absent ([`Self::trace`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
}

impl TroupeCallMetadata {
    /// The message `metadata` object that carries it: `{"troupe": {...}}`.
    pub fn to_metadata(&self) -> Value {
        json!({ TROUPE_METADATA_KEY: self })
    }

    /// Reads it from a message's `metadata`: `Ok(None)` when there is no
    /// `metadata.troupe` (a message from outside Troupe).
    ///
    /// # Errors
    /// What is wrong with `metadata.troupe`, naming the field.
    pub fn from_metadata(metadata: Option<&Map<String, Value>>) -> Result<Option<Self>, String> {
        let Some(value) = metadata.and_then(|metadata| metadata.get(TROUPE_METADATA_KEY)) else {
            return Ok(None);
        };
        let parsed: Self =
            serde_json::from_value(value.clone()).map_err(|error| format!("\"metadata.troupe\": {error}"))?;
        parsed.check()?;
        Ok(Some(parsed))
    }

    /// The request's trace id, when `trace_id` is one (32 lowercase hex digits, not all
    /// zero); `None` when it is absent or any other string (an older caller's free-form
    /// per-call id): the receiver then starts a trace of its own.
    pub fn trace(&self) -> Option<troupe_core::TraceId> {
        self.trace_id.as_deref().and_then(troupe_core::TraceId::parse_hex)
    }

    /// Checks the fields against each other and the limits.
    ///
    /// # Errors
    /// What is wrong, naming the field.
    pub fn check(&self) -> Result<(), String> {
        arrival_chain(&self.chain, self.depth).map_err(|fault| match fault {
            ChainFault::TooLong { entries, limit } => {
                format!("\"metadata.troupe.chain\" has {entries} entries, more than the limit of {limit}")
            }
            ChainFault::NotAnAgent { id, .. } => {
                format!("\"metadata.troupe.chain\" holds {id:?}, which is not an agent id")
            }
            ChainFault::ShallowerThanChain { depth, entries } => format!(
                "\"metadata.troupe.depth\" is {depth} but the chain has {entries} entries: a call is at least as deep as its chain is long"
            ),
        })?;
        if self.timeout_ms == Some(0) {
            return Err("\"metadata.troupe.timeout_ms\" is 0: the caller has no time left".into());
        }
        if self
            .trace_id
            .as_ref()
            .is_some_and(|trace| trace.len() > REMOTE_TRACE_ID_LENGTH_MAX_BYTES)
        {
            return Err(format!(
                "\"metadata.troupe.trace_id\" is longer than {REMOTE_TRACE_ID_LENGTH_MAX_BYTES} bytes"
            ));
        }
        Ok(())
    }

    /// Why Troupe's call rules refuse this call to agent `agent`, if they do: `agent`
    /// in the chain (a cycle, across servers), or a depth over the limit.
    pub fn refusal(&self, agent: &str) -> Option<CallRefused> {
        let ids = |ids: &[String]| ids.iter().filter_map(|id| agent_id(id).ok()).collect::<Vec<_>>();
        if self.chain.iter().any(|link| link == agent) {
            let mut chain = ids(&self.chain);
            chain.extend(agent_id(agent).ok());
            return Some(CallRefused::CycleDetected { chain });
        }
        if self.depth > AGENT_CALL_DEPTH_MAX {
            return Some(CallRefused::DepthExceeded {
                depth: self.depth.saturating_sub(1),
                max: AGENT_CALL_DEPTH_MAX,
            });
        }
        None
    }
}

/// A non-negative whole number given as an integer or a double (`2` or `2.0`).
fn whole<T: TryFrom<u64>, E: serde::de::Error>(value: f64) -> Result<T, E> {
    if value.fract() != 0.0 || value < 0.0 || value > u64::MAX as f64 {
        return Err(E::custom(format!("expected a non-negative whole number, got {value}")));
    }
    // Exact: a whole double in range.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    T::try_from(value as u64).map_err(|_| E::custom(format!("{value} is out of range")))
}

fn whole_u32<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
    whole(f64::deserialize(deserializer)?)
}

fn optional_whole_u64<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    Option::<f64>::deserialize(deserializer)?.map(whole).transpose()
}

/// Why a call to a remote agent produced no answer (besides a timeout, which is
/// [`InvokeError::Timeout`] as for a local call).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RemoteCallError {
    /// The server could not be reached (connection refused, DNS, reset).
    #[error("remote agent {agent} at {url} is unreachable: {cause}")]
    Unreachable {
        /// The local id.
        agent: String,
        /// Its endpoint.
        url: String,
        /// Why.
        cause: String,
    },
    /// The server answered with an HTTP error status.
    #[error("remote agent {agent} at {url} answered HTTP {status}: {body}")]
    Status {
        /// The local id.
        agent: String,
        /// Its endpoint.
        url: String,
        /// The status code.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// The remote agent is busy or its server full: retry later.
    #[error("remote agent {agent} at {url} is busy (HTTP {status}); retry later")]
    Busy {
        /// The local id.
        agent: String,
        /// Its endpoint.
        url: String,
        /// 429 or 503.
        status: u16,
    },
    /// The server answered a JSON-RPC error.
    #[error("remote agent {agent} at {url} answered error {code}: {message}")]
    Rpc {
        /// The local id.
        agent: String,
        /// Its endpoint.
        url: String,
        /// The JSON-RPC error code.
        code: i64,
        /// Its message.
        message: String,
    },
    /// The remote side refused the call (its cycle or depth check, an unknown agent):
    /// the task was rejected.
    #[error("remote agent {agent} at {url} refused the call: {reason}")]
    Refused {
        /// The local id.
        agent: String,
        /// Its endpoint.
        url: String,
        /// The remote side's reason.
        reason: String,
    },
    /// The remote agent's task failed or was canceled.
    #[error("remote agent {agent} at {url} failed: {reason}")]
    Failed {
        /// The local id.
        agent: String,
        /// Its endpoint.
        url: String,
        /// The remote side's reason.
        reason: String,
    },
    /// The answer is not an A2A answer this client understands.
    #[error("remote agent {agent} at {url} gave an answer that could not be read: {cause}")]
    Malformed {
        /// The local id.
        agent: String,
        /// Its endpoint.
        url: String,
        /// Why.
        cause: String,
    },
    /// The token's environment variable is not set.
    #[error("remote agent {agent}: its token variable {variable} is not set; set it in the server's environment")]
    TokenMissing {
        /// The local id.
        agent: String,
        /// The variable.
        variable: String,
    },
}

/// A call to remote agent `remote` that admission let through: `child` is the callee's
/// context (chain with the caller, depth, deadline), `timeout` what it has left, and
/// `allowed_ms` the time the caller allowed (what a timeout's error names).
#[cfg_attr(madsim, allow(dead_code))]
pub(crate) struct RemoteCall<'a> {
    pub(crate) remote: &'a RemoteAgent,
    pub(crate) target: &'a ActorId,
    pub(crate) text: &'a str,
    pub(crate) child: &'a CallContext,
    pub(crate) timeout: Duration,
    /// The time the caller allowed when admission let the call through, in
    /// milliseconds: a timeout names it. `timeout` is read later (after an approval's
    /// wait, and from a second clock reading): a call given 100 ms said "timed out
    /// after 99 ms", one that waited 1.5 s of 3 s for its approval "after 1499 ms".
    pub(crate) allowed_ms: u64,
    /// What goes in `metadata.troupe.trace_id`: the caller's trace id in hex, or
    /// (a caller without one) a per-call id for the logs, which the callee ignores.
    pub(crate) trace_id: String,
    /// The A2A `messageId` of the call's message: unique per call (a server takes a
    /// message sent again with the same id as the task it already started).
    pub(crate) message_id: String,
}

#[cfg_attr(madsim, allow(dead_code))]
impl RemoteCall<'_> {
    /// The metadata this call carries.
    pub(crate) fn metadata(&self) -> TroupeCallMetadata {
        TroupeCallMetadata {
            chain: self.child.chain().iter().map(|id| id.key().to_string()).collect(),
            depth: self.child.depth(),
            timeout_ms: Some(u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX).max(1)),
            trace_id: Some(self.trace_id.clone()),
        }
    }

    fn timed_out(&self) -> AgentCallError {
        AgentCallError::Invoke(InvokeError::Timeout {
            target: self.target.clone(),
            timeout_ms: self.allowed_ms,
        })
    }
}

/// Sends the call and waits for the answer, at most the call's timeout.
pub(crate) async fn call_remote(
    directory: &RemoteDirectory,
    call: RemoteCall<'_>,
) -> Result<AgentReply, AgentCallError> {
    #[cfg(not(madsim))]
    {
        let timeout = call.timeout;
        match tokio::time::timeout(timeout, http::send(directory, &call)).await {
            Ok(result) => result,
            Err(_) => Err(call.timed_out()),
        }
    }
    #[cfg(madsim)]
    {
        let _ = directory;
        Err(AgentCallError::Remote(RemoteCallError::Unreachable {
            agent: call.remote.id.clone(),
            url: call.remote.url.clone(),
            cause: "remote agents are not reachable under the simulator (HTTP is not simulated)".into(),
        }))
    }
}

/// A completed A2A task or message as an [`AgentReply`]: the reply text, and the
/// remote turn's steps and token usage when it is a Troupe server's.
#[cfg_attr(madsim, allow(dead_code))] // the HTTP client is not built under madsim
pub(crate) fn reply_of(remote: &RemoteAgent, result: &Value) -> Result<Outcome, AgentCallError> {
    let malformed = |cause: String| {
        AgentCallError::Remote(RemoteCallError::Malformed {
            agent: remote.id.clone(),
            url: remote.url.clone(),
            cause,
        })
    };
    if let Some(message) = result.get("message") {
        return Ok(Outcome::Done(AgentReply {
            text: parts_text(message.get("parts")),
            truncated: false,
            steps: 0,
            usage: crate::TokenUsage::default(),
            spent: crate::Spend::default(),
            exhausted: None,
        }));
    }
    let Some(task) = result.get("task") else {
        return Err(malformed("the result holds neither a task nor a message".into()));
    };
    let Some(state) = task.pointer("/status/state").and_then(Value::as_str) else {
        return Err(malformed("the task has no status.state".into()));
    };
    let status_text = || parts_text(task.pointer("/status/message/parts"));
    match state {
        "TASK_STATE_COMPLETED" => {
            let text = task
                .get("artifacts")
                .and_then(Value::as_array)
                .and_then(|artifacts| artifacts.first())
                .map(|artifact| parts_text(artifact.get("parts")))
                .unwrap_or_else(status_text);
            let meta = task.pointer("/metadata/troupe/reply");
            let usage: crate::TokenUsage = meta
                .and_then(|meta| meta.get("usage"))
                .and_then(|usage| serde_json::from_value(usage.clone()).ok())
                .unwrap_or_default();
            let number = |key: &str| meta.and_then(|meta| meta.get(key)).and_then(Value::as_u64).unwrap_or(0);
            // Cut to the size of a local reply, as a local callee's is.
            let capped = truncate_utf8(&text, crate::limits::AGENT_REPLY_SIZE_MAX_BYTES).to_string();
            Ok(Outcome::Done(AgentReply {
                truncated: capped.len() < text.len()
                    || meta
                        .and_then(|meta| meta.get("truncated"))
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                text: capped,
                steps: u32::try_from(number("steps")).unwrap_or(u32::MAX),
                spent: crate::Spend {
                    tokens: usage.total_tokens,
                    tool_calls: 0,
                },
                usage,
                exhausted: None,
            }))
        }
        "TASK_STATE_REJECTED" => Err(AgentCallError::Remote(RemoteCallError::Refused {
            agent: remote.id.clone(),
            url: remote.url.clone(),
            reason: status_text(),
        })),
        "TASK_STATE_FAILED" | "TASK_STATE_CANCELED" => {
            let reason = status_text();
            if reason.starts_with("timeout:") {
                return Ok(Outcome::TimedOut);
            }
            Err(AgentCallError::Remote(RemoteCallError::Failed {
                agent: remote.id.clone(),
                url: remote.url.clone(),
                reason: if reason.is_empty() { state.to_string() } else { reason },
            }))
        }
        "TASK_STATE_SUBMITTED" | "TASK_STATE_WORKING" => match task.get("id").and_then(Value::as_str) {
            Some(id) => Ok(Outcome::Running(id.to_string())),
            None => Err(malformed("a running task has no id".into())),
        },
        other => Err(AgentCallError::Remote(RemoteCallError::Failed {
            agent: remote.id.clone(),
            url: remote.url.clone(),
            reason: format!("the task is in state {other}, which a call cannot answer"),
        })),
    }
}

/// What an A2A result says.
#[derive(Debug)]
#[cfg_attr(madsim, allow(dead_code))]
pub(crate) enum Outcome {
    /// The answer.
    Done(AgentReply),
    /// The task is still running (the server's blocking wait ended first): its id.
    Running(String),
    /// The remote turn ran out of time.
    TimedOut,
}

/// The text of A2A `parts`, joined with newlines.
#[cfg_attr(madsim, allow(dead_code))]
fn parts_text(parts: Option<&Value>) -> String {
    parts
        .and_then(Value::as_array)
        .map(|parts| {
            parts
                .iter()
                .filter_map(|part| part.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default()
}

#[cfg(not(madsim))]
mod http {
    use super::*;

    /// The JSON-RPC request of a call.
    pub(super) fn send_message_body(call: &RemoteCall<'_>) -> Value {
        json!({
            "jsonrpc": "2.0",
            "id": call.trace_id,
            "method": "SendMessage",
            "params": {
                "message": {
                    "messageId": call.message_id,
                    "role": "ROLE_USER",
                    "parts": [{"text": truncate_utf8(call.text, AGENT_MESSAGE_SIZE_MAX_BYTES)}],
                    "metadata": call.metadata().to_metadata(),
                },
                "configuration": {"acceptedOutputModes": ["text/plain"]},
            },
        })
    }

    pub(super) async fn send(directory: &RemoteDirectory, call: &RemoteCall<'_>) -> Result<AgentReply, AgentCallError> {
        let remote = call.remote;
        let client = directory.http().map_err(|cause| {
            AgentCallError::Remote(RemoteCallError::Unreachable {
                agent: remote.id.clone(),
                url: remote.url.clone(),
                cause,
            })
        })?;
        let token = match &remote.token {
            RemoteToken::None => None,
            RemoteToken::Literal(token) => Some(token.clone()),
            RemoteToken::Env(variable) => match std::env::var(variable) {
                Ok(token) if !token.is_empty() => Some(token),
                _ => {
                    return Err(AgentCallError::Remote(RemoteCallError::TokenMissing {
                        agent: remote.id.clone(),
                        variable: variable.clone(),
                    }))
                }
            },
        };
        let started = tokio::time::Instant::now();
        let mut result = rpc(client, call, token.as_deref(), send_message_body(call)).await?;
        loop {
            match reply_of(remote, &result)? {
                Outcome::Done(reply) => return Ok(reply),
                Outcome::TimedOut => return Err(call.timed_out()),
                Outcome::Running(task) => {
                    // The server's blocking wait ended before the task: read it again
                    // until it ends (the caller's timeout bounds the loop).
                    if started.elapsed() >= call.timeout {
                        return Err(call.timed_out());
                    }
                    tokio::time::sleep(Duration::from_millis(REMOTE_TASK_POLL_INTERVAL_MS)).await;
                    let body = json!({
                        "jsonrpc": "2.0",
                        "id": call.trace_id,
                        "method": "GetTask",
                        "params": {"id": task},
                    });
                    let task = rpc(client, call, token.as_deref(), body).await?;
                    result = json!({ "task": task });
                }
            }
        }
    }

    /// One JSON-RPC exchange: its `result`, or the typed error.
    async fn rpc(
        client: &reqwest::Client,
        call: &RemoteCall<'_>,
        token: Option<&str>,
        body: Value,
    ) -> Result<Value, AgentCallError> {
        let remote = call.remote;
        let failure = |error: RemoteCallError| AgentCallError::Remote(error);
        let mut request = client
            .post(&remote.url)
            .timeout(call.timeout)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header("A2A-Version", "1.0")
            .body(body.to_string());
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(traceparent) = crate::export_hooks::current_traceparent() {
            request = request.header("traceparent", traceparent);
        }
        let response = request.send().await.map_err(|error| {
            if error.is_timeout() {
                call.timed_out()
            } else {
                failure(RemoteCallError::Unreachable {
                    agent: remote.id.clone(),
                    url: remote.url.clone(),
                    cause: describe(&error),
                })
            }
        })?;
        let status = response.status().as_u16();
        let bytes = read_capped(response).await.map_err(|(timeout, cause)| {
            if timeout {
                call.timed_out()
            } else {
                failure(RemoteCallError::Malformed {
                    agent: remote.id.clone(),
                    url: remote.url.clone(),
                    cause,
                })
            }
        })?;
        if status == 429 || status == 503 {
            return Err(failure(RemoteCallError::Busy {
                agent: remote.id.clone(),
                url: remote.url.clone(),
                status,
            }));
        }
        if status != 200 {
            let text = String::from_utf8_lossy(&bytes);
            return Err(failure(RemoteCallError::Status {
                agent: remote.id.clone(),
                url: remote.url.clone(),
                status,
                body: truncate_utf8(text.trim(), REMOTE_ERROR_BODY_QUOTED_MAX_BYTES).to_string(),
            }));
        }
        let answer: Value = serde_json::from_slice(&bytes).map_err(|error| {
            failure(RemoteCallError::Malformed {
                agent: remote.id.clone(),
                url: remote.url.clone(),
                cause: format!("the body is not JSON: {error}"),
            })
        })?;
        if let Some(error) = answer.get("error") {
            return Err(failure(RemoteCallError::Rpc {
                agent: remote.id.clone(),
                url: remote.url.clone(),
                code: error.get("code").and_then(Value::as_i64).unwrap_or(0),
                message: error
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("(no message)")
                    .to_string(),
            }));
        }
        answer.get("result").cloned().ok_or_else(|| {
            failure(RemoteCallError::Malformed {
                agent: remote.id.clone(),
                url: remote.url.clone(),
                cause: "the answer has neither result nor error".into(),
            })
        })
    }

    /// At most [`REMOTE_RESPONSE_SIZE_MAX_BYTES`] of the body; the error says whether
    /// it was a timeout.
    async fn read_capped(mut response: reqwest::Response) -> Result<Vec<u8>, (bool, String)> {
        let mut bytes = Vec::new();
        loop {
            match response.chunk().await {
                Ok(None) => return Ok(bytes),
                Ok(Some(chunk)) => {
                    if bytes.len() + chunk.len() > REMOTE_RESPONSE_SIZE_MAX_BYTES {
                        return Err((
                            false,
                            format!("the answer is larger than {REMOTE_RESPONSE_SIZE_MAX_BYTES} bytes"),
                        ));
                    }
                    bytes.extend_from_slice(&chunk);
                }
                Err(error) => {
                    return Err((
                        error.is_timeout(),
                        format!("reading the answer failed: {}", describe(&error)),
                    ))
                }
            }
        }
    }

    /// A reqwest error with its causes (the URL is in it, never the token).
    fn describe(error: &reqwest::Error) -> String {
        let mut text = error.to_string();
        let mut source = std::error::Error::source(error);
        while let Some(cause) = source {
            text.push_str(": ");
            text.push_str(&cause.to_string());
            source = cause.source();
        }
        text
    }
}

impl AgentClient {
    /// Makes `remote` callable by its local id, as a local agent is: `call_agent` sends
    /// it an A2A message. A remote agent of the same id is replaced.
    ///
    /// # Errors
    /// [`RemoteAgentError`]: an invalid id, URL or token variable; the id of a local
    /// agent; too many remote agents.
    pub fn add_remote_agent(&self, remote: RemoteAgent) -> Result<(), RemoteAgentError> {
        if self.shared.directory.contains(&remote.id) {
            return Err(RemoteAgentError::ClashesWithLocal { id: remote.id });
        }
        self.shared.remotes.upsert(remote)
    }

    /// The remote agents known, by local id.
    pub fn remote_agents(&self) -> Vec<RemoteAgent> {
        self.shared.remotes.list()
    }

    /// Asks agent `agent` on behalf of a call that arrived from another server with
    /// Troupe's call context `context`: refused at once (nothing runs) if `agent` is in
    /// its chain or the depth is over the limit; otherwise the agent's turn runs at the
    /// context's depth, with its chain, until `deadline` (at most the longest invoke
    /// timeout from now), so the agent's own calls continue that chain. On a cluster
    /// node it runs on the agent's owner (routed with the context).
    ///
    /// # Errors
    /// [`AgentCallError::Refused`] with `CycleDetected`, `DepthExceeded` or
    /// `AgentNotFound`; otherwise as [`AgentClient::ask_with_timeout`].
    pub async fn ask_continued(
        &self,
        agent: &str,
        text: &str,
        context: &TroupeCallMetadata,
        deadline: Deadline,
    ) -> Result<AgentReply, AgentCallError> {
        let target = agent_id(agent).map_err(|error| AgentCallError::InvalidAgentId {
            agent_id: agent.to_string(),
            cause: error.to_string(),
        })?;
        context.check().map_err(|cause| {
            AgentCallError::Invoke(InvokeError::Rejected {
                target: target.clone(),
                reason: cause,
            })
        })?;
        let call = self.shared.next_call_id();
        self.shared.emit(&AgentEvent::CallStarted {
            call,
            parent: None,
            caller: None,
            target: target.clone(),
            depth: context.depth,
            at: self.runtime.now(),
        });
        let result = if let Some(refused) = context.refusal(agent) {
            Err(AgentCallError::Refused(refused))
        } else if !self.lists_agent(agent).await {
            Err(AgentCallError::Refused(CallRefused::AgentNotFound {
                target: target.clone(),
            }))
        } else {
            let chain = context.chain.iter().filter_map(|id| agent_id(id).ok()).collect();
            let latest = self.runtime.deadline_in(Duration::from_millis(INVOKE_TIMEOUT_MS_MAX));
            let mut call_context = CallContext::continued(context.depth, chain, deadline.min(latest));
            if let Some(trace) = context.trace() {
                call_context = call_context.with_trace_id(trace);
            }
            let request = AgentRequest {
                text: truncate_utf8(text, AGENT_MESSAGE_SIZE_MAX_BYTES).to_string(),
                from: None,
                call: Some(call),
                budget: Budget::UNLIMITED,
            };
            // Routed with its context: on a cluster node the turn runs on the agent's
            // owner, at the caller's depth, with its chain and trace id.
            crate::system::ask_from_outside(&self.runtime, &target, request, call_context).await
        };
        self.outside_call_finished(call, result)
    }
}

/// What is wrong with the chain and depth a call arrives with ([`arrival_chain`]).
pub(crate) enum ChainFault {
    /// More entries than any call tree has (`AGENT_CALL_DEPTH_MAX + 1`).
    TooLong { entries: usize, limit: usize },
    /// An entry that is not an agent id.
    NotAnAgent { id: String, cause: String },
    /// A depth below the chain's length (every agent in the chain is one call deeper).
    ShallowerThanChain { depth: u32, entries: usize },
}

/// The chain a call arrives through, as agent ids, once checked by Troupe's rules for
/// arrivals (over A2A, [`TroupeCallMetadata::check`]; from an embedder,
/// `AgentClient::delegate_external`): at most `AGENT_CALL_DEPTH_MAX + 1` entries, each
/// an agent id, and a depth at least the chain's length (`CallContext::continued`
/// asserts the last). Each caller words the fault for its own input.
pub(crate) fn arrival_chain(chain: &[String], depth: u32) -> Result<Vec<ActorId>, ChainFault> {
    let limit = AGENT_CALL_DEPTH_MAX as usize + 1;
    if chain.len() > limit {
        return Err(ChainFault::TooLong {
            entries: chain.len(),
            limit,
        });
    }
    let ids = chain
        .iter()
        .map(|id| {
            agent_id(id).map_err(|error| ChainFault::NotAnAgent {
                id: id.clone(),
                cause: error.to_string(),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if (depth as usize) < ids.len() {
        return Err(ChainFault::ShallowerThanChain {
            depth,
            entries: ids.len(),
        });
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(key: &str) -> ActorId {
        agent_id(key).unwrap()
    }

    #[test]
    fn a_hex_trace_id_is_continued_and_an_older_free_form_one_is_treated_as_absent() {
        let with = |trace: &str| TroupeCallMetadata {
            trace_id: Some(trace.to_string()),
            ..TroupeCallMetadata::default()
        };
        let hex = "0af7651916cd43dd8448eb211c80319c";
        assert_eq!(
            with(hex).trace(),
            Some(troupe_core::TraceId::new(0x0af7_6519_16cd_43dd_8448_eb21_1c80_319c))
        );
        for older in ["a-call-7", "0AF7651916CD43DD8448EB211C80319C", ""] {
            assert!(with(older).check().is_ok(), "still accepted: {older:?}");
            assert_eq!(with(older).trace(), None, "{older:?}");
        }
        assert_eq!(TroupeCallMetadata::default().trace(), None);
    }

    #[test]
    fn the_metadata_a_call_sends_carries_chain_depth_deadline_and_trace() {
        let child = CallContext::root(Deadline::from_micros(10_000_000))
            .child(agent("a"), Deadline::from_micros(10_000_000))
            .child(agent("b"), Deadline::from_micros(10_000_000));
        let remote = RemoteAgent::new("hq", "http://127.0.0.1:1/a2a/hq");
        let call = RemoteCall {
            remote: &remote,
            target: &agent("hq"),
            text: "hi",
            child: &child,
            timeout: Duration::from_millis(1_500),
            allowed_ms: 2_000,
            trace_id: "a-call-7".into(),
            message_id: "a-call-7.a-call-7".into(),
        };
        let metadata = call.metadata().to_metadata();
        assert_eq!(
            metadata,
            json!({"troupe": {"chain": ["a", "b"], "depth": 2, "timeout_ms": 1500, "trace_id": "a-call-7"}})
        );
        let read = TroupeCallMetadata::from_metadata(metadata.as_object())
            .unwrap()
            .unwrap();
        assert_eq!(read, call.metadata());
    }

    #[test]
    fn metadata_numbers_may_be_doubles_and_absent_metadata_is_none() {
        let metadata = json!({"troupe": {"chain": ["a"], "depth": 1.0, "timeout_ms": 2000.0}});
        let read = TroupeCallMetadata::from_metadata(metadata.as_object())
            .unwrap()
            .unwrap();
        assert_eq!((read.depth, read.timeout_ms), (1, Some(2_000)));
        assert_eq!(TroupeCallMetadata::from_metadata(None), Ok(None));
        assert_eq!(
            TroupeCallMetadata::from_metadata(json!({"other": 1}).as_object()),
            Ok(None)
        );
    }

    #[test]
    fn bad_metadata_is_refused_naming_the_field() {
        let cases = [
            (json!({"troupe": {"depth": 1.5}}), "whole number"),
            (json!({"troupe": {"chain": ["a", "b"], "depth": 1}}), "depth"),
            (json!({"troupe": {"chain": [""], "depth": 1}}), "chain"),
            (json!({"troupe": {"timeout_ms": 0}}), "timeout_ms"),
            (json!({"troupe": {"depht": 1}}), "unknown field"),
        ];
        for (metadata, needle) in cases {
            let error = TroupeCallMetadata::from_metadata(metadata.as_object()).unwrap_err();
            assert!(error.contains(needle), "{metadata}: {error}");
        }
    }

    #[test]
    fn a_target_in_the_chain_is_a_cycle_naming_the_chain_and_too_deep_is_refused() {
        let context = TroupeCallMetadata {
            chain: vec!["a".into(), "b".into()],
            depth: 2,
            ..TroupeCallMetadata::default()
        };
        assert_eq!(
            context.refusal("a"),
            Some(CallRefused::CycleDetected {
                chain: vec![agent("a"), agent("b"), agent("a")]
            })
        );
        assert_eq!(context.refusal("c"), None);
        let deep = TroupeCallMetadata {
            depth: AGENT_CALL_DEPTH_MAX + 1,
            ..TroupeCallMetadata::default()
        };
        assert!(matches!(deep.refusal("c"), Some(CallRefused::DepthExceeded { .. })));
    }

    #[test]
    fn remote_agents_are_validated() {
        assert!(RemoteAgent::new("hq", "http://127.0.0.1:8080/a2a/hq")
            .validate()
            .is_ok());
        assert!(matches!(
            RemoteAgent::new("hq", "ftp://x/a2a/hq").validate(),
            Err(RemoteAgentError::InvalidUrl { .. })
        ));
        assert!(matches!(
            RemoteAgent::new("hq", "http:///a2a").validate(),
            Err(RemoteAgentError::InvalidUrl { .. })
        ));
        assert!(matches!(
            RemoteAgent::new("", "http://x/a2a/hq").validate(),
            Err(RemoteAgentError::InvalidId { .. })
        ));
        assert!(matches!(
            RemoteAgent::new("hq", "http://x/a2a/hq").token_env("1BAD").validate(),
            Err(RemoteAgentError::InvalidTokenEnv { .. })
        ));
        let secret = RemoteAgent::new("hq", "http://x/a2a/hq").bearer_token("s3cret-token-value");
        assert!(!format!("{secret:?}").contains("s3cret"));
    }

    #[test]
    fn a2a_results_map_to_replies_and_typed_errors() {
        let remote = RemoteAgent::new("hq", "http://127.0.0.1:1/a2a/hq");
        let completed = json!({"task": {"id": "t", "status": {"state": "TASK_STATE_COMPLETED"},
            "artifacts": [{"parts": [{"text": "the answer"}]}],
            "metadata": {"troupe": {"reply": {"steps": 2, "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}, "truncated": false}}}}});
        match reply_of(&remote, &completed).unwrap() {
            Outcome::Done(reply) => {
                assert_eq!(
                    (reply.text.as_str(), reply.steps, reply.spent.tokens),
                    ("the answer", 2, 7)
                );
            }
            other => panic!("{other:?}"),
        }
        let rejected = json!({"task": {"id": "t", "status": {"state": "TASK_STATE_REJECTED",
            "message": {"parts": [{"text": "refused: a cycle"}]}}}});
        let error = reply_of(&remote, &rejected).unwrap_err();
        assert!(
            matches!(error, AgentCallError::Remote(RemoteCallError::Refused { .. })),
            "{error:?}"
        );
        assert!(error.to_string().contains("http://127.0.0.1:1/a2a/hq"), "{error}");
        let timed_out = json!({"task": {"id": "t", "status": {"state": "TASK_STATE_FAILED",
            "message": {"parts": [{"text": "timeout: timed out after 5 ms"}]}}}});
        assert!(matches!(reply_of(&remote, &timed_out), Ok(Outcome::TimedOut)));
        let working = json!({"task": {"id": "t-9", "status": {"state": "TASK_STATE_WORKING"}}});
        assert!(matches!(reply_of(&remote, &working), Ok(Outcome::Running(id)) if id == "t-9"));
        assert!(matches!(
            reply_of(&remote, &json!({})),
            Err(AgentCallError::Remote(RemoteCallError::Malformed { .. }))
        ));
    }
}

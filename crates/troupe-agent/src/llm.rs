//! The language-model boundary: [`LlmClient`] and the chat types it speaks.
//!
//! Everything the agent layer needs from a model goes through this trait, so the
//! simulator and tests use a scripted, deterministic client while production uses an
//! HTTP client; HTTP never runs inside simulated code.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use troupe_core::{ActorId, Deadline};

/// Who wrote a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// Instructions that frame the conversation.
    System,
    /// The input the agent answers (a person or another agent).
    User,
    /// The model's own output.
    Assistant,
    /// The result of a tool call the model asked for.
    Tool,
}

/// One tool call the model asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The model's id for this call; the tool result refers to it.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments, a JSON object that is validated against the tool's schema.
    pub arguments: serde_json::Value,
}

/// One message of a chat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who wrote it.
    pub role: Role,
    /// Its text (may be empty for an assistant message that only calls tools).
    pub content: String,
    /// Tool calls requested (assistant messages only).
    pub tool_calls: Vec<ToolCall>,
    /// The call this message answers (tool messages only).
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message with `role` and `content` and nothing else.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// The result of tool call `tool_call_id`.
    pub fn tool_result(tool_call_id: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: Role::Tool,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: Some(tool_call_id.into()),
        }
    }
}

/// A tool as the model sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// Its name, as the model will call it.
    pub name: String,
    /// What it does, for the model.
    pub description: String,
    /// A JSON schema of its arguments (an object schema).
    pub parameters: serde_json::Value,
}

/// One request to the model.
#[derive(Debug, Clone, PartialEq)]
pub struct LlmRequest {
    /// The agent asking (scripted clients pick their script by it).
    pub agent: ActorId,
    /// The model name from the agent's settings.
    pub model: String,
    /// The chat so far, system prompt first.
    pub messages: Vec<ChatMessage>,
    /// The tools the model may call: shared, as every step of every turn offers the
    /// same list (`vec![...].into()` makes one).
    pub tools: Arc<[ToolSpec]>,
    /// When the answer must have arrived, on the runtime's clock.
    pub deadline: Deadline,
    /// The most tokens, prompt and completion together, this call may be charged: what
    /// is left of the turn's [`crate::Budget`] (`None`: unlimited). A client must not
    /// bill past it: [`crate::ScriptedLlm`] answers [`LlmError::OverTokenLimit`] instead;
    /// an OpenAI-compatible provider only caps the completion (`max_tokens`), so its
    /// prompt can overshoot and the turn then ends with its budget exhausted.
    pub max_tokens: Option<u64>,
}

/// How many tokens one model call used, as the provider counted them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TokenUsage {
    /// Tokens of the request (the chat and the tool specs).
    pub prompt_tokens: u64,
    /// Tokens of the answer.
    pub completion_tokens: u64,
    /// Their sum, as reported (not recomputed).
    pub total_tokens: u64,
}

/// The model's answer: text, tool calls, or both.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlmReply {
    /// The assistant message.
    pub message: ChatMessage,
    /// The tokens the call used; `None` when the provider did not say.
    #[serde(default)]
    pub usage: Option<TokenUsage>,
}

impl LlmReply {
    /// A reply of `message` with no usage reported.
    pub fn new(message: ChatMessage) -> Self {
        Self { message, usage: None }
    }

    /// This reply with `usage`.
    #[must_use]
    pub fn with_usage(mut self, usage: TokenUsage) -> Self {
        self.usage = Some(usage);
        self
    }
}

/// Why the model gave no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum LlmError {
    /// No answer before the deadline.
    #[error("the model did not answer within {timeout_ms} ms")]
    Timeout {
        /// The time allowed, in milliseconds.
        timeout_ms: u64,
    },
    /// The provider answered with an error status.
    #[error("the model provider answered {status}: {body}")]
    Provider {
        /// The HTTP status.
        status: u16,
        /// The start of the response body.
        body: String,
    },
    /// The provider could not be reached.
    #[error("the model provider is unreachable: {cause}")]
    Unreachable {
        /// What failed.
        cause: String,
    },
    /// The answer could not be understood.
    #[error("the model's answer is malformed: {cause}")]
    Malformed {
        /// What was wrong.
        cause: String,
    },
    /// The answer would use more tokens than the call's cap (`LlmRequest::max_tokens`);
    /// nothing was charged. The agent reports it as its budget exhausted.
    #[error("the answer needs {needed} tokens, more than the {max_tokens} this call may use")]
    OverTokenLimit {
        /// Tokens the answer would have used, prompt included.
        needed: u64,
        /// The call's cap.
        max_tokens: u64,
    },
    /// A failure injected by a script or the simulator.
    #[error("injected model failure: {cause}")]
    Injected {
        /// What the script said.
        cause: String,
    },
}

/// A chat-completions model with tool calling.
#[async_trait]
pub trait LlmClient: Send + Sync + 'static {
    /// Asks the model for the next assistant message.
    ///
    /// # Errors
    /// [`LlmError`]; the agent's turn reports it to its caller.
    async fn complete(&self, request: LlmRequest) -> Result<LlmReply, LlmError>;
}

/// An [`LlmClient`] that sends each agent's requests to the client chosen for it, and
/// every other agent's to a default: per-agent models and providers (a local model for
/// one agent, a hosted one for the rest) while [`crate::AgentSpec`] stays plain data.
/// The agent is `LlmRequest::agent`'s key, the id given to `AgentSpec::new`.
///
/// # Examples
/// ```
/// use std::sync::Arc;
/// use troupe_agent::{LlmRouter, ScriptRule, ScriptedLlm};
/// let cheap = Arc::new(ScriptedLlm::new().rule(ScriptRule::agent("summarizer").reply("short")));
/// let default = Arc::new(ScriptedLlm::new());
/// let llm = LlmRouter::new(default).route("summarizer", cheap);
/// assert_eq!(llm.routed_agents(), vec!["summarizer"]);
/// ```
#[derive(Clone)]
pub struct LlmRouter {
    default: Arc<dyn LlmClient>,
    routes: BTreeMap<String, Arc<dyn LlmClient>>,
}

impl std::fmt::Debug for LlmRouter {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("LlmRouter")
            .field("routed_agents", &self.routed_agents())
            .finish_non_exhaustive()
    }
}

impl LlmRouter {
    /// A router sending every agent to `default`.
    pub fn new(default: Arc<dyn LlmClient>) -> Self {
        Self {
            default,
            routes: BTreeMap::new(),
        }
    }

    /// This router, sending agent `agent_id`'s requests to `client` (a later route for
    /// the same agent replaces an earlier one).
    #[must_use]
    pub fn route(mut self, agent_id: impl Into<String>, client: Arc<dyn LlmClient>) -> Self {
        self.routes.insert(agent_id.into(), client);
        self
    }

    /// The agents with a client of their own, in order.
    pub fn routed_agents(&self) -> Vec<&str> {
        self.routes.keys().map(String::as_str).collect()
    }
}

#[async_trait]
impl LlmClient for LlmRouter {
    async fn complete(&self, request: LlmRequest) -> Result<LlmReply, LlmError> {
        let client = self.routes.get(request.agent.key()).unwrap_or(&self.default);
        client.complete(request).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ScriptRule, ScriptedLlm};

    fn request(agent: &str) -> LlmRequest {
        LlmRequest {
            agent: ActorId::new("agent", agent).unwrap(),
            model: String::new(),
            messages: vec![ChatMessage::new(Role::User, "hi")],
            tools: Vec::new().into(),
            deadline: Deadline::from_micros(u64::MAX),
            max_tokens: None,
        }
    }

    #[tokio::test]
    async fn each_agent_reaches_its_own_client_and_the_rest_the_default() {
        let local = Arc::new(ScriptedLlm::new().rule(ScriptRule::agent("summarizer").reply("from local")));
        let hosted = Arc::new(ScriptedLlm::new().rule(ScriptRule::agent("planner").reply("from hosted")));
        let router = LlmRouter::new(hosted.clone()).route("summarizer", local.clone());

        let summarizer = router.complete(request("summarizer")).await.unwrap();
        let planner = router.complete(request("planner")).await.unwrap();

        assert_eq!(summarizer.message.content, "from local");
        assert_eq!(planner.message.content, "from hosted");
        assert_eq!(local.requests().len(), 1);
        assert_eq!(hosted.requests().len(), 1);
        assert_eq!(hosted.requests()[0].agent.key(), "planner");
    }
}

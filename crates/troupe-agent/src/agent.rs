//! The agent actor: an LLM-driven virtual actor of kind `"agent"`.
//!
//! One turn handles one inbound [`AgentRequest`]:
//!
//! ```text
//! decode request ─► user message ─► loop (≤ AGENT_TURN_STEPS_MAX model steps) {
//!     prompt = system prompt + directory of peers + history window + this turn's messages
//!     model.complete(prompt, tool specs)   clipped to the turn's deadline
//!     no tool calls? → final answer, stop
//!     run this step's tool calls concurrently (each validated, clipped to the deadline)
//!     append the tool results }
//! ─► append this turn's messages to the log (`log/{seq:020}`, one write each) and to
//!    the bounded window in the snapshot ─► reply (capped at AGENT_REPLY_SIZE_MAX_BYTES)
//! ```
//!
//! The runtime commits the log writes and the snapshot atomically after the turn, so a
//! failed, timed-out or cancelled turn leaves no trace of its messages. State and log are
//! JSON (tool arguments are arbitrary JSON), readable with `sqlite3` in the SQLite store.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe_core::{truncate_utf8, ActorId, Deadline, IdError};
use troupe_runtime::{Actor, ActorError, ActorFactory, Clock, RuntimeHandle, Turn};

use crate::inbox::{AgentCommand, PendingSends, SharedSends};
use crate::limits::{
    AGENT_HISTORY_WINDOW_MAX, AGENT_MESSAGE_SIZE_MAX_BYTES, AGENT_REPLY_SIZE_MAX_BYTES,
    AGENT_SYSTEM_PROMPT_SIZE_MAX_BYTES, AGENT_TOOL_CALLS_PER_STEP_MAX, AGENT_TOOL_RESULT_SIZE_MAX_BYTES,
    AGENT_TURN_STEPS_MAX,
};
use crate::{
    AgentEvent, AgentObserver, ChatMessage, LlmClient, LlmError, LlmRequest, Role, TokenUsage, ToolCall,
    ToolExecutionContext, ToolRegistry, ToolSpec,
};

/// The actor kind of every agent.
pub const AGENT_KIND: &str = "agent";

/// The actor id of the agent with key `key`.
///
/// # Errors
/// [`IdError`] if `key` cannot be an actor key.
pub fn agent_id(key: &str) -> Result<ActorId, IdError> {
    ActorId::new(AGENT_KIND, key)
}

/// Which model an agent uses and how many steps a turn may take.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSettings {
    /// The model's name, passed to the [`LlmClient`]; empty means the client's default.
    pub model: String,
    /// Most model steps per turn; clipped to [`AGENT_TURN_STEPS_MAX`].
    pub max_steps: u32,
}

impl Default for ModelSettings {
    fn default() -> Self {
        Self {
            model: String::new(),
            max_steps: AGENT_TURN_STEPS_MAX,
        }
    }
}

/// Why an agent definition was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentSpecError {
    /// The id cannot be an actor key.
    #[error("agent id {id:?} is invalid: {cause}")]
    InvalidId {
        /// The id.
        id: String,
        /// Why.
        cause: IdError,
    },
    /// The system prompt is too long.
    #[error("the system prompt of {id} is {size} bytes, more than the limit of {limit}")]
    SystemPromptTooLong {
        /// The agent.
        id: String,
        /// Its size in bytes.
        size: usize,
        /// [`AGENT_SYSTEM_PROMPT_SIZE_MAX_BYTES`].
        limit: usize,
    },
    /// An agent with this id is already defined.
    #[error("agent {id:?} is already defined")]
    Duplicate {
        /// The id.
        id: String,
    },
}

/// The definition of an agent: who it is and how it thinks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentSpec {
    /// Its id, the key of its actor id (`agent/{id}`); what `call_agent` names.
    pub id: String,
    /// A display name.
    pub name: String,
    /// The instructions its model gets first.
    pub system_prompt: String,
    /// A one-line description of its job, shown to the other agents.
    pub role: String,
    /// Its model settings.
    pub model: ModelSettings,
}

impl AgentSpec {
    /// An agent named and identified `id`, with empty prompt and role.
    pub fn new(id: impl Into<String>) -> Self {
        let id = id.into();
        Self {
            name: id.clone(),
            id,
            system_prompt: String::new(),
            role: String::new(),
            model: ModelSettings::default(),
        }
    }

    /// Sets the display name.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Sets the system prompt.
    pub fn system_prompt(mut self, prompt: impl Into<String>) -> Self {
        self.system_prompt = prompt.into();
        self
    }

    /// Sets the role.
    pub fn role(mut self, role: impl Into<String>) -> Self {
        self.role = role.into();
        self
    }

    /// Sets the model name.
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model.model = model.into();
        self
    }

    /// Sets the most model steps per turn.
    pub fn max_steps(mut self, steps: u32) -> Self {
        self.model.max_steps = steps;
        self
    }

    /// Checks the id and the prompt size.
    ///
    /// # Errors
    /// [`AgentSpecError`].
    pub fn validate(&self) -> Result<(), AgentSpecError> {
        agent_id(&self.id).map_err(|cause| AgentSpecError::InvalidId {
            id: self.id.clone(),
            cause,
        })?;
        if self.system_prompt.len() > AGENT_SYSTEM_PROMPT_SIZE_MAX_BYTES {
            return Err(AgentSpecError::SystemPromptTooLong {
                id: self.id.clone(),
                size: self.system_prompt.len(),
                limit: AGENT_SYSTEM_PROMPT_SIZE_MAX_BYTES,
            });
        }
        Ok(())
    }
}

/// The agents that exist, by id; shared by the factory, `call_agent` admission and the
/// embedding API. An agent not in the directory cannot be called or activated.
///
/// The directory lives in memory: agent definitions are the application's code or
/// configuration, registered again when it starts (as [`crate::AgentSystemBuilder::agent`]
/// does). What must survive a restart, each agent's conversation, is in the store; each
/// snapshot also keeps the definition the agent last ran with, and the directory's
/// current definition replaces it on the next turn.
#[derive(Debug, Clone, Default)]
pub struct AgentDirectory {
    agents: Arc<RwLock<BTreeMap<String, AgentSpec>>>,
}

impl AgentDirectory {
    /// An empty directory.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds or replaces an agent; its next turn uses the new definition and keeps its
    /// history.
    ///
    /// # Errors
    /// [`AgentSpecError`] if the definition is invalid.
    pub fn upsert(&self, spec: AgentSpec) -> Result<(), AgentSpecError> {
        spec.validate()?;
        self.agents.write().unwrap().insert(spec.id.clone(), spec);
        Ok(())
    }

    /// Removes agent `id` from the directory and returns its definition. It can no
    /// longer be called or activated; an activation that is live keeps running until it
    /// is deactivated (see [`crate::AgentClient::remove_agent`], which does both).
    pub fn remove(&self, id: &str) -> Option<AgentSpec> {
        self.agents.write().unwrap().remove(id)
    }

    /// The definition of agent `id`.
    pub fn get(&self, id: &str) -> Option<AgentSpec> {
        self.agents.read().unwrap().get(id).cloned()
    }

    /// Whether agent `id` exists.
    pub fn contains(&self, id: &str) -> bool {
        self.agents.read().unwrap().contains_key(id)
    }

    /// Every definition, by id.
    pub fn list(&self) -> Vec<AgentSpec> {
        self.agents.read().unwrap().values().cloned().collect()
    }
}

/// What one agent sends another (bincode on the wire).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentRequest {
    /// The message.
    pub text: String,
    /// The calling agent; `None` from outside.
    pub from: Option<ActorId>,
    /// The observer's id of this call, if it is recorded.
    pub call: Option<u64>,
}

/// An agent's answer (bincode on the wire).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentReply {
    /// The final assistant text, at most [`AGENT_REPLY_SIZE_MAX_BYTES`].
    pub text: String,
    /// Whether `text` was cut to fit.
    pub truncated: bool,
    /// Model steps the turn took.
    pub steps: u32,
    /// Tokens the turn's model calls used, summed (calls that reported none add
    /// nothing); the turns of agents it called are not included.
    pub usage: TokenUsage,
}

impl AgentRequest {
    /// Encodes with bincode, as the ask command an agent's actor handles.
    pub fn encode(&self) -> Bytes {
        AgentCommand::Ask(self.clone()).encode()
    }

    /// Decodes an ask command from bincode.
    ///
    /// # Errors
    /// The decoding error, as text, or a command that is not an ask.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        match AgentCommand::decode(bytes)? {
            AgentCommand::Ask(request) => Ok(request),
            other => Err(format!("not an ask: {other:?}")),
        }
    }
}

impl AgentReply {
    /// Encodes with bincode.
    pub fn encode(&self) -> Bytes {
        Bytes::from(bincode::serialize(self).expect("an agent reply always serializes"))
    }

    /// Decodes from bincode.
    ///
    /// # Errors
    /// The decoding error, as text.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        bincode::deserialize(bytes).map_err(|error| error.to_string())
    }
}

/// What every agent of one system shares.
pub(crate) struct AgentShared {
    pub(crate) directory: AgentDirectory,
    pub(crate) llm: Arc<dyn LlmClient>,
    pub(crate) tools: ToolRegistry,
    /// The registry's specs, built once: every model request offers this list.
    pub(crate) tool_specs: Arc<[ToolSpec]>,
    pub(crate) observers: Vec<Arc<dyn AgentObserver>>,
    /// The organisation: links, permissions, approvals (`org_store.rs`).
    pub(crate) org: crate::org_store::OrgStore,
    /// The broadcast event stream ([`crate::AgentClient::subscribe`]).
    pub(crate) stream: tokio::sync::broadcast::Sender<AgentEvent>,
    next_call: AtomicU64,
    /// The runtime's clock, set once the runtime has started (before any agent can
    /// activate): the time of the events the hooks report, which have no turn at hand.
    clock: OnceLock<Clock>,
    /// The runtime, set once it has started: delivery tasks invoke through it.
    runtime: OnceLock<RuntimeHandle>,
}

impl AgentShared {
    pub(crate) fn new(
        directory: AgentDirectory,
        llm: Arc<dyn LlmClient>,
        tools: ToolRegistry,
        observers: Vec<Arc<dyn AgentObserver>>,
    ) -> Self {
        Self {
            directory,
            llm,
            tool_specs: tools.specs().into(),
            tools,
            observers,
            org: crate::org_store::OrgStore::new(),
            stream: tokio::sync::broadcast::channel(crate::limits::AGENT_EVENT_STREAM_CAPACITY).0,
            next_call: AtomicU64::new(1),
            clock: OnceLock::new(),
            runtime: OnceLock::new(),
        }
    }

    /// Records the runtime the agents run in (and its clock); the first call wins.
    pub(crate) fn set_runtime(&self, runtime: RuntimeHandle) {
        let _ = self.clock.set(runtime.clock());
        let _ = self.runtime.set(runtime);
    }

    /// The runtime, once started.
    pub(crate) fn runtime(&self) -> Option<RuntimeHandle> {
        self.runtime.get().cloned()
    }

    /// The current time on the runtime's clock.
    ///
    /// # Panics
    /// Before [`AgentShared::set_runtime`]: the system sets it as soon as its runtime
    /// starts, before any agent can be activated.
    pub(crate) fn now(&self) -> Deadline {
        self.clock
            .get()
            .expect("the agent system sets the runtime's clock when it starts")
            .now()
    }

    pub(crate) fn next_call_id(&self) -> u64 {
        self.next_call.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn emit(&self, event: &AgentEvent) {
        for observer in &self.observers {
            observer.on_event(event);
        }
        if self.stream.receiver_count() > 0 {
            // Never waits: a slow subscriber loses the oldest events and sees `Lagged`.
            let _ = self.stream.send(event.clone());
        }
    }

    /// Whether anyone receives events (an observer or a stream subscriber).
    pub(crate) fn has_listeners(&self) -> bool {
        !self.observers.is_empty() || self.stream.receiver_count() > 0
    }
}

/// An agent in memory: its definition, the recent conversation (the window: the last
/// messages of its log) and how long its full log is.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AgentState {
    pub(crate) spec: AgentSpec,
    pub(crate) window: Vec<ChatMessage>,
    /// Whether `window` holds the log's last `saved_window` messages yet: after an
    /// activation it is read from the log at the first turn.
    window_loaded: bool,
    /// The window's length when the state was loaded.
    saved_window: u64,
    pub(crate) log_length: u64,
    pub(crate) turns: u64,
    pub(crate) boxes: BoxCounters,
}

/// The counters of an agent's inbox and outbox (see `inbox.rs`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BoxCounters {
    /// The seq of the next inbox entry.
    #[serde(default)]
    pub(crate) inbox_next: u64,
    /// Entries in the inbox.
    #[serde(default)]
    pub(crate) inbox_len: u64,
    /// The seq of the next outbox entry (also names message and task ids).
    #[serde(default)]
    pub(crate) outbox_next: u64,
    /// Entries in the outbox.
    #[serde(default)]
    pub(crate) outbox_len: u64,
    /// Delegations not yet resolved.
    #[serde(default)]
    pub(crate) tasks_open: u64,
}

/// What an agent commits after each turn: counters only. The definition comes from
/// the directory, and the window is the tail of the log (each message is already
/// committed there, once), so a turn's snapshot costs a few bytes, not the whole chat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SavedAgent {
    pub(crate) log_length: u64,
    pub(crate) turns: u64,
    /// How many of the log's last messages make up the window.
    pub(crate) window: u64,
    /// Inbox and outbox counters.
    #[serde(default)]
    pub(crate) boxes: BoxCounters,
}

impl SavedAgent {
    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(bytes).map_err(|error| error.to_string())
    }

    /// The log key after which the window starts (`None`: at the log's start).
    pub(crate) fn window_after(&self) -> Option<String> {
        let start = self.log_length - self.window.min(self.log_length);
        start.checked_sub(1).map(log_key)
    }
}

impl AgentState {
    fn new(spec: AgentSpec, saved: Option<SavedAgent>) -> Self {
        let saved = saved.unwrap_or(SavedAgent {
            log_length: 0,
            turns: 0,
            window: 0,
            boxes: BoxCounters::default(),
        });
        Self {
            spec,
            window: Vec::new(),
            window_loaded: saved.window == 0,
            saved_window: saved.window,
            log_length: saved.log_length,
            turns: saved.turns,
            boxes: saved.boxes,
        }
    }

    fn saved(&self) -> SavedAgent {
        SavedAgent {
            log_length: self.log_length,
            turns: self.turns,
            window: self.window.len() as u64,
            boxes: self.boxes,
        }
    }

    /// Reads the window from the log, once per activation.
    async fn load_window(&mut self, turn: &Turn) -> Result<(), ActorError> {
        if self.window_loaded {
            return Ok(());
        }
        let saved = SavedAgent {
            log_length: self.log_length,
            turns: self.turns,
            window: self.saved_window,
            boxes: self.boxes,
        };
        let after = saved.window_after();
        let limit = usize::try_from(saved.window).unwrap_or(usize::MAX);
        let page = turn.scan("log/", after.as_deref(), limit).await?;
        let mut window = Vec::with_capacity(page.len());
        for (key, value) in page {
            let message: ChatMessage = serde_json::from_slice(&value)
                .map_err(|error| ActorError::failed(format!("log entry {key} cannot be decoded: {error}")))?;
            window.push(message);
        }
        self.window = window;
        self.window_loaded = true;
        Ok(())
    }

    /// Appends `messages`, keeps the last [`AGENT_HISTORY_WINDOW_MAX`], and never starts
    /// the window in the middle of an exchange (a tool result without its call).
    fn remember(&mut self, messages: &[ChatMessage]) {
        self.window.extend_from_slice(messages);
        if self.window.len() > AGENT_HISTORY_WINDOW_MAX {
            let excess = self.window.len() - AGENT_HISTORY_WINDOW_MAX;
            self.window.drain(..excess);
        }
        let first_user = self
            .window
            .iter()
            .position(|m| m.role == Role::User)
            .unwrap_or(self.window.len());
        self.window.drain(..first_user);
        assert!(self.window.len() <= AGENT_HISTORY_WINDOW_MAX);
    }
}

/// The key of entry `seq` of the conversation log.
pub(crate) fn log_key(seq: u64) -> String {
    format!("log/{seq:020}")
}

/// Builds agents from the directory and their snapshots.
pub(crate) struct AgentFactory {
    pub(crate) shared: Arc<AgentShared>,
}

impl ActorFactory for AgentFactory {
    fn create(&self, id: &ActorId, saved: Option<Bytes>) -> Result<Box<dyn Actor>, ActorError> {
        let Some(spec) = self.shared.directory.get(id.key()) else {
            return Err(ActorError::rejected(format!(
                "agent {} is not in the directory",
                id.key()
            )));
        };
        let saved = match saved {
            Some(bytes) => Some(
                SavedAgent::decode(&bytes)
                    .map_err(|cause| ActorError::failed(format!("the state of {id} cannot be decoded: {cause}")))?,
            ),
            None => None,
        };
        let state = AgentState::new(spec, saved);
        Ok(Box::new(AgentActor {
            id: id.clone(),
            state,
            shared: Arc::clone(&self.shared),
            relaying: std::collections::BTreeSet::new(),
        }))
    }
}

/// One activation of one agent.
pub(crate) struct AgentActor {
    pub(crate) id: ActorId,
    pub(crate) state: AgentState,
    pub(crate) shared: Arc<AgentShared>,
    /// Outbox seqs a delivery task of this activation is delivering.
    pub(crate) relaying: std::collections::BTreeSet<u64>,
}

/// One conversation turn to run: the user message and who it serves.
pub(crate) struct Conversation {
    /// The user message, as the model sees it.
    pub(crate) content: String,
    /// The observer's call id, if any.
    pub(crate) call: Option<u64>,
    /// When the model loop must be done (at or before the turn's deadline).
    pub(crate) deadline: Deadline,
}

impl fmt::Debug for AgentActor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentActor")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl AgentActor {
    /// The system message: the agent's prompt, its role, and the peers it may call.
    fn system_message(&self) -> ChatMessage {
        let spec = &self.state.spec;
        let mut text = spec.system_prompt.clone();
        if !text.is_empty() {
            text.push_str("\n\n");
        }
        text.push_str(&format!("You are {} (agent id \"{}\")", spec.name, spec.id));
        if !spec.role.is_empty() {
            text.push_str(&format!(", {}", spec.role));
        }
        text.push('.');
        text.push_str(&crate::org_prompt::contacts_section(&self.shared, &spec.id));
        ChatMessage::new(Role::System, text)
    }

    /// The error of a turn that reached its deadline: the same [`InvokeError::Timeout`]
    /// the runtime gives when it cancels the turn, so a caller sees a timeout whichever
    /// fires first at that instant (the model call's clip, or the runtime's).
    pub(crate) fn timed_out(&self, timeout_ms: u64) -> ActorError {
        ActorError::Invoke(troupe_core::InvokeError::Timeout {
            target: self.id.clone(),
            timeout_ms,
        })
    }

    /// Runs one conversation turn (see `converse_steps`) and reports its end
    /// ([`AgentEvent::TurnEnded`]) when anyone listens.
    pub(crate) async fn converse(
        &mut self,
        turn: &mut Turn,
        conversation: Conversation,
    ) -> Result<AgentReply, ActorError> {
        let call = conversation.call;
        let result = self.converse_steps(turn, conversation).await;
        if self.shared.has_listeners() {
            let (ok, steps, usage) = match &result {
                Ok(reply) => (true, reply.steps, reply.usage),
                Err(_) => (false, 0, TokenUsage::default()),
            };
            self.shared.emit(&AgentEvent::TurnEnded {
                agent: self.id.clone(),
                call,
                ok,
                steps,
                usage,
                at: self.shared.now(),
            });
        }
        result
    }

    /// The model loop (until `conversation.deadline`), then the log writes and the
    /// turn's sends (outbox entries, task records, relays).
    async fn converse_steps(&mut self, turn: &mut Turn, conversation: Conversation) -> Result<AgentReply, ActorError> {
        let clock = turn.clock();
        let context = turn.context().clone();
        let deadline = conversation.deadline.min(context.deadline());
        let started = clock.now();
        let timeout_ms = |from: troupe_core::Deadline| deadline.remaining_ms(from);
        self.shared.emit(&AgentEvent::TurnStarted {
            agent: self.id.clone(),
            call: conversation.call,
            depth: context.depth(),
            chain: context.chain().to_vec(),
            deadline,
            at: started,
        });
        let mut fresh = vec![ChatMessage::new(Role::User, conversation.content)];
        let boxes = self.state.boxes;
        let sends: SharedSends = Arc::new(Mutex::new(PendingSends::new(
            self.id.clone(),
            boxes.outbox_next,
            boxes.outbox_len,
            boxes.tasks_open,
        )));
        let tools = ToolExecutionContext::new(
            turn.caller().clone(),
            conversation.call,
            Arc::clone(&self.shared),
            Some(Arc::clone(&sends)),
        );
        let specs = &crate::org_prompt::tool_specs_for(&self.shared, self.id.key());
        let max_steps = self.state.spec.model.max_steps.clamp(1, AGENT_TURN_STEPS_MAX);
        let mut steps = 0;
        let mut usage = TokenUsage::default();
        let answer = loop {
            if steps == max_steps {
                return Err(ActorError::failed(format!(
                    "{} used all {max_steps} model steps without a final answer",
                    self.id
                )));
            }
            steps += 1;
            let mut messages = Vec::with_capacity(1 + self.state.window.len() + fresh.len());
            messages.push(self.system_message());
            messages.extend_from_slice(&self.state.window);
            messages.extend_from_slice(&fresh);
            let llm_request = LlmRequest {
                agent: self.id.clone(),
                model: self.state.spec.model.model.clone(),
                messages,
                tools: Arc::clone(specs),
                deadline,
            };
            let model_call = tracing::Instrument::instrument(
                self.shared.llm.complete(llm_request),
                tracing::debug_span!("model_call", agent = %self.id, step = steps),
            );
            let reply = match clock.run_until(deadline, model_call).await {
                Ok(Ok(reply)) => reply,
                Ok(Err(error)) => return Err(ActorError::failed(format!("the model failed: {error}"))),
                Err(_elapsed) => {
                    tracing::debug!(agent = %self.id, "{}", LlmError::Timeout { timeout_ms: timeout_ms(clock.now()) });
                    return Err(self.timed_out(timeout_ms(started)));
                }
            };
            if let Some(used) = reply.usage {
                usage.prompt_tokens += used.prompt_tokens;
                usage.completion_tokens += used.completion_tokens;
                usage.total_tokens += used.total_tokens;
            }
            if self.shared.has_listeners() {
                self.shared.emit(&AgentEvent::ModelResponded {
                    agent: self.id.clone(),
                    call: conversation.call,
                    step: steps,
                    usage: reply.usage,
                    tool_calls: reply.message.tool_calls.len(),
                    at: clock.now(),
                });
            }
            let mut message = reply.message;
            message.role = Role::Assistant;
            message.tool_call_id = None;
            let calls = message.tool_calls.clone();
            let content = message.content.clone();
            fresh.push(message);
            if calls.is_empty() {
                break content;
            }
            let Ok(results) = clock.run_until(deadline, self.run_tools(&tools, &calls)).await else {
                return Err(self.timed_out(timeout_ms(started)));
            };
            for (call, result) in calls.iter().zip(results) {
                fresh.push(ChatMessage::tool_result(call.id.clone(), result));
            }
        };
        // A future that finishes at the very instant of its deadline wins the race with
        // the timer, but the caller has given up by then (a deadline equal to now has
        // passed): such a turn must not commit.
        if deadline.has_passed(clock.now()) {
            return Err(self.timed_out(timeout_ms(started)));
        }
        for message in &fresh {
            let bytes = serde_json::to_vec(message).map_err(|error| ActorError::failed(error.to_string()))?;
            turn.put(log_key(self.state.log_length), Bytes::from(bytes))?;
            self.state.log_length += 1;
        }
        drop(tools);
        let sends = std::mem::replace(
            &mut *sends.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
            PendingSends::new(self.id.clone(), 0, 0, 0),
        );
        self.flush_sends(turn, sends).await?;
        self.state.remember(&fresh);
        self.state.turns += 1;
        let text = truncate_utf8(&answer, AGENT_REPLY_SIZE_MAX_BYTES);
        Ok(AgentReply {
            text: text.to_string(),
            truncated: text.len() < answer.len(),
            steps,
            usage,
        })
    }

    /// Runs one step's tool calls concurrently; one result text per call, in order.
    async fn run_tools(&self, context: &ToolExecutionContext, calls: &[ToolCall]) -> Vec<String> {
        let registry = &self.shared.tools;
        // Polled in place on the turn's task (no spawned tasks, which would outlive a
        // cancelled turn), first in input order; dropped with the turn.
        let futures = calls.iter().enumerate().map(|(index, call)| async move {
            if index >= AGENT_TOOL_CALLS_PER_STEP_MAX {
                return format!(
                    "error: at most {AGENT_TOOL_CALLS_PER_STEP_MAX} tool calls run per step; this one was skipped"
                );
            }
            let arguments = match &call.arguments {
                // Some providers send the arguments as a JSON string.
                serde_json::Value::String(text) => {
                    serde_json::from_str(text).unwrap_or_else(|_| call.arguments.clone())
                }
                other => other.clone(),
            };
            let executed = tracing::Instrument::instrument(
                registry.execute(context, &call.name, arguments),
                tracing::debug_span!("tool_call", agent = %self.id, tool = %call.name),
            )
            .await;
            if self.shared.has_listeners() {
                self.shared.emit(&AgentEvent::ToolFinished {
                    agent: self.id.clone(),
                    tool: call.name.clone(),
                    ok: executed.is_ok(),
                    at: self.shared.now(),
                });
            }
            let result = match executed {
                Ok(text) => text,
                Err(error) => format!("error: {error}"),
            };
            truncate_utf8(&result, AGENT_TOOL_RESULT_SIZE_MAX_BYTES).to_string()
        });
        futures::future::join_all(futures).await
    }
}

#[async_trait]
impl Actor for AgentActor {
    async fn on_activate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        if self.shared.has_listeners() {
            self.shared.emit(&AgentEvent::Activated {
                agent: self.id.clone(),
                at: self.shared.now(),
            });
        }
        Ok(())
    }

    async fn on_deactivate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        if self.shared.has_listeners() {
            self.shared.emit(&AgentEvent::Deactivated {
                agent: self.id.clone(),
                at: self.shared.now(),
            });
        }
        Ok(())
    }

    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let command = AgentCommand::decode(&payload)
            .map_err(|cause| ActorError::rejected(format!("not an agent request: {cause}")))?;
        self.state.load_window(turn).await?;
        crate::org_store::ensure_loaded(&self.shared).await;
        if let Some(spec) = self.shared.directory.get(self.id.key()) {
            self.state.spec = spec;
        }
        match command {
            AgentCommand::Ask(request) => {
                let text = truncate_utf8(&request.text, AGENT_MESSAGE_SIZE_MAX_BYTES);
                let content = match &request.from {
                    Some(from) => format!(
                        "[message from {}] {text}",
                        crate::org_prompt::sender_label(&self.shared, self.id.key(), from.key())
                    ),
                    None => text.to_string(),
                };
                let conversation = Conversation {
                    content,
                    call: request.call,
                    deadline: turn.context().deadline(),
                };
                let reply = self.converse(turn, conversation).await?;
                Ok(reply.encode())
            }
            other => self.handle_box(turn, other).await,
        }
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        let bytes = serde_json::to_vec(&self.state.saved()).map_err(|error| ActorError::failed(error.to_string()))?;
        Ok(Some(Bytes::from(bytes)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_stays_bounded_and_starts_at_a_user_message() {
        let mut state = AgentState::new(AgentSpec::new("a"), None);
        for turn in 0..100 {
            let mut assistant = ChatMessage::new(Role::Assistant, "");
            assistant.tool_calls.push(ToolCall {
                id: format!("c{turn}"),
                name: "t".into(),
                arguments: serde_json::json!({}),
            });
            state.remember(&[
                ChatMessage::new(Role::User, format!("q{turn}")),
                assistant,
                ChatMessage::tool_result(format!("c{turn}"), "r"),
                ChatMessage::new(Role::Assistant, format!("a{turn}")),
            ]);
            assert!(state.window.len() <= AGENT_HISTORY_WINDOW_MAX);
            assert_eq!(state.window[0].role, Role::User);
        }
        assert_eq!(state.window.last().unwrap().content, "a99");
    }

    #[test]
    fn requests_and_replies_round_trip_through_bincode() {
        let request = AgentRequest {
            text: "héllo".into(),
            from: Some(agent_id("b").unwrap()),
            call: Some(7),
        };
        assert_eq!(AgentRequest::decode(&request.encode()), Ok(request));
        let reply = AgentReply {
            text: "ok".into(),
            truncated: false,
            steps: 2,
            usage: TokenUsage {
                prompt_tokens: 3,
                completion_tokens: 1,
                total_tokens: 4,
            },
        };
        assert_eq!(AgentReply::decode(&reply.encode()), Ok(reply));
        assert!(AgentReply::decode(b"\x01").is_err());
    }
}

//! What an agent is: its definition ([`AgentSpec`], [`ModelSettings`]) and the
//! directory of the agents that exist ([`AgentDirectory`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use serde::{Deserialize, Serialize};
use troupe_core::{ActorId, ActorKind, IdError};

use crate::limits::{
    AGENT_HISTORY_WINDOW_DEFAULT, AGENT_HISTORY_WINDOW_MAX, AGENT_HISTORY_WINDOW_MIN, AGENT_MODEL_NAME_SIZE_MAX_BYTES,
    AGENT_NAME_SIZE_MAX_BYTES, AGENT_ROLE_SIZE_MAX_BYTES, AGENT_SYSTEM_PROMPT_SIZE_MAX_BYTES, AGENT_TURN_STEPS_MAX,
    AGENT_TURN_STEPS_MIN,
};

/// The actor kind of every agent.
pub const AGENT_KIND: &str = "agent";

/// The actor id of the agent with key `key`.
///
/// # Errors
/// [`IdError`] if `key` cannot be an actor key.
pub fn agent_id(key: &str) -> Result<ActorId, IdError> {
    // The kind is checked and allocated once per process, not at every call.
    static KIND: OnceLock<ActorKind> = OnceLock::new();
    let kind = KIND.get_or_init(|| ActorKind::new(AGENT_KIND).expect("AGENT_KIND is a valid actor kind"));
    ActorId::of_kind(kind.clone(), key)
}

/// Which model an agent uses and how many steps a turn may take.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelSettings {
    /// The model's name, passed to the [`crate::LlmClient`]; empty means the client's
    /// default. At most [`AGENT_MODEL_NAME_SIZE_MAX_BYTES`] (checked by
    /// [`AgentSpec::validate`]).
    pub model: String,
    /// Most model steps per turn, [`AGENT_TURN_STEPS_MIN`]..=[`AGENT_TURN_STEPS_MAX`]
    /// (checked by [`AgentSpec::validate`]).
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
    /// The id is a valid actor key but cannot name one agent: `*` is every agent in
    /// permission rules and links ([`crate::PERMISSION_TARGET_ANY`]), and an id with
    /// whitespace at either end reads as another agent's in prompts, mentions and logs.
    #[error("agent id {id:?} cannot name an agent: {why}; pick another id")]
    UnusableId {
        /// The id.
        id: String,
        /// Why.
        why: &'static str,
    },
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
    /// The role, the display name or the model name is too long (see
    /// [`AGENT_ROLE_SIZE_MAX_BYTES`], [`AGENT_NAME_SIZE_MAX_BYTES`],
    /// [`AGENT_MODEL_NAME_SIZE_MAX_BYTES`]).
    #[error("the {field} of {id} is {size} bytes, more than the limit of {limit}; shorten it")]
    FieldTooLong {
        /// The agent.
        id: String,
        /// `role`, `name` or `model`.
        field: &'static str,
        /// Its size in bytes.
        size: usize,
        /// [`AGENT_ROLE_SIZE_MAX_BYTES`], [`AGENT_NAME_SIZE_MAX_BYTES`] or
        /// [`AGENT_MODEL_NAME_SIZE_MAX_BYTES`].
        limit: usize,
    },
    /// The most model steps per turn is out of range.
    #[error("the max_steps of {id} is {value}, which is not in {min}..={max}; pick a value in range")]
    MaxStepsOutOfRange {
        /// The agent.
        id: String,
        /// The value given.
        value: u32,
        /// [`AGENT_TURN_STEPS_MIN`].
        min: u32,
        /// [`AGENT_TURN_STEPS_MAX`].
        max: u32,
    },
    /// An agent with this id is already defined.
    #[error("agent {id:?} is already defined")]
    Duplicate {
        /// The id.
        id: String,
    },
    /// The agent names a model provider the system does not have.
    #[error(
        "agent {id:?} names model provider {provider:?}, which this system does not have; known providers: [{}] \
         (register it with AgentSystemBuilder::provider)",
        known.join(", ")
    )]
    UnknownProvider {
        /// The agent.
        id: String,
        /// The provider it names.
        provider: String,
        /// The providers the system has, by name.
        known: Vec<String>,
    },
    /// The agent's conversation window is out of range.
    #[error(
        "the conversation window of {id} has {what} = {value}, which is not in 1..={limit}; pick a value in range"
    )]
    WindowOutOfRange {
        /// The agent.
        id: String,
        /// `messages` or `tokens`.
        what: &'static str,
        /// The value given.
        value: usize,
        /// [`crate::CONVERSATION_WINDOW_MESSAGES_MAX`] or
        /// [`crate::CONVERSATION_WINDOW_TOKENS_MAX`].
        limit: usize,
    },
    /// The agent's history window is out of range.
    #[error("the history window of {id} is {value} messages, which is not in {min}..={max}; pick a value in range")]
    HistoryOutOfRange {
        /// The agent.
        id: String,
        /// The value given.
        value: usize,
        /// [`AGENT_HISTORY_WINDOW_MIN`].
        min: usize,
        /// [`AGENT_HISTORY_WINDOW_MAX`].
        max: usize,
    },
    /// The agent names a tool the system does not have: no tool registered at start
    /// has its name, and no attached MCP server lists it now.
    #[error(
        "agent {id:?} names tool {tool:?}, which this system does not have; registered tools: [{}]{} \
         (register it with AgentSystemBuilder::tool{})",
        known.join(", "),
        unknown_tool_servers_clause(servers),
        if servers.is_empty() { "" } else { ", or have an attached server list it" }
    )]
    UnknownTool {
        /// The agent.
        id: String,
        /// The tool it names.
        tool: String,
        /// The tools the system has now, by name: those registered at start and those
        /// its attached servers list now.
        known: Vec<String>,
        /// The attached MCP servers (`MCP server "files"`), none of which lists the
        /// tool now; empty without attached servers.
        servers: Vec<String>,
    },
}

/// What [`AgentSpecError::UnknownTool`]'s text says of the attached servers.
fn unknown_tool_servers_clause(servers: &[String]) -> String {
    if servers.is_empty() {
        String::new()
    } else {
        format!("; no attached server lists it now ({})", servers.join(", "))
    }
}

/// The model providers and tools an agent definition may name: what the directory of a
/// started [`crate::AgentSystem`] checks definitions against.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentCatalog {
    /// The named providers ([`crate::AgentSystemBuilder::provider`]), in order.
    pub providers: Vec<String>,
    /// The registered tools, built-in ones included, in order.
    pub tools: Vec<String>,
}

impl AgentCatalog {
    /// Checks that every provider and tool `spec` names is in this catalog.
    ///
    /// # Errors
    /// [`AgentSpecError::UnknownProvider`], [`AgentSpecError::UnknownTool`] (the first
    /// unknown tool).
    pub fn check(&self, spec: &AgentSpec) -> Result<(), AgentSpecError> {
        self.check_with_sources(spec, &[])
    }

    /// As [`AgentCatalog::check`], a tool not in the catalog accepted when one of
    /// `sources` (the attached MCP servers) lists it now.
    fn check_with_sources(
        &self,
        spec: &AgentSpec,
        sources: &[Arc<dyn crate::tool::ToolSource>],
    ) -> Result<(), AgentSpecError> {
        if let Some(provider) = &spec.provider {
            if !self.providers.contains(provider) {
                return Err(AgentSpecError::UnknownProvider {
                    id: spec.id.clone(),
                    provider: provider.clone(),
                    known: self.providers.clone(),
                });
            }
        }
        // The sources' names now, read once, and only if a tool is not in the catalog
        // (each source builds its tools to list them).
        let mut listed: Option<Vec<String>> = None;
        for tool in spec.tools.iter().flatten() {
            if self.tools.contains(tool) {
                continue;
            }
            let listed = listed.get_or_insert_with(|| {
                sources
                    .iter()
                    .flat_map(|source| source.tools())
                    .map(|listed| listed.spec().name.clone())
                    .collect()
            });
            if listed.contains(tool) {
                continue;
            }
            let mut known = self.tools.clone();
            if !sources.is_empty() {
                known.extend(listed.iter().cloned());
                known.sort();
                known.dedup();
            }
            return Err(AgentSpecError::UnknownTool {
                id: spec.id.clone(),
                tool: tool.clone(),
                known,
                servers: sources.iter().map(|source| source.describe()).collect(),
            });
        }
        Ok(())
    }
}

/// The attached MCP servers a directory also checks tool names against (their lists
/// change while the system runs).
#[derive(Clone, Default)]
struct AttachedSources(Arc<[Arc<dyn crate::tool::ToolSource>]>);

impl std::fmt::Debug for AttachedSources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|source| source.describe()))
            .finish()
    }
}

/// The definition of an agent: who it is and how it thinks.
///
/// Two definitions are equal when every field but the time they were defined
/// ([`AgentSpec::defined_at_us`]) is.
#[derive(Debug, Clone, Serialize, Deserialize)]
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
    /// The named model provider its turns use ([`crate::AgentSystemBuilder::provider`]);
    /// `None`: the system's default client ([`crate::AgentSystemBuilder::llm`]).
    #[serde(default)]
    pub provider: Option<String>,
    /// The tools its model is offered and may run, by name; `None`: every registered
    /// tool. A call of any other tool is refused with a tool result and not run.
    #[serde(default)]
    pub tools: Option<Vec<String>>,
    /// How much of a conversation its prompt shows when it answers a mention (its
    /// pull-based context).
    #[serde(default)]
    pub window: ContextWindow,
    /// How many of its own newest log messages its model sees at every turn (its private
    /// history window), [`AGENT_HISTORY_WINDOW_MIN`]..=[`AGENT_HISTORY_WINDOW_MAX`];
    /// [`AGENT_HISTORY_WINDOW_DEFAULT`] unless set. The window never starts in the
    /// middle of an exchange, so it may hold fewer.
    #[serde(default = "default_history")]
    pub history: usize,
    /// What its `call_agent` does when the organisation says the call needs approval:
    /// wait for it in the turn (the default), or send the question as a delegated task
    /// that waits for it in the outbox. Left out of its stored form when it is the
    /// default, so a definition stored by an older Troupe reads the same.
    #[serde(default, skip_serializing_if = "CallApproval::is_default")]
    pub call_approval: CallApproval,
    /// When it was defined, in microseconds since the Unix epoch on the runtime's
    /// clock (see [`AgentSpec::defined_at_us`]); set by the system, not by the builder
    /// methods. Stored with a definition made through the API; a definition stored by
    /// an older Troupe has none (and reads the same).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) defined_at_us: Option<u64>,
}

impl PartialEq for AgentSpec {
    /// Every field but `defined_at_us`: the same definition made at another time is the
    /// same definition.
    fn eq(&self, other: &Self) -> bool {
        // Destructured, so a new field cannot be left out of the comparison unnoticed.
        let Self {
            id,
            name,
            system_prompt,
            role,
            model,
            provider,
            tools,
            window,
            history,
            call_approval,
            defined_at_us: _,
        } = self;
        *id == other.id
            && *name == other.name
            && *system_prompt == other.system_prompt
            && *role == other.role
            && *model == other.model
            && *provider == other.provider
            && *tools == other.tools
            && *window == other.window
            && *history == other.history
            && *call_approval == other.call_approval
    }
}

impl Eq for AgentSpec {}

/// What an agent's `call_agent` does when the call needs approval (a rule with
/// `requires_approval`, or a `supervised` or `strict` sender).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CallApproval {
    /// Records a pending approval and waits for it in the calling turn, until the call's
    /// deadline (30 s by default, at most 300 s): approved, the call proceeds and the
    /// model reads the answer; denied or not given in time, it reads the refusal. A
    /// restart loses the wait with its turn.
    #[default]
    WaitInTurn,
    /// Sends the question as a delegated task instead (as `delegate_to_agent` would; its
    /// deadline is the call's `timeout_ms` if the model gave one, at most 300 s, else the
    /// task default of 120 s): the task waits for its own approval in the
    /// outbox, durably (across restarts), and the turn goes on; the model reads that the
    /// question was sent as task N pending approval M, and the callee's answer, or the
    /// denial, comes back to the agent as the task's result in a turn of its own. A
    /// call to a remote (A2A) agent, which cannot be sent a task, still waits in the turn.
    Delegate,
}

impl CallApproval {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

fn default_history() -> usize {
    AGENT_HISTORY_WINDOW_DEFAULT
}

/// How much of a conversation an agent's prompt shows: the newest `messages` messages,
/// and within them at most `tokens` approximate tokens (bytes /
/// [`crate::CONVERSATION_BYTES_PER_TOKEN`]); the newest message is always kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ContextWindow {
    /// Most messages, 1..=[`crate::CONVERSATION_WINDOW_MESSAGES_MAX`].
    pub messages: usize,
    /// Most approximate tokens, 1..=[`crate::CONVERSATION_WINDOW_TOKENS_MAX`].
    pub tokens: usize,
}

impl Default for ContextWindow {
    /// The largest window: [`crate::CONVERSATION_WINDOW_MESSAGES_MAX`] messages,
    /// [`crate::CONVERSATION_WINDOW_TOKENS_MAX`] tokens.
    fn default() -> Self {
        Self {
            messages: crate::CONVERSATION_WINDOW_MESSAGES_MAX,
            tokens: crate::CONVERSATION_WINDOW_TOKENS_MAX,
        }
    }
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
            provider: None,
            tools: None,
            window: ContextWindow::default(),
            history: AGENT_HISTORY_WINDOW_DEFAULT,
            call_approval: CallApproval::WaitInTurn,
            defined_at_us: None,
        }
    }

    /// When the agent was defined, in microseconds since the Unix epoch on the
    /// runtime's clock (`RuntimeHandle::now`): for an agent the system was built with
    /// (its builder, its config file), the time this system started, as such an agent is
    /// defined anew at each start (a config file's agents written to the store,
    /// [`crate::AgentClient::store_config`], the time they were written); for one
    /// defined through the API ([`crate::AgentClient::define_agent`],
    /// [`crate::AgentClient::replace_agent`]), the time it was defined or last replaced,
    /// stored with it. `None`: not known (a definition stored by an older Troupe, a spec
    /// not yet in a started system's directory, or one added to it with
    /// [`AgentDirectory::upsert`] directly). `GET /v1/models` answers it as `created`.
    pub fn defined_at_us(&self) -> Option<u64> {
        self.defined_at_us
    }

    /// This definition, defined at `at_us` (see [`AgentSpec::defined_at_us`]).
    pub(crate) fn defined_at(mut self, at_us: u64) -> Self {
        self.defined_at_us = Some(at_us);
        self
    }

    /// Sets what its `call_agent` does when the call needs approval (see
    /// [`CallApproval`]).
    pub fn call_approval(mut self, call_approval: CallApproval) -> Self {
        self.call_approval = call_approval;
        self
    }

    /// Sets how many of its own newest log messages its model sees at every turn
    /// (checked by [`AgentSpec::validate`]: [`AGENT_HISTORY_WINDOW_MIN`]..=
    /// [`AGENT_HISTORY_WINDOW_MAX`]). A running agent takes a new value at its next
    /// turn: a smaller window drops its oldest messages then, a larger one fills up as
    /// the agent talks (and, after a restart, is read back from the log up to the
    /// window kept before it).
    pub fn history(mut self, messages: usize) -> Self {
        self.history = messages;
        self
    }

    /// Sets its conversation window: the newest `messages` messages, at most `tokens`
    /// approximate tokens (checked by [`AgentSpec::validate`]).
    pub fn window(mut self, messages: usize, tokens: usize) -> Self {
        self.window = ContextWindow { messages, tokens };
        self
    }

    /// Uses the system's model provider named `provider` (registered with
    /// [`crate::AgentSystemBuilder::provider`]) instead of the default client.
    pub fn provider(mut self, provider: impl Into<String>) -> Self {
        self.provider = Some(provider.into());
        self
    }

    /// Limits the agent to the tools named (registered ones, built-in or MCP); its model
    /// is offered only these, and a call of any other is refused. Without this call it
    /// has every registered tool.
    pub fn tools<I, S>(mut self, tools: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.tools = Some(tools.into_iter().map(Into::into).collect());
        self
    }

    /// Whether the agent may use tool `name`.
    pub fn allows_tool(&self, name: &str) -> bool {
        self.tools
            .as_ref()
            .is_none_or(|tools| tools.iter().any(|tool| tool == name))
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

    /// Sets the model name (checked by [`AgentSpec::validate`]: at most
    /// [`AGENT_MODEL_NAME_SIZE_MAX_BYTES`]).
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model.model = model.into();
        self
    }

    /// Sets the most model steps per turn (checked by [`AgentSpec::validate`]:
    /// [`AGENT_TURN_STEPS_MIN`]..=[`AGENT_TURN_STEPS_MAX`]).
    pub fn max_steps(mut self, steps: u32) -> Self {
        self.model.max_steps = steps;
        self
    }

    /// Checks that `steps` may be agent `id`'s most model steps per turn: the one check
    /// of `max_steps` for every path a definition takes (the builder, the API, a config
    /// file, which reports it at the field's line and column).
    ///
    /// # Errors
    /// [`AgentSpecError::MaxStepsOutOfRange`] outside
    /// [`AGENT_TURN_STEPS_MIN`]..=[`AGENT_TURN_STEPS_MAX`].
    pub(crate) fn check_max_steps(id: &str, steps: u32) -> Result<(), AgentSpecError> {
        if (AGENT_TURN_STEPS_MIN..=AGENT_TURN_STEPS_MAX).contains(&steps) {
            return Ok(());
        }
        Err(AgentSpecError::MaxStepsOutOfRange {
            id: id.to_string(),
            value: steps,
            min: AGENT_TURN_STEPS_MIN,
            max: AGENT_TURN_STEPS_MAX,
        })
    }

    /// Checks the id, the prompt, role, name and model name sizes, the steps and the
    /// windows.
    ///
    /// # Errors
    /// [`AgentSpecError`].
    pub fn validate(&self) -> Result<(), AgentSpecError> {
        let limits = [
            (
                "messages",
                self.window.messages,
                crate::CONVERSATION_WINDOW_MESSAGES_MAX,
            ),
            ("tokens", self.window.tokens, crate::CONVERSATION_WINDOW_TOKENS_MAX),
        ];
        if let Some((what, value, limit)) = limits
            .into_iter()
            .find(|(_, value, limit)| !(1..=*limit).contains(value))
        {
            return Err(AgentSpecError::WindowOutOfRange {
                id: self.id.clone(),
                what,
                value,
                limit,
            });
        }
        if !(AGENT_HISTORY_WINDOW_MIN..=AGENT_HISTORY_WINDOW_MAX).contains(&self.history) {
            return Err(AgentSpecError::HistoryOutOfRange {
                id: self.id.clone(),
                value: self.history,
                min: AGENT_HISTORY_WINDOW_MIN,
                max: AGENT_HISTORY_WINDOW_MAX,
            });
        }
        agent_id(&self.id).map_err(|cause| AgentSpecError::InvalidId {
            id: self.id.clone(),
            cause,
        })?;
        let unusable = if self.id == crate::permissions::PERMISSION_TARGET_ANY {
            Some("\"*\" means every agent in permission rules and links")
        } else if self.id.trim() != self.id {
            Some("it begins or ends with whitespace")
        } else {
            None
        };
        if let Some(why) = unusable {
            return Err(AgentSpecError::UnusableId {
                id: self.id.clone(),
                why,
            });
        }
        for (field, size, limit) in [
            ("role", self.role.len(), AGENT_ROLE_SIZE_MAX_BYTES),
            ("name", self.name.len(), AGENT_NAME_SIZE_MAX_BYTES),
            ("model", self.model.model.len(), AGENT_MODEL_NAME_SIZE_MAX_BYTES),
        ] {
            if size > limit {
                return Err(AgentSpecError::FieldTooLong {
                    id: self.id.clone(),
                    field,
                    size,
                    limit,
                });
            }
        }
        if self.system_prompt.len() > AGENT_SYSTEM_PROMPT_SIZE_MAX_BYTES {
            return Err(AgentSpecError::SystemPromptTooLong {
                id: self.id.clone(),
                size: self.system_prompt.len(),
                limit: AGENT_SYSTEM_PROMPT_SIZE_MAX_BYTES,
            });
        }
        Self::check_max_steps(&self.id, self.model.max_steps)
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
    catalog: Option<Arc<AgentCatalog>>,
    /// The attached MCP servers: a tool one of them lists now may be named too, though
    /// it is not in `catalog` (made at start).
    sources: AttachedSources,
    /// Counts the changes (shared by every clone), so what is derived from the whole
    /// directory (an agent's list of peers) is rebuilt only when it changed.
    generation: Arc<AtomicU64>,
}

impl AgentDirectory {
    /// An empty directory that checks no provider or tool names (see
    /// [`AgentDirectory::with_catalog`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty directory that refuses definitions naming a provider or tool not in
    /// `catalog` (a started system's directory is one).
    pub fn with_catalog(catalog: AgentCatalog) -> Self {
        Self {
            agents: Arc::default(),
            catalog: Some(Arc::new(catalog)),
            sources: AttachedSources::default(),
            generation: Arc::default(),
        }
    }

    /// This directory, also accepting a tool that one of `sources` (the system's
    /// attached MCP servers) lists when a definition is checked.
    pub(crate) fn with_tool_sources(mut self, sources: Vec<Arc<dyn crate::tool::ToolSource>>) -> Self {
        self.sources = AttachedSources(sources.into());
        self
    }

    /// Checks that every provider and tool `spec` names exists here: in the catalog,
    /// or (a tool) in an attached server's list now. Nothing is checked without a
    /// catalog.
    fn check_names(&self, spec: &AgentSpec) -> Result<(), AgentSpecError> {
        match &self.catalog {
            Some(catalog) => catalog.check_with_sources(spec, &self.sources.0),
            None => Ok(()),
        }
    }

    /// Checks `spec` as [`AgentDirectory::upsert`] does; when it names a tool that
    /// neither the catalog nor an attached server's last list has, checks again after
    /// reading again the list of each attached server that said its list changed (or
    /// waiting for the read under way, at most the server's connect timeout), and
    /// starting again a dead one when it is due (see
    /// `MCP_DEAD_SERVER_RESTART_INTERVAL_MS`): what `AgentClient::define_agent` checks,
    /// so a tool a server lists now is accepted.
    ///
    /// # Errors
    /// As [`AgentDirectory::upsert`].
    pub(crate) async fn check_definition(&self, spec: &AgentSpec) -> Result<(), AgentSpecError> {
        spec.validate()?;
        match self.check_names(spec) {
            Err(AgentSpecError::UnknownTool { servers, .. }) if !servers.is_empty() => {
                for source in self.sources.0.iter() {
                    source.refresh().await;
                }
                self.check_names(spec)
            }
            checked => checked,
        }
    }

    /// The providers and tools definitions are checked against, if any.
    pub fn catalog(&self) -> Option<&AgentCatalog> {
        self.catalog.as_deref()
    }

    /// Adds or replaces an agent; its next turn uses the new definition and keeps its
    /// history.
    ///
    /// A tool that an attached MCP server lists now may be named, though the system did
    /// not have it at start. If the server later stops listing it, the definition
    /// stays: the tool is not offered to the agent while no server lists it (a call of
    /// it reads `McpError::ToolGone`'s text) and is offered again once one does.
    ///
    /// # Errors
    /// [`AgentSpecError`] if the definition is invalid, or names a provider not in the
    /// directory's catalog, or a tool neither in it nor listed now by an attached
    /// server ([`AgentSpecError::UnknownTool`], naming the servers).
    pub fn upsert(&self, spec: AgentSpec) -> Result<(), AgentSpecError> {
        spec.validate()?;
        self.check_names(&spec)?;
        self.insert(spec);
        Ok(())
    }

    /// As [`AgentDirectory::upsert`], for a definition read from the stored directory
    /// (`directory_store.rs`: at start, and what another process defined): with attached
    /// MCP servers, a tool no one lists now is accepted (with a warning), as it was when
    /// it was defined: a server may list it again, and the agent is offered it then.
    /// Skipping the definition lost the agent in this process until the record changed
    /// again. Without attached servers such a tool can never come, and the definition
    /// is refused as by `upsert`.
    ///
    /// # Errors
    /// As [`AgentDirectory::upsert`], but [`AgentSpecError::UnknownTool`] only without
    /// attached servers.
    pub(crate) fn upsert_stored(&self, spec: AgentSpec) -> Result<(), AgentSpecError> {
        spec.validate()?;
        match self.check_names(&spec) {
            Ok(()) => {}
            // The provider is checked before the tools: it is known.
            Err(AgentSpecError::UnknownTool { id, tool, servers, .. }) if !servers.is_empty() => {
                tracing::warn!(
                    agent = %id,
                    %tool,
                    servers = ?servers,
                    "a stored agent definition names a tool no attached server lists now; defined, and offered the \
                     tool once a server lists it"
                );
            }
            Err(error) => return Err(error),
        }
        self.insert(spec);
        Ok(())
    }

    fn insert(&self, spec: AgentSpec) {
        let mut agents = self.agents.write().unwrap();
        agents.insert(spec.id.clone(), spec);
        // Under the lock: a reader that sees the new generation reads the new entry.
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    /// Removes agent `id` from the directory and returns its definition. It can no
    /// longer be called or activated; an activation that is live keeps running until it
    /// is deactivated (see [`crate::AgentClient::remove_agent`], which does both).
    pub fn remove(&self, id: &str) -> Option<AgentSpec> {
        let mut agents = self.agents.write().unwrap();
        let removed = agents.remove(id);
        self.generation.fetch_add(1, Ordering::SeqCst);
        removed
    }

    /// Sets when agent `id` was defined (see [`AgentSpec::defined_at_us`]), without
    /// counting a change: the time is not part of the definition its turns use.
    pub(crate) fn set_defined_at(&self, id: &str, at_us: Option<u64>) {
        if let Some(spec) = self.agents.write().unwrap().get_mut(id) {
            spec.defined_at_us = at_us;
        }
    }

    /// Sets `at_us` as the time every agent that has none was defined: the agents the
    /// system was built with, when it starts. Not counted as a change.
    pub(crate) fn set_defined_at_where_unknown(&self, at_us: u64) {
        for spec in self.agents.write().unwrap().values_mut() {
            spec.defined_at_us.get_or_insert(at_us);
        }
    }

    /// How many changes the directory has had: equal generations, equal contents.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// The definition of agent `id`.
    pub fn get(&self, id: &str) -> Option<AgentSpec> {
        self.agents.read().unwrap().get(id).cloned()
    }

    /// What agent `id`'s `call_agent` does when a call needs approval (the default
    /// for an unknown id), read without copying its definition.
    pub(crate) fn call_approval_of(&self, id: &str) -> CallApproval {
        self.agents
            .read()
            .unwrap()
            .get(id)
            .map_or_else(CallApproval::default, |spec| spec.call_approval)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: definitions stored before providers and tool sets existed still load.
    /// Method: decode the JSON of a spec without the two fields; round-trip a new one.
    #[test]
    fn a_spec_stored_without_provider_or_tools_loads_with_neither() {
        let old = r#"{"id":"a","name":"A","system_prompt":"","role":"","model":{"model":"m","max_steps":3}}"#;
        let spec: AgentSpec = serde_json::from_str(old).unwrap();
        assert_eq!(spec.provider, None);
        assert_eq!(spec.tools, None);
        assert!(spec.allows_tool("anything"));

        let new = AgentSpec::new("b").provider("cheap").tools(["search"]);
        let round: AgentSpec = serde_json::from_str(&serde_json::to_string(&new).unwrap()).unwrap();
        assert_eq!(round, new);
        assert!(round.allows_tool("search"));
        assert!(!round.allows_tool("call_agent"));
    }
}

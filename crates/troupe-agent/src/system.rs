//! The embedding API: build an [`AgentSystem`] (a runtime with the agent kind, a model
//! client, agents and tools), ask agents, read their conversations.

use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use troupe_core::limits::INVOKE_TIMEOUT_MS_MAX;
use troupe_core::{truncate_utf8, ActorKind, CallRefused, InvokeError};
use troupe_runtime::{
    ConfigError, KindConfig, Runtime, RuntimeBuilder, RuntimeHandle, StateStore, StoreError, StoreOperation,
};

use crate::agent::{agent_id, log_key, AgentFactory, AgentShared, SavedAgent, AGENT_KIND};
use crate::call_agent::call_agent_tool;
use crate::limits::{AGENT_ASK_TIMEOUT_MS_DEFAULT, AGENT_MESSAGE_SIZE_MAX_BYTES};
use crate::{
    AgentCallError, AgentDirectory, AgentEvent, AgentObserver, AgentReply, AgentRequest, AgentSpec, AgentSpecError,
    CallOutcome, ChatMessage, LlmClient, Tool, ToolRegistry, ToolRegistryError,
};

/// Why an [`AgentSystem`] could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentSystemError {
    /// No model client was given.
    #[error("no LLM client was configured; call AgentSystemBuilder::llm")]
    NoLlm,
    /// An agent definition is invalid or repeated.
    #[error(transparent)]
    Spec(#[from] AgentSpecError),
    /// A tool name is repeated (`call_agent` is built in).
    #[error(transparent)]
    Tool(#[from] ToolRegistryError),
    /// The agent kind's configuration is invalid, or the runtime builder already has it.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// Configures an [`AgentSystem`].
pub struct AgentSystemBuilder {
    runtime: RuntimeBuilder,
    llm: Option<Arc<dyn LlmClient>>,
    agents: Vec<AgentSpec>,
    tools: Vec<Tool>,
    observers: Vec<Arc<dyn AgentObserver>>,
    kind_config: KindConfig,
}

impl Default for AgentSystemBuilder {
    fn default() -> Self {
        Self {
            runtime: Runtime::builder(),
            llm: None,
            agents: Vec::new(),
            tools: Vec::new(),
            observers: Vec::new(),
            kind_config: KindConfig::default(),
        }
    }
}

impl AgentSystemBuilder {
    /// Starts from `runtime`, a runtime builder that may already have other actor kinds
    /// registered (and its store set). Call it before [`AgentSystemBuilder::store`], which
    /// sets the store on the builder held at that moment.
    pub fn runtime(mut self, runtime: RuntimeBuilder) -> Self {
        self.runtime = runtime;
        self
    }

    /// Keeps agent state in `store` (the default is a fresh in-memory store).
    pub fn store(mut self, store: Arc<dyn StateStore>) -> Self {
        self.runtime = self.runtime.store(store);
        self
    }

    /// Uses `llm` for every agent.
    pub fn llm(mut self, llm: Arc<dyn LlmClient>) -> Self {
        self.llm = Some(llm);
        self
    }

    /// Defines an agent.
    pub fn agent(mut self, spec: AgentSpec) -> Self {
        self.agents.push(spec);
        self
    }

    /// Gives every agent `tool` (besides `call_agent`).
    pub fn tool(mut self, tool: Tool) -> Self {
        self.tools.push(tool);
        self
    }

    /// Reports agent events to `observer`.
    pub fn observer(mut self, observer: Arc<dyn AgentObserver>) -> Self {
        self.observers.push(observer);
        self
    }

    /// Configures the agent actor kind (mailbox, idle timeout).
    pub fn kind_config(mut self, config: KindConfig) -> Self {
        self.kind_config = config;
        self
    }

    /// Registers the agent kind and starts the runtime.
    ///
    /// # Errors
    /// [`AgentSystemError`].
    ///
    /// # Panics
    /// Outside a tokio (or madsim) runtime.
    pub fn start(self) -> Result<AgentSystem, AgentSystemError> {
        let llm = self.llm.ok_or(AgentSystemError::NoLlm)?;
        let directory = AgentDirectory::new();
        for spec in self.agents {
            if directory.contains(&spec.id) {
                return Err(AgentSpecError::Duplicate { id: spec.id }.into());
            }
            directory.upsert(spec)?;
        }
        let mut tools = ToolRegistry::new();
        tools.register(call_agent_tool())?;
        for tool in self.tools {
            tools.register(tool)?;
        }
        let shared = Arc::new(AgentShared::new(directory, llm, tools, self.observers));
        let kind = ActorKind::new(AGENT_KIND).expect("the agent kind name is valid");
        let factory = AgentFactory {
            shared: Arc::clone(&shared),
        };
        let runtime = self.runtime.register(kind, factory, self.kind_config)?.start();
        shared.set_clock(runtime.handle().clock());
        let client = AgentClient {
            runtime: runtime.handle(),
            shared,
        };
        Ok(AgentSystem { runtime, client })
    }
}

/// A cheap, cloneable handle for asking agents and reading their conversations.
#[derive(Clone)]
pub struct AgentClient {
    runtime: RuntimeHandle,
    shared: Arc<AgentShared>,
}

impl std::fmt::Debug for AgentClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentClient")
            .field("agents", &self.shared.directory.list().len())
            .finish()
    }
}

impl AgentClient {
    /// The runtime the agents run in.
    pub fn runtime(&self) -> &RuntimeHandle {
        &self.runtime
    }

    /// The agent directory; agents added here can be asked at once.
    pub fn directory(&self) -> &AgentDirectory {
        &self.shared.directory
    }

    /// Removes agent `agent`: it leaves the directory (new calls to it are refused with
    /// `AgentNotFound`), then its live activation, if any, is deactivated with the same
    /// handshake as idle deactivation (its running turn and already queued requests
    /// finish, then it saves and stops). Requests that reach it afterwards are refused.
    /// Its stored conversation is kept. Returns its definition, or `None` if there was
    /// no such agent.
    ///
    /// # Errors
    /// [`InvokeError::Shutdown`] if the runtime has stopped.
    pub async fn remove_agent(&self, agent: &str) -> Result<Option<AgentSpec>, InvokeError> {
        let removed = self.shared.directory.remove(agent);
        if removed.is_some() {
            if let Ok(id) = agent_id(agent) {
                self.runtime.deactivate(&id).await?;
            }
        }
        Ok(removed)
    }

    /// Sends `text` to agent `agent` from outside and waits up to
    /// [`AGENT_ASK_TIMEOUT_MS_DEFAULT`] for its reply.
    ///
    /// # Errors
    /// As [`AgentClient::ask_with_timeout`].
    pub async fn ask(&self, agent: &str, text: &str) -> Result<AgentReply, AgentCallError> {
        self.ask_with_timeout(agent, text, Duration::from_millis(AGENT_ASK_TIMEOUT_MS_DEFAULT))
            .await
    }

    /// Sends `text` (cut to `AGENT_MESSAGE_SIZE_MAX_BYTES`) to agent `agent` from
    /// outside (depth 0) and waits up to `timeout` (capped at the runtime's maximum) for
    /// its reply. The call is reported to the observers as a root of the call tree.
    ///
    /// # Errors
    /// [`AgentCallError::Refused`] with `AgentNotFound` for an agent not in the directory,
    /// [`AgentCallError::InvalidAgentId`], [`AgentCallError::Invoke`] (timeout, the
    /// agent's turn failed: its model failed or it ran out of steps, storage, shutdown),
    /// [`AgentCallError::MalformedReply`].
    pub async fn ask_with_timeout(
        &self,
        agent: &str,
        text: &str,
        timeout: Duration,
    ) -> Result<AgentReply, AgentCallError> {
        let target = agent_id(agent).map_err(|error| AgentCallError::InvalidAgentId {
            agent_id: agent.to_string(),
            cause: error.to_string(),
        })?;
        let call = self.shared.next_call_id();
        let now = self.runtime.now();
        self.shared.emit(&AgentEvent::CallStarted {
            call,
            parent: None,
            caller: None,
            target: target.clone(),
            depth: 0,
            at: now,
        });
        let result = if self.shared.directory.contains(agent) {
            let timeout = timeout.min(Duration::from_millis(INVOKE_TIMEOUT_MS_MAX));
            let request = AgentRequest {
                text: truncate_utf8(text, AGENT_MESSAGE_SIZE_MAX_BYTES).to_string(),
                from: None,
                call: Some(call),
            };
            match self
                .runtime
                .invoke(&target, request.encode(), self.runtime.deadline_in(timeout))
                .await
            {
                Ok(bytes) => AgentReply::decode(&bytes).map_err(|cause| AgentCallError::MalformedReply {
                    target: target.clone(),
                    cause,
                }),
                Err(error) => Err(AgentCallError::Invoke(error)),
            }
        } else {
            Err(AgentCallError::Refused(CallRefused::AgentNotFound {
                target: target.clone(),
            }))
        };
        let outcome = match &result {
            Ok(reply) => CallOutcome::Replied {
                bytes: reply.text.len(),
            },
            Err(error) => error.outcome(),
        };
        self.shared.emit(&AgentEvent::CallFinished {
            call,
            outcome,
            at: self.runtime.now(),
        });
        result
    }

    /// Agent `agent`'s full conversation log from the store, oldest first: every user,
    /// assistant and tool message of every committed turn.
    ///
    /// # Errors
    /// [`StoreError`] if the store fails or an entry cannot be decoded (operation
    /// [`StoreOperation::Decode`]).
    pub async fn conversation_log(&self, agent: &str) -> Result<Vec<ChatMessage>, StoreError> {
        let id = agent_id(agent).map_err(|error| decode_error(error.to_string()))?;
        let store = self.runtime.store();
        let mut messages = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let page = store
                .scan(&id, "log/", after.as_deref(), troupe_runtime::STATE_SCAN_LIMIT_MAX)
                .await?;
            let Some((last, _)) = page.last() else { break };
            after = Some(last.clone());
            for (key, value) in &page {
                let message: ChatMessage =
                    serde_json::from_slice(value).map_err(|error| decode_error(format!("{key}: {error}")))?;
                messages.push(message);
            }
        }
        debug_assert!(messages.is_empty() || after.as_deref() == Some(log_key(messages.len() as u64 - 1).as_str()));
        Ok(messages)
    }

    /// Agent `agent`'s committed conversation window (what its model sees besides the
    /// system prompt), oldest first; empty if it never finished a turn.
    ///
    /// # Errors
    /// As [`AgentClient::conversation_log`].
    pub async fn history_window(&self, agent: &str) -> Result<Vec<ChatMessage>, StoreError> {
        let id = agent_id(agent).map_err(|error| decode_error(error.to_string()))?;
        let store = self.runtime.store();
        let Some(bytes) = store.load(&id).await? else {
            return Ok(Vec::new());
        };
        let saved = SavedAgent::decode(&bytes).map_err(decode_error)?;
        let after = saved.window_after();
        let limit = usize::try_from(saved.window).unwrap_or(usize::MAX);
        let page = store.scan(&id, "log/", after.as_deref(), limit).await?;
        page.into_iter()
            .map(|(key, value)| serde_json::from_slice(&value).map_err(|error| decode_error(format!("{key}: {error}"))))
            .collect()
    }
}

fn decode_error(cause: String) -> StoreError {
    StoreError::Backend {
        operation: StoreOperation::Decode,
        cause,
    }
}

/// A running agent system: a [`Runtime`] with the agent kind registered, and an
/// [`AgentClient`] (it dereferences to it).
pub struct AgentSystem {
    runtime: Runtime,
    client: AgentClient,
}

impl std::fmt::Debug for AgentSystem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentSystem")
            .field("client", &self.client)
            .finish_non_exhaustive()
    }
}

impl Deref for AgentSystem {
    type Target = AgentClient;
    fn deref(&self) -> &AgentClient {
        &self.client
    }
}

impl AgentSystem {
    /// A builder with no agents, no model and an in-memory store.
    pub fn builder() -> AgentSystemBuilder {
        AgentSystemBuilder::default()
    }

    /// A cloneable client, for use from other tasks.
    pub fn client(&self) -> AgentClient {
        self.client.clone()
    }

    /// Deactivates every agent and stops the runtime.
    pub async fn shutdown(self) {
        self.runtime.shutdown().await;
    }
}

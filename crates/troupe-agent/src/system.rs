//! The embedding API: build an [`AgentSystem`] (a runtime with the agent kind, a model
//! client, agents and tools), ask agents, read their conversations.

use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use troupe_core::limits::INVOKE_TIMEOUT_MS_MAX;
use troupe_core::{truncate_utf8, ActorId, ActorKind, CallContext, CallRefused, InvokeError, TraceId};
use troupe_runtime::{
    AnyValue, ConfigError, KindConfig, Runtime, RuntimeBuilder, RuntimeHandle, StateStore, StoreError, StoreOperation,
};

use crate::agent::{
    agent_id, decode_log_entry, log_key, window_messages, AgentFactory, AgentShared, SavedAgent, AGENT_KIND,
};
use crate::budget::{reply_or_exhausted, AskOptions};
use crate::call_agent::call_agent_tool;
use crate::inbox::{
    decode_reply, task_deadline, task_key, AgentCommand, EnqueueReply, InboxBody, InboxEntry, SendReply,
};
use crate::inbox_turns::{delegate_tool, notify_tool};
use crate::limits::AGENT_DELIVERY_ACK_TIMEOUT_MS;
use crate::limits::{AGENT_ASK_TIMEOUT_MS_DEFAULT, AGENT_MESSAGE_SIZE_MAX_BYTES, AGENT_TASK_ID_LENGTH_MAX_BYTES};
use crate::{
    AgentCallError, AgentCatalog, AgentDirectory, AgentEvent, AgentObserver, AgentReply, AgentRequest, AgentSpec,
    AgentSpecError, Budget, CallOutcome, ChatMessage, DelegateOptions, InboxError, LlmClient, MessageKind,
    NotifyOptions, TaskState, TaskStatus, Tool, ToolRegistry, ToolRegistryError,
};

/// Why an [`AgentSystem`] could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentSystemError {
    /// No model client was given.
    #[error("no LLM client was configured; call AgentSystemBuilder::llm")]
    NoLlm,
    /// An agent definition is invalid or repeated, or names an unknown provider or tool.
    #[error(transparent)]
    Spec(#[from] AgentSpecError),
    /// A tool name is repeated (`call_agent` is built in).
    #[error(transparent)]
    Tool(#[from] ToolRegistryError),
    /// The agent kind's configuration is invalid, or the runtime builder already has it.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A remote agent is invalid or has the id of a local agent.
    #[error(transparent)]
    Remote(#[from] crate::RemoteAgentError),
    /// [`PendingAgentSystem::attach`] was given a runtime without the agent kind.
    #[error("the runtime has no agent kind: start the runtime builder AgentSystemBuilder::prepare returned, and attach its handle")]
    NotRegistered,
}

/// Configures an [`AgentSystem`].
pub struct AgentSystemBuilder {
    runtime: RuntimeBuilder,
    llm: Option<Arc<dyn LlmClient>>,
    providers: BTreeMap<String, Arc<dyn LlmClient>>,
    agents: Vec<AgentSpec>,
    tools: Vec<Tool>,
    /// Attached MCP servers (`mcp_server`), whose tools change as they list them.
    tool_sources: Vec<Arc<dyn crate::tool::ToolSource>>,
    observers: Vec<Arc<dyn AgentObserver>>,
    kind_config: KindConfig,
    remotes: Vec<crate::RemoteAgent>,
}

impl Default for AgentSystemBuilder {
    fn default() -> Self {
        Self {
            runtime: Runtime::builder(),
            llm: None,
            providers: BTreeMap::new(),
            agents: Vec::new(),
            tools: Vec::new(),
            tool_sources: Vec::new(),
            observers: Vec::new(),
            kind_config: KindConfig::default(),
            remotes: Vec::new(),
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

    /// Uses `llm` for every agent that names no provider: the default provider
    /// (required).
    pub fn llm(mut self, llm: Arc<dyn LlmClient>) -> Self {
        self.llm = Some(llm);
        self
    }

    /// Registers model provider `name`: agents whose spec names it
    /// ([`AgentSpec::provider`]) send their model calls to `client`, the others to the
    /// default ([`AgentSystemBuilder::llm`]). A later provider of the same name replaces
    /// an earlier one.
    ///
    /// # Examples
    /// ```
    /// # use std::sync::Arc;
    /// # use troupe_agent::{AgentSpec, AgentSystem, ScriptRule, ScriptedLlm};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let cheap = Arc::new(ScriptedLlm::new().rule(ScriptRule::agent("summarizer").reply("short")));
    /// let system = AgentSystem::builder()
    ///     .llm(Arc::new(ScriptedLlm::new()))
    ///     .provider("cheap", cheap.clone())
    ///     .agent(AgentSpec::new("summarizer").provider("cheap"))
    ///     .start()?;
    /// assert_eq!(system.ask("summarizer", "hi").await?.text, "short");
    /// assert_eq!(cheap.requests().len(), 1);
    /// # system.shutdown().await;
    /// # Ok(())
    /// # }
    /// ```
    pub fn provider(mut self, name: impl Into<String>, client: Arc<dyn LlmClient>) -> Self {
        self.providers.insert(name.into(), client);
        self
    }

    /// Defines an agent.
    pub fn agent(mut self, spec: AgentSpec) -> Self {
        self.agents.push(spec);
        self
    }

    /// Makes `remote`, an agent on another A2A server, callable by its local id with
    /// `call_agent`, under the same rules as a local agent (see [`crate::RemoteAgent`]).
    pub fn remote_agent(mut self, remote: crate::RemoteAgent) -> Self {
        self.remotes.push(remote);
        self
    }

    /// Registers `tool` (besides the built-in `call_agent`, `delegate_to_agent` and
    /// `notify_agent`): every agent whose spec lists no tools has it, and an agent that
    /// lists tools ([`AgentSpec::tools`]) may name it.
    pub fn tool(mut self, tool: Tool) -> Self {
        self.tools.push(tool);
        self
    }

    /// Attaches MCP server `server`: its tools are offered as it lists them, now and
    /// while the system runs. When it says its list changed
    /// (`notifications/tools/list_changed`) or is started again, the new list is read
    /// (at once, and at the latest before the next model step of any agent), and the
    /// next step offers it: a tool new in it to every agent whose spec lists no tools
    /// (they have every tool) and to an agent that names it in [`AgentSpec::tools`]; a
    /// tool it no longer lists leaves every list, and a model that still calls it reads
    /// [`crate::McpError::ToolGone`]'s text. A step's list is fixed when the step starts.
    ///
    /// A name clash among the tools it lists at start (with a built-in, a
    /// [`AgentSystemBuilder::tool`] or another server's) fails
    /// [`AgentSystemBuilder::start`] with [`ToolRegistryError::Duplicate`]; a tool new
    /// later whose name is taken is not offered ([`AgentClient::refused_tools`], a
    /// warning): the tool that has the name keeps it, and `call_agent` and the other
    /// built-ins are never shadowed. A server offers at most [`crate::MCP_TOOLS_MAX`]
    /// tools: a longer list is refused when read, and the last one kept.
    #[cfg(not(madsim))]
    pub fn mcp_server(self, server: crate::McpServer) -> Self {
        self.mcp_server_with_prefix(server, "")
    }

    /// As [`AgentSystemBuilder::mcp_server`], each tool offered as `{prefix}{name}`
    /// (see [`crate::McpServer::tools_with_prefix`]).
    #[cfg(not(madsim))]
    pub fn mcp_server_with_prefix(mut self, server: crate::McpServer, prefix: &str) -> Self {
        self.tool_sources
            .push(Arc::new(crate::mcp::McpToolSource::new(server, prefix)));
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

    /// Registers the agent kind and starts the runtime: [`AgentSystemBuilder::prepare`],
    /// then [`Runtime`]'s start, then [`PendingAgentSystem::attach`].
    ///
    /// # Errors
    /// [`AgentSystemError`].
    ///
    /// # Panics
    /// Outside a tokio (or madsim) runtime.
    pub fn start(self) -> Result<AgentSystem, AgentSystemError> {
        let (runtime, pending) = self.prepare()?;
        let runtime = runtime.start();
        let client = pending.attach(runtime.handle())?;
        Ok(AgentSystem { runtime, client })
    }

    /// Builds the agents and registers the agent and conversation kinds (and the
    /// organisation record, a shared record kind) on the runtime builder, without
    /// starting it: for embedders that start the runtime themselves,
    /// such as a cluster node (`troupe_cluster::ClusterNode::start` takes the builder
    /// and sets its own store). Start the returned builder, then give its handle to
    /// [`PendingAgentSystem::attach`]. Until then, no agent can activate (an activation
    /// fails with `ActorFailed`, naming `PendingAgentSystem::attach`).
    ///
    /// # Errors
    /// [`AgentSystemError`] as [`AgentSystemBuilder::start`].
    pub fn prepare(self) -> Result<(RuntimeBuilder, PendingAgentSystem), AgentSystemError> {
        let llm = self.llm.ok_or(AgentSystemError::NoLlm)?;
        let mut tools = ToolRegistry::new();
        tools.register(call_agent_tool())?;
        tools.register(delegate_tool())?;
        tools.register(notify_tool())?;
        for tool in self.tools {
            tools.register(tool)?;
        }
        for source in &self.tool_sources {
            tools.add_source(Arc::clone(source))?;
        }
        let directory = AgentDirectory::with_catalog(AgentCatalog {
            providers: self.providers.keys().cloned().collect(),
            tools: tools.names(),
        })
        .with_tool_sources(self.tool_sources);
        for spec in self.agents {
            if directory.contains(&spec.id) {
                return Err(AgentSpecError::Duplicate { id: spec.id }.into());
            }
            directory.upsert(spec)?;
        }
        let shared = Arc::new(AgentShared::new(directory, llm, self.providers, tools, self.observers));
        for remote in self.remotes {
            if shared.directory.contains(&remote.id) {
                return Err(crate::RemoteAgentError::ClashesWithLocal { id: remote.id }.into());
            }
            shared.remotes.upsert(remote)?;
        }
        let kind = ActorKind::new(AGENT_KIND).expect("the agent kind name is valid");
        let factory = AgentFactory {
            shared: Arc::clone(&shared),
        };
        let conversations = crate::conversation::ConversationFactory {
            shared: Arc::clone(&shared),
        };
        let conversation_kind = ActorKind::new(crate::CONVERSATION_KIND).expect("the conversation kind name is valid");
        let org_kind = ActorKind::new(crate::ORG_STORE_KIND).expect("the organisation kind name is valid");
        let runtime = self
            .runtime
            .register(kind, factory, self.kind_config)?
            .register(conversation_kind, conversations, KindConfig::default())?
            // Written by every process sharing the store (every node of a cluster).
            .shared_record_kind(org_kind)?
            .shared_record_kind(
                ActorKind::new(crate::DIRECTORY_STORE_KIND).expect("the directory kind name is valid"),
            )?;
        Ok((runtime, PendingAgentSystem { shared }))
    }
}

/// Agents built by [`AgentSystemBuilder::prepare`], waiting for the runtime that was
/// started from the builder `prepare` returned.
pub struct PendingAgentSystem {
    shared: Arc<AgentShared>,
}

impl std::fmt::Debug for PendingAgentSystem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingAgentSystem")
            .field("agents", &self.shared.directory.list().len())
            .finish()
    }
}

impl PendingAgentSystem {
    /// Attaches the agents to `runtime`, the started runtime of the builder
    /// [`AgentSystemBuilder::prepare`] returned, and returns the client. Inbox and
    /// outbox entries left by an earlier run are scheduled again (on this runtime).
    ///
    /// With a [`troupe_runtime::RootCallRouter`] installed in the runtime (a cluster
    /// node installs one), the client's asks, notifications and commands go to the
    /// node that owns the agent.
    ///
    /// # Errors
    /// [`AgentSystemError::NotRegistered`] if `runtime` does not have the agent kind
    /// (it was not started from the builder `prepare` returned).
    ///
    /// # Panics
    /// Outside a tokio (or madsim) runtime.
    pub fn attach(self, runtime: RuntimeHandle) -> Result<AgentClient, AgentSystemError> {
        let kind = ActorKind::new(AGENT_KIND).expect("the agent kind name is valid");
        if !runtime.is_registered(&kind) {
            return Err(AgentSystemError::NotRegistered);
        }
        let shared = self.shared;
        // The agents it was built with are defined anew at each start: now.
        shared.directory.set_defined_at_where_unknown(runtime.now().as_micros());
        shared.set_runtime(runtime.clone());
        let client = AgentClient { runtime, shared };
        // Inbox and outbox entries left by an earlier run are scheduled again.
        let resumer = client.clone();
        tokio::spawn(async move {
            if let Err(error) = resumer.resume_pending().await {
                tracing::warn!(%error, "resuming pending inbox and outbox entries failed");
            }
            if let Err(error) = resumer.arm_overdue_wakes().await {
                tracing::warn!(%error, "arming the wake-ups of open delegated tasks failed");
            }
            if let Err(error) = resumer.resume_conversations().await {
                tracing::warn!(%error, "resuming pending mentions failed");
            }
        });
        Ok(client)
    }
}

/// A cheap, cloneable handle for asking agents and reading their conversations.
#[derive(Clone)]
pub struct AgentClient {
    pub(crate) runtime: RuntimeHandle,
    pub(crate) shared: Arc<AgentShared>,
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

    /// The names of the tools offered now, sorted: the built-ins, those given to
    /// [`AgentSystemBuilder::tool`] and those the attached MCP servers list now (each
    /// agent is offered those of them it may use).
    pub fn tool_names(&self) -> Vec<String> {
        self.shared.tools.names()
    }

    /// The attached MCP servers' tools that are not offered because their name is
    /// taken, each a [`ToolRegistryError::Clash`] naming it, its server and what has
    /// the name.
    pub fn refused_tools(&self) -> Vec<ToolRegistryError> {
        self.shared.tools.refused()
    }

    /// The agent directory of this process; agents added here can be asked at once.
    /// Changes made here stay in this process; [`AgentClient::define_agent`],
    /// [`AgentClient::replace_agent`] and [`AgentClient::remove_agent`] store theirs.
    pub fn directory(&self) -> &AgentDirectory {
        &self.shared.directory
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
    /// [`AgentCallError::InvalidAgentId`], [`AgentCallError::ModelFailed`] (the agent's
    /// model failed: the model's [`crate::LlmError`], typed: rate limited, too large,
    /// timed out, unreachable, malformed, stopped early, ...), [`AgentCallError::Invoke`]
    /// (timeout, the agent's turn failed otherwise: it ran out of steps, storage,
    /// shutdown), [`AgentCallError::MalformedReply`].
    pub async fn ask_with_timeout(
        &self,
        agent: &str,
        text: &str,
        timeout: Duration,
    ) -> Result<AgentReply, AgentCallError> {
        self.ask_with(agent, text, AskOptions::default().timeout(timeout)).await
    }

    /// [`AgentClient::ask_with_timeout`] with options: the time to wait and the
    /// [`Budget`] of the whole request (the agent's turn and every call it makes). The
    /// reply's `spent` says what the request spent, never more than the budget when the
    /// model honours its per-call cap.
    ///
    /// # Errors
    /// As [`AgentClient::ask_with_timeout`], and [`AgentCallError::BudgetExhausted`]
    /// when the budget ran out before the agent's final answer.
    ///
    /// # Examples
    /// ```
    /// # use std::sync::Arc;
    /// # use troupe_agent::{AgentCallError, AgentSpec, AgentSystem, AskOptions, Budget, ScriptRule, ScriptedLlm};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let llm = ScriptedLlm::new().rule(ScriptRule::agent("a").reply("a short answer"));
    /// let system = AgentSystem::builder().llm(Arc::new(llm)).agent(AgentSpec::new("a")).start()?;
    /// let reply = system.ask_with("a", "hi", AskOptions::default().budget(Budget::tokens(100))).await?;
    /// assert!(reply.spent.tokens <= 100);
    /// let starved = system.ask_with("a", "hi", AskOptions::default().budget(Budget::tokens(3))).await;
    /// assert!(matches!(starved, Err(AgentCallError::BudgetExhausted(_))));
    /// # system.shutdown().await;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn ask_with(&self, agent: &str, text: &str, options: AskOptions) -> Result<AgentReply, AgentCallError> {
        let AskOptions {
            timeout,
            budget,
            trace_id,
        } = options;
        let target = agent_id(agent).map_err(|error| AgentCallError::InvalidAgentId {
            agent_id: agent.to_string(),
            cause: error.to_string(),
        })?;
        let call = self.shared.next_call_id();
        // The event (the id copied, the clock read) is made only for someone to receive
        // it: `emit` hands it to the listeners, and there are none.
        if self.shared.has_listeners() {
            self.shared.emit(&AgentEvent::CallStarted {
                call,
                parent: None,
                caller: None,
                target: target.clone(),
                depth: 0,
                at: self.runtime.now(),
            });
        }
        let result = if self.lists_agent(agent).await {
            let timeout = timeout.min(Duration::from_millis(INVOKE_TIMEOUT_MS_MAX));
            let request = AgentRequest {
                text: truncate_utf8(text, AGENT_MESSAGE_SIZE_MAX_BYTES).to_string(),
                from: None,
                call: Some(call),
                budget,
            };
            let deadline = self.runtime.deadline_in(timeout);
            // Routed with its context: on a cluster node the turn runs under the trace id
            // (if any) on the agent's owner.
            let mut context = CallContext::root(deadline);
            if let Some(trace) = trace_id {
                context = context.with_trace_id(trace);
            }
            ask_from_outside(&self.runtime, &target, request, context)
                .await
                .map_err(|error| match error {
                    AgentCallError::Invoke(error) => AgentCallError::Invoke(timeout_as_given(error, &target, timeout)),
                    other => other,
                })
        } else {
            Err(AgentCallError::Refused(CallRefused::AgentNotFound {
                target: target.clone(),
            }))
        };
        self.outside_call_finished(call, result)
    }

    /// A new trace id for a request that enters this process without one: made from a
    /// per-process counter, the runtime's clock and the process id, hashed (SipHash
    /// with fixed keys), so it draws no randomness: under simulation the same seed makes
    /// the same ids. Not a secret; unique in practice across processes and restarts.
    pub fn new_trace_id(&self) -> TraceId {
        TraceId::new(self.shared.fresh_id(self.runtime.now()))
    }

    /// Reports the end of call `call` from outside ([`AgentEvent::CallFinished`]) and
    /// returns its result.
    pub(crate) fn outside_call_finished(
        &self,
        call: u64,
        result: Result<AgentReply, AgentCallError>,
    ) -> Result<AgentReply, AgentCallError> {
        // As the start's: made only for a listener.
        if !self.shared.has_listeners() {
            return result;
        }
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

    /// Sends agent `agent` a notification from outside and returns its id once it is
    /// persisted in the agent's inbox, which names it (`{agent}.in{seq}`, unique for
    /// good). The agent processes it in a turn of its own, exactly once. A retry after an
    /// error may append it twice: use [`AgentClient::notify_with_id`] to retry safely.
    ///
    /// # Errors
    /// As [`AgentClient::notify_with_id`].
    pub async fn notify(&self, agent: &str, text: &str) -> Result<String, InboxError> {
        self.append_notification(agent, "", text, None, None).await
    }

    /// Sends agent `agent` notification `msg_id` (non-empty, chosen by the caller) from
    /// outside, to be processed before `timeout_ms` (default and cap as for tasks);
    /// returns once it is persisted in the agent's inbox (acknowledged), or was already
    /// there: retrying with the same id never makes a second entry.
    ///
    /// # Errors
    /// [`InboxError::Full`] (nothing kept), [`InboxError::Refused`] (`AgentNotFound`;
    /// `InvalidTimeout` for a `timeout_ms` of 0, nothing sent),
    /// [`InboxError::InvalidAgentId`], [`InboxError::EmptyMessageId`],
    /// [`InboxError::MessageIdTooLong`] (nothing sent),
    /// [`InboxError::Invoke`] (timeout, storage, shutdown: whether it was kept is
    /// unknown; retry with the same id).
    pub async fn notify_with_id(
        &self,
        agent: &str,
        msg_id: &str,
        text: &str,
        timeout_ms: Option<u64>,
    ) -> Result<(), InboxError> {
        if msg_id.is_empty() {
            return Err(InboxError::EmptyMessageId);
        }
        crate::inbox::check_message_id_length(msg_id)?;
        self.append_notification(agent, msg_id, text, timeout_ms, None)
            .await
            .map(|_| ())
    }

    /// Sends agent `agent` a notification from outside with `options` (its id, its
    /// timeout, the trace the turn that processes it runs under); returns its id once
    /// it is persisted in the agent's inbox, as [`AgentClient::notify_with_id`] (with
    /// an id) or [`AgentClient::notify`] (without) do.
    ///
    /// # Errors
    /// As [`AgentClient::notify_with_id`].
    pub async fn notify_with(&self, agent: &str, text: &str, options: NotifyOptions) -> Result<String, InboxError> {
        let NotifyOptions {
            msg_id,
            timeout_ms,
            trace_id,
        } = options;
        if msg_id.as_deref() == Some("") {
            return Err(InboxError::EmptyMessageId);
        }
        crate::inbox::check_message_id_length(msg_id.as_deref().unwrap_or_default())?;
        let msg_id = msg_id.unwrap_or_default();
        self.append_notification(agent, &msg_id, text, timeout_ms, trace_id)
            .await
    }

    async fn append_notification(
        &self,
        agent: &str,
        msg_id: &str,
        text: &str,
        timeout_ms: Option<u64>,
        trace_id: Option<TraceId>,
    ) -> Result<String, InboxError> {
        crate::inbox::check_send_timeout(timeout_ms)?;
        let target = self.known_agent(agent).await?;
        let now = self.runtime.now();
        let mut context = CallContext::root(task_deadline(now, timeout_ms));
        if let Some(trace) = trace_id {
            context = context.with_trace_id(trace);
        }
        let entry = InboxEntry {
            msg_id: msg_id.to_string(),
            from: None,
            body: InboxBody::Notify {
                text: truncate_utf8(text, AGENT_MESSAGE_SIZE_MAX_BYTES).to_string(),
            },
            context,
            budget: Budget::UNLIMITED,
            pair: None,
        };
        // The agent may be in a long turn: the append waits for it.
        let ack = Duration::from_millis(AGENT_DELIVERY_ACK_TIMEOUT_MS);
        let reply = self
            .runtime
            .invoke_routed_within(&target, AgentCommand::Enqueue(entry).encode(), ack)
            .await?;
        let msg_id = match decode_reply::<EnqueueReply>(&reply)? {
            EnqueueReply::Accepted { msg_id } => msg_id,
            EnqueueReply::Duplicate => msg_id.to_string(),
            EnqueueReply::Full { capacity } => return Err(InboxError::Full { target, capacity }),
            EnqueueReply::OutOfOrder { .. } | EnqueueReply::Stale { .. } => {
                return Err(InboxError::Malformed {
                    cause: "a notification from outside, which has no sender order, was refused as out of order"
                        .to_string(),
                })
            }
        };
        self.shared.emit(&AgentEvent::MessageSent {
            msg_id: msg_id.clone(),
            from: None,
            to: target,
            kind: MessageKind::Notification,
            at: self.runtime.now(),
        });
        Ok(msg_id)
    }

    /// Makes agent `from` send agent `to` a notification, as its `notify_agent` tool
    /// does: admission as for a call, then the notification is committed to `from`'s
    /// outbox and delivered until acknowledged. Returns the message id.
    ///
    /// # Errors
    /// [`InboxError::Refused`], [`InboxError::OutboxFull`],
    /// [`InboxError::InvalidAgentId`], [`InboxError::Invoke`].
    pub async fn notify_as(&self, from: &str, to: &str, text: &str) -> Result<String, InboxError> {
        self.send_as(from, to, text, None, false, None).await
    }

    /// Makes agent `from` delegate `text` to agent `to`, as its `delegate_to_agent`
    /// tool does, with a deadline `timeout_ms` from now (default
    /// [`crate::limits::AGENT_TASK_TIMEOUT_MS_DEFAULT`], capped at its maximum; 0 is
    /// refused, [`InboxError::Refused`] with `InvalidTimeout`). Returns the task id at once;
    /// the task is committed to `from`'s outbox and delivered until acknowledged; `to`
    /// works on it in a turn of its own, and the result, failure or cancellation comes
    /// back to `from` as a new turn, exactly once ([`AgentClient::task`] shows it).
    ///
    /// # Errors
    /// As [`AgentClient::notify_as`].
    pub async fn delegate(
        &self,
        from: &str,
        to: &str,
        text: &str,
        timeout_ms: Option<u64>,
    ) -> Result<String, InboxError> {
        self.send_as(from, to, text, timeout_ms, true, None).await
    }

    /// [`AgentClient::delegate`] with `options`: its timeout, and the trace the
    /// delegation runs under (the delegating agent's turn, the task's turn at `to`, and
    /// the turn that takes the result back at `from`).
    ///
    /// # Errors
    /// As [`AgentClient::notify_as`].
    pub async fn delegate_with(
        &self,
        from: &str,
        to: &str,
        text: &str,
        options: DelegateOptions,
    ) -> Result<String, InboxError> {
        self.send_as(from, to, text, options.timeout_ms, true, options.trace_id)
            .await
    }

    async fn send_as(
        &self,
        from: &str,
        to: &str,
        text: &str,
        timeout_ms: Option<u64>,
        task: bool,
        trace_id: Option<TraceId>,
    ) -> Result<String, InboxError> {
        crate::inbox::check_send_timeout(timeout_ms)?;
        let sender = self.known_agent(from).await?;
        let command = if task {
            AgentCommand::Delegate {
                to: to.to_string(),
                text: text.to_string(),
                timeout_ms,
            }
        } else {
            AgentCommand::Notify {
                to: to.to_string(),
                text: text.to_string(),
                timeout_ms,
            }
        };
        match self.command_traced(&sender, command, trace_id).await? {
            SendReply::Sent(id) => Ok(id),
            SendReply::Refused(refused) => Err(InboxError::Refused(refused)),
            SendReply::NotPermitted(refused) => Err(InboxError::NotPermitted(refused)),
            SendReply::OutboxFull { limit } => Err(InboxError::OutboxFull { agent: sender, limit }),
            SendReply::InvalidAgentId { agent_id, cause } => Err(InboxError::InvalidAgentId { agent_id, cause }),
            other => Err(InboxError::Malformed {
                cause: format!("unexpected reply {other:?}"),
            }),
        }
    }

    /// Cancels task `task_id` that agent `agent` delegated. Returns `Ok(None)` once the
    /// cancellation is queued (the task then resolves as canceled if its delegatee had
    /// not started it, else with its result), or `Ok(Some(state))` if it had already
    /// ended.
    ///
    /// # Errors
    /// [`InboxError::UnknownTask`] (also for an id longer than
    /// [`AGENT_TASK_ID_LENGTH_MAX_BYTES`], which no task has), [`InboxError::InvalidAgentId`],
    /// [`InboxError::Invoke`].
    pub async fn cancel(&self, agent: &str, task_id: &str) -> Result<Option<TaskState>, InboxError> {
        let delegator = self.known_agent(agent).await?;
        if task_id.len() > AGENT_TASK_ID_LENGTH_MAX_BYTES {
            // No delegation has such an id (and its key would not fit in the store's).
            return Err(InboxError::UnknownTask {
                agent: delegator,
                task_id: task_id.to_string(),
            });
        }
        let command = AgentCommand::Cancel {
            task_id: task_id.to_string(),
        };
        match self.command(&delegator, command).await? {
            SendReply::CancelSent => Ok(None),
            SendReply::AlreadyFinal(state) => Ok(Some(state)),
            SendReply::UnknownTask => Err(InboxError::UnknownTask {
                agent: delegator,
                task_id: task_id.to_string(),
            }),
            other => Err(InboxError::Malformed {
                cause: format!("unexpected reply {other:?}"),
            }),
        }
    }

    /// [`AgentClient::command`], its turn under trace id `trace_id` (if any).
    async fn command_traced(
        &self,
        agent: &ActorId,
        command: AgentCommand,
        trace_id: Option<TraceId>,
    ) -> Result<SendReply, InboxError> {
        let Some(trace) = trace_id else {
            return self.command(agent, command).await;
        };
        let deadline = self
            .runtime
            .deadline_in(Duration::from_millis(AGENT_ASK_TIMEOUT_MS_DEFAULT));
        let context = CallContext::root(deadline).with_trace_id(trace);
        let reply = self
            .runtime
            .invoke_routed_in(agent, command.encode(), context)
            .await
            .map_err(|error| timeout_as_given(error, agent, Duration::from_millis(AGENT_ASK_TIMEOUT_MS_DEFAULT)))?;
        decode_reply(&reply)
    }

    pub(crate) async fn command(&self, agent: &ActorId, command: AgentCommand) -> Result<SendReply, InboxError> {
        // The agent may be in a long turn: wait as long as for an ask.
        let timeout = Duration::from_millis(AGENT_ASK_TIMEOUT_MS_DEFAULT);
        let reply = self
            .runtime
            .invoke_routed_within(agent, command.encode(), timeout)
            .await?;
        decode_reply(&reply)
    }

    pub(crate) async fn known_agent(&self, agent: &str) -> Result<ActorId, InboxError> {
        let id = agent_id(agent).map_err(|error| InboxError::InvalidAgentId {
            agent_id: agent.to_string(),
            cause: error.to_string(),
        })?;
        if !self.lists_agent(agent).await {
            return Err(InboxError::Refused(CallRefused::AgentNotFound { target: id }));
        }
        Ok(id)
    }

    /// Agent `agent`'s committed record of task `task_id` it delegated; `None` if there
    /// is none (an id longer than [`AGENT_TASK_ID_LENGTH_MAX_BYTES`] names none). A
    /// store down for a moment is read again for up to
    /// [`crate::AGENT_API_STORE_WAIT_MS`].
    ///
    /// # Errors
    /// As [`AgentClient::conversation_log`].
    pub async fn task(&self, agent: &str, task_id: &str) -> Result<Option<TaskStatus>, StoreError> {
        let id = agent_id(agent).map_err(|error| decode_error(error.to_string()))?;
        if task_id.len() > AGENT_TASK_ID_LENGTH_MAX_BYTES {
            // No delegation has such an id (and its key would not fit in the store's).
            return Ok(None);
        }
        let Some(bytes) = self.api_store().get(&id, &task_key(task_id)).await? else {
            return Ok(None);
        };
        <TaskStatus as crate::inbox::Record>::decode(&task_key(task_id), &bytes)
            .map(Some)
            .map_err(|error| decode_error(error.to_string()))
    }

    /// How many entries agent `agent` has in its inbox and its outbox, committed. A store
    /// down for a moment is read again for up to [`crate::AGENT_API_STORE_WAIT_MS`].
    ///
    /// # Errors
    /// As [`AgentClient::conversation_log`].
    pub async fn pending(&self, agent: &str) -> Result<(u64, u64), StoreError> {
        let id = agent_id(agent).map_err(|error| decode_error(error.to_string()))?;
        let Some(bytes) = self.api_store().load(&id).await? else {
            return Ok((0, 0));
        };
        let saved = SavedAgent::decode(&bytes).map_err(decode_error)?;
        Ok((saved.boxes.inbox_len, saved.boxes.outbox_len))
    }

    /// Wakes every agent of the directory that has committed inbox or outbox entries,
    /// so they are processed and delivered: after a restart (the system does it when
    /// it starts), or whenever the embedder wants (it is idempotent). Returns how many
    /// agents were woken.
    ///
    /// On a cluster node (a root call router installed), an agent with entries that is
    /// placed on another node is not woken: its owner's activation processes them (a
    /// local wake-up would start an activation here that the placement refuses). Each
    /// such agent costs one placement lookup (an etcd read); one whose lookup fails is
    /// skipped too, for the next call (the next sweep round) to look again. An agent
    /// placed here or nowhere is woken here, which claims it here: so an agent whose
    /// node died is taken over once that node's lease has ended. In a single process
    /// nothing is looked up.
    ///
    /// A store down for a moment is read again for up to
    /// [`crate::AGENT_API_STORE_WAIT_MS`] (all its reads share one deadline).
    ///
    /// # Errors
    /// [`StoreError`] if reading a snapshot fails.
    pub async fn resume_pending(&self) -> Result<usize, StoreError> {
        let mut woken = 0;
        let mut skipped = NotResumedHere::default();
        let store = self.api_store();
        // A removed agent's entries too: its draining activation ends them. The stored
        // directory is read first, so an agent an earlier run removed is known so.
        self.shared
            .defined
            .refresh_if_stale_through(&self.shared, &self.runtime, &store)
            .await;
        let ids = self
            .shared
            .directory
            .list()
            .into_iter()
            .map(|spec| spec.id.clone())
            .chain(self.shared.defined.removed_ids());
        for agent in ids {
            let Ok(id) = agent_id(&agent) else { continue };
            if !has_pending(&store, &id).await? {
                continue;
            }
            if !skipped.resume_here(&self.runtime, &id).await {
                continue;
            }
            if tell_resume(&self.runtime, &id).await {
                woken += 1;
            }
        }
        skipped.log(woken, "agents with pending entries");
        Ok(woken)
    }

    /// Resumes agent `id` if it has pending entries (`remove_agent`: its draining
    /// activation); whether it was told.
    pub(crate) async fn resume_if_pending(
        &self,
        store: &dyn troupe_runtime::StateStore,
        id: &ActorId,
    ) -> Result<bool, StoreError> {
        resume_if_pending(&self.runtime, store, id).await
    }

    /// Arms, for every agent of the directory with an open delegated task (a
    /// `task_due/` key), the wake-up that resolves its tasks overdue at the earliest due
    /// time, without activating it: the wake-ups armed by the turns of an earlier run,
    /// or of another node, are in that process's memory. Run by `attach`, and on a
    /// cluster node by each round of a resume sweep; one key read per agent. Returns how
    /// many agents have an open task.
    ///
    /// In a single process (no root call router) each is armed as its turns would arm
    /// it (`overdue_wake::arm_overdue_wake`): told at the due time. On a cluster node,
    /// which may not run the agent, as a watch (`overdue_wake::watch_overdue_wake`): it
    /// looks again [`crate::limits::AGENT_OVERDUE_TAKEOVER_DELAY_MS`] after the due time
    /// and wakes the agent, through the router, only if its node has not resolved the
    /// task by then (it died, say). The node that runs the agent arms its own wake-up at
    /// the agent's turns (each activation's first command scans the index).
    ///
    /// A store down for a moment is read again for up to
    /// [`crate::AGENT_API_STORE_WAIT_MS`] (all its reads share one deadline).
    ///
    /// # Errors
    /// [`StoreError`] if reading a key fails.
    pub(crate) async fn arm_overdue_wakes(&self) -> Result<usize, StoreError> {
        let mut armed = 0;
        let cluster = self.runtime.has_root_call_router();
        let store = self.api_store();
        for spec in self.shared.directory.list() {
            let Ok(id) = agent_id(&spec.id) else { continue };
            let Some(due_us) = crate::overdue_wake::earliest_task_due(&store, &id).await? else {
                continue;
            };
            if cluster {
                crate::overdue_wake::watch_overdue_wake(&self.shared, &id, due_us);
            } else {
                crate::overdue_wake::arm_overdue_wake(&self.shared, &id, due_us);
            }
            armed += 1;
        }
        Ok(armed)
    }

    /// A stream of every [`AgentEvent`] from now on: a bounded broadcast
    /// ([`crate::limits::AGENT_EVENT_STREAM_CAPACITY`] per subscriber) that never slows
    /// the agents; a subscriber that falls behind gets
    /// `RecvError::Lagged(missed)` and continues with the oldest event kept.
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<AgentEvent> {
        self.shared.stream.subscribe()
    }

    /// Agent `agent`'s full conversation log from the store, oldest first: every user,
    /// assistant and tool message of every committed turn. A store down for a moment is
    /// read again for up to [`crate::AGENT_API_STORE_WAIT_MS`] (all its reads share one
    /// deadline).
    ///
    /// # Errors
    /// [`StoreError`] if the store fails or an entry cannot be decoded (operation
    /// [`StoreOperation::Decode`]).
    pub async fn conversation_log(&self, agent: &str) -> Result<Vec<ChatMessage>, StoreError> {
        let id = agent_id(agent).map_err(|error| decode_error(error.to_string()))?;
        let store = self.api_store();
        let mut messages = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let page = store
                .scan(&id, "log/", after.as_deref(), troupe_runtime::STATE_SCAN_LIMIT_MAX)
                .await?;
            let Some((last, _)) = page.last() else { break };
            after = Some(last.clone());
            for (key, value) in &page {
                let entry: Vec<ChatMessage> =
                    decode_log_entry(value).map_err(|error| decode_error(format!("{key}: {error}")))?;
                messages.extend(entry);
            }
        }
        debug_assert!(messages.is_empty() || after.as_deref() == Some(log_key(messages.len() as u64 - 1).as_str()));
        Ok(messages)
    }

    /// A page of agent `agent`'s conversation log: at most `limit` messages ending
    /// before message number `before` (`None`: the log's end; past it: the end), oldest
    /// first, with the log's length when read. Reads only the log entries that hold the
    /// page's messages (and the agent's saved counters), so a page of an old agent's
    /// log costs what a page of a new one does; [`AgentClient::conversation_log`] reads
    /// the whole log. A store down for a moment is read again for up to
    /// [`crate::AGENT_API_STORE_WAIT_MS`] (all its reads share one deadline).
    ///
    /// # Errors
    /// As [`AgentClient::conversation_log`].
    pub async fn conversation_log_page(
        &self,
        agent: &str,
        before: Option<u64>,
        limit: usize,
    ) -> Result<LogPage, StoreError> {
        let id = agent_id(agent).map_err(|error| decode_error(error.to_string()))?;
        let store = self.api_store();
        let total = match store.load(&id).await? {
            Some(bytes) => SavedAgent::decode(&bytes).map_err(decode_error)?.log_length,
            None => 0,
        };
        let end = before.unwrap_or(total).min(total);
        let start = end.saturating_sub(u64::try_from(limit).unwrap_or(u64::MAX));
        let wanted = usize::try_from(end - start).unwrap_or(usize::MAX);
        let mut messages = Vec::with_capacity(wanted);
        // Entries are keyed by their last message's number: the first entry after the
        // key of `start - 1` holds message `start`. An entry holds one message or more
        // (a turn's), so `wanted` entries are enough, and a page of entries may run past
        // `end` (cut below). A turn committed since the counters were read only adds
        // entries after `end`.
        let mut after = start.checked_sub(1).map(log_key);
        while messages.len() < wanted {
            let scan_limit = (wanted - messages.len()).min(troupe_runtime::STATE_SCAN_LIMIT_MAX);
            let page = store.scan(&id, "log/", after.as_deref(), scan_limit).await?;
            let Some((last, _)) = page.last() else { break };
            after = Some(last.clone());
            messages.extend(window_messages(page, start).map_err(decode_error)?);
        }
        messages.truncate(wanted);
        Ok(LogPage { total, start, messages })
    }

    /// Agent `agent`'s committed conversation window (what its model sees besides the
    /// system prompt), oldest first; empty if it never finished a turn. A store down for
    /// a moment is read again for up to [`crate::AGENT_API_STORE_WAIT_MS`].
    ///
    /// # Errors
    /// As [`AgentClient::conversation_log`].
    pub async fn history_window(&self, agent: &str) -> Result<Vec<ChatMessage>, StoreError> {
        let id = agent_id(agent).map_err(|error| decode_error(error.to_string()))?;
        let store = self.api_store();
        let Some(bytes) = store.load(&id).await? else {
            return Ok(Vec::new());
        };
        let saved = SavedAgent::decode(&bytes).map_err(decode_error)?;
        let after = saved.window_after();
        let limit = usize::try_from(saved.window).unwrap_or(usize::MAX);
        let page = store.scan(&id, "log/", after.as_deref(), limit).await?;
        window_messages(page, saved.window_start()).map_err(decode_error)
    }
}

fn decode_error(cause: String) -> StoreError {
    StoreError::Backend {
        operation: StoreOperation::Decode,
        cause,
    }
}

/// A page of an agent's conversation log ([`AgentClient::conversation_log_page`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LogPage {
    /// The log's length when it was read, in messages.
    pub total: u64,
    /// The number of the page's first message (0: the log's first).
    pub start: u64,
    /// Messages `start..start + messages.len()`, oldest first.
    pub messages: Vec<ChatMessage>,
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

    /// Stores the `call_agent` exchanges recorded in this process that still wait in
    /// memory (each conversation within
    /// [`crate::limits::CALL_RECORD_SHUTDOWN_FLUSH_TIMEOUT_MS`]), then deactivates every
    /// agent and stops the runtime, then ends the tasks delivering inbox entries and
    /// mentions, wherever they wait (an approval among them), and waits (at most
    /// [`crate::limits::DELIVERY_TASKS_SHUTDOWN_WAIT_MS`]) for them to be gone: what
    /// they had not delivered is still stored, and the next start delivers it.
    pub async fn shutdown(self) {
        let shared = &self.client.shared;
        for conversation in shared.conversations_with_waiting_records() {
            let timeout = Duration::from_millis(crate::limits::CALL_RECORD_SHUTDOWN_FLUSH_TIMEOUT_MS);
            let stored =
                crate::call_record::store_waiting_records(shared, &self.client.runtime, &conversation, timeout).await;
            if let Err(error) = stored {
                tracing::warn!(%conversation, %error, "recorded calls were not stored before the shutdown");
            }
        }
        self.runtime.shutdown().await;
        // The delivery tasks end now, wherever they wait (an approval, a pause between
        // attempts: before, one waiting for an approval ran until its entry's deadline,
        // and this wait gave up on it); waiting for them closes their spans before an
        // exporter's last flush, and leaves no task of this system running after it.
        shared.stop_deliveries();
        let within = Duration::from_millis(crate::limits::DELIVERY_TASKS_SHUTDOWN_WAIT_MS);
        let running = shared.deliveries_ended(within).await;
        if running > 0 {
            tracing::warn!(
                running,
                "delivery tasks still ran when the shutdown stopped waiting for them"
            );
        }
    }
}

/// Asks agent `target` from outside under `context` (routed to its owner on a cluster
/// node) and returns its answer as the caller sees it: a reply that does not decode is
/// [`AgentCallError::MalformedReply`], an exhausted turn
/// [`AgentCallError::BudgetExhausted`].
pub(crate) async fn ask_from_outside(
    runtime: &RuntimeHandle,
    target: &ActorId,
    request: AgentRequest,
    context: CallContext,
) -> Result<AgentReply, AgentCallError> {
    // Within one process the request and the reply pass as values (no encoding or
    // decoding at either end); where root requests are routed (a cluster node) the
    // agent's owner may be another process, so they go as bytes.
    let answer = if runtime.has_root_call_router() {
        runtime
            .invoke_routed_in(target, request.into_encoded(), context)
            .await
            .map(|bytes| AgentReply::decode(&bytes))
    } else {
        runtime
            .invoke_value_in(target, AnyValue::new(request), context)
            .await
            .map(AgentReply::from_value)
    };
    match answer {
        Ok(reply) => reply
            .map_err(|cause| AgentCallError::MalformedReply {
                target: target.clone(),
                cause,
            })
            .and_then(reply_or_exhausted),
        Err(error) => Err(AgentCallError::of_invoke(error, target)),
    }
}

/// `error`, a timeout of `target` naming `timeout`, the time its caller gave, where the
/// caller made the request's deadline itself (`deadline_in`, to give the request a
/// context) and the runtime, reading the clock again when it sent it, names the time
/// from that later reading: on a real clock every ask from outside with 100 ms said
/// "timed out after 99 ms" (`tests/timeout_texts.rs`). Any other error is as it was.
pub(crate) fn timeout_as_given(error: InvokeError, target: &ActorId, timeout: Duration) -> InvokeError {
    match error {
        InvokeError::Timeout { target: timed_out, .. } if timed_out == *target => InvokeError::Timeout {
            target: timed_out,
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        },
        other => other,
    }
}

/// What a resume (`resume_pending`, `resume_conversations`) left to other nodes: actors
/// with pending entries placed on another node, or whose placement could not be looked
/// up (the next round looks again).
#[derive(Debug, Default)]
pub(crate) struct NotResumedHere {
    placed_elsewhere: usize,
    unknown: usize,
}

impl NotResumedHere {
    /// Whether `id` is to be woken here: not when the root router places it on another
    /// node or cannot say where it is (`Ok(false)` at once without a router: a single
    /// process resumes everything), which is counted.
    pub(crate) async fn resume_here(&mut self, runtime: &troupe_runtime::RuntimeHandle, id: &ActorId) -> bool {
        match runtime.placed_elsewhere(id).await {
            Ok(false) => true,
            Ok(true) => {
                self.placed_elsewhere += 1;
                false
            }
            Err(error) => {
                tracing::debug!(actor = %id, %error, "not resumed: where it is placed is not known");
                self.unknown += 1;
                false
            }
        }
    }

    /// Logs (debug) what was left to other nodes, if anything, beside the `woken` count
    /// of `what`.
    pub(crate) fn log(&self, woken: usize, what: &str) {
        if self.placed_elsewhere + self.unknown > 0 {
            tracing::debug!(
                woken,
                placed_elsewhere = self.placed_elsewhere,
                unknown = self.unknown,
                "{what} not resumed here: placed on another node, or not known where"
            );
        }
    }
}

/// Whether agent `id` has an entry in its inbox or outbox (the entries themselves, not
/// the snapshot's counters: a plain key read).
async fn has_pending(store: &dyn StateStore, id: &ActorId) -> Result<bool, StoreError> {
    if !store.scan(id, "inbox/", None, 1).await?.is_empty() {
        return Ok(true);
    }
    Ok(!store.scan(id, "outbox/", None, 1).await?.is_empty())
}

/// Tells agent `id` to resume its pending entries; whether the tell was taken.
async fn tell_resume(runtime: &RuntimeHandle, id: &ActorId) -> bool {
    let resume = AgentCommand::Resume {
        inbox_after: None,
        outbox_after: None,
    };
    let deadline = runtime.deadline_in(Duration::from_millis(INVOKE_TIMEOUT_MS_MAX));
    match runtime.tell(id, resume.encode(), deadline).await {
        Ok(()) => true,
        Err(error) => {
            tracing::warn!(agent = %id, %error, "could not resume");
            false
        }
    }
}

/// Resumes agent `id` if it has pending entries in `store`; whether it was told. A
/// removed agent's (`remove_agent`, or a removal read from the stored directory after
/// its activation was deactivated) starts its draining activation.
pub(crate) async fn resume_if_pending(
    runtime: &RuntimeHandle,
    store: &dyn StateStore,
    id: &ActorId,
) -> Result<bool, StoreError> {
    Ok(has_pending(store, id).await? && tell_resume(runtime, id).await)
}

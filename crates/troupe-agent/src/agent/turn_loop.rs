//! One conversation turn: the model loop, the tool calls of each step, the budget
//! meter, and the log writes at the end (see the diagram in `agent.rs`).

use std::sync::{Arc, Mutex};

use troupe_core::{truncate_utf8, ActorId, Deadline};
use troupe_runtime::{ActorError, Turn};

use super::AgentActor;
use crate::budget::BudgetMeter;
use crate::inbox::{PendingSends, SharedSends};
use crate::limits::{
    AGENT_REPLY_SIZE_MAX_BYTES, AGENT_TOOL_CALLS_PER_STEP_MAX, AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES,
    AGENT_TOOL_CALL_ID_SIZE_MAX_BYTES, AGENT_TOOL_NAME_SIZE_MAX_BYTES, AGENT_TOOL_RESULT_SIZE_MAX_BYTES,
    AGENT_TURN_STEPS_MAX,
};
use crate::{
    AgentEvent, AgentReply, AgentSpec, Budget, BudgetExhausted, BudgetResource, ChatMessage, LlmError, LlmRequest,
    Prompt, Role, TokenUsage, ToolCall, ToolExecutionContext, ToolSpec, CALL_AGENT_TOOL_NAME, DELEGATE_TOOL_NAME,
    NOTIFY_TOOL_NAME,
};

/// Cuts a tool-calling assistant message and its step's tool results (one per call
/// run, in order) to what an agent keeps of them: the first
/// [`AGENT_TOOL_CALLS_PER_STEP_MAX`] calls (the ones run; the last result says how many
/// more were skipped); the text to [`AGENT_REPLY_SIZE_MAX_BYTES`] (as an answer); each
/// call's id to [`AGENT_TOOL_CALL_ID_SIZE_MAX_BYTES`] (its result's id with it, see
/// [`converse_steps_kept_id`]), its name to [`AGENT_TOOL_NAME_SIZE_MAX_BYTES`] and its
/// arguments to [`AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES`] of JSON text (longer ones
/// become a JSON string of their text cut there), all on a character boundary. Every
/// kept call keeps a result with its id, as a chat's protocol requires, and the ids of
/// one step are present and distinct (see [`converse_steps_unique_id`]): a provider
/// refuses an empty id and cannot pair results with calls that share one.
fn converse_steps_keep_within_limits(message: &mut ChatMessage, results: &mut [ChatMessage], step: u32) {
    message.tool_calls.truncate(AGENT_TOOL_CALLS_PER_STEP_MAX);
    assert_eq!(message.tool_calls.len(), results.len(), "a result for every kept call");
    let kept = truncate_utf8(&message.content, AGENT_REPLY_SIZE_MAX_BYTES).len();
    message.content.truncate(kept);
    for (index, (call, result)) in message.tool_calls.iter_mut().zip(results.iter_mut()).enumerate() {
        if let Some(id) = converse_steps_kept_id(&call.id, index) {
            result.tool_call_id = Some(id.clone());
            call.id = id;
        }
    }
    // Ids present and distinct (the usual step) are looked at, not copied: only a step
    // with an empty or repeated id pays for making them distinct.
    let calls = &message.tool_calls;
    let ids_to_make = calls
        .iter()
        .enumerate()
        .any(|(index, call)| call.id.is_empty() || calls[..index].iter().any(|earlier| earlier.id == call.id));
    if ids_to_make {
        converse_steps_make_ids_distinct(message, results, step);
    }
    for (call, result) in message.tool_calls.iter_mut().zip(results.iter_mut()) {
        let kept = truncate_utf8(&call.name, AGENT_TOOL_NAME_SIZE_MAX_BYTES).len();
        call.name.truncate(kept);
        assert!(
            call.id.len() <= AGENT_TOOL_CALL_ID_SIZE_MAX_BYTES,
            "an id of {} bytes was kept",
            call.id.len()
        );
        assert_eq!(
            result.tool_call_id.as_deref(),
            Some(call.id.as_str()),
            "a result keeps its call's id"
        );
        let cut = match &call.arguments {
            serde_json::Value::String(text) if text.len() > AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES => {
                Some(truncate_utf8(text, AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES).to_string())
            }
            serde_json::Value::String(_) => None,
            arguments if json_size_over(arguments, AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES) => {
                let text = arguments.to_string();
                Some(truncate_utf8(&text, AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES).to_string())
            }
            _ => None,
        };
        if let Some(text) = cut {
            call.arguments = serde_json::Value::String(text);
        }
        let arguments_bytes = match &call.arguments {
            serde_json::Value::String(text) => text.len(),
            _ => 0, // checked above, without writing them out again
        };
        assert!(
            arguments_bytes <= AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES,
            "arguments of {arguments_bytes} bytes were kept, over {AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES}"
        );
    }
    assert!(
        message.content.len() <= AGENT_REPLY_SIZE_MAX_BYTES,
        "a text of {} bytes was kept, over {AGENT_REPLY_SIZE_MAX_BYTES}",
        message.content.len()
    );
}

/// Gives each call of step `step` whose id is empty or repeats an earlier call's an id
/// of its own ([`converse_steps_unique_id`]), its result with it, and says so in a
/// warning naming both ids.
#[cold]
#[inline(never)]
fn converse_steps_make_ids_distinct(message: &mut ChatMessage, results: &mut [ChatMessage], step: u32) {
    // The provider's ids (as kept), which a made id must not take, and the ids given so
    // far in this step (each at most AGENT_TOOL_CALLS_PER_STEP_MAX).
    let provided: Vec<String> = message.tool_calls.iter().map(|call| call.id.clone()).collect();
    let mut given: Vec<String> = Vec::with_capacity(message.tool_calls.len());
    for (index, (call, result)) in message.tool_calls.iter_mut().zip(results.iter_mut()).enumerate() {
        if call.id.is_empty() || given.contains(&call.id) {
            let id = converse_steps_unique_id(step, index, &provided, &given);
            tracing::warn!(
                step,
                call = index,
                from = %call.id,
                to = %id,
                "a tool call's id is empty or repeats an earlier call's of its step: it is sent and kept under an id \
                 of its own"
            );
            result.tool_call_id = Some(id.clone());
            call.id = id;
        }
        given.push(call.id.clone());
    }
}

/// The id an agent keeps for a tool call with `id`, the `index`th call of its step, if
/// not `id` itself: cut to [`AGENT_TOOL_CALL_ID_SIZE_MAX_BYTES`] on a character
/// boundary, ending in `~{index}` (so two long ids that differ only past the cut stay
/// distinct).
fn converse_steps_kept_id(id: &str, index: usize) -> Option<String> {
    if id.len() <= AGENT_TOOL_CALL_ID_SIZE_MAX_BYTES {
        return None;
    }
    let suffix = format!("~{index}");
    let mut kept = truncate_utf8(id, AGENT_TOOL_CALL_ID_SIZE_MAX_BYTES - suffix.len()).to_string();
    kept.push_str(&suffix);
    Some(kept)
}

/// An id for the `index`th call of step `step` whose own id is empty or repeats an
/// earlier call's of the step: `call_{step}_{index}`, made from the step and the
/// position only (the same on every run, as the simulator needs), or
/// `call_{step}_{index}_{n}` with the least `n` that makes it none of `provided` (the
/// provider's ids in the step, which may look like it) and `given` (the ids given so
/// far). Each of them rules out one `n` at most, so the id stays short.
fn converse_steps_unique_id(step: u32, index: usize, provided: &[String], given: &[String]) -> String {
    let taken = |id: &String| provided.contains(id) || given.contains(id);
    let id = format!("call_{step}_{index}");
    if !taken(&id) {
        return id;
    }
    (1..=provided.len() + given.len())
        .map(|n| format!("{id}_{n}"))
        .find(|candidate| !taken(candidate))
        .expect("each taken id rules out at most one candidate")
}

/// Whether `value` written as JSON is longer than `limit` bytes: written into a counter
/// that stops at the limit (no copy of the text is made).
fn json_size_over(value: &serde_json::Value, limit: usize) -> bool {
    struct Counter {
        bytes: usize,
        limit: usize,
    }
    impl std::io::Write for Counter {
        fn write(&mut self, buffer: &[u8]) -> std::io::Result<usize> {
            self.bytes += buffer.len();
            if self.bytes > self.limit {
                return Err(std::io::Error::other("over the limit"));
            }
            Ok(buffer.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    serde_json::to_writer(&mut Counter { bytes: 0, limit }, value).is_err()
}

/// One conversation turn to run: the user message and who it serves.
pub(crate) struct Conversation {
    /// The user message, as the model sees it.
    pub(crate) content: String,
    /// The observer's call id, if any.
    pub(crate) call: Option<u64>,
    /// When the model loop must be done (at or before the turn's deadline).
    pub(crate) deadline: Deadline,
    /// What the turn may spend.
    pub(crate) budget: Budget,
    /// The history the prompt shows instead of the agent's private window (a
    /// conversation's role-relative window); such a turn is neither logged in nor
    /// remembered by the private log: the conversation keeps it.
    pub(crate) history: Option<Vec<ChatMessage>>,
    /// The time its sender allowed, which the turn's timeout names if the deadline
    /// passes in its model loop (`AgentActor::timed_out`): `None` for an ask,
    /// whose caller's wait names the time it allowed in place of the turn's, so the turn
    /// names what it had left when it started; `Some(0)` where only the deadline is
    /// known (a task's or a notification's entry carries its deadline, not the time
    /// its sender gave: "its deadline passed"); a mention's whole time. Before, every
    /// turn named the time left when it started: a task delegated with 100 ms failed
    /// "timed out after 99 ms" when the clock moved between the delegation and the
    /// turn (`tests/timeout_texts.rs`), and far less after a wait in the inbox.
    pub(crate) allowed_ms: Option<u64>,
}

/// Why a conversation turn ([`AgentActor::converse`]) gave no answer: either the turn
/// must fail whole, answered by no one, or the agent could not answer, which its caller
/// is told (an ask's error, a failure note in a conversation, a failed task result).
#[derive(Debug)]
pub(crate) enum TurnError {
    /// The turn must fail whole, commit nothing and be answered by no one: this
    /// activation's fence was refused (another runtime on the store claimed the agent
    /// since, or this node lost its cluster lease: `StoreError::Fenced`, `NotOwner`),
    /// the store failed or refused a write, or the runtime was aborted. The agent never
    /// had the failure: an inbox entry stays, for the agent's current owner or a later
    /// try. Answered as the agent's failure (a note, a failed task), it reported a
    /// failure that was not the agent's (`cluster_conversation_partition_dst`, seed 19).
    Refused(ActorError),
    /// The agent's model gave no answer.
    Model(LlmError),
    /// The agent could not answer for another reason: the turn's deadline passed, it
    /// used all its model steps, its model provider is unknown, a send was refused.
    Failed(ActorError),
}

impl TurnError {
    /// The text an ask's caller gets for a model failure: `the model failed: ` and the
    /// error's text (`ModelFailed::from_cause` reads it back).
    pub(crate) const MODEL_FAILED_PREFIX: &'static str = "the model failed: ";

    /// The error of a write or send of the turn: a store's error refuses the whole turn
    /// ([`TurnError::Refused`]); any other is the agent's failure.
    fn of_store(error: ActorError) -> Self {
        match error {
            ActorError::Store(_) => Self::Refused(error),
            other => Self::Failed(other),
        }
    }

    /// As the actor's turn fails with it (an ask's caller gets this).
    pub(crate) fn into_actor_error(self) -> ActorError {
        match self {
            Self::Refused(error) | Self::Failed(error) => error,
            Self::Model(error) => ActorError::failed(format!("{}{error}", Self::MODEL_FAILED_PREFIX)),
        }
    }
}

/// The text of [`TurnError::into_actor_error`].
impl std::fmt::Display for TurnError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(error) | Self::Failed(error) => error.fmt(formatter),
            Self::Model(error) => write!(formatter, "{}{error}", Self::MODEL_FAILED_PREFIX),
        }
    }
}

/// What an agent's model is shown besides the chat: its system message and the tool
/// specs, kept with what they are derived from (the directory's and the remote
/// directory's generations, the organisation in the cache), so they are built again only
/// when one of those changed. The agent's definition is not compared here: a turn that
/// takes a new definition drops the cache (`AgentActor::handle`). Comparing it was
/// costly: an `AgentSpec` holds empty strings, and glibc's AVX-512 `memcmp` reads an
/// empty `String`'s dangling address with a masked load, a microcode assist per field
/// (perf, 2026-11-25: 10 % of a `call_agent` round trip).
pub(crate) struct PromptCache {
    directory: u64,
    remotes: u64,
    /// Held, so its address cannot be reused while it is compared.
    org: Option<Arc<crate::Organisation>>,
    /// The system message, a part of every prompt (shared, see [`Prompt`]).
    system: Arc<[ChatMessage]>,
    tools: Arc<[ToolSpec]>,
    /// The tool registry's generation `tools` was built at (an attached MCP server's
    /// list moves it).
    tools_generation: u64,
}

impl PromptCache {
    fn build(shared: &crate::agent::AgentShared, spec: &AgentSpec) -> Self {
        // Read before what they guard: a change made meanwhile leaves a stale key,
        // which the next lookup misses (never a new key on old contents).
        let directory = shared.directory.generation();
        let remotes = shared.remotes.generation();
        let tools_generation = shared.tools.generation();
        let org = shared.org.cached();
        let mut text = spec.system_prompt.clone();
        if !text.is_empty() {
            text.push_str("\n\n");
        }
        text.push_str(&format!("You are {} (agent id \"{}\")", spec.name, spec.id));
        if !spec.role.is_empty() {
            text.push_str(&format!(", {}", spec.role));
        }
        text.push('.');
        text.push_str(&crate::org_prompt::contacts_section(shared, spec));
        Self {
            directory,
            remotes,
            org,
            system: Arc::new([ChatMessage::new(Role::System, text)]),
            tools: crate::org_prompt::tool_specs_for(shared, spec),
            tools_generation,
        }
    }

    fn is_current(&self, shared: &crate::agent::AgentShared) -> bool {
        let org = shared.org.cached();
        let same_org = match (&self.org, &org) {
            (None, None) => true,
            (Some(cached), Some(now)) => Arc::ptr_eq(cached, now),
            _ => false,
        };
        same_org
            && self.directory == shared.directory.generation()
            && self.remotes == shared.remotes.generation()
            && self.tools_generation == shared.tools.generation()
    }
}

impl AgentActor {
    /// The prompt parts of the agent's current definition, built again only when what
    /// they are derived from changed.
    fn prompt_parts(&mut self) -> &PromptCache {
        let current = self.prompt.as_ref().is_some_and(|cache| cache.is_current(&self.shared));
        if !current {
            self.prompt = Some(PromptCache::build(&self.shared, &self.state.spec));
        }
        self.prompt.as_ref().expect("built above")
    }

    /// The system message: the agent's prompt, its role, and the peers it may call.
    fn system_message(&mut self) -> Arc<[ChatMessage]> {
        Arc::clone(&self.prompt_parts().system)
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

    /// The error of a turn whose runtime was aborted: the same [`InvokeError::Shutdown`]
    /// its caller gets when the runtime cancels the turn.
    ///
    /// [`InvokeError::Shutdown`]: troupe_core::InvokeError::Shutdown
    fn runtime_aborted(&self) -> ActorError {
        ActorError::Invoke(troupe_core::InvokeError::Shutdown)
    }

    /// Runs one conversation turn (see `converse_steps`) and reports its end
    /// ([`AgentEvent::TurnEnded`]) when anyone listens.
    pub(crate) async fn converse(
        &mut self,
        turn: &mut Turn,
        conversation: Conversation,
    ) -> Result<AgentReply, TurnError> {
        let call = conversation.call;
        let result = self.converse_steps(turn, conversation).await;
        if self.shared.has_listeners() {
            let (ok, steps, usage) = match &result {
                Ok(reply) => (reply.exhausted.is_none(), reply.steps, reply.usage),
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
    async fn converse_steps(&mut self, turn: &mut Turn, conversation: Conversation) -> Result<AgentReply, TurnError> {
        let clock = turn.clock();
        // The turn's deadline without its whole context: a root request's context is
        // built (and boxed) only when it is read (`Turn::context`), here only for a
        // listener.
        let turn_deadline = turn.deadline();
        let deadline = conversation.deadline.min(turn_deadline);
        let started = clock.now();
        let allowed_ms = conversation.allowed_ms;
        let timeout_ms = |from: troupe_core::Deadline| allowed_ms.unwrap_or_else(|| deadline.remaining_ms(from));
        if self.shared.has_listeners() {
            let context = turn.context();
            self.shared.emit(&AgentEvent::TurnStarted {
                agent: self.id.clone(),
                call: conversation.call,
                depth: context.depth(),
                chain: context.chain().to_vec(),
                deadline,
                trace_id: context.trace_id(),
                at: started,
            });
        }
        // The turn's new messages, a part per step (the user message; then each
        // step's assistant message and its tool results), shared with every later
        // prompt of the turn and then with the window.
        // The user message is its own part, shared from the start (`Prompt::push`: one
        // allocation, where a `Vec` turned into a part was two and a copy).
        let mut fresh = Prompt::new();
        fresh.push(ChatMessage::new(Role::User, conversation.content));
        let private = conversation.history.is_none();
        let own_history = conversation.history.map(Prompt::from);
        let boxes = self.state.boxes;
        let unsent =
            |agent: &ActorId| PendingSends::new(agent.clone(), boxes.outbox_next, boxes.outbox_len, boxes.tasks_open);
        // The turn's meter, on its own until a tool needs it shared (see `MeterSlot`).
        let mut meter = MeterSlot::Own(BudgetMeter::new(self.id.clone(), conversation.budget));
        // The tools' context (the turn's caller handle and the shared sends) is made at
        // the first step that calls a tool: a turn that only answers (every turn of an
        // agent without tools, the last step of any) needs neither, and the runtime
        // builds a turn's caller handle only when it is first asked for. What a tool
        // sees is the same either way: the handle is the turn's, made once.
        let mut tools: Option<(ToolExecutionContext, SharedSends)> = None;
        let parts = self.prompt_parts();
        let (mut specs, mut specs_generation) = (Arc::clone(&parts.tools), parts.tools_generation);
        let Some(llm) = self.shared.llm_for(&self.state.spec).cloned() else {
            let provider = self.state.spec.provider.clone().unwrap_or_default();
            return Err(TurnError::Failed(ActorError::failed(format!(
                "{} names model provider {provider:?}, which this system does not have",
                self.id
            ))));
        };
        let max_steps = self.state.spec.model.max_steps.clamp(1, AGENT_TURN_STEPS_MAX);
        let mut steps = 0;
        let mut usage = TokenUsage::default();
        // The answer's length as the model gave it, before it was cut.
        let mut answer_bytes = 0;
        // Whether the provider stopped the answer at its token limit.
        let mut answer_cut_by_model = false;
        // A turn whose budget runs out replies with the typed error and commits nothing
        // (its spend is reported all the same: the tokens are gone).
        let exhausted = |meter: &BudgetMeter, steps, usage, error: BudgetExhausted| AgentReply {
            text: String::new(),
            truncated: false,
            steps,
            usage,
            spent: meter.spent(),
            exhausted: Some(error),
        };
        // The whole model loop runs under one deadline (a timer per model call and per
        // tool step cost a registration in the timer wheel each, four for a `call_agent`
        // round trip; the deadline is the same for every step). At the turn's own
        // deadline the runtime ends the turn: its caller's wait ends then and the
        // abandoned turn is cancelled, or, with nobody waiting, the turn's own timer
        // fails it (a turn cut so reports no `TurnEnded`, as `AgentEvent` says). So the
        // loop has a timer of its own only for an earlier deadline (an inbox entry's,
        // whose turn gets a grace to commit the failure), made only if the loop has to
        // wait (`Clock::until`). A second timer at the turn's deadline cost a clock
        // reading and a timer each turn, and a registration in the timer wheel for each
        // that waits (an agent step 18,450 → 18,233 instructions, a `call_agent` round
        // trip 66,980 → 66,413 and about 5 % of its wall-clock time, 2026-12-04). A step
        // that finishes at the deadline's very instant is caught below, before the log
        // is written.
        let own_deadline = (deadline < turn_deadline).then_some(deadline);
        let steps_run = clock
            .until(own_deadline, async {
                loop {
                    if steps == max_steps {
                        return Err(TurnError::Failed(ActorError::failed(format!(
                            "{} used all {max_steps} model steps without a final answer",
                            self.id
                        ))));
                    }
                    // A runtime that was aborted (dropped, or its shutdown grace over) commits
                    // nothing more of this turn: no further model request or tool is started
                    // for it (the tool results of its last step may be refusals the model would
                    // otherwise be asked about).
                    if turn.runtime_aborted() {
                        return Err(TurnError::Refused(self.runtime_aborted()));
                    }
                    // Another runtime on this store (a second process on the SQLite file)
                    // may have claimed the agent since this activation started: a stale
                    // activation stops here, before paying for a model call whose answer it
                    // could not commit, and closes (`Turn::check_fence`). On SQLite a
                    // `PRAGMA data_version`, and a read only after another connection
                    // committed; on a store that cannot check, nothing.
                    turn.check_fence()
                        .await
                        .map_err(|error| TurnError::Refused(error.into()))?;
                    let max_tokens = match meter.get().model_call_cap() {
                        Ok(cap) => cap,
                        Err(error) => return Ok(Some(exhausted(meter.get(), steps, usage, error))),
                    };
                    // An attached MCP server's changed list is read (or its reading waited
                    // for) before the step: the step offers the tools listed now, and its
                    // list stays as it is until the next step.
                    if self.shared.tools.has_sources() {
                        self.shared.tools.refresh_sources().await;
                        let generation = self.shared.tools.generation();
                        if generation != specs_generation {
                            specs = crate::org_prompt::tool_specs_for(&self.shared, &self.state.spec);
                            specs_generation = generation;
                        }
                    }
                    steps += 1;
                    let mut messages = Prompt::from(self.system_message());
                    messages.extend_shared(own_history.as_ref().unwrap_or(&self.state.window));
                    messages.extend_shared(&fresh);
                    let llm_request = LlmRequest {
                        agent: self.id.clone(),
                        model: self.state.spec.model.model.clone(),
                        messages,
                        tools: Arc::clone(&specs),
                        deadline,
                        max_tokens,
                    };
                    let model_call = tracing::Instrument::instrument(
                        llm.complete(llm_request),
                        tracing::info_span!("model_call", agent = %self.id, step = steps),
                    );
                    let reply = match model_call.await {
                        Ok(reply) => reply,
                        Err(LlmError::OverTokenLimit { max_tokens, .. }) => {
                            let limit = meter.get().limit().tokens.unwrap_or(u64::MAX);
                            let error = BudgetExhausted {
                                agent: self.id.clone(),
                                resource: BudgetResource::Tokens,
                                spent: limit.saturating_sub(max_tokens),
                                limit,
                            };
                            return Ok(Some(exhausted(meter.get(), steps, usage, error)));
                        }
                        Err(error) => return Err(TurnError::Model(error)),
                    };
                    // The provider's counts are untrusted: summed saturating, so a
                    // huge report cannot overflow (a panic in the turn).
                    if let Some(used) = reply.usage {
                        usage.prompt_tokens = usage.prompt_tokens.saturating_add(used.prompt_tokens);
                        usage.completion_tokens = usage.completion_tokens.saturating_add(used.completion_tokens);
                        usage.total_tokens = usage.total_tokens.saturating_add(used.total_tokens);
                    }
                    let charged = reply
                        .usage
                        .map_or(Ok(()), |used| meter.get().charge_tokens(used.total_tokens));
                    if self.shared.has_listeners() {
                        // The calls the step keeps and runs, and those asked for past the limit.
                        let asked = reply.message.tool_calls.len();
                        let kept = asked.min(AGENT_TOOL_CALLS_PER_STEP_MAX);
                        self.shared.emit(&AgentEvent::ModelResponded {
                            agent: self.id.clone(),
                            call: conversation.call,
                            step: steps,
                            usage: reply.usage,
                            tool_calls: kept,
                            tool_calls_dropped: asked - kept,
                            at: clock.now(),
                        });
                    }
                    let cut_by_model = reply.truncated;
                    let mut message = reply.message;
                    message.role = Role::Assistant;
                    message.tool_call_id = None;
                    if let Err(error) = charged {
                        return Ok(Some(exhausted(meter.get(), steps, usage, error)));
                    }
                    if message.tool_calls.is_empty() {
                        // Kept as the caller gets it (cut to AGENT_REPLY_SIZE_MAX_BYTES on a
                        // character boundary): kept whole, a provider's oversized answer
                        // went into the log and every later prompt of the window.
                        answer_bytes = message.content.len();
                        answer_cut_by_model = cut_by_model;
                        let kept = truncate_utf8(&message.content, AGENT_REPLY_SIZE_MAX_BYTES).len();
                        message.content.truncate(kept);
                        fresh.push(message);
                        break;
                    }
                    if turn.runtime_aborted() {
                        return Err(TurnError::Refused(self.runtime_aborted()));
                    }
                    let (tools, _) = tools.get_or_insert_with(|| {
                        let sends: SharedSends = Arc::new(Mutex::new(unsent(&self.id)));
                        let context = ToolExecutionContext::new(
                            turn.caller().clone(),
                            conversation.call,
                            Arc::clone(&self.shared),
                            Some(Arc::clone(&sends)),
                            meter.share(),
                        );
                        (context, sends)
                    });
                    // The step's part: the assistant message, then a result per tool
                    // call, made as one shared list (one allocation for the usual
                    // single call, with no list of the results first).
                    let mut results = self.run_tools(tools, &message.tool_calls).await;
                    // Kept (the turn's later steps, the log, the window) within the limits
                    // of an answer; the tools ran on the calls as given. Kept whole, a
                    // provider's oversized text, arguments, ids or number of calls went
                    // into every later prompt (and over the store's value limit, failing
                    // the turn).
                    converse_steps_keep_within_limits(&mut message, results.as_mut_slice(), steps);
                    let step: Arc<[ChatMessage]> = match results {
                        StepResults::One(result) => Arc::new([message, result]),
                        StepResults::Many(results) => std::iter::once(message).chain(results).collect(),
                    };
                    fresh.push_part(step);
                }
                Ok(None)
            })
            .await;
        match steps_run {
            Ok(Ok(None)) => {}
            Ok(Ok(Some(exhausted))) => return Ok(exhausted),
            Ok(Err(error)) => return Err(error),
            Err(troupe_runtime::DeadlinePassed) => {
                tracing::debug!(agent = %self.id, steps, "the turn reached its deadline in its model loop");
                return Err(TurnError::Failed(self.timed_out(timeout_ms(started))));
            }
        }
        let answer = &fresh.last().expect("the loop ends with the answer").content;
        // A future that finishes at the very instant of its deadline wins the race with
        // the timer, but the caller has given up by then (a deadline equal to now has
        // passed): such a turn must not commit.
        if deadline.has_passed(clock.now()) {
            return Err(TurnError::Failed(self.timed_out(timeout_ms(started))));
        }
        if private {
            self.state
                .append_log(turn, &fresh)
                .map_err(|error| TurnError::Refused(error.into()))?;
        }
        let sends = match tools {
            None => unsent(&self.id),
            Some((context, sends)) => {
                drop(context);
                // A tool may have kept a clone of its context (a task of its own): then
                // the sends are taken out, as before.
                match Arc::try_unwrap(sends) {
                    Ok(sends) => sends.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner),
                    Err(sends) => std::mem::replace(
                        &mut *sends.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
                        PendingSends::new(self.id.clone(), 0, 0, 0),
                    ),
                }
            }
        };
        self.flush_sends(turn, sends).await.map_err(TurnError::of_store)?;
        if private {
            self.state.remember(&fresh);
        }
        self.state.turns += 1;
        assert!(
            answer.len() <= AGENT_REPLY_SIZE_MAX_BYTES,
            "an answer of {} bytes was kept, over {AGENT_REPLY_SIZE_MAX_BYTES}",
            answer.len()
        );
        Ok(AgentReply {
            text: answer.clone(),
            truncated: answer.len() < answer_bytes || answer_cut_by_model,
            steps,
            usage,
            spent: meter.get().spent(),
            exhausted: None,
        })
    }

    /// Runs one step's tool calls concurrently, the first
    /// [`AGENT_TOOL_CALLS_PER_STEP_MAX`] of them, and gives one tool result message per
    /// call run, in order; the last says how many more calls were skipped, if any.
    async fn run_tools<'a>(&'a self, context: &'a ToolExecutionContext, calls: &'a [ToolCall]) -> StepResults {
        let registry = &self.shared.tools;
        let spec = &self.state.spec;
        let granting = calls
            .iter()
            .take(AGENT_TOOL_CALLS_PER_STEP_MAX)
            .filter(|call| [CALL_AGENT_TOOL_NAME, DELEGATE_TOOL_NAME, NOTIFY_TOOL_NAME].contains(&call.name.as_str()))
            .filter(|call| spec.allows_tool(&call.name))
            .count();
        context.budget().begin_step(granting);
        // Polled in place on the turn's task (no spawned tasks, which would outlive a
        // cancelled turn), first in input order; dropped with the turn.
        let skipped = calls.len().saturating_sub(AGENT_TOOL_CALLS_PER_STEP_MAX);
        let calls = &calls[..calls.len() - skipped];
        let run_one = |call: &'a ToolCall| async move {
            if !spec.allows_tool(&call.name) {
                // Refused before anything runs or is charged: the agent's tool set is
                // enforced here, not left to the model reading its tool list.
                return format!(
                    "error: tool `{}` is not available to agent {}; its tools are: {}",
                    call.name,
                    spec.id,
                    spec.tools.as_deref().unwrap_or_default().join(", ")
                );
            }
            // Some providers send the arguments as a JSON string; otherwise they are
            // borrowed from the message, which keeps them (the log, later prompts).
            let parsed: Option<serde_json::Value> = match &call.arguments {
                serde_json::Value::String(text) => serde_json::from_str(text).ok(),
                _ => None,
            };
            let arguments = parsed.as_ref().unwrap_or(&call.arguments);
            if let Err(error) = context.budget().charge_tool_call() {
                return format!("error: {error}");
            }
            let executed = tracing::Instrument::instrument(
                registry.execute_in_turn(context, &call.name, arguments),
                tracing::info_span!("tool_call", agent = %self.id, tool = %call.name),
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
            match executed {
                Ok(text) => text,
                Err(error) => format!("error: {error}"),
            }
        };
        // Said after the last call's result, which is cut to leave room for it.
        let skipped_note = (skipped > 0).then(|| {
            format!(
                "\n(error: at most {AGENT_TOOL_CALLS_PER_STEP_MAX} tool calls run per step; the {skipped} calls \
                 after this one were skipped, and are not kept)"
            )
        });
        let skipped_note = skipped_note.as_deref();
        let run = |index: usize, call: &'a ToolCall| async move {
            let mut result = run_one(call).await;
            let note = skipped_note.filter(|_| index + 1 == calls.len());
            // Cut in place (a result within the limit is kept as it is, not copied).
            let room = AGENT_TOOL_RESULT_SIZE_MAX_BYTES - note.map_or(0, str::len);
            let kept = truncate_utf8(&result, room).len();
            result.truncate(kept);
            result.push_str(note.unwrap_or_default());
            assert!(
                result.len() <= AGENT_TOOL_RESULT_SIZE_MAX_BYTES,
                "a result of {} bytes was kept",
                result.len()
            );
            result
        };
        let result_message = |call: &ToolCall, result| ChatMessage::tool_result(call.id.clone(), result);
        // One call (the usual step) is awaited alone: `join_all` allocates its list of
        // futures and its list of outputs.
        if let [call] = calls {
            return StepResults::One(result_message(call, run(0, call).await));
        }
        let texts = futures::future::join_all(calls.iter().enumerate().map(|(index, call)| run(index, call))).await;
        StepResults::Many(
            calls
                .iter()
                .zip(texts)
                .map(|(call, text)| result_message(call, text))
                .collect(),
        )
    }
}

/// A turn's budget meter: its own until the first tool call, which takes it shared
/// (`ToolExecutionContext` holds an `Arc`), so a turn that calls no tool allocates
/// none. The same meter either way: `share` moves it, charges and all, into the `Arc`
/// that every later step reads.
enum MeterSlot {
    Own(BudgetMeter),
    Shared(Arc<BudgetMeter>),
    /// Only while `share` moves the meter.
    Moving,
}

impl MeterSlot {
    fn get(&self) -> &BudgetMeter {
        match self {
            Self::Own(meter) => meter,
            Self::Shared(meter) => meter,
            Self::Moving => unreachable!("a meter is moved within `share` only"),
        }
    }

    fn share(&mut self) -> Arc<BudgetMeter> {
        if let Self::Shared(meter) = self {
            return Arc::clone(meter);
        }
        let Self::Own(meter) = std::mem::replace(self, Self::Moving) else {
            unreachable!("a meter is moved within `share` only")
        };
        let meter = Arc::new(meter);
        *self = Self::Shared(Arc::clone(&meter));
        meter
    }
}

/// The tool results of one step, in the order of its calls.
enum StepResults {
    /// The usual step's single call.
    One(ChatMessage),
    Many(Vec<ChatMessage>),
}

impl StepResults {
    fn as_mut_slice(&mut self) -> &mut [ChatMessage] {
        match self {
            Self::One(result) => std::slice::from_mut(result),
            Self::Many(results) => results,
        }
    }
}

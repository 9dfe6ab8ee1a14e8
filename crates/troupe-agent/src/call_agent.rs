//! `call_agent`: one agent asks another and waits for its answer.
//!
//! ```text
//! model of A ──tool call call_agent{agent_id: b, message, timeout_ms?}──► schema check
//!   ──► Caller::admit (the turn's handle: identity, chain, depth, deadline from the
//!        runtime): turn ended? shutting down? cycle? depth? known? too many? timeout
//!        → an in-flight slot and the child context
//!        refused → tool result "call_agent failed: call refused: ..." (nothing sent)
//!   ──► Caller::invoke(admitted, AgentRequest)   (wait-for edge A→B until B replies)
//!        B's whole turn runs under child: depth+1, chain+A, deadline ≤ A's
//!   ──► reply text (capped) or "call_agent failed: ..." (timeout, B failed, deadlock)
//! ```
//!
//! Rust callers use [`call_agent`] and get a typed [`AgentCallError`]; the model gets the
//! same error as readable text. When the caller gives up (its wait times out, its future
//! is dropped, or its own turn ends), the callee's turn for the call is cancelled at its
//! next `.await`: no further model or tool calls, nothing committed, and its own calls
//! are cancelled the same way.

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::Value;
use troupe_core::limits::{ACTOR_KEY_LENGTH_MAX, AGENT_CALL_TIMEOUT_MS_DEFAULT, AGENT_CALL_TIMEOUT_MS_MAX};
use troupe_core::{truncate_utf8, ActorId, CallRefused, InvokeError};
use troupe_runtime::AnyValue;

use crate::agent::{agent_id, AgentReply, AgentRequest};
use crate::budget::{settle_call, BudgetExhausted};
use crate::limits::AGENT_MESSAGE_SIZE_MAX_BYTES;
use crate::{tool_parameters_schema, AgentEvent, CallOutcome, Tool, ToolError, ToolExecutionContext};

/// The name of the tool every agent has.
pub const CALL_AGENT_TOOL_NAME: &str = "call_agent";

/// Why a call to an agent produced no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentCallError {
    /// Admission refused the call; nothing was sent.
    #[error("call refused: {0}")]
    Refused(#[from] CallRefused),
    /// The organisation refused the call (links, permissions, approval); nothing was
    /// sent.
    #[error("call not permitted: {0}")]
    NotPermitted(#[from] crate::NotPermitted),
    /// The call was sent and failed: timed out, the callee's turn failed (other than
    /// by its model: [`AgentCallError::ModelFailed`]), a deadlock, ...
    #[error("call failed: {0}")]
    Invoke(#[from] InvokeError),
    /// The callee's model gave no answer, so neither did the callee: the model's
    /// [`crate::LlmError`], typed (rate limited, request too large, timed out,
    /// unreachable, malformed, stopped early, ...). Its text names the error's kind
    /// ([`crate::LlmError::kind`]), which `call_agent`'s tool result shows the calling
    /// model. The callee's turn committed nothing, as for any failed turn.
    #[error("call failed: {0}")]
    ModelFailed(#[from] ModelFailed),
    /// The agent id cannot name an actor.
    #[error("agent id {agent_id:?} is not valid: {cause}")]
    InvalidAgentId {
        /// The id given.
        agent_id: String,
        /// Why it is refused.
        cause: String,
    },
    /// The budget ran out: this turn had none left to grant (nothing was sent), or the
    /// callee's turn spent all of its grant before answering.
    #[error(transparent)]
    BudgetExhausted(#[from] BudgetExhausted),
    /// A call to a remote agent failed on the way or on the other side (a timeout is
    /// [`AgentCallError::Invoke`] with `Timeout`, as for a local call).
    #[error(transparent)]
    Remote(#[from] crate::RemoteCallError),
    /// The callee's reply could not be decoded.
    #[error("the reply of {target} could not be decoded: {cause}")]
    MalformedReply {
        /// The callee.
        target: ActorId,
        /// The decoding error.
        cause: String,
    },
    /// The call needed approval and the caller sends such calls as delegated tasks
    /// ([`crate::CallApproval::Delegate`]): no answer now; the question was queued as
    /// task `task_id` (sent when the turn ends), which waits for approval `approval` in
    /// the outbox; the answer, or the denial, comes back as the task's result. The
    /// `call_agent` tool gives the model this text as its result, not as an error.
    #[error(
        "{}",
        match approval {
            Some(approval) => format!(
                "the call to {target} needs approval {approval}: your question was sent as task {task_id} \
                 instead, which is sent once approved; {target}'s answer (or the denial) will come back \
                 to you as the task's result"
            ),
            None => format!(
                "the call to {target} needed approval: your question was sent as task {task_id} instead; \
                 {target}'s answer will come back to you as the task's result"
            ),
        }
    )]
    SentAsTask {
        /// The callee.
        target: String,
        /// The task the question was sent as.
        task_id: String,
        /// The pending approval the task waits for (`None` if a delegation needs none).
        approval: Option<u64>,
    },
}

/// An agent's model gave no answer, so the agent could not ([`AgentCallError::ModelFailed`]).
///
/// # Examples
/// ```
/// use troupe_agent::{agent_id, AgentCallError, LlmError, ModelFailed};
/// let error = AgentCallError::ModelFailed(ModelFailed {
///     agent: agent_id("analyst").unwrap(),
///     error: LlmError::Provider { status: 429, body: "slow down".into(), retry_after_ms: Some(2_000) },
/// });
/// match &error {
///     AgentCallError::ModelFailed(ModelFailed {
///         error: LlmError::Provider { status: 429, retry_after_ms: Some(wait), .. }, ..
///     }) => assert_eq!(*wait, 2_000),
///     other => panic!("{other}"),
/// }
/// assert!(error.to_string().contains("(rate_limited)"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the model of {agent} failed ({}): {error}", error.kind())]
pub struct ModelFailed {
    /// The agent whose model failed.
    pub agent: ActorId,
    /// What the model's client said.
    pub error: crate::LlmError,
}

impl ModelFailed {
    /// The model failure of `target`'s turn that `error` reports, if it is one: a turn
    /// that failed with its model's error has the cause `the model failed: ` and the
    /// error's text (`TurnError::into_actor_error`), which is read back typed here, the
    /// same whether the reply came as a value or as bytes from another process.
    pub(crate) fn of_invoke(error: &InvokeError, target: &ActorId) -> Option<Self> {
        let InvokeError::ActorFailed { target: failed, cause } = error else {
            return None;
        };
        if failed != target {
            return None;
        }
        let text = cause.strip_prefix(crate::agent::TurnError::MODEL_FAILED_PREFIX)?;
        Some(Self {
            agent: failed.clone(),
            error: crate::LlmError::from_text(text)?,
        })
    }
}

impl AgentCallError {
    /// `error` of a call to agent `target`, typed: its model's failure is
    /// [`AgentCallError::ModelFailed`], any other [`AgentCallError::Invoke`].
    pub(crate) fn of_invoke(error: InvokeError, target: &ActorId) -> Self {
        match ModelFailed::of_invoke(&error, target) {
            Some(failed) => Self::ModelFailed(failed),
            None => Self::Invoke(error),
        }
    }

    /// What the observer records for this error.
    pub(crate) fn outcome(&self) -> CallOutcome {
        match self {
            Self::Refused(refused) => CallOutcome::Refused(refused.clone()),
            Self::NotPermitted(refused) => CallOutcome::NotPermitted(refused.clone()),
            Self::Invoke(error) => CallOutcome::Failed(error.clone()),
            // Recorded as the callee's failed turn, as before the error was typed.
            Self::ModelFailed(failed) => CallOutcome::Failed(InvokeError::ActorFailed {
                target: failed.agent.clone(),
                cause: format!("{}{}", crate::agent::TurnError::MODEL_FAILED_PREFIX, failed.error),
            }),
            Self::InvalidAgentId { .. } | Self::MalformedReply { .. } | Self::BudgetExhausted(_) | Self::Remote(_) => {
                CallOutcome::Other {
                    cause: self.to_string(),
                }
            }
            Self::SentAsTask { task_id, .. } => CallOutcome::SentAsTask {
                task_id: task_id.clone(),
            },
        }
    }
}

/// Reports the end of a call to the observers exactly once: with its outcome when the
/// call returns ([`CallEndReport::finish`]), or as [`CallOutcome::Cancelled`] when the
/// future is dropped first (the caller's turn was cut while the call was in flight).
struct CallEndReport<'a> {
    context: &'a ToolExecutionContext,
    call: u64,
    /// Whether the end is still to be reported (never, when nobody observes).
    armed: bool,
}

impl CallEndReport<'_> {
    fn report(&mut self, outcome: CallOutcome) {
        self.armed = false;
        let at = self.context.now();
        self.context.shared().emit(&AgentEvent::CallFinished {
            call: self.call,
            outcome,
            at,
        });
    }

    /// Reports how the call ended.
    fn finish(mut self, outcome: CallOutcome) {
        if self.armed {
            self.report(outcome);
        }
    }
}

impl Drop for CallEndReport<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.report(CallOutcome::Cancelled);
        }
    }
}

/// Asks agent `agent_id` with `message` on behalf of the tool call's agent, and waits for
/// its reply for `timeout_ms` (default 30 s, capped at 300 s, clipped to the caller's
/// remaining deadline). The callee's turn gets a grant of at most what this turn has
/// left of its budget (and this step's share of it), reserved until the reply reports
/// what it spent. `message` is cut to [`AGENT_MESSAGE_SIZE_MAX_BYTES`] on a
/// character boundary.
///
/// # Errors
/// [`AgentCallError::Refused`] (cycle, depth, unknown agent, too many calls, bad timeout,
/// no time left), [`AgentCallError::BudgetExhausted`] (no budget left to grant, or the
/// callee ran out of its grant), [`AgentCallError::ModelFailed`] (the callee's model
/// failed: the model's error, typed), [`AgentCallError::Invoke`] (timeout, the callee
/// failed otherwise, deadlock, busy, shutdown), [`AgentCallError::InvalidAgentId`],
/// [`AgentCallError::MalformedReply`].
///
/// # Cancel safety
/// Dropping the future abandons the call: the in-flight slot is freed, the dispatcher
/// drops the request if it has not run, or the callee finds its caller gone, and the
/// observers get `CallFinished` with [`CallOutcome::Cancelled`].
pub async fn call_agent(
    context: &ToolExecutionContext,
    agent_id_text: &str,
    message: &str,
    timeout_ms: Option<u64>,
) -> Result<AgentReply, AgentCallError> {
    let target = agent_id(agent_id_text).map_err(|error| AgentCallError::InvalidAgentId {
        agent_id: agent_id_text.to_string(),
        cause: error.to_string(),
    })?;
    let shared = context.shared();
    let call = shared.next_call_id();
    // Admission through the turn's caller handle: the in-flight slot, the cycle and
    // depth rules and the deadline all come from the runtime, not from the tool.
    // A local agent of the id wins over a remote one.
    // The directory is read once for both (nothing runs between the two uses).
    let local = shared.directory.contains(agent_id_text);
    let remote = if local { None } else { shared.remotes.get(agent_id_text) };
    let admission = context.caller().admit(&target, remote.is_some() || local, timeout_ms);
    // The event (its ids copied, the clock read) is made only for someone to receive
    // it: `emit` hands it to the listeners, and there are none.
    let listened = shared.has_listeners();
    if listened {
        shared.emit(&AgentEvent::CallStarted {
            call,
            parent: context.inbound_call(),
            caller: Some(context.agent_id().clone()),
            target: target.clone(),
            depth: context.call_depth().saturating_add(1),
            at: context.now(),
        });
    }
    let finished = CallEndReport {
        context,
        call,
        armed: listened,
    };
    // Then the organisation's admission (links, permissions, approval); the grant is
    // reserved only once the call is admitted; refused, it is not sent.
    let admission = match admission {
        Ok(admitted) => match crate::org_store::admit_call(context, &target, message, admitted).await {
            Ok(crate::org_store::CallAdmission::Call(admitted)) => Ok(admitted),
            Ok(crate::org_store::CallAdmission::AsTask) => {
                let result = send_as_task(context, agent_id_text, message, timeout_ms).await;
                finished.finish(result.outcome());
                return Err(result);
            }
            Err(error) => Err(error),
        },
        Err(refused) => Err(AgentCallError::Refused(refused)),
    };
    let admission = admission.and_then(|admitted| {
        let grant = context.budget().grant()?;
        Ok((admitted, grant))
    });
    let result = match admission {
        Err(error) => Err(error),
        Ok((admitted, grant)) => {
            let request = AgentRequest {
                text: truncate_utf8(message, AGENT_MESSAGE_SIZE_MAX_BYTES).to_string(),
                from: Some(context.agent_id().clone()),
                call: Some(call),
                budget: grant,
            };
            let allowed_ms = u64::try_from(admitted.timeout().as_millis()).unwrap_or(u64::MAX);
            if let Some(remote) = &remote {
                // The admission (its in-flight slot) is held until the answer.
                // The message's id names this call alone, also across processes and
                // restarts: a receiver takes an id it has seen as the task it already
                // started (a Troupe server answers it with that task, or refuses it
                // `MessageIdReused` if the text differs). Before, `{agent}-call-{n}`
                // from a counter every process starts at 1 was made again after a
                // restart (tests/remote_message_ids.rs). Short, whatever the agent's id:
                // the receiver keys its dedupe mark by it.
                let message_id = format!("call-{:032x}", shared.fresh_id(context.now()));
                // Without a trace id, the message id stands in for the logs (not 32 hex
                // digits alone: the callee starts a trace of its own).
                let trace_id = admitted
                    .child()
                    .trace_id()
                    .map_or_else(|| message_id.clone(), |trace| trace.to_string());
                // The time left now, not at admission: an approval waited for in
                // between (`admit_call`) has spent part of it, and the remote callee
                // must not get more than this caller has left (a local call waits
                // until the child's deadline, which is absolute).
                let timeout = admitted.child().deadline().remaining(context.now());
                let result = crate::remote::call_remote(
                    &shared.remotes,
                    crate::remote::RemoteCall {
                        remote,
                        target: &target,
                        text: &request.text,
                        child: admitted.child(),
                        timeout,
                        allowed_ms,
                        message_id,
                        trace_id,
                    },
                )
                .await;
                drop(admitted);
                let result = settle_call(context.budget(), grant, result);
                let outcome = match &result {
                    Ok(reply) => CallOutcome::Replied {
                        bytes: reply.text.len(),
                    },
                    Err(error) => error.outcome(),
                };
                finished.finish(outcome);
                return result;
            }
            let caller = context.caller();
            // Within one process the request and the reply pass as values (no encoding
            // or decoding at either end); a cluster node's calls may cross to another
            // process, so they go as bytes.
            let answered = if caller.routes_calls() {
                caller
                    .invoke(admitted, request.into_encoded())
                    .await
                    .map(|bytes| AgentReply::decode(&bytes))
            } else {
                caller
                    .invoke_value(admitted, AnyValue::new(request))
                    .await
                    .map(AgentReply::from_value)
            };
            let result = match answered {
                Ok(reply) => reply.map_err(|cause| AgentCallError::MalformedReply {
                    target: target.clone(),
                    cause,
                }),
                // The callee's turn and this wait end at the same instant; whichever timer
                // fires first, report the time this caller allowed.
                Err(InvokeError::Timeout { target: timed_out, .. }) if timed_out == target => {
                    Err(AgentCallError::Invoke(InvokeError::Timeout {
                        target: timed_out,
                        timeout_ms: allowed_ms,
                    }))
                }
                Err(InvokeError::Refused(refused)) => Err(AgentCallError::Refused(refused)),
                Err(error) => Err(AgentCallError::of_invoke(error, &target)),
            };
            let result = settle_call(context.budget(), grant, result);
            if let Ok(reply) = &result {
                // Into the pair's direct conversation (best effort, see `call_record.rs`).
                let (caller, callee) = (context.agent_id().key(), target.key());
                let recorded =
                    crate::call_record::record_call(shared, context.caller(), caller, callee, message, &reply.text)
                        .await;
                if let Err(error) = recorded {
                    tracing::warn!(%caller, %callee, %error, "the call was not recorded in the direct conversation");
                }
            }
            result
        }
    };
    let outcome = match &result {
        Ok(reply) => CallOutcome::Replied {
            bytes: reply.text.len(),
        },
        Err(error) => error.outcome(),
    };
    finished.finish(outcome);
    result
}

/// Sends the question of a call that needs approval as a delegated task (see
/// [`AgentCallError::SentAsTask`]), with the admission of `delegate_to_agent` (which
/// records the task's own approval, if it needs one) and its deadline: the call's
/// `timeout_ms` if given (at most `AGENT_TASK_TIMEOUT_MS_MAX`), else the task default.
async fn send_as_task(
    context: &ToolExecutionContext,
    to: &str,
    message: &str,
    timeout_ms: Option<u64>,
) -> AgentCallError {
    match crate::inbox_turns::tool_send(context, to, message, timeout_ms, true).await {
        Ok(queued) => AgentCallError::SentAsTask {
            target: to.to_string(),
            task_id: queued.id,
            approval: queued.approval,
        },
        Err(crate::InboxError::Refused(refused)) => AgentCallError::Refused(refused),
        Err(crate::InboxError::NotPermitted(refused)) => AgentCallError::NotPermitted(refused),
        Err(crate::InboxError::BudgetExhausted(exhausted)) => AgentCallError::BudgetExhausted(exhausted),
        Err(crate::InboxError::Invoke(error)) => AgentCallError::Invoke(error),
        Err(crate::InboxError::InvalidAgentId { agent_id, cause }) => {
            AgentCallError::InvalidAgentId { agent_id, cause }
        }
        Err(other) => AgentCallError::Invoke(InvokeError::Rejected {
            target: context.agent_id().clone(),
            reason: format!("the call needed approval and could not be sent as a task: {other}"),
        }),
    }
}

/// The arguments of the `call_agent` tool, as the model sends them; their JSON schema
/// ([`call_agent_schema`]) is derived from this type.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CallAgentArguments {
    /// The id of the agent to ask.
    #[schemars(length(min = 1, max = ACTOR_KEY_LENGTH_MAX))]
    pub agent_id: String,
    /// What to ask or tell it.
    #[schemars(length(max = AGENT_MESSAGE_SIZE_MAX_BYTES))]
    pub message: String,
    /// How long to wait for the answer, in milliseconds.
    #[schemars(range(min = 1), description = call_agent_timeout_description())]
    #[serde(default, deserialize_with = "call_agent_timeout_whole_milliseconds")]
    pub timeout_ms: Option<u64>,
}

/// `timeout_ms` as JSON Schema reads `integer`: `5000` and `5000.0` alike (the schema
/// has already refused fractions and negatives). Also `delegate_to_agent`'s and
/// `notify_agent`'s (`SendArguments`).
pub(crate) fn call_agent_timeout_whole_milliseconds<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<u64>, D::Error> {
    let Some(number) = Option::<serde_json::Number>::deserialize(deserializer)? else {
        return Ok(None);
    };
    match (number.as_u64(), number.as_f64()) {
        (Some(whole), _) => Ok(Some(whole)),
        (None, Some(float)) if float.fract() == 0.0 && float >= 0.0 => Ok(Some(float as u64)),
        _ => Err(serde::de::Error::custom(format!(
            "timeout_ms must be a whole number of milliseconds, got {number}"
        ))),
    }
}

fn call_agent_timeout_description() -> String {
    format!(
        "How long to wait for the answer, in milliseconds (default {AGENT_CALL_TIMEOUT_MS_DEFAULT}, at most {AGENT_CALL_TIMEOUT_MS_MAX})."
    )
}

/// The JSON schema of `call_agent`'s arguments, derived from [`CallAgentArguments`].
pub fn call_agent_schema() -> Value {
    tool_parameters_schema::<CallAgentArguments>()
}

/// The `call_agent` tool, registered for every agent.
pub(crate) fn call_agent_tool() -> Tool {
    Tool::typed::<CallAgentArguments, _, _>(
        CALL_AGENT_TOOL_NAME,
        "Ask another agent and wait for its answer. Agents waiting on you cannot be called \
         (that would deadlock), chains are at most 5 calls deep, and the answer must arrive \
         before your own deadline.",
        |context, arguments: CallAgentArguments| async move {
            match call_agent(&context, &arguments.agent_id, &arguments.message, arguments.timeout_ms).await {
                Ok(reply) => Ok(reply.text),
                // Not a failure: the answer comes later, as the task's result.
                Err(sent @ AgentCallError::SentAsTask { .. }) => Ok(sent.to_string()),
                Err(error) => Err(ToolError::failed(CALL_AGENT_TOOL_NAME, error.to_string())),
            }
        },
    )
}

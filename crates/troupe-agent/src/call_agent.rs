//! `call_agent`: one agent asks another and waits for its answer.
//!
//! ```text
//! model of A ──tool call call_agent{agent_id: b, message, timeout_ms?}──► schema check
//!   ──► reserve an in-flight slot (per activation of A)
//!   ──► troupe_core::admit_call: cycle? depth? known? too many? timeout → child context
//!        refused → tool result "call_agent failed: call refused: ..." (nothing sent)
//!   ──► RuntimeHandle::invoke_from(A, B, AgentRequest, child)   (wait-for edge A→B)
//!        B's whole turn runs under child: depth+1, chain+A, deadline ≤ A's
//!   ──► reply text (capped) or "call_agent failed: ..." (timeout, B failed, deadlock)
//! ```
//!
//! Rust callers use [`call_agent`] and get a typed [`AgentCallError`]; the model gets the
//! same error as readable text. The callee's deadline is the caller's wait: when the
//! caller gives up, the callee's turn is cancelled at the same instant and commits
//! nothing, so a late reply never lands anywhere.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};
use troupe_core::limits::{ACTOR_KEY_LENGTH_MAX, AGENT_CALL_TIMEOUT_MS_DEFAULT, AGENT_CALL_TIMEOUT_MS_MAX};
use troupe_core::{admit_call, truncate_utf8, ActorId, AdmissionRequest, CallRefused, InvokeError};

use crate::agent::{agent_id, AgentReply, AgentRequest};
use crate::limits::AGENT_MESSAGE_SIZE_MAX_BYTES;
use crate::{AgentEvent, CallOutcome, Tool, ToolError, ToolExecutionContext};

/// The name of the tool every agent has.
pub const CALL_AGENT_TOOL_NAME: &str = "call_agent";

/// Why a call to an agent produced no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentCallError {
    /// Admission refused the call; nothing was sent.
    #[error("call refused: {0}")]
    Refused(#[from] CallRefused),
    /// The call was sent and failed: timed out, the callee failed, a deadlock, ...
    #[error("call failed: {0}")]
    Invoke(#[from] InvokeError),
    /// The agent id cannot name an actor.
    #[error("agent id {agent_id:?} is not valid: {cause}")]
    InvalidAgentId {
        /// The id given.
        agent_id: String,
        /// Why it is refused.
        cause: String,
    },
    /// The callee's reply could not be decoded.
    #[error("the reply of {target} could not be decoded: {cause}")]
    MalformedReply {
        /// The callee.
        target: ActorId,
        /// The decoding error.
        cause: String,
    },
}

impl AgentCallError {
    /// What the observer records for this error.
    pub(crate) fn outcome(&self) -> CallOutcome {
        match self {
            Self::Refused(refused) => CallOutcome::Refused(refused.clone()),
            Self::Invoke(error) => CallOutcome::Failed(error.clone()),
            Self::InvalidAgentId { .. } | Self::MalformedReply { .. } => CallOutcome::Other {
                cause: self.to_string(),
            },
        }
    }
}

/// Frees an in-flight slot when the call ends, however it ends (including cancellation).
struct InFlightSlot(Arc<AtomicU32>);

impl InFlightSlot {
    /// Takes a slot; returns it with the number of calls that were in flight before.
    fn take(counter: &Arc<AtomicU32>) -> (Self, u32) {
        let before = counter.fetch_add(1, Ordering::SeqCst);
        (Self(Arc::clone(counter)), before)
    }
}

impl Drop for InFlightSlot {
    fn drop(&mut self) {
        let before = self.0.fetch_sub(1, Ordering::SeqCst);
        assert!(before >= 1, "in-flight call count underflow");
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
        let at = self.context.runtime.now();
        self.context.shared.emit(&AgentEvent::CallFinished {
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
/// remaining deadline). `message` is cut to [`AGENT_MESSAGE_SIZE_MAX_BYTES`] on a
/// character boundary.
///
/// # Errors
/// [`AgentCallError::Refused`] (cycle, depth, unknown agent, too many calls, bad timeout,
/// no time left), [`AgentCallError::Invoke`] (timeout, the callee failed, deadlock, busy,
/// shutdown), [`AgentCallError::InvalidAgentId`], [`AgentCallError::MalformedReply`].
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
    let shared = &context.shared;
    let call = shared.next_call_id();
    let now = context.runtime.now();
    let (slot, calls_in_flight) = InFlightSlot::take(&context.calls_in_flight);
    let admission = admit_call(AdmissionRequest {
        caller: &context.agent_id,
        context: &context.context,
        target: &target,
        target_known: shared.directory.contains(agent_id_text),
        calls_in_flight,
        requested_timeout_ms: timeout_ms,
        now,
    });
    shared.emit(&AgentEvent::CallStarted {
        call,
        parent: context.inbound_call,
        caller: Some(context.agent_id.clone()),
        target: target.clone(),
        depth: context.call_depth.saturating_add(1),
        at: now,
    });
    let finished = CallEndReport {
        context,
        call,
        armed: !shared.observers.is_empty(),
    };
    let result = match admission {
        Err(refused) => Err(AgentCallError::Refused(refused)),
        Ok(admitted) => {
            let request = AgentRequest {
                text: truncate_utf8(message, AGENT_MESSAGE_SIZE_MAX_BYTES).to_string(),
                from: Some(context.agent_id.clone()),
                call: Some(call),
            };
            let allowed_ms = u64::try_from(admitted.timeout.as_millis()).unwrap_or(u64::MAX);
            let sent = context
                .runtime
                .invoke_from(&context.agent_id, &target, request.encode(), admitted.child)
                .await;
            match sent {
                Ok(bytes) => AgentReply::decode(&bytes).map_err(|cause| AgentCallError::MalformedReply {
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
                Err(error) => Err(AgentCallError::Invoke(error)),
            }
        }
    };
    drop(slot);
    let outcome = match &result {
        Ok(reply) => CallOutcome::Replied {
            bytes: reply.text.len(),
        },
        Err(error) => error.outcome(),
    };
    finished.finish(outcome);
    result
}

/// The JSON schema of `call_agent`'s arguments.
pub fn call_agent_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "agent_id": {
                "type": "string",
                "minLength": 1,
                "maxLength": ACTOR_KEY_LENGTH_MAX,
                "description": "The id of the agent to ask."
            },
            "message": {
                "type": "string",
                "maxLength": AGENT_MESSAGE_SIZE_MAX_BYTES,
                "description": "What to ask or tell it."
            },
            "timeout_ms": {
                "type": "integer",
                "minimum": 1,
                "description": format!(
                    "How long to wait for the answer, in milliseconds (default {AGENT_CALL_TIMEOUT_MS_DEFAULT}, at most {AGENT_CALL_TIMEOUT_MS_MAX})."
                )
            }
        },
        "required": ["agent_id", "message"],
        "additionalProperties": false
    })
}

/// The `call_agent` tool, registered for every agent.
pub(crate) fn call_agent_tool() -> Tool {
    Tool::from_fn(
        CALL_AGENT_TOOL_NAME,
        "Ask another agent and wait for its answer. Agents waiting on you cannot be called \
         (that would deadlock), chains are at most 5 calls deep, and the answer must arrive \
         before your own deadline.",
        call_agent_schema(),
        |context, arguments| async move {
            let agent = arguments["agent_id"].as_str().unwrap_or_default().to_string();
            let message = arguments["message"].as_str().unwrap_or_default().to_string();
            let timeout_ms = arguments.get("timeout_ms").and_then(Value::as_f64).map(|ms| ms as u64);
            call_agent(&context, &agent, &message, timeout_ms)
                .await
                .map(|reply| reply.text)
                .map_err(|error| ToolError::failed(CALL_AGENT_TOOL_NAME, error.to_string()))
        },
    )
}

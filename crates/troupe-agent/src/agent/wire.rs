//! What one agent sends another ([`AgentRequest`]) and what it answers ([`AgentReply`]),
//! bincode on the wire.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe_core::ActorId;
use troupe_runtime::AnyValue;

use crate::inbox::AgentCommand;
use crate::{Budget, BudgetExhausted, Spend, TokenUsage};

/// What one agent sends another (bincode on the wire).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentRequest {
    /// The message.
    pub text: String,
    /// The calling agent; `None` from outside.
    pub from: Option<ActorId>,
    /// The observer's id of this call, if it is recorded.
    pub call: Option<u64>,
    /// What the turn may spend, the calls it makes included ([`Budget::UNLIMITED`]
    /// from `AgentClient::ask`; a grant of what the caller had left from `call_agent`).
    #[serde(default)]
    pub budget: Budget,
}

/// An agent's answer (bincode on the wire).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentReply {
    /// The final assistant text, at most [`crate::limits::AGENT_REPLY_SIZE_MAX_BYTES`].
    pub text: String,
    /// Whether `text` was cut: to fit, or by the model's provider at its token limit
    /// (`LlmReply::truncated`).
    pub truncated: bool,
    /// Model steps the turn took.
    pub steps: u32,
    /// Tokens the turn's model calls used, summed (calls that reported none add
    /// nothing); the turns of agents it called are not included.
    pub usage: TokenUsage,
    /// What the turn spent against its budget: its own model tokens and tool calls plus
    /// what it charged for the calls it made (their reported spend, or their whole grant
    /// when unknown). This is what its caller charges.
    #[serde(default)]
    pub spent: Spend,
    /// Set when the turn's budget ran out before a final answer (`text` is then empty
    /// and nothing of the turn is committed); `call_agent` and `AgentClient::ask_with`
    /// turn it into `AgentCallError::BudgetExhausted`.
    #[serde(default)]
    pub exhausted: Option<BudgetExhausted>,
}

impl AgentRequest {
    /// Encodes with bincode, as the ask command an agent's actor handles.
    pub fn encode(&self) -> Bytes {
        AgentCommand::Ask(self.clone()).encode()
    }

    /// [`AgentRequest::encode`] without copying the request (the same bytes).
    pub(crate) fn into_encoded(self) -> Bytes {
        AgentCommand::Ask(self).encode()
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

    /// The reply an agent's turn answered as a value (an ask made as a value within
    /// this process).
    ///
    /// # Errors
    /// What the value was instead, as text.
    pub(crate) fn from_value(value: AnyValue) -> Result<Self, String> {
        value
            .downcast::<Self>()
            .map_err(|_| "the agent replied with something other than an AgentReply".to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{agent_id, BudgetResource};

    #[test]
    fn requests_and_replies_round_trip_through_bincode() {
        let request = AgentRequest {
            text: "héllo".into(),
            from: Some(agent_id("b").unwrap()),
            call: Some(7),
            budget: Budget::tokens(9).with_tool_calls(2),
        };
        assert_eq!(request.clone().into_encoded(), request.encode());
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
            spent: Spend {
                tokens: 40,
                tool_calls: 1,
            },
            exhausted: Some(BudgetExhausted {
                agent: agent_id("b").unwrap(),
                resource: BudgetResource::Tokens,
                spent: 40,
                limit: 40,
            }),
        };
        assert_eq!(AgentReply::decode(&reply.encode()), Ok(reply));
        assert!(AgentReply::decode(b"\x01").is_err());
    }
}

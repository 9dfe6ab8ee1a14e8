//! Troupe's agent layer: agents as virtual actors that think with an LLM, use tools and
//! call each other through `call_agent`.

#![warn(missing_docs)]

mod llm;

pub use llm::{ChatMessage, LlmClient, LlmError, LlmReply, LlmRequest, Role, ToolCall, ToolSpec};

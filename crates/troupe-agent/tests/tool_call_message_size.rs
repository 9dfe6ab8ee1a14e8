//! An agent keeps an assistant message that calls tools within the limits of its own
//! answers: its text cut to `AGENT_REPLY_SIZE_MAX_BYTES` and each call's arguments to
//! `AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES`, on a character boundary, in its log, its
//! history window and the later steps of its turn, so a provider's oversized message is
//! not in every later prompt. The tool itself runs on the arguments as the model gave
//! them.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test tool_call_message_size`.

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::json;
use troupe_agent::limits::{AGENT_REPLY_SIZE_MAX_BYTES, AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES};
use troupe_agent::{
    AgentSpec, AgentSystem, ChatMessage, LlmClient, LlmError, LlmReply, LlmRequest, Role, ScriptRule, ScriptedLlm,
};
use troupe_runtime::MemoryStore;

/// The scripted model, with `text` said along with every tool call it makes (the
/// scripted model itself says nothing when it calls a tool).
struct Talkative {
    script: ScriptedLlm,
    text: String,
}

#[async_trait]
impl LlmClient for Talkative {
    async fn complete(&self, request: LlmRequest) -> Result<LlmReply, LlmError> {
        let mut reply = self.script.complete(request).await?;
        if !reply.message.tool_calls.is_empty() {
            reply.message.content = self.text.clone();
        }
        Ok(reply)
    }
}

/// The bytes of a call's arguments: their JSON text (given as a string, or written out).
fn arguments_bytes(arguments: &serde_json::Value) -> usize {
    match arguments {
        serde_json::Value::String(text) => text.len(),
        other => other.to_string().len(),
    }
}

/// The bytes of a message: its text and its calls' arguments.
fn message_bytes(message: &ChatMessage) -> usize {
    let arguments: usize = message
        .tool_calls
        .iter()
        .map(|call| arguments_bytes(&call.arguments))
        .sum();
    message.content.len() + arguments
}

/// Goal: a tool-calling message with an 8 MiB text and an 8 MiB argument is kept cut
/// (its text to `AGENT_REPLY_SIZE_MAX_BYTES`, on a character boundary; its arguments to
/// `AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES`) in the log, in the turn's next step and
/// in the next turn's prompt, while the tool got the arguments whole (and refused the
/// message, longer than `AGENT_MESSAGE_SIZE_MAX_BYTES`, by its schema). Method: a
/// scripted model wrapped to say the text with its call of `notify_agent`, whose
/// message is 8 MiB; then the agent's log and the model's later requests are read.
#[tokio::test(start_paused = true)]
async fn a_tool_calling_message_is_kept_cut_to_the_reply_and_arguments_limits() {
    let huge = format!("a{}", "é".repeat(4 * 1024 * 1024));
    let script = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("go")
                .call("notify_agent", json!({"agent_id": "b", "message": huge.clone()})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("done"))
        .rule(ScriptRule::agent("a").on_user_containing("next").reply("ok"));
    let llm = Talkative {
        script: script.clone(),
        text: huge.clone(),
    };
    let system = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts");

    assert_eq!(system.ask("a", "go").await.unwrap().text, "done");
    let log = system.conversation_log("a").await.unwrap();
    let calling = log
        .iter()
        .find(|message| message.role == Role::Assistant && !message.tool_calls.is_empty())
        .expect("the tool-calling message is logged");
    assert_eq!(
        calling.content.len(),
        AGENT_REPLY_SIZE_MAX_BYTES - 1,
        "the log keeps the text cut at the last whole character"
    );
    assert!(huge.starts_with(&calling.content));
    let arguments = arguments_bytes(&calling.tool_calls[0].arguments);
    assert!(
        arguments <= AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES,
        "the log keeps arguments of {arguments} bytes"
    );
    let serde_json::Value::String(kept) = &calling.tool_calls[0].arguments else {
        panic!(
            "cut arguments are kept as their text: {:?}",
            calling.tool_calls[0].arguments
        );
    };
    assert!(kept.starts_with(r#"{"agent_id":"b","message":"aé"#), "{}", &kept[..64]);

    // The turn's second step was shown the cut message.
    let requests = script.requests_of("a");
    let second = requests.last().expect("the second step's request");
    let shown = second
        .messages
        .iter()
        .find(|message| !message.tool_calls.is_empty())
        .expect("the second step shows the call");
    assert!(
        message_bytes(shown) <= AGENT_REPLY_SIZE_MAX_BYTES + AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES,
        "the second step was shown {} bytes",
        message_bytes(shown)
    );

    // The tool ran on the arguments as given: it refused the 8 MiB message by its
    // schema (a cut copy would not be an object with a message at all).
    let result = log
        .iter()
        .find(|message| message.role == Role::Tool)
        .expect("the tool result is logged");
    assert!(
        result
            .content
            .starts_with("error: invalid arguments for notify_agent: $.message"),
        "{}",
        &result.content[..200.min(result.content.len())]
    );

    assert_eq!(system.ask("a", "next").await.unwrap().text, "ok");
    let prompt = script.requests_of("a").pop().expect("the next turn's request");
    let prompt_bytes: usize = prompt.messages.iter().map(message_bytes).sum();
    assert!(
        prompt_bytes < AGENT_REPLY_SIZE_MAX_BYTES + AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES + 16 * 1024,
        "the next prompt holds {prompt_bytes} bytes"
    );
    system.shutdown().await;
}

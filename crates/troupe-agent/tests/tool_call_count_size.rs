//! An agent keeps of a model's tool-calling message only the calls it runs (the first
//! `AGENT_TOOL_CALLS_PER_STEP_MAX`), each with its id cut to
//! `AGENT_TOOL_CALL_ID_SIZE_MAX_BYTES` and its name to `AGENT_TOOL_NAME_SIZE_MAX_BYTES`,
//! and a result per kept call with the same id: a provider's message with thousands of
//! calls or huge ids is neither stored whole nor in every later prompt, and the chat
//! stays one a provider accepts (every call answered by its id). The step's
//! `ModelResponded` event counts the calls kept (`tool_calls`) and those dropped past the
//! limit (`tool_calls_dropped`).
//!
//! Runs in both builds: `cargo test -p troupe-agent --test tool_call_count_size`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use serde_json::json;
use troupe_agent::limits::{
    AGENT_REPLY_SIZE_MAX_BYTES, AGENT_TOOL_CALLS_PER_STEP_MAX, AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES,
    AGENT_TOOL_CALL_ID_SIZE_MAX_BYTES, AGENT_TOOL_NAME_SIZE_MAX_BYTES, AGENT_TOOL_RESULT_SIZE_MAX_BYTES,
};
use troupe_agent::{
    AgentEvent, AgentSpec, AgentSystem, CallRecorder, ChatMessage, LlmClient, LlmError, LlmReply, LlmRequest, Role,
    ScriptRule, ScriptedLlm, ToolCall,
};
use troupe_runtime::MemoryStore;

/// Calls the model makes in its flooding message.
const FLOOD_CALLS: usize = 10_000;
/// Bytes of each flooding call's id (10,000 of them: 20 MiB, over the store's 16 MiB
/// value limit in one message).
const FLOOD_ID_BYTES: usize = 2 * 1024;
/// Bytes of the first call's id and name.
const FLOOD_FIRST_BYTES: usize = 1024 * 1024;
/// Bytes of JSON a kept message holds besides its strings (field names, quotes).
const MESSAGE_FRAME_BYTES: usize = 128;

/// The scripted model, each of whose tool-calling replies is made a flood: the calls
/// replaced by `FLOOD_CALLS` calls of a tool the agent does not have, ids differing only
/// in their last bytes, the first call's id and name 1 MiB long.
struct Flooding {
    script: ScriptedLlm,
}

#[async_trait]
impl LlmClient for Flooding {
    async fn complete(&self, request: LlmRequest) -> Result<LlmReply, LlmError> {
        let mut reply = self.script.complete(request).await?;
        if !reply.message.tool_calls.is_empty() {
            let filler = "i".repeat(FLOOD_ID_BYTES);
            reply.message.tool_calls = (0..FLOOD_CALLS)
                .map(|index| ToolCall {
                    id: format!("{filler}{index}"),
                    name: "lookup".to_string(),
                    arguments: json!({"index": index}),
                })
                .collect();
            let first = &mut reply.message.tool_calls[0];
            first.id = format!("{}0", "é".repeat(FLOOD_FIRST_BYTES / 2));
            first.name = "n".repeat(FLOOD_FIRST_BYTES);
        }
        Ok(reply)
    }
}

/// A model whose `n`-th call (from 0) asks for `calls[n]` tool calls of a tool the agent
/// does not have (each answered by an error result), and which answers "done" once
/// `calls` is used up.
struct Asking {
    calls: Vec<usize>,
    step: AtomicUsize,
}

#[async_trait]
impl LlmClient for Asking {
    async fn complete(&self, _request: LlmRequest) -> Result<LlmReply, LlmError> {
        let step = self.step.fetch_add(1, Ordering::Relaxed);
        let mut message = ChatMessage::new(Role::Assistant, "");
        match self.calls.get(step) {
            Some(&count) => {
                message.tool_calls = (0..count)
                    .map(|index| ToolCall {
                        id: format!("call-{step}-{index}"),
                        name: "lookup".to_string(),
                        arguments: json!({"index": index}),
                    })
                    .collect();
            }
            None => message.content = "done".to_string(),
        }
        Ok(LlmReply::new(message))
    }
}

/// The `(step, tool_calls, tool_calls_dropped)` of every `ModelResponded` in `events`,
/// in order.
fn model_steps(events: &[AgentEvent]) -> Vec<(u32, usize, usize)> {
    events
        .iter()
        .filter_map(|event| match event {
            AgentEvent::ModelResponded {
                step,
                tool_calls,
                tool_calls_dropped,
                ..
            } => Some((*step, *tool_calls, *tool_calls_dropped)),
            _ => None,
        })
        .collect()
}

/// Asserts that every tool call in `messages` is followed by one result with its id, in
/// the order of the calls, that every result follows its call, and that the ids of a
/// message are distinct: what a chat-completions request needs.
fn assert_every_call_answered(messages: &[ChatMessage]) {
    let mut index = 0;
    while index < messages.len() {
        let message = &messages[index];
        assert!(
            message.role != Role::Tool,
            "message {index} is a result with no call before it: {:?}",
            message.tool_call_id
        );
        index += 1;
        let ids: Vec<&str> = message.tool_calls.iter().map(|call| call.id.as_str()).collect();
        let distinct: std::collections::BTreeSet<&str> = ids.iter().copied().collect();
        assert_eq!(distinct.len(), ids.len(), "the calls' ids are distinct: {ids:?}");
        for id in ids {
            let result = messages.get(index).expect("a result for every call");
            assert_eq!(result.role, Role::Tool, "message {index} answers a call");
            assert_eq!(
                result.tool_call_id.as_deref(),
                Some(id),
                "message {index} answers its call's id"
            );
            index += 1;
        }
    }
}

/// The bytes of `message` written as JSON.
fn json_bytes(message: &ChatMessage) -> usize {
    serde_json::to_vec(message).expect("a message is JSON").len()
}

/// Goal: a model message with 10,000 tool calls (20 MiB of ids, a 1 MiB id and a 1 MiB
/// name) is kept as its first `AGENT_TOOL_CALLS_PER_STEP_MAX` calls, ids and names cut,
/// a result each with the same id, the last saying how many were skipped: the log's
/// messages stay under a bound computed from the limits, and the turn's next step and
/// the next turn are sent a chat in which every call is answered by its id. Method: the
/// scripted model wrapped to flood its tool call; then the log and the model's later
/// requests are read.
#[tokio::test(start_paused = true)]
async fn a_message_with_thousands_of_tool_calls_and_huge_ids_is_kept_within_bounds() {
    let script = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("go")
                .call("lookup", json!({})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("done"))
        .rule(ScriptRule::agent("a").on_user_containing("next").reply("ok"));
    let llm = Flooding { script: script.clone() };
    let system = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("a"))
        .start()
        .expect("the system starts");

    assert_eq!(system.ask("a", "go").await.unwrap().text, "done");
    let log = system.conversation_log("a").await.unwrap();
    assert_every_call_answered(&log);
    let calling = log
        .iter()
        .find(|message| !message.tool_calls.is_empty())
        .expect("the tool-calling message is logged");
    assert_eq!(
        calling.tool_calls.len(),
        AGENT_TOOL_CALLS_PER_STEP_MAX,
        "only the calls run are kept"
    );
    for call in &calling.tool_calls {
        assert!(
            call.id.len() <= AGENT_TOOL_CALL_ID_SIZE_MAX_BYTES,
            "an id of {} bytes",
            call.id.len()
        );
        assert!(
            call.name.len() <= AGENT_TOOL_NAME_SIZE_MAX_BYTES,
            "a name of {} bytes",
            call.name.len()
        );
    }
    let call_bound = AGENT_TOOL_CALL_ID_SIZE_MAX_BYTES
        + AGENT_TOOL_NAME_SIZE_MAX_BYTES
        + AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES
        + MESSAGE_FRAME_BYTES;
    let calling_bound = AGENT_REPLY_SIZE_MAX_BYTES + MESSAGE_FRAME_BYTES + AGENT_TOOL_CALLS_PER_STEP_MAX * call_bound;
    assert!(
        json_bytes(calling) <= calling_bound,
        "the calling message is kept in {} bytes, over {calling_bound}",
        json_bytes(calling)
    );
    let results: Vec<&ChatMessage> = log.iter().filter(|message| message.role == Role::Tool).collect();
    assert_eq!(results.len(), AGENT_TOOL_CALLS_PER_STEP_MAX, "a result per kept call");
    let result_bound = AGENT_TOOL_RESULT_SIZE_MAX_BYTES + AGENT_TOOL_CALL_ID_SIZE_MAX_BYTES + MESSAGE_FRAME_BYTES;
    for result in &results {
        assert!(
            json_bytes(result) <= result_bound,
            "a result kept in {} bytes",
            json_bytes(result)
        );
    }
    let skipped = FLOOD_CALLS - AGENT_TOOL_CALLS_PER_STEP_MAX;
    let last = &results.last().expect("results").content;
    assert!(
        last.contains(&format!("the {skipped} calls after this one were skipped")),
        "the last result says how many calls were skipped: {last}"
    );
    // The registry was asked for the tool by its name as given, not as kept.
    let whole_name = format!(
        "error: unknown tool \"{}",
        "n".repeat(2 * AGENT_TOOL_NAME_SIZE_MAX_BYTES)
    );
    assert!(
        results[0].content.starts_with(&whole_name),
        "the first call ran on its name as given: {}",
        &results[0].content[..80]
    );

    // The turn's second step and the next turn were sent the kept message.
    let second = script.requests_of("a").pop().expect("the second step's request");
    let shown: Vec<ChatMessage> = second.messages.iter().cloned().collect();
    assert_every_call_answered(&shown);
    assert!(shown
        .iter()
        .any(|message| message.tool_calls.len() == AGENT_TOOL_CALLS_PER_STEP_MAX));
    assert_eq!(system.ask("a", "next").await.unwrap().text, "ok");
    let prompt = script.requests_of("a").pop().expect("the next turn's request");
    let shown: Vec<ChatMessage> = prompt.messages.iter().cloned().collect();
    assert_every_call_answered(&shown);
    let prompt_bytes: usize = shown.iter().map(json_bytes).sum();
    let prompt_bound = calling_bound + AGENT_TOOL_CALLS_PER_STEP_MAX * result_bound + 64 * 1024;
    assert!(
        prompt_bytes <= prompt_bound,
        "the next prompt holds {prompt_bytes} bytes, over {prompt_bound}"
    );
    system.shutdown().await;
}

/// Goal: the `ModelResponded` event of a step whose model asked for 10,000 tool calls
/// reports the calls the step keeps and runs, `AGENT_TOOL_CALLS_PER_STEP_MAX`, as many
/// as the `ToolFinished` events that follow it (before: 10,000, the model's raw count,
/// of which 9,984 never ran), and the 9,984 dropped past the limit in
/// `tool_calls_dropped` (before 2026-12-06 no event said they were dropped). Method:
/// the flooding model behind an observer; the events of the turn are read.
#[tokio::test(start_paused = true)]
async fn model_responded_reports_the_tool_calls_kept_not_all_the_model_asked_for() {
    let script = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("go")
                .call("lookup", json!({})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("done"));
    let recorder = CallRecorder::new();
    let system = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(Flooding { script }))
        .observer(Arc::new(recorder.clone()))
        .agent(AgentSpec::new("a"))
        .start()
        .expect("the system starts");
    assert_eq!(system.ask("a", "go").await.unwrap().text, "done");
    let events = recorder.events();
    assert_eq!(
        model_steps(&events),
        [
            (
                1,
                AGENT_TOOL_CALLS_PER_STEP_MAX,
                FLOOD_CALLS - AGENT_TOOL_CALLS_PER_STEP_MAX
            ),
            (2, 0, 0)
        ],
        "the calls kept and dropped, then the answer"
    );
    let finished = events
        .iter()
        .filter(|event| matches!(event, AgentEvent::ToolFinished { .. }))
        .count();
    assert_eq!(finished, AGENT_TOOL_CALLS_PER_STEP_MAX, "as many as ran");
    system.shutdown().await;
}

/// Goal: `ModelResponded` reports `tool_calls_dropped` 0 for a step that asks for fewer
/// calls than `AGENT_TOOL_CALLS_PER_STEP_MAX` or exactly as many, and the excess for one
/// that asks for one more, beside the calls kept; as many `ToolFinished` as calls kept.
/// Method: a model asking for 3, then `AGENT_TOOL_CALLS_PER_STEP_MAX`, then one more than
/// it, then answering, behind an observer; the events of the one turn are read.
#[tokio::test(start_paused = true)]
async fn model_responded_reports_no_dropped_calls_up_to_the_limit_and_the_excess_past_it() {
    let most = AGENT_TOOL_CALLS_PER_STEP_MAX;
    let recorder = CallRecorder::new();
    let system = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(Asking {
            calls: vec![3, most, most + 1],
            step: AtomicUsize::new(0),
        }))
        .observer(Arc::new(recorder.clone()))
        .agent(AgentSpec::new("a"))
        .start()
        .expect("the system starts");
    assert_eq!(system.ask("a", "go").await.unwrap().text, "done");
    let events = recorder.events();
    assert_eq!(
        model_steps(&events),
        [(1, 3, 0), (2, most, 0), (3, most, 1), (4, 0, 0)],
        "fewer than the limit, the limit, one past it, then the answer"
    );
    let finished = events
        .iter()
        .filter(|event| matches!(event, AgentEvent::ToolFinished { .. }))
        .count();
    assert_eq!(finished, 3 + 2 * most, "as many as kept");
    system.shutdown().await;
}

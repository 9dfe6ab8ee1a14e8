//! Token usage per turn: an agent's reply sums what its model calls reported. Both
//! builds (paused tokio time, or the simulator).

use std::sync::Arc;

use serde_json::json;
use troupe_agent::{
    AgentEvent, AgentObserver, AgentSpec, AgentSystem, ChatMessage, ScriptRule, ScriptedLlm, TokenUsage,
};

/// The scripted model's documented count: one token per whitespace-separated word, a
/// tool call counting one plus the words of its JSON arguments.
fn words(message: &ChatMessage) -> u64 {
    let text = message.content.split_whitespace().count();
    let calls: usize = message
        .tool_calls
        .iter()
        .map(|call| 1 + call.arguments.to_string().split_whitespace().count())
        .sum();
    (text + calls) as u64
}

/// The boss asks the worker to count the stars through `call_agent`, then answers with
/// the worker's reply; the worker answers "about four hundred billion".
fn boss_asks_worker() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(ScriptRule::agent("boss").on_user_containing("").call(
            "call_agent",
            json!({"agent_id": "worker", "message": "count the stars"}),
        ))
        .rule(
            ScriptRule::agent("boss")
                .on_tool_result()
                .reply("the worker says {tool_result}"),
        )
        .rule(ScriptRule::agent("worker").reply("about four hundred billion"))
}

/// Goal: a turn of two model steps (a call_agent, then the answer) reports the sum of
/// both steps' usage, and the callee's turn reports its own one step only.
#[tokio::test(start_paused = true)]
async fn a_reply_reports_the_summed_usage_of_its_own_model_calls() {
    let llm = Arc::new(boss_asks_worker());
    let system = AgentSystem::builder()
        .llm(Arc::clone(&llm) as Arc<dyn troupe_agent::LlmClient>)
        .agent(AgentSpec::new("boss"))
        .agent(AgentSpec::new("worker"))
        .start()
        .unwrap();
    let reply = system.ask("boss", "how many stars are there").await.unwrap();
    assert_eq!(reply.steps, 2);

    let prompt = |agent: &str| -> u64 {
        llm.requests_of(agent)
            .iter()
            .map(|request| request.messages.iter().map(words).sum::<u64>())
            .sum()
    };
    let call_step = 1 + json!({"agent_id": "worker", "message": "count the stars"})
        .to_string()
        .split_whitespace()
        .count() as u64;
    let answer_step = "the worker says about four hundred billion".split_whitespace().count() as u64;
    let boss = TokenUsage {
        prompt_tokens: prompt("boss"),
        completion_tokens: call_step + answer_step,
        total_tokens: prompt("boss") + call_step + answer_step,
    };
    assert_eq!(llm.requests_of("boss").len(), 2);
    assert_eq!(reply.usage, boss);
    assert!(boss.prompt_tokens > 0);

    let worker = system.ask("worker", "count the stars").await.unwrap();
    assert_eq!(worker.steps, 1);
    assert_eq!(worker.usage.completion_tokens, 4, "about four hundred billion");
    system.shutdown().await;
}

/// Keeps every event, in order.
#[derive(Default)]
struct Recorder(std::sync::Mutex<Vec<AgentEvent>>);

impl AgentObserver for Recorder {
    fn on_event(&self, event: &AgentEvent) {
        self.0.lock().unwrap().push(event.clone());
    }
}

/// What one agent's turn reported, in order, without times.
fn steps_of(events: &[AgentEvent], agent: &str) -> Vec<String> {
    events
        .iter()
        .filter_map(|event| match event {
            AgentEvent::TurnStarted { agent: a, depth, .. } if a.key() == agent => Some(format!("turn depth {depth}")),
            AgentEvent::ModelResponded {
                agent: a,
                step,
                tool_calls,
                usage,
                ..
            } if a.key() == agent => Some(format!(
                "model step {step}: {tool_calls} tool calls, {} tokens",
                usage.map_or(0, |u| u.total_tokens)
            )),
            AgentEvent::ToolFinished { agent: a, tool, ok, .. } if a.key() == agent => {
                Some(format!("tool {tool} ok={ok}"))
            }
            AgentEvent::TurnEnded {
                agent: a,
                ok,
                steps,
                usage,
                ..
            } if a.key() == agent => Some(format!(
                "turn ended ok={ok} steps {steps}, {} tokens",
                usage.total_tokens
            )),
            _ => None,
        })
        .collect()
}

/// Goal: a turn reports each model response with its usage, each tool call's end, and
/// its own end with the summed usage, in order; the callee's turn reports its own.
#[tokio::test(start_paused = true)]
async fn a_turn_reports_model_responses_tool_calls_and_its_end_with_usage() {
    let llm = Arc::new(boss_asks_worker());
    let recorder = Arc::new(Recorder::default());
    let system = AgentSystem::builder()
        .llm(Arc::clone(&llm) as Arc<dyn troupe_agent::LlmClient>)
        .observer(Arc::clone(&recorder) as Arc<dyn AgentObserver>)
        .agent(AgentSpec::new("boss"))
        .agent(AgentSpec::new("worker"))
        .start()
        .unwrap();
    let reply = system.ask("boss", "how many stars are there").await.unwrap();
    let events = recorder.0.lock().unwrap().clone();
    let requests = llm.requests_of("boss");
    let step_tokens =
        |index: usize, completion: u64| -> u64 { requests[index].messages.iter().map(words).sum::<u64>() + completion };
    let call_step = 1 + json!({"agent_id": "worker", "message": "count the stars"})
        .to_string()
        .split_whitespace()
        .count() as u64;
    assert_eq!(
        steps_of(&events, "boss"),
        vec![
            "turn depth 0".to_string(),
            format!("model step 1: 1 tool calls, {} tokens", step_tokens(0, call_step)),
            "tool call_agent ok=true".to_string(),
            format!("model step 2: 0 tool calls, {} tokens", step_tokens(1, 7)),
            format!("turn ended ok=true steps 2, {} tokens", reply.usage.total_tokens),
        ]
    );
    assert_eq!(reply.usage.total_tokens, step_tokens(0, call_step) + step_tokens(1, 7));
    let worker = steps_of(&events, "worker");
    assert_eq!(worker.len(), 3, "{worker:?}");
    assert_eq!(worker[0], "turn depth 1");
    system.shutdown().await;
}

/// A model whose provider reports `u64::MAX` tokens for every call: a tool call first,
/// then (once a tool result is in the prompt) the answer.
struct HugeUsage;

#[async_trait::async_trait]
impl troupe_agent::LlmClient for HugeUsage {
    async fn complete(
        &self,
        request: troupe_agent::LlmRequest,
    ) -> Result<troupe_agent::LlmReply, troupe_agent::LlmError> {
        let answered = request.messages.iter().any(|m| m.role == troupe_agent::Role::Tool);
        let mut message = ChatMessage::new(troupe_agent::Role::Assistant, if answered { "done" } else { "" });
        if !answered {
            message.tool_calls.push(troupe_agent::ToolCall {
                id: "c1".into(),
                name: "no_such_tool".into(),
                arguments: json!({}),
            });
        }
        let huge = TokenUsage {
            prompt_tokens: u64::MAX,
            completion_tokens: u64::MAX,
            total_tokens: u64::MAX,
        };
        Ok(troupe_agent::LlmReply::new(message).with_usage(huge))
    }
}

/// Goal: the usage a provider reports is untrusted input; two steps each reporting
/// `u64::MAX` tokens sum to `u64::MAX` (saturating), not an arithmetic overflow that
/// panics the turn.
#[tokio::test(start_paused = true)]
async fn usage_reported_near_u64_max_saturates_instead_of_overflowing() {
    let system = AgentSystem::builder()
        .llm(Arc::new(HugeUsage) as Arc<dyn troupe_agent::LlmClient>)
        .agent(AgentSpec::new("a"))
        .start()
        .unwrap();
    let reply = system.ask("a", "go").await.unwrap();
    assert_eq!(reply.steps, 2);
    assert_eq!(reply.text, "done");
    assert_eq!(
        reply.usage,
        TokenUsage {
            prompt_tokens: u64::MAX,
            completion_tokens: u64::MAX,
            total_tokens: u64::MAX,
        }
    );
    system.shutdown().await;
}

//! Token usage per turn: an agent's reply sums what its model calls reported. Both
//! builds (paused tokio time, or the simulator).

use std::sync::Arc;

use serde_json::json;
use troupe_agent::{AgentSpec, AgentSystem, ChatMessage, ScriptRule, ScriptedLlm, TokenUsage};

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

/// Goal: a turn of two model steps (a call_agent, then the answer) reports the sum of
/// both steps' usage, and the callee's turn reports its own one step only.
#[tokio::test(start_paused = true)]
async fn a_reply_reports_the_summed_usage_of_its_own_model_calls() {
    let llm = Arc::new(
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
            .rule(ScriptRule::agent("worker").reply("about four hundred billion")),
    );
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

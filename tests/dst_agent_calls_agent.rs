//! Agent calls agent, end to end, under model latency, model errors and tool errors.
//!
//! Goal: the `call_agent` path works for real: the coordinator's scripted model emits
//! `call_agent`, the analyst's own model runs and calls its `lookup` tool, and the answer
//! travels back to the client over the simulated network. Faults of the world around
//! the agents (a slow model, a failing model, a failing tool) show up as typed outcomes
//! and readable tool results, never as hangs. Method: a safety phase of concurrent asks
//! with random model latency, model failures and tool failures; a liveness phase with
//! everything healed in which a fresh ask must get the full answer.
//!
//! Faults: LLM latency, LLM error, tool error (and madsim's default link latency).
//! Invariants: all eight; DeadlineMonotone and DepthBounded read every agent turn's
//! context through the agent observer.
#![cfg(madsim)]

use std::sync::Arc;
use std::time::Duration;

use troupe_core::InvokeError;
use troupe_sim::agent::{agent_id, AgentEvent, AgentSpec, CallOutcome, CallRecorder, ScriptRule, ScriptedLlm};
use troupe_sim::agents::AgentSetup;
use troupe_sim::serde_json::json;
use troupe_sim::{Fault, Scenario, Sim, SimConfig};

const TEST: &str = "dst_agent_calls_agent";

fn script() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(ScriptRule::agent("coordinator").on_user_containing("ask").call(
            "call_agent",
            json!({"agent_id": "analyst", "message": "{input}", "timeout_ms": 400}),
        ))
        .rule(
            ScriptRule::agent("coordinator")
                .on_tool_result()
                .reply("analyst says: {tool_result}"),
        )
        .rule(
            ScriptRule::agent("analyst")
                .on_user_containing("ask")
                .call("lookup", json!({"key": "{input}"})),
        )
        .rule(ScriptRule::agent("analyst").on_tool_result().reply("{tool_result}"))
}

fn setup(recorder: &CallRecorder) -> AgentSetup {
    let agents = vec![
        AgentSpec::new("coordinator").role("plans the work"),
        AgentSpec::new("analyst").role("looks things up"),
    ];
    AgentSetup::new(Arc::new(script()), agents).observer(Arc::new(recorder.clone()))
}

/// Goal and method: see the module documentation.
#[madsim::test]
async fn agent_calls_agent_and_the_answer_comes_back_through_the_callees_model_and_tool() {
    let scenario = Scenario {
        test: TEST,
        name: "agent_calls_agent_and_the_answer_comes_back_through_the_callees_model_and_tool",
    };
    let recorder = CallRecorder::new();
    let mut sim = Sim::start_with_agents(scenario, SimConfig::default(), setup(&recorder)).await;

    sim.phase("safety");
    for round in 0..12 {
        match sim.rng().range(0, 4) {
            0 => {
                sim.inject(Fault::LlmLatency {
                    ms: sim.rng().range(1, 150),
                })
                .await
            }
            1 => {
                sim.inject(Fault::LlmFail {
                    count: sim.rng().range(1, 3),
                })
                .await
            }
            2 => {
                sim.inject(Fault::ToolFail {
                    count: sim.rng().range(1, 3),
                })
                .await
            }
            _ => {}
        }
        sim.spawn_ask("coordinator", &format!("ask q{round}"), Duration::from_millis(800));
        let gap = sim.rng().range(1, 40);
        sim.advance(Duration::from_millis(gap)).await;
    }
    sim.drain_asks().await;
    sim.quiesce().await;
    // Then each fault alone, so its effect is certain on every seed.
    sim.heal().await;
    sim.inject(Fault::ToolFail { count: 1 }).await;
    let tool_failures_before = sim.tool_faults().injected_count();
    let tool_error = sim
        .ask("coordinator", "ask with a broken tool", Duration::from_millis(800))
        .await;
    let tool_failures = sim.tool_faults().injected_count() - tool_failures_before;
    sim.heal().await;
    sim.inject(Fault::LlmFail { count: 1 }).await;
    let model_failures_before = sim.llm_faults().injected_count();
    let model_error = sim
        .ask("coordinator", "ask with a broken model", Duration::from_millis(800))
        .await;
    let model_failures = sim.llm_faults().injected_count() - model_failures_before;
    sim.heal().await;
    sim.inject(Fault::LlmLatency { ms: 1_000 }).await;
    let too_slow = sim
        .ask("coordinator", "ask a slow model", Duration::from_millis(300))
        .await;

    sim.phase("liveness");
    sim.heal().await;
    let answer = sim.ask("coordinator", "ask final", Duration::from_secs(2)).await;
    sim.read_agent_logs(&["coordinator", "analyst"]).await;

    // The tool's one injected failure reached the analyst's model as a tool result, and
    // travelled up as the analyst's answer.
    assert_eq!(tool_failures, 1, "the one injected tool failure happened");
    let tool_error = tool_error.expect("a tool error is a tool result, not a failed turn");
    assert_eq!(
        tool_error.text,
        "analyst says: error: lookup failed: simulated tool outage"
    );
    // The model's one injected failure hits the first model request after it: the
    // coordinator's first step. It fails the coordinator's turn, and the client sees
    // exactly that.
    assert_eq!(model_failures, 1, "the one injected model failure happened");
    assert_eq!(
        model_error,
        Err(InvokeError::ActorFailed {
            target: agent_id("coordinator").expect("a valid agent id"),
            cause: "the model failed: injected model failure: simulated provider outage".to_string(),
        })
    );
    // A model slower than the client's deadline: the client times out at its deadline.
    // (The host reports the budget it received: 300 ms less the request's transit.)
    match too_slow {
        Err(InvokeError::Timeout { target, timeout_ms }) => {
            assert_eq!(target, agent_id("coordinator").expect("a valid agent id"));
            assert!(timeout_ms <= 300, "a budget of {timeout_ms} ms from a 300 ms timeout");
        }
        other => panic!("a model slower than the deadline must be Timeout, got {other:?}"),
    }
    // After healing, the whole path works.
    let answer = answer.expect("after healing the ask must succeed");
    assert_eq!(
        answer.text,
        "analyst says: value-of-[message from agent coordinator] ask final"
    );
    // The call tree shows a real agent-to-agent call that was answered.
    let replied = recorder.events().iter().any(|event| {
        matches!(
            event,
            AgentEvent::CallFinished {
                outcome: CallOutcome::Replied { .. },
                ..
            }
        )
    });
    assert!(replied, "no call_agent was answered:\n{}", recorder.render_tree());
    sim.finish().await;
}

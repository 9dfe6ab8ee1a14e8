//! The agent-level faults, each with its typed outcome: a callee that rejects (its turn
//! fails), an agent that does not exist, an agent that is busy (mailbox full), and a
//! callee that times out. Each reaches the calling agent's model as a readable tool
//! result and the observer as a typed `CallOutcome`; none hangs.
//!
//! Faults: callee rejects, agent not found, agent busy, callee timeout, with random
//! model latency. Invariants: all eight.
#![cfg(madsim)]

use std::sync::Arc;
use std::time::Duration;

use troupe_core::{CallRefused, InvokeError};
use troupe_sim::agent::{AgentEvent, AgentSpec, CallOutcome, CallRecorder, ScriptRule, ScriptedLlm};
use troupe_sim::agents::AgentSetup;
use troupe_sim::serde_json::json;
use troupe_sim::{Fault, Scenario, Sim, SimConfig};

const TEST: &str = "dst_agent_faults";

fn ask_rule(needle: &str, target: &str, timeout_ms: u64) -> ScriptRule {
    ScriptRule::agent("boss").on_user_containing(needle).call(
        "call_agent",
        json!({"agent_id": target, "message": "please", "timeout_ms": timeout_ms}),
    )
}

/// The outcomes of every `call_agent` finished so far, in order.
fn outcomes(recorder: &CallRecorder) -> Vec<CallOutcome> {
    recorder
        .events()
        .into_iter()
        .filter_map(|event| match event {
            AgentEvent::CallFinished { outcome, .. } => Some(outcome),
            _ => None,
        })
        .collect()
}

/// Goal and method: the boss agent calls, in turn, an agent whose model fails, an agent
/// that does not exist, a busy agent (four calls at once into a mailbox of one while the
/// worker is already thinking for 200 ms about a direct ask: exactly one is queued and
/// answered, three are refused with `Busy`), and a slow agent with a short timeout. Each
/// call's typed outcome is checked, the boss answers every time, and after healing a
/// normal call works.
#[madsim::test]
async fn every_agent_level_fault_is_a_typed_outcome_and_a_readable_tool_result() {
    let scenario = Scenario {
        test: TEST,
        name: "every_agent_level_fault_is_a_typed_outcome_and_a_readable_tool_result",
    };
    let mut fan_out = ScriptRule::agent("boss").on_user_containing("crowd");
    for _ in 0..4 {
        fan_out = fan_out.call("call_agent", json!({"agent_id": "worker", "message": "work"}));
    }
    let llm = ScriptedLlm::new()
        .rule(ask_rule("reject", "grumpy", 2_000))
        .rule(ask_rule("ghost", "nobody", 2_000))
        .rule(fan_out)
        .rule(ask_rule("slow", "sloth", 100))
        .rule(ask_rule("normal", "worker", 2_000))
        .rule(
            ScriptRule::agent("boss")
                .on_tool_result()
                .reply("boss heard: {tool_result}"),
        )
        .rule(ScriptRule::agent("grumpy").fail("grumpy refuses to work"))
        .rule(
            ScriptRule::agent("worker")
                .reply("worked")
                .latency(Duration::from_millis(200)),
        )
        .rule(
            ScriptRule::agent("sloth")
                .reply("eventually")
                .latency(Duration::from_secs(1)),
        );
    let recorder = CallRecorder::new();
    let agents = ["boss", "grumpy", "worker", "sloth"]
        .into_iter()
        .map(AgentSpec::new)
        .collect();
    let setup = AgentSetup::new(Arc::new(llm), agents).observer(Arc::new(recorder.clone()));
    let config = SimConfig {
        mailbox_capacity: 1,
        ..SimConfig::default()
    };
    let mut sim = Sim::start_with_agents(scenario, config, setup).await;
    let timeout = Duration::from_secs(5);

    sim.phase("safety");
    let jitter = sim.rng().range(0, 20);
    sim.inject(Fault::LlmLatency { ms: jitter }).await;

    let reply = sim.ask("boss", "reject me", timeout).await.expect("the boss answers");
    assert!(reply.text.starts_with("boss heard: "), "{reply:?}");
    match outcomes(&recorder).pop() {
        Some(CallOutcome::Failed(InvokeError::ActorFailed { target, cause })) => assert_eq!(
            (target.key(), cause.as_str()),
            (
                "grumpy",
                "the model failed: injected model failure: grumpy refuses to work"
            )
        ),
        other => panic!("a callee whose turn fails must be ActorFailed, got {other:?}"),
    }

    let reply = sim
        .ask("boss", "call a ghost", timeout)
        .await
        .expect("the boss answers");
    assert!(reply.text.contains("not found"), "{reply:?}");
    match outcomes(&recorder).pop() {
        Some(CallOutcome::Refused(CallRefused::AgentNotFound { target })) => assert_eq!(target.key(), "nobody"),
        other => panic!("an unknown agent must be AgentNotFound, got {other:?}"),
    }

    // The worker is busy with a direct ask (its turn has taken the message, so its
    // mailbox of one is empty) when the boss's four calls arrive.
    sim.spawn_ask("worker", "direct work", timeout);
    sim.advance(Duration::from_millis(20)).await;
    let before = outcomes(&recorder).len();
    let reply = sim
        .ask("boss", "a crowd of calls", timeout)
        .await
        .expect("the boss answers");
    assert!(reply.text.starts_with("boss heard: "), "{reply:?}");
    let crowd: Vec<CallOutcome> = outcomes(&recorder).split_off(before);
    let busy = crowd
        .iter()
        .filter(|o| matches!(o, CallOutcome::Failed(InvokeError::Busy { .. })))
        .count();
    let worked = crowd
        .iter()
        .filter(|o| matches!(o, CallOutcome::Replied { .. }))
        .count();
    // One running (the direct ask) and one queued in a mailbox of one: the other three
    // are refused at once.
    assert_eq!((worked, busy), (1, 3), "{crowd:?}");
    let direct = sim.drain_asks().await;
    assert_eq!(
        direct
            .into_iter()
            .map(|outcome| outcome.map(|reply| reply.text))
            .collect::<Vec<_>>(),
        vec![Ok("worked".to_string())]
    );

    let reply = sim.ask("boss", "be slow", timeout).await.expect("the boss answers");
    assert!(reply.text.contains("timed out"), "{reply:?}");
    assert!(matches!(
        outcomes(&recorder).pop(),
        Some(CallOutcome::Failed(InvokeError::Timeout { .. }))
    ));

    sim.phase("liveness");
    sim.heal().await;
    sim.quiesce().await;
    let reply = sim.ask("boss", "normal work", timeout).await.expect("after healing");
    assert_eq!(reply.text, "boss heard: worked");
    sim.read_agent_logs(&["boss", "worker"]).await;
    sim.finish().await;
}

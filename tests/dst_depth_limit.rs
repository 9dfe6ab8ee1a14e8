//! The depth limit: a chain of calls stops at depth 5 (`AGENT_CALL_DEPTH_MAX`), between
//! real agents and across nodes over the transport.
//!
//! Faults: model latency, link latency. Invariants: all eight, in particular
//! DepthBounded (every turn's context and every admitted call) and DeadlineMonotone
//! (each hop's deadline against its caller's).
#![cfg(madsim)]

use std::sync::Arc;
use std::time::Duration;

use troupe_core::limits::AGENT_CALL_DEPTH_MAX;
use troupe_core::CallRefused;
use troupe_sim::agent::{AgentEvent, AgentSpec, CallOutcome, CallRecorder, ScriptRule, ScriptedLlm};
use troupe_sim::agents::AgentSetup;
use troupe_sim::serde_json::json;
use troupe_sim::workload::keys_on;
use troupe_sim::{Fault, ProbeOp, ProbeReply, RefusalKind, Scenario, Sim, SimConfig};

const TEST: &str = "dst_depth_limit";

/// Goal: agents a0 → a1 → ... → a6, each asking the next: a0..a4 call at depths 0..4 and
/// are admitted; a5, at depth 5, is refused with `DepthExceeded` and says so, and the
/// answer travels back up. Method: scripted models with random latency; the observer's
/// turns must reach depth 5 and never 6.
#[madsim::test]
async fn a_chain_of_agents_stops_at_depth_five() {
    let scenario = Scenario {
        test: TEST,
        name: "a_chain_of_agents_stops_at_depth_five",
    };
    let names: Vec<String> = (0..7).map(|i| format!("a{i}")).collect();
    let mut llm = ScriptedLlm::new();
    for i in 0..6 {
        llm = llm
            .rule(
                ScriptRule::agent(names[i].clone())
                    .on_user_containing("")
                    .call("call_agent", json!({"agent_id": names[i + 1], "message": "go deeper"})),
            )
            .rule(
                ScriptRule::agent(names[i].clone())
                    .on_tool_result()
                    .reply(format!("{}<{{tool_result}}", names[i])),
            );
    }
    llm = llm.rule(ScriptRule::agent("a6").reply("a6 must never run"));
    let recorder = CallRecorder::new();
    let setup = AgentSetup::new(Arc::new(llm), names.iter().map(|n| AgentSpec::new(n.clone())).collect())
        .observer(Arc::new(recorder.clone()));
    let mut sim = Sim::start_with_agents(scenario, SimConfig::default(), setup).await;

    sim.phase("safety");
    let model_ms = sim.rng().range(0, 30);
    sim.inject(Fault::LlmLatency { ms: model_ms }).await;
    let reply = sim
        .ask("a0", "start", Duration::from_secs(20))
        .await
        .expect("a refused call is a tool result");
    assert!(reply.text.starts_with("a0<a1<a2<a3<a4<a5<"), "{reply:?}");
    assert!(reply.text.contains("call depth 5 has reached the limit"), "{reply:?}");
    let depths: Vec<u32> = recorder
        .events()
        .iter()
        .filter_map(|event| match event {
            AgentEvent::TurnStarted { depth, .. } => Some(*depth),
            _ => None,
        })
        .collect();
    // One turn per agent a0..a5, in call order, at depths 0..5; a6 never runs.
    assert_eq!(depths, (0..=AGENT_CALL_DEPTH_MAX).collect::<Vec<u32>>(), "turn depths");
    let refused = recorder.events().iter().any(|event| {
        matches!(
            event,
            AgentEvent::CallFinished {
                outcome: CallOutcome::Refused(CallRefused::DepthExceeded { depth: 5, .. }),
                ..
            }
        )
    });
    assert!(refused, "no DepthExceeded refusal:\n{}", recorder.render_tree());

    sim.phase("liveness");
    sim.heal().await;
    sim.finish().await;
}

/// Goal: depth and chain survive the transport: chains of distinct probes alternating
/// between two nodes succeed up to 5 hops and are refused at the sixth. Method: random
/// chain lengths from 1 to 8 hops, with random link latency.
#[madsim::test]
async fn chains_across_nodes_are_admitted_to_five_hops_and_refused_beyond() {
    let scenario = Scenario {
        test: TEST,
        name: "chains_across_nodes_are_admitted_to_five_hops_and_refused_beyond",
    };
    let mut sim = Sim::start(
        scenario,
        SimConfig {
            nodes: 2,
            ..SimConfig::default()
        },
    )
    .await;
    let (on_one, on_two) = (keys_on(1, 2, 5), keys_on(2, 2, 5));
    let alternating: Vec<String> = on_one
        .iter()
        .zip(&on_two)
        .flat_map(|(a, b)| [a.clone(), b.clone()])
        .collect();
    sim.phase("safety");
    let max_ms = sim.rng().range(2, 30);
    sim.inject(Fault::Latency { min_ms: 1, max_ms }).await;
    for _ in 0..8 {
        let hops = sim.rng().range(1, 9) as usize;
        let rest: Vec<&str> = alternating[1..=hops].iter().map(String::as_str).collect();
        let outcome = sim
            .request(
                &alternating[0],
                ProbeOp::chain(&rest, ProbeOp::Get, 2_000),
                Duration::from_secs(5),
            )
            .await;
        if hops <= AGENT_CALL_DEPTH_MAX as usize {
            // Nothing ever adds: the last hop reads a count of 0.
            assert_eq!(outcome, Ok(ProbeReply::Count(0)), "{hops} hops");
        } else {
            assert_eq!(outcome, Ok(ProbeReply::Refused(RefusalKind::Depth)), "{hops} hops");
        }
    }
    sim.phase("liveness");
    sim.heal().await;
    sim.finish().await;
}

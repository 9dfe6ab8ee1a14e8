//! Cycle detection: a call back into a waiting agent is refused at once, never left to
//! deadlock until a timeout.
//!
//! Faults: model latency, link latency (madsim's default 1-10 ms), random timing of
//! independent crossing calls. Invariants: all eight, in particular NoCycleInCallChain
//! (every turn's and every admitted call's chain) and WaitForGraphAcyclic (no cycle of
//! waiting actors lives longer than 1 ms of virtual time).
#![cfg(madsim)]

use std::sync::Arc;
use std::time::Duration;

use troupe_core::{CallRefused, InvokeError};
use troupe_sim::agent::{AgentEvent, AgentSpec, CallOutcome, CallRecorder, ScriptRule, ScriptedLlm};
use troupe_sim::agents::AgentSetup;
use troupe_sim::serde_json::json;
use troupe_sim::workload::keys_on;
use troupe_sim::{Fault, ProbeOp, ProbeReply, RefusalKind, Scenario, Sim, SimConfig};

const TEST: &str = "dst_cycle_detection";

/// Goal: A → B → A between real agents is refused by call admission with the whole
/// chain, at once. Method: A's model calls B, B's model calls A back; each model answers
/// its tool result as text. Under random model latency the ask must come back long
/// before its deadline, and the observer must show `CycleDetected` with chain A, B, A.
#[madsim::test]
async fn a_call_back_up_the_chain_between_agents_is_refused_at_once_with_the_chain() {
    let scenario = Scenario {
        test: TEST,
        name: "a_call_back_up_the_chain_between_agents_is_refused_at_once_with_the_chain",
    };
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("")
                .call("call_agent", json!({"agent_id": "b", "message": "{input}"})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("a got: {tool_result}"))
        .rule(
            ScriptRule::agent("b")
                .on_user_containing("")
                .call("call_agent", json!({"agent_id": "a", "message": "back"})),
        )
        .rule(
            ScriptRule::agent("b")
                .on_tool_result()
                .reply("b could not ask a: {tool_result}"),
        );
    let recorder = CallRecorder::new();
    let setup = AgentSetup::new(Arc::new(llm), vec![AgentSpec::new("a"), AgentSpec::new("b")])
        .observer(Arc::new(recorder.clone()));
    let mut sim = Sim::start_with_agents(scenario, SimConfig::default(), setup).await;

    sim.phase("safety");
    let model_ms = sim.rng().range(0, 50);
    sim.inject(Fault::LlmLatency { ms: model_ms }).await;
    let timeout = Duration::from_secs(10);
    let started = tokio::time::Instant::now();
    let reply = sim
        .ask("a", "start a cycle", timeout)
        .await
        .expect("a refused call is a tool result");
    let elapsed = started.elapsed();
    // Four model steps and two network hops, nothing waits for a timeout.
    let bound = Duration::from_millis(4 * model_ms + 100);
    assert!(
        elapsed < bound,
        "the cycle took {elapsed:?} (bound {bound:?}): it waited instead of being refused"
    );
    assert!(reply.text.contains("cycle detected"), "{reply:?}");
    let refused_chain = recorder.events().into_iter().find_map(|event| match event {
        AgentEvent::CallFinished {
            outcome: CallOutcome::Refused(CallRefused::CycleDetected { chain }),
            ..
        } => Some(chain.iter().map(|id| id.key().to_string()).collect::<Vec<_>>()),
        _ => None,
    });
    assert_eq!(
        refused_chain,
        Some(vec!["a".to_string(), "b".to_string(), "a".to_string()])
    );

    sim.phase("liveness");
    sim.heal().await;
    sim.read_agent_logs(&["a", "b"]).await;
    sim.finish().await;
}

/// Goal: the wait-for graph catches what a call chain cannot: two independent requests,
/// X waiting on Y while Y waits on X. Method: on one node, probes X and Y receive
/// requests at random moments that call each other after a random delay; ten rounds.
/// Every request resolves by its deadline; when both calls overlap, the dispatcher
/// refuses one with `DeadlockDetected` at once (WaitForGraphAcyclic would catch a
/// cycle that lived longer than 1 ms).
#[madsim::test]
async fn crossing_calls_from_independent_requests_never_deadlock() {
    let scenario = Scenario {
        test: TEST,
        name: "crossing_calls_from_independent_requests_never_deadlock",
    };
    let mut sim = Sim::start(scenario, SimConfig::default()).await;
    let keys = keys_on(1, 1, 2);
    let (x, y) = (keys[0].clone(), keys[1].clone());
    sim.phase("safety");
    let mut deadlocks = 0;
    for _ in 0..10 {
        // X calls Y, and Y (a separate request) calls X: each callee would call back.
        let (dx, dy) = (sim.rng().range(0, 4), sim.rng().range(0, 4));
        let x_to_y = ProbeOp::Call {
            target: format!("probe/{y}"),
            op: Box::new(ProbeOp::Sleep {
                ms: 5,
                then: Box::new(ProbeOp::Get),
            }),
            timeout_ms: 500,
            delay_ms: dx,
        };
        let y_to_x = ProbeOp::Call {
            target: format!("probe/{x}"),
            op: Box::new(ProbeOp::Sleep {
                ms: 5,
                then: Box::new(ProbeOp::Get),
            }),
            timeout_ms: 500,
            delay_ms: dy,
        };
        sim.spawn_request(&x, x_to_y, Duration::from_secs(1));
        sim.spawn_request(&y, y_to_x, Duration::from_secs(1));
        let outcomes = sim.drain().await;
        deadlocks += outcomes
            .iter()
            .filter(|o| matches!(o, Err(InvokeError::DeadlockDetected { .. })))
            .count();
        assert_eq!(outcomes.len(), 2);
        for outcome in &outcomes {
            assert!(
                matches!(
                    outcome,
                    Ok(ProbeReply::Count(_)) | Err(InvokeError::DeadlockDetected { .. })
                ),
                "{outcome:?}"
            );
        }
    }
    // Both turns hold each other for 5 ms, so overlapping rounds are the rule.
    assert!(deadlocks >= 1, "no crossing call was ever refused in 10 rounds");
    sim.phase("liveness");
    sim.heal().await;
    sim.read_back(&[&x, &y]).await;
    sim.finish().await;
}

/// Goal: across two nodes and over the transport, a chain that would revisit a probe is
/// refused by admission with `CycleDetected` before anything is sent, and no turn ever
/// runs inside its own chain. Method: random chains of 2-6 hops over 4 probes on 2
/// nodes; the model expects a refusal exactly when a probe repeats.
#[madsim::test]
async fn chains_that_revisit_an_actor_are_refused_across_nodes() {
    let scenario = Scenario {
        test: TEST,
        name: "chains_that_revisit_an_actor_are_refused_across_nodes",
    };
    let mut sim = Sim::start(
        scenario,
        SimConfig {
            nodes: 2,
            ..SimConfig::default()
        },
    )
    .await;
    let mut keys = keys_on(1, 2, 2);
    keys.extend(keys_on(2, 2, 2));
    sim.phase("safety");
    for _ in 0..15 {
        let length = sim.rng().range(2, 6) as usize;
        let hops: Vec<String> = (0..length).map(|_| sim.rng().pick(&keys).clone()).collect();
        let first = hops[0].clone();
        let rest: Vec<&str> = hops[1..].iter().map(String::as_str).collect();
        let op = ProbeOp::chain(&rest, ProbeOp::Get, 1_000);
        let outcome = sim.request(&first, op, Duration::from_secs(2)).await;
        let repeats = (1..hops.len()).any(|i| hops[..i].contains(&hops[i]));
        if repeats {
            assert_eq!(outcome, Ok(ProbeReply::Refused(RefusalKind::Cycle)), "chain {hops:?}");
        } else {
            assert!(
                matches!(outcome, Ok(ProbeReply::Count(_))),
                "chain {hops:?}: {outcome:?}"
            );
        }
    }
    sim.phase("liveness");
    sim.heal().await;
    sim.finish().await;
}

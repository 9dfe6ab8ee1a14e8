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
use troupe_sim::{probe, Fault, ProbeOp, ProbeReply, RefusalKind, Scenario, Sim, SimConfig};

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

/// How long each crossing turn waits before it calls: longer than the spread of the two
/// requests' arrival times (link latency 1-10 ms over a warm connection), so both turns
/// are running before either calls.
const CROSSING_DELAY_MS: u64 = 20;

/// Goal: the wait-for graph catches what a call chain cannot: two independent requests,
/// X waiting on Y while Y waits on X. Method: on one node, probes X and Y each receive a
/// request whose turn waits 20-23 ms (both turns are then running), then calls the other;
/// ten rounds. In every round exactly one call is refused with `DeadlockDetected`
/// naming the cycle (the refused caller first and last), at once, and the other call
/// then completes: its callee's turn ends with the refusal and takes the queued call.
/// (WaitForGraphAcyclic would also catch a cycle that lived longer than 1 ms.)
#[madsim::test]
async fn crossing_calls_from_independent_requests_never_deadlock() {
    let scenario = Scenario {
        test: TEST,
        name: "crossing_calls_from_independent_requests_never_deadlock",
    };
    let mut sim = Sim::start(scenario, SimConfig::default()).await;
    let keys = keys_on(1, 1, 2);
    let (x, y) = (keys[0].clone(), keys[1].clone());
    let (x_id, y_id) = (probe(&x), probe(&y));
    // Warm the client's connection, so both requests of a round travel over it.
    sim.request(&x, ProbeOp::Get, Duration::from_millis(500))
        .await
        .expect("warm-up");
    sim.phase("safety");
    for round in 0..10 {
        // X calls Y, and Y (a separate request) calls X: each callee would call back.
        let crossing = |target: &str, delay_ms: u64| ProbeOp::Call {
            target: format!("probe/{target}"),
            op: Box::new(ProbeOp::Sleep {
                ms: 5,
                then: Box::new(ProbeOp::Get),
            }),
            timeout_ms: 500,
            delay_ms,
        };
        let dx = CROSSING_DELAY_MS + sim.rng().range(0, 4);
        let dy = CROSSING_DELAY_MS + sim.rng().range(0, 4);
        sim.spawn_request(&x, crossing(&y, dx), Duration::from_secs(1));
        sim.spawn_request(&y, crossing(&x, dy), Duration::from_secs(1));
        let outcomes = sim.drain().await;
        assert_eq!(outcomes.len(), 2, "round {round}: a request hung: {outcomes:?}");
        // Nothing ever adds: the call that completes reads a count of 0.
        let refused_x = Err(InvokeError::DeadlockDetected {
            cycle: vec![x_id.clone(), y_id.clone(), x_id.clone()],
        });
        let refused_y = Err(InvokeError::DeadlockDetected {
            cycle: vec![y_id.clone(), x_id.clone(), y_id.clone()],
        });
        let answered = Ok(ProbeReply::Count(0));
        assert!(
            (outcomes[0] == refused_x && outcomes[1] == answered)
                || (outcomes[0] == answered && outcomes[1] == refused_y),
            "round {round}: exactly one crossing call must be refused with the cycle and the \
             other answered; x -> y: {:?}, y -> x: {:?}",
            outcomes[0],
            outcomes[1]
        );
    }
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
            // Nothing ever adds: every chain reads a count of 0.
            assert_eq!(outcome, Ok(ProbeReply::Count(0)), "chain {hops:?}");
        }
    }
    sim.phase("liveness");
    sim.heal().await;
    sim.finish().await;
}

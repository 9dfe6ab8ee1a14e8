//! Timeouts under network delay: a call to a slow or far callee fails with `Timeout` by
//! its deadline, never later, and the late work is not committed.
//!
//! Faults: link latency (up to 80 ms), callee timeout (slow turns, slow models).
//! Invariants: all eight, in particular EveryCallResolves (by the deadline, 1 ms slack)
//! and DeadlineMonotone.
#![cfg(madsim)]

use std::sync::Arc;
use std::time::Duration;

use troupe_core::InvokeError;
use troupe_sim::agent::{AgentEvent, AgentSpec, CallOutcome, CallRecorder, ScriptRule, ScriptedLlm};
use troupe_sim::agents::AgentSetup;
use troupe_sim::serde_json::json;
use troupe_sim::workload::keys_on;
use troupe_sim::{Fault, ProbeOp, ProbeReply, Scenario, Sim, SimConfig};

const TEST: &str = "dst_timeout_under_delay";
/// The coordinator's `timeout_ms` for its call to the analyst.
const CALLEE_TIMEOUT_MS: u64 = 200;

/// Goal: under random link latency, a probe on node 1 calling a probe on node 2 whose
/// turn takes a random time gets the answer when the work fits in the timeout and
/// `Timeout` when it cannot; either way by the deadline. Method: 12 calls with 60 ms
/// timeouts and callee work of 0-120 ms; the callee's add is read back afterwards: a
/// timed-out add was cancelled at the callee's deadline and rolled back.
#[madsim::test]
async fn calls_to_slow_callees_time_out_by_their_deadline_under_latency() {
    let scenario = Scenario {
        test: TEST,
        name: "calls_to_slow_callees_time_out_by_their_deadline_under_latency",
    };
    let mut sim = Sim::start(
        scenario,
        SimConfig {
            nodes: 2,
            ..SimConfig::default()
        },
    )
    .await;
    let (caller, callee) = (keys_on(1, 2, 1).remove(0), keys_on(2, 2, 1).remove(0));
    // Warm both connections (client -> node 1, node 1 -> node 2) at the default latency:
    // the bound below is about a call over an open connection. A cold one also pays the
    // TCP connect and the transport's clock handshake (one round trip each). Either way
    // the callee's deadline is earlier than the caller's by the one-way transit of the
    // handshake's answer (at most 10 ms at madsim's default latency).
    let warm_up = ProbeOp::Call {
        target: format!("probe/{callee}"),
        op: Box::new(ProbeOp::Get),
        timeout_ms: 200,
        delay_ms: 0,
    };
    sim.request(&caller, warm_up, Duration::from_millis(500))
        .await
        .expect("warm-up");
    sim.phase("safety");
    let max_ms = sim.rng().range(5, 40);
    sim.inject(Fault::Latency { min_ms: 1, max_ms }).await;
    let (mut timeouts, mut answers) = (0, 0);
    for _ in 0..12 {
        let work_ms = sim.rng().range(0, 120);
        let op = ProbeOp::Call {
            target: format!("probe/{callee}"),
            op: Box::new(ProbeOp::Sleep {
                ms: work_ms,
                then: Box::new(ProbeOp::Add { amount: 1 }),
            }),
            timeout_ms: 60,
            delay_ms: 0,
        };
        match sim.request(&caller, op, Duration::from_millis(500)).await {
            Ok(ProbeReply::Count(_)) => {
                answers += 1;
                assert!(work_ms < 60, "{work_ms} ms of work answered within a 60 ms timeout");
            }
            Err(InvokeError::Timeout { .. }) => {
                timeouts += 1;
                // The request's transit (≤ max_ms), the work, then whichever is longer
                // of the reply's transit (≤ max_ms) and how much earlier the callee's
                // deadline is (≤ 10 ms, the warm-up handshake's answer transit): all
                // within work + 2 x max_ms + 10.
                assert!(
                    work_ms + 2 * max_ms + 10 > 60,
                    "{work_ms} ms of work at {max_ms} ms latency timed out"
                );
            }
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    assert_eq!(answers + timeouts, 12);
    sim.phase("liveness");
    sim.heal().await;
    sim.quiesce().await;
    // Each answered add counted; each timed-out add was rolled back (it may have
    // committed only if the callee finished before its own deadline: NoAckedStateLost
    // bounds the read between the acknowledged floor and everything sent).
    sim.read_back(&[&callee]).await;
    sim.finish().await;
}

/// Goal: a callee agent slower than the caller's `timeout_ms` yields a typed `Timeout`
/// tool result, and the caller answers anyway; one faster answers. Method: the analyst's
/// model takes a random 0-400 ms other than exactly 200 (a tie with the deadline could
/// go either way); the coordinator allows 200 ms. Both agents are on one node, so the
/// outcome is exactly `Timeout` above 200 ms and the answer below.
#[madsim::test]
async fn a_slow_callee_agent_yields_a_timeout_tool_result() {
    let scenario = Scenario {
        test: TEST,
        name: "a_slow_callee_agent_yields_a_timeout_tool_result",
    };
    let analyst_ms = match troupe_sim::SimRng::new().range(0, 399) {
        below if below < CALLEE_TIMEOUT_MS => below,
        above => above + 1,
    };
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("coordinator").on_user_containing("").call(
            "call_agent",
            json!({"agent_id": "analyst", "message": "{input}", "timeout_ms": CALLEE_TIMEOUT_MS}),
        ))
        .rule(ScriptRule::agent("coordinator").on_tool_result().reply("{tool_result}"))
        .rule(
            ScriptRule::agent("analyst")
                .reply("done")
                .latency(Duration::from_millis(analyst_ms)),
        );
    let recorder = CallRecorder::new();
    let setup = AgentSetup::new(
        Arc::new(llm),
        vec![AgentSpec::new("coordinator"), AgentSpec::new("analyst")],
    )
    .observer(Arc::new(recorder.clone()));
    let mut sim = Sim::start_with_agents(scenario, SimConfig::default(), setup).await;
    sim.phase("safety");
    let reply = sim
        .ask("coordinator", "question", Duration::from_secs(2))
        .await
        .expect("the coordinator answers");
    // The only call_agent: coordinator -> analyst.
    let call_outcome = recorder.events().into_iter().find_map(|event| match event {
        AgentEvent::CallFinished { outcome, .. } => Some(outcome),
        _ => None,
    });
    match call_outcome {
        Some(CallOutcome::Failed(InvokeError::Timeout { target, timeout_ms })) => {
            assert!(
                analyst_ms > CALLEE_TIMEOUT_MS,
                "a {analyst_ms} ms callee timed out at 200 ms"
            );
            assert_eq!((target.key(), timeout_ms), ("analyst", CALLEE_TIMEOUT_MS));
            assert_eq!(
                reply.text,
                "error: call_agent failed: call failed: invocation of agent/analyst timed out after 200 ms"
            );
        }
        Some(CallOutcome::Replied { .. }) => {
            assert!(
                analyst_ms < CALLEE_TIMEOUT_MS,
                "a {analyst_ms} ms callee answered within 200 ms"
            );
            assert_eq!(reply.text, "done");
        }
        other => panic!("unexpected call outcome {other:?}:\n{}", recorder.render_tree()),
    }
    sim.phase("liveness");
    sim.heal().await;
    sim.quiesce().await;
    sim.finish().await;
}

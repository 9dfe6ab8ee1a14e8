//! Abandoned calls: a caller that gives up cancels its callee, which commits nothing
//! (NoCommitAfterAbandon), across nodes too.
//!
//! Faults: the caller's node is killed while its call runs on another node; the
//! transport connection breaks, the callee's node drops the call, and the callee's turn
//! must be cancelled before it commits. Invariants: all of them, NoCommitAfterAbandon in
//! particular; a planted bug (turns ignore their caller) must be caught.
#![cfg(madsim)]

use std::time::Duration;

use troupe_sim::workload::keys_on;
use troupe_sim::{Event, Fault, ProbeOp, Scenario, Sim, SimConfig};

const TEST: &str = "dst_abandon";

/// Runs the scenario: probes on node 1 call slow probes on node 2 (sleep, then add);
/// node 1 is killed while the callees sleep. Returns the sim before it finishes, with
/// the callees' keys.
async fn kill_the_callers_node_mid_call(sim: &mut Sim) -> Vec<String> {
    let (callers, callees) = (keys_on(1, 2, 3), keys_on(2, 2, 3));
    // Warm every connection so the calls reach node 2 quickly.
    for (caller, callee) in callers.iter().zip(&callees) {
        let warm = ProbeOp::Call {
            target: format!("probe/{callee}"),
            op: Box::new(ProbeOp::Get),
            timeout_ms: 300,
            delay_ms: 0,
        };
        sim.request(caller, warm, Duration::from_millis(500))
            .await
            .expect("a warm-up call");
    }
    sim.phase("safety");
    let slow_ms = sim.rng().range(150, 250);
    for (caller, callee) in callers.iter().zip(&callees) {
        let op = ProbeOp::Call {
            target: format!("probe/{callee}"),
            op: Box::new(ProbeOp::Sleep {
                ms: slow_ms,
                then: Box::new(ProbeOp::Add { amount: 1 }),
            }),
            timeout_ms: 2_000,
            delay_ms: 0,
        };
        sim.spawn_request(caller, op, Duration::from_millis(3_000));
    }
    // Kill node 1 only once every call runs on node 2: a call still in flight when its
    // caller's node dies never reaches node 2, so there is nothing there to abandon.
    // Links take up to 10 ms a hop and activations load state, so a fixed delay raced
    // (seed 1795625953036839327 killed node 1 while the third call was on the wire).
    let mut waited_ms = 0;
    while callee_turns_started_on_node_2(sim) < callees.len() {
        assert!(
            waited_ms < CALLS_REACH_NODE_2_MAX_MS,
            "the calls did not all start on node 2 within {CALLS_REACH_NODE_2_MAX_MS} ms"
        );
        sim.advance(Duration::from_millis(1)).await;
        waited_ms += 1;
    }
    // The callees sleep at least 150 ms from their start, and they start within tens of
    // milliseconds of each other: killing within 10 ms of the last start leaves each of
    // them mid-sleep.
    let before_kill = sim.rng().range(0, 10);
    sim.advance(Duration::from_millis(before_kill)).await;
    sim.inject(Fault::KillNode(1)).await;
    // Well past the callees' sleep: a callee that ignored its caller would commit now.
    sim.advance(Duration::from_millis(300)).await;
    sim.inject(Fault::RestartNode(1)).await;
    let _ = sim.drain().await;
    sim.phase("liveness");
    sim.heal().await;
    callees
}

/// How long the calls may take to start on node 2, in milliseconds: two hops of at
/// most 10 ms each plus two activations, with room to spare.
const CALLS_REACH_NODE_2_MAX_MS: u64 = 200;

/// Turns started on node 2 at depth 1 (the callees') since the safety phase began.
fn callee_turns_started_on_node_2(sim: &Sim) -> usize {
    sim.trace()
        .events()
        .iter()
        .skip_while(|stamped| !matches!(&stamped.event, Event::Phase { name: "safety" }))
        .filter(|stamped| matches!(&stamped.event, Event::TurnStarted { node: 2, depth: 1, .. }))
        .count()
}

fn abandonments_on_node_2(sim: &Sim) -> usize {
    sim.trace()
        .events()
        .iter()
        .filter(|stamped| matches!(&stamped.event, Event::RequestAbandoned { node: 2, .. }))
        .count()
}

/// Goal: when the caller's node dies, the callees on the other node stop and commit
/// nothing. Method: three cross-node calls to probes that sleep 150–250 ms and then
/// add; node 1 is killed 0–10 ms after the last of them started on node 2. Node 2 must
/// see each call abandoned (the connection broke) and no callee may commit: every
/// callee still reads 0 afterwards.
#[madsim::test]
async fn a_callers_node_dying_cancels_its_calls_on_other_nodes_and_nothing_commits() {
    let scenario = Scenario {
        test: TEST,
        name: "a_callers_node_dying_cancels_its_calls_on_other_nodes_and_nothing_commits",
    };
    let mut sim = Sim::start(
        scenario,
        SimConfig {
            nodes: 2,
            ..SimConfig::default()
        },
    )
    .await;
    let callees = kill_the_callers_node_mid_call(&mut sim).await;
    assert_eq!(
        abandonments_on_node_2(&sim),
        callees.len(),
        "each cross-node call was abandoned on node 2"
    );
    let keys: Vec<&str> = callees.iter().map(String::as_str).collect();
    let counts = sim.read_back(&keys).await;
    assert!(
        counts.iter().all(|count| *count == 0),
        "no abandoned callee committed its add: {counts:?}"
    );
    sim.finish().await;
}

/// Goal: NoCommitAfterAbandon can fail. Method: the same scenario with the planted bug
/// (turns ignore that their caller gave up): the callees commit after node 2 saw their
/// calls abandoned, and the invariant must catch it.
#[madsim::test]
async fn a_callee_that_ignores_its_callers_death_is_caught_by_no_commit_after_abandon() {
    let scenario = Scenario {
        test: TEST,
        name: "a_callee_that_ignores_its_callers_death_is_caught_by_no_commit_after_abandon",
    };
    let config = SimConfig {
        nodes: 2,
        plant_commit_after_abandon: true,
        expect_violation: Some("NoCommitAfterAbandon"),
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    let _ = kill_the_callers_node_mid_call(&mut sim).await;
    sim.finish().await;
}

//! Calls under network partitions: symmetric, one-way, isolation and packet loss.
//! Calls across a cut fail by their deadline (`Timeout`, or `Unreachable` when a
//! connection cannot be opened); nothing hangs; after healing, everything works again.
//!
//! Faults: symmetric partition (client ↔ node, node ↔ node), one-way partition, node
//! isolation, packet loss, latency. Invariants: all eight, with no known issue tolerated.
//! A request held by a partition and delivered after its caller's deadline never runs
//! (the last scenario; this was a transport bug found by DST, see docs/dst.md).
#![cfg(madsim)]

use std::time::Duration;

use troupe_core::InvokeError;
use troupe_sim::workload::keys_on;
use troupe_sim::{Event, Fault, ProbeOp, ProbeReply, Scenario, Sim, SimConfig};

const TEST: &str = "dst_partition";

fn config() -> SimConfig {
    SimConfig {
        nodes: 2,
        ..SimConfig::default()
    }
}

fn failed_by_cut(outcome: &Result<ProbeReply, InvokeError>) -> bool {
    matches!(
        outcome,
        Err(InvokeError::Timeout { .. } | InvokeError::Unreachable { .. })
    )
}

/// Goal: while the client is cut off from node 2 (both ways), requests to node 2's
/// probes fail by their deadline and requests to node 1's still succeed; after the
/// heal both succeed. Method: a warm connection first (so the cut hits an open
/// connection), then requests at random moments during the cut.
#[madsim::test]
async fn a_symmetric_partition_fails_calls_across_it_by_their_deadline() {
    let scenario = Scenario {
        test: TEST,
        name: "a_symmetric_partition_fails_calls_across_it_by_their_deadline",
    };
    let mut sim = Sim::start(scenario, config()).await;
    let (near, far) = (keys_on(1, 2, 1).remove(0), keys_on(2, 2, 1).remove(0));
    let far_actor = format!("probe/{far}");
    sim.request(&far, ProbeOp::Add { amount: 1 }, Duration::from_millis(200))
        .await
        .expect("warm-up");
    sim.phase("safety");
    sim.inject(Fault::Partition(0, 2)).await;
    let far_turns_before = turns_of(&sim, &far_actor, None);
    for round in 0..4 {
        let far_outcome = sim
            .request(&far, ProbeOp::Add { amount: 1 }, Duration::from_millis(100))
            .await;
        assert!(failed_by_cut(&far_outcome), "across the cut: {far_outcome:?}");
        let near_outcome = sim
            .request(&near, ProbeOp::Add { amount: 1 }, Duration::from_millis(100))
            .await;
        assert_eq!(near_outcome, Ok(ProbeReply::Count(round + 1)), "beside the cut");
        let gap = sim.rng().range(1, 30);
        sim.advance(Duration::from_millis(gap)).await;
    }
    sim.phase("liveness");
    sim.heal().await;
    sim.quiesce().await;
    // None of the adds sent across the cut ran: each was delivered, if at all, after its
    // deadline, and refused unrun.
    assert_eq!(
        turns_of(&sim, &far_actor, None),
        far_turns_before,
        "an add sent across the cut ran"
    );
    let after = sim
        .request_until_ok(&far, ProbeOp::Add { amount: 1 }, Duration::from_secs(1), 20)
        .await;
    // The warm-up's add, and one per attempt that ran (the last one answered; an earlier
    // one may have run and lost its reply to the reconnecting link).
    let attempts_run = turns_of(&sim, &far_actor, None) - far_turns_before;
    assert!(attempts_run >= 1, "the answered attempt ran");
    assert_eq!(after, Ok(ProbeReply::Count(1 + attempts_run as u64)), "after the heal");
    assert_eq!(sim.read_back(&[&near, &far]).await, vec![4, 1 + attempts_run as u64]);
    sim.finish().await;
}

/// Goal: a one-way cut between the nodes. Calls from node 1 to node 2 cannot arrive;
/// calls from node 2 to node 1 arrive and run, but their replies cannot come back:
/// both fail by their deadline, and the second kind's effect may have happened
/// (NoAckedStateLost's model treats it as unknown). Method: cut node 1 → node 2 only,
/// then calls in both directions.
#[madsim::test]
async fn a_one_way_partition_fails_calls_both_ways_by_their_deadline() {
    let scenario = Scenario {
        test: TEST,
        name: "a_one_way_partition_fails_calls_both_ways_by_their_deadline",
    };
    let mut sim = Sim::start(scenario, config()).await;
    let (one, two) = (keys_on(1, 2, 1).remove(0), keys_on(2, 2, 1).remove(0));
    let (one_actor, two_actor) = (format!("probe/{one}"), format!("probe/{two}"));
    let call = |target: &str| ProbeOp::Call {
        target: format!("probe/{target}"),
        op: Box::new(ProbeOp::Add { amount: 1 }),
        timeout_ms: 80,
        delay_ms: 0,
    };
    // Warm both node-to-node connections.
    sim.request(&one, call(&two), Duration::from_millis(300))
        .await
        .expect("warm-up 1 -> 2");
    sim.request(&two, call(&one), Duration::from_millis(300))
        .await
        .expect("warm-up 2 -> 1");
    sim.phase("safety");
    sim.inject(Fault::OneWay { from: 1, to: 2 }).await;
    let called_turns_before = (turns_of(&sim, &one_actor, Some(1)), turns_of(&sim, &two_actor, Some(1)));
    for _ in 0..3 {
        let forward = sim.request(&one, call(&two), Duration::from_millis(300)).await;
        assert!(failed_by_cut(&forward), "1 -> 2 across a 1 -> 2 cut: {forward:?}");
        let backward = sim.request(&two, call(&one), Duration::from_millis(300)).await;
        assert!(
            failed_by_cut(&backward),
            "2 -> 1 whose replies cross the cut: {backward:?}"
        );
    }
    sim.phase("liveness");
    sim.heal().await;
    sim.quiesce().await;
    // Every call 2 -> 1 ran its add on node 1 (only its reply was lost); no call 1 -> 2
    // ran on node 2 (delivered, if at all, after its deadline, and refused unrun).
    let called_turns = (turns_of(&sim, &one_actor, Some(1)), turns_of(&sim, &two_actor, Some(1)));
    assert_eq!(
        (
            called_turns.0 - called_turns_before.0,
            called_turns.1 - called_turns_before.1
        ),
        (3, 0),
        "(called turns on node 1, called turns on node 2) during the cut"
    );
    let after = sim.request_until_ok(&one, call(&two), Duration::from_secs(1), 20).await;
    // The warm-up's add on node 2, and one per attempt that ran (the last one answered;
    // an earlier one may have run and lost its reply to the reconnecting link).
    let attempts_run = (turns_of(&sim, &two_actor, Some(1)) - called_turns.1) as u64;
    assert!(attempts_run >= 1, "the answered attempt ran");
    assert_eq!(after, Ok(ProbeReply::Count(1 + attempts_run)), "after the heal");
    // Node 1's probe: the warm-up's add and the three adds whose replies were lost.
    assert_eq!(sim.read_back(&[&one, &two]).await, vec![4, 1 + attempts_run]);
    sim.finish().await;
}

/// Goal: heavy packet loss on real TCP (madsim retransmits lost packets with a backoff
/// from 1 ms, as TCP does) makes calls slow enough to miss short deadlines, which they
/// do as `Timeout`/`Unreachable` by the deadline; after healing they succeed. Method:
/// 90% loss, ten requests with 50 ms timeouts (each needs several packets through; all
/// ten succeeding has a probability below 1e-7), then a heal.
#[madsim::test]
async fn heavy_packet_loss_makes_calls_miss_their_deadlines_and_healing_restores_them() {
    let scenario = Scenario {
        test: TEST,
        name: "heavy_packet_loss_makes_calls_miss_their_deadlines_and_healing_restores_them",
    };
    let mut sim = Sim::start(scenario, config()).await;
    let key = keys_on(1, 2, 1).remove(0);
    sim.request(&key, ProbeOp::Get, Duration::from_millis(200))
        .await
        .expect("warm-up");
    sim.phase("safety");
    sim.inject(Fault::PacketLoss { percent: 90 }).await;
    let mut missed = 0;
    for _ in 0..10 {
        let outcome = sim
            .request(&key, ProbeOp::Add { amount: 1 }, Duration::from_millis(50))
            .await;
        match outcome {
            Ok(ProbeReply::Count(_)) => {}
            ref failed if failed_by_cut(failed) => missed += 1,
            other => panic!("unexpected outcome under loss: {other:?}"),
        }
    }
    assert!(missed >= 1, "90% packet loss never made a 50 ms call miss its deadline");
    sim.phase("liveness");
    sim.heal().await;
    sim.quiesce().await;
    let after = sim
        .request_until_ok(&key, ProbeOp::Add { amount: 1 }, Duration::from_secs(1), 20)
        .await;
    assert!(matches!(after, Ok(ProbeReply::Count(_))), "after the heal: {after:?}");
    sim.read_back(&[&key]).await;
    sim.finish().await;
}

/// Goal: random isolation, partitions and packet loss during a steady workload: every
/// request resolves by its deadline, and once healed every probe is reachable and reads
/// at least what was acknowledged. Method: the standard workload with network faults
/// only, at a high fault rate. (The effect of each network fault is shown by the
/// scenarios above; this one is about composing them.)
#[madsim::test]
async fn random_partitions_isolation_and_loss_never_hang_a_call() {
    use troupe_sim::workload::{run_standard, FaultMix, Standard};
    let scenario = Scenario {
        test: TEST,
        name: "random_partitions_isolation_and_loss_never_hang_a_call",
    };
    let mut sim = Sim::start(scenario, config()).await;
    let faults = FaultMix {
        network: true,
        ..FaultMix::default()
    };
    run_standard(
        &mut sim,
        Standard {
            faults,
            fault_percent: 12,
            ..Standard::default()
        },
    )
    .await;
    sim.finish().await;
}

/// Goal: a request held up by a partition and delivered after its caller's deadline
/// never runs (DeadlineMonotone, "expired work never runs"): the caller fails by its
/// deadline, the host refuses the late request unrun, and no turn of the target runs
/// until the next request. Regression test for the transport's late-delivery bug
/// (docs/dst.md, "Known issues"): the transport used to rebuild the deadline as
/// arrival + remaining, and this request ran with its whole budget after the heal.
/// Method: a warm connection, a cut, a request with a short deadline, a random hold of
/// 50-500 ms, the heal; then count the target's turns in the trace.
#[madsim::test]
async fn a_request_delivered_after_a_partition_runs_no_longer_than_its_callers_deadline() {
    let scenario = Scenario {
        test: TEST,
        name: "a_request_delivered_after_a_partition_runs_no_longer_than_its_callers_deadline",
    };
    let mut sim = Sim::start(scenario, config()).await;
    let far = keys_on(2, 2, 1).remove(0);
    let far_actor = format!("probe/{far}");
    sim.request(&far, ProbeOp::Get, Duration::from_millis(200))
        .await
        .expect("warm-up");
    sim.phase("safety");
    sim.inject(Fault::Partition(0, 2)).await;
    let turns_before = turns_of(&sim, &far_actor, None);
    let cut = sim
        .request(&far, ProbeOp::Add { amount: 1 }, Duration::from_millis(100))
        .await;
    assert!(failed_by_cut(&cut), "{cut:?}");
    let held = sim.rng().range(50, 500);
    sim.advance(Duration::from_millis(held)).await;
    sim.phase("liveness");
    sim.heal().await;
    sim.quiesce().await;
    assert_eq!(
        turns_of(&sim, &far_actor, None),
        turns_before,
        "the request delivered after its deadline ran"
    );
    sim.read_back(&[&far]).await;
    let report = sim.finish().await;
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    assert!(report.tolerated.is_empty(), "{:?}", report.tolerated);
}

/// Turns of `actor` started so far (at call depth `depth` only, if given), from the trace.
fn turns_of(sim: &Sim, actor: &str, depth: Option<u32>) -> usize {
    sim.trace()
        .events()
        .iter()
        .filter(|e| {
            matches!(&e.event, Event::TurnStarted { actor: a, depth: d, .. }
                if a == actor && depth.is_none_or(|depth| depth == *d))
        })
        .count()
}

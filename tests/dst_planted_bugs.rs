//! Proof that the invariants can fail: each test plants one bug through a test-only
//! switch of `troupe-sim` (never in production code) and asserts that the matching
//! invariant catches it, on every seed.
//!
//! | planted bug (switch)                                   | caught by            |
//! |--------------------------------------------------------|----------------------|
//! | placement ignores the directory (`Placement::BugSplitBrain`) | SingleActivation |
//! | admission skips the depth check (`AdmissionMode::BugSkipDepthCheck`) | DepthBounded |
//! | admission skips the chain check (`AdmissionMode::BugSkipChainCheck`) | NoCycleInCallChain |
//! | calls bypass the wait-for graph (`AdmissionMode::BugNoWaitForEdge`) | WaitForGraphAcyclic |
//! | the callee gets a fresh budget (`AdmissionMode::BugDeadlineGrows`) | DeadlineMonotone |
//! | the client retries past its deadline (`ClientMode::BugRetryIgnoresDeadline`) | EveryCallResolves |
//! | the store acks before persisting (`StoreMode::BugAckBeforeFlush`) | NoAckedStateLost |
//! | a turn's commit is split (`StoreMode::BugSplitCommit`) | TurnWritesAtomic |
//!
//! Each run prints its report line with the violation found (`--nocapture` shows it).
#![cfg(madsim)]

use std::time::Duration;

use troupe_core::InvokeError;
use troupe_sim::workload::keys_on;
use troupe_sim::{
    probe, AdmissionMode, ClientMode, Disk, Event, Fault, Placement, ProbeOp, ProbeReply, Report, Scenario, Sim,
    SimConfig, StoreMode,
};

const TEST: &str = "dst_planted_bugs";

fn caught(report: &Report, invariant: &str) {
    let violation = report.violations.iter().find(|v| v.invariant == invariant);
    assert!(
        violation.is_some(),
        "{invariant} missed the planted bug: {:?}",
        report.violations
    );
}

/// Two nodes share a database, and the client sends each request to a random node, as
/// a placement that ignores the directory would: both nodes activate the same probe.
#[madsim::test]
async fn split_brain_placement_is_caught_by_single_activation() {
    let scenario = Scenario {
        test: TEST,
        name: "split_brain_placement_is_caught_by_single_activation",
    };
    let config = SimConfig {
        nodes: 2,
        disk: Disk::Shared,
        placement: Placement::BugSplitBrain,
        idle_timeout: Duration::from_secs(10),
        expect_violation: Some("SingleActivation"),
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    sim.phase("safety");
    // 20 random placements of one actor: both nodes are hit with probability 1 - 2^-19.
    for _ in 0..20 {
        let outcome = sim
            .request("shared", ProbeOp::Add { amount: 1 }, Duration::from_millis(200))
            .await;
        // Both activations answer (from whatever count each holds): the bug is silent
        // to the client.
        assert!(matches!(outcome, Ok(ProbeReply::Count(_))), "{outcome:?}");
        if !sim.violations().is_empty() {
            break;
        }
    }
    let report = sim.finish().await;
    caught(&report, "SingleActivation");
}

/// Admission that lets a call through at depth 5: a chain of seven probes runs a turn at
/// depth 6.
#[madsim::test]
async fn skipping_the_depth_check_is_caught_by_depth_bounded() {
    let scenario = Scenario {
        test: TEST,
        name: "skipping_the_depth_check_is_caught_by_depth_bounded",
    };
    let config = SimConfig {
        nodes: 2,
        admission: AdmissionMode::BugSkipDepthCheck,
        expect_violation: Some("DepthBounded"),
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    let keys: Vec<String> = keys_on(1, 2, 4).into_iter().chain(keys_on(2, 2, 4)).collect();
    let hops: Vec<&str> = keys[1..8].iter().map(String::as_str).collect();
    sim.phase("safety");
    let outcome = sim
        .request(
            &keys[0],
            ProbeOp::chain(&hops, ProbeOp::Get, 2_000),
            Duration::from_secs(5),
        )
        .await;
    // The bug took effect: the seven-hop chain ran to its end (nothing ever adds).
    assert_eq!(outcome, Ok(ProbeReply::Count(0)));
    let report = sim.finish().await;
    caught(&report, "DepthBounded");
}

/// Admission that ignores the chain: A → B → A is admitted (across nodes, where no
/// dispatcher sees both edges).
#[madsim::test]
async fn skipping_the_chain_check_is_caught_by_no_cycle_in_call_chain() {
    let scenario = Scenario {
        test: TEST,
        name: "skipping_the_chain_check_is_caught_by_no_cycle_in_call_chain",
    };
    let config = SimConfig {
        nodes: 2,
        admission: AdmissionMode::BugSkipChainCheck,
        expect_violation: Some("NoCycleInCallChain"),
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    let (a, b) = (keys_on(1, 2, 1).remove(0), keys_on(2, 2, 1).remove(0));
    sim.phase("safety");
    let outcome = sim
        .request(&a, ProbeOp::chain(&[&b, &a], ProbeOp::Get, 300), Duration::from_secs(1))
        .await;
    // The bug took effect: B's call back into A (busy waiting on B) was admitted, and
    // the cycle lasted until one of the two calls timed out (whichever deadline came
    // first after the transport's clock adjustments).
    assert!(
        matches!(&outcome, Err(InvokeError::Timeout { target, .. }) if *target == probe(&a) || *target == probe(&b)),
        "{outcome:?}"
    );
    let report = sim.finish().await;
    caught(&report, "NoCycleInCallChain");
}

/// Calls sent as root invocations, so the dispatcher records no wait-for edge: two
/// independent requests, X calling Y while Y calls X, deadlock until their timeouts.
#[madsim::test]
async fn bypassing_the_wait_for_graph_is_caught_by_wait_for_graph_acyclic() {
    let scenario = Scenario {
        test: TEST,
        name: "bypassing_the_wait_for_graph_is_caught_by_wait_for_graph_acyclic",
    };
    let config = SimConfig {
        admission: AdmissionMode::BugNoWaitForEdge,
        expect_violation: Some("WaitForGraphAcyclic"),
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    let crossing = |target: &str| ProbeOp::Call {
        target: format!("probe/{target}"),
        op: Box::new(ProbeOp::Get),
        timeout_ms: 200,
        // Longer than the spread of arrival times (link latency 1-10 ms): both turns
        // are running before either calls.
        delay_ms: 20,
    };
    sim.phase("safety");
    sim.spawn_request("x", crossing("y"), Duration::from_secs(1));
    sim.spawn_request("y", crossing("x"), Duration::from_secs(1));
    let outcomes = sim.drain().await;
    // The bug took effect: neither call was refused; the cycle lasted until the earlier
    // call timed out. The later one then either ran (its callee's turn had ended) or had
    // timed out too (when the two calls were almost simultaneous).
    assert_eq!(outcomes.len(), 2, "{outcomes:?}");
    let timed_out = |outcome: &troupe_sim::Outcome, callee: &str| matches!(outcome, Err(InvokeError::Timeout { target, .. }) if target.key() == callee);
    assert!(
        (timed_out(&outcomes[0], "y") && (timed_out(&outcomes[1], "x") || outcomes[1] == Ok(ProbeReply::Count(0))))
            || (timed_out(&outcomes[1], "x") && outcomes[0] == Ok(ProbeReply::Count(0))),
        "{outcomes:?}"
    );
    let report = sim.finish().await;
    caught(&report, "WaitForGraphAcyclic");
}

/// A callee context rebuilt with a fresh 60 s budget instead of the caller's remaining
/// time.
#[madsim::test]
async fn a_growing_deadline_is_caught_by_deadline_monotone() {
    let scenario = Scenario {
        test: TEST,
        name: "a_growing_deadline_is_caught_by_deadline_monotone",
    };
    let config = SimConfig {
        admission: AdmissionMode::BugDeadlineGrows,
        expect_violation: Some("DeadlineMonotone"),
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    sim.phase("safety");
    let outcome = sim
        .request(
            "caller",
            ProbeOp::chain(&["callee"], ProbeOp::Get, 100),
            Duration::from_millis(500),
        )
        .await;
    // The bug does not change the answer (nothing ever adds); only the callee's budget.
    assert_eq!(outcome, Ok(ProbeReply::Count(0)));
    let report = sim.finish().await;
    caught(&report, "DeadlineMonotone");
}

/// A client that retries a transient failure with a fresh budget, ignoring its
/// deadline: while the node is down, its request resolves long after the deadline.
#[madsim::test]
async fn retrying_past_the_deadline_is_caught_by_every_call_resolves() {
    let scenario = Scenario {
        test: TEST,
        name: "retrying_past_the_deadline_is_caught_by_every_call_resolves",
    };
    let config = SimConfig {
        client: ClientMode::BugRetryIgnoresDeadline,
        expect_violation: Some("EveryCallResolves"),
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    sim.phase("safety");
    sim.inject(Fault::KillNode(1)).await;
    sim.spawn_request("patient", ProbeOp::Add { amount: 1 }, Duration::from_millis(50));
    let down = sim.rng().range(100, 400);
    sim.advance(Duration::from_millis(down)).await;
    sim.phase("liveness");
    sim.heal().await;
    sim.drain().await;
    let report = sim.finish().await;
    caught(&report, "EveryCallResolves");
}

/// A store that acknowledges a commit before it is durable (a lazy writer flushes every
/// 50 ms): a crash after an acknowledged add loses it.
#[madsim::test]
async fn acking_before_persisting_is_caught_by_no_acked_state_lost() {
    let scenario = Scenario {
        test: TEST,
        name: "acking_before_persisting_is_caught_by_no_acked_state_lost",
    };
    let config = SimConfig {
        store: StoreMode::BugAckBeforeFlush { flush_every_ms: 50 },
        expect_violation: Some("NoAckedStateLost"),
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    sim.inject(Fault::Latency { min_ms: 1, max_ms: 2 }).await;
    sim.phase("safety");
    // Within one flush period: acknowledged, not yet durable.
    sim.advance(Duration::from_millis(55)).await;
    let amount = sim.rng().range(1, 10);
    sim.request("ledger", ProbeOp::Add { amount }, Duration::from_millis(20))
        .await
        .expect("acknowledged");
    sim.inject(Fault::CrashNode(1)).await;
    sim.inject(Fault::RestartNode(1)).await;
    sim.phase("liveness");
    sim.heal().await;
    sim.read_back(&["ledger"]).await;
    let report = sim.finish().await;
    caught(&report, "NoAckedStateLost");
}

/// A store that applies a turn's writes one by one, 1 ms apart: a node killed in the
/// middle of a batch's commit leaves part of it on the disk.
#[madsim::test]
async fn a_split_commit_is_caught_by_turn_writes_atomic() {
    let scenario = Scenario {
        test: TEST,
        name: "a_split_commit_is_caught_by_turn_writes_atomic",
    };
    let config = SimConfig {
        store: StoreMode::BugSplitCommit,
        expect_violation: Some("TurnWritesAtomic"),
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    sim.inject(Fault::Latency { min_ms: 1, max_ms: 2 }).await;
    sim.phase("safety");
    let keys = sim.rng().range(6, 10) as u32;
    sim.spawn_request(
        "books",
        ProbeOp::Batch { keys, fail_after: None },
        Duration::from_secs(1),
    );
    // Wait for the batch's turn to start; its commit then takes `keys` ms: kill in the
    // middle of it.
    let started = |sim: &Sim| {
        sim.trace()
            .events()
            .iter()
            .any(|e| matches!(&e.event, Event::TurnEnded { actor, .. } if actor == "probe/books"))
    };
    while !started(&sim) {
        sim.advance(Duration::from_micros(100)).await;
    }
    sim.advance(Duration::from_micros(2_500)).await;
    sim.inject(Fault::KillNode(1)).await;
    sim.inject(Fault::RestartNode(1)).await;
    sim.drain().await;
    sim.phase("liveness");
    sim.heal().await;
    sim.audit(&["books"]).await;
    let report = sim.finish().await;
    caught(&report, "TurnWritesAtomic");
}

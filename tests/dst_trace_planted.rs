//! A planted runtime bug that every DST invariant misses and trace validation catches.
//!
//! The bug (`SimConfig::plant_commit_failed_turn`, the runtime's
//! `plant_bug_commit_failed_turn` under the `planted-bugs` feature): a turn whose handler
//! returned an error still commits, then answers with the error. Here the failing turns
//! are rejections that change nothing, so no read, audit or ack shows a difference: the
//! run passes all nine invariants (asserted exactly below). Its trace, checked against
//! `docs/tla/TraceCallPath.tla` by `scripts/trace-check`, is refused: the model commits
//! only a turn whose handler succeeded (`TurnEnded ok` before `TurnCommitting`).
//!
//! The same scenario without the bug is one of the traces `scripts/trace-check` accepts.
#![cfg(madsim)]

use std::time::Duration;

use troupe_core::InvokeError;
use troupe_sim::{ProbeOp, ProbeReply, Scenario, Sim, SimConfig};

const TEST: &str = "dst_trace_planted";

async fn add_reject_call_get(sim: &mut Sim) {
    sim.phase("safety");
    let timeout = Duration::from_millis(500);
    let added = sim.request("a", ProbeOp::Add { amount: 1 }, timeout).await;
    assert!(matches!(added, Ok(ProbeReply::Count(1))), "{added:?}");
    let rejected = sim.request("a", ProbeOp::Reject, timeout).await;
    assert!(matches!(rejected, Err(InvokeError::Rejected { .. })), "{rejected:?}");
    // a calls b, b rejects: the call fails, so a's turn fails too.
    let called = sim
        .request("a", ProbeOp::chain(&["b"], ProbeOp::Reject, 300), timeout)
        .await;
    assert!(matches!(called, Err(InvokeError::Rejected { .. })), "{called:?}");
    let read = sim.request("a", ProbeOp::Get, timeout).await;
    assert!(matches!(read, Ok(ProbeReply::Count(1))), "{read:?}");
    sim.phase("liveness");
    sim.heal().await;
}

/// Goal: the honest runtime's trace of adds, rejections and a rejected call, for trace
/// validation to accept. Method: the requests in order; every reply is what it must be.
#[madsim::test]
async fn rejected_turns_commit_nothing() {
    let scenario = Scenario {
        test: TEST,
        name: "rejected_turns_commit_nothing",
    };
    let mut sim = Sim::start(scenario, SimConfig::default()).await;
    add_reject_call_get(&mut sim).await;
    let report = sim.finish().await;
    assert_eq!(report.violations, Vec::new());
}

/// Goal: a bug the invariants miss. Method: the same requests with failed turns
/// committing: every reply is still what it must be and no invariant is violated
/// (asserted); `scripts/trace-check` must refuse the trace.
#[madsim::test]
async fn committing_a_rejected_turn_passes_every_invariant() {
    let scenario = Scenario {
        test: TEST,
        name: "committing_a_rejected_turn_passes_every_invariant",
    };
    let config = SimConfig {
        plant_commit_failed_turn: true,
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    add_reject_call_get(&mut sim).await;
    let report = sim.finish().await;
    assert_eq!(report.violations, Vec::new());
}

//! The randomized workload mixing every fault: the standard scenario.
//!
//! Goal: under any interleaving the seed picks, every invariant holds. Method: probes on
//! two nodes receive random adds, gets, atomic batches, calls, chains (some cyclic or
//! too deep), slow, failing and rejecting turns and calls to unknown kinds, while nodes
//! are killed (memory lost) and crashed (unflushed disk writes lost) and storage fails;
//! then everything heals and all pending work must finish, every probe must read back
//! at least what was acknowledged and its batches must be whole.
//!
//! Faults: symmetric and one-way partitions, node isolation, latency, packet loss, node
//! kill/restart, disk crash with lost unflushed writes, commit/load/read failures,
//! callee timeout, callee rejects, agent (kind) not found, cycle, depth.
//! Invariants: all eight (`troupe_sim::Invariants::all`).
#![cfg(madsim)]

use std::time::Duration;

use troupe_sim::workload::{run_standard, FaultMix, Standard};
use troupe_sim::{Scenario, Sim, SimConfig, StoreMode};

const TEST: &str = "dst_random_workload";

/// The standard scenario: the one the seed sweep's speed target is measured on.
#[madsim::test]
async fn random_workload_with_every_fault_keeps_every_invariant() {
    let scenario = Scenario {
        test: TEST,
        name: "random_workload_with_every_fault_keeps_every_invariant",
    };
    let config = SimConfig {
        nodes: 2,
        store: StoreMode::Fsync { latency_ms: 2 },
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    run_standard(
        &mut sim,
        Standard {
            faults: FaultMix::all(),
            ..Standard::default()
        },
    )
    .await;
    sim.finish().await;
}

/// The same workload with no faults: a baseline where every request that is not
/// refused by design must succeed.
#[madsim::test]
async fn random_workload_without_faults_keeps_every_invariant() {
    let scenario = Scenario {
        test: TEST,
        name: "random_workload_without_faults_keeps_every_invariant",
    };
    let mut sim = Sim::start(
        scenario,
        SimConfig {
            nodes: 2,
            ..SimConfig::default()
        },
    )
    .await;
    run_standard(
        &mut sim,
        Standard {
            safety: Duration::from_millis(200),
            ..Standard::default()
        },
    )
    .await;
    sim.finish().await;
}

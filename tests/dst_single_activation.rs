//! Single activation during cross calls: probes on two nodes call each other across the
//! transport while idle deactivation churns their activations and nodes are killed and
//! restarted; no actor ever has two live activations.
//!
//! Faults: node kill and restart, idle deactivation racing new calls (a 5 ms idle
//! timeout), link latency. Invariants: all eight, in particular SingleActivation,
//! checked from every real `on_activate`/`on_deactivate` across both nodes.
#![cfg(madsim)]

use std::time::Duration;

use troupe_sim::workload::{keys_on, run_standard, FaultMix, Standard};
use troupe_sim::{Event, ProbeOp, Scenario, Sim, SimConfig};

const TEST: &str = "dst_single_activation";

/// Goal and method: see the module documentation. Each probe must have been activated
/// several times (the churn is real), and never twice at once.
#[madsim::test]
async fn cross_calls_with_activation_churn_and_kills_never_activate_an_actor_twice() {
    let scenario = Scenario {
        test: TEST,
        name: "cross_calls_with_activation_churn_and_kills_never_activate_an_actor_twice",
    };
    let config = SimConfig {
        nodes: 2,
        idle_timeout: Duration::from_millis(5),
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    let mut keys = keys_on(1, 2, 2);
    keys.extend(keys_on(2, 2, 2));
    sim.phase("safety");
    for _ in 0..40 {
        let (from, to) = (sim.rng().pick(&keys).clone(), sim.rng().pick(&keys).clone());
        let op = ProbeOp::Call {
            target: format!("probe/{to}"),
            op: Box::new(ProbeOp::Add { amount: 1 }),
            timeout_ms: 100,
            delay_ms: sim.rng().range(0, 3),
        };
        sim.spawn_request(&from, op, Duration::from_millis(200));
        if sim.rng().chance(5) {
            let node = sim.rng().range(1, 3) as u32;
            sim.inject(troupe_sim::Fault::KillNode(node)).await;
            let down = sim.rng().range(1, 20);
            sim.advance(Duration::from_millis(down)).await;
            sim.inject(troupe_sim::Fault::RestartNode(node)).await;
        }
        let gap = sim.rng().range(0, 12);
        sim.advance(Duration::from_millis(gap)).await;
    }
    sim.phase("liveness");
    sim.heal().await;
    sim.drain().await;
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    sim.read_back(&key_refs).await;
    let activations = sim
        .trace()
        .events()
        .iter()
        .filter(|e| matches!(e.event, Event::Activated { .. }))
        .count();
    assert!(
        activations > keys.len(),
        "only {activations} activations: the churn did not happen"
    );
    sim.finish().await;
}

/// Goal: the same with the standard random workload and every node fault, on three
/// nodes.
#[madsim::test]
async fn random_workload_on_three_nodes_with_kills_keeps_single_activation() {
    let scenario = Scenario {
        test: TEST,
        name: "random_workload_on_three_nodes_with_kills_keeps_single_activation",
    };
    let config = SimConfig {
        nodes: 3,
        idle_timeout: Duration::from_millis(5),
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    let faults = FaultMix {
        kills: true,
        ..FaultMix::default()
    };
    run_standard(
        &mut sim,
        Standard {
            actors: 6,
            faults,
            fault_percent: 6,
            ..Standard::default()
        },
    )
    .await;
    sim.finish().await;
}

//! Determinism of a multi-agent run: one seed, run twice, gives the same trace hash
//! (every event with its virtual time), and another seed gives a different one.
//!
//! madsim's own check (`MADSIM_TEST_CHECK_DETERMINISM`, run by `scripts/dst
//! --check-determinism` on every scenario) compares every random draw; this test
//! compares what the system did.
#![cfg(madsim)]

use std::sync::Arc;
use std::time::Duration;

use troupe_sim::agent::{AgentSpec, ScriptRule, ScriptedLlm};
use troupe_sim::agents::AgentSetup;
use troupe_sim::serde_json::json;
use troupe_sim::workload::{run_standard, FaultMix, Standard};
use troupe_sim::{Fault, Scenario, Sim, SimConfig};

const TEST: &str = "dst_determinism";

/// A multi-agent run: three agents calling each other with random model latency and
/// failures, probes under the standard workload with every fault, on two nodes.
async fn multi_agent_run() -> u64 {
    let scenario = Scenario {
        test: TEST,
        name: "one_seed_run_twice_gives_the_same_trace_hash",
    };
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("lead")
                .on_user_containing("")
                .call("call_agent", json!({"agent_id": "left", "message": "{input}"}))
                .call("call_agent", json!({"agent_id": "right", "message": "{input}"})),
        )
        .rule(ScriptRule::agent("lead").on_tool_result().reply("lead: {tool_result}"))
        .rule(
            ScriptRule::agent("left")
                .on_user_containing("")
                .call("lookup", json!({"key": "left"})),
        )
        .rule(ScriptRule::agent("left").on_tool_result().reply("{tool_result}"))
        .rule(ScriptRule::agent("right").reply("right"));
    let agents = vec![AgentSpec::new("lead"), AgentSpec::new("left"), AgentSpec::new("right")];
    let config = SimConfig {
        nodes: 2,
        ..SimConfig::default()
    };
    let mut sim = Sim::start_with_agents(scenario, config, AgentSetup::new(Arc::new(llm), agents)).await;
    for index in 0..6 {
        let ms = sim.rng().range(0, 40);
        sim.inject(Fault::LlmLatency { ms }).await;
        if sim.rng().chance(30) {
            sim.inject(Fault::LlmFail { count: 1 }).await;
        }
        sim.spawn_ask("lead", &format!("question {index}"), Duration::from_millis(500));
    }
    run_standard(
        &mut sim,
        Standard {
            faults: FaultMix::all(),
            ..Standard::default()
        },
    )
    .await;
    sim.drain_asks().await;
    sim.finish().await.trace_hash
}

// A madsim runtime must be built on a fresh OS thread (it owns thread-local state);
// this is test code, outside the simulated world.
// A failed run names its own seed in the harness's report; for the second seed of a
// pair (`seed ^ 0x5eed`) that is not a seed of the swept range, so the panic here names
// the range's seed last: `scripts/dst` resumes after the last `MADSIM_TEST_SEED=` it finds.
#[allow(clippy::disallowed_methods)]
fn run_seed(seed: u64, swept: u64) -> u64 {
    std::thread::spawn(move || {
        let runtime = madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default());
        runtime.block_on(multi_agent_run())
    })
    .join()
    .unwrap_or_else(|_| {
        panic!(
            "the simulated run of seed {seed} panicked (the pair of swept seed {swept}); \
             replay: MADSIM_TEST_SEED={swept} bash scripts/dst --replay {TEST}::one_seed_run_twice_gives_the_same_trace_hash"
        )
    })
}

/// Goal and method: see the module documentation. The seed is `MADSIM_TEST_SEED` if
/// set (so the sweep covers many), else 1.
#[test]
fn one_seed_run_twice_gives_the_same_trace_hash() {
    let seed = std::env::var("MADSIM_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let count: u64 = std::env::var("MADSIM_TEST_NUM")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    for seed in seed..seed + count {
        let (first, second) = (run_seed(seed, seed), run_seed(seed, seed));
        assert_eq!(
            first, second,
            "seed {seed} is not deterministic: trace hashes {first:016x} and {second:016x} differ\n\
             replay: MADSIM_TEST_SEED={seed} bash scripts/dst --replay {TEST}::one_seed_run_twice_gives_the_same_trace_hash"
        );
        let other = run_seed(seed ^ 0x5eed, seed);
        assert_ne!(
            first,
            other,
            "seeds {seed} and {} gave the same trace: the hash ignores the seed",
            seed ^ 0x5eed
        );
    }
}

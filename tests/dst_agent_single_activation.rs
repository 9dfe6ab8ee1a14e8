//! Single activation of agents under activation churn.
//!
//! Goal: an agent never has two live activations, while its activations churn: the
//! agent kind's idle timeout is 3 ms, so agents deactivate between asks and reactivate
//! on the next one, while many concurrent asks (from the client and from other agents'
//! `call_agent`) race each deactivation. SingleActivation reads the agent actor's real
//! `on_activate`/`on_deactivate` hooks (`AgentEvent::Activated`/`Deactivated`, mapped
//! to the trace's `Activated`/`Deactivated` by `TraceObserver`). Method: a safety phase
//! of bursts of concurrent asks to the same agents (coordinators that call workers,
//! and the workers directly) with random model latency and random gaps; a liveness phase
//! with everything healed in which every agent answers. The run asserts from the trace
//! that every agent was activated several times (the churn happened, the check is not
//! vacuous), and from the call recorder that every `call_agent` reported exactly one
//! end (`Cancelled` when its caller's turn was cut). A planted split brain (a second
//! agent system on the same store answering the same agent) must be caught.
//!
//! Faults: idle deactivation racing new asks (3 ms idle timeout), LLM latency, callee
//! timeouts and cut callers (client deadlines shorter than the work). Invariants: all
//! eight, in particular SingleActivation on agents.
#![cfg(madsim)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use troupe_runtime::KindConfig;
use troupe_sim::agent::{AgentEvent, AgentSpec, AgentSystem, CallRecorder, ScriptRule, ScriptedLlm};
use troupe_sim::agents::{AgentSetup, FaultyLlm, TraceObserver};
use troupe_sim::serde_json::json;
use troupe_sim::{Disk, Event, Fault, Scenario, Sim, SimConfig};

const TEST: &str = "dst_agent_single_activation";

/// The agents: coordinators call workers; workers answer.
const COORDINATORS: [&str; 2] = ["c0", "c1"];
const WORKERS: [&str; 2] = ["w0", "w1"];

fn script() -> ScriptedLlm {
    let mut llm = ScriptedLlm::new().without_recording();
    for coordinator in COORDINATORS {
        for worker in WORKERS {
            llm = llm.rule(
                ScriptRule::agent(coordinator)
                    .on_user_containing(format!("via {worker}"))
                    .call(
                        "call_agent",
                        json!({"agent_id": worker, "message": "{input}", "timeout_ms": 300}),
                    ),
            );
        }
        llm = llm.rule(
            ScriptRule::agent(coordinator)
                .on_tool_result()
                .reply("{agent} relays: {tool_result}"),
        );
    }
    for worker in WORKERS {
        llm = llm.rule(ScriptRule::agent(worker).reply("{agent} did it"));
    }
    llm
}

fn agents() -> Vec<AgentSpec> {
    COORDINATORS
        .iter()
        .map(|id| AgentSpec::new(*id).role("delegates to a worker"))
        .chain(WORKERS.iter().map(|id| AgentSpec::new(*id).role("does the work")))
        .collect()
}

fn config() -> SimConfig {
    SimConfig {
        idle_timeout: Duration::from_millis(3),
        mailbox_capacity: 16,
        ..SimConfig::default()
    }
}

/// Activations per agent (full id), from the trace.
fn activations(sim: &Sim) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for stamped in sim.trace().events() {
        if let Event::Activated { actor, .. } = &stamped.event {
            if actor.starts_with("agent/") {
                *counts.entry(actor.clone()).or_insert(0) += 1;
            }
        }
    }
    counts
}

/// Goal and method: see the module documentation.
#[madsim::test]
async fn agents_under_activation_churn_and_concurrent_asks_never_have_two_live_activations() {
    let scenario = Scenario {
        test: TEST,
        name: "agents_under_activation_churn_and_concurrent_asks_never_have_two_live_activations",
    };
    let recorder = CallRecorder::new();
    let setup = AgentSetup::new(Arc::new(script()), agents()).observer(Arc::new(recorder.clone()));
    let mut sim = Sim::start_with_agents(scenario, config(), setup).await;

    sim.phase("safety");
    for round in 0..30 {
        if sim.rng().chance(30) {
            let ms = sim.rng().range(0, 30);
            sim.inject(Fault::LlmLatency { ms }).await;
        }
        // A burst of concurrent asks to the same few agents: coordinators (which call a
        // worker) and the workers themselves, some with deadlines shorter than the work.
        let burst = sim.rng().range(1, 6);
        for ask in 0..burst {
            let timeout = Duration::from_millis(sim.rng().range(20, 400));
            if sim.rng().chance(50) {
                let coordinator = *sim.rng().pick(&COORDINATORS);
                let worker = *sim.rng().pick(&WORKERS);
                sim.spawn_ask(coordinator, &format!("via {worker} r{round}a{ask}"), timeout);
            } else {
                let worker = *sim.rng().pick(&WORKERS);
                sim.spawn_ask(worker, &format!("direct r{round}a{ask}"), timeout);
            }
            let stagger = sim.rng().range(0, 3);
            sim.advance(Duration::from_millis(stagger)).await;
        }
        // Gaps around the idle timeout: deactivations race the next burst.
        let gap = sim.rng().range(0, 15);
        sim.advance(Duration::from_millis(gap)).await;
    }
    sim.drain_asks().await;
    sim.quiesce().await;

    sim.phase("liveness");
    sim.heal().await;
    for (index, coordinator) in COORDINATORS.iter().enumerate() {
        let worker = WORKERS[index % WORKERS.len()];
        let reply = sim
            .ask(coordinator, &format!("via {worker} final"), Duration::from_secs(2))
            .await;
        let reply = reply.unwrap_or_else(|error| panic!("{coordinator} must answer after healing: {error}"));
        assert_eq!(reply.text, format!("{coordinator} relays: {worker} did it"));
    }
    for worker in WORKERS {
        let reply = sim.ask(worker, "direct final", Duration::from_secs(2)).await;
        assert_eq!(
            reply.expect("a worker answers after healing").text,
            format!("{worker} did it")
        );
    }
    // Idle: every agent deactivates.
    sim.advance(Duration::from_millis(50)).await;
    let names: Vec<&str> = COORDINATORS.iter().chain(WORKERS.iter()).copied().collect();
    sim.read_agent_logs(&names).await;

    // The churn happened: every agent was activated several times.
    let counts = activations(&sim);
    for name in &names {
        let count = counts.get(&format!("agent/{name}")).copied().unwrap_or(0);
        assert!(
            count >= 2,
            "agent {name} was activated {count} times: no churn ({counts:?})"
        );
    }
    // Every call_agent that started reported exactly one end.
    let events = recorder.events();
    let mut ends: BTreeMap<u64, usize> = BTreeMap::new();
    for event in &events {
        match event {
            AgentEvent::CallStarted {
                call, caller: Some(_), ..
            } => {
                ends.entry(*call).or_insert(0);
            }
            AgentEvent::CallFinished { call, .. } => {
                if let Some(count) = ends.get_mut(call) {
                    *count += 1;
                }
            }
            _ => {}
        }
    }
    assert!(!ends.is_empty(), "no agent called another");
    for (call, count) in &ends {
        assert_eq!(
            *count,
            1,
            "call_agent {call} reported {count} ends:\n{}",
            recorder.render_tree()
        );
    }
    sim.finish().await;
}

/// The node number the second, rogue agent system reports as (the cluster has one node).
const ROGUE_NODE: u32 = 2;

/// Planted bug (test-only, nothing in production code): a second agent system on the
/// same store, as a deployment whose placement ignores the directory would run, answers
/// the same agent while the real one's activation is live (its model is slow). Both
/// activations are live at once: SingleActivation must report it on every seed.
#[madsim::test]
async fn a_second_agent_system_answering_the_same_agent_is_caught_by_single_activation() {
    let scenario = Scenario {
        test: TEST,
        name: "a_second_agent_system_answering_the_same_agent_is_caught_by_single_activation",
    };
    let config = SimConfig {
        disk: Disk::Shared,
        expect_violation: Some("SingleActivation"),
        ..config()
    };
    let mut sim = Sim::start_with_agents(scenario, config, AgentSetup::new(Arc::new(script()), agents())).await;
    let mut rogue = AgentSystem::builder()
        .store(Arc::new(sim.cluster().disk(1)))
        .llm(Arc::new(FaultyLlm::new(Arc::new(script()), sim.llm_faults().clone())))
        .kind_config(KindConfig {
            idle_timeout: Duration::from_millis(3),
            ..KindConfig::default()
        })
        .observer(Arc::new(TraceObserver::new(ROGUE_NODE, sim.trace().clone())));
    for spec in agents() {
        rogue = rogue.agent(spec);
    }
    let rogue = rogue.start().expect("the rogue agent system starts");

    sim.phase("safety");
    sim.inject(Fault::LlmLatency { ms: 50 }).await;
    sim.spawn_ask("w0", "direct to the real system", Duration::from_secs(1));
    sim.advance(Duration::from_millis(10)).await;
    let rogue_answer = rogue
        .ask_with_timeout("w0", "direct to the rogue", Duration::from_secs(1))
        .await;
    assert_eq!(rogue_answer.map(|reply| reply.text), Ok("w0 did it".to_string()));
    sim.drain_asks().await;

    sim.phase("liveness");
    sim.heal().await;
    rogue.shutdown().await;
    sim.quiesce().await;
    sim.finish().await;
}

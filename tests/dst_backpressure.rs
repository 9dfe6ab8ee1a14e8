//! Backpressure under load: the bound is the mailbox. A full mailbox answers `Busy` at
//! once (no waiting for the busy actor), exactly the messages that fit are queued, and
//! every queued message still completes.
//!
//! Faults: agent busy (mailbox full), link latency. Invariants: all eight.
#![cfg(madsim)]

use std::sync::Arc;
use std::time::Duration;

use troupe_core::InvokeError;
use troupe_sim::agent::{AgentSpec, ScriptRule, ScriptedLlm};
use troupe_sim::agents::AgentSetup;
use troupe_sim::{Fault, ProbeOp, ProbeReply, Scenario, Sim, SimConfig};

const TEST: &str = "dst_backpressure";
const CAPACITY: usize = 2;

/// Goal: with a mailbox of 2, while one 100 ms turn runs, a burst of N adds gets exactly
/// 2 queued and N - 2 refused with `Busy`, each refusal long before the slow turn
/// ends, and the queued adds complete. Method: N drawn from the seed
/// (4-16), link latency 1-2 ms so the burst lands during the slow turn.
#[madsim::test]
async fn a_burst_beyond_the_mailbox_is_refused_busy_at_once_and_the_rest_completes() {
    let scenario = Scenario {
        test: TEST,
        name: "a_burst_beyond_the_mailbox_is_refused_busy_at_once_and_the_rest_completes",
    };
    let mut sim = Sim::start(
        scenario,
        SimConfig {
            mailbox_capacity: CAPACITY,
            ..SimConfig::default()
        },
    )
    .await;
    sim.inject(Fault::Latency { min_ms: 1, max_ms: 2 }).await;
    sim.phase("safety");
    let burst = sim.rng().range(4, 17) as usize;
    sim.spawn_request(
        "hot",
        ProbeOp::Sleep {
            ms: 100,
            then: Box::new(ProbeOp::Add { amount: 1 }),
        },
        Duration::from_secs(1),
    );
    sim.advance(Duration::from_millis(10)).await;
    let started = tokio::time::Instant::now();
    let client = sim.client();
    let mut burst_tasks = Vec::new();
    for _ in 0..burst {
        let client = client.clone();
        burst_tasks.push(tokio::spawn(async move {
            let outcome = client
                .request("hot", ProbeOp::Add { amount: 1 }, Duration::from_secs(1))
                .await;
            (outcome, tokio::time::Instant::now())
        }));
    }
    let (mut busy, mut done) = (0, 0);
    for task in burst_tasks {
        let (outcome, at) = task.await.expect("a request task");
        match outcome {
            Err(InvokeError::Busy { capacity, .. }) => {
                assert_eq!(capacity, CAPACITY);
                busy += 1;
                let waited = at - started;
                // Not after the 100 ms turn: the refusal does not wait for the actor.
                assert!(
                    waited < Duration::from_millis(50),
                    "Busy came after {waited:?}: it waited for the actor"
                );
            }
            Ok(ProbeReply::Count(_)) => done += 1,
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    assert_eq!(done, CAPACITY, "exactly the mailbox's worth is queued and completes");
    assert_eq!(busy, burst - CAPACITY);
    sim.drain().await;
    sim.phase("liveness");
    sim.heal().await;
    let values = sim.read_back(&["hot"]).await;
    assert_eq!(
        values,
        vec![1 + CAPACITY as u64],
        "the slow add and the queued ones, nothing else"
    );
    sim.finish().await;
}

/// Goal: the same for real agents: with a mailbox of 2 and a slow model, a burst of
/// asks gets the overflow refused with `Busy` at once; the queued asks are answered.
#[madsim::test]
async fn a_burst_of_asks_beyond_an_agents_mailbox_is_refused_busy() {
    let scenario = Scenario {
        test: TEST,
        name: "a_burst_of_asks_beyond_an_agents_mailbox_is_refused_busy",
    };
    let llm = ScriptedLlm::new().rule(
        ScriptRule::agent("worker")
            .reply("done")
            .latency(Duration::from_millis(50)),
    );
    let setup = AgentSetup::new(Arc::new(llm), vec![AgentSpec::new("worker")]);
    let config = SimConfig {
        mailbox_capacity: CAPACITY,
        ..SimConfig::default()
    };
    let mut sim = Sim::start_with_agents(scenario, config, setup).await;
    sim.inject(Fault::Latency { min_ms: 1, max_ms: 2 }).await;
    sim.phase("safety");
    let burst = sim.rng().range(3, 10) as usize;
    sim.spawn_ask("worker", "first", Duration::from_secs(2));
    sim.advance(Duration::from_millis(10)).await;
    for index in 0..burst {
        sim.spawn_ask("worker", &format!("burst {index}"), Duration::from_secs(2));
    }
    let outcomes = sim.drain_asks().await;
    let busy = outcomes
        .iter()
        .filter(|o| matches!(o, Err(InvokeError::Busy { .. })))
        .count();
    let answered = outcomes
        .iter()
        .filter(|o| o.as_ref().is_ok_and(|reply| reply.text == "done"))
        .count();
    assert_eq!(answered, 1 + CAPACITY, "{outcomes:?}");
    assert_eq!(busy, burst - CAPACITY, "{outcomes:?}");
    sim.phase("liveness");
    sim.heal().await;
    sim.read_agent_logs(&["worker"]).await;
    sim.finish().await;
}

//! Restart and resume: after the whole deployment is killed and restarted from its
//! disks, every actor resumes from exactly what was acknowledged and keeps working;
//! agents resume their conversations.
//!
//! Faults: node kill and restart (every node), disk crash with an fsync window.
//! Invariants: all eight, in particular NoAckedStateLost and SingleActivation across
//! incarnations.
#![cfg(madsim)]

use std::sync::Arc;
use std::time::Duration;

use troupe_sim::agent::{AgentSpec, Role, ScriptRule, ScriptedLlm};
use troupe_sim::agents::AgentSetup;
use troupe_sim::workload::keys_on;
use troupe_sim::{Fault, ProbeOp, ProbeReply, Scenario, Sim, SimConfig, StoreMode};

const TEST: &str = "dst_restart_resume";

/// Goal: probes on two nodes resume at exactly their acknowledged counts after both
/// nodes are killed (disks crashed too) and restarted, and continue from there. Method:
/// random acknowledged adds (waited for, so nothing is ambiguous), a full kill at a
/// quiet moment, restart, exact reads, more adds, exact reads again.
#[madsim::test]
async fn every_actor_resumes_from_its_acknowledged_state_after_a_full_restart() {
    let scenario = Scenario {
        test: TEST,
        name: "every_actor_resumes_from_its_acknowledged_state_after_a_full_restart",
    };
    let config = SimConfig {
        nodes: 2,
        store: StoreMode::Fsync { latency_ms: 2 },
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    let mut keys = keys_on(1, 2, 2);
    keys.extend(keys_on(2, 2, 2));
    let mut expected = vec![0_u64; keys.len()];
    sim.phase("safety");
    for round in 0..2 {
        for _ in 0..10 {
            let index = sim.rng().range(0, keys.len() as u64) as usize;
            let amount = sim.rng().range(1, 10);
            let outcome = sim
                .request(&keys[index], ProbeOp::Add { amount }, Duration::from_millis(500))
                .await;
            expected[index] += amount;
            assert_eq!(outcome, Ok(ProbeReply::Count(expected[index])));
        }
        sim.inject(Fault::CrashNode(1)).await;
        sim.inject(Fault::CrashNode(2)).await;
        let down = sim.rng().range(1, 200);
        sim.advance(Duration::from_millis(down)).await;
        sim.inject(Fault::RestartNode(1)).await;
        sim.inject(Fault::RestartNode(2)).await;
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let values = sim.read_back(&key_refs).await;
        assert_eq!(values, expected, "after restart {round}");
    }
    sim.phase("liveness");
    sim.heal().await;
    sim.finish().await;
}

/// Goal: an agent's acknowledged conversation survives a crash of its node (disk
/// included) and the agent resumes it: its model sees the earlier exchange after the
/// restart. Method: three acknowledged asks, a crash at a quiet moment, a restart, the
/// committed log read back (NoAckedStateLost), one more ask whose model request must
/// carry the earlier messages.
#[madsim::test]
async fn an_agent_resumes_its_conversation_after_its_node_crashes() {
    let scenario = Scenario {
        test: TEST,
        name: "an_agent_resumes_its_conversation_after_its_node_crashes",
    };
    let llm = Arc::new(ScriptedLlm::new().rule(ScriptRule::agent("memo").reply("noted: {input}")));
    let setup = AgentSetup::new(llm.clone(), vec![AgentSpec::new("memo")]);
    let config = SimConfig {
        store: StoreMode::Fsync { latency_ms: 2 },
        ..SimConfig::default()
    };
    let mut sim = Sim::start_with_agents(scenario, config, setup).await;
    sim.phase("safety");
    let asks = sim.rng().range(1, 4);
    for index in 0..asks {
        let reply = sim
            .ask("memo", &format!("fact {index}"), Duration::from_secs(1))
            .await
            .expect("acknowledged");
        assert_eq!(reply.text, format!("noted: fact {index}"));
    }
    sim.inject(Fault::CrashNode(1)).await;
    let down = sim.rng().range(1, 200);
    sim.advance(Duration::from_millis(down)).await;
    sim.inject(Fault::RestartNode(1)).await;
    sim.read_agent_logs(&["memo"]).await;
    let reply = sim
        .ask("memo", "what do you know?", Duration::from_secs(1))
        .await
        .expect("resumed");
    assert_eq!(reply.text, "noted: what do you know?");
    let last = llm.requests_of("memo").pop().expect("the model was asked");
    let remembered = last
        .messages
        .iter()
        .filter(|m| m.role == Role::User && m.content.starts_with("fact "))
        .count();
    assert_eq!(
        remembered as u64, asks,
        "the model saw {remembered} of {asks} earlier facts after the restart"
    );
    sim.phase("liveness");
    sim.heal().await;
    sim.read_agent_logs(&["memo"]).await;
    sim.finish().await;
}

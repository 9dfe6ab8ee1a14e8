//! What the observers are told about calls to ids that name no agent: nothing that would
//! make them count an agent or a link that does not exist. The server's topology
//! (`GET /v1/topology`) counts an agent and an observed link for every call it is told
//! of, so calls to invented ids must not be announced as calls.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test observed_targets` (tokio with
//! paused time) and `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo test
//! -p troupe-agent --test observed_targets` (the madsim simulator).

use std::collections::BTreeSet;
use std::sync::Arc;

use serde_json::json;
use troupe_agent::limits::AGENT_TOOL_CALLS_PER_STEP_MAX;
use troupe_agent::{
    agent_id, AgentCallError, AgentEvent, AgentSpec, AgentSystem, AskOptions, CallRecorder, ScriptRule, ScriptedLlm,
    TroupeCallMetadata,
};
use troupe_core::CallRefused;

/// The agents and the (caller, target) links the call events name, as an observer that
/// counts them (the server's topology) sees them.
fn observed(recorder: &CallRecorder) -> (BTreeSet<String>, BTreeSet<(String, String)>) {
    let mut agents = BTreeSet::new();
    let mut links = BTreeSet::new();
    for event in recorder.events() {
        if let AgentEvent::CallStarted { caller, target, .. } = event {
            agents.insert(target.key().to_string());
            if let Some(caller) = caller {
                agents.insert(caller.key().to_string());
                links.insert((caller.key().to_string(), target.key().to_string()));
            }
        }
    }
    (agents, links)
}

/// Goal: calls to ids that name no agent (from a model's `call_agent`, from outside with
/// `ask_with`, and arriving over A2A with `ask_continued`) are refused with
/// `AgentNotFound` and leave the agents and links an observer counts unchanged, however
/// many there are. Method: a real call a -> b first (counted: one link, two agents, so
/// the counting works), then `AGENT_TOOL_CALLS_PER_STEP_MAX` `call_agent`s of a to
/// invented ids in one step and as many asks from outside and over A2A; the observed
/// agents and links are compared before and after.
#[tokio::test(start_paused = true)]
async fn calls_to_invented_ids_leave_the_observed_agents_and_links_unchanged() {
    let invented: Vec<String> = (0..AGENT_TOOL_CALLS_PER_STEP_MAX)
        .map(|n| format!("ghost-{n}"))
        .collect();
    let mut invent = ScriptRule::agent("a").on_user_containing("invent");
    for id in &invented {
        invent = invent.call("call_agent", json!({"agent_id": id, "message": "hello"}));
    }
    let llm = ScriptedLlm::new()
        .rule(invent)
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("real")
                .call("call_agent", json!({"agent_id": "b", "message": "hello"})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("a saw: {tool_result}"))
        .rule(ScriptRule::agent("b").reply("b here"));
    let recorder = CallRecorder::new();
    let system = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .observer(Arc::new(recorder.clone()))
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .start()
        .unwrap();

    assert_eq!(system.ask("a", "real").await.unwrap().text, "a saw: b here");
    let before = observed(&recorder);
    let expected_agents: BTreeSet<String> = ["a", "b"].map(String::from).into();
    let expected_links: BTreeSet<(String, String)> = [("a".to_string(), "b".to_string())].into();
    assert_eq!(before, (expected_agents, expected_links), "the real call is counted");

    system.ask("a", "invent").await.unwrap();
    let results = llm.tool_results_seen_by("a");
    let refusals = results.iter().filter(|result| result.contains("not found")).count();
    assert_eq!(refusals, invented.len(), "every invented id was refused: {results:?}");
    for id in &invented {
        let refused = system.ask_with(id, "hello", AskOptions::default()).await;
        assert_eq!(
            refused,
            Err(AgentCallError::Refused(CallRefused::AgentNotFound {
                target: agent_id(id).unwrap()
            }))
        );
        let deadline = system.runtime().deadline_in(std::time::Duration::from_secs(5));
        let refused = system
            .ask_continued(id, "hello", &TroupeCallMetadata::default(), deadline)
            .await;
        assert!(
            matches!(refused, Err(AgentCallError::Refused(CallRefused::AgentNotFound { .. }))),
            "{refused:?}"
        );
    }
    assert_eq!(
        observed(&recorder),
        before,
        "calls to invented ids add no agent and no link"
    );
    system.shutdown().await;
}

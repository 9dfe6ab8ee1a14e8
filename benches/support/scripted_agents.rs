//! Two scripted agents for the agent-layer benchmarks: `asker` asks `answerer` through
//! `call_agent` and replies with its answer; `answerer` replies "42" in one step.

use std::sync::Arc;

use serde_json::json;
use troupe::agent::{AgentSpec, AgentSystem, ScriptRule, ScriptedLlm};
use troupe::runtime::{KindConfig, MemoryStore, StateStore};

/// The two agents on an in-memory store, their activations kept by `kind_config`.
pub(crate) fn asker_and_answerer(kind_config: KindConfig) -> AgentSystem {
    asker_and_answerer_on(Arc::new(MemoryStore::new()), kind_config)
}

/// The two agents on `store`, their activations kept by `kind_config`.
pub(crate) fn asker_and_answerer_on(store: Arc<dyn StateStore>, kind_config: KindConfig) -> AgentSystem {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("asker")
                .on_user_containing("")
                .call("call_agent", json!({"agent_id": "answerer", "message": "{input}"})),
        )
        .rule(ScriptRule::agent("asker").on_tool_result().reply("{tool_result}"))
        .rule(ScriptRule::agent("answerer").reply("42"))
        .without_recording();
    AgentSystem::builder()
        .store(store)
        .llm(Arc::new(llm))
        .kind_config(kind_config)
        .agent(AgentSpec::new("asker"))
        .agent(AgentSpec::new("answerer"))
        .start()
        .unwrap()
}

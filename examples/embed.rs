//! Embedding agents in about ten lines: two agents, each a virtual actor, where the
//! coordinator asks the analyst through the built-in `call_agent` tool. The model is the
//! scripted one (deterministic, no API key, no network); swap in
//! `troupe::agent::OpenAiClient` for a real model.
//!
//! Run it with `cargo run --example embed`. It prints the coordinator's answer.

use std::sync::Arc;

use troupe::agent::{AgentSpec, AgentSystem, ScriptRule, ScriptedLlm};
use troupe::json;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("coordinator")
                .on_user_containing("forecast")
                .call("call_agent", json!({"agent_id": "analyst", "message": "{input}"})),
        )
        .rule(
            ScriptRule::agent("coordinator")
                .on_tool_result()
                .reply("the analyst says: {tool_result}"),
        )
        .rule(ScriptRule::agent("analyst").reply("sunny, 24 °C"));
    let system = AgentSystem::builder()
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("coordinator").role("plans the work"))
        .agent(AgentSpec::new("analyst").role("answers questions about data"))
        .start()?;
    let reply = system.ask("coordinator", "what is the forecast for Lisbon?").await?;
    println!("coordinator: {}", reply.text);
    system.shutdown().await;
    Ok(())
}

//! An agent with a custom tool: a `forecast` tool written as an async closure, with the
//! JSON schema the model sees. The scripted model (deterministic, no API key, no
//! network) calls the tool with a city, then answers with the tool's result; a real
//! model would decide the call itself from the schema and the description.
//!
//! Run it with `cargo run --example custom_tool`. It prints the tool call and the
//! agent's answer.

use std::sync::Arc;

use troupe::agent::{AgentSpec, AgentSystem, ScriptRule, ScriptedLlm, Tool, ToolError};
use troupe::json;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let forecast = Tool::from_fn(
        "forecast",
        "the weather forecast for a city",
        json!({
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": false
        }),
        |_context, arguments| async move {
            let city = arguments["city"]
                .as_str()
                .ok_or_else(|| ToolError::failed("forecast", "city must be a string"))?;
            println!("tool forecast called for {city}");
            Ok(format!("{city}: sunny, 24 °C"))
        },
    );
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("weather")
                .on_user_containing("Lisbon")
                .call("forecast", json!({"city": "Lisbon"})),
        )
        .rule(
            ScriptRule::agent("weather")
                .on_tool_result()
                .reply("Tomorrow in {tool_result}"),
        );
    let system = AgentSystem::builder()
        .llm(Arc::new(llm))
        .tool(forecast)
        .agent(AgentSpec::new("weather").role("answers questions about the weather"))
        .start()?;
    let reply = system.ask("weather", "What will the weather be in Lisbon?").await?;
    println!("weather: {}", reply.text);
    system.shutdown().await;
    Ok(())
}

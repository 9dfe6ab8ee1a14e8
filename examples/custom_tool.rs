//! An agent with a custom, typed tool: a `forecast` tool whose arguments are a Rust
//! struct. The JSON schema the model sees is derived from the struct (schemars), model
//! arguments are validated against it (jsonschema) and deserialized before the handler
//! runs. The scripted model (deterministic, no API key, no network) calls the tool with
//! a city, then answers with the tool's result; a real model would decide the call
//! itself from the schema and the description.
//!
//! Run it with `cargo run --example custom_tool`. It prints the tool call and the
//! agent's answer.

use std::sync::Arc;

use serde::Deserialize;
use troupe::agent::schemars::JsonSchema;
use troupe::agent::{AgentSpec, AgentSystem, ScriptRule, ScriptedLlm, Tool, ToolExecutionContext};
use troupe::json;

/// Arguments of the `forecast` tool.
#[derive(Deserialize, JsonSchema)]
#[schemars(crate = "troupe::agent::schemars")]
struct ForecastArguments {
    /// The city to forecast.
    city: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let forecast = Tool::typed::<ForecastArguments, _, _>(
        "forecast",
        "the weather forecast for a city",
        |_context: ToolExecutionContext, arguments: ForecastArguments| async move {
            println!("tool forecast called for {}", arguments.city);
            Ok(format!("{}: sunny, 24 °C", arguments.city))
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

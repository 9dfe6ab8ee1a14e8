//! Custom tools are held to the model providers' naming rule when they are registered:
//! `[a-zA-Z0-9_-]`, 1 to `TOOL_NAME_BYTES_MAX` (64) bytes, as OpenAI-compatible
//! providers accept them (MCP tools are renamed to it, see `mcp.rs`).
//!
//! Goal: a name a provider would refuse (a 400 for every turn of every agent that has
//! the tool, as the provider sees the whole tool list) is refused when the system is
//! built, with a typed error naming the tool and the rule; names within the rule, at
//! its edges too, are taken.
//!
//! Runs in both builds: `cargo nextest run -p troupe-agent --test tool_names` and the
//! madsim build.

use std::sync::Arc;

use serde::Deserialize;
use troupe_agent::schemars::JsonSchema;
use troupe_agent::{
    AgentSpec, AgentSystem, AgentSystemError, ScriptedLlm, Tool, ToolExecutionContext, ToolRegistry, ToolRegistryError,
    TOOL_NAME_BYTES_MAX,
};

/// Nothing to pass.
#[derive(Deserialize, JsonSchema)]
#[schemars(crate = "troupe_agent::schemars")]
struct NoArguments {}

fn typed(name: &str) -> Tool {
    Tool::typed::<NoArguments, _, _>(
        name,
        "Does nothing.",
        |_context: ToolExecutionContext, _arguments: NoArguments| async move { Ok("done".to_owned()) },
    )
}

fn start_with(tool: Tool) -> Result<AgentSystem, AgentSystemError> {
    AgentSystem::builder()
        .llm(Arc::new(ScriptedLlm::new()))
        .tool(tool)
        .agent(AgentSpec::new("bob"))
        .start()
}

/// Names a provider refuses (a dot, a space, a slash, non-ASCII, empty, 65 bytes) stop
/// the system from starting, each with `ToolRegistryError::InvalidName` naming the
/// tool and the rule. Before, the system started, and every model request offering
/// the tool was a 400 from the provider.
#[tokio::test]
async fn a_custom_tool_with_a_name_providers_refuse_is_refused_at_start() {
    let too_long = "t".repeat(TOOL_NAME_BYTES_MAX + 1);
    for name in ["files.read", "read file", "fs/read", "café", "", too_long.as_str()] {
        let Err(error) = start_with(typed(name)) else {
            panic!("{name:?}: the system started with a tool providers refuse");
        };
        let shown = error.to_string();
        assert!(
            matches!(&error, AgentSystemError::Tool(ToolRegistryError::InvalidName { name: named, .. }) if named == name),
            "{name:?}: {error:?}"
        );
        assert!(shown.contains(&format!("{name:?}")), "the tool is named: {shown}");
        assert!(shown.contains("a-zA-Z0-9_-"), "the rule is said: {shown}");
        assert!(
            shown.contains(&TOOL_NAME_BYTES_MAX.to_string()),
            "the limit is said: {shown}"
        );
    }
}

/// Names at the rule's edges are taken: one character, exactly 64 bytes, digits,
/// `_` and `-`; the registry refuses the same bad names as the system.
#[tokio::test]
async fn names_within_the_rule_are_taken_at_its_edges() {
    let longest = "L".repeat(TOOL_NAME_BYTES_MAX);
    for name in ["x", "get_weather-v2", "0", longest.as_str()] {
        let system = start_with(typed(name)).unwrap_or_else(|error| panic!("{name:?}: {error}"));
        drop(system);
    }
    let mut registry = ToolRegistry::new();
    let error = registry.register(typed("files.read")).unwrap_err();
    assert!(matches!(error, ToolRegistryError::InvalidName { .. }), "{error:?}");
    assert!(registry.names().is_empty());
}

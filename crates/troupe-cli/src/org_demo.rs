//! `troupe demo --config FILE`: an organisation from a TOML file, on the scripted model.
//!
//! The config's agents, links, permissions and policy are synced into a fresh system
//! ([`troupe_agent::AgentClient::apply_config`]); then, for every ordered pair of declared
//! agents, the user asks the first to contact the second: its scripted model emits
//! `call_agent`, and the organisation's admission lets the call through or refuses it
//! (the model reads the refusal as its tool result). The report lists who talked to
//! whom, refused pairs included.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use troupe_agent::{AgentSystem, CallOutcome, CallRecorder, OrgConfig, ScriptRule, ScriptedLlm};
use troupe_runtime::StateStore;

/// How long an agent told `route: wait` takes to answer, in milliseconds.
pub const ORG_DEMO_WAIT_MS: u64 = 20_000;

/// How long the user waits for each agent, in milliseconds.
pub const ORG_DEMO_ASK_TIMEOUT_MS: u64 = 30_000;

/// The scripted model of the organisation demo: an agent asked by the user with an
/// agent id calls that agent; an agent called by another answers; a caller reports its
/// tool result.
///
/// Scripted call chains, for tests across servers: a message `route: x y z` makes its
/// agent call `x` with `route: y z`; `route: wait` makes it answer after
/// [`ORG_DEMO_WAIT_MS`]; a route that has ended (`route:`) is answered
/// `hello from {agent}`.
pub fn org_demo_script() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(ScriptRule::any_agent().on_tool_result().reply("{tool_result}"))
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("route: wait")
                .reply("waited")
                .latency(Duration::from_millis(ORG_DEMO_WAIT_MS)),
        )
        .rule(ScriptRule::any_agent().on_user_containing("route: ").call(
            "call_agent",
            json!({"agent_id": "{route_next}", "message": "route:{route_rest}"}),
        ))
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("route:")
                .reply("hello from {agent}"),
        )
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("[message from")
                .reply("hello from {agent}"),
        )
        .rule(ScriptRule::any_agent().on_tool_result().reply("{tool_result}"))
        .rule(ScriptRule::any_agent().on_user_containing("").call(
            "call_agent",
            json!({"agent_id": "{input}", "message": "hello, this is {agent}"}),
        ))
}

/// One attempted contact.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contact {
    /// The caller.
    pub from: String,
    /// The callee.
    pub to: String,
    /// `ok`, `not permitted`, `refused`, `timeout`, `failed`, `cancelled`.
    pub label: String,
    /// The callee's answer, or why there was none.
    pub detail: String,
}

/// What the organisation demo produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrgDemoReport {
    /// Every attempted contact, in the order asked.
    pub contacts: Vec<Contact>,
}

impl OrgDemoReport {
    /// The contacts with outcome `label`.
    pub fn with_label(&self, label: &str) -> Vec<&Contact> {
        self.contacts.iter().filter(|contact| contact.label == label).collect()
    }
}

/// Runs the organisation of `config` on `store` with the scripted model.
///
/// # Errors
/// The system could not start, or the config could not be synced.
pub async fn run_org_demo(store: Arc<dyn StateStore>, config: &OrgConfig) -> Result<OrgDemoReport, String> {
    let recorder = CallRecorder::new();
    let system = AgentSystem::builder()
        .store(store)
        .llm(Arc::new(org_demo_script()))
        .observer(Arc::new(recorder.clone()))
        .start()
        .map_err(|error| error.to_string())?;
    system
        .apply_config(config)
        .await
        .map_err(|error| format!("the config could not be applied: {error}"))?;
    let ids: Vec<String> = config.agent_specs().into_iter().map(|spec| spec.id).collect();
    for from in &ids {
        for to in ids.iter().filter(|to| *to != from) {
            // The answer is in the call tree; a failed ask shows there too.
            let _ = system
                .ask_with_timeout(from, to, Duration::from_millis(ORG_DEMO_ASK_TIMEOUT_MS))
                .await;
        }
    }
    system.shutdown().await;
    let mut contacts = Vec::new();
    for root in recorder.call_trees() {
        for call in &root.children {
            let from = call.caller.as_ref().map_or("user", |id| id.key()).to_string();
            let (label, detail) = match &call.finished {
                Some((_, outcome)) => {
                    let detail = match outcome {
                        CallOutcome::Replied { .. } => String::new(),
                        CallOutcome::NotPermitted(refused) => refused.reason.to_string(),
                        CallOutcome::Refused(refused) => refused.to_string(),
                        CallOutcome::Failed(error) => error.to_string(),
                        CallOutcome::Other { cause } => cause.clone(),
                        CallOutcome::SentAsTask { task_id } => format!("sent as task {task_id}"),
                        CallOutcome::Cancelled => "the caller's turn was cut".to_string(),
                    };
                    (outcome.label().to_string(), detail)
                }
                None => ("running".to_string(), String::new()),
            };
            contacts.push(Contact {
                from,
                to: call.target.key().to_string(),
                label,
                detail,
            });
        }
    }
    Ok(OrgDemoReport { contacts })
}

//! Agents for the cluster tests: a scripted model whose agents really emit `call_agent`
//! tool calls, an observer that records which node each event happened on, and the
//! agent system a node embeds (`AgentSystemBuilder::prepare`, the runtime builder
//! handed to `ClusterNode::start`, then `PendingAgentSystem::attach`).
//!
//! The script (the first matching rule wins; rules look at the last message):
//! - any agent asked `ping` answers `pong`;
//! - `a` asked for a `chain` calls `b` with `hop to c`; `b` then calls `c` with `leaf
//!   question`; `c` answers `c-answer`: the reply is `a<b<c-answer`;
//! - `a` asked for a `cycle` calls `b` with `call back a`; `b` calls `a`, which the
//!   chain rule refuses;
//! - `a` asked for `just b` calls `b` with `question for b`; `b` answers `b-answer`;
//! - `d<i>` asked `deep` calls `d<i+1>` with `deep`; `d6` would answer `unreachable`;
//! - after a tool result, `a`, `b`, `d<i>` answer `<name><<the tool result>`;
//! - `c` asked `again` answers `c-again`;
//! - `b` given a task containing `slow delegated work` answers `task done` after
//!   [`SLOW_TASK_MODEL_LATENCY_MS`] (so its node can die while it works);
//! - `b` given a task containing `delegated work` answers `task done`; `a` told the
//!   result of a task it delegated answers `noted`;
//! - any agent given a notification answers `noted`;
//! - `b` or `c` mentioned in a conversation answers `seen`, after
//!   [`MENTION_MODEL_LATENCY_MS`] (so mentions wait for it in its inbox, and their
//!   relays stay pending meanwhile).
#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use serde_json::json;
use troupe_agent::{AgentEvent, AgentObserver, AgentSpec, AgentSystem, ScriptRule, ScriptedLlm};

/// The agents every node defines (the directory is per process: each node has all).
pub(crate) const AGENTS: [&str; 10] = ["a", "b", "c", "d0", "d1", "d2", "d3", "d4", "d5", "d6"];
/// Agents of the depth chain.
pub(crate) const DEPTH_AGENTS: usize = 7;
/// The model's latency on a conversation mention, in simulated milliseconds.
pub(crate) const MENTION_MODEL_LATENCY_MS: u64 = 400;
/// The model's latency on a task of `slow delegated work`, in simulated milliseconds.
pub(crate) const SLOW_TASK_MODEL_LATENCY_MS: u64 = 2_000;

fn ask(agent: &str, needle: &str, target: &str, message: &str) -> ScriptRule {
    ScriptRule::agent(agent)
        .on_user_containing(needle)
        .call("call_agent", json!({"agent_id": target, "message": message}))
}

/// `agent`'s answer to a mention in a conversation (its prompt's last message starts
/// `[conversation`).
fn mention_rule(agent: &str) -> ScriptRule {
    ScriptRule::agent(agent)
        .on_user_containing("[conversation")
        .latency(std::time::Duration::from_millis(MENTION_MODEL_LATENCY_MS))
        .reply("seen")
}

/// The scripted model of every node (clones share what it recorded).
pub(crate) fn script() -> ScriptedLlm {
    let mut llm = ScriptedLlm::new()
        .rule(ScriptRule::any_agent().on_user_containing("ping").reply("pong"))
        .rule(ask("a", "chain", "b", "hop to c"))
        .rule(ask("b", "hop to c", "c", "leaf question"))
        .rule(
            ScriptRule::agent("c")
                .on_user_containing("leaf question")
                .reply("c-answer"),
        )
        .rule(ScriptRule::agent("c").on_user_containing("again").reply("c-again"))
        .rule(ask("a", "cycle", "b", "call back a"))
        .rule(ask("b", "call back a", "a", "are you there"))
        .rule(ask("a", "just b", "b", "question for b"))
        .rule(
            ScriptRule::agent("b")
                .on_user_containing("question for b")
                .reply("b-answer"),
        )
        .rule(
            ScriptRule::agent("b")
                .on_user_containing("slow delegated work")
                .latency(std::time::Duration::from_millis(SLOW_TASK_MODEL_LATENCY_MS))
                .reply("task done"),
        )
        .rule(
            ScriptRule::agent("b")
                .on_user_containing("delegated work")
                .reply("task done"),
        )
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("you delegated is")
                .reply("noted"),
        )
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("[notification")
                .reply("noted"),
        )
        .rule(mention_rule("b"))
        .rule(mention_rule("c"))
        .rule(ScriptRule::agent("a").on_tool_result().reply("a<{tool_result}"))
        .rule(ScriptRule::agent("b").on_tool_result().reply("b<{tool_result}"));
    for index in 0..DEPTH_AGENTS - 1 {
        let name = format!("d{index}");
        llm = llm.rule(ask(&name, "deep", &format!("d{}", index + 1), "deep")).rule(
            ScriptRule::agent(name.clone())
                .on_tool_result()
                .reply(format!("{name}<{{tool_result}}")),
        );
    }
    llm.rule(ScriptRule::agent(format!("d{}", DEPTH_AGENTS - 1)).reply("unreachable"))
}

/// Every agent event of every node, with the index of the node it happened on.
#[derive(Clone, Default)]
pub(crate) struct Seen {
    events: Arc<Mutex<Vec<(usize, AgentEvent)>>>,
    /// Every event ever recorded, rendered (never cleared): a run's record.
    all: Arc<Mutex<Vec<String>>>,
}

impl Seen {
    pub(crate) fn events(&self) -> Vec<(usize, AgentEvent)> {
        self.events.lock().expect("the events").clone()
    }

    /// (node, depth, chain keys) of every turn `agent` started, in order.
    pub(crate) fn turns_of(&self, agent: &str) -> Vec<(usize, u32, Vec<String>)> {
        self.events()
            .into_iter()
            .filter_map(|(node, event)| match event {
                AgentEvent::TurnStarted {
                    agent: id,
                    depth,
                    chain,
                    ..
                } if id.key() == agent => Some((node, depth, chain.iter().map(|a| a.key().to_string()).collect())),
                _ => None,
            })
            .collect()
    }

    /// The trace id of every turn `agent` started, in order.
    pub(crate) fn traces_of(&self, agent: &str) -> Vec<Option<troupe_core::TraceId>> {
        self.events()
            .into_iter()
            .filter_map(|(_, event)| match event {
                AgentEvent::TurnStarted {
                    agent: id, trace_id, ..
                } if id.key() == agent => Some(trace_id),
                _ => None,
            })
            .collect()
    }

    /// Every event since the start, rendered with its node, in order (not cleared).
    pub(crate) fn record(&self) -> Vec<String> {
        self.all.lock().expect("the record").clone()
    }

    /// Forgets the events recorded so far (not the record).
    pub(crate) fn clear(&self) {
        self.events.lock().expect("the events").clear();
    }
}

/// Records the events of node `node` into a [`Seen`].
pub(crate) struct NodeObserver {
    pub(crate) node: usize,
    pub(crate) seen: Seen,
}

impl AgentObserver for NodeObserver {
    fn on_event(&self, event: &AgentEvent) {
        self.seen
            .all
            .lock()
            .expect("the record")
            .push(format!("node {}: {event:?}", self.node));
        self.seen
            .events
            .lock()
            .expect("the events")
            .push((self.node, event.clone()));
    }
}

/// The agent system of node `node`: every agent of [`AGENTS`], the shared script, the
/// node's observer. Not started: the caller prepares it and starts the runtime in a
/// `ClusterNode`.
pub(crate) fn agent_system(llm: &ScriptedLlm, node: usize, seen: &Seen) -> troupe_agent::AgentSystemBuilder {
    let mut builder = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .observer(Arc::new(NodeObserver {
            node,
            seen: seen.clone(),
        }));
    for agent in AGENTS {
        builder = builder.agent(AgentSpec::new(agent).role(format!("the {agent}")));
    }
    builder
}

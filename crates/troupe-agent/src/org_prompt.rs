//! What an agent's model sees of the organisation: the organisation section of its
//! system prompt (Spacebot's org context), the framing of a message from a related agent
//! (its link context), and tool descriptions that list only the agents it may contact.
//!
//! All read the cached organisation (loaded at the start of each turn); before it is
//! loaded, every agent of the directory is listed, as without an organisation.

use std::sync::Arc;

use crate::agent::AgentShared;
use crate::inbox::{DELEGATE_TOOL_NAME, NOTIFY_TOOL_NAME};
use crate::limits::AGENT_PEERS_LISTED_MAX;
use crate::{AgentSpec, ToolSpec, CALL_AGENT_TOOL_NAME};

/// An agent `agent` may contact: its id, its role, and whether it is a remote agent
/// (on another server: it can only be asked, with `call_agent`, not sent a task or a
/// notification).
struct Peer {
    id: String,
    role: String,
    remote: bool,
}

/// The agents `agent` may contact (possibly after approval), with their roles, by id.
fn reachable(shared: &AgentShared, agent: &str) -> Vec<Peer> {
    let others: Vec<_> = shared
        .directory
        .list()
        .into_iter()
        .filter(|spec| spec.id != agent)
        // Remote agents are listed like local ones (a local agent of the id wins).
        .chain(
            shared
                .remotes
                .list()
                .into_iter()
                .filter(|remote| !shared.directory.contains(&remote.id))
                .map(|remote| {
                    let role = if remote.role.is_empty() {
                        format!("an agent on another server ({})", remote.url)
                    } else {
                        remote.role
                    };
                    AgentSpec::new(remote.id).role(role)
                }),
        )
        .collect();
    let org = shared.org.cached();
    others
        .into_iter()
        .filter(|spec| {
            org.as_ref()
                .is_none_or(|org| org.decide(agent, &spec.id, crate::ContactKind::Ask).is_ok())
        })
        .take(AGENT_PEERS_LISTED_MAX)
        .map(|spec| Peer {
            remote: !shared.directory.contains(&spec.id),
            id: spec.id,
            role: spec.role,
        })
        .collect()
}

/// The part of `spec`'s system prompt after its identity: its place in the
/// organisation (if it has one) and the agents it may contact (when it has a contact
/// tool).
pub(crate) fn contacts_section(shared: &AgentShared, spec: &AgentSpec) -> String {
    let agent = spec.id.as_str();
    let mut text = String::new();
    if let Some(org) = shared.org.cached() {
        let section = org.prompt_section(agent);
        if !section.is_empty() {
            text.push('\n');
            text.push_str(&section);
        }
    }
    let contact_tools: Vec<&str> = [CALL_AGENT_TOOL_NAME, DELEGATE_TOOL_NAME, NOTIFY_TOOL_NAME]
        .into_iter()
        .filter(|tool| spec.allows_tool(tool))
        .collect();
    if contact_tools.is_empty() {
        return text;
    }
    // A remote agent can only be asked: listed only to an agent with `call_agent`,
    // marked so when the agent has other contact tools too.
    let asks = spec.allows_tool(CALL_AGENT_TOOL_NAME);
    let sends = contact_tools.len() > usize::from(asks);
    let peers: Vec<Peer> = reachable(shared, agent)
        .into_iter()
        .filter(|peer| asks || !peer.remote)
        .collect();
    if !peers.is_empty() {
        let tools = match contact_tools.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
            _ => contact_tools.join(""),
        };
        text.push_str(&format!("\nAgents you may contact with {tools}:\n"));
        let lines: Vec<String> = peers
            .iter()
            .map(|peer| {
                let only = if peer.remote && sends { " (call_agent only)" } else { "" };
                format!("- {}: {}{only}", peer.id, peer.role)
            })
            .collect();
        text.push_str(&lines.join("\n"));
    }
    text
}

/// How a message from agent `from` is introduced to `agent`: `agent from`, with the
/// link context when they are related.
pub(crate) fn sender_label(shared: &AgentShared, agent: &str, from: &str) -> String {
    match shared.org.cached().and_then(|org| org.link_context(agent, from)) {
        Some(context) => ["agent ", from, "; ", &context].concat(),
        None => ["agent ", from].concat(),
    }
}

/// `text` from agent `from` as `agent`'s model reads it: `[message from {label}] {text}`
/// with [`sender_label`]'s label, built in one allocation (not the label's first).
pub(crate) fn message_from(shared: &AgentShared, agent: &str, from: &str, text: &str) -> String {
    match shared.org.cached().and_then(|org| org.link_context(agent, from)) {
        Some(context) => ["[message from agent ", from, "; ", &context, "] ", text].concat(),
        None => ["[message from agent ", from, "] ", text].concat(),
    }
}

/// The tool specs `spec`'s model is offered: the tools it may use
/// ([`AgentSpec::tools`]), where the contact tools' descriptions end with the agents it
/// may contact. Unchanged (shared) when the agent has every tool and the organisation is
/// not loaded.
pub(crate) fn tool_specs_for(shared: &AgentShared, spec: &AgentSpec) -> Arc<[ToolSpec]> {
    let agent = spec.id.as_str();
    let offered = shared.tools.offered_specs();
    if shared.org.cached().is_none() {
        if spec.tools.is_none() {
            return offered;
        }
        return offered
            .iter()
            .filter(|tool| spec.allows_tool(&tool.name))
            .cloned()
            .collect();
    }
    let peers = reachable(shared, agent);
    let suffix = |remotes: bool| {
        let ids: Vec<&str> = peers
            .iter()
            .filter(|peer| remotes || !peer.remote)
            .map(|peer| peer.id.as_str())
            .collect();
        if ids.is_empty() {
            " You may contact no agent.".to_string()
        } else {
            format!(" Agents you may contact: {}.", ids.join(", "))
        }
    };
    // `call_agent` reaches remote agents too; a task or a notification cannot be sent
    // to one.
    let (asked, sent) = (suffix(true), suffix(false));
    offered
        .iter()
        .filter(|tool| spec.allows_tool(&tool.name))
        .map(|spec| {
            let mut spec = spec.clone();
            if spec.name == CALL_AGENT_TOOL_NAME {
                spec.description.push_str(&asked);
            } else if [DELEGATE_TOOL_NAME, NOTIFY_TOOL_NAME].contains(&spec.name.as_str()) {
                spec.description.push_str(&sent);
            }
            spec
        })
        .collect()
}

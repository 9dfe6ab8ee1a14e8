//! NoAckedStateLost (`docs/tla/ActorLifecycle.tla`): what the runtime acknowledged to a
//! client survives crashes, restarts and deactivations.
//!
//! A reference model of the probe counters (a `BTreeMap`, in the style of sled's
//! failpoint tests): for each actor, the *floor* is the largest count ever acknowledged
//! and the *ceiling* the sum of every amount ever sent (an add whose outcome the client
//! could not know may or may not have happened). Every read made through the runtime
//! (`GetReplied`) must lie between the floor when the read was sent and the ceiling;
//! every acknowledged add must be at least the floor when it was sent plus its amount.
//!
//! Agents: every message whose answer a client was told (`AgentAcked`) must be in the
//! agent's committed conversation log whenever the log is read (`AgentLogRead`).

use std::collections::BTreeMap;

use super::Invariant;
use crate::trace::{Event, Stamped};

#[derive(Debug, Default)]
struct Model {
    floor: u64,
    ceiling: u64,
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct NoAckedStateLost {
    actors: BTreeMap<String, Model>,
    /// Open requests: id → (floor when sent, amount added).
    open: BTreeMap<u64, (u64, u64)>,
    /// Agent → messages whose answers were acknowledged.
    agent_acks: BTreeMap<String, Vec<String>>,
}

impl Invariant for NoAckedStateLost {
    fn name(&self) -> &'static str {
        "NoAckedStateLost"
    }

    fn observe(&mut self, stamped: &Stamped) -> Result<(), String> {
        match &stamped.event {
            Event::AddSent { request, actor, amount } => {
                let model = self.actors.entry(actor.clone()).or_default();
                model.ceiling += amount;
                self.open.insert(*request, (model.floor, *amount));
            }
            Event::AddAcked { request, actor, value } => {
                let model = self.actors.entry(actor.clone()).or_default();
                let (floor, amount) = self.open.remove(request).unwrap_or((0, 0));
                if *value < floor + amount || *value > model.ceiling {
                    return Err(format!(
                        "an add of {amount} to {actor} was acknowledged with count {value}, but the model allows \
                         [{} ..= {}] (acked floor {floor} when sent)",
                        floor + amount,
                        model.ceiling
                    ));
                }
                model.floor = model.floor.max(*value);
            }
            Event::GetSent { request, actor } => {
                let model = self.actors.entry(actor.clone()).or_default();
                self.open.insert(*request, (model.floor, 0));
            }
            Event::GetReplied { request, actor, value } => {
                let model = self.actors.entry(actor.clone()).or_default();
                let (floor, _) = self.open.remove(request).unwrap_or((0, 0));
                if *value < floor {
                    return Err(format!(
                        "{actor} reads {value}, but {floor} had been acknowledged before the read: acknowledged state was lost"
                    ));
                }
                if *value > model.ceiling {
                    return Err(format!(
                        "{actor} reads {value}, more than the {} ever sent",
                        model.ceiling
                    ));
                }
            }
            Event::RequestResolved { request, .. } => {
                self.open.remove(request);
            }
            Event::AgentAcked { agent, text } => {
                self.agent_acks.entry(agent.clone()).or_default().push(text.clone());
            }
            Event::AgentLogRead { agent, user_texts } => {
                for acked in self.agent_acks.get(agent).into_iter().flatten() {
                    if !user_texts.contains(acked) {
                        return Err(format!(
                            "{agent} answered {acked:?} to a client, but its committed log has no such message \
                             ({} user messages)",
                            user_texts.len()
                        ));
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }
}

//! SingleActivation (`docs/tla/ActorLifecycle.tla`): at any moment at most one live
//! activation of an actor exists in the whole deployment.
//!
//! Observed from the real hooks: `Activated` when an activation ran `on_activate`,
//! `Deactivated` when it ran `on_deactivate`. A killed node ends every activation it
//! hosted (its tasks are gone), so `NodeKilled` clears them. The check is cluster-wide:
//! two nodes each hosting the same actor is a violation even though each node's
//! dispatcher is internally consistent.

use std::collections::BTreeMap;

use super::Invariant;
use crate::trace::{Event, Stamped};

/// See the module documentation.
#[derive(Debug, Default)]
pub struct SingleActivation {
    /// Live activations: actor → the node hosting it.
    live: BTreeMap<String, u32>,
}

impl Invariant for SingleActivation {
    fn name(&self) -> &'static str {
        "SingleActivation"
    }

    fn observe(&mut self, stamped: &Stamped) -> Result<(), String> {
        match &stamped.event {
            Event::Activated { node, actor, .. } => {
                if let Some(other) = self.live.insert(actor.clone(), *node) {
                    return Err(format!(
                        "{actor} activated on node {node} while its activation on node {other} is live"
                    ));
                }
            }
            Event::Deactivated { node, actor, .. } => match self.live.remove(actor) {
                Some(host) if host == *node => {}
                Some(host) => {
                    return Err(format!(
                        "{actor} deactivated on node {node} but was live on node {host}"
                    ));
                }
                None => return Err(format!("{actor} deactivated on node {node} without a live activation")),
            },
            Event::NodeKilled { node } => self.live.retain(|_, host| host != node),
            _ => {}
        }
        Ok(())
    }
}

//! NoCycleInCallChain (`docs/tla/MultiAgentInvocation.tla`): no actor appears twice in
//! a call chain, and no turn runs in an actor that is already waiting up its own chain.
//!
//! Observed from each admitted call (its chain plus its target) and from the context
//! each real turn runs under (its chain plus the actor itself).

use std::collections::BTreeSet;

use super::Invariant;
use crate::trace::{Event, Stamped};

/// See the module documentation.
#[derive(Debug, Default)]
pub struct NoCycleInCallChain;

fn repeated<'a>(chain: &'a [String], last: &'a String) -> Option<&'a String> {
    let mut seen = BTreeSet::new();
    chain
        .iter()
        .chain(std::iter::once(last))
        .find(|actor| !seen.insert(*actor))
}

impl Invariant for NoCycleInCallChain {
    fn name(&self) -> &'static str {
        "NoCycleInCallChain"
    }

    fn observe(&mut self, stamped: &Stamped) -> Result<(), String> {
        match &stamped.event {
            Event::CallAdmitted {
                caller, target, chain, ..
            } => match repeated(chain, target) {
                Some(actor) => Err(format!(
                    "{caller} -> {target} was admitted with {actor} twice in its chain {chain:?} + {target}"
                )),
                None => Ok(()),
            },
            Event::TurnStarted { actor, chain, .. } => match repeated(chain, actor) {
                Some(again) => Err(format!(
                    "a turn of {actor} runs with {again} twice in chain {chain:?} + {actor}"
                )),
                None => Ok(()),
            },
            _ => Ok(()),
        }
    }
}
